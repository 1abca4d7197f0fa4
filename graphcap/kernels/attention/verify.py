"""Verify attention: the target's attention for the `n_q` tokens a speculative verify checks per request (the bonus
token and the draft's chain), causal among themselves, over each request's prefix read in place from the KV pool.

Why a kernel of its own: on NVIDIA, sglang's Triton backend runs the verify through its prefill kernel
(`extend_attention_fwd`: grid batch x query heads x one query tile, each program walking the whole prefix serially).
At verify shapes - a few query tokens against a long prefix - that leaves most of the GPU idle and reads every K/V
tile once per query head, so its cost grows with batch x min(context, window) while a decode step over the same
prefix costs a fraction of it. Here the verify is the split-KV decode kernel (`decode_kernels`) generalised to
`n_q` query rows per request: program (request, KV head, split) loads each K/V tile of its chunk of the prefix once
for every query head of the GQA group and every one of the `n_q` query tokens (one tl.dot over group x n_q rows),
splits the prefix so that a small batch still fills the GPU, and the first split of a request also attends to the
`n_q` new tokens' own keys (causal). The partials are merged by the decode kernels' combine kernel, one query token
per row.

Prefix layout: sglang's ragged lists - request b's prefix locations are `indices[indptr[b]:indptr[b + 1]]`, oldest
first (the full layers' `kv_indices`; the sliding layers' `window_kv_indices`, already the last `min(len, W)`
tokens, in the SWA pool). Sliding window (`window` > 0, sglang's `sliding_window_size`): query token i of a request
whose prefix list holds `n` keys sees prefix key `j` when `n + i <= j + window` (the query's and the key's absolute
positions at most `window` apart - sglang's extend kernel's rule, in the list's own indices), and new token `e`
when `e <= i` and `i - e <= window` (all of them once the window spans the verify, as in every real model).
`window` <= 0: every prefix key, new tokens causal.

Everything the launch decides (grid, split count, tiles) comes from static numbers (`plan_verify`), never from GPU
values: the call is captured into the verify's CUDA graph as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from graphcap.kernels import pdl, use_triton
from graphcap.kernels.checks import check_same_device, check_tensor
from graphcap.kernels.attention.online_softmax import LOG2E, combine_kernel, softmax_tile, split_scratch, tile_scores
from graphcap.kernels.arch import GpuArch, device_arch
from graphcap.kernels.attention.plan import AttentionError, AttentionPlan, plan_attention
from graphcap.kernels.pdl import pdl_start

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_QUERY_TOKENS = 16  # verify tokens per request one program holds (speculative_num_draft_tokens)


# ---------------------------------------------------------------------------------------------------------------
# plain-torch twin


def verify_attention_torch(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, n_q: int,
                           sm_scale: float, window: int) -> torch.Tensor:
    """Twin of the kernels: one request at a time, scores and softmax in fp32. The CPU path and a test reference."""
    t, h, d = q.shape
    g = h // k_pool.shape[1]
    out = torch.empty_like(q)
    ptr = indptr.tolist()
    for b in range(t // n_q):
        rows = slice(b * n_q, (b + 1) * n_q)
        locs = indices[ptr[b]:ptr[b + 1]].long()
        n = locs.numel()
        k = torch.cat([k_pool[locs], k_new[rows]]).float().repeat_interleave(g, dim=1)  # [n + n_q, H, D]
        v = torch.cat([v_pool[locs], v_new[rows]]).float().repeat_interleave(g, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[rows].float(), k) * sm_scale  # [H, n_q, n + n_q]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n + n_q, device=q.device)[None, :]
        visible = j <= n + i  # list index j: prefix keys, then the new tokens at n + e
        if window > 0:
            visible &= n + i <= j + window
        s = s.masked_fill(~visible[None], float("-inf"))
        out[rows] = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel (the combine is online_softmax.combine_kernel, one query token per row)


@triton.jit
def _verify_split_kernel(
    q, k_new, v_new, k_pool, v_pool, indptr, indices, out, part, lse,
    sm_scale_log2, window, num_splits, min_chunk, wave, max_chunk,
    stride_qt, stride_qh, stride_nt, stride_nh, stride_kp, stride_kh, stride_vp, stride_vh, stride_ot, stride_oh,
    H: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_TILES: tl.constexpr, NQ: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    SINGLE: tl.constexpr, F32_DOT: tl.constexpr, GDC: tl.constexpr = False,
):
    pdl_start(GDC)
    b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid_h // HEAD_TILES
    ht = pid_h % HEAD_TILES

    kv_start = tl.load(indptr + b).to(tl.int64)
    length = (tl.load(indptr + b + 1).to(tl.int64) - kv_start).to(tl.int32)
    used = tl.minimum(num_splits, tl.maximum(wave, tl.cdiv(length, max_chunk)))  # the decode kernel's adaptation
    chunk = tl.maximum(tl.cdiv(tl.cdiv(length, used), BLOCK_N) * BLOCK_N, min_chunk)
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    # Rows of the tile: (query head g of this tile, query token i), g-major.
    offs_m = tl.arange(0, BLOCK_M)
    g = offs_m // NQ
    i = offs_m % NQ
    head_in_group = ht * HEADS + g
    mask_m = (g < HEADS) & (head_in_group < GROUP)
    heads = kvh * GROUP + head_in_group
    tok = b * NQ + i  # the query token's row in q / out (NQ tokens per request)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    qv = tl.load(q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(k_pool.dtype.element_ty)
    scale = tl.cast(sm_scale_log2, tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Prefix keys [start, end) of this split. Sliding window: key j is visible to token i when
    # length + i <= j + window, i.e. j >= length + i - window.
    lo = tl.where(window > 0, length + i - window, 0)  # [BLOCK_M]: each row's oldest visible key
    k_base = k_pool + kvh.to(tl.int64) * stride_kh + offs_d[None, :]
    v_base = v_pool + kvh.to(tl.int64) * stride_vh + offs_d[None, :]
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        loc = tl.load(indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        kt = tl.load(k_base + loc[:, None] * stride_kp, mask=kv_mask, other=0.0)
        s = tile_scores(qv, kt, F32_DOT)
        visible = mask_n[None, :] & (offs_n[None, :] >= lo[:, None])
        s = tl.where(visible, s * scale, float("-inf"))
        m_i, l_i, acc = softmax_tile(s, v_base, loc, stride_vp, kv_mask, m_i, l_i, acc,
                                     v_pool.dtype.element_ty, F32_DOT, True)  # a row may see no key yet in this split

    if split == 0:  # the request's own new tokens, causal: token i sees new tokens e <= i with i - e <= window
        offs_e = tl.arange(0, BLOCK_E)
        mask_e = offs_e < NQ
        e_rows = (b * NQ + offs_e).to(tl.int64)
        e_mask = mask_e[:, None] & mask_d[None, :]
        ke = tl.load(k_new + e_rows[:, None] * stride_nt + kvh.to(tl.int64) * stride_nh + offs_d[None, :],
                     mask=e_mask, other=0.0).to(k_pool.dtype.element_ty)
        s = tile_scores(qv, ke, F32_DOT)
        near = (offs_e[None, :] <= i[:, None]) & ((window <= 0) | (i[:, None] <= offs_e[None, :] + window))
        s = tl.where(mask_e[None, :] & near, s * scale, float("-inf"))
        ve = v_new + kvh.to(tl.int64) * stride_nh + offs_d[None, :]
        m_i, l_i, acc = softmax_tile(s, ve, e_rows, stride_nt, e_mask, m_i, l_i, acc, k_pool.dtype.element_ty, F32_DOT,
                                     True)

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SINGLE:
        tl.store(out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    else:
        row = (tok * H + heads) * num_splits + split  # [B * NQ, H, S]: the combine kernel's layout, a row a token
        tl.store(lse + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=mask_m)
        tl.store(part + row[:, None] * D + offs_d[None, :], o, mask=(mask_m & has)[:, None] & mask_d[None, :])


# ---------------------------------------------------------------------------------------------------------------
# planning (host, static numbers only) and the launch


@dataclass(frozen=True)
class VerifyPlan:
    """One verify-attention launch: the decode plan's split grid and tiles, and the query tiling (`heads` query
    heads x `n_q` tokens per program, `head_tiles` programs per KV head)."""
    attention: AttentionPlan
    n_q: int
    heads: int
    head_tiles: int
    block_m: int


def max_rows(head_dim: int) -> int:
    """Query rows (heads x tokens) one program holds: its fp32 accumulator [rows, D] stays in registers."""
    return 16 if head_dim >= 512 else 64


def plan_verify(batch: int, kv_heads: int, q_heads: int, head_dim: int, n_q: int, dtype: torch.dtype,
                device: torch.device | str, max_len: int, rows: int | None = None, num_splits: int | None = None,
                arch: GpuArch | None = None) -> VerifyPlan:
    """The plan of a verify over `batch` requests of `n_q` tokens each, prefixes at most `max_len` keys long (the
    window for sliding layers, the context bound for full ones). Per capture bucket, on the host. `rows` overrides
    the query rows per program (`max_rows`), `num_splits` the split rule (tuning and tests); `arch` the GPU planned
    for (`graphcap.kernels.arch`, default the device's)."""
    if not 1 <= n_q <= MAX_QUERY_TOKENS:
        raise AttentionError(f"verify_attention: {n_q} query tokens per request; 1..{MAX_QUERY_TOKENS} supported")
    if kv_heads < 1 or q_heads % kv_heads:
        raise AttentionError(f"verify_attention: query heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    group = q_heads // kv_heads
    heads = max(1, min(group, (rows or max_rows(head_dim)) // n_q))
    head_tiles = triton.cdiv(group, heads)
    attention = plan_attention(max(1, batch) * head_tiles, kv_heads, head_dim, dtype, device, max_len,
                               num_splits=num_splits, arch=arch)
    if torch.device(device).type == "cuda" and head_dim >= 512 and not (arch or device_arch(device)).hopper:
        # Without wgmma (which reads its operands from shared memory) the [rows, 512] tiles of q, the accumulator
        # and K/V live in registers: at 4 warps ptxas spills ~670 bytes per thread on sm_80; 8 warps hold them
        # (compiled in tests/kernels/test_sm80.py; not timed on an A100)
        attention = replace(attention, num_warps=8, block_n=16, min_chunk=32)
    return VerifyPlan(attention, n_q, heads, head_tiles, max(16, triton.next_power_of_2(heads * n_q)))


def _check(q, k_new, v_new, k_pool, v_pool, indptr, indices, n_q, out) -> None:
    op = "verify_attention"
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_pool", k_pool), ("v_pool", v_pool),
                    ("out", out)):
        check_tensor(AttentionError, op, name, x, DTYPES, 3)
    for name, x in (("indptr", indptr), ("indices", indices)):  # read one entry at a time: any stride
        check_tensor(AttentionError, op, name, x, INDEX_DTYPES, 1, contiguous_rows=False)
    tokens, h, d = q.shape
    hkv = k_pool.shape[1]
    if k_pool.shape[1:] != (hkv, d) or v_pool.shape[1:] != (hkv, d) or k_new.shape != (tokens, hkv, d) \
            or v_new.shape != (tokens, hkv, d) or out.shape != q.shape:
        raise AttentionError(f"verify_attention: shapes disagree: q {tuple(q.shape)}, k_new {tuple(k_new.shape)}, "
                             f"v_new {tuple(v_new.shape)}, k_pool {tuple(k_pool.shape)}, v_pool "
                             f"{tuple(v_pool.shape)}, out {tuple(out.shape)} "
                             "(want [T, H, D], [T, Hkv, D], [P, Hkv, D])")
    if h % hkv:
        raise AttentionError(f"verify_attention: query heads ({h}) must be a multiple of kv heads ({hkv})")
    if not isinstance(n_q, int) or n_q < 1 or tokens % n_q:
        raise AttentionError(f"verify_attention: {tokens} query tokens are not whole requests of n_q={n_q!r}")
    if indptr.shape[0] < tokens // n_q + 1:
        raise AttentionError(f"verify_attention: indptr has {indptr.shape[0]} entries for {tokens // n_q} requests")
    check_same_device(AttentionError, op, q=q, k_new=k_new, v_new=v_new, k_pool=k_pool, v_pool=v_pool,
                      indptr=indptr, indices=indices, out=out)
    if k_pool.dtype != v_pool.dtype:
        raise AttentionError(f"verify_attention: k_pool {k_pool.dtype} and v_pool {v_pool.dtype} differ")


def verify_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, n_q: int, sm_scale: float,
                     window: int, *, plan: VerifyPlan | None = None, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Attention of q [B * n_q, H, D] (n_q tokens per request, request-major) over each request's prefix
    (`indices[indptr[b]:indptr[b + 1]]` in k_pool / v_pool [P, Hkv, D]) and its own new keys k_new / v_new
    [B * n_q, Hkv, D] (causal). Writes `out` ([B * n_q, H, D], allocated when None) and returns it.

    `plan`: made per capture bucket with `plan_verify` (a call without one plans from its inputs, sizing the grid
    for prefixes as long as `indices`)."""
    if out is None:
        out = torch.empty_like(q)
    _check(q, k_new, v_new, k_pool, v_pool, indptr, indices, n_q, out)
    tokens, h, d = q.shape
    hkv = k_pool.shape[1]
    b = tokens // n_q
    if plan is not None and plan.n_q != n_q:  # named on either path: a plan made for another verify is a caller's bug
        raise AttentionError(f"verify_attention: the plan is for {plan.n_q} query tokens per request, got {n_q}")
    if not use_triton(q):
        out.copy_(verify_attention_torch(q, k_new, v_new, k_pool, v_pool, indptr, indices, n_q, sm_scale, window))
        return out
    if plan is None:
        plan = plan_verify(b, hkv, h, d, n_q, q.dtype, q.device, max(1, indices.shape[0]))
    if b == 0:
        return out
    ap = plan.attention
    single = ap.num_splits == 1
    if single:
        part = lse = torch.empty((1,), dtype=torch.float32, device=q.device)  # never touched
    else:
        part, lse = split_scratch(tokens, h, ap.num_splits, d, q.device)
    wave = ap.wave if ap.max_chunk > 0 else ap.num_splits
    max_chunk = ap.max_chunk if ap.max_chunk > 0 else 1 << 30
    block_d = max(16, triton.next_power_of_2(d))
    pdl_opts = pdl.launch_options(q, wrapped=False)  # a direct launch, as sglang's attention backend calls it
    _verify_split_kernel[(b, hkv * plan.head_tiles, ap.num_splits)](
        q, k_new, v_new, k_pool, v_pool, indptr, indices, out, part, lse,
        float(sm_scale) * LOG2E, int(window), ap.num_splits, ap.min_chunk, wave, max_chunk,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
        H=h, GROUP=h // hkv, HEADS=plan.heads, HEAD_TILES=plan.head_tiles, NQ=n_q, D=d, BLOCK_D=block_d,
        BLOCK_M=plan.block_m, BLOCK_N=ap.block_n, BLOCK_E=max(16, triton.next_power_of_2(n_q)), SINGLE=single,
        # Triton's interpreter computes bf16/fp16 dots wrongly (decode_kernels says so): fp32 tiles there
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda,
        num_warps=ap.num_warps, num_stages=ap.num_stages, **pdl_opts,
    )
    if not single:
        combine_kernel[(tokens, h)](
            part, lse, out, ap.num_splits, out.stride(0), out.stride(1),
            H=h, D=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(ap.num_splits),
            num_warps=ap.combine_warps, num_stages=1, **pdl_opts,
        )
    return out
