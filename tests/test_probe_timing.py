"""What a probe's step time holds: the GPU's work, as the run's steady state sees it, not the
collation of its worst-case batch (the run's prefetcher collates in the background)."""

import time

from conftest import SyntheticBatches, tiny_bert
from tightfit.planner.probe import run_probe_steps
from tightfit.workload import Workload

COLLATION_S = 0.25


class SlowWorstCase(SyntheticBatches):
    """Synthetic text whose worst-case batch takes ``COLLATION_S`` to collate (a heavy image
    pipeline's 77 MB micro-batch, in kind); counts the collations."""

    calls = 0

    def worst_case(self, n):
        type(self).calls += 1
        time.sleep(COLLATION_S)
        return super().worst_case(n)


def test_a_probe_step_time_holds_no_collation_of_its_batches():
    """Two micro-batches per timed step (accumulation), three timed steps: the worst case is
    collated once, before the timing. Red when each micro-batch is collated inside the step
    (six collations)."""
    SlowWorstCase.calls = 0
    w = Workload(tiny_bert(dropout=0.1), SlowWorstCase(16, seq_len=16), None, 8)
    seconds, micro_batches = run_probe_steps(w, 4, "fp32", "adamw", timed_steps=3)
    assert micro_batches == 2 and seconds > 0
    # counted, not timed: a wall-clock bound (a step under 0.25 s) failed on a loaded 2-core CI host
    assert SlowWorstCase.calls == 1, f"{SlowWorstCase.calls} collations: the timed steps collated their batches"
