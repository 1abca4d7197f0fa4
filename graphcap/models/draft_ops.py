"""The draft layers' small ops, as interchangeable sets over the same weights and math.

- `TORCH_OPS`: plain torch ops (the reference; Inductor fuses them when the loop is compiled, eagerly a Gemma
  RMSNorm is ~9 kernels).
- `LAYER_KERNEL_OPS` (`DEFAULT_OPS`: graphcap's loop): the torch set with each of the layer's norm chains one
  graphcap kernel (graphcap.kernels.elementwise.layer_fusions), the query's norm and rotary inside graphcap's
  attention kernel and the gelu-mul one kernel (or inside the skinny GEMM's gate/up), whatever Inductor fuses;
  post_proj and the centroid scores one projection. The same math, rounded where the reference rounds
  (`LayerKernelOps`).
- `fused_ops()` (graphcap.models.fused_op_set): one kernel per op, as sglang 0.5.23's Gemma 4 layers launch them on
  CUDA.

The centroid LM head's scoring is part of the set too. The torch set calls graphcap's kernel
(`graphcap.kernels.head.centroid`: lm_head rows read in place, fp32 accumulation; its gather twin where Triton cannot
run), as the loop calls graphcap's attention kernel. The fused set runs sglang's Gemma 4 assistant head
(`_apply_centroid_masking`) op for op, so the sglang-style baselines keep it: the chosen clusters' rows gathered
with a contiguous index (torch's vectorised gather; a strided index takes its element-wise kernel: with one the
sglang mode ran 17-50% above sglang's engine draft from batch 8 up on the H200, with this one 12-15% below), one
batched product in the weights' dtype. Both sets then take the greedy token among the candidates; sglang also
scatters the candidates' scores into a full-vocabulary row first, which no set does (graphcap's sglang plugin keeps
that row only for sglang's own calls of the head, and in its captured loop picks from the candidates:
graphcap.sglang.head).

The head's two top-ks (the top clusters of the centroid scores, the best two candidates) are in the set too: the
torch set takes graphcap's one-kernel top-k (`graphcap.kernels.head.small_topk`: the row in registers, k rounds of
argmax; torch.topk where Triton cannot run or past its sizes), the fused set and `PLAIN_OPS` torch.topk, as sglang
and a plain loop call it. Both give torch.topk's values; equal values may come in another order (the kernel takes the
smallest index first), which decides nothing the tests compare: they compare tokens where the margin is clear.

The projections are in the set too (`linear`, and `gate_up_gelu` for the MLP's gate/up with its activation): cuBLAS,
or graphcap's skinny GEMM (`graphcap.kernels.gemm.skinny`: each weight read once, the gelu-mul in the gate/up kernel)
for batches of at most `skinny_rows` rows, and with `skinny_by_shape` only as far as the weight's shape class
measured faster than cuBLAS (`gemm.skinny.KERNEL_ROWS`) - the default set; every shape at every batch in `SKINNY_OPS`
(the bench's `graphcap-skinny-gemm`), 0 rows (cuBLAS) in the torch and sglang sets.

A draft loop picks its set (`DraftLoop(..., ops=...)`, which calls `ops.bind(model)`), so the sglang-style
baselines and graphcap's own loop run one model with the same weights.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from graphcap.kernels.elementwise import layer_fusions
from graphcap.kernels.attention.decode_kernels import QueryNormRope
from graphcap.kernels.head.centroid import centroid_logits, centroid_logits_torch
from graphcap.kernels.elementwise.fused_ops import gelu_tanh_and_mul, gemma_rmsnorm
from graphcap.kernels.elementwise.layer_fusions import query_positions
from graphcap.kernels.gemm.skinny import DTYPES as SKINNY_DTYPES
from graphcap.kernels.gemm.skinny import MAX_M as SKINNY_MAX_M
from graphcap.kernels.gemm.skinny import kernel_rows, skinny_gate_up_gelu, skinny_linear
from graphcap.kernels.gemm.skinny_kernels import prepare_fixup
from graphcap.kernels.head.small_topk import small_topk

EPS = 1e-6
LAYER_TYPES = ("sliding", "full")


class DraftOps(Protocol):
    name: str
    # post_proj and the centroid scores (which read the same rows) as one GEMM over the stacked weights
    # (FrozenKVDraft.step): one weight read and one launch per step instead of two
    merge_head_proj: bool

    def bind(self, model: nn.Module) -> DraftOps: ...

    def static_tensors(self) -> dict[str, torch.Tensor]: ...

    def rope_inputs(self, model: nn.Module, layer_type: str, slots: torch.Tensor, lens: torch.Tensor) -> tuple:
        """What `rope`/`norm_rope` take for this layer type's rows, whose query positions are lens[slots] - 1,
        clamped to the position tables (`query_positions`; every set alike)."""
        ...

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def norm_add_scale(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       scalar: torch.Tensor) -> torch.Tensor: ...

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope(self, q: torch.Tensor, rope: tuple) -> torch.Tensor: ...

    def centroid_head(self, lm_head: torch.Tensor, token_of_cluster: torch.Tensor, x: torch.Tensor,
                      top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 scores [B, k * T] of rows `x` [B, H] over the tokens of clusters `top` [B, k], and those tokens'
        ids [B, k * T]."""
        ...

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...  # x @ w.T, w [N, K] as nn.Linear's

    def gate_up_gelu(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor: ...  # gelu_mul(linear(x, w))

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest entries of each row of `x` [B, N] and their indices, largest first (torch.topk's values;
        the order of equal values is the set's own)."""
        ...

    # The layer's chains of norms (`ChainedOps` composes them from the ops above; LAYER_KERNEL_OPS runs each as one
    # kernel, graphcap.kernels.elementwise.layer_fusions).
    def norm_rope(self, q: torch.Tensor, weight: torch.Tensor, rope: tuple) -> torch.Tensor:
        """rope(norm(q, weight)): the query heads' norm and rotary."""
        ...

    def attention_q_norm(self, weight: torch.Tensor, rope: tuple) -> QueryNormRope | None:
        """The query heads' norm and rotary for graphcap's attention kernel to apply itself (decode_attention's
        `q_norm`), or None: the layer runs `norm_rope` first."""
        ...

    def norm_add_norm(self, x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor,
                      w_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s, w_sum), s) with s = residual + norm(x, w_x): post-attention norm, residual add, pre-MLP norm."""
        ...

    def norm_add_scale_norm(self, x: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor, scalar: torch.Tensor,
                            w_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, norm(o, w_out)) with o = norm_add_scale(x, w_x, residual, scalar): the layer's output and the next
        layer's input norm (or the final norm)."""
        ...


class ChainedOps:
    """The layer's norm chains as calls of the set's single ops, in the reference's order: what the torch set (which
    Inductor fuses) and sglang's set (one kernel per op, as sglang launches them) run."""

    def attention_q_norm(self, weight, rope):
        return None

    def norm_rope(self, q, weight, rope):
        return self.rope(self.norm(q, weight), rope)

    def norm_add_norm(self, x, residual, w_x, w_sum):
        return self.add_norm(self.norm(x, w_x), residual, w_sum)

    def norm_add_scale_norm(self, x, w_x, residual, scalar, w_out):
        out = self.norm_add_scale(x, w_x, residual, scalar)
        return out, self.norm(out, w_out)


def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def _rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [B, H, D]; cos/sin [B, D/2] (rotate-half layout)."""
    half = q.shape[-1] // 2
    q1, q2 = q[..., :half].float(), q[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], dim=-1).to(q.dtype)


@dataclass(frozen=True)
class TorchOps(ChainedOps):
    """Plain torch ops: the reference model's own code (the centroid head's scoring and the head's top-ks: graphcap's
    kernels, module docstring; `graphcap_kernels=False`: the gather, batched product and torch.topk a plain loop
    would write, `PLAIN_OPS`)."""

    name: str = "torch"
    graphcap_kernels: bool = True  # the centroid-head and top-k kernels; False: what a plain loop writes
    # the projections of batches of at most this many rows through graphcap's skinny GEMM
    # (graphcap.kernels.gemm.skinny; gate/up with its gelu-mul in the same kernel), cuBLAS above - decided per call in
    # the op, so one compile serves every bucket. 0: cuBLAS always; SKINNY_MAX_M: the kernel at every bucket
    skinny_rows: int = 0
    # and at most as many as the kernel measured faster than cuBLAS for the weight's shape class
    # (gemm.skinny.kernel_rows: 0 sends the shape to cuBLAS at every batch, with no op in the graph)
    skinny_by_shape: bool = False
    merge_head_proj: bool = False  # a plain loop projects twice (the reference's code)

    def bind(self, model: nn.Module) -> TorchOps:
        p = next(model.parameters(), None)
        if self.skinny_rows > 0 and p is not None:  # the one-kernel split K's counters, before any compile or capture
            prepare_fixup(p.device)
        return self

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def rope_inputs(self, model, layer_type, slots, lens):
        cos, sin = getattr(model, f"rope_cos_{layer_type}"), getattr(model, f"rope_sin_{layer_type}")
        pos = query_positions(slots, lens, cos.shape[0])  # clamped to the tables, as graphcap's kernels clamp
        return cos[pos], sin[pos]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _norm(x, weight)

    def add_norm(self, x, residual, weight):
        residual = residual + x
        return _norm(residual, weight), residual

    def norm_add_scale(self, x, weight, residual, scalar):
        return (residual + _norm(x, weight)) * scalar

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate="tanh") * up

    def _kernel_rows(self, x: torch.Tensor, n: int, gated: bool) -> int:
        """Rows up to which this projection runs graphcap's kernel (cuBLAS above; 0: cuBLAS always, no op). Above
        MAX_M rows (an eager call past the largest bucket) a GEMM is no longer a weight read, and the kernel is
        bf16/fp16 only: cuBLAS there."""
        if self.skinny_rows <= 0 or x.dtype not in SKINNY_DTYPES or x.shape[0] > SKINNY_MAX_M:
            return 0
        return min(self.skinny_rows, kernel_rows(n, gated)) if self.skinny_by_shape else self.skinny_rows

    def linear(self, x, w):
        rows = self._kernel_rows(x, w.shape[0], False)
        return skinny_linear(x, w, cublas_above=rows) if rows else x @ w.t()

    def gate_up_gelu(self, x, w_gate_up):
        rows = self._kernel_rows(x, w_gate_up.shape[0] // 2, True)
        if rows:
            return skinny_gate_up_gelu(x, w_gate_up, cublas_above=rows)
        return self.gelu_mul(x @ w_gate_up.t())

    def rope(self, q, rope):
        return _rope(q, *rope)

    def centroid_head(self, lm_head, token_of_cluster, x, top):
        t = token_of_cluster.shape[1]
        # graphcap's kernel (the twin on CPU), or the plain gather + product
        logits = centroid_logits(lm_head, x, top, t) if self.graphcap_kernels else centroid_logits_torch(lm_head, x,
                                                                                                        top, t)
        return logits, token_of_cluster[top].flatten(1)

    def topk(self, x, k):
        # graphcap's one-kernel top-k (torch.topk on CPU, past its sizes), or torch.topk
        return small_topk(x, k) if self.graphcap_kernels else torch.topk(x, k, dim=-1)


TORCH_OPS = TorchOps()
PLAIN_OPS = TorchOps(name="torch-plain", graphcap_kernels=False)  # what a hand-written loop runs (bench compile-plain)


@dataclass(frozen=True)
class LayerKernelOps(TorchOps):
    """The torch set with the layer's small ops as graphcap's kernels: each norm chain one kernel
    (graphcap.kernels.elementwise.layer_fusions: post-attention norm + residual + pre-MLP norm; post-MLP norm +
    residual + scalar + the next layer's input norm), the query's norm + rotary in the attention's split kernel
    (`attention_q_norm`), the first input norm and the gelu-mul one kernel each
    (graphcap.kernels.elementwise.fused_ops). Under one compile for every bucket (an unbacked batch) Inductor splits
    each norm into a reduction and a pointwise kernel (docs/results.md), so the torch set costs more launches. The
    same math as the torch set, rounded where it rounds (layer_fusions' docstring). Also post_proj and the centroid
    scores as one projection (`merge_head_proj`)."""

    name: str = "layer-kernels"
    merge_head_proj: bool = True
    # the query's norm + rotary in the attention's split kernel (decode_attention's `q_norm`); False: the
    # norm_rope kernel before the attention, one launch more per layer call (bench mode graphcap-qnorm-kernel)
    q_norm_in_attention: bool = True

    def norm(self, x, weight):
        shape = x.shape
        return gemma_rmsnorm(x.reshape(-1, shape[-1]), weight, EPS).view(shape)

    def gelu_mul(self, gate_up):
        return gelu_tanh_and_mul(gate_up)

    def rope_inputs(self, model, layer_type, slots, lens):
        # the tables and the rows' slots: the kernel finds each row's position and its cos/sin itself
        return getattr(model, f"rope_cos_{layer_type}"), getattr(model, f"rope_sin_{layer_type}"), slots, lens

    def rope(self, q, rope):
        cos, sin, slots, lens = rope
        pos = query_positions(slots, lens, cos.shape[0])
        return _rope(q, cos[pos], sin[pos])

    def norm_rope(self, q, weight, rope):
        return layer_fusions.norm_rope(q, weight, *rope, EPS)

    def attention_q_norm(self, weight, rope):
        # in the attention's split kernel: the rows' slots and lengths are the attention's own (DraftLoop passes
        # both the same), and the norm_rope kernel is one launch fewer per layer
        if not self.q_norm_in_attention:
            return None
        cos, sin, _, _ = rope
        return QueryNormRope(weight, cos, sin, EPS)

    def norm_add_norm(self, x, residual, w_x, w_sum):
        return layer_fusions.norm_add_norm(x, residual, w_x, w_sum, EPS)

    def norm_add_scale_norm(self, x, w_x, residual, scalar, w_out):
        return layer_fusions.norm_add_scale_norm(x, w_x, residual, scalar, w_out, EPS)


# graphcap's loop (DraftLoop's default): each projection through the skinny GEMM at the batches where its shape
# class made the iteration faster than cuBLAS on the H200 (gemm.skinny.KERNEL_ROWS: q_proj, post_proj and gate/up +
# gelu-mul and the narrow split-K shapes up to 8 rows; docs/results.md)
LAYER_KERNEL_OPS = LayerKernelOps(name="layer-kernels-gemm-by-shape", skinny_rows=SKINNY_MAX_M, skinny_by_shape=True)
DEFAULT_OPS = LAYER_KERNEL_OPS
# graphcap's loop with the skinny GEMM at every bucket and shape (bench mode graphcap-skinny-gemm)
SKINNY_OPS = LayerKernelOps(name="layer-kernels-skinny-gemm", skinny_rows=SKINNY_MAX_M)
# the skinny GEMM for every shape up to 4 rows, cuBLAS above (bench mode graphcap-skinny-4rows)
SKINNY_4ROWS_OPS = LayerKernelOps(name="layer-kernels", skinny_rows=4)
# graphcap's loop less one kernel-count lever each, to price it alone (bench modes graphcap-qnorm-kernel: the
# query's norm + rotary as its own kernel; graphcap-two-head-proj: post_proj and the centroid scores as two GEMMs)
QNORM_KERNEL_OPS = dataclasses.replace(LAYER_KERNEL_OPS, name="layer-kernels-qnorm-kernel", q_norm_in_attention=False)
TWO_HEAD_PROJ_OPS = dataclasses.replace(LAYER_KERNEL_OPS, name="layer-kernels-two-head-proj", merge_head_proj=False)
