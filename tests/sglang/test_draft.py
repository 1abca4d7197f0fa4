"""The sglang plugin's draft-phase pieces that run in this process: the schedule-batch hooks' logging, and (below)
graphcap's half of a draft iteration. Nothing here imports sglang's scheduler, worker or batch modules (those run in
a fresh interpreter: test_runtime.py)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from bench_scripts import load_file
from tiers import examples
from trace_events import stand_in_events

from graphcap import manifest as mf
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.guards import CaptureError
from graphcap.engine.options import CaptureOptions
from graphcap.sglang import hooks as hooks
from graphcap.sglang.config import sglang_parallel, sglang_tp_rank
from graphcap.sglang.runtime import GraphcapDraftRuntime, SlotTracker, bind_window, capture_graphs, slot_of
from graphcap.sglang.settings import CHECK_ENV, DraftCaptureOptions, PluginSettings
from graphcap.models.draft_loop import DraftOutput

pytestmark = pytest.mark.usefixtures("cpu_twins")  # the plugin's bookkeeping is the point, not the kernels


def _window(device="cpu", rows=6, width=64, window=8, seed=0, max_accepted=4):
    g = torch.Generator().manual_seed(seed)
    r2t = (1 + torch.randperm(rows * width, generator=g)).reshape(rows, width).to(torch.int32)
    f2s = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(rows * width, generator=g)])
    return bind_window(r2t.to(device), window, f2s.to(device), max_accepted=max_accepted)


class _Runtime:  # what the batch hooks need of a GraphcapDraftRuntime
    def __init__(self, tracker):
        self.tracker, self.active = tracker, True


# -----------------------------------------------------------------------------------------------------------------
# Schedule-batch hooks


@pytest.mark.sglang
def test_unreadable_eviction_frontier_warns_once_and_still_resets(monkeypatch, glog):
    """A request whose SWA frontier cannot be read is rebuilt every time (safe), and the user hears about it once,
    at warning level - not at debug level, and not once per request and iteration."""
    pytest.importorskip("sglang", reason="the real sglang package is not installed")  # the hook reads sglang's enum
    monkeypatch.setattr(hooks, "_WARNED", set(), raising=False)  # a fresh process
    tracker = SlotTracker(_window())
    rt = _Runtime(tracker)
    hooks._RUNTIMES.add(rt)
    try:
        calls = []
        batch = SimpleNamespace()
        for i in range(3):
            req = SimpleNamespace(rid=f"r{i}", kv=SimpleNamespace(req_pool_idx=i))  # no get_evicted_seqlen
            hooks.around_evict_swa(lambda b, r, pre_len: calls.append(pre_len), batch, req, 40 + i)
        assert calls == [40, 41, 42]  # sglang's own body ran every time
        assert tracker.stale == {0, 1, 2}  # each row is rebuilt at the next draft
    finally:
        hooks._RUNTIMES.discard(rt)
    warnings = [r for r in glog.records if "eviction frontier" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    msg = warnings[0].getMessage()  # names the request and both layouts it looked for
    assert "r0" in msg and "req.kv.get_evicted_seqlen" in msg and "req.kv.swa_evicted_seqlen" in msg


# -----------------------------------------------------------------------------------------------------------------
# graphcap's half of a draft (GraphcapDraftRuntime.iterate) against the path it replaced


HIDDEN = 3


def _iteration(window):
    """Stands in for the captured draft iteration (sglang's model needs its weights): advances the windows, and its
    outputs depend on every input and on the advanced lengths."""
    def fn(slots, accepted, tokens, hidden):
        window.advance(slots, accepted)
        lens = window.seq_lens.index_select(0, slots).long()
        acc = accepted.float()[:, None].expand(-1, 2)
        return DraftOutput(torch.stack([tokens * 1000 + lens, slots], 1), acc + 0.5, acc - lens.float()[:, None],
                           hidden * 2 + accepted[:, None].to(hidden.dtype))
    return fn


def _example_inputs(window):
    dev = window.device

    def example_inputs(b):
        return (torch.full((b,), window.padding_slot, dtype=torch.int64, device=dev),
                torch.zeros(b, dtype=torch.int32, device=dev), torch.zeros(b, dtype=torch.int64, device=dev),
                torch.zeros(b, HIDDEN, device=dev))
    return example_inputs


def _graphs(window, buckets, tracker: SlotTracker):
    """Captured as the plugin captures: the iteration takes the pending counts itself (`tracker.in_iteration`), and on
    a GPU is recorded as the plugin's default backend records it (a replay runs no Python: `Replay.pure`)."""
    static = {**window.static_tensors(), "pending_accepts": tracker.pending}
    options = CaptureOptions(backend="cudagraph" if window.device.type == "cuda" else "eager", buckets=buckets,
                             manifest_path=None)
    graphs = DraftGraphs(tracker.in_iteration(_iteration(window)), example_inputs=_example_inputs(window),
                         static_tensors=static, padding_slot=window.padding_slot, options=options)
    graphs.capture()
    return graphs


def _runtime(device, buckets=(1, 2, 4), seed=0, steps=3) -> GraphcapDraftRuntime:
    """A runtime at `steps` draft steps: a verify accepts 1..steps + 1 tokens, the window buffers take that many."""
    window = _window(device, rows=8, width=96, window=8, seed=seed, max_accepted=steps + 1)
    rt = GraphcapDraftRuntime(SimpleNamespace(speculative_num_steps=steps), DraftCaptureOptions(enabled=True),
                              window, target_pool=None)
    assert rt.steps == steps
    rt.attach(_graphs(window, buckets, rt.tracker))
    return rt


def _request(layout: str, rid: str, slot: int | None, **extra) -> SimpleNamespace:
    """A request as sglang `layout` keeps its pool row: on `req.kv` (0.5.23) or on the request (0.5.18)."""
    if layout == "0.5.23":
        return SimpleNamespace(rid=rid, kv=SimpleNamespace(req_pool_idx=slot), **extra)
    return SimpleNamespace(rid=rid, req_pool_idx=slot, kv=SimpleNamespace(kv_allocated_len=0, swa_evicted_seqlen=0),
                           **extra)


def _set_slot(req, slot) -> None:
    """Change a request's pool row where its layout keeps it."""
    setattr(req.kv if hasattr(req.kv, "req_pool_idx") else req, "req_pool_idx", slot)


class _Scheduler:
    """Requests join, are retracted, lose in-window pages and are verified with random accepted counts; `batch()` is
    what sglang hands the draft (rows, device lengths, their host mirrors, the seed tokens and hidden states). Each
    request also records what the next draft must apply to its window: `accepted` (summed over the verifies since
    the last draft), or nothing when it is `fresh` (joined or lost in-window pages: the window is rebuilt). Requests
    are laid out as sglang `layout` keeps them."""

    def __init__(self, seed, device, rows=8, width=96, steps=3, layout="0.5.23"):
        self.g = torch.Generator().manual_seed(seed)
        self.device, self.rows, self.width, self.steps, self.layout = device, rows, width, steps, layout
        self.running: dict[int, SimpleNamespace] = {}
        self.next_rid = 0

    def randint(self, lo, hi) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def events(self, trackers):
        free = [s for s in range(self.rows) if s not in self.running]
        if free and (not self.running or self.randint(0, 3) == 0):
            slot = free[self.randint(0, len(free) - 1)]
            req = _request(self.layout, f"r{self.next_rid}", slot, length=self.randint(1, 40), accepted=0,
                           fresh=True)
            self.next_rid += 1
            self.running[slot] = req
            for t in trackers:
                t.on_join([req])
        elif len(self.running) > 1 and self.randint(0, 9) == 0:
            slot = sorted(self.running)[self.randint(0, len(self.running) - 1)]
            del self.running[slot]
            for t in trackers:
                t.on_retract([slot])
        elif self.running and self.randint(0, 9) == 0:
            slot = sorted(self.running)[self.randint(0, len(self.running) - 1)]
            self.running[slot].fresh = True
            for t in trackers:
                t.on_evict(slot, evicted_upto=self.running[slot].length, seq_len=self.running[slot].length)

    def batch(self):
        reqs = list(self.running.values())
        order = torch.randperm(len(reqs), generator=self.g).tolist()
        reqs = [reqs[i] for i in order]
        lens = [r.length for r in reqs]
        dev = self.device
        return SimpleNamespace(
            reqs=reqs, seq_lens=torch.tensor(lens, device=dev), seq_lens_cpu=torch.tensor(lens), seq_lens_sum=sum(lens),
            req_pool_indices=torch.tensor([slot_of(r) for r in reqs], device=dev),
            spec_info=SimpleNamespace(bonus_tokens=torch.randint(0, 500, (len(reqs),), generator=self.g).to(dev),
                                      hidden_states=torch.randn(len(reqs), HIDDEN, generator=self.g).to(dev)))

    def verify(self, batch, trackers):
        acc = [min(self.randint(1, self.steps + 1), self.width - r.length) for r in batch.reqs]
        for r, a in zip(batch.reqs, acc):
            r.length += a
            r.accepted += a
        for t in trackers:
            t.on_accept(batch.req_pool_indices, torch.tensor(acc, dtype=torch.int32, device=self.device))
        for slot in [s for s, r in self.running.items() if r.length + self.steps + 1 > self.width]:
            del self.running[slot]  # finished: the row is free for a new request


def _expected(batch) -> tuple[DraftOutput, list[int]]:
    """What `_iteration` must return for `batch` when each window advanced by exactly what the scheduler says
    (rebuilt rows by nothing), and the row lengths after it: the scheduler's own."""
    acc = torch.tensor([0 if r.fresh else r.accepted for r in batch.reqs], device=batch.seq_lens.device)
    lens = batch.seq_lens.long()
    tokens = torch.stack([batch.spec_info.bonus_tokens * 1000 + lens, batch.req_pool_indices], 1)
    accf = acc.float()[:, None].expand(-1, 2)
    hidden = batch.spec_info.hidden_states
    return DraftOutput(tokens, accf + 0.5, accf - lens.float()[:, None], hidden * 2 + acc[:, None].to(hidden.dtype)), \
        [r.length for r in batch.reqs]


@pytest.mark.parametrize("seed, steps, layout", [(0, 3, "0.5.23"), (1, 1, "0.5.18"), (2, 2, "0.5.23"),
                                                  (3, 1, "0.5.23"), (4, 3, "0.5.18"), (5, 2, "0.5.18")])
def test_iterate_against_the_schedulers_own_account(device, monkeypatch, seed, steps, layout):
    """Random joins, retracts, evictions and accepts, batches from 1 to 8 rows over buckets 1, 2, 4 (padding rows,
    shrinking batches, and oversize batches that run eagerly), at 1, 2 and 3 draft steps (1..steps + 1 accepted per
    verify), requests laid out as sglang 0.5.23 or 0.5.18 keeps them. Each iteration, against what the scheduler
    itself knows: every row's window advanced by the counts accepted since its last draft (rebuilt rows by none), so
    the outputs, each window's length and contents (against a rebuild from req_to_token), the pending counts and the
    manifest's counters per bucket are what they must be."""
    monkeypatch.setenv(CHECK_ENV, "1")  # and the check mode finds nothing wrong on consistent batches
    rt, sched = _runtime(device, seed=seed, steps=steps), _Scheduler(seed, device, steps=steps, layout=layout)
    wb, buckets = rt.window, (1, 2, 4)
    want_counts = {b: [0, 0] for b in buckets}  # bucket -> [replays, padded rows]
    oversize = 0
    sizes = set()
    for _ in range(60):
        sched.events([rt.tracker])
        if not sched.running:
            continue
        batch = sched.batch()
        b = len(batch.reqs)
        sizes.add(b)
        if sched.randint(0, 1):  # the overlap scheduler's batches under the Triton backend: no host lengths
            batch.seq_lens_sum = batch.seq_lens_cpu = None
        want, _ = _expected(batch)
        ours = rt.iterate(batch)
        for name, x, y in zip(DraftOutput._fields, ours, want):
            assert torch.equal(x, y), name
        for r in batch.reqs:
            s, n = slot_of(r), r.length
            assert int(wb.seq_lens[s]) == n
            rebuilt = wb.full_to_swa[wb.req_to_token[s, max(0, n - wb.window):n].long()].cpu()
            assert torch.equal(wb.window_locs(s).cpu(), rebuilt.to(wb.window_locs(s).dtype))
            r.accepted, r.fresh = 0, False
        bucket = next((x for x in buckets if x >= b), None)
        if bucket is None:
            oversize += 1
        else:
            want_counts[bucket][0] += 1
            want_counts[bucket][1] += bucket - b
        sched.verify(batch, [rt.tracker])
        for s, r in sched.running.items():
            if not r.fresh:
                assert int(rt.tracker.pending[s]) == r.accepted
    got = {r.batch_size: [r.replays, r.padded_rows] for r in rt.graphs.buckets}
    assert got == want_counts and rt.graphs.oversize_fallbacks == oversize
    assert all(r.fallbacks == 0 for r in rt.graphs.buckets)
    assert {1, 3}.issubset(sizes) and max(sizes) > 4 and oversize > 0
    st = rt.tracker.stats
    assert st["resets"] >= 3 and st["retracts"] and st["evictions_in_window"]


@pytest.mark.parametrize("buckets", [(1, 2, 4), (1, 2)], ids=["in-bucket", "oversize"])
@pytest.mark.parametrize("corrupt, named", [
    (lambda b: _set_slot(b.reqs[1], slot_of(b.reqs[0])), "appears more than once"),
    (lambda b: _set_slot(b.reqs[0], 8), "slot 8 out of range"),
    (lambda b: _set_slot(b.reqs[0], None), "has no request-pool row"),
    (lambda b: b.__setattr__("req_pool_indices", b.req_pool_indices[:1]), "3 host_slots for a batch of 1"),
    (lambda b: b.__setattr__("req_pool_indices", b.req_pool_indices.float()), "slots has dtype"),
    (lambda b: b.spec_info.__setattr__("hidden_states", b.spec_info.hidden_states.double()), "hidden has dtype"),
    (lambda b: b.spec_info.__setattr__("bonus_tokens", b.spec_info.bonus_tokens[:1]), "tokens has shape"),
])
@pytest.mark.parametrize("layout", ["0.5.23", "0.5.18"])
def test_iterate_refuses_a_bad_batch_before_writing(device, corrupt, named, buckets, layout):
    """iterate checks the batch (DraftGraphs.check_batch: host ints and tensor metadata, no sync) before it writes
    anything - static inputs, windows (rebuilds), pending counts - on the zero-copy path and on run()'s path for a
    batch above the largest bucket alike, whichever layout the requests have."""
    rt, sched = _runtime(device, buckets=buckets), _Scheduler(0, device, layout=layout)
    while len(sched.running) < 3:
        sched.events([rt.tracker])
    batch = sched.batch()
    rt.iterate(batch)  # the rows are built; the next iteration only advances
    sched.verify(batch, [rt.tracker])
    batch = sched.batch()
    assert len(batch.reqs) == 3
    state = lambda: [rt.window.ring, rt.window.seq_lens, rt.tracker.pending,  # noqa: E731
                     *(t for bucket in rt.graphs._buckets for t in bucket.inputs)]
    before = [t.clone() for t in state()]
    corrupt(batch)
    with pytest.raises(CaptureError, match=named):
        rt.iterate(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, state()))


