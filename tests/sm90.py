"""Compile Triton kernels for an H100/H200 (sm_90) with Triton's own compiler and its bundled ptxas, no GPU needed:
catches what Triton's CPU interpreter cannot - types the compiler checks (a loop-carried variable that changes
type), layouts, tl.dot shapes, shared memory. Scripts run in a subprocess: under TRITON_INTERPRET=1 triton.jit makes
interpreted functions, which do not compile."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Prepended to every script: compile(fn, types, consts, num_warps, num_stages) builds the signature from the kernel's
# own parameters (pointer and float types by name in `types`, every other non-constexpr an i32).
PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SMEM_LIMIT = 227 * 1024


def compile(fn, types, consts, num_warps, num_stages=1):
    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in fn.params}
    consts = {p.name: consts[p.name] for p in fn.params if p.is_constexpr and p.name in consts}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    assert k.metadata.shared <= SMEM_LIMIT, (fn.__name__, consts, k.metadata.shared)
    return k
"""


def compile_for_sm90(script: str, tmp_path: Path) -> str:
    """Run PRELUDE + `script` (which prints "compiled" at its end); skip where this Triton has no bundled ptxas.
    Returns the script's stdout."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH"))  # the repo, then the machine's
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), TRITON_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", PRELUDE + script], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
    return r.stdout
