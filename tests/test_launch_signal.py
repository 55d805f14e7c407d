"""`tightfit train --gpus N` stopped by Ctrl-C or SIGTERM: torch.distributed.run passes the signal
on to the processes (they checkpoint and print the --resume command) and raises SignalException
in the launcher, which must end with exit code 130 like a one-process run, not a traceback."""

import signal

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException

from tightfit.runtime.launch import launch


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_ends_it_with_exit_code_130(monkeypatch, sig):
    started = []

    def fake_run(args):  # what torch.distributed.run does after the processes stopped on the signal
        started.append(args.nproc_per_node)
        raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)

    monkeypatch.setattr(torchrun, "run", fake_run)
    assert launch(2, "cpu", ["train", "--device", "cpu", "--gpus", "2"]) == 130
    assert started == ["2"]  # it did start the processes
