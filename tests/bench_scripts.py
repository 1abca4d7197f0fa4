"""The scripts in bench/ as modules, for tests of their pure parts (they are scripts, not a package), and the
checkpoint fixture the W8A8 tests share."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_file(path: Path, name: str) -> ModuleType:
    """The Python file at `path` as module `name`, neither sys.path nor sys.modules changed by the load (a module
    left there would be replaced by the next load of the same file)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while building a class
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py, imported as module `bench_<name>` (its `main` not run)."""
    return load_file(BENCH_DIR / f"{name}.py", f"bench_{name}")


@pytest.fixture(scope="module")
def tiny_w8a8(tmp_path_factory):
    """The tiny pair written with a W8A8 target (its checkpoint holds the target's structure alone), room for 128k."""
    d = tmp_path_factory.mktemp("ck-w8a8")
    load_bench_script("sglang_checkpoint").make_pair("tiny", d, device="cpu", sample=64, weights="w8a8",
                                                     max_pos=135168)
    return d
