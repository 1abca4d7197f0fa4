"""The sglang plugin's draft-phase pieces that run in this process: the schedule-batch hooks' logging, and (below)
graphcap's half of a draft iteration. Nothing here imports sglang's scheduler, worker or batch modules (those run in
a fresh interpreter: test_sglang_runtime.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from graphcap.integrations import sglang_hooks as hooks
from graphcap.integrations.sglang_runtime import SlotTracker, bind_window


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def glog():
    """graphcap's log records (a handler of its own: sglang's argument parsing may re-configure the root logger)."""
    h = _Records()
    logger = logging.getLogger("graphcap")
    logger.addHandler(h)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield h
    logger.removeHandler(h)
    logger.setLevel(old)


def _window(device="cpu", rows=6, width=64, window=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r2t = (1 + torch.randperm(rows * width, generator=g)).reshape(rows, width).to(torch.int32)
    f2s = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(rows * width, generator=g)])
    return bind_window(r2t.to(device), window, f2s.to(device), max_accepted=4)


class _Runtime:  # what the batch hooks need of a GraphcapDraftRuntime
    def __init__(self, tracker):
        self.tracker, self.active = tracker, True


# -----------------------------------------------------------------------------------------------------------------
# Schedule-batch hooks


def test_unreadable_eviction_frontier_warns_once_and_still_resets(monkeypatch, glog):
    """A request whose SWA frontier cannot be read is rebuilt every time (safe), and the user hears about it once,
    at warning level - not at debug level, and not once per request and iteration."""
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
    assert "r0" in warnings[0].getMessage() and "AttributeError" in warnings[0].getMessage()
