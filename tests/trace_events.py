"""A stand-in for CUDA events, for the draft trace's tests on a machine without a GPU."""
from __future__ import annotations


def stand_in_events(monkeypatch, tr, elapsed_ms: float) -> None:
    """CUDA events for the trace on a machine without a GPU: every span `elapsed_ms` long."""
    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return elapsed_ms

    monkeypatch.setattr(tr.torch.cuda, "Event", Event)
    monkeypatch.setattr(tr.torch.cuda, "is_available", lambda: True)  # the stand-in events are the GPU's
