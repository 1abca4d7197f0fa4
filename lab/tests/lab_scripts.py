"""The scripts in lab/ as modules, for tests of their pure parts (they are scripts, not a package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

LAB_DIR = Path(__file__).resolve().parents[1]


def load_lab_script(name: str) -> ModuleType:
    """lab/<name>.py, imported as module `lab_<name>` (its `main` not run)."""
    spec = importlib.util.spec_from_file_location(f"lab_{name}", LAB_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
