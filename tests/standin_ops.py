"""The sgl_kernel stand-in's own kernels (tests/support/sgl_kernel: `speculative`, `top_k`) for tests in this
process, each loaded from its file as a module of its own. Importing the stand-in package instead would let every
later sglang import in the process find an `sgl_kernel` (sglang then takes stand-ins where it would fall back)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

STANDIN = Path(__file__).resolve().parent / "support" / "sgl_kernel"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"standin_{name}", STANDIN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import registers a module, before its code runs
    spec.loader.exec_module(module)
    return module


speculative = _load("speculative")
top_k = _load("top_k")
