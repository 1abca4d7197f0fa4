"""The user-scale record's rows (bench/sglang_user_scale.py): one per (engine, batch, context) from the engines'
results - the wall-time decode rate, the phases of sglang's profile, the rate the profiled iteration gives, and the
draft trace's view of a timed run. Pure Python over the results' JSON: tested on CPU."""
from __future__ import annotations

import statistics

# a wall-time rate this far from the profiled iteration's is not a decode rate: the short and long runs it is the
# difference of did not prefill alike
RATE_TOLERANCE = 0.15


def trace_summary(rows: list[dict], rids: list[str], window: tuple[float, float] | None = None) -> dict | None:
    """The draft calls of one timed run (graphcap's draft trace: the calls whose requests are exactly `rids`): how
    many, their GPU and host ms (median, max, sum), and the three slowest by host time with their lengths - where a
    run's wall time goes that the profiled iterations do not show. Where the records carry their start (`t`, on
    time.perf_counter's clock) also the run's calls in time, its tail included (calls of some of `rids`, as requests
    finish): the gaps between consecutive calls (median, the largest and after which call), and with `window` (the
    run's start and end, on the same clock) the time to the first call (prefill and first verify) and after the
    last."""
    want = set(rids)
    calls = [r for r in rows if set(r["rids"]) == want]
    if not calls:
        return None
    gpu, host = [r["gpu_ms"] for r in calls], [r["host_ms"] for r in calls]
    slow = sorted(calls, key=lambda r: -r["host_ms"])[:3]
    out = {"calls": len(calls), "gpu_ms": {"median": statistics.median(gpu), "max": max(gpu), "sum": sum(gpu)},
           "host_ms": {"median": statistics.median(host), "max": max(host), "sum": sum(host)},
           "slowest_host": [{"host_ms": r["host_ms"], "gpu_ms": r["gpu_ms"], "seq_lens": r.get("seq_lens")}
                            for r in slow]}
    run = sorted((r for r in rows if r["rids"] and set(r["rids"]) <= want and "t" in r), key=lambda r: r["t"])
    if len(run) >= 2:
        gaps = [(b["t"] - a["t"]) * 1e3 for a, b in zip(run, run[1:])]
        i = max(range(len(gaps)), key=gaps.__getitem__)
        out["timeline"] = {"calls": len(run), "gap_ms": {"median": statistics.median(gaps), "max": gaps[i]},
                           "max_gap_after_call": i + 1, "batch_after_max_gap": len(run[i + 1]["rids"])}
        if window is not None:
            out["timeline"]["to_first_call_ms"] = (run[0]["t"] - window[0]) * 1e3
            out["timeline"]["after_last_call_ms"] = (window[1] - run[-1]["t"]) * 1e3
    return out


def trace_fields(case: dict) -> dict:
    """A row's view of the first timed run's draft trace (`--trace`): draft calls, their host and GPU ms summed, and
    the largest gap between two of the run's draft calls where the records carry their start."""
    t = (case.get("draft_trace") or [None])[0]
    if t is None:
        return {}
    out = {"trace_draft_calls": t["calls"], "trace_draft_host_ms_sum": round(t["host_ms"]["sum"], 2),
           "trace_draft_gpu_ms_sum": round(t["gpu_ms"]["sum"], 2)}
    if "timeline" in t:
        out["trace_max_gap_ms"] = round(t["timeline"]["gap_ms"]["max"], 2)
    return out


def below_batch(profile: dict, batch: int) -> dict:
    """`{"below_batch": ...}` where the profiled forward steps ran at a smaller batch than the case's: its requests
    did not all run at once (a KV or sliding-window pool too small to admit them together), so its rate and phases
    are a smaller batch's; else nothing. JSON keys are strings."""
    seen = {int(k): v for k, v in (profile.get("step_batches") or {}).items()}
    if not seen or max(seen) >= batch:
        return {}
    return {"below_batch": f"the profiled steps ran at batch {max(seen)} at most, not {batch}: "
                           f"the requests did not all run at once"}


