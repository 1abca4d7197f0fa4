"""One engine of the user-scale harness in this process: the child side of bench/sglang_user_scale.py (its
`--child`). It starts `sglang.Engine` (no speculation, stock MTP or the flag) on the 31B-shaped checkpoint, loads the
W8A8 target's int8 projections and the target's structure where asked (graphcap.bench.target_weights), then runs each
(batch, context) case: warm runs, timed short/long pairs, sglang's profiler where the case is profiled, the draft
trace where asked. A case the engine's pool cannot hold at once is not run; its row says which setting would hold it.
Every case is printed as a JSON line as it ends, so a parent whose child dies reads back what finished
(graphcap.bench.user_scale_engines).
"""
from __future__ import annotations

import glob
import json
import os
import random
import shutil
import statistics
import time

from graphcap.bench import target_weights as tw
from graphcap.bench.phase_profile import load_trace, read_trace
from graphcap.bench.sglang_pool import PoolShape, pool_shape, ratio_advice
from graphcap.bench.user_scale_rows import trace_summary

SHORT_NEW = 16  # the short run's new tokens: a timed pair's rate is the long run's extra tokens over its extra time


def target_dir(ckpt: str) -> str:
    return os.path.join(ckpt, "target")


def engine_kwargs(cfg: dict) -> dict:
    from graphcap.bench.served import sglang_engine_kwargs

    mtp = cfg["engine"] != "nospec"
    extra = {"load_format": "dummy", "context_length": cfg["context_length"]}
    if cfg.get("radix_cache"):  # a case's runs share their prompts: each prefills once (long contexts: minutes)
        extra["disable_radix_cache"] = False
    extra.update(cfg.get("sglang_settings") or {})  # sglang's own pool and prefill settings, where asked
    if mtp and cfg["structured"]:  # the structured assistant beside the structured target; else both dummy (they agree)
        extra["speculative_draft_load_format"] = "auto"
    return sglang_engine_kwargs(target_dir(cfg["ckpt"]), os.path.join(cfg["ckpt"], "assistant") if mtp else None,
                                steps=cfg["steps"], decode_batches=sorted(set(cfg["batches"])),
                                max_running=max(cfg["batches"]), mem_fraction=cfg["mem_fraction"], **extra)


def accept_length(outs: list[dict]) -> list[float]:
    """[tokens per verify] of one run's requests together (sglang's completion tokens over its verify count), or []
    where a request has no verify count (no speculation)."""
    vc = [o["meta_info"].get("spec_verify_ct") for o in outs]
    return [sum(o["meta_info"]["completion_tokens"] for o in outs) / sum(vc)] if all(vc) else []


def pool_facts(engine) -> dict:
    """The engine's pool as sglang states it (`get_server_info`): `tokens`, the full-attention layers' pool
    (`max_total_num_tokens`), the sliding one's `ratio` to it and the prefill `chunk`; {} where the engine does not
    say (every case then runs)."""
    try:
        info = engine.get_server_info()
    except Exception:  # noqa: BLE001 - an engine without the record runs every case
        return {}
    n = info.get("max_total_num_tokens")
    if not isinstance(n, (int, float)):
        return {}
    return {"tokens": int(n), "ratio": info.get("swa_full_tokens_ratio"), "chunk": info.get("chunked_prefill_size")}


def not_run_reason(need: int, batch: int, facts: dict, shape: PoolShape | None) -> str:
    """Why a case whose batch needs `need` KV tokens at once is not run, and the sglang setting that would hold it
    (`sglang_pool.ratio_advice`) where the target's pool shape and the engine's ratio and chunk are known."""
    out = f"needs {need} KV tokens at once; this engine's pool holds {facts['tokens']}"
    ratio, chunk = facts.get("ratio"), facts.get("chunk")
    if shape is None or not isinstance(ratio, (int, float)) or not isinstance(chunk, int) or chunk <= 0:
        return out + " (a lower --swa-full-tokens-ratio gives the full-attention pool more)"
    return f"{out} at --swa-full-tokens-ratio {ratio}: {ratio_advice(shape, facts['tokens'], ratio, need, batch, chunk)}"


