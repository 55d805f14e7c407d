"""The Python face of ``tightfit train``: a recipe, read top to bottom in :func:`train`.

:class:`TrainRecipe` composes tightfit's parts in steps, each a short method: the setup
(options checked → device resolved → data loaded → run folder checked → model loaded → plan →
trainer), then the run folder opened, one call of the training loop, and the finish (model,
report, plots, summary).

Order matters: every check that can fail on bad input (the options, sizes, profiles, files,
columns, the budget against the model's state) runs in the setup, before anything is written to
the run folder or the GPU touched (a new run's folder is made empty and held once ``--out`` is
checked, so that a second run into it is refused before it plans; removed if the setup fails);
on resume nothing is written before the checkpoint is verified and the finished-run check is done.

Messages (notes, the plan, the summary, training events) go to the ``tightfit`` logger: the
command line prints them; a Python caller sees them with ``logging.basicConfig(level=logging.INFO)``
and silences them with ``logging.getLogger("tightfit").setLevel(logging.ERROR)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import math
import os
import re
import shlex
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

from . import __version__
from .config import PlanOptions, TrainRequest, names_flags, option_given, option_name, saved_options
from .data import TextClassificationData, check_split, held_out_split, load_default, load_text_classification, take
from .devices import DeviceProfile, card_budget, detect, get_profile
from .errors import TightfitError
from .fileio import (atomic_write_dir, atomic_write_json, atomic_write_text, disk_write_error, missing_folders,
                     output_folder, remove_empty_folders, unwritable_folder)
from .levers.checkpointing import check_checkpointing
from .levers.layout import use_channels_last
from .report.summary import RunInfo, RunSummary
from .rng import seed_everything
from .tasks import size_name
from .units import count_of, format_bytes, format_bytes_pair, parse_budget

__all__ = ["TrainRecipe", "TrainRequest", "RunSummary", "resolve_device", "train"]

log = logging.getLogger(__name__)

CPU_DEFAULT_TRAIN_SAMPLES = 2000  # keeps the default run under 10 minutes on 2 CPU cores


def train(req: TrainRequest) -> RunSummary:
    """Run ``tightfit train``.

    Args:
        req: the options (``TrainRequest(model=..., data=..., batch_size=...)``).

    Returns:
        The run's summary, also written to ``summary.json`` (for a resumed run that had already
        finished: the summary it wrote then).

    Raises:
        TightfitError: ``req`` not a :class:`TrainRequest`; bad input (before anything is written), a run that cannot fit, or a
            run stopped early (:class:`tightfit.runtime.trainer.StoppedError`, with the command
            that continues it).
    """
    from .runtime.allocator import configure_allocator

    from .runtime.distributed import World

    if not isinstance(req, TrainRequest):
        raise TightfitError(f"tightfit.api.train takes a TrainRequest, e.g. train(TrainRequest(batch_size=32)), "
                            f"got {type(req).__name__}")

    configure_allocator()  # effective only if CUDA has not started yet in this process
    from .image_train import recipe_class
    from .levers.attention import without_cudnn_attention

    world = World.from_env(req.planning.device)  # several ranks under torchrun (docs/distributed.md)
    recipe = recipe_class(req)(req, world)  # TrainRecipe, or ImageTrainRecipe for an image model
    with without_cudnn_attention(recipe.VARYING_SHAPES):  # planning's probes, training and evaluation alike
        return _train(recipe, world)


def _train(recipe: TrainRecipe, world) -> RunSummary:
    """:func:`train`'s steps on ``recipe``: setup, then the run, then its end."""
    req = recipe.req
    try:
        if req.run.resume and world.is_main:  # before the resume touches anything in the folder: one writer
            from .runtime.checkpoint import resume_target

            run = resume_target(req.run.resume)[0]
            if (run / "request.json").is_file():  # a run folder (setup says what else it is)
                _hold_run_folder(run, recipe)
        try:
            recipe.setup()  # checks, loads and plans; writes nothing but a new run's folder, made empty and held
        except BaseException as e:
            recipe.remove_created()  # that folder, if this run made it: a failed setup leaves nothing
            if isinstance(e, TightfitError):
                e.every_rank = world.distributed  # each rank checked the same input: rank 0 alone says so
                if not names_flags() and len(e.args) == 1 and isinstance(e.args[0], str):
                    from .loop import as_arguments  # the advice's flags as keywords: optimizer='adamw8bit'

                    e.args = (as_arguments(e.args[0]),)
            raise
        finished = recipe.finished_summary()
        if finished is not None:
            return finished
        try:
            try:
                recipe.open_run_folder()
            except BaseException:
                recipe.remove_created()  # a run folder left half-made (e.g. request.json not written) would block --out
                raise
            result = recipe.train()
        except KeyboardInterrupt:  # stopped at once (a second Ctrl-C, before training began, in the evaluation)
            recipe.interrupted("the final evaluation")  # (the training loop's own stops are StoppedError)
            raise
        except OSError as e:  # metrics.jsonl on a full disk, an image gone: one line that says how to go on
            raise recipe.disk_failure(e) or recipe.missing_sample(e) or e
        try:
            summary = recipe.finish(result)
        except KeyboardInterrupt:  # while the model and report were written: the command that finishes the run
            recipe.interrupted("writing the model and the report")
            raise
        except Exception as e:  # the model or the report on a full disk (safetensors' error is no OSError): likewise
            raise recipe.disk_failure(e) or e
        world.close()
        return summary
    finally:
        _release_run_folders(recipe)
        recipe.settings.close()  # the process's settings the run changed (--deterministic), as they were


_HELD: dict[str, tuple[object, int]] = {}  # run folders being written -> (the train call's recipe, lock fd)
_HELD_LOCK = threading.Lock()


