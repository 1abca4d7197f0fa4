"""A draft layer's narrow projection and the norm chain after it as one kernel.

In the draft layer two projections are each followed by a chain of norms over their output rows
(graphcap.kernels.layer_fusions): o_proj by norm_add_norm (post-attention norm, residual add, pre-MLP norm), down by
norm_add_scale_norm (post-MLP norm, residual add, layer scalar, the next layer's input norm). The chain needs whole
output rows, which no one program of the skinny GEMM holds; so the GEMM's last column block to store its output
runs the chain over all M rows (an arrival count, like the one-kernel split K's: skinny_gemm_kernels), and the
chain's own kernel - a launch and a gap between graph nodes, ~3-4 us each at the draft's sizes - is gone.

- `linear_norm_add_norm(x, w, residual, w_x, w_sum)` = layer_fusions.norm_add_norm(x @ w.T, residual, w_x, w_sum);
- `linear_norm_add_scale_norm(x, w, w_x, residual, scalar, w_out)` = norm_add_scale_norm(x @ w.T, w_x, residual,
  scalar, w_out).
The projection rounds to the activation dtype before the chain, and the chain is the separate kernel's row code
(layer_fusions' `*_row` functions), so the result is the two kernels' up to the order of the chain's fp32 sums.

Where the chain cannot ride along - more rows than `cublas_above` (cuBLAS's product), a config that splits K without
the one-kernel sum, no arrival counters made for the device, or Triton not running - the op runs the two steps as
separate kernels (the torch twins where Triton does not run). The ops are opaque custom ops, as the skinny GEMM's.
"""
from __future__ import annotations

import torch

from graphcap.kernels import layer_fusions, use_triton
from graphcap.kernels.fused_ops import DTYPES, FusedOpError, _same_device
from graphcap.kernels.skinny_gemm import MAX_M, NormTail, _check, launch, plan, skinny_linear_torch, tail_counters

__all__ = ["linear_norm_add_norm", "linear_norm_add_scale_norm", "linear_norm_add_norm_torch",
           "linear_norm_add_scale_norm_torch"]


