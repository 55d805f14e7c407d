#!/usr/bin/env bash
# Several GPUs (issue 16) on a 2-GPU machine, budgets emulated per GPU (--budget 4GiB):
#  1. BERT-base seq 128 @ 4 GiB: 1 GPU vs 2 GPUs (DDP), samples/s ratio (target >= 1.8x); both with the
#     same options (100 steps of 256, a checkpoint every 25 steps), samples/s counting every rank's samples
#  2. BERT-large seq 128 @ 4 GiB: 2 GPUs (FSDP2 expected) vs 1 GPU (its state does not fit 4 GiB)
#  3. an OOM injected on rank 1 mid-run (bench/multi_gpu_oom.py): every rank recovers, losses equal
#     a run that switched to the smaller micro-batch at that step
#  4. a 2-GPU run killed (SIGKILL) after its first checkpoint, resumed on 2 GPUs (exact: losses equal
#     the uninterrupted run of 1.) and on 1 GPU (DCP reshards; the losses continue); only the steps the
#     resumed run itself wrote are compared, and a resume that failed or wrote none fails the check
# Usage (repo root; the shipped model/data as for bench/gpu_train.sh): OUT=folder bench/multi_gpu.sh
# Writes $OUT/multi_gpu.json, $OUT/multi_gpu.md, $OUT/oom.json, $OUT/logs.txt (about 7 minutes).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
OUT=${OUT:-bench/results/multi-gpu}
WORK=${WORK:-/tmp/tightfit-multi-gpu}
mkdir -p "$OUT"; rm -rf "$WORK"; mkdir -p "$WORK"
LOGS="$OUT/logs.txt"; : > "$LOGS"
COMMON=(--seq-len 128 --budget 4GiB --batch-size 256 --eval-samples 256 --epochs 1
        --log-every 1 --compile off --planner probe --replan --no-progress)
BASE=(--train-samples 25600 --checkpoint-every 25)  # 100 steps, the same for 1 and 2 GPUs and the killed run
LARGE=(--train-samples 12800)  # 50 steps

run() {  # run NAME SECONDS CMD... : output to $WORK/NAME.log, head+tail into logs.txt
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> "$LOGS"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "exit $rc" >> "$LOGS"
  grep -v "Warning\|warn(" "$WORK/$name.log" | grep -E "plan:|  (micro-batch|precision|checkpointing|why)|samples/s|summary|error|Error|OOM|out of memory|resumed" | head -40 >> "$LOGS"
  echo "$name $rc" >> "$WORK/exit-codes.txt"
}

# 1. BERT-base, 1 GPU then 2 GPUs (the 2-GPU run writes checkpoints: it is the reference of 4.)
run base-1gpu 150 env CUDA_VISIBLE_DEVICES=0 python3 -m tightfit train --model bert-base "${COMMON[@]}" "${BASE[@]}" --out "$WORK/base-1gpu"
run base-2gpu 150 python3 -m tightfit train --model bert-base "${COMMON[@]}" "${BASE[@]}" --gpus 2 --out "$WORK/base-2gpu"
# 2. BERT-large: 2 GPUs (sharded), and the single-GPU attempt under the same budget
run large-2gpu 150 python3 -m tightfit train --model bert-large "${COMMON[@]}" "${LARGE[@]}" --gpus 2 --out "$WORK/large-2gpu"
run large-1gpu 60 env CUDA_VISIBLE_DEVICES=0 python3 -m tightfit train --model bert-large "${COMMON[@]}" "${LARGE[@]}" --out "$WORK/large-1gpu"
# 3. OOM on rank 1 mid-run
run oom 120 env OUT="$OUT" python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/multi_gpu_oom.py
# 4. kill after the first checkpoint, resume on 2 GPUs and (from a copy) on 1 GPU
setsid python3 -m tightfit train --model bert-base "${COMMON[@]}" "${BASE[@]}" --gpus 2 \
  --out "$WORK/killed" > "$WORK/killed.log" 2>&1 &
pid=$!  # its own process group: the launcher and both ranks
for _ in $(seq 1 240); do
  [ -d "$WORK/killed/checkpoints/ckpt-25" ] && break  # renamed into place only once complete
  sleep 0.2
done
kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null
sleep 2
echo "killed after: $(ls "$WORK/killed/checkpoints" 2>/dev/null | tr '\n' ' ')" >> "$LOGS"
cp "$WORK/killed/metrics.jsonl" "$WORK/killed-before-resume.jsonl" 2>/dev/null  # what the killed run wrote
cp -r "$WORK/killed" "$WORK/killed-1gpu"
run resume-2gpu 150 python3 -m tightfit train --resume "$WORK/killed" --gpus 2 --no-progress
run resume-1gpu 150 env CUDA_VISIBLE_DEVICES=0 python3 -m tightfit train --resume "$WORK/killed-1gpu" --no-progress

python3 bench/multi_gpu_report.py "$WORK" "$OUT"
