"""graphcap: static, in-place sliding-window state and whole-loop CUDA-graph capture for MTP draft phases.

Exports resolve lazily (PEP 562), so `import graphcap` - and `graphcap inspect` / `graphcap specs` - never pull in
torch; `graphcap.WindowBuffers` imports `graphcap.window` (and torch) on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from graphcap.version import VERSION as __version__

_EXPORTS = {
    "CaptureSpec": "graphcap.spec",
    "SpecError": "graphcap.spec",
    "GraphcapInputError": "graphcap.errors",
    "load_spec": "graphcap.spec",
    "WindowBuffers": "graphcap.window",
    "WindowError": "graphcap.window",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from graphcap.errors import GraphcapInputError
    from graphcap.spec import CaptureSpec, SpecError, load_spec
    from graphcap.window import WindowBuffers, WindowError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'graphcap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
