"""Decode attention for the draft model: one query token per batch row, K/V read in place from the target's pools.

Both draft layer types use the same op:
- full layers: `table` = sglang's `req_to_token` [rows, max_context], `window` = 0: row b attends
  `table[slots[b], :lens[slots[b]]]`;
- sliding layers: `table` = the WindowBuffers ring [max_slots + 1, W] (SWA-pool locations), `window` = W: row b
  attends `table[slots[b], :min(lens[slots[b]], W)]`. The ring's live columns are exactly those (canonical layout
  p % W; softmax does not care about the order of the keys).
In both cases the length is also clipped to the table's column count (`window`, or `table.shape[1]` when 0), so a
stale length can never read past a row. A row whose length is 0 (padding rows point at the padding slot, whose length
is 0 and which may have no row in `table`) reads nothing - not even `table` - and returns zeros.

Page size: sglang's `req_to_token` maps every token position to its own location in the pool, whatever the page
size (a page of 64 is 64 consecutive locations, each listed). The kernels read per-token locations, so they are
correct for every page size; a page size > 1 only makes neighbouring locations contiguous, which helps the memory
system but is never assumed.

The kernels - split-KV "flash-decoding": a split kernel, then a combine kernel - and their plain-torch twin
`decode_attention_torch` (the CPU path and a test reference) are in graphcap.kernels.attention.decode_kernels.

Grid and temporaries depend only on static shapes (B, H, D, num_splits), never on GPU values: the op can be captured
in a CUDA graph and traced by torch.compile (it is a `torch.library.triton_op`). Those host-side decisions (launch
configuration, split count, wave) are one `plan.AttentionPlan`, made per bucket before anything is traced
and passed to the op as ints; the launch derives only the query tiling from the shapes.
"""
from __future__ import annotations

from typing import Optional  # the op's schema

import torch
from torch.library import triton_op

from graphcap.kernels import use_triton
from graphcap.kernels.checks import check_same_device, check_tensor
from graphcap.kernels.elementwise.fused_ops import FusedOpError
from graphcap.kernels.elementwise.layer_fusions import check_norm_rope, norm_rope_torch
from graphcap.kernels.attention.decode_kernels import QueryNormRope, decode_attention_torch, launch
from graphcap.kernels.attention.plan import AttentionError, AttentionPlan, KernelConfig, plan_attention

MAX_SPLITS = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# checks (static: shapes, dtypes, devices, strides - nothing that needs a GPU value)


