"""The scripts in bench/ as modules, for tests of their pure parts (they are scripts, not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
