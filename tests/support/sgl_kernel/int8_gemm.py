"""sgl_kernel's `int8_scaled_mm` for the stand-in: the GEMM of sglang's W8A8 int8 linear layers (compressed-tensors
`CompressedTensorsW8A8Int8.apply_weights` and sglang's own `W8A8Int8LinearMethod.apply`), as a Triton kernel beside a
plain-torch twin (`int8_scaled_mm_torch`).

`int8_scaled_mm(mat_a, mat_b, scales_a, scales_b, out_dtype, bias=None) -> out`, as sgl-kernel defines it
(csrc/gemm/int8_gemm_kernel.cu):
- mat_a [M, K] int8, rows contiguous (stride(1) == 1): the activations, quantized per token by sglang's own Triton
  kernel `per_token_quant_int8` (not an sgl_kernel op);
- mat_b [K, N] int8, column-major (stride(0) == 1): the weight as stored, [N, K] row-major, passed as its transpose
  (`process_weights_after_loading` keeps `weight.t()`); its column stride may exceed K;
- scales_a: M fp32 values (sglang passes [M, 1]), scales_b: N fp32 values ([N, 1] per output channel), contiguous;
- bias: None or N values of out_dtype, contiguous; out_dtype float16 or bfloat16;
- K % 16 == 0 and N % 8 == 0 (sgl_kernel's alignment checks);
- out: a new contiguous [M, N] tensor of out_dtype.
Arithmetic, as CUTLASS's epilogues do it: the int8 products summed exactly in int32, the sum converted to fp32, the
two scales applied in fp32, the bias (converted to fp32) added by one fused multiply-add, one rounding to out_dtype.
The order of the fp32 operations is the GPU's own in sgl_kernel, and the kernel follows the one the planned-for GPU
(`graphcap.kernels.arch.device_arch`, which `GRAPHCAP_KERNEL_PATHS=sm80` forces to an A100's) would run:
- sm90 (CUTLASS 3 `ScaledEpilogue[Bias]`): `scales_a * (scales_b * acc)`, with bias `fma(scales_a, scales_b * acc,
  bias)`;
- sm80 (CUTLASS 2 `EpilogueVisitorPerRowPerCol`): `acc * (scales_b * scales_a)`, with bias `fma(acc, scales_b *
  scales_a, bias)` (nvcc contracts the visitor's multiply and add into one fma at its default -fmad=true).
The int32 sum wraps past 2**31 as sgl_kernel's does (K up to 131072 cannot reach it).

The kernel (`_int8_mm_kernel`): program (n-block, split, m-block) owns BLOCK_N output columns of BLOCK_M rows over one
K range, computed transposed (acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile.T, int8 tl.dot into int32: the weight rows on
the MMA's large side, the few rows of x on its small side, padded to 16), so each weight byte is read once, in
K-contiguous runs. Up to ONE_BLOCK_M rows (a decode batch, a verify) one m-block holds every row; above it (prefill)
the rows are tiled too. Unsplit, the program applies the epilogue and stores the output. Split K: each split stores
its int32 partial to a workspace [S, M, N] and `_int8_splitk_epilogue_kernel` sums them (exact: integers, so any
order gives the same bits, the unsplit kernel's bits too) and applies the epilogue - two kernels and no state kept
between calls, so a call captures in a CUDA graph at any time and any stream.

Launch parameters come from `plan(m, n, k, arch)`, pure Python on the static shapes (no tuning at call time);
`candidates` lists the alternatives bench/int8_gemm.py times. Dispatch (`graphcap.kernels.use_triton`): CUDA
tensors and, under TRITON_INTERPRET=1, CPU tensors run the kernel; otherwise the twin. Bad arguments raise
`Int8GemmError` (a ValueError) naming the op and the argument, checked without reading a GPU value.

Self-contained (torch, triton and graphcap only): tests load this file on its own, without importing the stand-in
package (whose import finder must not reach the test process).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import use_triton
from graphcap.kernels.arch import GpuArch, device_arch
from graphcap.kernels.gemm.skinny_kernels import round_to  # the GPU's bf16 rounding under the interpreter too

OP = "int8_scaled_mm"
OUT_DTYPES = (torch.float16, torch.bfloat16)
ORDERS = ("sm90", "sm80")  # the epilogue's fp32 operation order (module docstring)
SKINNY_M = 64  # up to this many rows: a decode batch's plan, every row in one m-block
ONE_BLOCK_M = 4 * SKINNY_M  # up to this many: a verify's, every row in one m-block too; above, rows are tiled (prefill)
WIDE_N = 8192  # from this many output columns the n-blocks alone fill the GPU (no split K)
MIN_SPLIT_K = 1024  # K per split at the least: shorter runs pay more for the partials than they gain
SMEM_MARGIN = 8 * 1024  # shared memory left to Triton beyond the pipeline's tiles (layout conversions)


class Int8GemmError(ValueError):
    """A bad argument to int8_scaled_mm (the message names the op and the argument)."""


@dataclass(frozen=True)
class Config:
    """One launch of the kernel. block_m None: one m-block of every row, max(16, next_pow2(M)) (decode); an int:
    rows tiled in blocks of that many (prefill)."""

    block_n: int
    block_k: int
    split_k: int = 1  # an upper bound: a launch uses at most cdiv(K, block_k) splits, none empty
    num_warps: int = 4
    num_stages: int = 4
    block_m: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise Int8GemmError(f"{OP}: Config.{name} must be an int >= 1, got {v!r}")
        for name in ("block_n", "block_k") + (("block_m",) if self.block_m is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise Int8GemmError(f"{OP}: Config.{name} must be a power of two >= 16 (tl.dot's tiles), got {v!r}")
        if self.block_k < 32:
            raise Int8GemmError(f"{OP}: Config.block_k must be >= 32 (an int8 MMA's K), got {self.block_k}")

    @property
    def name(self) -> str:
        rows = f"m{self.block_m}" if self.block_m is not None else ""
        return f"{rows}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}st{self.num_stages}"


def rows_block(m: int, cfg: Config) -> int:
    """BLOCK_M of a launch: the config's, or every row in one block (tl.dot's minimum is 16)."""
    return cfg.block_m if cfg.block_m is not None else max(16, triton.next_power_of_2(max(1, m)))


def pipeline_smem(cfg: Config, m: int, arch: GpuArch) -> int:
    """Shared memory the kernel's pipeline takes: copies of the x and weight tiles (1 byte an element). Triton keeps
    num_stages copies where its tl.dot is a Hopper wgmma (a weight tile of >= 64 rows: the MMA reads its operands
    from shared memory while the next loads land), num_stages - 1 where it is an mma.sync."""
    copies = cfg.num_stages if arch.hopper and cfg.block_n >= 64 else max(1, cfg.num_stages - 1)
    return copies * cfg.block_k * (rows_block(m, cfg) + cfg.block_n)


def fit(cfg: Config, m: int, arch: GpuArch) -> Config:
    """cfg with its pipeline made shallower until it fits arch's shared memory per block (an A100 has less)."""
    while cfg.num_stages > 1 and pipeline_smem(cfg, m, arch) > arch.smem_per_block - SMEM_MARGIN:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def splits(k: int, cfg: Config) -> tuple[int, int]:
    """(K per split, a multiple of block_k; the number of splits, none of them empty)."""
    if k == 0:
        return cfg.block_k, 1
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_split, triton.cdiv(k, k_split)


