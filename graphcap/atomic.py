"""Whole-file writes that a reader never sees half done: a temp file in the same directory, flushed and synced, then
renamed over the target (os.replace is atomic within a filesystem)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes, mode: int) -> Path:
    """Write `data` to `path` with permissions `mode`; on any failure the target is untouched and no temp file is
    left behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600 until chmod
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
