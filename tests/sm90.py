"""Compile Triton kernels for a GPU - an H100/H200 (sm_90), an A100 (sm_80), or an H200 under
GRAPHCAP_KERNEL_PATHS=sm80 - with Triton's own compiler and its bundled ptxas, no GPU needed: catches what Triton's
CPU interpreter cannot - types the compiler checks (a loop-carried variable that changes type), layouts, tl.dot
shapes, shared memory, register spills. Scripts run in a subprocess: under TRITON_INTERPRET=1 triton.jit makes
interpreted functions, which do not compile."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Target:
    """What a script compiles for: `capability` is the GPU's (PTX target and ptxas's SASS), `arch` the capability
    Triton lowers for where it differs (Triton's `arch` option, what TRITON_OVERRIDE_ARCH sets: "sm80" on an H200
    under the switch), `smem_limit` the shared memory one block may opt into."""

    name: str
    capability: int
    smem_limit: int
    arch: str | None = None
    plans: str = "SM90"  # the graphcap.kernels.arch description its planners plan for (a script's PLAN_ARCH)


SM90 = Target("sm90", 90, 232448)  # H100/H200: 227 KiB
SM80 = Target("sm80", 80, 166912, plans="SM80")  # A100: 163 KiB
# an H200 under GRAPHCAP_KERNEL_PATHS=sm80: Triton lowers for 80, ptxas assembles for sm_90a, planners plan an A100
SM80_ON_SM90 = Target("sm80-on-sm90", 90, 166912, "sm80", plans="SM80")

# Prepended to every script, after the target's numbers (CAPABILITY, SMEM_LIMIT, ARCH, TARGET_NAME, PLAN_ARCH):
# compile(fn, types, consts, num_warps, num_stages, attrs, max_spill) builds the signature from the kernel's own
# parameters (pointer and float types by name in `types`, every other non-constexpr an i32), compiles for the
# target and checks its shared memory, and (max_spill given) the bytes per thread ptxas spilled; a spill is printed
# ("spilled ..."), one past its bound collected, and EPILOGUE fails the script naming every one.
# `target()` and `options(...)` are what a script that calls triton.compile itself passes.
PRELUDE = """
import contextlib
import io
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def target():
    return GPUTarget("cuda", CAPABILITY, 32)


def options(**kw):
    return dict(kw, arch=ARCH) if ARCH else kw


SPILLS_OVER = []  # (target, kernel, constexprs, warps, bytes spilled, bound): what a script asserts empty at its end


def spills(log):
    return sum(int(n) for n in re.findall(r"(\\d+) bytes spill stores", log))


# what graphcap.kernels.pdl's launches pass as GDC on this target: programmatic dependent launch on sm_90 and up,
# never where Triton lowers for an older capability (the sm80 switch)
PDL = CAPABILITY >= 90 and not ARCH


def compile(fn, types, consts, num_warps, num_stages=1, attrs=None, max_spill=None):
    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in fn.params}
    consts = dict(consts)
    if any(p.name == "GDC" and p.is_constexpr for p in fn.params):  # a kernel that takes PDL: as launched here
        consts.setdefault("GDC", PDL)
    consts = {p.name: consts[p.name] for p in fn.params if p.is_constexpr and p.name in consts}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # ptxas -v, which TRITON_DUMP_PTXAS_LOG prints
        k = triton.compile(ASTSource(fn, sig, consts, attrs or {}), target=target(),
                           options=options(num_warps=num_warps, num_stages=num_stages))
    assert k.metadata.shared <= SMEM_LIMIT, (TARGET_NAME, fn.__name__, consts, k.metadata.shared)
    spilled = spills(log.getvalue())
    if spilled:
        print("spilled", TARGET_NAME, fn.__name__, spilled, consts)
    if max_spill is not None and spilled > max_spill:  # every one collected: one run names them all
        SPILLS_OVER.append((TARGET_NAME, fn.__name__, consts, num_warps, spilled, max_spill))
    # griddepcontrol (sm_90's PDL instructions) exactly where the kernel was compiled to take PDL
    assert ("griddepcontrol.wait" in k.asm["ptx"]) == bool(consts.get("GDC")), (TARGET_NAME, fn.__name__, consts)
    if ARCH:  # lowered for ARCH, assembled for the device
        assert ".target sm_%d" % CAPABILITY in k.asm["ptx"] and "wgmma" not in k.asm["ptx"], (fn.__name__, consts)
    return k
"""


# Appended to every script: its failed parts (FAILED_PARTS, a driver's) and every spill past its bound, named at once
EPILOGUE = """
import sys
if SPILLS_OVER:
    print("spilled past their bounds (target, kernel, constexprs, warps, bytes, bound):", *SPILLS_OVER, sep="\\n",
          file=sys.stderr)
if SPILLS_OVER or globals().get("FAILED_PARTS"):
    sys.exit("failed: " + ", ".join(globals().get("FAILED_PARTS") or ["spills"]))
"""


def compile_for(script: str, tmp_path: Path, target: Target = SM90) -> str:
    """Run PRELUDE + `script` (which prints "compiled" at its end) for `target`; skip where this Triton has no
    bundled ptxas. Returns the script's stdout."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    drop = ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH", "GRAPHCAP_KERNEL_PATHS")  # the target says what to compile
    env = {k: v for k, v in os.environ.items() if k not in drop}
    repo = Path(__file__).resolve().parents[1]
    # the repo, the sgl_kernel stand-in (its kernels import as sgl_kernel's modules), then the machine's
    path = (str(repo), str(repo / "tests" / "support"), os.environ.get("PYTHONPATH"))
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), TRITON_CACHE_DIR=str(tmp_path / target.name),
               TRITON_DUMP_PTXAS_LOG="1", TRITON_DEFAULT_FP_FUSION="1")  # fusion: Triton 3.9's default, unwarned
    head = (f"CAPABILITY = {target.capability}\nSMEM_LIMIT = {target.smem_limit}\nARCH = {target.arch!r}\n"
            f"TARGET_NAME = {target.name!r}\nPLAN_ARCH = {target.plans!r}\n")
    r = subprocess.run([sys.executable, "-c", head + PRELUDE + script + EPILOGUE], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
    return r.stdout


def compile_for_sm90(script: str, tmp_path: Path) -> str:
    """`compile_for` an H100/H200."""
    return compile_for(script, tmp_path, SM90)
