#!/usr/bin/env bash
# `tightfit bench --suite seeds` on one CUDA GPU: the GTX 1080 Ti BERT-base table (seq 512, 20 steps
# per row) beside tightfit's plan for that card, and the ViT-B/16 challenge (digits at 224 px, two
# 12-epoch fine-tunes at effective batch 16). About 4-6 minutes on an H200.
# Usage (repository root): OUT=folder bench/seeds.sh
# Writes into $OUT: seeds.json, seeds.md, seeds-bert.png, seeds-vit.png, seeds.log.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/seeds}
mkdir -p "$OUT"
# scikit-learn's digits without scikit-learn: the same file, kept in bench/data
python3 -c "import sklearn" 2>/dev/null || export TIGHTFIT_DIGITS=$PWD/bench/data/digits.csv.gz
timeout 470 python3 -m tightfit bench --suite seeds --out "$OUT" 2>&1 | tee "$OUT/seeds.log" | grep -v "^  step" | tail -n 60
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/seeds.log"
