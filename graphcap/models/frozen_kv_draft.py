"""A reference frozen-KV MTP draft with the Gemma 4 assistant's structure and cost, built from a capture spec.

Per step: pre-projection of [target embedding * sqrt(target hidden), previous hidden] -> the draft's sliding/full
layers (query-only attention over the target's KV, gated MLP, Gemma-style norms and a per-layer scalar) -> final
norm -> post-projection (the next step's "previous hidden") and the LM head (full vocab, or the assistant's
centroid head) -> greedy token. Weights are random (seeded): graphcap measures and captures the draft phase; it
does not ship a trained draft. What is simplified against Gemma 4 is listed in docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from graphcap.kernels.attention.decode import decode_attention
from graphcap.kernels.attention.plan import AttentionPlan, plan_attention
from graphcap.models.draft_ops import TORCH_OPS, DraftOps
from graphcap.spec import CaptureSpec


@dataclass(frozen=True)
class KVSource:
    """Where one layer type's attention reads: pools, the index table and the window (0 = full attention), and its
    attention plans: one per batch bucket, made on the host before capture (`planned`), so that neither the eager
    call nor a trace of it plans anything."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    table: torch.Tensor  # sliding: WindowBuffers.ring; full: req_to_token
    window: int
    max_len: int  # the longest row this source can hold (the split grid is sized for it)
    attend: Callable[[torch.Tensor, float], torch.Tensor] | None = None  # another attention (the sglang baseline)
    plans: Mapping[int, AttentionPlan] = field(default_factory=dict, compare=False)  # per batch (bucket)
    # One plan for every batch (one compile for every bucket: no host value may be derived from a symbolic batch): the
    # grid's split count an expression of the batch (`AttentionPlan.grid_splits`), each row's share decided in-kernel.
    any_batch: AttentionPlan | None = field(default=None, compare=False)

    def _plan(self, batch: int | None) -> AttentionPlan:
        return plan_attention(batch, self.k_pool.shape[1], self.k_pool.shape[-1], self.k_pool.dtype,
                              self.k_pool.device, self.max_len)

    def planned(self, batches: Iterable[int]) -> KVSource:
        """This source with plans for `batches` too (itself when it has them: compiled code guards on the object)."""
        new = {b: self._plan(b) for b in batches if b not in self.plans}
        return dataclasses.replace(self, plans={**self.plans, **new}) if new else self

    def per_bucket(self) -> KVSource:
        """This source without its plan for any batch (itself when it has none)."""
        return self if self.any_batch is None else dataclasses.replace(self, any_batch=None)

    def for_any_batch(self) -> KVSource:
        return self if self.any_batch is not None else dataclasses.replace(self, any_batch=self._plan(None))

    def plan(self, batch: int) -> AttentionPlan:
        """The plan of a call over `batch` rows: the one made for it (or for any batch), else made now - a batch no
        bucket planned for (the eager path above the largest bucket, a direct call)."""
        if self.any_batch is not None:
            return self.any_batch
        p = self.plans.get(batch)
        return p if p is not None else self._plan(batch)