def test_on_accept_sums_the_accepted_counts_per_slot(device):
    """Pending counts are per-slot sums of what each verify accepted, a row given twice in one call counted twice
    (random rows, repeats included), against a plain host sum."""
    g = torch.Generator().manual_seed(5)
    tracker = SlotTracker(_window(device))
    want = [0] * 7
    for _ in range(20):
        idx = torch.randint(0, 6, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        lens = torch.randint(0, 5, idx.shape, generator=g, dtype=torch.int32)
        tracker.on_accept(idx.to(device), lens.to(device))
        for i, n in zip(idx.tolist(), lens.tolist()):
            want[i] += n
    assert tracker.pending.tolist() == want


def test_on_evict_marks_a_row_stale_only_when_freed_pages_reach_its_window():
    """A row is rebuilt when sglang freed SWA pages inside the window the next draft reads: positions [0, upto) freed
    against the window's positions [max(0, seq_len - W), seq_len), intersected as sets (random windows, lengths and
    frontiers, lengths shorter than the window included: a frontier at 0 there frees nothing)."""
    g = torch.Generator().manual_seed(11)
    for _ in range(200):
        w, seq_len = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 120, (1,), generator=g))
        upto = int(torch.randint(0, seq_len + 1, (1,), generator=g)) if torch.rand(1, generator=g) < 0.7 else 0
        tracker = SlotTracker(_window(window=w))
        tracker.on_evict(3, evicted_upto=upto, seq_len=seq_len)
        freed, read = set(range(upto)), set(range(max(0, seq_len - w), seq_len))
        assert (3 in tracker.stale) == bool(freed & read), (w, seq_len, upto)
        assert tracker.stats["evictions_in_window"] == int(bool(freed & read))


