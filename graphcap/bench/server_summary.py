"""A server's record from what bench/sglang_server.py ran on it: its command and departures from sglang's defaults,
start-up, each phase's numbers (the texts are left to the comparisons), and what its scheduler's traces say - Triton
compiles, draft calls, prefill pauses, host samples, the soak's gaps after warm-up - with graphcap's manifest."""
from __future__ import annotations

import glob

from graphcap.bench import load
from graphcap.bench import server_report as rep
from graphcap.bench.server import Server
from graphcap.sglang import host_samples


def _with_prefill_share(run: dict, prefills: list[dict]) -> dict:
    """One client run's summary, with the prefill batches inside its window where the server traced them."""
    if not prefills or not run.get("window"):
        return run["summary"]
    return {**run["summary"], **rep.prefill_share(prefills, run["window"], run["summary"].get("duration"))}


def summarize_server(label: str, srv: Server, phases: dict) -> dict:
    """A server's record: what it ran with, start-up, each phase's numbers (texts left to the comparisons)."""
    compiles = rep.read_jsonl(srv.trace_dir / "compiles-*.jsonl")
    trace = rep.read_jsonl(srv.trace_dir / "draft-trace-*.jsonl")
    prefills = rep.read_jsonl(srv.trace_dir / "prefill-trace-*.jsonl")
    s: dict = {"command": (srv.work / f"{label}.cmd").read_text().strip(), "departures": srv.cfg.departures,
               "check_mode": srv.cfg.check, "startup_s": srv.startup_s, "seconds": phases.get("seconds"),
               "not_run": phases.get("not_run"), "soak_s": phases.get("soak_s"),
               "alive_after": phases.get("alive_after"), "died": phases.get("died"),
               "compiles": rep.compiles_summary(compiles), "draft_calls": len(trace)}
    if prefills:  # every prefill batch's pause over the server's life (the soak's: below, after warm-up)
        s["prefill"] = rep.prefill_time(prefills)
    host_files = sorted(glob.glob(str(srv.trace_dir / "host-samples-*.jsonl")))  # GRAPHCAP_SGLANG_TRACE_HOST
    if host_files:
        s["host"] = host_samples.summary(*host_files)
    for name in ("bench", "rate", "gsp"):
        if name in phases:
            p = phases[name]
            s[name] = ({c: _with_prefill_share(r, prefills) for c, r in p.items()}
                       if name in ("bench", "rate") and "error" not in p else p.get("summary", p))
    if "multiturn" in phases:
        mt = phases["multiturn"]
        s["multiturn"] = mt if "error" in mt else {
            key: [{"round": i + 1, "cached_tokens": sum(r.get("cached_tokens") or 0 for r in rnd),
                   "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in rnd), **rep.latency(rnd)}
                  for i, rnd in enumerate(v["rounds"])] for key, v in mt.items()}
    if "faults" in phases:
        f = phases["faults"]
        s["faults"] = f if "error" in f else {
            k: {"alive_after": v["alive"], **rep.latency(v["replies"]),
                **({"stop_errors": load.stop_string_errors(v)} if k == "stop_strings" else {}),
                **({"one_token_errors": [i for i, r in enumerate(v["replies"]) if not r.get("error")
                                         and r.get("completion_tokens") != 1]} if k == "one_token" else {})}
            for k, v in f.items() if isinstance(v, dict) and "replies" in v}
        if "facts" in f:
            s["facts"] = f["facts"]
    if "soak" in phases and "error" not in phases["soak"]:
        sk = phases["soak"]
        by_kind: dict[str, list] = {}
        for r in sk["records"]:
            by_kind.setdefault(r["kind"], []).append(r)
        s["soak"] = {"requests": len(sk["records"]), "memory": sk["memory"],
                     "latency": {k: rep.latency(v) for k, v in sorted(by_kind.items())},
                     "gaps": rep.draft_gaps(trace, after=sk["warmup_end"], limit_ms=100.0, compiles=compiles,
                                            prefills=prefills),
                     "compiles": rep.compiles_summary(compiles, after=sk["warmup_end"]),
                     "host": host_samples.summary(*host_files, after=sk["warmup_end"])}
    elif "soak" in phases:
        s["soak"] = phases["soak"]
    man = rep.manifest_snapshot(srv.manifest_dir)
    if man is not None:
        s["manifest"] = {"buckets": [b["batch_size"] for b in man["buckets"]],
                         "captured": sum(b["status"] == "captured" for b in man["buckets"]),
                         "replays": sum(b["replays"] for b in man["buckets"]),
                         "fallbacks": sum(b["fallbacks"] for b in man["buckets"]),
                         "oversize_fallbacks": man["oversize_fallbacks"], "serving": man.get("serving")}
    log_text = srv.log_path.read_text(errors="replace")
    s["retractions"] = rep.retractions(log_text)
    s["pool_check_warnings"] = rep.pool_check_warnings(log_text)
    errors = [ln.strip()[:300] for ln in log_text.splitlines()
              if any(w in ln for w in ("Traceback", "Error", "error:", "leak", "graphcap (GRAPHCAP_SGLANG_CHECK"))]
    s["log_errors"] = errors[:12]
    return s
