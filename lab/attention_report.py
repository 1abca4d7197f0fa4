"""attention_bw's outputs: attention_bw.{md,csv,json} and the markdown table."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from tabulate import tabulate

from graphcap.bench import environment as bench_env

def write(out: Path | None, env: dict, rows: list[dict], notes: list[str]) -> None:
    if out is None or not rows:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_bw.md").write_text(render(env, rows, notes))
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(out / "attention_bw.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    (out / "attention_bw.json").write_text(json.dumps({"env": env, "rows": rows, "notes": notes}, indent=1))


L2_TEXT = {
    "dirty": "replayed in a CUDA graph, L2 emptied before each call by writing 256 MB (triton's do_bench)",
    "clean": "replayed in a CUDA graph, L2 emptied before each call by reading 256 MB",
    "in-graph": "inside a CUDA graph of 8 x (read 256 MB, call), the reads' own graph time subtracted",
}


def render(env: dict, rows: list[dict], notes: list[str]) -> str:
    head = ["layer", "B", "ctx", "MB K+V", "ours default us (splits)", "GB/s", "% copy", "ours best us", "GB/s", "% copy",
            "best config (splits)", "sglang us (best of 8/16/32)", "sglang GB/s", "sglang / ours best",
            "sglang / ours default", "ours eager us", "err vs sglang", "err vs f64"]
    body = []
    for r in rows:
        sg = r.get("sglang_best_us")
        cells = [r["layer"], r["batch"], r["ctx"], r["mbytes"], f"{r['default_us']} ({r['splits']})", r["default_gbps"],
                 r["default_pct_copy"], r["best_us"], r["best_gbps"], r["best_pct_copy"],
                 f"{r['best_config']} ({r['best_splits']})"]
        if sg is not None:
            cells += [f"{sg} ({r['sglang_best_splits']})", r["sglang_best_gbps"], f"{r['speedup_best_vs_sglang']}x",
                      f"{r['speedup_default_vs_sglang']}x"]
        else:
            cells += ["-"] * 4
        cells += [r["eager_us"], f"{r['err_vs_sglang']:.1e}" if "err_vs_sglang" in r else "-", f"{r['err_ref']:.1e}"]
        body.append(cells)
    lines = [f"# decode attention bandwidth ({env['device']}, {env['date']})", "",
             f"{bench_env.summary_line(env)}; sglang kernel: {env['sglang_kernel']}; copy bandwidth "
             f"{env.get('copy_gbps')} GB/s (read + write); {env.get('elapsed_s')} s. Times: median GPU time of one call "
             f"{L2_TEXT.get(env.get('l2', 'dirty'), '?')} (--l2 {env.get('l2', 'dirty')}); 'eager' = the registered op "
             "called from Python.", "", tabulate(body, headers=head, tablefmt="github", disable_numparse=True)]
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
