"""The module-level skips of the tests that need the real sglang package and graphcap's plugin entry point (both
installed by `make test`; a machine without them skips these tests with the reason)."""
from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest


def require_sglang_plugin(runtime: bool = False) -> None:
    """Skip the calling test module, with the reason, unless sglang is importable and its plugin loader can find
    graphcap's entry point; with `runtime`, also unless sglang's runtime dependency apache-tvm-ffi is installed."""
    pytest.importorskip("sglang", reason="the real sglang package is not installed (make test installs "
                                         "requirements/sglang-cpu.txt)")
    if not any(ep.name == "graphcap" for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")):
        pytest.skip("graphcap is not installed as a distribution here, so sglang cannot discover its plugin entry "
                    "point (make test installs it with pip install -e .)", allow_module_level=True)
    if runtime and importlib.util.find_spec("tvm_ffi") is None:
        pytest.skip("sglang's runtime dependency apache-tvm-ffi is missing here (make test installs "
                    "requirements/sglang-cpu.txt)", allow_module_level=True)
