#!/usr/bin/env bash
# Accuracy cost of the optimizer levers and of LoRA on the main job (MiniLM on Rotten Tomatoes, all
# training reviews, 3 epochs, 4 GiB budget): fused AdamW (fp32 state), 8-bit AdamW state, LoRA.
# Usage (repo root, CUDA, torchao + peft importable): OUT=folder bench/optimizer_accuracy.sh
# The shipped model/data may be given as files: TIGHTFIT_DEFAULT_MODEL=folder TIGHTFIT_DEFAULT_DATA=csv.bz2
# Writes OUT/accuracy.md (one row per run) and OUT/accuracy-<name>.log; about 1-2 min per run on an H200.
# BASE replaces the options every run shares (default: the GPU job); on a CPU: BASE="--device cpu"
# trains the CPU job (2,000 reviews x 3 epochs, fp32), about 4 min per run on 2 cores.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
BASE=${BASE:---full --budget 4GiB --compile off}
RUNS=$(mktemp -d)
mkdir -p "$OUT"
echo "command: BASE=\"$BASE\" OUT=$OUT bench/optimizer_accuracy.sh; code $(git rev-parse --short HEAD); $(python3 -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")')" > "$OUT/accuracy.md"
echo >> "$OUT/accuracy.md"
echo "| run | options | held-out accuracy | samples/s | peak reserved | trainable |" >> "$OUT/accuracy.md"
echo "|---|---|---|---|---|---|" >> "$OUT/accuracy.md"
# SPECS: "name:options" per run (the bf16-weights lever needs a CUDA GPU: leave it out on a CPU)
SPECS=${SPECS:-"adamw:--optimizer adamw|adamw8bit:--optimizer adamw8bit|adamw8bit-bf16:--optimizer adamw8bit-bf16|lora:--optimizer adamw --trainable lora --lr 5e-4"}
IFS='|' read -ra SPEC_LIST <<< "$SPECS"
for spec in "${SPEC_LIST[@]}"; do
  name=${spec%%:*}; opts=${spec#*:}
  python3 -m tightfit train $BASE $opts --out "$RUNS/$name" --no-progress \
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
