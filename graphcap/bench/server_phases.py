"""The phases bench/sglang_server.py runs while one server is up: sglang.bench_serving's random dataset at each
concurrency and request rate, its generated-shared-prefix dataset, graphcap's multi-turn, fault and soak clients
(graphcap.bench.load), GPU memory beside the soak, and the target's top tokens where two servers' replies part.
Each phase's outcome - or the error it raised - goes into the server's phases dict; the record is built from it
(graphcap.bench.server_report, graphcap.bench.server_summary)."""
from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

from graphcap.bench import load
from graphcap.bench import server_report as rep
from graphcap.bench.server import Server, ServerConfig, http_json

PHASES = ("bench", "rate", "gsp", "multiturn", "faults", "soak")


class MemorySampler:
    """GPU memory in use on device 0 every `every_s` (NVML), on the harness's clock; nothing without NVML."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            return
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), pynvml.nvmlDeviceGetMemoryInfo(h).used // 2**20))
            self._stop.wait(self.every_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def server_facts(url: str) -> dict:
    status, info = http_json(url + "/server_info")
    info = info if status == 200 and isinstance(info, dict) else {}

    def find(key: str):
        if key in info:
            return info[key]
        for v in info.values():
            if isinstance(v, dict) and key in v:
                return v[key]
        return None
    return {k: find(k) for k in ("chunked_prefill_size", "max_total_num_tokens", "max_running_requests",
                                 "cuda_graph_max_bs", "disable_radix_cache", "page_size", "attention_backend")}


OPEN_LOOP = 4096  # bench_serving's --max-concurrency for the rate phase: more than any server here admits


def rate_key(rate: float) -> str:
    return f"{rate:g}"


def random_run(cfg: ServerConfig, args: argparse.Namespace, work: Path, data: Path, key: str, *, concurrency: int,
               request_rate: float = float("inf")) -> dict:
    """sglang.bench_serving's random dataset - the same --num-prompts requests in every run (seed 1) - at one
    concurrency cap and request rate: its summary and the generated texts."""
    f = work / f"{cfg.label}-{key}.jsonl"
    # no client warm-up (the harness warmed the server): every prefill batch in the run's window is the run's
    a = load.bench_serving_args(cfg.url, cfg.model_path, f, dataset="random", num_prompts=args.num_prompts,
                                concurrency=concurrency, input_len=args.input_len, output_len=args.output_len,
                                range_ratio=args.range_ratio, seed=1, dataset_path=data, request_rate=request_rate,
                                warmup_requests=0)
    t0 = time.perf_counter()  # the server's prefill trace stamps its batches on this clock (one per machine)
    res = load.run_bench_serving(a, work / f"{cfg.label}-{key}.log", f, command=args.bench_serving)
    return {"summary": load.summarize_bench(res), "texts": res.get("generated_texts"),
            "window": [t0, time.perf_counter()]}


def run_phases(srv: Server, args: argparse.Namespace, words: load.Words, work: Path, shared: dict) -> dict:
    cfg, url, out = srv.cfg, srv.cfg.url, {}
    model = str(Path(cfg.model_path))
    tok = cfg.model_path
    for phase in args.phases:
        t0 = time.perf_counter()
        if (args.deadline is not None and time.time() > args.deadline) or (phase == "soak"
                                                                             and cfg.kind not in args.soak_on):
            out.setdefault("not_run", []).append(phase)  # past the call's time; or a soak this server is not given
            continue
        try:
            if phase == "bench":
                data = shared.setdefault("sharegpt", load.write_sharegpt(work / "sharegpt.json", words, seed=7))
                warm = load.bench_serving_args(url, tok, work / f"{cfg.label}-warm.jsonl", dataset="random",
                                               num_prompts=2 * max(args.concurrency), concurrency=max(args.concurrency),
                                               input_len=args.input_len, output_len=64, seed=99, dataset_path=data)
                load.run_bench_serving(warm, work / f"{cfg.label}-warm.log", work / f"{cfg.label}-warm.jsonl",
                                       command=args.bench_serving)
                out[phase] = {str(c): random_run(cfg, args, work, data, f"bench-c{c}", concurrency=c)
                              for c in args.concurrency}
            elif phase == "rate":  # open loop: Poisson arrivals at each rate, no cap on requests in flight
                data = shared.setdefault("sharegpt", load.write_sharegpt(work / "sharegpt.json", words, seed=7))
                out[phase] = {rate_key(r): random_run(cfg, args, work, data, f"rate-r{rate_key(r)}",
                                                      concurrency=OPEN_LOOP, request_rate=r)
                              for r in args.request_rates}
            elif phase == "gsp":
                f = work / f"{cfg.label}-gsp.jsonl"
                a = load.bench_serving_args(url, tok, f, dataset="generated-shared-prefix", num_prompts=32,
                                            concurrency=8, seed=3, gsp=dict(num_groups=4, prompts_per_group=8,
                                                                          system_prompt_len=2048, question_len=128,
                                                                          output_len=128))
                res = load.run_bench_serving(a, work / f"{cfg.label}-gsp.log", f, command=args.bench_serving)
                out[phase] = {"summary": load.summarize_bench(res), "texts": res.get("generated_texts")}
            elif phase == "multiturn":
                out[phase] = {key: asyncio.run(load.multi_turn(url, model, words, flush=flush, seed=5))
                              for key, flush in (("kept", False), ("flushed", True))}
            elif phase == "faults":
                facts = server_facts(url)
                largest = shared.setdefault("largest_bucket", args.largest_bucket or facts.get("cuda_graph_max_bs")
                                            or 256)
                chunk = shared.setdefault("chunk", facts.get("chunked_prefill_size") or 8192)
                out[phase] = asyncio.run(load.faults(url, words, largest_bucket=int(largest), window=args.window,
                                                     chunk=int(chunk), seed=11, pressure_requests=args.pressure[0],
                                                     pressure_tokens=args.pressure[1]))
                out[phase]["facts"] = facts
            elif phase == "soak":
                start = time.perf_counter()
                duration = args.soak_s if args.deadline is None else min(args.soak_s, args.deadline - time.time())
                out["soak_s"] = duration
                with MemorySampler() as mem:
                    recs = asyncio.run(load.sustained(url, model, words, duration_s=duration,
                                                      concurrency=args.soak_concurrency, seed=13))
                out[phase] = {"start": start, "warmup_end": start + args.soak_warmup_s, "records": recs,
                              "memory": rep.memory_trend(mem.samples, after=start + args.soak_warmup_s),
                              "memory_samples": mem.samples}
        except Exception as e:  # a phase that breaks is a finding: record it and go on to the next
            out[phase] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
        out.setdefault("seconds", {})[phase] = round(time.perf_counter() - t0, 1)
        responsive = srv.responsive()
        out.setdefault("alive_after", {})[phase] = responsive
        if not responsive:
            out["died"] = srv.why() if not srv.alive() else "alive but not answering /health"
            break
    return out


def margins_while_up(label: str, url: str, texts: dict[str, dict[str, list]], limit: int = 48) -> dict:
    """For each pair `label` makes with a server that ran before it, where their replies part: the target's top two
    next tokens there, asked of `label`'s server while it is up (the replies agree up to that word, so either
    server's target answers the same question). At most `limit` per pair. {pair: {phase key: {(request, word): ...}}}"""
    out: dict = {}
    for a, b in rep.compared_pairs(list(texts)):
        if label not in (a, b) or a not in texts or b not in texts:
            continue
        asked = 0
        for k, replies in texts[label].items():
            other = texts[b if label == a else a].get(k)
            if other is None or len(other) != len(replies):
                continue
            for d in rep.replies_compared(texts[a][k], texts[b][k])["differ"]:
                text = rep.continuation(replies[d["request"]], d["first_word"])
                if text is None or asked >= limit:
                    continue
                out.setdefault(f"{a} vs {b}", {}).setdefault(k, {})[(d["request"], d["first_word"])] = \
                    load.top_logprobs(url, text)
                asked += 1
    return out
