"""The elementwise / per-row ops sglang's Gemma layers launch from `sgl_kernel`, one Triton kernel per call.

Each op has sgl_kernel's name, signature and semantics (in place where sgl_kernel is in place), so it serves two
users: the stand-in `sgl_kernel` package of the engine tests (tests/support/sgl_kernel) and benches that must launch
what sglang launches - one kernel per norm, per fused residual-add + norm, per gated activation, per rotary call.

- `rmsnorm(input, weight, eps, out=None, enable_pdl=None) -> out`: out = input / rms(input) * weight.
- `fused_add_rmsnorm(input, residual, weight, eps, enable_pdl=None) -> None`: residual += input; input = the norm of
  that sum. As in sgl_kernel (flashinfer's kernel), the sum is kept in fp32 for the norm; only the residual written
  back is rounded to its dtype.
- `gemma_rmsnorm` / `gemma_fused_add_rmsnorm`: the same with `(1 + weight)` as the scale.
- `gelu_tanh_and_mul`, `gelu_and_mul`, `silu_and_mul(input, out=None) -> out`: act(input[..., :d]) * input[..., d:].
- `apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True,
  fused_set_kv_buffer_arg=None, enable_pdl=None) -> None`: rotates the first `cos_sin_cache.shape[1]` dims of every
  query and key head in place; cache row p = [cos(p * f_i) for i < rot/2] + [sin(p * f_i)]. NeoX pairs (i, i + rot/2),
  otherwise (2i, 2i + 1).
All arithmetic is fp32, outputs are rounded once to the output dtype. `enable_pdl` as sgl_kernel reads it: None (its
default) or True launches with programmatic dependent launch where graphcap's kernels take it (graphcap.kernels.pdl:
sm_90 and up), False without. Unlike sgl_kernel, the activations do not require 16-byte rows, and
the weight may be any float dtype (it is read as fp32). Positions are not range-checked (that would need a sync).

Dispatch (`graphcap.kernels.use_triton`): CUDA tensors and, under TRITON_INTERPRET=1, CPU tensors run the kernel;
otherwise the plain-torch twin (`*_ref`, also the tests' reference) runs. The kernels are `torch.library.triton_op`s
that name what they mutate, so torch.compile/Inductor can trace loops that call them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import pdl
from graphcap.kernels.pdl import pdl_start

from graphcap.kernels import use_triton
from graphcap.kernels.checks import check_eps, check_same_device, check_tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
ACTS = {"gelu_tanh": 0, "gelu": 1, "silu": 2}


class FusedOpError(ValueError):
    """Bad input to a fused op; the message names the op and the argument."""


# ---------------------------------------------------------------------------------------------------------------
# checks (shapes, dtypes, devices, strides only: nothing that needs a GPU value)


def _check_norm(op: str, input: torch.Tensor, weight: torch.Tensor, eps: float, **others: torch.Tensor | None) -> None:
    check_tensor(FusedOpError, op, "input", input, DTYPES, 2)
    check_tensor(FusedOpError, op, "weight", weight, DTYPES, 1)
    if weight.shape[0] != input.shape[1]:
        raise FusedOpError(f"{op}: weight has {weight.shape[0]} entries, input rows have {input.shape[1]}")
    check_eps(FusedOpError, op, eps)
    for name, x in others.items():
        if x is None:
            continue
        check_tensor(FusedOpError, op, name, x, DTYPES, 2)
        if x.shape != input.shape or x.dtype != input.dtype:
            raise FusedOpError(f"{op}: {name} must match input ({input.dtype} {tuple(input.shape)}), "
                               f"got {x.dtype} {tuple(x.shape)}")
    given = {k: v for k, v in others.items() if v is not None}
    check_same_device(FusedOpError, op, input=input, weight=weight, **given)


def _check_rows(op: str, name: str, x: torch.Tensor) -> None:
    """The kernels see x as [rows, last dim] through one row stride."""
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        raise FusedOpError(f"{op}: {name}'s leading dimensions must collapse into rows without a copy "
                           f"(strides {x.stride()})") from None


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm family: one program per row, the whole row in one block


@triton.jit
def _rmsnorm_kernel(x, res, out, w, n, x_stride, res_stride, out_stride, eps,
                    W_OFFSET: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
    pdl_start(GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    v = tl.load(x + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:
        v += tl.load(res + row * res_stride + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(res + row * res_stride + cols, v.to(res.dtype.element_ty), mask=m)
    rrms = tl.math.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    scale = tl.load(w + cols, mask=m, other=0.0).to(tl.float32) + W_OFFSET
    tl.store(out + row * out_stride + cols, (v * rrms * scale).to(out.dtype.element_ty), mask=m)


def _pdl_options(x: torch.Tensor, enable_pdl: bool) -> dict:
    """A launch's PDL options: graphcap's choice (graphcap.kernels.pdl), unless the caller said False."""
    return pdl.launch_options(x) if enable_pdl else {"GDC": False}


def _norm_launch(x: torch.Tensor, res: torch.Tensor | None, out: torch.Tensor, weight: torch.Tensor, eps: float,
                 w_offset: float, enable_pdl: bool) -> None:
    n = x.shape[1]
    if x.shape[0] == 0 or n == 0:
        return
    block = triton.next_power_of_2(n)
    r = res if res is not None else x
    wrap_triton(_rmsnorm_kernel)[(x.shape[0],)](
        x, r, out, weight, n, x.stride(0), r.stride(0), out.stride(0), eps,
        W_OFFSET=w_offset, ADD=res is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        **_pdl_options(x, enable_pdl),
    )


def _norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, w_offset: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (weight.float() + w_offset)


@triton_op("graphcap::rmsnorm", mutates_args={"out"})
def _rmsnorm_op(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float, w_offset: float,
                enable_pdl: bool) -> None:
    if use_triton(input):
        _norm_launch(input, None, out, weight, eps, w_offset, enable_pdl)
    else:
        out.copy_(_norm_torch(input, weight, eps, w_offset))


@triton_op("graphcap::fused_add_rmsnorm", mutates_args={"input", "residual"})
def _fused_add_rmsnorm_op(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          w_offset: float, enable_pdl: bool) -> None:
    if use_triton(input):
        _norm_launch(input, residual, input, weight, eps, w_offset, enable_pdl)
    else:
        _fused_add_twin_op(input, residual, weight, eps, w_offset)


# Opaque to Inductor: its CPU code generator fails on the inlined twin (torch 2.13, KeyError in outer-loop fusion).
@torch.library.custom_op("graphcap::fused_add_rmsnorm_twin", mutates_args={"input", "residual"})
def _fused_add_twin_op(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       w_offset: float) -> None:
    _fused_add_torch(input, residual, weight, eps, w_offset)


def _fused_add_torch(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     w_offset: float) -> None:
    s = input.float() + residual.float()  # the norm reads the fp32 sum, not the rounded residual
    normed = _norm_torch(s, weight, eps, w_offset)
    residual.copy_(s)
    input.copy_(normed)


def _norm_out(op: str, input: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None) -> torch.Tensor:
    _check_norm(op, input, weight, eps, out=out)
    return torch.empty_like(input) if out is None else out


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    out = _norm_out("rmsnorm", input, weight, eps, out)
    _rmsnorm_op(out, input, weight, float(eps), 0.0, enable_pdl is not False)
    return out


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
                  enable_pdl: bool | None = None) -> torch.Tensor:
    out = _norm_out("gemma_rmsnorm", input, weight, eps, out)
    _rmsnorm_op(out, input, weight, float(eps), 1.0, enable_pdl is not False)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    _check_norm("fused_add_rmsnorm", input, weight, eps, residual=residual)
    _fused_add_rmsnorm_op(input, residual, weight, float(eps), 0.0, enable_pdl is not False)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            enable_pdl: bool | None = None) -> None:
    _check_norm("gemma_fused_add_rmsnorm", input, weight, eps, residual=residual)
    _fused_add_rmsnorm_op(input, residual, weight, float(eps), 1.0, enable_pdl is not False)


def rmsnorm_ref(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
                enable_pdl: bool | None = None) -> torch.Tensor:
    out = _norm_out("rmsnorm", input, weight, eps, out)
    return out.copy_(_norm_torch(input, weight, eps, 0.0))


def gemma_rmsnorm_ref(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
                      enable_pdl: bool | None = None) -> torch.Tensor:
    out = _norm_out("gemma_rmsnorm", input, weight, eps, out)
    return out.copy_(_norm_torch(input, weight, eps, 1.0))


def fused_add_rmsnorm_ref(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                          enable_pdl: bool | None = None) -> None:
    _check_norm("fused_add_rmsnorm", input, weight, eps, residual=residual)
    _fused_add_torch(input, residual, weight, eps, 0.0)


def gemma_fused_add_rmsnorm_ref(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                                enable_pdl: bool | None = None) -> None:
    _check_norm("gemma_fused_add_rmsnorm", input, weight, eps, residual=residual)
    _fused_add_torch(input, residual, weight, eps, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# gated activations: out = act(input[..., :d]) * input[..., d:]


@triton.jit
def _act_mul_kernel(x, out, d, x_stride, out_stride, ACT: tl.constexpr, BLOCK: tl.constexpr,
                    GDC: tl.constexpr = False):
    pdl_start(GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < d
    a = tl.load(x + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(x + row * x_stride + d + cols, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:  # 0.5 a (1 + tanh(u)) == a * sigmoid(2u): no tanh needed
        g = a * tl.sigmoid(2.0 * 0.7978845608028654 * (a + 0.044715 * a * a * a))
    elif ACT == 1:
        g = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
    else:
        g = a * tl.sigmoid(a)
    tl.store(out + row * out_stride + cols, (g * b).to(out.dtype.element_ty), mask=m)


def _act_torch(x: torch.Tensor, act: int) -> torch.Tensor:
    d = x.shape[-1] // 2
    a, b = x[..., :d].float(), x[..., d:].float()
    if act == 0:
        g = torch.nn.functional.gelu(a, approximate="tanh")
    elif act == 1:
        g = torch.nn.functional.gelu(a)
    else:
        g = torch.nn.functional.silu(a)
    return g * b


@triton_op("graphcap::act_and_mul", mutates_args={"out"})
def _act_and_mul_op(out: torch.Tensor, input: torch.Tensor, act: int) -> None:
    if not use_triton(input):
        out.copy_(_act_torch(input, act))
        return
    d = out.shape[-1]
    x2 = input.view(-1, input.shape[-1])
    if x2.shape[0] == 0 or d == 0:
        return
    block = min(1024, triton.next_power_of_2(d))
    wrap_triton(_act_mul_kernel)[(x2.shape[0], triton.cdiv(d, block))](
        input, out, d, x2.stride(0), out.view(-1, d).stride(0), ACT=act, BLOCK=block, **pdl.launch_options(input),
    )


def _act_out(op: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    check_tensor(FusedOpError, op, "input", input, DTYPES)
    if input.ndim == 0 or input.shape[-1] % 2:
        raise FusedOpError(f"{op}: input's last dimension must be even, got shape {tuple(input.shape)}")
    _check_rows(op, "input", input)
    shape = input.shape[:-1] + (input.shape[-1] // 2,)
    if out is None:
        return torch.empty(shape, dtype=input.dtype, device=input.device)
    check_tensor(FusedOpError, op, "out", out, (input.dtype,))
    if out.shape != shape:
        raise FusedOpError(f"{op}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    _check_rows(op, "out", out)
    check_same_device(FusedOpError, op, input=input, out=out)
    return out


def _act_and_mul(name: str, act: str) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """sgl_kernel's `name(input, out=None)`: act(input[..., :d]) * input[..., d:] in one kernel, and its torch twin
    (`name`_ref), for one activation of ACTS."""
    def fused(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = _act_out(name, input, out)
        _act_and_mul_op(out, input, ACTS[act])
        return out

    def ref(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _act_out(name, input, out).copy_(_act_torch(input, ACTS[act]))

    fused.__name__ = fused.__qualname__ = name
    ref.__name__ = ref.__qualname__ = f"{name}_ref"
    return fused, ref


gelu_tanh_and_mul, gelu_tanh_and_mul_ref = _act_and_mul("gelu_tanh_and_mul", "gelu_tanh")
gelu_and_mul, gelu_and_mul_ref = _act_and_mul("gelu_and_mul", "gelu")
silu_and_mul, silu_and_mul_ref = _act_and_mul("silu_and_mul", "silu")


# ---------------------------------------------------------------------------------------------------------------
# rotary embedding, in place on query and key: one program per (token, head), query and key heads in one launch


@triton.jit
def _rope_kernel(q, k, cache, pos, q_ts, q_hs, k_ts, k_hs, cache_stride, nq, half,
                 NEOX: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
    pdl_start(GDC)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < nq:
        base = q + t * q_ts + h * q_hs
    else:
        base = k + t * k_ts + (h - nq) * k_hs
    p = tl.load(pos + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < half
    cos = tl.load(cache + p * cache_stride + i, mask=m, other=0.0)
    sin = tl.load(cache + p * cache_stride + half + i, mask=m, other=0.0)
    if NEOX:
        i1, i2 = i, i + half
    else:
        i1, i2 = 2 * i, 2 * i + 1
    x1 = tl.load(base + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=m, other=0.0).to(tl.float32)
    tl.store(base + i1, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=m)
    tl.store(base + i2, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=m)


def _heads(x: torch.Tensor, head_size: int) -> tuple[int, int, int]:
    """(heads, token stride, head stride) of a [nnz, H * D] or [nnz, H, D] tensor."""
    if x.ndim == 2:
        return x.shape[1] // head_size, x.stride(0), head_size
    return x.shape[1], x.stride(0), x.stride(1)


def _rope_torch(positions: torch.Tensor, x: torch.Tensor, head_size: int, cache: torch.Tensor, is_neox: bool) -> None:
    rot = cache.shape[1]
    half = rot // 2
    x3 = x.view(x.shape[0], -1, head_size)
    cs = cache[positions.long()][:, None, :]
    cos, sin = cs[..., :half], cs[..., half:]
    v1, v2 = (x3[..., :half], x3[..., half:rot]) if is_neox else (x3[..., 0:rot:2], x3[..., 1:rot:2])
    x1, x2 = v1.to(torch.float32, copy=True), v2.to(torch.float32, copy=True)  # copies: v1 is written first
    v1.copy_(x1 * cos - x2 * sin)
    v2.copy_(x2 * cos + x1 * sin)


@triton_op("graphcap::rope_cos_sin_cache", mutates_args={"query", "key"})
def _rope_op(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
             cos_sin_cache: torch.Tensor, is_neox: bool, enable_pdl: bool) -> None:
    if not use_triton(query):
        _rope_torch(positions, query, head_size, cos_sin_cache, is_neox)
        _rope_torch(positions, key, head_size, cos_sin_cache, is_neox)
        return
    nq, q_ts, q_hs = _heads(query, head_size)
    nk, k_ts, k_hs = _heads(key, head_size)
    half = cos_sin_cache.shape[1] // 2
    if positions.shape[0] == 0 or half == 0:
        return
    wrap_triton(_rope_kernel)[(positions.shape[0], nq + nk)](
        query, key, cos_sin_cache, positions, q_ts, q_hs, k_ts, k_hs, cos_sin_cache.stride(0), nq, half,
        NEOX=is_neox, BLOCK=triton.next_power_of_2(half), **_pdl_options(query, enable_pdl),
    )


def _check_rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                cos_sin_cache: torch.Tensor, fused_set_kv_buffer_arg: object) -> None:
    op = "apply_rope_with_cos_sin_cache_inplace"
    if fused_set_kv_buffer_arg is not None:
        raise NotImplementedError(f"{op}: fused_set_kv_buffer_arg (writing K/V to the cache) is not provided")
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size < 1:
        raise FusedOpError(f"{op}: head_size must be an int >= 1, got {head_size!r}")
    check_tensor(FusedOpError, op, "positions", positions, INDEX_DTYPES, 1)
    if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dtype != torch.float32:
        raise FusedOpError(f"{op}: cos_sin_cache must be float32 (as sgl_kernel requires), got {cos_sin_cache.dtype}")
    check_tensor(FusedOpError, op, "cos_sin_cache", cos_sin_cache, (torch.float32,), 2)
    rot = cos_sin_cache.shape[1]
    if rot % 2 or not 0 < rot <= head_size:
        raise FusedOpError(f"{op}: cos_sin_cache's width (the rotary dim, {rot}) must be even and in "
                           f"[2, head_size={head_size}]")
    for name, x in (("query", query), ("key", key)):
        check_tensor(FusedOpError, op, name, x, DTYPES)
        if x.ndim not in (2, 3) or x.shape[0] != positions.shape[0]:
            raise FusedOpError(f"{op}: {name} must be [nnz, heads * head_size] or [nnz, heads, head_size] with "
                               f"nnz = len(positions) = {positions.shape[0]}, got {tuple(x.shape)}")
        if (x.ndim == 2 and x.shape[1] % head_size) or (x.ndim == 3 and x.shape[2] != head_size):
            raise FusedOpError(f"{op}: {name}'s shape {tuple(x.shape)} does not hold heads of size {head_size}")
    if key.dtype != query.dtype:
        raise FusedOpError(f"{op}: query and key dtypes differ ({query.dtype}, {key.dtype})")
    check_same_device(FusedOpError, op, positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
    is_neox: bool = True, fused_set_kv_buffer_arg: object = None, enable_pdl: bool | None = None,
) -> None:
    _check_rope(positions, query, key, head_size, cos_sin_cache, fused_set_kv_buffer_arg)
    _rope_op(positions, query, key, head_size, cos_sin_cache, bool(is_neox), enable_pdl is not False)


def apply_rope_with_cos_sin_cache_inplace_ref(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
    is_neox: bool = True, fused_set_kv_buffer_arg: object = None, enable_pdl: bool | None = None,
) -> None:
    _check_rope(positions, query, key, head_size, cos_sin_cache, fused_set_kv_buffer_arg)
    _rope_torch(positions, query, head_size, cos_sin_cache, bool(is_neox))
    _rope_torch(positions, key, head_size, cos_sin_cache, bool(is_neox))
