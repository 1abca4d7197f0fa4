"""The user's question at the user's scale: decode tokens/s per request at batch 8 with MTP against no speculation,
with a Gemma-4-31B-shaped target in sglang's own engine - stock sglang, and sglang with graphcap's flag (its draft
capture, with sglang's verify attention or graphcap's).

Checkpoint: `bench/sglang_checkpoint.py --size user-scale` (the draft-shapes assistant, structured, and a 60-layer
target config whose checkpoint holds only the structure: embeddings, lm_head, norms, layer scalars). The engine loads
both models with load_format="dummy": the same random init, so every draft token is accepted and only the
iteration's time is measured. `--structured` loads the structured assistant from disk and the target's structure
over its dummy weights (graphcap.bench.target_weights: sglang's `update_weights_from_tensor` on the target runner
alone - its `update_weights_from_disk` also loads the draft runner, which fails on the target's embeddings), so the
draft's acceptance is the structured pair's: real, and what the record's `accept_len` measures.

Per engine (each in a child process of its own), per (batch, context): decode tokens/s per request from pairs of a short
and a long run of the same prompts (the same prefill in both) after two warm runs as long as the long one, and the
accept length sglang reports; at `--profile-batches` and the first context, and at every case of the `--sweep` (contexts
at `--profile-batch`), sglang's own profiler (`Engine.start_profile`, by stage, decode) over a few iterations, read back
as GPU time per phase (verify, draft, draft extend; decode for no-spec), the iteration period, the verify's top kernels,
and the host time of the draft call with the runtime calls inside it that waited on the GPU. A profiled row also gets
the rate its iteration gives (`profile_tok_s_per_req`: accept length over the period) and says where the wall-time
rate is off it (`rate_disagrees`: the short and long runs did not prefill alike - with the radix cache on and a small
sliding-window pool, sglang evicts the prompts' window and one run prefills again; graphcap.bench.user_scale_rows).
`--rate-from profile`: the profiled iteration alone gives the rate, after one warm run (no timed pair): two prefills
of a case instead of five, where the radix cache does not keep a long batch's prompts.
A case whose batch the engine's pool cannot hold at once is not run; its row names the sglang settings that would
hold it (graphcap.bench.sglang_pool).

    python bench/sglang_user_scale.py --ckpt DIR --out OUT.json [--engines nospec,sglang,graphcap]
        [--batches 1,8,32] [--contexts 2048] [--sweep 220,670,1270,1870,2460] [--profile-batches 1,8,32]
        [--cases 1x32768,8x32768,1x131072] [--steps 3] [--structured] [--trace] [--weights bf16|w8a8]
        [--context-length N] [--radix-cache] [--swa-full-tokens-ratio R] [--chunked-prefill-size N]
        [--mem-fraction F] [--triton-attention-num-kv-splits N] [--rate-from timed|profile] [--plan-only]

`--cases`: exactly these (batch, context) cases instead of every batch at every context, profiled where their batch
is one of `--profile-batches` (the long contexts: 1x32768,8x32768,1x131072 with --profile-batches 1,8).

`--weights w8a8` (with `--structured`, on a checkpoint written with `sglang_checkpoint.py --weights w8a8`): the user's
INT8 W8A8 target. sglang builds every linear layer of the target as its compressed-tensors W8A8 int8 scheme; after
the engine starts, graphcap.bench.target_weights.load_target_w8a8 loads random int8 projections (seeded; per-channel
fp32 scales that give the dequantized weights the bf16 init's scale) into every layer with load_format="direct", layer
by layer, then the structure loads as above. `--context-length`: the engine's (default: 8192, or what the longest
context needs); the checkpoint's max_position_embeddings must hold it (`sglang_checkpoint.py --max-pos`).
`--plan-only`: check the arguments against the checkpoint and print the plan (cases, profiled cases, engine batches,
context length).

`--trace`: graphcap's draft trace (graphcap.sglang.trace) in every MTP engine; each timed run's draft calls, their
host and GPU time (median, max, sum) and the slowest three, where a run's wall time goes that the profile's few
iterations do not show; and every run's timeline (warm runs included): the gaps between its draft calls.
`--fresh-jit-cache`: each engine with an empty Triton cache of its own, so a first-time compile shows in every
engine's warm runs, not only in the first engine's to serve on the machine.
`--restarts N`: an engine that dies before its last case starts again on the cases it left, at most N times within
its `--timeout` (`spawn_restarting`); each death is kept in its result's `restarts`. A start that died before its
first case (sglang refusing a pool the card cannot hold) is not repeated.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable

from graphcap.bench import target_weights as tw
from graphcap.bench import user_scale_engines
from graphcap.bench.served import exit_on_term
from graphcap.bench.user_scale_child import child, target_dir  # the child side: one engine
from graphcap.bench.user_scale_rows import summarize

# graphcap: the flag as a user turns it on (the plugin's defaults, its verify kernel included); graphcap-sglang-verify:
# the flag with sglang's own verify attention (--draft-graph-verify-attention sglang), what the verify kernel adds.
ENGINES = ("nospec", "sglang", "graphcap", "graphcap-sglang-verify")
DEFAULT_ENGINES = ENGINES[:3]
WEIGHTS = ("bf16", "w8a8")
PAGE_SIZE = 64  # sglang_engine_kwargs' page size: a request's KV ends on a page
MIN_CONTEXT_LENGTH = 8192  # the engine's context length where the cases need less (the recorded runs')


def context_length_for(contexts: Iterable[int], new: int, steps: int, page: int = PAGE_SIZE) -> int:
    """The context length an engine needs for prompts of `contexts` tokens and `new` new ones: the longest prompt, its
    new tokens, a verify's draft tokens past them (twice: the overlap scheduler's next one) and a page."""
    return max(contexts) + new + 2 * (steps + 1) + page


# -----------------------------------------------------------------------------------------------------------------
# parent


def spawn(cfg: dict, work: str, timeout: float, tag: str | None = None) -> dict:
    """One engine child of this script over `cfg`'s cases (graphcap.bench.user_scale_engines.spawn)."""
    return user_scale_engines.spawn(__file__, cfg, work, timeout, tag)


