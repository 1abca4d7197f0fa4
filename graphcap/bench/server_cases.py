"""The server record's rows (docs/results/server-*.json, issue 52's schema): one row per engine x workload x
concurrency from what bench/sglang_server.py wrote (its `servers` and `comparisons`). Pure functions over that JSON;
bench/server_record.py merges the rows of several harness runs into one record."""
from __future__ import annotations

import re
from typing import Any

# sglang.bench_serving's summary keys (graphcap.bench.load.summarize_bench) under the record's names
BENCH_KEYS = {"output_tok_s": "output_throughput", "tpot_ms_p50": "median_tpot_ms", "tpot_ms_p99": "p99_tpot_ms",
              "itl_ms_p50": "median_itl_ms", "itl_ms_p99": "p99_itl_ms", "ttft_ms_p50": "median_ttft_ms",
              "ttft_ms_p99": "p99_ttft_ms", "accept_len": "accept_length", "requests": "completed",
              "radix_hits": "cached_tokens", "failed": "failed_requests",
              # the harness's, from the server's prefill trace: the run's time in prefill batches (server_report)
              "prefill_share": "prefill_share"}
COLUMNS = ("run", "engine", "pair", "workload", "concurrency", "radix_cache", "output_tok_s", "tpot_ms_p50",
           "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "accept_len", "requests",
           "tokens_equal", "near_ties", "radix_hits", "aborts", "crashes", "leaked_rows", "max_gap_ms")


def _num(v: Any, digits: int = 2) -> Any:
    if isinstance(v, float) and v.is_integer() or isinstance(v, int) and not isinstance(v, bool):
        return int(v)  # counts (bench_serving writes some as floats)
    return round(v, digits) if isinstance(v, float) else v


def _equal(comparisons: dict, label: str, keys: list[str]) -> tuple[str | None, int | None]:
    """graphcap's replies against stock sglang's for these phase keys: "equal/compared" and the near-ties among the
    differences (None where the pair was not compared: stock and no-speculation rows, or stock did not run)."""
    if label.split("-")[0] != "graphcap":
        return None, None
    pair = next((v for k, v in comparisons.items() if k.startswith(f"{label} vs ")
                 and k.split(" vs ")[1].split("-")[0] == "sglang"), None)  # its stock: server_report.compared_pairs
    got = [pair[k] for k in keys if pair and k in pair]
    if not got:
        return None, None
    differ = [d for c in got for d in c.get("differ", [])]
    return (f"{sum(c['equal'] for c in got)}/{sum(c['compared'] for c in got)}",
            sum(bool(d.get("near_tie")) for d in differ))


_STALE_ROW = re.compile(r"\brow \d+: \d+ positions")  # runtime.check_lengths: a ring row unlike sglang's rows


def stale_rows(check_failures: list[str]) -> int:
    """The leaked or stale rows check mode found: ring rows that differ from a rebuild from sglang's req_to_token and
    SWA mapping as sglang holds them (`graphcap.sglang.runtime.check_lengths`), over every draft call it checked. Rows
    are known only where check mode ran; elsewhere the column stays empty."""
    return sum(len(_STALE_ROW.findall(ln)) for ln in check_failures)


def _latency_row(lat: dict) -> dict:
    return {"itl_ms_p50": lat["itl_ms"]["p50"], "itl_ms_p99": lat["itl_ms"]["p99"],
            "ttft_ms_p50": lat["ttft_ms"]["p50"], "ttft_ms_p99": lat["ttft_ms"]["p99"]}


