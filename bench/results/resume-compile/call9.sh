mkdir -p $OUT/s9
R=$PWD; mkdir -p /tmp/head9 && tar xzf .gpu-head.tgz -C /tmp/head9 && cd /tmp/head9
mkdir -p /tmp/site && tar xzf $R/.carry/site.tgz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TIGHTFIT_DEFAULT_MODEL=$R/.carry/minilm TIGHTFIT_DEFAULT_DATA=$R/.carry/data/rotten_tomatoes_corpus_full.csv.bz2
export TIGHTFIT_CACHE_DIR=$(mktemp -d); T=$(mktemp -d)
cp $R/.gpu-commit $OUT/s9/commit.txt
TORCH_LOGS=recompiles timeout 520 python3 -m tightfit train --model bert-large --seq-len 128 --budget 4GiB --batch-size 256 --eval-samples 256 --epochs 6 --train-samples 7680 --max-steps 120 --log-every 1 --out $T/L --no-progress > $OUT/s9/large.log 2>&1; echo "exit $?" >> $OUT/s9/large.log
cp $T/L/metrics.jsonl $OUT/s9/large-metrics.jsonl; cp $T/L/summary.json $OUT/s9/large-summary.json
grep -A6 "Recompiling function" $OUT/s9/large.log | grep -v "adam\|'p'" | cut -c1-300 | head -40
grep "planning took\|tightfit:\|exit\|samples/s\|time:" $OUT/s9/large.log | head -20
tar czf $OUT/s9.tgz -C $OUT s9
