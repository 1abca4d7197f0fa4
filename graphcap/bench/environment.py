"""The one environment report of every benchmark (`graphcap bench`, bench/*.py, scripts/gpu-check.sh): the
manifest's device/driver/versions plus what a reader of a timing needs - date, Python, CUDA, SMs, CPU cores and
torch threads, sglang, the tree's commit, the command. `python -m graphcap.bench.environment` prints it as JSON."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from graphcap import manifest


def sglang_version() -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version("sglang")
    except Exception:  # noqa: BLE001 - not installed, or installed without metadata (a --target copy)
        try:
            import sglang

            return str(getattr(sglang, "__version__", "unknown"))
        except Exception:  # noqa: BLE001
            return None


def commit() -> str | None:
    """The tree's commit: `.gpu-commit` where a copied tree records it (its .git may be stale), else git."""
    root = Path(__file__).resolve().parents[2]
    recorded = root / ".gpu-commit"
    if recorded.is_file():
        return recorded.read_text().strip() or None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(command: str | None = None, **extra: Any) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = manifest.environment()
    env.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               python=platform.python_version(), cuda=torch.version.cuda, cpu_count=os.cpu_count(),
               torch_threads=torch.get_num_threads(), sglang=sglang_version(), commit=commit(),
               command=command or " ".join([Path(sys.argv[0]).name] + sys.argv[1:]))
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(sm_count=p.multi_processor_count, gpu_memory_gib=round(p.total_memory / 2**30, 1))
    env.update(extra)
    return env


def summary_line(env: dict[str, Any]) -> str:
    """One line for a report's header."""
    return (f"{env['device']}, driver {env.get('driver') or '-'}, torch {env['torch_version']}, triton "
            f"{env.get('triton_version') or '-'}, sglang {env.get('sglang') or '-'}, commit {env.get('commit') or '-'}")


if __name__ == "__main__":
    print(json.dumps(environment(), indent=1))
