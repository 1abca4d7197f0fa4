"""What the server harness makes of its runs: outputs compared between servers (same requests, greedy), latency
percentiles, the gaps between draft calls in a server's draft trace and the Triton compiles inside them, and the GPU
memory over a soak. Pure functions over the clients' records and the files the servers wrote; no torch, no sglang.
"""
from __future__ import annotations

import bisect
import glob
import json
import math
import os
import re
import statistics
from collections.abc import Sequence
from pathlib import Path


def compare_texts(ours: Sequence[str | None], theirs: Sequence[str | None], skip: Sequence[bool] = ()) -> dict:
    """Request by request (the same requests in the same order): how many texts are equal, and where each other one
    first differs (its index among whitespace-separated words, as the word-level checkpoints tokenize). `skip[i]`:
    leave request i out (an aborted reply, an error on either side)."""
    if len(ours) != len(theirs):
        raise ValueError(f"compare_texts: {len(ours)} replies against {len(theirs)}")
    equal, diffs = 0, []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if (skip and skip[i]) or a is None or b is None:
            continue
        if a == b:
            equal += 1
            continue
        wa, wb = a.split(), b.split()
        at = next((j for j, (x, y) in enumerate(zip(wa, wb)) if x != y), min(len(wa), len(wb)))
        diffs.append({"request": i, "first_word": at, "ours": " ".join(wa[at:at + 4]),
                      "theirs": " ".join(wb[at:at + 4]), "lengths": [len(wa), len(wb)]})
    return {"compared": equal + len(diffs), "equal": equal, "differ": diffs}


def replies_compared(ours: Sequence[dict], theirs: Sequence[dict]) -> dict:
    """`compare_texts` over two servers' replies to the same requests, aborted or failed ones left out."""
    skip = [bool(a.get("aborted") or b.get("aborted") or a.get("error") or b.get("error"))
            for a, b in zip(ours, theirs)]
    return compare_texts([r.get("text") for r in ours], [r.get("text") for r in theirs], skip)


def continuation(reply: dict, words: int) -> str | None:
    """The text that ends where two replies to `reply`'s request part: its prompt and its first `words` words (the
    word-level checkpoints tokenize by whitespace, so this is the same tokens); None where the prompt is unknown."""
    prompt = reply.get("prompt")
    if prompt is None:
        return None
    head = " ".join((reply.get("text") or "").split()[:words])
    return prompt + (" " + head if head else "")


def self_differences(across: dict | None, key: str) -> set[tuple[int, int]] | None:
    """Where stock sglang gave itself other text for the same requests under other batching: (request, first word)
    of `across` ("bench-c1 vs bench-cN": compare_texts results) that involve run `key`; None where stock ran `key`'s
    requests once (nothing to tell a near-tie by)."""
    if not across:
        return None
    hits, seen = set(), False
    for pair, cmp in across.items():
        if key in pair.split(" vs "):
            seen = True
            hits |= {(d["request"], d["first_word"]) for d in cmp.get("differ", [])}
    return hits if seen else None


def annotate_differences(cmp: dict, margins: dict, stock_self: set[tuple[int, int]] | None) -> dict:
    """Each difference of `cmp` (compare_texts) with the target's logit margin where the replies part (`margins`:
    (request, word) -> top_logprobs' answer) and whether stock sglang also differs from itself there: a difference is a
    near-tie only where it does (`stock_also_differs` None: stock ran these requests once)."""
    for d in cmp.get("differ", []):
        m = margins.get((d["request"], d["first_word"]))
        if m is not None:
            d["margin"], d["top"] = m.get("margin"), m.get("top", m.get("error"))
        d["stock_also_differs"] = None if stock_self is None else (d["request"], d["first_word"]) in stock_self
        d["near_tie"] = bool(d["stock_also_differs"])
    return cmp


def texts_of(phases: dict) -> dict[str, list]:
    """Every phase's replies, keyed for comparison across servers: `bench-c8`, `rate-r2`, `gsp`, `multiturn-kept`,
    ..."""
    out: dict[str, list] = {}
    for c, r in (phases.get("bench") or {}).items():
        if isinstance(r, dict) and r.get("texts"):
            out[f"bench-c{c}"] = [{"text": t} for t in r["texts"]]
    for rate, r in (phases.get("rate") or {}).items():
        if isinstance(r, dict) and r.get("texts"):
            out[f"rate-r{rate}"] = [{"text": t} for t in r["texts"]]
    if (phases.get("gsp") or {}).get("texts"):
        out["gsp"] = [{"text": t} for t in phases["gsp"]["texts"]]
    for key, v in (phases.get("multiturn") or {}).items():
        if isinstance(v, dict) and "rounds" in v:
            out[f"multiturn-{key}"] = [r for rnd in v["rounds"] for r in rnd]
    for key, v in (phases.get("faults") or {}).items():
        if isinstance(v, dict) and "replies" in v:
            out[f"faults-{key}"] = v["replies"]
    return out


