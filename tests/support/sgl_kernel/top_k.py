"""`sgl_kernel.fast_topk(values, topk, dim)` (sgl_kernel's `top_k.py`), the draft's top-k that sglang 0.5.18 imports
from sgl_kernel on CUDA (`speculative/spec_utils.py`; 0.5.23 uses the same code from `sglang.srt.utils.common`).
sgl_kernel's is plain torch:

    torch.max(values, dim=dim, keepdim=True) if topk == 1 else torch.topk(values, topk, dim=dim)

`fast_topk_torch` is that code, the twin. graphcap's path (topk 1) runs one Triton kernel instead: per row, the
largest entry and its index, as torch.max with keepdim - ties to the smallest index, NaN above everything (the first
NaN wins), -0.0 equal to +0.0; the value is the row's own entry, bit for bit, in its dtype (torch.max's, except that
a NaN keeps its payload: torch's CUDA reduce hands back 0x7fff for a bf16 NaN found after a number); indices int64. Rows
longer than one block (MAX_BLOCK) are split over programs: each writes its block's best (key, index) and the last
to finish a row (an atomic ticket per row) reduces them and writes the row's result - one launch, no sync, a grid
that depends only on shapes (so it captures in CUDA graphs and traces under torch.compile: a triton_op).

topk > 1 (general trees) runs sgl_kernel's own code, torch.topk. So do dtypes other than bf16/fp16/fp32 and
devices where Triton does not run. Results are a (values, indices) tuple (torch's named tuple on those paths).

It imports nothing of the stand-in package, so tests load it in their own process without it (tests/standin_ops.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import use_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK = 4096  # entries per program: a vocabulary row of 262144 is 64 programs
_KEY_MIN = tl.constexpr(-(2 ** 31))  # below every value's key: masked lanes and empty partials
_IDX_MAX = tl.constexpr(2 ** 31 - 1)


class TopkError(ValueError):
    """Bad input to fast_topk; the message names the argument."""


def _check(values: object, topk: object, dim: object) -> None:
    if not isinstance(values, torch.Tensor):
        raise TopkError(f"fast_topk: values must be a torch.Tensor, got {type(values).__name__}")
    if isinstance(topk, bool) or not isinstance(topk, (int, torch.SymInt)) or topk < 1:
        raise TopkError(f"fast_topk: topk must be an int >= 1, got {topk!r}")
    if isinstance(dim, bool) or not isinstance(dim, (int, torch.SymInt)):
        raise TopkError(f"fast_topk: dim must be an int, got {dim!r}")
    nd = max(values.ndim, 1)
    if not -nd <= dim < nd:
        raise TopkError(f"fast_topk: dim {dim} is out of range for a {values.ndim}-D tensor")
    n = values.shape[dim] if values.ndim else 1
    if topk > n:
        raise TopkError(f"fast_topk: topk ({topk}) exceeds values' size along dim {dim} ({n})")


def fast_topk_torch(values: torch.Tensor, topk: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: sgl_kernel's fast_topk."""
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


@triton.jit
def _top1_kernel(x, values, indices, part_key, part_idx, tickets, n, stride_row, stride_col, n_split,
                 BLOCK: tl.constexpr, SPLIT: tl.constexpr, RBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cols = s * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    v = tl.load(x + row * stride_row + cols.to(tl.int64) * stride_col, mask=m, other=0.0).to(tl.float32)
    # an int32 key whose integer order is torch.max's: negative floats' magnitude bits flipped, -0.0 tied with +0.0,
    # every NaN above +inf (helpers inlined: the interpreter re-patches Triton for every jit call)
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(v == 0.0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    key = tl.where(m, tl.where(v != v, 0x7FFFFFFF, key), _KEY_MIN)
    best = tl.max(key, 0)
    at = tl.min(tl.where(key == best, cols, _IDX_MAX), 0)  # the smallest index among the best
    if SPLIT:
        tl.store(part_key + row * n_split + s, best)
        tl.store(part_idx + row * n_split + s, at)
        tl.debug_barrier()  # every thread's store before the ticket (release: seen by the row's last program)
        ticket = tl.atomic_add(tickets + row, 1, sem="acq_rel")
        if ticket == n_split - 1:  # the row's last program: every partial is written
            kk = tl.full([RBLOCK], _KEY_MIN, tl.int32)
            ii = tl.full([RBLOCK], _IDX_MAX, tl.int32)
            for start in range(0, n_split, RBLOCK):
                offs = start + tl.arange(0, RBLOCK)
                pm = offs < n_split
                k = tl.load(part_key + row * n_split + offs, mask=pm, other=_KEY_MIN, cache_modifier=".cg")
                i = tl.load(part_idx + row * n_split + offs, mask=pm, other=_IDX_MAX, cache_modifier=".cg")
                better = (k > kk) | ((k == kk) & (i < ii))
                kk = tl.where(better, k, kk)
                ii = tl.where(better, i, ii)
            best = tl.max(kk, 0)
            at = tl.min(tl.where(kk == best, ii, _IDX_MAX), 0)
            tl.store(values + row, tl.load(x + row * stride_row + at.to(tl.int64) * stride_col))
            tl.store(indices + row, at.to(tl.int64))
    else:
        tl.store(values + row, tl.load(x + row * stride_row + at.to(tl.int64) * stride_col))
        tl.store(indices + row, at.to(tl.int64))


def _top1_launch(x: torch.Tensor, max_block: int = MAX_BLOCK, rblock: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over x [rows, n] (n >= 1); max_block / rblock: smaller in tests, to split short rows."""
    rows, n = x.shape
    values = torch.empty((rows, 1), dtype=x.dtype, device=x.device)
    indices = torch.empty((rows, 1), dtype=torch.int64, device=x.device)
    if rows == 0:
        return values, indices
    block = min(max_block, max(16, triton.next_power_of_2(n)))
    n_split = triton.cdiv(n, block)
    if n_split > 1:
        part_key = torch.empty((rows, n_split), dtype=torch.int32, device=x.device)
        part_idx = torch.empty((rows, n_split), dtype=torch.int32, device=x.device)
        tickets = torch.zeros((rows,), dtype=torch.int32, device=x.device)
    else:
        part_key = part_idx = tickets = indices  # never read
    wrap_triton(_top1_kernel)[(rows, n_split)](
        x, values, indices, part_key, part_idx, tickets, n, x.stride(0), x.stride(1), n_split,
        BLOCK=block, SPLIT=n_split > 1, RBLOCK=min(rblock, max(16, triton.next_power_of_2(n_split))),
        num_warps=max(1, min(8, block // 512)))
    return values, indices


@triton_op("graphcap::fast_top1", mutates_args=())
def _top1_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _top1_launch(x)


def fast_topk(values: torch.Tensor, topk: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sgl_kernel.fast_topk: (values, indices) of the topk largest along dim, keepdim for topk 1 (module docstring)."""
    _check(values, topk, dim)
    if topk != 1 or values.ndim == 0 or values.dtype not in DTYPES or not use_triton(values):
        return fast_topk_torch(values, topk, dim)
    x = values.movedim(dim, -1)
    lead = x.shape[:-1]
    v, i = _top1_op(x.reshape(-1, x.shape[-1]))
    return v.view(*lead, 1).movedim(-1, dim), i.view(*lead, 1).movedim(-1, dim)
