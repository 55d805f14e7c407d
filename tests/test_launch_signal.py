"""`tightfit train --gpus N` stopped by Ctrl-C or SIGTERM: torch.distributed.run passes the signal
on to the processes (they checkpoint and print the --resume command) and raises SignalException
in the launcher, which must end with 128 plus the signal's number (130 for Ctrl-C, 143 for SIGTERM)
like a one-process run, not a traceback."""

import signal

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException

from tightfit.runtime.launch import launch


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_ends_it_with_128_plus_the_signals_number(monkeypatch, sig):
    started = []

    def fake_run(args):  # what torch.distributed.run does after the processes stopped on the signal
        started.append(args.nproc_per_node)
        raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)

    monkeypatch.setattr(torchrun, "run", fake_run)
    assert launch(2, "cpu", ["train", "--device", "cpu", "--gpus", "2"]) == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig]
    assert started == ["2"]  # it did start the processes


def test_the_resume_command_of_a_multi_process_run_keeps_its_processes(monkeypatch):
    """Only the same number of processes continues exactly (docs/distributed.md)."""
    from tightfit.runtime.launch import resume_processes

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resume_processes(1) == ""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_processes(2) == " --gpus 2"
    assert "torchrun" in resume_processes(8) and "8 processes" in resume_processes(8)  # 2 machines x 4


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_interrupted_multi_process_run_says_how_to_resume_once(monkeypatch, capsys, rank):
    import tightfit.cli as cli
    from tightfit.runtime.trainer import TrainingInterrupted

    def stopped(args):
        raise TrainingInterrupted("SIGINT: stopped after step 3 of 9; continue with: tightfit train --resume r --gpus 2",
                                  3, "r/checkpoints/ckpt-3")

    monkeypatch.setattr(cli, "_run", stopped)
    monkeypatch.setenv("RANK", rank)
    assert cli.main(["train", "--device", "cpu"]) == 130
    assert ("continue with" in capsys.readouterr().err) == (rank == "0")


def test_bad_options_with_gpus_are_one_line_before_any_process_starts(monkeypatch, capsys, tmp_path):
    import tightfit.cli as cli

    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cli.main(["train", "--gpus", "2", "--device", "cpu", "--lr", "-1", "--out", str(tmp_path / "run")]) == 2
    out = capsys.readouterr()
    assert started == [] and "starting" not in out.out
    assert out.err.count("\n") == 1 and "--lr" in out.err
    assert not (tmp_path / "run").exists()


def test_a_run_stopped_by_sigterm_exits_143_and_by_ctrl_c_130(monkeypatch, capsys):
    """The exit code says which signal stopped the run (128 plus its number), as a shell reports a
    process it ended: a scheduler's SIGTERM (preemption, `timeout`) read 130, Ctrl-C's code. In the
    training loop (the stop at a step boundary) and outside it (loading, planning, evaluating)."""
    import os

    import tightfit.cli as cli
    from tightfit.runtime.trainer import TrainingInterrupted

    for name, code in (("SIGINT", 130), ("SIGTERM", 143)):
        def stopped(args, name=name):
            raise TrainingInterrupted(f"{name}: stopped after step 3 of 9", 3, None, name)

        monkeypatch.setattr(cli, "_run", stopped)
        assert cli.main(["train", "--device", "cpu"]) == code
    monkeypatch.setattr(cli, "_run", lambda args: os.kill(os.getpid(), signal.SIGTERM))
    assert cli.main(["train", "--device", "cpu"]) == 143
    assert "terminated (SIGTERM)" in capsys.readouterr().err


def test_the_launcher_reports_bad_input_then_sigterm_then_ctrl_c_whichever_rank_failed_first(monkeypatch):
    """A SIGTERM that reached one rank stops the others on its stop vote, and they know no signal
    (130): the launcher's code is 143 whichever rank torchrun saw fail first; bad input (2) first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def fails_with(*codes):
        def fake_run(args):
            raise ChildFailedError("tightfit", {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c,
                                                                  error_file="/nonexistent")
                                                for r, c in enumerate(codes)})
        monkeypatch.setattr(torchrun, "run", fake_run)
        return launch(2, "cpu", ["train", "--device", "cpu", "--gpus", "2"])

    assert fails_with(130, 143) == 143 and fails_with(143, 130) == 143
    assert fails_with(130, 130) == 130 and fails_with(143, 2) == 2 and fails_with(1, 1) == 1


def test_a_sigterm_the_process_was_started_ignoring_stays_ignored(monkeypatch):
    """The command stops on SIGTERM as on Ctrl-C, unless whoever started it ignored SIGTERM
    (``SIG_IGN`` is inherited): then it stays ignored, as Python leaves an ignored SIGINT."""
    import tightfit.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_run", lambda args: seen.append(signal.getsignal(signal.SIGTERM)) or 0)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert cli.main(["doctor"]) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert cli.main(["doctor"]) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIG_IGN, cli._interrupt]


def test_the_launcher_leaves_the_processes_time_for_their_stop_checkpoint(monkeypatch):
    """Found by a review: torch.distributed.run kills the processes (SIGKILL) 30 s after passing a
    signal on, by default; a step plus the stop checkpoint that took longer (a long accumulation
    window, a large model) left no stop checkpoint and no resume command, unlike one process, which
    waits for its stop as long as it takes. A timeout set in the environment is kept."""
    got = []

    def fake_run(args):
        got.append(args)

    if not any("--shutdown-timeout" in a.option_strings for a in torchrun.get_args_parser()._actions):
        pytest.skip("this torch.distributed.run has no --shutdown-timeout")
    monkeypatch.setattr(torchrun, "run", fake_run)
    for k in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    assert launch(2, "cpu", ["train", "--device", "cpu"]) == 0
    assert got[-1].shutdown_timeout is not None and got[-1].shutdown_timeout >= 600
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert launch(2, "cpu", ["train", "--device", "cpu"]) == 0
    assert got[-1].shutdown_timeout in (None, 45)  # torch's launcher reads the environment itself


@pytest.mark.parametrize("rank, said", [("0", True), ("1", False)])
def test_an_interrupt_before_training_is_said_once_for_the_run(monkeypatch, capsys, rank, said):
    """Ctrl-C while loading reaches every process of --gpus N: each printed "tightfit: interrupted";
    rank 0 alone says so, as it does for a stop in the loop."""
    import tightfit.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli, "_run", interrupted)
    assert cli.main(["plan"]) == 130
    assert ("tightfit: interrupted" in capsys.readouterr().err) == said


def test_a_store_that_cannot_be_reached_is_not_said_as_a_lost_peer(monkeypatch):
    """Every DistNetworkError was taken for a peer's exit: a process of several machines whose
    rendezvous store timed out (or whose port was in use) said only "another process of the run
    ended first", though none had, and its own error was not shown."""
    import torch.distributed as dist

    from tightfit.runtime.distributed import lost_a_peer

    monkeypatch.setenv("WORLD_SIZE", "2")
    timed_out = dist.DistNetworkError("The client socket has timed out after 2000ms while trying to connect to "
                                      "(10.0.0.1, 29500).")
    assert not lost_a_peer(timed_out)
    assert lost_a_peer(dist.DistNetworkError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1"))
    assert lost_a_peer(RuntimeError("Connection reset by peer"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not lost_a_peer(RuntimeError("Connection reset by peer"))