def _steady(device, seed=3):
    """A runtime after a few verified iterations, and the next batch sglang would hand it (consistent)."""
    rt, sched = _runtime(device, seed=seed), _Scheduler(seed, device)
    while len(sched.running) < 3:
        sched.events([rt.tracker])
    for _ in range(4):
        batch = sched.batch()
        rt.iterate(batch)
        sched.verify(batch, [rt.tracker])
    return rt, sched


@pytest.mark.gpu
@pytest.mark.parametrize("joins", [False, True], ids=["steady", "a-request-joins"])
def test_a_draft_does_not_sync(joins):
    """On CUDA, under torch's sync debug mode (which raises on a synchronizing call), with no host lengths given (the
    overlap scheduler's batches under the Triton backend): a draft issues no host sync - in a steady batch, and when
    a request joins and its row is rebuilt (outside the check mode sglang's lengths and rows are trusted); every row's
    window then equals a rebuild from req_to_token at the scheduler's length."""
    rt, sched = _steady("cuda")
    if joins:
        free = [s for s in range(sched.rows) if s not in sched.running]
        req = _request(sched.layout, "joined", free[0], length=17, accepted=0, fresh=True)
        sched.running[free[0]] = req
        rt.tracker.on_join([req])
    batch = sched.batch()  # built outside: the scheduler's own host-to-device copies are not graphcap's
    batch.seq_lens_sum = batch.seq_lens_cpu = None
    resets = rt.tracker.stats["resets"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rt.iterate(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rt.tracker.stats["resets"] - resets == int(joins) and rt.tracker.stats["reset_syncs"] == 0
    wb = rt.window
    for r in batch.reqs:
        s, n = slot_of(r), r.length
        assert int(wb.seq_lens[s]) == n
        rebuilt = wb.full_to_swa[wb.req_to_token[s, max(0, n - wb.window):n].long()].cpu()
        assert torch.equal(wb.window_locs(s).cpu(), rebuilt.to(wb.window_locs(s).dtype))


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0] += 1
    return t


@pytest.mark.parametrize("corrupt, named", [
    (lambda b: setattr(b, "seq_lens_sum", b.seq_lens_sum + 1),
     [r"batch\.seq_lens_sum (\d+) != sum\(batch\.seq_lens\) = (\d+)"]),
    (lambda b: (setattr(b, "seq_lens_sum", None), setattr(b, "seq_lens_cpu", _plus_one(b.seq_lens_cpu))),
     [r"batch\.seq_lens_cpu \[.*\] != batch\.seq_lens \["]),
    (lambda b: setattr(b, "req_pool_indices", b.req_pool_indices.flip(0)),
     [r"batch\.req_pool_indices \[.*\] != the requests' req_pool_idx \[", r"graphcap's window lengths"]),
    (lambda b: setattr(b, "seq_lens", _plus_one(b.seq_lens)),  # sglang's lengths ahead of what the verify reported
     [r"graphcap's window lengths \[.*\] != batch\.seq_lens", r"batch\.seq_lens_cpu", r"seq_lens_sum"]),
])
def test_check_mode_names_what_disagrees(device, monkeypatch, corrupt, named):
    """GRAPHCAP_SGLANG_CHECK=1 checks every length graphcap hands on to sglang (seq_lens_sum, seq_lens_cpu) and the
    rows it replayed against batch.seq_lens / the requests, not only the window lengths; off, it checks nothing."""
    monkeypatch.setenv(CHECK_ENV, "1")  # read when the runtime is made
    rt, sched = _steady(device)
    batch = sched.batch()
    corrupt(batch)
    with pytest.raises(RuntimeError, match=CHECK_ENV) as e:
        rt.iterate(batch)
    for pattern in named:
        assert re.search(pattern, str(e.value)), (pattern, str(e.value))


def test_check_mode_names_a_ring_row_that_went_stale(device, monkeypatch):
    """sglang moves a token that graphcap's ring already holds (a location rewritten in req_to_token without any of
    the events graphcap follows): the check mode's comparison against a rebuild names the row and the position."""
    monkeypatch.setenv(CHECK_ENV, "1")
    rt, sched = _steady(device)
    batch = sched.batch()
    i = next(i for i, r in enumerate(batch.reqs) if r.length >= 7)
    row, pos = slot_of(batch.reqs[i]), batch.reqs[i].length - 6  # held since an earlier draft (<= 4 accepted since)
    rt.window.req_to_token[row, pos] += 1
    with pytest.raises(RuntimeError, match=CHECK_ENV) as e:
        rt.iterate(batch)
    assert f"row {row}: 1 positions, the newest at {pos}" in str(e.value), str(e.value)


@pytest.mark.parametrize("given", ["both", "seq_lens_cpu", "none"])
def test_check_mode_passes_whatever_host_lengths_sglang_gives(device, monkeypatch, given):
    monkeypatch.setenv(CHECK_ENV, "1")
    rt, sched = _steady(device)
    batch = sched.batch()
    if given != "both":
        batch.seq_lens_sum = None
    if given == "none":
        batch.seq_lens_cpu = None
    rt.iterate(batch)  # consistent: the check finds nothing (the outputs: test_iterate_against_the_schedulers_...)


def test_check_mode_off_trusts_sglang(device, monkeypatch):
    monkeypatch.delenv(CHECK_ENV, raising=False)
    rt, sched = _steady(device)
    batch = sched.batch()
    batch.seq_lens_sum += 1
    rt.iterate(batch)  # not checked: the check is a debugging aid (it syncs)


# -----------------------------------------------------------------------------------------------------------------
# The manifest under tensor (and data) parallelism: every process writes its own


def _ranks(tp_rank: int, tp_size: int, dp_rank: int | None = None, dp_size: int = 1) -> dict:
    """A manifest's `parallel` field as the file should hold it."""
    return dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, dp_rank=dp_rank, dp_size=dp_size)


