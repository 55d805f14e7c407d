#!/usr/bin/env bash
# One device call: carried wheels and shipped files set up, then the named parts in order.
# Usage (repository root, CUDA): OUT=folder bench/gpu_session.sh gpu-tests|update-chunks|levers|main ...
#   bert-base: BERT-base seq 128, effective batch 256, 4 GiB, --compile on (as bench/gpu_speed.sh),
#              instrumented by bench/speed_profile.py -> OUT/bert-base-128.{json,log}, OUT/speed.md
#   gpu-tests: pytest -m gpu -> OUT/pytest-gpu.txt
#   recompute: issue 17's side-by-side bench (tightfit, eager and compiled no-budget) on BERT-base seq 128
#              and ResNet-50 at 4 GiB -> OUT/recompute/{*.json,results.md}; env BENCH_WORKLOADS (space-
#              separated), BENCH_SETTINGS and BENCH_TIMEOUT (s per workload) change what and how long
#   update-chunks: bench/update_chunks.py (adamw8bit-bf16's update in chunks, every 8-bit tensor alone, and
#              one call per tensor, each in a process of its own, inductor caches off) and bench/step_breakdown.py's
#              BERT-large 4 GiB plan rows chunked and per tensor (env BREAKDOWN_ROWS, STEPS)
#              -> OUT/update_chunks-*.json, OUT/step-breakdown.log
#   levers:    issue 14's BERT-large seq 128 row at 4 GiB (bench/optimizer_levers.py: tightfit, compiled and eager
#              no-budget, 300 steps; env LEVERS_WORKLOADS, LEVERS_SETTINGS) -> OUT/levers.log, OUT/optimizer_levers.{json,md}
#   main:      the main job at 4 GiB (`tightfit train --full --budget 4GiB`) -> OUT/main.log
#   timeline:  bench/warmup_timeline.py on the main job at 4 GiB four times, alternating the allocator flush before
#              each CUDA graph capture on and off (env TIMELINE_VARIANTS, e.g. "flush no-flush"; "profile":
#              flush, the planner, the first 4 steps and each eager step or capture over 50 ms under cProfile,
#              their tables in the log; "no-cudnn-sdpa": flush, attention without cuDNN kernels;
#              "cudnn-sdpa": flush, the text run keeping PyTorch's attention kernels)
#              -> OUT/timeline-N-{flush,no-flush}.log (slowest steps in env.txt), OUT/timelines.tgz
#   schedule:  the main job at 4 GiB with the default checkpoint schedule, --checkpoint-every 100 and --cuda-graphs
#              off, then bench/warmup_timeline.py on it -> OUT/main-*.log, OUT/warmup-timeline.{json,log}, OUT/runs.tgz
#   sync:      bench/optimizer_sync.py (8-bit step with and without the per-tensor syncs) -> OUT/optimizer_sync.*
#   plan-breakdown: bench/plan_breakdown.py (the GPU planner's stages and probe steps timed) on BERT-large
#              and BERT-base seq 128 at 4 GiB -> OUT/plan-breakdown/plan-breakdown.{json,md}
#   loop-overhead: bench/loop_overhead.py on the main job (the loop's per-step bookkeeping made no-ops one at
#              a time; env LOOP_VARIANTS, e.g. to alternate the prefetch thread on and off) -> OUT/loop-overhead.{json,md}
#   checkpoint-gil: bench/checkpoint_gil.py (a host-bound thread during background checkpoint writes)
#              -> OUT/checkpoint-gil.{json,md}
#   cuda-graphs: bench/cuda_graphs.py (the eager step, its forward and backward graphed, the whole step captured;
#              env GRAPH_WORKLOADS) -> OUT/cuda-graphs.{json,md}
#   steady-windows: bench/steady_windows.py (BERT-base's 4 GiB plan built directly, probed, run 300 steps by the
#              Trainer in 25-step windows with the SM clock and power sampled, probed again: issue 12's
#              run-against-probe gap, the loop's or the clocks') -> OUT/steady-windows/{run.log,steady_windows.json}
#   graphs-lever: the bench's tightfit setting on GRAPHS_WORKLOAD (bert-base-128@4GiB) planned with
#              TIGHTFIT_PLAN_CUDA_GRAPHS=1 then 0 (BENCH_SETTINGS adds others), then the sweep's static
#              reduce-overhead step (its first row after compilation fails: gradients left in the graphs'
#              pool) against the lever's, two rows each -> OUT/graphs-{1,0}/, OUT/sweep.log
#   sweep:     bench/whole_graph_accumulation.py (probe steps of rows of scope, micro-batch, checkpointing, cap; env
#              SWEEP_WORKLOAD, SWEEP_PRECISION, SWEEP_OPTIMIZER, SWEEP_ROWS, SWEEP_TIMEOUT) -> OUT/sweep.log, OUT/*.json
#              (bench/micro_batch_sweep.sh, offload_sweep.sh and cudagraph_ceiling.sh run it)
#   plan-time: bench/plan_time.py on three workloads (`tightfit plan`, no GPU: exact estimates traced one
#              by one and in worker processes) -> OUT/plan-time/plan-time.{json,md}
# Carried (ignored by git, .git/info/exclude): .carry/site.tgz (bitsandbytes with only its CUDA 13.0
# and CPU libraries, torchao), .carry/minilm (the shipped MiniLM, weights rounded to bf16 to fit a
# call's 64 MiB; tightfit loads them as fp32), .carry/data (the shipped Rotten Tomatoes CSV).
# bench/make_carry.sh builds .carry/ from this checkout's .venv.
set -uo pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
if [ -f .carry/site.tgz ]; then tar xzf .carry/site.tgz -C /tmp; export PYTHONPATH=/tmp/site; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -d .carry/minilm ] && export TIGHTFIT_DEFAULT_MODEL=$PWD/.carry/minilm
[ -d .carry/data ] && export TIGHTFIT_DEFAULT_DATA=$PWD/.carry/data/rotten_tomatoes_corpus_full.csv.bz2
export TIGHTFIT_CACHE_DIR=$(mktemp -d /tmp/tightfit-cache.XXXX)  # empty: every run plans
RUNS=$(mktemp -d /tmp/tightfit-runs.XXXX)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, bitsandbytes, torchao; print('torch', torch.__version__, 'transformers', transformers.__version__, 'bitsandbytes', bitsandbytes.__version__, 'torchao', torchao.__version__)"
  echo "tightfit commit $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) uncommitted"; } > "$OUT/env.txt" 2>&1
