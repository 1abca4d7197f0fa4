"""The scripts in bench/ as modules, for tests of their pure parts (they are scripts, not a package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py, imported as module `bench_<name>` (its `main` not run)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