def _capture(window, directory, **kw) -> DraftGraphs:
    return capture_graphs(window, _iteration(window), buckets=[1, 2], example_inputs=_example_inputs(window),
                          static_tensors=window.static_tensors(), backend="eager", manifest_dir=str(directory),
                          name="sglang-test", steps=3, **kw)


def _written(directory) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(Path(directory).iterdir())}


@pytest.mark.parametrize("published, name, recorded", [
    (None, "sglang-test-w8-s3-eager.json", None),  # a process sglang set up no ranks in: the name a single GPU has
    (dict(tp_rank=0, tp_size=1), "sglang-test-w8-s3-eager.json", _ranks(0, 1)),  # one GPU: the name unchanged
    (dict(tp_rank=0, tp_size=2), "sglang-test-w8-s3-eager-tp0.json", _ranks(0, 2)),
    (dict(tp_rank=3, tp_size=4), "sglang-test-w8-s3-eager-tp3.json", _ranks(3, 4)),
    (dict(tp_rank=1, tp_size=2, dp_rank=1, dp_size=2), "sglang-test-w8-s3-eager-dp1-tp1.json", _ranks(1, 2, 1, 2)),
])
def test_every_rank_writes_its_own_manifest(tmp_path, published, name, recorded):
    """Every process captures and writes a file of its own, named and stamped with the ranks sglang 0.5.23's runtime
    context gives it (set here with sglang's own `get_parallel().override`)."""
    pytest.importorskip("sglang", reason="the real sglang package is not installed")
    from sglang.srt.runtime_context import get_parallel

    window = _window()
    with get_parallel().override(**published) if published else contextlib.nullcontext():
        assert sglang_tp_rank() == (published or {}).get("tp_rank")
        graphs = _capture(window, tmp_path)
    graphs.run(*_example_inputs(window)(2))
    graphs.flush()
    written = _written(tmp_path)
    assert list(written) == [name]
    assert written[name]["parallel"] == recorded
    assert [(b["batch_size"], b["status"], b["replays"]) for b in written[name]["buckets"]] == [
        (1, "captured", 0), (2, "captured", 1)]
    assert sglang_tp_rank(SimpleNamespace(tp_rank=2)) == 2  # a worker that carries its rank (older sglang layouts)


