set -u
OUT=${OUT:-out}; mkdir -p $OUT
[ -f .carry/site.tgz ] && tar xzf .carry/site.tgz -C /tmp && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
echo "tightfit commit $(git rev-parse HEAD) $(git status --porcelain | wc -l) uncommitted" > $OUT/env.txt
SWEEP_WORKLOAD=resnet50-224@4GiB SWEEP_PRECISION=fp16 SWEEP_OPTIMIZER=adamw \
SWEEP_ROWS='[["eager",128,6,true],["eager",128,7,true],["eager",86,3,true],["eager",64,null,true],["eager",64,null,false],["eager",256,null,false],["model",128,6,true],["model",64,null,true],["model",86,3,true]]' \
  timeout 330 python3 bench/whole_graph_accumulation.py $OUT > $OUT/resnet50.log 2>&1; echo "resnet exit $?" >> $OUT/env.txt
SWEEP_ROWS='[["eager",256,10,true],["eager",128,7,true],["eager",64,null,true],["eager",64,null,false],["eager",256,null,false]]' \
  timeout 150 python3 bench/whole_graph_accumulation.py $OUT > $OUT/bert-base.log 2>&1; echo "bert exit $?" >> $OUT/env.txt
grep "^|" $OUT/*.log