def linear_norm_add_norm_torch(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor,
                               w_sum: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: the projection (cuBLAS on CUDA), rounded, then norm_add_norm's twin."""
    return layer_fusions.norm_add_norm_torch(skinny_linear_torch(x, w), residual, w_x, w_sum, eps)


def linear_norm_add_scale_norm_torch(x: torch.Tensor, w: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor,
                                     scalar: torch.Tensor, w_out: torch.Tensor, eps: float
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return layer_fusions.norm_add_scale_norm_torch(skinny_linear_torch(x, w), w_x, residual, scalar, w_out, eps)


def _run(kind: int, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, w_1: torch.Tensor,
         scalar: torch.Tensor | None, w_2: torch.Tensor, eps: float, cublas_above: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        if kind == 1:
            return linear_norm_add_norm_torch(x, w, residual, w_1, w_2, eps)
        return linear_norm_add_scale_norm_torch(x, w, w_1, residual, scalar, w_2, eps)
    m, n, k = x.shape[0], w.shape[0], x.shape[1]
    y = x.new_empty((m, n))
    if m == 0 or n == 0:
        return y, x.new_empty((m, n))
    cfg = plan(m, n, k)
    if k and m <= cublas_above and tail_counters(x.device, n, k, cfg) is not None:
        out_1, out_2 = x.new_empty((m, n)), x.new_empty((m, n))
        launch(x, w, y, cfg, tail=NormTail(kind, residual, w_1, scalar, w_2, out_1, out_2, eps))
        return out_1, out_2
    # the two steps apart: the projection (graphcap's kernel up to cublas_above rows, cuBLAS above), then the chain
    if m <= cublas_above:
        launch(x, w, y, cfg)
    else:
        torch.mm(x, w.t(), out=y)
    if kind == 1:
        return layer_fusions.launch_norm_add_norm(y, residual, w_1, w_2, eps)
    return layer_fusions.launch_norm_add_scale_norm(y, w_1, residual, scalar, w_2, eps)


@torch.library.custom_op("graphcap::linear_norm_add_norm", mutates_args=())
def _linear_norm_add_norm_op(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor,
                             w_sum: torch.Tensor, eps: float, cublas_above: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(1, x, w, residual, w_x, None, w_sum, eps, cublas_above)


@_linear_norm_add_norm_op.register_fake
def _(x, w, residual, w_x, w_sum, eps, cublas_above):
    return x.new_empty((x.shape[0], w.shape[0])), x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("graphcap::linear_norm_add_scale_norm", mutates_args=())
def _linear_norm_add_scale_norm_op(x: torch.Tensor, w: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor,
                                   scalar: torch.Tensor, w_out: torch.Tensor, eps: float, cublas_above: int
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(2, x, w, residual, w_x, scalar, w_out, eps, cublas_above)


@_linear_norm_add_scale_norm_op.register_fake
def _(x, w, w_x, residual, scalar, w_out, eps, cublas_above):
    return x.new_empty((x.shape[0], w.shape[0])), x.new_empty((x.shape[0], w.shape[0]))


def _check_all(op: str, x: object, w: object, residual: object, weights: dict[str, object], eps: object,
               cublas_above: object) -> tuple[float, int]:
    m, n = _check(op, x, w, False)
    layer_fusions._check_rows(op, {"residual": residual}, weights)
    if tuple(residual.shape) != (m, n) or residual.dtype != x.dtype:
        raise FusedOpError(f"{op}: residual must be a {x.dtype} {(m, n)} tensor (the projection's output), got "
                           f"{residual.dtype} {tuple(residual.shape)}")
    _same_device(op, x=x, residual=residual)
    if type(cublas_above) is not int or cublas_above < 0:
        raise FusedOpError(f"{op}: cublas_above must be an int >= 0 (rows above it go to cuBLAS), got "
                           f"{cublas_above!r}")
    return layer_fusions._check_eps(op, eps), cublas_above


def linear_norm_add_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor,
                         w_sum: torch.Tensor, eps: float = 1e-6, *, cublas_above: int = MAX_M
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s, w_sum), s) with s = residual + norm(x @ w.T, w_x): x [M, K] (rows contiguous), w [N, K] contiguous,
    residual [M, N], w_x and w_sum [N]; bf16/fp16. One kernel up to `cublas_above` rows (module docstring). New
    tensors."""
    eps, rows = _check_all("linear_norm_add_norm", x, w, residual, {"w_x": w_x, "w_sum": w_sum}, eps, cublas_above)
    return _linear_norm_add_norm_op(x, w, residual, w_x, w_sum, eps, rows)


def linear_norm_add_scale_norm(x: torch.Tensor, w: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor,
                               scalar: torch.Tensor, w_out: torch.Tensor, eps: float = 1e-6, *,
                               cublas_above: int = MAX_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, norm(o, w_out)) with o = (residual + norm(x @ w.T, w_x)) * scalar (a one-element tensor); shapes as
    `linear_norm_add_norm`'s. New tensors."""
    op = "linear_norm_add_scale_norm"
    eps, rows = _check_all(op, x, w, residual, {"w_x": w_x, "w_out": w_out}, eps, cublas_above)
    if not isinstance(scalar, torch.Tensor) or scalar.dtype not in DTYPES or scalar.numel() != 1:
        raise FusedOpError(f"{op}: scalar must be a one-element float tensor, got "
                           f"{getattr(scalar, 'dtype', type(scalar).__name__)} {tuple(getattr(scalar, 'shape', ()))}")
    _same_device(op, x=x, scalar=scalar)
    return _linear_norm_add_scale_norm_op(x, w, w_x, residual, scalar, w_out, eps, rows)
