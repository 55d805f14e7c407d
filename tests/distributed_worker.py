"""Runs tightfit's trainer on several CPU processes (gloo) for tests/test_distributed.py: each
rank trains a tiny BERT with the given spec and saves what it saw and did."""

import os
import signal
import socket

import torch

DEADLINE_S = 150

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(spec: dict, world_size: int, out, failing: bool = False) -> list[dict]:
    """Run :func:`train` on ``world_size`` spawned processes (1: in this process); returns each
    rank's result. ``failing``: a rank whose ``fit`` raised exits with 2 (as ``tightfit train``
    does, whereupon torchrun stops the others): its result is returned and the ranks killed
    then give None."""
    import torch.multiprocessing as mp

    if world_size == 1:
        return [train(0, 1, None, spec)]
    import time

    for r in range(world_size):  # an earlier spawn's results into the same folder are not this one's
        stale = os.path.join(str(out), f"rank{r}.pt")
        if os.path.exists(stale):
            os.remove(stale)
    port = free_port()
    ctx = mp.spawn(_entry, args=(world_size, port, spec, str(out)), nprocs=world_size, join=False)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):  # a rank left waiting in a collective must fail the test, not hang it
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"the ranks did not finish within {DEADLINE_S} s (a rank waits in a collective)")
    except mp.ProcessExitedException as e:  # killed by a signal: what the ranks' C++ side said before
        if not (failing and e.exit_code == 2):
            raise AssertionError(f"{e}\n" + _stderr_tails(out, world_size)) from e
        for p in ctx.processes:  # as torchrun does once a worker fails
            if p.is_alive():
                p.kill()
    saved = [os.path.join(str(out), f"rank{r}.pt") for r in range(world_size)]
    return [torch.load(f, weights_only=False) if os.path.exists(f) else None for f in saved]


def _stderr_tails(out, world_size: int, lines: int = 30) -> str:
    tails = []
    for r in range(world_size):
        path = os.path.join(str(out), f"rank{r}.stderr")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                kept = [x for x in f.read().splitlines() if "Failed to load" not in x and "Enum subclass" not in x]
            tails.append(f"--- rank {r} stderr (last {lines} lines) ---\n" + "\n".join(kept[-lines:]))
    return "\n".join(tails)


