"""The small top-k kernel's two paths (`graphcap/kernels/small_topk.py`: k argmax rounds, or the bitonic top-k) and
torch.topk at the draft head's two selections - 33 of 2048 centroid scores and 2 of 4096 candidate logits - and the
crossed pairs (2 of 2048, 33 of 4096), fp32 and bf16, batches 1..64.

Each call runs inside a CUDA graph among 256 MB reads (bench/attention_bw.py's in_graph_us), as the draft iteration
runs it. Both paths' indices must equal torch.topk's where the row has no ties (random fp32 rows) and each other's
everywhere; a mismatch stops the run. Reported: microseconds per call for each, and which path `_launch` picks
(BITONIC_MIN_K).

    python bench/small_topk.py --out DIR     # CUDA only; writes small_topk.json into DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from graphcap.bench import environment as bench_env
from graphcap.bench.options import OneLineParser
from graphcap.kernels.small_topk import BITONIC_MIN_K, _launch

SHAPES = ((2048, 33), (4096, 2), (2048, 2), (4096, 33))  # (N, k): the head's two, then crossed
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", type=Path, default=Path("out/small-topk"))
    a = ap.parse_args(argv)
    try:
        batches = [int(b) for b in a.batches.split(",")]
        dtypes = [DTYPES[d] for d in a.dtypes.split(",")]
        assert batches and min(batches) > 0
    except (ValueError, KeyError, AssertionError):
        ap.error(f"--batches: positive ints, --dtypes: of {','.join(DTYPES)}; got {a.batches!r}, {a.dtypes!r}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the kernel's two paths on the GPU are what is measured)")
    from attention_bw import in_graph_us  # bench/: the script's directory is on sys.path

    rows = []
    for n, k in SHAPES:
        for dtype in dtypes:
            for batch in batches:
                g = torch.Generator(device="cuda").manual_seed(batch * n + k)
                x = torch.randn(batch, n, generator=g, device="cuda").to(dtype)
                rounds, bitonic = _launch(x, k, False), _launch(x, k, True)
                if not (torch.equal(rounds[1], bitonic[1]) and torch.equal(rounds[0], bitonic[0])):
                    raise SystemExit(f"small_topk: the two paths differ at N {n}, k {k}, {dtype}, batch {batch}")
                if dtype == torch.float32 and not torch.equal(rounds[1], torch.topk(x, k, dim=-1).indices):
                    raise SystemExit(f"small_topk: indices differ from torch.topk at N {n}, k {k}, batch {batch}")
                us = {"rounds": in_graph_us(lambda: _launch(x, k, False)),
                      "bitonic": in_graph_us(lambda: _launch(x, k, True)),
                      "torch": in_graph_us(lambda: torch.topk(x, k, dim=-1))}
                row = {"n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                       "us": {name: round(v, 2) for name, v in us.items()},
                       "picked": "bitonic" if k >= BITONIC_MIN_K else "rounds"}
                rows.append(row)
                print(json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "small_topk.json").write_text(json.dumps(
        {"environment": bench_env.environment(), "bitonic_min_k": BITONIC_MIN_K, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
