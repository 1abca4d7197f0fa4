"""A draft-phase trace for sglang's FROZEN_KV_MTP worker, with or without graphcap: `GRAPHCAP_SGLANG_TRACE=DIR`.

What a user comparing `--enable-draft-graph-capture` against stock sglang needs from inside the scheduler: per draft
call, the requests (rid), their lengths, the draft tokens proposed and the draft phase's GPU time (CUDA events
around the worker's `draft`, on the current stream: it includes any stall the draft causes, such as a host sync
that leaves the GPU idle while the host catches up). Installed by the plugin's `register()` in scheduler processes
when the variable is set, after graphcap's own hooks, so it wraps whichever draft runs.

Cost: a clone of the draft tokens and two events per call; one sync every FLUSH_EVERY calls, when the records are
read back and appended to DIR/draft-trace-<pid>.jsonl. Meant for measurement runs, not for serving.
"""
from __future__ import annotations

import atexit
import json
import os
import time

import torch

from graphcap.integrations.sglang_config import TRACE_ENV  # noqa: F401 - where the variable is named
# Records read back per sync: few enough that a killed scheduler (sglang's engine shutdown kills its children, so
# no exit handler runs) loses little; `GRAPHCAP_SGLANG_TRACE_FLUSH=1` loses nothing, at one sync per draft.
FLUSH_ENV = "GRAPHCAP_SGLANG_TRACE_FLUSH"
FLUSH_EVERY = 16


class DraftTrace:
    def __init__(self, directory: str, flush_every: int = FLUSH_EVERY) -> None:
        self.flush_every = flush_every
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"draft-trace-{os.getpid()}.jsonl")
        self.pending: list[tuple] = []

    def around_draft(self, original, worker, batch, *args, **kwargs):
        if batch.forward_mode.is_idle():
            return original(worker, batch, *args, **kwargs)
        rids = [r.rid for r in batch.reqs]
        lens = batch.seq_lens_cpu.tolist() if getattr(batch, "seq_lens_cpu", None) is not None else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        result = original(worker, batch, *args, **kwargs)
        end.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        tokens = result.draft_token.detach().reshape(len(rids), -1).clone()  # [B, steps + 1]: bonus token first
        self.pending.append((rids, lens, tokens, start, end, host_ms))
        if len(self.pending) >= self.flush_every:
            self.flush()
        return result

    def flush(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        pending[-1][4].synchronize()
        with open(self.path, "a") as f:
            for rids, lens, tokens, start, end, host_ms in pending:
                f.write(json.dumps({"rids": rids, "seq_lens": lens, "draft": tokens[:, 1:].tolist(),
                                    "gpu_ms": start.elapsed_time(end), "host_ms": host_ms}) + "\n")


def install(directory: str, target: str) -> DraftTrace:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    raw = os.environ.get(FLUSH_ENV, str(FLUSH_EVERY))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"${FLUSH_ENV}: expected a whole number of draft calls >= 1, got {raw!r}")
    trace = DraftTrace(directory, int(raw))
    atexit.register(trace.flush)  # the records since the last FLUSH_EVERY reach the file at the scheduler's exit
    HookRegistry.register(target, trace.around_draft, HookType.AROUND)
    return trace
