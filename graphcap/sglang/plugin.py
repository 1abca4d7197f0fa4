"""sglang plugin: `--enable-draft-graph-capture` for Gemma 4 frozen-KV MTP (sglang's FROZEN_KV_MTP).

Loaded by sglang's own `load_plugins()` through the `sglang.srt.plugins` entry point (pyproject.toml). It does nothing
unless asked:

- Always (so the flags exist): an AFTER hook on `ServerArgs.add_cli_args` adds the three flags, and an AFTER hook on
  `ServerArgs.from_cli_args` (which drops argparse values that are not ServerArgs fields) attaches the parsed options
  to the ServerArgs record as `_graphcap_draft_capture` - a bookkeeping attribute, which `ServerArgs.__reduce__`
  carries into the scheduler subprocess - and, when enabled, exports them as $GRAPHCAP_SGLANG_DRAFT_CAPTURE so the
  subprocesses' own `load_plugins()` knows to install the runtime hooks.
- Only when enabled: a BEFORE hook on `ServerArgs.check_server_args` (start-up validation, in the launcher), and in a
  process that runs a scheduler the hooks on the draft worker and the schedule batch (RUNTIME_HOOKS below), which
  hand the draft phase to `graphcap.sglang.runtime`.
- With or without the flag, where $GRAPHCAP_SGLANG_TRACE names a directory: the draft trace
  (`graphcap.sglang.trace`) in scheduler processes - a measurement aid, off unless set - and the start-up check.
- With or without the flag, where one of the plugin's environment variables holds a bad value
  (graphcap.sglang.settings): the start-up check, which refuses it by name.

Serves sglang 0.5.18 and 0.5.23 (TESTED_SGLANG; what differs between them is found by feature in
`graphcap.sglang.compat`); with the flag on, another sglang is refused at start-up, naming the versions
tested. docs/sglang.md says what was exercised against each real package.
"""
from __future__ import annotations

import sys

from graphcap.backends import GRAPH_BACKENDS
from graphcap.sglang import compat as sglang_compat  # its sglang_version by attribute: tests stand in for it
from graphcap.sglang.compat import TESTED_SGLANG, DraftCaptureConfigError
from graphcap.sglang.config import (ADD_CLI_ARGS, BACKEND_FLAG, BATCH_EVICT_SWA, BATCH_RETRACT, CHECK_SERVER_ARGS,
                                    FLAG, FLAG_DESTS, FROM_CLI_ARGS, MANIFEST_FLAG, PROJECTIONS_FLAG,
                                    SCHEDULER_MODULE, TARGET_ITERATION, TRITON_BACKEND_INIT, VERIFY_ATTENTION_FLAG,
                                    WORKER_DRAFT, WORKER_EXTEND_DECODE, WORKER_EXTEND_PREFILL, WORKER_INIT_GRAPHS,
                                    WORKER_ITERATION, WORKER_SEED_HIDDEN, attach_options, check_sglang_version, log,
                                    options_from_namespace)
from graphcap.sglang.settings import PLUGIN_DEFAULT_BACKEND, PROJECTIONS, VERIFY_ATTENTION, plugin_settings


class _State:
    registered = 0  # register() calls in this process (tests read it)
    runtime_hooks: set[str] = set()
    trace = None  # the draft trace ($GRAPHCAP_SGLANG_TRACE), once per process


STATE = _State()


# -----------------------------------------------------------------------------------------------------------------
# Entry point


