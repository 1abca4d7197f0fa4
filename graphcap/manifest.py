"""Capture manifests: what the capture engine captured, per batch bucket, written as JSON for `graphcap inspect`.

One manifest per (spec, spec hash, backend) and process, at `manifest_path(default_manifest_dir(), ...)`: a process
of a server split over GPUs (tensor, pipeline or data parallel: `Parallel`) writes a file of its own, the rank in its
name (`...-tp1.json`); a single process keeps the plain name. The capture engine
keeps the run-time counters (replays, fallbacks, padded rows) in plain ints on the `BucketRecord`s and calls
`write_manifest` now and then (never per iteration); the write is atomic, so a reader never sees half a file.

The file's schema is the dataclasses below, validated by pydantic (types, bounds, allowed values, unknown fields).
Every problem reading a manifest is a `ManifestError` whose message is `<file>: <field>: <reason>`, like `SpecError`.
This module imports no torch at import time (`graphcap inspect` stays light); only `environment()` imports it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError, with_config

from graphcap import envvars  # no torch
from graphcap.atomic import write_atomic
from graphcap.backends import ALL_BACKENDS  # no torch: `graphcap inspect` stays light
from graphcap.errors import GraphcapInputError
from graphcap.version import VERSION

FORMAT_VERSION = 1
STATUSES = ("captured", "failed", "pending")


class ManifestError(GraphcapInputError):
    """A manifest cannot be read. `str(err)` is `<file>: <field>: <reason>`."""


def _iso_timestamp(v: str) -> str:
    try:
        datetime.fromisoformat(v)
    except ValueError:
        raise ValueError("not an ISO-8601 timestamp") from None
    return v


# Field types of the file. Strict: a JSON `true` or `"3"` is not a count.
Count = Annotated[int, Strict(), Field(ge=0)]
Seconds = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Text = Annotated[str, Strict()]
Timestamp = Annotated[str, Strict(), AfterValidator(_iso_timestamp)]
_FORBID = ConfigDict(extra="forbid")


@with_config(_FORBID)
@dataclass
class BucketRecord:
    """One captured batch size. Mutable: the capture engine bumps the counters in place between writes."""

    batch_size: Annotated[int, Strict(), Field(ge=1)]
    status: Literal[STATUSES] = "pending"
    reason: Text | None = None  # why the capture failed (None unless status == "failed")
    capture_s: Seconds = 0.0  # wall time of warm-up + capture
    pool_bytes: Count = 0  # graph memory, from torch.cuda.memory_stats() taken before and after the capture
    replays: Count = 0  # graph replays of this bucket
    fallbacks: Count = 0  # eager runs of this bucket (e.g. its capture failed)
    padded_rows: Count = 0  # padding rows summed over all replays

    @property
    def padding_waste(self) -> float:
        """Fraction of replayed rows that were padding (0 when never replayed)."""
        return self.padded_rows / (self.replays * self.batch_size) if self.replays else 0.0


Size = Annotated[int, Strict(), Field(ge=1)]
PARALLEL_DIMS = ("dp", "pp", "tp")  # the order of a rank's label and file suffix: replica, stage, TP rank
_DIM_WORDS = {"dp": "data parallel", "pp": "pipeline parallel", "tp": "tensor parallel"}


@with_config(_FORBID)
@dataclass(frozen=True)
class Parallel:
    """Where the process that wrote a manifest sits in its server's parallel layout, in sglang's terms: TP rank and
    size, pipeline stage and count, data-parallel replica and count. Every size 1: one process (`single`)."""

    tp_rank: Count
    tp_size: Size
    pp_rank: Count = 0
    pp_size: Size = 1
    dp_rank: Count | None = None  # the replica; None where sglang runs no data-parallel controller
    dp_size: Size = 1

    def __post_init__(self) -> None:
        for dim in PARALLEL_DIMS:
            rank, size = getattr(self, f"{dim}_rank"), getattr(self, f"{dim}_size")
            if rank is not None and rank >= size:
                raise ValueError(f"{dim}_rank {rank} is not below {dim}_size {size}")

    @property
    def world(self) -> tuple[int, int, int]:
        """(dp_size, pp_size, tp_size): the processes of one server are those of one world."""
        return self.dp_size, self.pp_size, self.tp_size

    @property
    def single(self) -> bool:
        return self.world == (1, 1, 1)

    @property
    def label(self) -> str:
        """The rank along each dimension wider than one, `dp1-tp0`; "" for a single process. A replica sglang does
        not number (`dp_rank` None) is left out: its files cannot be told apart."""
        return "-".join(f"{d}{getattr(self, f'{d}_rank')}" for d in PARALLEL_DIMS
                        if getattr(self, f"{d}_size") > 1 and getattr(self, f"{d}_rank") is not None)

    def describe_world(self) -> str:
        """`tensor parallel 2`, `data parallel 2, tensor parallel 2`; `one process`."""
        return ", ".join(f"{_DIM_WORDS[d]} {getattr(self, f'{d}_size')}" for d in PARALLEL_DIMS
                         if getattr(self, f"{d}_size") > 1) or "one process"


@with_config(_FORBID)
@dataclass
class LateCompile:
    """A Triton kernel variant first compiled while serving (graphcap.sglang.variants)."""

    kernel: Text  # "<module>:<qualname>"
    variant: Text  # Triton's description of the variant
    seconds: Seconds  # the compile (or the load from Triton's disk cache)
    after_s: Seconds  # since the process's first draft call


@with_config(_FORBID)
@dataclass
class Serving:
    """What the sglang plugin saw while serving: its window rows' bookkeeping and the Triton kernel variants compiled
    in the process (graphcap.sglang.variants). Written with the manifest; None where nothing served (a capture
    outside sglang)."""

    joins: Count = 0  # requests that joined a row (after their prefill)
    resets: Count = 0  # rows rebuilt from req_to_token (a join, a retraction, freed in-window SWA pages)
    retracts: Count = 0  # rows whose request sglang retracted
    evictions_in_window: Count = 0  # SWA pages freed inside a live window (the row rebuilt)
    variants_preloaded: Count = 0  # recorded variants compiled at start-up, before serving
    variants_preload_failed: Count = 0  # recorded variants that could not be (another kernel source or target)
    variants_at_startup: Count = 0  # compiled by a launch before the first draft call
    variants_while_serving: Count = 0  # compiled by a launch after it: each one a stall while serving
    late_compiles: list[LateCompile] = field(default_factory=list)  # the first of those, named


@with_config(_FORBID)
@dataclass
class Manifest:
    format_version: Annotated[int, Strict(), Field(ge=1)]
    spec_name: Text
    spec_hash: Text
    spec_source: Text
    backend: Literal[ALL_BACKENDS]
    device: Text  # GPU name, or "cpu"
    driver: Text | None  # NVIDIA driver version (NVML), None where unavailable
    torch_version: Text
    triton_version: Text | None
    graphcap_version: Text
    created: Timestamp  # ISO-8601 UTC
    updated: Timestamp  # ISO-8601 UTC, stamped by write_manifest
    steps: Count
    window: Count
    buckets: list[BucketRecord]
    oversize_fallbacks: Count = 0  # batches larger than the largest bucket, run eagerly
    dynamic_batch: Annotated[bool, Strict()] = False  # one compile for every bucket (else one per bucket)
    notes: list[Text] = field(default_factory=list)
    compile_cache: Text | None = None  # CaptureOptions(compile_cache=...): "hit", "miss" or "refused: <why>"; else None
    parallel: Parallel | None = None  # the writing process's ranks (the sglang plugin); None: not recorded
    serving: Serving | None = None  # the sglang plugin's rows and kernel variants; None: not serving

    @classmethod
    def for_spec(cls, spec: Any, backend: str | None = None, env: dict[str, Any] | None = None, *,
                 buckets: list[BucketRecord] | None = None, created: str | None = None) -> Manifest:
        """A manifest for a `CaptureSpec` (or a stand-in with its name, hash, source, window and capture.steps, and
        optionally `parallel`, the process's ranks; None for a function captured without one, which then needs
        `backend` and `buckets`). Fresh by default: the spec's
        buckets all "pending", created now, the environment from `environment()`; a running capture
        (`DraftGraphs.manifest()`) passes its own `buckets`, `created` and (read once) `env`."""
        if spec is None and (backend is None or buckets is None):
            raise ValueError("Manifest.for_spec: without a spec, backend and buckets must be given")
        backend = backend or spec.capture.backend
        if backend not in ALL_BACKENDS:
            raise ValueError(f"Manifest.for_spec: unknown backend {backend!r}; "
                             f"expected one of {', '.join(ALL_BACKENDS)}")
        if buckets is None:
            buckets = [BucketRecord(b) for b in spec.capture.buckets]
        now = utc_now()
        if spec is None:
            name, spec_hash, source, steps, window = "(none)", "", "", 0, 0
        else:
            name, spec_hash, source, steps, window = spec.name, spec.hash, spec.source, spec.capture.steps, spec.window
        return cls(
            format_version=FORMAT_VERSION, spec_name=name, spec_hash=spec_hash, spec_source=source, backend=backend,
            **(environment() if env is None else env), created=created or now, updated=now, steps=steps,
            window=window, buckets=buckets, parallel=getattr(spec, "parallel", None),
        )

    def bucket(self, batch_size: int) -> BucketRecord:
        for b in self.buckets:
            if b.batch_size == batch_size:
                return b
        raise KeyError(f"no bucket of batch size {batch_size} in manifest for {self.spec_name}")

    def to_dict(self, derived: bool = False) -> dict[str, Any]:
        """Plain JSON-able dict: exactly the file's content, plus each bucket's `padding_waste` if `derived`."""
        d = dataclasses.asdict(self)
        if derived:
            for rec, bd in zip(self.buckets, d["buckets"]):
                bd["padding_waste"] = rec.padding_waste
        return d


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def environment() -> dict[str, Any]:
    """device, driver, torch/triton/graphcap versions of this process. Imports torch; needs no GPU."""
    import importlib.metadata

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        triton_version: str | None = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return dict(device=device, driver=nvidia_driver_version(), torch_version=str(torch.__version__),
                triton_version=triton_version, graphcap_version=VERSION)


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver version through NVML (nvidia-ml-py), or None without NVML or an NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no pynvml, no libnvidia-ml, no driver: all mean "unknown"
        return None
    try:
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------------
# Where manifests live


def default_manifest_dir() -> Path:
    """`$GRAPHCAP_MANIFEST_DIR`, else `$XDG_CACHE_HOME/graphcap/manifests`, else `~/.cache/graphcap/manifests`."""
    named = envvars.manifest_dir(os.environ)
    if named is not None:
        return named
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: relative values are ignored
    return base / "graphcap" / "manifests"


def manifest_path(directory: str | Path, spec_name: str, spec_hash: str, backend: str,
                  parallel: Parallel | None = None) -> Path:
    """`{directory}/{spec_name}-{spec_hash}-{backend}.json`, characters unsafe in file names replaced by `_`; a
    process of a parallel server adds its rank, `...-{backend}-tp1.json` (`Parallel.label`: `-dp1-tp0` with
    replicas too), so that every process writes a file of its own."""
    stem = "-".join(re.sub(r"[^A-Za-z0-9._-]", "_", part) for part in (spec_name, spec_hash, backend))
    label = parallel.label if parallel is not None else ""
    return Path(directory) / f"{stem.lstrip('.')}{'-' + label if label else ''}.json"


# `*-{backend}.json`, or with a rank: `*-{backend}-tp1.json`, `*-{backend}-dp0-tp1.json` (manifest_path's names)
_MANIFEST_NAME = re.compile(rf"-(?:{'|'.join(map(re.escape, ALL_BACKENDS))})"
                            + "".join(rf"(?:-{d}\d+)?" for d in PARALLEL_DIMS) + r"\.json$")


def list_manifests(directory: str | Path) -> list[Path]:
    """The manifests in `directory` by name (`*-{backend}.json` and its ranks' `*-{backend}-tp1.json`, as
    `manifest_path` writes them), sorted; [] if it does not exist. Other JSON files beside them (a bench's results,
    say) are not manifests and are left alone."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("*.json") if p.is_file() and _MANIFEST_NAME.search(p.name))


