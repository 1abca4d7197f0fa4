"""One whole draft iteration, the function graphcap captures: advance the windows, then all draft steps.

Everything it touches outside its arguments is static (model weights, WindowBuffers, the target's KV pools and
`req_to_token`), and nothing in it syncs with the host, branches on a tensor value or allocates by a GPU value -
so one CUDA graph per batch bucket can replay it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from graphcap.engine.iteration import DraftOutput  # the engine's type (re-exported here for older imports)
from graphcap.models.draft_ops import DEFAULT_OPS, DraftOps
from graphcap.models.frozen_kv_draft import FrozenKVDraft, KVSource
from graphcap.window import WindowBuffers


class DraftLoop(nn.Module):
    """Frozen-KV MTP draft iteration over the target's pools.

    Query position is `seq_len - 1` for every step (the draft attends to the target's KV and writes none), so the
    attention metadata is the same for all steps: the window ring and `req_to_token` as they are after `advance`.
    """

    def __init__(self, model: FrozenKVDraft, window: WindowBuffers, k_swa: torch.Tensor, v_swa: torch.Tensor,
                 k_full: torch.Tensor, v_full: torch.Tensor, steps: int | None = None,
                 sources: dict[str, KVSource] | None = None, ops: DraftOps = DEFAULT_OPS,
                 layer_regions: bool = True) -> None:
        """`layer_regions`: under torch.compile, each draft layer is a nested compile region (one compiled body per
        layer shape, called for every layer of every step: `FrozenKVDraft.step`). On the H200 it cut the cold
        capture of buckets 1..64 from 35.8 to 25.9 s, the iteration 0.99-1.00x as long (docs/results.md, capture);
        False inlines every layer into one graph."""
        super().__init__()
        spec = model.spec
        if window.window != spec.window:
            raise ValueError(f"DraftLoop: window buffers have W={window.window}, spec {spec.name} says {spec.window}")
        for name, pool, shape in (("k_swa", k_swa, spec.sliding), ("v_swa", v_swa, spec.sliding),
                                  ("k_full", k_full, spec.full), ("v_full", v_full, spec.full)):
            if pool.ndim != 3 or tuple(pool.shape[1:]) != (shape.kv_heads, shape.head_dim):
                raise ValueError(f"DraftLoop: {name} must be [pool, {shape.kv_heads}, {shape.head_dim}] for spec "
                                 f"{spec.name}, got {tuple(pool.shape)}")
        if not isinstance(layer_regions, bool):  # a truthy string would silently pick a compile
            raise ValueError(f"DraftLoop: layer_regions must be True or False, got {layer_regions!r}")
        self.model, self.window = model, window
        self.layer_regions = layer_regions
        self.steps = steps or spec.capture.steps
        # the layers' small ops: plain torch (the reference) or one fused kernel each (sglang's), bound to this model
        self.ops = ops.bind(model)
        self.sources = sources or {
            "sliding": KVSource(k_swa, v_swa, window.ring, window.window, window.window),
            "full": KVSource(k_full, v_full, window.req_to_token, 0, window.req_to_token.shape[1]),
        }
        self.plan_for_batches(spec.capture.buckets)  # the spec's buckets; a capture over others plans those too

    @property
    def spec(self):
        """The model's capture spec (what `DraftGraphs.for_loop` takes buckets, backend and the manifest's name from)."""
        return self.model.spec

    @property
    def padding_slot(self) -> int:
        return self.window.padding_slot

    def plan_for_batches(self, sizes: Iterable[int]) -> None:
        """Plan the attention of every batch in `sizes` (the capture's buckets) now, on the host: the traced and
        replayed calls then only look their plan up (`KVSource.plan`). `DraftGraphs.for_loop` calls it."""
        sizes = tuple(sizes)
        # per bucket from now on: a plan for any batch (an earlier dynamic_batch capture) would override these
        sources = {lt: src if src.attend is not None else src.planned(sizes).per_bucket()
                   for lt, src in self.sources.items()}
        if any(sources[lt] is not src for lt, src in self.sources.items()):  # else keep the dict compiled code saw
            self.sources = sources

    def plan_for_any_batch(self) -> None:
        """Plan the attention for any batch, not per bucket: what one compile for every bucket needs
        (a `dynamic_batch` capture calls it through `DraftGraphs.for_loop`). A per-batch plan (a Python int grid and
        wave looked up by the batch) would make Dynamo specialise the batch."""
        sources = {lt: src if src.attend is not None else src.for_any_batch() for lt, src in self.sources.items()}
        if any(sources[lt] is not src for lt, src in self.sources.items()):
            self.sources = sources

    def forward(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                hidden: torch.Tensor) -> DraftOutput:
        """`slots` [B] request-pool rows (padding rows: `window.padding_slot`), `accepted` [B] tokens the last verify
        accepted per row (0 for padding), `tokens` [B] last accepted token, `hidden` [B, target hidden]."""
        self.window.advance(slots, accepted)
        return self.draft_steps(slots, accepted, tokens, hidden)

    def draft_steps(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                    hidden: torch.Tensor) -> DraftOutput:
        """The steps alone, over the windows as they stand (the rebuild baselines call this after a rebuild)."""
        del accepted  # same signature as forward, so both capture the same way
        m, lens = self.model, self.window.seq_lens
        ropes = {lt: self.ops.rope_inputs(m, lt, slots, lens) for lt in ("sliding", "full")}
        toks, scores, margins = [], [], []
        for _ in range(self.steps):
            tokens, score, margin, hidden = m.step(tokens, hidden, ropes, self.sources, slots, lens, self.ops,
                                                    layer_regions=self.layer_regions)
            toks.append(tokens)
            scores.append(score)
            margins.append(margin)
        return DraftOutput(torch.stack(toks, 1), torch.stack(scores, 1), torch.stack(margins, 1), hidden)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor the loop reads or writes: weights, window buffers, pools."""
        out = {f"model.{n}": t for n, t in self.model.named_parameters()}
        out.update({f"model.{n}": t for n, t in self.model.named_buffers()})
        out.update({f"window.{n}": t for n, t in self.window.static_tensors().items()})
        out.update({f"ops.{n}": t for n, t in self.ops.static_tensors().items()})
        for lt, src in self.sources.items():
            out[f"{lt}.k_pool"], out[f"{lt}.v_pool"] = src.k_pool, src.v_pool
        return out

    def precompile_signature(self) -> str:
        """What a precompiled iteration bakes in beyond its tensors' shapes (engine.precompile): the step count and
        the attention plans."""
        plans = {lt: (src.any_batch, sorted(src.plans.items())) for lt, src in self.sources.items()
                 if src.attend is None}
        return f"steps={self.steps};layer_regions={self.layer_regions};plans={plans}"

    def pool_dims(self) -> dict[str, tuple[int, ...]]:
        """The dimensions of `static_tensors` sized by the engine's memory settings (the pools' token capacity, the
        window buffers'), which capture compiles symbolically; the model's own tensors follow the spec."""
        out = {f"window.{n}": d for n, d in self.window.pool_dims().items()}
        for lt in self.sources:
            out[f"{lt}.k_pool"] = out[f"{lt}.v_pool"] = (0,)
        return out

    def example_inputs(self, batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Random inputs for `batch` padding rows: capture warms up on these without touching any live slot."""
        dev, spec = self.window.device, self.model.spec
        g = torch.Generator(device=dev).manual_seed(seed)
        slots = torch.full((batch,), self.window.padding_slot, dtype=torch.int64, device=dev)
        accepted = torch.zeros(batch, dtype=torch.int32, device=dev)
        tokens = torch.randint(0, spec.draft.vocab, (batch,), generator=g, device=dev)
        hidden = torch.randn(batch, spec.target.hidden, generator=g, device=dev).to(self.model.embed.dtype)
        return slots, accepted, tokens, hidden
