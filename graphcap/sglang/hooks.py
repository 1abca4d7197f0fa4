"""The hook functions `graphcap.sglang.plugin.register_runtime_hooks` installs (the worker's only when the flag is on).

Each is thin: it finds the worker's graphcap runtime (or every live runtime, for the schedule-batch hooks) and hands
over; with no runtime attached it is a pass-through, so a worker graphcap declined to serve behaves as stock sglang.
Signatures follow sglang's HookRegistry: BEFORE fn(*args), AFTER fn(result, *args), AROUND fn(original, *args).
"""
from __future__ import annotations

import logging
import weakref

from graphcap.sglang import variants
from graphcap.sglang.compat import DraftCaptureConfigError, SglangLayoutError, swa_evicted_len
from graphcap.sglang.config import options_of, unpatched_worker_hooks, validate_server_args
from graphcap.sglang.runtime import GraphcapDraftRuntime
from graphcap.sglang.seed import last_extend_hidden
from graphcap.sglang.slots import slot_of

log = logging.getLogger("graphcap.sglang")
RUNTIME_ATTR = "_graphcap_runtime"  # on the FrozenKVMTPDraftWorker
_RUNTIMES: weakref.WeakSet = weakref.WeakSet()  # live runtimes in this process (the batch hooks reach them here)
_WARNED: set[str] = set()  # per-iteration conditions already logged in this process (warn once, not every iteration)


def runtime_of(worker):
    return getattr(worker, RUNTIME_ATTR, None)


def live_runtimes() -> list:
    return [rt for rt in list(_RUNTIMES) if rt.active]


def before_check_server_args(server_args, *args, **kwargs):
    validate_server_args(server_args)
    return None  # arguments unchanged


def around_init_cuda_graphs(original, worker, *args, **kwargs):
    """sglang's `init_cuda_graphs` runs `TpModelWorker.init_cuda_graphs` and then `_capture_cuda_graphs` (its own
    FrozenKVMTPCudaGraphRunner) inside the draft's TP/PP/MoE contexts. When graphcap serves this worker, the second
    call captures graphcap's loop instead, in the same contexts; otherwise everything runs as stock sglang."""
    opts = options_of(getattr(worker, "server_args", None))
    if not opts.enabled:
        return original(worker, *args, **kwargs)
    missing = unpatched_worker_hooks()
    if missing:
        raise DraftCaptureConfigError(f"graphcap: sglang did not install its hooks on {', '.join(missing)} (sglang's "
                                      "log says why); --enable-draft-graph-capture cannot run without them")
    runtime = GraphcapDraftRuntime.for_worker(worker, opts)  # raises DraftCaptureConfigError, or None: stays off
    if runtime is None:
        return original(worker, *args, **kwargs)
    worker._capture_cuda_graphs = runtime.capture  # instance attribute shadows the method for this one call
    try:
        result = original(worker, *args, **kwargs)
    finally:
        del worker._capture_cuda_graphs
    setattr(worker, RUNTIME_ATTR, runtime)
    _RUNTIMES.add(runtime)
    return result


def around_draft(original, worker, batch, *args, **kwargs):
    rt = runtime_of(worker)
    if rt is None or not rt.active or batch.forward_mode.is_idle():
        return original(worker, batch, *args, **kwargs)
    variants.note_draft()
    return rt.draft(batch, fallback=lambda: original(worker, batch, *args, **kwargs))


def after_draft_extend_for_prefill(result, worker, batch, *args, **kwargs):
    rt = runtime_of(worker)
    if rt is not None and rt.active and not batch.forward_mode.is_idle():
        rt.tracker.on_join(batch.reqs)
    return None  # keep sglang's seed


def around_select_last_extend_hidden(original, worker, batch, hidden_states, *args, **kwargs):
    """A prefill's seed rows: graphcap.sglang.seed's gather (no host sync) where graphcap serves the worker."""
    rt = runtime_of(worker)
    if rt is None or not rt.active or args or kwargs:
        return original(worker, batch, hidden_states, *args, **kwargs)
    return last_extend_hidden(batch.extend_lens, batch.batch_size(), hidden_states)


def after_draft_extend_for_decode(result, worker, batch, batch_result, *args, **kwargs):
    rt = runtime_of(worker)
    if rt is not None and rt.active and not batch.forward_mode.is_idle():
        rt.tracker.on_accept(batch.req_pool_indices, batch_result.accept_lens)
    return None


def around_retract_decode(original, batch, *args, **kwargs):
    before = [(id(r), slot_of(r)) for r in batch.reqs]
    result = original(batch, *args, **kwargs)
    kept = {id(r) for r in batch.reqs}
    gone = [slot for rid, slot in before if rid not in kept and slot is not None]
    for rt in live_runtimes():
        rt.tracker.on_retract(gone)
    return result


def around_evict_swa(original, batch, req, pre_len, *args, **kwargs):
    slot = slot_of(req)
    result = original(batch, req, pre_len, *args, **kwargs)
    evicted = _evicted_swa_len(req)
    if slot is not None and evicted is not None:
        for rt in live_runtimes():
            rt.tracker.on_evict(slot, evicted_upto=evicted, seq_len=pre_len + 1)
    return result


def _evicted_swa_len(req) -> int | None:
    """How far (absolute position) the request's SWA pages have been freed, from sglang's own bookkeeping
    (`compat.swa_evicted_len`: either layout); where neither layout is there, a position past any window, so
    the row is rebuilt (safe), with one warning per process."""
    try:
        return swa_evicted_len(req)
    except SglangLayoutError as e:  # a layout this code was not written for: reset to be safe
        if "evicted_swa_len" not in _WARNED:  # runs per request and iteration: once is enough to act on
            _WARNED.add("evicted_swa_len")
            log.warning("graphcap: cannot read sglang's SWA eviction frontier of request %s (%s). graphcap rebuilds a "
                        "request's window after every SWA eviction check it cannot read (safe, but each rebuild syncs "
                        "with the GPU). Logged once per process.", getattr(req, "rid", "?"), e)
        return 1 << 62


def after_triton_backend_init(result, backend, model_runner, *args, **kwargs):
    """A TritonAttnBackend was built: on the target's, seat graphcap's verify kernel when the options ask for it
    (graphcap.sglang.verify decides whether this backend is one it serves)."""
    opts = options_of(getattr(model_runner, "server_args", None))
    if opts.enabled and opts.verify_attention == "graphcap":
        from graphcap.sglang import verify as sglang_verify

        sglang_verify.install(backend, model_runner)
    return None
