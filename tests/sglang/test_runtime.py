"""The sglang checks that need an interpreter of their own, against both sglang versions graphcap serves:

- 0.5.23 (the venv's): tests/sglang_isolated/check_*.py - graphcap's runtime hooks on the real scheduler, schedule
  batch and Frozen-KV MTP worker classes, graphcap's window against sglang's own `update_sliding_window_buffer`, the
  loop, head and projections on the real tiny Gemma 4 assistant. They import sglang's runtime modules with
  torchvision stubbed and patch sglang classes in place, so they must not share a process with the rest of the suite;
- 0.5.18 (the user's; `make venv` installs it beside the venv's, in $VENV/sglang-0518, from
  requirements/sglang-0518-cpu.txt): the same checks and tests/sglang/test_plugin.py (flag parsing, start-up
  validation), each with that directory in front of PYTHONPATH (`sglang_isolated/sglang_0518_pytest.py` prepares
  `import sglang` and fails the run unless 0.5.18 is what was imported).

The runs start together, as many at a time as there are cores (at most all four): each spends much of its time
importing sglang, and CI has two cores."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from sglang_required import require_sglang_plugin

require_sglang_plugin(runtime=True)
pytestmark = pytest.mark.sglang

TESTS = Path(__file__).resolve().parents[1]
ISOLATED = TESTS / "sglang_isolated"
GPU_SKIP = "needs a CUDA GPU (scripts/gpu-check.sh runs these on one)"  # a GPU case, on a machine without one
HAS_CUDA = torch.cuda.is_available()
# $VENV/sglang-0518 (the Makefile's recipe) next to the interpreter's venv; GRAPHCAP_SGLANG_0518 names another place
SGLANG_0518 = Path(os.environ.get("GRAPHCAP_SGLANG_0518") or Path(sys.prefix) / "sglang-0518")


@dataclass(frozen=True)
class Run:
    version: str
    paths: tuple[str, ...]  # relative to tests/
    checks: bool = True  # the check_*.py files (else the test_*.py files named)
    skips: tuple[str, ...] = ()  # skip reasons this run may report (a case the version cannot express)

    @property
    def allowed_skips(self) -> tuple[str, ...]:
        return (*self.skips, GPU_SKIP) if not HAS_CUDA else self.skips


RUNS = {
    "0.5.23-checks": Run("0.5.23", ("sglang_isolated",)),
    "0.5.18-plugin": Run("0.5.18", ("sglang/test_plugin.py",), checks=False,
                         skips=("sglang 0.5.18 has no ServerArgs.attn_dp_size",)),
    "0.5.18-runtime": Run("0.5.18", ("sglang_isolated/check_sglang_runtime.py",)),
    "0.5.18-model": Run("0.5.18", ("sglang_isolated/check_sglang_eager_boundaries.py",)),
}


def command(run: Run) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")  # sglang's Triton gather runs on CPU through the interpreter
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"]
    if run.checks:
        cmd += ["-o", "python_files=check_*.py"]
    if run.version != "0.5.23":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SGLANG_0518), str(ISOLATED), env.get("PYTHONPATH"))
                                            if p)
        env["GRAPHCAP_TEST_SGLANG"] = run.version
        cmd += ["-p", "sglang_0518_pytest"]
    return cmd + [str(TESTS / p) for p in run.paths], env


def execute(run: Run) -> subprocess.CompletedProcess:
    cmd, env = command(run)
    return subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def started():
    """Every run that can run here, started at once (a pool as wide as the cores); each test waits for its own."""
    todo = {name: run for name, run in RUNS.items() if run.version == "0.5.23" or (SGLANG_0518 / "sglang").is_dir()}
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        yield {name: pool.submit(execute, run) for name, run in todo.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_sglang_checks_in_a_fresh_interpreter(started: dict[str, Future], name: str):
    run = RUNS[name]
    if name not in started:
        pytest.skip(f"sglang {run.version} is not installed at {SGLANG_0518} (make venv installs it from "
                    "requirements/sglang-0518-cpu.txt)")
    r = started[name].result()
    out = r.stdout + r.stderr
    tail = "\n".join(out.splitlines()[-60:])
    assert r.returncode == 0, f"inner run failed ({' '.join(command(run)[0])}):\n{tail}"
    summary = [line for line in r.stdout.splitlines() if " passed" in line]
    assert summary and "failed" not in summary[-1] and "error" not in summary[-1], tail
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", r.stdout, re.M)
    assert all(reason in run.allowed_skips for reason in reasons), (reasons, tail)
    assert ("skipped" in summary[-1]) == bool(reasons), summary[-1]
    print(summary[-1])
