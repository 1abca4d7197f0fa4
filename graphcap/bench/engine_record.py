"""What bench/sglang_engine.py's record says of its engines: each engine's entry, the kernel table of a profiled
batch, the draft tokens per request and call, acceptance and retractions per case, graphcap's manifests, stock
sglang against graphcap case by case, the issue's per-case record and the printed summary. Pure functions over the
engines' JSON outputs and files."""
from __future__ import annotations

import glob
import json
import os
import statistics


def engine_info(r: dict) -> dict:
    """One engine's entry: what ran in its own process (sglang version, steps, kernel paths as graphcap.kernels.arch
    names them there), whether it started, and what broke if it failed."""
    cfg, progress = r["config"], r.get("progress") or {}
    requested = cfg.get("kernel_paths") or "native"
    return {"tag": cfg["tag"], "mode": cfg["mode"], "backend": cfg.get("backend"), "steps": cfg.get("steps"),
            "sglang": r.get("sglang") or progress.get("sglang"),
            "kernel_paths": r.get("kernel_paths") or progress.get("kernel_paths"), "kernel_paths_asked": requested,
            "startup_s": r.get("startup_s") or progress.get("startup_s"),
            "started": None if r.get("not_run") else bool(not r.get("crashed") or progress.get("started")),
            "crashed": bool(r.get("crashed")), "not_run": r.get("not_run"), "error": r.get("error"),
            "log_tail": r.get("log_tail")}

def read_profile(trace_dir: str, batch: int, top: int = 30) -> dict | None:
    """The trace's kernel table for `batch` (GRAPHCAP_SGLANG_TRACE_PROFILE), its `top` kernels by time; None if none."""
    paths = glob.glob(os.path.join(trace_dir, f"draft-profile-*-b{batch}.json"))
    if not paths:
        return None
    d = json.load(open(paths[0]))
    return {**d, "kernels": d["kernels"][:top]}

def draft_map(rows: list[dict]) -> dict:
    """(rid, k) -> the draft tokens of the request's k-th draft call (the trace is in call order): two engines whose
    outputs and accepted lengths agree draft from the same state at the same k."""
    out, seen = {}, {}
    for r in rows:
        for i, rid in enumerate(r["rids"]):
            k = seen[rid] = seen.get(rid, -1) + 1
            out[(rid, k)] = r["draft"][i]
    return out

def accept_len(case: dict) -> float | None:
    v = [o["completion"] / o["verify_ct"] for o in case["outputs"] if o.get("verify_ct")]
    return statistics.mean(v) if v else None

def retractions(case: dict) -> int | None:
    """Times the case's requests were retracted (sglang's per-request count; None where sglang did not report it)."""
    v = [o.get("retractions") for o in case["outputs"]]
    return None if any(x is None for x in v) else sum(v)

def manifest_summary(d: str) -> dict:
    """Buckets captured, replays and fallbacks over every manifest in `d` (one per rank under --tp: each rank writes
    its own), and per manifest file its captured / bucket counts."""
    files = sorted(glob.glob(os.path.join(d, "*.json")))
    ms = [json.load(open(p)) for p in files]
    if not ms:
        return {"manifests": 0}
    b = [x for m in ms for x in m["buckets"]]
    return {"manifests": len(ms), "captured": sum(x["status"] == "captured" for x in b), "buckets": len(b),
            "replays": sum(x.get("replays", 0) for x in b), "fallbacks": sum(x.get("fallbacks", 0) for x in b)
            + sum(m.get("oversize_fallbacks", 0) for m in ms),
            "reasons": sorted({x.get("reason") or "" for x in b} - {""}),
            "per_manifest": {os.path.basename(p): [sum(x["status"] == "captured" for x in m["buckets"]),
                                                   len(m["buckets"])] for p, m in zip(files, ms)}}

def compare(base: dict, other: dict, base_trace: dict, other_trace: dict) -> list[dict]:
    rows = []
    for cb, co in zip(base["cases"], other["cases"]):
        eq = sum(a["tokens"] == b["tokens"] for a, b in zip(cb["outputs"], co["outputs"]))
        rids = {o["rid"] for o in cb["outputs"]}
        mine = {k for k in base_trace if k[0] in rids}
        theirs = {k for k in other_trace if k[0] in rids}
        keys = mine & theirs
        same = sum(base_trace[k] == other_trace[k] for k in keys)
        rows.append({"case": cb["name"], "batch": cb["batch"], "requests": len(cb["outputs"]), "tokens_equal": eq,
                     "drafts_compared": len(keys), "drafts_equal": same, "drafts_unmatched": len(mine ^ theirs),
                     "retractions_sglang": retractions(cb), "retractions_graphcap": retractions(co),
                     "accept_len_sglang": accept_len(cb), "accept_len_graphcap": accept_len(co)})
    return rows

def issue_record(check: dict | None, speed: dict | None, commit: str | None) -> dict:
    """The per-case record docs/results/sglang-engine-h200.json keeps: correctness from the tiny pair's check, and
    for the batches both runs have, the draft-shapes pair's timings (null where a figure was not measured)."""
    speed = speed or {}
    cases = []
    for c in (check or {}).get("cases", []):
        sp = speed.get(str(c["batch"])) or speed.get(c["batch"]) or {}
        base, ours, nospec = sp.get("sglang", {}), sp.get(f"graphcap-{c['backend']}", {}), sp.get("nospec", {})
        cases.append({
            "batch": c["batch"], "backend": c["backend"], "requests": c["requests"], "tokens_equal": c["tokens_equal"],
            "drafts_compared": c["drafts_compared"], "drafts_equal": c["drafts_equal"],
            # differing drafts traced to near-ties: none to trace when all agree; otherwise not traced (null)
            "near_ties": 0 if c["drafts_equal"] == c["drafts_compared"] else None,
            "drafts_unmatched": c.get("drafts_unmatched"),
            "crashes": c["crashes"], "fallbacks": c["fallbacks"],
            "retractions_sglang": c.get("retractions_sglang"), "retractions_graphcap": c.get("retractions_graphcap"),
            "accept_len_sglang": c["accept_len_sglang"], "accept_len_graphcap": c["accept_len_graphcap"],
            "draft_ms_sglang": base.get("draft_ms"), "draft_ms_graphcap": ours.get("draft_ms"),
            "decode_tok_s_sglang": base.get("decode_tok_s"), "decode_tok_s_graphcap": ours.get("decode_tok_s"),
            "decode_tok_s_no_spec": nospec.get("decode_tok_s")})
    return {"commit": commit, "default_backend": (check or {}).get("default_backend"), "cases": cases}

def summary(record: dict) -> dict:
    """What the harness prints at its end: the check's cases and engines, stock's start, the speed, the refusals."""
    s = {}
    if record["check"]:
        s["check"] = [{k: c[k] for k in ("engine", "backend", "case", "requests", "tokens_equal", "drafts_compared",
                                         "drafts_equal", "accept_len_sglang", "accept_len_graphcap", "fallbacks",
                                         "retractions_sglang", "retractions_graphcap") if k in c}
                      for c in record["check"]["cases"]]
        s["engines"] = {b: {k: v for k, v in e.items() if k != "log_tail"}
                        for b, e in record["check"]["engines"].items()}
        if record["check"].get("stock"):
            s["stock"] = {k: v for k, v in record["check"]["stock"].items() if k != "log_tail"}
    if record["speed"]:
        s["speed"] = record["speed"]
    if record.get("refusals"):
        s["refusals"] = [{k: v for k, v in r.items() if k != "log_tail"} for r in record["refusals"]]
    return s
