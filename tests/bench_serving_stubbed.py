"""`python -m sglang.bench_serving` where torchvision or Hugging Face `datasets` is missing (CI and this repo's CPU
venv lack both, the GPU machine lacks `datasets`): sglang's benchmark client imports both at module level for
datasets the harness never picks (images, MMMU). Installs the torchvision stub of tests/sglang_isolated/_sglang_env.py
and an empty `datasets` module where the real one is missing, then runs the real client with the arguments given."""
from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_isolated"))
from _sglang_env import install_torchvision_stub  # noqa: E402

if __name__ == "__main__":
    install_torchvision_stub()
    if "datasets" not in sys.modules:
        try:
            import datasets  # noqa: F401
        except ImportError:
            stub = types.ModuleType("datasets")

            def load_dataset(*args, **kwargs):
                raise RuntimeError("the `datasets` stub of tests/bench_serving_stubbed.py loads no dataset")
            stub.load_dataset = load_dataset
            sys.modules["datasets"] = stub
    sys.argv = ["sglang.bench_serving", *sys.argv[1:]]
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
