"""Import sglang's runtime modules (scheduler, schedule batch, Triton backend, Frozen-KV MTP workers) on a CPU
machine without torchvision.

sglang.srt.configs imports two multimodal helpers that do `import torchvision.transforms` at module level
(multimodal/internvl_utils.py, configs/deepseek_ocr.py). torchvision cannot be installed here without dragging a CUDA
torch in, and nothing these tests run calls it, so `install_torchvision_stub()` answers `import torchvision...` with
empty modules. It first pins transformers' (lru-cached) "is torchvision available?" answers to False, so transformers
never takes the stub for the real thing. Use only in a fresh interpreter (tests/sglang/test_runtime.py runs these checks
in one): the stub is process-wide.

sglang 0.5.18 imports `torchvision.io` at `import sglang` itself, and its transformers (5.12) hands out
`AutoImageProcessor` as a placeholder that raises without torchvision, which sglang's multimodal configs call
`.register` on at import. `prepare_sglang_import()` does what either version needs before sglang's runtime modules
import (`sglang_0518_pytest.py` runs it at pytest start-up for the 0.5.18 runs).
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


def install_vllm_rope_stub() -> None:
    """sglang's RotaryEmbedding imports vllm's rope op off CUDA (used only on its fallback): where no vllm is imported,
    an empty `vllm._custom_ops` answers the import."""
    if "vllm" in sys.modules:
        return
    vllm = types.ModuleType("vllm")
    vllm._custom_ops = types.ModuleType("vllm._custom_ops")
    vllm._custom_ops.rotary_embedding = None
    sys.modules.update({"vllm": vllm, "vllm._custom_ops": vllm._custom_ops})


class _ImageProcessorRegistry:
    """transformers' AutoImageProcessor where transformers hands out a torchvision placeholder: sglang's multimodal
    configs register their image processors at import; nothing these tests run looks one up."""

    registered: list = []

    @classmethod
    def register(cls, config_class, *args, **kwargs) -> None:
        cls.registered.append(config_class)


def prepare_sglang_import() -> None:
    """The torchvision stub, then `import sglang`, then transformers' AutoImageProcessor made registrable where it is
    a torchvision placeholder (transformers 5.12; 5.19's is the real class and is left alone). After `import
    sglang`: its transformers patches re-resolve the lazy attribute."""
    install_torchvision_stub()
    import sglang  # noqa: F401
    import transformers

    aip = transformers.AutoImageProcessor
    if "torchvision" in (getattr(aip, "_backends", None) or ()):
        transformers.AutoImageProcessor = _ImageProcessorRegistry
