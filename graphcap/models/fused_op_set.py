"""The fused op set (`fused_ops()`): the draft layers' small ops one kernel each, as sglang 0.5.23's Gemma 4 layers
launch them on CUDA (docs/sglang-standin.md) - the bench's sglang-style baselines run the reference model with it.
Each norm one kernel, the residual add + norm one kernel, gelu-tanh-and-mul one kernel, rotary one kernel (plus the
zero dummy key sglang allocates for KV-shared layers), post-MLP norm + residual + layer scalar one kernel (sglang's
own Triton `gemma_rmsnorm_residual_scalar`, where sglang imports; otherwise three). The kernels are
graphcap.kernels.elementwise.fused_ops (sgl_kernel's semantics; torch twins where Triton cannot run). The op-set
protocol and the other sets: graphcap.models.draft_ops.

The reference's norms are Gemma-style, scale (1 + weight) in fp32, so the set takes sgl_kernel's `gemma_rmsnorm` /
`gemma_fused_add_rmsnorm` (the same kernel as `rmsnorm` / `fused_add_rmsnorm` with the offset folded in: what
Gemma 4 launches, at the same cost). sglang's post-MLP kernel scales by `weight` alone, so it gets (1 + weight) in
fp32, made once per model (`bind`), looked up by the weight's identity: a weight bind did not see is an error naming
it (never a silent three-kernel fallback), and a weight updated in place after bind needs `refresh()` (it recomputes
the (1 + weight) tensors in place, so graphs captured over them read the new values). Rotary: the reference rotates
halves (NeoX) with cos/sin tables of `head_dim / 2` columns per position; the fused kernel reads the same tables side
by side, `[cos | sin]`, as sgl_kernel's cos_sin_cache.

Numerics: float32 results agree to rounding. In bf16 the fused set rounds once per op where the reference rounds
after each torch op (the add-norm normalises the fp32 sum, as sgl_kernel does; the post-MLP kernel adds and scales
in fp32) - differences of an output ulp, the difference between sglang and a plain-torch Gemma.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphcap.kernels import use_triton
from graphcap.kernels.elementwise.layer_fusions import query_positions
from graphcap.models.draft_ops import EPS, LAYER_TYPES, ChainedOps

FUSED_MODULE = "graphcap.kernels.elementwise.fused_ops"
SGLANG_POST_NORM = "sglang.kernels.ops.layernorm.gemma4_fused_ops"  # gemma_rmsnorm_residual_scalar


# sglang's post-MLP kernel as one opaque op (torch.compile: one extern call, as its attention kernels in the bench);
# the kernel where Triton runs, otherwise the same fp32 math in torch.
@torch.library.custom_op("graphcap::sglang_rmsnorm_residual_scalar", mutates_args=())
def sglang_rmsnorm_residual_scalar(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                                   scalar: torch.Tensor, eps: float) -> torch.Tensor:
    """(x / rms(x) * weight + residual) * scalar, fp32 inside, one rounding (sglang's kernel: weight as given)."""
    if use_triton(x):
        return importlib.import_module(SGLANG_POST_NORM).gemma_rmsnorm_residual_scalar(x, weight, residual, scalar,
                                                                                       eps)
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float() + residual.float()
    return (out * scalar.float()).to(x.dtype)


@sglang_rmsnorm_residual_scalar.register_fake
def _(x, weight, residual, scalar, eps):
    return torch.empty_like(x)


def _sglang_post_norm() -> Callable | None:
    try:
        importlib.import_module(SGLANG_POST_NORM)
    except ImportError:
        return None
    return sglang_rmsnorm_residual_scalar


@dataclass(frozen=True, eq=False)
class FusedOps(ChainedOps):
    """One kernel per op (sglang's launches). `mod` is graphcap.kernels.elementwise.fused_ops; its functions take
    sgl_kernel's arguments (2-D inputs, in-place add-norm and rotary) - this class is the one place that adapts the
    draft's shapes. `post_norm` is sglang's norm + residual + scalar kernel (None: three kernels). `bind(model)` makes
    the per-model tensors the kernels read: the rotary caches and the (1 + weight) post-MLP norm weights."""

    mod: Any
    post_norm: Callable | None = None
    tables: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> tensor, made by bind
    shifted: dict[int, torch.Tensor] = field(default_factory=dict)  # id(norm weight) -> fp32 1 + weight
    # id(norm weight) -> (its name, the weight): kept alive, so no other tensor can take its id
    weights: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    kv_width: dict[str, int] = field(default_factory=dict)  # layer type -> the dummy key's width
    name: str = "fused"
    merge_head_proj: bool = False  # sglang's assistant projects twice

    def bind(self, model: nn.Module) -> FusedOps:
        tables: dict[str, torch.Tensor] = {}
        shifted: dict[int, torch.Tensor] = {}
        kv_width: dict[str, int] = {}
        spec = model.spec
        for lt in LAYER_TYPES:
            cos, sin = getattr(model, f"rope_cos_{lt}"), getattr(model, f"rope_sin_{lt}")
            tables[f"rope_cache_{lt}"] = torch.cat([cos, sin], dim=-1).float().contiguous()
            shape = spec.attention(lt)
            kv_width[lt] = shape.kv_heads * shape.head_dim
        weights: dict[int, tuple[str, torch.Tensor]] = {}
        if self.post_norm is not None:
            for i, layer in enumerate(model.layers):
                w = layer.post_mlp_norm.weight
                shifted[id(w)] = tables[f"post_mlp_norm_{i}"] = (1.0 + w.detach().float()).contiguous()
                weights[id(w)] = (f"layers.{i}.post_mlp_norm.weight", w)
        return FusedOps(self.mod, self.post_norm, tables, shifted, weights, kv_width, self.name)

    def refresh(self) -> None:
        """Recompute every (1 + weight) from its weight, in place (same tensors, same addresses): after the bound
        model's post-MLP norm weights were updated in place."""
        with torch.no_grad():
            for key, (_, w) in self.weights.items():
                self.shifted[key].copy_(1.0 + w.detach().float())

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.tables)

    def rope_inputs(self, model, layer_type, slots, lens):
        cache = self.tables.get(f"rope_cache_{layer_type}")
        if cache is None:
            raise RuntimeError("FusedOps: bind(model) first (DraftLoop does)")
        return query_positions(slots, lens, cache.shape[0]), cache, self.kv_width[layer_type]

    def norm(self, x, weight):
        shape = x.shape
        return self.mod.gemma_rmsnorm(x.reshape(-1, shape[-1]), weight, EPS).view(shape)

    def add_norm(self, x, residual, weight):
        # sgl_kernel semantics: residual += x and x = norm(residual), both in place; the callers' tensors are
        # fresh activations of this layer, so clone nothing
        self.mod.gemma_fused_add_rmsnorm(x, residual, weight, EPS)
        return x, residual

    def norm_add_scale(self, x, weight, residual, scalar):
        if self.post_norm is None:
            return (residual + self.norm(x, weight)) * scalar  # 3 kernels: sglang's fused one is not importable
        w1 = self.shifted.get(id(weight))
        if w1 is None:
            bound = ", ".join(name for name, _ in self.weights.values()) or "none"
            raise RuntimeError(f"FusedOps: post-MLP norm weight {tuple(weight.shape)} {weight.dtype} was not bound "
                               f"(bound: {bound}); bind(model) the model that owns it (DraftLoop does)")
        return self.post_norm(x, w1, residual, scalar, EPS)  # one kernel, as sglang's Gemma 4 layer

    def gelu_mul(self, gate_up):
        return self.mod.gelu_tanh_and_mul(gate_up)

    def linear(self, x, w):
        return x @ w.t()  # cuBLAS, as sglang's layers

    def gate_up_gelu(self, x, w_gate_up):
        return self.gelu_mul(x @ w_gate_up.t())

    def rope(self, q, rope):
        # sglang's Gemma 4 attention on a KV-shared layer (the draft's, reading the target's KV) rotates q with a
        # zero dummy key of the KV heads' width (models/gemma4_causal.py): one fill, one rotary kernel
        pos, cache, kv_width = rope
        key = q.new_zeros(q.shape[0], kv_width)
        self.mod.apply_rope_with_cos_sin_cache_inplace(pos, q, key, q.shape[-1], cache, is_neox=True)
        return q

    def centroid_head(self, lm_head, token_of_cluster, x, top):
        # sglang 0.5.23's Gemma4AssistantForCausalLM._apply_centroid_masking up to its scatter (module docstring)
        top = top.contiguous()  # sglang's index is torch.topk's own output: contiguous
        b, k = top.shape
        clusters, t = token_of_cluster.shape
        sel = lm_head.view(clusters, t, -1)[top].reshape(b, k * t, -1)
        logits = torch.bmm(x.unsqueeze(1), sel.transpose(1, 2)).squeeze(1)
        return logits.float(), token_of_cluster[top].flatten(1)

    def topk(self, x, k):
        return torch.topk(x, k, dim=-1)  # sglang's head: torch.topk (several kernels each)


def fused_ops(sglang_post_norm: bool = True) -> FusedOps:
    """The fused set; ImportError (with the reason) where graphcap.kernels.elementwise.fused_ops is missing. With
    `sglang_post_norm`, sglang's post-MLP kernel where sglang imports (else three kernels there)."""
    return FusedOps(importlib.import_module(FUSED_MODULE), _sglang_post_norm() if sglang_post_norm else None)

