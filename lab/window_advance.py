"""Cost of moving the windows forward (CUDA): one in-place `advance` by the accepted counts against a full rebuild of
the same windows from req_to_token (gather + translate, what sglang's update_sliding_window_buffer does every
iteration), and the rebuild plus sglang's `seq_lens.sum().item()` host sync. W = 1024 by default.

    python lab/window_advance.py --out DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate
from tqdm import tqdm

from graphcap.bench.environment import environment, summary_line
from graphcap.bench.options import OneLineParser
from graphcap.bench.timing import do_bench_ms, host_us
from graphcap.kernels.window.update import window_reset
from graphcap.window import WindowBuffers


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--batches", default="1,8,32,64,256")
    p.add_argument("--contexts", default="256,2048,8192,32768")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("window_advance: needs CUDA", file=sys.stderr)
        return 2
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    w, room = a.window, 16384  # growth room for the advances do_bench repeats
    rows = []
    for ctx, b in tqdm([(c, b) for c in contexts for b in batches], desc="window_advance", leave=False):
        width = ctx + room
        g = torch.Generator(device="cuda").manual_seed(0)
        r2t = torch.randperm(b * width, generator=g, device="cuda").view(b, width).to(torch.int32)
        f2s = torch.randperm(b * width, generator=g, device="cuda")
        wb = WindowBuffers(r2t, w, b, f2s, max_accepted=4)
        slots = torch.arange(b, device="cuda")
        wb.reset(slots.tolist(), [ctx] * b)
        acc = torch.randint(0, 2, (b,), generator=g, device="cuda", dtype=torch.int32)  # mean 0.5 per call
        lens = wb.seq_lens[:b].clone()

        def advance():
            wb.advance(slots, acc)

        def rebuild():
            window_reset(wb.ring, wb.seq_lens, r2t, f2s, slots, lens)

        def rebuild_sync():
            rebuild()
            int(lens.sum().item())

        adv_gpu = do_bench_ms(advance) * 1e3
        reb_gpu = do_bench_ms(rebuild) * 1e3
        rows.append({"batch": b, "context": ctx, "advance_gpu_us": adv_gpu, "advance_host_us": host_us(advance),
                     "rebuild_gpu_us": reb_gpu, "rebuild_host_us": host_us(rebuild),
                     "rebuild_sync_host_us": host_us(rebuild_sync),
                     "advance_gpu_ns_per_row": adv_gpu * 1e3 / b, "rebuild_gpu_ns_per_row": reb_gpu * 1e3 / b})
    hdr = ["batch", "context", "advance GPU us", "advance host us", "rebuild GPU us", "rebuild host us",
           "rebuild+sync host us", "advance ns/row", "rebuild ns/row"]
    table = tabulate([[r["batch"], r["context"], f"{r['advance_gpu_us']:.1f}", f"{r['advance_host_us']:.1f}",
                       f"{r['rebuild_gpu_us']:.1f}", f"{r['rebuild_host_us']:.1f}", f"{r['rebuild_sync_host_us']:.1f}",
                       f"{r['advance_gpu_ns_per_row']:.0f}", f"{r['rebuild_gpu_ns_per_row']:.0f}"] for r in rows],
                     headers=hdr, tablefmt="github")
    a.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    (a.out / "window_advance.md").write_text(f"W = {w}; {summary_line(env)}\n\n{table}\n")
    (a.out / "window_advance.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
