"""`sgl_kernel.utils` of the stand-in: `is_arch_support_pdl`; every other name is a stand-in that raises when called."""
from __future__ import annotations

from sgl_kernel import StandIn, _is_dunder


def is_arch_support_pdl() -> bool:
    """What the real one answers (a CUDA GPU of capability 9.0 or later), capped by the GPU graphcap's kernels plan
    for (`GRAPHCAP_KERNEL_PATHS=sm80` lowers every Triton kernel for sm_80, which has no griddepcontrol): sglang's
    Triton attention backend asks this to decide whether to launch its kernels with programmatic dependent launch,
    as graphcap's kernels decide for themselves (graphcap.kernels.pdl)."""
    import torch

    from graphcap.kernels.arch import device_arch

    return torch.cuda.is_available() and device_arch().hopper


def __getattr__(name: str) -> StandIn:
    if _is_dunder(name):
        raise AttributeError(name)
    return StandIn(f"{__name__}.{name}")
