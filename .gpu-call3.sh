set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site && tar xJf .whl-bnb/bnb.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TIGHTFIT_DEFAULT_MODEL=$PWD/.assets/minilm-bf16 TIGHTFIT_DEFAULT_DATA=$PWD/.assets/rotten_tomatoes_corpus_full.csv.bz2
mkdir -p $OUT/diag
timeout 200 python3 .diag_probe.py train --model bert-large --seq-len 128 --budget 4GiB --batch-size 256 --compile off --train-samples 12800 --replan --no-progress --out /tmp/diag-run > $OUT/diag/probe.txt 2>&1
grep -v "Warning\|warn" $OUT/diag/probe.txt | tail -50
