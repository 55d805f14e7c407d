"""The planner's one bisection: the boundary of a predicate that flips once."""

from __future__ import annotations

from collections.abc import Callable


def bisect(good: int, bad: int, ok: Callable[[int], bool]) -> int:
    """The last value, going from ``good`` toward ``bad``, at which ``ok`` holds.

    ``ok`` is taken to hold at ``good`` and to fail at ``bad`` (neither is evaluated) and to flip
    once between them. ``good`` may lie on either side of ``bad``, so one loop answers both
    questions the planner asks:

    - the largest value that fits: ``bisect(known_fit, first_known_miss, fits)``;
    - the smallest value that fits: ``bisect(known_fit, last_known_miss, fits)`` with
      ``last_known_miss < known_fit``.

    Midpoints are rounded toward ``good`` (each evaluation of ``ok`` may be an exact trace or a
    probe step on the GPU: the order is part of what a caller can rely on).

    Args:
        good, bad: integers (micro-batches, block counts, list indices).
        ok: the predicate, evaluated only strictly between ``good`` and ``bad``.

    Returns:
        ``good`` itself if no value between the two satisfies ``ok``.
    """
    while abs(bad - good) > 1:
        half = (abs(bad - good)) // 2
        mid = good + half if bad > good else good - half
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def gallop(good: int, bad: int, ok: Callable[[int], bool]) -> int:
    """:func:`bisect`'s answer, found by steps of 1, 2, 4, ... from ``good`` toward ``bad`` until
    ``ok`` fails (or ``bad`` is reached), then by bisection of the last step: ``2 log2(d) + 1``
    evaluations or fewer for a boundary ``d`` steps from ``good``, against ``log2(|bad - good|)``.
    For a boundary expected near ``good``: the fewest blocks a compiled step needs at 4 GiB lie a
    block or two under the most (BERT-large, NVIDIA H200: 23 and 21 of 24, where bisection from
    all 24 probed 5 and 4 counts that did not fit; bench/results/plan-breakdown).

    Args: as :func:`bisect` (``ok`` evaluated only strictly between ``good`` and ``bad``).
    """
    direction, step = (1 if bad > good else -1), 1
    while abs(bad - good) > 1:
        probe = good + direction * min(step, abs(bad - good) - 1)
        if not ok(probe):
            return bisect(good, probe, ok)
        good, step = probe, step * 2
    return good
