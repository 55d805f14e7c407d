set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site && tar xJf .whl-bnb/bnb.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TIGHTFIT_DEFAULT_MODEL=$PWD/.assets/minilm-bf16 TIGHTFIT_DEFAULT_DATA=$PWD/.assets/rotten_tomatoes_corpus_full.csv.bz2
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/tests $OUT/opt $OUT/large
(timeout 150 python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider tests/test_optimizer_levers.py tests/test_host_adamw.py > $OUT/tests/pytest-gpu-offload.txt 2>&1; echo "exit $?" >> $OUT/tests/pytest-gpu-offload.txt)
tail -15 $OUT/tests/pytest-gpu-offload.txt
OUT=$OUT/opt timeout 120 python3 bench/optimizer_step_time.py > $OUT/opt/log.txt 2>&1; tail -20 $OUT/opt/log.txt
RUNS="large1" OUT=$OUT/large timeout 300 bash bench/multi_gpu.sh > /dev/null 2>&1
cat $OUT/large/logs.txt | head -60
cp /tmp/tightfit-multi-gpu/large-1gpu/metrics.jsonl $OUT/large/large-1gpu-metrics.jsonl 2>/dev/null
