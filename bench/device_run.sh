#!/bin/bash
# Runs benchmark workloads one after another on one GPU: bench/device_run.sh GPU OUTDIR SECONDS WORKLOAD...
# (each workload capped at SECONDS; what it measured so far is kept in OUTDIR/<workload>.json)
gpu=$1; out=$2; limit=$3; shift 3
for w in "$@"; do
  CUDA_VISIBLE_DEVICES=$gpu PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$limit" \
    python3 -m tightfit bench run --workload "$w" --out "$out" > "$out/$w.log" 2>&1
  echo "$w exit $?" >> "$out/exit-codes.txt"
done
