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
topk 1). Each engine's entry names what its own process ran: the sglang version it imported (the PYTHONPATH decides:
an sglang in a --target dir in front of it runs beside the machine's), the steps, and the kernel paths graphcap's
kernels took (`--kernel-paths native,sm80`: a graphcap engine per value; sm80 sets GRAPHCAP_KERNEL_PATHS=sm80 and
Triton's TRITON_OVERRIDE_ARCH=sm80 for the whole engine, so every Triton kernel lowers for capability 80 as on an
A100; recorded as graphcap.kernels.arch describes the GPU in that process, e.g. sm90 on an H200's own paths).

`--check --time-batch B` (scripts/gpu-check.sh user-setup): each engine also times its draft phase on B requests
after the checks (one engine start for both; the length checks' per-draft sync is then off, as it would stall the
timed draft). `--until EPOCH_S`: an engine that could not finish by then is not started (recorded as not run), and
one still running then is stopped with its processes.

Usage: python bench/sglang_engine.py --ckpt DIR --check --out OUT.json [--backends ...] [--steps N]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import tempfile
import time

from graphcap.bench.engine_child import SHORT_NEW, STEPS, refusal_child, run_child  # the child side
from graphcap.bench.engine_record import (accept_len, compare, draft_map, engine_info, issue_record,
                                          manifest_summary, read_profile, summary)
from graphcap.bench.served import (exit_on_term, failure, machine, read_trace, run_stoppable,  # shared parts
                                   timed_draft_ms)
from graphcap.backends import GRAPH_BACKENDS
from graphcap.envvars import FORCED_KERNEL_PATHS, NATIVE
from graphcap.sglang.compat import sglang_version
from graphcap.sglang.config import UNSERVED_BACKENDS
from graphcap.sglang.settings import PLUGIN_DEFAULT_BACKEND, PROJECTIONS

WINDOW = 1024
CHECK_BATCHES = (1, 2, 8, 32, 64)
SPEED_BATCHES = (1, 8, 32, 64)
SPEED_ENGINES = ("nospec", "sglang", "graphcap", "graphcap-nopdl")  # --speed-engines' values
KERNEL_PATHS = (NATIVE, *FORCED_KERNEL_PATHS)
MIN_ENGINE_S = 75  # --until: an engine (tiny pair: start ~25 s, checks, timing, shutdown) wants at least this long
STOP_MARGIN_S = 5  # and is stopped this long before --until, so that the record is written in time
# Settings the plugin refuses at start-up (graphcap.sglang.config.validate_server_args): the graphcap
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
# parent: engines in children, comparisons


def refusal_row(case: dict, r: dict) -> dict:
    """One refusal case's outcome: refused with graphcap's error naming the setting (ok), or what happened instead."""
    msg = r.get("message") or ""
    ok = (not r.get("crashed") and r.get("error_type") == "DraftCaptureConfigError" and case["expect"] in msg)
    return {"name": case["name"], "ok": ok, "error_type": r.get("error_type"), "message": msg or None,
            "seconds": r.get("seconds"), "crashed": bool(r.get("crashed")), "log_tail": r.get("log_tail")}


def spawn(cfg: dict, log_dir: str) -> dict:
    """One engine in a child process (its own process group), stopped after cfg's timeout_s if given; a child that
    failed returns crashed, its log's tail, what broke and how far it got (its progress file)."""
    tag = cfg["tag"]
    path = os.path.join(log_dir, f"child-{tag}.json")
    cfg_path = os.path.join(log_dir, f"child-{tag}-config.json")  # prompts: too long for a command line
    cfg = dict(cfg, progress_path=os.path.join(log_dir, f"child-{tag}-progress.json"))
    json.dump(cfg, open(cfg_path, "w"))
    with open(os.path.join(log_dir, f"child-{tag}.log"), "w") as log:
        t = time.perf_counter()
        rc, timed_out = run_stoppable([sys.executable, __file__, "--child", cfg_path, "--child-out", path], log,
                                  cfg.get("timeout_s"))
    if rc != 0 or not os.path.exists(path):
        text = open(os.path.join(log_dir, f"child-{tag}.log"), errors="replace").read()
        tail = text[-3000:]
        why = f"stopped after its {cfg['timeout_s']:.0f} s (--until)" if timed_out else failure(text)
        progress = json.load(open(cfg["progress_path"])) if os.path.exists(cfg["progress_path"]) else {}
        print(f"== {tag}: engine child failed (rc {rc}) after {time.perf_counter() - t:.0f} s: {why}\n{tail}",
              flush=True)
        return {"config": cfg, "crashed": True, "rc": rc, "log_tail": tail, "error": why, "timed_out": timed_out,
                "progress": progress}
    print(f"== {tag}: ok in {time.perf_counter() - t:.0f} s", flush=True)
    return json.load(open(path))


def triton_kernels_for(arch: str, cache: str | None = None) -> int:
    """Kernels in Triton's cache (TRITON_CACHE_DIR, else ~/.triton/cache) compiled with options.arch == `arch`: after
    an sm80 engine, evidence that Triton lowered for 80 (a Triton without the override knob would show none)."""
    cache = cache or os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    n = 0
    for path in glob.glob(os.path.join(cache, "*", "*.json")):
        if os.path.basename(path).startswith("__grp__"):
            continue
        try:
            n += json.load(open(path)).get("arch") == arch
        except (OSError, ValueError, AttributeError):
            continue
    return n


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
                         "draft), graphcap (one engine per backend of --backends and projections of --projections), "
                         "graphcap-nopdl (the same with GRAPHCAP_PDL=0: no programmatic dependent launch)")
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
    ap.add_argument("--kernel-paths", default="native",
                    help=f"--check: a graphcap engine per value, each once, of {', '.join(KERNEL_PATHS)} (native: the "
                         "device's own; sm80: an A100's, GRAPHCAP_KERNEL_PATHS=sm80 and TRITON_OVERRIDE_ARCH=sm80 in "
                         "that engine). Default: %(default)s")
    ap.add_argument("--time-batch", type=int, default=0, metavar="B",
                    help="--check: each engine then times its draft phase on B requests of --context tokens and --new "
                         "new ones (draft_ms: median GPU time per full-batch draft call), in the same engine; the "
                         "per-draft length check (GRAPHCAP_SGLANG_CHECK, a sync) is then off. 0: no timing")
    ap.add_argument("--check-batches", default="",
                    help=f"--check: only the cases of these batch sizes (of {', '.join(map(str, (*CHECK_BATCHES, 96)))};"
                         " default: all)")
    ap.add_argument("--expect-sglang", default="",
                    help="the sglang version each engine's process must import (a wrong PYTHONPATH fails the engine, "
                         "named, instead of running another version)")
    ap.add_argument("--until", type=float, default=0.0, metavar="EPOCH_S",
                    help="engines that cannot finish by this time (time.time()) are not started but recorded as not "
                         "run; one still running then is stopped with its processes")
    ap.add_argument("--work", default="",
                    help="where the children's configs, logs, traces and manifests go (default: beside --out)")
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
        if not engines or len(set(engines)) != len(engines) or any(e not in SPEED_ENGINES for e in engines):
            ap.error(f"--speed-engines: a list of {', '.join(SPEED_ENGINES)}, each once; got {a.speed_engines!r}")
        paths = [p for p in a.kernel_paths.split(",") if p]
        if not paths or len(set(paths)) != len(paths) or any(p not in KERNEL_PATHS for p in paths):
            ap.error(f"--kernel-paths: a list of {', '.join(KERNEL_PATHS)}, each once; got {a.kernel_paths!r}")
        if a.time_batch < 0:
            ap.error(f"--time-batch must be >= 0, got {a.time_batch}")
        sizes = [x.strip() for x in a.check_batches.split(",") if x.strip()]
        if any(not x.isdigit() or int(x) not in (*CHECK_BATCHES, 96) for x in sizes):
            ap.error(f"--check-batches: batch sizes of {', '.join(map(str, (*CHECK_BATCHES, 96)))}; got "
                     f"{a.check_batches!r}")
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
    with exit_on_term():
        return run(a)


