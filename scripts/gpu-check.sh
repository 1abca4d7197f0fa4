#!/usr/bin/env bash
# Every GPU test and benchmark of graphcap, for a CUDA machine (docs/results.md: an H200). Logs and tables go to
# $GPU_WORK/logs (default /tmp/graphcap-gpu) and are packed into $OUT/gpu-<stages joined by ->.tar.gz (default OUT=out/gpu).
#   scripts/gpu-check.sh perf     capture cost (cold and warm Inductor caches, host time per call), per-kernel
#                                 profile of an iteration, attention GPU tests + default configs vs sglang
#   scripts/gpu-check.sh smoke    quick (the default stage): CUDA unit tests of window/attention/model + a tiny bench
#   scripts/gpu-check.sh unit     the kernels' GPU tests (attention, plan, centroid head, small top-k, candidate
#                                 pick, fused ops, layer fusions, skinny GEMM; UNIT_TESTS: other test files)
#   scripts/gpu-check.sh tests    the whole pytest suite on CUDA (GPU-marked tests included), attention tuning grid
#                                 (more than one 600 s call: TESTS_PATHS runs some files, TESTS_GRID=0 skips the grid)
#   scripts/gpu-check.sh gemm     bench/skinny_gemm.py: the skinny GEMM's candidates and plan vs cuBLAS and Inductor
#                                 max-autotune at the draft's matmul shapes, M 1..64 (skinny_gemm.{json,md})
#   scripts/gpu-check.sh kernels  bench/window_advance.py, bench/attention_bw.py defaults timed three ways (L2
#                                 emptied by writing / by reading; in-graph among other work)
#   scripts/gpu-check.sh capture-warm  all buckets from the warm caches an earlier stage left, host time, census
#   scripts/gpu-check.sh host-affinity  host time per call, 3 runs free / 3 pinned to a core near the GPU
#   scripts/gpu-check.sh host     host time per call (GPU idle / busy) and a census of the graph's nodes, batch 8
#   scripts/gpu-check.sh bench    `graphcap bench`: graphcap / compile(-nosync, -plain) / sglang / eager-rebuild
#                                 over batch 1..64 at context 2048, 3 steps (bench.json in $LOG/bench-small, -large;
#                                 BENCH_PARTS=small or large: one of the two runs, for a call of its own;
#                                 BENCH_MODES: another mode list)
#   scripts/gpu-check.sh capture  one compile for every bucket + the compile cache: cold, warm restart, warm restart
#                                 with other pool sizes; host time per call (inductor-cudagraph, reduce-overhead);
#                                 the three starts again with the iteration precompiled; both warm restarts under
#                                 cProfile (capture_starts; CAPTURE_RUNS="cold warm ...": only those starts)
#   scripts/gpu-check.sh capture-all  gemma4 replay tests over every bucket (Inductor backends)
#   scripts/gpu-check.sh replay   the replay-equality suite (incl. dynamic_batch and a precompiled iteration) and
#                                 the bench's GPU tests
#   scripts/gpu-check.sh profile  bench/profile_iteration.py at batch 1 and 8, cuBLAS and skinny-GEMM projections
#   scripts/gpu-check.sh dynamic  the one compile for every bucket: replay-equality tests, attention/plan GPU tests,
#                                 the skinny GEMM's candidates
#   scripts/gpu-check.sh variants graphcap against one compile per bucket (what the one compile for all costs per
#                                 iteration) and the best compiled baseline, compile-plain, in one bench run at
#                                 batches 1, 8, 64
#   scripts/gpu-check.sh replay-dynamic  the replay-equality tests of the one compile for every bucket and of the
#                                 precompiled iteration (the default capture; REPLAY_K: another -k)
#   scripts/gpu-check.sh regions  each draft layer a nested compile region (the default) against the layers
#                                 inlined (DraftLoop(layer_regions=False)), same machine: the capture stage's
#                                 starts and host time for each (REGIONS_VARIANTS=regions: the default alone)
#   scripts/gpu-check.sh layers   the layer's small ops as graphcap's kernels (the default) against torch ops
#                                 Inductor fuses: their GPU tests, the bench at batches 1, 8, 64 (graphcap-torch-ops,
#                                 graphcap-skinny-gemm, compile-nosync, compile-plain, graphcap; BENCH_MODES: others),
#                                 host time per call, the per-kernel profile at batch 8 both ways, the default
#                                 capture's replay tests (LAYERS_STEPS: a subset of unit bench host profile replay;
#                                 LAYERS_BATCH: the bench's batches)
#   scripts/gpu-check.sh bench8   the draft-phase bench at batch 8 over contexts 256..32000
#   scripts/gpu-check.sh check    the whole suite on CUDA, attention defaults in-graph vs sglang, bench at batch 8
#   scripts/gpu-check.sh splits   the split rule: split counts timed in-graph, defaults vs sglang in-graph,
#                                 kernel/model tests, gemma4 replay tests
#   scripts/gpu-check.sh prefetch an experiment: a projection's weights pulled into L2 by cp.async.bulk.prefetch
#                                 while the attention before it runs (bench/l2_prefetch.py; PREFETCH_ARGS)
#   scripts/gpu-check.sh centroid-config  the centroid head's kernel over its launch configurations at batches
#                                 1..64, in-graph (bench/centroid_config.py; CENTROID_CONFIG_ARGS)
#   scripts/gpu-check.sh row-kernels  warps per program of the one-program-per-row kernels (small top-k, the layer's
#                                 norm chains) at the draft's sizes, in-graph (bench/row_kernels.py; ROW_KERNELS_ARGS)
#   scripts/gpu-check.sh persistent-mlp  an experiment: the MLP at one row as one persistent kernel (a grid-wide
#                                 barrier between gate/up and down) against graphcap's two launches, in-graph
#                                 (bench/persistent_mlp.py)
#   scripts/gpu-check.sh attention-grid  the attention's tile configs x split counts in-graph at batch
#                                 ATTENTION_GRID_BATCH (1), context 2048 (bench/attention_bw.py --grid)
#   scripts/gpu-check.sh ncu      Nsight Compute's speed-of-light, memory, occupancy and warp-stall sections for the
#                                 first NCU_COUNT (14) attention and skinny-GEMM kernels of the batch-NCU_BATCH (1)
#                                 iteration (bench/profile_iteration.py under ncu; NCU_TARGET=attention: the first 8
#                                 attention kernels of bench/attention_bw.py at batches 1 and 8, context 2048)
#   scripts/gpu-check.sh engine-check  sglang's own engine with and without --enable-draft-graph-capture (per
#                                 backend) on a tiny structured Gemma 4 pair: tokens, drafts, acceptance, manifests
#                                 (ENGINE_RETRACT=N: every engine retracts running requests every N forwards)
#   scripts/gpu-check.sh engine-speed  the same on the draft-shapes pair: draft-phase GPU time and decode tok/s per
#                                 batch, stock sglang vs graphcap vs the target alone (each engine stage wants a
#                                 call of its own: an engine starts in 40-150 s; ENGINE_BACKENDS picks the backends;
#                                 ENGINE_PROFILE=8,64: kernel tables of the draft at those batches, every engine;
#                                 ENGINE_SPEED_ENGINES=sglang,graphcap: leave the target alone out; ENGINE_REPEATS;
#                                 ENGINE_CONTEXT: the prompts' length, default 2048; ENGINE_PROJECTIONS=graphcap,sglang:
#                                 graphcap once per --draft-graph-projections value)
#   scripts/gpu-check.sh engine-refusal  a real engine start with each setting the plugin refuses (tiny pair): the
#                                 error raised, its message and how soon
# Several stages run in one call in order: scripts/gpu-check.sh kernels capture-all.
# sglang's kernels are used when ./.whl holds sglang 0.5.23's wheels (for a machine without network).
# A copied checkout's .git may be stale: `git rev-parse --short HEAD > .gpu-commit` here (ignored; carry it) records
# the commit the tree is at in env-<stage>.txt.
set -uo pipefail
tree_hash() {  # the code that runs: graphcap/, bench/, tests/, scripts/ (tracked or not), content only
  (cd "$(dirname "$0")/.." && find graphcap bench tests scripts -type f \( -name '*.py' -o -name '*.sh' -o -name '*.toml' \) \
    -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12)
}
[ "${1:-}" = "--tree-hash" ] && { tree_hash; exit 0; }
[ $# -eq 0 ] && set -- smoke
STAGES="perf smoke unit gemm tests replay kernels capture-warm host-affinity host bench capture capture-all variants"
STAGES+=" profile bench8 check splits engine-check engine-speed dynamic replay-dynamic regions layers prefetch"
STAGES+=" centroid-config engine-refusal row-kernels ncu persistent-mlp attention-grid"
for stage in "$@"; do  # every name checked before anything runs
  case " $STAGES " in *" $stage "*) ;; *) echo "unknown stage $stage (stages: $STAGES)" >&2; exit 2 ;; esac