def spawn_restarting(cfg: dict, work: str, timeout: float, restarts: int = 0) -> dict:
    """One engine of this script over its cases, started again after a death (user_scale_engines.spawn_restarting)."""
    return user_scale_engines.spawn_restarting(__file__, cfg, work, timeout, restarts)


def profile_plan(batches: list[int], contexts: list[int], profiled: list[int], sweep_batch: int,
                 sweep: list[int]) -> list[tuple[int, int]]:
    """The (batch, context) cases sglang's profiler records: the profiled batches among the run's at the first
    context, and every case of the context sweep (the iteration per context is the sweep's question)."""
    first = [(b, contexts[0]) for b in batches if b in profiled]
    return first + [(sweep_batch, c) for c in sweep if (sweep_batch, c) not in first]


def write_record(path: str, results: dict) -> None:
    json.dump({"engines": results, "rows": summarize(results)}, open(path, "w"), indent=1)


def parse_cases(text: str) -> list[tuple[int, int]]:
    """`--cases`: "BxC,..." (batch x context), e.g. "1x32768,8x32768,1x131072"."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        b, sep, c = item.lower().partition("x")
        if not sep or not b.strip().isdigit() or not c.strip().isdigit() or int(b) < 1 or int(c) < 1:
            raise ValueError(f"--cases: {item!r} is not BATCHxCONTEXT (positive integers, e.g. 8x32768)")
        out.append((int(b), int(c)))
    if not out:
        raise ValueError("--cases: no case given (BATCHxCONTEXT, separated by commas)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help=f"of {', '.join(ENGINES)} (graphcap: the flag with the plugin's defaults; "
                         "graphcap-sglang-verify: the flag with sglang's verify attention)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--sweep", default="", help="contexts at --profile-batch after the first context's cases")
    ap.add_argument("--cases", default="", help="BATCHxCONTEXT,... (e.g. 1x32768,8x32768,1x131072): these cases "
                    "instead of --batches x --contexts (no --sweep); profiled where their batch is a --profile-batches")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-batch", type=int, default=8, help="the --sweep's batch")
    ap.add_argument("--profile-batches", default="",
                    help="batches profiled at the first context (default: --profile-batch); every --sweep case is")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--rate-from", choices=("timed", "profile"), default="timed",
                    help="timed: the rate from a short and a long run after two warm ones; profile: from the profiled "
                         "iteration alone, after one warm run (every case profiled): two prefills of a case, not "
                         "five, where the radix cache does not keep a long batch's prompts")
    ap.add_argument("--structured", action="store_true")
    ap.add_argument("--weights", choices=WEIGHTS, default="bf16",
                    help="the target's linear layers: bf16 (dummy), or w8a8: the user's INT8 W8A8 (needs --structured "
                         "and a checkpoint written with sglang_checkpoint.py --weights w8a8)")
    ap.add_argument("--trace", action="store_true", help="graphcap's draft trace around every draft call of the MTP "
                    "engines: per timed run, the draft calls' host and GPU time (one sync per 16 calls)")
    ap.add_argument("--radix-cache", action="store_true",
                    help="sglang's radix cache on: the warm, short, long and profiled runs of a case share its "
                         "prompts, so only the first prefills them (decode rates are differences of runs, which no "
                         "prefill enters; for long contexts, where five prefills of the batch take minutes)")
    ap.add_argument("--mem-fraction", type=float, default=0.88,
                    help="sglang's --mem-fraction-static: what the weights, CUDA graphs and KV pool may take")
    ap.add_argument("--swa-full-tokens-ratio", type=float, default=None,
                    help="sglang's --swa-full-tokens-ratio (sliding-window pool tokens per full-attention pool "
                         "token; sglang's default 0.8, used with the radix cache on): lower, the full-attention "
                         "pool holds more tokens - long contexts on an 80 GB card")
    ap.add_argument("--chunked-prefill-size", type=int, default=None,
                    help="sglang's --chunked-prefill-size: with the radix cache off sglang sizes the sliding-window "
                         "pool for two chunks in flight beside max-running-requests windows")
    ap.add_argument("--triton-attention-num-kv-splits", type=int, default=None,
                    help="sglang's --triton-attention-num-kv-splits (its decode kernel's most KV splits, default 8; "
                         "its help: larger is better at long context): the no-speculation baseline a long-context "
                         "user tunes (graphcap's verify and draft plan their own splits)")
    ap.add_argument("--context-length", type=int, default=None,
                    help=f"the engine's context length (default: {MIN_CONTEXT_LENGTH}, or what the longest context "
                         "with its new tokens needs); at most the checkpoint's max_position_embeddings")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per engine")
    ap.add_argument("--restarts", type=int, default=0,
                    help="start an engine that died (not timed out) after finishing a case again on its unfinished "
                         "cases, at most N times")
    ap.add_argument("--fresh-jit-cache", action="store_true",
                    help="each engine with an empty Triton cache of its own (TRITON_CACHE_DIR), so no engine loads "
                         "kernels another compiled: a first-time compile then shows in every engine's warm runs")
    ap.add_argument("--work", help="logs, configs and profiler traces (default: beside --out)")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the run's plan (cases, profiled cases, engine batches, context length) and exit")
    ap.add_argument("--child")
    ap.add_argument("--child-out")
    a = ap.parse_args(argv)
    if a.child:
        res = child(json.load(open(a.child)))
        json.dump(res, open(a.child_out, "w"))
        return 0
    if not a.ckpt or not a.out:
        ap.error("--ckpt and --out are required")
    if a.restarts < 0:
        ap.error(f"--restarts: a count >= 0, got {a.restarts}")
    if a.swa_full_tokens_ratio is not None and not 0 < a.swa_full_tokens_ratio <= 1:
        ap.error(f"--swa-full-tokens-ratio: a ratio in (0, 1] (sglang's bound), got {a.swa_full_tokens_ratio}")
    if a.chunked_prefill_size is not None and a.chunked_prefill_size <= 0:
        ap.error(f"--chunked-prefill-size: tokens > 0, got {a.chunked_prefill_size}")
    if a.triton_attention_num_kv_splits is not None and a.triton_attention_num_kv_splits < 1:
        ap.error(f"--triton-attention-num-kv-splits: splits >= 1, got {a.triton_attention_num_kv_splits}")
    if not 0 < a.mem_fraction < 1:
        ap.error(f"--mem-fraction: a fraction in (0, 1) (sglang's --mem-fraction-static), got {a.mem_fraction}")
    sglang_settings = {k: v for k, v in (("swa_full_tokens_ratio", a.swa_full_tokens_ratio),
                                         ("chunked_prefill_size", a.chunked_prefill_size),
                                         ("triton_attention_num_kv_splits", a.triton_attention_num_kv_splits))
                       if v is not None}
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error(f"--engines: unknown {bad}; choose from {', '.join(ENGINES)}")
    try:
        batches = [int(x) for x in a.batches.split(",")]
        contexts = [int(x) for x in a.contexts.split(",")]
        sweep = [int(x) for x in a.sweep.split(",") if x.strip()]
        profiled = [int(x) for x in a.profile_batches.split(",") if x.strip()] or [a.profile_batch]
    except ValueError:
        ap.error("--batches/--contexts/--sweep/--profile-batches: integers separated by commas")
    if a.cases:
        if sweep:
            ap.error("--cases and --sweep: give the sweep's cases in --cases")
        try:
            cases = parse_cases(a.cases)
        except ValueError as e:
            ap.error(str(e))
        profile_cases = [c for c in cases if c[0] in profiled]
    else:
        cases = [(b, c) for c in contexts for b in batches] + [(a.profile_batch, c) for c in sweep]
        profile_cases = profile_plan(batches, contexts, profiled, a.profile_batch, sweep)
    config_path = os.path.join(target_dir(a.ckpt), "config.json")
    if not os.path.isfile(config_path):
        ap.error(f"--ckpt {a.ckpt}: no target/config.json (write the pair with bench/sglang_checkpoint.py)")
    tcfg = json.load(open(config_path))
    have = tw.checkpoint_weights(tcfg)
    if have != a.weights:
        ap.error(f"--weights {a.weights}: {config_path} declares a {have} target (write the checkpoint with "
                 f"bench/sglang_checkpoint.py --weights {a.weights})")
    if a.weights == "w8a8" and not a.structured:
        ap.error("--weights w8a8 needs --structured: the int8 projections' weight update leaves sglang's "
                 "int8 weights transposed until the structure's weight update ends (load_target_w8a8)")
    unprofiled = [f"{b}x{c}" for b, c in cases if (b, c) not in profile_cases]
    if a.rate_from == "profile" and unprofiled:
        ap.error(f"--rate-from profile: {', '.join(unprofiled)} not profiled (their batches are not in "
                 "--profile-batches)")
    if a.repeats < 1:
        ap.error(f"--repeats: timed runs per case >= 1, got {a.repeats}")
    need = context_length_for([c for _, c in cases], a.new, a.steps)
    context_length = a.context_length if a.context_length is not None else max(MIN_CONTEXT_LENGTH, need)
    if context_length < need:
        ap.error(f"--context-length {context_length}: the longest case's context with its {a.new} new tokens needs "
                 f"{need}")
    max_pos = tcfg.get("max_position_embeddings")
    if max_pos is not None and context_length > max_pos:
        ap.error(f"context length {context_length} exceeds the checkpoint's max_position_embeddings {max_pos} "
                 f"({config_path}): write it with bench/sglang_checkpoint.py --max-pos {context_length} or more")
    engine_batches = sorted({b for b, _ in cases})  # the decode graphs and running requests every case needs
    if a.plan_only:
        print(json.dumps({"cases": cases, "profile_cases": profile_cases, "batches": engine_batches,
                          "context_length": context_length, "weights": a.weights, "engines": engines,
                          "radix_cache": a.radix_cache, "sglang_settings": sglang_settings,
                          "mem_fraction": a.mem_fraction, "rate_from": a.rate_from}))
        return 0
    work = a.work or os.path.join(os.path.dirname(os.path.abspath(a.out)), "user-scale-work")
    os.makedirs(work, exist_ok=True)
    results = {}
    try:
        for e in engines:
            cfg = {"engine": e, "ckpt": a.ckpt, "work": work, "batches": engine_batches, "cases": cases,
                   "steps": a.steps, "new": a.new, "repeats": a.repeats, "profile_cases": profile_cases,
                   "profile_steps": a.profile_steps, "structured": a.structured, "weights": a.weights,
                   "trace": a.trace, "mem_fraction": a.mem_fraction, "context_length": context_length,
                   "fresh_jit_cache": a.fresh_jit_cache, "vocab": tcfg["vocab_size"], "radix_cache": a.radix_cache,
                   "sglang_settings": sglang_settings, "rate_from": a.rate_from}
            results[e] = spawn_restarting(cfg, work, a.timeout, a.restarts)
            write_record(a.out, results)
    except user_scale_engines.Stopped as stop:  # what ran so far is written, the running engine's finished cases too
        results[stop.result["config"]["engine"]] = stop.result
        write_record(a.out, results)
        print(f"stopped: the record holds {', '.join(results)}", flush=True)
        raise
    for r in summarize(results):
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    with exit_on_term():  # a step limit's SIGTERM: the running engine is stopped, what ran is written
        raise SystemExit(main())
