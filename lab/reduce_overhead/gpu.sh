#!/usr/bin/env bash
# Issue 44 on a CUDA machine: reduce-overhead's illegal memory access in sglang's engine (lab/reduce_overhead/README.md
# says what each stage tells). Run from the repository root with sglang 0.5.23's wheels in ./.whl (carry .whl), as
# scripts/gpu-check.sh's engine stages are run. Stages, each a step with its own time limit, several per call in order:
#   tools      where compute-sanitizer is and its version, then a planted out-of-bounds read from a Triton kernel in
#              a torch process under memcheck (must be reported): ~30-60 s
#   repros     the standalone reproductions, no sglang: repro_piecewise_tree.py (as served: side streams; then on one
#              stream), repro_shared_pool_outputs.py: ~2-4 min cold
#   crash      the failing case as it crashed: reduce-overhead, draft-shapes pair, batch 1, 2048-token prompt, all
#              seven buckets, no extra logging (makes the checkpoint first, ~1 min, once per machine): ~3-4 min cold
#   crash-one  the same with bucket 1 alone (one tree path: is sharing the pool between buckets needed?): ~2 min cold
#   logs       crash-one with TORCH_LOGS=cudagraphs,recompiles,graph_breaks (what the tree records/warms/re-records
#              at serve, which frames Dynamo skips): ~2 min
#   localize   crash-one with GRAPHCAP_LAB_SYNC=1: a device sync at each phase edge (before the draft, after the
#              replay, after the tree kernel, after the verify); the first failing edge names the phase: ~2 min
#   memcheck   crash-one under compute-sanitizer memcheck (RO_SAN_BUCKETS: other buckets): the faulting kernel,
#              address and allocation; 3-8 min (warm caches: run after crash or crash-one in the same call)
#   initcheck, racecheck, synccheck  the same under those tools (initcheck is slow: reads of never-written device
#              memory; racecheck/synccheck check shared-memory and barrier hazards inside kernels only)
#   csan       crash-one under PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1): an unsynchronized use of one
#              tensor on two streams, named with both stack traces (eager ops only; graph replays are opaque): ~3 min
#   bisect     crash-one variants, one engine each (RO_BISECT, default all): blocking (CUDA_LAUNCH_BLOCKING=1 alone),
#              treesync (Inductor's force_cudagraph_sync: a sync after every tree replay), notrees (Inductor's
#              cudagraphify without trees: no shared tree pool), sglangproj (sglang's projections, as at 5f67d6c),
#              prompt512: ~2 min each with warm caches
#   control    the cudagraph backend (served) under memcheck, same case: a latent out-of-bounds access that every
#              backend has would show here too: 3-8 min
#   workspace  repro_cublas_workspace.py (torch alone): an earlier graph's cuBLAS workspace after a CUDA-graph tree
#              (then manual graphs, then nothing) warmed up and recorded another function - freed or not, reused,
#              clobbered; then the tree case returned to the driver, plain and under memcheck: ~1-2 min
#   keepws     memcheck again with GRAPHCAP_LAB_KEEP_CUBLAS=1 (the tree no longer clears cuBLAS's workspaces): what
#              the tree does without its clear (it refused its own recording: the bucket ran eagerly): 2-4 min
#   recapture  issue 54's capture order: reduce-overhead with GRAPHCAP_LAB_RECAPTURE=1 (sglang's target graphs captured
#              again after graphcap's trees, the trees then sealed), all seven buckets, batch RO_RECAPTURE_BATCH (8),
#              512-token prompts; then stock sglang's draft on the same requests; $LOG/recapture.json: finished, the
#              tokens equal or the first difference, late tree work: ~5-6 min cold (RO_RECAPTURE_REFERENCE: an earlier
#              call's stock summary for the same case, instead of a stock run)
#   recapture-memcheck  the recapture case under compute-sanitizer memcheck (bucket 1, batch 1): 3-8 min
# Each engine run writes $LOG/<step>.json (engine_case.py's summary: crashed, CUDA error, sanitizer reports, probe
# events, manifests, tree log counts) and $LOG/<step>/ (child.log, probe, manifests, sanitizer logs), all packed into
# $OUT/reduce-overhead-<stages>.tar.gz. RO_CASE: more engine_case.py arguments for every engine run (e.g.
# "--batch 8 --prompt-len 512"); RO_STEP_LIMIT: seconds per engine run (default 300; sanitizer runs 540).
STAGES="tools repros crash crash-one logs localize memcheck initcheck racecheck synccheck csan bisect control"
STAGES+=" workspace keepws recapture recapture-memcheck"
DEFAULT_STAGE=tools
PACK_NAME=reduce-overhead
source "$(dirname "$0")/../../scripts/gpu-lib.sh"

SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
      /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)

ckpt() {  # the draft-shapes pair, once per machine (scripts/gpu-check.sh engine-speed makes the same one)
  engine_env
  [ -f "$WORK/ckpt-ds/target/config.json" ] || \
    step ckpt-draft-shapes python3 bench/sglang_checkpoint.py --size draft-shapes --out "$WORK/ckpt-ds" --device cuda
}

engine_run() {  # engine_run NAME [VAR=VALUE...] [-- engine_case.py args...]: one engine, killed inside its step limit
  local name=$1; shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  local limit=${RO_STEP_LIMIT:-300}
  STEP_LIMIT=$limit step "$name" env "${envs[@]}" python3 lab/reduce_overhead/engine_case.py --ckpt "$WORK/ckpt-ds" \
    --work "$LOG/$name" --out "$LOG/$name.json" --timeout-s $((limit - 20)) ${RO_CASE:-} "$@"
}