def plan(m: int, n: int, k: int, arch: GpuArch | None = None) -> Config:
    """The config a call of M rows, N output columns and K uses on `arch` (default: the current device's; a CPU plans
    an H200's). Pure Python on static shapes; cached."""
    return _plan(m, n, k, arch if arch is not None else device_arch())


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, arch: GpuArch) -> Config:
    if m > ONE_BLOCK_M:  # prefill: a tiled GEMM, the weights re-read once per m-block
        return fit(_tiled(m), m, arch)
    if m > SKINNY_M:
        # A verify (requests x draft tokens): every row in one block, so the weights are read once, as sgl_kernel's
        # 2 x 1 clusters along M read them (TMA multicast). Tiles of 64 weight rows and K steps of 128 keep the
        # 256-row pipeline in shared memory; narrow shapes split K in two up to 128 rows, where 84 n-blocks would
        # leave SMs idle. Timed against the prefill's tiling (docs/results/int8-gemm-h100.json, verify_rows): one
        # token's 60 layers 15.6 against 22.1 ms at 128 rows, 22.8 against 25.4 at 192 (qkv_full at 96-128 rows and
        # qkv_sliding at 192 alone 1.1-1.2x slower).
        split = 2 if n < WIDE_N and m <= 2 * SKINNY_M else 1
        return fit(Config(64, 128, split, 8, 4), m, arch)
    block_m = max(16, triton.next_power_of_2(m))
    # Every n-block re-reads x from L2: M * K bytes beside its BLOCK_N * K bytes of weights. Tiles of 64 weight rows
    # (a Hopper wgmma's) keep that at half the weights' bytes or less up to 32 rows; a narrow shape's 16 rows or
    # fewer take 32 rows, twice the programs, no split.
    block_n = 32 if n < WIDE_N and block_m <= 16 else 64
    n_blocks = triton.cdiv(n, block_n)
    # Narrow shapes split K until every SM has a program, each split keeping at least MIN_SPLIT_K of K.
    split = 1
    while n_blocks * split < arch.sm_count and split < 8 and k // (2 * split) >= MIN_SPLIT_K:
        split *= 2
    # K steps of 256 bytes per weight row. Pipeline depth: ~3 tiles in flight per program; a fifth stage where a
    # narrow unsplit shape leaves 1-2 programs per SM; three where 64 rows of x double the tiles, and 8 warps to
    # hold the 64 x 64 accumulator (with 4, sm_80's mma.sync lowering spills).
    stages = 3 if block_m > 32 else 5 if block_n == 32 else 4
    return fit(Config(block_n, 256, split, 8 if block_m > 32 else 4, stages), m, arch)


