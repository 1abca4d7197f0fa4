"""The lab scripts' in-graph timer: a call timed as one node sequence among others inside a CUDA graph, the way a draft
iteration runs it (no graph-launch latency, no event around the call, the L2 holding clean lines of other data).
CUDA only. The scripts run as `python lab/<script>.py`, which puts lab/ on sys.path: `from graph_timing import ...`."""
from __future__ import annotations

from collections.abc import Callable

import torch

from graphcap.bench import timing

IN_GRAPH_REPEATS = 8
_FLUSH: list[torch.Tensor] = []


def flush_buffer() -> torch.Tensor:
    """256 MB of fp32 on the GPU (the H200's L2 is 50 MB): reading it leaves the L2 holding clean lines of other
    data. Made once per process."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(64 << 20, dtype=torch.float32, device="cuda").uniform_())
    return _FLUSH[0]


def in_graph_ms(fn: Callable[[], object], rep_ms: float) -> float:
    """Milliseconds of `fn` among other work in a graph: graph A holds 8 x (read 256 MB, fn), graph B the 8 reads
    alone; (A - B) / 8."""
    buf = flush_buffer()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(IN_GRAPH_REPEATS):
                buf.sum()
                if with_fn:
                    fn()
        graphs.append(g)
    try:
        both, reads = (timing.events_ms(g.replay, rep_ms) for g in graphs)
        return max(0.0, (both - reads) / IN_GRAPH_REPEATS)
    finally:
        del graphs


def in_graph_us(fn: Callable[[], object], rep_ms: float = 200.0) -> float:
    """Microseconds of `fn` the same way, after one warm-up call outside the graph (compiles, plans)."""
    fn()
    torch.cuda.synchronize()
    return in_graph_ms(fn, rep_ms) * 1e3


def copy_bandwidth() -> float:
    """GB/s, bytes read + written: the same measurement as the draft-phase bench's roofline; its buffers freed."""
    from graphcap.bench.roofline import measure_copy_bandwidth

    gbs = measure_copy_bandwidth()
    torch.cuda.empty_cache()
    return gbs