def register() -> None:
    """`sglang.srt.plugins` entry point. Runs in every sglang process, before argument parsing in the launcher.

    A bad value of one of the plugin's environment variables (graphcap.sglang.settings), or with the flag on (from
    the environment: a child of a launcher that parsed it, or an Engine user who set the variable) an sglang outside
    TESTED_SGLANG: it installs only the start-up check (which refuses, naming the variable or the versions tested,
    in the process that checks the arguments) and raises the same error here (sglang logs it and carries on without
    graphcap's worker hooks: stock sglang). Without the flag, an untested sglang gets a warning."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    STATE.registered += 1
    HookRegistry.register(ADD_CLI_ARGS, _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, _after_from_cli_args, HookType.AFTER)
    try:
        settings = plugin_settings()
        if settings.draft_capture.enabled:
            check_sglang_version(settings.allow_untested)
    except DraftCaptureConfigError:
        register_runtime_hooks(workers=False)
        raise
    scheduler = SCHEDULER_MODULE in sys.modules
    if settings.draft_capture.enabled:
        register_runtime_hooks(workers=scheduler)
    else:
        _warn_untested_version()
        if settings.trace_dir is not None:  # the start-up check: whether the trace's directory can be written
            register_runtime_hooks(workers=False)
    if scheduler and (settings.draft_capture.enabled or settings.trace_dir):  # Triton's compiles in the scheduler
        from graphcap.sglang.variants import install_process

        install_process(settings.trace_dir)
    if settings.trace_dir and scheduler and not STATE.trace:  # after graphcap's hooks: wraps them
        from graphcap.sglang.trace import install

        STATE.trace = install(settings, WORKER_DRAFT, (WORKER_ITERATION, TARGET_ITERATION))


def register_runtime_hooks(workers: bool) -> None:
    """The hooks that do the work; `workers`: also those on the draft worker and schedule batch (a scheduler
    process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from graphcap.sglang import hooks as h

    table = {CHECK_SERVER_ARGS: (h.before_check_server_args, HookType.BEFORE)}
    if workers:
        table.update({
            WORKER_INIT_GRAPHS: (h.around_init_cuda_graphs, HookType.AROUND),
            WORKER_DRAFT: (h.around_draft, HookType.AROUND),
            WORKER_EXTEND_PREFILL: (h.after_draft_extend_for_prefill, HookType.AFTER),
            WORKER_EXTEND_DECODE: (h.after_draft_extend_for_decode, HookType.AFTER),
            BATCH_RETRACT: (h.around_retract_decode, HookType.AROUND),
            BATCH_EVICT_SWA: (h.around_evict_swa, HookType.AROUND),
            TRITON_BACKEND_INIT: (h.after_triton_backend_init, HookType.AFTER),
            WORKER_SEED_HIDDEN: (h.around_select_last_extend_hidden, HookType.AROUND),
        })
    for target, (hook, kind) in table.items():
        if target not in STATE.runtime_hooks:
            HookRegistry.register(target, hook, kind)
            STATE.runtime_hooks.add(target)


def _warn_untested_version() -> None:
    v = sglang_compat.sglang_version()
    if v not in TESTED_SGLANG:
        log.warning("graphcap: sglang %s is installed; graphcap's plugin is tested with sglang %s only, and "
                    "%s refuses to start on another.", v or "(no package metadata)", ", ".join(TESTED_SGLANG), FLAG)


# -----------------------------------------------------------------------------------------------------------------
# Arguments


def add_arguments(parser) -> None:
    """The plugin's flags, in their own argparse group (idempotent per parser)."""
    if FLAG in getattr(parser, "_option_string_actions", {}):
        return
    g = parser.add_argument_group("graphcap draft graph capture (plugin)")
    g.add_argument(FLAG, dest=FLAG_DESTS["enabled"], action="store_true", default=False,
                   help="graphcap: for FROZEN_KV_MTP speculative decoding (--speculative-algorithm NEXTN/EAGLE with a "
                        "Gemma 4 assistant draft, --speculative-eagle-topk 1, Triton attention), keep the draft's "
                        "sliding-window state in graphcap's static buffers, advanced in place by each verify's "
                        "accepted tokens, and capture the whole draft iteration per decode batch bucket. Off by "
                        "default: without this flag the plugin changes nothing.")
    g.add_argument(BACKEND_FLAG, dest=FLAG_DESTS["backend"], choices=GRAPH_BACKENDS, default=PLUGIN_DEFAULT_BACKEND,
                   help="graphcap: how the draft iteration is captured: 'cudagraph' = torch.cuda.CUDAGraph of the "
                        "eager ops, 'inductor-cudagraph' = the Inductor-compiled iteration recorded in "
                        "torch.cuda.CUDAGraph. 'reduce-overhead' (torch.compile's CUDA-graph trees) is refused at "
                        "start-up: the trees free the cuBLAS workspace of graphs captured before them, "
                        "as sglang's are, and the engine crashed. Default: %(default)s.")
    g.add_argument(MANIFEST_FLAG, dest=FLAG_DESTS["manifest_dir"], default=None, metavar="DIR",
                   help="graphcap: directory for the capture manifest that `graphcap inspect DIR` lists (default: "
                        "$GRAPHCAP_MANIFEST_DIR, else $XDG_CACHE_HOME/graphcap/manifests, else "
                        "~/.cache/graphcap/manifests).")
    g.add_argument(PROJECTIONS_FLAG, dest=FLAG_DESTS["projections"], choices=PROJECTIONS, default=PROJECTIONS[0],
                   help="graphcap: whose kernels run the draft model's unquantized projections inside the captured "
                        "iteration: 'graphcap' = graphcap's skinny GEMM up to 8 rows (gate/up and gelu-mul in one "
                        "kernel), sglang's own path above; 'sglang' = sglang's own path at every batch. Default: "
                        "%(default)s.")
    g.add_argument(VERIFY_ATTENTION_FLAG, dest=FLAG_DESTS["verify_attention"], choices=VERIFY_ATTENTION,
                   default=VERIFY_ATTENTION[0],
                   help="graphcap: whose kernel runs the target verify's attention (Triton backend, "
                        "--speculative-eagle-topk 1): 'graphcap' = graphcap's split-KV verify kernel, which reads "
                        "each K/V tile once for all query heads and verify tokens of a KV head and splits the prefix "
                        "over the GPU; 'sglang' = sglang's extend (prefill) kernel. Cases graphcap's kernel does not "
                        "serve exactly run sglang's. Default: %(default)s.")


def _after_add_cli_args(result, parser, *args, **kwargs):
    add_arguments(parser)
    return result


def _after_from_cli_args(result, cls, args, *rest, **kwargs):
    opts = options_from_namespace(args)
    if not opts.enabled and (opts.backend != PLUGIN_DEFAULT_BACKEND or opts.manifest_dir is not None
                             or opts.projections != PROJECTIONS[0]
                             or opts.verify_attention != VERIFY_ATTENTION[0]):
        log.warning("graphcap: %s/%s/%s given without %s: they have no effect", BACKEND_FLAG, MANIFEST_FLAG,
                    PROJECTIONS_FLAG, FLAG)
    attach_options(result, opts)
    if opts.enabled:
        from sglang.srt.plugins.hook_registry import HookRegistry

        register_runtime_hooks(workers=SCHEDULER_MODULE in sys.modules)
        HookRegistry.apply_hooks()
    return result
