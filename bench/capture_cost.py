"""What capture costs and buys (CUDA): capture time and graph memory per bucket for both backends, and at one
(batch, context, steps) point the replay time of the whole draft iteration against the eager loop and against the
same loop in a manual CUDA graph without Inductor, plus the host time of one `run()` call.

    python bench/capture_cost.py --spec gemma4-31b-assistant --batch 8 --context 2048 --out DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

from graphcap import manifest as mf
from graphcap.capture import DraftGraphs
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.spec import load_spec
from graphcap.state import make_target_state
from graphcap.window import WindowBuffers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="gemma4-31b-assistant")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("capture_cost: needs CUDA (CUDA graphs)", file=sys.stderr)
        return 2
    spec = load_spec(a.spec)
    a.out.mkdir(parents=True, exist_ok=True)
    b, n = a.batch, a.iters
    growth = 3 * (n + 10) * (spec.capture.steps + 1)
    state = make_target_state(spec, [a.context] * b, a.context + growth, seed=0, device="cuda")
    model = FrozenKVDraft(spec, seed=1, device="cuda")
    g = torch.Generator().manual_seed(2)
    accepted = torch.randint(1, spec.capture.steps + 2, (n, b), generator=g, dtype=torch.int32).cuda()
    tokens = torch.randint(0, spec.draft.vocab, (n, b), generator=g).cuda()
    hidden = torch.randn(n, b, spec.target.hidden, generator=g).to("cuda", spec.torch_dtype())
    host_slots = state.slots.tolist()

    def make(backend: str | None):
        wb = WindowBuffers.from_spec(spec, state.req_to_token, state.full_to_swa)
        loop = DraftLoop(model, wb, state.k_swa, state.v_swa, state.k_full, state.v_full)
        if backend is None:
            return wb, loop, loop
        path = mf.manifest_path(a.out, spec.name, spec.hash, backend)
        graphs = DraftGraphs.for_loop(loop, backend=backend, manifest_path=path, progress=False)
        t0 = time.perf_counter()
        graphs.capture()
        return wb, graphs, time.perf_counter() - t0

    results, capture = {}, {}
    runners = {"eager": make(None)[:2]}
    for backend in ("cudagraph", "reduce-overhead"):
        wb, graphs, secs = make(backend)
        runners[backend], capture[backend] = (wb, graphs), (secs, graphs.buckets)
    for name, (wb, r) in runners.items():
        wb.reset(host_slots, [a.context] * b)
        run = r if name == "eager" else (lambda *x, r=r: r.run(*x, host_slots=host_slots))
        for i in range(5):
            run(state.slots, accepted[i], tokens[i], hidden[i])
        torch.cuda.synchronize()
        gpu, host = [], []
        for i in range(5, n):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            run(state.slots, accepted[i], tokens[i], hidden[i])
            host.append((time.perf_counter() - t0) * 1e6)
            e1.record()
            torch.cuda.synchronize()
            gpu.append(e0.elapsed_time(e1))
        results[name] = {"gpu_ms": statistics.median(gpu), "host_us": statistics.median(host)}
        if name != "eager":
            r.flush()
    eager = results["eager"]["gpu_ms"]
    rows = [[k, f"{v['gpu_ms']:.3f}", f"{eager / v['gpu_ms']:.2f}", f"{v['host_us']:.1f}"] for k, v in results.items()]
    table = tabulate(rows, headers=["mode", "GPU ms/iter", "x eager", "host us / call"], tablefmt="github")
    ctable = tabulate([[bk, f"{capture[bk][0]:.1f}"] + [f"{r.batch_size}:{r.capture_s:.2f}s/{r.pool_bytes / 2**20:.0f}MiB"
                                                      for r in capture[bk][1]] for bk in capture],
                      headers=["backend", "total s"] + [f"bucket {x}" for x in spec.capture.buckets], tablefmt="github")
    env = mf.environment()
    text = (f"# capture cost, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
            f"spec {spec.name} ({spec.hash}), batch {b}, context {a.context}, steps {spec.capture.steps}; "
            f"{env['device']}, driver {env['driver']}, torch {env['torch_version']}, triton {env['triton_version']}\n\n"
            f"{table}\n\nCapture (all buckets; per bucket: capture seconds / graph memory):\n\n{ctable}\n")
    print(text)
    (a.out / "capture_cost.md").write_text(text)
    (a.out / "capture_cost.json").write_text(json.dumps({"results": results, "capture_total_s": {k: v[0] for k, v in
                                                          capture.items()}, "env": env}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
