"""The sgl_kernel stand-in's own kernels (tests/support/sgl_kernel: `speculative`, `top_k`) for tests in this
process, each loaded from its file as a module of its own. Importing the stand-in package instead would let every
later sglang import in the process find an `sgl_kernel` (sglang then takes stand-ins where it would fall back).
`run_with_standin` runs code in a process of its own that imports the package, as sglang's engine does."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

STANDIN = Path(__file__).resolve().parent / "support" / "sgl_kernel"
ROOT = STANDIN.parents[2]


def run_with_standin(code: str) -> str:
    """`code` in a fresh interpreter with the stand-in package and the repo first on PYTHONPATH (the machine's own
    path kept after them, where it keeps its packages, sglang among them), under Triton's interpreter without CUDA;
    its stdout, or an assertion error holding its output."""
    import torch

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STANDIN.parent), str(ROOT), os.environ.get("PYTHONPATH"))
                                        if p)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    return r.stdout


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"standin_{name}", STANDIN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import registers a module, before its code runs
    spec.loader.exec_module(module)
    return module


speculative = _load("speculative")
top_k = _load("top_k")
