"""The online softmax both split-KV attention kernels run (decode: `decode_kernels`; verify: `verify`), in base 2:
a key tile's scores (`tile_scores`), the step that folds the tile into each query row's running max, sum and output
(`softmax_tile`), the flat scratch a split writes its normalised partial output and log-sum-exp to
(`split_scratch`), and the kernel that merges a row's splits (`combine_kernel`). Scores reach the step scaled by
sm_scale * log2(e) (LOG2E), so exp2 is the exponential.

Both steps are `triton.jit` helpers, which Triton inlines: each kernel runs their floating-point operations in the
order they set them, as if written out in its loop, with no call."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.kernels.pdl import pdl_start

LOG2E = 1.4426950408889634


@triton.jit
def tile_scores(q, k, F32_DOT: tl.constexpr):
    """q [M, D] against a key tile k [N, D]: [M, N] fp32 dot products. F32_DOT: exact fp32 products (fp32 inputs; on
    CPU, where Triton's interpreter gets bf16/fp16 dots wrong), else in the tiles' dtype on tensor cores."""
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def softmax_tile(s, v_base, v_rows, v_stride, v_mask, m_i, l_i, acc, V_DTYPE: tl.constexpr, F32_DOT: tl.constexpr,
                 EMPTY_ROWS: tl.constexpr):
    """Fold one key tile into each row's running softmax: `s` [M, N] the tile's scaled scores (-inf where a key is
    masked); its values [N, D], row n at `v_base + v_rows[n] * v_stride` ([1, D] pointers), read where `v_mask` (0
    elsewhere) as V_DTYPE; (m_i, l_i, acc) each row's max, sum of exponentials and unnormalised output [M, D]
    (fp32). Returns the three updated. The tile is read
    here, after the weights: the instruction order the kernels' timings (docs/results.md) were measured with.
    EMPTY_ROWS: a row may have seen no visible key yet (its max still -inf); its max is then taken as 0, so that exp2
    gives 0 rather than NaN. F32_DOT: exact fp32 products, else the weights in V_DTYPE (tensor cores), accumulated in
    fp32."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY_ROWS:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + v_rows[:, None] * v_stride, mask=v_mask, other=0.0).to(V_DTYPE)
    if F32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def combine_kernel(
    part, lse, out, num_splits, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, GDC: tl.constexpr = False,
):
    pdl_start(GDC)
    # program (row, head): the row's num_splits partials merged by their log-sum-exps; all empty gives zeros
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = (b * H + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    ls = tl.load(lse + row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(ls, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(ls - m), 0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        l_s = tl.load(lse + row + s)
        live_d = tl.where(l_s > float("-inf"), D, 0)  # an empty split wrote no partial: read none
        pv = tl.load(part + (row + s) * D + offs_d, mask=offs_d < live_d, other=0.0)
        acc += tl.exp2(l_s - m) * pv
    o = tl.where(denom > 0, acc / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(out + b * stride_ob + h * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=mask_d)


def split_scratch(b: int | torch.SymInt, h: int, num_splits: int | torch.SymInt, d: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's partial outputs [B, H, S, D] and log-sum-exps [B, H, S], fp32, allocated flat. Under one
    compile for every bucket S is an expression of the batch (`AttentionPlan.grid_splits`), and a 3-D or 4-D empty
    tensor's contiguous strides hold max(1, S), which Inductor does not prove equal to S: it then fills the buffer
    with NaN in a kernel of its own before each launch (two per layer call). One dimension has stride 1."""
    part = torch.empty((b * h * num_splits * d,), dtype=torch.float32, device=device)
    lse = torch.empty((b * h * num_splits,), dtype=torch.float32, device=device)
    return part, lse
