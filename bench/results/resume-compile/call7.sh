mkdir -p $OUT/s7
R=$PWD; mkdir -p /tmp/head7 && tar xzf .gpu-head.tgz -C /tmp/head7 && cd /tmp/head7
mkdir -p /tmp/site && tar xzf $R/.carry/site.tgz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TIGHTFIT_DEFAULT_MODEL=$R/.carry/minilm TIGHTFIT_DEFAULT_DATA=$R/.carry/data/rotten_tomatoes_corpus_full.csv.bz2
export TIGHTFIT_CACHE_DIR=$(mktemp -d); T=$(mktemp -d)
cp $R/.gpu-commit $OUT/s7/commit.txt
run() { name=$1; shift; ( time TORCH_LOGS=recompiles,graph_breaks,dynamo timeout 200 python3 -m tightfit "$@" --no-progress ) > $OUT/s7/$name.log 2>&1; echo "exit $?" >> $OUT/s7/$name.log; }
run base8 train --model bert-base --seq-len 128 --budget 4GiB --batch-size 256 --eval-samples 256 --max-steps 40 --checkpoint-every 10 --train-samples 10240 --optimizer adamw8bit-bf16 --compile on --out $T/b8
cp $T/b8/metrics.jsonl $OUT/s7/base8-metrics.jsonl; cp $T/b8/plan.json $OUT/s7/base8-plan.json
ls $T/b8/checkpoints; rm -rf $T/b8/checkpoints/ckpt-40*
run base8-resume train --resume $T/b8
cp $T/b8/metrics.jsonl $OUT/s7/base8-resume-metrics.jsonl
run base32 train --model bert-base --seq-len 128 --budget 4GiB --batch-size 256 --eval-samples 256 --max-steps 40 --checkpoint-every 10 --train-samples 10240 --compile on --out $T/b32
cp $T/b32/metrics.jsonl $OUT/s7/base32-metrics.jsonl; cp $T/b32/plan.json $OUT/s7/base32-plan.json
ls $T/b32/checkpoints; rm -rf $T/b32/checkpoints/ckpt-40*
run base32-resume train --resume $T/b32
cp $T/b32/metrics.jsonl $OUT/s7/base32-resume-metrics.jsonl
for f in $OUT/s7/*.log; do echo "== $f"; grep -i "start tracing\|recompiling\|graph break\|planning took\|real\|exit\|step  *[0-9]* \|^tightfit" $f | cut -c1-220 | head -60; done
