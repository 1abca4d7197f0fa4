"""`graphcap bench`'s output: the table (tabulate), and bench.json / bench.csv / bench.md / bench.png."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

from tabulate import tabulate

from graphcap.bench.environment import summary_line
from graphcap.bench.options import MODES
from graphcap.bench.rows import BenchResult, BenchRow

COLUMNS = ("batch", "ctx", "steps", "mode", "iter/s", "ms/iter", "p90 ms", "GPU ms", "host ms", "syncs/iter",
           "kernels/iter", "x eager-rebuild", "x graph-rebuild", "x sglang", "x compile", "x compile-nosync",
           "x compile-plain", "x compile-tuned", "x per-bucket", "x skinny-gemm", "x skinny-4rows", "x inlined-layers",
           "x torch-ops",
           "x qnorm-kernel", "x two-head-proj", "floor ms", "x floor",
           "util %", "power W")


def _fmt(v: object, digits: int = 2) -> object:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else v


def _cells(r: BenchRow) -> list[object]:
    return [r.batch, r.context, r.steps, r.mode, _fmt(r.iter_per_s, 1), _fmt(r.wall_ms, 3), _fmt(r.wall_p90_ms, 3),
            _fmt(r.gpu_ms, 3), _fmt(r.host_ms, 3), _fmt(r.syncs_per_iter), _fmt(r.kernels_per_iter),
            _fmt(r.x_eager_rebuild), _fmt(r.x_graph_rebuild), _fmt(r.x_sglang), _fmt(r.x_compile),
            _fmt(r.x_compile_nosync), _fmt(r.x_compile_plain), _fmt(r.x_compile_tuned), _fmt(r.x_per_bucket),
            _fmt(r.x_skinny_gemm),
            _fmt(r.x_skinny_4rows), _fmt(r.x_inlined_layers), _fmt(r.x_torch_ops),
            _fmt(r.x_qnorm_kernel), _fmt(r.x_two_head_proj),
            _fmt(r.floor_ms, 3), _fmt(r.x_floor),
            _fmt(r.util_pct, 0), _fmt(r.power_w, 0)]


# What a run without CUDA can and cannot show: the first line it prints, and a note of its record.
CPU_SCOPE = ("CPU run: graphcap's loop runs eagerly, without CUDA graphs, so its ratio against compile says nothing "
             "about GPU speed; this run checks that every mode runs the same draft, counts host reads of tensor "
             "values (syncs on CUDA) and times host-side work at tiny sizes (GPU numbers: scripts/gpu-check.sh bench)")


# Under the table on a CPU, where a skimmer reads the ratios: why graphcap's x compile below 1 there is no regression.
CPU_TABLE_NOTE = ("CPU run: graphcap's mode runs eagerly here, the compile modes run Inductor's C++, both at tiny "
                  "sizes and without CUDA graphs: the ratios time host-side work, and an x below 1 is no regression; "
                  "graphcap's speed claims are measured on a GPU (docs/results.md)")
LEGEND = {"x ": "x <mode>: graphcap's speed-up over that mode at the same batch, context and steps (the mode's ms/iter "
                "over graphcap's; above 1: graphcap is faster)",
          "host ms": "host ms: until the call returned (the host's share of ms/iter; the GPU may still be running)",
          "floor ms": "floor ms: the bytes an iteration must read at the copy bandwidth measured in this run; x floor: "
                      "ms/iter over it"}


def format_table(rows: tuple[BenchRow, ...] | list[BenchRow]) -> str:
    """The rows as a table, with only the columns that hold a value in some row: a speed-up over a mode not run, or a
    GPU's measure on a CPU, is no column."""
    cells = [_cells(r) for r in rows]
    keep = _shown(cells)
    return tabulate([[c[i] for i in keep] for c in cells], headers=[COLUMNS[i] for i in keep], tablefmt="github",
                    disable_numparse=True)


def _shown(cells: list[list[object]]) -> list[int]:
    """The columns with a value in some row; host ms only beside a GPU's time: without an asynchronous device the call
    returns when the iteration is done, and host ms is ms/iter again."""
    device = not cells or any(c[COLUMNS.index("GPU ms")] != "-" for c in cells)
    return [i for i in range(len(COLUMNS)) if (not cells or any(c[i] != "-" for c in cells))
            and (device or COLUMNS[i] != "host ms")]


def legend(result: BenchResult) -> list[str]:
    """One line per kind of column shown that its header does not explain."""
    shown = [COLUMNS[i] for i in _shown([_cells(r) for r in result.rows])]
    return [f"legend: {text}" for start, text in LEGEND.items()
            if any(c.startswith(start) and c != "x floor" for c in shown)]


def headline(result: BenchResult) -> str | None:
    """The line printed above everything else: what this run can show, where that is limited (a CPU run)."""
    return CPU_SCOPE if CPU_SCOPE in result.notes else None


def footnotes(result: BenchResult) -> list[str]:
    """The legend, on a CPU what its ratios are not, the notes (but the headline), then how each count shown was made,
    once per distinct way."""
    lines = legend(result) + ([f"note: {CPU_TABLE_NOTE}"] if headline(result) else [])
    lines += [f"note: {n}" for n in result.notes if n != headline(result)]
    shown = {COLUMNS[i] for i in _shown([_cells(r) for r in result.rows])}
    seen: set[str] = set()
    for r in result.rows:
        for text in (f"{r.mode}: {r.note}" if r.note else "",
                     f"syncs/iter: {r.syncs_how}" if "syncs/iter" in shown else "",
                     f"kernels/iter: {r.kernels_how}" if "kernels/iter" in shown else ""):
            if text and text not in seen:
                seen.add(text)
                lines.append(f"note: {text}")
    lines.append(f"note: whole run {result.wall_s:.1f} s (capture: " + "; ".join(
        f"steps {s}: " + ", ".join(f"{m} {t:.1f} s" for m, t in c.items()) for s, c in result.captures_s.items())
        + ")")
    return lines


def write_outputs(out: Path, result: BenchResult, table: str) -> list[str]:
    """Writes the files; returns their names."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result.as_dict(), indent=1, default=str))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[x.name for x in dataclasses.fields(BenchRow)])
        w.writeheader()
        w.writerows(r.as_dict() for r in result.rows)
    env = result.environment
    scope = headline(result)
    head = [f"# graphcap bench, {env['date']}", "", *([scope, ""] if scope else []), f"- command: `{env['command']}`",
            f"- {summary_line(env)}",
            f"- spec: {env['spec']} ({env['spec_hash']})",
            *([f"- copy bandwidth (roofline ceiling, measured in this run): {result.copy_gb_s:.0f} GB/s"]
              if result.copy_gb_s else []), ""]
    (out / "bench.md").write_text("\n".join(head + [table, ""] + footnotes(result)) + "\n")
    names = ["bench.json", "bench.csv", "bench.md"]
    if _plot(out / "bench.png", result.rows):
        names.append("bench.png")
    return names


def _plot(path: Path, rows: tuple[BenchRow, ...]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install graphcap[plot])", file=sys.stderr)
        return False
    groups = sorted({(r.steps, r.context) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.8), squeeze=False)
    for ax, (steps, ctx) in zip(axes[0], groups):
        for mode in MODES:
            pts = sorted((r.batch, r.iter_per_s) for r in rows if r.mode == mode and r.steps == steps
                         and r.context == ctx)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set(xscale="log", xlabel="batch", ylabel="draft iterations / s", title=f"steps {steps}, context {ctx}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