def _check(q, k_pool, v_pool, table, slots, lens, window, sm_scale, num_splits) -> None:
    op = "decode_attention"
    for name, x, ndim in (("q", q, 3), ("k_pool", k_pool, 3), ("v_pool", v_pool, 3)):
        check_tensor(AttentionError, op, name, x, DTYPES, ndim)
    check_tensor(AttentionError, op, "table", table, INDEX_DTYPES, 2)
    for name, x in (("slots", slots), ("lens", lens)):  # read one entry per row: any stride
        check_tensor(AttentionError, op, name, x, INDEX_DTYPES, 1, contiguous_rows=False)
    b, h, d = q.shape
    if k_pool.shape != v_pool.shape:
        raise AttentionError(f"decode_attention: k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise AttentionError(
            f"decode_attention: q, k_pool, v_pool dtypes differ ({q.dtype}, {k_pool.dtype}, {v_pool.dtype})")
    hkv, dk = k_pool.shape[1], k_pool.shape[2]
    if dk != d:
        raise AttentionError(f"decode_attention: head dim of q ({d}) != head dim of k_pool/v_pool ({dk})")
    if hkv < 1 or h % hkv:
        raise AttentionError(f"decode_attention: query heads ({h}) must be a multiple of kv heads ({hkv})")
    if slots.shape[0] != b:
        raise AttentionError(f"decode_attention: slots has {slots.shape[0]} entries, q has {b} rows")
    check_same_device(AttentionError, op, q=q, k_pool=k_pool, v_pool=v_pool, table=table, slots=slots, lens=lens)
    if not isinstance(window, int) or window < 0:
        raise AttentionError(f"decode_attention: window must be an int >= 0, got {window!r}")
    if window > table.shape[1]:
        raise AttentionError(f"decode_attention: window {window} is wider than table ({table.shape[1]} columns)")
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise AttentionError(f"decode_attention: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if not isinstance(sm_scale, (int, float)):
        raise AttentionError(f"decode_attention: sm_scale must be a float, got {type(sm_scale).__name__}")


def _batch_of(q: torch.Tensor) -> int | None:
    """q's batch as a host int, or None where it is symbolic (one compile for every bucket)."""
    b = q.shape[0]
    return b if isinstance(b, int) else None


def plan_for_inputs(q: torch.Tensor, k_pool: torch.Tensor, table: torch.Tensor, window: int,
                    num_splits: int | None = None, config: KernelConfig | None = None) -> AttentionPlan:
    """`plan_attention` from a call's own tensors (rows at most `window`, or the table's columns, long): the plan of
    a direct call that brings none. Draft layers plan per bucket instead, before anything is traced."""
    return plan_attention(_batch_of(q), k_pool.shape[1], q.shape[-1], q.dtype, q.device,
                          window if window > 0 else table.shape[1], num_splits=num_splits, config=config)


def decode_attention_with_config(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
    lens: torch.Tensor, window: int, sm_scale: float, num_splits: int, config: KernelConfig | None = None,
) -> torch.Tensor:
    """The kernels with an explicit launch configuration (for tuning; not a registered op)."""
    _check(q, k_pool, v_pool, table, slots, lens, window, sm_scale, num_splits)
    plan = plan_for_inputs(q, k_pool, table, window, num_splits, config)
    return launch(q, k_pool, v_pool, table, slots, lens, window, sm_scale, plan)


def decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
    lens: torch.Tensor, window: int, sm_scale: float, num_splits: int | None = None, *,
    plan: AttentionPlan | None = None, q_norm: QueryNormRope | None = None,
) -> torch.Tensor:
    """Decode attention over `table[slots[b], :min(lens[slots[b]], window or table.shape[1])]` per batch row.

    q [B, H, D] (RoPE applied), k_pool/v_pool [P, Hkv, D] (read in place), table [rows, cols] int32/int64 locations,
    slots [B], lens indexed by slot. Returns [B, H, D] in q's dtype; rows of length 0 give zeros.

    `plan`: the call's `AttentionPlan`, made beforehand (per bucket, outside anything traced). Without one the op
    plans inside its body from the inputs with the given `num_splits` (a direct call; under torch.compile Inductor
    traces that body, so a compiled caller should bring a plan).

    `q_norm`: q is the raw query projection, normed and rotated at each row's query position (lens[slots[b]] - 1)
    in the split kernel before it attends (`QueryNormRope`; the same as attending over
    layer_fusions.norm_rope(q, ...)).
    """
    if q_norm is not None:
        try:
            eps = check_norm_rope("decode_attention", q, *q_norm[:3], slots, lens, q_norm.eps)
        except FusedOpError as e:
            raise AttentionError(str(e)) from None
        q_args = (q_norm.weight, q_norm.cos, q_norm.sin, eps)
    else:
        q_args = (None, None, None, 0.0)
    if plan is None:
        if num_splits is None:
            raise AttentionError("decode_attention: pass num_splits or a plan (plan.plan_attention)")
        args = (num_splits, *_UNPLANNED)
    elif num_splits is not None and num_splits != plan.num_splits:
        raise AttentionError(f"decode_attention: num_splits {num_splits} != the plan's {plan.num_splits}")
    else:
        args = plan.launch_args()
    # Every argument passed, positionally: nothing relies on how a torch version's custom-op wrapper fills in
    # defaults.
    return _decode_attention_op(q, k_pool, v_pool, table, slots, lens, window, sm_scale, *args, *q_args)


_UNPLANNED = (0,) * 9  # the op's plan arguments after num_splits when the call brought no plan


@triton_op("graphcap::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
    lens: torch.Tensor, window: int, sm_scale: float, num_splits: int, block_n: int, num_warps: int,
    num_stages: int, min_chunk: int, max_chunk: int, combine_warps: int, programs: int, wave: int, min_splits: int,
    q_weight: Optional[torch.Tensor], cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], eps: float,
) -> torch.Tensor:
    """The registered op behind `decode_attention` (traceable by torch.compile, capturable in a CUDA graph). The
    plan's numbers arrive as ints (an op takes only tensors and scalars); block_n 0 means the call brought none and
    it is planned here, from the inputs (Dynamo does not trace an op's body; Inductor's lowering does, on fake
    tensors, which is why a symbolic batch plans for any batch)."""
    _check(q, k_pool, v_pool, table, slots, lens, window, sm_scale, num_splits)
    q_norm = QueryNormRope(q_weight, cos, sin, eps) if q_weight is not None else None
    if not use_triton(q):
        if q_norm is not None:
            q = norm_rope_torch(q, q_weight, cos, sin, slots, lens, eps)
        return decode_attention_torch(q, k_pool, v_pool, table, slots, lens, window, sm_scale, num_splits)
    if block_n == 0:
        plan = plan_for_inputs(q, k_pool, table, window, num_splits)
    else:
        plan = AttentionPlan(num_splits, block_n, num_warps, num_stages, min_chunk, max_chunk, combine_warps,
                             programs, wave, min_splits)
    return launch(q, k_pool, v_pool, table, slots, lens, window, sm_scale, plan, q_norm)
