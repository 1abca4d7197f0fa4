"""Triton kernels, each beside its plain-torch twin, grouped by what they compute: `attention` (decode, verify, their
plan), `gemm` (the skinny GEMM), `head` (the draft head's scores, top-ks and pick), `elementwise` (norms, adds, gated
activations, rotary) and `window` (the window ring's updates). Here: where a kernel runs (`use_triton`).

A kernel runs where Triton can run it: on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1` (how CI checks
the kernels themselves). Elsewhere the op falls back to its twin, which is also the tests' reference.

The GPU the planners plan for, and the switch forcing an A100's paths (`GRAPHCAP_KERNEL_PATHS=sm80`), are
`graphcap.kernels.arch`'s; the switch's Triton side is applied here, on import, before any kernel compiles.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from graphcap.kernels.arch import apply_triton_arch

apply_triton_arch()
_twin_only = False


def use_triton(t: torch.Tensor) -> bool:
    if _twin_only and not t.is_cuda:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def twins_on_cpu() -> Iterator[None]:
    """Run CPU tensors through the torch twins even under TRITON_INTERPRET=1 (tests of the twins themselves, and
    torch.compile on CPU, where Inductor cannot lower interpreted Triton kernels)."""
    global _twin_only
    old, _twin_only = _twin_only, True
    try:
        yield
    finally:
        _twin_only = old
