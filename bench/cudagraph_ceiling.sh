# Issue 17: would CUDA graphs make BERT-base's small micro-batches without recomputation fast at
# 4 GiB? The whole model compiled in the default mode and with mode="reduce-overhead", 64 x 4 and
# 86 x 3 capped, 256 x 1 uncapped (the compiled no-budget reference), 8-bit AdamW with bf16 weights.
# Usage (repository root, CUDA): OUT=folder bash bench/cudagraph_ceiling.sh
set -u
OUT=${OUT:-out}; mkdir -p $OUT
[ -f .carry/site.tgz ] && tar xzf .carry/site.tgz -C /tmp && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
echo "tightfit commit $(git rev-parse HEAD) $(git status --porcelain | wc -l) uncommitted" > $OUT/env.txt
SWEEP_ROWS='[["model-ro",64,null,false],["model-ro",64,null,true],["model-ro",64,null,true],["model",64,null,true],["model",256,null,false],["eager",256,null,false]]' \
  timeout 400 python3 bench/whole_graph_accumulation.py $OUT > $OUT/cudagraph-ceiling.log 2>&1; echo "exit $?" >> $OUT/env.txt
grep "^|" $OUT/*.log
