"""pytest plugin (`-p sglang_0518_pytest`) for the runs against sglang 0.5.18 (tests/sglang/test_runtime.py): prepares
`import sglang` on a CPU machine (_sglang_env.prepare_sglang_import) before any test module imports it, and fails the
run at once unless the sglang imported is the one asked for (the PYTHONPATH did not take)."""
from __future__ import annotations

import importlib.metadata
import os
import sys

import torch

if not torch.cuda.is_available():  # as tests/conftest.py, but before sglang imports triton here
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sglang_env import prepare_sglang_import  # noqa: E402

prepare_sglang_import()
_WANT = os.environ.get("GRAPHCAP_TEST_SGLANG")
_HAVE = importlib.metadata.version("sglang")
if _WANT and _HAVE != _WANT:
    raise RuntimeError(f"asked for sglang {_WANT}, imported {_HAVE} (from {sys.modules['sglang'].__file__})")
