"""What a capture tells the outside world, as observers: the library itself prints nothing and registers no exit hook.

`DraftGraphs(observers=[...])` calls each observer's hooks: a bucket starting and finished, the capture done (with a
`CaptureSummary`), and the manifest at every flush (at the end of a capture, every `flush_every_s` from run/replay,
and on an explicit `DraftGraphs.flush()`). Three come with graphcap:
- `ManifestWriter`: writes the manifest at every flush (what `CaptureOptions.manifest_path` attaches);
- `StderrProgress`: a progress line and the summary on stderr, only where asked (`CaptureOptions(progress=True)`: the
  CLI, a bench);
- `LoggingProgress`: the same through `logging` (the sglang plugin: the server's log, its levels and handlers).

Counters since the last timed flush reach the file only at the next flush: a process that wants them written at
exit registers that itself - `atexit.register(graphs.flush)` - as the sglang plugin does
(graphcap.sglang.runtime.capture_graphs). A library that registered exit hooks would keep every
DraftGraphs alive, and write files, for programs that never asked.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import TextIO

from graphcap import manifest as mf


@dataclass(frozen=True)
class CaptureSummary:
    backend: str
    buckets: tuple[int, ...]  # sizes, smallest first
    captured: int  # buckets whose graph was recorded; the others run eagerly
    seconds: float  # wall time of the whole capture
    pool_bytes: int  # graph memory, summed over the buckets
    manifest_path: str | None
    dynamic_batch: bool = False  # one compile for every bucket (DraftGraphs' dynamic_batch)

    def text(self) -> str:
        n = len(self.buckets)
        failed = "" if self.captured == n else f", {n - self.captured} failed (eager fallback)"
        one = ", one compile for all" if self.dynamic_batch else ""
        where = f"; manifest {self.manifest_path}" if self.manifest_path else ""
        return (f"captured {self.captured}/{n} buckets ({self.buckets[0]}..{self.buckets[-1]}) with {self.backend}"
                f"{one} in {self.seconds:.1f} s, {self.pool_bytes / 2**20:.0f} MiB graph memory{failed}{where}")


class CaptureObserver:
    """Hooks a `DraftGraphs` calls; every one does nothing here, so an observer overrides only what it needs. An
    observer that does not override `on_flush` costs no manifest at a flush."""

    def on_bucket_start(self, size: int, index: int, total: int) -> None:
        """Bucket `size` is about to be recorded, the `index`-th (from 1) of `total`, largest first."""

    def on_bucket_captured(self, record: mf.BucketRecord, index: int, total: int) -> None:
        """Bucket `record.batch_size` is done: `record.status` is "captured" or "failed" (with the reason)."""

    def on_capture_done(self, summary: CaptureSummary) -> None:
        """Every bucket is done (after the capture's own flush)."""

    def on_flush(self, manifest: mf.Manifest) -> None:
        """The manifest as it stands (a snapshot: the counters keep moving). An OSError raised here reaches the
        caller of `flush()`/`capture()`; from the periodic flush in run/replay it is logged once and retried."""


def wants_flush(observer: CaptureObserver) -> bool:
    """Whether `observer` does anything with a flushed manifest (building one reads the environment once and copies
    every bucket record: not done for observers that ignore it)."""
    return getattr(type(observer), "on_flush", None) is not CaptureObserver.on_flush


class ManifestWriter(CaptureObserver):
    """Writes the manifest to `path` at every flush (atomically: graphcap.manifest.write_manifest)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path

    def on_flush(self, manifest: mf.Manifest) -> None:
        mf.write_manifest(manifest, self.path)


class StderrProgress(CaptureObserver):
    """One self-overwriting progress line while buckets are recorded, then the summary line. For programs that own
    their terminal (the CLI, benches): `CaptureOptions(progress=True)`."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream  # None: sys.stderr at the time of writing (pytest and others swap it)

    def _write(self, text: str) -> None:
        out = self.stream or sys.stderr
        out.write(text)
        out.flush()

    def on_bucket_start(self, size: int, index: int, total: int) -> None:
        self._write(f"\r\033[Kgraphcap: capturing bucket {size:>4} ({index}/{total})")

    def on_capture_done(self, summary: CaptureSummary) -> None:
        self._write(f"\r\033[Kgraphcap: {summary.text()}\n")


class LoggingProgress(CaptureObserver):
    """Each bucket at DEBUG (a failed one at WARNING is DraftGraphs' own), the summary at `level`, through `logger`."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger, self.level = logger or logging.getLogger("graphcap"), level

    def on_bucket_captured(self, record: mf.BucketRecord, index: int, total: int) -> None:
        self.logger.debug("graphcap: bucket %d %s in %.1f s (%d/%d)", record.batch_size, record.status,
                          record.capture_s, index, total)

    def on_capture_done(self, summary: CaptureSummary) -> None:
        self.logger.log(self.level, "graphcap: %s", summary.text())