@contextlib.contextmanager
def _loading_notes():
    """The notes (``note: ...``) the data and model loaders (:mod:`tightfit.data`,
    :mod:`tightfit.images`, :mod:`tightfit.models`) log inside the block, taken instead of shown: a
    list filled as they come (without the prefix), for the run's notes, which its header shows and
    its report records (a skipped file or classes differing only in case were shown once and
    recorded nowhere)."""
    said: list[str] = []

    def take(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("note: "):
            said.append(message.removeprefix("note: "))
            return False
        return True

    loggers = [logging.getLogger(name) for name in ("tightfit.data", "tightfit.images", "tightfit.models")]
    for logger in loggers:
        logger.addFilter(take)
    try:
        yield said
    finally:
        for logger in loggers:
            logger.removeFilter(take)


def _hold_run_folder(folder: Path, owner) -> None:
    """Take an exclusive advisory lock on run folder ``folder`` for ``owner`` (one ``train`` call's
    recipe; ``flock`` on the folder itself, so nothing is added to it) until
    :func:`_release_run_folders`: a run folder has one writer, and a second one -- another process,
    or another call of this one -- resuming or writing it (which would remove the first's checkpoint
    write in flight as a leftover and duplicate its records) is refused. No lock where the
    filesystem or the platform has none.

    Raises:
        TightfitError: another writer holds it.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        return
    key = str(Path(folder).resolve())
    refusal = (f"run folder {folder} is being written by another tightfit run (a run folder has one writer): "
               f"wait for it to end, or stop it")
    with _HELD_LOCK:
        if key in _HELD:
            if _HELD[key][0] is owner:
                return
            raise TightfitError(refusal)
        try:
            fd = os.open(key, os.O_RDONLY)
        except OSError:  # a folder that cannot be opened for reading: its writes will say why
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TightfitError(refusal) from None
            return  # no flock on this filesystem (ENOLCK, ENOSYS, EOPNOTSUPP): unguarded, as before
        _HELD[key] = (owner, fd)


def _claim_run_folder(folder: Path, owner, next_name=None) -> tuple[Path, list[Path]]:
    """Make new run folder ``folder`` (unless it is there, empty) and hold it for ``owner``
    (:func:`_hold_run_folder`) once it is checked, before the data are read and the plan is made:
    a second run started into it at once is refused before it plans, not after.

    Args:
        next_name: for the default run folder (:func:`_default_run_folder`), whose name another
            run may take between its choice and its creation: ``folder`` is then used only if it
            is made here (``mkdir`` is the test, exclusive), else ``next_name()`` is tried.

    Returns:
        The folder held, and the folders made here, it first, then the parents it needed,
        innermost first (``runs/`` for the default ``runs/<date-time>``): to be removed if the run
        stops before it writes anything.

    Raises:
        TightfitError: it cannot be made, or another run holds it.
    """
    for _ in range(100):
        missing = missing_folders(folder)
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            if next_name is not None:  # taken since it was chosen
                folder = next_name()
                continue
            missing = []
        except OSError as e:  # e.g. under /proc: the folder check passed (root may write anywhere)
            raise TightfitError(f"cannot create the run folder {folder}: {e.strerror or e}") from e
        _hold_run_folder(folder, owner)
        return folder, missing
    raise TightfitError(f"no free run folder name under runs/ (the last tried: {folder}): give {option_name('out')}")


def _default_run_folder() -> Path:
    """The default run folder: ``runs/<date-time>``, or ``runs/<date-time>-2``, ``-3``, ... where
    that name is taken already (runs started in the same second, e.g. a sweep launched with ``&``)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        if not os.path.lexists(folder):
            return folder


def _release_run_folders(owner) -> None:
    """Release ``owner``'s locks of :func:`_hold_run_folder` (the end of its ``train``, however it ends)."""
    with _HELD_LOCK:
        for key in [k for k, (o, _) in _HELD.items() if o is owner]:
            os.close(_HELD.pop(key)[1])


def run_folder_in_use(folder: Path) -> bool:
    """Whether a ``tightfit train`` is writing run folder ``folder``: it holds the folder's
    exclusive lock (:func:`_hold_run_folder`) while it runs. False where the folder cannot be
    opened or the filesystem has no locks."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as fd is closed
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)


def resolve_device(options: PlanOptions | TrainRequest) -> tuple[str, DeviceProfile | None, int | None, list[str]]:
    """Device, the card profile whose rules apply, the budget in bytes, and notes.

    ``--gpu`` emulates a known card on whatever GPU is present (its budget and precision rules);
    ``--budget`` caps memory at a given size (with ``--gpu``, at most that card's usable memory:
    :func:`tightfit.devices.card_budget`, as ``tightfit plan`` decides it, with a note where it
    is lowered); neither: the local card's own budget.

    Args:
        options: the plan options (or a whole request).

    Raises:
        TightfitError: unknown profile, unreadable budget, no GPU for ``--device cuda``, or a
            budget larger than the card (the ``--gpu`` card's, or the local one).
    """
    import torch

    p = options.planning if isinstance(options, TrainRequest) else options
    notes = []
    profile = get_profile(p.gpu) if p.gpu else None
    budget = parse_budget(p.budget) if p.budget else None
    if profile:  # as `tightfit plan` decides it, GPU or not: above the card refused, above its usable part lowered
        budget, notes = card_budget(profile, budget)
    if p.device == "cuda" and not torch.cuda.is_available():
        raise TightfitError(f"{option_given('device', 'cuda')}, but no CUDA GPU is visible")
    if not torch.cuda.is_available() or p.device == "cpu":
        if profile:
            notes.append(f"no CUDA GPU in use: {option_name('gpu')}"
                         + (f"/{option_name('budget')} are" if p.budget else " is")
                         + f" checked against the {profile.name}'s memory but not applied: training runs on the CPU")
        elif budget:  # no card to check it against: only that it holds the model state
            notes.append(f"no CUDA GPU in use: {option_name('budget')} caps a GPU's memory and is not applied "
                         "(checked only against the model state): training runs on the CPU")
        if getattr(p, "planner", "search") != "search":
            notes.append(f"no CUDA GPU in use: {option_given('planner', p.planner)} applies on a GPU; the CPU takes "
                         "the first plan that fits")
        return "cpu", None, budget, notes
    local = detect()
    if profile is None:
        profile = local
    if budget is None:  # neither --gpu nor --budget: the local card's own
        budget = profile.budget_bytes()
    if budget > local.total_bytes:
        shown = format_bytes_pair(budget, local.total_bytes)
        raise TightfitError(f"budget {shown[0]} is more than the {shown[1]} of {local.name}")
    return "cuda", profile, budget, notes


class TrainRecipe:
    """One ``tightfit train`` run, as steps on its state (in the manner of torchtune's recipes).

    Its batches vary in shape (each micro-batch padded to its longest text), so its attention
    runs without cuDNN's kernels, which build a plan per shape (:mod:`tightfit.levers.attention`).

    Use: ``recipe.setup()``; if ``recipe.finished_summary()`` is None, ``recipe.open_run_folder()``,
    then ``recipe.finish(recipe.train())``. The options were checked when the request was made
    (:mod:`tightfit.config`); :meth:`setup` does every other check and writes nothing (but a new
    run's empty folder, held against a second run).

    Args:
        req: the options of the run.

    Attributes (set by the steps, in order):
        req: the options in force (on resume: the run's own, with what may change given anew).
        resume_from, changed: the verified checkpoint a resumed run continues from, and the
            options given anew (``{option: [old, new]}``).
        device, profile, budget: ``"cpu"`` or ``"cuda"``, the card whose rules apply, the budget in bytes.
        source, data: the model's registry entry (a name or a local folder) and the whole data set.
        out: the run folder.
        train_data, eval_data: the samples trained on and held out.
        model, tokenizer, workload: the model with its new head, its tokenizer, and the workload.
        device_name: ``"CPU"`` or the GPU's name.
        plan, planning_s: the plan and the seconds it took.
        trainer: the :class:`tightfit.runtime.trainer.Trainer`.
        metrics: the open ``metrics.jsonl`` writer (after :meth:`open_run_folder`).
    """

    VARYING_SHAPES = True  # micro-batches padded to their longest text: see tightfit.levers.attention

    def __init__(self, req: TrainRequest, world=None):
        from .runtime.distributed import World

        self.req = req
        self.world = world or World()  # rank 0 plans and writes the run folder; see runtime/distributed.py
        self.t_start = time.perf_counter()
        self.notes: list[str] = []  # printed after the banner, as "note: ..."
        self.resume_from: Path | None = None  # the checkpoint a resumed run continues from
        self.resume_notes: list[str] = []  # what the resume found and did in the run folder (events)
        self.changed: dict = {}  # {option: [old, new]} given anew on resume
        # the options this session's command gave: a resumed request counts every recorded option as given
        self.given = frozenset(req.run.given)
        # every session's command line, in order: this one's last (on resume the earlier ones'
        # are read back from metrics.jsonl's plan records, open_run_folder)
        self.commands: list[str] = [req.run.command]
        self.resume_state: dict | None = None  # the checkpoint's state once read (_check_resume_point)
        self.device, self.profile, self.budget = "cpu", None, None
        self.records: list[dict] = []  # what the trainer logs before the metrics file is open
        self.data_fingerprint: str | None = None  # of the samples trained on and held out
        self.settings = contextlib.ExitStack()  # the process's settings changed for the run, until train returns
        self.metrics = None
        self.plan_timings: dict = {}  # the planner's stage times (seconds), or {"cached": True, ...}
        self.offload_reason: str | None = None  # one process offloading its parameters: why (_check_budget)
        self._refused: str | None = None  # the single-GPU refusal offload was taken instead of
        self.made_parents: list[Path] = []  # the parents a new run's folder needed (_check_run_folder)
        self.finished = False  # summary.json written (finish): an interrupt after it stops nothing

    # ---------------------------------------------------------------- setup: writes nothing (but a new run's empty folder)
    def setup(self) -> None:
        """Resolve the resume, the device, the run folder, the data, the model, the plan and the
        trainer (on resume: its state restored from the verified checkpoint).

        Raises:
            TightfitError: bad input or a request that cannot be met; nothing is written (a new
                run's folder, made empty by :meth:`_check_run_folder`, is left to :func:`train`
                to remove: :meth:`remove_created`).
        """
        if self.req.run.resume:
            # rank 0 chooses the checkpoint for every rank: it alone puts back a displaced one (the
            # folder's one writer), and a rank choosing by itself before that would take an older one
            self.req, self.resume_from, self.changed, self.data_fingerprint, self.resume_notes = \
                self.world.decide(lambda: _resume_request(self.req, self.world.is_main))
            self.notes += [f"{option_name('resume')} with {option_given(k, new)} (the run had {old})"
                           for k, (old, new) in self.changed.items()]
            self.notes += [n for n in self.resume_notes if not n.startswith(_DONE_TO_THE_FOLDER)]  # said already
        from .runtime.determinism import deterministic_kernels

        # the run's own setting (a resumed run's recorded one), before anything is planned or compiled under it
        self.settings.enter_context(deterministic_kernels(self.req.training.deterministic))
        if self.req.training.deterministic:  # the plan does not show it: a note in the header and report.md
            self.notes.append(f"{option_name('deterministic')}: planned, trained and evaluated with PyTorch's "
                              "deterministic kernels (an operation without one warns and runs as it would without)")
        self._resolve_device()
        if self.resume_from is None:  # a resumed run's --data is as recorded: names stay names, folders absolute
            from .images import check_data_name

            check_data_name(self.req.workload.data)
        self._check_run_folder()  # before the data are read (every image decoded): it needs only their path
        self._noting(self._load_data)
        self._split_data()
        self._noting(self._load_model)  # the model folder's head kept or replaced (tightfit.models.new_head)
        check_checkpointing(self.model, self.req.planning.checkpointing)
        self._check_batchnorm()
        self._check_resume_point()
        self._announce()  # the notes, the resume's too, once every check has passed
        self._plan()
        self._make_trainer()

    def _noting(self, load) -> None:
        """``load()`` with the loaders' notes taken as the run's (:func:`_loading_notes`): shown with
        the others once every check has passed, and recorded."""
        with _loading_notes() as said:
            load()
        self.notes += said

    def _resolve_device(self) -> None:
        """Device, profile and budget; the options that depend on the device."""
        p = self.req.planning
        self.device, self.profile, self.budget, notes = resolve_device(p)
        self.notes += notes
        temps = [option_name(k) for k in ("warn_temp", "cooldown_temp") if k in self.given]
        if temps and self.device == "cpu":  # the health watch reads a GPU's sensors (NVML)
            self.notes.append(f"no CUDA GPU in use: {'/'.join(temps)} {'apply' if len(temps) > 1 else 'applies'} "
                              "to a GPU's temperature; nothing is watched on the CPU")
        if p.sharding not in ("auto", "fsdp-offload") and not self.world.distributed:
            self.notes.append(f"{option_given('sharding', p.sharding)} applies to several processes (--gpus N); "
                              "this run has one")
        p.check_for_device(self.device, self.world.distributed)
        from .levers.optimizers import LEVER_OPTIMIZERS, check_precision as check_optimizer_precision

        check_optimizer_precision(p.optimizer, p.precision, self.profile)  # bf16 weights: a card with bf16
        if p.optimizer in LEVER_OPTIMIZERS:
            from .planner.optimizers import levers_installed

            if not levers_installed(p.optimizer):
                from .levers.optimizers import LEVER_LIBRARY

                whose = (f"the resumed run's optimizer {p.optimizer}" if self.resume_from is not None
                         else option_given("optimizer", p.optimizer))
                raise TightfitError(f"{whose} needs {LEVER_LIBRARY[p.optimizer]}: "
                                    "pip install 'tightfit[levers]'")
        if p.precision != "auto":
            from .levers.precision import check_precision

            self.notes += check_precision(p.precision, self.profile if self.device == "cuda" else None)

    def _load_data(self) -> None:
        """The model's registry entry and the whole data set (both checked)."""
        from .models import resolve_for_training

        w = self.req.workload
        self.source = resolve_for_training(w.model)  # the registry: a name or a local folder
        self.data = load_text_classification(w.data, w.text_column, w.label_column) if w.data else load_default()

    def _check_run_folder(self) -> None:
        """The run folder: new or empty (or the run being resumed), and creatable; a new run's is
        then made (if need be) and held (:func:`_claim_run_folder`; without ``--out``,
        :func:`_default_run_folder`'s name).

        Raises:
            TightfitError: it cannot be used, or another run is writing it.
        """
        out = self.req.run.out
        if out is not None and not str(out).strip():  # "" would silently become runs/<date-time>
            raise TightfitError(f"{option_name('out')} is empty: give the run folder, or leave {option_name('out')} out for "
                                "runs/<date-time>")
        new = self.resume_from is None  # a resumed run's folder is held from train() on
        # the default named once, on rank 0: ranks started a second apart would name two folders
        self.out = output_folder(out) if out else self.world.decide(_default_run_folder)
        if new:  # a folder another run is writing: refused as such, not as "not empty" (rank 0 holds it)
            self.world.decide(lambda: self.out.is_dir() and _hold_run_folder(self.out, self))
        _check_out(self.out, resuming=not new)
        data = self.req.workload.data
        if new and data and Path(data).is_dir() and \
                Path(data).resolve() in (self.out.resolve(), *self.out.resolve().parents):
            # its files would become samples (a class of their own) and the data would change under it
            raise TightfitError(f"{option_given('out', str(self.out))} is inside the data folder {data}: its files "
                                f"would become samples; choose a folder outside it")
        if new:  # rank 0 writes it: it makes and holds it (the default: the next name where another run
            # took this one meanwhile); a refusal is every rank's
            self.out, made = self.world.decide(
                lambda: _claim_run_folder(self.out, self, None if out else _default_run_folder))
            self.created = made[:1] if self.world.is_main else []
            self.made_parents = made[1:] if self.world.is_main else []  # removed with it, once empty (remove_created)

    def _split_data(self) -> None:
        """The fixed held-out split, cut to ``--train-samples``/``--eval-samples`` (on the CPU, to
        :data:`CPU_DEFAULT_TRAIN_SAMPLES` unless ``--full``), and its checks."""
        run, data = self.req.run, self.data
        train_idx, eval_idx = held_out_split(len(data))
        limit = run.train_samples
        if limit is None and self.device == "cpu" and not run.full and len(train_idx) > CPU_DEFAULT_TRAIN_SAMPLES:
            limit = CPU_DEFAULT_TRAIN_SAMPLES
            self.notes.append(f"CPU run: training on {limit} of {len(train_idx)} training samples "
                              f"({option_name('full') if names_flags() else 'full=True'} for all, "
                              f"{option_name('train_samples')}{' N' if names_flags() else '=N'} to choose)")
        if data.skipped_blank:
            self.notes.append(f"{count_of(data.skipped_blank, 'row')} with a blank {data.SAMPLE_FIELD} or label "
                              f"{'was' if data.skipped_blank == 1 else 'were'} skipped")
        if data.skipped_unlabelled:  # -100 marks no label (Hugging Face's ignore index), not a class
            self.notes.append(f"{count_of(data.skipped_unlabelled, 'row')} labelled -100 (no label, as in Hugging "
                              f"Face's losses) {'was' if data.skipped_unlabelled == 1 else 'were'} skipped")
        if data.skipped_header:  # said, as blank rows are: a count the file's row total does not show
            self.notes.append(f"{count_of(data.skipped_header, 'row')} identical to the header "
                              f"{'was' if data.skipped_header == 1 else 'were'} skipped (files joined, each with its "
                              "header?)")
        self.train_data: TextClassificationData = data.subset(take(train_idx, limit))
        self.eval_data: TextClassificationData = data.subset(take(eval_idx, run.eval_samples))
        self.notes += check_split(data, self.train_data, self.eval_data)
        for flag, asked, split, what in ((option_name("train_samples"), run.train_samples, train_idx, "training"),
                                         (option_name("eval_samples"), run.eval_samples, eval_idx, "held-out")):
            if asked is not None and asked > len(split):
                self.notes.append(f"{flag} {asked} is more than the {len(split)} {what} samples of the split: "
                                  f"using all {len(split)}")
        batch = self.effective_batch()
        if batch < self.req.workload.batch_size:
            self.notes.append(f"{option_name('batch_size')} {self.req.workload.batch_size} is more than the "
                              f"{len(self.train_data)} training samples: the effective batch is {batch} (every "
                              f"optimizer step sees all of them, one step per epoch)")
        training, steps = self.req.training, self._epoch_steps(batch)
        if training.max_steps and training.max_steps > steps:
            self.notes.append(f"{option_given('max_steps', training.max_steps)} is more than the {steps} optimizer steps of "
                              f"{training.epochs:g} epoch(s): training {steps} (raise {option_name('epochs')} for more)")
        if not (training.max_steps and training.max_steps < steps):  # else --max-steps says the length
            from .runtime.trainer import rounded_epochs_note

            note = rounded_epochs_note(training.epochs, len(self.train_data), batch, steps)
            if note:
                self.notes.append(note)
        from .images import legacy_fingerprints

        fingerprint = f"{self.train_data.fingerprint()}:{self.eval_data.fingerprint()}"
        if self.resume_from is not None and self.data_fingerprint not in (None, fingerprint, *legacy_fingerprints(
                self.train_data, self.eval_data)):
            raise TightfitError(f"{option_given('resume', str(self.out))}: the data differ from those the run started with "
                                f"({self.data.source}: {self.data.CHANGED}); resume with the same data, "
                                "or start a new run")
        self.data_fingerprint = fingerprint

    def effective_batch(self) -> int:
        """Samples per optimizer step: ``batch_size``, or all the training samples where there are
        fewer (what every step then sees: the plan, ``plan.json`` and the summary say that, not
        the number asked for)."""
        return max(1, min(self.req.workload.batch_size, len(self.train_data)))

    def _epoch_steps(self, effective_batch: int) -> int:
        """Optimizer steps of ``--epochs`` over the training split at ``effective_batch`` samples
        each (before ``--max-steps``), as the trainer counts them."""
        from .runtime.trainer import epoch_steps

        return epoch_steps(self.req.training.epochs, len(self.train_data), effective_batch)

    def _run_steps(self, effective_batch: int) -> int:
        """Optimizer steps the run takes: the epochs' (:meth:`_epoch_steps`), at most ``--max-steps``."""
        steps = self._epoch_steps(effective_batch)
        return min(steps, self.req.training.max_steps or steps)

    def _load_model(self) -> None:
        """The model with a new head (seeded), its tokenizer checked against the data and
        ``--seq-len``, the budget checked against its state, and the workload.

        Raises:
            TightfitError: a bad model folder or tokenizer, or a budget below the model's state.
        """
        from .models import check_tokenizer
        from .workload import TextBatches, Workload

        seq_len = self.req.workload.seq_len
        seed_everything(self.req.training.seed)  # before the new head is initialised
        self.model, self.tokenizer = self.source.load_classifier(self.data.label_names)
        self.notes += self.source.training_notes()
        self.notes += check_tokenizer(self.model, self.tokenizer, self.source.tokenizer_path(), self.data.texts, seq_len,
                                      "seq_len" in self.req.run.given)
        self._apply_trainable()
        self._check_budget()
        self.workload = Workload(self.model, TextBatches(self.tokenizer, self.train_data, seq_len),
                                 TextBatches(self.tokenizer, self.eval_data, seq_len), self.effective_batch())

    def _apply_trainable(self) -> None:
        """``--trainable``: wrap the model with LoRA adapters or freeze its lower layers
        (:mod:`tightfit.levers.trainable`), and say how many parameters train."""
        from .levers.trainable import apply_trainable

        self.model, note = apply_trainable(self.model, self.req.workload.trainable)
        if note:
            self.notes.append(note)

    def _check_budget(self) -> None:
        """The budget holds the least model state of the optimizers that may be chosen
        (:func:`tightfit.planner.advice.check_model_state`, as ``tightfit plan`` checks it; fp32
        AdamW: weights, gradients and state, 16 B per parameter).

        Raises:
            TightfitError: it does not (naming the levers and what each saves).
        """
        from .devices import get_profile
        from .planner.advice import check_model_state
        from .planner.optimizers import levers_installed

        p = self.req.planning
        if self.budget is None or self.world.distributed:  # several ranks: planner/sharding.py
            return
        if p.sharding == "fsdp-offload":
            self._check_host_for_offload()
            self.offload_reason = f"{option_given('sharding', 'fsdp-offload')} (asked for)"
            return
        link = (self.profile or get_profile("h200")).host_link_bytes_per_s
        try:
            check_model_state(self.model, self.budget, p.optimizer, levers_installed() and self.device == "cuda",
                              link, cuda=self.device == "cuda", profile=self.profile if self.device == "cuda" else None,
                              precision=p.precision)
        except TightfitError as e:
            if not self._offload_instead(str(e)):
                raise

    def _offload_instead(self, refused: str) -> bool:
        """Whether ``auto`` offloads the parameters of a model that no single-GPU plan fits
        (``refused``: the planner's refusal): on one CUDA GPU, where
        :func:`tightfit.planner.sharding.falls_back_to_offload` says so. Sets :attr:`offload_reason`.

        Raises:
            TightfitError: the host has too little memory for it (:meth:`_check_host_for_offload`).
        """
        from .planner.sharding import fallback_reason, falls_back_to_offload, first_clause

        p = self.req.planning
        if not (self.device == "cuda" and p.sharding == "auto" and not self.world.distributed and
                falls_back_to_offload(self.model, self.budget, self.profile, p.optimizer, p.precision)):
            return False
        self._check_host_for_offload(refused=first_clause(refused))
        self.offload_reason = fallback_reason(refused, p.optimizer)
        self._refused = refused  # said whole if no micro-batch fits under offload either
        return True

    def _check_host_for_offload(self, refused: str | None = None) -> None:
        """Parameter offload keeps 16 B per trained parameter in host memory
        (:func:`tightfit.planner.sharding.host_state_bytes`): refuse it where the host has less
        available than that (the model's own copy, loaded already, is not counted again: FSDP2
        replaces it block by block).

        Raises:
            TightfitError: too little host memory (after ``refused``, the single-GPU refusal, if any).
        """
        from .levers.blocks import find_blocks
        from .levers.optimizers import available_host_bytes
        from .planner.sharding import host_state_bytes

        if not find_blocks(self.model):
            raise TightfitError("parameter offload (--sharding fsdp-offload) needs a model of repeated blocks "
                                "(transformer layers): FSDP2 gathers one block at a time")
        need, have = host_state_bytes(self.model), available_host_bytes()
        if have is not None and need > have:
            raise TightfitError((refused + "; and p" if refused else "P") +
                                f"arameter offload needs {format_bytes(need)} of host memory (fp32 weights, "
                                f"gradients and AdamW state, 16 B per trained parameter and 4 B per frozen one), "
                                f"{format_bytes(have)} available")

    def input_size(self) -> int:
        """The size a sample's worst case has, for the planner: ``--seq-len`` (tokens)."""
        return self.req.workload.seq_len

    def _check_batchnorm(self) -> None:
        """Before planning: an epoch's last window of one sample that the run reaches, which
        BatchNorm cannot train on (:func:`~tightfit.runtime.trainer.batchnorm_sees_one_sample`
        at micro-batch = effective batch; a split that leaves one sample depends on the plan's
        micro-batch and is refused when the trainer is made).

        Raises:
            TightfitError: one line saying which window and what to change.
        """
        import torch

        from .runtime.trainer import batchnorm_sees_one_sample, one_sample_forward

        E, n, least = self.workload.effective_batch, len(self.train_data), 2 * self.world.size
        # below 2 samples a rank, every window leaves some rank 1: no batch size helps, more samples do
        more = f"{option_name('train_samples')}{' ' if names_flags() else '='}{least} or more"
        # a batch of 1 a rank has every window of one sample: only a larger batch helps, not a sample less
        per_rank = E // self.world.size  # the smallest share a rank gets
        fix = (f"train on at least {least} samples ({more})" if n < least
               else f"choose a {option_name('batch_size')} of at least {least}" if per_rank < 2
               else f"choose another {option_name('batch_size')} (or drop a sample)")
        from .plan import rank_batch

        # the whole share of each rank in one micro-batch (the plan comes later: a smaller one is checked then)
        one = batchnorm_sees_one_sample(  # the model is still on the CPU, on every rank whole
            self.model, n, E, rank_batch(E, self.world.size), self._run_steps(E),
            one_sample_forward(self.workload, self.model, torch.device("cpu")), fix=fix, world_size=self.world.size)
        if one:
            raise TightfitError(one)

    def _check_resume_point(self) -> None:
        """On resume: read the checkpoint's state (once: the plan and the trainer's resume take it)
        and refuse another model's weights or another run's data order, before anything is shown."""
        if self.resume_from is None:
            return
        from .runtime.checkpoint import check_training_state, check_weights_fit, read_state
        from .runtime.sharded_checkpoint import is_sharded
        from .runtime.trainer import check_same_windows

        self.resume_state = read_state(self.resume_from)
        check_training_state(self.resume_from, self.resume_state, is_sharded(self.resume_from))
        if not is_sharded(self.resume_from):
            check_weights_fit(self.resume_from, self.world.unwrap(self.model))
        check_same_windows(self.resume_from, self.resume_state, self.workload.effective_batch)

    def _announce(self) -> None:
        """Log what is trained on what, and the notes so far."""
        import torch

        self.device_name = "CPU" if self.device == "cpu" else torch.cuda.get_device_name(0)
        name = self.source.about
        from .levers.lora import model_parameters

        n = model_parameters(self.model)  # the model's own: LoRA's adapters are counted in its note
        count = f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"  # a tiny model is not "0.0M"
        log.info(f"tightfit {__version__}: fine-tuning {name} ({count} parameters) on {self.data.source}: "
                 f"{len(self.train_data)} training / {len(self.eval_data)} held-out samples, "
                 f"classes {self.data.label_names}")
        for n in self.notes:
            log.warning(f"note: {n}")

    def _plan(self) -> None:
        """On a GPU: cap the caching allocator at the budget. Then plan (or take the plan in force
        from the checkpoint on resume) and log it."""
        import torch

        from .report.summary import plan_lines

        if self.device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget / total))
            log.info(f"device: {self.device_name}, memory capped at {format_bytes(self.budget)}"
                     + (f" (the {self.profile.name} profile)" if self.req.planning.gpu else ""))
            if not self._offloads():  # parameter offload: FSDP2 moves the model block by block
                self.model.to(self.device)
            if not (self.world.distributed or self._offloads()):  # planned and run in the layout it trains in
                chosen = self.req.planning.optimizer
                layout = use_channels_last(self.model, self.device, None if chosen == "auto" else chosen)
                if layout:
                    log.info(layout)
        from .planner import probe  # noqa: F401  (imported before the clock: planning_s times the planning)

        t_plan = time.perf_counter()
        if self.world.distributed:  # rank 0 plans, every rank takes its plan (or its error)
            from .planner.sharding import plan_for_ranks

            self.plan = self.world.decide(lambda: plan_for_ranks(self, self._choose_plan))
        else:
            self.plan = self._choose_plan()
            if self.plan.world_size != 1:  # a run of several ranks resumed by one process
                kept = "fsdp-offload" if self.plan.sharding == "fsdp-offload" else "none"  # on one GPU too
                self.plan = replace(self.plan, world_size=1, sharding=kept, reasons=self.plan.reasons + (
                    f"resumed in one process: the same micro-batch {self.plan.micro_batch}, the ranks' "
                    f"effective batch {self.plan.effective_batch} in more accumulation steps",))
        if self.resume_from is None:  # what is trained, in the plan and the report
            from .levers.trainable import trainable_fields

            self.plan = replace(self.plan, **trainable_fields(self.model))
        self.planning_s = time.perf_counter() - t_plan
        cached = self.plan_timings.get("cached", False)
        if self.resume_from is not None:  # the first run's predicted and probed speeds, for the summary
            from .report.metrics import planned_speeds

            self.plan_timings.update(planned_speeds(self.out / "metrics.jsonl"), from_checkpoint=True)
        self._compile_before_training()
        log.info("plan:" + (" (from the checkpoint)" if self.resume_from else " (from the plan cache)" if cached
                            else "") + f" planning took {self.planning_s:.1f} s")
        for line in plan_lines(self.plan):
            log.info(f"  {line}")

    def _offload_plan(self):
        """The parameter-offload plan (:func:`tightfit.planner.sharding.offload_plan`; not cached),
        its first reason why."""
        from .planner.sharding import offload_plan

        return offload_plan(self, self.offload_reason, self._refused)

    def _offloads(self) -> bool:
        """This run offloads its parameters (asked for, planned so, or resumed from such a plan):
        the model then stays in host memory until FSDP2 shards it."""
        if self.resume_state is not None:
            return self.resume_state["plan"].get("sharding") == "fsdp-offload"
        return self.offload_reason is not None or self.req.planning.sharding == "fsdp-offload"

    def _compile_before_training(self) -> None:
        """A plan from the plan cache or from the checkpoint compiled nothing in this process:
        compile now, at the worst case and another length, what the first run's planning
        compiled, so that the run's first batches do not compile the model (a resumed BERT-large
        spent 273 s there). On one GPU only: compilation runs on CUDA, and several ranks would
        each compile alone. Sets ``plan_timings["compile_s"]``."""
        cached = self.plan_timings.get("cached", False)
        if (cached or self.resume_from is not None) and self.device == "cuda" and not self.world.distributed:
            from .planner.warmup import warm_compiled_plan

            self.plan_timings["compile_s"] = warm_compiled_plan(self.workload, self.plan, self.budget)

    def _choose_plan(self):
        """The planner's plan: the search on a GPU (``--planner search``), the first prober
        otherwise; on resume the plan the run chose, as its checkpoint carries it (the trainer's
        resume then restores the micro-batch in force)."""
        p = self.req.planning
        if self.resume_from is not None:
            from .plan import Plan

            plan = Plan.from_dict(self.resume_state["plan"])  # read and checked by _check_resume_point
            if plan.compile_scope == "model-graphs" and self.req.training.cuda_graphs == "off":
                # the same compiled graph, without CUDA graphs (--cuda-graphs may change on resume)
                plan = replace(plan, compile_scope="model",
                               reasons=plan.reasons + ("--cuda-graphs off on resume: compiled whole, not replayed "
                                                       "as CUDA graphs",))
            return plan
        if self.offload_reason is not None:
            return self._offload_plan()
        if self.device == "cuda":
            from .planner.search import NothingFitsError

            try:
                return self._cached_gpu_plan()
            except NothingFitsError as e:  # the state fits, but no step with its activations does
                if not self._offload_instead(str(e)):
                    raise
                self.model.to("cpu")  # FSDP2 gathers it block by block
                return self._offload_plan()
        from .planner.probe import plan_first

        plan = plan_first(self.workload, self.device, self.profile, self.budget, p.precision, p.checkpointing)
        return plan if p.optimizer == "auto" else replace(plan, optimizer=p.optimizer)  # the CPU: no search

    def _cached_gpu_plan(self):
        """The GPU planner's plan, from the plan cache (:mod:`tightfit.planner.cache`) when the
        same job was planned before on the same card and budget (``--replan``: plan afresh);
        a fresh plan is cached. ``self.plan_timings`` gets the planner's stage times."""
        import math

        import torch

        from .planner.cache import from_cache_reason, host_changed, load_plan, plan_key, store_plan
        from .planner.probe import plan_first

        p, w, E = self.req.planning, self.workload, self.workload.effective_batch
        run_samples = self._run_steps(E) * E
        # the run's length decides only whether compiling repays itself: a run that compiles
        # nothing takes the same plan for any --epochs
        compiles = p.planner == "search" and p.compile != "off"
        from .planner.gpu import graphs_planned

        graphs = graphs_planned(self.req.training.cuda_graphs != "off")  # the planner may replay CUDA graphs
        key = plan_key(w.model, w.train.worst_case(1), E,
                       {"precision": p.precision, "checkpointing": p.checkpointing, "compile": p.compile,
                        "planner": p.planner, "optimizer": p.optimizer, "trainable": self.req.workload.trainable,
                        "cuda_graphs": graphs, "deterministic": self.req.training.deterministic},
                       self.profile.name, torch.cuda.get_device_properties(0).total_memory,
                       self.budget, run_samples if compiles else None, profile=dataclasses.asdict(self.profile))
        cached = None if p.replan else load_plan(key)
        changed = cached and host_changed(cached[0], w.model)
        if changed:  # planned for more free host memory than there is now: planned anew (and cached so)
            log.warning(f"note: the cached plan ({cached[1]['path']}) is planned anew: {changed}")
            cached = None
        if cached is not None:
            plan, record = cached
            self.plan_timings = {**record["timings"], "cached": True, "planned_s": record["planning_seconds"]}
            self.plan_timings.pop("compile_s", None)  # the first run's; this run's is measured in _plan
            reasons = tuple(r for r in plan.reasons if not r.startswith("plan from the cache"))
            return replace(plan, reasons=(from_cache_reason(record),) + reasons)
        t0 = time.perf_counter()
        if p.planner == "search":
            from .planner.gpu import plan_on_gpu

            plan = plan_on_gpu(w, self.profile, self.budget, self.input_size(), p.precision, p.checkpointing,
                               p.compile, run_samples=run_samples, timings=self.plan_timings, optimizer=p.optimizer,
                               cuda_graphs=graphs)
        else:
            # the probes step the optimizer asked for: 8-bit or offloaded state fits where fp32 AdamW's does not
            plan = plan_first(w, self.device, self.profile, self.budget, p.precision, p.checkpointing,
                              "adamw" if p.optimizer == "auto" else p.optimizer)
        store_plan(key, plan, time.perf_counter() - t0, timings=self.plan_timings)
        return plan

    def _make_trainer(self) -> None:
        """The trainer of the training options; on resume, restored from the checkpoint."""
        from .runtime.trainer import TrainConfig, Trainer

        cfg = TrainConfig.from_options(self.req.training, checkpoint_dir=str(self.out / "checkpoints"))
        if cfg.max_steps and cfg.max_steps > self._epoch_steps(self.workload.effective_batch):
            cfg = replace(cfg, max_steps=None)  # the epochs end the run first: noted already (_split_data)
        self.trainer = Trainer(self.workload, self.plan, cfg, log=self.records.append,
                               progress=self.req.run.progress and self.world.is_main,
                               profile=self.profile if self.device == "cuda" else None, world=self.world)
        self.trainer.wall_start = self.t_start  # the run's wall time, which checkpoints carry, counts planning
        if self.resume_from is not None:  # verified by _resume_request, its state read by _check_resume_point
            self.trainer.resume(self.resume_from, state=self.resume_state, verified=True)
            if self.world.is_main:  # (the earlier sessions' events: open_run_folder, once metrics.jsonl is cut back)
                for note in self.resume_notes:  # shown when found; kept for the report and by later resumes
                    self.trainer.event(note, show=False, session=True)
            written_at = (self.resume_state or {}).get("scheduler", {}).get("base_lrs", [None])[0]
            written_at = None if written_at is None else float(written_at)  # a 0-d tensor under torchao's optimizers
            lr = self.req.training.lr
            if "lr" not in self.changed and written_at is not None and not math.isclose(written_at, lr, rel_tol=1e-9):
                # an earlier checkpoint than the run's last options: theirs apply, and the user is told
                self.trainer.event(f"{Path(self.resume_from).name} was written at {option_given('lr', written_at)}; "
                                   f"the run's options since say {option_given('lr', lr)}, which applies from "
                                   f"here (give {option_given('lr', written_at)} to keep the checkpoint's)")
            if self.changed:  # in the report's events: request.json now holds only the new values
                self.trainer.event("options given anew: " + ", ".join(
                    f"{option_given(k, new)} (was {old})" for k, (old, new) in self.changed.items()),
                    show=False)  # shown already, as each option's note when the resume read them
        elif self.device == "cuda" and self.plan.sharding in ("fsdp", "fsdp-offload"):  # the estimator's, run once
            from .planner.fsdp_probe import verify_micro_batch

            planned, mb = self.plan.micro_batch, verify_micro_batch(self.trainer)
            if mb != planned:
                self.plan = replace(self.plan, micro_batch=mb, reasons=self.plan.reasons + (
                    f"probe step on every rank: micro-batch {planned} ran out of memory, {mb} runs",))
                self.trainer.plan = self.trainer.result.plan = self.plan
                log.info(f"  probe step on every rank: micro-batch {planned} -> {mb}")

    def finished_summary(self) -> RunSummary | None:
        """For a resumed run that had already finished: its summary (logged as such; nothing is
        written). None otherwise."""
        summary = self.out / "summary.json"
        if self.resume_from is None or self.trainer.step < self.trainer.total_steps or not summary.is_file():
            return None
        try:
            finished = RunSummary.from_dict(json.loads(summary.read_text()))
        except (ValueError, TypeError, KeyError, AttributeError, OSError, TightfitError) as e:
            # damaged (e.g. cut short): the run is finished again, evaluated and written anew
            log.warning(f"note: {summary} cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                        f"the run is evaluated and its results written again")
            return None
        model = self.out / "model"
        if not (model / "config.json").is_file() or not any(model.glob("*.safetensors")):
            # the checkpoint holds the weights: written again, as a summary cut short is
            log.warning(f"note: {model} lacks the trained model (config.json or its weights): the run is evaluated "
                        f"and its results written again")
            return None
        # the notes above (the checkpoint resumed from, an option given anew) said what a resume would do: undone
        given = [option_name(k) for k in self.changed]
        anew = f"; {', '.join(given)} not applied" if given else ""
        log.info(f"run {self.out} had already finished at step {self.trainer.step}: nothing left to train "
                 f"(nothing written{anew})")
        return finished

    # ---------------------------------------------------------------- from here on the run folder is written
    def interrupted(self, after_training: str) -> None:
        """After an interrupt that stopped at once: a new run with no checkpoint yet is removed
        (what it wrote and, if it made it, the folder), so that the same ``--out`` can be used
        again; otherwise say how to continue (as this face takes it: the command or the call).

        Args:
            after_training: what the run was doing if its training had ended (``"the final
                evaluation"``), for the note.
        """
        if getattr(self, "created", None) is None:
            return
        if self.finished:  # while the summary was printed: nothing is left to do
            log.warning(f"note: interrupted after the run had finished: its model, report and summary are in {self.out}")
            return
        made_folder = self.created[:1] == [self.out]
        if self._resumable(say_wait=True):
            trainer = getattr(self, "trainer", None)
            trained = trainer is not None and trainer.trained
            log.warning(f"note: {f'interrupted during {after_training}: the run is trained; ' if trained else ''}"
                        f"continue with: {self.resume_hint()}{' (it finishes the run)' if trained else ''}")
            return
        # said, or the user looks for a run that is gone
        what = str(self.out) if made_folder and not self.out.exists() else f"what it had written in {self.out}"
        log.warning(f"note: stopped before its first checkpoint: removed {what} (nothing in it could be resumed)")

    def _resumable(self, say_wait: bool = False) -> bool:
        """Whether the run stopped now has a checkpoint to resume from, once a checkpoint being
        written is in place (e.g. the end's, during the evaluation; judged before it, the folder
        would be deleted under the writer; a failed write counts as none). Where it has none, what
        this run wrote is removed (:meth:`remove_created`), so that the same command starts it
        again. ``say_wait``: say that it waits for the write."""
        from .runtime.checkpoint import has_checkpoint

        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.writing_checkpoint():
            if say_wait:  # (another Ctrl-C leaves it as it is)
                log.warning("note: waiting for the checkpoint being written")
            with contextlib.suppress(Exception):
                trainer.flush_checkpoints()
        if has_checkpoint(self.out / "checkpoints"):
            return True
        self.remove_created()
        return False

    def remove_created(self) -> None:
        """Remove what this run made in its folder, files first, then the folder if the run made it
        (nothing of a resumed run's; before :meth:`open_run_folder`, a new run's folder that the setup
        made, empty); the metrics file is closed first."""
        if getattr(self, "created", None) is None:
            return
        if self.metrics is not None:
            self.metrics.close()
        for path in reversed(self.created):  # files first, the folder last
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if self.created[:1] == [self.out]:  # the folder went: the parents made for it too, once empty
            remove_empty_folders(self.made_parents)  # never another run's: an empty one only

    def open_run_folder(self) -> None:
        """Create the run folder; write ``request.json`` (new runs, and resumed runs with changed
        options) and ``plan.json``; open ``metrics.jsonl`` (on resume: cut back to the
        checkpoint's step) with the plan record and what the trainer logged so far."""
        from .report.metrics import (PLANNED_SPEEDS, MetricsWriter, earlier_events, keep_metrics_until,
                                     session_commands)

        if not self.world.is_main:  # only rank 0 writes the run folder
            self.metrics = _Discard()
            self.trainer.log = self.metrics
            self.created = None
            return
        out, step = self.out, self.trainer.step
        made = bool(getattr(self, "created", None))  # a new run's folder, made by the setup (held since)
        self.created = []  # what interrupted() may remove: only what this run made
        # made and held by the setup already (a new run's folder) or there (a resumed run's): made
        # here only if it went in between, by this process, so another one starting into it finds it made
        made_now = bool(_claim_run_folder(out, self)[1])
        made = made or made_now
        if not made_now and self.resume_from is None:  # again under the lock: another writer may have filled it
            _check_out(out, resuming=False)
        self.created = [out] if made else []
        self.created += [out / n for n in ("request.json", "plan.json", "metrics.jsonl", "checkpoints")
                         if self.resume_from is None and not (out / n).exists()]
        if self.resume_from is None or self.changed:
            atomic_write_json(out / "request.json", {**_request_record(self.req),
                                                     "data_fingerprint": self.data_fingerprint})
        if self.resume_from is not None:  # drop the records the stopped run wrote after its checkpoint
            from .runtime.checkpoint import mark_abandoned

            notes = [] if (out / "metrics.jsonl").is_file() else [
                "metrics.jsonl was missing: the earlier sessions' losses and events are not in this run's records"]
            # the run's line is this resume's from here: later checkpoints are left behind (until this
            # run writes one, which deletes them) and the results of a finish past this step are stale
            mark_abandoned(out / "checkpoints", step)
            stale = [n for n in ("summary.json", "report.md") if (out / n).is_file()]
            for name in stale:
                (out / name).unlink()
            if stale:
                notes.append(f"{' and '.join(stale)} of an earlier finish removed: written anew when this run "
                             f"finishes (model/ is replaced then)")
            notes += _remove_run_folder_leftovers(out)
            damaged = keep_metrics_until(out / "metrics.jsonl", step)
            # the report's events are the whole run's: the earlier sessions' first, as cut back to the checkpoint
            self.trainer.result.events[:0] = earlier_events(out / "metrics.jsonl")
            # and so are its commands (the run's own, request.json's, for a first session that recorded none)
            first = self.req.run.command.removesuffix(f" (resumed as: {self.commands[-1]})")
            self.commands[:0] = session_commands(out / "metrics.jsonl", first)
            if damaged:
                notes.append(f"metrics.jsonl: {count_of(len(damaged), 'damaged line')} (not JSON) dropped: "
                             f"line{'s' if len(damaged) > 1 else ''} {', '.join(map(str, damaged[:5]))}"
                             f"{' ...' if len(damaged) > 5 else ''}")
            for note in notes:
                log.warning(f"note: {note}")
                self.trainer.event(note, show=False, session=True)
        atomic_write_json(out / "plan.json", self.plan.to_dict())
        self.metrics = MetricsWriter(out / "metrics.jsonl")
        self.metrics({"type": "plan", "step": step, "planning_seconds": self.planning_s,
                      "planned_speeds": {k: self.plan_timings[k] for k in PLANNED_SPEEDS if self.plan_timings.get(k)},
                      "resumed_from": str(self.resume_from) if self.resume_from else None,
                      "command": self.commands[-1],  # this session's, for the report of a later resume
                      **({"changed_options": self.changed} if self.changed else {}), **self.plan.to_dict()})
        for record in self.records:
            self.metrics(record)
        self.trainer.log = self.metrics

    def train(self):
        """The training loop, then the evaluation. Returns the trainer's ``TrainResult``.

        Raises:
            StoppedError: stopped early (signal, non-finite steps); the message says how to resume.
        """
        import torch

        from .runtime.checkpoint import CheckpointWriteError, clean_checkpoint_before, has_checkpoint
        from .runtime.trainer import NonFiniteTrainingError, StoppedError

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            return self.trainer.fit()
        except CheckpointWriteError as e:  # the run stops; what is in place stays, and resumes
            then = (f"continue from the newest checkpoint in place once there is room: {self.resume_command()}"
                    if has_checkpoint(e.folder) else "no earlier checkpoint is in place")
            with contextlib.suppress(OSError):  # the stop is one of the run's events; a full disk may refuse it too
                self.trainer.event(f"stopped at step {self.trainer.step}: {e}", show=False, session=True)
            raise CheckpointWriteError(f"{e}; training stopped at step {self.trainer.step}; {then}", e.folder) from None
        except KeyboardInterrupt:  # stopped at once: after the training, recorded while the metrics are open
            # the session's end is one of the run's events, as any stop's; a full disk may refuse it too
            with contextlib.suppress(OSError):
                self.trainer.event("interrupted during the final evaluation: the run is trained, stopped at once"
                                   if self.trainer.trained else  # a second Ctrl-C: in a step, an evaluation, a write
                                   f"interrupted at once after step {self.trainer.step}", show=False, session=True)
            raise
        except StoppedError as e:
            nonfinite = isinstance(e, NonFiniteTrainingError)

            def resume(target: Path) -> str:
                return self.resume_hint(target, lower_lr=nonfinite)

            said = (f"checkpoint {e.checkpoint} written; continue with: {resume(self.out)}" if e.checkpoint
                    else "no checkpoint could be written")
            text = str(e)
            if not names_flags():  # the advice's flags as TrainRequest's keywords: "e.g. lr=1e-04"
                from .loop import as_arguments

                text = as_arguments(re.sub(r"--lr(?: ([0-9][^)\s:;,]*))?", lambda m: f"lr={m.group(1)}" if m.group(1)
                                           else "lr", text))
            if not nonfinite:
                raise e.reworded(f"{text}; {said}") from None  # TrainingInterrupted keeps its signal
            if not has_checkpoint(self.out / "checkpoints"):  # the folder holds nothing to continue from
                said = (f"no checkpoint could be written, and {self.out} holds none to continue from: start again "
                        f"with another {option_name('out')}, or delete {self.out} first")
            elif e.last_update and self.req.training.checkpoint_every != 0:
                # the weights at the stop are step last_update's: only an earlier checkpoint is another start
                before = clean_checkpoint_before(self.out / "checkpoints", e.last_update)
                said += (f"; or go back to {before.name}, the last checkpoint before step {e.last_update}'s update "
                         f"(the last one applied): {resume(before)}" if before is not None else
                         f"; no checkpoint from before step {e.last_update}'s update (the last one applied) is left")
            raise NonFiniteTrainingError(f"{text}; {said}", e.step, e.checkpoint, e.last_update) from None
        finally:
            self.metrics.close()

    def resume_hint(self, target: Path | None = None, lower_lr: bool = False) -> str:
        """How to continue this run from ``target`` (the run folder by default) as this face takes
        it: the command line (:meth:`resume_command`) or the Python API's call; ``lower_lr``: with a
        lower learning rate to fill in."""
        if names_flags():
            return self.resume_command(target) + (" --lr <lower>" if lower_lr else "")
        lower = ", lr=<lower>" if lower_lr else ""
        return f"tightfit.api.train(TrainRequest(resume={str(target or self.out)!r}{lower}))"

    def resume_command(self, target: Path | None = None) -> str:
        """The command line that continues this run from ``target`` (a checkpoint, or the run
        folder: the default), with the processes it ran on."""
        from .runtime.launch import resume_processes

        return f"tightfit train --resume {shlex.quote(str(target or self.out))}{resume_processes(self.world.size)}"

    def disk_failure(self, e: BaseException) -> TightfitError | None:
        """``e``, raised while the run folder was written (``metrics.jsonl``, the model, the report;
        a checkpoint's own is a :class:`~tightfit.runtime.checkpoint.CheckpointWriteError`), as one
        line saying where the run stands and how it goes on, where it is the disk's (full, over
        quota, read-only, failing: :func:`tightfit.fileio.disk_write_error`, an ``OSError`` or the
        writers' own errors) and names no file outside the run folder; None for any other error
        (raised as it is)."""
        from .runtime.checkpoint import has_checkpoint

        why = disk_write_error(e)
        if why is None:
            return None
        # an error naming a file elsewhere (the compiler's cache, an image being read) is not the run
        # folder's; a write to an open file (metrics.jsonl) names none
        name = getattr(e, "filename", None)
        if name is not None and not os.path.abspath(os.fsdecode(name)).startswith(os.path.abspath(self.out) + os.sep):
            return None
        if not self.out.exists():  # failed while it was made: removed (open_run_folder), nothing to resume
            return TightfitError(f"the run folder {self.out} could not be written: {why}; nothing of it "
                                 "is left: make room, then run the same command again")
        then = (f"continue from the newest checkpoint in place once there is room: {self.resume_command()}"
                if has_checkpoint(self.out / "checkpoints") else "no checkpoint is in place")
        return TightfitError(f"the run folder {self.out} could not be written: {why}; the run is at step "
                             f"{self.trainer.step} of {self.trainer.total_steps}; {then}")

    def missing_sample(self, e: OSError) -> TightfitError | None:
        """``e`` as one line where it says a sample's file is gone (an image deleted or moved while
        the run trained: images are read when their batch is made) or can no longer be read (one
        rewritten: :class:`tightfit.images.ImageSamples`), with the step the run is at and how it
        goes on once the file is back as it was; None for any other error (raised as it is)."""
        if e.filename is None:
            return None
        gone = os.fsdecode(e.filename)
        if not any(gone == p for d in (self.train_data, self.eval_data) for p in getattr(d, "images", ())
                   if isinstance(p, str)):
            return None
        if e.errno == errno.ENOENT:
            what, back = "is gone (deleted or moved while the run read it)", "put it back"
        elif e.errno is None:  # ImageSamples' own: it reads but no longer decodes; resume checks the contents
            what, back = f"can no longer be read ({e.strerror or e}), changed while the run read it", \
                "restore it as it was"
        else:  # a denied permission, a failing disk, too many open files: not a changed file, raised as it is
            return None
        if self._resumable():
            then = f"{back}, then continue from the newest checkpoint: {self.resume_command()}"
        else:
            then = f"{back} and run the same command again (nothing could be resumed: the run's files were removed)"
        return TightfitError(f"{gone}: a sample of the data {what}; the run "
                             f"is at step {self.trainer.step} of {self.trainer.total_steps}; {then}")

    # ---------------------------------------------------------------- finish
    def finish(self, result) -> RunSummary:
        """Save the model and tokenizer; write the final plan (if recoveries changed it),
        ``report.md``, the plots and ``summary.json``; log the summary. Returns the summary."""
        from .report.plots import plot_run
        from .report.speed import speed_record, speed_rows
        from .report.summary import report_markdown, summary_rows

        out, health = self.out, self.trainer.health
        self._weights = self._gathered_weights()  # a collective under FSDP2: every rank takes part
        if not self.world.is_main:  # rank 0 writes the model, the report and the summary
            return RunSummary.of_run(result, self._run_info(), self._planning_seconds(), self._wall_seconds(),
                                     health.status if health else None)
        atomic_write_dir(out / "model", self._save_model)
        info = self._run_info()
        if result.plan != self.plan:
            atomic_write_json(out / "plan.json", result.plan.to_dict())
        speed = speed_record(result, self._planning_seconds(), self.plan_timings)
        atomic_write_text(out / "report.md", report_markdown(result.plan, result, info, speed))
        plot_run(out, self.trainer.memory_timeline, self.budget if self.device == "cuda" else None)
        summary = RunSummary.of_run(result, info, self._planning_seconds(), self._wall_seconds(),
                                    health.status if health else None, speed)
        atomic_write_json(out / "summary.json", summary.to_dict())
        self.finished = True
        log.info("summary:")
        for k, v in summary_rows(result, info) + speed_rows(speed):
            log.info(f"  {k:<20} {v}")
        files = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        log.info(f"run folder: {out} ({', '.join(files)})")
        return summary

    def _wall_seconds(self) -> float:
        """The whole run's wall time: this process's, plus, on resume, the earlier sessions' up to
        the checkpoint resumed (the checkpoint carries it, as it carries ``train_seconds``)."""
        return time.perf_counter() - self.t_start + self.trainer.resumed_wall_seconds

    def _planning_seconds(self) -> float:
        """The planning the run's plan took: this process's, or on resume the first run's (its
        plan record in ``metrics.jsonl``; this process only read the plan back)."""
        return self.plan_timings.get("first_planning_s", self.planning_s)

    def _save_model(self, folder: Path) -> None:
        """Write the trained weights (:meth:`_save_weights`) and the tokenizer into ``folder``."""
        self._save_weights(folder)
        self.tokenizer.save_pretrained(folder)

    def _save_weights(self, folder: Path) -> None:
        """The trained weights (safetensors, from the CPU) and ``config.json``: the model out of its
        DDP/FSDP2 wrapper, under FSDP2 the full weights gathered from the shards, LoRA merged."""
        from .levers.lora import has_adapters, merged, merged_from_state

        model = self.world.unwrap(self.trainer.model)
        if self._weights is not None and has_adapters(model):  # FSDP2 and LoRA: a plain model, merged
            # (peft's own save_pretrained would write the adapters alone, without the trained head)
            merged_from_state(model, self._weights).save_pretrained(folder, safe_serialization=True)
        elif self._weights is not None:  # FSDP2: the full weights gathered from the shards
            model.save_pretrained(folder, state_dict=self._weights, safe_serialization=True)
        else:
            merged(model.to("cpu")).save_pretrained(folder, safe_serialization=True)  # LoRA: merged

    def _gathered_weights(self) -> dict | None:
        """Under FSDP2, the full weights on the CPU (gathered from every rank: call on all); else None."""
        if not self.trainer.world.sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))

    def _run_info(self) -> RunInfo:
        """What was trained, where and how, for the report and the summary."""
        import torch

        cuda = self.device == "cuda"
        return RunInfo(
            model=self.source.location(), data=self.data.source, n_train=len(self.train_data),
            n_eval=len(self.eval_data), label_names=self.data.label_names,
            majority=self.eval_data.majority_fraction(),
            device_name=self.device_name + (f", memory capped at {format_bytes(self.budget)}" if cuda else ""),
            # the budget applied: a --budget given to a CPU run is checked, not applied (the plan's and
            # the report's "no GPU budget applies" say so too)
            budget_bytes=self.budget if cuda else None, torch=torch.__version__, version=__version__,
            command=self.req.run.command,
            commands=tuple(self.commands),
            peak_rss_bytes=None if cuda and self.plan.sharding != "fsdp-offload"  # offload: the host holds the state
            else self.trainer.peak_rss_bytes(),  # the earlier sessions' too
            **dict(zip(("max_temp_c", "max_power_w"), self.trainer.health_maxima())),  # the earlier sessions' too
            input_size=f"{size_name(self.data.SAMPLE_KIND)} {self.input_size()}", notes=tuple(self.notes))


# Options a resumed run may change: they alter neither the plan nor the data order, so the
# steps before the checkpoint stay what they were (--lr rescales the schedule from there on).
RESUME_MAY_CHANGE = ("lr", "max_skipped_steps", "log_every", "warn_temp", "cooldown_temp", "cuda_graphs")


def _same_option(key: str, saved, given, resolved: dict | None = None) -> bool:
    """Whether option ``key`` given as ``given`` (as :func:`_request_record` writes it) is the value
    ``saved`` in a run's ``request.json``, however it was spelled: a budget by its bytes, a GPU
    profile by its key, the default model by its name or by nothing, numbers by value, and an
    ``auto`` by what it resolved to (``resolved``: :func:`_resolved_options` of the run's plan)."""
    if saved == given:
        return True
    if saved == "auto" and given is not None and (resolved or {}).get(key) == given:
        return True
    if key == "model":
        from .models import DEFAULT_MODEL_NAME

        return {saved, given} <= {None, DEFAULT_MODEL_NAME}
    if key == "data" and isinstance(saved, str) and isinstance(given, str) and os.path.exists(given):
        return Path(saved).resolve() == Path(given).resolve()  # runs recorded before --data kept its links
    try:
        if key == "budget" and saved is not None and given is not None:
            from .units import parse_budget

            return parse_budget(saved) == parse_budget(given)
        if key == "gpu" and saved is not None and given is not None:
            from .devices import get_profile

            return get_profile(saved).key == get_profile(given).key
    except TightfitError:
        return False
    return False


def _resolved_options(run: Path) -> dict:
    """What the run's ``auto`` options resolved to, from its ``plan.json`` (empty where unreadable):
    ``device``, ``precision``, ``optimizer``, ``compile`` (``on``/``off``) and ``checkpointing``
    (``off``, or ``on`` where every block is: some blocks are neither)."""
    try:
        plan = json.loads((run / "plan.json").read_text())
        every_block = plan.get("checkpoint_blocks") is None and plan.get("block_policies") is None
        checkpointing = {False: "off", True: "on" if every_block else None}.get(plan.get("activation_checkpointing"))
        return {"device": plan.get("device"), "precision": plan.get("precision"), "optimizer": plan.get("optimizer"),
                "compile": {True: "on", False: "off"}.get(plan.get("compile")), "checkpointing": checkpointing}
    except (OSError, ValueError, AttributeError):
        return {}


def _request_record(req: TrainRequest) -> dict:
    """The request as written to ``request.json`` (what ``--resume`` starts from): the flat
    ``{option: value}`` dict of :meth:`TrainRequest.to_flat`, less ``progress`` and ``resume``.
    A ``--model`` folder and a ``--data`` file or folder are written as absolute paths, so that
    ``--resume`` finds them from any working directory; names (``bert-base``, ``digits``) stay.
    ``--data`` keeps its links (not resolved): a list of images given through a link names them
    relative to the link's folder, where the run read them, not to the folder of the file it points to."""
    from .images import DIGITS
    from .models import REGISTRY

    record = {k: v for k, v in req.to_flat().items() if k not in ("progress", "resume", "given")}
    for key, names in (("model", REGISTRY), ("data", (DIGITS,))):
        if record.get(key) and record[key] not in names and Path(record[key]).exists():
            path = Path(record[key])
            record[key] = str(path.absolute() if key == "data" else path.resolve())
    return record


class _Discard:
    """The metrics writer of ranks other than 0: they write nothing."""

    def __call__(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


# the beginnings of _resume_request's notes of what it did to the run folder (shown at once)
_DONE_TO_THE_FOLDER = ("put back ", "removed ")


def _resume_request(req: TrainRequest, main: bool = True) -> tuple[TrainRequest, Path, dict, str | None, list[str]]:
    """The request a run folder was started with (with the options of :data:`RESUME_MAY_CHANGE`
    given now), its newest intact checkpoint, ``{option: [old, new]}`` for what changed, the
    fingerprint of the data it started with (None for runs that recorded none), and the notes of
    what the resume found and did in the folder (a corrupt checkpoint skipped, one put back,
    leftovers removed: shown, and events of the resumed run). A run started with
    both ``--full`` and ``--train-samples`` (before the pair was refused) goes on with ``--train-samples``,
    which is what it trained on.
    A newer corrupt checkpoint is skipped with a note (checkpoints are verified against their
    checksums here, before anything is written, about 1 to 2 s per GB); temporary folders of a
    killed checkpoint write are then removed.

    Raises:
        TightfitError: not a tightfit run folder, or no intact checkpoint in it.
    """
    from .runtime.checkpoint import (checkpoint_step, has_checkpoint, latest_intact_checkpoint, list_checkpoints,
                                      remove_stale_temporaries, restore_displaced, resume_point, resume_target)

    run, chosen = resume_target(req.run.resume)
    if not Path(req.run.resume).exists():
        raise TightfitError(f"{option_given('resume', req.run.resume)}: does not exist")
    if Path(req.run.resume).name == "checkpoints" and (run.parent / "request.json").is_file():
        newest = list_checkpoints(run)
        raise TightfitError(f"{option_given('resume', req.run.resume)} is the run's checkpoints folder: give the run "
                            f"folder {run.parent} (its newest intact checkpoint)"
                            + (f" or one checkpoint, e.g. {newest[-1]}" if newest else ""))
    if not (run / "request.json").is_file():
        raise TightfitError(f"{option_given('resume', str(run))}: not a tightfit run folder (no request.json)")
    if not has_checkpoint(run / "checkpoints"):
        raise TightfitError(f"{option_given('resume', str(run))}: no checkpoint to resume from (the run stopped "
                            f"before its first); start it again: delete {run} or choose another {option_name('out')}")
    # the flags on the command line, or the keywords of TrainRequest: both recorded in run.given,
    # so a value given equal to its default counts, on either face, as a value given
    now = req.to_flat()
    given = {k: v for k, v in now.items() if k not in ("resume", "progress", "command", "given")
             and k in req.run.given}
    try:
        saved = saved_options(json.loads((run / "request.json").read_text()))
        fingerprint = saved.pop("data_fingerprint", None)
    except (ValueError, TypeError, AttributeError, OSError) as e:  # e.g. a list, not an object
        raise TightfitError(f"{option_given('resume', str(run))}: unreadable request.json ({e})") from None
    # An option the run was started with may be repeated; a new value of one the resumed run cannot
    # change is refused (ignored, an asked-for change such as more epochs would never happen).
    recorded = _request_record(req)  # the given values as request.json holds them (absolute paths)
    resolved = _resolved_options(run)  # repeating what an `auto` became is repeating the run's own
    # data moved since: its new place may be given (the fingerprint check then wants the same samples)
    gone = isinstance(saved.get("data"), str) and Path(saved["data"]).is_absolute() and not Path(saved["data"]).exists()
    if gone and ("data" not in given or fingerprint is None):  # a run that recorded none cannot check new data
        where = (f"or give its new place with {option_name('data')} (the same data: checked against the run's)"
                 if fingerprint is not None else "(the run recorded no fingerprint to check other data against)")
        raise TightfitError(f"{option_given('resume', str(run))}: the run's data {saved['data']} is gone (moved or "
                            f"deleted): put it back {where}")
    may_change = RESUME_MAY_CHANGE + (("data",) if gone else ())
    refused = [option_name(k) for k, v in given.items() if k not in may_change and k != "out"
               and not _same_option(k, saved.get(k), recorded.get(k, v), resolved)]
    if "out" in given and Path(now["out"]).resolve() != run.resolve():
        refused.append(option_name("out"))
    if refused:
        raise TightfitError(f"{option_given('resume', str(run))} continues the run with the options it was started with "
                            f"({run / 'request.json'}); it cannot change {', '.join(refused)} (a resumed run may "
                            f"change only {', '.join(option_name(k) for k in RESUME_MAY_CHANGE)}): leave "
                            f"{'it' if len(refused) == 1 else 'them'} out, or start a new run")
    try:
        given = {**given, **({"data": recorded["data"]} if "data" in given else {})}  # the new place, absolute
        changed = {k: [saved.get(k), v] for k, v in given.items() if k in may_change and saved.get(k) != v}
        command = saved.get("command", req.run.command)  # the run's own command,
        if changed:  # and the resume that changed its options: both make the run (--lr 1e-3, then 1e-4)
            command = f"{command} (resumed as: {req.run.command})"
        resumed = TrainRequest(**{**saved, **{k: new for k, (_, new) in changed.items()}, "out": str(run),
                                  "resume": str(run), "progress": req.run.progress, "command": command})
    except (json.JSONDecodeError, TypeError) as e:
        raise TightfitError(f"{option_given('resume', str(run))}: unreadable request.json ({e})") from None
    except TightfitError as e:  # the options were checked when given: a value of the file is at fault
        raise TightfitError(f"{option_given('resume', str(run))}: {run / 'request.json'} holds a value tightfit "
                            f"cannot take (edited by hand?): {e}") from None
    resumed.workload.check_columns()  # with the run's own --data, now known
    done = [f"put back {name}, displaced by a checkpoint write that was cut short"
            for name in (restore_displaced(run / "checkpoints") if main else ())]  # rank 0 writes the folder
    for note in done:  # done to the folder: said now, whatever a later check decides
        log.warning(f"note: {note}")
    notes = list(done)
    try:
        point = resume_point(chosen) if chosen else latest_intact_checkpoint(run / "checkpoints")
    except TightfitError as e:
        raise type(e)(f"{option_given('resume', req.run.resume)}: {e}") from None
    later = [p.name for p in list_checkpoints(run / "checkpoints")
             if chosen and checkpoint_step(p) > checkpoint_step(chosen)]
    if later:
        notes.append(f"resuming from {chosen.name}: the later {', '.join(later)} {'is' if len(later) == 1 else 'are'} "
                     f"deleted at the resumed run's first checkpoint")  # read in the final report too: no future tense
    notes += point.notes
    removed = [f"removed {name} ({format_bytes(size)}), left by a checkpoint write that was cut short"
               for name, size in (remove_stale_temporaries(run / "checkpoints") if main else ())]  # rank 0 cleans up
    for note in removed:
        log.warning(f"note: {note}")
    return resumed, point.path, changed, fingerprint, notes + removed


# What tightfit writes atomically into a run folder (tightfit.fileio: ``.NAME.<random>.tmp`` while written)
_RUN_FILES = ("request.json", "plan.json", "summary.json", "report.md", "metrics.jsonl", "model", "memory.png",
              "loss.png")
_RUN_TEMPORARY = re.compile(r"^\.(?:" + "|".join(map(re.escape, _RUN_FILES)) + r")\.[^/]+\.tmp$")


def _remove_run_folder_leftovers(out: Path) -> list[str]:
    """Remove the temporary files and folders (``.NAME.<random>.tmp`` of the files in
    :data:`_RUN_FILES`, :mod:`tightfit.fileio`) that a write into run folder ``out`` cut short left
    there (nothing else); one note each."""
    notes = []
    for p in sorted(q for q in out.iterdir() if _RUN_TEMPORARY.match(q.name)):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        notes.append(f"removed {p.name}, left by a write that was cut short")
    return notes


def enclosing_run_folder(path: Path) -> Path | None:
    """The run folder (``request.json`` and ``plan.json``) that ``path`` lies inside, the nearest
    of its parents (resolved), or None. A run writes, replaces and prunes inside its folder, so
    neither a run's ``--out`` nor an export's goes there."""
    return next((p for p in Path(path).resolve().parents
                 if (p / "request.json").is_file() and (p / "plan.json").is_file()), None)


def _check_out(out: Path, resuming: bool) -> None:
    """The run folder must be new or empty (or the run being resumed), and creatable.

    Raises:
        TightfitError: it is a file or a link to nothing, holds another run, lies inside another
            run's folder, or cannot be created.
    """
    from .runtime.checkpoint import has_checkpoint

    if out.exists() and not out.is_dir():
        raise TightfitError(f"{option_given('out', str(out))} is a file, not a folder")
    if out.is_symlink() and not out.exists():  # mkdir would fail on the link itself, after planning
        try:
            os.stat(out)  # raises: the link leads nowhere
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise TightfitError(f"{option_given('out', str(out))} is a link in a loop of links "
                                    f"({os.readlink(out)}): choose another {option_name('out')}") from None
        raise TightfitError(f"{option_given('out', str(out))} is a link to nothing ({os.readlink(out)}): make its "
                            f"target folder first, or choose another {option_name('out')}")
    if not resuming:  # a run writes, replaces and prunes inside its folder: another run's place is not there
        inside = enclosing_run_folder(out)
        if inside is not None:
            raise TightfitError(f"{option_given('out', str(out))} is inside the run folder {inside}, which would "
                                f"replace or delete it: choose a folder outside it")
    if not resuming and out.exists() and any(out.iterdir()):
        if (out / "request.json").is_file() and not has_checkpoint(out / "checkpoints") and \
                not (out / "summary.json").exists():  # e.g. a process killed before its first checkpoint
            raise TightfitError(f"output folder {out} holds a run that stopped before its first checkpoint (nothing "
                                f"to resume): delete it or choose another {option_name('out')}")
        raise TightfitError(f"output folder {out} exists and is not empty; choose another {option_name('out')}")
    blocked = unwritable_folder(out)
    if blocked is not None:
        raise TightfitError(f"cannot create the run folder {out}: {blocked} is not a writable folder")
