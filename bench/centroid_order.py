"""The centroid head's scoring launched row-major against cluster-major (`centroid_logits(cluster_major=True)`): does
ordering the programs by cluster let HBM serve each chosen cluster about once per batch?

At the spec's head (2048 clusters of 128 tokens, hidden 1536, top 32 per row) a row's choices read 12.6 MB of
lm_head rows; rows of one batch share clusters (uniform choices at batch 64: about 1300 distinct of 2048). Each call
runs as one node sequence inside a CUDA graph, 8 times among 256 MB reads (bench/attention_bw.py's in-graph timing),
at each batch, for two choice distributions:
- uniform: each row's top 32 of random scores;
- shared: the same with a bias common to all rows added (scores = row noise + 2 x shared noise), so rows agree more,
  as rows of one batch may where the drafts share a topic.
Reported per batch: distinct clusters, microseconds per call each way (cluster-major includes its argsort), and
two floors at the copy bandwidth measured in the same run: every choice's bytes, and the distinct clusters' bytes.
`--configs` also times the kernel's other launch configurations (tokens per program, hidden columns per loop
iteration, warps) in both orders, uniform choices only: the shipped one is BLOCK_T / BLOCK_H / 4 warps.

    python bench/centroid_order.py --out DIR     # CUDA only; writes centroid_order.json into DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from graphcap.bench import environment as bench_env
from graphcap.bench.options import OneLineParser
from graphcap.kernels.centroid_head import BLOCK_H, BLOCK_T, _launch, centroid_logits

CLUSTERS, TOKENS, HIDDEN, TOP = 2048, 128, 1536, 32
DISTRIBUTIONS = ("uniform", "shared")


def in_graph_us(fn) -> float:
    """Microseconds of `fn` among 256 MB reads, over the reads alone (attention_bw.in_graph_ms), after a warm-up."""
    from attention_bw import in_graph_ms  # bench/: the script's directory is on sys.path
    fn()
    torch.cuda.synchronize()
    return in_graph_ms(fn, 200.0) * 1e3


def choices(batch: int, distribution: str, g: torch.Generator) -> torch.Tensor:
    scores = torch.randn(batch, CLUSTERS, generator=g, device="cuda")
    if distribution == "shared":
        scores += 2.0 * torch.randn(CLUSTERS, generator=g, device="cuda")
    return torch.topk(scores, TOP, dim=-1).indices


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--configs", default="16x256x4,32x256x4,32x128x4,16x512x8,32x256x8,64x128x8,8x256x2",
                    help="BLOCK_TxBLOCK_HxWARPS list ('' for none)")
    ap.add_argument("--out", type=Path, default=Path("out/centroid-order"))
    a = ap.parse_args(argv)
    try:
        configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",") if c]
        assert all(len(c) == 3 and min(c) > 0 for c in configs)
    except (ValueError, AssertionError):
        ap.error(f"--configs: a list of BLOCK_TxBLOCK_HxWARPS, e.g. 16x256x4; got {a.configs!r}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the kernel's launch order is what is measured)")
    from attention_bw import copy_bandwidth

    gbs = copy_bandwidth(200.0)
    lm_head = torch.randn(CLUSTERS * TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
    cluster_bytes = TOKENS * HIDDEN * lm_head.element_size()
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        for dist in DISTRIBUTIONS:
            g = torch.Generator(device="cuda").manual_seed(batch)
            x = torch.randn(batch, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
            top = choices(batch, dist, g)
            row_major = centroid_logits(lm_head, x, top, TOKENS)
            assert torch.equal(centroid_logits(lm_head, x, top, TOKENS, cluster_major=True), row_major)
            distinct = int(torch.unique(top).numel())
            us = {order: in_graph_us(lambda cm=cm: centroid_logits(lm_head, x, top, TOKENS, cluster_major=cm))
                  for order, cm in (("row_major", False), ("cluster_major", True))}
            row = {"batch": batch, "distribution": dist, "distinct_clusters": distinct,
                   "us": {k: round(v, 2) for k, v in us.items()},
                   "cluster_major_over_row_major": round(us["cluster_major"] / us["row_major"], 3),
                   "floor_every_choice_us": round(batch * TOP * cluster_bytes / gbs / 1e3, 2),
                   "floor_distinct_us": round(distinct * cluster_bytes / gbs / 1e3, 2)}
            if dist == "uniform":
                for bt, bh, w in configs:  # another block changes the fp32 sums' order: each config's own bits
                    mine = _launch(lm_head, x, top, TOKENS, False, bt, bh, w)
                    torch.testing.assert_close(mine, row_major, rtol=1e-4, atol=1e-4)
                    for order, cm in (("row_major", False), ("cluster_major", True)):
                        call = lambda: _launch(lm_head, x, top, TOKENS, cm, bt, bh, w)  # noqa: E731
                        assert torch.equal(call(), mine)
                        row["us"][f"{bt}x{bh}x{w}:{order}"] = round(in_graph_us(call), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "centroid_order.json").write_text(json.dumps(
        {"environment": bench_env.environment(), "copy_gbs": round(gbs, 1), "shipped": f"{BLOCK_T}x{BLOCK_H}x4",
         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