def case_rows(harness: dict, *, run: str, pair: str, radix_cache: bool = True) -> list[dict]:
    """Rows for every phase each server of one harness output ran (servers that never started give none)."""
    rows: list[dict] = []
    cmp = harness.get("comparisons") or {}
    for label, s in harness["servers"].items():
        if "command" not in s:  # not started (the call's time)
            continue
        engine = label.split("-")[0]
        base = {"run": run, "engine": engine, "pair": pair, "radix_cache": radix_cache,
                "crashes": int(bool(s.get("died"))), "leaked_rows": None,
                # the server's whole life, from its log: sglang's retractions and its idle pool check's warnings
                "retracted_requests": (s.get("retractions") or {}).get("requests"),
                "pool_check_warnings": s.get("pool_check_warnings")}
        if label != engine:
            base["server"] = label
        # the random requests' INPUT:OUTPUT:RATIO (bench_serving's lengths), where the harness wrote them
        lengths = {"lengths": harness["lengths"]} if harness.get("lengths") else {}
        if s.get("check_mode"):  # GRAPHCAP_SGLANG_CHECK: a failed check raises in the scheduler and logs its name
            failures = [ln for ln in s.get("log_errors") or [] if "GRAPHCAP_SGLANG_CHECK" in ln]
            base |= {"checked_drafts": s.get("draft_calls"), "check_failures": len(failures) + int(bool(s.get("died"))),
                     "leaked_rows": stale_rows(failures)}
        for c, b in sorted((s.get("bench") or {}).items(), key=lambda kv: int(kv[0])):
            eq, ties = _equal(cmp, label, [f"bench-c{c}"])
            rows.append({**base, "workload": "random", **lengths, "concurrency": int(c),
                         **{k: _num(b.get(v)) for k, v in BENCH_KEYS.items()}, "tokens_equal": eq, "near_ties": ties})
        for r, b in sorted((s.get("rate") or {}).items(), key=lambda kv: float(kv[0])):
            if not isinstance(b, dict) or "completed" not in b:
                continue
            eq, ties = _equal(cmp, label, [f"rate-r{r}"])
            rows.append({**base, "workload": "random", **lengths, "concurrency": None, "request_rate": float(r),
                         **{k: _num(b.get(v)) for k, v in BENCH_KEYS.items()}, "tokens_equal": eq, "near_ties": ties})
        if isinstance(s.get("gsp"), dict) and "completed" in s["gsp"]:
            eq, ties = _equal(cmp, label, ["gsp"])
            rows.append({**base, "workload": "shared-prefix", "concurrency": 8,
                         **{k: _num(s["gsp"].get(v)) for k, v in BENCH_KEYS.items()}, "tokens_equal": eq,
                         "near_ties": ties})
        for variant, rounds in (s.get("multiturn") or {}).items():
            if not isinstance(rounds, list):
                continue
            eq, ties = _equal(cmp, label, [f"multiturn-{variant}"])
            rows.append({**base, "workload": "multiturn", "variant": "flush_cache between rounds"
                         if variant == "flushed" else "cache kept", "concurrency": 8,
                         "requests": sum(r.get("ttft_ms", {}).get("n", 0) if isinstance(r.get("ttft_ms"), dict)
                                         else 0 for r in rounds) or None,
                         "radix_hits": sum(r.get("cached_tokens") or 0 for r in rounds),
                         "radix_hits_by_round": [r.get("cached_tokens") for r in rounds],
                         "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in rounds),
                         "ttft_ms_p99": max((r["ttft_ms"]["p99"] for r in rounds if isinstance(r.get("ttft_ms"), dict)
                                             and r["ttft_ms"]["p99"] is not None), default=None),
                         "tokens_equal": eq, "near_ties": ties})
        if isinstance(s.get("faults"), dict) and "error" not in s["faults"]:
            f = {k: v for k, v in s["faults"].items() if isinstance(v, dict) and "requests" in v}
            eq, ties = _equal(cmp, label, [f"faults-{k}" for k in f])
            rows.append({**base, "workload": "faults", "concurrency": None,
                         "requests": sum(v["requests"] for v in f.values()),
                         "aborts": sum(v.get("aborted", 0) for v in f.values()),
                         "failed": sum(v.get("errors", 0) for v in f.values()),
                         "answered_after_each": all(v.get("alive_after", True) for v in f.values()),
                         "tokens_equal": eq, "near_ties": ties})
        sk = s.get("soak")
        if isinstance(sk, dict) and "latency" in sk:
            lat, gaps, mem = sk["latency"], sk.get("gaps") or {}, sk.get("memory") or {}
            rows.append({**base, "workload": "soak", "concurrency": sk.get("concurrency", 32),
                         "seconds": _num(s.get("soak_s") or sk.get("seconds"), 1),
                         **(_latency_row(lat["random"]) if "random" in lat else {}),
                         "requests": sk["requests"], "aborts": sum(v.get("aborted", 0) for v in lat.values()),
                         "failed": sum(v.get("errors", 0) for v in lat.values()),
                         "max_gap_ms": gaps.get("max_ms"), "median_gap_ms": gaps.get("median_ms"),
                         "gaps_over_100ms_joined": gaps.get("over_limit_joined"),
                         "gaps_over_100ms_no_join": gaps.get("over_limit_no_join"),
                         "gaps_over_100ms": len(gaps["over_limit"]) if isinstance(gaps.get("over_limit"), list)
                         else gaps.get("over_limit"),
                         "max_gap_ms_no_join": gaps.get("max_ms_no_join"),
                         "gaps_over_100ms_prefill": gaps.get("over_limit_prefill"),
                         "gaps_over_100ms_no_prefill": gaps.get("over_limit_no_prefill"),
                         "max_gap_ms_no_prefill": gaps.get("max_ms_no_prefill"),
                         "p99_gap_ms_no_prefill": gaps.get("p99_ms_no_prefill"),
                         "prefill_batches": gaps.get("prefill_batches"),
                         **_prefill_columns(gaps.get("prefill_time") or {}),
                         **_host_columns(sk.get("host")),
                         "memory_growth_after_warmup_mib": mem.get("growth_after_warmup_mib"),
                         "compiles_after_warmup": len((sk.get("compiles") or {}).get("after_warmup") or [])})
    # the schema's columns first, in its order; a value nothing measured is left out
    return [{k: r[k] for k in COLUMNS if r.get(k) is not None} | {k: v for k, v in r.items()
                                                                  if k not in COLUMNS and v is not None} for r in rows]


