"""What capture costs and buys (CUDA): capture time and graph memory per bucket for each backend, and at one
(batch, context, steps) point the replay time of the whole draft iteration against the eager loop and against the
same loop in a manual CUDA graph without Inductor, plus the host time of one call: `run()` (copies the batch in),
`replay()` (zero-copy: the batch already in the static inputs), run()'s own parts (`check_batch()` - remembered
and full -, the input copy, the static address guard) and, for the manual-graph backends, the bare
`CUDAGraph.replay()` underneath (and, to tell the host's fixed cost per launch from its cost per node, graphs of 1 and
160 tiny kernels). `--profile-capture` says where a capture's host time went (cProfile).

    python bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 --out DIR
    python bench/capture_cost.py ... --capture-only --backends inductor-cudagraph --out DIR2   # e.g. a warm cache
    python bench/capture_cost.py ... --capture-only --backends inductor-cudagraph --per-bucket --out DIR3

Capture time depends on Inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): empty them for a cold
start, keep them for what a server restart sees. The output says which phases of torch.compile the time went to.
"""
from __future__ import annotations

import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

from graphcap import manifest as mf
from graphcap.bench.options import OneLineParser, server_compile
from graphcap.bench.environment import environment, summary_line
from graphcap.bench.state import make_target_state
from graphcap.bench.timing import median_p90, time_call
from graphcap.backends import GRAPH_BACKENDS
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.guards import AddressGuard, check_batch_inputs
from graphcap.engine.options import CaptureOptions
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.models.draft_ops import DEFAULT_OPS, TORCH_OPS
from graphcap.spec import load_spec
from graphcap.window import WindowBuffers


