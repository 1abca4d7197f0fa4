"""The scheduler's host sampler (graphcap.sglang.host_samples) and the trace's phases for it: time credited per phase
and per function against a plain sum of the same steps, on a real thread parked at a known stack."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from graphcap.sglang import host_samples as hs


class Parked:
    """A thread parked in outer_fn -> recurse(depth) -> inner_fn until released: a live stack to sample."""

    def __init__(self, depth: int = 3) -> None:
        self.release = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.outer_fn, args=(depth,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def outer_fn(self, depth: int) -> None:
        self.recurse(depth)

    def recurse(self, depth: int) -> None:
        if depth:
            self.recurse(depth - 1)
        else:
            self.inner_fn()

    def inner_fn(self) -> None:
        self.ready.set()
        self.release.wait(30)

    def stop(self) -> None:
        self.release.set()
        self.thread.join(10)


def _key(table: dict, name: str) -> float:
    (value,) = [v for k, v in table.items() if k.endswith(":" + name) or k.endswith("." + name)]
    return value


@settings(max_examples=examples(40), deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(hs.PHASES), st.floats(0.0, 0.5)), min_size=1, max_size=30),
       flush_at=st.integers(0, 30))
def test_time_is_credited_per_phase_and_function_as_a_plain_sum(tmp_path_factory, steps, flush_at):
    """Each sample credits the clock's advance since the previous one (capped at 100 intervals) to the phase then set;
    every function on the parked stack gets it once (recursion counted once), the innermost line gets it as its own;
    flushes split nothing: the file read back sums to the same."""
    path = str(tmp_path_factory.mktemp("samples") / "s.jsonl")
    parked = Parked(depth=3)
    now = [100.0]
    try:
        sampler = hs.HostSampler(path, 0.001, clock=lambda: now[0])
        sampler.thread_id = parked.thread.ident
        want: dict[str, float] = {}
        n_samples = 0
        for i, (phase, dt) in enumerate(steps):
            sampler.phase = phase
            before = now[0]
            now[0] += dt
            advance = now[0] - before  # what the clock moved: a tiny dt may not move it at all
            sampler.sample()
            if advance > 0:
                want[phase] = want.get(phase, 0.0) + min(advance, 0.1) * 1e3
                n_samples += 1
            if i == flush_at:
                sampler.flush()
        sampler.flush()
    finally:
        parked.stop()
    if not want:
        return
    got = hs.read(path)
    assert got["samples"] == n_samples
    assert set(got["phases"]) == set(want)
    for phase, ms in want.items():
        d = got["phases"][phase]
        assert abs(d["ms"] - ms) < 1e-2
        for fn in ("outer_fn", "recurse", "inner_fn"):
            assert abs(_key(d["inclusive"], fn) - ms) < 1e-2, fn
        (own,) = d["own"].items()  # parked: one innermost line, in threading's wait
        assert "threading.py" in own[0] and abs(own[1] - ms) < 1e-2
        rows = hs.top(got, phase)
        assert rows[0][1] == max(v for _, v, _ in rows) and all(0 < share <= 1.0 + 1e-9 for *_, share in rows)


def test_no_stack_and_no_time_credit_nothing(tmp_path):
    """A thread that is gone (or none chosen) and a clock that did not move add no sample; flushing nothing writes
    nothing."""
    now = [5.0]
    sampler = hs.HostSampler(str(tmp_path / "s.jsonl"), 0.001, clock=lambda: now[0], frames=lambda: {})
    now[0] += 0.01
    sampler.sample()
    sampler.thread_id = None
    sampler.sample()
    sampler.flush()
    assert sampler.samples == 0 and not (tmp_path / "s.jsonl").exists()


def test_the_thread_samples_a_busy_thread_where_it_spins(tmp_path):
    """Started for real at 1 ms: a thread spinning in one function for 0.3 s under 'prefill' is where most of that
    phase's time goes; stop() flushes it to the file."""
    path = str(tmp_path / "s.jsonl")
    done = threading.Event()
    started = threading.Event()

    def spin_here() -> None:
        started.set()
        end = time.perf_counter() + 0.3
        x = 0
        while time.perf_counter() < end:
            x += 1
        done.set()

    worker = threading.Thread(target=spin_here, daemon=True)
    sampler = hs.HostSampler(path, 0.001)
    sampler.phase = "prefill"
    worker.start()
    started.wait(10)
    sampler.thread_id = worker.ident
    sampler.start()
    done.wait(10)
    worker.join(10)
    sampler.stop()
    got = hs.read(path)
    prefill = got["phases"]["prefill"]
    assert prefill["ms"] > 50
    assert _key(prefill["inclusive"], "spin_here") / prefill["ms"] > 0.5