def _parallel_state_0518():
    """sglang 0.5.18's own ParallelState (what its workers carry as `ps`), loaded from its file: a module of plain
    dataclasses, so it loads beside the venv's sglang 0.5.23."""
    root = Path(os.environ.get("GRAPHCAP_SGLANG_0518") or Path(sys.prefix) / "sglang-0518")
    path = root / "sglang" / "srt" / "distributed" / "parallel_state_wrapper.py"
    if not path.exists():
        pytest.skip(f"sglang 0.5.18 is not installed at {root} (make venv)")
    return load_file(path, "graphcap_test_parallel_state_0518").ParallelState


@pytest.mark.parametrize("ps, name, recorded", [
    (dict(), "sglang-test-w8-s3-eager.json", _ranks(0, 1, 0, 1)),  # ParallelState.trivial(): one GPU
    (dict(tp_rank=1, tp_size=2, dp_rank=None), "sglang-test-w8-s3-eager-tp1.json", _ranks(1, 2)),
    (dict(tp_rank=0, tp_size=2, dp_rank=1, dp_size=2), "sglang-test-w8-s3-eager-dp1-tp0.json", _ranks(0, 2, 1, 2)),
])
def test_sglang_0518_workers_give_their_ranks_and_replica(tmp_path, ps, name, recorded):
    """sglang 0.5.18 keeps the data-parallel replica on the worker only (`worker.ps.dp_rank`; its runtime context has
    no `dp_rank`): the worker's ranks win over the runtime context's."""
    pytest.importorskip("sglang", reason="the real sglang package is not installed")
    from sglang.srt.runtime_context import get_parallel

    worker = SimpleNamespace(ps=_parallel_state_0518().trivial(**ps))
    window = _window()
    with get_parallel().override(tp_rank=3, tp_size=4):  # another layout in the context: not what is read
        parallel = sglang_parallel(worker)
    _capture(window, tmp_path, parallel=parallel)
    assert {k: v["parallel"] for k, v in _written(tmp_path).items()} == {name: recorded}


def test_ranks_that_do_not_fit_their_sizes_warn_and_keep_the_single_name(glog):
    worker = SimpleNamespace(ps=SimpleNamespace(tp_rank=2, tp_size=2, pp_rank=0, pp_size=1, dp_rank=None, dp_size=1))
    assert sglang_parallel(worker) is None
    assert any("tp_rank 2 is not below tp_size 2" in r.getMessage() for r in glog.records if r.levelname == "WARNING")


