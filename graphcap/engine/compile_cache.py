"""An opt-in on-disk compile cache: torch's cache artifacts (`torch.compiler.save_cache_artifacts` /
`load_cache_artifacts`), one file per key, for `CaptureOptions(compile_cache=DIR)`.

A compile cache is code: loading it runs what it holds. So the directory is created 0700, files are written 0600
(temp file + os.replace), and nothing is loaded from a directory or file that is a symlink, not owned by this user,
or writable by group or others - that is one warning line and a normal compile, never an error. A file that does
not load (corrupt, another torch) is one warning line and a normal compile too; it is left in place (its path is
logged) and overwritten by the next successful capture's artifacts.

The key (`cache_key`) is a hex digest of everything whose change must miss: the spec hash (or a caller's string),
backend, buckets, dynamic_batch, graphcap/torch/triton versions and the device (name, capability and any forced
kernel paths, GRAPHCAP_KERNEL_PATHS; CPU: the machine architecture).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from graphcap.atomic import write_atomic
from graphcap.version import VERSION

log = logging.getLogger("graphcap")
T = TypeVar("T")

__all__ = ["cache_key", "cache_file", "load", "save", "HIT", "MISS"]

HIT, MISS = "hit", "miss"  # manifest values; a refusal is "refused: <why>"


def _version(dist: str, fallback: str | None = None) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return fallback


def _device_id(device) -> str:
    import torch

    from graphcap.kernels.arch import kernel_paths

    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        forced = kernel_paths()  # GRAPHCAP_KERNEL_PATHS: other kernels (Triton lowers for another capability)
        paths = f":paths={forced.name}" if forced is not None else ""
        return f"cuda:{torch.cuda.get_device_name(idx)}:sm{cap[0]}{cap[1]}{paths}"
    return f"{device.type}:{platform.machine()}"


def cache_key(*, spec_hash: str | None = None, key: str | None = None, backend: str, buckets: Sequence[int],
              dynamic_batch: bool = False, device=None) -> str:
    """The hex digest naming a cache file. `spec_hash`, else `key` (a caller's description of what is compiled,
    e.g. a model path and config), must be given."""
    import torch

    if not spec_hash and not key:
        raise ValueError("compile cache: a spec (its hash) or a cache_key string is needed for the key")
    parts = {
        "spec_hash": spec_hash or "", "key": key or "", "backend": backend, "buckets": sorted(int(b) for b in buckets),
        "dynamic_batch": bool(dynamic_batch),
        "graphcap": [VERSION, _version("graphcap")],  # the module's, and the installed dist's
        "torch": str(torch.__version__), "triton": _version("triton"),
        "device": _device_id(device),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_file(directory: str | os.PathLike, key: str) -> Path:
    return Path(directory) / f"{key}.bin"


def untrusted(path: Path, what: str) -> str | None:
    """Why `path` must not be trusted (None: it may be)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"the {what} is a symlink"
    if st.st_uid != os.getuid():
        return f"the {what} is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"the {what} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def ensure_dir(directory: str | os.PathLike) -> Path:
    """Create the cache directory 0700 if it is missing (an existing one keeps its mode: `load` checks it)."""
    d = Path(directory).expanduser()
    if not os.path.lexists(d):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask
    return d


def read_trusted(directory: str | os.PathLike, name: str, what: str, loader: Callable[[bytes], T]
                 ) -> tuple[T | None, str]:
    """`loader(bytes of <directory>/<name>)` if the file is there and trusted, with the manifest value: "hit", "miss"
    (no file, or it did not load: logged, the file left in place for inspection) or "refused: <why>" (logged).
    Never raises for a bad cache: the caller compiles instead."""
    d = ensure_dir(directory)
    f = d / name
    if not os.path.lexists(f):
        return None, MISS
    why = untrusted(d, "directory") or untrusted(f, "file")
    if why:
        log.warning("graphcap: not loading the %s %s: %s; compiling instead", what, f, why)
        return None, f"refused: {why}"
    try:
        return loader(f.read_bytes()), HIT
    except Exception as e:  # corrupt, truncated, another torch: compile as usual
        log.warning("graphcap: could not load the %s %s (%s: %s); compiling instead (file left in place)",
                    what, f, type(e).__name__, e)
        return None, MISS


def write_trusted(directory: str | os.PathLike, name: str, what: str, produce: Callable[[], bytes | None]
                  ) -> Path | None:
    """Write `produce()` to `<directory>/<name>`, atomically and 0600; None if it produced nothing, the directory is
    not trusted (code written where others can replace it would only be refused at the next load) or the write
    failed (logged: the capture stands)."""
    try:
        data = produce()
        if not data:
            return None
        d = ensure_dir(directory)
        why = untrusted(d, "directory")
        if why:
            log.warning("graphcap: not saving the %s in %s: %s", what, d, why)
            return None
        return write_atomic(d / name, data, 0o600)
    except Exception as e:  # noqa: BLE001 - torch's serialisers are experimental: the capture must not die of them
        log.warning("graphcap: could not save the %s in %s (%s: %s)", what, directory, type(e).__name__, e)
        return None


def _load_artifacts(data: bytes) -> None:
    import torch

    if torch.compiler.load_cache_artifacts(data) is None:  # torch logs why and returns None for bytes it cannot read
        raise ValueError("torch could not deserialize it")


def _saved_artifacts() -> bytes | None:
    import torch

    got = torch.compiler.save_cache_artifacts()
    return got[0] if got else None


def load(directory: str | os.PathLike, key: str) -> str:
    """Load the artifacts of `key` into this process's compile caches if present and trusted; the manifest value."""
    return read_trusted(directory, cache_file(directory, key).name, "compile cache", _load_artifacts)[1]


def save(directory: str | os.PathLike, key: str) -> Path | None:
    """Write this process's compile artifacts (`torch.compiler.save_cache_artifacts()`) to `<directory>/<key>.bin`."""
    return write_trusted(directory, cache_file(directory, key).name, "compile cache", _saved_artifacts)
