"""Skinny GEMM: out = x @ w.T for few rows (M <= 64), and the MLP's gate/up projection with its gelu-tanh * up in
the same kernel.

At the draft's batch sizes a linear layer is a weight read: w [N, K] bf16 is megabytes, x [M, K] kilobytes, and the
time is bytes / HBM bandwidth. cuBLAS runs these shapes as split-K kernels at about half of copy bandwidth, plus a
split-K reduction kernel, plus (gate/up) a separate gelu-mul kernel that reads the [M, 2I] product back. Here:

- One program owns BLOCK_N output columns for all M rows and streams its BLOCK_N weight rows over K in BLOCK_K
  chunks (fp32 accumulation), so every weight byte is read once, in long K-contiguous runs.
- The product is computed transposed, acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile.T ("swap AB"): the weight rows fill the
  MMA's large side and the batch its small side, padded to BLOCK_M = max(16, next_pow2(M)) (tl.dot's minimum). The
  padding costs tensor-core work only, which is idle in a bandwidth-bound kernel; padded rows are never loaded.
  Configs with dot=False use a broadcast multiply + sum on CUDA cores instead (BLOCK_M = next_pow2(M), no padding):
  offered for M <= 4, where it skips the shared-memory staging of x; whether it wins is the bench's to say.
- skinny_gate_up_gelu: the program reads gate rows n and up rows n + I of w [2I, K] against the same x tile and
  stores gelu_tanh(g) * u (fp32, one rounding): no [M, 2I] intermediate, no second kernel, no split-K (I = 6144 is
  wide enough to fill the GPU).
- Narrow shapes (N = 1536, K up to 16384: o_proj, down, pre_proj) cannot fill 132 SMs with N-blocks alone, so they
  split K: program (n, s) writes its fp32 partial to a workspace [S, M, N], and the S partials are summed in order
  s = 0..S-1 and rounded once - by a second kernel, or (Config.fixup) in the same kernel by the last split of each
  n-block to arrive, which an atomic counter per n-block tells (`skinny_kernels.prepare_fixup`). Either way
  deterministic: the same bits on every call, as replay-vs-compiled equality needs (the atomics only count; they add
  nothing).
- One row of a narrow shape (class m1-narrow) runs as a GEMV instead (Config.gemv): a program per 4 output columns
  over all of K on CUDA cores, each thread summing its own elements and the tile reduced once at the end - 384
  programs for N = 1536 without a split or its tail (the form of Inductor's tuned one-row matmul, which beat the
  split K there on the H200).

Launch configs come from a fixed table (CANDIDATES, keyed by shape class) through `plan`, a pure-Python function of
the static shapes: no autotuning at call time, so a call costs nothing extra on the host and captures in a CUDA graph.
The ops are opaque `torch.library.custom_op`s (with fake implementations): torch.compile keeps them as calls.
`cublas_above=R` sends calls of more than R rows to cuBLAS instead (gate/up: cuBLAS, then graphcap's gelu-mul
kernel), decided in the op's body at run time, where M is a plain int also under one compile for every batch (the
draft loop's op set uses the kernel only for the shape classes and batches it measured faster at: `KERNEL_ROWS`).
The Triton kernels and the split-K counters live in graphcap.kernels.gemm.skinny_kernels; this module plans, checks,
launches and registers them. `skinny_linear_torch` / `skinny_gate_up_gelu_torch` are the plain-torch twins (cuBLAS +
an fp32 gelu-mul): the tests' reference and the fallback where Triton does not run.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from graphcap.kernels.gemm import skinny_kernels as kernels
from graphcap.kernels import use_triton
from graphcap.kernels import pdl
from graphcap.kernels.arch import SM90, GpuArch, device_arch
from graphcap.kernels.checks import check_same_device, check_tensor
from graphcap.kernels.elementwise.fused_ops import gelu_tanh_and_mul
from graphcap.kernels.gemm.skinny_kernels import fixup_counters

DTYPES = (torch.bfloat16, torch.float16)
MAX_M = 64  # rows per call: above this a GEMM is no longer a weight read
NARROW_N = 4096  # below this many output columns a shape splits K (see CANDIDATES)


class SkinnyGemmError(ValueError):
    """A bad argument to a skinny GEMM op (the op and the argument are named in the message)."""


class Config(NamedTuple):
    block_n: int
    block_k: int
    split_k: int  # an upper bound: plan/launch use at most cdiv(K, block_k) splits
    num_warps: int
    num_stages: int
    dot: bool = True  # tl.dot (tensor cores) or broadcast multiply + sum (CUDA cores)
    fixup: bool = False  # split K: the last split of each n-block sums the partials (no second kernel)
    gemv: bool = False  # one row per program over all of K on CUDA cores (`gemv_kernel`; dot False, split_k 1)

    @property
    def name(self) -> str:
        kind = "-gemv" if self.gemv else "" if self.dot else "-bcast"
        return (f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}st{self.num_stages}" + kind
                + ("-fixup" if self.fixup else ""))


# Candidate configs per shape class "<m>-<n>" (m: M <= 4 / <= 16 / <= 64, and M = 1 of a narrow shape; n: gated,
# wide N >= NARROW_N, or narrow),
# the first of each the one `plan` picks. Sized for an H200 (132 SMs, ~228 KB shared memory per SM): 8-32 KB of
# weights per pipeline stage, 3-4 stages, and at least ~2 programs per SM. Each class's first is the fastest of its
# candidates at the draft's shapes in lab/skinny_gemm.py's sweep on the H200 (docs/results.md, the skinny GEMM).
# Every candidate fits an A100's 163 KiB per block too (Triton stages one copy fewer there: `pipeline_smem`); none
# was timed on one.
_FIXUP = (Config(64, 128, 8, 4, 4, fixup=True), Config(32, 256, 4, 4, 4, fixup=True),
          Config(32, 256, 8, 4, 4, fixup=True), Config(16, 256, 8, 4, 4, fixup=True))
_SMALL = {
    "wide": (Config(64, 128, 1, 4, 4), Config(32, 256, 1, 4, 4), Config(16, 512, 1, 4, 3), Config(64, 256, 1, 8, 3)),
    "gated": (Config(32, 128, 1, 4, 4), Config(16, 256, 1, 4, 4), Config(32, 256, 1, 4, 3), Config(64, 128, 1, 8, 3)),
    "narrow": _FIXUP + (Config(32, 256, 4, 4, 4), Config(16, 256, 4, 4, 4), Config(32, 256, 8, 4, 4),
                        Config(64, 256, 8, 8, 3), Config(16, 256, 1, 4, 4), Config(16, 512, 2, 4, 3))
    # Whole waves: N = 1536 in 12 / 24 / 48 n-blocks times 11 splits of K (10 for K = 6144) is 132 / 264 / 528
    # programs, 1 / 2 / 4 per SM of the H200's 132, where 8 splits make 192 (1.45 per SM: half the SMs get two).
    # Timed on the H200 they were no faster than the 8-split candidate first in the class (docs/results.md)
    + (Config(128, 128, 11, 8, 3, fixup=True), Config(64, 128, 11, 4, 4, fixup=True),
       Config(32, 128, 11, 4, 4, fixup=True), Config(32, 256, 11, 4, 4, fixup=True)),
}
_BCAST = {"wide": Config(16, 128, 1, 4, 2, False), "gated": Config(16, 128, 1, 4, 2, False),
          "narrow": Config(16, 128, 4, 4, 2, False)}
# One row per program over all of K, as Inductor's tuned one-row matmul (a multiply-and-sum reduction) runs; slower
# than the plans on the wide and gated shapes, so only m1-narrow plans one
_GEMV = (Config(4, 1024, 1, 4, 3, False, gemv=True), Config(2, 2048, 1, 8, 2, False, gemv=True))
# First up to 16 rows: the fastest of lab/skinny_gemm.py --grid at one row, and of the class's candidates at 1,
# 2, 4 and 8 rows (docs/results.md, the skinny GEMM's wider search) - a fifth pipeline stage for gate/up, and for the
# narrow shapes four splits of K with five stages. Not timed at 9-16 rows, which only SKINNY_OPS (the bench's
# graphcap-skinny-gemm) sends to the kernel: KERNEL_ROWS stops the default op set at 8.
_DEEP = {"gated": Config(64, 128, 1, 4, 5), "narrow": Config(64, 128, 4, 4, 5, fixup=True)}
CANDIDATES: dict[str, tuple[Config, ...]] = {
    **{f"m4-{n}": ((_DEEP[n],) if n in _DEEP else ()) + cfgs + (_BCAST[n],) + _GEMV for n, cfgs in _SMALL.items()},
    **{f"m16-{n}": ((_DEEP[n],) if n in _DEEP else ()) + cfgs for n, cfgs in _SMALL.items()},
    # up to 64 rows the x tile is as large as the weight tile at BLOCK_N = 64: wider N-blocks read x less often
    "m64-wide": (Config(64, 128, 1, 4, 4), Config(128, 128, 1, 8, 3), Config(32, 256, 1, 4, 3),
                 Config(64, 256, 1, 8, 3)),
    "m64-gated": (Config(64, 128, 1, 4, 3), Config(32, 128, 1, 4, 4), Config(128, 64, 1, 8, 3)),
    # one row of a narrow shape: no split K, hundreds of one-row programs instead (1.7-2.3 us per call faster than
    # the split K on the H200, the first gemv config within 0.05 us of the fastest of 48: docs/results.md, one row of
    # a narrow projection as a GEMV)
    "m1-narrow": _GEMV + (_DEEP["narrow"],) + _SMALL["narrow"] + (_BCAST["narrow"],),
    "m64-narrow": (Config(64, 128, 4, 4, 4), Config(64, 128, 8, 4, 4), Config(64, 128, 4, 4, 4, fixup=True),
                   Config(64, 128, 8, 4, 4, fixup=True), Config(128, 128, 8, 8, 3), Config(32, 256, 8, 4, 3),
                   Config(64, 128, 1, 4, 4)),
}

# Up to how many rows graphcap's op sets send a shape class to the kernel (its plan) rather than cuBLAS: where it made
# the draft iteration faster on the H200 (graphcap bench and its kernel-time profile; docs/results.md, the skinny
# GEMM). Alone (lab/skinny_gemm.py) the kernel beat cuBLAS on the wide and gate/up shapes (gate/up's margin includes
# the gelu-mul kernel cuBLAS needs after it); the wide and gated shapes won in the iteration at 8 rows and lost at 16.
# The narrow split-K shapes: the eight-split config lost at 8 rows (0.94x in the iteration, its 27 fewer kernels -
# cuBLAS adds a split-K reduction per call - notwithstanding); the four-split, five-stage one beats cuBLAS alone at
# 1-8 rows (o_proj_full: a tie at 8) and cut the batch-8 iteration's kernel time by 17 us, where the bench's wall
# clock, one run each way, gave 0.98x (within its spread between runs).
KERNEL_ROWS = {"wide": 8, "gated": 8, "narrow": 8}


def kernel_rows(n: int, gated: bool = False) -> int:
    """`KERNEL_ROWS` for a weight of `n` output columns (gated: I, half of w's rows)."""
    return KERNEL_ROWS["gated" if gated else "wide" if n >= NARROW_N else "narrow"]


def shape_class(m: int, n: int, gated: bool = False) -> str:
    kind = "gated" if gated else "wide" if n >= NARROW_N else "narrow"
    rows = "m1" if m == 1 and kind == "narrow" else "m4" if m <= 4 else "m16" if m <= 16 else "m64"
    return f"{rows}-{kind}"


def candidates(m: int, n: int, k: int, gated: bool = False) -> tuple[Config, ...]:
    """The configs a bench times for this shape (n: output columns; for gated, I)."""
    return CANDIDATES[shape_class(m, n, gated)]


def plan(m: int, n: int, k: int, gated: bool = False, arch: GpuArch | None = None) -> Config:
    """The config a call uses: its shape class's first candidate, its pipeline made shallower where `arch` (default:
    the current device's, an H200's on a CPU) has too little shared memory for it (`fit`; no class's first needs that
    on an H100/H200 or an A100). Pure Python on static shapes."""
    return _plan(m, n, k, gated, arch if arch is not None else device_arch())


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, gated: bool, arch: GpuArch) -> Config:
    return fit(candidates(m, n, k, gated)[0], m, gated, arch)