def _prefill_columns(t: dict) -> dict:
    """A soak row's prefill pauses (server_report.prefill_time): p50 of tokens, host, GPU span and kernel ms, and
    the GPU's idle share of the profiled spans."""
    return {f"prefill_{k}_p50": (t.get(k) or {}).get("p50") for k in ("tokens", "host_ms", "gpu_ms", "kernel_ms")} | {
        "prefill_gpu_idle_share": t.get("gpu_idle_share")}


def _host_columns(h: dict | None) -> dict:
    """A soak row's host samples (graphcap.sglang.host_samples.summary, after warm-up): sampled ms per phase (the
    per-function tables stay in the harness's output: its own-line table leans toward GIL-releasing calls)."""
    return {"host_ms_by_phase": {p: d["ms"] for p, d in h["phases"].items()}} if h else {}


# the manifest's serving counters that count what the compile log (a server's "compiles") counts too
_SAME_AS_COMPILES = {"variants_preloaded": "preloaded", "variants_at_startup": "at_startup",
                     "variants_while_serving": "while_serving", "late_compiles": "while_serving"}


def drop_repeated_counts(facts: dict) -> dict:
    """`facts` without the manifest counters that repeat the compile log's number; one that differs stays, so a
    disagreement between the two is still read in the record."""
    compiles, manifest = facts.get("compiles"), facts.get("manifest")
    if not isinstance(compiles, dict) or not isinstance(manifest, dict):
        return facts
    kept = {k: v for k, v in manifest.items()
            if k not in _SAME_AS_COMPILES or compiles.get(_SAME_AS_COMPILES[k]) != v}
    return {**facts, "manifest": kept}


def server_facts(s: dict) -> dict:
    """What a started server's record says beside its rows: start-up, weights loaded, Triton compiles (graphcap's
    variants log: preloaded, at start-up, while serving), graphcap's manifest (buckets captured, replays, eager
    fallbacks, the serving counters, the late compiles counted; those equal to the compile log's left out)."""
    out = {"startup_s": _num(s["startup_s"])} if s.get("startup_s") is not None else {}
    if isinstance(s.get("weights_loaded"), dict):
        out["weights_loaded_s"] = s["weights_loaded"].get("seconds")
    if isinstance(s.get("compiles"), dict):
        out["compiles"] = {k: v if not isinstance(v, list) else len(v) for k, v in s["compiles"].items()}
    m = s.get("manifest")
    if isinstance(m, dict):
        serving = dict(m.get("serving") or {})
        late = serving.pop("late_compiles", None) or []
        out["manifest"] = {"buckets": len(m.get("buckets") or []), "captured": m.get("captured"),
                           "replays": m.get("replays"), "fallbacks": m.get("fallbacks"),
                           "oversize_fallbacks": m.get("oversize_fallbacks"), **serving, "late_compiles": len(late)}
    return drop_repeated_counts(out)