def compared_pairs(labels: list[str]) -> list[tuple[str, str]]:
    """The servers compared: graphcap against stock sglang, stock against the target alone (each with its own kind
    of pool: plain with plain, small with small)."""
    return [(a, b) for a in labels for b in labels
            if ("small" in a) == ("small" in b) and (a.split("-")[0], b.split("-")[0]) in (("graphcap", "sglang"),
                                                                                       ("sglang", "nospec"))]


def comparisons(texts: dict[str, dict[str, list]], margins: dict | None = None) -> dict:
    """graphcap against stock sglang, stock against the target alone (`compared_pairs`), and stock against itself
    across concurrencies and request rates (the same requests, other batching); each difference with its logit
    margin where one was asked (`margins`: bench/sglang_server.py asks them while the later server is up) and whether
    stock also differs from itself there (a near-tie only then)."""
    out: dict = {}
    for a in texts:
        runs = sorted(k for k in texts[a] if k.startswith(("bench-c", "rate-r")))  # the same requests in each
        if a.split("-")[0] == "sglang" and len(runs) > 1:
            first = texts[a][runs[0]]
            out[f"{a} across concurrencies"] = {f"{runs[0]} vs {k}": replies_compared(first, texts[a][k])
                                                for k in runs[1:]}
    for a, b in compared_pairs(list(texts)):
        stock = a if a.split("-")[0] == "sglang" else b
        pair = f"{a} vs {b}"
        out[pair] = {k: annotate_differences(
                        replies_compared(texts[a][k], texts[b][k]), (margins or {}).get(pair, {}).get(k, {}),
                        self_differences(out.get(f"{stock} across concurrencies"), k))
                     for k in texts[a] if k in texts[b] and len(texts[a][k]) == len(texts[b][k])}
    return out


def percentiles(xs: Sequence[float], scale: float = 1e3) -> dict:
    """p50 / p99 / max of `xs` (seconds) in ms; None values left out."""
    v = sorted(x * scale for x in xs if x is not None)
    if not v:
        return {"n": 0, "p50": None, "p99": None, "max": None}

    def pct(q: float) -> float:
        return round(v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))], 3)
    return {"n": len(v), "p50": pct(0.50), "p99": pct(0.99), "max": round(v[-1], 3)}


def latency(replies: Sequence[dict]) -> dict:
    """TTFT and inter-token gaps of streamed replies (aborted and failed ones left out), ms."""
    ok = [r for r in replies if not r.get("error") and not r.get("aborted")]
    return {"requests": len(replies), "ok": len(ok), "errors": sum(bool(r.get("error")) for r in replies),
            "aborted": sum(bool(r.get("aborted")) for r in replies),
            "ttft_ms": percentiles([r.get("ttft_s") for r in ok]),
            "itl_ms": percentiles([x for r in ok for x in r.get("itl_s") or []])}


def read_jsonl(pattern: str | Path) -> list[dict]:
    rows = []
    for p in sorted(glob.glob(str(pattern))):
        with open(p) as f:
            rows += [json.loads(ln) for ln in f if ln.strip()]
    return rows


