"""Random target-engine state for tests and the bench: KV pools, `req_to_token` and `full_to_swa`, laid out the way
sglang's allocators leave them (pages handed out in shuffled order, location 0 reserved as the padding location).

Simplification (see docs/architecture.md): every token gets an SWA location for its whole life, so the SWA pool is
as large as the full pool. sglang frees SWA locations once a token leaves the window; the draft only ever reads
in-window tokens, so the difference changes memory, not what attention reads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphcap.spec import CaptureSpec


@dataclass
class TargetState:
    req_to_token: torch.Tensor  # [max_slots, max_context] int32: full-pool location of each token
    full_to_swa: torch.Tensor  # [full pool] int64: SWA-pool location of each full-pool location
    k_swa: torch.Tensor | None  # [swa pool, sliding kv heads, sliding head dim] (the target's last sliding layer)
    v_swa: torch.Tensor | None
    k_full: torch.Tensor | None  # [full pool, full kv heads, full head dim] (the target's last full layer)
    v_full: torch.Tensor | None
    slots: torch.Tensor  # [B] int64, the batch's request-pool rows (distinct, not contiguous)
    seq_lens: list[int]  # per batch row, tokens already in the KV cache
    capacity: list[int]  # per batch row, positions allocated in req_to_token (seq_len + room to grow)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        out = {"req_to_token": self.req_to_token, "full_to_swa": self.full_to_swa}
        for name in ("k_swa", "v_swa", "k_full", "v_full"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def make_target_state(
    spec: CaptureSpec,
    seq_lens: Sequence[int],
    capacity: int | Sequence[int] | None = None,
    *,
    slots: Sequence[int] | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    kv: bool = True,
) -> TargetState:
    """A batch of `len(seq_lens)` requests. `capacity` (default: seq_len + 64) positions are allocated per row, page
    by page, in random page order; the first `seq_len` are the context, the rest are what later verify steps fill."""
    n = len(seq_lens)
    max_slots, max_context, page = spec.capture.max_slots, spec.capture.max_context, spec.page_size
    if n > max_slots:
        raise ValueError(f"make_target_state: batch of {n} exceeds max_slots={max_slots}")
    if capacity is None:
        caps = [min(max_context, s + 64) for s in seq_lens]
    elif isinstance(capacity, int):
        caps = [capacity] * n
    else:
        caps = list(capacity)
    if len(caps) != n:
        raise ValueError(f"make_target_state: {len(caps)} capacities for {n} seq_lens")
    for s, c in zip(seq_lens, caps):
        if not 0 <= s <= c <= max_context:
            raise ValueError(f"make_target_state: need 0 <= seq_len {s} <= capacity {c} <= max_context {max_context}")
    g = torch.Generator().manual_seed(seed)
    if slots is None:
        slots = torch.randperm(max_slots, generator=g)[:n].tolist()
    slots = list(slots)
    if len(slots) != n or len(set(slots)) != n or not all(0 <= x < max_slots for x in slots):
        raise ValueError(f"make_target_state: slots {slots} must be {n} distinct values in [0, {max_slots})")

    pages_per_row = [-(-c // page) for c in caps]
    n_pages = 1 + sum(pages_per_row)  # page 0 holds location 0, the padding location
    full_pages = 1 + torch.randperm(n_pages - 1, generator=g)
    req_to_token = torch.zeros(max_slots, max_context, dtype=torch.int32)
    offs = torch.arange(page)
    used = 0
    for slot, k, cap in zip(slots, pages_per_row, caps):
        locs = (full_pages[used:used + k, None] * page + offs).reshape(-1)[:cap]
        req_to_token[slot, :cap] = locs.to(torch.int32)
        used += k
    # SWA pool: the same pages in another shuffled order; location 0 maps to 0.
    swa_page_of = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(n_pages - 1, generator=g)])
    full_to_swa = (swa_page_of[:, None] * page + offs).reshape(-1)

    dt = spec.torch_dtype()
    pool = n_pages * page

    gd = torch.Generator(device=device).manual_seed(seed)

    def randn(heads: int, dim: int) -> torch.Tensor:  # drawn on the device: GPU pools run to tens of GB
        return torch.randn(pool, heads, dim, generator=gd, device=device, dtype=dt)

    return TargetState(
        req_to_token=req_to_token.to(device), full_to_swa=full_to_swa.to(device),
        k_swa=randn(spec.sliding.kv_heads, spec.sliding.head_dim) if kv else None,
        v_swa=randn(spec.sliding.kv_heads, spec.sliding.head_dim) if kv else None,
        k_full=randn(spec.full.kv_heads, spec.full.head_dim) if kv else None,
        v_full=randn(spec.full.kv_heads, spec.full.head_dim) if kv else None,
        slots=torch.tensor(slots, dtype=torch.int64, device=device), seq_lens=list(seq_lens), capacity=caps,
    )