def _entry(rank, world_size, port, spec, out):
    # The rank's stderr (C++ included: a gloo abort prints there) goes to a file the test shows.
    err = os.open(os.path.join(out, f"rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    torch.set_num_threads(1)
    result = train(rank, world_size, port, spec)
    # written whole or not at all: the harness kills the other ranks once one exits with 2, and a
    # rank killed while saving left a truncated file (EOFError in the test, once in a CI run)
    path = os.path.join(out, f"rank{rank}.pt")
    torch.save(result, path + ".part")
    os.replace(path + ".part", path)
    if result.get("failed"):  # the ranks are out of step: no barrier, the exit status says it
        os._exit(2)
    # Leave without the interpreter's shutdown: there a gloo thread still alive now and then
    # aborts the process ("terminate called without an active exception", pytorch/pytorch#190489,
    # about once in a full test run) after everything this test checks is saved.
    os._exit(0)


class TokenBatchNorm(torch.nn.Module):
    """BatchNorm1d over the hidden features of every token of ``[B, T, H]`` (spec ``token_bn``)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(hidden)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def train(rank: int, world_size: int, port, spec: dict) -> dict:
    """Train as ``spec`` says: ``n``, ``effective_batch``, ``micro_batch``, ``dropout``,
    ``sharding``, ``max_steps``, ``checkpoint_dir``/``checkpoint_every``, ``resume`` (a
    checkpoint), ``oom`` (``(rank, step)``: an injected OOM in that rank's forward at that step,
    once), ``probe_oom_above`` (the FSDP2 probe step first, with an OOM on every rank for
    micro-batches above it), ``signal`` (``(rank, step)``: SIGTERM sent to that rank while it logs
    that step, after the ranks' stop vote), ``eval`` (held-out samples) and ``eval_oom`` (a rank:
    one injected OOM in its first evaluation batch), ``exit_on_error`` (a rank whose ``fit`` raised
    returns at once, without the collectives after it, and exits with 2: :func:`spawn`'s
    ``failing``), ``token_bn`` (a BatchNorm after the embeddings: :class:`TokenBatchNorm`),
    ``inf_buffer`` (``(rank, step)``: that rank's BatchNorm running variance set to inf as it logs
    that step), ``mask_buffer`` (a buffer holding -inf by design). Returns the records, the samples each step
    drew on this rank, the final weights, and the error that ended ``fit`` (its type and message)."""
    from conftest import SyntheticBatches, tiny_bert

    from tightfit.plan import Plan
    from tightfit.runtime.distributed import World
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    if world_size > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        world = World.from_env("cpu")
    else:
        world = World()
    data = SyntheticBatches(spec.get("n", 24))
    drawn = []  # (step, indices) of every collate of a training micro-batch on this rank
    collate = data.collate

    def logged(indices, pad_to=None):
        drawn.append(list(indices))
        return collate(indices, pad_to)

    data.collate = logged
    held_out = SyntheticBatches(spec["eval"], seed=1) if spec.get("eval") else None
    model = tiny_bert(spec.get("dropout", 0.0), 0)
    if spec.get("token_bn"):  # a BatchNorm over the tokens after the embeddings (one sample: several values)
        torch.manual_seed(0)
        model.bert.embeddings.LayerNorm = torch.nn.Sequential(model.bert.embeddings.LayerNorm, TokenBatchNorm(32))
    if spec.get("mask_buffer"):  # a buffer infinite by design (a -inf attention mask), unused here
        model.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
    w = Workload(model, data, held_out, spec.get("effective_batch", 8))
    plan = Plan("fp32", spec.get("micro_batch", 4), w.effective_batch, world_size=world_size,
                sharding=spec.get("sharding", "ddp") if world_size > 1 or spec.get("sharding") == "fsdp-offload"
                else "none")
    cfg = TrainConfig(epochs=spec.get("epochs", 1), max_steps=spec.get("max_steps"), lr=1e-3, seed=3, log_every=1,
                      grow_back_after=0, prefetch=False, checkpoint_dir=spec.get("checkpoint_dir"),
                      checkpoint_every=spec.get("checkpoint_every", 0), keep_last=spec.get("keep_last", 3))
    records = []

    def log(record):
        records.append(record)
        if spec.get("signal") == (rank, record.get("step")) and record["type"] == "train":
            os.kill(os.getpid(), signal.SIGTERM)
        if spec.get("inf_buffer") == (rank, record.get("step")) and record["type"] == "train":
            norm = next(m for m in world.unwrap(t.model).modules() if isinstance(m, torch.nn.BatchNorm1d))
            norm.running_var[0] = float("inf")  # overflowed in a forward whose gradients stayed finite

    t = Trainer(w, plan, cfg, log=log, progress=False, world=world)
    rng_after_resume = None
    if spec.get("resume"):
        t.resume(spec["resume"])
        rng_after_resume = torch.get_rng_state()
    if spec.get("oom") and spec["oom"][0] == rank:
        fired = []

        def inject(*a):
            if not fired and t.step == spec["oom"][1]:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        layer = world.unwrap(t.model).bert.encoder.layer
        if spec.get("oom_in") == "backward":  # the first block's backward: the others' gradients exist
            layer[0].register_full_backward_hook(inject)
        else:
            layer[1].register_forward_pre_hook(inject)
    allreduces = []  # DDP's gradient all-reduces (one per bucket) on this rank
    if world.sharding == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counted(state, bucket):
            allreduces.append(t.step)
            return allreduce_hook(state, bucket)
        t.model.register_comm_hook(None, counted)
    if spec.get("probe_oom_above"):  # every rank: an OOM in the forward of a micro-batch above this
        def too_big(module, args, kwargs):
            if args[0].shape[0] > spec["probe_oom_above"]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        hook = world.unwrap(t.model).bert.encoder.layer[1].register_forward_pre_hook(too_big, with_kwargs=True)
        from tightfit.planner.fsdp_probe import verify_micro_batch
        probed = verify_micro_batch(t)
        hook.remove()
    if spec.get("eval_oom") == rank:
        fired, real = [], t._eval_batch

        def eval_batch(*a, **k):  # as a GPU nearer its limit than the others' would
            if not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return real(*a, **k)
        t._eval_batch = eval_batch
    error = None
    try:
        res = t.fit()
    except Exception as e:  # e.g. TrainingInterrupted: what each rank ended with
        error, res = f"{type(e).__name__}: {e}", t.result
    if error is not None and spec.get("exit_on_error"):  # the ranks may be out of step: no more collectives
        return {"records": records, "error": error, "failed": True}
    if world.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        weights = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        weights = {k: v.detach().clone() for k, v in world.unwrap(t.model).state_dict().items()}
    world.close()
    norms = [m for m in world.unwrap(t.model).modules() if isinstance(m, torch.nn.BatchNorm1d)]
    return {"records": records, "drawn": drawn, "weights": weights, "oom_recoveries": res.oom_recoveries,
            "bn_batches": [int(m.num_batches_tracked) for m in norms], "bn_mean": [m.running_mean.clone() for m in norms],
            "micro_batch": t.micro_batch, "steps": t.step, "samples": res.samples, "allreduces": allreduces,
            "checkpoint_seconds": res.checkpoint_seconds, "error": error, "eval": res.eval,
            "rng_after_resume": rng_after_resume}