def draft_gaps(trace: Sequence[dict], *, after: float, limit_ms: float, compiles: Sequence[dict] = (),
               prefills: Sequence[dict] | None = None) -> dict:
    """The wall-clock gaps between consecutive draft calls of a server's draft trace (graphcap.sglang.trace: `t`,
    `rids` and `seq_lens` per call, time.perf_counter) from `after` on: their count, median, max, and every gap over
    `limit_ms` with the Triton compiles that started inside it (graphcap.sglang.variants, same clock), the requests
    that joined the batch across it, and the prefill batches the scheduler ran inside it.

    sglang's scheduler runs a prefill batch between two decode iterations (speculative decoding turns mixed
    prefill-decode batches off): a gap that holds one is the scheduler's pause, stock sglang's too; one that holds
    none is the decode loop's own stall. With the trace's prefill records (`prefills`: `t`, `extend_tokens`,
    `cached_tokens` per batch, every chunk and one-token request included) that is read directly: `over_limit_prefill`
    / `over_limit_no_prefill`, with the max and p99 of the gaps that held no prefill. Without them (None) it is
    inferred from joins: a request joins after its prefill, so a gap a request joined across held one; a gap no
    request joined across may still hold a prefill that ended no decode (a one-token request's, a non-final chunk).
    `joined_tokens`: the joined requests' lengths at the next call. A server with no request in flight makes no draft
    call: an idle gap is a gap too, so `after`..end should hold steady load."""
    calls = sorted((r for r in trace if "t" in r and r["t"] >= after and not r.get("profiled")), key=lambda r: r["t"])
    pre = sorted((p for p in prefills or () if p.get("t", -math.inf) >= after), key=lambda p: p["t"])
    starts = [p["t"] for p in pre]
    long, quiet, unfed = [], [], []
    for a, b in zip(calls, calls[1:]):
        g = (b["t"] - a["t"]) * 1e3
        before = set(a.get("rids") or ())
        joined = [i for i, rid in enumerate(b.get("rids") or ()) if rid not in before]
        inside = pre[bisect.bisect_left(starts, a["t"]):bisect.bisect_right(starts, b["t"])]
        if not joined:
            quiet.append(g)
        if not inside:
            unfed.append(g)
        if g > limit_ms:
            lens = b.get("seq_lens") or []
            row = {"at_s": round(a["t"] - after, 3), "ms": round(g, 1), "joined": len(joined),
                   "joined_tokens": sum(lens[i] for i in joined if i < len(lens)),
                   "compiles": [{"kernel": c["kernel"], "ms": round(c["ms"], 1)} for c in compiles
                                if a["t"] <= c["t"] <= b["t"]]}
            if prefills is not None:
                row.update(prefills=len(inside), prefill_tokens=sum(p.get("extend_tokens") or 0 for p in inside),
                           cached_tokens=sum(p.get("cached_tokens") or 0 for p in inside))
            long.append(row)
    ms = [(b["t"] - a["t"]) * 1e3 for a, b in zip(calls, calls[1:])]
    stalls = [x for x in long if not x["joined"]]
    out = {"calls": len(calls), "median_ms": round(statistics.median(ms), 3) if ms else None,
           "max_ms": round(max(ms), 1) if ms else None, "limit_ms": limit_ms,
           "over_limit_joined": len(long) - len(stalls),
           "over_limit_no_join": len(stalls), "max_ms_no_join": round(max(quiet), 1) if quiet else None,
           "p99_ms_no_join": percentiles(quiet, scale=1)["p99"]}
    if prefills is not None:
        bare = [x for x in long if not x["prefills"]]
        out.update(prefill_batches=len(pre), over_limit_prefill=len(long) - len(bare),
                   over_limit_no_prefill=len(bare), max_ms_no_prefill=round(max(unfed), 1) if unfed else None,
                   p99_ms_no_prefill=percentiles(unfed, scale=1)["p99"], prefill_time=prefill_time(pre))
    return {**out, "over_limit": long}


def prefill_time(prefills: Sequence[dict]) -> dict:
    """What the trace's prefill records say of a prefill batch's pause (graphcap.sglang.trace: `host_ms`, the
    worker's iteration on the host; `gpu_ms`, its span on the GPU; on profiled ones `kernel_ms`, its kernels' summed
    time): p50 / p99 of each and of the new tokens per batch, and the GPU's idle share of the profiled spans
    (1 - kernel_ms / gpu_ms, their median) - near 0: the GPU's own work sets the pause; large: the GPU waits on the
    host's launches."""
    def pcts(key: str) -> dict:
        p = percentiles([r.get(key) for r in prefills], scale=1)
        return {"p50": p["p50"], "p99": p["p99"]}

    idle = [1 - r["kernel_ms"] / r["gpu_ms"] for r in prefills
            if r.get("kernel_ms") is not None and r.get("gpu_ms")]
    return {"batches": len(prefills), "tokens": pcts("extend_tokens"), "host_ms": pcts("host_ms"),
            "gpu_ms": pcts("gpu_ms"), "profiled": len(idle),
            "kernel_ms": pcts("kernel_ms"), "gpu_idle_share": round(statistics.median(idle), 3) if idle else None}


def prefill_share(prefills: Sequence[dict], window: Sequence[float], duration_s: float | None) -> dict:
    """The prefill batches one client run met (trace records stamped inside `window`, the run's start and end on
    the trace's clock) and their GPU time's share of the run's `duration_s` (sglang.bench_serving's, first request
    to last reply). Every running request waits out each batch, so a request's TPOT is its decode time per token
    over (1 - share); a server that finishes requests sooner meets prefills more often, at a larger share."""
    inside = [r for r in prefills if window[0] <= r.get("t", -1.0) <= window[1] and r.get("gpu_ms") is not None]
    gpu_s = sum(r["gpu_ms"] for r in inside) / 1e3
    return {"prefill_batches": len(inside), "prefill_gpu_s": round(gpu_s, 3),
            "prefill_share": round(gpu_s / duration_s, 3) if duration_s else None}


