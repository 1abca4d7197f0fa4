"""The measuring loop behind `graphcap bench` (options, output and formatting live in graphcap.bench)."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from graphcap.baseline import RebuildBaseline, SglangBaseline
from graphcap.bench import BenchConfig, count_syncs, environment, growth_tokens, summarize
from graphcap.capture import DraftGraphs
from graphcap.gpu_monitor import GpuMonitor
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.roofline import floor_ms, measure_copy_bandwidth
from graphcap.state import make_target_state
from graphcap.window import WindowBuffers


@dataclass
class Mode:
    name: str
    window: WindowBuffers
    runner: Any  # .run(slots, accepted, tokens, hidden, host_slots=...) and .capture()
    capture_s: float = 0.0


def _buckets_for(cfg: BenchConfig) -> tuple[int, ...]:
    """The buckets the measured batches dispatch to (the smallest spec bucket >= each batch; a batch above every
    bucket gets its own): capturing only these keeps a run's compile time to what it measures."""
    spec_b = cfg.spec.capture.buckets
    return tuple(sorted({next((s for s in spec_b if s >= b), b) for b in cfg.batches}))


def build_modes(cfg: BenchConfig, model, state, steps: int, notes: list[str]) -> list[Mode]:
    spec, cuda = cfg.spec, state.req_to_token.is_cuda
    buckets = _buckets_for(cfg)
    pools = (state.k_swa, state.v_swa, state.k_full, state.v_full)
    modes = []
    for name in cfg.modes:
        wb = WindowBuffers(state.req_to_token, spec.window, spec.capture.max_slots, state.full_to_swa,
                           max_accepted=max(cfg.steps) + 1)
        loop = DraftLoop(model, wb, *pools, steps=steps)
        if name == "eager-rebuild":
            runner = RebuildBaseline(loop, graphed=False)
        elif name == "graph-rebuild":
            if not cuda:
                _note(notes, "graph-rebuild skipped: CUDA graphs need CUDA")
                continue
            runner = RebuildBaseline(loop, graphed=True, buckets=buckets)
        elif name == "sglang":
            if not cuda:
                _note(notes, "sglang skipped: sglang's Triton kernels and CUDA graphs need CUDA")
                continue
            try:
                runner = SglangBaseline(model, wb, *pools, buckets=buckets, steps=steps)
            except ImportError as e:
                _note(notes, f"sglang skipped: its kernels do not import here ({e})")
                continue
        else:
            backend = spec.capture.backend if cuda else "compile"
            if not cuda:
                _note(notes, "graphcap runs Inductor-compiled without CUDA graphs on this machine: graphs need CUDA")
            runner = DraftGraphs.for_loop(loop, backend=backend, buckets=buckets, progress=False)
        modes.append(Mode(name, wb, runner))
    return modes


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def run_bench(cfg: BenchConfig) -> dict:
    spec = cfg.spec
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    notes: list[str] = []
    growth = growth_tokens(cfg.warmup, cfg.iters, cfg.steps)
    bmax, cmax = max(cfg.batches), max(cfg.contexts)
    state = make_target_state(spec, [cmax] * bmax, cmax + growth, seed=cfg.seed, device=device)
    model = FrozenKVDraft(spec, seed=cfg.seed + 1, device=device)
    copy_gb_s = measure_copy_bandwidth() if cuda else None  # the roofline's ceiling, measured in this run
    g = torch.Generator().manual_seed(cfg.seed + 2)
    rows: list[dict] = []
    captures: dict[str, dict[str, float]] = {}
    total = len(cfg.steps) * len(cfg.contexts) * len(cfg.batches) * cfg.repeats
    done = 0
    for steps in cfg.steps:
        modes = build_modes(cfg, model, state, steps, notes)
        for m in modes:
            t0 = time.perf_counter()
            m.runner.capture()
            m.capture_s = time.perf_counter() - t0
        captures[str(steps)] = {m.name: m.capture_s for m in modes}
        for ctx in cfg.contexts:
            for b in cfg.batches:
                slots = state.slots[:b]
                host_slots = slots.tolist()
                n = cfg.warmup + cfg.iters
                accepted = torch.randint(1, steps + 2, (n, b), generator=g, dtype=torch.int32).to(device)
                tokens = torch.randint(0, spec.draft.vocab, (n, b), generator=g).to(device)
                hidden = torch.randn(n, b, spec.target.hidden, generator=g).to(device, spec.torch_dtype())
                acc: dict[str, dict[str, list]] = {m.name: {"wall": [], "host": [], "gpu": [], "mon": []} for m in modes}
                syncs: dict[str, int | None] = {}
                for _ in range(cfg.repeats):
                    for m in modes:
                        _measure(m, cfg, ctx, host_slots, slots, accepted, tokens, hidden, acc[m.name], syncs, cuda)
                    done += 1
                    _progress(done, total, f"steps {steps} ctx {ctx} batch {b}")
                new = _rows(modes, acc, syncs, b, ctx, steps, spec.window)
                for r in new:
                    r["floor_ms"] = floor_ms(spec, b, ctx, steps, copy_gb_s) if copy_gb_s else None
                    r["x_floor"] = r["wall_ms"] / r["floor_ms"] if copy_gb_s else None
                rows.extend(new)
    _progress(None, total, "")
    return {"environment": environment(cfg), "config": _config(cfg), "captures_s": captures, "rows": rows,
            "copy_gb_s": copy_gb_s, "notes": notes}