def test_two_ranks_capture_and_inspect_shows_them_side_by_side(tmp_path, monkeypatch, capsys):
    """Two fake TP ranks in one process, each with its own window and graphs: each writes its file (its exit flush
    brings its counters), and `graphcap inspect` over the directory shows both ranks agreeing; a bucket that then
    fails on rank 1 only (the file as a failed capture writes it) is named as a disagreement."""
    pytest.importorskip("sglang", reason="the real sglang package is not installed")
    from sglang.srt.runtime_context import get_parallel

    from graphcap.cli import main
    from graphcap.sglang import runtime as sglang_runtime

    registered, ranks = [], []
    monkeypatch.setattr(sglang_runtime.atexit, "register", lambda fn, *a: registered.append((fn, a)))
    for rank, batches in ((0, (2, 1)), (1, (2, 2, 2))):
        window = _window(seed=rank)
        with get_parallel().override(tp_rank=rank, tp_size=2):
            ranks.append(_capture(window, tmp_path))  # kept: the exit flush holds its graphs weakly
        for b in batches:
            ranks[-1].run(*_example_inputs(window)(b))
    assert len(registered) == 2  # every rank flushes its own file at exit
    for fn, args in registered:
        fn(*args)
    written = _written(tmp_path)
    tp0, tp1 = "sglang-test-w8-s3-eager-tp0.json", "sglang-test-w8-s3-eager-tp1.json"
    assert list(written) == [tp0, tp1]
    assert [written[n]["parallel"] for n in (tp0, tp1)] == [_ranks(0, 2), _ranks(1, 2)]
    assert [[b["replays"] for b in written[n]["buckets"]] for n in (tp0, tp1)] == [[1, 1], [0, 3]]
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sglang-test (spec w8-s3), backend eager: tensor parallel 2, manifests of 2 of 2 "
                          "ranks\n")
    assert "ranks agree: every rank has buckets 1, 2, each with the same status" in out
    written[tp1]["buckets"][1].update(status="failed", reason="OutOfMemoryError: CUDA out of memory")
    (tmp_path / tp1).write_text(json.dumps(written[tp1]))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ranks disagree:\n  bucket 2: captured on tp0; failed on tp1\n" in out


@pytest.mark.parametrize("rank", [0, 1])
def test_plugin_logs_the_capture_and_registers_its_own_exit_flush(tmp_path, monkeypatch, glog, rank):
    """The library prints nothing and registers no exit hook; the plugin logs the summary (graphcap.sglang) and, on
    every rank, registers the flush that brings the last counters to that rank's file at exit."""
    from graphcap.sglang import runtime as sglang_runtime

    registered = []
    monkeypatch.setattr(sglang_runtime.atexit, "register", lambda fn, *a: registered.append((fn, a)))
    window = _window()
    graphs = _capture(window, tmp_path, parallel=mf.Parallel(tp_rank=rank, tp_size=2))
    summaries = [r.getMessage() for r in glog.records if r.name == "graphcap.sglang" and "captured 2/2" in r.getMessage()]
    assert len(summaries) == 1 and f"sglang-test-w8-s3-eager-tp{rank}.json" in summaries[0]
    assert len(registered) == 1
    graphs.run(*_example_inputs(window)(2))
    fn, args = registered[0]
    fn(*args)  # what the interpreter does at exit
    written = _written(tmp_path)
    assert list(written) == [f"sglang-test-w8-s3-eager-tp{rank}.json"]
    assert [b["replays"] for b in next(iter(written.values()))["buckets"]] == [0, 1]


def test_the_runtime_takes_its_settings_once_from_the_environment(device, monkeypatch):
    """GRAPHCAP_SGLANG_CHECK and GRAPHCAP_MANIFEST_FLUSH_S reach the runtime through the process's settings, read
    when the runtime is made; settings given to it win."""
    monkeypatch.setenv(CHECK_ENV, "1")
    monkeypatch.setenv("GRAPHCAP_MANIFEST_FLUSH_S", "0.5")
    rt = GraphcapDraftRuntime(SimpleNamespace(speculative_num_steps=3), DraftCaptureOptions(enabled=True), _window(),
                              target_pool=None)
    assert rt.check and rt.tracker.checked and rt.settings.manifest_flush_s == 0.5
    monkeypatch.setenv(CHECK_ENV, "0")  # later changes do not reach a runtime already made
    assert rt.check
    given = GraphcapDraftRuntime(SimpleNamespace(speculative_num_steps=3), DraftCaptureOptions(enabled=True),
                                 _window(), target_pool=None, settings=PluginSettings())
    assert not given.check and given.settings.manifest_flush_s == 10.0


def test_the_manifest_flush_interval_reaches_the_capture(tmp_path):
    graphs = _capture(_window(), tmp_path, flush_every_s=0.0, parallel=mf.Parallel(tp_rank=0, tp_size=1))
    assert graphs.options.flush_every_s == 0.0 and graphs._flush_every_s == 0.0


