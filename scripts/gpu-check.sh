#!/usr/bin/env bash
# The product's GPU checks, for a CUDA machine (docs/results.md: an H200). The experiments' stages are
# lab/gpu-lab.sh's; what both share (environment, steps, logs packed into $OUT) is scripts/gpu-lib.sh's.
#   scripts/gpu-check.sh unit     the kernels' GPU tests (attention, plan, centroid head, small top-k, candidate
#                                 pick, fused ops, layer fusions, skinny GEMM, PDL; UNIT_TESTS: other test files).
#                                 The default
#   scripts/gpu-check.sh tests    the whole pytest suite on CUDA, thorough tier (GPU-marked tests and every heavy
#                                 variant), on TESTS_WORKERS (8) pytest-xdist workers sharing the GPU where xdist is
#                                 installed, so the suite fits one 600 s call on an H200 (docs/results.md#gpu-tests).
#                                 TESTS_PATHS runs some files or ids, TESTS_K a -k expression, TESTS_M a -m
#                                 expression (gpu: the GPU-marked tests alone), TESTS_ARGS pytest's
#                                 options instead of the default, e.g. -v for a per-test log that a cut call keeps;
#                                 GRAPHCAP_GPU_ALL_BUCKETS=1: the replay tests over every bucket)
#   scripts/gpu-check.sh bench    `graphcap bench`: graphcap / compile(-nosync, -plain, -tuned) / sglang / eager-rebuild
#                                 over batch 1..64 at context 2048, 3 steps (bench.json in $LOG/bench-small, -large;
#                                 BENCH_PARTS=small or large: one of the two runs, for a call of its own;
#                                 BENCH_MODES: another mode list; BENCH_PARTS=served: `graphcap bench --served`, the
#                                 served draft in sglang's engine on the draft-shapes pair, against stock and no-spec)
#   scripts/gpu-check.sh capture  one compile for every bucket + the compile cache: cold, warm restart, warm restart
#                                 with other pool sizes; host time per call (inductor-cudagraph, reduce-overhead);
#                                 the three starts again with the iteration precompiled; both warm restarts under
#                                 cProfile (capture_starts; CAPTURE_RUNS="cold warm ...": only those starts)
#   scripts/gpu-check.sh engine-check  sglang's own engine with and without --enable-draft-graph-capture (per
#                                 backend) on a tiny structured Gemma 4 pair: tokens, drafts, acceptance, manifests
#                                 (ENGINE_RETRACT=N: every engine retracts running requests every N forwards;
#                                 ENGINE_REFUSALS=1: then a real engine start with each setting the plugin refuses -
#                                 the error raised, its message and how soon)
#   scripts/gpu-check.sh user-scale  a Gemma-4-31B-shaped target: the verify attention against sglang's kernels, then
#                                 decode tok/s and sglang's per-phase profile for no-spec, stock MTP and graphcap MTP
#   scripts/gpu-check.sh user-setup  issue 42's matrix on the tiny pair: sglang {0.5.23, 0.5.18} x steps {1,2,3} x
#                                 graphcap's kernel paths {sm90, sm80} - stock sglang once per (version, steps), graphcap
#                                 per kernel paths: tokens and drafts against stock's, crashes, fallbacks, draft-phase
#                                 GPU time; a partial record per (version, steps) in $LOG/user-setup/, merged into
#                                 $LOG/user-setup-h200.json (bench/user_setup.py; merge several calls' the same way).
#                                 A version runs where the PYTHONPATH's sglang is it, or from /tmp/site-VERSION, installed
#                                 from carried wheels in .whl-VERSION/ (scripts/sglang-0518-wheels.sh). USER_SETUP_SGLANG,
#                                 USER_SETUP_STEPS, USER_SETUP_PATHS (sm90,sm80) split the matrix over calls;
#                                 USER_SETUP_BUDGET_S (570): no engine starts that could not end by then (from the
#                                 script's start); USER_SETUP_TIME_BATCH (8; 0: no timing, length checks on);
#                                 USER_SETUP_BATCHES: the check's batch sizes; USER_SETUP_DRY=1: print the runs only
#   scripts/gpu-check.sh engine-speed  the same on the draft-shapes pair: draft-phase GPU time and decode tok/s per
#                                 batch, stock sglang vs graphcap vs the target alone (each engine stage wants a
#                                 call of its own: an engine starts in 40-150 s; ENGINE_BACKENDS picks the backends;
#                                 ENGINE_PROFILE=8,64: kernel tables of the draft at those batches, every engine;
#                                 ENGINE_SPEED_ENGINES=sglang,graphcap: leave the target alone out (graphcap-nopdl:
#                                 graphcap with GRAPHCAP_PDL=0 as well); ENGINE_REPEATS;
#                                 ENGINE_CONTEXT: the prompts' length, default 2048; ENGINE_PROJECTIONS=graphcap,sglang:
#                                 graphcap once per --draft-graph-projections value)
#   scripts/gpu-check.sh server   sglang's HTTP server as users start it (bench/sglang_server.py) on the draft-shapes
#                                 pair: SERVER_SERVERS (graphcap,sglang,nospec; -small: a small KV pool, -check: graphcap's
#                                 check mode), SERVER_PHASES (bench,gsp,multiturn; rate, faults, soak),
#                                 SERVER_CONCURRENCY (1,8,32), SERVER_RATES (the rate phase's requests/s: 2,4),
#                                 SERVER_SOAK_S (480), SERVER_SOAK_ON (graphcap,sglang: the servers that
#                                 soak), SERVER_SMALL_POOL (a -small server's KV tokens, 24576), SERVER_PRESSURE (the
#                                 faults' long replies at once, 48x512), SERVER_PREFILL_GRAPHS=1 (sglang's prefill
#                                 graphs kept),
#                                 SERVER_BUDGET_S (480: no server starts after that; SERVER_DEADLINE_S: no phase starts
#                                 after that, a soak ends by then, and no server starts whose expected start-up and
#                                 least useful phases would not end by then), SERVER_VARIANTS_FROM (a directory in
#                                 the tree holding an earlier call's graphcap variants files), SERVER_FRESH_TRITON=1 (an
#                                 empty Triton cache for this stage), SERVER_SGLANG=0.5.18 (that sglang, from .whl-0.5.18
#                                 as user-setup installs it), SERVER_PHASES_FROM (an earlier call's server
#                                 work directory, /tmp/graphcap-gpu/server on a warm machine, or its server-phases/:
#                                 its servers' replies compared with this call's),
#                                 SERVER_PAIR (draft-shapes; user-scale, user-scale-w8a8:
#                                 the 31B-shaped pair, its weights loaded over the server's HTTP API), SERVER_ARGS (more
#                                 sglang flags for every server, space-separated, e.g. "--context-length 8192"),
#                                 SERVER_LENGTHS (bench and rate's random requests, INPUT:OUTPUT:RATIO, 1024:256:0.5;
#                                 sglang.bench_serving's own: 1024:1024:0), SERVER_PROMPTS (their count, 32).
#                                 The trace's GRAPHCAP_SGLANG_TRACE_PROFILE and _HOST reach every server's scheduler.
#                                 sglang's Python radix-tree core (its Rust one is built
#                                 for another torch); datasets stubbed where missing (tests/bench_serving_stubbed.py)
#   scripts/gpu-check.sh int8-gemm  the stand-in's int8_scaled_mm: its GPU tests, bench/int8_gemm.py (INT8_GEMM_ARGS)
# Several stages run in one call in order: scripts/gpu-check.sh unit bench. Logs: $GPU_WORK/logs (default
# /tmp/graphcap-gpu), packed into $OUT/gpu-<stages joined by ->.tar.gz (default OUT=out/gpu).
STAGES="unit tests bench capture engine-check engine-speed user-scale user-setup server int8-gemm"
DEFAULT_STAGE=unit
PACK_NAME=gpu
source "$(dirname "$0")/gpu-lib.sh"