def test_frame_keys_read_the_same_on_every_machine(monkeypatch):
    """Paths are cut below their import root (the longest sys.path entry holding them), so two machines' files
    merge; a path under no root stays whole."""
    class Code:  # hashable, as a code object is (frame_key caches by code and line)
        co_qualname, co_name = "Q.f", "f"

        def __init__(self, path):
            self.co_filename = path

    def frame(path):
        return SimpleNamespace(f_code=Code(path), f_lineno=7)

    roots = ["", "/usr/lib/python3/dist-packages", "/tmp/site", "/w/r", "/w/r/tests/support"]
    monkeypatch.setattr(hs.sys, "path", roots)
    assert hs.frame_key(frame("/usr/lib/python3/dist-packages/sglang/srt/x.py")) == ("sglang/srt/x.py:Q.f",
                                                                                    "sglang/srt/x.py:7 Q.f")
    assert hs.frame_key(frame("/tmp/site/sglang/srt/y.py"))[0] == "sglang/srt/y.py:Q.f"
    assert hs.frame_key(frame("/w/r/graphcap/sglang/trace.py"))[0] == "graphcap/sglang/trace.py:Q.f"
    assert hs.frame_key(frame("/w/r/tests/support/sgl_kernel/int8_gemm.py"))[0] == "sgl_kernel/int8_gemm.py:Q.f"
    assert hs.frame_key(frame("/tmp/sitex/a.py"))[0] == "/tmp/sitex/a.py:Q.f"  # a prefix, not a root


def test_the_trace_tells_the_sampler_each_iterations_phase(tmp_path, monkeypatch):
    """Inside a prefill iteration the sampler's phase is 'prefill', inside a decode one 'decode' and inside the draft
    call within it 'draft'; each is restored on the way out (an exception too), and the sampled thread is the one
    that ran the iteration."""
    from graphcap.sglang import trace as tr
    from trace_events import stand_in_events

    stand_in_events(monkeypatch, tr, 1.0)
    sampler = SimpleNamespace(phase="scheduler", thread_id=None)
    trace = tr.DraftTrace(str(tmp_path), flush_every=1000, sampler=sampler)
    seen = []

    def batch(extend):
        return SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False, is_extend=lambda: extend),
                               seq_lens_cpu=None, reqs=[SimpleNamespace(rid="a", seqlen=9)],
                               extend_num_tokens=5, prefix_lens=[0])

    def draft(worker, b):
        seen.append(sampler.phase)
        return SimpleNamespace(draft_token=tr.torch.arange(4))

    def iteration(worker, b):
        seen.append(sampler.phase)
        if not b.forward_mode.is_extend():
            trace.around_draft(draft, None, b)
            seen.append(sampler.phase)
        return "out"

    def failing(worker, b):
        raise RuntimeError("boom")

    assert trace.around_iteration(iteration, None, batch(True)) == "out"
    assert trace.around_iteration(iteration, None, batch(False)) == "out"
    try:
        trace.around_iteration(failing, None, batch(True))
    except RuntimeError:
        pass
    assert seen == ["prefill", "decode", "draft", "decode"]
    assert sampler.phase == "scheduler" and sampler.thread_id == threading.get_ident()
    json.dumps(seen)


def test_summary_keeps_what_began_after_warm_up_and_ranks_it(tmp_path):
    """Two processes' files, three flushes each: `after` leaves out flushes that began before it; the summary's
    phases are ranked by time with shares of all sampled time, each phase's functions ranked within it."""
    paths = []
    for pid in range(2):
        path = tmp_path / f"host-samples-{pid}.jsonl"
        with open(path, "w") as f:
            for k in range(3):
                f.write(json.dumps({"since": 10.0 * k, "t": 10.0 * (k + 1), "interval_ms": 2.0, "samples": 4,
                                    "phases": {"prefill": {"ms": 30.0 + k, "inclusive": {"a:f": 30.0 + k,
                                                                                         "a:g": 5.0},
                                                           "own": {"a:3 g": 30.0 + k}},
                                               "scheduler": {"ms": 10.0, "inclusive": {"b:h": 10.0},
                                                             "own": {"b:1 h": 10.0}}}}) + "\n")
        paths.append(str(path))
    got = hs.summary(*paths, after=10.0)
    assert got["flushes"] == 4 and got["samples"] == 16
    pre, sched = 2 * (31.0 + 32.0), 2 * 20.0
    assert list(got["phases"]) == ["prefill", "scheduler"]
    assert got["phases"]["prefill"]["ms"] == pre and got["ms"] == pre + sched
    assert got["phases"]["prefill"]["share"] == round(pre / (pre + sched), 3)
    # a:f is on the stack for all of the phase: its frame, not a cost; left out
    assert got["phases"]["prefill"]["inclusive"] == [("a:g", 20.0, round(20.0 / pre, 3))]
    assert hs.summary(*paths, after=100.0) is None
