"""The draft layers' small ops, as two interchangeable sets over the same weights and math.

- `TORCH_OPS`: plain torch ops (the reference; Inductor fuses them when the loop is compiled, eagerly a Gemma
  RMSNorm is ~9 kernels).
- `fused_ops()`: one kernel per op, what sglang's Gemma layers launch on CUDA (sgl_kernel's `gemma_rmsnorm`,
  `gemma_fused_add_rmsnorm`, `gelu_tanh_and_mul`, the rotary kernel; sglang's Triton
  `gemma_rmsnorm_residual_scalar` for post-MLP norm + residual + layer scalar), from graphcap.kernels.fused_ops
  (Triton kernels with sgl_kernel's semantics, torch twins where Triton cannot run).

A draft loop picks its set (`DraftLoop(..., ops=...)`), so the sglang-style baselines and graphcap's own loop run
one model with the same weights. Every op keeps the reference's numerics: norms in fp32 with scale (1 + weight).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

EPS = 1e-6


class DraftOps(Protocol):
    name: str

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def norm_add_scale(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       scalar: torch.Tensor) -> torch.Tensor: ...

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def _rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [B, H, D]; cos/sin [B, D/2] (rotate-half layout)."""
    half = q.shape[-1] // 2
    q1, q2 = q[..., :half].float(), q[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], dim=-1).to(q.dtype)


@dataclass(frozen=True)
class TorchOps:
    """Plain torch ops: the reference model's own code."""

    name: str = "torch"

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _norm(x, weight)

    def add_norm(self, x, residual, weight):
        residual = residual + x
        return _norm(residual, weight), residual

    def norm_add_scale(self, x, weight, residual, scalar):
        return (residual + _norm(x, weight)) * scalar

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate="tanh") * up

    def rope(self, q, cos, sin):
        return _rope(q, cos, sin)


TORCH_OPS = TorchOps()
FUSED_MODULE = "graphcap.kernels.fused_ops"


@dataclass(frozen=True)
class FusedOps:
    """One kernel per op (sglang's launches). `mod` is graphcap.kernels.fused_ops; its functions take sgl_kernel's
    arguments (2-D inputs, in-place add-norm) - this class is the one place that adapts the draft's shapes."""

    mod: object
    name: str = "fused"

    def norm(self, x, weight):
        shape = x.shape
        return self.mod.gemma_rmsnorm(x.reshape(-1, shape[-1]), weight, EPS).view(shape)

    def add_norm(self, x, residual, weight):
        # sgl_kernel semantics: residual += x and x = norm(residual), both in place; the callers' tensors are
        # fresh activations of this layer, so clone nothing
        self.mod.gemma_fused_add_rmsnorm(x, residual, weight, EPS)
        return x, residual

    def norm_add_scale(self, x, weight, residual, scalar):
        fn = getattr(self.mod, "gemma_rmsnorm_residual_scalar", None)
        if fn is not None:
            return fn(x, weight, residual, scalar, EPS)
        return (residual + self.norm(x, weight)) * scalar  # 2 kernels more than sglang's fused one

    def gelu_mul(self, gate_up):
        return self.mod.gelu_tanh_and_mul(gate_up)

    def rope(self, q, cos, sin):
        return self.mod.rotary(q, cos, sin)


def fused_ops() -> FusedOps:
    """The fused set; ImportError (with the reason) where graphcap.kernels.fused_ops is missing."""
    return FusedOps(importlib.import_module(FUSED_MODULE))


def ops_named(name: str) -> DraftOps:
    if name == "torch":
        return TORCH_OPS
    if name == "fused":
        return fused_ops()
    raise ValueError(f"unknown draft op set {name!r}; expected 'torch' or 'fused'")