user_setup_site() {  # user_setup_site VERSION: the --target dir holding sglang VERSION, for the engines' PYTHONPATH
  # (empty where the PYTHONPATH's own sglang is VERSION), installed once from carried wheels in .whl-VERSION/
  local ver=$1 dir=/tmp/site-$1 have
  have=$(python3 -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)
  if [ "$have" = "$ver" ]; then echo; return 0; fi
  if [ ! -d "$dir/sglang" ] && ls ".whl-$ver"/*.whl >/dev/null 2>&1; then
    [ "${USER_SETUP_DRY:-0}" = 1 ] && { echo "$dir"; return 0; }  # would install
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$dir" ".whl-$ver"/*.whl >&2 || return 1
  fi
  if [ -d "$dir/sglang" ]; then echo "$dir"; return 0; fi
  echo "user-setup: no sglang $ver here (the PYTHONPATH's: ${have:-none}; no $dir; no wheels in .whl-$ver/ - make" \
    "them with scripts/sglang-0518-wheels.sh .whl-$ver and carry .whl-$ver)" | tee -a "$LOG/commands.txt" >&2
  return 1
}

user_setup() {  # the user-setup stage: one bench/sglang_engine.py run per (sglang version, steps), then the merge
  local until=$(( $(date +%s) - SECONDS + ${USER_SETUP_BUDGET_S:-570} )) dry=${USER_SETUP_DRY:-0}
  local paths=() p ver s site left env_=()
  for p in $(echo "${USER_SETUP_PATHS:-sm90,sm80}" | tr , ' '); do
    case $p in sm90|native) paths+=(native) ;; sm80) paths+=(sm80) ;;
      *) echo "USER_SETUP_PATHS: sm90 and/or sm80, got $p" >&2; exit 2 ;; esac
  done
  for s in $(echo "${USER_SETUP_STEPS:-1,2,3}" | tr , ' '); do
    [[ $s =~ ^[1-9][0-9]*$ ]] || { echo "USER_SETUP_STEPS: draft steps >= 1, got $s" >&2; exit 2; }
  done
  [ "$dry" = 1 ] || engine_env
  if [ "$dry" != 1 ] && [ ! -f "$WORK/ckpt-tiny/summary.json" ]; then
    step ckpt-tiny python3 bench/sglang_checkpoint.py --size tiny --out "$WORK/ckpt-tiny" --device cuda
  fi
  mkdir -p "$LOG/user-setup"
  for ver in $(echo "${USER_SETUP_SGLANG:-0.5.23,0.5.18}" | tr , ' '); do
    site=$(user_setup_site "$ver") || continue
    env_=()
    [ -n "$site" ] && env_+=("PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}")
    if [ -n "$site" ] && { [ -d "$site/flashinfer" ] || ls ".whl-$ver"/flashinfer_standin-*.whl >/dev/null 2>&1; }; then
      env_+=(SGLANG_IS_FLASHINFER_AVAILABLE=false)  # 0.5.18's set: flashinfer is its stand-in, for no path to choose
    fi
    for s in $(echo "${USER_SETUP_STEPS:-1,2,3}" | tr , ' '); do
      local cmd=(env "${env_[@]}" python3 bench/sglang_engine.py --ckpt "$WORK/ckpt-tiny" --check --steps "$s"
        --backends "${USER_SETUP_BACKENDS:-cudagraph}" --kernel-paths "$(IFS=,; echo "${paths[*]}")"
        --time-batch "${USER_SETUP_TIME_BATCH:-8}" --check-batches "${USER_SETUP_BATCHES:-}" --expect-sglang "$ver"
        --until "$until" --work "$WORK/user-setup" --out "$LOG/user-setup/sglang-$ver-steps-$s.json")
      left=$(( until - $(date +%s) ))
      if [ "$dry" = 1 ]; then echo "${cmd[*]}"; continue; fi
      if [ "$left" -lt 75 ]; then
        echo "user-setup: sglang $ver, $s steps: not started, $left s left of USER_SETUP_BUDGET_S" | tee -a "$LOG/commands.txt"
        continue
      fi
      STEP_LIMIT=$(( left + 20 )) step "user-setup-$ver-steps-$s" "${cmd[@]}"
    done
  done
  [ "$dry" = 1 ] && { : >> "$LOG/commands.txt"; return 0; }
  mkdir -p "$LOG/user-setup/logs"  # the engines' logs, their ends (configs, traces and manifests stay in $WORK)
  for p in "$WORK"/user-setup/graphcap-engine-*/child-*.log; do
    [ -f "$p" ] && tail -c 100000 "$p" > "$LOG/user-setup/logs/$(basename "$(dirname "$p")")-$(basename "$p")"
  done
  if ls "$LOG"/user-setup/sglang-*.json >/dev/null 2>&1; then
    step user-setup-combine python3 bench/user_setup.py --out "$LOG/user-setup-h200.json" "$LOG"/user-setup/sglang-*.json
  fi
}

