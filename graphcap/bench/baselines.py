"""The baselines graphcap is measured against, all on the same model, weights and target state:

- `RebuildBaseline`: graphcap's model and kernels driven the way sglang drives the frozen-KV draft. Every iteration
  rebuilds every row's window from `req_to_token` (the gather-and-translate work of sglang's
  `update_sliding_window_buffer`, O(batch x min(ctx, W))), does sglang's `seq_lens.sum().item()` host sync, then runs
  the steps eagerly (`eager-rebuild`) or replayed from a CUDA graph of the steps alone (`graph-rebuild`). The rebuild
  writes the ring in the canonical layout `advance` keeps, so both produce exactly graphcap's tokens.
- `SglangBaseline` (`sglang`): what sglang 0.5.23 launches on CUDA - the fused op set (one kernel per norm,
  add-norm, gelu-mul, rotary; sglang's centroid head: contiguous row gather, batched product), sglang's
  index builder, split rule (both layer types planned with the full layers' KV heads, every layer's decode reading
  the full rows' plan, as sglang; graphcap.bench.sglang_ops) and decode kernel (with PDL at compute capability >= 9,
  as sglang with the real sgl_kernel), the rebuild and `.item()` eager, the steps in one CUDA graph.
- `CompiledBaseline` (`compile`): what a user builds without graphcap - the same draft loop as `sglang` with the
  metadata rebuilt inside the compiled function, sglang's kernels as opaque custom ops, under
  torch.compile(mode="reduce-overhead", fullgraph=True), every persistent tensor marked static. sglang's
  `seq_lens.sum().item()` is in its worker's draft(), outside anything a user would compile: here it is in `run()`,
  before the compiled call, so both modes pay the same host sync. Without CUDA: graphcap's torch twins for the
  rebuild and attention.
- `CompiledBaseline(host_sync=False)` (`compile-nosync`): the same compiled loop without that sync - the most a user
  gets from torch.compile alone if they also take sglang's `.item()` out of the worker.
- `compile-plain` (a default mode with CUDA only): a hand-written loop under the same compile - plain torch ops for
  the norms, activation and rotary (Inductor fuses them with their neighbours, where sglang's fused kernels are
  opaque to it), the centroid head's gather and product, torch.topk, sglang's attention kernels, no sync: built to
  the description of a loop that beat graphcap at batch 1 in an earlier H200 measurement (not reproduced:
  docs/results.md).
- `compile-tuned` (a default mode with CUDA only): `compile-plain` with gpt-fast's Inductor setting,
  `coordinate_descent_tuning` - Inductor then tunes each generated kernel's launch config, and lowers a one-row
  matmul to a multiply-and-sum reduction it tunes (torch/_inductor/decomposition.py, `mm`): what a user who
  follows gpt-fast compiles.

A baseline whose graphs were lost is not a baseline: `graph_problem(runner)` says why a mode's measured calls may not
be its captured graphs - a DraftGraphs bucket that failed to capture (it runs eagerly), a call past the largest
bucket, Inductor skipping the compiled baseline's CUDA graphs, a recompile after capture - and the bench then gives
no speed-ups against (or of) that mode.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from graphcap.bench.sglang_ops import SglangAttention
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.guards import cache_entries, cudagraph_or_error, cudagraph_skips, describe
from graphcap.engine.iteration import DraftOutput
from graphcap.engine.options import CaptureOptions
from graphcap.kernels.window.update import window_reset
from graphcap.models.draft_loop import DraftLoop
from graphcap.models.draft_ops import DraftOps
from graphcap.engine.recording import compile_iteration


# gpt-fast's Inductor setting that changes the kernels (its others name kernels and cache compiles)
GPT_FAST_INDUCTOR = {"coordinate_descent_tuning": True}


class RebuildBaseline:
    def __init__(self, loop: DraftLoop, graphed: bool, buckets: Sequence[int] | None = None) -> None:
        self.loop = loop
        self.syncs = 0  # host syncs issued (one per iteration, as in sglang)
        self.graphs: DraftGraphs | None = None
        if graphed:
            backend = "cudagraph" if loop.window.device.type == "cuda" else "eager"
            self.graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend=backend, buckets=buckets,
                                                                    manifest_path=None), steps_only=True)

    @property
    def name(self) -> str:
        return "graph-rebuild" if self.graphs is not None else "eager-rebuild"

    def capture(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    def run(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
            *, host_slots: Sequence[int] | None = None) -> DraftOutput:
        w = self.loop.window
        new_lens = w.seq_lens[slots] + accepted.to(w.seq_lens.dtype)
        self.seq_lens_sum = int(new_lens.sum().item())  # sglang's per-iteration device-to-host sync
        self.syncs += 1
        window_reset(w.ring, w.seq_lens, w.req_to_token, w.full_to_swa, slots, new_lens)
        if self.graphs is not None:
            return self.graphs.run(slots, accepted, tokens, hidden, host_slots=host_slots)
        return self.loop.draft_steps(slots, accepted, tokens, hidden)


class SglangBaseline:
    name = "sglang"

    def __init__(self, loop: DraftLoop, ops: DraftOps, buckets: Sequence[int], *, cores: int | None = None,
                 backend: str = "cudagraph") -> None:
        """`cores` and `backend` (not "cudagraph") serve CPU tests under Triton's interpreter."""
        w, m = loop.window, loop.model
        pools = {lt: (src.k_pool, src.v_pool) for lt, src in loop.sources.items()}
        self.window, self.syncs = w, 0
        self.attention = SglangAttention(w, pools, m.spec.draft.heads, buckets[-1], opaque=False, cores=cores)
        self.loop = DraftLoop(m, w, *pools["sliding"], *pools["full"], steps=loop.steps,
                              sources=self.attention.sources(), ops=ops)
        self.graphs = DraftGraphs.for_loop(self.loop, CaptureOptions(backend=backend, buckets=buckets,
                                                                     manifest_path=None), steps_only=True)

    def capture(self) -> None:
        self.graphs.capture()

    def run(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
            *, host_slots: Sequence[int] | None = None) -> DraftOutput:
        w = self.window
        lens = w.seq_lens[slots] + accepted.to(w.seq_lens.dtype)
        w.seq_lens[slots] = lens
        self.seq_lens_sum = int(lens.sum().item())  # sglang's per-iteration device-to-host sync
        self.syncs += 1
        self.attention.rebuild(slots, lens)
        return self.graphs.run(slots, accepted, tokens, hidden, host_slots=host_slots)


