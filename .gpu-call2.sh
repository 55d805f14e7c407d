set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site && tar xJf .whl-bnb/bnb.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TIGHTFIT_DEFAULT_MODEL=$PWD/.assets/minilm-bf16 TIGHTFIT_DEFAULT_DATA=$PWD/.assets/rotten_tomatoes_corpus_full.csv.bz2
mkdir -p $OUT/tests $OUT/mem
(timeout 120 python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider tests/test_optimizer_levers.py > $OUT/tests/pytest-gpu-levers.txt 2>&1; echo "exit $?" >> $OUT/tests/pytest-gpu-levers.txt)
tail -4 $OUT/tests/pytest-gpu-levers.txt
for row in '{"arch":"bert-large","size":128,"micro_batch":32,"precision":"bf16","checkpointing":"all","optimizer":"adamw8bit"}' \
           '{"arch":"bert-large","size":128,"micro_batch":64,"precision":"bf16","checkpointing":"all","optimizer":"adamw8bit"}' \
           '{"arch":"bert-large","size":128,"micro_batch":32,"precision":"bf16","checkpointing":"all","optimizer":"adamw"}'; do
  timeout 120 python3 bench/measure_memory.py --row "$row" >> $OUT/mem/rows.jsonl 2>> $OUT/mem/err.txt
done
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/mem/rows.jsonl"):
    r = json.loads(line)
    print({k: (round(v / 2**30, 3) if isinstance(v, int) and v > 2**20 else v) for k, v in r.items() if k not in ("steps_peak_allocated_bytes",)})
    print("  breakdown GiB", {k: round(v / 2**30, 3) for k, v in r.get("breakdown", {}).items()})
    print("  steps reserved GiB", [round(v / 2**30, 3) for v in r.get("steps_peak_reserved_bytes", [])], "alloc", [round(v / 2**30, 3) for v in r.get("steps_peak_allocated_bytes", [])])
PY
tail -3 $OUT/mem/err.txt