def _measure(m: Mode, cfg, ctx, host_slots, slots, accepted, tokens, hidden, out, syncs, cuda) -> None:
    m.window.reset(host_slots, [ctx] * len(host_slots))

    def it(i):
        return m.runner.run(slots, accepted[i], tokens[i], hidden[i], host_slots=host_slots)

    for i in range(cfg.warmup):
        it(i)
    if cuda:
        torch.cuda.synchronize()
        if m.name not in syncs:
            syncs[m.name] = count_syncs(lambda: it(cfg.warmup))
            torch.cuda.synchronize()
    mon = GpuMonitor() if cuda else None
    with mon or contextlib.nullcontext():
        for i in range(cfg.warmup, cfg.warmup + cfg.iters):
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                e0.record()
                it(i)
                e1.record()
                t1 = time.perf_counter()
                torch.cuda.synchronize()  # an engine reads the draft (verify's accept counts) every iteration
                t2 = time.perf_counter()
                out["gpu"].append(e0.elapsed_time(e1))
            else:
                t0 = time.perf_counter()
                it(i)
                t1 = t2 = time.perf_counter()
            out["wall"].append((t2 - t0) * 1e3)
            out["host"].append((t1 - t0) * 1e3)
    if mon is not None:
        out["mon"].append(mon.summary())


def _rows(modes, acc, syncs, b, ctx, steps, window) -> list[dict]:
    rows, wall = [], {}
    for m in modes:
        a = acc[m.name]
        med, p90 = summarize(a["wall"])
        wall[m.name] = med
        mons = [x for x in a["mon"] if x["util_pct"] is not None]
        mean = (lambda k: sum(x[k] for x in mons) / len(mons)) if mons else (lambda k: None)
        rows.append({
            "batch": b, "context": ctx, "steps": steps, "mode": m.name, "window": window,
            "iter_per_s": 1e3 / med, "wall_ms": med, "wall_p90_ms": p90,
            "gpu_ms": summarize(a["gpu"])[0] if a["gpu"] else None, "host_ms": summarize(a["host"])[0],
            "syncs_per_iter": syncs.get(m.name), "util_pct": mean("util_pct"), "power_w": mean("power_w"),
            "sm_mhz": mean("sm_mhz"), "capture_s": m.capture_s, "samples": len(a["wall"]),
        })
    for r in rows:
        for base in ("eager-rebuild", "graph-rebuild", "sglang"):
            if base in wall and r["mode"] != base:
                r[f"speedup_vs_{base}"] = wall[base] / r["wall_ms"]
    return rows


def _config(cfg: BenchConfig) -> dict:
    return {"spec": cfg.spec.name, "spec_source": cfg.spec.source, "batches": cfg.batches, "contexts": cfg.contexts,
            "steps": cfg.steps, "modes": cfg.modes, "iters": cfg.iters, "warmup": cfg.warmup,
            "repeats": cfg.repeats, "seed": cfg.seed}


def _progress(done: int | None, total: int, text: str) -> None:
    if not sys.stderr.isatty():
        return
    if done is None:
        sys.stderr.write("\r\033[K")
    else:
        width = 24
        fill = int(width * done / total)
        sys.stderr.write(f"\r\033[K[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {text}")
    sys.stderr.flush()
