# Issue 17: would CUDA graphs make BERT-base's small micro-batches without recomputation fast at
# 4 GiB? The whole model compiled in the default mode and with mode="reduce-overhead", 64 x 4 capped
# and not, 256 x 1 uncapped (the compiled and eager no-budget references), 8-bit AdamW with bf16
# weights (bench/gpu_session.sh's sweep part). Usage (repository root, CUDA): OUT=folder bash bench/cudagraph_ceiling.sh
SWEEP_TIMEOUT=400 \
SWEEP_ROWS='[["model-ro",64,null,false],["model-ro",64,null,true],["model-ro",64,null,true],["model",64,null,true],["model",256,null,false],["eager",256,null,false]]' \
  bash bench/gpu_session.sh sweep
