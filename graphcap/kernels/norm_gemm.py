"""A norm chain in the skinny GEMM's prologue: the MLP's gate/up (with its gelu-mul) reading the post-attention
norm + residual add + pre-MLP norm it needs, computed in the same kernel.

In the draft layer the chain `norm_add_norm` (graphcap.kernels.layer_fusions) is a kernel of its own between o_proj
and gate/up: a few microseconds of work whose cost at small batches is mostly its launch and its gap in the graph
(docs/results.md). Here each program of the gate/up kernel computes the chain for the K-slices it multiplies:
- two passes over its rows' K (hidden) elements find the rows' two rms values: the attention output's, then the
  sum's (the residual plus the normed output, rounded as the reference rounds);
- the main loop computes each K-slice of the pre-MLP norm from them and multiplies it as the skinny GEMM does.
The rows are a few kilobytes, read from L2 by every program; the weights are read once. Program 0 also stores the
sum, the residual stream the layer goes on with. Every program computes the same values in the same order, so the
stored sum is the one every program multiplied. Against the two kernels the chain differs only in the order of its
rms sums (fp32; the rounding points are the reference's: layer_fusions' docstring).

`norm_add_norm_gate_up(x, residual, w_x, w_sum, w_gate_up)` is an opaque `torch.library.custom_op` that decides per
call, where M is a plain int also under one compile for every batch: at most `fold_rows` rows run this kernel;
more run `norm_add_norm` and then `skinny_gate_up_gelu` (its `cublas_above` rule), the same kernels as before the
fold. Its twin `norm_add_norm_gate_up_torch` is the two twins in a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.kernels import layer_fusions, use_triton
from graphcap.kernels.skinny_gemm import MAX_M, SkinnyGemmError, _check, plan, skinny_gate_up_gelu, \
    skinny_gate_up_gelu_torch
from graphcap.kernels.skinny_gemm_kernels import _mac, _round

BLOCK_P = 256  # K elements per step of the rms passes (the main loop steps by the plan's BLOCK_K)


# ---------------------------------------------------------------------------------------------------------------
# twin


def norm_add_norm_gate_up_torch(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor,
                                w_gate_up: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu_tanh(h @ gate.T) * (h @ up.T), s) with (h, s) = norm_add_norm_torch(x, residual, w_x, w_sum)."""
    h, s = layer_fusions.norm_add_norm_torch(x, residual, w_x, w_sum, eps)
    return skinny_gate_up_gelu_torch(h, w_gate_up), s


# ---------------------------------------------------------------------------------------------------------------
# kernel