def test_trace_profiles_a_few_warm_draft_calls_per_listed_batch_and_records_prefills(tmp_path, monkeypatch):
    """GRAPHCAP_SGLANG_TRACE_PROFILE: at each listed batch size, draft calls PROFILE_SKIP .. +PROFILE_CALLS are
    profiled (their records flagged, as a profiled call pays a sync); the kernel table is the per-call mean of what
    the profiler saw, copies left out; other batch sizes are never profiled. CUDA events and the profiler are
    stand-ins here (no GPU)."""
    import json
    from types import SimpleNamespace

    from graphcap.sglang import trace as tr

    stand_in_events(monkeypatch, tr, 1.5)
    cuda, cpu = tr.torch.autograd.DeviceType.CUDA, tr.torch.autograd.DeviceType.CPU
    opened = []

    class Profiler:
        def __enter__(self):
            opened.append(self)

        def __exit__(self, *a):
            pass

        def events(self):
            k = len(opened)  # a different amount per call: the table must be the mean
            return [SimpleNamespace(name="gemm", device_type=cuda, device_time=10.0 * k),
                    SimpleNamespace(name="gemm", device_type=cuda, device_time=10.0 * k),
                    SimpleNamespace(name="topk", device_type=cuda, device_time=3.0),
                    SimpleNamespace(name="Memcpy HtoD", device_type=cuda, device_time=99.0),
                    SimpleNamespace(name="aten::mm", device_type=cpu, device_time=0.0)]

    trace = tr.DraftTrace(str(tmp_path), flush_every=1000, profile_batches=(2,), profiler=Profiler)

    def draft(worker, batch):
        return SimpleNamespace(draft_token=tr.torch.arange(len(batch.reqs) * 4))

    rng = random.Random(5)

    def batch(n, idle=False, extend=False):  # a server's decode batch: no host copy of seq_lens, the requests
        # know their lengths
        return SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: idle, is_extend=lambda: extend),
                               seq_lens_cpu=None,
                               reqs=[SimpleNamespace(rid=f"r{i}", seqlen=rng.randint(1, 9000)) for i in range(n)],
                               extend_num_tokens=rng.randint(1, 8192), prefix_lens=[rng.randint(0, 4096)] * n)

    seeds, want_prefills = [], []
    for k in range(tr.PROFILE_SKIP + tr.PROFILE_CALLS + 3):
        b2 = batch(2)
        trace.around_draft(draft, None, b2)
        assert trace.pending[-1][1] == [r.seqlen for r in b2.reqs]
        if k % 2 == 1:  # an iteration between two draft calls: a prefill batch's is recorded, the result returned
            p = batch(k % 3 + 1, idle=k == 9, extend=k not in (7, 9))
            seeds.append(trace.around_iteration(lambda w, b, *a: ("out", b), None, p, "publish"))
            assert seeds[-1] == ("out", p)
            if k not in (7, 9):  # a decode or idle iteration is no prefill
                want_prefills.append(([r.rid for r in p.reqs], p.extend_num_tokens, sum(p.prefix_lens)))
        trace.around_draft(draft, None, batch(3))
    trace.flush()
    records = [json.loads(line) for line in open(trace.path)]
    prefills = [json.loads(line) for line in open(trace.prefill_path)]
    assert [(r["rids"], r["extend_tokens"], r["cached_tokens"]) for r in prefills] == want_prefills
    assert all(r["gpu_ms"] == 1.5 and r["host_ms"] >= 0 and "kernel_ms" not in r for r in prefills)
    assert len(prefills) <= tr.PROFILE_SKIP  # none profiled yet (test below)
    # each prefill lies between the two draft calls it was recorded between, on the draft records' clock
    two = [r["t"] for r in records if len(r["rids"]) == 2]
    three = [r["t"] for r in records if len(r["rids"]) == 3]
    assert all(any(a < p["t"] < b for a, b in zip(two, three)) for p in prefills)
    flagged = [i for i, r in enumerate(x for x in records if len(x["rids"]) == 2) if r.get("profiled")]
    assert flagged == list(range(tr.PROFILE_SKIP, tr.PROFILE_SKIP + tr.PROFILE_CALLS))
    assert not any(r.get("profiled") for r in records if len(r["rids"]) == 3)
    assert len(opened) == tr.PROFILE_CALLS
    (path,) = tmp_path.glob("draft-profile-*-b2.json")
    table = json.loads(path.read_text())
    n = tr.PROFILE_CALLS
    gemm = 2 * 10.0 * sum(range(1, n + 1)) / n
    assert table["kernels"] == [{"name": "gemm", "launches_per_draft": 2.0, "us_per_draft": gemm},
                                {"name": "topk", "launches_per_draft": 1.0, "us_per_draft": 3.0}]
    assert table["gpu_us_per_draft"] == gemm + 3.0 and table["launches_per_draft"] == 3.0


def test_trace_profiles_a_few_prefill_batches_when_profiling(tmp_path, monkeypatch):
    """With profiled batch sizes, prefill batches PROFILE_SKIP + 1 .. + PROFILE_CALLS are profiled: their records
    carry the kernels' summed GPU time (copies left out) and launches beside the GPU span, and are flagged; without
    any, no prefill is. Stand-in events (a GPU span of 4 ms) and profiler."""
    import json
    from types import SimpleNamespace

    from graphcap.sglang import trace as tr

    stand_in_events(monkeypatch, tr, 4.0)
    cuda = tr.torch.autograd.DeviceType.CUDA

    class Profiler:
        def __enter__(self):
            pass

        def __exit__(self, *a):
            pass

        def events(self):
            return [SimpleNamespace(name="int8_mm", device_type=cuda, device_time=1500.0),
                    SimpleNamespace(name="norm", device_type=cuda, device_time=250.0),
                    SimpleNamespace(name="Memset", device_type=cuda, device_time=99.0)]

    extend = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False, is_extend=lambda: True),
                             reqs=[SimpleNamespace(rid="a")], extend_num_tokens=200, prefix_lens=[64])
    for batches, want in (((8,), list(range(tr.PROFILE_SKIP, tr.PROFILE_SKIP + tr.PROFILE_CALLS))), ((), [])):
        d = tmp_path / str(len(batches))
        trace = tr.DraftTrace(str(d), flush_every=4, profile_batches=batches, profiler=Profiler)
        for _ in range(tr.PROFILE_SKIP + tr.PROFILE_CALLS + 3):
            trace.around_iteration(lambda w, b: None, None, extend)
        trace.flush()
        recs = [json.loads(line) for line in open(trace.prefill_path)]
        assert len(recs) == tr.PROFILE_SKIP + tr.PROFILE_CALLS + 3 and all(r["gpu_ms"] == 4.0 for r in recs)
        assert [i for i, r in enumerate(recs) if r.get("profiled")] == want
        assert all((r["kernel_ms"], r["launches"]) == (1.75, 2) for r in recs if r.get("profiled"))
        assert not any("kernel_ms" in r for r in recs if not r.get("profiled"))