done
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}            # what comes back: one tarball per call (re-packed after each step) and the command log
WORK=${GPU_WORK:-/tmp/graphcap-gpu}
LOG=$WORK/logs
mkdir -p "$LOG" "$OUT"
export PYTHONUNBUFFERED=1
# Bytecode for every module in one writable place: the device's torch has no usable .pyc (each process compiled
# ~550-950 of torch's sources, 2.4-3.0 s of every capture start), where a pip-installed torch has them
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$WORK/pycache}
unset PYTHONDONTWRITEBYTECODE
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/sglang ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
engine_env() {  # sglang's engine finds graphcap's plugin through its entry point (an installed dist-info) and
  # imports the sgl_kernel stand-in (tests/support) in every subprocess
  if [ ! -d /tmp/graphcap-dist ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/graphcap-dist . >/dev/null
  fi
  export PYTHONPATH=$PWD:$PWD/tests/support:/tmp/graphcap-dist${PYTHONPATH:+:$PYTHONPATH}
  export GRAPHCAP_COMMIT=$(cat .gpu-commit 2>/dev/null)
}
export GRAPHCAP_MANIFEST_DIR=$LOG/manifests
# Inductor's and Triton's on-disk caches live in $WORK: later stages on the same (still warm) machine reuse what an
# earlier stage compiled. The perf stage measures a cold start in fresh directories of its own.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton-cache}

env_report() {  # the one environment report (graphcap.bench.environment), plus what only nvidia-smi says
  python3 -m graphcap.bench.environment
  nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv
  # .gpu-commit can be stale (a tree with later changes): this hash of the code that ran names the tree exactly;
  # `scripts/gpu-check.sh --tree-hash` at a commit here gives the same value
  echo "tree hash $(tree_hash)"
}

step() {  # step NAME CMD...: run, keep the log, report the exit code and time ($STEP_LIMIT s at most, if set)
  local name=$1; shift
  echo "== $name: $*" | tee -a "$LOG/commands.txt"
  local t0=$SECONDS
  timeout "${STEP_LIMIT:-0}" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG/commands.txt"
  tail -n 25 "$LOG/$name.log"
  pack
}

capture_starts() {  # capture_starts NAME DIR HOST_BACKENDS [FLAG...]: the start-up of one compile for every bucket
  # with the compile cache, in fresh caches under DIR: empty caches, a warm restart, a warm restart with other KV pool
  # sizes (another context); host time per call at batch 8 over HOST_BACKENDS; the same three starts with the
  # iteration precompiled (own caches); last, both warm restarts again under cProfile (where their host time goes;
  # its overhead makes them no timing). FLAGs go to every capture_cost.py run; logs capture[-NAME]-<start>.
  local name=${1:+-$1} dir=$2 host=$3; shift 3
  mkdir -p "$dir/cc" "$dir/pre-cc"; chmod 700 "$dir" "$dir/cc" "$dir/pre-cc"
  local run what ctx pre prof
  for run in cold:2048:: warm:2048:: warm-other-pools:4096:: host:2048:: pre-cold:2048:pre: pre-warm:2048:pre: \
             pre-warm-other-pools:4096:pre: warm-profiled:2048::prof pre-warm-profiled:2048:pre:prof; do
    IFS=: read -r what ctx pre prof <<< "$run"
    case " ${CAPTURE_RUNS:-$what} " in *" $what "*) ;; *) continue ;; esac  # CAPTURE_RUNS: only these starts
    local only=(--capture-only --backends inductor-cudagraph)
    [ "$what" = host ] && only=(--backends "$host")
    local precomp=--no-precompile; [ -n "$pre" ] && precomp=--precompile
    step capture$name-$what env TORCHINDUCTOR_CACHE_DIR=$dir/${pre}inductor TRITON_CACHE_DIR=$dir/${pre}triton \
      python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context "$ctx" --dynamic-batch \
      "${only[@]}" "$precomp" ${prof:+--profile-capture} "$@" --compile-cache "$dir/${pre:+pre-}cc" \
      --out "$LOG/capture$name-$what"
  done
}

