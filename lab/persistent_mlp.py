"""An experiment toward fewer, longer kernels: the draft layer's MLP at one row - gate/up with gelu-tanh * up, then the
down projection - as ONE persistent kernel against graphcap's two skinny-GEMM launches, in-graph at the draft's
shapes (hidden 1536, intermediate 6144, bf16).

At batch 1 each projection is a 19-38 MB weight read of 9-13 us, of which a few microseconds are the kernel's ramp and
tail and the launch between the two (docs/results.md: the skinny GEMM at 48-70% of copy bandwidth). Here one program
per multiprocessor computes its share of the intermediate row h, all programs meet at a grid-wide barrier (an atomic
counter every program adds itself to and then waits on; all are resident, the grid being the SM count), and then
compute their share of the output from h. Timed as:
- `two kernels`: graphcap's ops as the draft loop runs them (skinny_gate_up_gelu, then skinny_linear's split K);
- `persistent`: the one kernel, the down phase in 16-row blocks over the whole K (96 of the 132 programs busy);
  `persistent, down tile first`: the same, each program loading its first down-weight tile before it waits at the
  barrier (a weight read that does not depend on h);
- `phases as two launches`: the same two phases launched as two kernels (no barrier): what the barrier itself costs
  or saves against the launch between them, the phases' own speed aside;
- `persistent, down split K 4` / `8`: the down phase's blocks split over K as well (384 / 768 units for the 132
  programs), each block's last split to arrive summing the partials in order (graphcap.kernels.gemm.skinny_kernels'
  one-kernel split K).
Each timed inside a CUDA graph among 256 MB reads (lab/graph_timing.py's in_graph_us); every output is checked
against a float64 computation (bf16 tolerance), and one that is off is reported and not timed. Not part of graphcap's
draft loop.

    python lab/persistent_mlp.py --out DIR     # CUDA only; writes persistent_mlp.json into DIR
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
    # h[n] = gelu_tanh(w[n] . x) * (w[n + I] . x) for n in block blk (graphcap.kernels.gemm.skinny_kernels' gated math
    # and rounding)
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
def _down_unit(h, w, y, part, cnt, unit, N, K, w0, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
               S: tl.constexpr, FIRST_LOADED: tl.constexpr):
    # unit = (block blk of BN output rows, K split s of S): y[n] = w[n] . h over K range s; h written by other
    # programs: read past L1 (.cg). With FIRST_LOADED the range's first tile of w is w0, loaded by the caller. S > 1:
    # the partial goes to part[s], and the block's last split to arrive (cnt[blk] counts them) sums part[0..S-1] in
    # order and stores y (graphcap.kernels.gemm.skinny_kernels' one-kernel split K).
    blk = unit // S
    s = unit % S
    k_lo = s * (K // S)
    offs_n = blk * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    w_ptr = w + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    h_ptr = h + offs_m[None, :] * K + offs_k[:, None]
    acc = tl.zeros([BN, BM], tl.float32)
    k0 = k_lo
    if FIRST_LOADED:
        acc = tl.dot(w0, tl.load(h_ptr + k_lo, mask=offs_m[None, :] < 1, other=0.0, cache_modifier=".cg"), acc)
        k0 = k_lo + BK
    for k in range(k0, k_lo + K // S, BK):
        ht = tl.load(h_ptr + k, mask=offs_m[None, :] < 1, other=0.0, cache_modifier=".cg")
        acc = tl.dot(tl.load(w_ptr + k), ht, acc)
    row0 = offs_m[None, :] < 1
    if S == 1:
        tl.store(y + offs_m[None, :] * N + offs_n[:, None], acc.to(y.dtype.element_ty), mask=row0)
    else:
        p_ptr = part + offs_m[None, :] * 0 + offs_n[:, None]
        tl.store(p_ptr + s * N, acc, mask=row0)
        tl.debug_barrier()
        if tl.atomic_add(cnt + blk, 1, sem="acq_rel") == S - 1:
            total = tl.load(p_ptr, mask=row0, other=0.0, cache_modifier=".cg")
            for j in range(1, S):
                total += tl.load(p_ptr + j * N, mask=row0, other=0.0, cache_modifier=".cg")
            tl.store(y + offs_m[None, :] * N + offs_n[:, None], total.to(y.dtype.element_ty), mask=row0)
            tl.atomic_xchg(cnt + blk, 0)


@triton.jit
def _mlp_kernel(x, w_gu, w_d, h, y, part, counters, I, H, spin_limit,
                PHASES: tl.constexpr, PREFETCH: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
                BN2: tl.constexpr, BK2: tl.constexpr, BM: tl.constexpr, S2: tl.constexpr):
    # counters: [0] the barrier's arrivals, [1] programs done with the down phase, [2 + b] block b's down splits
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    units = tl.cdiv(H, BN2) * S2
    if PHASES % 2 == 1:
        for blk in range(pid, tl.cdiv(I, BN1), nprog):
            _gate_up_block(x, w_gu, h, blk, I, H, BN1, BK1, BM)
    w0 = tl.zeros([BN2, BK2], w_d.dtype.element_ty)
    if PREFETCH:
        if pid < units:  # this program's first down tile, before the wait
            offs_n = (pid // S2) * BN2 + tl.arange(0, BN2)
            k_lo = (pid % S2) * (I // S2)
            w0 = tl.load(w_d + offs_n.to(tl.int64)[:, None] * I + k_lo + tl.arange(0, BK2)[None, :])
    if PHASES == 3:  # grid-wide barrier: every program's h stores before any program's h loads
        tl.debug_barrier()
        tl.atomic_add(counters, 1, sem="release")
        spins = 0
        while (tl.atomic_add(counters, 0, sem="acquire") < nprog) & (spins < spin_limit):
            spins += 1
    if PHASES >= 2:
        start = pid
        if PREFETCH:  # this program's first unit from the tile it loaded before the wait
            if pid < units:
                _down_unit(h, w_d, y, part, counters + 2, pid, H, I, w0, BN2, BK2, BM, S2, True)
            start = pid + nprog
        for unit in range(start, units, nprog):
            _down_unit(h, w_d, y, part, counters + 2, unit, H, I, w0, BN2, BK2, BM, S2, False)
    if PHASES == 3:  # the last program out resets the barrier's counters for the next launch or replay
        if tl.atomic_add(counters + 1, 1, sem="acq_rel") == nprog - 1:
            tl.atomic_xchg(counters, 0)
            tl.atomic_xchg(counters + 1, 0)


def new_counters(hidden: int, device: torch.device | str) -> torch.Tensor:
    """The kernel's int32 counters (the barrier's two, one per 16-row down block), zero between launches."""
    return torch.zeros(2 + triton.cdiv(hidden, 16), dtype=torch.int32, device=device)


def launch(x: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
           counters: torch.Tensor, programs: int, phases: int, prefetch: bool = False, split: int = 1,
           part: torch.Tensor | None = None, bk2: int = 512) -> torch.Tensor:
    """phases: 3 = both with the barrier (CUDA only: Triton's interpreter runs programs one after another), 1 or 2 =
    that phase alone. split: the down phase's K splits (part: their [split, hidden] fp32 partials; the intermediate
    size a multiple of split x bk2)."""
    if w_d.shape[1] % (split * bk2) or (split > 1 and (part is None or part.shape[0] < split)):
        raise ValueError(f"persistent_mlp.launch: the intermediate size ({w_d.shape[1]}) must be a multiple of split x "
                         f"bk2 ({split} x {bk2}), and a split needs part with >= {split} rows")
    _mlp_kernel[(programs,)](x, w_gu, w_d, h, y, y if part is None else part, counters, w_d.shape[1], x.shape[1],
                             SPIN_LIMIT, PHASES=phases, PREFETCH=prefetch, BN1=16, BK1=256, BN2=16, BK2=bk2, BM=16,
                             S2=split, num_warps=4, num_stages=4)
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
    from graph_timing import copy_bandwidth, in_graph_us

    from graphcap.kernels.gemm.skinny import skinny_gate_up_gelu, skinny_linear
    from graphcap.kernels.gemm.skinny_kernels import prepare_fixup

    dev = torch.device("cuda")
    prepare_fixup(dev)
    gbs = copy_bandwidth()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=g, device=dev).bfloat16()
    w_gu = (torch.randn(2 * INTER, HIDDEN, generator=g, device=dev) * HIDDEN ** -0.5).bfloat16()
    w_d = (torch.randn(HIDDEN, INTER, generator=g, device=dev) * INTER ** -0.5).bfloat16()
    h = torch.empty(1, INTER, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    counters = new_counters(HIDDEN, dev)
    part = torch.empty(8, HIDDEN, device=dev, dtype=torch.float32)
    want = reference(x, w_gu, w_d)

    def two_kernels():
        return skinny_linear(skinny_gate_up_gelu(x, w_gu), w_d)

    def phases_apart():
        launch(x, w_gu, w_d, h, y, counters, sms, 1)
        return launch(x, w_gu, w_d, h, y, counters, sms, 2)

    contestants = {"two kernels": two_kernels, "persistent": lambda: launch(x, w_gu, w_d, h, y, counters, sms, 3),
                   "persistent, down tile first": lambda: launch(x, w_gu, w_d, h, y, counters, sms, 3, True),
                   "phases as two launches": phases_apart,
                   "persistent, down split K 4": lambda: launch(x, w_gu, w_d, h, y, counters, sms, 3, split=4,
                                                                part=part),
                   "persistent, down split K 8": lambda: launch(x, w_gu, w_d, h, y, counters, sms, 3, split=8,
                                                                part=part, bk2=256)}
    rows = []
    for name, fn in contestants.items():
        out = fn().double()
        torch.cuda.synchronize()
        err = float(((out - want).norm() / want.norm()).item())
        row = {"contestant": name, "rel_err": err}
        if err <= 1e-2:  # a wrong result (a barrier that never filled) is reported, not timed
            row["us"] = round(in_graph_us(fn), 2)
            row["rel_err_after_replays"] = float(((fn().double() - want).norm() / want.norm()).item())
        row["counters_after_nonzero"] = int(counters.count_nonzero())
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