def random_weight(out_f: int, in_f: int, gen: torch.Generator, dtype: torch.dtype, device) -> nn.Parameter:
    """[out_f, in_f] N(0, 1/in_f) (drawn in fp32 from `gen`, so a seed gives the same model in every dtype)."""
    t = torch.randn(out_f, in_f, generator=gen, device=device, dtype=torch.float32) / math.sqrt(in_f)
    return nn.Parameter(t.to(dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """Gemma-style RMSNorm's weight (scale = 1 + weight, computed in fp32); the loop's op set applies it."""

    def __init__(self, dim: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_OPS.norm(x, self.weight)


def _rope_tables(max_pos: int, dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    ang = torch.arange(max_pos, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


class DraftLayer(nn.Module):
    def __init__(self, spec: CaptureSpec, layer_type: str, gen: torch.Generator, dtype, device) -> None:
        super().__init__()
        shape = spec.attention(layer_type)
        hd, heads, inter = spec.draft.hidden, spec.draft.heads, spec.draft.intermediate
        self.layer_type, self.heads, self.head_dim = layer_type, heads, shape.head_dim
        self.scale = shape.head_dim ** -0.5

        w = functools.partial(random_weight, gen=gen, dtype=dtype, device=device)
        self.input_norm = RMSNorm(hd, dtype, device)
        self.q_proj = w(heads * shape.head_dim, hd)
        self.q_norm = RMSNorm(shape.head_dim, dtype, device)
        self.o_proj = w(hd, heads * shape.head_dim)
        self.post_attn_norm = RMSNorm(hd, dtype, device)
        self.pre_mlp_norm = RMSNorm(hd, dtype, device)
        self.gate_up = w(2 * inter, hd)
        self.down = w(hd, inter)
        self.post_mlp_norm = RMSNorm(hd, dtype, device)
        self.register_buffer("layer_scalar", torch.ones((), dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, h: torch.Tensor, w_next: torch.Tensor, rope: tuple, src: KVSource,
                slots: torch.Tensor, lens: torch.Tensor,
                ops: DraftOps = TORCH_OPS) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` the residual stream entering the layer, `h` its input norm (norm(x, input_norm.weight)). Returns the
        stream leaving it and that stream's norm with `w_next` - the next layer's input norm weight, or the final
        norm's after the last layer - so an op set can end a layer and start the next in one kernel."""
        b = x.shape[0]
        q = ops.linear(h, self.q_proj).view(b, self.heads, self.head_dim)
        q_norm = ops.attention_q_norm(self.q_norm.weight, rope) if src.attend is None else None
        if q_norm is None:  # else graphcap's attention kernel norms and rotates q itself
            q = ops.norm_rope(q, self.q_norm.weight, rope)
        if src.attend is not None:
            attn = src.attend(q, self.scale)
        else:
            attn = decode_attention(q, src.k_pool, src.v_pool, src.table, slots, lens, src.window, self.scale,
                                    plan=src.plan(b), q_norm=q_norm)
        # x + norm(o) and its norm (sglang: a norm kernel, then its residual add + norm kernel)
        h, x = ops.norm_add_norm(ops.linear(attn.reshape(b, -1), self.o_proj), x, self.post_attn_norm.weight,
                                 self.pre_mlp_norm.weight)
        d = ops.linear(ops.gate_up_gelu(h, self.gate_up), self.down)
        # (x + norm(d)) * scalar, and its norm for what comes next
        return ops.norm_add_scale_norm(d, self.post_mlp_norm.weight, x, self.layer_scalar, w_next)


def _call_layer(layer: DraftLayer, x: torch.Tensor, h: torch.Tensor, w_next: torch.Tensor, rope: tuple,
                src: KVSource, slots: torch.Tensor, lens: torch.Tensor,
                ops: DraftOps) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(x, h, w_next, rope, src, slots, lens, ops)


# The same call as a nested compile region: under torch.compile, Dynamo/Inductor compile one body per layer shape
# (the sliding layers share one, the full layer has its own) and call it for every layer of every step, instead of
# inlining 12 layer instances (4 layers x 3 steps) into one graph. Compile time falls with the inlined size; the cost
# is that nothing fuses across a layer's boundary. A no-op in eager code.
_call_layer_region = torch.compiler.nested_compile_region(_call_layer)


class FrozenKVDraft(nn.Module):
    """The draft model. `step` is one draft step; `graphcap.models.DraftLoop` runs the whole iteration."""

    def __init__(self, spec: CaptureSpec, *, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.spec = spec
        dtype = dtype or spec.torch_dtype()
        d = spec.draft
        gen = torch.Generator(device=device).manual_seed(seed)
        ht, hd = spec.target.hidden, d.hidden

        w = functools.partial(random_weight, gen=gen, dtype=dtype, device=device)
        # The target's input embedding (shared with the target in Gemma 4; owned here for a standalone model).
        self.embed = w(d.vocab, ht)
        self.embed_scale = math.sqrt(ht)
        self.pre_proj = w(hd, 2 * ht)
        self.layers = nn.ModuleList(DraftLayer(spec, lt, gen, dtype, device) for lt in d.layers)
        self.final_norm = RMSNorm(hd, dtype, device)
        self.post_proj = w(ht, hd)
        # Centroid head: rows stored cluster-major (row c * T + j is token token_of_cluster[c, j]), so the top
        # clusters' rows are read as contiguous blocks.
        self.lm_head = w(d.vocab, hd)
        if d.head == "centroid":
            self.centroids = w(d.centroids, hd)
            perm = torch.randperm(d.vocab, generator=gen, device=device)
            self.register_buffer("token_of_cluster", perm.view(d.centroids, d.vocab // d.centroids))
            # post_proj and the centroids read the same final-norm rows: stacked in one tensor (the two parameters
            # are views of its rows, so the weights stay one copy), one GEMM can compute both (an op set's
            # `merge_head_proj`)
            both = torch.cat([self.post_proj, self.centroids])
            self.post_proj = nn.Parameter(both[:ht], requires_grad=False)
            self.centroids = nn.Parameter(both[ht:], requires_grad=False)
            self.register_buffer("post_proj_and_centroids", both, persistent=False)
        max_pos = spec.capture.max_context
        for lt, theta in (("sliding", 10_000.0), ("full", 1_000_000.0)):
            cos, sin = _rope_tables(max_pos, spec.attention(lt).head_dim, theta, device)
            self.register_buffer(f"rope_cos_{lt}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{lt}", sin, persistent=False)

    def head(self, x: torch.Tensor, ops: DraftOps = TORCH_OPS,
             centroid_scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy token, its logit, and the decision's margin: how far the nearest competing choice is (the
        runner-up token, and for the centroid head also the first cluster left out). Tests compare backends only
        where this margin exceeds the dtype's tolerance. `ops` scores the chosen clusters' tokens (graphcap's kernel
        in the torch set, sglang's contiguous gather and batched product in the fused set: draft_ops' docstring) and
        takes both top-ks (graphcap's one-kernel top-k in the torch set, torch.topk in the others).
        `centroid_scores`: x's centroid scores where the caller has them (`step`: with post_proj, in one GEMM)."""
        cluster_margin = None
        if self.spec.draft.head == "centroid":
            d = self.spec.draft
            scores = (ops.linear(x, self.centroids) if centroid_scores is None else centroid_scores).float()
            cs_values, cs_indices = ops.topk(scores, min(d.centroid_top_k + 1, d.centroids))
            top = cs_indices[:, : d.centroid_top_k]  # [B, k]
            if d.centroid_top_k < d.centroids:
                cluster_margin = cs_values[:, d.centroid_top_k - 1] - cs_values[:, d.centroid_top_k]
            logits, cand = ops.centroid_head(self.lm_head, self.token_of_cluster, x, top)
        else:
            cand = None
            logits = ops.linear(x, self.lm_head).float()
        best_values, best_indices = ops.topk(logits, 2)
        idx = best_indices[:, 0]
        token = idx if cand is None else cand.gather(1, idx[:, None])[:, 0]
        margin = best_values[:, 0] - best_values[:, 1]
        if cluster_margin is not None:
            margin = torch.minimum(margin, cluster_margin)
        return token, best_values[:, 0], margin

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, ropes: dict[str, tuple],
             sources: dict[str, KVSource], slots: torch.Tensor, lens: torch.Tensor, ops: DraftOps = TORCH_OPS,
             layer_regions: bool = True):
        """One draft step; `layer_regions` (DraftLoop's default): each layer called as a nested compile region
        (`_call_layer_region`)."""
        e = self.embed[tokens] * self.embed_scale
        x = ops.linear(torch.cat([e, hidden], dim=-1), self.pre_proj)
        h = ops.norm(x, self.layers[0].input_norm.weight)
        call = _call_layer_region if layer_regions else _call_layer
        # each layer hands on its output's norm with the next one's input norm weight; the last, with the final norm's
        nexts = [layer.input_norm.weight for layer in self.layers[1:]] + [self.final_norm.weight]
        for layer, w_next in zip(self.layers, nexts):
            x, h = call(layer, x, h, w_next, ropes[layer.layer_type], sources[layer.layer_type], slots, lens, ops)
        if ops.merge_head_proj and self.spec.draft.head == "centroid":
            both = ops.linear(h, self.post_proj_and_centroids)  # the same dot products, one weight read
            ht = self.post_proj.shape[0]
            token, score, margin = self.head(h, ops, both[:, ht:])
            return token, score, margin, both[:, :ht]
        token, score, margin = self.head(h, ops)
        return token, score, margin, ops.linear(h, self.post_proj)
