#!/usr/bin/env bash
# The experiments' GPU stages (lab/README.md: the question each answered), for a CUDA machine. The product's stages
# are scripts/gpu-check.sh's; what both share (environment, steps, logs packed into $OUT) is scripts/gpu-lib.sh's.
#   lab/gpu-lab.sh gemm       lab/skinny_gemm.py: the skinny GEMM's candidates and plan vs cuBLAS and Inductor
#                             max-autotune at the draft's matmul shapes, M 1..64 (skinny_gemm.{json,md}; GEMM_ARGS:
#                             other options, e.g. --no-inductor --ms 1,8,16; --ceiling: the read-only kernels;
#                             --read-grids sweep: the read kernel over other grids)
#   lab/gpu-lab.sh kernels    lab/window_advance.py, lab/attention_bw.py defaults timed three ways (L2 emptied by
#                             writing / by reading; in-graph among other work)
#   lab/gpu-lab.sh host       host time per call (GPU idle / busy) and a census of the graph's nodes, batch 8
#   lab/gpu-lab.sh variants   graphcap against one compile per bucket and the compiled baselines, one bench run at
#                             batches 1, 8, 64 (VARIANTS_BATCH: other batches; BENCH_MODES: other modes)
#   lab/gpu-lab.sh profile    lab/profile_iteration.py at batch 1 and 8, as it ships and with the skinny GEMM at every
#                             batch (PROFILE_RUNS: a subset of b1 skinny-b1 b8 skinny-b8 qnorm-b1 qnorm-b8 twohead-b1
#                             twohead-b8; PROFILE_CODE=1: also the batch-8 iteration's generated code)
#   lab/gpu-lab.sh splits     the attention's split rule: split counts timed in-graph, defaults vs sglang in-graph
#   lab/gpu-lab.sh attention-grid  every tile config x split count of the attention, in-graph, at batch
#                             ATTENTION_GRID_BATCH (1), context 2048
#   lab/gpu-lab.sh regions    each draft layer a nested compile region against the layers inlined: the capture starts
#                             of each (REGIONS_VARIANTS=regions: the default alone)
#   lab/gpu-lab.sh layers     the layer's small ops as graphcap's kernels against torch ops Inductor fuses: GPU tests,
#                             bench at batches 1, 8, 64, host time, per-kernel profile at batch 8 both ways, the
#                             default capture's replay tests (LAYERS_STEPS: a subset of unit bench host profile
#                             replay; LAYERS_BATCH: the bench's batches)
#   lab/gpu-lab.sh prefetch   a projection's weights pulled into L2 by cp.async.bulk.prefetch while the attention
#                             before it runs (lab/l2_prefetch.py; PREFETCH_ARGS)
#   lab/gpu-lab.sh centroid-config  the centroid head's kernel over its launch configurations at batches 1..64,
#                             in-graph (lab/centroid_config.py; CENTROID_CONFIG_ARGS)
#   lab/gpu-lab.sh row-kernels  warps per program of the one-program-per-row kernels (small top-k, the layer's norm
#                             chains) at the draft's sizes, in-graph (lab/row_kernels.py; ROW_KERNELS_ARGS)
#   lab/gpu-lab.sh pdl        programmatic dependent launch over a chain of dependent GEMVs in one CUDA graph: per
#                             launch, with and without it, the weights' first tile before the wait (lab/pdl_chain.py;
#                             PDL_ARGS; sm_90+)
#   lab/gpu-lab.sh persistent-mlp  the MLP at one row as one persistent kernel (a grid-wide barrier between gate/up
#                             and down) against graphcap's two launches, in-graph (lab/persistent_mlp.py)
#   lab/gpu-lab.sh ncu        Nsight Compute's speed-of-light, memory, occupancy and warp-stall sections for the first
#                             NCU_COUNT (14) attention and skinny-GEMM kernels of the batch-NCU_BATCH (1) iteration
#                             (NCU_TARGET=attention: the first 8 attention kernels of lab/attention_bw.py at
#                             batches 1 and 8, context 2048)
#   lab/gpu-lab.sh tests      the lab scripts' tests (lab/tests) on CUDA
# Several stages run in one call in order: lab/gpu-lab.sh kernels profile. Logs: $GPU_WORK/logs (default
# /tmp/graphcap-gpu), packed into $OUT/gpu-lab-<stages joined by ->.tar.gz (default OUT=out/gpu).
STAGES="gemm kernels host variants profile splits attention-grid regions layers prefetch centroid-config row-kernels"
STAGES+=" persistent-mlp ncu tests pdl"
DEFAULT_STAGE=kernels
PACK_NAME=gpu-lab
source "$(dirname "$0")/../scripts/gpu-lib.sh"

