"""The benchmarks' one timer. An iteration: host wall clock around the call and the sync that ends it, CUDA events
around the call where there is a GPU. A kernel: triton's do_bench (L2 emptied before each call) or CUDA events over
many calls. Nothing here sleeps or polls: what is timed is the call."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sample:
    wall_ms: float  # call + the sync that ends it (an engine reads the draft every iteration)
    host_ms: float  # until the call returned (on a CPU: the same as wall)
    gpu_ms: float | None  # CUDA events around the call; None without CUDA


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cycle collector run once, then off for the block (on again after, if it was): a collection inside a
    timed or counted call is not the call's cost, and one that frees CUDA memory of earlier captures may make the
    allocator synchronise."""
    was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def time_call(fn: Callable[[], object], cuda: bool) -> Sample:
    if not cuda:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        return Sample((t1 - t0) * 1e3, (t1 - t0) * 1e3, None)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()  # the host clock brackets the call alone, not the event records
    fn()
    t1 = time.perf_counter()
    e1.record()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return Sample((t2 - t0) * 1e3, (t1 - t0) * 1e3, e0.elapsed_time(e1))


def median_p90(samples: Sequence[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))]


def do_bench_ms(fn: Callable[[], object], rep_ms: float = 100.0) -> float:
    """Median GPU milliseconds per call, L2 emptied (by writing) before each: triton.testing.do_bench."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(2.0, rep_ms / 4), rep=rep_ms, return_mode="median"))


def events_ms(fn: Callable[[], object], rep_ms: float, before: Callable[[], object] | None = None) -> float:
    """Median milliseconds of `fn` between two CUDA events; `before` (untimed) runs ahead of each call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = int(min(500, max(10, rep_ms / max(1e-3, (time.perf_counter() - t0) * 1e3))))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in ev:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in ev))


def call_us(fn: Callable[[], object], iters: int, warmup: int = 200) -> tuple[float, float]:
    """Median and 90th-percentile host microseconds of one call, each timed alone and none synced: what the host
    spends issuing it. `warmup` untimed calls first; the collector off while timing."""
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter_ns
    with collector_off():
        for _ in range(iters):
            t0 = clock()
            fn()
            samples.append((clock() - t0) / 1e3)
    return median_p90(samples)


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Host wall microseconds per call over n calls, the GPU drained at the end (so it also bounds GPU time)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6
