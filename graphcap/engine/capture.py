"""`DraftGraphs`: one captured draft iteration per batch bucket - the capture engine's facade.

The jobs are split as vLLM's cudagraph dispatcher splits them, one module of this package each: `dispatch` picks the
bucket of a batch size, `bucket_graph` records and replays one bucket (static inputs, graph, static outputs,
padding), `replay` is the handle an engine's hot path holds, `static_buffers` owns the tensors the graphs read by
address and their guard, `shared_compile` obtains the one compiled iteration the buckets share (marks, compile cache,
precompiled iteration) and `recording` compiles and records per backend. This module orders the capture, checks
batches, runs the eager fallbacks and keeps the manifest; what it reports (the manifest file, progress) goes to
observers (`observers`): it prints nothing.

Run time: the smallest bucket >= B is chosen, the live batch is copied into its first B rows, the other rows point
at the padding slot with accepted = 0, the graph replays and views of the first B rows come back. They stay valid
until the next `run` (a replay overwrites them); pass `copy=True` to keep them longer. B above the largest bucket,
or a bucket whose capture failed, runs the same function eagerly: logged once per cause and counted.

Zero-copy: an engine that can write its batch straight into the bucket's static inputs takes them from
`static_inputs(B)`, fills them, and calls `replay(B)` - no input copies at all. An engine's hot path dispatches once
per call instead: `prepare(B)` hands back the bucket's `Replay` for B rows (made once per B), which writes the batch
in one copy, says whether its replay runs any of the function's Python (`pure`: a recorded graph, nothing else), and
replays.

The address guard (every persistent tensor where it was at capture) runs before every replay by default. With
`replay_checks=False` it runs at each flush interval instead, as vLLM checks addresses only in its debug mode: a
tensor that moved is then named up to one interval late, after replays that read its old memory.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from graphcap import manifest as mf
from graphcap.backends import COMPILED_BACKENDS, GRAPH_BACKENDS, MANUAL_GRAPH_BACKENDS, SPEC_DEFAULT_BACKEND
from graphcap.engine import precompile as precompile_mod
from graphcap.engine.bucket_graph import BucketGraph
from graphcap.engine.dispatch import BucketDispatcher
from graphcap.engine.guards import BatchCheck, CaptureError
from graphcap.engine.iteration import CapturableLoop, DraftFn, DraftOutput, Inputs
from graphcap.engine.observers import CaptureObserver, CaptureSummary, ManifestWriter, StderrProgress, wants_flush
from graphcap.engine.options import CaptureOptions
from graphcap.engine.recording import CompiledIteration
from graphcap.engine.replay import Replay
from graphcap.engine.shared_compile import SharedCompile
from graphcap.engine.static_buffers import PoolDims, StaticBuffers

__all__ = ["DraftGraphs", "Replay"]  # CaptureError: graphcap.engine.guards; CaptureOptions: graphcap.engine.options

log = logging.getLogger("graphcap")


def _options(options: CaptureOptions | None) -> CaptureOptions:
    """`options`, None standing for the defaults."""
    options = CaptureOptions() if options is None else options
    if not isinstance(options, CaptureOptions):
        raise ValueError(f"DraftGraphs: options must be a CaptureOptions, got {options!r}")
    return options


class DraftGraphs:
    """One captured draft iteration per batch bucket, a dispatcher, guards, eager fallback and a manifest."""

    def __init__(self, fn: DraftFn, *, example_inputs: Callable[[int], Inputs],
                 static_tensors: dict[str, torch.Tensor], padding_slot: int, options: CaptureOptions | None = None,
                 spec=None, observers: Sequence[CaptureObserver] = (), pool_dims: PoolDims | None = None) -> None:
        """Capture `fn` (slots, accepted, tokens, hidden) -> DraftOutput per bucket of `options` (CaptureOptions:
        backend, buckets, compile, manifest and checks). `example_inputs(b)`: inputs of b rows (their shapes, dtypes and device are the static inputs');
        `static_tensors`: {name: every tensor the graphs read by address}; `padding_slot`: the window row padding
        rows point at; `spec`: what the manifest and the compile cache's key name; `observers`
        (graphcap.engine.observers) and `add_observer` receive the capture and every flush.

        `pool_dims` (with dynamic_batch): {static tensor name: its dimensions sized by the engine's memory settings}
        (KV pools' token capacity, req_to_token, full_to_swa, slot rows), compiled symbolically like the batch, so
        that a restart with other pool sizes hits Inductor's on-disk caches instead of compiling again - unless its
        context bound changes the full layer's planned split count, a constant of the graph
        (graphcap.engine.static_buffers). `for_loop` takes the loop's `pool_dims()`. The per-bucket compile
        specialises."""
        opts = _options(options)
        if opts.buckets is None:
            raise ValueError("DraftGraphs: CaptureOptions.buckets is None: name the batch sizes to capture "
                             "(DraftGraphs.for_loop takes the spec's)")
        backend = opts.backend or SPEC_DEFAULT_BACKEND
        dynamic_batch, precompile = bool(opts.dynamic_batch), bool(opts.precompile)
        compile_cache, compile_max_batch = opts.compile_cache, opts.compile_max_batch
        self._dispatch = BucketDispatcher(opts.buckets)
        device = example_inputs(1)[0].device
        if backend in GRAPH_BACKENDS and device.type != "cuda":
            raise ValueError(f"DraftGraphs: backend {backend!r} records CUDA graphs; tensors are on {device}. "
                             "Use backend 'compile' or 'eager' on a CPU.")
        if dynamic_batch and backend not in COMPILED_BACKENDS:
            raise ValueError(f"DraftGraphs: dynamic_batch compiles once for every bucket; backend {backend!r} "
                             f"compiles nothing (compiled backends: {', '.join(COMPILED_BACKENDS)})")
        if precompile and not (dynamic_batch and compile_cache is not None and backend in precompile_mod.BACKENDS):
            raise ValueError(f"DraftGraphs: precompile needs dynamic_batch=True, a compile_cache directory and a "
                             f"backend of {', '.join(precompile_mod.BACKENDS)} (got dynamic_batch={dynamic_batch}, "
                             f"compile_cache={compile_cache!r}, backend {backend!r})")
        if precompile and getattr(fn, "graph_breaks", False):
            raise ValueError("DraftGraphs: precompile needs a function Dynamo traces whole (fn.graph_breaks is set)")
        largest = self._dispatch.largest
        if compile_max_batch is not None and not (dynamic_batch and compile_max_batch >= largest):
            raise ValueError(f"DraftGraphs: compile_max_batch sizes the one compile for every bucket: an int >= the "
                             f"largest bucket {largest} with dynamic_batch=True (got {compile_max_batch!r}, "
                             f"dynamic_batch={dynamic_batch})")
        if compile_cache is not None and backend in COMPILED_BACKENDS and spec is None and not opts.cache_key:
            raise ValueError("DraftGraphs: compile_cache without a spec needs a cache_key (what is compiled)")
        manifest_path = opts.manifest_path
        if manifest_path == "default":  # $GRAPHCAP_MANIFEST_DIR or the per-user cache; None: write none
            manifest_path = mf.manifest_path(mf.default_manifest_dir(), spec.name if spec else "unnamed",
                                             spec.hash if spec else "0", backend)
        # What this capture runs with, every default resolved
        self.options = dataclasses.replace(opts, backend=backend, dynamic_batch=dynamic_batch, precompile=precompile,
                                           manifest_path=manifest_path)
        self.backend, self.dynamic_batch, self.precompile = backend, dynamic_batch, precompile
        self.compile_cache = compile_cache if backend in COMPILED_BACKENDS else None
        self.fn, self.spec, self.padding_slot = fn, spec, padding_slot
        self.device = device
        self._static = StaticBuffers(static_tensors, example_inputs, pool_dims)
        self._compile = SharedCompile(fn, backend, spec, device, self._dispatch.sizes, self._static, f"{id(self):x}",
                                      compile_max=compile_max_batch or largest, dynamic_batch=dynamic_batch,
                                      compile_cache=self.compile_cache, cache_key_text=opts.cache_key,
                                      precompile=precompile)
        self._buckets = [self._new_bucket(b) for b in self._dispatch.sizes]
        self._check_batch = BatchCheck(self._buckets[0].inputs, device, padding_slot)
        self._compiled: CompiledIteration | None = None
        self._warned: set[str] = set()
        self._notes: list[str] = []  # for the manifest
        self.serving: Callable[[], mf.Serving] | None = None  # the manifest's serving section, from the engine
        self.captured = False
        self.manifest_path = manifest_path
        self._observers: list[CaptureObserver] = []
        self._flushers: list[CaptureObserver] = []  # the observers that take the manifest at a flush
        builtin = [ManifestWriter(manifest_path)] if manifest_path else []
        builtin += [StderrProgress()] if opts.progress else []
        for o in [*builtin, *observers]:
            self.add_observer(o)
        self._flush_every_s, self._last_flush = opts.flush_every_s, 0.0
        self.replay_checks = opts.replay_checks  # an attribute: an engine may switch it later
        self._replays: dict[int, Replay] = {}  # prepare()'s handles, by batch size (dropped at recapture)
        self._created = None
        self._env: dict | None = None  # device, driver, versions: read once (NVML), not at every flush

    @classmethod
    def for_loop(cls, loop: CapturableLoop, options: CaptureOptions | None = None, *, steps_only: bool = False,
                 observers: Sequence[CaptureObserver] = (), pool_dims: PoolDims | None = None) -> DraftGraphs:
        """Capture `loop` (advance + steps), or with `steps_only` just its steps (the rebuild baseline's graph), with
        `options`. `pool_dims`: None takes the loop's.

        Defaults where an option is None: the spec's backend and buckets. With a compiled backend, one compile for
        every bucket (`dynamic_batch=True`; the loop plans its attention for any batch): on the H200 it captures
        buckets 1..64 in seconds where one compile per bucket took minutes, also on a restart with other pool sizes
        (docs/results.md, capture). `dynamic_batch=False` gives the per-bucket compile, whose iteration was faster
        (the one compile ran at 0.85-0.96x its speed, layers inlined).

        With a `compile_cache` the default is also `precompile=True` wherever it applies (one compile for every
        bucket, backend inductor-cudagraph or compile, a loop with a `precompile_signature()` as DraftLoop has): a
        warm restart then loads the iteration instead of tracing it. Only here, not in `DraftGraphs` itself: the
        precompiled iteration's key stands in for Dynamo's guards, and only a loop's signature says what that key must
        hold (graphcap.engine.precompile)."""
        opts = _options(options)
        spec = loop.spec
        backend = opts.backend or spec.capture.backend
        dynamic = backend in COMPILED_BACKENDS if opts.dynamic_batch is None else opts.dynamic_batch
        fn = loop.draft_steps if steps_only else loop
        precompile = opts.precompile
        if precompile is None:  # only for a loop that names what its compiled code depends on (the guards' stand-in)
            precompile = (dynamic and opts.compile_cache is not None and backend in precompile_mod.BACKENDS
                          and not getattr(fn, "graph_breaks", False)
                          and callable(getattr(loop, "precompile_signature", None)))
        if pool_dims is None and hasattr(loop, "pool_dims"):
            pool_dims = loop.pool_dims()
        # what is compiled beyond the spec: the loop's own step count and whether the advance is in it
        what = f"steps={getattr(loop, 'steps', spec.capture.steps)}" + (";steps_only" if steps_only else "")
        ops = getattr(loop, "ops", None)
        what += f";ops={ops.name}" if ops is not None else ""  # another op set compiles other code
        what += ";layer_regions" if getattr(loop, "layer_regions", False) else ""  # so do layer regions
        opts = dataclasses.replace(opts, backend=backend, buckets=opts.buckets or spec.capture.buckets,
                                   dynamic_batch=dynamic, precompile=precompile,
                                   cache_key=";".join(x for x in (opts.cache_key, what) if x))
        graphs = cls(fn, example_inputs=loop.example_inputs, static_tensors=loop.static_tensors(),
                     padding_slot=loop.padding_slot, options=opts, spec=spec, observers=observers,
                     pool_dims=pool_dims)
        # planned once the arguments are known good: a refused call leaves the loop as it was
        if graphs.dynamic_batch:
            loop.plan_for_any_batch()
        else:
            loop.plan_for_batches(graphs._dispatch.sizes)
        return graphs

    def add_observer(self, observer: CaptureObserver) -> None:
        """Tell `observer` about captures and flushes from now on (graphcap.engine.observers)."""
        self._observers.append(observer)
        if wants_flush(observer):
            self._flushers.append(observer)

    @property
    def oversize_fallbacks(self) -> int:
        """Batches above the largest bucket, run eagerly."""
        return self._dispatch.oversize

    @property
    def compiled(self) -> DraftFn | None:
        """The compiled iteration all buckets share (compiled backends, after capture), else None."""
        return self._compiled.fn if self._compiled is not None else None

    def bucket_graph(self, b: int) -> BucketGraph:
        """The bucket that serves a batch of `b` rows (1 <= b <= the largest bucket): its static inputs, graph and
        record, for benches that time its parts."""
        return self._buckets[self._dispatch.captured_index("bucket_graph", b)]

    # -----------------------------------------------------------------------------------------------------------
    # capture

    def capture(self) -> None:
        """Warm up and record every bucket, largest first (so smaller ones reuse its pool memory)."""
        t_all = time.perf_counter()
        self._static.arm()
        if self.backend in COMPILED_BACKENDS:
            self._compiled = self._compile.obtain([b.inputs for b in self._buckets], self._warn_once)
        pool = torch.cuda.graph_pool_handle() if self.backend in MANUAL_GRAPH_BACKENDS else None
        order = list(reversed(self._buckets))
        for i, bucket in enumerate(order, 1):
            for o in self._observers:
                o.on_bucket_start(bucket.size, i, len(order))
            bucket.capture(self.backend, self.fn, self._compiled, pool)
            if not bucket.captured:
                self._warn_once(f"capture:{bucket.size}", f"graphcap: bucket {bucket.size} not captured "
                                                          f"({bucket.record.reason}); it will run eagerly")
            for o in self._observers:
                o.on_bucket_captured(bucket.record, i, len(order))
        if self._compiled is not None:
            self._compiled.seal()
            if self.dynamic_batch and self._compiled.entries > 1:  # correct graphs, but not the one compile asked for
                note = (f"dynamic_batch: {self._compiled.entries} compiles for {len(self._buckets)} buckets, not 1 - "
                        "something in the function specialises the batch (TORCH_LOGS=recompiles names the guard)")
                self._warn_once("dynamic_batch", f"graphcap: {note}")
                self._notes.append(note)
        self._compile.save(all(b.captured for b in self._buckets))
        self.captured = True
        self._created = self._created or mf.utc_now()
        self.flush()  # an unwritable manifest is the caller's error here
        summary = CaptureSummary(
            backend=self.backend, buckets=self._dispatch.sizes, captured=sum(b.captured for b in self._buckets),
            seconds=time.perf_counter() - t_all, pool_bytes=sum(b.record.pool_bytes for b in self._buckets),
            manifest_path=str(self.manifest_path) if self.manifest_path else None, dynamic_batch=self.dynamic_batch)
        for o in self._observers:
            o.on_capture_done(summary)

    def recapture(self) -> None:
        """Capture again after a static tensor moved in place (its storage reallocated or resized, which the address
        guard reports): the graphs are recorded over the same tensor objects' new addresses. A function that should
        read *new* tensor objects needs a new `DraftLoop` and `DraftGraphs` (the graphs cannot know what the function
        reads). Until the capture finishes nothing replays (run() raises)."""
        self.captured = False
        self._replays.clear()
        self._buckets = [self._new_bucket(b.size) for b in self._buckets]
        self._compiled = None
        self._notes.clear()
        self._compile.notes.clear()
        self.capture()

    def _new_bucket(self, size: int) -> BucketGraph:
        return BucketGraph(size, self._static.new_inputs(size), mf.BucketRecord(size))

    # -----------------------------------------------------------------------------------------------------------
    # run time

    def run(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
            *, copy: bool = False, host_slots: Sequence[int] | None = None) -> DraftOutput:
        """One draft iteration for a live batch of B rows. `host_slots` (the same slots as Python ints, which an
        engine has on the host anyway) turns on the duplicate/range check at no device sync."""
        if not self.captured:
            raise CaptureError("run() before capture()")
        self.check_batch(slots, tokens, hidden, accepted=accepted, host_slots=host_slots)
        b = slots.shape[0]
        j = self._dispatch.index(b)
        if j is None:
            self._warn_once("oversize", f"graphcap: batch {b} is larger than the largest bucket "
                                        f"{self._dispatch.largest}; running eagerly (counted in the manifest)")
            return self._finish(self.fn(slots, accepted, tokens, hidden), b=b, copy=copy)
        bucket = self._buckets[j]
        if bucket.captured and self.replay_checks:
            self._static.check()  # before anything is written
        bucket.write(slots, accepted, tokens, hidden)  # written rows: padding again at the next smaller batch
        return self._finish(*bucket.replay(b, self.fn, self._compiled, self.padding_slot), b=b, copy=copy)

    def static_inputs(self, b: int) -> Inputs:
        """Views of the first `b` rows of the static inputs (slots, accepted, tokens, hidden) of `b`'s bucket, for an
        engine that writes its batch straight into them and then calls `replay(b)`. Every row must be written
        before each `replay` (they hold the previous batch otherwise)."""
        return self._bucket_for("static_inputs", b).claim(b)

    def replay(self, b: int, *, copy: bool = False) -> DraftOutput:
        """One draft iteration over the batch already written into `static_inputs(b)`: the zero-copy `run`. No
        input checks (shapes are the static buffers'; the engine checks its batch first with `check_batch`)."""
        return self._replay_bucket(self._bucket_for("replay", b), b, copy)

    def _replay_bucket(self, bucket: BucketGraph, b: int, copy: bool) -> DraftOutput:
        """`replay`'s and a `Replay` handle's one path: the address guard where it runs per replay, the replay, the
        interval's work and the first b rows."""
        if bucket.captured and self.replay_checks:
            self._static.check()
        return self._finish(*bucket.replay(b, self.fn, self._compiled, self.padding_slot), b=b, copy=copy)

    def prepare(self, b: int) -> Replay | None:
        """The `Replay` of the bucket that serves `b` rows (one dispatch, its handle made once per `b`), or None above
        the largest bucket (then `run` runs the batch eagerly and counts it)."""
        r = self._replays.get(b)
        if r is None:
            if not self.captured:
                raise CaptureError("prepare() before capture()")
            if type(b) is int and b > self._dispatch.largest:
                return None
            r = self._replays[b] = Replay(self._bucket_for("prepare", b), b, self._replay_bucket)
        return r

    def _bucket_for(self, caller: str, b: int) -> BucketGraph:
        if not self.captured:
            raise CaptureError(f"{caller}() before capture()")
        return self._buckets[self._dispatch.captured_index(caller, b)]

    def _finish(self, out: DraftOutput, sliced: bool = False, *, b: int, copy: bool) -> DraftOutput:
        if time.monotonic() - self._last_flush > self._flush_every_s:
            self._interval()
        rows = out if sliced else DraftOutput(*(x[:b] for x in out))
        return DraftOutput(*(x.clone() for x in rows)) if copy else rows

    def _interval(self) -> None:
        """Once per flush interval, after a replay: the address guard where it does not run before every replay,
        and the manifest's flush."""
        self._last_flush = time.monotonic()  # first: a failing check or flush is tried again an interval later
        if not self.replay_checks:
            self._static.check()
        if self._flushers:
            try:
                self.flush()
            except OSError as e:  # the iteration ran: return its outputs, retry at the next interval
                self._warn_once("flush", f"graphcap: could not write manifest {self.manifest_path}: {e}")

    def check_batch(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, *,
                    accepted: torch.Tensor | None = None, host_slots: Sequence[int] | None = None,
                    call: str = "run") -> None:
        """What `run` checks before it writes, for an engine that writes `static_inputs` itself (call it first, then
        write, then `replay`): shapes, devices and dtypes against the static inputs, and with `host_slots` (the same
        slots as Python ints) that they match the batch and are distinct and in range. Tensor metadata and host ints
        only, no device sync; a clear error instead of a broadcast error from deep inside copy_."""
        self._check_batch(slots, tokens, hidden, accepted=accepted, host_slots=host_slots, call=call)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # -----------------------------------------------------------------------------------------------------------
    # reporting

    @property
    def buckets(self) -> list[mf.BucketRecord]:
        return [b.record for b in self._buckets]

    def manifest(self) -> mf.Manifest:
        """What was captured and how it ran so far; the bucket records are copies (the counters keep moving)."""
        if self._env is None:
            self._env = mf.environment()
        m = mf.Manifest.for_spec(self.spec, self.backend, self._env, created=self._created,
                                 buckets=[dataclasses.replace(b.record) for b in self._buckets])
        m.oversize_fallbacks = self.oversize_fallbacks
        m.dynamic_batch = self.dynamic_batch
        m.compile_cache = self._compile.state
        m.notes = [*self._compile.notes, *self._notes]
        if self.serving is not None:
            m.serving = self.serving()
        return m

    def flush(self) -> None:
        """Hand the manifest as it stands to the observers that take it (the `ManifestWriter` writes the file); run()
        and replay() also do, at most every `flush_every_s`. Never at exit by itself: a process that wants the last
        counters written registers `atexit.register(graphs.flush)` (graphcap.engine.observers says why)."""
        if self._flushers:
            m = self.manifest()
            for o in self._flushers:
                o.on_flush(m)
        self._last_flush = time.monotonic()

