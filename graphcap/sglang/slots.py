"""Request lifecycle -> window resets and advances: which sglang request each ring row holds, and the accepted counts
waiting to be applied (`SlotTracker`), over window buffers bound to sglang's request-pool rows (`bind_window`). Host
bookkeeping and device scatters/gathers only; the runtime (`runtime`) calls it once per draft."""
from __future__ import annotations

import torch

from graphcap.sglang.compat import slot_of  # noqa: F401 - re-exported (the hooks and runtime use it)
from graphcap.window import WindowBuffers


def bind_window(req_to_token: torch.Tensor, window: int, full_to_swa: torch.Tensor | None,
                max_accepted: int) -> WindowBuffers:
    """Every request-pool row is a slot; the padding slot is one past them (it needs no req_to_token row)."""
    return WindowBuffers(req_to_token, window, req_to_token.shape[0], full_to_swa, max_accepted=max_accepted)


class SlotTracker:
    """Which request each ring row holds, and the accepted counts waiting to be applied.

    - `on_join(reqs)` (after a prefill), `on_retract(slots)`, `on_evict(slot, ...)`: host bookkeeping only; the rows
      are rebuilt at the next draft, from req_to_token as it is then.
    - `on_accept(req_pool_indices, accept_lens)` (after each verify): device scatter into `pending[slot]`, no sync.
    - each draft: `rebuild(reqs, seq_lens)` (host rows; a rebuilt row's window validated on the host, one sync, only
      where `checked`: sglang's lengths and rows are trusted otherwise, as everywhere on the draft path); the iteration
      `in_iteration` wraps gathers and clears the rows' counts inside its captured graph (no launch outside it), or
      `take_accepted(slots, out)` gathers them on the device for an iteration that takes them as its input.
      `prepare(reqs, seq_lens)` does both for a caller that has no device copy of the rows.
    """

    def __init__(self, window: WindowBuffers, checked: bool = True) -> None:
        self.window, self.checked = window, checked
        self.owner: dict[int, str] = {}  # slot -> rid whose window the ring row holds
        self.stale: set[int] = set()  # rows whose in-window SWA pages were freed
        self.pending = torch.zeros(window.max_slots + 1, dtype=torch.int32, device=window.device)
        self.stats = dict(joins=0, resets=0, retracts=0, evictions_in_window=0, reset_syncs=0)

    def on_join(self, reqs) -> None:
        for r in reqs:
            slot = slot_of(r)
            if slot is not None:
                self.owner.pop(slot, None)
                self.stats["joins"] += 1

    def on_retract(self, slots) -> None:
        for s in slots:
            self.owner.pop(s, None)
            self.stale.discard(s)
            self.stats["retracts"] += 1

    def on_evict(self, slot: int, evicted_upto: int, seq_len: int) -> None:
        """sglang freed SWA pages of `slot` below `evicted_upto`. Its window at the next draft starts at or after
        `max(0, seq_len - W)`; if the freed range reaches into that, the row is rebuilt (normally it never does: sglang
        keeps max(window, draft window) behind each request; a request shorter than the window, frontier 0, has freed
        nothing)."""
        if evicted_upto > max(0, seq_len - self.window.window):
            self.stale.add(slot)
            self.stats["evictions_in_window"] += 1

    def on_accept(self, req_pool_indices: torch.Tensor, accept_lens: torch.Tensor) -> None:
        # index_add_: the sums index_put_(accumulate=True) makes (a row given twice adds twice), no index tuple
        self.pending.index_add_(0, req_pool_indices.to(torch.long), accept_lens.to(torch.int32))

    def rebuild(self, reqs, seq_lens: torch.Tensor, host_slots: list[int] | None = None) -> list[int]:
        """Rebuild the rows whose request is new to them, came back, or lost in-window pages; returns the batch's
        rows as host ints (`host_slots`, where the caller has them). `seq_lens` [B] (device): the lengths now."""
        host_slots = [slot_of(r) for r in reqs] if host_slots is None else host_slots
        rows = [i for i, (s, r) in enumerate(zip(host_slots, reqs)) if self.owner.get(s) != r.rid or s in self.stale]
        if rows:  # checked: WindowBuffers.reset validates on the host first (one read-back: one sync)
            rs = [host_slots[i] for i in rows]
            rows_t = torch.tensor(rows, dtype=torch.int64).to(seq_lens.device, non_blocking=True)
            self.window.reset(rs, seq_lens.index_select(0, rows_t), checked=self.checked)
            rs_t = torch.tensor(rs, dtype=torch.int64).to(self.window.device, non_blocking=True)
            self.pending.index_fill_(0, rs_t, 0)  # the rebuilt length already holds what they accepted
            for s, i in zip(rs, rows):
                self.owner[s] = reqs[i].rid
                self.stale.discard(s)
            self.stats["resets"] += len(rs)
            self.stats["reset_syncs"] += int(self.checked)
        return host_slots

    def take_accepted(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The counts waiting for `slots` (device), then cleared. With `out` (the captured graph's static input) the
        gather writes there: one copy, no temporary."""
        accepted = torch.index_select(self.pending, 0, slots, out=out) if out is not None else \
            self.pending.index_select(0, slots)
        self.pending.index_fill_(0, slots, 0)
        return accepted

    def in_iteration(self, fn) -> TakesPending:
        """`fn` taking the counts waiting for its rows itself (`TakesPending`), for the capture."""
        return TakesPending(fn, self.pending)

    def prepare(self, reqs, seq_lens: torch.Tensor):
        """`rebuild` + `take_accepted` with the rows copied from the host: (slots, accepted, host_slots)."""
        host_slots = self.rebuild(reqs, seq_lens)
        slots = torch.tensor(host_slots, dtype=torch.int64).to(self.window.device, non_blocking=True)
        return slots, self.take_accepted(slots), host_slots


class TakesPending:
    """A draft iteration fn(slots, accepted, tokens, hidden) that adds the counts waiting in `pending` for its rows to
    `accepted` and clears them, inside the call - so inside its captured graph, where an engine would otherwise gather
    and clear them with two launches before each replay. The engine leaves the static accepted rows at 0; padding
    rows read and clear the padding slot's count, which nothing ever adds to. Keeps the iteration's `graph_breaks`
    (graphcap.engine.recording reads it)."""

    def __init__(self, fn, pending: torch.Tensor) -> None:
        self.fn, self.pending = fn, pending
        self.graph_breaks = bool(getattr(fn, "graph_breaks", False))

    def __call__(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor):
        accepted = accepted + self.pending.index_select(0, slots)
        self.pending.index_fill_(0, slots, 0)
        return self.fn(slots, accepted, tokens, hidden)
