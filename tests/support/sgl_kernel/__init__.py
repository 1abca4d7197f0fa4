"""graphcap's stand-in for `sgl_kernel` (the compiled sglang-kernel package), for running sglang's own engine where
that package cannot be installed (a GPU machine without network access: the wheel is too large to carry and built
against another torch).

Use: put `tests/support` on PYTHONPATH (not sys.path of one interpreter: sglang's scheduler and detokenizer run in
subprocesses that import it too). The `sglang_kernel-0.4.9.dist-info` next to this package answers sglang's start-up
check (`importlib.metadata.version("sglang-kernel") >= 0.4.9`, srt/entrypoints/engine.py).

Provided, with sgl_kernel's names, signatures and semantics (docs/sglang-standin.md has the call sites):
- compute ops from `graphcap.kernels.elementwise.fused_ops`, one Triton kernel per call: rmsnorm, fused_add_rmsnorm,
  gemma_rmsnorm, gemma_fused_add_rmsnorm, gelu_tanh_and_mul, gelu_and_mul, silu_and_mul,
  apply_rope_with_cos_sin_cache_inplace;
- the speculative-decoding ops sglang 0.5.18 takes from sgl_kernel on CUDA (0.5.23 has its own), one Triton kernel
  each, in this package's modules named as sgl_kernel's: `fast_topk` (`top_k`), `build_tree_kernel_efficient` and
  `verify_tree_greedy` (`speculative`);
- `weak_ref_tensor` and `utils.is_arch_support_pdl`.
Every other name - attribute chains such as `scalar_types.uint4b8`, and submodules such as `sgl_kernel.flash_attn` -
resolves to a stand-in that imports cleanly and raises NotImplementedError naming itself only when called. Nothing
is registered under `torch.ops.sgl_kernel`: sglang probes that namespace (e.g. `convert_weight_packed` for its CPU
AMX path) and must find it empty.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch

from graphcap.kernels.elementwise.fused_ops import (  # noqa: F401 - re-exported under sgl_kernel's names
    apply_rope_with_cos_sin_cache_inplace,
    fused_add_rmsnorm,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
    silu_and_mul,
)
from sgl_kernel.speculative import build_tree_kernel_efficient, verify_tree_greedy  # noqa: F401 - sgl_kernel's names
from sgl_kernel.top_k import fast_topk  # noqa: F401 - sgl_kernel's name
# sgl_kernel's W8A8 int8 GEMM (sglang's compressed-tensors / w8a8_int8 linear layers): docs/sglang-standin.md
from sgl_kernel.int8_gemm import int8_scaled_mm  # noqa: F401 - sgl_kernel's name

__version__ = "0.4.9"
_SCOPE = "graphcap's engine harness covers only the Gemma 4 frozen-KV MTP path"


def _is_dunder(name: str) -> bool:
    # Dunders must stay missing: import machinery, inspect, pickle and typing probe them.
    return name.startswith("__") and name.endswith("__")


class StandIn:
    """A name sgl_kernel has and this stand-in does not provide. Attribute reads give further stand-ins (so
    import-time chains resolve); calling one raises."""

    __slots__ = ("_standin_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_standin_name", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel stand-in: {self._standin_name} is not provided ({_SCOPE})")

    def __getattr__(self, name: str) -> StandIn:
        if _is_dunder(name):
            raise AttributeError(name)
        return StandIn(f"{self._standin_name}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._standin_name}>"


class StandInModule(types.ModuleType):
    """A submodule of sgl_kernel that has no file here: every public name is a StandIn."""

    def __getattr__(self, name: str) -> StandIn:
        if _is_dunder(name):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path, so it only sees sgl_kernel submodules that no file provides (utils.py is real)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())


def weak_ref_tensor(tensor: Any) -> Any:
    """A tensor over the same memory that does not keep that memory alive, as sgl_kernel's (a non-owning view):
    sglang's graph capture hands these out so its memory pool can reuse what a captured graph no longer needs.
    Non-tensors come back unchanged."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    storage = tensor.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        borrowed, tensor.storage_offset(), tensor.shape, tensor.stride())


def __getattr__(name: str) -> StandIn:
    if _is_dunder(name):
        raise AttributeError(name)
    return StandIn(f"{__name__}.{name}")


# `from sgl_kernel import utils` would take __getattr__'s stand-in instead of loading the file.
import sgl_kernel.utils as utils  # noqa: E402,F401 - sgl_kernel.utils.<name> resolves without an import of its own
