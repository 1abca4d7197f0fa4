"""`DraftGraphs`: one captured draft iteration per batch bucket, and the run-time dispatcher around them.

How a bucket is recorded, per backend (`reduce-overhead`, `inductor-cudagraph`, `cudagraph`, `compile`, `eager`), is
graphcap.recording's; this module owns the buckets' static inputs, capturing them in order, the guards at run time,
the dispatch and the manifest.

Run time: the smallest bucket >= B is chosen, the live batch is copied into its first B rows, the other rows point
at the padding slot with accepted = 0, the graph replays and views of the first B rows come back. They stay valid
until the next `run` (a replay overwrites them); pass `copy=True` to keep them longer. B above the largest bucket,
or a bucket whose capture failed, runs the same function eagerly: logged once per cause and counted.

Zero-copy: an engine that can write its batch straight into the bucket's static inputs takes them from
`static_inputs(B)`, fills them, and calls `replay(B)` - no input copies at all.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from graphcap import manifest as mf
from graphcap.guards import AddressGuard, CaptureError, cache_entries
from graphcap.iteration import CapturableLoop, DraftOutput
from graphcap.backends import ALL_BACKENDS, COMPILED_BACKENDS, DEFAULT_BACKEND, GRAPH_BACKENDS, MANUAL_GRAPH_BACKENDS
from graphcap.recording import Inputs, compile_iteration, record_bucket
from graphcap.window import check_slots

__all__ = ["DraftGraphs"]  # CaptureError is graphcap.guards'

log = logging.getLogger("graphcap")


@dataclass
class _Bucket:
    size: int
    inputs: Inputs  # static input buffers, rows [B:] always padding
    record: mf.BucketRecord
    graph: torch.cuda.CUDAGraph | None = None  # manual-graph backends
    outputs: DraftOutput | None = None  # manual-graph backends: the graph's static outputs
    used_rows: int = 0  # live rows written by the last run (rows past it are padding again)
    views: dict[int, tuple[Inputs, DraftOutput | None]] = field(default_factory=dict)  # first-B-row views, by B

    def rows(self, b: int) -> tuple[Inputs, DraftOutput | None]:
        """Views of the first b rows of the static inputs (and static outputs), made once per b: slicing costs
        host time on every call otherwise."""
        v = self.views.get(b)
        if v is None:
            outs = DraftOutput(*(x[:b] for x in self.outputs)) if self.outputs is not None else None
            v = self.views[b] = (tuple(x[:b] for x in self.inputs), outs)
        return v


class DraftGraphs:
    """One captured draft iteration per batch bucket, a dispatcher, guards, eager fallback and a manifest."""

    def __init__(
        self,
        fn: Callable[..., DraftOutput],
        *,
        buckets: Sequence[int],
        padding_slot: int,
        example_inputs: Callable[[int], Inputs],
        static_tensors: dict[str, torch.Tensor],
        backend: str = DEFAULT_BACKEND,
        spec=None,
        manifest_path: str | os.PathLike | None = "default",
        progress: bool | None = None,
        flush_every_s: float = 10.0,
    ) -> None:
        if backend not in ALL_BACKENDS:
            raise ValueError(f"DraftGraphs: unknown backend {backend!r}; expected one of {', '.join(ALL_BACKENDS)}")
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"DraftGraphs: buckets must be positive and strictly increasing, got {list(buckets)}")
        device = example_inputs(1)[0].device
        if backend in GRAPH_BACKENDS and device.type != "cuda":
            raise ValueError(f"DraftGraphs: backend {backend!r} records CUDA graphs; tensors are on {device}. "
                             "Use backend 'compile' or 'eager' on a CPU.")
        self.fn, self.backend, self.spec, self.padding_slot = fn, backend, spec, padding_slot
        self.device = device
        self._example_inputs = example_inputs
        self._static = dict(static_tensors)
        self._addresses = AddressGuard({})
        self._progress = sys.stderr.isatty() if progress is None else progress
        self._buckets = [self._new_bucket(b) for b in buckets]
        self._bucket_of = [None] * (buckets[-1] + 1)  # batch size -> bucket index
        j = 0
        for b in range(1, buckets[-1] + 1):
            while buckets[j] < b:
                j += 1
            self._bucket_of[b] = j
        self._compiled: Callable[..., DraftOutput] | None = None
        self._code: types.CodeType | None = None
        self._entries_after_capture = 0
        self._warned: set[str] = set()
        self.oversize_fallbacks = 0
        self.captured = False
        if manifest_path == "default":  # $GRAPHCAP_MANIFEST_DIR or the per-user cache; None: write none
            manifest_path = mf.manifest_path(mf.default_manifest_dir(), spec.name if spec else "unnamed",
                                             spec.hash if spec else "0", backend)
        self.manifest_path = manifest_path
        if manifest_path:  # counters since the last timed flush reach the file at exit too
            atexit.register(_flush_at_exit, weakref.ref(self))
        self._flush_every_s, self._last_flush = flush_every_s, 0.0
        self._created = None
        self._env: dict | None = None  # device, driver, versions: read once (NVML), not at every flush

    @classmethod
    def for_loop(cls, loop: CapturableLoop, backend: str | None = None, buckets: Sequence[int] | None = None,
                 steps_only: bool = False, **kw) -> DraftGraphs:
        """Capture `loop` (advance + steps), or with `steps_only` just its steps (the rebuild baseline's graph)."""
        spec = loop.spec
        return cls(loop.draft_steps if steps_only else loop, buckets=buckets or spec.capture.buckets,
                   padding_slot=loop.padding_slot, example_inputs=loop.example_inputs,
                   static_tensors=loop.static_tensors(), backend=backend or spec.capture.backend, spec=spec, **kw)

    # -----------------------------------------------------------------------------------------------------------
    # capture

    def capture(self) -> None:
        """Warm up and record every bucket, largest first (so smaller ones reuse its pool memory)."""
        t_all = time.perf_counter()
        self._addresses = AddressGuard(self._static)
        if self.backend in COMPILED_BACKENDS:
            static = [*self._static.values(), *(t for b in self._buckets for t in b.inputs)]
            self._compiled, self._code = compile_iteration(self.fn, self.backend, static, len(self._buckets),
                                                           tag=f"{id(self):x}")
        pool = torch.cuda.graph_pool_handle() if self.backend in MANUAL_GRAPH_BACKENDS else None
        order = list(reversed(self._buckets))
        for i, bucket in enumerate(order):
            self._show(f"capturing bucket {bucket.size:>4} ({i + 1}/{len(order)})")
            rec = bucket.record
            bucket.graph, bucket.outputs = record_bucket(bucket.inputs, rec, self.backend, self.fn, self._compiled,
                                                         pool)
            if rec.status == "failed":
                self._warn_once(f"capture:{bucket.size}", f"graphcap: bucket {bucket.size} not captured "
                                                          f"({rec.reason}); it will run eagerly")
        if self._code is not None:
            self._entries_after_capture = cache_entries(self._code)
        self.captured = True
        self._created = self._created or mf.utc_now()
        ok = [b for b in self._buckets if b.record.status == "captured"]
        pool_mib = sum(b.record.pool_bytes for b in self._buckets) / 2**20
        self._show(None)
        failed = "" if len(ok) == len(self._buckets) else f", {len(self._buckets) - len(ok)} failed (eager fallback)"
        summary = (f"graphcap: captured {len(ok)}/{len(self._buckets)} buckets "
                   f"({self._buckets[0].size}..{self._buckets[-1].size}) with {self.backend} in "
                   f"{time.perf_counter() - t_all:.1f} s, {pool_mib:.0f} MiB graph memory{failed}")
        if self.manifest_path:
            self.flush()
            summary += f"; manifest {self.manifest_path}"
        print(summary, file=sys.stderr)

    def recapture(self) -> None:
        """Capture again after a static tensor moved in place (its storage reallocated or resized, which the address
        guard reports): the graphs are recorded over the same tensor objects' new addresses. A function that should
        read *new* tensor objects needs a new `DraftLoop` and `DraftGraphs` (the graphs cannot know what the function
        reads). Until the capture finishes nothing replays (run() raises)."""
        self.captured = False
        self._buckets = [self._new_bucket(b.size) for b in self._buckets]
        self._compiled, self._code = None, None
        self.capture()

    def _new_bucket(self, size: int) -> _Bucket:
        inputs = tuple(t.clone() for t in self._example_inputs(size))
        return _Bucket(size, inputs, mf.BucketRecord(size))

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
        if b > self._buckets[-1].size:
            self.oversize_fallbacks += 1
            self._warn_once("oversize", f"graphcap: batch {b} is larger than the largest bucket "
                                        f"{self._buckets[-1].size}; running eagerly (counted in the manifest)")
            return self._finish(self.fn(slots, accepted, tokens, hidden), b, copy)
        bucket = self._buckets[self._bucket_of[b]]
        if bucket.record.status == "captured":
            self._addresses.check()  # before anything is written
        (s, a, t, h), _ = bucket.rows(b)
        bucket.used_rows = max(bucket.used_rows, b)  # written rows: padding again at the next smaller batch
        s.copy_(slots)
        a.copy_(accepted)
        t.copy_(tokens)
        h.copy_(hidden)
        return self._replay(bucket, b, copy)

    def static_inputs(self, b: int) -> Inputs:
        """Views of the first `b` rows of the static inputs (slots, accepted, tokens, hidden) of `b`'s bucket, for an
        engine that writes its batch straight into them and then calls `replay(b)`. Every row must be written
        before each `replay` (they hold the previous batch otherwise)."""
        bucket = self._bucket_for("static_inputs", b)
        bucket.used_rows = max(bucket.used_rows, b)  # the engine writes them: padding again at a smaller batch
        return bucket.rows(b)[0]

    def replay(self, b: int, *, copy: bool = False) -> DraftOutput:
        """One draft iteration over the batch already written into `static_inputs(b)`: the zero-copy `run`. No
        input checks (shapes are the static buffers'; the engine checks its batch first with `check_batch`)."""
        bucket = self._bucket_for("replay", b)
        if bucket.record.status == "captured":
            self._addresses.check()
        return self._replay(bucket, b, copy)

    def _bucket_for(self, caller: str, b: int) -> _Bucket:
        if not self.captured:
            raise CaptureError(f"{caller}() before capture()")
        if type(b) is not int or not 1 <= b <= self._buckets[-1].size:
            raise CaptureError(f"{caller}: batch {b!r} is not an int in the captured buckets' range "
                               f"1..{self._buckets[-1].size}; use run() (larger batches run eagerly)")
        return self._buckets[self._bucket_of[b]]

    def _replay(self, bucket: _Bucket, b: int, copy: bool) -> DraftOutput:
        rec = bucket.record
        inputs, outputs = bucket.rows(b)
        s, a, t, h = bucket.inputs
        if bucket.used_rows > b:  # rows a larger batch used last time become padding again
            s[b:bucket.used_rows].fill_(self.padding_slot)
            a[b:bucket.used_rows].zero_()
        bucket.used_rows = b
        if rec.status != "captured":
            rec.fallbacks += 1
            return self._finish(self.fn(*inputs), b, copy)
        if bucket.graph is not None:
            bucket.graph.replay()
            rec.replays += 1
            rec.padded_rows += bucket.size - b
            return self._finish(outputs, b, copy, sliced=True)
        if self._compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
            out = self._compiled(s, a, t, h)
            if cache_entries(self._code) != self._entries_after_capture:
                # Only visible once the call returned: this iteration did run (the windows advanced), slowly.
                raise CaptureError(f"bucket {bucket.size}: recompiled after capture (a guard failed: a static "
                                   "tensor or the function changed; this iteration still ran and advanced the "
                                   "windows); run with TORCH_LOGS=recompiles for the guard, then recapture()")
        else:
            out = self.fn(s, a, t, h)
        rec.replays += 1
        rec.padded_rows += bucket.size - b
        return self._finish(out, b, copy)

    def _finish(self, out: DraftOutput, b: int, copy: bool, sliced: bool = False) -> DraftOutput:
        if self.manifest_path and time.monotonic() - self._last_flush > self._flush_every_s:
            try:
                self.flush()
            except OSError as e:  # the iteration ran: return its outputs, retry at the next interval
                self._last_flush = time.monotonic()
                self._warn_once("flush", f"graphcap: could not write manifest {self.manifest_path}: {e}")
        rows = out if sliced else DraftOutput(*(x[:b] for x in out))
        return DraftOutput(*(x.clone() for x in rows)) if copy else rows

    def check_batch(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, *,
                    accepted: torch.Tensor | None = None, host_slots: Sequence[int] | None = None,
                    call: str = "run") -> None:
        """What `run` checks before it writes, for an engine that writes `static_inputs` itself (call it first, then
        write, then `replay`): shapes, devices and dtypes against the static inputs, and with `host_slots` (the same
        slots as Python ints) that they match the batch and are distinct and in range. Tensor metadata and host ints
        only, no device sync; a clear error instead of a broadcast error from deep inside copy_."""
        ref = self._buckets[0].inputs
        for name, x in (("slots", slots), ("accepted", accepted), ("tokens", tokens), ("hidden", hidden)):
            if x is not None and not isinstance(x, torch.Tensor):
                raise CaptureError(f"{call}: {name} must be a torch.Tensor, got {type(x).__name__}")
        b = slots.shape[0] if slots.ndim == 1 else -1
        if b < 1:
            raise CaptureError(f"{call}: slots must be a non-empty 1-D tensor, got shape {tuple(slots.shape)}")
        if host_slots is not None and len(host_slots) != b:
            raise CaptureError(f"{call}: {len(host_slots)} host_slots for a batch of {b} (slots {tuple(slots.shape)})")
        given = [("slots", slots, ref[0]), ("accepted", accepted, ref[1]), ("tokens", tokens, ref[2]),
                 ("hidden", hidden, ref[3])]
        given = [g for g in given if g[1] is not None]
        for name, x, r in given[1:]:
            if tuple(x.shape) != (b, *r.shape[1:]):
                raise CaptureError(f"{call}: {name} has shape {tuple(x.shape)}, expected {(b, *r.shape[1:])}")
        for name, x, r in given:
            if x.device != self.device:
                raise CaptureError(f"{call}: {name} is on {x.device}, the captured graphs on {self.device}")
            # integer inputs may be any integer dtype (copied into the static buffers); hidden must match exactly
            ok = x.dtype == r.dtype if r.is_floating_point() else not (x.is_floating_point() or x.is_complex()
                                                                       or x.dtype == torch.bool)
            if not ok:
                want = r.dtype if r.is_floating_point() else "an integer dtype"
                raise CaptureError(f"{call}: {name} has dtype {x.dtype}, expected {want}")
        if host_slots is not None:
            check_slots(host_slots, self.padding_slot, error=CaptureError, call=call, arg="host_slots")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _show(self, text: str | None) -> None:
        if self._progress:
            sys.stderr.write("\r\033[K" + (f"graphcap: {text}" if text else ""))
            sys.stderr.flush()

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
        return m

    def flush(self) -> None:
        """Write the manifest now (run() also does, at most every `flush_every_s`)."""
        if self.manifest_path:
            mf.write_manifest(self.manifest(), self.manifest_path)
            self._last_flush = time.monotonic()


def _flush_at_exit(ref: weakref.ref) -> None:
    graphs = ref()
    if graphs is not None and graphs.captured:
        try:
            graphs.flush()
        except OSError as e:  # never turn interpreter exit into a traceback
            log.warning("graphcap: could not write manifest %s at exit: %s", graphs.manifest_path, e)
