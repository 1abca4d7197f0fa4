"""Runs tests/sglang_isolated/check_sglang_runtime.py - graphcap's runtime hooks on the real sglang 0.5.23 classes, and
graphcap's window against sglang's own `update_sliding_window_buffer` - in a fresh interpreter. They import sglang's
scheduler, Triton backend and Frozen-KV MTP worker with torchvision stubbed and patch sglang classes in place, so
they must not share a process with the rest of the suite."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_required import require_sglang_plugin

require_sglang_plugin(runtime=True)
pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent


def test_sglang_runtime_checks_in_a_fresh_interpreter():
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")  # sglang's Triton gather runs on CPU through the interpreter
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=check_*.py",
           "-o", "addopts=-ra", str(HERE / "sglang_isolated")]
    r = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join((r.stdout + r.stderr).splitlines()[-60:])
    assert r.returncode == 0, f"inner run failed ({' '.join(cmd)}):\n{tail}"
    summary = [line for line in r.stdout.splitlines() if " passed" in line]
    assert summary and "failed" not in summary[-1] and "skipped" not in summary[-1], tail
    print(summary[-1])
