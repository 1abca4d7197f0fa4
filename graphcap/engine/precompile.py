"""The precompiled iteration (`precompile`: `DraftGraphs.for_loop`'s default with a compile cache, opt-in for
`DraftGraphs` itself): the one dynamic-batch compile saved whole, Dynamo's output included, with torch's AOT compile
(`torch.compile(...).aot_compile`, `load_compiled_function`), so that a restart loads it and records its graphs
without tracing anything.

Why: a warm restart from Inductor's caches still re-runs Dynamo over the whole iteration (2.4 s of 5.0 s on the
H200 for buckets 1..64; precompiled, the restart took 2.5 s). A precompiled iteration skips that; it needs
`dynamic_batch` (one artifact for every bucket, the pool sizes symbolic, so other memory settings load it too -
unless they change the context bound enough to change the full layer's split count, which is in the key).

What replaces Dynamo's guards: the artifact is saved with none (torch would check them against objects of the
process that compiled it). graphcap's key stands in for them: the compile cache's key (spec hash or caller's key,
backend, buckets, versions, device) plus the static tensors' names, dtypes and sizes other than the pool-sized
dimensions, plus the loop's `precompile_signature()` where it has one (its attention plans). Anything else that
would change the compiled code must change one of these.

A precompiled file is code, kept under the compile cache's rules (`compile_cache`): 0600 in a 0700 directory this
user owns, nothing loaded from a shared-writable, foreign or symlinked path. A file that does not load is one warning
and a normal compile. The function compiled is the capture's own (`recording.iteration_function`); the
model object it closes over travels as external data (it is the live object of the loading process, not a copy).

Experimental in torch (2.11 and 2.13 both have the API; 2.11 only under Dynamo's `enable_aot_compile`). On the H200
it saved and loaded (docs/results.md, capture section), and its replays over larger pools equal the same code without
graphs (tests/engine/test_capture_gpu.py). CPU: equal to the eager loop (tests/engine/test_compile_cache.py).
"""
from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from graphcap.engine import compile_cache as cc
from graphcap.engine.iteration import DraftFn, Inputs

BACKENDS = ("inductor-cudagraph", "compile")  # Inductor without CUDA graphs of its own: graphcap records them
SUFFIX = ".aot"


def _no_guards(entries: Sequence) -> list[bool]:
    return [False] * len(entries)


def signature(static: Mapping[str, torch.Tensor], pool_dims: Mapping[str, Sequence[int]], fn: object) -> str:
    """What the key adds for a precompiled artifact (module docstring): static tensors' names, dtypes and sizes with
    the pool-sized dimensions left out, and `fn.precompile_signature()` if it has one."""
    parts = []
    for name in sorted(static):
        t = static[name]
        dims = set(pool_dims.get(name, ()))
        parts.append(f"{name}:{t.dtype}:{[s if i not in dims else '*' for i, s in enumerate(t.shape)]}")
    extra = getattr(getattr(fn, "__self__", fn), "precompile_signature", None)  # a bound draft_steps: its loop
    if callable(extra):
        parts.append(str(extra()))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def compile_aot(fresh: DraftFn, example_inputs: Inputs) -> DraftFn:
    """`fresh` (the capture's iteration function) compiled now, for the example inputs whose batch dimension is
    marked unbacked: one artifact for every bucket, saved with no guards."""
    # torch 2.11 attaches `.aot_compile` only under this flag (2.13 always does)
    flag = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    with torch._dynamo.config.patch(**flag):
        compiled = torch.compile(fresh, fullgraph=True, dynamic=None,
                                 options={"triton.cudagraphs": False, "guard_filter_fn": _no_guards})
        return compiled.aot_compile((tuple(example_inputs), {}))


def file_name(key: str) -> str:
    return f"{key}{SUFFIX}"


def save(directory: str | os.PathLike, key: str, compiled: DraftFn, external: Mapping[str, object]) -> Path | None:
    """Write `compiled` to `<directory>/<key>.aot` under the compile cache's rules; None (logged) where it cannot be
    serialised or written: the capture stands either way."""
    def produce() -> bytes:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        return AOTCompiledFunction.serialize(compiled, dict(external)).serialized_data

    return cc.write_trusted(directory, file_name(key), "precompiled iteration", produce)


def load(directory: str | os.PathLike, key: str, external: Mapping[str, object]) -> tuple[DraftFn | None, str]:
    """The precompiled iteration of `key` and the manifest's compile_cache value ("hit", "miss", "refused: <why>");
    (None, ...) where there is none or it is refused or does not load."""
    return cc.read_trusted(directory, file_name(key), "precompiled iteration", lambda data:
                           torch.compiler.load_compiled_function(io.BytesIO(data), external_data=dict(external)))


@dataclass(frozen=True)
class Obtained:
    """What `load_or_compile` got: the iteration (None: torch's AOT compile failed), the manifest's compile_cache
    value, what to `save` once every bucket is captured (compiled now; None when loaded) and the manifest's note
    ("" for none)."""

    fn: DraftFn | None
    state: str
    to_save: DraftFn | None
    note: str


def load_or_compile(directory: str | os.PathLike, key: str, external: Mapping[str, object],
                    fresh: Callable[[], DraftFn], example_inputs: Inputs) -> Obtained:
    """The precompiled iteration of `key` from `directory` ("hit": nothing traced), else `fresh()` (the capture's
    iteration function, its static tensors marked) compiled now. A failing AOT compile is no error: torch's AOT
    compile is experimental, and its failure costs the warm start only (the caller compiles as without precompile)."""
    fn, state = load(directory, key, external)
    if fn is not None:
        return Obtained(fn, state, None, "precompiled: the iteration was loaded, not traced")
    try:
        fn = compile_aot(fresh(), example_inputs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return Obtained(None, state, None, f"precompile: torch's AOT compile failed ({type(e).__name__}: {first}); "
                                           "compiled without it, nothing precompiled saved")
    return Obtained(fn, state, fn, "")