def run(a: argparse.Namespace) -> int:
    """The engines of --refusals, --check and --speed, in that order (arguments checked by main)."""
    if a.work:
        os.makedirs(a.work, exist_ok=True)
    work = tempfile.mkdtemp(prefix="graphcap-engine-", dir=a.work or os.path.dirname(os.path.abspath(a.out)))
    vocab = a.vocab or json.load(open(os.path.join(a.ckpt, "target", "config.json")))["vocab_size"]
    backends = [b for b in a.backends.split(",") if b]
    record = {"commit": os.environ.get("GRAPHCAP_COMMIT"), "ckpt": a.ckpt, "backends": backends, "steps": a.steps,
              "tp": a.tp, "sglang": sglang_version(), "kernel_paths": a.kernel_paths.split(","),
              "time_batch": a.time_batch or None, "context": a.context, "new": a.new,
              "expect_sglang": a.expect_sglang or None, "machine": machine(), "check": None, "speed": None}
    if a.refusals:
        record["refusals"] = []

    def cfg(tag, mode, cases, backend=None, **extra):
        d = {k: os.path.join(work, f"{k}-{tag}") for k in ("trace_dir", "manifest_dir")}
        return {"tag": tag, "mode": mode, "backend": backend, "ckpt": a.ckpt, "cases": cases, "max_running": 64,
                "steps": a.steps, "tp": a.tp, "expect_sglang": a.expect_sglang or None, **d, **extra}

    def launch(c: dict) -> dict:
        """spawn, within --until: not started when too little time is left, stopped at it."""
        if not a.until:
            return spawn(c, work)
        left = a.until - time.time()
        if left < MIN_ENGINE_S:
            print(f"== {c['tag']}: not run ({left:.0f} s left before --until)", flush=True)
            return {"config": c, "not_run": f"{max(left, 0):.0f} s left before --until, {MIN_ENGINE_S} s wanted"}
        return spawn(dict(c, timeout_s=left - STOP_MARGIN_S), work)

    if a.refusals:  # first: seconds each, and they say whether the plugin is loaded at all
        for case in REFUSALS:
            r = spawn(cfg("refusal-" + case["name"], "refusal", [], backend=case["backend"], engine=case["engine"]),
                      work)
            record["refusals"].append(refusal_row(case, r))
            json.dump(record, open(a.out, "w"), indent=1)
    if a.check:
        sizes = {int(x) for x in a.check_batches.split(",") if x.strip()}
        cases = [c for c in check_cases(vocab) if not sizes or c["batch"] in sizes]
        # a small pool, meant to make the 96-request case retract (64 x 2600 tokens was not small enough to)
        pool = dict(max_total_tokens=64 * 2600, retract_every=a.retract_every)
        if a.time_batch:  # one engine for both: no per-draft sync (it would stall the timed draft), the manifest
            # written every second so that a fallback reaches it before shutdown kills the scheduler
            timed = speed_case(a.time_batch, vocab, a.context, a.new)
            pool.update(timed=dict(timed, requests=[dict(r, rid="t" + r["rid"]) for r in timed["requests"]]),
                        manifest_flush_s=1)
        else:
            pool.update(flush_manifest=True)
        base = launch(cfg("sglang", "sglang", cases, **pool))
        ran = not base.get("crashed") and not base.get("not_run")
        btrace = read_trace(base["config"]["trace_dir"]) if ran else []
        bt = draft_map(btrace)
        out = {"default_backend": PLUGIN_DEFAULT_BACKEND, "requests": sum(c["batch"] for c in cases),
               "check_batches": [c["batch"] for c in cases], "engines": {}, "cases": [],
               "stock": dict(engine_info(base), draft_ms=None, draft_calls=0)}
        if a.time_batch and ran and base.get("timed"):
            out["stock"]["draft_ms"], out["stock"]["draft_calls"] = timed_draft_ms(btrace, base["timed"]["rids"])
        out["sglang_startup_s"], out["sglang_crashed"] = base.get("startup_s"), bool(base.get("crashed"))
        record["check"] = out
        json.dump(record, open(a.out, "w"), indent=1)
        for be in backends:
            for kp in a.kernel_paths.split(","):
                key = be if kp == "native" else f"{be}-{kp}"  # the device's own paths keep the plain name
                r = launch(cfg(f"graphcap-{key}", "graphcap", cases, backend=be, kernel_paths=kp, **pool))
                m = manifest_summary(r["config"]["manifest_dir"])
                crashed = bool(r.get("crashed"))
                info = out["engines"][key] = dict(engine_info(r), manifest=m, draft_ms=None, draft_calls=0)
                trace = read_trace(r["config"]["trace_dir"]) if not crashed and not r.get("not_run") else []
                if a.time_batch and r.get("timed"):
                    info["draft_ms"], info["draft_calls"] = timed_draft_ms(trace, r["timed"]["rids"])
                if kp != "native":
                    info["triton_kernels_for_paths"] = triton_kernels_for(kp)
                who = {"engine": key, "backend": be, "kernel_paths": info["kernel_paths"], "sglang": info["sglang"],
                       "steps": a.steps}
                if not ran or r.get("not_run"):  # nothing to compare: the engine entries say why
                    pass
                elif crashed:  # every case of a crashed engine is a crash, not a missing row
                    out["cases"] += [{**who, "case": c["name"], "batch": c["batch"], "requests": c["batch"],
                                      "tokens_equal": 0, "drafts_compared": 0, "drafts_equal": 0,
                                      "drafts_unmatched": None, "accept_len_sglang": None,
                                      "accept_len_graphcap": None, "crashes": 1, "fallbacks": m.get("fallbacks")}
                                     for c in cases]
                else:
                    for row in compare(base, r, bt, draft_map(trace)):
                        out["cases"].append({**who, "crashes": 0, "fallbacks": m.get("fallbacks"), **row})
                json.dump(record, open(a.out, "w"), indent=1)
    if a.speed:
        cases = [dict(speed_case(b, vocab, a.context, a.new), decode_rate=True, repeats=a.repeats)
                 for b in SPEED_BATCHES]
        rows = {}
        # (tag, mode, backend, projections) in --speed-engines' order, graphcap once per backend and projections
        projections = [p for p in a.projections.split(",") if p]
        engines = [(f"{mode}-{be}" + ("" if pr == projections[0] else f"-{pr}-proj"), mode, be, pr)
                   if mode.startswith("graphcap") else (mode, mode, None, None)
                   for mode in a.speed_engines.split(",") if mode
                   for be in (backends if mode.startswith("graphcap") else [None])
                   for pr in (projections if mode.startswith("graphcap") else [None])]
        for tag, mode, be, pr in engines:
            prof = [int(x) for x in a.profile_batches.split(",") if x.strip()]
            extra = {"projections": pr} if pr else {}
            if mode == "graphcap-nopdl":
                mode, extra["pdl"] = "graphcap", False
            r = spawn(cfg("speed-" + tag, mode, cases, backend=be, profile_batches=prof, **extra), work)
            tr = read_trace(r["config"]["trace_dir"]) if not r.get("crashed") else []
            for c in r.get("cases", []):
                long_run = {f"s{c['batch']}-r{i}" for i in range(c["batch"])}  # not the warm-up's or short run's
                draft_ms, calls = timed_draft_ms(tr, long_run)
                rates = decode_rates(c["batch"], a.new, c["short_s"], c["long_s"])
                rows.setdefault(c["batch"], {})[tag] = {
                    "decode_tok_s": statistics.median(rates) if rates else None, "decode_tok_s_runs": rates,
                    "draft_ms": draft_ms, "draft_calls": calls,
                    "accept_len": accept_len(c), "profile": read_profile(r["config"]["trace_dir"], c["batch"])}
            rows.setdefault("startup_s", {})[tag] = r.get("startup_s")
            if r.get("crashed"):
                rows.setdefault("crashed", []).append(tag)
            record["speed"] = rows
            json.dump(record, open(a.out, "w"), indent=1)
    json.dump(record, open(a.out, "w"), indent=1)
    print(json.dumps(summary(record), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