def _tiled(m: int) -> Config:
    """Rows tiled in m-blocks, each reading the weights again: prefill's config (a candidate at verify rows)."""
    return Config(128, 128, 1, 8, 3, block_m=64 if m <= 2 * SKINNY_M else 128)


# Variations a bench times around the plan (bench/int8_gemm.py --candidates): tile widths, K steps, splits, depths.
_VARIANTS = ((16, 512, 1, 4, 4), (32, 256, 1, 4, 4), (32, 512, 1, 4, 4), (32, 256, 1, 4, 6), (32, 256, 2, 4, 4),
             (64, 256, 1, 4, 4), (64, 256, 1, 4, 3), (64, 512, 1, 4, 3), (64, 256, 2, 4, 4), (64, 256, 4, 4, 4),
             (64, 128, 1, 4, 5), (128, 256, 1, 8, 3), (128, 128, 1, 8, 4), (128, 256, 2, 8, 3),
             (32, 256, 4, 4, 4), (32, 256, 8, 4, 4), (16, 256, 2, 4, 4), (16, 256, 4, 4, 4), (64, 256, 8, 4, 4),
             (32, 256, 4, 4, 5), (64, 256, 4, 4, 3))


# Rows above SKINNY_M up to ONE_BLOCK_M - a verify of 32 or 48 requests x 4 draft tokens is 128 or 192 rows - in one
# block of every row (the plan's) or tiled as a prefill is.
_ONE_BLOCK = ((64, 256, 1, 8, 3), (64, 256, 2, 8, 3), (64, 128, 1, 8, 4), (64, 128, 2, 8, 4), (32, 256, 1, 8, 3),
              (32, 128, 1, 8, 4), (128, 128, 1, 8, 3))


def candidates(m: int, n: int, k: int, arch: GpuArch | None = None) -> tuple[Config, ...]:
    """The plan's config first, then the variations that fit `arch`: around the plan at decode rows, other one-block
    configs and the prefill's tiling at verify rows (up to ONE_BLOCK_M), none above (prefill: the plan only)."""
    arch = arch if arch is not None else device_arch()
    first = plan(m, n, k, arch)
    if m > SKINNY_M:
        if m > ONE_BLOCK_M:
            return (first,)
        # block_m None: every row in one block; the accumulator at most 128 x 128 (16384) int32 (64 registers a
        # thread at 8 warps: a larger one spills on sm_80)
        one = (Config(*v) for v in _ONE_BLOCK)
        one = (fit(c, m, arch) for c in one if c.block_n * rows_block(m, c) <= 16384)
        return tuple(dict.fromkeys((first, *one, fit(_tiled(m), m, arch))))
    out = [first]
    for v in _VARIANTS:
        c = Config(*v)
        if m > 32:  # 64 rows of x: 8 warps hold the accumulator without spilling (as the plan's)
            c = replace(c, num_warps=8)
        c = fit(c, m, arch)
        if c not in out:
            out.append(c)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# checks (shapes, dtypes, devices, strides: nothing that needs a GPU value)