@triton.jit
def _sum_slice(x, res, w_x, r_x, offs_m, mask_m, kk, K, stride_xm, stride_rm, INTERPRET: tl.constexpr):
    """The slice kk of residual + norm(x) ([len(kk), BLOCK_M] fp32, each value rounded to x's dtype as the reference
    rounds it; 0 outside K and M), `r_x` the rows' 1/rms of x."""
    mask_k = kk < K
    mask = mask_k[:, None] & mask_m[None, :]
    dt = x.dtype.element_ty
    v = tl.load(x + offs_m[None, :] * stride_xm + kk[:, None], mask=mask, other=0.0).to(tl.float32)
    wx = tl.load(w_x + kk, mask=mask_k, other=0.0).to(tl.float32)
    a = _round(v * r_x[None, :] * (wx[:, None] + 1.0), dt, INTERPRET).to(tl.float32)
    r = tl.load(res + offs_m[None, :] * stride_rm + kk[:, None], mask=mask, other=0.0).to(tl.float32)
    return _round(r + a, dt, INTERPRET).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _norm_add_norm_gate_up_kernel(x, res, w_x, w_sum, w, y, total, M, N, K, stride_xm, stride_rm, stride_wn,
                                  stride_ym, stride_tm, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, DOT: tl.constexpr,
                                  INTERPRET: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    # program n: columns [n0, n0 + BLOCK_N) of gelu(gate) * up for all M rows (skinny_gemm's gated kernel, unsplit)
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_p = tl.arange(0, BLOCK_P)
    dt = x.dtype.element_ty

    # the rows' 1/rms of x, then of s = residual + norm(x): two passes over K, [BLOCK_M] each
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_P):
        kk = k + offs_p
        v = tl.load(x + offs_m[None, :] * stride_xm + kk[:, None], mask=(kk < K)[:, None] & mask_m[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(v * v, axis=0)
    r_x = tl.math.rsqrt(ss / K + eps)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_P):
        s = _sum_slice(x, res, w_x, r_x, offs_m, mask_m, k + offs_p, K, stride_xm, stride_rm, INTERPRET)
        ss += tl.sum(s * s, axis=0)
    r_s = tl.math.rsqrt(ss / K + eps)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_ptr = w + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptr = w + (offs_n + N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # the up rows n + I
    mask_t = offs_m < tl.where(pid_n == 0, M, 0)  # program 0 stores the sum
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + offs_k
        mask_k = kk < K
        s = _sum_slice(x, res, w_x, r_x, offs_m, mask_m, kk, K, stride_xm, stride_rm, INTERPRET)
        tl.store(total + offs_m[None, :] * stride_tm + kk[:, None], s.to(dt),
                 mask=mask_k[:, None] & mask_t[None, :])
        ws = tl.load(w_sum + kk, mask=mask_k, other=0.0).to(tl.float32)
        ht = _round(s * r_s[None, :] * (ws[:, None] + 1.0), dt, INTERPRET)  # h.T slice [BLOCK_K, BLOCK_M]
        if EVEN_K and EVEN_N:
            wt = tl.load(w_ptr + k)
            ut = tl.load(u_ptr + k)
        else:
            wt = tl.load(w_ptr + k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            ut = tl.load(u_ptr + k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = _mac(acc, wt, ht, DOT, INTERPRET)
        acc_u = _mac(acc_u, ut, ht, DOT, INTERPRET)
    acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)) * acc_u  # skinny_gemm's gelu
    y_ptr = y + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptr, _round(acc, dt, INTERPRET), mask=mask_n[:, None] & mask_m[None, :])


def launch(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor, w_gate_up: torch.Tensor,
           eps: float, act: torch.Tensor, total: torch.Tensor) -> None:
    """Run the kernel into `act` [M, I] and `total` [M, K] with skinny_gemm's plan for gate/up at M rows. Inputs are
    assumed checked."""
    m, k = x.shape
    i = w_gate_up.shape[0] // 2
    if m == 0:
        return
    if i == 0:  # no program would store the sum
        total.copy_(layer_fusions.norm_add_norm(x, residual, w_x, w_sum, eps)[1])
        return
    cfg = plan(m, i, k, gated=True)
    block_m = max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m)
    _norm_add_norm_gate_up_kernel[(triton.cdiv(i, cfg.block_n),)](
        x, residual, w_x, w_sum, w_gate_up, act, total, m, i, k, x.stride(0), residual.stride(0), w_gate_up.stride(0),
        act.stride(0), total.stride(0), eps, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_P=BLOCK_P, DOT=cfg.dot, INTERPRET=not x.is_cuda, EVEN_K=k % cfg.block_k == 0,
        EVEN_N=i % cfg.block_n == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------------------------------------------------------
# the op


OP = "norm_add_norm_gate_up"


def _check_all(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor,
               w_gate_up: torch.Tensor) -> tuple[int, int]:
    """(M, I) of a valid call; FusedOpError / SkinnyGemmError naming the op and argument otherwise."""
    layer_fusions._check_rows(OP, {"x": x, "residual": residual}, {"w_x": w_x, "w_sum": w_sum})
    return _check(OP, x, w_gate_up, True)


@torch.library.custom_op(f"graphcap::{OP}", mutates_args=())
def _op(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor, w_gate_up: torch.Tensor,
        eps: float, fold_rows: int, cublas_above: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, i = _check_all(x, residual, w_x, w_sum, w_gate_up)
    if not use_triton(x):
        return norm_add_norm_gate_up_torch(x, residual, w_x, w_sum, w_gate_up, eps)
    if m > fold_rows:  # the chain's kernel, then the gate/up's (or cuBLAS + the gelu-mul kernel)
        h, total = layer_fusions.norm_add_norm(x, residual, w_x, w_sum, eps)
        return skinny_gate_up_gelu(h, w_gate_up, cublas_above=cublas_above), total
    act, total = x.new_empty((m, i)), x.new_empty(x.shape)
    launch(x, residual, w_x, w_sum, w_gate_up, eps, act, total)
    return act, total


@_op.register_fake
def _(x, residual, w_x, w_sum, w_gate_up, eps, fold_rows, cublas_above):
    m, i = _check_all(x, residual, w_x, w_sum, w_gate_up)
    return x.new_empty((m, i)), x.new_empty(x.shape)


def norm_add_norm_gate_up(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor,
                          w_gate_up: torch.Tensor, eps: float = 1e-6, *, fold_rows: int = MAX_M,
                          cublas_above: int = MAX_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(act, s): s = residual + norm(x, w_x) and act = gelu_tanh(h @ gate.T) * (h @ up.T) with h = norm(s, w_sum),
    for x, residual [M, K] and w_gate_up [2I, K] (gate rows, then up rows). Batches of at most `fold_rows` rows
    (<= MAX_M) in one kernel; above, layer_fusions.norm_add_norm, then skinny_gate_up_gelu with `cublas_above`.
    New tensors, in x's dtype."""
    _check_all(x, residual, w_x, w_sum, w_gate_up)
    eps = layer_fusions._check_eps(OP, eps)
    for name, rows in (("fold_rows", fold_rows), ("cublas_above", cublas_above)):
        if type(rows) is not int or rows < 0:
            raise SkinnyGemmError(f"{OP}: {name} must be an int >= 0, got {rows!r}")
    return _op(x, residual, w_x, w_sum, w_gate_up, eps, min(fold_rows, MAX_M), cublas_above)
