"""Where a scheduler's host time goes, by phase: `GRAPHCAP_SGLANG_TRACE_HOST=MS` beside the draft trace.

A daemon thread wakes every MS milliseconds, reads the Python stack of the thread that runs sglang's iterations
(`sys._current_frames()`) and credits the wall time since its previous sample to that stack under the phase the
trace set (`prefill`: the speculative worker's iteration on an extend batch; `decode`: on a decode batch, `draft`
inside it; `scheduler`: everything else - receiving requests, scheduling, the radix cache, sending results). Per
phase it keeps each function's inclusive milliseconds (the function is on the stack) and each line's own (the
innermost frame), not whole stacks, so a flush stays a few kilobytes. Every FLUSH_S seconds the thread appends what
it gathered since its last flush to DIR/host-samples-<pid>.jsonl (one JSON object per line), so a killed scheduler
loses at most that much.

Why in-process rather than an external sampler such as py-spy: the scheduler is a child of sglang's launcher and
attaching to it needs ptrace rights the GPU machine's container need not grant; this needs nothing. Its bias: the
thread runs only when it gets the GIL, so a sample lands where the sampled thread releases the GIL or at a switch
interval (5 ms). Torch ops, Triton launches and event waits release it, so the `own` table credits each such call
with the Python time since the thread's previous release: read it as "the work leading up to this call". The
inclusive table (every function on the stack) is the one to read for costs. Weighting by the wall time since the
previous sample (not per sample) keeps the totals in milliseconds whatever the spacing.
Meant for measurement runs: each sample takes the GIL for a stack walk.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from types import FrameType

PHASES = ("prefill", "decode", "draft", "scheduler")
FLUSH_S = 10.0
MAX_DEPTH = 64  # frames walked per sample from the innermost out (sglang's deepest stacks are ~40)


_KEYS: dict[tuple, tuple[str, str]] = {}  # (code, line) -> frame_key's answer: a sample builds no strings


def frame_key(frame: FrameType) -> tuple[str, str]:
    """(function, line): 'path:function' and 'path:line function', the path below its import root."""
    at = (frame.f_code, frame.f_lineno)
    key = _KEYS.get(at)
    if key is None:
        key = _KEYS[at] = _frame_key(frame)
    return key


def _frame_key(frame: FrameType) -> tuple[str, str]:
    code = frame.f_code
    path = code.co_filename
    # the path below its import root (the longest sys.path entry holding it: site-packages, a --target dir, the
    # repository), so keys read the same on every machine
    for root in sorted((p for p in sys.path if p), key=len, reverse=True):
        if path.startswith(root.rstrip("/") + "/"):
            path = path[len(root.rstrip("/")) + 1:]
            break
    name = getattr(code, "co_qualname", code.co_name)
    return f"{path}:{name}", f"{path}:{frame.f_lineno} {name}"


class HostSampler:
    """Samples one thread's stack; `phase` is set by whoever knows what that thread is doing (graphcap.sglang.trace).
    `frames` and `clock` are injectable so tests drive `sample` deterministically."""

    def __init__(self, path: str, interval_s: float, *,
                 frames: Callable[[], dict[int, FrameType]] = sys._current_frames,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = path
        self.interval_s = interval_s
        self.phase = "scheduler"
        self.thread_id: int | None = threading.main_thread().ident
        self._frames = frames
        self._clock = clock
        self._last = clock()
        self._since = self._last  # the start of what the next flush covers
        self._cap_s = max(100 * interval_s, 0.1)  # a longer silence (the process stopped) credits no one
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset()

    def _reset(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)  # phase -> ms
        self.inclusive: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.own: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.samples = 0

    def sample(self) -> None:
        """Credit the time since the previous sample to the sampled thread's stack under the current phase."""
        now = self._clock()
        dt_ms = min(now - self._last, self._cap_s) * 1e3
        self._last = now
        frame = self._frames().get(self.thread_id) if self.thread_id is not None else None
        if frame is None or dt_ms <= 0:
            return
        phase = self.phase
        seen: set[str] = set()
        own = None
        depth = 0
        with self._lock:
            inclusive = self.inclusive[phase]
            while frame is not None and depth < MAX_DEPTH:
                func, line = frame_key(frame)
                if own is None:
                    own = line
                if func not in seen:  # recursion counts once
                    seen.add(func)
                    inclusive[func] += dt_ms
                frame = frame.f_back
                depth += 1
            self.own[phase][own] += dt_ms
            self.totals[phase] += dt_ms
            self.samples += 1

    def flush(self) -> None:
        """Append what was gathered since the last flush (nothing when nothing was)."""
        with self._lock:
            if not self.samples:
                return
            now = self._clock()
            rec = {"since": self._since, "t": now, "interval_ms": self.interval_s * 1e3, "samples": self.samples,
                   "phases": {p: {"ms": round(ms, 3),
                                  "inclusive": {k: round(v, 3) for k, v in self.inclusive[p].items()},
                                  "own": {k: round(v, 3) for k, v in self.own[p].items()}}
                              for p, ms in self.totals.items()}}
            self._reset()
            self._since = now
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _run(self) -> None:
        next_flush = self._clock() + FLUSH_S
        while not self._stop.wait(self.interval_s):
            self.sample()
            if self._clock() >= next_flush:
                self.flush()
                next_flush = self._clock() + FLUSH_S

    def start(self) -> HostSampler:
        self._last = self._since = self._clock()
        self._thread = threading.Thread(target=self._run, name="graphcap-host-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()


def sampler_path(directory: str) -> str:
    return os.path.join(directory, f"host-samples-{os.getpid()}.jsonl")


def read(*paths: str, after: float | None = None) -> dict:
    """Samples files summed over their flushes, those that began before `after` (time.perf_counter's clock, one per
    machine) left out: {"samples", "flushes", "phases": {phase: {"ms", "inclusive", "own"}}}."""
    out: dict = {"samples": 0, "flushes": 0, "phases": {}}
    for path in paths:
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        for rec in recs:
            if after is not None and rec["since"] < after:
                continue
            out["flushes"] += 1
            out["samples"] += rec["samples"]
            for p, d in rec["phases"].items():
                acc = out["phases"].setdefault(p, {"ms": 0.0, "inclusive": defaultdict(float),
                                                   "own": defaultdict(float)})
                acc["ms"] += d["ms"]
                for kind in ("inclusive", "own"):
                    for k, v in d[kind].items():
                        acc[kind][k] += v
    return out


COMMON_SHARE = 0.98  # a function on the stack for this much of a phase's time is its frame, not a cost


def summary(*paths: str, after: float | None = None, n: int = 30) -> dict | None:
    """What a report keeps of samples files (`read`): per phase its ms, share of all sampled time, and the `n`
    functions (inclusive, those under the phase's common frames: on the stack for less than COMMON_SHARE of it)
    and lines (own) taking most of it. None where nothing was sampled."""
    got = read(*paths, after=after)
    total = sum(d["ms"] for d in got["phases"].values())
    if not total:
        return None
    return {"samples": got["samples"], "flushes": got["flushes"], "ms": round(total, 1),
            "phases": {p: {"ms": round(d["ms"], 1), "share": round(d["ms"] / total, 3),
                           "inclusive": [r for r in top(got, p, "inclusive", n + 64) if r[2] < COMMON_SHARE][:n],
                           "own": top(got, p, "own", n)}
                       for p, d in sorted(got["phases"].items(), key=lambda kv: -kv[1]["ms"])}}


def top(got: dict, phase: str, kind: str = "inclusive", n: int = 15) -> list[tuple[str, float, float]]:
    """The `n` largest (key, ms, share of the phase's ms) of one phase's `kind` table."""
    d = got["phases"].get(phase)
    if not d or not d["ms"]:
        return []
    rows = sorted(d[kind].items(), key=lambda kv: -kv[1])[:n]
    return [(k, round(v, 1), round(v / d["ms"], 3)) for k, v in rows]