def matched_prefills(ours: Sequence[dict], theirs: Sequence[dict]) -> dict:
    """Two servers' prefill batches (trace records) matched by their new tokens, cached tokens and requests, each
    with the first unmatched one of the other's in time order: the same load's prefills on both, so the medians of
    our GPU span and host time minus theirs say what one server adds to a prefill pause over the other."""
    def key(r: dict) -> tuple:
        return r.get("extend_tokens"), r.get("cached_tokens"), len(r.get("rids") or ())

    pending: dict[tuple, list[dict]] = {}
    for r in reversed(theirs):  # popped from the end: the earliest first
        pending.setdefault(key(r), []).append(r)
    pairs = [(r, pending[key(r)].pop()) for r in ours if pending.get(key(r))]

    def median_diff(field: str) -> float | None:
        d = [a[field] - b[field] for a, b in pairs if a.get(field) is not None and b.get(field) is not None]
        return round(statistics.median(d), 3) if d else None
    return {"matched": len(pairs), "ours": len(ours), "theirs": len(theirs),
            "gpu_ms_diff_p50": median_diff("gpu_ms"), "host_ms_diff_p50": median_diff("host_ms")}


def prefill_comparisons(prefills: dict[str, Sequence[dict]]) -> dict:
    """`matched_prefills` for each two servers with prefill records and the same kind of pool, the flag first, then
    stock, then the target alone: "graphcap vs nospec" is what speculation with the flag adds to a prefill pause."""
    order = {"graphcap": 0, "sglang": 1, "nospec": 2}
    labels = sorted((k for k, v in prefills.items() if v), key=lambda k: order.get(k.split("-")[0], 3))
    return {f"{a} vs {b}": matched_prefills(prefills[a], prefills[b])
            for i, a in enumerate(labels) for b in labels[i + 1:] if ("small" in a) == ("small" in b)}


def compiles_summary(compiles: Sequence[dict], *, after: float | None = None) -> dict:
    """Triton compiles in a server's scheduler: how many at start-up and while serving (the log's own split at the
    first draft call), and those from `after` on (the harness's end of warm-up), named."""
    late = [c for c in compiles if not c.get("preload") and after is not None and c["t"] >= after]
    return {"preloaded": sum(bool(c.get("preload")) for c in compiles),
            "at_startup": sum(not c.get("serving") and not c.get("preload") for c in compiles),
            "while_serving": sum(bool(c.get("serving")) and not c.get("preload") for c in compiles),
            "after_warmup": [{"kernel": c["kernel"], "ms": round(c["ms"], 1), "variant": c.get("variant", "")[:120]}
                             for c in late]}


_RETRACT = re.compile(r"(KV cache pool is full\. Retract requests\. |Testing retraction\. )#retracted_reqs: (\d+)")


def retractions(log_text: str) -> dict:
    """sglang's retractions as its scheduler logs them (`retract_decode`'s warning, sglang 0.5.18 and 0.5.23): events
    and requests, those the KV pool forced apart from sglang's test hook (SGLANG_TEST_RETRACT)."""
    out = {"events": 0, "requests": 0, "pool_full_events": 0}
    for m in _RETRACT.finditer(log_text):
        out["events"] += 1
        out["requests"] += int(m.group(2))
        out["pool_full_events"] += m.group(1).startswith("KV cache pool is full")
    return out


# sglang's own pool accounting when its scheduler goes idle (invariant_checker, 0.5.18 and 0.5.23): each warning it
# logs (the first of every 1000 alike; under SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE it raises instead)
POOL_CHECK_WARNINGS = ("memory leak detected!", "Mem Leak Detected!", "KV double free:", "KV page use-after-free:")


def pool_check_warnings(log_text: str) -> int:
    """Lines of a server's log where sglang's idle pool check found its pools not whole."""
    return sum(any(w in ln for w in POOL_CHECK_WARNINGS) for ln in log_text.splitlines())


def memory_trend(samples: Sequence[tuple[float, int]], *, after: float) -> dict | None:
    """GPU memory in use (MiB) over a run: at the end of warm-up (`after`), the largest after it, and at the end.
    None without samples (no NVML)."""
    if not samples:
        return None
    warm = [m for t, m in samples if t >= after]
    if not warm:
        return None
    return {"samples": len(samples), "at_warmup_end_mib": warm[0], "max_after_warmup_mib": max(warm),
            "at_end_mib": warm[-1], "growth_after_warmup_mib": max(warm) - warm[0]}


def manifest_snapshot(directory: str | Path) -> dict | None:
    """The graphcap server's capture manifest as its JSON (the first one in `directory`), or None."""
    for p in sorted(glob.glob(os.path.join(str(directory), "*.json"))):
        if p.endswith("-variants.json"):
            continue
        try:
            return json.loads(Path(p).read_text())
        except (OSError, ValueError):
            return None
    return None
