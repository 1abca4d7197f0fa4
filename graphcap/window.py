"""WindowBuffers: per-slot sliding-window rings, allocated once and moved forward in place.

Slot = a request's row in the engine's request pool (sglang's `req_pool_idx`). `ring[s, p % W]` holds the SWA-pool
location of the token at absolute position p, for the last `min(seq_lens[s], W)` positions; other columns are 0.
Row `max_slots` is the padding slot: its length stays 0, so padded batch rows read nothing and write nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from graphcap.kernels.window.update import window_advance, window_reset

IntsLike = torch.Tensor | Sequence[int]


class WindowError(ValueError):
    """Bad input to WindowBuffers; the message names the call, the slot and the value. Nothing was changed."""


class WindowBuffers:
    def __init__(
        self,
        req_to_token: torch.Tensor,
        window: int,
        max_slots: int,
        full_to_swa: torch.Tensor | None = None,
        max_accepted: int | None = None,
    ) -> None:
        """`req_to_token` [rows >= max_slots, max_context] and `full_to_swa` [full pool size] are used in place.

        `max_accepted` bounds the tokens one `advance` may add to a row (speculative decoding: steps + 1); it fixes
        the kernel's block size. Defaults to `window`, which is always enough.
        """
        if not isinstance(window, int) or window < 1:
            raise WindowError(f"WindowBuffers: window must be a positive int, got {window!r}")
        if not isinstance(max_slots, int) or max_slots < 1:
            raise WindowError(f"WindowBuffers: max_slots must be a positive int, got {max_slots!r}")
        _check_index_tensor("req_to_token", req_to_token, ndim=2)
        if req_to_token.shape[0] < max_slots:
            raise WindowError(f"WindowBuffers: req_to_token has {req_to_token.shape[0]} rows, fewer than max_slots={max_slots}")
        if req_to_token.stride(1) != 1:
            raise WindowError("WindowBuffers: req_to_token rows must be contiguous (stride(1) == 1)")
        if full_to_swa is not None:
            _check_index_tensor("full_to_swa", full_to_swa, ndim=1)
            if full_to_swa.device != req_to_token.device:
                raise WindowError(f"WindowBuffers: full_to_swa is on {full_to_swa.device}, req_to_token on {req_to_token.device}")
        max_accepted = window if max_accepted is None else max_accepted
        if not isinstance(max_accepted, int) or max_accepted < 1:
            raise WindowError(f"WindowBuffers: max_accepted must be a positive int, got {max_accepted!r}")

        self.req_to_token = req_to_token
        self.full_to_swa = full_to_swa
        self.window = window
        self.max_slots = max_slots
        self.padding_slot = max_slots
        self.max_accepted = max_accepted
        device = req_to_token.device
        self.ring = torch.zeros(max_slots + 1, window, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_slots + 1, dtype=torch.int32, device=device)

    @classmethod
    def from_spec(cls, spec, req_to_token: torch.Tensor, full_to_swa: torch.Tensor | None = None) -> WindowBuffers:
        return cls(req_to_token, spec.window, spec.capture.max_slots, full_to_swa, max_accepted=spec.capture.steps + 1)

    @property
    def device(self) -> torch.device:
        return self.ring.device

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured graph touches through this object (capture marks them static)."""
        out = {"ring": self.ring, "seq_lens": self.seq_lens, "req_to_token": self.req_to_token}
        if self.full_to_swa is not None:
            out["full_to_swa"] = self.full_to_swa
        return out

    def pool_dims(self) -> dict[str, tuple[int, ...]]:
        """The dimensions of `static_tensors` sized by the engine's memory settings, not the model: slot rows (the
        engine's request pool), req_to_token's columns (its context bound), full_to_swa (the full pool). Capture
        compiles them symbolically (graphcap.engine.static_buffers)."""
        out = {"ring": (0,), "seq_lens": (0,), "req_to_token": (0, 1)}
        if self.full_to_swa is not None:
            out["full_to_swa"] = (0,)
        return out

    # -----------------------------------------------------------------------------------------------------------
    def reset(self, slots: IntsLike, seq_lens: IntsLike, checked: bool = True) -> None:
        """Rebuild `slots` from req_to_token with the given lengths (a request joined, was retracted, or lost pages).

        O(min(len, W)) work per slot. `checked` (the default) validates on the host first: slots, lengths and every
        location the windows will hold, from one read-back (one sync on a GPU). `checked=False`, for a caller that
        trusts its lengths and rows (a serving engine's own, rebuilt between its iterations): no read-back, so no sync;
        slots given as host ints are still checked, lengths are clamped to the row on the device, locations are not
        checked.
        """
        slots_t, lens_t = self._as_index(slots, "reset", "slots"), self._as_index(seq_lens, "reset", "seq_lens")
        if slots_t.shape != lens_t.shape:
            raise WindowError(f"reset: {slots_t.numel()} slots but {lens_t.numel()} seq_lens")
        row_len = self.req_to_token.shape[1]
        hi = lens_t.clamp(0, row_len)
        if not checked:
            if not isinstance(slots, torch.Tensor) or slots.device.type == "cpu":  # host ints: checked for free
                host = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
                check_slots(host, self.max_slots, error=WindowError, call="reset")
            if slots_t.numel():
                window_reset(self.ring, self.seq_lens, self.req_to_token, self.full_to_swa, slots_t, hi)
            return
        lo = (hi - self.window).clamp(min=0)
        # One read-back for all the host checks: slots, lengths, the first bad location per row - one sync on a GPU
        # by construction (tests/test_window.py counts it on CUDA). A pinned host tensor given as
        # slots or seq_lens adds a blocking copy each (_as_index).
        s, lens, bad_at, bad_val = torch.stack([slots_t, lens_t, *self._bad_locs(slots_t, lo, hi, self.window)]
                                               ).tolist() if slots_t.numel() else ([], [], [], [])
        check_slots(s, self.max_slots, error=WindowError, call="reset")
        for slot, n in zip(s, lens):
            if not 0 <= n <= row_len:
                raise WindowError(f"reset: seq_len {n} for slot {slot} is outside [0, {row_len}] (req_to_token row length)")
        self._raise_bad_locs("reset", s, bad_at, bad_val)
        if slots_t.numel():
            window_reset(self.ring, self.seq_lens, self.req_to_token, self.full_to_swa, slots_t, lens_t)

    def advance(self, slots: torch.Tensor, accepted: torch.Tensor, checked: bool = False) -> None:
        """The verify step accepted `accepted[i]` tokens for `slots[i]`; their locations are already in
        `req_to_token[slot, seq_len : seq_len + accepted]`. Writes only those into the ring and bumps `seq_lens`.

        Hot path: O(batch x accepted), no allocation, no host sync, capturable. `slots` and `accepted` must be
        integer tensors on the buffers' device. Padding rows use `padding_slot` with `accepted = 0`.
        `checked=True` validates first on the host (syncs): for debugging, never inside a captured graph.
        """
        self._check_advance_static(slots, accepted)  # shapes, dtypes, device: no sync, nothing written yet
        if checked:
            self._check_advance(slots, accepted)
        window_advance(self.ring, self.seq_lens, self.req_to_token, self.full_to_swa, slots, accepted,
                       min(self.max_accepted, self.window))

    def mismatches(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of `slots` (a device tensor), against a rebuild from req_to_token as it is now: how many of the
        window's positions the ring holds differently, and the first such position (newest first; -1 where none).
        On the device, O(rows x W), no sync: for a check mode that reads it back with whatever else it checks."""
        w = self.window
        s = slots.to(self.device, torch.int64)
        lens = self.seq_lens.index_select(0, s).to(torch.int64)
        pos = lens[:, None] - 1 - torch.arange(w, device=self.device)  # [rows, W], newest first
        p = pos.clamp(min=0, max=self.req_to_token.shape[1] - 1)
        rows = s.clamp(max=self.max_slots - 1)[:, None]  # the padding slot has no req_to_token row (length 0)
        want = self.req_to_token[rows, p].to(torch.int64)
        if self.full_to_swa is not None:
            want = self.full_to_swa[want.clamp(0, self.full_to_swa.numel() - 1)].to(torch.int64)
        bad = (pos >= 0) & (self.ring[s[:, None], p % w].to(torch.int64) != want)
        first = torch.where(bad.any(1), pos.gather(1, bad.to(torch.int32).argmax(1, keepdim=True))[:, 0], -1)
        return bad.sum(1), first

    def window_locs(self, slot: int) -> torch.Tensor:
        """The live window of `slot`, oldest to newest, as a CPU tensor (tests and debugging)."""
        if not 0 <= slot <= self.padding_slot:
            raise WindowError(f"window_locs: slot {slot} out of range [0, {self.max_slots}]")
        n = int(self.seq_lens[slot])
        pos = torch.arange(max(0, n - self.window), n)
        return self.ring[slot].cpu()[pos % self.window]

    # -----------------------------------------------------------------------------------------------------------
    def _as_index(self, x: IntsLike, call: str, name: str) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            t = x
        else:
            xs = list(x)
            t = torch.as_tensor(xs) if xs else torch.empty(0, dtype=torch.int64)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise WindowError(f"{call}: {name} must be integers, got dtype {t.dtype}")
        if t.ndim > 1:
            raise WindowError(f"{call}: {name} must be 1-D, got shape {tuple(t.shape)}")
        t = t.reshape(-1).to(torch.int64)
        # From pageable host memory non_blocking stages the copy before returning (safe to reuse the source) without
        # torch's stream sync of a blocking copy; pinned memory keeps the blocking copy (the caller may reuse it).
        return t.to(self.device, non_blocking=t.device.type == "cpu" and not t.is_pinned())

    def _check_advance_static(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        for name, x in (("slots", slots), ("accepted", accepted)):
            if not isinstance(x, torch.Tensor):
                raise WindowError(f"advance: {name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise WindowError(f"advance: {name} must be an integer tensor, got dtype {x.dtype}")
            if x.device != self.device:
                raise WindowError(f"advance: {name} is on {x.device}, the window buffers on {self.device}")
        if slots.ndim != 1 or slots.shape != accepted.shape:
            raise WindowError(f"advance: slots {tuple(slots.shape)} and accepted {tuple(accepted.shape)} must be "
                              "equal 1-D shapes")

    def _bad_locs(self, slots: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, span: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, on the device: the first position p in [lo, hi) (at most `span` of them) whose
        `req_to_token[slot, p]` is not a location of the full pool, and that entry; -1 and 0 where all are valid
        (or without full_to_swa). Slots are clamped for the gather: an out-of-range slot is refused on the host."""
        n = slots.numel()
        if self.full_to_swa is None or n == 0:
            return torch.full_like(slots, -1), torch.zeros_like(slots)
        row_len = self.req_to_token.shape[1]
        rows = slots.clamp(0, self.max_slots - 1)[:, None]
        pos = lo[:, None] + torch.arange(max(1, span), device=slots.device)
        locs = self.req_to_token[rows, pos.clamp(max=row_len - 1)].to(torch.int64)
        bad = (pos < hi[:, None]) & ((locs < 0) | (locs >= self.full_to_swa.numel()))
        j = bad.to(torch.int32).argmax(dim=1, keepdim=True)  # the first True (0 where none: masked below)
        found = bad.any(dim=1)
        return torch.where(found, pos.gather(1, j)[:, 0], -1), torch.where(found, locs.gather(1, j)[:, 0], 0)

    def _raise_bad_locs(self, call: str, slots: list[int], bad_at: list[int], bad_val: list[int]) -> None:
        for slot, p, v in zip(slots, bad_at, bad_val):
            if p >= 0:
                raise WindowError(f"{call}: slot {slot}: req_to_token[{slot}, {p}] = {v} is not a location of the "
                                  f"full pool [0, {self.full_to_swa.numel()})")

    def _check_advance(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        s, a = slots.tolist(), accepted.tolist()
        check_slots(s, self.max_slots, error=WindowError, call="advance", padding=self.padding_slot)
        lens = self.seq_lens.tolist()
        row_len = self.req_to_token.shape[1]
        for slot, n in zip(s, a):
            if n < 0:
                raise WindowError(f"advance: accepted count {n} for slot {slot} is negative")
            if slot == self.padding_slot and n != 0:
                raise WindowError(f"advance: the padding slot {slot} got accepted count {n}; it must be 0")
            if n > self.max_accepted:
                raise WindowError(f"advance: accepted count {n} for slot {slot} exceeds max_accepted={self.max_accepted}")
            if lens[slot] + n > row_len:
                raise WindowError(f"advance: slot {slot} would reach length {lens[slot] + n}, past its req_to_token row "
                                  f"({row_len} positions)")
        lo = self.seq_lens.index_select(0, slots.long()).long()
        bad_at, bad_val = (t.tolist() for t in self._bad_locs(slots.long(), lo, lo + accepted.long(),
                                                               self.max_accepted))
        self._raise_bad_locs("advance", s, bad_at, bad_val)


def check_slots(slots: Sequence[int], limit: int, *, error: type[Exception], call: str, arg: str = "slots",
                padding: int | None = None) -> None:
    """Raise `error("<call>: ...")`, naming the first bad slot of `slots` (the argument `arg`), unless each is in
    [0, limit) and appears once; `padding` (the padding slot), where given, may appear any number of times. The one
    slot check behind WindowBuffers (a WindowError) and DraftGraphs.run's `host_slots` (a CaptureError)."""
    live = slots if padding is None else [s for s in slots if s != padding]
    # The common case in a few C calls: run() checks every batch.
    if not live or (len(set(live)) == len(live) and min(live) >= 0 and max(live) < limit):
        return
    seen: set[int] = set()
    for s in live:
        if not 0 <= s < limit:
            besides = f" (or the padding slot {padding})" if padding is not None else ""
            raise error(f"{call}: slot {s} out of range [0, {limit}){besides} in {arg}")
        if s in seen:
            raise error(f"{call}: slot {s} appears more than once in {arg}")
        seen.add(s)


def _check_index_tensor(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise WindowError(f"WindowBuffers: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim or t.dtype not in (torch.int32, torch.int64):
        raise WindowError(f"WindowBuffers: {name} must be a {ndim}-D int32/int64 tensor, got {t.ndim}-D {t.dtype}")