def fit(cfg: Config, m: int, gated: bool, arch: GpuArch) -> Config:
    """`cfg` with num_stages lowered until its pipeline fits `arch`'s shared memory per block (`pipeline_smem`);
    configs without tl.dot stage no tiles and are returned as they are."""
    while cfg.dot and cfg.num_stages > 1 and pipeline_smem(cfg, m, gated, arch=arch) > arch.smem_per_block:
        cfg = cfg._replace(num_stages=cfg.num_stages - 1)
    return cfg


SMEM_LIMIT = SM90.smem_per_block  # shared memory one block may opt into on an H100/H200 (227 KiB)


def pipeline_smem(cfg: Config, m: int, gated: bool, elem_bytes: int = 2, arch: GpuArch = SM90) -> int:
    """Shared memory the dot kernel's software pipeline takes: copies of the x tile and the weight tile (two of
    them, gate and up, when gated) - num_stages copies where Triton makes the tl.dot a wgmma (sm_90 with at least 64
    weight rows, a warp group's tile: it reads its operands from shared memory while the next loads land),
    num_stages - 1 where it is an mma.sync (the tile in use is in registers). Triton's own count for these kernels
    (tests/kernels/test_sm80.py compiles every candidate for sm_80 and sm_90), exact from two stages up, above it at
    one; over the device's limit a launch fails with OutOfResources."""
    block_m = max(16, triton.next_power_of_2(m))
    wgmma = arch.hopper and cfg.block_n >= 64
    copies = cfg.num_stages if wgmma else max(1, cfg.num_stages - 1)
    return copies * cfg.block_k * (block_m + (2 if gated else 1) * cfg.block_n) * elem_bytes


