"""Where a training loop's time goes, from a py-spy recording of ``tightfit train``.

    py-spy record -r 200 --idle --threads -f raw -o idle.txt -- python3 -m tightfit train ...
    py-spy record -r 200 --gil --threads -f raw -o gil.txt -- python3 -m tightfit train ...
    python bench/spy_summary.py idle.txt gil.txt > spy.md

``--idle`` keeps the samples where a thread waits (for the GPU, a lock, the autograd engine),
so its shares are of wall time; ``--gil`` keeps only the samples where a thread holds the GIL,
so its shares are of Python-side host time. For each file: the samples per thread, then, among
the main thread's samples inside ``Trainer._train_loop``, the shares by innermost frame and by
innermost tightfit frame (the step's own code or the trainer's bookkeeping).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

LOOP = "Trainer._train_loop"


def read(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format: ``frame;frame;...;frame count`` per line, outermost first."""
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            rows.append((stack.split(";"), int(n)))
    return rows


def table(title: str, counts: collections.Counter, total: int, most: int = 15) -> list[str]:
    lines = [f"| {title} | share |", "|---|---|"]
    lines += [f"| `{k}` | {100 * v / total:.1f}% |" for k, v in counts.most_common(most)]
    return lines + [""]


def summary(path: str, rate_hz: float = 200.0) -> list[str]:
    rows = read(path)
    threads = collections.Counter()
    for stack, n in rows:
        threads[stack[0]] += n
    loop = [(s, n) for s, n in rows if any(LOOP in f for f in s)]
    total = sum(n for _, n in loop)
    leaf, own = collections.Counter(), collections.Counter()
    for stack, n in loop:
        leaf[stack[-1]] += n
        ours = [f for f in stack if "tightfit/" in f]
        own[ours[-1] if ours else "?"] += n
    out = [f"## `{Path(path).name}`", "", "| thread | samples | seconds at the rate |", "|---|---|---|"]
    out += [f"| {k} | {v} | {v / rate_hz:.1f} |" for k, v in threads.most_common(6)]
    out += ["", f"Main thread inside `{LOOP}`: {total} samples ({total / rate_hz:.1f} s).", ""]
    return out + table("innermost frame", leaf, total) + table("innermost tightfit frame", own, total)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("\n".join(summary(p)))
