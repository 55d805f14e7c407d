#!/usr/bin/env bash
# The main job on a CUDA GPU under emulated small-card budgets, plus the GPU tests.
# Usage (repo root, python3 with torch + transformers): RESULTS=results-folder bench/gpu_train.sh
# The shipped model/data may be given as files: TIGHTFIT_DEFAULT_MODEL=folder TIGHTFIT_DEFAULT_DATA=csv.bz2
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-bench/results/gpu-train}
mkdir -p "$RESULTS"
python3 -m tightfit doctor 2>&1 | tee "$RESULTS/doctor.txt"
for budget in 4GiB 11GiB; do
  python3 -m tightfit train --full --budget $budget --out "$RESULTS/run-$budget" --no-progress 2>&1 | tee "$RESULTS/train-$budget.log"
done
python3 -m pytest -q -m gpu tests 2>&1 | tee "$RESULTS/pytest-gpu.log"
