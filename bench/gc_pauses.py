"""The garbage collector's pauses in a run (issue 12: whole run against steady).

    python3 bench/gc_pauses.py OUTFILE.json [tightfit train options]

Trains through the Python API (the command line's recipe) with a ``gc.callbacks`` hook that times
every collection, and prints, per generation, how many ran and how long they took, separately for
the training loop (``Trainer._train_loop``) and the rest of the process: does a full collection,
which traverses every tracked object (467k in the main job), pause the loop?
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(out: Path, argv: list[str]) -> None:
    from tightfit import api
    from tightfit.cli import _parser
    from tightfit.config import TrainRequest
    from tightfit.runtime import trainer

    events, started, where = [], {}, {"loop": False}

    def timed(phase, info):
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        else:
            events.append({"generation": info["generation"], "in_loop": where["loop"],
                           "seconds": time.perf_counter() - started.pop(info["generation"], time.perf_counter())})

    loop = trainer.Trainer._train_loop

    def marked_loop(self, *a, **k):
        where["loop"] = True
        try:
            return loop(self, *a, **k)
        finally:
            where["loop"] = False

    trainer.Trainer._train_loop = marked_loop
    gc.callbacks.append(timed)
    req = TrainRequest.from_args(_parser().parse_args(["train", *argv]))
    summary = api.train(req)
    gc.callbacks.remove(timed)
    rows = {}
    for e in events:
        r = rows.setdefault(f"{'loop' if e['in_loop'] else 'outside'} gen{e['generation']}", [0, 0.0, 0.0])
        r[0], r[1], r[2] = r[0] + 1, r[1] + e["seconds"], max(r[2], e["seconds"])
    result = {"argv": argv, "train_seconds": summary.train_seconds,
              "tracked_objects_at_end": len(gc.get_objects()),
              "collections": {k: {"count": n, "total_s": t, "max_s": m} for k, (n, t, m) in sorted(rows.items())}}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"training {summary.train_seconds:.2f} s")
    for k, (n, t, m) in sorted(rows.items()):
        print(f"  {k}: {n} collections, {t * 1e3:.1f} ms in all, longest {m * 1e3:.1f} ms")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
