"""scripts/sglang-0518-wheels.sh's offline part: the flashinfer stand-in wheel it builds for sglang 0.5.18 on the GPU
machine installs as pip installs the others, and answers every name sglang 0.5.18 imports from flashinfer at module
load (read off 0.5.18's own source, where make venv installed it), raising NotImplementedError naming the name
when called; and the script will not mix its wheels with wheels already there (0.5.23's)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sglang-0518-wheels.sh"
SGLANG_0518 = Path(os.environ.get("GRAPHCAP_SGLANG_0518") or Path(sys.prefix) / "sglang-0518")
# 0.5.18's modules that import flashinfer at load on CUDA (the machine's path; on CPU they take another branch)
LOADED_ON_CUDA = ("srt/layers/sampler.py", "srt/layers/quantization/fp8_utils.py", "srt/layers/attention/vision.py")


def _standin(tmp_path: Path) -> Path:
    dest = tmp_path / "whl"
    r = subprocess.run(["bash", str(SCRIPT), "--standin-only", str(dest)], env=dict(os.environ, PYTHON=sys.executable),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--target", str(site), *map(str, dest.glob("*.whl"))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return site


def _flashinfer_imports(source: str) -> list[tuple[str, str]]:
    """(module, name) of every `from flashinfer... import name` at module level (inside top-level if/try too)."""
    out = []

    def walk(body):
        for node in body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flashinfer":
                out.extend((node.module, a.name) for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                walk(node.body)
                walk(node.orelse)
    walk(ast.parse(source).body)
    return out


@pytest.mark.skipif(not (SGLANG_0518 / "sglang").is_dir(), reason=f"sglang 0.5.18 is not installed at {SGLANG_0518} "
                    "(make venv installs it from requirements/sglang-0518-cpu.txt)")
def test_the_flashinfer_standin_answers_what_sglang_0518_imports_at_load(tmp_path):
    names = [x for rel in LOADED_ON_CUDA for x in _flashinfer_imports((SGLANG_0518 / "sglang" / rel).read_text())]
    assert ("flashinfer.sampling", "min_p_sampling_from_probs") in names and ("flashinfer", "bmm_fp8") in names
    site = _standin(tmp_path)
    probe = "\n".join([
        "import importlib, importlib.util",
        "import flashinfer",
        "assert flashinfer.__graphcap_standin__ and importlib.util.find_spec('flashinfer') is not None",
        f"for module, name in {names!r}:",
        "    fn = getattr(importlib.import_module(module), name)",
        "    try:",
        "        fn(1, x=2)",
        "    except NotImplementedError as e:",
        "        assert f'flashinfer stand-in: {module}.{name} is not available' in str(e), str(e)",
        "    else:",
        "        raise AssertionError(f'{module}.{name} ran')",
        "print('standin ok', len(" + repr(names) + "))"])
    r = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "standin ok" in r.stdout, r.stderr


def test_the_script_will_not_mix_its_wheels_with_others(tmp_path):
    dest = tmp_path / "whl"
    dest.mkdir()
    (dest / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl").write_bytes(b"")
    r = subprocess.run(["bash", str(SCRIPT), str(dest)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "holds wheels already" in r.stderr
    assert [p.name for p in dest.iterdir()] == ["sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"]