for part in "$@"; do
  case $part in
    bert-base)
      python3 bench/make_bert_base.py /tmp/bert-base "${TIGHTFIT_DEFAULT_MODEL:-}" > /dev/null 2>&1
      timeout 240 python3 bench/speed_profile.py run bert-base-128 "$OUT" -- --model /tmp/bert-base --seq-len 128 \
        --batch-size 256 --budget 4GiB --compile on --epochs 3 --checkpoint-every 30 --train-samples 8192 \
        --out "$RUNS/bert-base-128" --no-progress > "$OUT/bert-base-128.log" 2>&1
      echo "bert-base exit $?" >> "$OUT/env.txt"
      rm -f "$OUT/bert-base-128-profile.txt"
      python3 bench/speed_profile.py report "$OUT" >> "$OUT/env.txt" 2>&1 ;;
    gpu-tests)
      timeout ${GPU_TESTS_TIMEOUT:-560} python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS_ARGS:--n 6 --dist load} tests > "$OUT/pytest-gpu.txt" 2>&1
      echo "gpu-tests exit $?" >> "$OUT/env.txt" ;;
    sync)
      timeout 150 python3 bench/optimizer_sync.py > "$OUT/optimizer_sync.md" 2>&1
      echo "sync exit $?" >> "$OUT/env.txt"; cat "$OUT/optimizer_sync.md" >> "$OUT/env.txt" ;;
    plan-breakdown)
      timeout ${BREAKDOWN_TIMEOUT:-420} python3 bench/plan_breakdown.py "$OUT/plan-breakdown" ${BREAKDOWN_WORKLOADS:-} > "$OUT/plan-breakdown.log" 2>&1
      echo "plan-breakdown exit $?" >> "$OUT/env.txt"; grep -E "^## |^\| [a-z_(]" "$OUT/plan-breakdown/plan-breakdown.md" >> "$OUT/env.txt" 2>/dev/null ;;
    cuda-graphs)
      timeout 400 python3 bench/cuda_graphs.py "$OUT" ${GRAPH_WORKLOADS:-} > "$OUT/cuda-graphs.log" 2>&1
      echo "cuda-graphs exit $?" >> "$OUT/env.txt"; cat "$OUT/cuda-graphs.md" >> "$OUT/env.txt" 2>/dev/null ;;
    plan-time)
      timeout 420 python3 bench/plan_time.py "$OUT/plan-time" bert-base-128@4GiB bert-large-128@4GiB resnet50-224@4GiB > "$OUT/plan-time.log" 2>&1
      echo "plan-time exit $?" >> "$OUT/env.txt"; cat "$OUT/plan-time/plan-time.md" >> "$OUT/env.txt" 2>/dev/null ;;
    recompute)
      for w in ${BENCH_WORKLOADS:-bert-base-128@4GiB resnet50-224@4GiB}; do
        timeout ${BENCH_TIMEOUT:-280} python3 -m tightfit bench run --workload "$w" \
          --settings "${BENCH_SETTINGS:-tightfit,no-budget,compiled-no-budget}" \
          --out "$OUT/recompute" > "$OUT/recompute-${w//@/-at-}.log" 2>&1
        echo "recompute $w exit $?" >> "$OUT/env.txt"
      done
      python3 -m tightfit bench report "$OUT/recompute" >> "$OUT/env.txt" 2>&1
      for f in "$OUT"/recompute/*@*; do mv "$f" "${f//@/-at-}"; done  # '@' does not travel back
      cat "$OUT/recompute/results.md" >> "$OUT/env.txt" 2>/dev/null ;;
    graphs-lever)
      # the planner with and without its CUDA-graph stage (TIGHTFIT_PLAN_CUDA_GRAPHS), then the
      # static reduce-overhead step against the lever's (batch dimension dynamic), one call
      for g in 1 0; do
        TIGHTFIT_PLAN_CUDA_GRAPHS=$g timeout ${BENCH_TIMEOUT:-300} python3 -m tightfit bench run \
          --workload "${GRAPHS_WORKLOAD:-bert-base-128@4GiB}" --settings "${BENCH_SETTINGS:-tightfit}" \
          --out "$OUT/graphs-$g" > "$OUT/graphs-$g.log" 2>&1
        echo "graphs-lever TIGHTFIT_PLAN_CUDA_GRAPHS=$g exit $?" >> "$OUT/env.txt"
        for f in "$OUT"/graphs-$g/*@*; do mv "$f" "${f//@/-at-}"; done
      done
      SWEEP_WORKLOAD=${GRAPHS_WORKLOAD:-bert-base-128@4GiB} \
        SWEEP_ROWS='[["model-ro", 64, null, true], ["model-ro", 64, null, true], ["model-graphs", 64, null, true], ["model-graphs", 64, null, true]]' \
        timeout ${SWEEP_TIMEOUT:-300} python3 bench/whole_graph_accumulation.py "$OUT" > "$OUT/sweep.log" 2>&1
      echo "graphs-lever sweep exit $?" >> "$OUT/env.txt"; grep "^|" "$OUT/sweep.log" >> "$OUT/env.txt" ;;
    steady-windows)
      mkdir -p "$OUT/steady-windows"
      timeout ${STEADY_TIMEOUT:-200} python3 bench/steady_windows.py "$OUT/steady-windows" 300 \
        > "$OUT/steady-windows/run.log" 2>&1
      echo "steady-windows exit $?" >> "$OUT/env.txt"
      grep -E "^probe|^steps|^\{" "$OUT/steady-windows/run.log" >> "$OUT/env.txt" ;;
    sweep)
      timeout ${SWEEP_TIMEOUT:-400} python3 bench/whole_graph_accumulation.py "$OUT" > "$OUT/sweep.log" 2>&1
      echo "sweep exit $?" >> "$OUT/env.txt"; grep "^|" "$OUT/sweep.log" >> "$OUT/env.txt" ;;
    loop-overhead)
      timeout ${LOOP_TIMEOUT:-300} python3 bench/loop_overhead.py "$OUT" > "$OUT/loop-overhead.log" 2>&1
      echo "loop-overhead exit $?" >> "$OUT/env.txt"; cat "$OUT/loop-overhead.md" >> "$OUT/env.txt" 2>/dev/null ;;
    checkpoint-gil)
      timeout 120 python3 bench/checkpoint_gil.py "$OUT" > "$OUT/checkpoint-gil.log" 2>&1
      echo "checkpoint-gil exit $?" >> "$OUT/env.txt"; cat "$OUT/checkpoint-gil.md" >> "$OUT/env.txt" 2>/dev/null ;;
    update-chunks)
      for v in chunked per-tensor lone; do
        TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 timeout ${UPDATE_TIMEOUT:-120} python3 bench/update_chunks.py $v \
          >> "$OUT/update-chunks.log" 2>&1; echo "update-chunks $v exit $?" >> "$OUT/env.txt"
      done
      cat "$OUT"/update_chunks-*.json >> "$OUT/env.txt" 2>/dev/null
      [ -n "${STEPS:-}" ] || [ -n "${BREAKDOWN_ROWS:-}" ] || continue  # the step breakdown only when asked
      STEPS=${STEPS:-20} timeout ${BREAKDOWN_TIMEOUT:-330} python3 bench/step_breakdown.py --no-profile \
        ${BREAKDOWN_ROWS:-large-plan-4GiB-128-compiled large-plan-4GiB-128-compiled-per-tensor \
        large-nobudget-128-adamw-compiled} > "$OUT/step-breakdown.log" 2>&1
      echo "step-breakdown exit $?" >> "$OUT/env.txt"; grep "^|" "$OUT/step-breakdown.log" >> "$OUT/env.txt" ;;
    levers)
      TF_COMPILE=auto TF_STEPS=300 BENCH_WORKLOADS=${LEVERS_WORKLOADS:-bert-large-128@4GiB} \
        BENCH_SETTINGS=${LEVERS_SETTINGS:-tightfit,compiled-no-budget,no-budget} \
        timeout ${LEVERS_TIMEOUT:-400} python3 bench/optimizer_levers.py > "$OUT/levers.log" 2>&1
      echo "levers exit $?" >> "$OUT/env.txt"; cat "$OUT/optimizer_levers.md" >> "$OUT/env.txt" 2>/dev/null ;;
    main)
      timeout 200 python3 -m tightfit train --full --budget 4GiB --out "$RUNS/main" --no-progress > "$OUT/main.log" 2>&1
      echo "main exit $?" >> "$OUT/env.txt"
      cp "$RUNS/main/summary.json" "$OUT/main-summary.json" 2>/dev/null ;;
    timeline)
      for v in ${TIMELINE_VARIANTS:-flush no-flush flush no-flush}; do  # alternated: the allocator flush before each capture, or not
        n=$((${n:-0} + 1))
        TIMELINE_NO_EMPTY_CACHE=$([ "$v" = no-flush ] && echo 1) TIMELINE_NO_CUDNN_SDPA=$([ "$v" = no-cudnn-sdpa ] && echo 1) \
          TIMELINE_CUDNN_SDPA=$([ "$v" = cudnn-sdpa ] && echo 1) \
          TIMELINE_PROFILE_STEPS=$([ "$v" = profile ] && echo 4) \
          TIMELINE_PROFILE_SLOW=$([ "$v" = profile ] && echo 0.05) TIMELINE_PROFILE_PLAN=$([ "$v" = profile ] && echo 1) \
          TIGHTFIT_CACHE_DIR=$(mktemp -d) timeout 100 \
          python3 bench/warmup_timeline.py "$RUNS/tl/timeline-$n-$v" --full --budget 4GiB --out "$RUNS/timeline-$n" \
          --no-progress > "$OUT/timeline-$n-$v.log" 2>&1
        echo "timeline $n $v exit $?" >> "$OUT/env.txt"
        grep -E "^speed: |slow step|train_seconds|excess_seconds" "$OUT/timeline-$n-$v.log" >> "$OUT/env.txt"
      done
      (cd "$RUNS" && tar czf "$OUT/timelines.tgz" tl) ;;  # the JSONs in one file: a call returns 8
    schedule)
      for run in "default" "every100 --checkpoint-every 100" "off --cuda-graphs off"; do
        set -- $run
        TIGHTFIT_CACHE_DIR=$(mktemp -d) timeout 100 python3 -m tightfit train --full --budget 4GiB --out "$RUNS/$1" \
          --no-progress "${@:2}" > "$OUT/main-$1.log" 2>&1
        echo "main $1 exit $?" >> "$OUT/env.txt"
      done
      TIGHTFIT_CACHE_DIR=$(mktemp -d) timeout 100 python3 bench/warmup_timeline.py "$OUT" --full --budget 4GiB \
        --out "$RUNS/timeline" --no-progress > "$OUT/warmup-timeline.log" 2>&1
      echo "timeline exit $?" >> "$OUT/env.txt"
      (cd "$RUNS" && tar czf "$OUT/runs.tgz" */metrics.jsonl */summary.json */report.md) ;;  # one file: a call returns 8
  esac
done
tail -3 "$OUT"/pytest-gpu.txt 2>/dev/null; grep -E "planning took|runner-up|decided by" "$OUT"/*.log 2>/dev/null | cut -c1-400
cat "$OUT/env.txt"
