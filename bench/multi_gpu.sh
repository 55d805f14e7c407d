#!/usr/bin/env bash
# Several GPUs (issue 16) on a 2-GPU machine, budgets emulated per GPU (--budget 4GiB):
#  1. BERT-base seq 128 @ 4 GiB: 1 GPU vs 2 GPUs (DDP), samples/s ratio (target >= 1.8x); both with the
#     same options (46 steps of 256, a checkpoint every 25 steps), compiled and eager, samples/s counting
#     every rank's samples
#  2. BERT-large seq 128 @ 4 GiB: 2 GPUs (FSDP2 expected) vs the best 1-GPU plan (8-bit or offloaded optimizer state)
#  3. an OOM injected on rank 1 mid-run (bench/multi_gpu_oom.py): every rank recovers, losses equal
#     a run that switched to the smaller micro-batch at that step
#  4. a 2-GPU run killed (SIGKILL) after its first checkpoint, resumed on 2 GPUs (exact: losses equal
#     the uninterrupted eager 2-GPU run of 1.) and on 1 GPU (DCP reshards; the losses continue); only the steps the
#     resumed run itself wrote are compared, and a resume that failed or wrote none fails the check
# Usage (repo root; the shipped model/data as for bench/gpu_train.sh): OUT=folder bench/multi_gpu.sh
# (RUNS="base eager1 eager2 large2 large1 oom kill" by default: the sections to run; kill needs eager2's reference)
# Writes $OUT/multi_gpu.json, $OUT/multi_gpu.md, $OUT/oom.json, $OUT/logs.txt (about 7 minutes).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
OUT=${OUT:-bench/results/multi-gpu}
WORK=${WORK:-/tmp/tightfit-multi-gpu}
mkdir -p "$OUT"; rm -rf "$WORK"; mkdir -p "$WORK"
LOGS="$OUT/logs.txt"; : > "$LOGS"
COMMON=(--seq-len 128 --budget 4GiB --batch-size 256 --eval-samples 256 --epochs 1 --log-every 1
        --replan --no-progress)
EAGER=(--compile off --planner probe)
BASE=(--train-samples 25600 --checkpoint-every 25)  # one epoch of the shipped data (46 steps), for 1 and 2 GPUs
LARGE=(--train-samples 12800)  # 50 steps

run() {  # run NAME SECONDS CMD... : output to $WORK/NAME.log, head+tail into logs.txt
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> "$LOGS"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s" >> "$LOGS"
  grep -v "Warning\|warn(" "$WORK/$name.log" | grep -E "plan:|  (micro-batch|precision|checkpointing|optimizer|why)|samples/s|summary|error|Error|OOM|out of memory|resumed" | head -40 >> "$LOGS"
  echo "$name $rc" >> "$WORK/exit-codes.txt"
}

# 1. BERT-base, 1 GPU then 2 GPUs, compiled (the planner's default on a GPU) and eager; the eager
#    2-GPU run writes checkpoints: it is the reference of 4.
want() { [[ " ${RUNS:-base eager1 eager2 large2 large1 oom kill} " == *" $1 "* ]]; }  # RUNS: the sections to run

want base && run base-1gpu 170 env CUDA_VISIBLE_DEVICES=0 python3 -m tightfit train --model bert-base "${COMMON[@]}" "${BASE[@]}" --compile on --out "$WORK/base-1gpu"
want base && run base-2gpu 170 python3 -m tightfit train --model bert-base "${COMMON[@]}" "${BASE[@]}" --compile on --gpus 2 --out "$WORK/base-2gpu"
want eager1 && run base-1gpu-eager 120 env CUDA_VISIBLE_DEVICES=0 python3 -m tightfit train --model bert-base "${COMMON[@]}" "${EAGER[@]}" "${BASE[@]}" --out "$WORK/base-1gpu-eager"
want eager2 && run base-2gpu-eager 120 python3 -m tightfit train --model bert-base "${COMMON[@]}" "${EAGER[@]}" "${BASE[@]}" --gpus 2 --out "$WORK/base-2gpu-eager"
# 2. BERT-large: 2 GPUs (sharded), and the best single-GPU plan under the same budget (optimizer levers
#    allowed)
want large2 && run large-2gpu 150 python3 -m tightfit train --model bert-large "${COMMON[@]}" "${EAGER[@]}" "${LARGE[@]}" --gpus 2 --out "$WORK/large-2gpu"
want large1 && run large-1gpu 300 env CUDA_VISIBLE_DEVICES=0 python3 -m tightfit train --model bert-large "${COMMON[@]}" --compile off "${LARGE[@]}" --out "$WORK/large-1gpu"
# 3. OOM on rank 1 mid-run
want oom && run oom 120 env OUT="$OUT" python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/multi_gpu_oom.py
# 4. kill after the first checkpoint, resume on 2 GPUs and (from a copy) on 1 GPU. The run gets its
#    own session (setsid) and writes its process-group id, so that the kill reaches the launcher; the ranks
#    are killed by their command line.
if want kill; then
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$WORK/killed.pgid" python3 -m tightfit train --model bert-base \
    "${COMMON[@]}" "${EAGER[@]}" "${BASE[@]}" --gpus 2 --out "$WORK/killed" > "$WORK/killed.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    [ -d "$WORK/killed/checkpoints/ckpt-25" ] && break  # renamed into place only once complete
    sleep 0.2
  done
  # the launcher's group, and the ranks by their command line (torchrun may start them in sessions of their own)
  kill -KILL -- "-$(cat "$WORK/killed.pgid")" 2>/dev/null; pkill -KILL -f -- "--out $WORK/killed( |$)"; wait "$pid" 2>/dev/null
  sleep 2
  echo "killed after: $(ls "$WORK/killed/checkpoints" 2>/dev/null | tr '\n' ' ')" >> "$LOGS"
  cp "$WORK/killed/metrics.jsonl" "$WORK/killed-before-resume.jsonl" 2>/dev/null  # what the killed run wrote
  cp -r "$WORK/killed" "$WORK/killed-1gpu"
  run resume-2gpu 150 python3 -m tightfit train --resume "$WORK/killed" --gpus 2 --no-progress
  run resume-1gpu 150 env CUDA_VISIBLE_DEVICES=0 python3 -m tightfit train --resume "$WORK/killed-1gpu" --no-progress
fi

python3 bench/multi_gpu_report.py "$WORK" "$OUT"
