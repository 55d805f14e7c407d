#!/usr/bin/env bash
# Where the run's time goes, and delivered against predicted samples/s, on a CUDA GPU:
# the main job (`tightfit train --full --budget 4GiB`) twice with an empty plan cache (the second
# run must take its plan from the cache), then BERT-base, seq 128, effective batch 256 at 4 GiB
# (compiled: --compile on, so that the compiled path and its warm-up lengths are measured),
# each instrumented by bench/speed_profile.py (CUDA events, host syncs, PyTorch profiler).
# Usage (repository root): OUT=folder bench/gpu_speed.sh
# Needs TIGHTFIT_DEFAULT_MODEL / TIGHTFIT_DEFAULT_DATA where the shipped files are not in the tree.
# Writes OUT/{main-1,main-2,bert-base-128}.json, OUT/{main-1,bert-base-128}-profile.txt,
# OUT/speed.md (the table), OUT/speed.log.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/speed}
mkdir -p "$OUT"
export TIGHTFIT_CACHE_DIR=$(mktemp -d /tmp/tightfit-cache.XXXX)  # empty: the first run plans
RUNS=$(mktemp -d /tmp/tightfit-runs.XXXX)
log="$OUT/speed.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git log -1 --format='tightfit commit %H' 2>/dev/null
} > "$log" 2>&1
for i in 1 2; do
  timeout 150 python3 bench/speed_profile.py run main-$i "$OUT" -- --full --budget 4GiB --out "$RUNS/main-$i" \
      --no-progress >> "$log" 2>&1
  echo "main-$i exit $?" >> "$log"
done
rm -f "$OUT/main-2-profile.txt"  # the same steps as main-1's; keeps the file count down
python3 bench/make_bert_base.py /tmp/bert-base "${TIGHTFIT_DEFAULT_MODEL:-}" >> "$log" 2>&1
timeout 150 python3 bench/speed_profile.py run bert-base-128 "$OUT" -- --model /tmp/bert-base --seq-len 128 \
    --batch-size 256 --budget 4GiB --compile on --epochs 3 --checkpoint-every 30 --train-samples 8192 \
    --out "$RUNS/bert-base-128" --no-progress >> "$log" 2>&1
echo "bert-base-128 exit $?" >> "$log"
python3 bench/speed_profile.py report "$OUT" >> "$log" 2>&1
grep -E "planning took|why: (plan from|torch.compile|compiled for)|samples/s|time:" "$log" | head -40
cat "$OUT/speed.md"