# ---------------------------------------------------------------------------------------------------------------
# Writing and reading


def write_manifest(m: Manifest, path: str | Path) -> Path:
    """Stamp `m.updated` and write `m` to `path` atomically (temp file in the same directory, then os.replace)."""
    path = Path(path)
    m.updated = utc_now()
    text = json.dumps(m.to_dict(), indent=2, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode(), 0o644)
    return path


def read_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest; every problem is a `ManifestError` naming the file and the field."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ManifestError(source, "<file>", f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ManifestError(source, "<file>", f"not UTF-8 text: {e.reason} at byte {e.start}") from None
    if not text.strip():
        raise ManifestError(source, "<file>", "empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(source, "<json>", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise ManifestError(source, "<json>", f"expected a JSON object, got {_kind(data)}")
    return parse_manifest(data, source)


def parse_manifest(data: dict[str, Any], source: str = "<manifest>") -> Manifest:
    """Validate a manifest dict (the file's JSON) into a `Manifest`."""
    v = data.get("format_version")
    if isinstance(v, int) and not isinstance(v, bool) and v > FORMAT_VERSION:  # first: a newer format may differ
        raise ManifestError(source, "format_version",                            # in every field
                            f"written by a newer graphcap (format {v} > {FORMAT_VERSION}); upgrade graphcap")
    # graphcap writes every field, defaulted ones included: a missing one means a cut or hand-edited file
    missing = _first_missing(data, Manifest, "", optional=_ADDED_FIELDS)
    if missing is None and isinstance(data.get("buckets"), list):
        missing = next((m for i, b in enumerate(data["buckets"]) if isinstance(b, dict)
                        for m in [_first_missing(b, BucketRecord, f"buckets[{i}].")] if m), None)
    if missing:
        raise ManifestError(source, missing, "missing")
    try:
        m = _MANIFEST.validate_python(data)
    except ValidationError as e:
        raise ManifestError.from_validation(source, e, table="an object", extra="unknown field") from None
    seen: set[int] = set()
    for i, b in enumerate(m.buckets):
        if b.batch_size in seen:
            raise ManifestError(source, f"buckets[{i}].batch_size", f"duplicate bucket {b.batch_size}")
        seen.add(b.batch_size)
    return m


_MANIFEST = TypeAdapter(Manifest)


# Fields added after format 1's first files: absent in those, so absence means the default, not a cut file.
_ADDED_FIELDS = frozenset({"dynamic_batch", "compile_cache", "parallel", "serving"})


def _first_missing(raw: dict[str, Any], cls: type, prefix: str, optional: frozenset[str] = frozenset()) -> str | None:
    return next((prefix + f.name for f in dataclasses.fields(cls) if f.name not in raw and f.name not in optional),
                None)


def _kind(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(x), type(x).__name__)