run_stage() {
local stage=$1
env_report > "$LOG/env-$stage.txt" 2>&1
cat "$LOG/env-$stage.txt"
case $stage in
  perf)
    cold=$WORK/cold-$(date +%s)
    step capture-cost-cold env TORCHINDUCTOR_CACHE_DIR=$cold/inductor TRITON_CACHE_DIR=$cold/triton \
      python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 \
      --backends cudagraph,inductor-cudagraph --out "$LOG/capture-cold"
    step capture-cost-warm env TORCHINDUCTOR_CACHE_DIR=$cold/inductor TRITON_CACHE_DIR=$cold/triton \
      python3 bench/capture_cost.py --spec gemma4-31b-assistant --capture-only --backends inductor-cudagraph \
      --out "$LOG/capture-warm"
    mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"  # later stages start from what this one compiled
    cp -r "$cold/inductor/." "$TORCHINDUCTOR_CACHE_DIR/"; cp -r "$cold/triton/." "$TRITON_CACHE_DIR/"
    step profile-iteration python3 bench/profile_iteration.py --batch 8 --context 2048 --out "$LOG/profile"
    step attention-gpu-tests python3 -m pytest -q -rs -m gpu tests/test_attention.py
    step attention-defaults python3 bench/attention_bw.py --no-tune --out "$LOG/attention-defaults"
    ;;
  smoke)
    step smoke-pytest python3 -m pytest -q -x tests/test_window.py tests/test_attention.py tests/test_models.py
    step smoke-bench python3 -m graphcap.cli bench --spec tiny --batch 1,4 --context 64 --iters 5 --repeats 1 \
      --modes graphcap,compile,sglang,eager-rebuild --out "$LOG/bench-smoke"
    ;;
  unit)  # the kernels' GPU tests alone (attention, its plan, the centroid head, small top-k, the candidate pick,
    # fused ops, layer fusions, skinny GEMM): quick (UNIT_TESTS: other test files)
    step unit-gpu python3 -m pytest -q -rs -m gpu ${UNIT_TESTS:-tests/test_attention.py tests/test_attention_plan.py \
      tests/test_centroid_head.py tests/test_small_topk.py tests/test_candidate_pick.py tests/test_fused_ops.py \
      tests/test_layer_fusions.py tests/test_skinny_gemm.py}
    ;;
  gemm)  # the skinny GEMM vs cuBLAS and Inductor per shape and M; Inductor's max-autotune compiles go last and stop
    # at the bench's --budget-s, and the step is cut at 560 s so that what ran comes back inside a 600 s call
    # GEMM_ARGS: other bench/skinny_gemm.py options (e.g. --no-inductor --ms 1,8,16; --ceiling: the read-only kernels;
    # --read-grids sweep: the read kernel over other grids)
    STEP_LIMIT=${STEP_LIMIT:-560} step skinny-gemm python3 bench/skinny_gemm.py ${GEMM_ARGS:-} --out "$LOG/skinny-gemm"
    ;;
  tests)  # the whole suite, then the attention grid at the shapes short of 70% of copy bandwidth (TESTS_ARGS: pytest's
    # options instead of -q -rs, e.g. -v for a per-test log that a cut call keeps; TESTS_PATHS: some test files or
    # ids instead of tests/ - the whole suite takes more than one call; TESTS_GRID=0: the suite alone)
    step pytest python3 -m pytest ${TESTS_ARGS:--q -rs} ${TESTS_PATHS:-tests/}
    if [ "${TESTS_GRID:-1}" != 0 ]; then
      step attention-grid-sliding python3 bench/attention_bw.py --grid --rep-ms 5 --layers sliding --batches 8 \
        --contexts 1024 --out "$LOG/attention-grid-sliding"
      step attention-grid-full python3 bench/attention_bw.py --grid --rep-ms 5 --layers full --batches 8,16 \
        --contexts 2048,4096 --out "$LOG/attention-grid-full"
    fi
    ;;
  kernels)  # window advance; attention defaults vs sglang: L2 emptied by writing (do_bench), by reading, in-graph
    step window-advance python3 bench/window_advance.py --out "$LOG"
    step attention-defaults-dirty python3 bench/attention_bw.py --no-tune --out "$LOG/attention-dirty"
    step attention-defaults-clean python3 bench/attention_bw.py --no-tune --l2 clean --out "$LOG/attention-clean"
    step attention-defaults-in-graph python3 bench/attention_bw.py --no-tune --l2 in-graph \
      --out "$LOG/attention-in-graph"
    ;;
  capture-warm)  # every bucket captured from warm caches (what a server restart pays; run after perf, whose
    # capture_cost run builds KV pools of the same shapes - Inductor's cache is keyed on them)
    step capture-warm-all python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 \
      --backends cudagraph,inductor-cudagraph --census --out "$LOG/capture-warm-all"
    ;;
  host-affinity)  # host time per call, three runs free and three pinned to one core of the GPU's NUMA node
    nvidia-smi topo -m > "$LOG/topo.txt" 2>&1; cat "$LOG/topo.txt"
    cpus=$(nvidia-smi topo -m 2>/dev/null | awk '$1 == "GPU0" {for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$/) {print $i; exit}}')
    core=${cpus%%[-,]*}
    for i in 1 2 3; do
      step host-free-$i python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 \
        --buckets 8 --backends inductor-cudagraph --out "$LOG/host-free-$i"
      step host-pinned-$i taskset -c "${core:-0}" python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 \
        --context 2048 --buckets 8 --backends inductor-cudagraph --out "$LOG/host-pinned-$i"
    done
    ;;
  host)  # host time of run()/replay()/the bare graph launch (GPU idle and busy); the graph's nodes by type
    step host-time python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 --buckets 8 \
      --backends cudagraph,inductor-cudagraph --census --out "$LOG/host-time"
    ;;
  bench)  # iter/s vs batch against sglang's launches and a user's torch.compile loop (bench.json in
    # $LOG/bench-small and bench-large; the context sweep at batch 8 is stage bench8). The sglang modules the bench imports (decode
    # attention, index builder, split rule, Gemma 4 post-MLP norm) import no sgl_kernel, so tests/support stays off
    # PYTHONPATH here.
    # Two runs (each compiles its own buckets), so that a call cut at its time limit keeps the first. With six modes
    # from empty caches they take ~5 + ~4 minutes: more than one 600 s call, so BENCH_PARTS=small and
    # BENCH_PARTS=large (a call each) split them.
    for part in ${BENCH_PARTS:-small large}; do
      case $part in small) part=small:1,2,4,8 ;; large) part=large:16,32,64 ;;
        *) echo "BENCH_PARTS: small and/or large, got $part" >&2; exit 2 ;; esac
      STEP_LIMIT=${STEP_LIMIT:-420} step bench-${part%%:*} python3 -m graphcap.cli bench --batch ${part##*:} \
        --context 2048 --steps 3 --modes ${BENCH_MODES:-graphcap,compile,compile-nosync,compile-plain,compile-tuned,sglang,eager-rebuild} \
        --out "$LOG/bench-${part%%:*}"
    done
    ;;
  capture)  # start-up cost of one compile for every bucket (dynamic batch) with the compile cache (capture_starts)
    capture_starts "" "$WORK/capture-$(date +%s)" inductor-cudagraph,reduce-overhead
    ;;
  capture-all)  # the replay-equality test for the gemma4 spec over every bucket (compile-heavy: ~25 s per bucket);
    # cut at 560 s so that what ran still comes back inside a 600 s per-command limit
    STEP_LIMIT=${STEP_LIMIT:-560} step pytest-capture-all env GRAPHCAP_GPU_ALL_BUCKETS=1 python3 -m pytest -q -rs tests/test_capture_gpu.py \
      -k "gemma4 and (inductor-cudagraph or reduce-overhead) and not dynamic"
    ;;
  replay)  # the replay-equality suite alone (every backend, dynamic_batch, a precompiled iteration over larger
    # pools) and the bench's GPU tests (sync and kernel counters)
    STEP_LIMIT=${STEP_LIMIT:-560} step pytest-replay python3 -m pytest -q -rs tests/test_capture_gpu.py \
      tests/test_bench.py -m gpu
    ;;
  dynamic)  # the one compile for every bucket: its replay-equality tests (tiny and gemma4 specs), the attention
    # kernels' and plans' GPU tests (each bucket's grid from one plan for any batch), the skinny GEMM's candidates
    STEP_LIMIT=${STEP_LIMIT:-300} step pytest-dynamic python3 -m pytest -q -rs -m gpu tests/test_capture_gpu.py \
      -k dynamic
    step pytest-dynamic-kernels python3 -m pytest -q -rs -m gpu tests/test_attention.py tests/test_attention_plan.py \
      tests/test_skinny_gemm.py
    ;;
  profile)  # graphcap's iteration kernel by kernel at batch 1 and 8, as it ships and with the skinny GEMM at every
    # batch (PROFILE_RUNS: a subset of b1 skinny-b1 b8 skinny-b8, or qnorm-b1/-b8 / twohead-b1/-b8: less one lever;
    # PROFILE_CODE=1: also the batch-8 iteration's generated code)
    for run in ${PROFILE_RUNS:-b1 skinny-b1 b8 skinny-b8}; do
      case $run in b1|b8) flag= ;; skinny-b1|skinny-b8) flag=--skinny-gemm ;;
        qnorm-b1|qnorm-b8) flag=--qnorm-kernel ;; twohead-b1|twohead-b8) flag=--two-head-proj ;;
        *) echo "PROFILE_RUNS: b1 skinny-b1 b8 skinny-b8 qnorm-b1 qnorm-b8 twohead-b1 twohead-b8, got $run" >&2
           exit 2 ;; esac
      step profile-$run python3 bench/profile_iteration.py --batch ${run##*b} --context 2048 $flag \
        --out "$LOG/profile-$run"
    done
    if [ -n "${PROFILE_CODE:-}" ]; then  # PROFILE_CODE=1: Inductor's generated code of the batch-8 iteration, from
      # empty caches (a warm cache logs no code), to read what its fused kernels compute (profile-b8-code.txt.gz)
      fresh=$WORK/code-$(date +%s)
      STEP_LIMIT=${STEP_LIMIT:-120} step profile-b8-code env TORCHINDUCTOR_CACHE_DIR=$fresh/inductor \
        TRITON_CACHE_DIR=$fresh/triton TORCH_LOGS=output_code TORCH_LOGS_OUT=$LOG/profile-b8-code.txt \
        python3 bench/profile_iteration.py --batch 8 --context 2048 --out "$fresh/out"
      gzip -f "$LOG/profile-b8-code.txt"
    fi
    ;;
  variants)  # graphcap against one compile per bucket and compile-plain, same run (VARIANTS_BATCH: other batches)
    step bench-variants python3 -m graphcap.cli bench --batch ${VARIANTS_BATCH:-1,8,64} --context 2048 --steps 3 \
      --modes ${BENCH_MODES:-graphcap-per-bucket,compile-plain,compile-tuned,graphcap} --out "$LOG/bench-variants"
    ;;
  regions)  # each draft layer a nested compile region against the inlined layers, same machine (capture_starts
    # for each; the replay tests with regions are replay-dynamic's)
    fresh=$WORK/regions-$(date +%s)
    for v in ${REGIONS_VARIANTS:-regions inlined}; do  # the default first: a call cut short keeps it
      case $v in regions) capture_starts regions "$fresh/regions" inductor-cudagraph ;;
        inlined) capture_starts inlined "$fresh/inlined" inductor-cudagraph --inlined-layers ;;
        *) echo "REGIONS_VARIANTS: regions and/or inlined, got $v" >&2; exit 2 ;; esac
    done
    ;;
  replay-dynamic)  # the default capture's replay tests alone: one compile for every bucket, the precompiled iteration
    STEP_LIMIT=${STEP_LIMIT:-300} step pytest-replay-dynamic python3 -m pytest -q -rs -m gpu \
      tests/test_capture_gpu.py -k "${REPLAY_K:-dynamic or precompiled}"
    ;;
  layers)  # graphcap's layer kernels (LAYER_KERNEL_OPS, the default) against the torch ops Inductor fuses, in the order
    # that keeps what matters most if the call is cut
    for s in ${LAYERS_STEPS:-unit bench host profile replay}; do
      case $s in
        unit) step unit-layers python3 -m pytest -q -rs -m gpu tests/test_layer_fusions.py tests/test_fused_ops.py ;;
        bench) step bench-layers python3 -m graphcap.cli bench --batch ${LAYERS_BATCH:-1,8,64} --context 2048 \
          --steps 3 \
          --modes ${BENCH_MODES:-graphcap-torch-ops,graphcap-skinny-gemm,compile-nosync,compile-plain,graphcap} \
          --out "$LOG/bench-layers" ;;
        host) step host-time python3 bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 \
          --buckets 8 --backends inductor-cudagraph --out "$LOG/host-time" ;;
        profile)
          step profile-b8 python3 bench/profile_iteration.py --batch 8 --context 2048 --out "$LOG/profile-b8"
          step profile-torch-ops-b8 python3 bench/profile_iteration.py --batch 8 --context 2048 --torch-ops \
            --out "$LOG/profile-torch-ops-b8" ;;
        replay) STEP_LIMIT=${STEP_LIMIT:-300} step pytest-replay-dynamic python3 -m pytest -q -rs -m gpu \
          tests/test_capture_gpu.py -k "${REPLAY_K:-dynamic or precompiled}" ;;
        *) echo "LAYERS_STEPS: unit bench host profile replay, got $s" >&2; exit 2 ;;
      esac
    done
    ;;
  bench8)  # the draft-phase bench at batch 8 over contexts (the check stage's last step alone)
    step bench-context python3 -m graphcap.cli bench --batch 8 --context 256,1024,2048,4096,8192,32000 --steps 3 \
      --out "$LOG/bench-context"
    ;;
  check)  # the tree as it stands: the whole suite on CUDA, the attention defaults in-graph beside sglang's kernel,
    # the draft-phase bench at batch 8 over contexts (~9.5 min in all on 11-30: close to a call's 10 - bench8 alone
    # if it is cut)
    step pytest python3 -m pytest -q -rs -p no:cacheprovider tests/
    step attention-in-graph-sglang python3 bench/attention_bw.py --no-tune --l2 in-graph \
      --out "$LOG/attention-in-graph-sglang"
    step bench-context python3 -m graphcap.cli bench --batch 8 --context 256,1024,2048,4096,8192,32000 --steps 3 \
      --out "$LOG/bench-context"
    ;;
  splits)  # the split rule (attention_plan.target_programs): every split count at the default tiles, timed in-graph
    # (as the draft runs the kernel), sliding and full layers over the batches; then the defaults at all 84 points
    # in-graph beside sglang's kernel, the kernel/model tests on CUDA, the gemma4 replay tests
    step attention-split-sweep-sliding python3 bench/attention_bw.py --grid-splits --no-sglang --l2 in-graph \
      --rep-ms 5 --budget-s 400 --layers sliding --batches 1,2,4,8,16,32 --contexts 2048 \
      --out "$LOG/attention-split-sweep-sliding"
    step attention-split-sweep-full python3 bench/attention_bw.py --grid-splits --no-sglang --l2 in-graph \
      --rep-ms 5 --budget-s 400 --layers full --batches 1,2,4,8,16,32 --contexts 1024,2048,4096 \
      --out "$LOG/attention-split-sweep-full"
    step attention-in-graph-sglang python3 bench/attention_bw.py --no-tune --l2 in-graph \
      --out "$LOG/attention-in-graph-sglang"
    step pytest-kernels python3 -m pytest -q -rs tests/test_attention.py tests/test_models.py
    STEP_LIMIT=${STEP_LIMIT:-300} step pytest-replay-gemma4 python3 -m pytest -q -rs tests/test_capture_gpu.py \
      -k "gemma4 and inductor-cudagraph"
    ;;
  prefetch)  # experiment: a projection's weights prefetched into L2 while the attention runs (bench/l2_prefetch.py)
    step l2-prefetch python3 bench/l2_prefetch.py ${PREFETCH_ARGS:-} --out "$LOG/l2-prefetch"
    ;;
  centroid-config)  # the centroid head's kernel over its launch configurations (bench/centroid_config.py)
    step centroid-config python3 bench/centroid_config.py ${CENTROID_CONFIG_ARGS:-} --out "$LOG/centroid-config"
    ;;
  row-kernels)  # warps of the one-program-per-row kernels (bench/row_kernels.py)
    step row-kernels python3 bench/row_kernels.py ${ROW_KERNELS_ARGS:-} --out "$LOG/row-kernels"
    ;;
  persistent-mlp)  # the MLP at one row as one persistent kernel against two launches (bench/persistent_mlp.py)
    STEP_LIMIT=${STEP_LIMIT:-240} step persistent-mlp python3 bench/persistent_mlp.py --out "$LOG/persistent-mlp"
    ;;
  attention-grid)  # every tile config x split count of the attention, in-graph, at one batch (ATTENTION_GRID_BATCH,
    # default 1) and context 2048: the defaults were chosen from grids at the shapes near the 70%-of-copy line
    STEP_LIMIT=${STEP_LIMIT:-300} step attention-grid python3 bench/attention_bw.py --grid --no-sglang --l2 in-graph \
      --rep-ms 3 --batches "${ATTENTION_GRID_BATCH:-1}" --contexts 2048 --out "$LOG/attention-grid"
    ;;
  ncu)  # hardware counters of the first attention and skinny-GEMM launches (--clock-control none: clocks as they run)
    # of one iteration (NCU_TARGET=iteration, the default), or of the attention alone at context 2048
    # (NCU_TARGET=attention: bench/attention_bw.py's first launches, whose rows are full)
    sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
              --section WarpStateStats)
    case ${NCU_TARGET:-iteration} in
      iteration) STEP_LIMIT=${STEP_LIMIT:-400} step ncu env TORCHINDUCTOR_COMPILE_THREADS=1 ncu --clock-control none \
        -k regex:"_split_kernel|_combine_kernel|_skinny_kernel" -c "${NCU_COUNT:-14}" "${sections[@]}" \
        python3 bench/profile_iteration.py --batch "${NCU_BATCH:-1}" --context 2048 --out "$WORK/ncu-profile" ;;
      attention) STEP_LIMIT=${STEP_LIMIT:-400} step ncu-attention ncu --clock-control none \
        -k regex:"_split_kernel|_combine_kernel" -c "${NCU_COUNT:-8}" "${sections[@]}" python3 bench/attention_bw.py \
        --no-tune --no-sglang --l2 in-graph --batches "${NCU_BATCH:-1,8}" --contexts 2048 --out "$WORK/ncu-attention" ;;
      *) echo "NCU_TARGET: iteration or attention, got $NCU_TARGET" >&2; exit 2 ;;
    esac
    ;;
  engine-check)  # correctness in sglang's own engine (tiny pair: starts in tens of seconds per engine)
    engine_env
    step ckpt-tiny python3 bench/sglang_checkpoint.py --size tiny --out "$WORK/ckpt-tiny" --device cuda
    STEP_LIMIT=${STEP_LIMIT:-540} step engine-check python3 bench/sglang_engine.py --ckpt "$WORK/ckpt-tiny" --check \
      --backends "${ENGINE_BACKENDS:-cudagraph}" --retract-every "${ENGINE_RETRACT:-0}" --out "$LOG/engine-check.json"
    ;;
  engine-refusal)  # each setting the plugin refuses, asked of a real engine start (tiny pair: the error, not a crash)
    engine_env
    step ckpt-tiny python3 bench/sglang_checkpoint.py --size tiny --out "$WORK/ckpt-tiny" --device cuda
    STEP_LIMIT=${STEP_LIMIT:-300} step engine-refusal python3 bench/sglang_engine.py --ckpt "$WORK/ckpt-tiny" \
      --refusals --out "$LOG/engine-refusal.json"
    ;;
  engine-speed)  # speed in sglang's own engine (draft-shapes pair)
    engine_env
    step ckpt-draft-shapes python3 bench/sglang_checkpoint.py --size draft-shapes --out "$WORK/ckpt-ds" --device cuda
    STEP_LIMIT=${STEP_LIMIT:-540} step engine-speed python3 bench/sglang_engine.py --ckpt "$WORK/ckpt-ds" --speed \
      --backends "${ENGINE_BACKENDS:-cudagraph}" --context "${ENGINE_CONTEXT:-2048}" --profile-batches "${ENGINE_PROFILE:-}" \
      --speed-engines "${ENGINE_SPEED_ENGINES:-nospec,sglang,graphcap}" --repeats "${ENGINE_REPEATS:-3}" \
      --projections "${ENGINE_PROJECTIONS:-graphcap}" \
      --out "$LOG/engine-speed.json"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
}

call_name=$(IFS=-; echo "$*")  # not `name`: step's local of that name would shadow it inside pack
pack() {  # after every step and on exit: a call killed at the device's time limit runs no trap, and loose files
  # past a count do not come back, so what ran so far is always in the one tarball
  tar czf "$OUT/gpu-$call_name.tar.gz" -C "$WORK" logs
  cp "$LOG/commands.txt" "$OUT/commands-$call_name.txt" 2>/dev/null
}
trap pack EXIT
trap 'exit 143' TERM INT
for stage in "$@"; do
  run_stage "$stage"
  pack
done
cat "$LOG/commands.txt"
