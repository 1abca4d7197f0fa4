"""Triton kernel launch variants in an sglang scheduler process: which compile, when and for how long, and the
compiling at start-up of every variant an earlier run of the same server needed.

A Triton kernel compiles once per launch variant: its constexpr values and its arguments' specialization (dtypes,
16-byte alignment, integers equal to 1 or divisible by 16). A kernel whose variant follows the batch or the lengths
compiles again the first time serving reaches a new one: with an empty Triton cache that is 0.3-1 s inside serving,
a stall every request of that batch waits through (a p99 spike), paid by stock sglang's kernels as much as by any
of graphcap's. graphcap's captured draft iteration and the verify graphs sglang captures compile everything they
run at capture; what is left is what runs outside the graphs.

`VariantLog` (one per process, installed by the plugin) hooks Triton's compile (`knobs.runtime.jit_cache_hook` and
`jit_post_compile_hook`; `JITFunction.cache_hook`/`compiled_hook` on a Triton without knobs) and records each compile
with its kernel, its variant, its seconds, and whether it came before the process's first draft call (start-up) or
after (while serving). With the flag on:
- the variants compiled while serving go to a variants file beside the capture manifest (`save`, at each manifest
  flush and at exit), with the specialization Triton needs to compile a variant without its arguments;
- the next start of the same server compiles every recorded variant before it serves (`preload`, at the end of
  graphcap's capture): from Triton's disk cache where it holds them, else compiled there, at start-up;
- the manifest's `serving` section says how many variants were preloaded, compiled at start-up, and compiled while
  serving - the last named, with their seconds (`summary`).
With `GRAPHCAP_SGLANG_TRACE=DIR`, with or without the flag, every compile is also appended to
`DIR/compiles-<pid>.jsonl` on the draft trace's clock (`time.perf_counter`), to place a gap between two draft calls.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("graphcap.sglang")
FORMAT = 1
LATE_KEPT = 32  # compiles while serving the manifest names (all are counted)
VARIANT_CHARS = 240  # of Triton's description of a variant, kept per record


@dataclass
class Compile:
    kernel: str  # "<module>:<qualname>", the key of Triton's registry of jit functions
    variant: str  # Triton's description: launch options and each argument's specialization
    t: float  # start, time.perf_counter()
    seconds: float  # until Triton's post-compile hook: a disk-cache load (ms) or a compile (0.3-1 s)
    serving: bool  # after the process's first draft call
    preload: bool  # compiled by `preload` (Triton's warm-up path), not by a launch
    spec: str | None = None  # Triton's specialization data (JSON), what `JITFunction.preload` takes


@dataclass
class VariantSummary:
    preloaded: int = 0
    preload_failed: int = 0
    at_startup: int = 0  # compiled by a launch before the first draft call
    while_serving: int = 0
    late: list[Compile] = field(default_factory=list)  # the first LATE_KEPT compiled while serving


class VariantLog:
    def __init__(self, trace_dir: str | None = None, clock=time.perf_counter) -> None:
        self.clock = clock
        self.records: list[Compile] = []
        self.serving_since: float | None = None
        self.preloaded = self.preload_failed = 0
        self.preload_errors: list[str] = []
        self._open: dict[tuple[int, object], float] = {}  # (thread, Triton's cache key) -> start
        self._lock = threading.Lock()
        self._saved = 0  # records already in the variants file
        self.trace_path = (os.path.join(trace_dir, f"compiles-{os.getpid()}.jsonl") if trace_dir else None)
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)

    # -- Triton's hooks ------------------------------------------------------------------------------------------

    def before_compile(self, *, key, **_) -> bool:
        self._open[(threading.get_ident(), _hashable(key))] = self.clock()
        return False  # False: Triton goes on to compile

    def after_compile(self, *, key, repr, fn, compile, is_manual_warmup, **_) -> None:  # noqa: A002 - Triton's names
        t1 = self.clock()
        t0 = self._open.pop((threading.get_ident(), _hashable(key)), t1)
        jf = getattr(fn, "jit_function", None)
        kernel = f"{jf.module}:{jf.fn.__qualname__}" if jf is not None else str(getattr(fn, "name", "?"))
        spec = compile.get("specialization_data") if isinstance(compile, dict) else None
        rec = Compile(kernel, str(repr)[:VARIANT_CHARS], t0, t1 - t0, self.serving_since is not None,
                      bool(is_manual_warmup), spec)
        with self._lock:
            self.records.append(rec)
        if self.trace_path:
            with open(self.trace_path, "a") as f:
                f.write(json.dumps({"kernel": rec.kernel, "variant": rec.variant, "t": rec.t, "ms": rec.seconds * 1e3,
                                    "serving": rec.serving, "preload": rec.preload}) + "\n")

    # -- the process's phases ------------------------------------------------------------------------------------

    def on_draft(self) -> None:
        """A draft call: the first one ends start-up."""
        if self.serving_since is None:
            self.serving_since = self.clock()

    def summary(self) -> VariantSummary:
        with self._lock:
            recs = list(self.records)
        s = VariantSummary(preloaded=self.preloaded, preload_failed=self.preload_failed)
        for r in recs:
            if r.preload:
                continue
            if r.serving:
                s.while_serving += 1
                if len(s.late) < LATE_KEPT:
                    s.late.append(r)
            else:
                s.at_startup += 1
        return s

    # -- the variants file ---------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> bool:
        """Merge the variants compiled by a launch while serving into `path` (atomically); False when nothing is new
        since the last save. The file keeps the Triton version its specializations are for."""
        with self._lock:  # what a start-up compiles anyway is not recorded: what serving met first is
            new = [r for r in self.records[self._saved:] if r.spec and r.serving and not r.preload]
            upto = len(self.records)
        if not new:
            self._saved = upto
            return False
        path = Path(path)
        data = _read_variants(path) or {"format": FORMAT, "triton": _triton_version(), "variants": {}}
        if data.get("triton") != _triton_version():  # another Triton's specializations: start over
            data = {"format": FORMAT, "triton": _triton_version(), "variants": {}}
        for r in new:
            data["variants"].setdefault(r.kernel, [])
            if r.spec not in data["variants"][r.kernel]:
                data["variants"][r.kernel].append(r.spec)
        from graphcap.atomic import write_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(data, indent=1) + "\n").encode(), 0o644)
        self._saved = upto
        return True

    def preload(self, path: str | Path) -> int:
        """Compile every variant `path` records (none if it is missing, unreadable or from another Triton), through
        Triton's own preload; a variant that cannot be (its kernel gone, another GPU target) is counted and skipped,
        never an error: preloading only moves compile time to start-up. Returns the variants compiled."""
        data = _read_variants(Path(path))
        if not data or data.get("triton") != _triton_version():
            return 0
        for kernel, specs in data.get("variants", {}).items():
            jf = _jit_function(kernel)
            for spec in specs:
                try:
                    if jf is None:
                        raise LookupError(f"no Triton kernel {kernel} in this process")
                    jf.preload(spec)
                    self.preloaded += 1
                except Exception as e:  # a stale record: the kernel changed, another target, another signature
                    self.preload_failed += 1
                    if len(self.preload_errors) < 8:
                        self.preload_errors.append(f"{kernel}: {' '.join(str(e).split())[:200]}")
        if self.preload_failed:
            log.warning("graphcap: %d recorded kernel variants could not be compiled at start-up (%s)",
                        self.preload_failed, "; ".join(self.preload_errors))
        return self.preloaded


PROCESS: VariantLog | None = None  # this process's log, once installed (`install_process`)


def install_process(trace_dir: str | None) -> VariantLog:
    """The process's VariantLog, hooked into Triton once (the plugin's register() runs more than once)."""
    global PROCESS
    if PROCESS is None:
        PROCESS = install(VariantLog(trace_dir))
    return PROCESS


def note_draft() -> None:
    """A draft call in this process (the draft hooks call this): the first ends start-up."""
    if PROCESS is not None:
        PROCESS.on_draft()


def variants_path(manifest_path: str | Path) -> Path:
    """The variants file of the server whose capture manifest is `manifest_path`."""
    p = Path(manifest_path)
    return p.with_name(p.stem + "-variants.json")


def install(log_: VariantLog) -> VariantLog:
    """Hook `log_` into Triton's compile, chained after any hooks already there (process-wide)."""
    try:
        from triton import knobs

        rt = knobs.runtime
        prev_pre, prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook
        rt.jit_cache_hook = _chain_pre(prev_pre, log_.before_compile)
        rt.jit_post_compile_hook = _chain_post(prev_post, log_.after_compile)
    except (ImportError, AttributeError):  # a Triton before knobs: the class attributes
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = _chain_pre(getattr(JITFunction, "cache_hook", None), log_.before_compile)
        JITFunction.compiled_hook = _chain_post(getattr(JITFunction, "compiled_hook", None), log_.after_compile)
    return log_


def _chain_pre(prev, hook):
    if prev is None:
        return hook

    def both(**kw):
        hook(**kw)
        return prev(**kw)  # the earlier hook decides whether Triton skips the compile
    return both


def _chain_post(prev, hook):
    if prev is None:
        return hook

    def both(**kw):
        prev(**kw)
        hook(**kw)
    return both


def _hashable(key) -> object:
    try:
        hash(key)
        return key
    except TypeError:
        return repr(key)


def _jit_function(kernel: str):
    """Triton's JITFunction `kernel` ("<module>:<qualname>"): from Triton's registry where this Triton keeps one, else
    its module (imported if need be) and the qualified name, through any autotune/heuristics wrapper (`.fn`)."""
    from triton.runtime import jit

    found = getattr(jit, "_triton_jit_function_registry", {}).get(kernel)
    if found is not None:
        return found
    module, _, qualname = kernel.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # gone from this sglang, or a function's local kernel
        return None
    while not isinstance(obj, jit.JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj if isinstance(obj, jit.JITFunction) else None


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _read_variants(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("variants"), dict)
    return data if ok else None