san_run() {  # san_run TOOL NAME [engine_case.py args...]: one engine under compute-sanitizer
  local tool=$1 name=$2; shift 2
  if [ -z "$SAN" ]; then
    echo "== $name: compute-sanitizer not found on this machine (PATH, /usr/local/cuda*/bin, /opt/nvidia): skipped" \
      | tee -a "$LOG/commands.txt"
    return
  fi
  mkdir -p "$LOG/$name"
  RO_STEP_LIMIT=${RO_STEP_LIMIT:-540} engine_run "$name" -- --buckets "${RO_SAN_BUCKETS:-1}" \
    --wrap "$SAN --tool $tool --target-processes all --report-api-errors no --leak-check no --print-limit 20 \
--show-backtrace device --log-file $LOG/$name/sanitizer-%p.log" "$@"
}

run_stage() {
local v
case $1 in
  tools)
    { echo "compute-sanitizer: ${SAN:-not found (PATH, /usr/local/cuda*/bin, /opt/nvidia)}"
      [ -n "$SAN" ] && "$SAN" --version
      command -v nvcc >/dev/null && nvcc --version | tail -2
      python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)"; } > "$LOG/tools.txt" 2>&1
    cat "$LOG/tools.txt"
    if [ -n "$SAN" ]; then
      STEP_LIMIT=${STEP_LIMIT:-180} step planted-oob "$SAN" --tool memcheck --report-api-errors no --print-limit 5 \
        python3 lab/reduce_overhead/planted_oob.py
    fi
    ;;
  repros)
    (cd lab/reduce_overhead && STEP_LIMIT=${STEP_LIMIT:-240} step repro-piecewise-tree python3 repro_piecewise_tree.py \
      --out "$LOG/repro-piecewise-tree.json")
    (cd lab/reduce_overhead && STEP_LIMIT=${STEP_LIMIT:-180} step repro-piecewise-tree-one-stream python3 \
      repro_piecewise_tree.py --same-stream --out "$LOG/repro-piecewise-tree-one-stream.json")
    (cd lab/reduce_overhead && STEP_LIMIT=${STEP_LIMIT:-120} step repro-shared-pool python3 \
      repro_shared_pool_outputs.py --out "$LOG/repro-shared-pool.json")
    ;;
  crash) ckpt; engine_run crash ;;
  crash-one) ckpt; engine_run crash-one -- --buckets 1 ;;
  logs) ckpt; engine_run logs TORCH_LOGS=cudagraphs,recompiles,graph_breaks -- --buckets 1 ;;
  localize) ckpt; engine_run localize GRAPHCAP_LAB_SYNC=1 -- --buckets 1 ;;
  memcheck|initcheck|racecheck|synccheck) ckpt; san_run "$1" "$1" ;;
  csan) ckpt; engine_run csan TORCH_CUDA_SANITIZER=1 -- --buckets 1 ;;
  bisect)
    ckpt
    for v in ${RO_BISECT:-blocking treesync notrees sglangproj prompt512}; do
      case $v in
        blocking) engine_run bisect-blocking CUDA_LAUNCH_BLOCKING=1 -- --buckets 1 ;;
        treesync) engine_run bisect-treesync GRAPHCAP_LAB_INDUCTOR=force_cudagraph_sync=1 -- --buckets 1 ;;
        notrees) engine_run bisect-notrees GRAPHCAP_LAB_INDUCTOR=cudagraph_trees=0 -- --buckets 1 ;;
        sglangproj) engine_run bisect-sglangproj -- --buckets 1 --projections sglang ;;
        prompt512) engine_run bisect-prompt512 -- --buckets 1 --prompt-len 512 ;;
        *) echo "RO_BISECT: blocking treesync notrees sglangproj prompt512, got $v" >&2; exit 2 ;;
      esac
    done
    ;;
  control) ckpt; san_run memcheck control-cudagraph-memcheck --backend cudagraph ;;
  workspace)
    for v in tree manual none; do
      STEP_LIMIT=${STEP_LIMIT:-120} step "repro-cublas-$v" python3 lab/reduce_overhead/repro_cublas_workspace.py \
        --other "$v" --out "$LOG/repro-cublas-$v.json"
    done
    STEP_LIMIT=${STEP_LIMIT:-120} step repro-cublas-tree-unmap python3 lab/reduce_overhead/repro_cublas_workspace.py \
      --other tree --unmap --out "$LOG/repro-cublas-tree-unmap.json"
    if [ -n "$SAN" ]; then
      STEP_LIMIT=${STEP_LIMIT:-240} step repro-cublas-tree-unmap-memcheck "$SAN" --tool memcheck --report-api-errors no \
        --print-limit 5 python3 lab/reduce_overhead/repro_cublas_workspace.py --other tree --unmap
    fi
    ;;
  keepws) ckpt; GRAPHCAP_LAB_KEEP_CUBLAS=1 san_run memcheck keepws-memcheck ;;
  recapture)
    ckpt
    v="--batch ${RO_RECAPTURE_BATCH:-8} --prompt-len 512 --new 96"
    engine_run recapture-ro GRAPHCAP_LAB_RECAPTURE=1 -- $v
    local ref=${RO_RECAPTURE_REFERENCE:-$LOG/recapture-stock.json}  # an earlier call's stock run, same case
    [ -n "${RO_RECAPTURE_REFERENCE:-}" ] || engine_run recapture-stock -- --backend '' $v
    step recapture-compare python3 lab/reduce_overhead/compare_tokens.py "$LOG/recapture-ro.json" "$ref" \
      --out "$LOG/recapture.json"
    ;;
  recapture-memcheck) ckpt; GRAPHCAP_LAB_RECAPTURE=1 san_run memcheck recapture-memcheck ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
}

gpu_main "$@"
