"""Warps per program of graphcap's one-program-per-row kernels, at the draft's sizes: the small top-k (33 of 2048 centroid
scores, 2 of 4096 candidate logits, fp32; `graphcap/kernels/head/small_topk.py`) and the layer's two norm chains over
a 1536-wide bf16 row (`norm_add_norm`, `norm_add_scale_norm`; `graphcap/kernels/elementwise/layer_fusions.py`),
batches 1..64.

Each launch runs inside a CUDA graph among 256 MB reads (lab/graph_timing.py's in_graph_us), as the draft iteration
runs it. A warp count changes no top-k result (an argmax per round, ties to the smallest index) and may change a norm's
fp32 sums' order: each launch's output is checked against the shipped launch's (top-k exactly, norms within one bf16
rounding). Reported: microseconds per launch for each warp count, and the shipped count.

    python lab/row_kernels.py --out DIR     # CUDA only; writes row_kernels.json into DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

from graphcap.bench import environment as bench_env
from graphcap.bench.options import OneLineParser
from graphcap.kernels.elementwise import layer_fusions as lf
from graphcap.kernels.head import small_topk as st

HIDDEN, EPS = 1536, 1e-6
TOPK = ((2048, 33), (4096, 2))


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--warps", default="1,2,4,8,16")
    ap.add_argument("--out", type=Path, default=Path("out/row-kernels"))
    a = ap.parse_args(argv)
    try:
        batches = [int(b) for b in a.batches.split(",")]
        warps = [int(w) for w in a.warps.split(",")]
    except ValueError:
        batches = warps = []
    # an explicit check, not an assert: `python -O` would drop that and launch with a bad warp count
    if not (batches and warps and min(batches) > 0 and all(w in (1, 2, 4, 8, 16, 32) for w in warps)):
        ap.error(f"--batches: positive ints, --warps: powers of two up to 32; got {a.batches!r}, {a.warps!r}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (launch configurations on the GPU are what is measured)")
    from graph_timing import in_graph_us

    rows = []

    def record(kernel: str, batch: int, shipped: int, timed: dict[int, float]) -> None:
        row = {"kernel": kernel, "batch": batch, "shipped_warps": shipped,
               "us": {str(w): round(v, 2) for w, v in timed.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)

    for batch in batches:
        g = torch.Generator(device="cuda").manual_seed(batch)
        for n, k in TOPK:
            x = torch.randn(batch, n, generator=g, device="cuda")
            shipped = st.warps_for(max(16, triton.next_power_of_2(n)))
            want = st.launch(x, k)
            timed = {}
            for w in warps:
                got = st.launch(x, k, w)
                if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                    raise SystemExit(f"row_kernels: top-k {k} of {n} at {w} warps differs from {shipped} warps")
                timed[w] = in_graph_us(lambda w=w: st.launch(x, k, w))
            record(f"small_topk {k} of {n}", batch, shipped, timed)
        x, res = (torch.randn(batch, HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(2))
        w1, w2 = (0.1 * torch.randn(HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(2))
        scalar = torch.rand(1, generator=g, device="cuda").bfloat16() + 0.5
        shipped = lf.warps_for(triton.next_power_of_2(HIDDEN))
        for kernel, fn in (("norm_add_norm", lambda w: lf.launch_norm_add_norm(x, res, w1, w2, EPS, w)),
                           ("norm_add_scale_norm",
                            lambda w: lf.launch_norm_add_scale_norm(x, w1, res, scalar, w2, EPS, w))):
            want = fn(None)
            timed = {}
            for w in warps:
                for got_t, want_t in zip(fn(w), want):  # another sum order: at most one bf16 rounding apart
                    torch.testing.assert_close(got_t.float(), want_t.float(), rtol=1e-2, atol=1e-2)
                timed[w] = in_graph_us(lambda w=w: fn(w))
            record(kernel, batch, shipped, timed)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "row_kernels.json").write_text(json.dumps(
        {"environment": bench_env.environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
