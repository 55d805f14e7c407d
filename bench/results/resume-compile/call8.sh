mkdir -p $OUT/s8
R=$PWD; mkdir -p /tmp/head8 && tar xzf .gpu-head.tgz -C /tmp/head8 && cd /tmp/head8
mkdir -p /tmp/site && tar xzf $R/.carry/site.tgz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TIGHTFIT_DEFAULT_MODEL=$R/.carry/minilm TIGHTFIT_DEFAULT_DATA=$R/.carry/data/rotten_tomatoes_corpus_full.csv.bz2
export TIGHTFIT_CACHE_DIR=$(mktemp -d); T=$(mktemp -d)
TORCH_LOGS=recompiles timeout 200 python3 -m tightfit train --model bert-base --seq-len 128 --budget 4GiB --batch-size 256 --eval-samples 256 --max-steps 40 --checkpoint-every 10 --train-samples 10240 --optimizer adamw8bit-bf16 --compile on --out $T/b8 --no-progress > $OUT/s8/base8.log 2>&1
grep -A8 "Recompiling function forward" $OUT/s8/base8.log | cut -c1-400
grep -B3 -A3 "start tracing forward" $OUT/s8/base8.log | cut -c1-300 | head -30
grep "planning took\|tightfit:" $OUT/s8/base8.log | head
tar czf $OUT/s8.tgz -C $OUT s8