def k_splits(k: int, cfg: Config) -> tuple[int, int]:
    """(K per split, a multiple of block_k; number of splits, none of them empty)."""
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_split, triton.cdiv(k, k_split)


# ---------------------------------------------------------------------------------------------------------------
# checks (static: shapes, dtypes, devices, strides)


def _check(op: str, x: object, w: object, gated: bool, out: object = None) -> tuple[int, int]:
    """(M, output columns) of a valid call; SkinnyGemmError naming op and argument otherwise."""
    check_tensor(SkinnyGemmError, op, "x", x, DTYPES, 2)
    check_tensor(SkinnyGemmError, op, "w", w, DTYPES, 2, contiguous_rows=False)  # w: contiguous whole, below
    if x.dtype != w.dtype:
        raise SkinnyGemmError(f"{op}: x ({x.dtype}) and w ({w.dtype}) dtypes differ")
    if x.shape[1] != w.shape[1]:
        raise SkinnyGemmError(f"{op}: x has K = {x.shape[1]} columns, w {tuple(w.shape)} has {w.shape[1]}")
    if x.shape[0] > MAX_M:
        raise SkinnyGemmError(f"{op}: x has {x.shape[0]} rows, at most MAX_M = {MAX_M} are supported")
    if not w.is_contiguous():
        raise SkinnyGemmError(f"{op}: w must be contiguous, got strides {w.stride()}")
    if gated and w.shape[0] % 2:
        raise SkinnyGemmError(f"{op}: w must stack gate and up rows ([2I, K]), got an odd {w.shape[0]} rows")
    check_same_device(SkinnyGemmError, op, x=x, w=w)
    shape = (x.shape[0], w.shape[0] // 2 if gated else w.shape[0])
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or tuple(out.shape) != shape \
                or out.device != x.device or (out.numel() and out.stride(1) != 1):
            got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
            raise SkinnyGemmError(f"{op}: out must be a {x.dtype} {shape} tensor on {x.device} with contiguous "
                                  f"rows, got {got}")
    return shape


def accepts(x: object, w: object, gated: bool = False) -> bool:
    """Whether the ops take (x, w) as they are (`_check`'s rules), for callers that route elsewhere instead."""
    try:
        _check("accepts", x, w, gated)
    except SkinnyGemmError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# plain-torch twins


def skinny_linear_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Twin of skinny_linear: x @ w.T (cuBLAS on CUDA), one rounding to x's dtype."""
    return torch.nn.functional.linear(x, w)


def skinny_gate_up_gelu_torch(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """Twin of skinny_gate_up_gelu: the [M, 2I] product in x's dtype, then gelu_tanh(gate) * up in fp32, rounded
    once (what cuBLAS + graphcap's gelu_tanh_and_mul compute)."""
    gate, up = torch.nn.functional.linear(x, w_gate_up).float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: Config, gated: bool = False) -> torch.Tensor:
    """Run the kernel with an explicit config into `out` ([M, N] or gated [M, I]); the bench and tests time and check
    every candidate through this. Inputs are assumed checked (`_check`)."""
    m, n = out.shape
    k = x.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if gated and cfg.split_k != 1:
        raise SkinnyGemmError(f"skinny_gate_up_gelu: config {cfg.name} splits K; the gated kernel does not")
    pdl_opts = pdl.launch_options(x, wrapped=False)  # the op's body: never a traced launch
    if cfg.gemv:
        if cfg.split_k != 1 or cfg.dot or cfg.fixup:
            raise SkinnyGemmError(f"config {cfg.name}: a gemv config takes all of K on CUDA cores "
                                  "(split_k 1, dot and fixup False)")
        kernels.gemv_kernel[(triton.cdiv(n, cfg.block_n), m)](
            x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GATED=gated, INTERPRET=not x.is_cuda, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
            STAGES=cfg.num_stages, num_warps=cfg.num_warps, **pdl_opts)
        return out
    k_split, splits = k_splits(k, cfg)
    block_m = max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m)
    n_blocks = triton.cdiv(n, cfg.block_n)
    y = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    counters = fixup_counters(x.device, n_blocks) if splits > 1 and cfg.fixup else None
    kernels.skinny_kernel[(n_blocks, splits)](
        x, w, y, out, counters if counters is not None else y, m, n, k, k_split, x.stride(0), w.stride(0),
        y.stride(-2), y.stride(0) if splits > 1 else 0, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated, DOT=cfg.dot, INTERPRET=not x.is_cuda,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, FIXUP=counters is not None,
        SPLITS=splits if counters is not None else 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_opts,
    )
    if splits > 1 and counters is None:
        kernels.splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](y, out, m, n, splits, out.stride(0), BLOCK=1024,
                                                                    INTERPRET=not x.is_cuda, num_warps=4,
                                                                    **pdl_opts)
    return out


