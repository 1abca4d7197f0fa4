"""The sglang plugin's configuration layer: its flags' names, the hook targets, start-up validation.

Imported by every other module of the plugin (runtime, hooks, entry point) and importing none of them but `compat`
(what differs between the sglang versions served) and `settings` (the flags' options, the environment variables):
the plugin's modules (graphcap.sglang) depend one way, compat -> settings -> config -> slots -> runtime -> hooks ->
plugin (the entry point).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from graphcap.backends import COMPILED_BACKENDS  # light: no torch
from graphcap.envvars import MANIFEST_DIR_ENV
from graphcap.manifest import Parallel  # light: no torch
from graphcap.sglang import compat as sglang_compat  # its sglang_version by attribute: tests stand in for it
from graphcap.sglang.compat import TESTED_SGLANG, DraftCaptureConfigError, resolution_reader
from graphcap.sglang.settings import (ALLOW_UNTESTED_ENV, COMPILE_SCOPE_ENV, DRAFT_CAPTURE_ENV, PLUGIN_DEFAULT_BACKEND,
                                      PROJECTIONS, TRACE_ENV, VERIFY_ATTENTION, DraftCaptureOptions, PluginSettings,
                                      plugin_settings)

log = logging.getLogger("graphcap.sglang")

# Refused at start-up. reduce-overhead: CUDA-graph trees clear every stream's cached cuBLAS workspace around each
# warm-up and recording (torch._inductor.cudagraph_trees.clear_cublas_manager), so a graph captured before them
# replays its split-K GEMMs into freed memory (shown with torch alone; tests/engine/test_reduce_overhead_serving_gpu.py
# checks it per torch). sglang captures its target graphs first, and its engine crashed with an illegal address in such
# a GEMM at the verify after the first draft (which graph's GEMM was not identified: docs/results.md). The manual-graph
# backends clear nothing.
UNSERVED_BACKENDS = ("reduce-overhead",)
FLAG = "--enable-draft-graph-capture"
BACKEND_FLAG = "--draft-graph-capture-backend"
MANIFEST_FLAG = "--draft-graph-manifest-dir"
PROJECTIONS_FLAG = "--draft-graph-projections"  # its values: settings.PROJECTIONS
VERIFY_ATTENTION_FLAG = "--draft-graph-verify-attention"  # its values: settings.VERIFY_ATTENTION
ATTR = "_graphcap_draft_capture"  # on ServerArgs: underscore names are bookkeeping, allowed even on a sealed record
FLAG_DESTS = {"enabled": "enable_draft_graph_capture", "backend": "draft_graph_capture_backend",  # argparse's
              "manifest_dir": "draft_graph_manifest_dir", "projections": "draft_graph_projections",
              "verify_attention": "draft_graph_verify_attention"}

# Hook targets, the same in sglang 0.5.18 and 0.5.23 (dotted paths for sglang's HookRegistry).
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
ADD_CLI_ARGS = f"{SERVER_ARGS}.add_cli_args"
FROM_CLI_ARGS = f"{SERVER_ARGS}.from_cli_args"
CHECK_SERVER_ARGS = f"{SERVER_ARGS}.check_server_args"
DRAFT_WORKER = "sglang.srt.speculative.frozen_kv_mtp_worker_v2.FrozenKVMTPDraftWorker"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
WORKER_INIT_GRAPHS = f"{DRAFT_WORKER}.init_cuda_graphs"  # capture graphcap's loop instead of sglang's draft runner
WORKER_DRAFT = f"{DRAFT_WORKER}.draft"  # the draft phase: one replay, no per-iteration .item()
WORKER_EXTEND_PREFILL = f"{DRAFT_WORKER}._draft_extend_for_prefill"  # requests join (after their prefill)
WORKER_EXTEND_DECODE = f"{DRAFT_WORKER}._draft_extend_for_decode"  # verify accepted accept_lens[i] tokens
# the speculative worker's iteration (a prefill batch's: the target's prefill, then the draft's seed): the trace's
WORKER_ITERATION = "sglang.srt.speculative.frozen_kv_mtp_worker_v2.FrozenKVMTPWorkerV2.forward_batch_generation"
# the target worker's forward: no speculation's iteration, and nested inside the speculative one (the trace records
# the outermost, so a server without speculation gets its prefill pauses recorded too)
TARGET_ITERATION = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
BATCH_RETRACT = f"{SCHEDULE_BATCH}.retract_decode"  # requests retracted under memory pressure
BATCH_EVICT_SWA = f"{SCHEDULE_BATCH}._evict_swa"  # SWA pages freed behind a request's window
# the target's verify seat (graphcap.sglang.verify); not required: unhooked, the verify is stock
TRITON_BACKEND_INIT = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"
# a joining request's seed, gathered without sglang's host sync (graphcap.sglang.seed); not required either
WORKER_SEED_HIDDEN = f"{DRAFT_WORKER}._select_last_extend_hidden"
ARG_HOOKS = (ADD_CLI_ARGS, FROM_CLI_ARGS)
WORKER_HOOKS = (WORKER_INIT_GRAPHS, WORKER_DRAFT, WORKER_EXTEND_PREFILL, WORKER_EXTEND_DECODE, BATCH_RETRACT,
                BATCH_EVICT_SWA)
RUNTIME_HOOKS = (CHECK_SERVER_ARGS, *WORKER_HOOKS)
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"  # imported in every process that runs a scheduler


def unpatched_worker_hooks() -> list[str]:
    """The worker hooks sglang did not install (it logs a failed patch and carries on). graphcap must not serve a
    worker half-hooked: without the decode-extend hook the windows never advance, without the SWA-eviction hook a
    freed location could be read. Empty when sglang's registry does not say (an older/newer layout)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    patched = getattr(HookRegistry, "_patched", None)
    if not isinstance(patched, (set, frozenset)):
        return []
    return [t for t in WORKER_HOOKS if t not in patched]


