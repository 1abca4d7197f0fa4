"""In-place updates of the window ring: `advance` (hot path, captured) and `reset` (rebuild, off the hot path).

Canonical layout: the token at absolute position p of slot s sits in `ring[s, p % W]`; ring columns that hold no
live token are 0 (sglang reserves KV location 0 as its padding slot). A rebuild and a run of advances therefore leave
bit-identical rings.

Each op has a Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1) and a plain-torch twin (the CPU path and the
test reference). The ops are `torch.library.triton_op`s so torch.compile/Inductor sees which tensors they mutate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import use_triton

# ---------------------------------------------------------------------------------------------------------------
# advance


def window_advance_torch(
    ring: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor, full_to_swa: torch.Tensor | None,
    slots: torch.Tensor, accepted: torch.Tensor, block: int,
) -> None:
    """Twin of the kernel. `block` = min(max accepted count, W): the most ring columns one row can change."""
    w = ring.shape[1]
    s = slots.long()
    a = accepted.long()
    length = seq_lens[s].long()
    # Only the last min(a, W) accepted tokens can survive in the ring; their positions are distinct mod W.
    start = length + (a - w).clamp(min=0)
    p = start[:, None] + torch.arange(block, device=ring.device)[None, :]
    live = (p < (length + a)[:, None]) & (p < req_to_token.shape[1])
    # Dead entries read location (0, 0): the padding slot may have no req_to_token row.
    loc = req_to_token[torch.where(live, s[:, None], 0), torch.where(live, p, 0)].long()
    if full_to_swa is not None:
        loc = full_to_swa[torch.where(live, loc, 0)].long()
    rows, cols = s[:, None].expand_as(p), p % w
    ring[rows, cols] = torch.where(live, loc, ring[rows, cols].long()).to(ring.dtype)
    seq_lens[s] = (length + a).to(seq_lens.dtype)


@triton.jit
def _window_advance_kernel(
    ring, seq_lens, req_to_token, full_to_swa, slots, accepted,
    ring_stride, r2t_stride, row_len, W,
    HAS_F2S: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    a = tl.load(accepted + i).to(tl.int64)
    length = tl.load(seq_lens + slot).to(tl.int64)
    start = length + tl.maximum(a - W, 0)
    p = start + tl.arange(0, BLOCK)
    live = (p < length + a) & (p < row_len)
    loc = tl.load(req_to_token + slot * r2t_stride + p, mask=live, other=0).to(tl.int64)
    if HAS_F2S:
        loc = tl.load(full_to_swa + loc, mask=live, other=0)
    tl.store(ring + slot * ring_stride + p % W, loc.to(ring.dtype.element_ty), mask=live)
    # Padding rows (a == 0) write nothing, so any number of them may share the padding slot.
    tl.store(seq_lens + slot, (length + a).to(seq_lens.dtype.element_ty), mask=a > 0)


@triton_op("graphcap::window_advance", mutates_args={"ring", "seq_lens"})
def window_advance(
    ring: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor, full_to_swa: torch.Tensor | None,
    slots: torch.Tensor, accepted: torch.Tensor, block: int,
) -> None:
    if not use_triton(ring):
        window_advance_torch(ring, seq_lens, req_to_token, full_to_swa, slots, accepted, block)
        return
    wrap_triton(_window_advance_kernel)[(slots.shape[0],)](
        ring, seq_lens, req_to_token, full_to_swa if full_to_swa is not None else req_to_token, slots, accepted,
        ring.stride(0), req_to_token.stride(0), req_to_token.shape[1], ring.shape[1],
        HAS_F2S=full_to_swa is not None, BLOCK=triton.next_power_of_2(block),
    )


# ---------------------------------------------------------------------------------------------------------------
# reset


def window_reset_torch(
    ring: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor, full_to_swa: torch.Tensor | None,
    slots: torch.Tensor, new_lens: torch.Tensor,
) -> None:
    w = ring.shape[1]
    s = slots.long()
    length = new_lens.long()[:, None]
    c = torch.arange(w, device=ring.device)[None, :]
    live = c < length
    # The live position that lands in column c is the largest p <= L - 1 with p % W == c.
    p = torch.where(live, c + w * torch.div(length - 1 - c, w, rounding_mode="floor"), 0)
    loc = req_to_token[s[:, None], p].long()
    if full_to_swa is not None:
        loc = full_to_swa[torch.where(live, loc, 0)].long()
    ring[s] = torch.where(live, loc, 0).to(ring.dtype)
    seq_lens[s] = new_lens.to(seq_lens.dtype)


@triton.jit
def _window_reset_kernel(
    ring, seq_lens, req_to_token, full_to_swa, slots, new_lens,
    ring_stride, r2t_stride, W,
    HAS_F2S: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cb = tl.program_id(1)
    slot = tl.load(slots + i).to(tl.int64)
    length = tl.load(new_lens + i).to(tl.int64)
    c = cb * BLOCK + tl.arange(0, BLOCK)
    in_ring = c < W
    live = in_ring & (c < length)
    p = tl.where(live, c + W * ((length - 1 - c) // W), 0)  # length - 1 - c >= 0 where live
    loc = tl.load(req_to_token + slot * r2t_stride + p, mask=live, other=0).to(tl.int64)
    if HAS_F2S:
        loc = tl.load(full_to_swa + loc, mask=live, other=0)
    tl.store(ring + slot * ring_stride + c, tl.where(live, loc, 0).to(ring.dtype.element_ty), mask=in_ring)
    if cb == 0:
        tl.store(seq_lens + slot, length.to(seq_lens.dtype.element_ty))


@triton_op("graphcap::window_reset", mutates_args={"ring", "seq_lens"})
def window_reset(
    ring: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor, full_to_swa: torch.Tensor | None,
    slots: torch.Tensor, new_lens: torch.Tensor,
) -> None:
    if not use_triton(ring):
        window_reset_torch(ring, seq_lens, req_to_token, full_to_swa, slots, new_lens)
        return
    block = min(1024, triton.next_power_of_2(ring.shape[1]))
    wrap_triton(_window_reset_kernel)[(slots.shape[0], triton.cdiv(ring.shape[1], block))](
        ring, seq_lens, req_to_token, full_to_swa if full_to_swa is not None else req_to_token, slots, new_lens,
        ring.stride(0), req_to_token.stride(0), ring.shape[1],
        HAS_F2S=full_to_swa is not None, BLOCK=block,
    )
