mkdir -p $OUT/s10
R=$PWD; mkdir -p /tmp/head10 && tar xzf .gpu-head.tgz -C /tmp/head10 && cd /tmp/head10
mkdir -p /tmp/site && tar xzf $R/.carry/site.tgz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TIGHTFIT_DEFAULT_MODEL=$R/.carry/minilm TIGHTFIT_DEFAULT_DATA=$R/.carry/data/rotten_tomatoes_corpus_full.csv.bz2
export TIGHTFIT_CACHE_DIR=$(mktemp -d)
cp $R/.gpu-commit $OUT/s10/commit.txt
timeout 450 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -o faulthandler_timeout=200 --durations=8 tests/ 2>&1 | grep -v Warning > $OUT/s10/pytest-gpu.txt
tail -25 $OUT/s10/pytest-gpu.txt
