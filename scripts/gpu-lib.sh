# What scripts/gpu-check.sh (the product's stages) and lab/gpu-lab.sh (the experiments') share: the environment of a
# CUDA machine, the step runner, the packing of logs, the engine's environment and the capture starts. Sourced, not
# run: a stage script defines STAGES, PACK_NAME and run_stage, sources this file and calls `gpu_main "$@"`.
# Logs and tables go to $GPU_WORK/logs (default /tmp/graphcap-gpu) and are packed into
# $OUT/<PACK_NAME>-<stages joined by ->.tar.gz (default OUT=out/gpu), the command log beside it.
# sglang's kernels are used when ./.whl holds sglang 0.5.23's wheels (for a machine without network).
# A copied checkout's .git may be stale: `git rev-parse --short HEAD > .gpu-commit` here (ignored; carry it) records
# the commit the tree is at in env-<stage>.txt.
set -uo pipefail
GPU_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

tree_hash() {  # the code that runs: graphcap/, bench/, lab/, tests/, scripts/ (tracked or not), content only
  (cd "$GPU_ROOT" && find graphcap bench lab tests scripts -type f \( -name '*.py' -o -name '*.sh' -o -name '*.toml' \) \
    -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12)
}

gpu_setup() {
  cd "$GPU_ROOT"
  OUT=${OUT:-out/gpu}            # what comes back: one tarball per call (re-packed after each step) and the command log
  WORK=${GPU_WORK:-/tmp/graphcap-gpu}
  LOG=$WORK/logs
  mkdir -p "$LOG" "$OUT"
  export PYTHONUNBUFFERED=1
  # Bytecode for every module in one writable place: the device's torch has no usable .pyc (each process compiled
  # ~550-950 of torch's sources, 2.4-3.0 s of every capture start), where a pip-installed torch has them
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$WORK/pycache}
  unset PYTHONDONTWRITEBYTECODE
  # the carried wheels, installed again on a warm machine when the set changed
  if ls .whl/*.whl >/dev/null 2>&1 && [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$(ls .whl | sha1sum)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
      && ls .whl | sha1sum > /tmp/site/.wheels
  fi
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  export GRAPHCAP_MANIFEST_DIR=$LOG/manifests
  # Inductor's and Triton's on-disk caches live in $WORK: later stages on the same (still warm) machine reuse what an
  # earlier stage compiled.
  export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor-cache}
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton-cache}
}

engine_env() {  # sglang's engine finds graphcap's plugin through its entry point (an installed dist-info) and
  # imports the sgl_kernel stand-in (tests/support) in every subprocess
  if [ ! -d /tmp/graphcap-dist ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/graphcap-dist . >/dev/null
  fi
  export PYTHONPATH=$PWD:$PWD/tests/support:/tmp/graphcap-dist${PYTHONPATH:+:$PYTHONPATH}
  export GRAPHCAP_COMMIT=$(cat .gpu-commit 2>/dev/null)
}

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

pack() {  # after every step and on exit: a call killed at the device's time limit runs no trap, and loose files
  # past a count do not come back, so what ran so far is always in the one tarball
  tar czf "$OUT/$PACK_NAME-$CALL_NAME.tar.gz" -C "$WORK" logs
  cp "$LOG/commands.txt" "$OUT/commands-$CALL_NAME.txt" 2>/dev/null
}

gpu_main() {  # gpu_main STAGE...: every name checked before anything runs, then each stage in order
  [ "${1:-}" = "--tree-hash" ] && { tree_hash; exit 0; }
  [ $# -eq 0 ] && set -- "$DEFAULT_STAGE"
  local stage
  for stage in "$@"; do
    case " $STAGES " in *" $stage "*) ;; *) echo "unknown stage $stage (stages: $STAGES)" >&2; exit 2 ;; esac
  done
  gpu_setup
  CALL_NAME=$(IFS=-; echo "$*")
  trap pack EXIT
  trap 'exit 143' TERM INT
  for stage in "$@"; do
    env_report > "$LOG/env-$stage.txt" 2>&1
    cat "$LOG/env-$stage.txt"
    run_stage "$stage"
    pack
  done
  cat "$LOG/commands.txt"
}