class CompiledBaseline:
    def __init__(self, loop: DraftLoop, ops: DraftOps, batches: Sequence[int], sglang_kernels: bool,
                 warm_slots: torch.Tensor, *, cores: int | None = None, host_sync: bool = True,
                 name: str | None = None, inductor: dict[str, object] | None = None) -> None:
        w, m = loop.window, loop.model
        self.host_sync = host_sync
        self.name = name or ("compile" if host_sync else "compile-nosync")
        self.warm_slots = warm_slots
        pools = {lt: (src.k_pool, src.v_pool) for lt, src in loop.sources.items()}
        self.window, self.batches, self.syncs = w, tuple(batches), 0
        self.attention = SglangAttention(w, pools, m.spec.draft.heads, max(batches), opaque=True, cores=cores) \
            if sglang_kernels else None
        sources = self.attention.sources() if self.attention else None
        # layers inlined, as a user's torch.compile of the loop has them (graphcap's layer regions are a compile-time
        # choice: its iteration with them ran 0.99-1.00x as long as without on the H200)
        self.loop = DraftLoop(m, w, *pools["sliding"], *pools["full"], steps=loop.steps, sources=sources, ops=ops,
                              layer_regions=False)
        self.loop.plan_for_batches(self.batches)  # graphcap's attention (no sglang kernels): planned before the trace
        static = dict(self.loop.static_tensors())
        if self.attention:
            static.update(self.attention.static_tensors())
        # the code object Dynamo caches the compiled iteration under: its entries count the recompiles
        self._fn, self._code = compile_iteration(self._iteration, "reduce-overhead", static.values(),
                                                 len(self.batches), f"compile_mode_{id(self):x}", inductor=inductor)
        self.cuda = w.device.type == "cuda"
        self._entries: int | None = None  # Dynamo cache entries after capture
        self.capture_problem = ""

    def _iteration(self, slots, accepted, tokens, hidden) -> DraftOutput:
        w = self.window
        lens = w.seq_lens[slots] + accepted.to(w.seq_lens.dtype)
        if self.attention is not None:
            w.seq_lens[slots] = lens
            self.attention.rebuild(slots, lens)
        else:  # graphcap's rebuild op (its torch twin on a CPU), then graphcap's attention reads the ring
            window_reset(w.ring, w.seq_lens, w.req_to_token, w.full_to_swa, slots, lens)
        return self.loop.draft_steps(slots, accepted, tokens, hidden)

    def capture(self) -> None:
        """Compile (and on CUDA record) every measured batch size once, on live rows with nothing accepted: the
        windows are rebuilt as they stand, so the state does not move. On CUDA Inductor must record its graphs
        (`cudagraph_or_error`, and its skip counter unchanged); a capture that did not is `capture_problem`."""
        skips0 = cudagraph_skips()
        try:
            with cudagraph_or_error(self.cuda):
                for b in self.batches:
                    slots = self.warm_slots[:b]
                    zeros = torch.zeros(b, dtype=torch.int32, device=slots.device)
                    _, _, tokens, hidden = self.loop.example_inputs(b)
                    for _ in range(3):  # compile, record, first replay
                        self.run(slots, zeros, tokens, hidden)
        except Exception as e:
            if "skipping cudagraphs" not in str(e):
                raise
            self.capture_problem = f"Inductor would not record a CUDA graph: {describe(e)}"
        if self.cuda:
            torch.cuda.synchronize()
            if not self.capture_problem and cudagraph_skips() > skips0:
                self.capture_problem = "Inductor skipped CUDA graphs at capture (TORCH_LOGS=cudagraphs says why)"
        self._entries = cache_entries(self._code)

    def graph_problem(self) -> str:
        """Why the measured calls may not be the captured ones ('' if they are): the capture's problem, or Dynamo
        cache entries added since capture (a guard failed: the calls were recompiled, and not replayed)."""
        if self.capture_problem:
            return self.capture_problem
        if self._entries is None:
            return "not captured"
        new = cache_entries(self._code) - self._entries
        return f"recompiled after capture ({new} new Dynamo cache entries)" if new > 0 else ""

    def run(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
            *, host_slots: Sequence[int] | None = None) -> DraftOutput:
        w = self.window
        if self.host_sync:  # sglang's per-iteration device-to-host sync, in its worker's draft() as here: outside
            # the compiled function
            self.seq_lens_sum = int((w.seq_lens[slots] + accepted.to(w.seq_lens.dtype)).sum().item())
            self.syncs += 1
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration: the last one's outputs may be overwritten
        return self._fn(slots, accepted, tokens, hidden)


def graph_problem(runner) -> str:
    """Why a mode's measured calls may not be its captured graphs, or '' when they are (or it has none to lose:
    eager-rebuild): see the module docstring."""
    if isinstance(runner, CompiledBaseline):
        return runner.graph_problem()
    graphs = runner if isinstance(runner, DraftGraphs) else getattr(runner, "graphs", None)
    if graphs is None:
        return ""
    out = [f"bucket {r.batch_size} not captured ({r.reason}), ran eagerly" for r in graphs.buckets
           if r.status != "captured"]
    if graphs.oversize_fallbacks:
        out.append(f"{graphs.oversize_fallbacks} calls past the largest bucket ran eagerly")
    return "; ".join(out)