def _same(mine: list | None, theirs: list | None) -> bool | None:
    """None where either side's tokens are unknown (a case read back from a stopped engine's log, an engine not run)."""
    return None if mine is None or theirs is None else mine == theirs


def summarize(results: dict) -> list[dict]:
    """One row per (engine, batch, context): the record's cases; a graphcap engine's output tokens against stock
    sglang's for the same case, and a speculative engine's against no speculation's - the target's own greedy
    output (greedy, the same dummy weights: equal unless a kernel differs)."""
    rows = []

    def tokens_of(engine: str) -> dict:
        return {(c["batch"], c["context"]): c.get("tokens") for c in results.get(engine, {}).get("cases", [])}
    stock, target = tokens_of("sglang"), tokens_of("nospec")
    for name, r in results.items():
        steps = r["config"]["steps"] if name != "nospec" else 0
        for c in r.get("cases", []):
            if "not_run" in c:
                rows.append({"engine": name, "batch": c["batch"], "context": c["context"], "steps": steps,
                             "weights": r["config"].get("weights", "bf16"), "not_run": c["not_run"]})
                continue
            p = c.get("profile") or {}
            theirs = stock.get((c["batch"], c["context"])) if name.startswith("graphcap") else None
            rows.append({"engine": name, "batch": c["batch"], "context": c["context"], "steps": steps,
                         "weights": r["config"].get("weights", "bf16"),  # records from before w8a8 ran bf16
                         **rate_fields(c["decode_tok_s_per_req"],
                                       profile_rate(steps, c.get("accept_len"), p.get("iteration_ms"))),
                         "accept_len": c.get("accept_len"),
                         "verify_ms": (p.get("verify") or {}).get("gpu_span_ms"),
                         "draft_ms": (p.get("draft") or {}).get("gpu_span_ms"),
                         "extend_ms": (p.get("draft_extend") or {}).get("gpu_span_ms"),
                         "decode_ms": (p.get("decode") or {}).get("gpu_span_ms"),
                         "iteration_ms": p.get("iteration_ms"),
                         **below_batch(p, c["batch"]),
                         "tokens_equal_sglang": _same(c.get("tokens"), theirs),
                         "tokens_equal_nospec": (None if name == "nospec"
                                                 else _same(c.get("tokens"), target.get((c["batch"], c["context"])))),
                         **trace_fields(c)})
    return rows


def profile_rate(steps: int, accept_len: float | None, iteration_ms: float | None) -> float | None:
    """Decode tokens/s per request from sglang's profile: the tokens an iteration gives a request (the accept length
    with speculation, 1 without) over the profiled iteration period; None where either is unknown."""
    tokens = 1.0 if steps == 0 else accept_len
    if not tokens or not iteration_ms or iteration_ms <= 0:
        return None
    return 1e3 * tokens / iteration_ms


def rate_fields(wall: float | None, profiled: float | None) -> dict:
    """A row's rates: the wall-time one (`decode_tok_s_per_req`, the difference of a long and a short run of the same
    prompts; None where the case ran no timed pair: `--rate-from profile`) and, where the case was profiled, the
    profiled iteration's. Where they disagree by more than RATE_TOLERANCE the runs did not prefill alike (with the
    radix cache on, one of them missed it: sglang evicts the prompts' sliding-window KV when its pool is small) and
    the row says so; a wall rate <= 0 is no rate (None)."""
    out = {"decode_tok_s_per_req": round(wall, 2) if wall is not None and wall > 0 else None}
    if profiled is None:
        return out
    out["profile_tok_s_per_req"] = round(profiled, 2)
    if wall is not None and (wall <= 0 or abs(wall / profiled - 1) > RATE_TOLERANCE):
        out["rate_disagrees"] = (f"the wall-time rate ({wall:.2f}) is not within {RATE_TOLERANCE:.0%} of the profiled "
                                 f"iteration's ({profiled:.2f}): its short and long runs did not prefill alike; "
                                 "profile_tok_s_per_req is the decode rate")
    return out
