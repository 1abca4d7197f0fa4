"""The skinny GEMM's Triton kernels (graphcap.kernels.gemm.skinny: what they compute, the configs, the launch and the
ops) and the split-K arrival counters of the one-kernel split K.

- `skinny_kernel`: program (n-block, split) owns BLOCK_N output columns of all M rows over one K range, the product
  computed transposed (weight rows on the MMA's large side); unsplit it stores the output, split it stores an fp32
  partial, which the n-block's last split to arrive sums (FIXUP) or `splitk_sum_kernel` does.
- `gemv_kernel`: program (n-block, row) owns BLOCK_N output columns of one row over all of K, on CUDA cores, its
  tile reduced once at the end (Config.gemv).
- the counters: one int32 per n-block per device, zero between launches (each launch's last splits reset theirs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.kernels.pdl import pdl_start


# INTERPRET (CPU tensors, which reach a kernel only under TRITON_INTERPRET=1) works around two faults of Triton's
# CPU interpreter with bf16: tl.dot multiplies the tiles' raw bits (it stores bf16 as uint16), and fp32 -> bf16
# casts truncate. The workaround is exact: bf16 -> fp32 is exact and fp32 products of bf16 values are too, and the
# explicit rounding is what a GPU's cast does (to nearest, ties to even).


@triton.jit
def _mac(acc, w, xt, DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """acc[BN, BM] += w[BN, BK] @ xt[BK, BM] with fp32 accumulation."""
    if DOT:
        if INTERPRET:
            return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(w, xt, acc)
    return acc + tl.sum(w.to(tl.float32)[:, :, None] * xt.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def round_to(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype, to nearest even: Triton's CPU interpreter truncates fp32 -> bf16 casts, so under it (INTERPRET)
    the bf16 rounding is done on the bits first, as a GPU's cast does (the interpreted kernel has the GPU's bits)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # now exact in bf16
    return v.to(dtype)


@triton.jit
def _gelu_tanh_mul(g, u):
    """gelu_tanh(g) * u in fp32: 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g * sigmoid(2c (g + 0.044715 g^3))."""
    return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) * u


# M is not specialised (Triton compiles a separate binary for an int argument equal to 1): batches 1..16 share one
# binary per config, which is what a warm start loads (BLOCK_M already is the constexpr that matters).
@triton.jit(do_not_specialize=["M"])
def skinny_kernel(x, w, y, out, counters, M, N, K, k_split, stride_xm, stride_wn, stride_ym, stride_ys, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                   DOT: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                   FIXUP: tl.constexpr, SPLITS: tl.constexpr, GDC: tl.constexpr = False):
    # program (n-block, split s): columns [n0, n0 + BLOCK_N) of all M rows over K range [s * k_split, +k_split)
    pdl_start(GDC)
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_ptr = w + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptr = w + (offs_n + N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # gated: the up rows n + I
    x_ptr = x + offs_m[None, :] * stride_xm + offs_k[:, None]  # x.T tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k0 = pid_s * k_split
    for k in range(k0, tl.minimum(k0 + k_split, K), BLOCK_K):
        mask_k = (k + offs_k) < K
        xt = tl.load(x_ptr + k, mask=mask_m[None, :] & mask_k[:, None], other=0.0)
        if EVEN_K and EVEN_N:  # the real shapes: unmasked, fully vectorised weight loads
            wt = tl.load(w_ptr + k)
        else:
            wt = tl.load(w_ptr + k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = _mac(acc, wt, xt, DOT, INTERPRET)
        if GATED:
            if EVEN_K and EVEN_N:
                ut = tl.load(u_ptr + k)
            else:
                ut = tl.load(u_ptr + k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc_u = _mac(acc_u, ut, xt, DOT, INTERPRET)
    if GATED:
        acc = _gelu_tanh_mul(acc, acc_u)
    mask = mask_n[:, None] & mask_m[None, :]
    y_ptr = y + pid_s * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None]
    if not FIXUP:  # the output, or (split K) this split's fp32 partial for the sum kernel
        tl.store(y_ptr, round_to(acc, y.dtype.element_ty, INTERPRET), mask=mask)
    else:
        # Split K in one kernel: store the partial, count this split in, and the n-block's last split to arrive sums
        # all partials in order 0..S-1 (the sum kernel's order and bits) and stores the output. The barrier puts the
        # whole program's stores before the count (the atomic releases them), the acquire puts the reads after it;
        # the reads bypass L1 (.cg). The last split resets the counter to 0, ready for the next launch or replay.
        tl.store(y_ptr, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counters + pid_n, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            # unrolled (SPLITS a constant): the partials' loads are not held behind a loop's branch and can be in
            # flight together (0.2-0.3 us less per call on the H200: docs/results.md)
            ws_ptr = y + offs_m[None, :] * stride_ym + offs_n[:, None]
            total = tl.load(ws_ptr, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(ws_ptr + s * stride_ys, mask=mask, other=0.0, cache_modifier=".cg")
            o_ptr = out + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(o_ptr, round_to(total, out.dtype.element_ty, INTERPRET), mask=mask)
            tl.atomic_xchg(counters + pid_n, 0)


@triton.jit(do_not_specialize=["M"])
def gemv_kernel(x, w, out, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 STAGES: tl.constexpr, GDC: tl.constexpr = False):
    pdl_start(GDC)
    # program (n-block, row m): out[m, n0:n0 + BLOCK_N] over all of K on CUDA cores. Each thread keeps fp32 sums of
    # its own elements of the [BLOCK_N, BLOCK_K] tile and the tile is reduced across threads once, after the loop
    # (the broadcast configs of skinny_kernel reduce every chunk); few rows per program, so a one-row call over a
    # narrow weight still launches hundreds of programs without splitting K.
    pid_n, m = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_ptr = w + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptr = w + (offs_n + N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # gated: the up rows n + I
    x_ptr = x + m * stride_xm + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    # an explicit depth: Triton pipelines a loop's loads on its own only where they feed a tl.dot
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        mask_k = (k + offs_k) < K
        xv = tl.load(x_ptr + k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        if EVEN_K and EVEN_N:
            wt = tl.load(w_ptr + k)
        else:
            wt = tl.load(w_ptr + k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += wt.to(tl.float32) * xv
        if GATED:
            if EVEN_K and EVEN_N:
                ut = tl.load(u_ptr + k)
            else:
                ut = tl.load(u_ptr + k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc_u += ut.to(tl.float32) * xv
    g = tl.sum(acc, 1)
    if GATED:
        g = _gelu_tanh_mul(g, tl.sum(acc_u, 1))
    tl.store(out + m * stride_om + offs_n, round_to(g, out.dtype.element_ty, INTERPRET), mask=mask_n)


@triton.jit
def splitk_sum_kernel(ws, out, M, N, SPLITS, stride_om, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                      GDC: tl.constexpr = False):
    pdl_start(GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws + offs, mask=mask, other=0.0)
    for s in range(1, SPLITS):  # always split 0, 1, ... in order: the same bits on every call
        acc += tl.load(ws + s * M * N + offs, mask=mask, other=0.0)
    tl.store(out + (offs // N) * stride_om + offs % N, round_to(acc, out.dtype.element_ty, INTERPRET), mask=mask)


MAX_FIXUP_BLOCKS = 4096  # n-blocks one fixup launch may have (N / block_n): 16 KiB of counters per device
_counters: dict[torch.device, torch.Tensor] = {}


def prepare_fixup(device: torch.device | str) -> torch.Tensor:
    """Make `device`'s split-K arrival counters (int32, zero between launches: each launch's last splits reset
    theirs), once; returns them. Call it before compiling or capturing anything that launches a fixup config
    (graphcap's op sets do, at bind): never lazily inside a call, where a CUDA graph capture, or torch.compile's
    CUDA-graph warm-up, would take them from the graph's private memory pool - memory the graph machinery hands out
    again, clobbering the counts. One buffer per device, so two fixup launches must not run at the same time on two
    streams of one device (their counts would mix): graphcap launches its projections from one stream, in order."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    c = _counters.get(device)
    if c is None:
        c = _counters[device] = torch.zeros(MAX_FIXUP_BLOCKS, dtype=torch.int32, device=device)
    return c


def fixup_counters(device: torch.device, blocks: int) -> torch.Tensor | None:
    """The counters `prepare_fixup` made for `device`; None - the launch then takes the two-kernel split K, the same
    bits - where none were made or `blocks` exceeds MAX_FIXUP_BLOCKS."""
    return _counters.get(device) if blocks <= MAX_FIXUP_BLOCKS else None
