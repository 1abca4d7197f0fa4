#!/usr/bin/env bash
# The product's GPU checks, for a CUDA machine (docs/results.md: an H200). The experiments' stages are
# lab/gpu-lab.sh's; what both share (environment, steps, logs packed into $OUT) is scripts/gpu-lib.sh's.
#   scripts/gpu-check.sh unit     the kernels' GPU tests (attention, plan, centroid head, small top-k, candidate
#                                 pick, fused ops, layer fusions, skinny GEMM; UNIT_TESTS: other test files). The default
#   scripts/gpu-check.sh tests    the whole pytest suite on CUDA, thorough tier (GPU-marked tests and every heavy
#                                 variant; more than one 600 s call: TESTS_PATHS runs some files or ids, TESTS_K a -k
#                                 expression, TESTS_ARGS pytest's options instead of -q -rs, e.g. -v for a per-test
#                                 log that a cut call keeps; GRAPHCAP_GPU_ALL_BUCKETS=1: the replay tests over every
#                                 bucket)
#   scripts/gpu-check.sh bench    `graphcap bench`: graphcap / compile(-nosync, -plain, -tuned) / sglang / eager-rebuild
#                                 over batch 1..64 at context 2048, 3 steps (bench.json in $LOG/bench-small, -large;
#                                 BENCH_PARTS=small or large: one of the two runs, for a call of its own;
#                                 BENCH_MODES: another mode list)
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
#   scripts/gpu-check.sh engine-speed  the same on the draft-shapes pair: draft-phase GPU time and decode tok/s per
#                                 batch, stock sglang vs graphcap vs the target alone (each engine stage wants a
#                                 call of its own: an engine starts in 40-150 s; ENGINE_BACKENDS picks the backends;
#                                 ENGINE_PROFILE=8,64: kernel tables of the draft at those batches, every engine;
#                                 ENGINE_SPEED_ENGINES=sglang,graphcap: leave the target alone out; ENGINE_REPEATS;
#                                 ENGINE_CONTEXT: the prompts' length, default 2048; ENGINE_PROJECTIONS=graphcap,sglang:
#                                 graphcap once per --draft-graph-projections value)
# Several stages run in one call in order: scripts/gpu-check.sh unit bench. Logs: $GPU_WORK/logs (default
# /tmp/graphcap-gpu), packed into $OUT/gpu-<stages joined by ->.tar.gz (default OUT=out/gpu).
STAGES="unit tests bench capture engine-check engine-speed user-scale"
DEFAULT_STAGE=unit
PACK_NAME=gpu
source "$(dirname "$0")/gpu-lib.sh"

run_stage() {
case $1 in
  unit)  # the kernels' GPU tests alone: quick (UNIT_TESTS: other test files)
    step unit-gpu python3 -m pytest -q -rs -m gpu ${UNIT_TESTS:-tests/test_attention.py tests/test_attention_plan.py \
      tests/test_centroid_head.py tests/test_small_topk.py tests/test_candidate_pick.py tests/test_fused_ops.py \
      tests/test_layer_fusions.py tests/test_skinny_gemm.py}
    ;;
  tests)  # the whole suite, thorough tier (tests/conftest.py: every test, hypothesis at its full example counts)
    local k=()
    [ -n "${TESTS_K:-}" ] && k=(-k "$TESTS_K")
    step pytest env GRAPHCAP_TEST_TIER=thorough python3 -m pytest ${TESTS_ARGS:--q -rs} "${k[@]}" ${TESTS_PATHS:-tests/}
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
        *) echo "BENCH_PARTS: small and/or large, got $part" >&2; exit 2 ;; esac
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
    # engines at one or two batch sizes; USER_BATCHES, USER_ENGINES, USER_SWEEP: contexts at batch 8, USER_STEPS)
    engine_env
    STEP_LIMIT=${STEP_LIMIT:-120} step verify-attention python3 bench/verify_attention.py --batches 1,8,32 --n-q 4 \
      --rep-ms 30 --out "$LOG/verify-attention"
    step ckpt-user-scale python3 bench/sglang_checkpoint.py --size user-scale --out "$WORK/ckpt-us" --device cuda
    STEP_LIMIT=${STEP_LIMIT:-480} step user-scale python3 bench/sglang_user_scale.py --ckpt "$WORK/ckpt-us" \
      --engines "${USER_ENGINES:-nospec,graphcap-verify,sglang}" --batches "${USER_BATCHES:-8}" --contexts 2048 \
      ${USER_SWEEP:+--sweep "$USER_SWEEP"} --steps "${USER_STEPS:-3}" --repeats 1 --new 96 --timeout 215 \
      --work "$WORK/user-scale" --out "$LOG/user-scale.json"
    ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
}

gpu_main "$@"
