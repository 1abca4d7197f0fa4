"""Does programmatic dependent launch (PDL) shorten a chain of dependent, memory-bound kernels replayed in a CUDA
graph, and by how much per launch? An experiment for the draft iteration (issue 53: at batch 8 the served draft runs
207 launches, ~1.5 ms of kernel time in a ~1.8 ms span on the H200, so ~1.5 us passes between two kernels).

The chain: L GEMV-like kernels (y = x W^T, M rows, bf16, fp32 accumulation), each reading the previous one's output
and weights of its own, alternating the draft MLP's shapes (1536 -> 6144 -> 1536 ...), captured in one CUDA graph and timed in-graph among
256 MB reads (lab/graph_timing.py). Variants of the same kernel and arithmetic:
- off: launched as today;
- pdl: launched with PDL; each program waits for the previous kernel (`gdc_wait`) before reading anything, then
  lets the next kernel launch (`gdc_launch_dependents`);
- pdl-prefetch: as pdl, with the first weight tile loaded before the wait (weights are never written by an earlier
  kernel, so their load may start while the previous kernel finishes);
- pdl-late: as pdl, the next kernel let launch only after this one's loop (its programs then do not hold SMs while
  this one streams).
Every variant's output is compared with `off`'s bit for bit; the floor is the weights' bytes over the copy bandwidth.

    python lab/pdl_chain.py --out DIR [--batches 1,8] [--launches 48]   # CUDA sm_90+ only; writes pdl_chain.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from graphcap.bench.options import OneLineParser
from graphcap.kernels.gemm.skinny_kernels import round_to

SHAPES = ((6144, 1536), (1536, 6144))  # (N, K): the draft MLP's up and down widths, alternating
VARIANTS = ("off", "pdl", "pdl-prefetch", "pdl-late")
BLOCK_N, BLOCK_K = 64, 128


@triton.jit
def _chain_gemv_kernel(x, w, y, N, K, M, stride_x, stride_w, stride_y, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr, PREFETCH: tl.constexpr,
                       LATE: tl.constexpr, F32_DOT: tl.constexpr):
    # program n: rows [n0, n0 + BLOCK_N) of W against every row of x (M <= BLOCK_M); the first K tile peeled in
    # every variant, so all of them run the same arithmetic
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_ptr = w + offs_n[:, None] * stride_w + offs_k[None, :]
    x_ptr = x + offs_m[None, :] * stride_x + offs_k[:, None]
    if PREFETCH:  # the weights' first tile: written by no earlier kernel, so loaded before the wait
        w0 = tl.load(w_ptr, mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        if not LATE:
            tl.extra.cuda.gdc_launch_dependents()
    if not PREFETCH:
        w0 = tl.load(w_ptr, mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
    x0 = tl.load(x_ptr, mask=mask_m[None, :] & (offs_k < K)[:, None], other=0.0)
    # F32_DOT: Triton's interpreter (CPU) computes bf16 dots wrongly and truncates fp32 -> bf16: fp32 tiles there,
    # and round_to's rounding to nearest on the bits
    if F32_DOT:
        acc = tl.dot(w0.to(tl.float32), x0.to(tl.float32))
    else:
        acc = tl.dot(w0, x0)
    for k in range(BLOCK_K, K, BLOCK_K):
        wt = tl.load(w_ptr + k, mask=mask_n[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
        xt = tl.load(x_ptr + k, mask=mask_m[None, :] & ((k + offs_k) < K)[:, None], other=0.0)
        if F32_DOT:
            acc = tl.dot(wt.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(wt, xt, acc)
    if GDC and LATE:
        tl.extra.cuda.gdc_launch_dependents()
    y_ptr = y + offs_m[None, :] * stride_y + offs_n[:, None]
    tl.store(y_ptr, round_to(acc, y.dtype.element_ty, F32_DOT), mask=mask_n[:, None] & mask_m[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, variant: str = "off") -> torch.Tensor:
    """y [M, N] = x [M, K] @ w [N, K]^T, launched as `variant` (VARIANTS)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: one of {', '.join(VARIANTS)}, got {variant!r}")
    m, k = x.shape
    n = w.shape[0]
    gdc = variant != "off"
    extra = {"launch_pdl": True} if gdc else {}
    _chain_gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, w, y, n, k, m, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GDC=gdc, PREFETCH=variant == "pdl-prefetch", LATE=variant == "pdl-late",
        F32_DOT=not x.is_cuda, num_warps=4, num_stages=3, **extra)
    return y


class Chain:
    """`launches` dependent GEMVs over static buffers: x0 -> h1 -> h2 ..., SHAPES alternating, each launch its own
    weights (as each of the draft's projections has: together they do not fit in L2)."""

    def __init__(self, batch: int, launches: int, device: str, seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.weights = [torch.randn(n, k, generator=g, device=device).div_(k ** 0.5).to(torch.bfloat16)
                        for n, k in (SHAPES[i % 2] for i in range(launches))]
        self.x0 = torch.randn(batch, SHAPES[0][1], generator=g, device=device).to(torch.bfloat16)
        self.outs = [torch.empty(batch, SHAPES[i % 2][0], device=device, dtype=torch.bfloat16)
                     for i in range(launches)]

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    def run(self, variant: str) -> torch.Tensor:
        x = self.x0
        for i, y in enumerate(self.outs):
            x = gemv(x, self.weights[i], y, variant)
        return x


def measure(batches: list[int], launches: int, rep_ms: float) -> dict:
    from graph_timing import copy_bandwidth, in_graph_us

    bw = copy_bandwidth()
    rows = []
    for b in batches:
        chain = Chain(b, launches, "cuda", seed=b)
        base = chain.run("off").clone()
        floor_us = chain.weight_bytes() / (bw * 1e3)  # the bytes at the copy's rate (reads + writes), as the benches
        for v in VARIANTS:
            row = {"batch": b, "variant": v, "launches": launches}
            try:
                same = bool(torch.equal(chain.run(v), base))
                us = in_graph_us(lambda: chain.run(v), rep_ms)
            except Exception as e:  # a launch or capture this torch/Triton/driver refuses is the answer for it
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                rows.append(row)
                continue
            row.update(us=round(us, 1), us_per_launch=round(us / launches, 2), floor_us=round(floor_us, 1),
                       x_floor=round(us / floor_us, 2), bits_equal_off=same)
            rows.append(row)
        off = next(r for r in rows if r["batch"] == b and r["variant"] == "off")
        for r in rows:
            if r["batch"] == b and "us" in r and "us" in off:
                r["saved_us_per_launch"] = round((off["us"] - r["us"]) / launches, 2)
    return {"copy_gb_s": round(bw, 1), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="lab/pdl_chain.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for pdl_chain.json")
    ap.add_argument("--batches", default="1,8", help="rows M per GEMV (1..16), comma-separated")
    ap.add_argument("--launches", type=int, default=48, help="kernels in the chain")
    ap.add_argument("--rep-ms", type=float, default=200.0)
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",") if x.strip()]
    except ValueError:
        batches = []
    if not batches or not all(1 <= b <= 16 for b in batches):
        ap.error(f"--batches: rows between 1 and 16, comma-separated; got {a.batches!r}")
    if a.launches < 2:
        ap.error(f"--launches: a chain of at least 2 kernels, got {a.launches}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        ap.error("needs a CUDA GPU of compute capability 9.0 or later (programmatic dependent launch)")
    from graphcap.bench import environment as bench_env

    res = {"what": __doc__.split("\n\n")[0], "environment": bench_env.environment(),
           **measure(batches, a.launches, a.rep_ms)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pdl_chain.json").write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