def _run(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gated: bool, cublas_above: int) -> None:
    if not use_triton(x):
        out.copy_(skinny_gate_up_gelu_torch(x, w) if gated else skinny_linear_torch(x, w))
    elif out.shape[0] > cublas_above:  # cuBLAS's own kernels, as the twin computes them
        if gated:
            gelu_tanh_and_mul(torch.mm(x, w.t()), out=out)
        else:
            torch.mm(x, w.t(), out=out)
    else:  # planned for the current device, where Triton launches
        launch(x, w, out, plan(out.shape[0], out.shape[1], x.shape[1], gated), gated)


# ---------------------------------------------------------------------------------------------------------------
# the ops: a functional one (returns a new tensor) and an out= one (writes into out) per function


def _register(name: str, gated: bool) -> tuple[Callable[..., torch.Tensor], Callable[..., None]]:
    @torch.library.custom_op(f"graphcap::{name}", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor, cublas_above: int) -> torch.Tensor:
        out = x.new_empty(_check(name, x, w, gated))
        _run(out, x, w, gated, cublas_above)
        return out

    @op.register_fake
    def _(x, w, cublas_above):
        return x.new_empty(_check(name, x, w, gated))

    @torch.library.custom_op(f"graphcap::{name}_out", mutates_args=("out",))
    def op_out(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cublas_above: int) -> None:
        _check(name, x, w, gated, out)
        _run(out, x, w, gated, cublas_above)

    @op_out.register_fake
    def _(out, x, w, cublas_above):
        _check(name, x, w, gated, out)

    return op, op_out


