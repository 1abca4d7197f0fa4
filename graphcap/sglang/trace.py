"""A draft-phase trace for sglang's FROZEN_KV_MTP worker, with or without graphcap: `GRAPHCAP_SGLANG_TRACE=DIR`.

What a user comparing `--enable-draft-graph-capture` against stock sglang needs from inside the scheduler: per draft
call, the requests (rid), their lengths, the draft tokens proposed and the draft phase's GPU time (CUDA events
around the worker's `draft`, on the current stream: it includes any stall the draft causes, such as a host sync
that leaves the GPU idle while the host catches up); per prefill batch (each extend batch, a chunk included: the
speculative worker's iteration for it, the target's prefill then the draft's seed; without speculation the target
worker's forward, so the same pause can be compared across servers), when the scheduler ran it, its requests and
tokens, its host time and its span on the GPU (CUDA events around it), in DIR/prefill-trace-<pid>.jsonl - so a wait
between two draft calls can be told to hold a prefill or not, and how long the prefill held it (host and GPU spans
come out equal where the iteration ends in a sync, as it does in sglang's engine; the profiled prefills below tell
the GPU's own work from its idle time). Installed by the plugin's `register()` in scheduler processes when the
variable is set, after graphcap's own hooks, so it wraps whichever draft runs.

Cost: a clone of the draft tokens and two events per call; one sync every `GRAPHCAP_SGLANG_TRACE_FLUSH` calls
(default 16), when the records are read back and appended to DIR/draft-trace-<pid>.jsonl. Meant for measurement
runs, not for serving. The variables are parsed by graphcap.sglang.settings (and checked at start-up).

`GRAPHCAP_SGLANG_TRACE_PROFILE=8,64` (batch sizes) also profiles the kernels of PROFILE_CALLS draft calls at each
of those batch sizes, after PROFILE_SKIP warm ones (torch.profiler's CUDA activity, CUDA-graph replays' kernels
included), into DIR/draft-profile-<pid>-b<B>.json: per kernel name, launches and GPU microseconds per draft call.
Those calls' trace records say `"profiled": true` (a profiled call pays a sync; timings should leave them out).
With it, PROFILE_CALLS prefill batches after PROFILE_SKIP are profiled too: their records gain `kernel_ms` (the
kernels' summed GPU time) and `launches`, so `gpu_ms - kernel_ms` is the GPU's idle time inside the prefill.

`GRAPHCAP_SGLANG_TRACE_HOST=MS` also samples the scheduler thread's Python stack every MS milliseconds
(graphcap.sglang.host_samples), each sample under the phase this trace knows it is in (prefill, decode, draft, or
the scheduler's own work between iterations): where the host time of a prefill pause goes.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time

import torch

from graphcap.sglang import variants
from graphcap.sglang.host_samples import HostSampler, sampler_path
from graphcap.sglang.settings import PluginSettings

PROFILE_SKIP, PROFILE_CALLS = 8, 5


def _cuda_profiler():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])


class DraftTrace:
    # `flush_every`: records read back per sync - few enough that a killed scheduler (sglang's engine shutdown kills
    # its children, so no exit handler runs) loses little; 1 loses nothing, at one sync per draft.
    def __init__(self, directory: str, flush_every: int, profile_batches: tuple[int, ...] = (),
                 profiler=_cuda_profiler, sampler: HostSampler | None = None) -> None:
        self.flush_every = flush_every
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, f"draft-trace-{os.getpid()}.jsonl")
        self.prefill_path = os.path.join(directory, f"prefill-trace-{os.getpid()}.jsonl")
        self.pending: list[tuple] = []
        self.pending_prefills: list[tuple] = []  # (record, start event, end event)
        self._prefills_seen = 0
        self._in_iteration = False  # inside a recorded iteration: a nested one is part of it
        self._seen = {b: 0 for b in profile_batches}  # draft calls seen per profiled batch size
        self._kernels: dict[int, dict[str, list[float]]] = {b: {} for b in profile_batches}  # name -> [us, launches]
        self._profiler = profiler
        self.sampler = sampler

    def _profiling(self, b: int) -> bool:
        seen = self._seen.get(b)
        if seen is None:
            return False
        self._seen[b] = seen + 1
        return PROFILE_SKIP <= seen < PROFILE_SKIP + PROFILE_CALLS

    def _add_profile(self, b: int, events) -> None:
        totals = self._kernels[b]
        for ev in events:
            if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.lower().startswith(("memcpy",
                                                                                                  "memset")):
                t = totals.setdefault(ev.name, [0.0, 0])
                t[0] += ev.device_time
                t[1] += 1
        if self._seen[b] == PROFILE_SKIP + PROFILE_CALLS:  # the last profiled call: write the table
            rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
            out = {"batch": b, "draft_calls": PROFILE_CALLS,
                   "gpu_us_per_draft": sum(us for us, _ in totals.values()) / PROFILE_CALLS,
                   "launches_per_draft": sum(n for _, n in totals.values()) / PROFILE_CALLS,
                   "kernels": [{"name": name, "launches_per_draft": n / PROFILE_CALLS,
                                "us_per_draft": us / PROFILE_CALLS}
                               for name, (us, n) in rows]}
            with open(os.path.join(self.directory, f"draft-profile-{os.getpid()}-b{b}.json"), "w") as f:
                json.dump(out, f, indent=1)

    def around_draft(self, original, worker, batch, *args, **kwargs):
        if batch.forward_mode.is_idle():
            return original(worker, batch, *args, **kwargs)
        variants.note_draft()
        rids = [r.rid for r in batch.reqs]
        # the server's decode batches carry no host copy of seq_lens: the requests' own lengths are on the host
        lens = (batch.seq_lens_cpu.tolist() if getattr(batch, "seq_lens_cpu", None) is not None
                else [r.seqlen for r in batch.reqs])
        profiling = self._profiling(len(rids))
        prof = self._profiler() if profiling else None
        if prof is not None:
            prof.__enter__()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        outer = self._enter_phase("draft")
        t0 = time.perf_counter()
        start.record()
        try:
            result = original(worker, batch, *args, **kwargs)
        finally:
            end.record()
            self._leave_phase(outer)
            if prof is not None:
                end.synchronize()  # the draft's kernels done before the profiler stops collecting
                prof.__exit__(None, None, None)
        host_ms = (time.perf_counter() - t0) * 1e3
        if prof is not None:
            self._add_profile(len(rids), prof.events())
        tokens = result.draft_token.detach().reshape(len(rids), -1).clone()  # [B, steps + 1]: bonus token first
        self.pending.append((rids, lens, tokens, start, end, t0, host_ms, profiling))
        if len(self.pending) >= self.flush_every:
            self.flush()
        return result

    def around_iteration(self, original, worker, batch, *args, **kwargs):
        """A prefill batch's record (the worker's iteration on an extend batch; decode iterations pass through): its
        start on the draft records' clock, requests, new and cached tokens, host ms and GPU span. An iteration
        inside another (the target's forward inside the speculative worker's) or with no batch passes through."""
        mode = getattr(batch, "forward_mode", None)
        if self._in_iteration or mode is None:
            return original(worker, batch, *args, **kwargs)
        self._in_iteration = True
        try:
            return self._iteration(original, worker, batch, mode, *args, **kwargs)
        finally:
            self._in_iteration = False

    def _iteration(self, original, worker, batch, mode, *args, **kwargs):
        if mode.is_idle() or not mode.is_extend():
            outer = self._enter_phase("decode")
            try:
                return original(worker, batch, *args, **kwargs)
            finally:
                self._leave_phase(outer)
        outer = self._enter_phase("prefill")
        rec = {"t": time.perf_counter(), "rids": [r.rid for r in batch.reqs],
               "extend_tokens": int(batch.extend_num_tokens or 0), "cached_tokens": int(sum(batch.prefix_lens or ()))}
        self._prefills_seen += 1
        prof = (self._profiler() if self._seen  # any profiled batch size: profiling asked for
                and PROFILE_SKIP < self._prefills_seen <= PROFILE_SKIP + PROFILE_CALLS else None)
        if prof is not None:
            prof.__enter__()
        # no CUDA (a CPU-only torch): no GPU span
        start, end = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      if torch.cuda.is_available() else (None, None))
        if start is not None:
            start.record()
        try:
            return original(worker, batch, *args, **kwargs)
        finally:
            if end is not None:
                end.record()
            rec["host_ms"] = (time.perf_counter() - rec["t"]) * 1e3
            if prof is not None:
                if end is not None:
                    end.synchronize()
                prof.__exit__(None, None, None)
                kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
                           and not ev.name.lower().startswith(("memcpy", "memset"))]
                rec.update(kernel_ms=sum(ev.device_time for ev in kernels) / 1e3, launches=len(kernels),
                           profiled=True)
            self.pending_prefills.append((rec, start, end))
            if len(self.pending_prefills) >= self.flush_every:
                self.flush()
            self._leave_phase(outer)

    def _enter_phase(self, phase: str) -> str | None:
        """Tell the host sampler what the calling thread now does; returns what it did before (for `_leave_phase`)."""
        s = self.sampler
        if s is None:
            return None
        s.thread_id = threading.get_ident()  # the thread that runs the iterations is the one sampled
        outer, s.phase = s.phase, phase
        return outer

    def _leave_phase(self, outer: str | None) -> None:
        if self.sampler is not None and outer is not None:
            self.sampler.phase = outer

    def flush(self) -> None:
        drafts, self.pending = self.pending, []
        prefills, self.pending_prefills = self.pending_prefills, []
        for last in (drafts[-1][4] if drafts else None, prefills[-1][2] if prefills else None):  # read-backs
            if last is not None:
                last.synchronize()
        if prefills:
            with open(self.prefill_path, "a") as f:
                f.writelines(json.dumps({**rec, "gpu_ms": start.elapsed_time(end) if start else None}) + "\n"
                             for rec, start, end in prefills)
        if not drafts:
            return
        with open(self.path, "a") as f:
            for rids, lens, tokens, start, end, t0, host_ms, profiled in drafts:
                # t: the call's start on time.perf_counter's clock (CLOCK_MONOTONIC, one per machine), which the
                # process timing a run reads too: where a run's wall time goes between draft calls
                rec = {"rids": rids, "seq_lens": lens, "draft": tokens[:, 1:].tolist(),
                       "gpu_ms": start.elapsed_time(end), "host_ms": host_ms, "t": t0}
                if profiled:
                    rec["profiled"] = True
                f.write(json.dumps(rec) + "\n")


def install(settings: PluginSettings, target: str, iteration_targets: tuple[str, ...] = ()) -> DraftTrace:
    """The trace of `settings` (its directory, flush count and profiled batch sizes) around `target` (the draft),
    and around each of `iteration_targets` (a worker's iteration: its prefill batches; nested ones pass through)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if settings.trace_dir is None:
        raise ValueError("graphcap.sglang.trace.install: the settings name no trace directory "
                         "($GRAPHCAP_SGLANG_TRACE)")
    sampler = (HostSampler(sampler_path(settings.trace_dir), settings.trace_host_ms / 1e3).start()
               if settings.trace_host_ms else None)
    trace = DraftTrace(settings.trace_dir, settings.trace_flush, settings.trace_profile, sampler=sampler)
    atexit.register(trace.flush)  # the records since the last read-back reach the file at the scheduler's exit
    if sampler is not None:
        atexit.register(sampler.stop)
    HookRegistry.register(target, trace.around_draft, HookType.AROUND)
    for it in iteration_targets:
        HookRegistry.register(it, trace.around_iteration, HookType.AROUND)
    return trace
