"""Import sglang's runtime modules (scheduler, schedule batch, Triton backend, Frozen-KV MTP workers) on a CPU
machine without torchvision.

sglang.srt.configs imports two multimodal helpers that do `import torchvision.transforms` at module level
(multimodal/internvl_utils.py, configs/deepseek_ocr.py). torchvision cannot be installed here without dragging a CUDA
torch in, and nothing these tests run calls it, so `install_torchvision_stub()` answers `import torchvision...` with
empty modules. It first pins transformers' (lru-cached) "is torchvision available?" answers to False, so transformers
never takes the stub for the real thing. Use only in a fresh interpreter (test_sglang_runtime.py runs these checks
in one): the stub is process-wide.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Anything:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        module.__graphcap_stub__ = True


def install_torchvision_stub() -> bool:
    """Install the stub unless a real torchvision is importable. Returns whether it installed it."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("torchvision") is not None:
        return False
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available() and not import_utils.is_torchvision_v2_available()
    sys.meta_path.insert(0, _Finder())
    return True
