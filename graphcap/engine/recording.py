"""Recording one draft iteration per batch bucket, per backend: the capture procedure behind `DraftGraphs.capture`.
What each backend is, and which of them compile or record their own graphs, is graphcap.backends'.

Nothing here knows about dispatch: a bucket is its static inputs and its manifest record going in, and a graph with
its static outputs (manual-graph backends) coming out.
"""
from __future__ import annotations

import inspect
import time
import types
from collections.abc import Iterable, Mapping

import torch

from graphcap import manifest as mf
from graphcap.backends import MANUAL_GRAPH_BACKENDS
from graphcap.engine.guards import (CaptureError, cache_entries, cudagraph_or_error, cudagraph_skips, describe,
                                    reserved_bytes)
from graphcap.engine.iteration import DraftFn, DraftOutput, Inputs


def mark_batch_unbacked(t: torch.Tensor, top: int) -> None:
    """Mark dim 0 of `t` as the one unbacked batch symbol ("batch") of every bucket, in [1, top] where this torch
    takes a range (2.13); torch 2.11's mark_unbacked has no min/max, so there `compile_iteration`'s `batch_range`
    states the range inside the compiled function instead (torch._check)."""
    kw = {k: v for k, v in (("shape_id", "batch"), ("hint_override", top), ("min", 1), ("max", top))
          if k in _MARK_UNBACKED_PARAMS}
    torch._dynamo.decorators.mark_unbacked(t, 0, **kw)


_MARK_UNBACKED_PARAMS = frozenset(inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters)


def mark_static(static: Iterable[torch.Tensor]) -> None:
    """`mark_static_address` on every tensor a graph reads by address: one Dynamo sees as a plain input would be
    copied into the graph at every replay."""
    for t in static:
        torch._dynamo.mark_static_address(t)


def iteration_function(fn: DraftFn, tag: str, batch_range: tuple[int, int] | None = None
                       ) -> tuple[DraftFn, types.CodeType]:
    """The function a capture compiles: `fn` behind a fresh code object (`draft_iteration_<tag>`) - its own Dynamo
    cache (one entry per bucket), so recompiles are counted exactly and other compiled code in the process cannot
    push it past the recompile limit - with the unbacked batch's range stated where `batch_range` is given."""
    lo, hi = batch_range or (0, 0)

    def draft_iteration(slots, accepted, tokens, hidden):
        if batch_range is not None:  # the unbacked batch's range (mark_batch_unbacked): no branch on b == 0 or 1
            torch._check(slots.shape[0] >= lo)
            torch._check(slots.shape[0] <= hi)
        return fn(slots, accepted, tokens, hidden)

    code = draft_iteration.__code__.replace(co_name=f"draft_iteration_{tag}")
    return types.FunctionType(code, draft_iteration.__globals__, code.co_name, None, draft_iteration.__closure__), code


def compile_iteration(fn: DraftFn, backend: str, static: Iterable[torch.Tensor], buckets: int,
                      tag: str, dynamic_batch: bool = False,
                      batch_range: tuple[int, int] | None = None,
                      inductor: Mapping[str, object] | None = None) -> tuple[DraftFn, types.CodeType]:
    """`fn` under torch.compile for `backend` (one of backends' COMPILED_BACKENDS), and the code object Dynamo caches it
    under (`draft_iteration_<tag>`), whose entries count the recompiles. Every tensor of `static` (the persistent
    tensors and each bucket's static inputs) is marked with `mark_static_address`, so no replay copies it.

    A function whose `graph_breaks` attribute is true is compiled with fullgraph=False: Dynamo compiles the pieces
    between the Python it cannot trace (sglang's layers build msgspec records mid-forward), and the manual-graph
    backends still record all of it, Python glue included, in one CUDA graph. Its recompile limit is then raised
    with the recompile limit made an error, so a piece that would silently run eagerly fails the capture instead.

    `dynamic_batch`: compiled with dynamic=None instead of False, so that inputs whose batch dimension the caller
    marked dynamic (`mark_batch_unbacked`) give one graph for every bucket instead of one per bucket; `batch_range`
    (lo, hi) bounds that batch inside the function, for torch versions whose marks take no range.

    `inductor`: more Inductor options for this compile alone (e.g. gpt-fast's coordinate_descent_tuning); torch
    takes a mode or options, not both, so reduce-overhead is then given as its one option, triton.cudagraphs."""
    mark_static(static)
    fresh, code = iteration_function(fn, tag, batch_range)
    breaks = bool(getattr(fn, "graph_breaks", False))
    # pieces after a graph break are cached per layer instance and bucket: room for all of them
    limit = buckets + 2 if not breaks else 64 * (buckets + 2)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    if breaks:
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               4 * limit)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    mode = "reduce-overhead" if backend == "reduce-overhead" else None
    options = None if mode else {"triton.cudagraphs": False}  # inductor-cudagraph records its own graphs
    if inductor:
        options = {"triton.cudagraphs": mode is not None, **(options or {}), **inductor}
        mode = None
    dynamic = None if dynamic_batch else False
    return torch.compile(fresh, mode=mode, options=options, fullgraph=not breaks, dynamic=dynamic), code


