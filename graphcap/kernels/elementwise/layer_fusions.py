"""The draft layer's chains of small ops, each one Triton kernel, beside its torch twin.

sglang (and `fused_ops` beside this module, which launches what sglang launches) runs one kernel per norm. In the
draft layer the norms come in chains, each link reading what the one before wrote, so a chain is one pass over a row:
- `norm_rope(q, weight, cos, sin, slots, lens)`: every query head's RMSNorm, then its rotary (NeoX halves: a head's
  element i pairs with i + D/2) at the row's query position, read from the position tables in the kernel - the
  layer's q_norm and rope. The position is the draft's (its last token's, lens[slots[b]] - 1), found in the kernel
  too, so a compiled loop gathers no cos/sin rows outside it (gathered once per iteration, Inductor still ran such
  gathers in every layer call: docs/results.md, where the time goes);
- `norm_add_norm(x, residual, w_x, w_sum) -> (normed, sum)`: sum = residual + norm(x, w_x), normed = norm(sum, w_sum)
  - the attention output's post-norm, the residual add and the MLP's pre-norm;
- `norm_add_scale_norm(x, w_x, residual, scalar, w_out) -> (out, normed)`: out = (residual + norm(x, w_x)) * scalar,
  normed = norm(out, w_out) - the post-MLP norm, residual and layer scalar, and the next layer's input norm (the
  final norm after the last layer): a layer's output norm is the next one's input.
Norms are Gemma's: x / rms(x) * (1 + weight), in fp32. Each kernel rounds to the activation dtype where the
reference (graphcap.models.draft_ops.TorchOps, one torch op at a time) rounds - after each norm, add and scale - so
it differs from the reference only in the order of fp32 sums. One program per row (a hidden row, or a query head),
the whole row in registers.

Dispatch (`graphcap.kernels.use_triton`): CUDA tensors, and CPU tensors under TRITON_INTERPRET=1, run the kernel;
otherwise the twin (`*_torch`, also the tests' reference) runs. The ops are `torch.library.triton_op`s returning new
tensors, so Inductor traces loops that call them and keeps each one kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from graphcap.kernels import use_triton
from graphcap.kernels.checks import check_eps, check_same_device, check_tensor
from graphcap.kernels.elementwise.fused_ops import DTYPES, FusedOpError

__all__ = ["norm_rope", "norm_add_norm", "norm_add_scale_norm", "norm_rope_torch", "norm_add_norm_torch",
           "norm_add_scale_norm_torch", "query_positions"]

INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# torch twins: the reference's own ops, in its order (graphcap.models.draft_ops)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def query_positions(slots: torch.Tensor, lens: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Each row's query position, lens[slots[b]] - 1 (int64), at least 0 and, with `rows`, at most rows - 1 (the
    last row of a position table)."""
    pos = lens[slots].long() - 1
    return pos.clamp(0, None if rows is None else rows - 1)


def norm_rope_torch(q: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                    lens: torch.Tensor, eps: float) -> torch.Tensor:
    """q [B, H, D]; weight [D]; cos, sin [P, D/2] fp32 position tables; slots [B], lens indexed by slot."""
    pos = query_positions(slots, lens, cos.shape[0])
    n = _norm(q, weight, eps)
    half = q.shape[-1] // 2
    q1, q2 = n[..., :half].float(), n[..., half:].float()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    return torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], dim=-1).to(q.dtype)


