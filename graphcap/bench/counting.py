"""What one call does besides its arithmetic, counted rather than assumed: host syncs and launched kernels.

- Syncs, with CUDA: CUDA's sync debug mode warns at every operation that synchronizes the host with the device
  (`.item()`, `nonzero`, a blocking copy), and each warning is counted. Without CUDA there is no device to wait for;
  what would be a sync - the host reading a tensor's value (`aten::_local_scalar_dense`, behind `.item()` and
  `int(t)`) - is counted with torch.profiler instead, which also sees through compiled code.
- Only torch's per-sync warning counts: the first switch to debug mode in a process also warns that the mode "does
  not yet detect all synchronizing operations", once, and counted by substring that notice read as one sync of
  whichever call was counted first.
- The collector is off while the call runs: a cycle collected mid-call can free CUDA memory of earlier captures (a
  graph pool, a side stream's blocks), and the allocator may synchronise for that - a sync of the collector's
  timing, not of the call's.
- Kernels, with CUDA: torch.profiler's device activity (CUPTI), kernels of CUDA-graph replays included; copies and
  memsets are not kernels. Without CUDA: None and the reason.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphcap.bench.timing import collector_off

HOST_READ_OP = "aten::_local_scalar_dense"
SYNC_WARNING = "called a synchronizing CUDA operation"  # c10's warn_or_error_on_sync, once per synchronizing op
NO_KERNELS_ON_CPU = "kernels are counted from the GPU's activity (torch.profiler, CUDA); a CPU run launches none"


@dataclass(frozen=True)
class Count:
    value: int | None
    how: str  # how it was counted, or why it is None


def count_syncs(fn: Callable[[], object], cuda: bool) -> Count:
    with collector_off():
        return _count_syncs(fn, cuda)


def _count_syncs(fn: Callable[[], object], cuda: bool) -> Count:
    if cuda:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return Count(sum(is_sync_warning(str(w.message)) for w in caught), "CUDA sync debug mode")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    reads = sum(1 for e in prof.events() if e.name == HOST_READ_OP)
    return Count(reads, "host reads of tensor values (.item(); a sync on CUDA), torch.profiler")


def is_sync_warning(message: str) -> bool:
    return SYNC_WARNING in message


def count_kernels(fn: Callable[[], object], cuda: bool) -> Count:
    if not cuda:
        return Count(None, NO_KERNELS_ON_CPU)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.lower().startswith(("memcpy", "memset"))]
    return Count(len(kernels), "CUDA kernels in torch.profiler's device activity (graph replays included)")
