"""sglang's own engine with and without `--enable-draft-graph-capture`: same checkpoint, same prompts, greedy.

Runs on a CUDA machine with sglang installed (scripts/gpu-check.sh stages `engine-check`, `engine-speed`). Each engine
configuration runs in a child process of its own (`--child`): sglang.Engine in-process, `skip_tokenizer_init`, prompts
as token ids. The parent compares the children's outputs and writes one JSON record (rewritten after every engine, so
a run cut at a time limit keeps what finished):

- correctness (`--check`, the tiny checkpoint): batches of 1, 2, 8, 32 and 64 requests with prompts shorter and
  longer than the sliding window and mixed `max_new_tokens`, then more requests (96) than `--max-running-requests`
  (64), so that requests queue and join. Per engine with the flag: output tokens per request against stock sglang's,
  the draft tokens of each request's k-th draft call against stock sglang's (graphcap's draft trace,
  `GRAPHCAP_SGLANG_TRACE`, flushed at every call), accepted length, fallbacks and captured buckets from graphcap's
  manifest;
- speed (`--speed`, the draft-shapes checkpoint): per batch, the draft phase's GPU time per iteration (CUDA events
  around the worker's draft call) and decode tokens/s, for the target alone, stock sglang and graphcap with each
  backend of `--backends` and each value of `--projections` (the plugin's `--draft-graph-projections`: whose
  kernels run the draft's projections) (`--speed-engines`: a subset, in that order);
- refusals (`--refusals`, any checkpoint): each setting the plugin refuses at start-up (REFUSALS), asked of a real
  engine start: whether `sglang.Engine` raised graphcap's DraftCaptureConfigError naming the setting (in the
  launcher, before sglang starts its scheduler), how long that took, and the message a user sees.

Every engine with a draft runs `--steps` draft steps (default 3) and `steps + 1` draft tokens (sglang's chain for
topk 1); the record names the steps and the sglang version that ran.

Usage: python bench/sglang_engine.py --ckpt DIR --check --out OUT.json [--backends ...] [--steps N]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from graphcap.backends import GRAPH_BACKENDS
from graphcap.integrations.sglang_compat import sglang_version
from graphcap.integrations.sglang_config import PROJECTIONS, UNSERVED_BACKENDS

WINDOW = 1024
CHECK_BATCHES = (1, 2, 8, 32, 64)
SPEED_BATCHES = (1, 8, 32, 64)
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
STEPS = 3  # the default of --steps
SHORT_NEW = 32  # the short run's new tokens (speed): decode rate from the long run minus this one
# Settings the plugin refuses at start-up (graphcap.integrations.sglang_config.validate_server_args): the graphcap
# backend, sglang engine arguments over engine_kwargs' defaults, and a phrase the error must contain.
REFUSALS = (
    {"name": "reduce-overhead", "backend": "reduce-overhead", "engine": {},
     "expect": "reduce-overhead is not supported in sglang's engine"},
    {"name": "eagle-topk-2", "backend": "cudagraph",
     "engine": {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6},
     "expect": "--speculative-eagle-topk must be 1, got 2"},
    {"name": "cuda-graphs-off", "backend": "cudagraph", "engine": {"disable_cuda_graph": True},
     "expect": "captures the draft into CUDA graphs, but"},
)


# -----------------------------------------------------------------------------------------------------------------
# workloads (deterministic: the same prompts reach every engine)


def check_cases(vocab: int, seed: int = 0) -> list[dict]:
    """Batches of requests with prompts both sides of the window and mixed lengths, then an oversubscribed batch."""
    rng = random.Random(seed)
    cases = []
    for b in (*CHECK_BATCHES, 96):
        reqs = []
        for i in range(b):
            n = rng.randint(200, WINDOW - 100) if i % 2 == 0 else rng.randint(WINDOW + 100, 2 * WINDOW + 500)
            reqs.append({"rid": f"b{b}-r{i}", "prompt": [rng.randrange(3, vocab) for _ in range(n)],
                         "max_new": rng.choice((8, 24, 48, 96))})
        cases.append({"name": f"batch{b}", "batch": b, "requests": reqs})
    return cases


def decode_rates(batch: int, new: int, short_s: list[float] | None, long_s: list[float] | None) -> list[float]:
    """Decode tokens/s per (short, long) pair of runs of the same prompts: the same prefill in both, so the extra
    time is the extra `new - SHORT_NEW` tokens of every request."""
    extra = batch * (new - SHORT_NEW)
    return [extra / max(lo - sh, 1e-9) for sh, lo in zip(short_s or [], long_s or [])]


def speed_case(b: int, vocab: int, context: int, new: int, seed: int = 1) -> dict:
    rng = random.Random(seed + b)
    return {"name": f"speed{b}", "batch": b, "requests": [
        {"rid": f"s{b}-r{i}", "prompt": [rng.randrange(3, vocab) for _ in range(context)], "max_new": new}
        for i in range(b)]}


# -----------------------------------------------------------------------------------------------------------------
# child: one engine


def engine_kwargs(cfg: dict) -> dict:
    kw = dict(model_path=os.path.join(cfg["ckpt"], "target"), skip_tokenizer_init=True, dtype="bfloat16",
              attention_backend="triton", page_size=64, disable_radix_cache=True, disable_prefill_cuda_graph=True,
              cuda_graph_bs_decode=BUCKETS, max_running_requests=cfg["max_running"], random_seed=0,
              mem_fraction_static=0.6, log_level="warning", tp_size=cfg.get("tp", 1))
    if cfg.get("max_total_tokens"):
        kw["max_total_tokens"] = cfg["max_total_tokens"]
    if cfg["mode"] != "nospec":
        kw.update(speculative_algorithm="NEXTN", speculative_draft_model_path=os.path.join(cfg["ckpt"], "assistant"),
                  speculative_num_steps=cfg.get("steps", STEPS), speculative_eagle_topk=1,
                  speculative_num_draft_tokens=cfg.get("steps", STEPS) + 1)
    kw.update(cfg.get("engine", {}))  # a refusal case's settings over these
    return kw


def enable_graphcap(cfg: dict) -> None:
    """The flag for an engine started in this process (the variable graphcap's plugin reads, as a launcher that
    parsed --enable-draft-graph-capture sets it), before sglang is imported."""
    os.environ["GRAPHCAP_SGLANG_DRAFT_CAPTURE"] = json.dumps(
        {"enabled": True, "backend": cfg["backend"], "manifest_dir": cfg["manifest_dir"],
         "projections": cfg.get("projections", PROJECTIONS[0])})


def refusal_child(cfg: dict) -> dict:
    """Start an engine with a setting graphcap refuses: the error it raised (type, message, seconds), or None where
    the engine started (then it is shut down)."""
    enable_graphcap(cfg)
    import sglang

    t0 = time.perf_counter()
    try:
        engine = sglang.Engine(**engine_kwargs(cfg))
    except Exception as e:  # what a user's engine start raises
        return {"config": cfg, "error_type": type(e).__name__, "message": str(e),
                "seconds": time.perf_counter() - t0}
    engine.shutdown()
    return {"config": cfg, "error_type": None, "message": None, "seconds": time.perf_counter() - t0}


def refusal_row(case: dict, r: dict) -> dict:
    """One refusal case's outcome: refused with graphcap's error naming the setting (ok), or what happened instead."""
    msg = r.get("message") or ""
    ok = (not r.get("crashed") and r.get("error_type") == "DraftCaptureConfigError" and case["expect"] in msg)
    return {"name": case["name"], "ok": ok, "error_type": r.get("error_type"), "message": msg or None,
            "seconds": r.get("seconds"), "crashed": bool(r.get("crashed")), "log_tail": r.get("log_tail")}


def run_child(cfg: dict) -> dict:
    if cfg.get("flush_manifest"):  # correctness runs (not timed): the engine is killed at shutdown, so keep the
        os.environ["GRAPHCAP_MANIFEST_FLUSH_S"] = "0"  # manifest current; and check every length graphcap reads
        os.environ["GRAPHCAP_SGLANG_CHECK"] = "1"  # or hands on against sglang's after each draft (one sync)
        os.environ["GRAPHCAP_SGLANG_TRACE_FLUSH"] = "1"  # the trace loses no draft call when the engine is killed
    if cfg.get("retract_every"):  # sglang's own test switch: retract running requests every N forwards (they are
        # re-queued and prefilled again), in the scheduler process the engine starts with this environment
        os.environ["SGLANG_TEST_RETRACT"] = "1"
        os.environ["SGLANG_TEST_RETRACT_INTERVAL"] = str(cfg["retract_every"])
    if cfg["mode"] == "graphcap":
        enable_graphcap(cfg)
    os.environ["GRAPHCAP_SGLANG_TRACE"] = cfg["trace_dir"]
    if cfg.get("profile_batches"):  # kernel tables of a few draft calls per batch (graphcap.integrations.sglang_trace)
        os.environ["GRAPHCAP_SGLANG_TRACE_PROFILE"] = ",".join(map(str, cfg["profile_batches"]))
    import sglang

    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(cfg))
    result = {"config": cfg, "startup_s": time.perf_counter() - t0, "cases": []}
    try:
        for case in cfg["cases"]:
            reqs = case["requests"]

            def generate(suffix: str, new_tokens: int | None = None):
                params = [{"temperature": 0.0, "max_new_tokens": new_tokens or r["max_new"], "ignore_eos": True}
                          for r in reqs]
                t = time.perf_counter()
                outs = engine.generate(input_ids=[r["prompt"] for r in reqs], sampling_params=params,
                                       rid=[r["rid"] + suffix for r in reqs])
                return outs, time.perf_counter() - t

            short_s, long_s = [], []
            if case.get("decode_rate"):  # warm up, then pairs of a short and a long run of the same prompts: the
                # decode rate is the extra tokens over the extra time, per pair (the last long run is the case's)
                generate("-warm", 8)
                for i in range(case.get("repeats", 1) - 1):
                    short_s.append(generate(f"-short{i}", SHORT_NEW)[1])
                    long_s.append(generate(f"-long{i}")[1])
                short_s.append(generate("-short", SHORT_NEW)[1])
            outs, wall = generate("")
            if case.get("decode_rate"):
                long_s.append(wall)
            result["cases"].append({"name": case["name"], "batch": case["batch"], "wall_s": wall,
                                    "short_s": short_s or None, "long_s": long_s or None, "outputs": [
                {"rid": r["rid"], "tokens": o["output_ids"], "verify_ct": o["meta_info"].get("spec_verify_ct"),
                 "completion": o["meta_info"].get("completion_tokens"),
                 "retractions": o["meta_info"].get("num_retractions")} for r, o in zip(reqs, outs)]})
    finally:
        engine.shutdown()
    return result


# -----------------------------------------------------------------------------------------------------------------
# parent: engines in children, comparisons


def spawn(cfg: dict, log_dir: str) -> dict:
    tag = cfg["tag"]
    path = os.path.join(log_dir, f"child-{tag}.json")
    cfg_path = os.path.join(log_dir, f"child-{tag}-config.json")  # prompts: too long for a command line
    json.dump(cfg, open(cfg_path, "w"))
    with open(os.path.join(log_dir, f"child-{tag}.log"), "w") as log:
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, __file__, "--child", cfg_path, "--child-out", path],
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not os.path.exists(path):
        tail = open(os.path.join(log_dir, f"child-{tag}.log")).read()[-3000:]
        print(f"== {tag}: engine child failed (rc {rc}) after {time.perf_counter() - t:.0f} s\n{tail}", flush=True)
        return {"config": cfg, "crashed": True, "rc": rc, "log_tail": tail}
    print(f"== {tag}: ok in {time.perf_counter() - t:.0f} s", flush=True)
    return json.load(open(path))


def read_trace(trace_dir: str) -> list[dict]:
    rows = []
    for p in glob.glob(os.path.join(trace_dir, "draft-trace-*.jsonl")):
        rows += [json.loads(line) for line in open(p)]
    return rows


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--backends", default="cudagraph,inductor-cudagraph")
    ap.add_argument("--vocab", type=int, default=None, help="default: the checkpoint's")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3,
                    help="--speed: short/long run pairs per batch for the decode rate (the median is reported)")
    ap.add_argument("--retract-every", type=int, default=0, metavar="N",
                    help="--check: every engine retracts running requests every N forwards (sglang's "
                         "SGLANG_TEST_RETRACT), so requests leave, queue and are prefilled again mid-decode")
    ap.add_argument("--profile-batches", default="", metavar="B,B",
                    help="--speed: also record the kernels of 5 warm draft calls at each of these batch sizes (each "
                         "engine). Those calls sync and fall in the first short run: left out of draft_ms, but they "
                         "bias the first pair's decode rate up a little - leave this off for decode rates")
    ap.add_argument("--speed-engines", default="nospec,sglang,graphcap",
                    help="--speed: the engines to time, in order: nospec (the target alone), sglang (its own MTP "
                         "draft), graphcap (one engine per backend of --backends and projections of --projections)")
    ap.add_argument("--projections", default=PROJECTIONS[0],
                    help=f"--speed: the plugin's --draft-graph-projections values to time graphcap with, each an "
                         f"engine of its own (of {', '.join(PROJECTIONS)}; the first's engines are tagged "
                         f"graphcap-BACKEND, the others' graphcap-BACKEND-PROJECTIONS-proj)")
    ap.add_argument("--steps", type=int, default=STEPS,
                    help="speculative_num_steps of every engine with a draft (num_draft_tokens: steps + 1). "
                         "Default: %(default)s")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel size (sglang's tp_size) of every engine; with the flag each rank writes its "
                         "own manifest. Default: %(default)s")
    ap.add_argument("--refusals", action="store_true",
                    help="start an engine with each setting the plugin refuses (REFUSALS) and record the error")
    ap.add_argument("--combine", nargs=2, metavar=("CHECK_JSON", "SPEED_JSON"),
                    help="write the issue record (--out) from a --check and a --speed output")
    ap.add_argument("--child")
    ap.add_argument("--child-out")
    a = ap.parse_args(argv)
    if not a.child:  # what each mode needs, named before anything starts
        if not a.out:
            ap.error("--out is required")
        if not a.combine and not (a.ckpt and (a.check or a.speed or a.refusals)):
            ap.error("give --ckpt with --check, --speed and/or --refusals, or --combine CHECK_JSON SPEED_JSON")
        served = [b for b in GRAPH_BACKENDS if b not in UNSERVED_BACKENDS]
        given = [b for b in a.backends.split(",") if b]
        if not given or any(b not in served for b in given):
            ap.error(f"--backends: a list of {', '.join(served)} (the backends the plugin serves); got "
                     f"{a.backends!r}")
        if a.steps < 1:
            ap.error(f"--steps must be >= 1, got {a.steps}")
        if a.tp < 1:
            ap.error(f"--tp must be >= 1, got {a.tp}")
        if a.repeats < 1 or a.new <= SHORT_NEW:
            ap.error(f"--repeats must be >= 1 and --new > {SHORT_NEW} (the short run's tokens), got {a.repeats}, "
                     f"{a.new}")
        if any(not x.strip().isdigit() or int(x) < 1 for x in a.profile_batches.split(",") if x.strip()):
            ap.error(f"--profile-batches: expected batch sizes >= 1, got {a.profile_batches!r}")
        projections = [p for p in a.projections.split(",") if p]
        if not projections or len(set(projections)) != len(projections) or any(p not in PROJECTIONS
                                                                               for p in projections):
            ap.error(f"--projections: a list of {', '.join(PROJECTIONS)}, each once; got {a.projections!r}")
        engines = [e for e in a.speed_engines.split(",") if e]
        if not engines or len(set(engines)) != len(engines) or any(e not in ("nospec", "sglang", "graphcap")
                                                                   for e in engines):
            ap.error(f"--speed-engines: a list of nospec, sglang, graphcap, each once; got {a.speed_engines!r}")
    if a.child:
        child_cfg = json.load(open(a.child))
        res = (refusal_child if child_cfg["mode"] == "refusal" else run_child)(child_cfg)
        json.dump(res, open(a.child_out, "w"))
        return 0
    if a.combine:
        chk, spd = (json.load(open(p)) for p in a.combine)
        rec = issue_record(chk["check"], spd["speed"], chk.get("commit") or spd.get("commit"))
        json.dump(rec, open(a.out, "w"), indent=1)
        return 0
    work = tempfile.mkdtemp(prefix="graphcap-engine-", dir=os.path.dirname(os.path.abspath(a.out)))
    vocab = a.vocab or json.load(open(os.path.join(a.ckpt, "target", "config.json")))["vocab_size"]
    backends = [b for b in a.backends.split(",") if b]
    record = {"commit": os.environ.get("GRAPHCAP_COMMIT"), "ckpt": a.ckpt, "backends": backends, "steps": a.steps,
              "tp": a.tp, "sglang": sglang_version(), "check": None, "speed": None}
    if a.refusals:
        record["refusals"] = []

    def cfg(tag, mode, cases, backend=None, **extra):
        d = {k: os.path.join(work, f"{k}-{tag}") for k in ("trace_dir", "manifest_dir")}
        return {"tag": tag, "mode": mode, "backend": backend, "ckpt": a.ckpt, "cases": cases, "max_running": 64,
                "steps": a.steps, "tp": a.tp, **d, **extra}

    if a.refusals:  # first: seconds each, and they say whether the plugin is loaded at all
        for case in REFUSALS:
            r = spawn(cfg("refusal-" + case["name"], "refusal", [], backend=case["backend"], engine=case["engine"]),
                      work)
            record["refusals"].append(refusal_row(case, r))
            json.dump(record, open(a.out, "w"), indent=1)
    if a.check:
        cases = check_cases(vocab)
        # a small pool, meant to make the 96-request case retract (64 x 2600 tokens was not small enough to)
        pool = dict(max_total_tokens=64 * 2600, flush_manifest=True, retract_every=a.retract_every)
        base = spawn(cfg("sglang", "sglang", cases, **pool), work)
        from graphcap.integrations.sglang_config import DEFAULT_BACKEND

        out = {"default_backend": DEFAULT_BACKEND, "engines": {}, "cases": []}
        bt = draft_map(read_trace(base["config"]["trace_dir"])) if not base.get("crashed") else {}
        for be in backends:
            r = spawn(cfg(f"graphcap-{be}", "graphcap", cases, backend=be, **pool), work)
            m = manifest_summary(r["config"]["manifest_dir"])
            crashed = bool(r.get("crashed"))
            out["engines"][be] = {"startup_s": r.get("startup_s"), "crashed": crashed, "manifest": m,
                                  "log_tail": r.get("log_tail")}
            if base.get("crashed"):
                continue
            if crashed:  # every case of a crashed engine is a crash, not a missing row
                out["cases"] += [{"backend": be, "case": c["name"], "batch": c["batch"], "requests": c["batch"],
                                  "tokens_equal": 0, "drafts_compared": 0, "drafts_equal": 0, "drafts_unmatched": None,
                                  "accept_len_sglang": None, "accept_len_graphcap": None, "crashes": 1,
                                  "fallbacks": m.get("fallbacks")} for c in cases]
            else:
                for row in compare(base, r, bt, draft_map(read_trace(r["config"]["trace_dir"]))):
                    out["cases"].append({"backend": be, "crashes": 0, "fallbacks": m.get("fallbacks"), **row})
            out["sglang_startup_s"], out["sglang_crashed"] = base.get("startup_s"), bool(base.get("crashed"))
            record["check"] = out
            json.dump(record, open(a.out, "w"), indent=1)
        out["sglang_startup_s"], out["sglang_crashed"] = base.get("startup_s"), bool(base.get("crashed"))
        record["check"] = out
    if a.speed:
        cases = [dict(speed_case(b, vocab, a.context, a.new), decode_rate=True, repeats=a.repeats)
                 for b in SPEED_BATCHES]
        rows = {}
        # (tag, mode, backend, projections) in --speed-engines' order, graphcap once per backend and projections
        projections = [p for p in a.projections.split(",") if p]
        engines = [(f"graphcap-{be}" + ("" if pr == projections[0] else f"-{pr}-proj"), "graphcap", be, pr)
                   if mode == "graphcap" else (mode, mode, None, None)
                   for mode in a.speed_engines.split(",") if mode
                   for be in (backends if mode == "graphcap" else [None])
                   for pr in (projections if mode == "graphcap" else [None])]
        for tag, mode, be, pr in engines:
            prof = [int(x) for x in a.profile_batches.split(",") if x.strip()]
            extra = {"projections": pr} if pr else {}
            r = spawn(cfg("speed-" + tag, mode, cases, backend=be, profile_batches=prof, **extra), work)
            tr = read_trace(r["config"]["trace_dir"]) if not r.get("crashed") else []
            for c in r.get("cases", []):
                long_run = {f"s{c['batch']}-r{i}" for i in range(c["batch"])}  # not the warm-up's or short run's
                ms = [t["gpu_ms"] for t in tr if len(t["rids"]) == c["batch"] and set(t["rids"]) == long_run
                      and not t.get("profiled")]
                rates = decode_rates(c["batch"], a.new, c["short_s"], c["long_s"])
                rows.setdefault(c["batch"], {})[tag] = {
                    "decode_tok_s": statistics.median(rates) if rates else None, "decode_tok_s_runs": rates,
                    "draft_ms": statistics.median(ms[len(ms) // 4:]) if ms else None, "draft_calls": len(ms),
                    "accept_len": accept_len(c), "profile": read_profile(r["config"]["trace_dir"], c["batch"])}
            rows.setdefault("startup_s", {})[tag] = r.get("startup_s")
            if r.get("crashed"):
                rows.setdefault("crashed", []).append(tag)
            record["speed"] = rows
            json.dump(record, open(a.out, "w"), indent=1)
    json.dump(record, open(a.out, "w"), indent=1)
    print(json.dumps(summary(record), indent=1))
    return 0


def summary(record: dict) -> dict:
    s = {}
    if record["check"]:
        s["check"] = [{k: c[k] for k in ("backend", "case", "requests", "tokens_equal", "drafts_compared",
                                         "drafts_equal", "accept_len_sglang", "accept_len_graphcap", "fallbacks", "retractions_sglang",
                                         "retractions_graphcap") if k in c}
                      for c in record["check"]["cases"]]
        s["engines"] = {b: {k: v for k, v in e.items() if k != "log_tail"} for b, e in record["check"]["engines"].items()}
    if record["speed"]:
        s["speed"] = record["speed"]
    if record.get("refusals"):
        s["refusals"] = [{k: v for k, v in r.items() if k != "log_tail"} for r in record["refusals"]]
    return s


if __name__ == "__main__":
    sys.exit(main())
