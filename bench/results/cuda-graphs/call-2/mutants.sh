#!/usr/bin/env bash
# ad-hoc (not committed): the new GPU tests must go red when the property they guard is broken
set -u
for m in "lr:s/lr.fill_(group\[\"lr\"\])/pass/" "inputs:s/graph.inputs\[name\].copy_(t, non_blocking=True)/pass/" "rng:s/graph.graph.replay()/torch.cuda.manual_seed(7); graph.graph.replay()/"; do
  name=${m%%:*}; expr=${m#*:}
  rm -rf /tmp/mut-$name; mkdir -p /tmp/mut-$name; cp -r tightfit tests /tmp/mut-$name/
  sed -i "$expr" /tmp/mut-$name/tightfit/runtime/graphs.py
  grep -c "pass\|manual_seed(7)" /tmp/mut-$name/tightfit/runtime/graphs.py
  (cd /tmp/mut-$name && PYTHONPATH=/tmp/mut-$name:/tmp/site timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_cuda_graphs.py -k "exactly_as_eager" 2>&1 | tail -2) | sed "s/^/mutant $name: /"
done
