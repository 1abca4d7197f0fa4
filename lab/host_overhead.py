"""Host (CPU) time that `DraftGraphs.run()` and `replay()` spend around the graph launch, on any machine.

A CPU has no CUDA graph to launch, so the bench captures with the eager backend and then gives every bucket a graph
whose `replay()` does nothing, with static outputs of the bucket's size: run() and replay() then take the manual-graph
backends' path (guards, dispatch, input copies, padding, output views, flush check) and the launch itself costs
nothing. What a GPU adds on top - the launch of the graph and of the input copies - is not measured here.

    python lab/host_overhead.py --batches 8
    python lab/host_overhead.py --batches 5,8   # alternating in one bucket: every other call resets padding rows
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from tabulate import tabulate

from graphcap.bench.state import make_target_state
from graphcap.bench.timing import collector_off
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.kernels import twins_on_cpu
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.spec import load_spec
from graphcap.window import WindowBuffers


class NoLaunch:
    """Stands in for a recorded `torch.cuda.CUDAGraph`: a replay that launches nothing."""

    def replay(self) -> None:
        pass


def build(spec_name: str) -> tuple[DraftGraphs, WindowBuffers, object]:
    spec = load_spec(spec_name)
    n = spec.capture.max_slots
    st = make_target_state(spec, [8] * n, [spec.capture.max_context] * n, slots=list(range(n)), seed=0, device="cpu")
    wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
    wb.reset(list(range(n)), [8] * n)
    loop = DraftLoop(FrozenKVDraft(spec, seed=0, device="cpu"), wb, st.k_swa, st.v_swa, st.k_full, st.v_full)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", manifest_path=None))
    graphs.capture()
    for size in (r.batch_size for r in graphs.buckets):
        bucket = graphs.bucket_graph(size)
        # padding rows only (the padding slot, accepted = 0): this call reads and writes no live window
        bucket.graph, bucket.outputs = NoLaunch(), loop(*bucket.inputs)
        bucket.views.clear()
    return graphs, wb, spec


def per_call_us(fn: Callable[[int], object], batches: list[int], iters: int) -> tuple[float, float]:
    """Median and p90 host microseconds of one call, cycling through `batches`."""
    for i in range(200):
        fn(batches[i % len(batches)])
    samples = []
    clock = time.perf_counter_ns
    with collector_off():
        for i in range(iters):
            b = batches[i % len(batches)]
            t0 = clock()
            fn(b)
            samples.append(clock() - t0)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.9 * (len(samples) - 1))] / 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="tiny")
    p.add_argument("--batches", default="8", help="comma-separated batch sizes, cycled call by call")
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the copies are tiny)")
    a = p.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",") if x]
    except ValueError:
        p.error(f"--batches: {a.batches!r} is not a comma-separated list of ints")
    if a.iters < 1 or a.threads < 1:
        p.error(f"--iters and --threads must be >= 1, got {a.iters}, {a.threads}")
    torch.set_num_threads(a.threads)
    with twins_on_cpu():
        graphs, wb, spec = build(a.spec)
        largest = graphs.buckets[-1].batch_size
        if not batches or min(batches) < 1 or max(batches) > largest:
            p.error(f"--batches: each in 1..{largest} (the spec's buckets)")
        g = torch.Generator().manual_seed(0)
        live = {}
        for b in batches:
            slots = torch.randperm(spec.capture.max_slots, generator=g)[:b]
            live[b] = (slots, torch.zeros(b, dtype=torch.int32), torch.randint(0, spec.draft.vocab, (b,), generator=g),
                       torch.randn(b, spec.target.hidden, generator=g), slots.tolist())
        for b in batches:  # the zero-copy path's inputs: written once, replayed many times
            for view, x in zip(graphs.static_inputs(b), live[b][:4]):
                view.copy_(x)
        bucket_of = {b: graphs.bucket_graph(b) for b in batches}
        calls: dict[str, Callable[[int], object]] = {
            "run(host_slots=...)": lambda b: graphs.run(*live[b][:4], host_slots=live[b][4]),
            "run()": lambda b: graphs.run(*live[b][:4]),
            "replay()": lambda b: graphs.replay(b),
            "  check_batch(host_slots=...)": lambda b: graphs.check_batch(live[b][0], live[b][2], live[b][3],
                                                                          accepted=live[b][1],
                                                                          host_slots=live[b][4]),
            "  static address guard": lambda b: graphs._static.check(),
            "  4 input copies (BucketGraph.write)": lambda b: bucket_of[b].write(*live[b][:4]),
            "  the no-op launch": lambda b: bucket_of[b].graph.replay(),
        }
        rows = []
        for name, fn in calls.items():
            med, p90 = per_call_us(fn, batches, a.iters)
            rows.append([name, f"{med:.2f}", f"{p90:.2f}"])
    print(f"spec {spec.name}, batches {batches}, {a.iters} calls each, {len(graphs._static.persistent)} static "
          f"tensors, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(tabulate(rows, headers=["call", "median us", "p90 us"], stralign="right"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