_linear_op, _linear_out_op = _register("skinny_linear", gated=False)
_gate_up_op, _gate_up_out_op = _register("skinny_gate_up_gelu", gated=True)


def _check_rows(op: str, cublas_above: object) -> int:
    if type(cublas_above) is not int or cublas_above < 0:
        raise SkinnyGemmError(f"{op}: cublas_above must be an int >= 0 (rows above it go to cuBLAS), "
                              f"got {cublas_above!r}")
    return cublas_above


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                  cublas_above: int = MAX_M) -> torch.Tensor:
    """x @ w.T for x [M, K] (M <= MAX_M, rows contiguous) and w [N, K] contiguous, bf16/fp16, fp32 accumulation,
    [M, N] in x's dtype (into `out` if given). The Triton kernel where Triton runs (cuBLAS for M > `cublas_above`),
    the twin elsewhere."""
    _check("skinny_linear", x, w, False, out)  # here too: the op's schema would reject a bad type first, unnamed
    rows = _check_rows("skinny_linear", cublas_above)
    if out is None:
        return _linear_op(x, w, rows)
    _linear_out_op(out, x, w, rows)
    return out


def skinny_gate_up_gelu(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None = None, *,
                        cublas_above: int = MAX_M) -> torch.Tensor:
    """gelu_tanh(x @ w_gate_up[:I].T) * (x @ w_gate_up[I:].T) for w_gate_up [2I, K] (gate rows, then up rows):
    [M, I] in x's dtype (into `out` if given), the activation in fp32 before the one rounding (for M >
    `cublas_above`: cuBLAS's product, rounded, then graphcap's gelu-mul kernel)."""
    _check("skinny_gate_up_gelu", x, w_gate_up, True, out)
    rows = _check_rows("skinny_gate_up_gelu", cublas_above)
    if out is None:
        return _gate_up_op(x, w_gate_up, rows)
    _gate_up_out_op(out, x, w_gate_up, rows)
    return out
