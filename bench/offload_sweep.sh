# Issue 17: activation offload (per-block policies) at 4 GiB against whole-block recomputation, eager
# and with the other blocks compiled one by one; BERT-base seq 128 (bf16, 8-bit AdamW with bf16
# weights) and ResNet-50 (fp16, AdamW). Usage (repository root, CUDA): OUT=folder bash bench/offload_sweep.sh
set -u
OUT=${OUT:-out}; mkdir -p $OUT
[ -f .carry/site.tgz ] && tar xzf .carry/site.tgz -C /tmp && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
echo "tightfit commit $(git rev-parse HEAD) $(git status --porcelain | wc -l) uncommitted" > $OUT/env.txt
p() { python3 -c "import json,sys; n=int(sys.argv[1]); spec=sys.argv[2:]; out=[]
for s in spec: k,v=s.split('x'); out += [v]*int(k)
print(json.dumps(out + ['none']*(n-len(out))))" "$@"; }
B="$(p 12 12xfull)"; O="$(p 12 12xoffload)"; O2="$(p 12 2xoffload 10xfull)"; O6="$(p 12 6xoffload)"
SWEEP_ROWS="[[\"eager\",256,$B,true],[\"eager\",256,$O,true],[\"eager\",256,$O2,true],[\"eager\",128,$O,true],[\"eager\",128,$O6,true],[\"blocks\",256,10,true],[\"blocks\",256,$O2,true],[\"blocks\",128,$O6,true]]" \
  timeout 200 python3 bench/whole_graph_accumulation.py $OUT > $OUT/bert-base-offload.log 2>&1; echo "bert exit $?" >> $OUT/env.txt
R="$(p 16 16xoffload)"
SWEEP_WORKLOAD=resnet50-224@4GiB SWEEP_PRECISION=fp16 SWEEP_OPTIMIZER=adamw \
SWEEP_ROWS="[[\"eager\",128,$R,true],[\"eager\",256,$R,true],[\"eager\",128,6,true]]" \
  timeout 150 python3 bench/whole_graph_accumulation.py $OUT > $OUT/resnet50-offload.log 2>&1; echo "resnet exit $?" >> $OUT/env.txt
grep "^|" $OUT/*.log | cut -c1-200
