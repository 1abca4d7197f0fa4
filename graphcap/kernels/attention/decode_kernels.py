"""The Triton kernels of `graphcap.kernels.attention.decode` (the op, its checks and its planning live there and in
plan), their launch, and their plain-torch twin. The online softmax they share with the verify kernel - the tile
step, the split scratch, the combine - is `online_softmax`'s.

Kernel ("flash-decoding", split-KV):
1. `_split_kernel`, grid (B, Hkv * head_tiles, num_splits): program (b, kv head, split) covers a contiguous chunk of
   the row's [0, len). How many of the num_splits a row uses is decided in-kernel from its own length: enough to
   fill the GPU (`wave_splits`: B x Hkv x splits <= `target_programs`, two waves of the programs it holds at once),
   more only when the row is so long that a program would cover more than `max_chunk` tokens (then several waves
   balance rows of different lengths); chunk = max(round_up(cdiv(len, used), BLOCK_N), min_chunk). Programs past
   the row's end read no keys (they still write an empty partial's lse). So the static split count (the grid,
   fixed per capture bucket) can be sized for the longest row the layer may see while a short row still fills the
   GPU - on the H200, past two waves of resident programs the time steps up (docs/results.md#attention-kernels).
   It loads each K/V tile once for the whole query-head group (tl.dot with the group padded to >= 16 rows), runs
   an online softmax in fp32 and writes a normalised partial output [B, H, S, D] fp32 and its log-sum-exp
   [B, H, S] (base 2; -inf for an empty chunk). With num_splits == 1 it writes the final output directly and the
   second kernel is skipped.
2. `online_softmax.combine_kernel`, grid (B, H): merges the splits; an all-empty row gives zeros. (Merging in the
   split kernel instead - the last program of a row merging all partials - is slower on the H200 at nearly every
   shape: that one program merges serially; docs/results.md#attention-kernels.)

`decode_attention_torch` is the plain-torch twin (static shapes: gathers `table[slots, :cols]` with a mask, masked
softmax in fp32). It is the CPU path and a test reference; it materialises [B, cols, Hkv, D] in fp32, so it is meant
for small shapes.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from graphcap.kernels.attention.online_softmax import LOG2E, combine_kernel, softmax_tile, split_scratch, tile_scores
from graphcap.kernels.attention.plan import AttentionPlan, query_block
from graphcap.kernels import pdl
from graphcap.kernels.pdl import pdl_start


# ---------------------------------------------------------------------------------------------------------------
# plain-torch twin


def decode_attention_torch(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
    lens: torch.Tensor, window: int, sm_scale: float, num_splits: int,
) -> torch.Tensor:
    """Twin of the kernels (num_splits only matters to them). Static shapes only, so it traces under torch.compile."""
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    g = h // hkv
    cols = window if window > 0 else table.shape[1]
    s = slots.long()
    length = lens[s].long().clamp(0, cols)
    c = torch.arange(cols, device=q.device)
    live = c[None, :] < length[:, None]  # [B, cols]
    # A length-0 row reads nothing: its slot may have no table row, so index row 0 and mask.
    row = torch.where(length > 0, s, torch.zeros_like(s))
    locs = torch.where(live, table[row[:, None], c[None, :]].long(), 0)
    k = k_pool[locs].float()  # [B, cols, Hkv, D]
    v = v_pool[locs].float()
    qf = q.float().reshape(b, hkv, g, d)
    scores = torch.einsum("bhgd,bchd->bhgc", qf, k) * sm_scale
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)  # masked keys: exp(-inf) = 0
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgc,bchd->bhgd", p, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.reshape(b, h, d).to(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _split_kernel(
    q, k_pool, v_pool, table, slots, lens, out, part, lse, q_w, cos, sin,
    sm_scale_log2, cols, num_splits, min_chunk, wave, max_chunk, rope_rows, eps,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_t, stride_ob, stride_oh, stride_c,
    H: tl.constexpr, GROUP: tl.constexpr, HEAD_TILES: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr, F32_DOT: tl.constexpr, WAVE_IN_KERNEL: tl.constexpr = False, NORM_ROPE: tl.constexpr = False,
    GDC: tl.constexpr = False,
):
    pdl_start(GDC)
    b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid_h // HEAD_TILES
    ht = pid_h % HEAD_TILES

    slot = tl.load(slots + b).to(tl.int64)
    length = tl.maximum(tl.minimum(tl.load(lens + slot).to(tl.int32), cols), 0)
    if WAVE_IN_KERNEL:  # `wave` holds the target programs; the batch is the grid's (`wave_splits`, on the device)
        bh = tl.num_programs(0) * (H // GROUP)
        wave = tl.minimum(num_splits, tl.where(10 * bh >= 9 * wave, 1, tl.maximum(1, wave // bh)))
    used = tl.minimum(num_splits, tl.maximum(wave, tl.cdiv(length, max_chunk)))  # splits this row uses
    chunk = tl.maximum(tl.cdiv(tl.cdiv(length, used), BLOCK_N) * BLOCK_N, min_chunk)
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    offs_g = ht * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    q_mask = mask_g[:, None] & mask_d[None, :]
    q_ptr = q + b * stride_qb + heads[:, None] * stride_qh
    if NORM_ROPE:  # q is the raw projection: layer_fusions.norm_rope's math and roundings, per head of the tile
        half = D // 2
        partner = (offs_d + half) % D  # the element each one rotates with
        x = tl.load(q_ptr + offs_d[None, :], mask=q_mask, other=0.0).to(tl.float32)
        xp = tl.load(q_ptr + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        dt = q.dtype.element_ty
        n = (x * r * (tl.load(q_w + offs_d, mask=mask_d, other=0.0).to(tl.float32) + 1.0)[None, :])
        n = n.to(dt).to(tl.float32)
        npart = (xp * r * (tl.load(q_w + partner, mask=mask_d, other=0.0).to(tl.float32) + 1.0)[None, :])
        npart = npart.to(dt).to(tl.float32)
        pos = tl.minimum(tl.maximum(tl.load(lens + slot).to(tl.int64) - 1, 0), rope_rows - 1)  # query_positions
        c = tl.load(cos + pos * stride_c + offs_d % half, mask=mask_d, other=0.0)[None, :]
        sn = tl.load(sin + pos * stride_c + offs_d % half, mask=mask_d, other=0.0)[None, :]
        sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
        qv = (n * c + sign * npart * sn).to(dt).to(k_pool.dtype.element_ty)
    else:
        qv = tl.load(q_ptr + offs_d[None, :], mask=q_mask, other=0.0).to(k_pool.dtype.element_ty)
    scale = tl.cast(sm_scale_log2, tl.float32)  # Inductor passes Python floats as fp64 scalars
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    t_row = table + slot * stride_t  # not dereferenced unless the row has keys
    k_base = k_pool + kvh.to(tl.int64) * stride_kh + offs_d[None, :]
    v_base = v_pool + kvh.to(tl.int64) * stride_vh + offs_d[None, :]
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        loc = tl.load(t_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        kt = tl.load(k_base + loc[:, None] * stride_kp, mask=kv_mask, other=0.0)
        s = tile_scores(qv, kt, F32_DOT)
        s = tl.where(mask_n[None, :], s * scale, float("-inf"))
        m_i, l_i, acc = softmax_tile(s, v_base, loc, stride_vp, kv_mask, m_i, l_i, acc,
                                     v_pool.dtype.element_ty, F32_DOT, False)  # every row has a key in every tile

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SINGLE:
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        row = (b * H + heads) * num_splits + split  # [BLOCK_G] index into lse [B, H, S]
        tl.store(lse + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=mask_g)
        tl.store(part + row[:, None] * D + offs_d[None, :], o,
                 mask=(mask_g & has)[:, None] & mask_d[None, :])  # an empty chunk writes only its lse


class QueryNormRope(NamedTuple):
    """The query heads' RMSNorm weight [D] and the rotary position tables cos, sin [P, D/2] fp32 (and eps): with
    them decode_attention takes q as the raw projection and norms and rotates it in its split kernel
    (layer_fusions.norm_rope's math, roundings and positions) - one kernel fewer per layer call."""
    weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    eps: float = 1e-6


def launch(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
    lens: torch.Tensor, window: int, sm_scale: float, plan: AttentionPlan, q_norm: QueryNormRope | None = None,
) -> torch.Tensor:
    """The kernels as `plan` says; nothing here plans. A plan for any batch (`wave` 0), or a symbolic batch (one
    compile for every bucket), has the split kernel derive the wave (`wave_splits`) from its grid's batch instead of
    taking it from the host, where a symbolic batch would make it a symbolic, guarded Python value. The same number
    either way. The grid's split count of a plan for any batch is `grid_splits`, an expression of the batch that
    Inductor's wrapper evaluates at each launch: every bucket gets the grid its own plan would give."""
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    group = h // hkv
    block_g = query_block(group, d)
    head_tiles = triton.cdiv(group, block_g)
    block_d = max(16, triton.next_power_of_2(d))
    cols = window if window > 0 else table.shape[1]
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    single = plan.num_splits == 1  # static: a grid that adapts to the batch keeps the split + combine kernels
    num_splits = plan.grid_splits(b, hkv)
    if plan.max_chunk > 0:  # adapt per row (module docstring); else every row uses num_splits
        wave_in_kernel = plan.wave == 0 or not isinstance(b, int)
        wave = plan.programs if wave_in_kernel else plan.wave
        max_chunk = plan.max_chunk
    else:
        wave, max_chunk, wave_in_kernel = num_splits, 1 << 30, False
    if single:  # placeholders, never touched
        part = torch.empty((1,), dtype=torch.float32, device=q.device)
        lse = part
    else:  # [B, H, S, D] and [B, H, S], indexed by the kernels alone
        part, lse = split_scratch(b, h, num_splits, d, q.device)
    if q_norm is not None:
        q_w, cos, sin, eps = q_norm
        rope_rows, stride_c = cos.shape[0], cos.stride(0)
    else:  # placeholders, never read (NORM_ROPE is off)
        q_w = cos = sin = q
        rope_rows, stride_c, eps = 1, 0, 0.0
    pdl_opts = pdl.launch_options(q)
    wrap_triton(_split_kernel)[(b, hkv * head_tiles, num_splits)](
        q, k_pool, v_pool, table, slots, lens, out, part, lse, q_w, cos, sin,
        float(sm_scale) * LOG2E, cols, num_splits, plan.min_chunk, wave, max_chunk, rope_rows, float(eps),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        table.stride(0), out.stride(0), out.stride(1), stride_c,
        H=h, GROUP=group, HEAD_TILES=head_tiles, D=d, BLOCK_D=block_d, BLOCK_G=block_g,
        BLOCK_N=plan.block_n, SINGLE=single, WAVE_IN_KERNEL=wave_in_kernel, NORM_ROPE=q_norm is not None,
        # fp32 inputs: exact fp32 dots, not TF32. On CPU (Triton's interpreter) always: its tl.dot of bf16/fp16 tiles
        # returns garbage (seen with triton 3.9), so the tiles are upcast there.
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_opts,
    )
    if not single:
        wrap_triton(combine_kernel)[(b, h)](
            part, lse, out, num_splits, out.stride(0), out.stride(1),
            H=h, D=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(plan.num_splits),
            num_warps=plan.combine_warps, num_stages=1, **pdl_opts,
        )
    return out
