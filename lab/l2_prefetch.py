"""Can a projection's weights be pulled into the H200's L2 while a latency-bound kernel runs, so that the projection
after it reads them from L2? An experiment for the draft iteration (docs/results.md): at batch 1 the sliding
attention reads its 16.8 MB of K/V at ~28% of copy bandwidth, so HBM is mostly idle while it runs, and the o_proj
after it streams 25 MB of weights at ~55%.

Each sequence below runs as one node sequence inside a CUDA graph, 8 times among 256 MB reads (the L2 then holds
clean lines of other data, as in the iteration), and is reported as microseconds per repeat over the reads alone:
- attn: graphcap's sliding decode attention at batch B, context 2048 (window 1024);
- gemm: the projection (graphcap's skinny GEMM, or cuBLAS) at M = B;
- pf: one small kernel issuing `cp.async.bulk.prefetch.L2` over the weights (sm_90: asynchronous, no registers or
  shared memory held while the bytes arrive);
- gemm,gemm: the second call reads from L2 where the weights fit (the best case).
The projection's cost after the attention is (attn,gemm - attn) without the prefetch and (pf,attn,gemm - pf,attn)
with it; what the prefetch costs the attention is (pf,attn - attn).

    python lab/l2_prefetch.py --out DIR     # CUDA (sm_90) only; writes l2_prefetch.json into DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from graphcap.bench import environment as bench_env
from graphcap.bench.options import OneLineParser
from graphcap.kernels.attention.decode import decode_attention
from graphcap.kernels.attention.plan import plan_attention
from graphcap.kernels.gemm.skinny import skinny_linear

SHAPES = {"o_proj_sliding": (1536, 8192), "down": (1536, 6144), "q_proj_sliding": (8192, 1536)}


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    # one bulk prefetch per element: base .. base + nbytes in CHUNK-byte pieces (nbytes a multiple of 16)
    offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, chunk: int = 16384, per_program: int = 128) -> None:
    nbytes = t.numel() * t.element_size()
    grid = (triton.cdiv(triton.cdiv(nbytes, chunk), per_program),)
    _l2_prefetch_kernel[grid](t.data_ptr(), nbytes, CHUNK=chunk, PER_PROGRAM=per_program, num_warps=4)


def attention_call(batch: int, ctx: int = 2048, window: int = 1024, heads: int = 32, kv_heads: int = 16,
                   dim: int = 256):
    g = torch.Generator(device="cuda").manual_seed(batch)
    tokens = batch * ctx + 64
    k = torch.randn(tokens, kv_heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, kv_heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    # each row's last `window` positions, at shuffled locations, in ring order
    locs = torch.randperm(tokens, generator=g, device="cuda")[: batch * window].view(batch, window).to(torch.int32)
    slots = torch.arange(batch, device="cuda", dtype=torch.int64)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    plan = plan_attention(batch, kv_heads, dim, torch.bfloat16, "cuda", window)
    return lambda: decode_attention(q, k, v, locs, slots, lens, window, dim ** -0.5, plan=plan)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--chunks", default="16384,65536")
    ap.add_argument("--out", type=Path, default=Path("out/l2-prefetch"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        ap.error("needs a CUDA device of compute capability 9.0 or later (cp.async.bulk.prefetch)")
    shapes = [s for s in a.shapes.split(",") if s]
    if any(s not in SHAPES for s in shapes):
        ap.error(f"--shapes: a list of {', '.join(SHAPES)}; got {a.shapes!r}")
    from graph_timing import in_graph_us

    rows = []
    for batch in (int(x) for x in a.batches.split(",")):
        attn = attention_call(batch)
        for shape in shapes:
            n, kdim = SHAPES[shape]
            w = torch.randn(n, kdim, device="cuda", dtype=torch.bfloat16) * kdim ** -0.5
            x = torch.randn(batch, kdim, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
            gemms = {"skinny": lambda: skinny_linear(x, w, out, cublas_above=64),
                     "cublas": lambda: torch.mm(x, w.t(), out=out)}
            for gname, gemm in gemms.items():
                row = {"batch": batch, "shape": shape, "weights_mb": round(w.numel() * 2 / 1e6, 2), "gemm": gname}
                t = {"attn": in_graph_us(attn), "gemm": in_graph_us(gemm),
                     "gemm,gemm": in_graph_us(lambda: (gemm(), gemm())),
                     "attn,gemm": in_graph_us(lambda: (attn(), gemm()))}
                for chunk in (int(c) for c in a.chunks.split(",")):
                    pf = lambda: l2_prefetch(w, chunk)  # noqa: E731 - bound per chunk
                    t[f"pf{chunk},attn"] = in_graph_us(lambda: (pf(), attn()))
                    t[f"pf{chunk},attn,gemm"] = in_graph_us(lambda: (pf(), attn(), gemm()))
                    t[f"pf{chunk},gemm"] = in_graph_us(lambda: (pf(), gemm()))
                row["us"] = {k: round(v, 2) for k, v in t.items()}
                row["gemm_after_attn_us"] = round(t["attn,gemm"] - t["attn"], 2)
                row["gemm_from_l2_us"] = round(t["gemm,gemm"] - t["gemm"], 2)
                for chunk in (int(c) for c in a.chunks.split(",")):
                    row[f"gemm_after_pf{chunk}_attn_us"] = round(t[f"pf{chunk},attn,gemm"] - t[f"pf{chunk},attn"], 2)
                    row[f"attn_cost_of_pf{chunk}_us"] = round(t[f"pf{chunk},attn"] - t["attn"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "l2_prefetch.json").write_text(json.dumps({"environment": bench_env.environment(), "rows": rows},
                                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
