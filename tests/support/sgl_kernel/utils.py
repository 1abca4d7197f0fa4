"""`sgl_kernel.utils` of the stand-in: `is_arch_support_pdl`; every other name is a stand-in that raises when called."""
from __future__ import annotations

from sgl_kernel import StandIn, _is_dunder


def is_arch_support_pdl() -> bool:
    """False: sglang's Triton attention backend asks this to decide whether to launch its kernels with programmatic
    dependent launch; with the stand-in they launch the ordinary way."""
    return False


def __getattr__(name: str) -> StandIn:
    if _is_dunder(name):
        raise AttributeError(name)
    return StandIn(f"{__name__}.{name}")