@settings(max_examples=examples(40), deadline=None)
@given(depths=st.lists(st.integers(1, 3), min_size=1, max_size=8), extend=st.lists(st.booleans(), min_size=8,
                                                                                  max_size=8))
def test_trace_records_the_outermost_iteration_once(tmp_path_factory, depths, extend):
    """The trace wraps the speculative worker's iteration and the target worker's forward: inside a speculative
    iteration the target's forward (and anything nested deeper) passes through, so each prefill batch is recorded
    once, by the outermost iteration, whatever the nesting; a no-speculation server's forward is the outermost and is
    recorded; a call with no batch (sglang passes a ForwardBatch instead) passes through. Checked against a plain
    count of the outermost extend calls."""
    from graphcap.sglang import trace as tr

    trace = tr.DraftTrace(str(tmp_path_factory.mktemp("t")), flush_every=1000)
    calls = []

    def batch(i: int, ext: bool):
        return SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False, is_extend=lambda: ext),
                               reqs=[SimpleNamespace(rid=f"r{i}")], extend_num_tokens=10 + i, prefix_lens=[i])

    def nest(depth: int, b):  # an iteration whose body runs `depth - 1` nested ones (the same batch)
        def body(worker, bb, *a):
            calls.append(depth)
            assert trace._in_iteration  # inside: a nested one is part of it
            return nest(depth - 1, bb) if depth > 1 else ("out", bb)
        return trace.around_iteration(body, None, b)

    want = []
    for i, depth in enumerate(depths):
        b = batch(i, extend[i])
        assert nest(depth, b) == ("out", b)
        assert not trace._in_iteration
        assert trace.around_iteration(lambda w, bb, **kw: ("none", bb, kw), None, None, forward_batch=1) == (
            "none", None, {"forward_batch": 1})
        if extend[i]:
            want.append(([f"r{i}"], 10 + i, i))
    assert sorted(calls) == sorted(d for depth in depths for d in range(1, depth + 1))
    trace.flush()
    recs = [json.loads(line) for line in open(trace.prefill_path)] if os.path.exists(trace.prefill_path) else []
    assert [(r["rids"], r["extend_tokens"], r["cached_tokens"]) for r in recs] == want


def test_the_trace_takes_its_settings(tmp_path):
    pytest.importorskip("sglang", reason="the real sglang package is not installed")
    from sglang.srt.plugins.hook_registry import HookRegistry

    from graphcap.sglang import trace as sglang_trace

    settings = PluginSettings(trace_dir=str(tmp_path / "trace"), trace_flush=3, trace_profile=(8, 64))
    target = "sglang.srt.managers.scheduler.Scheduler.does_not_matter"
    seed = "sglang.srt.managers.scheduler.Scheduler.nor_this"
    try:
        trace = sglang_trace.install(settings, target, (seed, seed + "_too"))
        hooked = {t: list(HookRegistry._hooks.get(t, ())) for t in (target, seed, seed + "_too")}
    finally:
        for t in (target, seed, seed + "_too"):
            HookRegistry._hooks.pop(t, None)
    assert (trace.directory, trace.flush_every, sorted(trace._seen)) == (str(tmp_path / "trace"), 3, [8, 64])
    assert all(len(v) == 1 for v in hooked.values()), hooked
    with pytest.raises(ValueError, match=r"no trace directory \(\$GRAPHCAP_SGLANG_TRACE\)"):
        sglang_trace.install(PluginSettings(), target)


class _NoLaunch:
    """A recorded graph's stand-in on CPU: a replay that runs no Python of the iteration."""

    def replay(self) -> None:
        pass


def test_forward_context_only_where_the_replay_runs_python(device):
    """sglang's forward context (what the iteration's Python reads) is entered around a replay that runs the
    function - a bucket without a recorded graph, a batch above the largest bucket - and not around a recorded
    graph's replay, which runs none of it."""
    rt, sched = _steady(device)
    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(1)
        yield

    rt.loop = SimpleNamespace(context=context)
    batch = sched.batch()
    rt.iterate(batch)
    assert len(entered) == (0 if device == "cuda" else 1)  # cudagraph on a GPU, the eager backend on a CPU
    for b in rt.graphs.buckets:
        bucket = rt.graphs.bucket_graph(b.batch_size)
        bucket.graph, bucket.outputs = _NoLaunch(), bucket.outputs or _iteration(rt.window)(*bucket.inputs)
        bucket.views.clear()
    rt.graphs._replays.clear()  # handles are made after capture: these buckets now replay a graph
    entered.clear()
    rt.iterate(batch)
    assert entered == []
    while len(sched.running) < 5:
        sched.events([rt.tracker])
    big = sched.batch()
    assert len(big.reqs) > rt.max_bucket
    rt.iterate(big)
    assert entered == [1]
