"""Top-k of short rows in one kernel: the draft head's two selections (k = 33 of 2048 centroid scores, k = 2 of 4096
candidate logits) without torch's several-kernel top-k (radix-select passes, a gather, a sort).

Per row b, the k largest entries of x[b, :N], largest first, and their column indices:

    values[b, j] = x[b, indices[b, j]],   x[b, indices[b, 0]] >= x[b, indices[b, 1]] >= ... (j < k)

`topk_torch` is the plain-torch twin, `torch.topk(x, k, dim=-1)` (largest, sorted). The kernel runs one program per
row: the row is loaded once into registers (masked past N), then k rounds of (argmax, record, remove that entry).

Order. Entries are ranked by a 32-bit key made from the fp32 value (bf16/fp16 widen to fp32 exactly): the IEEE bits
mapped to an order-preserving signed integer, with -0.0 given +0.0's key and every NaN the largest key. So:
- NaN ranks above +inf, as in torch.topk: a row's NaNs come first (values NaN), then the rest in descending order.
- Equal values (+0.0 and -0.0 included, and all NaNs) are taken smallest index first: within a tie the indices
  ascend. torch.topk's order among equal values is unspecified, so the kernel's indices equal torch's only where
  the values are distinct.
- -inf is an ordinary value below every finite one: a row with fewer than k finite entries returns its -inf
  entries next (values -inf, their indices ascending), as torch returns -inf values. Entries past N, and entries
  already taken, hold a key below -inf's, so they are never chosen (k <= N).
(Triton's CPU interpreter takes the leftmost index whatever `tie_break_left` says, so only a GPU run checks the
kernel's own tie rule: the GPU tests do, in bf16 rows where ties occur.)
Values are copied from x at the chosen indices (one gather at the end), so they are x's entries bit for bit (a NaN
keeps its payload, -0.0 its sign); values in x's dtype, indices int64.

Sizes. The row lives in registers: N <= MAX_N (8192) and k <= MAX_K (64, the length of the index vector each
program keeps). Larger rows or k fall back to the twin (torch.topk), silently and with the same results up to tie
order. num_warps grows with the row (`warps_for`: 4 warps for 2048, 8 for 4096 and 8192) - a first choice, not yet
tuned on a GPU. Grid (one program per row) and outputs depend only on static shapes, never on a GPU value, so the op
captures in a CUDA graph and traces under torch.compile (a `torch.library.triton_op`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import use_triton
from graphcap.kernels import pdl
from graphcap.kernels.pdl import pdl_start
from graphcap.kernels.checks import check_tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_N = 8192  # the longest row held in registers (fp32 keys: 32 per thread at 8 warps)
MAX_K = 64  # the most entries per row: the indices are kept in a vector of next_power_of_2(k) lanes


class SmallTopkError(ValueError):
    """A bad argument to small_topk (named in the message)."""


def _check(x: torch.Tensor, k: int) -> None:
    """Static checks only (shape, dtype, stride, k): nothing that reads a GPU value."""
    check_tensor(SmallTopkError, "small_topk", "x", x, DTYPES, 2)
    n = x.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise SmallTopkError(f"small_topk: k must be an int in [1, {n}] (x's last dimension), got {k!r}")


# ---------------------------------------------------------------------------------------------------------------
# plain-torch twin


def topk_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the kernel: torch.topk over the last dimension, largest first, sorted (ties in torch's order)."""
    values, indices = torch.topk(x, k, dim=-1)
    return values, indices


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _small_topk_kernel(x, values, indices, stride_xb, stride_vb, stride_ib,
                       N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GDC: tl.constexpr = False):
    pdl_start(GDC)
    # program b: row b's K largest, by an order-preserving integer key (module docstring)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    v = tl.load(x + b * stride_xb + offs, mask=offs < N, other=0.0).to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped, so integer order = float order
    key = tl.where(v == 0.0, 0, key)  # -0.0 ties with +0.0
    key = tl.where(v != v, 2147483647, key)  # every NaN above +inf (torch.topk's order), all NaNs equal
    gone = -2147483647 - 1  # below -inf's key: entries past N and entries taken are never chosen again
    key = tl.where(offs < N, key, gone)
    lanes = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], tl.int32)
    for j in range(K):
        i = tl.argmax(key, 0, tie_break_left=True)  # the smallest index among the largest keys
        chosen = tl.where(lanes == j, i, chosen)
        key = tl.where(offs == i, gone, key)
    # one gather for all K: x's own entries (NaN payloads, -0.0), in x's dtype
    out = tl.load(x + b * stride_xb + chosen, mask=lanes < K)
    tl.store(values + b * stride_vb + lanes, out, mask=lanes < K)
    tl.store(indices + b * stride_ib + lanes, chosen.to(tl.int64), mask=lanes < K)


def warps_for(block_n: int) -> int:
    """Warps per program: ~512 row entries per warp (16 per thread), 1 to 8 (2048: 4; 4096, 8192: 8). Untuned."""
    return max(1, min(8, block_n // 512))


def launch(x: torch.Tensor, k: int, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over x's rows; num_warps: `warps_for`'s choice unless given (lab/row_kernels.py sweeps it)."""
    b, n = x.shape
    values = torch.empty((b, k), dtype=x.dtype, device=x.device)
    indices = torch.empty((b, k), dtype=torch.int64, device=x.device)
    if b == 0:
        return values, indices
    block_n = max(16, triton.next_power_of_2(n))
    wrap_triton(_small_topk_kernel)[(b,)](
        x, values, indices, x.stride(0), values.stride(0), indices.stride(0),
        N=n, K=k, BLOCK_N=block_n, BLOCK_K=max(2, triton.next_power_of_2(k)),
        num_warps=num_warps or warps_for(block_n), **pdl.launch_options(x),
    )
    return values, indices


# ---------------------------------------------------------------------------------------------------------------
# the op


def small_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of x and their indices, largest first: (values [B, k] in x's dtype,
    indices [B, k] int64), as torch.topk(x, k, dim=-1) up to the order of equal values (the kernel: smallest index
    first; NaN above everything, as torch).

    x [B, N] bf16/fp16/fp32, row stride free, last dimension contiguous; 1 <= k <= N. The Triton kernel where Triton
    runs (CUDA; CPU under TRITON_INTERPRET=1) and N <= MAX_N, k <= MAX_K; the twin (torch.topk) otherwise.
    """
    _check(x, k)  # here too: the op's schema would reject a bad type first, unnamed
    return _small_topk_op(x, k)


@triton_op("graphcap::small_topk", mutates_args=())
def _small_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered op behind `small_topk` (traceable by torch.compile, capturable in a CUDA graph)."""
    _check(x, k)
    if not use_triton(x) or x.shape[1] > MAX_N or k > MAX_K:
        return topk_torch(x, k)
    return launch(x, k)