def sglang_tp_rank(worker=None) -> int | None:
    """The TP rank sglang gives this process: the worker's own `tp_rank` where its layout keeps one, else sglang's
    runtime context (0.5.18, 0.5.23); None where neither says (a process sglang did not set up)."""
    rank = getattr(worker, "tp_rank", None)
    if isinstance(rank, int):
        return rank
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:  # RuntimeError: not published in this process; ImportError: another sglang layout
        return None


def sglang_parallel(worker=None) -> Parallel | None:
    """This process's place in sglang's parallel layout (TP rank and size, pipeline stage and count, data-parallel
    replica and count), for its manifest's name. sglang 0.5.18's workers carry it (`worker.ps`, a ParallelState: the
    only place 0.5.18 keeps the replica); 0.5.23 publishes it in its runtime context (`get_parallel()`, where
    `dp_rank` is None without a data-parallel controller). None where neither gives a TP rank and size (a process
    sglang did not set up)."""
    src = getattr(worker, "ps", None)
    if not isinstance(getattr(src, "tp_rank", None), int):
        try:
            from sglang.srt.runtime_context import get_parallel

            src = get_parallel()
        except ImportError:  # another sglang layout
            return None

    def read(name: str, default: int | None) -> int | None:
        try:  # unpublished: 0.5.23 raises RuntimeError/ValueError, 0.5.18 AttributeError, or asserts (no TP group)
            value = getattr(src, name)
        except Exception:
            return default
        return default if value is None else int(value)

    tp_rank, tp_size = read("tp_rank", None), read("tp_size", None)
    if tp_rank is None or tp_size is None:
        return None
    try:
        return Parallel(tp_rank=tp_rank, tp_size=tp_size, pp_rank=read("pp_rank", 0), pp_size=read("pp_size", 1),
                        dp_rank=read("dp_rank", None), dp_size=read("dp_size", 1))
    except ValueError as e:  # ranks that do not fit their sizes: name them, and capture on (the manifest is a report)
        log.warning("graphcap: sglang's parallel ranks do not fit together (%s); the manifest is written under the "
                    "single-GPU name", " ".join(str(e).split()))
        return None


def options_from_namespace(args) -> DraftCaptureOptions:
    return DraftCaptureOptions(enabled=bool(getattr(args, FLAG_DESTS["enabled"], False)),
                               backend=getattr(args, FLAG_DESTS["backend"], None) or PLUGIN_DEFAULT_BACKEND,
                               manifest_dir=getattr(args, FLAG_DESTS["manifest_dir"], None),
                               projections=getattr(args, FLAG_DESTS["projections"], None) or PROJECTIONS[0],
                               verify_attention=(getattr(args, FLAG_DESTS["verify_attention"], None)
                                                 or VERIFY_ATTENTION[0]))


def options_of(server_args) -> DraftCaptureOptions:
    """The options a ServerArgs record carries (CLI path), else those in the environment (Engine path:
    $GRAPHCAP_SGLANG_DRAFT_CAPTURE)."""
    data = getattr(server_args, ATTR, None) if server_args is not None else None
    if data is not None:
        return DraftCaptureOptions.from_mapping(dict(data), f"ServerArgs.{ATTR}")
    return plugin_settings().draft_capture


def attach_options(server_args, opts: DraftCaptureOptions) -> None:
    """Store on the record (plain dict: unpickles without graphcap's classes) and export for child processes."""
    setattr(server_args, ATTR, dataclasses.asdict(opts))
    if opts.enabled:
        os.environ[DRAFT_CAPTURE_ENV] = opts.to_json()
    else:
        os.environ.pop(DRAFT_CAPTURE_ENV, None)  # the command line wins over an inherited variable


