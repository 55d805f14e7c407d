#!/usr/bin/env bash
# The plans `tightfit plan` (no GPU) gives for the six bench workloads and the main job, one JSON
# line each, to check that a change leaves the planner's choices unchanged.
# Usage (repo root): bench/plan_snapshot.sh > plans.jsonl
set -euo pipefail
TIGHTFIT=${TIGHTFIT:-.venv/bin/tightfit}
plan() { "$TIGHTFIT" plan "$@" --gpu h200 --json | python3 -c "
import json, sys
p = json.load(sys.stdin)['plan']
keep = ('precision', 'micro_batch', 'effective_batch', 'activation_checkpointing', 'checkpoint_blocks', 'optimizer')
print(json.dumps({'args': sys.argv[1:], **{k: p.get(k) for k in keep}}))" "$@"; }
plan --model bert-base --seq-len 128 --batch-size 256 --budget 4GiB
plan --model bert-base --seq-len 128 --batch-size 256 --budget 11GiB
plan --model bert-base --seq-len 512 --batch-size 64 --budget 11GiB
plan --model bert-large --seq-len 128 --batch-size 128 --budget 11GiB
plan --model vit-b16 --image-size 224 --batch-size 128 --budget 10GiB
plan --model resnet50 --image-size 224 --batch-size 256 --budget 4GiB
plan --model minilm --seq-len 64 --batch-size 32 --budget 4GiB