def _tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise Int8GemmError(f"{OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or (ndim is not None and t.ndim != ndim):
        want = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise Int8GemmError(f"{OP}: {name} must be a {f'{ndim}-D ' if ndim else ''}{want} tensor, "
                            f"got {t.ndim}-D {t.dtype} {tuple(t.shape)}")
    return t


def check(mat_a: object, mat_b: object, scales_a: object, scales_b: object, out_dtype: object,
          bias: object = None) -> tuple[int, int, int]:
    """(M, N, K) of a valid call; Int8GemmError naming the argument otherwise (sgl_kernel's rules)."""
    a = _tensor("mat_a", mat_a, (torch.int8,), 2)
    b = _tensor("mat_b", mat_b, (torch.int8,), 2)
    m, k = a.shape
    k_b, n = b.shape
    if a.stride(1) != 1 and k > 1:
        raise Int8GemmError(f"{OP}: mat_a must be row-major (stride(1) == 1), got strides {a.stride()}")
    if b.stride(0) != 1 and k_b > 1:
        raise Int8GemmError(f"{OP}: mat_b must be column-major (stride(0) == 1: the weight [N, K] passed as w.t()), "
                            f"got shape {tuple(b.shape)} strides {b.stride()}")
    if k != k_b:
        raise Int8GemmError(f"{OP}: mat_a {tuple(a.shape)} and mat_b {tuple(b.shape)} shapes cannot be multiplied "
                            f"(mat_a.size(1) != mat_b.size(0))")
    if k % 16:
        raise Int8GemmError(f"{OP}: mat_a.size(1) (K = {k}) must be a multiple of 16 (sgl_kernel's alignment)")
    if n % 8:
        raise Int8GemmError(f"{OP}: mat_b.size(1) (N = {n}) must be a multiple of 8 (sgl_kernel's alignment)")
    if out_dtype not in OUT_DTYPES:
        raise Int8GemmError(f"{OP}: out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype!r}")
    for name, s, want in (("scales_a", scales_a, m), ("scales_b", scales_b, n)):
        s = _tensor(name, s, (torch.float32,))
        if s.numel() != want:
            raise Int8GemmError(f"{OP}: {name} must hold {want} values ({'M' if name == 'scales_a' else 'N'}), "
                                f"got shape {tuple(s.shape)}")
        if not s.is_contiguous():
            raise Int8GemmError(f"{OP}: {name} must be contiguous, got strides {s.stride()}")
    devices = {"mat_a": a.device, "mat_b": b.device, "scales_a": scales_a.device, "scales_b": scales_b.device}
    if bias is not None:
        bias = _tensor("bias", bias, OUT_DTYPES)
        if bias.dtype != out_dtype:
            raise Int8GemmError(f"{OP}: bias dtype ({bias.dtype}) must match out_dtype ({out_dtype})")
        if bias.numel() != n:
            raise Int8GemmError(f"{OP}: bias must hold N = {n} values, got shape {tuple(bias.shape)}")
        if not bias.is_contiguous():
            raise Int8GemmError(f"{OP}: bias must be contiguous, got strides {bias.stride()}")
        devices["bias"] = bias.device
    if len(set(devices.values())) != 1:
        raise Int8GemmError(f"{OP}: {', '.join(devices)} must be on one device, got "
                            + ", ".join(f"{k_} on {v}" for k_, v in devices.items()))
    return m, n, k


def epilogue_order(device: torch.device) -> str:
    """The order sgl_kernel's epilogue would take on the GPU `device` plans for (module docstring)."""
    return "sm90" if device_arch(device).hopper else "sm80"


# ---------------------------------------------------------------------------------------------------------------
# the plain-torch twin


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once (an fma), broadcast: the product is exact in fp64, the sum's fp64 rounding error
    is recovered (TwoSum) and settles the one case a second rounding to fp32 could get wrong, an fp64 sum exactly
    half way between two fp32 values."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
    r = s.float()
    d = s - r.double()
    other = torch.nextafter(r, torch.where(d > 0, torch.inf, -torch.inf).float())
    tie = (d != 0) & (s == (r.double() + other.double()) / 2)
    return torch.where(tie & (err != 0) & ((err > 0) == (d > 0)), other, r)


def int8_scaled_mm_torch(mat_a: torch.Tensor, mat_b: torch.Tensor, scales_a: torch.Tensor, scales_b: torch.Tensor,
                         out_dtype: torch.dtype, bias: torch.Tensor | None = None, *,
                         order: str | None = None) -> torch.Tensor:
    """The twin: int8_scaled_mm's result from torch ops (the same bits as the kernel's). The int32 sum is exact in
    fp64 (integers below 2**53 in any summation order), then wrapped to int32 as sgl_kernel's accumulator would;
    `order`: "sm90" or "sm80" (default: the device's, `epilogue_order`)."""
    m, n, _ = check(mat_a, mat_b, scales_a, scales_b, out_dtype, bias)
    order = order if order is not None else epilogue_order(mat_a.device)
    if order not in ORDERS:
        raise Int8GemmError(f"{OP}: order must be one of {', '.join(ORDERS)}, got {order!r}")
    acc = (mat_a.double() @ mat_b.double()).to(torch.int64)
    acc = (acc + 2**31) % 2**32 - 2**31  # int32 wrap-around
    af = acc.float()
    xs, ws = scales_a.reshape(m, 1), scales_b.reshape(1, n)
    if order == "sm90":
        v = af * ws
        v = fma32(xs, v, bias.reshape(1, n).float()) if bias is not None else xs * v
    else:
        s = ws * xs
        v = fma32(af, s, bias.reshape(1, n).float()) if bias is not None else af * s
    return v.to(out_dtype).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# the Triton kernels

@triton.jit
def _epilogue(acc, xs, ws, b, HAS_BIAS: tl.constexpr, SM90: tl.constexpr):
    """fp32 result of an int32 sum (module docstring: the two orders); xs, ws, b broadcast against acc."""
    a = acc.to(tl.float32)
    if SM90:
        v = a * ws
        if HAS_BIAS:
            v = tl.fma(xs, v, b)
        else:
            v = xs * v
    else:
        s = ws * xs
        if HAS_BIAS:
            v = tl.fma(a, s, b)
        else:
            v = a * s
    return v


# M is not specialised (Triton compiles a separate binary for an int argument equal to 1): the batches of one
# BLOCK_M share a binary.
@triton.jit(do_not_specialize=["M"])
def _int8_mm_kernel(a, b, xs_ptr, ws_ptr, bias_ptr, out, M, N, K, k_split, stride_am, stride_bn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SM90: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                    INTERPRET: tl.constexpr):
    # program (n-block, split s, m-block): columns [n0, n0 + BLOCK_N) of rows [m0, m0 + BLOCK_M) over K range
    # [s * k_split, + k_split); out is the output, or (SPLIT) the int32 workspace [S, M, N]
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_ptr = b + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]  # weight tile [BLOCK_N, BLOCK_K]
    x_ptr = a + offs_m.to(tl.int64)[None, :] * stride_am + offs_k[:, None]  # x.T tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.int32)
    k0 = pid_s * k_split
    for k in range(k0, tl.minimum(k0 + k_split, K), BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptr + k, mask=mask_m[None, :], other=0)
        else:
            xt = tl.load(x_ptr + k, mask=mask_m[None, :] & ((k + offs_k) < K)[:, None], other=0)
        if EVEN_K and EVEN_N:  # the real shapes: unmasked, fully vectorised weight loads
            wt = tl.load(w_ptr + k)
        else:
            wt = tl.load(w_ptr + k, mask=mask_n[:, None] & ((k + offs_k) < K)[None, :], other=0)
        acc = tl.dot(wt, xt, acc, out_dtype=tl.int32)
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT:
        ws_out = out + pid_s * M * N + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(ws_out, acc, mask=mask)
    else:
        xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
        ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
        bias = ws  # unread without HAS_BIAS
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        v = _epilogue(acc, xs[None, :], ws[:, None], bias[:, None], HAS_BIAS, SM90)
        o_ptr = out + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(o_ptr, round_to(v, out.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _int8_splitk_epilogue_kernel(ws, xs_ptr, ws_ptr, bias_ptr, out, M, N, SPLITS, stride_om, BLOCK: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, SM90: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m, n = offs // N, offs % N
    acc = tl.load(ws + offs, mask=mask, other=0)
    for s in range(1, SPLITS):  # int32: exact, the unsplit kernel's sum
        acc += tl.load(ws + s * M * N + offs, mask=mask, other=0)
    xs = tl.load(xs_ptr + m, mask=mask, other=0.0)
    w_s = tl.load(ws_ptr + n, mask=mask, other=0.0)
    bias = w_s  # unread without HAS_BIAS
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    v = _epilogue(acc, xs, w_s, bias, HAS_BIAS, SM90)
    tl.store(out + m * stride_om + n, round_to(v, out.dtype.element_ty, INTERPRET), mask=mask)


SPLITK_EPILOGUE_BLOCK = 1024


def launch(mat_a: torch.Tensor, mat_b: torch.Tensor, scales_a: torch.Tensor, scales_b: torch.Tensor,
           out: torch.Tensor, bias: torch.Tensor | None, cfg: Config, order: str) -> torch.Tensor:
    """Run the kernel with an explicit config and epilogue order into `out` ([M, N], rows contiguous); the bench and
    tests time and check every candidate through this. Arguments are assumed checked (`check`)."""
    m, k = mat_a.shape
    n = mat_b.shape[1]
    if m == 0 or n == 0:
        return out
    k_split, n_splits = splits(k, cfg)
    block_m = rows_block(m, cfg)
    grid = (triton.cdiv(n, cfg.block_n), n_splits, triton.cdiv(m, block_m))
    interpret = not mat_a.is_cuda
    has_bias, sm90 = bias is not None, order == "sm90"
    bias_arg = bias if bias is not None else scales_b  # a pointer never read without HAS_BIAS
    target = out if n_splits == 1 else torch.empty((n_splits, m, n), dtype=torch.int32, device=out.device)
    wrap_triton(_int8_mm_kernel)[grid](
        mat_a, mat_b, scales_a, scales_b, bias_arg, target, m, n, k, k_split, mat_a.stride(0), mat_b.stride(1),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=n_splits > 1,
        HAS_BIAS=has_bias, SM90=sm90, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, INTERPRET=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if n_splits > 1:
        wrap_triton(_int8_splitk_epilogue_kernel)[(triton.cdiv(m * n, SPLITK_EPILOGUE_BLOCK),)](
            target, scales_a, scales_b, bias_arg, out, m, n, n_splits, out.stride(0), BLOCK=SPLITK_EPILOGUE_BLOCK,
            HAS_BIAS=has_bias, SM90=sm90, INTERPRET=interpret, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the op


@triton_op("graphcap::int8_scaled_mm", mutates_args=())
def _int8_scaled_mm_op(mat_a: torch.Tensor, mat_b: torch.Tensor, scales_a: torch.Tensor, scales_b: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    order = epilogue_order(mat_a.device)
    if not use_triton(mat_a):
        return int8_scaled_mm_torch(mat_a, mat_b, scales_a, scales_b, out_dtype, bias, order=order)
    m, n = mat_a.shape[0], mat_b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=mat_a.device)
    return launch(mat_a, mat_b, scales_a, scales_b, out, bias, plan(m, n, mat_a.shape[1], device_arch(mat_a.device)),
                  order)


def int8_scaled_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, scales_a: torch.Tensor, scales_b: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """sgl_kernel.int8_scaled_mm (module docstring): out [M, N] of out_dtype = the scaled int8 product of mat_a
    [M, K] (row-major) and mat_b [K, N] (column-major), plus bias."""
    check(mat_a, mat_b, scales_a, scales_b, out_dtype, bias)  # here too: the op's schema would reject first, unnamed
    return _int8_scaled_mm_op(mat_a, mat_b, scales_a, scales_b, out_dtype, bias)