# -----------------------------------------------------------------------------------------------------------------
# Start-up validation (launcher, after sglang resolved the arguments; the worker re-checks with the real objects)


def check_sglang_version(allow_untested: bool | None = None, version: str | None = None) -> str | None:
    """Refuse (DraftCaptureConfigError naming the versions tested) an installed sglang outside `TESTED_SGLANG`,
    unless `allow_untested` (None: $GRAPHCAP_SGLANG_ALLOW_UNTESTED=1 in this process's settings), which logs a
    warning instead. Returns the version."""
    version = sglang_compat.sglang_version() if version is None else version
    if version in TESTED_SGLANG:
        return version
    if allow_untested is None:
        allow_untested = plugin_settings().allow_untested
    what = f"sglang {version}" if version else "an sglang without package metadata"
    if allow_untested:
        log.warning("graphcap: %s is installed; --enable-draft-graph-capture is tested with sglang %s only. "
                    "Going on because $%s=1: a layout graphcap does not know is named when it is met.",
                    what, ", ".join(TESTED_SGLANG), ALLOW_UNTESTED_ENV)
        return version
    raise DraftCaptureConfigError(
        f"{FLAG}: {what} is installed; graphcap's plugin is tested with sglang "
        f"{', '.join(TESTED_SGLANG)} only. Install one of those, or drop the flag "
        f"(${ALLOW_UNTESTED_ENV}=1 goes on anyway, for developers).")


def validate_server_args(server_args) -> DraftCaptureOptions:
    """Error naming the unsupported setting, or - where leaving graphcap off is safe - a warning and disabled options
    (stored back on the record, so the scheduler process sees them). Returns the options in force. Every
    environment variable of the plugin is parsed first (`plugin_settings`: a bad value is refused naming it, with or
    without the flag), then with the flag an sglang outside TESTED_SGLANG is refused (`check_sglang_version`)."""
    settings = plugin_settings()
    if settings.trace_dir is not None:  # the trace runs with or without the flag
        _writable_dir(f"${TRACE_ENV}={settings.trace_dir}", settings.trace_dir)
    opts = options_of(server_args)
    if not opts.enabled:
        return opts
    check_sglang_version(settings.allow_untested)
    get, resolved = resolution_reader(server_args)
    algo = get("speculative_algorithm")
    algo = str(algo).upper() if algo else None
    if algo is None:
        return _stays_off(server_args, opts, "no --speculative-algorithm is set (speculative decoding is off)")
    pending = {"NEXTN", "EAGLE"} if not resolved else set()  # resolution turns these into FROZEN_KV_MTP for Gemma 4
    if algo != "FROZEN_KV_MTP" and algo not in pending:
        raise DraftCaptureConfigError(
            f"{FLAG} supports only FROZEN_KV_MTP (--speculative-algorithm NEXTN or EAGLE with a Gemma 4 assistant "
            f"draft, Gemma4AssistantForCausalLM); this server's --speculative-algorithm resolved to {algo}. "
            f"Drop {FLAG} or use a Gemma 4 assistant draft.")
    topk = get("speculative_eagle_topk")
    if topk is not None and int(topk) != 1:
        raise DraftCaptureConfigError(
            f"{FLAG} captures a chain draft only: --speculative-eagle-topk must be 1, got {topk}")
    for name in ("speculative_draft_attention_backend", "decode_attention_backend", "attention_backend"):
        value = get(name)
        if value is not None:
            if value != "triton":
                raise DraftCaptureConfigError(
                    f"{FLAG}: graphcap's kernels serve sglang's Triton attention layout (req_to_token + the SWA "
                    f"pool's full_to_swa mapping); --{name.replace('_', '-')} {value} is not supported. "
                    "Use --attention-backend triton (Gemma 4's default) or drop the flag.")
            break
    if get("enable_unified_memory"):
        raise DraftCaptureConfigError(
            f"{FLAG}: --enable-unified-memory stores virtual ids in req_to_token (translated through page tables); "
            "graphcap's window buffers read the static SWA pool's full_to_swa mapping. Drop one of the two.")
    pp = get("pp_size") or 1
    if int(pp) > 1:
        raise DraftCaptureConfigError(f"{FLAG}: --pp-size {pp} is not supported (the draft runs on one stage)")
    if opts.backend in UNSERVED_BACKENDS:
        raise DraftCaptureConfigError(
            f"{FLAG}: {BACKEND_FLAG} {opts.backend} is not supported in sglang's engine: torch.compile's CUDA-graph "
            "trees free the cuBLAS workspace of CUDA graphs captured before them, as sglang captures its target's, "
            "and sglang's engine crashed (CUDA illegal memory access in a cuBLAS GEMM) at its first verify after a "
            f"draft. Use {PLUGIN_DEFAULT_BACKEND} (the default) or inductor-cudagraph (docs/sglang.md).")
    if opts.backend in COMPILED_BACKENDS and get("enable_torch_compile"):
        raise DraftCaptureConfigError(
            f"{FLAG}: {BACKEND_FLAG} {opts.backend} with --enable-torch-compile is not supported: to compile sglang's "
            "layers graphcap makes Dynamo break around their residual-stream bookkeeping, which sglang's own "
            "fullgraph compile of the target cannot take. Use the default backend (cudagraph) or drop one of the two.")
    scope = compile_scope_refusal(settings, opts)
    if scope is not None:
        raise DraftCaptureConfigError(scope)
    if get("speculative_adaptive"):
        raise DraftCaptureConfigError(f"{FLAG}: --speculative-adaptive is not supported with FROZEN_KV_MTP")
    attn_dp = _attention_dp(get)
    if attn_dp is not None:
        raise DraftCaptureConfigError(
            f"{FLAG}: attention data parallelism ({attn_dp}) is not supported: sglang then gathers the draft's "
            "attention inputs across ranks, which graphcap's captured iteration does not do. Drop one of the two.")
    device = get("device")
    if resolved and device not in (None, "cuda"):
        return _stays_off(server_args, opts, f"--device {device}: graphcap captures CUDA graphs")
    graphs_off = _cuda_graphs_off(get)
    if graphs_off is not None:  # after the device: off a GPU, staying off is the safe answer
        raise DraftCaptureConfigError(
            f"{FLAG} captures the draft into CUDA graphs, but {graphs_off}. Drop {FLAG} (sglang then runs its "
            "draft eagerly) or enable CUDA graphs.")
    if opts.manifest_dir is not None:
        _writable_dir(f"{MANIFEST_FLAG} {opts.manifest_dir}", opts.manifest_dir)
    elif settings.manifest_dir is not None:
        _writable_dir(f"${MANIFEST_DIR_ENV}={settings.manifest_dir}", settings.manifest_dir)
    return opts


