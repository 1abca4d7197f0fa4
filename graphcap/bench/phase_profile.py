"""sglang's profiler trace read back as GPU time per phase of a speculative iteration: verify, draft, draft extend
(decode without speculation), from the stage annotations of its by-stage decode profile (`Engine.start_profile(...,
profile_by_stage=True)`). Pure Python over the chrome trace's events: tested on CPU with synthetic traces."""
from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict

# a verify's or decode's step annotation names its batch before any padding to a graph's size (sglang's
# profile_utils: forward_batch.batch_size): step[VERIFY bs=8], step[DECODE bs=8 ...]
STEP_BATCH = re.compile(r"^step\[(?:VERIFY|DECODE) bs=(\d+)\b")
# stage annotations sglang's profiler writes (by-stage decode profile) -> phase
PHASES = (("verify", re.compile(r"VERIFY")), ("draft_extend", re.compile(r"^draft_extend|DRAFT_EXTEND")),
          ("draft", re.compile(r"^draft$|DRAFT_LOOP|^draft\b")), ("decode", re.compile(r"DECODE")))


def phase_of(name: str) -> str | None:
    for phase, rx in PHASES:
        if rx.search(name):
            return phase
    return None


def read_trace(events: list[dict], top: int = 15) -> dict:
    """Per phase, from a chrome trace's events: GPU spans (`gpu_user_annotation`: the span's length on the GPU
    timeline, and the kernels inside it), their count, the iteration period (between consecutive spans of the phase
    that starts an iteration: verify, or decode without speculation), the verify's top kernels, and the host side
    of the draft: its `user_annotation` spans' length and the CUDA runtime calls in them that lasted over 1 ms
    (a wait on the GPU); `step_batches`: how many profiled forward steps ran at each batch size (a case whose
    requests did not all run at once shows a smaller one)."""
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                     if e.get("cat") == "kernel" and "ts" in e)
    spans = defaultdict(list)
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and "ts" in e:
            p = phase_of(e.get("name", ""))
            if p is not None:
                spans[p].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    out: dict = {"annotations": sorted({e.get("name", "") for e in events
                                        if e.get("cat") in ("gpu_user_annotation", "user_annotation")})[:40]}
    steps: dict[int, int] = defaultdict(int)
    for e in events:
        m = STEP_BATCH.match(e.get("name", "")) if e.get("cat") == "gpu_user_annotation" else None
        if m:
            steps[int(m.group(1))] += 1
    if steps:
        out["step_batches"] = dict(sorted(steps.items()))
    starts = [k[0] for k in kernels]
    for p, ss in spans.items():
        ss = _outermost(sorted(ss))
        span_ms, kern_ms, per_kernel = [], [], defaultdict(float)
        for a, b, _ in ss:
            i = bisect.bisect_left(starts, a)
            t = 0.0
            while i < len(kernels) and kernels[i][0] < b:
                d = min(kernels[i][1], b) - kernels[i][0]
                t += d
                per_kernel[kernels[i][2]] += d
                i += 1
            span_ms.append((b - a) / 1e3)
            kern_ms.append(t / 1e3)
        rec = {"spans": len(ss), "gpu_span_ms": statistics.median(span_ms), "kernel_ms": statistics.median(kern_ms)}
        if p == "verify":
            n = len(ss)
            rec["top_kernels"] = [{"name": k[:120], "ms_per_span": v / 1e3 / n}
                                  for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]]
        out[p] = rec
    lead = "verify" if "verify" in spans else "decode" if "decode" in spans else None
    if lead:
        ss = _outermost(sorted(spans[lead]))
        gaps = [(b[0] - a[0]) / 1e3 for a, b in zip(ss, ss[1:])]
        if gaps:
            out["iteration_ms"] = statistics.median(gaps)
    host = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
            if e.get("cat") == "user_annotation" and e.get("name") == "draft" and "ts" in e]
    if host:
        waits = defaultdict(float)
        for a, b in host:
            for e in events:
                if e.get("cat") == "cuda_runtime" and a <= e.get("ts", -1) < b and e.get("dur", 0) > 1000:
                    waits[e["name"]] += e["dur"] / 1e3 / len(host)
        out["draft_host"] = {"calls": len(host), "host_ms": statistics.median((b - a) / 1e3 for a, b in host),
                             "runtime_waits_ms_per_call": dict(waits)}
    return out


def _outermost(spans: list[tuple]) -> list[tuple]:
    """Spans not nested inside another (a phase's annotation can nest another of the same phase)."""
    out, end = [], -1.0
    for s in spans:
        if s[0] >= end:
            out.append(s)
            end = s[1]
    return out


def load_trace(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data