def norm_add_norm_torch(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = residual + _norm(x, w_x, eps)
    return _norm(s, w_sum, eps), s


def norm_add_scale_norm_torch(x: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor, scalar: torch.Tensor,
                              w_out: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = (residual + _norm(x, w_x, eps)) * scalar
    return out, _norm(out, w_out, eps)


# ---------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _gemma_norm(v, w, cols, mask, n, eps):
    """fp32 row `v` normalised and scaled by (1 + w), still fp32 (the caller rounds)."""
    r = tl.math.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    return v * r * (tl.load(w + cols, mask=mask, other=0.0).to(tl.float32) + 1.0)


@triton.jit
def _norm_rope_kernel(q, w, cos, sin, slots, lens, out, H, half, rows, stride_qb, stride_qh, stride_ob, stride_oh,
                      stride_c, stride_s, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    slot = tl.load(slots + b).to(tl.int64)
    p = tl.minimum(tl.maximum(tl.load(lens + slot).to(tl.int64) - 1, 0), rows - 1)  # query_positions
    i = tl.arange(0, BLOCK)
    m = i < half
    base = q + b * stride_qb + h * stride_qh
    x1 = tl.load(base + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half) + eps)
    dt = out.dtype.element_ty
    n1 = (x1 * r * (tl.load(w + i, mask=m, other=0.0).to(tl.float32) + 1.0)).to(dt).to(tl.float32)
    n2 = (x2 * r * (tl.load(w + half + i, mask=m, other=0.0).to(tl.float32) + 1.0)).to(dt).to(tl.float32)
    c = tl.load(cos + p * stride_c + i, mask=m, other=0.0)
    s = tl.load(sin + p * stride_s + i, mask=m, other=0.0)
    o = out + b * stride_ob + h * stride_oh
    tl.store(o + i, (n1 * c - n2 * s).to(dt), mask=m)
    tl.store(o + half + i, (n2 * c + n1 * s).to(dt), mask=m)


@triton.jit
def _norm_add_norm_kernel(x, res, w_x, w_sum, normed, total, n, stride_x, stride_r, stride_n, stride_t, eps,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    dt = total.dtype.element_ty
    v = tl.load(x + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    a = _gemma_norm(v, w_x, cols, m, n, eps).to(dt).to(tl.float32)
    s = (tl.load(res + row * stride_r + cols, mask=m, other=0.0).to(tl.float32) + a).to(dt)
    tl.store(total + row * stride_t + cols, s, mask=m)
    out = _gemma_norm(s.to(tl.float32), w_sum, cols, m, n, eps)
    tl.store(normed + row * stride_n + cols, out.to(dt), mask=m)


@triton.jit
def _norm_add_scale_norm_kernel(x, res, w_x, scalar, w_out, out, normed, n, stride_x, stride_r, stride_o, stride_n,
                                eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    dt = out.dtype.element_ty
    v = tl.load(x + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    a = _gemma_norm(v, w_x, cols, m, n, eps).to(dt).to(tl.float32)
    t = (tl.load(res + row * stride_r + cols, mask=m, other=0.0).to(tl.float32) + a).to(dt).to(tl.float32)
    o = (t * tl.load(scalar).to(tl.float32)).to(dt)
    tl.store(out + row * stride_o + cols, o, mask=m)
    y = _gemma_norm(o.to(tl.float32), w_out, cols, m, n, eps)
    tl.store(normed + row * stride_n + cols, y.to(dt), mask=m)


def warps_for(block: int) -> int:
    """Warps per program for a row of `block` elements: 256 a warp, 1 to 16 (lab/row_kernels.py times others)."""
    return min(16, max(1, block // 256))


@triton_op("graphcap::norm_rope", mutates_args=())
def _norm_rope_op(q: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  lens: torch.Tensor, eps: float) -> torch.Tensor:
    if not use_triton(q):
        return norm_rope_torch(q, weight, cos, sin, slots, lens, eps)
    b, h, d = q.shape
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    half = d // 2
    block = triton.next_power_of_2(half)
    wrap_triton(_norm_rope_kernel)[(b * h,)](
        q, weight, cos, sin, slots, lens, out, h, half, cos.shape[0], q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), cos.stride(0), sin.stride(0), eps, BLOCK=block, num_warps=warps_for(block),
    )
    return out


def launch_norm_add_norm(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor, eps: float,
                         num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm_add_norm kernel, one program per row (unchecked; num_warps: `_warps`' unless given)."""
    rows, n = x.shape
    normed = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    total = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return normed, total
    block = triton.next_power_of_2(n)
    wrap_triton(_norm_add_norm_kernel)[(rows,)](
        x, residual, w_x, w_sum, normed, total, n, x.stride(0), residual.stride(0), normed.stride(0), total.stride(0),
        eps, BLOCK=block, num_warps=num_warps or warps_for(block),
    )
    return normed, total


def launch_norm_add_scale_norm(x: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor, scalar: torch.Tensor,
                               w_out: torch.Tensor, eps: float, num_warps: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm_add_scale_norm kernel, one program per row (unchecked; num_warps: `_warps`' unless given)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    normed = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out, normed
    block = triton.next_power_of_2(n)
    wrap_triton(_norm_add_scale_norm_kernel)[(rows,)](
        x, residual, w_x, scalar, w_out, out, normed, n, x.stride(0), residual.stride(0), out.stride(0),
        normed.stride(0), eps, BLOCK=block, num_warps=num_warps or warps_for(block),
    )
    return out, normed


@triton_op("graphcap::norm_add_norm", mutates_args=())
def _norm_add_norm_op(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return norm_add_norm_torch(x, residual, w_x, w_sum, eps)
    return launch_norm_add_norm(x, residual, w_x, w_sum, eps)


@triton_op("graphcap::norm_add_scale_norm", mutates_args=())
def _norm_add_scale_norm_op(x: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor, scalar: torch.Tensor,
                            w_out: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return norm_add_scale_norm_torch(x, w_x, residual, scalar, w_out, eps)
    return launch_norm_add_scale_norm(x, w_x, residual, scalar, w_out, eps)


# ---------------------------------------------------------------------------------------------------------------
# checked entry points (shapes, dtypes, devices, strides: nothing that needs a GPU value)


def _check_rows(op: str, named: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    """2-D activations of one shape and dtype, 1-D weights as wide as their rows, all on one device."""
    first = next(iter(named))
    ref = check_tensor(FusedOpError, op, first, named[first], DTYPES, 2)
    for name, x in named.items():
        check_tensor(FusedOpError, op, name, x, DTYPES, 2)
        if x.shape != ref.shape or x.dtype != ref.dtype:
            raise FusedOpError(f"{op}: {name} must match {first} ({ref.dtype} {tuple(ref.shape)}), "
                               f"got {x.dtype} {tuple(x.shape)}")
    for name, w in weights.items():
        check_tensor(FusedOpError, op, name, w, DTYPES, 1)
        if w.shape[0] != ref.shape[1]:
            raise FusedOpError(f"{op}: {name} has {w.shape[0]} entries, rows have {ref.shape[1]}")
    check_same_device(FusedOpError, op, **named, **weights)


def check_norm_rope(op: str, q: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slots: torch.Tensor, lens: torch.Tensor, eps: float) -> float:
    """`norm_rope`'s arguments (FusedOpError naming `op` and the argument); returns eps as a float. Also what
    decode_attention checks when it norms and rotates its query itself."""
    check_tensor(FusedOpError, op, "q", q, DTYPES, 3)
    check_tensor(FusedOpError, op, "weight", weight, DTYPES, 1)
    if q.shape[-1] % 2 or weight.shape[0] != q.shape[-1]:
        raise FusedOpError(f"{op}: q's head dim {q.shape[-1]} must be even and equal weight's {weight.shape[0]}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(FusedOpError, op, name, t, (torch.float32,), 2)
        if t.shape[0] < 1 or t.shape[1] != q.shape[-1] // 2:
            raise FusedOpError(f"{op}: {name} must be [positions >= 1, {q.shape[-1] // 2}] (a table of D/2 columns), "
                               f"got {tuple(t.shape)}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise FusedOpError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape and layout")
    for name, t, n in (("slots", slots, q.shape[0]), ("lens", lens, None)):
        check_tensor(FusedOpError, op, name, t, INDEX_DTYPES, 1)
        if n is not None and t.shape[0] != n:
            raise FusedOpError(f"{op}: {name} must have one entry per row of q ({n}), got {tuple(t.shape)}")
    check_same_device(FusedOpError, op, q=q, weight=weight, cos=cos, sin=sin, slots=slots, lens=lens)
    return check_eps(FusedOpError, op, eps)


def norm_rope(q: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
              lens: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each head of q [B, H, D] RMS-normalised with scale (1 + weight [D]), then rotated at its row's query position
    p = lens[slots[b]] - 1 (`query_positions`: at least 0, at most P - 1): halves (x1, x2) become
    (x1 cos[p] - x2 sin[p], x2 cos[p] + x1 sin[p]) with cos, sin [P, D/2] fp32 position tables. slots [B] and lens
    integer tensors; every slot must index lens (the draft's slots do: padding rows carry the padding slot). A new
    tensor."""
    eps = check_norm_rope("norm_rope", q, weight, cos, sin, slots, lens, eps)
    return _norm_rope_op(q, weight, cos, sin, slots, lens, eps)


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, w_x: torch.Tensor, w_sum: torch.Tensor,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum, w_sum), sum) with sum = residual + norm(x, w_x), for x, residual [rows, n]. New tensors."""
    _check_rows("norm_add_norm", {"x": x, "residual": residual}, {"w_x": w_x, "w_sum": w_sum})
    return _norm_add_norm_op(x, residual, w_x, w_sum, check_eps(FusedOpError, "norm_add_norm", eps))


def norm_add_scale_norm(x: torch.Tensor, w_x: torch.Tensor, residual: torch.Tensor, scalar: torch.Tensor,
                        w_out: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, norm(out, w_out)) with out = (residual + norm(x, w_x)) * scalar (a one-element tensor), for x,
    residual [rows, n]. New tensors."""
    op = "norm_add_scale_norm"
    _check_rows(op, {"x": x, "residual": residual}, {"w_x": w_x, "w_out": w_out})
    if not isinstance(scalar, torch.Tensor) or scalar.dtype not in DTYPES or scalar.numel() != 1:
        raise FusedOpError(f"{op}: scalar must be a one-element float tensor, got "
                           f"{getattr(scalar, 'dtype', type(scalar).__name__)} {tuple(getattr(scalar, 'shape', ()))}")
    check_same_device(FusedOpError, op, x=x, scalar=scalar)
    return _norm_add_scale_norm_op(x, w_x, residual, scalar, w_out, check_eps(FusedOpError, op, eps))
