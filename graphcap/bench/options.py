"""`graphcap bench`: draft-phase iterations/s against batch size (and context, steps), graphcap against the
sglang-style baselines, in one process, on the same target state, modes interleaved so machine drift hits all.

Modes:
- eager-rebuild: graphcap's model and kernels driven like sglang 0.5.18 at one step (window rebuilt from scratch
  every iteration, `.item()` sync, steps eager);
- graph-rebuild: the same, steps replayed from one CUDA graph (sglang 0.5.23); against graphcap it isolates what
  in-graph metadata and no sync buy;
- sglang: steps in plain torch ops with sglang's own Triton decode kernel over CSR lists rebuilt by sglang's own index
  builder, `.item()` sync, steps in one CUDA graph (where sglang's kernels import);
- graphcap: one replay per iteration with the spec's capture backend (inductor-cudagraph by default), window advanced
  in place inside it (on a CPU: Inductor-compiled, no graphs - graphs need CUDA).
Every iteration is a real one: random accepted counts in [1, steps + 1] per row advance the state (their KV locations
are already allocated in req_to_token, as after a verify), so windows slide and wrap as in serving.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from graphcap.spec import CaptureSpec, load_spec

MODES = ("eager-rebuild", "graph-rebuild", "sglang", "graphcap")
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXTS = (256, 1024, 2048, 4096)


@dataclass(frozen=True)
class BenchConfig:
    spec: CaptureSpec
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: tuple[int, ...]
    modes: tuple[str, ...]
    iters: int
    warmup: int
    repeats: int
    out: Path | None
    seed: int


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit status 2, no usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> BenchConfig:
    import torch

    cuda = torch.cuda.is_available()
    p = _Parser(prog="graphcap bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=None, help="capture spec file or built-in name (default: gemma4-31b-assistant "
                                                "with CUDA, tiny without)")
    p.add_argument("--batch", type=_ints, default=None, help="batch sizes, e.g. 1,2,4,8 (default: 1..64 within the "
                                                             "spec's buckets)")
    p.add_argument("--context", type=_ints, default=None, help="context lengths at the start of each measured run (default: "
                   f"{','.join(map(str, DEFAULT_CONTEXTS))}, those the spec's max_context leaves room for)")
    p.add_argument("--steps", type=_ints, default=None, help="draft steps (default: the spec's)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--iters", type=int, default=50 if cuda else 4, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=5 if cuda else 1)
    p.add_argument("--repeats", type=int, default=3 if cuda else 1, help="interleaved rounds over the modes")
    p.add_argument("--out", type=Path, default=None, help="directory for bench.json, bench.csv, bench.md, bench.png")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    spec = load_spec(a.spec or ("gemma4-31b-assistant" if cuda else "tiny"))
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown mode {unknown[0]!r}; expected some of {', '.join(MODES)}")
    steps = a.steps or (spec.capture.steps,)
    growth = growth_tokens(a.warmup, a.iters, steps)
    room = spec.capture.max_context - growth
    batches = a.batch or tuple(b for b in DEFAULT_BATCHES if b <= spec.capture.buckets[-1])
    if a.context:
        contexts = a.context
    else:
        contexts = tuple(c for c in DEFAULT_CONTEXTS if c <= room) or tuple(
            c for c in (spec.window // 2, spec.window, 2 * spec.window, 4 * spec.window) if 1 <= c <= room)
    if not contexts:
        p.error(f"spec {spec.name}: max_context {spec.capture.max_context} leaves no room for a context plus the "
                f"{growth} tokens {a.warmup} + {a.iters} iterations grow it by; lower --iters or pass --context")
    if max(contexts) > room:
        p.error(f"--context {max(contexts)} + {growth} tokens of growth exceeds max_context "
                f"{spec.capture.max_context} of spec {spec.name}")
    if max(batches) > spec.capture.max_slots:
        p.error(f"--batch {max(batches)} exceeds max_slots {spec.capture.max_slots} of spec {spec.name}")
    if min(a.iters, a.repeats) < 1 or a.warmup < 0:
        p.error("--iters and --repeats must be >= 1, --warmup >= 0")
    return BenchConfig(spec, tuple(batches), tuple(contexts), tuple(steps), modes, a.iters, a.warmup, a.repeats,
                       a.out, a.seed)


def growth_tokens(warmup: int, iters: int, steps: tuple[int, ...]) -> int:
    """Most tokens a row can gain in one measured run: warm-up, the one iteration whose syncs are counted, the
    measured ones, each accepting up to steps + 1. Rows are allocated this much past the context."""
    return (warmup + 1 + iters) * (max(steps) + 1)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    from graphcap.bench_runner import run_bench

    result = run_bench(cfg)
    table = format_table(result["rows"])
    print(table)
    for note in result["notes"]:
        print(f"note: {note}")
    if cfg.out:
        write_outputs(cfg.out, result, table)
        print(f"wrote {cfg.out}/bench.json, bench.csv, bench.md" + (", bench.png" if result.get("plot") else ""))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# output

COLUMNS = ["batch", "ctx", "steps", "mode", "iter/s", "ms/iter", "p90 ms", "GPU ms", "host ms", "syncs/iter",
           "x eager-rebuild", "x graph-rebuild", "x sglang", "floor ms", "x floor", "util %", "power W", "W"]


def _fmt(v, digits=2):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else v


def format_table(rows: list[dict]) -> str:
    body = [[r["batch"], r["context"], r["steps"], r["mode"], _fmt(r["iter_per_s"], 1), _fmt(r["wall_ms"], 3),
             _fmt(r["wall_p90_ms"], 3), _fmt(r["gpu_ms"], 3), _fmt(r["host_ms"], 3), _fmt(r["syncs_per_iter"]),
             _fmt(r.get("speedup_vs_eager-rebuild")), _fmt(r.get("speedup_vs_graph-rebuild")),
             _fmt(r.get("speedup_vs_sglang")), _fmt(r.get("floor_ms"), 3), _fmt(r.get("x_floor")), _fmt(r["util_pct"], 0), _fmt(r["power_w"], 0), r["window"]]
            for r in rows]
    return tabulate(body, headers=COLUMNS, tablefmt="github")


def write_outputs(out: Path, result: dict, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    with open(out / "bench.csv", "w", newline="") as f:
        keys = sorted({k for r in result["rows"] for k in r})
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(result["rows"])
    env = result["environment"]
    head = [f"# graphcap bench, {env['date']}", "", f"- command: `{env['command']}`",
            f"- device: {env['device']}, driver {env['driver']}, torch {env['torch_version']}, "
            f"triton {env['triton_version']}", f"- spec: {env['spec']} ({env['spec_hash']})",
            f"- copy bandwidth (roofline ceiling, measured in this run): {result.get('copy_gb_s') or '-'} GB/s", ""]
    (out / "bench.md").write_text("\n".join(head + [table, ""] + [f"note: {n}" for n in result["notes"]]) + "\n")
    result["plot"] = _plot(out / "bench.png", result["rows"])


def _plot(path: Path, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install graphcap[plot])", file=sys.stderr)
        return False
    groups = sorted({(r["steps"], r["context"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.8), squeeze=False)
    for ax, (steps, ctx) in zip(axes[0], groups):
        for mode in MODES:
            pts = sorted((r["batch"], r["iter_per_s"]) for r in rows
                         if r["mode"] == mode and r["steps"] == steps and r["context"] == ctx)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set(xscale="log", xlabel="batch", ylabel="draft iterations / s", title=f"steps {steps}, context {ctx}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def summarize(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))]


def environment(cfg: BenchConfig) -> dict:
    from graphcap import manifest as mf

    env = mf.environment()
    env.update(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), spec=cfg.spec.name,
               spec_hash=cfg.spec.hash, command="graphcap bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                                                             else sys.argv[1:]))
    return env


def count_syncs(fn) -> int:
    """Device-to-host syncs issued by one call, counted by CUDA's sync debug mode (not guessed)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


__all__ = ["BenchConfig", "main", "parse_args", "format_table"]