run_stage() {
local s run flag fresh v
case $1 in
  gemm)  # Inductor's max-autotune compiles go last and stop at the bench's --budget-s; the step is cut at 560 s so
    # that what ran comes back inside a 600 s call
    STEP_LIMIT=${STEP_LIMIT:-560} step skinny-gemm python3 lab/skinny_gemm.py ${GEMM_ARGS:-} --out "$LOG/skinny-gemm"
    ;;
  kernels)  # window advance; attention defaults vs sglang: L2 emptied by writing (do_bench), by reading, in-graph
    step window-advance python3 lab/window_advance.py --out "$LOG"
    step attention-defaults-dirty python3 lab/attention_bw.py --no-tune --out "$LOG/attention-dirty"
    step attention-defaults-clean python3 lab/attention_bw.py --no-tune --l2 clean --out "$LOG/attention-clean"
    step attention-defaults-in-graph python3 lab/attention_bw.py --no-tune --l2 in-graph \
      --out "$LOG/attention-in-graph"
    ;;
  host)  # host time of run()/replay()/the bare graph launch (GPU idle and busy); the graph's nodes by type
    step host-time python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 --buckets 8 \
      --backends cudagraph,inductor-cudagraph --census --out "$LOG/host-time"
    ;;
  variants)  # graphcap against one compile per bucket and the compiled baselines, same run
    step bench-variants python3 -m graphcap.cli bench --batch ${VARIANTS_BATCH:-1,8,64} --context 2048 --steps 3 \
      --modes ${BENCH_MODES:-graphcap-per-bucket,compile-plain,compile-tuned,graphcap} --out "$LOG/bench-variants"
    ;;
  profile)  # graphcap's iteration kernel by kernel
    for run in ${PROFILE_RUNS:-b1 skinny-b1 b8 skinny-b8}; do
      case $run in b1|b8) flag= ;; skinny-b1|skinny-b8) flag=--skinny-gemm ;;
        qnorm-b1|qnorm-b8) flag=--qnorm-kernel ;; twohead-b1|twohead-b8) flag=--two-head-proj ;;
        *) echo "PROFILE_RUNS: b1 skinny-b1 b8 skinny-b8 qnorm-b1 qnorm-b8 twohead-b1 twohead-b8, got $run" >&2
           exit 2 ;; esac
      step profile-$run python3 lab/profile_iteration.py --batch ${run##*b} --context 2048 $flag \
        --out "$LOG/profile-$run"
    done
    if [ -n "${PROFILE_CODE:-}" ]; then  # Inductor's generated code of the batch-8 iteration, from empty caches (a
      # warm cache logs no code), to read what its fused kernels compute (profile-b8-code.txt.gz)
      fresh=$WORK/code-$(date +%s)
      STEP_LIMIT=${STEP_LIMIT:-120} step profile-b8-code env TORCHINDUCTOR_CACHE_DIR=$fresh/inductor \
        TRITON_CACHE_DIR=$fresh/triton TORCH_LOGS=output_code TORCH_LOGS_OUT=$LOG/profile-b8-code.txt \
        python3 lab/profile_iteration.py --batch 8 --context 2048 --out "$fresh/out"
      gzip -f "$LOG/profile-b8-code.txt"
    fi
    ;;
  splits)  # the split rule (graphcap.kernels.attention.plan.target_programs): every split count at the default tiles,
    # timed in-graph, sliding and full layers over the batches; then the defaults at all 84 points in-graph beside
    # sglang's kernel
    step attention-split-sweep-sliding python3 lab/attention_bw.py --grid-splits --no-sglang --l2 in-graph \
      --rep-ms 5 --budget-s 400 --layers sliding --batches 1,2,4,8,16,32 --contexts 2048 \
      --out "$LOG/attention-split-sweep-sliding"
    step attention-split-sweep-full python3 lab/attention_bw.py --grid-splits --no-sglang --l2 in-graph \
      --rep-ms 5 --budget-s 400 --layers full --batches 1,2,4,8,16,32 --contexts 1024,2048,4096 \
      --out "$LOG/attention-split-sweep-full"
    step attention-in-graph-sglang python3 lab/attention_bw.py --no-tune --l2 in-graph \
      --out "$LOG/attention-in-graph-sglang"
    ;;
  attention-grid)  # the defaults were chosen from grids at the shapes near the 70%-of-copy line
    STEP_LIMIT=${STEP_LIMIT:-300} step attention-grid python3 lab/attention_bw.py --grid --no-sglang --l2 in-graph \
      --rep-ms 3 --batches "${ATTENTION_GRID_BATCH:-1}" --contexts 2048 --out "$LOG/attention-grid"
    ;;
  regions)  # capture_starts for each; the default first: a call cut short keeps it
    fresh=$WORK/regions-$(date +%s)
    for v in ${REGIONS_VARIANTS:-regions inlined}; do
      case $v in regions) capture_starts regions "$fresh/regions" inductor-cudagraph ;;
        inlined) capture_starts inlined "$fresh/inlined" inductor-cudagraph --inlined-layers ;;
        *) echo "REGIONS_VARIANTS: regions and/or inlined, got $v" >&2; exit 2 ;; esac
    done
    ;;
  layers)  # in the order that keeps what matters most if the call is cut
    for s in ${LAYERS_STEPS:-unit bench host profile replay}; do
      case $s in
        unit) step unit-layers python3 -m pytest -q -rs -m gpu tests/kernels/test_layer_fusions.py \
          tests/kernels/test_fused_ops.py ;;
        bench) step bench-layers python3 -m graphcap.cli bench --batch ${LAYERS_BATCH:-1,8,64} --context 2048 \
          --steps 3 \
          --modes ${BENCH_MODES:-graphcap-torch-ops,graphcap-skinny-gemm,compile-nosync,compile-plain,graphcap} \
          --out "$LOG/bench-layers" ;;
        host) step host-time python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 \
          --buckets 8 --backends inductor-cudagraph --out "$LOG/host-time" ;;
        profile)
          step profile-b8 python3 lab/profile_iteration.py --batch 8 --context 2048 --out "$LOG/profile-b8"
          step profile-torch-ops-b8 python3 lab/profile_iteration.py --batch 8 --context 2048 --torch-ops \
            --out "$LOG/profile-torch-ops-b8" ;;
        replay) STEP_LIMIT=${STEP_LIMIT:-300} step pytest-replay-dynamic python3 -m pytest -q -rs -m gpu \
          tests/engine/test_capture_gpu.py -k "${REPLAY_K:-dynamic or precompiled}" ;;
        *) echo "LAYERS_STEPS: unit bench host profile replay, got $s" >&2; exit 2 ;;
      esac
    done
    ;;
  prefetch)
    step l2-prefetch python3 lab/l2_prefetch.py ${PREFETCH_ARGS:-} --out "$LOG/l2-prefetch"
    ;;
  centroid-config)
    step centroid-config python3 lab/centroid_config.py ${CENTROID_CONFIG_ARGS:-} --out "$LOG/centroid-config"
    ;;
  row-kernels)
    step row-kernels python3 lab/row_kernels.py ${ROW_KERNELS_ARGS:-} --out "$LOG/row-kernels"
    ;;
  pdl)
    STEP_LIMIT=${STEP_LIMIT:-240} step pdl-chain python3 lab/pdl_chain.py ${PDL_ARGS:-} --out "$LOG/pdl-chain"
    ;;
  persistent-mlp)
    STEP_LIMIT=${STEP_LIMIT:-240} step persistent-mlp python3 lab/persistent_mlp.py --out "$LOG/persistent-mlp"
    ;;
  ncu)  # hardware counters (--clock-control none: clocks as they run) of the first attention and skinny-GEMM
    # launches of one iteration, or of the attention alone at context 2048 (its first launches, whose rows are full)
    local sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
                    --section WarpStateStats)
    case ${NCU_TARGET:-iteration} in
      iteration) STEP_LIMIT=${STEP_LIMIT:-400} step ncu env TORCHINDUCTOR_COMPILE_THREADS=1 ncu --clock-control none \
        -k regex:"_split_kernel|_combine_kernel|_skinny_kernel" -c "${NCU_COUNT:-14}" "${sections[@]}" \
        python3 lab/profile_iteration.py --batch "${NCU_BATCH:-1}" --context 2048 --out "$WORK/ncu-profile" ;;
      attention) STEP_LIMIT=${STEP_LIMIT:-400} step ncu-attention ncu --clock-control none \
        -k regex:"_split_kernel|_combine_kernel" -c "${NCU_COUNT:-8}" "${sections[@]}" python3 lab/attention_bw.py \
        --no-tune --no-sglang --l2 in-graph --batches "${NCU_BATCH:-1,8}" --contexts 2048 --out "$WORK/ncu-attention" ;;
      *) echo "NCU_TARGET: iteration or attention, got $NCU_TARGET" >&2; exit 2 ;;
    esac
    ;;
  tests)  # the lab scripts' tests, GPU-marked ones included
    step pytest-lab python3 -m pytest -q -rs lab/tests
    ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
}

gpu_main "$@"
