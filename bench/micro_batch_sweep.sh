# Issue 17: ResNet-50 and BERT-base at 4 GiB, small micro-batches without recomputation against the
# plans' recomputing ones, eager and compiled (bench/gpu_session.sh's sweep part, one folder each).
# Usage (repository root, CUDA): OUT=folder bash bench/micro_batch_sweep.sh
OUT=${OUT:-out}
SWEEP_WORKLOAD=resnet50-224@4GiB SWEEP_PRECISION=fp16 SWEEP_OPTIMIZER=adamw SWEEP_TIMEOUT=330 OUT=$OUT/resnet50 \
SWEEP_ROWS='[["eager",128,6,true],["eager",128,7,true],["eager",86,3,true],["eager",64,null,true],["eager",64,null,false],["eager",256,null,false],["model",128,6,true],["model",64,null,true],["model",86,3,true]]' \
  bash bench/gpu_session.sh sweep
SWEEP_TIMEOUT=150 OUT=$OUT/bert-base \
SWEEP_ROWS='[["eager",256,10,true],["eager",128,7,true],["eager",64,null,true],["eager",64,null,false],["eager",256,null,false]]' \
  bash bench/gpu_session.sh sweep
