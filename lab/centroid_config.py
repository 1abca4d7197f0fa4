"""The centroid head's scoring kernel (`graphcap/kernels/head/centroid.py`) over its launch configurations: tokens per
program (BLOCK_T), hidden columns per loop iteration (BLOCK_H) and warps, at the spec's head (2048 clusters of 128
tokens, hidden 1536, top 32 per row: a row's choices read 12.6 MB of lm_head rows) and batches 1..64.

Each call runs as one node sequence inside a CUDA graph, 8 times among 256 MB reads (lab/graph_timing.py's
in_graph_us), so no launch latency and an L2 holding other data, as in the draft iteration. Choices are each
row's top 32 of random scores, in two distributions:
- uniform: independent rows;
- shared: a bias common to all rows added (scores = row noise + 2 x shared noise), so the rows of a batch agree more.
Reported per batch and distribution: distinct clusters, microseconds per call for each configuration (uniform only
for all but the shipped one), and two floors at the copy bandwidth measured in the same run: every choice's bytes,
and the distinct clusters' bytes (what a kernel reading each chosen cluster once per batch would need). Each
configuration's output is checked against the shipped one's within fp32 rounding (another block sums in another
order).

    python lab/centroid_config.py --out DIR     # CUDA only; writes centroid_config.json into DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from graphcap.bench import environment as bench_env
from graphcap.bench.options import OneLineParser
from graphcap.kernels.head.centroid import BLOCK_H, BLOCK_T, NUM_WARPS, launch

CLUSTERS, TOKENS, HIDDEN, TOP = 2048, 128, 1536, 32
DISTRIBUTIONS = ("uniform", "shared")
SHIPPED = (BLOCK_T, BLOCK_H, NUM_WARPS)


def choices(batch: int, distribution: str, g: torch.Generator) -> torch.Tensor:
    scores = torch.randn(batch, CLUSTERS, generator=g, device="cuda")
    if distribution == "shared":
        scores += 2.0 * torch.randn(CLUSTERS, generator=g, device="cuda")
    return torch.topk(scores, TOP, dim=-1).indices


def name(config: tuple[int, int, int]) -> str:
    return "x".join(map(str, config))


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--configs", default="16x256x4,32x256x4,32x128x4,16x512x8,32x256x8,64x128x8,8x512x4,4x256x1",
                    help="BLOCK_TxBLOCK_HxWARPS list besides the shipped one")
    ap.add_argument("--out", type=Path, default=Path("out/centroid-config"))
    a = ap.parse_args(argv)
    try:
        configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",") if c]
        assert all(len(c) == 3 and min(c) > 0 for c in configs)
    except (ValueError, AssertionError):
        ap.error(f"--configs: a list of BLOCK_TxBLOCK_HxWARPS, e.g. 16x256x4; got {a.configs!r}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the kernel's launch configurations are what is measured)")
    from graph_timing import copy_bandwidth, in_graph_us

    gbs = copy_bandwidth()
    lm_head = torch.randn(CLUSTERS * TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
    cluster_bytes = TOKENS * HIDDEN * lm_head.element_size()
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        for dist in DISTRIBUTIONS:
            g = torch.Generator(device="cuda").manual_seed(batch)
            x = torch.randn(batch, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
            top = choices(batch, dist, g)
            shipped = launch(lm_head, x, top, TOKENS, *SHIPPED)
            us = {name(SHIPPED): in_graph_us(lambda: launch(lm_head, x, top, TOKENS, *SHIPPED))}
            for config in configs if dist == "uniform" else ():
                torch.testing.assert_close(launch(lm_head, x, top, TOKENS, *config), shipped, rtol=1e-4, atol=1e-4)
                us[name(config)] = in_graph_us(lambda c=config: launch(lm_head, x, top, TOKENS, *c))
            distinct = int(torch.unique(top).numel())
            row = {"batch": batch, "distribution": dist, "distinct_clusters": distinct,
                   "us": {k: round(v, 2) for k, v in us.items()},
                   "floor_every_choice_us": round(batch * TOP * cluster_bytes / gbs / 1e3, 2),
                   "floor_distinct_us": round(distinct * cluster_bytes / gbs / 1e3, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "centroid_config.json").write_text(json.dumps(
        {"environment": bench_env.environment(), "copy_gbs": round(gbs, 1), "shipped": name(SHIPPED), "rows": rows},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
