"""The measuring loop behind `graphcap bench`: draft iterations/s against batch (and context, steps), graphcap
against the baselines (graphcap.bench.baselines), in one process, on one target state and one model's weights,
modes interleaved so that machine drift hits all of them.

Every iteration is a real one: random accepted counts in [1, steps + 1] per row advance the state (their KV
locations are already allocated in req_to_token, as after a verify), so windows slide and wrap as in serving.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

import torch
from tqdm import tqdm

from graphcap.bench.baselines import (GPT_FAST_INDUCTOR, CompiledBaseline, RebuildBaseline, SglangBaseline,
                                      graph_problem)
from graphcap.bench.counting import Count, count_kernels, count_syncs
from graphcap.bench.environment import environment
from graphcap.bench.gpu_monitor import GpuMonitor
from graphcap.bench.options import (BenchConfig, OptionError, buckets_for, growth_tokens, mode_unavailable,
                                    server_compile)
from graphcap.bench.report import CPU_SCOPE
from graphcap.bench.roofline import floor_ms, measure_copy_bandwidth
from graphcap.bench.rows import SPEEDUP_FIELDS, BenchResult, BenchRow
from graphcap.bench.state import TargetState, make_target_state
from graphcap.bench.timing import Sample, collector_off, median_p90, time_call
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.kernels.gemm.skinny import DTYPES as SKINNY_DTYPES
from graphcap.models.draft_ops import (DEFAULT_OPS, PLAIN_OPS, QNORM_KERNEL_OPS, SKINNY_4ROWS_OPS, SKINNY_OPS,
                                       TORCH_OPS, TWO_HEAD_PROJ_OPS, DraftOps)
from graphcap.models.fused_op_set import fused_ops
from graphcap.window import WindowBuffers



@dataclass
class Mode:
    name: str
    window: WindowBuffers
    runner: Any  # .run(slots, accepted, tokens, hidden, host_slots=...) and .capture()
    note: str = ""
    capture_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    monitor: list[dict] = field(default_factory=list)
    syncs: Count | None = None
    kernels: Count | None = None


def _fused_or_torch(notes: list[str], cuda: bool) -> tuple[DraftOps, str]:
    try:
        ops = fused_ops()
    except ImportError as e:
        text = f"fused op set unavailable ({e}): plain torch ops instead of one kernel per norm/gelu/rotary"
        if cuda:
            raise ImportError(text) from e
        _note(notes, f"compile: {text}")
        return TORCH_OPS, "torch ops (fused set unavailable)"
    if ops.post_norm is None:  # sglang absent: its post-MLP norm + residual + scalar kernel with it
        return ops, "post-MLP norm + residual + scalar as 3 kernels (sglang's fused kernel not importable)"
    return ops, ""


def build_modes(cfg: BenchConfig, model: FrozenKVDraft, state: TargetState, steps: int,
                notes: list[str]) -> list[Mode]:
    cuda = state.req_to_token.is_cuda
    buckets = buckets_for(cfg)
    pools = (state.k_swa, state.v_swa, state.k_full, state.v_full)
    modes = []
    for name in cfg.modes:
        missing = mode_unavailable(name, cuda)
        if missing:
            _note(notes, f"{name} skipped: {missing}")
            continue
        wb = WindowBuffers(state.req_to_token, cfg.spec.window, cfg.spec.capture.max_slots, state.full_to_swa,
                           max_accepted=max(cfg.steps) + 1)
        variant_ops = {"graphcap-skinny-gemm": SKINNY_OPS, "graphcap-torch-ops": TORCH_OPS,
                       "graphcap-skinny-4rows": SKINNY_4ROWS_OPS, "graphcap-qnorm-kernel": QNORM_KERNEL_OPS,
                       "graphcap-two-head-proj": TWO_HEAD_PROJ_OPS}
        loop = DraftLoop(model, wb, *pools, steps=steps, ops=variant_ops.get(name, DEFAULT_OPS),
                         layer_regions=name != "graphcap-inlined-layers")
        note = ""
        try:
            if name == "eager-rebuild":
                runner = RebuildBaseline(loop, graphed=False)
            elif name == "graph-rebuild":
                runner = RebuildBaseline(loop, graphed=True, buckets=buckets)
            elif name == "sglang":
                runner = SglangBaseline(loop, fused_ops(), buckets)
                note = _pdl_note(runner.attention.use_pdl)
            elif name in ("compile", "compile-nosync", "compile-plain", "compile-tuned"):
                plain = name in ("compile-plain", "compile-tuned")
                ops, note = (PLAIN_OPS, "") if plain else _fused_or_torch(notes, cuda)
                if not cuda:
                    note = "; ".join(x for x in (note, "graphcap's torch twins for rebuild and attention (sglang's "
                                                        "kernels need CUDA); Inductor C++, no graphs") if x)
                runner = CompiledBaseline(loop, ops, cfg.batches, sglang_kernels=cuda, warm_slots=state.slots,
                                          host_sync=name == "compile", name=name,
                                          inductor=GPT_FAST_INDUCTOR if name == "compile-tuned" else None)
                if runner.attention is not None:
                    note = "; ".join(x for x in (note, _pdl_note(runner.attention.use_pdl)) if x)
            else:  # graphcap and its variants: compiled per bucket (options refuse that mode for a backend that
                # compiles nothing), or with the skinny GEMM (its loop's ops, above)
                backend = cfg.graphcap_backend
                if not cuda:
                    note = f"backend {backend} (CUDA graphs need CUDA)"
                skinny = name in ("graphcap-skinny-gemm", "graphcap-skinny-4rows")
                if skinny and cfg.spec.torch_dtype() not in SKINNY_DTYPES:
                    note = _join(note, f"{cfg.spec.dtype} spec: cuBLAS projections (the skinny GEMM is bf16/fp16 "
                                       "only), the same loop as graphcap")
                elif skinny and not cuda:
                    note = _join(note, "the skinny GEMM's torch twin (cuBLAS's math) without CUDA")
                sizing = server_compile(cfg.spec, buckets, backend, per_bucket=name == "graphcap-per-bucket")
                runner = DraftGraphs.for_loop(loop, CaptureOptions(backend=backend, buckets=buckets, manifest_path=None,
                                                                   progress=False, **sizing))
        except ImportError as e:
            _note(notes, f"{name} skipped: {e}")
            continue
        modes.append(Mode(name, wb, runner, note))
    return modes


def _pdl_note(on: bool) -> str:
    """sglang's decode kernel launches with programmatic dependent launch where sglang turns it on (compute
    capability >= 9 with the real sgl_kernel, e.g. an H200)."""
    return ("sglang decode with PDL (compute capability >= 9, as sglang with the real sgl_kernel)" if on else
            "sglang decode without PDL (compute capability < 9, as sglang)")


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


@contextlib.contextmanager
def _cpu_settings(cfg: BenchConfig) -> Iterator[None]:
    """Without CUDA, for the run alone (an in-process caller keeps its own): torch's thread count, and Kineto's log
    level - it logs every profiler start and stop to stderr (the host-read count's profiler), between the table's
    lines, read when the first profile starts. With CUDA its warnings say why kernels went uncounted: kept."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        with mock.patch.dict(os.environ, {"KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", "6")}):
            yield
    finally:
        torch.set_num_threads(threads)


def run_bench(cfg: BenchConfig) -> BenchResult:
    if torch.cuda.is_available():
        return _run_bench(cfg)
    with _cpu_settings(cfg):
        return _run_bench(cfg)


def _run_bench(cfg: BenchConfig) -> BenchResult:
    t_start = time.perf_counter()
    spec = cfg.spec
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    notes: list[str] = []
    if not cuda:
        notes.append(CPU_SCOPE)
    growth = growth_tokens(cfg.warmup, cfg.iters, cfg.steps)
    bmax, cmax = max(cfg.batches), max(cfg.contexts)
    state = make_target_state(spec, [cmax] * bmax, cmax + growth, seed=cfg.seed, device=device)
    model = FrozenKVDraft(spec, seed=cfg.seed + 1, device=device)
    copy_gb_s = measure_copy_bandwidth() if cuda else None  # the roofline's ceiling, measured in this run
    g = torch.Generator().manual_seed(cfg.seed + 2)
    rows: list[BenchRow] = []
    captures: dict[str, dict[str, float]] = {}
    points = [(s, c, b) for s in cfg.steps for c in cfg.contexts for b in cfg.batches]
    progress = tqdm(total=len(points) * cfg.repeats, desc="graphcap bench", unit="round", leave=False)
    with progress:
        for steps in cfg.steps:
            modes = build_modes(cfg, model, state, steps, notes)
            if not modes:  # the options refuse modes this machine lacks; this is a mode that failed to build
                why = "; ".join(n for n in notes if " skipped: " in n)
                raise OptionError(f"--modes {','.join(cfg.modes)}: every mode was skipped ({why})")
            for m in modes:
                progress.set_postfix_str(f"capturing {m.name}, steps {steps}")
                t0 = time.perf_counter()
                m.runner.capture()
                m.capture_s = time.perf_counter() - t0
            captures[str(steps)] = {m.name: m.capture_s for m in modes}
            for ctx in cfg.contexts:
                for b in cfg.batches:
                    n = cfg.warmup + 2 + cfg.iters
                    inputs = (torch.randint(1, steps + 2, (n, b), generator=g, dtype=torch.int32).to(device),
                              torch.randint(0, spec.draft.vocab, (n, b), generator=g).to(device),
                              torch.randn(n, b, spec.target.hidden, generator=g).to(device, spec.torch_dtype()))
                    for m in modes:
                        m.samples, m.monitor, m.syncs, m.kernels = [], [], None, None
                    for r in range(cfg.repeats):
                        for m in modes[r % len(modes):] + modes[:r % len(modes)]:  # each mode goes first in turn
                            progress.set_postfix_str(f"steps {steps} ctx {ctx} batch {b} {m.name}")
                            _measure(m, cfg, ctx, state.slots[:b], inputs, cuda)
                        progress.update()
                    rows.extend(_rows(modes, b, ctx, steps, spec.window, copy_gb_s, cfg))
    return BenchResult(environment(cfg.command, spec=spec.name, spec_hash=spec.hash), _config(cfg), tuple(rows),
                       captures, copy_gb_s, tuple(notes), time.perf_counter() - t_start)


def _measure(m: Mode, cfg: BenchConfig, ctx: int, slots: torch.Tensor, inputs: tuple[torch.Tensor, ...],
             cuda: bool) -> None:
    host_slots = slots.tolist()
    m.window.reset(host_slots, [ctx] * len(host_slots))
    accepted, tokens, hidden = inputs

    def it(i: int) -> Callable[[], object]:
        return lambda: m.runner.run(slots, accepted[i], tokens[i], hidden[i], host_slots=host_slots)

    for i in range(cfg.warmup):
        it(i)()
    if m.syncs is None:  # counted at each point, on warm iterations
        m.syncs = count_syncs(it(cfg.warmup), cuda)
        m.kernels = count_kernels(it(cfg.warmup + 1), cuda)
    else:
        it(cfg.warmup)()
        it(cfg.warmup + 1)()
    if cuda:
        torch.cuda.synchronize()
    mon = GpuMonitor() if cuda else None
    with collector_off(), mon or contextlib.nullcontext():
        for i in range(cfg.warmup + 2, cfg.warmup + 2 + cfg.iters):
            m.samples.append(time_call(it(i), cuda))
    if mon is not None:
        m.monitor.append(mon.summary())


def _rows(modes: list[Mode], b: int, ctx: int, steps: int, window: int, copy_gb_s: float | None,
          cfg: BenchConfig) -> list[BenchRow]:
    floor = floor_ms(cfg.spec, b, ctx, steps, copy_gb_s) if copy_gb_s else None
    # checked after measuring: a failed bucket, an oversize call, skipped graphs or a recompile
    lost = {m.name: graph_problem(m.runner) for m in modes}
    rows = []
    for m in modes:
        med, p90 = median_p90([s.wall_ms for s in m.samples])
        gpu = [s.gpu_ms for s in m.samples if s.gpu_ms is not None]
        mons = [x for x in m.monitor if x["util_pct"] is not None]

        def mean(k: str) -> float | None:
            return sum(x[k] for x in mons) / len(mons) if mons else None

        rows.append(BenchRow(
            batch=b, context=ctx, steps=steps, mode=m.name, window=window, wall_ms=med, wall_p90_ms=p90,
            host_ms=median_p90([s.host_ms for s in m.samples])[0], gpu_ms=median_p90(gpu)[0] if gpu else None,
            iter_per_s=1e3 / med, syncs_per_iter=m.syncs.value, syncs_how=m.syncs.how,
            kernels_per_iter=m.kernels.value, kernels_how=m.kernels.how, capture_s=m.capture_s,
            samples=len(m.samples), floor_ms=floor, x_floor=med / floor if floor else None, util_pct=mean("util_pct"),
            power_w=mean("power_w"), sm_mhz=mean("sm_mhz"), note=_join(m.note, _lost_note(lost[m.name]))))
    return [_speedups(r, rows, lost) if r.mode == "graphcap" else r for r in rows]


def _lost_note(problem: str) -> str:
    return f"graphs lost, no speed-up computed with this mode: {problem}" if problem else ""


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _speedups(row: BenchRow, rows: list[BenchRow], lost: dict[str, str]) -> BenchRow:
    """graphcap's speed-up over each baseline measured, None (and said) where either side lost its graphs."""
    if lost.get("graphcap"):
        return row  # every x_* stays None; the row's note says why
    wall = {r.mode: r.wall_ms for r in rows}
    given = {f: wall[base] / row.wall_ms for base, f in SPEEDUP_FIELDS.items() if base in wall and not lost[base]}
    missing = [base for base in SPEEDUP_FIELDS if base in wall and lost[base]]
    note = f"no speed-up over {', '.join(missing)} (its graphs were lost: see its row)" if missing else ""
    return replace(row, **given, note=_join(row.note, note))


def _config(cfg: BenchConfig) -> dict:
    return {"spec": cfg.spec.name, "spec_source": cfg.spec.source, "batches": cfg.batches, "contexts": cfg.contexts,
            "steps": cfg.steps, "modes": cfg.modes, "iters": cfg.iters, "warmup": cfg.warmup,
            "repeats": cfg.repeats, "seed": cfg.seed, "graphcap_backend": cfg.graphcap_backend,
            "threads": cfg.threads, "torch_threads": torch.get_num_threads()}


def main(cfg: BenchConfig) -> int:
    """`graphcap bench`: run, print the table and its notes, write the files."""
    from graphcap.bench.report import footnotes, format_table, write_outputs

    if not torch.cuda.is_available():
        print(CPU_SCOPE, flush=True)  # before the run's minute of compiles: what it will and will not show
    result = run_bench(cfg)
    table = format_table(result.rows)
    print(table)
    print("\n".join(footnotes(result)))
    if cfg.out:
        names = write_outputs(cfg.out, result, table)
        print(f"wrote {', '.join(str(cfg.out / n) for n in names)}")
    else:
        print("note: no files written (--out DIR writes bench.json, bench.csv, bench.md and bench.png there)")
    return 0
