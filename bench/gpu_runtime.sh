#!/usr/bin/env bash
# GPU checks of the runtime: the GPU tests, the prefetch idle-time benchmark, and BERT-base
# (seq 128, effective batch 32) planned for a GTX 1650 Ti and a GTX 1080 Ti profile.
# Usage (repository root, CUDA GPU): OUT=folder bench/gpu_runtime.sh
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/gpu-runtime}
mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log"
python3 bench/prefetch_idle.py "$OUT/prefetch.json" 2>&1 | tail -n 12
python3 bench/make_bert_base.py /tmp/bert-base "${TIGHTFIT_DEFAULT_MODEL:-}"
for gpu in gtx-1650-ti gtx-1080-ti; do
  python3 -m tightfit train --model /tmp/bert-base --gpu $gpu --seq-len 128 --max-steps 60 \
      --checkpoint-every 0 --out "/tmp/runs/bert-base-$gpu" --no-progress 2>&1 | tee "$OUT/bert-base-$gpu.log"
done
