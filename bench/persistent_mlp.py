"""An experiment toward fewer, longer kernels: the draft layer's MLP at one row - gate/up with gelu-tanh * up, then the
down projection - as ONE persistent kernel against graphcap's two skinny-GEMM launches, in-graph at the draft's
shapes (hidden 1536, intermediate 6144, bf16).

At batch 1 each projection is a 19-38 MB weight read of 9-13 us, of which a few microseconds are the kernel's ramp and
tail and the launch between the two (docs/results.md: the skinny GEMM at 48-70% of copy bandwidth). Here one program
per multiprocessor computes its share of the intermediate row h, all programs meet at a grid-wide barrier (an atomic
counter every program adds itself to and then waits on; all are resident, the grid being the SM count), and then
compute their share of the output from h. Timed as:
- `two kernels`: graphcap's ops as the draft loop runs them (skinny_gate_up_gelu, then skinny_linear's split K);
- `persistent`: the one kernel; `persistent, down tile first`: the same, each program loading its first down-weight
  tile before it waits at the barrier (a weight read that does not depend on h);
- `phases as two launches`: the same two phases launched as two kernels (no barrier): what the barrier itself costs
  or saves against the launch between them, the phases' own speed aside.
Each timed inside a CUDA graph among 256 MB reads (bench/attention_bw.py's in_graph_us); every output is checked
against a float64 computation (bf16 tolerance), and one that is off is reported and not timed. The phase-2 split: none (16 output rows per program, 96 of the 132
programs busy), so the down phase reads each weight row once in long runs. Not part of graphcap's draft loop.

    python bench/persistent_mlp.py --out DIR     # CUDA only; writes persistent_mlp.json into DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

HIDDEN, INTER = 1536, 6144
SPIN_LIMIT = 1 << 20  # a barrier that never fills (a bug) gives wrong numbers, not a hung GPU


@triton.jit
def _gate_up_block(x, w, h, blk, I, K, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    # h[n] = gelu_tanh(w[n] . x) * (w[n + I] . x) for n in block blk (skinny_gemm_kernels' gated math and rounding)
    offs_n = blk * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    w_ptr = w + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    u_ptr = w + (offs_n + I).to(tl.int64)[:, None] * K + offs_k[None, :]
    x_ptr = x + offs_m[None, :] * K + offs_k[:, None]
    acc = tl.zeros([BN, BM], tl.float32)
    acc_u = tl.zeros([BN, BM], tl.float32)
    for k in range(0, K, BK):
        xt = tl.load(x_ptr + k, mask=offs_m[None, :] < 1, other=0.0)
        acc = tl.dot(tl.load(w_ptr + k), xt, acc)
        acc_u = tl.dot(tl.load(u_ptr + k), xt, acc_u)
    g = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)) * acc_u
    tl.store(h + offs_m[None, :] * I + offs_n[:, None], g.to(h.dtype.element_ty), mask=offs_m[None, :] < 1)


@triton.jit
def _down_block(h, w, y, blk, N, K, w0, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
                FIRST_LOADED: tl.constexpr):
    # y[n] = w[n] . h for n in block blk; h written by other programs: read past L1 (.cg). With FIRST_LOADED the
    # first K tile of w is w0, loaded by the caller.
    offs_n = blk * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    w_ptr = w + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    h_ptr = h + offs_m[None, :] * K + offs_k[:, None]
    acc = tl.zeros([BN, BM], tl.float32)
    k0 = 0
    if FIRST_LOADED:
        acc = tl.dot(w0, tl.load(h_ptr, mask=offs_m[None, :] < 1, other=0.0, cache_modifier=".cg"), acc)
        k0 = BK
    for k in range(k0, K, BK):
        ht = tl.load(h_ptr + k, mask=offs_m[None, :] < 1, other=0.0, cache_modifier=".cg")
        acc = tl.dot(tl.load(w_ptr + k), ht, acc)
    tl.store(y + offs_m[None, :] * N + offs_n[:, None], acc.to(y.dtype.element_ty), mask=offs_m[None, :] < 1)


@triton.jit
def _mlp_kernel(x, w_gu, w_d, h, y, counters, I, H, spin_limit,
                PHASES: tl.constexpr, PREFETCH: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
                BN2: tl.constexpr, BK2: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if PHASES % 2 == 1:
        for blk in range(pid, tl.cdiv(I, BN1), nprog):
            _gate_up_block(x, w_gu, h, blk, I, H, BN1, BK1, BM)
    w0 = tl.zeros([BN2, BK2], w_d.dtype.element_ty)
    if PREFETCH:
        if pid < tl.cdiv(H, BN2):  # this program's first down tile, before the wait
            offs_n = pid * BN2 + tl.arange(0, BN2)
            w0 = tl.load(w_d + offs_n.to(tl.int64)[:, None] * I + tl.arange(0, BK2)[None, :])
    if PHASES == 3:  # grid-wide barrier: every program's h stores before any program's h loads
        tl.debug_barrier()
        tl.atomic_add(counters, 1, sem="release")
        spins = 0
        while (tl.atomic_add(counters, 0, sem="acquire") < nprog) & (spins < spin_limit):
            spins += 1
    if PHASES >= 2:
        start = pid
        if PREFETCH:  # this program's first block from the tile it loaded before the wait
            if pid < tl.cdiv(H, BN2):
                _down_block(h, w_d, y, pid, H, I, w0, BN2, BK2, BM, True)
            start = pid + nprog
        for blk in range(start, tl.cdiv(H, BN2), nprog):
            _down_block(h, w_d, y, blk, H, I, w0, BN2, BK2, BM, False)
    if PHASES == 3:  # the last program out resets the counters for the next launch or replay
        if tl.atomic_add(counters + 1, 1, sem="acq_rel") == nprog - 1:
            tl.atomic_xchg(counters, 0)
            tl.atomic_xchg(counters + 1, 0)


def launch(x: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
           counters: torch.Tensor, programs: int, phases: int, prefetch: bool = False) -> torch.Tensor:
    """phases: 3 = both with the barrier (CUDA only: Triton's interpreter runs programs one after another), 1 or 2 =
    that phase alone."""
    _mlp_kernel[(programs,)](x, w_gu, w_d, h, y, counters, w_d.shape[1], x.shape[1],
                             SPIN_LIMIT, PHASES=phases, PREFETCH=prefetch, BN1=16, BK1=256, BN2=16, BK2=512, BM=16,
                             num_warps=4, num_stages=4)
    return y


def reference(x: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor) -> torch.Tensor:
    """float64: gelu_tanh(gate) * up, rounded to x's dtype as the kernel stores h, then down."""
    i = w_d.shape[1]
    gu = x.double() @ w_gu.double().t()
    g, u = gu[:, :i], gu[:, i:]
    h = (torch.nn.functional.gelu(g, approximate="tanh") * u).to(x.dtype)
    return h.double() @ w_d.double().t()


def main(argv=None) -> int:
    from graphcap.bench import environment as bench_env
    from graphcap.bench.options import OneLineParser

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/persistent-mlp"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (a grid-wide barrier runs only there)")
    from attention_bw import copy_bandwidth, in_graph_us  # bench/: the script's directory is on sys.path

    from graphcap.kernels.skinny_gemm import skinny_gate_up_gelu, skinny_linear
    from graphcap.kernels.skinny_gemm_kernels import prepare_fixup

    dev = torch.device("cuda")
    prepare_fixup(dev)
    gbs = copy_bandwidth(200.0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=g, device=dev).bfloat16()
    w_gu = (torch.randn(2 * INTER, HIDDEN, generator=g, device=dev) * HIDDEN ** -0.5).bfloat16()
    w_d = (torch.randn(HIDDEN, INTER, generator=g, device=dev) * INTER ** -0.5).bfloat16()
    h = torch.empty(1, INTER, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    counters = torch.zeros(2, device=dev, dtype=torch.int32)
    want = reference(x, w_gu, w_d)

    def two_kernels():
        return skinny_linear(skinny_gate_up_gelu(x, w_gu), w_d)

    def phases_apart():
        launch(x, w_gu, w_d, h, y, counters, sms, 1)
        return launch(x, w_gu, w_d, h, y, counters, sms, 2)

    contestants = {"two kernels": two_kernels, "persistent": lambda: launch(x, w_gu, w_d, h, y, counters, sms, 3),
                   "persistent, down tile first": lambda: launch(x, w_gu, w_d, h, y, counters, sms, 3, True),
                   "phases as two launches": phases_apart}
    rows = []
    for name, fn in contestants.items():
        out = fn().double()
        torch.cuda.synchronize()
        err = float(((out - want).norm() / want.norm()).item())
        row = {"contestant": name, "rel_err": err}
        if err <= 1e-2:  # a wrong result (a barrier that never filled) is reported, not timed
            row["us"] = round(in_graph_us(fn), 2)
            row["rel_err_after_replays"] = float(((fn().double() - want).norm() / want.norm()).item())
        row["counters_after"] = counters.tolist()
        rows.append(row)
        print(json.dumps(row), flush=True)
    mb = (w_gu.numel() + w_d.numel()) * 2 / 1e6
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "persistent_mlp.json").write_text(json.dumps(
        {"environment": bench_env.environment(), "copy_gbs": round(gbs, 1), "weights_mb": round(mb, 2),
         "floor_us": round(mb * 1e3 / gbs, 2), "programs": sms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
