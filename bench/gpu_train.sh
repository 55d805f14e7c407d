#!/usr/bin/env bash
# The main job on a CUDA GPU under emulated small-card budgets, plus the GPU tests.
# Usage (repo root, python3 with torch + transformers): OUT=results-folder bench/gpu_train.sh
# The shipped model/data may be given as files: TIGHTFIT_DEFAULT_MODEL=folder TIGHTFIT_DEFAULT_DATA=csv.bz2
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/gpu-train}
mkdir -p "$OUT"
python3 -m tightfit doctor 2>&1 | tee "$OUT/doctor.txt"
for budget in 4GiB 11GiB; do
  python3 -m tightfit train --full --budget $budget --out "$OUT/run-$budget" --no-progress 2>&1 | tee "$OUT/train-$budget.log"
done
python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log"