def child(cfg: dict) -> dict:
    trace_dir = os.path.join(cfg["work"], f"trace-{cfg['engine']}")
    if cfg.get("fresh_jit_cache"):  # this engine compiles every Triton kernel it runs, none loaded from another's
        jit = os.path.join(cfg["work"], f"jit-{cfg['engine']}")
        shutil.rmtree(jit, ignore_errors=True)
        os.makedirs(jit)
        os.environ["TRITON_CACHE_DIR"] = jit
    if cfg.get("radix_cache"):  # sglang's Rust radix-tree core is built for its wheel's torch; the Python one runs
        os.environ.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    if cfg.get("trace"):  # graphcap's draft trace around the draft call, in every MTP engine (one sync per 16 calls)
        shutil.rmtree(trace_dir, ignore_errors=True)
        os.environ["GRAPHCAP_SGLANG_TRACE"] = trace_dir
    if cfg["engine"].startswith("graphcap"):
        opts = {"enabled": True, "backend": "cudagraph", "manifest_dir": cfg["work"]}
        if cfg["engine"] == "graphcap-sglang-verify":
            opts["verify_attention"] = "sglang"
        os.environ["GRAPHCAP_SGLANG_DRAFT_CAPTURE"] = json.dumps(opts)
    import sglang

    config_path = os.path.join(target_dir(cfg["ckpt"]), "config.json")
    tconfig = json.load(open(config_path)) if os.path.isfile(config_path) else None
    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(cfg))
    res = {"config": cfg, "startup_s": time.perf_counter() - t0, "cases": []}
    try:
        if cfg.get("weights", "bf16") == "w8a8":  # before the structure: its weight update puts the int8 layout right
            res["int8_loaded"] = tw.load_target_w8a8(tw.EngineUpdates(engine), tconfig)
            if not res["int8_loaded"]["ok"]:
                raise RuntimeError(f"the target's int8 projections did not load: {res['int8_loaded']['message']}")
        if cfg["structured"]:
            res["structure_loaded"] = tw.load_target_structure(tw.EngineUpdates(engine), target_dir(cfg["ckpt"]))
            if not res["structure_loaded"]["ok"]:
                raise RuntimeError(f"the target's structure did not load: {res['structure_loaded']['message']}")
        facts, shape = pool_facts(engine), pool_shape(tconfig) if tconfig else None
        rng = random.Random(0)
        for batch, context in cfg["cases"]:
            need = batch * (context + cfg["new"] + cfg["steps"] + 1)
            if facts and need > facts["tokens"]:  # the batch would not run at once: its rate would be another's
                case = {"batch": batch, "context": context, "not_run": not_run_reason(need, batch, facts, shape)}
                res["cases"].append(case)
                print(json.dumps(case), flush=True)
                continue
            prompts = [[rng.randrange(3, cfg["vocab"]) for _ in range(context)] for _ in range(batch)]

            windows = {}  # tag -> the run's (start, end) on time.perf_counter's clock, as the draft trace's `t`

            def gen(new, tag):
                t = time.perf_counter()
                outs = engine.generate(input_ids=prompts, rid=[f"b{batch}-c{context}-{tag}-{i}" for i in range(batch)],
                                       sampling_params=[{"temperature": 0.0, "max_new_tokens": new,
                                                         "ignore_eos": True}] * batch)
                windows[tag] = (t, time.perf_counter())
                return outs, windows[tag][1] - t

            profiled = [batch, context] in [list(x) for x in cfg["profile_cases"]]
            timed = not (profiled and cfg.get("rate_from") == "profile")
            # Warm runs as long as the timed ones: every path a timed run takes (prefill, each batch size of the
            # tail as requests finish) has run once, so no first-time cost (such as a JIT compile) lands in a timed
            # run. Two before a timed pair; one before a profile that alone gives the rate (a long batch whose
            # prompts the radix cache does not keep prefills in every run: minutes each).
            for k in range(2 if timed else 1):
                gen(cfg["new"], f"warm{k}")
            rates, accepts, long_tags, outs = [], [], [], None
            for k in range(cfg["repeats"] if timed else 0):
                _, short = gen(SHORT_NEW, f"short{k}")
                outs, long = gen(cfg["new"], f"long{k}")
                long_tags.append(f"long{k}")
                rates.append((cfg["new"] - SHORT_NEW) / (long - short))
                accepts += accept_length(outs)
            case = {"batch": batch, "context": context,
                    "decode_tok_s_per_req": statistics.median(rates) if rates else None, "rates": rates,
                    # every run of the case, warm ones first: where a first-time cost lands
                    "runs": {t: {"rids": [f"b{batch}-c{context}-{t}-{i}" for i in range(batch)], "window": w}
                             for t, w in windows.items()},
                    "long_tags": long_tags}
            if profiled:
                pdir = os.path.join(cfg["work"], f"profile-{cfg['engine']}-b{batch}-c{context}")
                shutil.rmtree(pdir, ignore_errors=True)
                os.makedirs(pdir)
                engine.start_profile(output_dir=pdir, num_steps=cfg["profile_steps"], activities=["CPU", "GPU"],
                                     profile_by_stage=True, profile_stages=["decode"])
                profile_outs, _ = gen(cfg["new"], "profile")
                if not timed:  # the profiled run's requests give the accept length and the tokens
                    outs, accepts = profile_outs, accept_length(profile_outs)
                time.sleep(2)
                traces = sorted(glob.glob(os.path.join(pdir, "**", "*.json*"), recursive=True))
                case["profile_files"] = [os.path.basename(t) for t in traces]
                decode = [t for t in traces if "decode" in os.path.basename(t).lower()] or traces
                if decode:
                    try:
                        case["profile"] = read_trace(load_trace(decode[0]))
                    except Exception as e:  # noqa: BLE001 - record what broke, keep the rates
                        case["profile"] = {"error": f"{type(e).__name__}: {e}"}
            case["accept_len"] = statistics.median(accepts) if accepts else None
            case["tokens"] = [o["output_ids"] for o in outs]
            res["cases"].append(case)
            # the case as the parent can read it back from the log should the engine not finish (its tokens left out)
            print(json.dumps({k: v for k, v in case.items() if k not in ("tokens", "runs")}), flush=True)
        if cfg.get("trace") and res["cases"]:
            from graphcap.bench.served import read_trace as read_draft_trace

            gen(cfg["new"], "flush")  # the trace writes every 16 draft calls: this run pushes the timed ones out
            rows = read_draft_trace(trace_dir)
            for case in res["cases"]:
                runs = case["runs"]
                case["draft_trace"] = [trace_summary(rows, runs[t]["rids"], runs[t]["window"])
                                       for t in case["long_tags"]]
                case["draft_trace_runs"] = {t: trace_summary(rows, r["rids"], r["window"]) for t, r in runs.items()}
    finally:
        engine.shutdown()
    return res