run_stage() {
case $1 in
  unit)  # the kernels' GPU tests alone: quick (UNIT_TESTS: other test files)
    step unit-gpu python3 -m pytest -q -rs -m gpu ${UNIT_TESTS:-tests/kernels/test_decode_attention.py \
      tests/kernels/test_attention_plan.py tests/kernels/test_centroid_head.py tests/kernels/test_small_topk.py \
      tests/kernels/test_candidate_pick.py tests/kernels/test_fused_ops.py tests/kernels/test_layer_fusions.py \
      tests/kernels/test_skinny_gemm.py tests/kernels/test_pdl.py tests/sglang/test_seed.py}
    ;;
  tests)  # the whole suite, thorough tier (tests/conftest.py: every test, hypothesis at its full example counts)
    local k=() args="-q -rs --durations=30"
    [ -n "${TESTS_K:-}" ] && k=(-k "$TESTS_K")
    [ -n "${TESTS_M:-}" ] && k+=(-m "$TESTS_M")  # TESTS_M=gpu: the GPU-marked tests alone
    # the tests are independent processes' worth of state (own temporary dirs, manifests, caches keyed by content)
    python3 -c 'import xdist' 2>/dev/null && args="$args -n ${TESTS_WORKERS:-8} --dist worksteal"
    # Inductor's compile workers per process: 2, not one per core, for 8 processes on 16 cores
    step pytest env GRAPHCAP_TEST_TIER=thorough TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2} \
      python3 -m pytest ${TESTS_ARGS:-$args} "${k[@]}" ${TESTS_PATHS:-tests/}
    ;;
  bench)  # iter/s vs batch against sglang's launches and a user's torch.compile loop (bench.json in
    # $LOG/bench-small and bench-large). The sglang modules the bench imports (decode attention, index builder, split
    # rule, Gemma 4 post-MLP norm) import no sgl_kernel, so tests/support stays off PYTHONPATH here.
    # Two runs (each compiles its own buckets), so that a call cut at its time limit keeps the first. With seven modes
    # from empty caches they take ~5 + ~4 minutes: more than one 600 s call, so BENCH_PARTS=small and
    # BENCH_PARTS=large (a call each) split them.
    local part
    for part in ${BENCH_PARTS:-small large}; do
      case $part in small) part=small:1,2,4,8 ;; large) part=large:16,32,64 ;;
        served)  # the draft the plugin serves, in sglang's engine on the draft-shapes pair (graphcap.bench.served)
          engine_env
          step ckpt-draft-shapes python3 bench/sglang_checkpoint.py --size draft-shapes --out "$WORK/ckpt-ds" \
            --device cuda
          STEP_LIMIT=${STEP_LIMIT:-540} step bench-served python3 -m graphcap.cli bench --served \
            --model-path "$WORK/ckpt-ds/target" --draft-model-path "$WORK/ckpt-ds/assistant" --batch 1,8,32,64 \
            --context 2048 --out "$LOG/bench-served"
          continue ;;
        *) echo "BENCH_PARTS: small, large and/or served, got $part" >&2; exit 2 ;; esac
      STEP_LIMIT=${STEP_LIMIT:-420} step bench-${part%%:*} python3 -m graphcap.cli bench --batch ${part##*:} \
        --context 2048 --steps 3 --modes ${BENCH_MODES:-graphcap,compile,compile-nosync,compile-plain,compile-tuned,sglang,eager-rebuild} \
        --out "$LOG/bench-${part%%:*}"
    done
    ;;
  capture)  # start-up cost of one compile for every bucket (dynamic batch) with the compile cache (capture_starts)
    capture_starts "" "$WORK/capture-$(date +%s)" inductor-cudagraph,reduce-overhead
    ;;
  engine-check)  # correctness in sglang's own engine (tiny pair: starts in tens of seconds per engine)
    engine_env
    STEP_LIMIT=${STEP_LIMIT:-60} step draft-host python3 bench/draft_host_time.py --device cuda --batches 1,8,32 \
      --iters 3000
    step ckpt-tiny python3 bench/sglang_checkpoint.py --size tiny --out "$WORK/ckpt-tiny" --device cuda
    STEP_LIMIT=${STEP_LIMIT:-540} step engine-check python3 bench/sglang_engine.py --ckpt "$WORK/ckpt-tiny" --check \
      --backends "${ENGINE_BACKENDS:-cudagraph}" --retract-every "${ENGINE_RETRACT:-0}" --out "$LOG/engine-check.json"
    if [ "${ENGINE_REFUSALS:-0}" != 0 ]; then  # each setting the plugin refuses, asked of a real engine start
      STEP_LIMIT=${STEP_LIMIT:-300} step engine-refusal python3 bench/sglang_engine.py --ckpt "$WORK/ckpt-tiny" \
        --refusals --out "$LOG/engine-refusal.json"
    fi
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
  user-scale)  # the user's question at a Gemma-4-31B-shaped target (dummy weights): no-spec, stock MTP, graphcap MTP;
    # the verify attention alone against sglang's kernels first (an engine starts in 30-120 s: one call fits three
    # engines at one or two batch sizes; USER_BATCHES, USER_ENGINES, USER_SWEEP: contexts at batch 8, USER_STEPS;
    # USER_STRUCTURED=1: the structured pair, so the acceptance is measured; USER_PROFILE=1,8,32: the batches
    # profiled at the first context - every sweep case is; USER_VERIFY_ALONE=0: no kernel timing first;
    # USER_REPEATS: timed runs per case, the median kept; USER_TRACE=1: each timed run's draft calls, host and GPU ms;
    # USER_TIMEOUT: seconds per engine, default 215, 450 past 16k tokens (a fresh machine's MTP engine at 1x131072:
    # ~60 s of capture, minutes of first prefill); USER_RESTARTS=N: an engine that dies before its last case starts
    # again on the cases it left, N times at most within its USER_TIMEOUT (stock sglang's W8A8 engine dies in torch's
    # profiler at its second profiled case), never after a start that finished no case; batches 32 and 48 need an
    # H200's memory (on an 80 GB card sglang refuses the sliding-window pool at start-up, the W8A8 target's too);
    # USER_FRESH_JIT=1: each engine with an empty Triton cache of
    # its own; USER_WEIGHTS=w8a8, with USER_STRUCTURED=1: the user's INT8 W8A8 target - the checkpoint writer and the
    # harness both get --weights w8a8, the checkpoint in $WORK/ckpt-us-w8a8 (compressed-tensors W8A8 int8 declared,
    # the structure alone), the harness loading seeded int8 projections into the engine; USER_CONTEXTS: the prompts'
    # lengths, default 2048; USER_CASES=1x32768,8x32768,1x131072: exactly these batch x context cases instead, each
    # profiled whose batch is in USER_PROFILE, with sglang's radix cache on (USER_RADIX, default 1 with USER_CASES:
    # a case's runs share its prompts, so one prefill of a long batch instead of five). The checkpoint's
    # max_position_embeddings is the longest context + 4096, 32768 at least. USER_SWA_RATIO, USER_CHUNK: sglang's
    # --swa-full-tokens-ratio and --chunked-prefill-size, USER_MEM its --mem-fraction-static (default 0.88), for long
    # contexts on an 80 GB card (with the radix cache on sglang gives the sliding-window layers 0.8 of the full
    # pool's tokens at 819 KB each): W8A8 1x131072 with USER_SWA_RATIO=0.1; 8x32768 with USER_MEM=0.92
    # USER_SWA_RATIO=0.04 USER_CHUNK=2048 (the pool arithmetic a skipped case's row prints, graphcap.bench.sglang_pool,
    # finds no ratio for the MTP engines at 0.88), a prefill of the batch ~87 s on an H100: USER_TIMEOUT=400
    # with USER_RATE_FROM=profile (no speculation alone: 251 s); a case whose requests still do not run at once says
    # so in its row, below_batch.
    # USER_KV_SPLITS: sglang's --triton-attention-num-kv-splits (default 8), the no-speculation baseline a
    # long-context user tunes; every engine of the call gets it. USER_RATE_FROM=profile:
    # the rate from the profiled iteration alone, one warm run before it - two prefills a case, not five, where the
    # radix cache does not keep a long batch's prompts, as at 8x32768. USER_TAG=NAME: the step, its record and
    # logs named user-scale-NAME, so several settings run in one call keep each its own)
    engine_env
    local weights=${USER_WEIGHTS:-bf16} ckpt=$WORK/ckpt-us longest=0 c radix= us=user-scale${USER_TAG:+-$USER_TAG}
    [[ ${USER_TAG:-x} =~ ^[A-Za-z0-9_-]+$ ]] || { echo "USER_TAG: letters, digits, - and _, got $USER_TAG" >&2; exit 2; }
    [ "${USER_RADIX:-${USER_CASES:+1}}" = 1 ] && radix=--radix-cache
    case $weights in
      bf16) ;;
      w8a8) ckpt=$WORK/ckpt-us-w8a8
        [ -n "${USER_STRUCTURED:-}" ] || { echo "USER_WEIGHTS=w8a8 needs USER_STRUCTURED=1" >&2; exit 2; } ;;
      *) echo "USER_WEIGHTS: bf16 or w8a8, got $weights" >&2; exit 2 ;;
    esac
    for c in $(echo "${USER_CONTEXTS:-2048},${USER_SWEEP:-},${USER_CASES:-}" | tr , ' '); do
      c=${c##*[xX]}  # a case's context
      [[ $c =~ ^[0-9]+$ ]] && (( c > longest )) && longest=$c
    done
    if [ "${USER_VERIFY_ALONE:-1}" != 0 ]; then  # USER_VERIFY_ALONE=0: straight to the engines
      STEP_LIMIT=${STEP_LIMIT:-120} step verify-attention python3 bench/verify_attention.py --batches 1,8,32 --n-q 4 \
        --rep-ms 30 --out "$LOG/verify-attention"
    fi
    step ckpt-user-scale python3 bench/sglang_checkpoint.py --size user-scale --out "$ckpt" --device cuda \
      --weights "$weights" --max-pos $(( longest + 4096 > 32768 ? longest + 4096 : 32768 ))
    STEP_LIMIT=${STEP_LIMIT:-480} step "$us" python3 bench/sglang_user_scale.py --ckpt "$ckpt" \
      --engines "${USER_ENGINES:-nospec,graphcap,sglang}" --batches "${USER_BATCHES:-8}" \
      --contexts "${USER_CONTEXTS:-2048}" ${USER_CASES:+--cases "$USER_CASES"} \
      ${USER_SWEEP:+--sweep "$USER_SWEEP"} ${USER_PROFILE:+--profile-batches "$USER_PROFILE"} \
      --steps "${USER_STEPS:-3}" ${USER_STRUCTURED:+--structured} ${USER_TRACE:+--trace} \
      ${USER_FRESH_JIT:+--fresh-jit-cache} --weights "$weights" $radix \
      ${USER_SWA_RATIO:+--swa-full-tokens-ratio "$USER_SWA_RATIO"} ${USER_CHUNK:+--chunked-prefill-size "$USER_CHUNK"} \
      ${USER_MEM:+--mem-fraction "$USER_MEM"} ${USER_KV_SPLITS:+--triton-attention-num-kv-splits "$USER_KV_SPLITS"} \
      ${USER_RATE_FROM:+--rate-from "$USER_RATE_FROM"} --repeats "${USER_REPEATS:-1}" --new 96 \
      --timeout "${USER_TIMEOUT:-$(( longest > 16384 ? 450 : 215 ))}" --restarts "${USER_RESTARTS:-0}" \
      --work "$WORK/$us" --out "$LOG/$us.json"
    mkdir -p "$LOG/$us-engines"  # each engine's log end and graphcap's manifests (traces stay in $WORK)
    for p in "$WORK/$us"/*.log "$WORK/$us"/*-cudagraph*.json; do
      [ -f "$p" ] && tail -c 200000 "$p" > "$LOG/$us-engines/$(basename "$p")"
    done
    ;;
  user-setup)  # issue 42: the user's sglang versions, draft steps and an A100's kernel paths, on the tiny pair
    user_setup
    ;;
  server)  # sglang's HTTP server as users run it, driven by sglang's own client and graphcap's (header: knobs)
    engine_env
    # sglang 0.5.23's Rust radix-tree core is built for the torch its wheel pins (2.14) and aborts under this machine's
    # torch at the first chunked prefill; sglang's own Python core is the same tree
    export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
    [ "${SERVER_FRESH_TRITON:-0}" = 1 ] && export TRITON_CACHE_DIR=$WORK/triton-server-$(date +%s)
    local until=$(( $(date +%s) + ${SERVER_BUDGET_S:-480} )) bs=() extra=()
    [ -n "${SERVER_DEADLINE_S:-}" ] && extra+=(--deadline "$(( $(date +%s) + SERVER_DEADLINE_S ))")
    python3 -c 'import datasets' 2>/dev/null || bs=(--bench-serving "python3 tests/bench_serving_stubbed.py")
    [ "${SERVER_PREFILL_GRAPHS:-0}" = 1 ] && extra+=(--prefill-graphs)
    [ -n "${SERVER_VARIANTS_FROM:-}" ] && extra+=(--variants-from "$SERVER_VARIANTS_FROM")
    [ -n "${SERVER_PHASES_FROM:-}" ] && extra+=(--phases-from "$SERVER_PHASES_FROM")
    [ -n "${SERVER_SOAK_ON:-}" ] && extra+=(--soak-on "$SERVER_SOAK_ON")
    [ -n "${SERVER_SMALL_POOL:-}" ] && extra+=(--small-pool "$SERVER_SMALL_POOL")
    [ -n "${SERVER_PRESSURE:-}" ] && extra+=(--pressure "$SERVER_PRESSURE")
    [ -n "${SERVER_PROMPTS:-}" ] && extra+=(--num-prompts "$SERVER_PROMPTS")
    if [ -n "${SERVER_LENGTHS:-}" ]; then  # INPUT:OUTPUT:RATIO of the random requests (sglang.bench_serving's: 1024:1024:0)
      [[ $SERVER_LENGTHS =~ ^[0-9]+:[0-9]+:[0-9.]+$ ]] || {
        echo "SERVER_LENGTHS: INPUT:OUTPUT:RATIO, e.g. 1024:1024:0, got $SERVER_LENGTHS" >&2; exit 2; }
      IFS=: read -r il ol rr <<< "$SERVER_LENGTHS"; extra+=(--input-len "$il" --output-len "$ol" --range-ratio "$rr")
    fi
    if [ -n "${SERVER_SGLANG:-}" ]; then  # another sglang for every server (0.5.18: from .whl-0.5.18, as user-setup)
      local site; site=$(user_setup_site "$SERVER_SGLANG") || exit 1
      if [ -n "$site" ]; then
        export PYTHONPATH=$site:$PYTHONPATH
        { [ -d "$site/flashinfer" ] || ls ".whl-$SERVER_SGLANG"/flashinfer_standin-*.whl >/dev/null 2>&1; } \
          && export SGLANG_IS_FLASHINFER_AVAILABLE=false
      fi
      env_report > "$LOG/env-server.txt" 2>&1  # the environment the servers run in (the first lacked this sglang)
    fi
    local ckpt=$WORK/ckpt-ds sargs=()
    case ${SERVER_PAIR:-draft-shapes} in  # user-scale pairs: random layers, the structure (int8 layers) over HTTP
      draft-shapes) [ -f "$ckpt/target/tokenizer.json" ] || step ckpt-draft-shapes python3 bench/sglang_checkpoint.py \
        --size draft-shapes --out "$ckpt" --device cuda ;;
      user-scale|user-scale-w8a8)
        local w=bf16; [ "$SERVER_PAIR" = user-scale-w8a8 ] && w=w8a8
        ckpt=$WORK/ckpt-us; [ $w = w8a8 ] && ckpt=$WORK/ckpt-us-w8a8
        [ -f "$ckpt/target/tokenizer.json" ] || step ckpt-user-scale python3 bench/sglang_checkpoint.py \
          --size user-scale --out "$ckpt" --device cuda --weights $w --max-pos 32768 ;;
      *) echo "SERVER_PAIR: draft-shapes, user-scale or user-scale-w8a8, got $SERVER_PAIR" >&2; exit 2 ;;
    esac
    local a; for a in ${SERVER_ARGS:-}; do sargs+=("--server-arg=$a"); done
    STEP_LIMIT=${STEP_LIMIT:-580} step server python3 bench/sglang_server.py --ckpt "$ckpt" "${sargs[@]}" \
      --servers "${SERVER_SERVERS:-graphcap,sglang,nospec}" --phases "${SERVER_PHASES:-bench,gsp,multiturn}" \
      --concurrency "${SERVER_CONCURRENCY:-1,8,32}" --request-rates "${SERVER_RATES:-2,4}" --soak-s "${SERVER_SOAK_S:-480}" --until "$until" \
      --work "$WORK/server" --out "$LOG/server.json" "${bs[@]}" "${extra[@]}"
    mkdir -p "$LOG/server-files"  # each server's log end, graphcap's manifests and variants files, the traces' ends
    for p in "$WORK"/server/*.log "$WORK"/server/manifests-*/*.json "$WORK"/server/trace-*/compiles-*.jsonl; do
      [ -f "$p" ] && tail -c 300000 "$p" > "$LOG/server-files/$(basename "$(dirname "$p")")-$(basename "$p")"
    done
    for p in "$WORK"/server/trace-*/host-samples-*.jsonl "$WORK"/server/trace-*/prefill-trace-*.jsonl; do  # whole
      [ -f "$p" ] && cp "$p" "$LOG/server-files/$(basename "$(dirname "$p")")-$(basename "$p")"
    done
    mkdir -p "$LOG/server-phases"  # each server's phases with its replies: SERVER_PHASES_FROM of a later call
    find "$WORK/server" -maxdepth 1 -name '*-phases.json' -size -8M -exec cp {} "$LOG/server-phases/" \; 2>/dev/null
    ;;
  int8-gemm)  # sgl_kernel's W8A8 int8 GEMM as the stand-in runs it, at Gemma-4-31B's projection shapes: its GPU tests,
    # then bench/int8_gemm.py against the int8 weight-read floor and torch._int_mm (INT8_GEMM_ARGS: the bench's options
    # besides --out, e.g. --candidates to time every candidate config, or --ms / --shapes for a shorter run)
    step int8-gemm-gpu python3 -m pytest -q -rs -m gpu tests/sglang/test_int8_gemm.py
    STEP_LIMIT=${STEP_LIMIT:-480} step int8-gemm python3 bench/int8_gemm.py --out "$LOG/int8-gemm.json" \
      ${INT8_GEMM_ARGS:-}
    ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
}

gpu_main "$@"
