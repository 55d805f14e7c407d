#!/usr/bin/env bash
# Accuracy cost of the optimizer levers and of LoRA on the main job (MiniLM on Rotten Tomatoes, all
# training reviews, 3 epochs, 4 GiB budget): fused AdamW (fp32 state), 8-bit AdamW state, LoRA.
# Usage (repo root, CUDA, torchao + peft importable): OUT=folder bench/optimizer_accuracy.sh
# The shipped model/data may be given as files: TIGHTFIT_DEFAULT_MODEL=folder TIGHTFIT_DEFAULT_DATA=csv.bz2
# Writes OUT/accuracy.md (one row per run) and OUT/accuracy-<name>.log; about 1-2 min per run on an H200.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
RUNS=$(mktemp -d)
mkdir -p "$OUT"
echo "| run | options | held-out accuracy | samples/s | peak reserved | trainable |" > "$OUT/accuracy.md"
echo "|---|---|---|---|---|---|" >> "$OUT/accuracy.md"
for spec in "adamw:--optimizer adamw" "adamw8bit:--optimizer adamw8bit" "lora:--optimizer adamw --trainable lora --lr 5e-4"; do
  name=${spec%%:*}; opts=${spec#*:}
  python3 -m tightfit train --full --budget 4GiB --compile off $opts --out "$RUNS/$name" --no-progress \
    > "$OUT/accuracy-$name.log" 2>&1
  python3 - "$RUNS/$name" "$name" "$opts" >> "$OUT/accuracy.md" <<'PY'
import json, sys
from pathlib import Path
run, name, opts = sys.argv[1:]
try:
    s = json.loads((Path(run) / "summary.json").read_text())
    p = s.get("plan") or {}
    print(f"| {name} | `{opts}` | {s['accuracy']:.4f} | {s['samples_per_s']:.0f} | "
          f"{(s['peak_reserved_bytes'] or 0) / 2**30:.2f} GiB | {p.get('trainable_params', '')} ({p.get('optimizer')}) |")
except Exception as e:
    print(f"| {name} | `{opts}` | failed: {e!r} | | | |")
PY
done
cat "$OUT/accuracy.md"