# run()'s parts that launch no graph: timed as 20 calls back to back (a single call timed after a sync also times the
# host waking from it: on the H200's host up to ~15 us, more than these calls take)
HOST_ONLY = ("check_batch()", "check_batch(), full check", "static address guard", "input copy (write)",
             "input copy, pair by pair", "static address guard, torch's C++ check",
             "static address guard, Python loop")


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="gemma4-31b-assistant")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--backends", default="cudagraph,inductor-cudagraph,reduce-overhead")
    p.add_argument("--capture-only", action="store_true", help="time the captures only (no replay timing)")
    p.add_argument("--buckets", default="", help="capture only these buckets (default: the spec's); e.g. 8")
    per = p.add_mutually_exclusive_group()
    per.add_argument("--dynamic-batch", action="store_true",
                     help="compiled backends: one compile for every bucket (DraftGraphs.for_loop's default)")
    per.add_argument("--per-bucket", action="store_true",
                     help="compiled backends: one compile per bucket (dynamic_batch=False)")
    p.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                   help="compiled backends: load/save torch's compile artifacts in DIR (DraftGraphs' compile_cache)")
    pre = p.add_mutually_exclusive_group()
    pre.add_argument("--precompile", action="store_true",
                     help="with --compile-cache (one compile for every bucket): save / load the whole compiled "
                          "iteration (DraftGraphs' precompile: a warm restart traces nothing); inductor-cudagraph "
                          "only. Without this flag or --no-precompile: for_loop's default (on with a compile cache)")
    pre.add_argument("--no-precompile", action="store_true",
                     help="with --compile-cache: torch's compile artifacts only (a warm restart traces the iteration)")
    p.add_argument("--inlined-layers", action="store_true",
                   help="every draft layer inlined into one graph (DraftLoop(layer_regions=False)) instead of a nested "
                        "compile region per layer")
    p.add_argument("--torch-ops", action="store_true",
                   help="the layer's norms, rotary and gelu-mul as torch ops Inductor fuses (TORCH_OPS) instead of "
                        "graphcap's kernels (the default set)")
    p.add_argument("--profile-capture", action="store_true",
                   help="run each capture under cProfile: where its host time went (capture-profile-<backend>.txt)")
    p.add_argument("--census", action="store_true",
                   help="record --batch's iteration once more as a debug graph: its nodes by type (graph.dot kept)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.precompile and a.per_bucket:
        p.error("--precompile saves the one compile for every bucket; it cannot go with --per-bucket")
    backends = [x for x in a.backends.split(",") if x]
    bad = [x for x in backends if x not in GRAPH_BACKENDS]
    if bad or not backends:
        p.error(f"--backends: {bad[0] if bad else a.backends!r} is not one of {', '.join(GRAPH_BACKENDS)}")
    if not torch.cuda.is_available():
        print("capture_cost: needs CUDA (CUDA graphs)", file=sys.stderr)
        return 2
    spec = load_spec(a.spec)
    try:
        buckets = [int(x) for x in a.buckets.split(",") if x] or list(spec.capture.buckets)
    except ValueError:
        p.error(f"--buckets: {a.buckets!r} is not a comma-separated list of batch sizes")
    if sorted(set(buckets)) != buckets or buckets[0] < 1 or a.batch > buckets[-1]:
        p.error(f"--buckets {a.buckets}: needs increasing positive sizes, the largest >= --batch {a.batch}")
    a.out.mkdir(parents=True, exist_ok=True)
    b, n = a.batch, a.iters
    growth = (n + 10) * (spec.capture.steps + 1)  # one call kind's advances (the windows are reset per kind)
    state = make_target_state(spec, [a.context] * b, a.context + growth, seed=0, device="cuda")
    model = FrozenKVDraft(spec, seed=1, device="cuda")
    g = torch.Generator().manual_seed(2)
    accepted = torch.randint(1, spec.capture.steps + 2, (n, b), generator=g, dtype=torch.int32).cuda()
    tokens = torch.randint(0, spec.draft.vocab, (n, b), generator=g).cuda()
    hidden = torch.randn(n, b, spec.target.hidden, generator=g).to("cuda", spec.torch_dtype())
    host_slots = state.slots.tolist()

    def make(backend: str | None):
        wb = WindowBuffers.from_spec(spec, state.req_to_token, state.full_to_swa)
        loop = DraftLoop(model, wb, state.k_swa, state.v_swa, state.k_full, state.v_full,
                         layer_regions=not a.inlined_layers, ops=TORCH_OPS if a.torch_ops else DEFAULT_OPS)
        if backend is None:
            return wb, loop, loop
        path = mf.manifest_path(a.out, spec.name, spec.hash, backend)
        sizing = server_compile(spec, buckets, backend, a.per_bucket)  # --buckets 8 times a server's code
        options = CaptureOptions(backend=backend, buckets=buckets, manifest_path=path, progress=True,
                                 compile_cache=a.compile_cache, precompile=precompile_choice(a, backend), **sizing)
        graphs = DraftGraphs.for_loop(loop, options)
        prof = cProfile.Profile() if a.profile_capture else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        graphs.capture()
        secs = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            write_profile(prof, a.out / f"capture-profile-{backend}.txt", secs)
        return wb, graphs, secs

    results, capture, phases, census = {}, {}, {}, {}
    runners = {} if a.capture_only else {"eager": make(None)[:2]}
    for backend in backends:
        before = _compile_phases()
        wb, graphs, secs = make(backend)
        runners[backend], capture[backend] = (wb, graphs), (secs, graphs.buckets)
        phases[backend] = {k: round(v - before.get(k, 0.0), 2) for k, v in _compile_phases().items()
                           if v - before.get(k, 0.0) >= 0.05}
        if a.capture_only:
            graphs.flush()
            del runners[backend]
    for name, (wb, r) in runners.items():
        wb.reset(host_slots, [a.context] * b)
        calls = {"call": r} if name == "eager" else {"run()": lambda *x, r=r: r.run(*x, host_slots=host_slots)}
        if name != "eager":
            calls["replay()"] = lambda *x, r=r: r.replay(b)  # inputs already in place: what is left per call
            calls["run(), GPU busy"], calls["replay(), GPU busy"] = calls["run()"], calls["replay()"]
            bucket = r.bucket_graph(b)
            # run()'s own parts before the replay: its input checks and its input copy
            calls["check_batch()"] = lambda s, acc, tok, hid, r=r: r.check_batch(s, tok, hid, accepted=acc,
                                                                               host_slots=host_slots)
            # what check_batch() does on a kind of batch it has not passed before (the full check, every call)
            calls["check_batch(), full check"] = lambda s, acc, tok, hid, r=r: check_batch_inputs(
                bucket.inputs, r.device, r.padding_slot, s, tok, hid, accepted=acc, host_slots=host_slots)
            calls["static address guard"] = lambda *x, r=r: r._static.check()  # replay()'s and run()'s
            # the same tensors through each way of reading their addresses, to compare the two on this host
            for how, native in (("torch's C++ check", True), ("Python loop", False)):
                try:
                    guard = AddressGuard(r._static.persistent, native=native)
                except ValueError:  # this torch has no C++ check
                    continue
                calls[f"static address guard, {how}"] = lambda *x, gd=guard: gd.check()
            calls["input copy (write)"] = bucket.write
            calls["input copy, pair by pair"] = lambda *x, bk=bucket: torch._foreach_copy_(bk.claim(b), x)
            if bucket.graph is not None:
                calls["CUDAGraph.replay()"] = lambda *x, g=bucket.graph: g.replay()
                calls["CUDAGraph.replay(), GPU busy"] = calls["CUDAGraph.replay()"]
                # the same host's launch of graphs of tiny kernels: its fixed cost per launch and per node, apart
                # from what the iteration's kernels are
                for k in (1, TINY_NODES):
                    calls[f"CUDAGraph.replay(), {k} tiny kernel{'s' * (k > 1)}"] = \
                        lambda *x, g=tiny_graph(k, r.device): g[0].replay()
            if a.census and name == "inductor-cudagraph":
                census[name] = graph_census(r.compiled, bucket.inputs, a.out / f"graph-{name}-b{b}.dot")
            if a.census and bucket.graph is not None:  # what one replay puts on the GPU beyond the graph's nodes
                census.setdefault(name, {})["replay_device_ops"] = replay_device_ops(bucket.graph)
        res = results[name] = {}
        for kind, run in calls.items():
            wb.reset(host_slots, [a.context] * b)  # each kind starts at the same context, inside the allocated rows
            for i in range(5):
                run(state.slots, accepted[i], tokens[i], hidden[i])
            torch.cuda.synchronize()
            gpu, host = [], []
            for i in range(5, n):
                if kind.endswith("GPU busy"):  # the launch overlaps GPU work, as in a serving loop
                    torch.cuda._sleep(2_000_000)  # ~1 ms of spinning at H200 clocks
                sample = time_call(lambda i=i: run(state.slots, accepted[i], tokens[i], hidden[i]), cuda=True)
                if kind in HOST_ONLY:  # no launch (or a copy's): 20 calls back to back, without a sync's wake-up
                    t0 = time.perf_counter()
                    for _ in range(20):
                        run(state.slots, accepted[i], tokens[i], hidden[i])
                    sample = dataclasses.replace(sample, host_ms=(time.perf_counter() - t0) / 20 * 1e3)
                host.append(sample.host_ms * 1e3)
                gpu.append(sample.gpu_ms)
            host_med, host_p90 = median_p90(host)
            res[kind] = {"gpu_ms": statistics.median(gpu), "host_us": host_med, "host_us_p90": host_p90}
        if name != "eager":
            r.flush()
    rows = []
    if results:
        eager = results["eager"]["call"]["gpu_ms"]
        rows = [[k, kind, f"{v['gpu_ms']:.3f}", f"{eager / v['gpu_ms']:.2f}", f"{v['host_us']:.1f}",
                 f"{v['host_us_p90']:.1f}"] for k, res in results.items() for kind, v in res.items()]
    table = tabulate(rows, headers=["mode", "call", "GPU ms/iter", "x eager", "host us / call (median)", "p90"],
                     tablefmt="github") if rows else "(--capture-only: no replay timing)"
    ptable = tabulate([[bk] + [f"{ph.get(k, 0.0):.1f}" for k in PHASES] for bk, ph in phases.items()],
                      headers=["backend"] + [PHASES[k] for k in PHASES], tablefmt="github")
    ctable = tabulate([[bk, f"{capture[bk][0]:.1f}"] + [f"{r.batch_size}:{r.capture_s:.2f}s/{r.pool_bytes / 2**20:.0f}MiB"
                                                      for r in capture[bk][1]] for bk in capture],
                      headers=["backend", "total s"] + [f"bucket {x}" for x in buckets], tablefmt="github")
    env = environment()
    text = (f"# capture cost, {env['date']}\n\n"
            f"spec {spec.name} ({spec.hash}), batch {b}, context {a.context}, steps {spec.capture.steps}; "
            f"{summary_line(env)}\n\n"
            f"{table}\n\nCapture (buckets {buckets}; per bucket: capture seconds / graph memory):\n\n{ctable}\n\n"
            f"Where torch.compile's time went (torch._dynamo.utils.compile_times, seconds summed over buckets):\n\n"
            f"{ptable}\n")
    if census:
        text += ("\nNodes of one recorded iteration (bucket of --batch; cudaGraphDebugDotPrint, file graph-*.dot):\n\n"
                 + tabulate([[k, v["nodes"], v["edges"], ", ".join(f"{t} {c}" for t, c in v["by_type"].items()),
                              ", ".join(f"{t} {c}" for t, c in v["kernels"][:12])] for k, v in census.items()
                             if "nodes" in v],
                            headers=["backend", "nodes", "edges", "by type", "most frequent kernels"],
                            tablefmt="github") + "\n"
                 + "\nDevice operations of one bare CUDAGraph.replay() (torch.profiler; the graph's kernels and "
                   "anything launched around them):\n\n"
                 + tabulate([[k, sum(v["replay_device_ops"].values()),
                              ", ".join(f"{t} {c}" for t, c in list(v["replay_device_ops"].items())[:8])]
                             for k, v in census.items() if "replay_device_ops" in v],
                            headers=["backend", "device ops", "most frequent"], tablefmt="github") + "\n")
    print(text)
    (a.out / "capture_cost.md").write_text(text)
    (a.out / "capture_cost.json").write_text(json.dumps(
        {"results": results, "capture_total_s": {k: v[0] for k, v in capture.items()},
         "capture_buckets": {k: [dataclasses.asdict(r) for r in v[1]] for k, v in capture.items()},
         "compile_phases_s": phases, "census": census, "env": env}, indent=1))
    return 0


def precompile_choice(a, backend: str) -> bool | None:
    """CaptureOptions.precompile from the flags: forced on (inductor-cudagraph only) or off, else None (left to
    for_loop's default)."""
    if a.precompile:
        return backend == "inductor-cudagraph"
    return False if a.no_precompile else None


def write_profile(prof: cProfile.Profile, path: Path, secs: float) -> None:
    """The capture's cProfile, most cumulative time first and most own time first."""
    buf = io.StringIO()
    buf.write(f"capture {secs:.2f} s under cProfile (its overhead included)\n")
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(30)
    path.write_text(buf.getvalue())


def graph_census(fn, inputs, dot_path: Path) -> dict:
    """Record `fn(*inputs)` once more into a debug-mode CUDA graph (it runs: the windows advance by the inputs'
    accepted counts, padding rows' 0 here), dump it as DOT and count nodes by type and kernels by name."""
    try:  # keep_graph: the cudaGraph_t survives capture_end, so it can be printed (torch >= 2.7)
        g = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        g = torch.cuda.CUDAGraph()
    g.enable_debug_mode()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn(*inputs)
    g.debug_dump(str(dot_path))
    del g
    if not dot_path.exists():
        return {"nodes": 0, "edges": 0, "by_type": {"(no dump written)": 1}, "kernels": []}
    return parse_dot(dot_path.read_text(errors="replace"))


TINY_NODES = 160  # about the batch-8 iteration's kernel nodes


def tiny_graph(nodes: int, device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of `nodes` one-element add kernels in a line (the iteration's graphs are a line too), and the
    tensor it writes (keep both alive together)."""
    x = torch.zeros(1, device=device)
    x.add_(1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1)
    return g, x


def replay_device_ops(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """Device operations (kernels, memsets, copies) of one bare `graph.replay()` by name, from torch.profiler: the
    graph's kernels plus whatever torch launches around them on every replay (e.g. filling a registered RNG
    generator's seed and offset)."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(collections.Counter(n[:80] for n in names).most_common())


def parse_dot(text: str) -> dict:
    """Nodes by type, edges, and kernels by (shortened) name in a cudaGraphDebugDotPrint dump."""
    import collections
    import re

    types = re.findall(r'label="\{\s*([A-Z_]+)\b', text)
    # kernel nodes: "{ID | 3 (topoId: 209) | name\<\<\<grid,block,smem\>\>\>}"
    kernels = [k.strip() for k in re.findall(r"\{ID \| \d+ \(topoId: \d+\) \| ([^\\{}|]+)", text)]
    short = [re.sub(r"^_ZN\w*?(cublasLt|cutlass)\w*", r"\1 ...", k)[:60] for k in kernels]
    return {"nodes": len(types), "edges": len(re.findall(r"->", text)),
            "by_type": dict(collections.Counter(types).most_common()),
            "kernels": collections.Counter(short).most_common()}


PHASES = {  # torch.compile's timed phases worth showing (nested: the first is the whole compile)
    "_compile.compile_inner": "compile total", "bytecode_tracing": "Dynamo tracing",
    "create_aot_dispatcher_function": "AOTAutograd (incl. Inductor)", "compile_fx_inner": "Inductor",
    "Scheduler.codegen": "Inductor codegen", "async_compile.wait": "waiting for Triton kernel compiles",
    "PyCodeCache.load_by_key_path": "loading compiled modules",
}


def _compile_phases() -> dict[str, float]:
    """Seconds spent so far in each timed phase of torch.compile (Dynamo, AOTAutograd, Inductor, ...)."""
    try:
        return {k: float(sum(v)) for k, v in torch._dynamo.utils.compilation_time_metrics.items()}
    except Exception:  # noqa: BLE001 - a private API: the bench must not die of it
        return {}


if __name__ == "__main__":
    sys.exit(main())