def record_bucket(inputs: Inputs, rec: mf.BucketRecord, backend: str, fn: DraftFn, compiled: DraftFn | None,
                  pool) -> tuple[torch.cuda.CUDAGraph | None, DraftOutput | None]:
    """Warm up and record one bucket over its static `inputs`, filling `rec` (status, reason, capture_s,
    pool_bytes). Returns the graph and its static outputs for the manual-graph backends, else (None, None). A capture
    that fails leaves the bucket to run eagerly ("failed", the reason recorded); Inductor declining to record a CUDA
    graph is a CaptureError instead (the graphs would be silently slow)."""
    cuda = inputs[0].is_cuda
    graph = outputs = None
    before = reserved_bytes() if cuda else 0
    t0 = time.perf_counter()
    skips0 = cudagraph_skips()
    try:
        if backend in MANUAL_GRAPH_BACKENDS:
            run = fn if backend == "cudagraph" else compiled
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                # Dynamo/Inductor compile, Triton JIT, cuBLAS handles: nothing may compile during recording
                for _ in range(2):
                    run(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = run(*inputs)
        elif compiled is not None:
            with cudagraph_or_error(backend == "reduce-overhead"):
                for _ in range(3):  # compile + warm up, record, first replay
                    torch.compiler.cudagraph_mark_step_begin()
                    compiled(*inputs)
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        rec.status, rec.reason = "failed", describe(e)  # "OutOfMemoryError: CUDA out of memory. ..."
    except Exception as e:  # a failed bucket falls back to eager; the reason goes to the manifest
        reason = describe(e)
        if "skipping cudagraphs" in str(e):
            raise CaptureError(f"bucket {rec.batch_size}: Inductor would not record a CUDA graph: {reason}") from e
        rec.status, rec.reason = "failed", reason
    else:
        if backend == "reduce-overhead" and cudagraph_skips() > skips0:
            raise CaptureError(f"bucket {rec.batch_size}: Inductor skipped CUDA graphs "
                               "(see TORCH_LOGS=cudagraphs for the reason)")
        rec.status, rec.reason = "captured", None
    rec.capture_s = time.perf_counter() - t0
    rec.pool_bytes = max(0, reserved_bytes() - before) if cuda else 0
    return (None, None) if rec.status == "failed" else (graph, outputs)


class CompiledIteration:
    """The compiled iteration every bucket of one `DraftGraphs` shares, and the recompile guard around a call of it.

    Dynamo's cache for `code` (fresh per DraftGraphs, see `compile_iteration`) holds what capture compiled; an entry
    added later means a guard failed and the call ran something that was never captured."""

    def __init__(self, fn: DraftFn, code: types.CodeType | None) -> None:
        """`code` None: a precompiled iteration (`precompile`), which Dynamo does not run: nothing to count."""
        self.fn, self.code = fn, code
        self.entries = 0  # cache entries once capture finished (`seal`)

    def seal(self) -> None:
        self.entries = cache_entries(self.code) if self.code is not None else 0

    def __call__(self, size: int, *inputs: torch.Tensor) -> DraftOutput:
        """One call on bucket `size`'s static inputs (compile and reduce-overhead backends: Dynamo runs per call)."""
        torch.compiler.cudagraph_mark_step_begin()
        out = self.fn(*inputs)
        if self.code is not None and cache_entries(self.code) != self.entries:
            # Only visible once the call returned: this iteration did run (the windows advanced), slowly.
            raise CaptureError(f"bucket {size}: recompiled after capture (a guard failed: a static tensor or the "
                               "function changed; this iteration still ran and advanced the windows); run with "
                               "TORCH_LOGS=recompiles for the guard, then recapture()")
        return out
