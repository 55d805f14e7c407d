# Issue 17: activation offload (per-block policies) at 4 GiB against whole-block recomputation, eager
# and with the other blocks compiled one by one; BERT-base seq 128 (bf16, 8-bit AdamW with bf16
# weights) and ResNet-50 (fp16, AdamW) (bench/gpu_session.sh's sweep part, one folder each).
# Usage (repository root, CUDA): OUT=folder bash bench/offload_sweep.sh
OUT=${OUT:-out}
SWEEP_TIMEOUT=200 OUT=$OUT/bert-base \
SWEEP_ROWS='[["eager",256,"12xfull",true],["eager",256,"12xoffload",true],["eager",256,"2xoffload+10xfull",true],["eager",128,"12xoffload",true],["eager",128,"6xoffload",true],["blocks",256,10,true],["blocks",256,"2xoffload+10xfull",true],["blocks",128,"6xoffload",true]]' \
  bash bench/gpu_session.sh sweep
SWEEP_WORKLOAD=resnet50-224@4GiB SWEEP_PRECISION=fp16 SWEEP_OPTIMIZER=adamw SWEEP_TIMEOUT=150 OUT=$OUT/resnet50 \
SWEEP_ROWS='[["eager",128,"16xoffload",true],["eager",256,"16xoffload",true],["eager",128,6,true]]' \
  bash bench/gpu_session.sh sweep
