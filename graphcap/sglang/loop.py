"""The draft iteration graphcap captures over sglang's own Gemma 4 assistant model: `SglangAssistantLoop` (advance the
windows, then the seed step and the other steps of sglang's model, as `FrozenKVMTPDraftWorker.draft_forward` does
them), `GraphcapDraftAttention` (the attention backend those steps see: graphcap's decode kernel over the target's
pools, sliding layers through graphcap's window ring), and what makes sglang's layers traceable by Dynamo
(`_eager_boundaries`). The per-worker runtime that captures and serves it is graphcap.sglang.runtime.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from graphcap.sglang import head as sglang_head
from graphcap.sglang import linear as sglang_linear
from graphcap.sglang.compat import layer_boundary_owners
from graphcap.engine.iteration import DraftOutput
from graphcap.window import WindowBuffers

if TYPE_CHECKING:
    from graphcap.kernels.attention.plan import AttentionPlan

# sglang 0.5.23's layer-boundary entry points the assistant's forward calls (Gemma4TextModel.forward and
# Gemma4DecoderLayer.forward/_next_stream): the residual-stream bookkeeping that builds msgspec records
# (ResidualStream.record's Contribution / OwedOutput, DeclaredSum, ExitDecision) mid-forward, which Dynamo cannot build.
# The norms and residual adds they run (input / post-attention / pre-FFN / final norm) run eagerly with them.
_EAGER_BOUNDARY_ENTRIES = (
    ("sglang.srt.layers.layer_boundary.stage", "StageBoundary", "prepare"),  # attn/ffn input: add + norm
    ("sglang.srt.layers.layer_boundary.stage", "StageBoundary", "finish"),  # records the stage's Contribution
    ("sglang.srt.layers.layer_boundary.stage", "StageBoundary", "sum_part"),  # FFN part's TP sum (MoE: per part)
    ("sglang.srt.layers.layer_boundary.residual.batch", None, "start"),  # new ResidualStream on the batch
    ("sglang.srt.layers.layer_boundary.residual.batch", None, "written_residual"),  # reads the stream's residual
    ("sglang.srt.layers.layer_boundary.residual.batch", None, "final_norm"),  # completes the stream + final norm
)
_EAGER_MARK = "_graphcap_eager_boundary"


def _eager_boundaries() -> None:
    """Wrap sglang's layer-boundary entry points (`_EAGER_BOUNDARY_ENTRIES`) in `torch._dynamo.disable`, once per
    process (idempotent: an entry already wrapped is left as it is). Dynamo then graph-breaks cleanly at each call
    and runs it eagerly, and traces the rest of the assistant's forward: attention (qkv proj, q norm, rope, the
    backend call, o proj), MLP, the post-FFN norm and residual, and the logits head. Without this, torch.compile of
    the iteration fails inside these calls (`object.__new__(Contribution) is not safe`). An sglang without the
    layer-boundary package (0.5.18: plain adds and norms, nothing Dynamo cannot build) has nothing to wrap
    (`compat.layer_boundary_owners`).

    Patched on sglang's classes and modules, so the target model's layers get it too. Outside torch.compile a
    disabled function is a plain call (about 0.3 us, and nothing in a replayed CUDA graph), so sglang's own eager and
    CUDA-graph paths run the same code; but under sglang's own fullgraph compile of the target (--enable-torch-compile)
    a disabled call is an error, which is why only a graphcap backend that compiles asks for this
    (`SglangAssistantLoop.prepare`). The residual_batch functions are looked up on their module at each call
    (gemma4_causal.py calls `residual_batch.start(...)`), so replacing the module attribute reaches them."""
    for owner, attr, _ in layer_boundary_owners(_EAGER_BOUNDARY_ENTRIES):
        fn = vars(owner)[attr]
        if getattr(fn, _EAGER_MARK, False):
            continue
        wrapped = torch._dynamo.disable(fn)
        setattr(wrapped, _EAGER_MARK, True)
        setattr(owner, attr, wrapped)


class GraphcapDraftAttention:
    """Stands in for the draft's attention backend inside graphcap's iteration (RadixAttention calls
    `get_attn_backend().forward`): sliding layers read graphcap's ring (SWA-pool ids), full layers `req_to_token`,
    both through graphcap's decode kernel over the target's pools. The draft writes no KV.

    Its attention plans (split grid, launch configuration) are made per layer and bucket before capture
    (`plan_for`, from `SglangAssistantLoop.prepare`), so the traced and replayed forward only looks them up."""

    def __init__(self, window: WindowBuffers, target_pool, max_context: int) -> None:
        self.window, self.token_to_kv_pool, self.max_context = window, target_pool, max_context
        self.slots: torch.Tensor | None = None
        self._plans: dict[tuple[int, int], AttentionPlan] = {}  # (layer id, batch) -> its plan

    def bind(self, slots: torch.Tensor) -> None:
        self.slots = slots

    def plan_for(self, layers: Iterable, sizes: Iterable[int]) -> None:
        """Plan the attention of every layer in `layers` (sglang's RadixAttention modules of the draft) at every
        batch in `sizes`, on the host."""
        sizes = tuple(sizes)
        for layer in layers:
            for b in sizes:
                self._plans[(layer.layer_id, b)] = self._plan(layer, b)

    @staticmethod
    def _sliding(layer) -> bool:
        return layer.sliding_window_size is not None and layer.sliding_window_size > -1

    def _plan(self, layer, batch: int | None) -> AttentionPlan:
        from graphcap.kernels.attention.plan import plan_attention

        kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        max_len = self.window.window if self._sliding(layer) else self.max_context
        return plan_attention(batch, kb.shape[1], layer.qk_head_dim, kb.dtype, kb.device, max_len)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        from graphcap.kernels.attention.decode import decode_attention

        sliding = self._sliding(layer)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vb = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        table, w = (self.window.ring, self.window.window) if sliding else (self.window.req_to_token, 0)
        b = q3.shape[0]
        plan = self._plans.get((layer.layer_id, b)) if isinstance(b, int) else None
        if plan is None:  # a batch no bucket planned for (the eager path above the largest bucket)
            plan = self._plan(layer, b if isinstance(b, int) else None)
        o = decode_attention(q3, kb, vb, table, self.slots, self.window.seq_lens, w, float(layer.scaling), plan=plan)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    forward_decode = forward


def greedy_pick(out) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy token and its logit from one forward's output: from the centroid head's candidates where the model
    returned them (`sglang_head.HeadCandidates`, graphcap's marked batches), else from the logits."""
    if isinstance(out, sglang_head.HeadCandidates):
        return out.greedy_token()
    return greedy_token(out.next_token_logits)


def greedy_token(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sglang's greedy draft token for topk == 1 and its logit (fp32). sglang takes `max` over `softmax(logits)`;
    softmax is monotone, so this takes `max` over the logits themselves - one reduction in their own dtype, the first
    index on a tie, as sglang's - and skips the softmax pass. The two differ only where a smaller logit's bf16
    probability rounds to the top one's, which needs two top logits under 2 in magnitude (from 2 up, distinct bf16
    logits are >= 1.6% apart in probability, two bf16 steps of it)."""
    top = logits.max(dim=-1)
    return top.indices, top.values.float()


class SglangAssistantLoop:
    """fn(slots, accepted, tokens, hidden) -> DraftOutput: advance, then the seed step and steps - 1 more steps of
    sglang's Gemma 4 assistant (greedy: topk == 1), as `FrozenKVMTPDraftWorker.draft_forward` does them.

    Built for Dynamo: nothing sglang-side is constructed inside the call. The ForwardBatch of each bucket is built
    beforehand (`prepare`), and the forward context (sglang's module-level global that RadixAttention reads its
    backend from) is set by the caller around every call (`context()`, which sets this loop's one context object
    itself): Dynamo guards on that global, so it must be the same object at every call, capture and replay alike.

    Compiled (the capture engine's Inductor backends compile the whole call; `prepare(compile_model=True)` only
    sglang's model forward, as sglang's own --enable-torch-compile does): sglang 0.5.23's layers construct msgspec
    records (its residual-stream bookkeeping) inside the forward, which Dynamo cannot build, so the call compiles
    with graph breaks there (`graph_breaks`, `_eager_boundaries`); the manual-graph backends record the compiled
    pieces and the Python between them in one CUDA graph, so a replay runs none of that Python."""

    graph_breaks = True  # read by graphcap.engine.recording.compile_iteration

    def __init__(self, worker, window: WindowBuffers, attention: GraphcapDraftAttention, steps: int) -> None:
        from sglang.srt.model_executor.forward_context import ForwardContext

        self.worker, self.window, self.attention, self.steps = worker, window, attention, steps
        self.model = worker.draft_model_runner.model
        self.forward_ctx = ForwardContext(attn_backend=attention)
        self._forward = self.model.forward
        self._batches: dict[int, object] = {}
        self.projections_routed = 0  # linear layers prepare() sent through graphcap's skinny GEMM

    def prepare(self, sizes, *, compiled: bool = True, compile_model: bool = False, projections: bool = False) -> None:
        """Build the ForwardBatch and the attention plans of every batch size that can reach the loop (buckets, and
        the eager path's larger batches are built on demand by `forward_batch`). `compiled`: something will compile
        sglang's layers (the capture engine's Inductor backends, or `compile_model`: wrap the model's forward in
        torch.compile, Inductor without CUDA graphs of its own), so Dynamo must break around sglang's residual-stream
        bookkeeping. Only then are sglang's boundary functions patched: under sglang's own fullgraph compile of the
        target a disabled function would be an error, so a plain `cudagraph` capture leaves them alone. The model's
        centroid head, if it has one, reads its LM-head rows through graphcap's kernel from here on
        (graphcap.sglang.head); with `projections`, its projections run graphcap's skinny GEMM at the
        batch sizes it serves (graphcap.sglang.linear)."""
        sizes = tuple(sizes)
        for b in sizes:
            self._batches[b] = self._new_forward_batch(b)
        if isinstance(self.attention, GraphcapDraftAttention):  # (a test's stand-in backend plans nothing)
            from sglang.srt.layers.radix_attention import RadixAttention

            layers = [m for m in self.model.modules() if isinstance(m, RadixAttention)]
            self.attention.plan_for(layers, sizes)
        sglang_head.install(self.model)  # before any capture records sglang's gather
        self.projections_routed = sglang_linear.install(self.model) if projections else 0
        if compiled or compile_model:
            _eager_boundaries()
        for m in self.model.modules():  # sglang's fused ops pick their implementation at their first call: pick it
            if getattr(m, "_forward_method", 0) is None and hasattr(m, "_resolve_forward_method"):  # now, not in a trace
                m._forward_method = m._resolve_forward_method()
        if compile_model:
            self._forward = torch.compile(self.model.forward, fullgraph=False, dynamic=False,
                                          options={"triton.cudagraphs": False})

    @contextlib.contextmanager
    def context(self):
        """sglang's forward context for this loop's calls (enter it around capture, replay and eager runs). Sets this
        loop's own context object (sglang's `forward_context()` may hand a copy instead, which Dynamo's guard on the
        global would see as a change) and restores whatever was there."""
        from sglang.srt.model_executor.forward_context import set_forward_context

        prev = set_forward_context(self.forward_ctx)
        try:
            yield
        finally:
            set_forward_context(prev)

    def forward_batch(self, b: int):
        fb = self._batches.get(b)
        if fb is None:  # eager path only (a batch above the largest bucket): built per call, outside any trace, and
            # not kept (one per size would hold its hidden states for good)
            fb = self._new_forward_batch(b)
        return fb

    def __call__(self, slots, accepted, tokens, hidden):
        self.window.advance(slots, accepted)
        positions = self.window.seq_lens.index_select(0, slots).to(torch.int64).sub(1).clamp(min=0)
        fb = self.forward_batch(slots.shape[0])
        self.attention.bind(slots)
        toks, scores = [], []
        for _ in range(self.steps):
            fb.spec_info.hidden_states = hidden  # the assistant reads its recurrent input from here
            out = self._forward(tokens, positions, fb)
            tokens, score = greedy_pick(out)
            hidden = out.hidden_states
            toks.append(tokens)
            scores.append(score)
        score = torch.stack(scores, 1)
        # no runner-up: sglang's chain needs the token alone, and a top-2 costs a multi-pass top-k over the vocabulary
        return DraftOutput(torch.stack(toks, 1), score, torch.full_like(score, float("nan")), hidden)

    def _new_forward_batch(self, b: int):
        """The ForwardBatch sglang's FrozenKVMTPCudaGraphRunner.capture_one_shape builds. Its tensors are
        placeholders of the right batch size: graphcap's attention reads the window buffers, and the model reads
        only the batch's mode, size and spec_info from it."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.frozen_kv_mtp_info import FrozenKVMTPDraftInput

        dev = self.window.device
        hidden = torch.zeros(b, int(self.model.backbone_hidden_size), dtype=self.worker.model_config.dtype,
                             device=dev)
        spec_info = FrozenKVMTPDraftInput(hidden_states=hidden, capture_hidden_mode=CaptureHiddenMode.LAST)
        spec_info.num_tokens_per_req = spec_info.num_tokens_for_logprob_per_req = 1
        zeros = torch.zeros(b, dtype=torch.int64, device=dev)
        spec_info.positions = zeros
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=b, input_ids=zeros.clone(), req_pool_indices=zeros.clone(),
            seq_lens=zeros.clone(), seq_lens_cpu=None, out_cache_loc=None,
            seq_lens_sum=b * self.attention.max_context, return_logprob=False, positions=zeros,
            spec_algorithm=self.worker.draft_model_runner.spec_algorithm, spec_info=spec_info,
            capture_hidden_mode=CaptureHiddenMode.LAST)
        setattr(fb, sglang_head.CANDIDATES_MARK, True)  # its centroid head returns candidates, not a vocabulary row
        return fb

    def example_inputs(self, b: int):
        dev = self.window.device
        return (torch.full((b,), self.window.padding_slot, dtype=torch.int64, device=dev),
                torch.zeros(b, dtype=torch.int32, device=dev), torch.zeros(b, dtype=torch.int64, device=dev),
                torch.zeros(b, int(self.model.backbone_hidden_size), dtype=self.worker.model_config.dtype, device=dev))
