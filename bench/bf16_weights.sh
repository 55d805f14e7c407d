#!/usr/bin/env bash
# adamw8bit-bf16 (bf16 weights, torchao's 8-bit AdamW with stochastic rounding) on one GPU:
#   1. its GPU tests (tests/test_bf16_weights.py -m gpu: CUDA state bytes = the estimator's, the
#      probe's fp32 weights restored bit for bit, exact resume);
#   2. BERT-large, sequence length 128, effective batch 256, 4 GiB: plan (printed) and 12,800
#      samples of training (summary with samples/s);
#   3. the main job (MiniLM on Rotten Tomatoes, --full, 4 GiB) with --optimizer adamw8bit-bf16 and
#      with --optimizer adamw: held-out accuracy of each.
# Usage (repo root, CUDA, torchao importable): OUT=folder bench/bf16_weights.sh   (about 5 min on an H200)
# The shipped model/data may be given as files: TIGHTFIT_DEFAULT_MODEL=folder TIGHTFIT_DEFAULT_DATA=csv.bz2
# Writes OUT/pytest-gpu.log, OUT/bert-large.log, OUT/bert-large-summary.json, OUT/main-<optimizer>.log,
# OUT/results.md (one row per run, and each part's seconds).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
RUNS=$(mktemp -d)
mkdir -p "$OUT"
python3 - > "$OUT/results.md" <<'PY'
import importlib.metadata as md
import importlib.util

import torch

v = lambda p: md.version(p) if importlib.util.find_spec(p) else "missing"
print(f"torch {torch.__version__}, torchao {v('torchao')}, "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}\n")
print("| run | options | held-out accuracy | samples/s | peak reserved | plan | seconds |")
print("|---|---|---|---|---|---|---|")
PY

row() {  # row NAME OPTS RUN_FOLDER SECONDS
  python3 - "$@" >> "$OUT/results.md" <<'PY'
import json, sys
from pathlib import Path
name, opts, run, secs = sys.argv[1:]
try:
    s = json.loads((Path(run) / "summary.json").read_text())
    p = s.get("plan") or {}
    print(f"| {name} | `{opts}` | {s['accuracy']:.4f} | {s['samples_per_s']:.0f} | "
          f"{(s['peak_reserved_bytes'] or 0) / 2**30:.2f} GiB | {p.get('optimizer')}, {p.get('precision')}, "
          f"micro-batch {p.get('micro_batch')} x {p.get('accumulation_steps')} | {secs} |")
except Exception as e:
    print(f"| {name} | `{opts}` | failed: {e!r} | | | | {secs} |")
PY
}

t0=$SECONDS
python3 -m pytest -q -m gpu tests/test_bf16_weights.py > "$OUT/pytest-gpu.log" 2>&1
echo "| GPU tests | \`pytest -m gpu tests/test_bf16_weights.py\` | $(tail -1 "$OUT/pytest-gpu.log") | | | | $((SECONDS - t0)) |" \
  >> "$OUT/results.md"

t0=$SECONDS
opts="--model bert-large --seq-len 128 --budget 4GiB --batch-size 256 --eval-samples 256 --epochs 1 --log-every 1 \
--replan --no-progress --compile off --train-samples 12800 --optimizer adamw8bit-bf16"
python3 -m tightfit train $opts --out "$RUNS/bert-large" > "$OUT/bert-large.log" 2>&1
cp "$RUNS/bert-large/summary.json" "$OUT/bert-large-summary.json" 2>/dev/null
row bert-large "$opts" "$RUNS/bert-large" $((SECONDS - t0))

for optimizer in adamw8bit-bf16 adamw; do
  t0=$SECONDS
  opts="--full --budget 4GiB --optimizer $optimizer --no-progress"
  python3 -m tightfit train $opts --out "$RUNS/main-$optimizer" > "$OUT/main-$optimizer.log" 2>&1
  row "main job" "$opts" "$RUNS/main-$optimizer" $((SECONDS - t0))
done
cat "$OUT/results.md"