def compile_scope_refusal(settings: PluginSettings, opts: DraftCaptureOptions) -> str | None:
    """Why $GRAPHCAP_SGLANG_COMPILE_SCOPE does not fit the backend, or None: scope `model` compiles sglang's model
    inside a recorded graph of the iteration, which only inductor-cudagraph asks for."""
    if settings.compile_scope == "model" and opts.backend != "inductor-cudagraph":
        return f"${COMPILE_SCOPE_ENV}=model needs {BACKEND_FLAG} inductor-cudagraph, got {opts.backend}"
    return None


def _writable_dir(what: str, path: str | os.PathLike) -> None:
    """Create `path` (and its parents) where missing; an error naming `what` where that fails or it is not
    writable."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise DraftCaptureConfigError(f"{what}: cannot create it ({e.strerror or e})") from None
    if not os.access(path, os.W_OK):
        raise DraftCaptureConfigError(f"{what}: not writable")


def _attention_dp(get) -> str | None:
    """The flag that turned attention DP on, or None. sglang 0.5.23's resolution turns the deprecated `--dp-size N
    --enable-dp-attention` into `attn_dp_size` = N; before it, and in 0.5.18 (no `attn_dp_size`), that spelling has
    to be read as such."""
    width = int(get("attn_dp_size") or 1)
    if width > 1:
        return f"--attn-dp-size {width}"
    dp = int(get("dp_size") or 1)
    if get("enable_dp_attention") and dp > 1:
        return f"--enable-dp-attention with --dp-size {dp}"
    return None


def _cuda_graphs_off(get) -> str | None:
    """Why CUDA graphs are off for both decode and prefill - sglang's `cuda_graph_fully_disabled()`, under which
    sglang captures no draft graph either - from the resolved `cuda_graph_config`. None while it is unresolved (the
    launcher checks a resolved record) or when a phase keeps its graphs."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    cfg = get("cuda_graph_config")
    if any(getattr(getattr(cfg, phase, None), "backend", None) != Backend.DISABLED for phase in Phase.ALL):
        return None
    given = [flag for flag, on in (("--disable-cuda-graph", get("disable_cuda_graph")),
                                   ("--disable-decode-cuda-graph", get("disable_decode_cuda_graph")),
                                   ("--cuda-graph-backend-decode disabled",
                                    get("cuda_graph_backend_decode") == Backend.DISABLED)) if on]
    if given:
        return f"CUDA graphs are disabled ({', '.join(given)})"
    return "sglang's resolved cuda_graph_config disables CUDA graphs for decode and prefill"


def _stays_off(server_args, opts: DraftCaptureOptions, why: str) -> DraftCaptureOptions:
    log.warning("graphcap: %s is set but %s; draft graph capture stays off and sglang runs as without the flag.",
                FLAG, why)
    off = dataclasses.replace(opts, enabled=False)
    attach_options(server_args, off)
    return off
