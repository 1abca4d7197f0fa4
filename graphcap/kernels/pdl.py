"""Programmatic dependent launch (PDL): a kernel launched with it may start while the kernel before it on the stream
is still finishing, and waits inside (`griddepcontrol.wait`) until that one has completed and its writes are
visible. Inside a captured CUDA graph the launch becomes a programmatic edge, so the next kernel's launch and set-up
overlap the tail of the one before: on an H100, 0.6-0.95 us per launch of a chain of dependent memory-bound kernels
(lab/results/pdl-chain-h100.json). The draft iteration is ~200 such launches.

How graphcap's kernels take it:
- `pdl_start(GDC)` is every such kernel's first statement: with GDC it waits for the previous kernel, then lets the
  next one launch (`gdc_launch_dependents`: its programs may become resident and wait in turn). Nothing is read or
  written before the wait, so what any earlier kernel wrote is visible and nothing an earlier kernel still reads is
  overwritten; the wait in every program before it ends makes completion transitive along a chain of such kernels.
- `launch_options(t)` is what the launch passes: `launch_pdl` and GDC=True where `enabled(t)`, else GDC=False (the
  same kernel, the instructions compiled out).

`enabled(t)`: a CUDA tensor on a GPU the planners describe as Hopper or later (capability 9.0: `griddepcontrol` is an
sm_90 instruction, so an A100 and the `GRAPHCAP_KERNEL_PATHS=sm80` switch keep plain launches), `GRAPHCAP_PDL` not
`0`, a Triton that has the instructions, and not where torch records the launch instead of running it (torch.compile;
wrap_triton's higher-order op outside a triton_op run eagerly): the wrapper takes the launch options it knows, not
`launch_pdl`, and a compiled iteration's kernels are launched by Inductor's code.
Kernels of other libraries around graphcap's (sglang's, cuBLAS) launch as they do: a kernel launched without PDL
starts after everything before it, and one with PDL after such a kernel waits for its completion.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from graphcap import envvars
from graphcap.kernels.arch import device_arch

try:  # whether torch.library.wrap_triton dispatches as its higher-order op (everywhere but an eager triton_op's body)
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:  # a torch without the switch records a launch only under torch.compile
    def is_wrap_triton_enabled() -> bool:
        return False


@functools.lru_cache(maxsize=None)
def _switched_on() -> bool:
    """`GRAPHCAP_PDL`, read once per process (a test that changes it calls `_switched_on.cache_clear()`)."""
    return envvars.pdl(os.environ)


@functools.lru_cache(maxsize=None)
def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def _traced(wrapped: bool) -> bool:
    """torch records this launch instead of running it: torch.compile traces, or (`wrapped`: a launch through
    torch.library.wrap_triton) torch's wrapper would dispatch it as its higher-order op - everywhere but inside a
    triton_op run eagerly, where it launches the kernel itself."""
    return torch.compiler.is_compiling() or (wrapped and is_wrap_triton_enabled())


def enabled(t: torch.Tensor, wrapped: bool = True) -> bool:
    """Whether a kernel launched over `t`'s device takes PDL (module docstring); `wrapped`: the launch goes through
    torch.library.wrap_triton (else it calls the kernel itself, as a custom op's body does)."""
    return (t.is_cuda and _switched_on() and _triton_has_gdc() and device_arch(t.device).hopper
            and not _traced(wrapped))


def launch_options(t: torch.Tensor, wrapped: bool = True) -> dict:
    """What the launch passes: `{"launch_pdl": True, "GDC": True}` where `enabled`, else `{"GDC": False}`."""
    return {"launch_pdl": True, "GDC": True} if enabled(t, wrapped) else {"GDC": False}


@triton.jit
def pdl_start(GDC: tl.constexpr):
    """A kernel's first statement: with GDC, wait for the kernel before (its writes visible), then let the next one
    launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
