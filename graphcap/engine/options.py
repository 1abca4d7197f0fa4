"""`CaptureOptions`: how `DraftGraphs` captures, dispatches and reports, as one frozen value.

Each field is checked when the value is made (a bad one is a ValueError naming it and what it takes). What depends
on the function, its tensors or its spec - the defaults a None stands for, which options fit the backend - is
resolved and checked by the constructor that takes the options (`DraftGraphs`, `DraftGraphs.for_loop`). The tensors
and functions themselves (the iteration, its example inputs, its static tensors and their pool-sized dimensions, the
padding slot, the spec, observers) are the constructors' arguments, not options.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from graphcap.backends import ALL_BACKENDS
from graphcap.engine.dispatch import bucket_sizes

_PATH_TYPES = (str, os.PathLike)


@dataclass(frozen=True)
class CaptureOptions:
    """`None` in `backend`, `buckets`, `dynamic_batch` and `precompile` stands for the constructor's default:
    `DraftGraphs(...)` over any function takes backends.SPEC_DEFAULT_BACKEND, needs the buckets named, and leaves
    `dynamic_batch` and `precompile` off; `DraftGraphs.for_loop` takes the spec's backend and buckets, and turns
    both on where graphcap's loop is built for them (its docstring)."""

    backend: str | None = None  # backends.ALL_BACKENDS
    buckets: tuple[int, ...] | None = None  # the batch sizes captured: positive, strictly increasing

    # dynamic_batch=True (compiled backends): compile the iteration once with the batch dimension symbolic
    # (1..largest bucket) and record every bucket from that one artifact, instead of one compile per bucket. The
    # function must then derive no Python value from the batch (for_loop calls the loop's `plan_for_any_batch`): one
    # that passes such a value where an int is required fails the bucket's capture (the reason names the symbol), one
    # that only branches on it costs extra compiles (warned, and noted in the manifest).
    dynamic_batch: bool | None = None
    # With dynamic_batch: the largest batch the one compile is sized for - its batch range and Inductor's size hints,
    # which choose its kernels - instead of the largest bucket. A bench that captures only some of a server's buckets
    # passes the server's largest, so that it measures the code the server runs.
    compile_max_batch: int | None = None
    # Compiled backends, opt-in: load torch's compile artifacts for this capture from this directory before
    # compiling, and save them there after (graphcap.engine.compile_cache: the key, and the rules that refuse an
    # untrusted file). Without a spec, `cache_key` (e.g. the model path and config) names what is compiled.
    compile_cache: str | os.PathLike | None = None
    cache_key: str | None = None
    # With dynamic_batch and compile_cache (backends inductor-cudagraph and compile; experimental in torch): save the
    # compiled iteration whole in the cache directory, Dynamo's output included, and at the next capture load it
    # instead of tracing (graphcap.engine.precompile: what replaces Dynamo's guards).
    precompile: bool | None = None

    # Where a ManifestWriter writes the manifest: "default" (the per-user directory, graphcap.manifest), a path, or
    # None (no file); written after capture and at most every flush_every_s seconds from run/replay.
    manifest_path: str | os.PathLike | None = "default"
    flush_every_s: float = 10.0
    progress: bool = False  # a StderrProgress observer: the capture on stderr
    # False: the address guard at each flush interval instead of before every replay (graphcap.engine.capture's
    # docstring); DraftGraphs keeps it as an attribute, so an engine may switch it later.
    replay_checks: bool = True

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in ALL_BACKENDS:
            raise self._bad("backend", f"one of {', '.join(ALL_BACKENDS)}")
        if self.buckets is not None:
            if isinstance(self.buckets, (str, bytes)) or not isinstance(self.buckets, Sequence):
                raise self._bad("buckets", "a sequence of positive, strictly increasing ints")
            object.__setattr__(self, "buckets", bucket_sizes(self.buckets, "CaptureOptions"))  # a list, as a tuple
        for name in ("dynamic_batch", "precompile"):  # a truthy string would silently load code saved without guards
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise self._bad(name, "True, False or None (the constructor's default)")
        if self.compile_max_batch is not None and not (type(self.compile_max_batch) is int
                                                       and self.compile_max_batch >= 1):
            raise self._bad("compile_max_batch", "an int >= 1 or None")
        if self.compile_cache is not None and not isinstance(self.compile_cache, _PATH_TYPES):
            raise self._bad("compile_cache", "a directory (str or path) or None")
        if self.cache_key is not None and not isinstance(self.cache_key, str):
            raise self._bad("cache_key", "a string or None")
        if self.manifest_path is not None and not isinstance(self.manifest_path, _PATH_TYPES):
            raise self._bad("manifest_path", "'default', a path or None")
        s = self.flush_every_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or math.isnan(s) or s < 0:
            raise self._bad("flush_every_s", "seconds >= 0")
        for name in ("progress", "replay_checks"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "True or False")

    def _bad(self, name: str, expected: str) -> ValueError:
        return ValueError(f"CaptureOptions: {name} must be {expected}, got {getattr(self, name)!r}")

    def replace(self, **changes: Any) -> CaptureOptions:
        """These options with `changes` (field names); an unknown name is a ValueError naming it and the fields."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"CaptureOptions has no option {', '.join(map(repr, unknown))}; "
                             f"its options: {', '.join(names)}")
        return dataclasses.replace(self, **changes)
