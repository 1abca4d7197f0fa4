"""Load for a running sglang server, the way its users send it: sglang's own benchmark client
(`python -m sglang.bench_serving`), and clients of graphcap's own over HTTP for what that one does not do - a
multi-turn conversation over the OpenAI-compatible API with streaming, faults (clients that disconnect mid-stream,
one-token requests, stop strings, prompts past the window and past a prefill chunk, more requests than the largest
graph bucket), and a sustained mixed load for a soak.

Every request is greedy (temperature 0), so two servers given the same requests should give the same text; each
client returns per request what it got (text, time to first token, inter-token gaps, cached prompt tokens) for
`graphcap.bench.server_report` to compare and summarise. Prompts are random token ids of the server's own
tokenizer, decoded to text (`Words`). aiohttp and transformers are imported where used (sglang has both).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH_SERVING = (sys.executable, "-m", "sglang.bench_serving")


# -----------------------------------------------------------------------------------------------------------------
# sglang's own client


def bench_serving_args(url: str, tokenizer: str, out_file: str | Path, *, dataset: str, num_prompts: int,
                       concurrency: int, seed: int = 1, input_len: int = 1024, output_len: int = 256,
                       range_ratio: float = 0.0, request_rate: float = math.inf, dataset_path: str | None = None,
                       gsp: dict[str, int] | None = None, warmup_requests: int | None = None) -> list[str]:
    """`sglang.bench_serving`'s arguments: backend sglang (its native /generate, streamed), greedy, the per-request
    details (generated texts, cached tokens) in `out_file`; `warmup_requests`: its own warm-up (1 unless given)."""
    args = ["--backend", "sglang", "--base-url", url, "--tokenizer", tokenizer, "--dataset-name", dataset,
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--request-rate", str(request_rate), "--output-file", str(out_file), "--output-details",
            "--cache-report", "--disable-tqdm", "--ready-check-timeout-sec", "0", "--temperature", "0"]
    if warmup_requests is not None:
        args += ["--warmup-requests", str(warmup_requests)]
    if dataset in ("random", "random-ids"):
        args += ["--random-input-len", str(input_len), "--random-output-len", str(output_len),
                 "--random-range-ratio", str(range_ratio)]
        if dataset_path:
            args += ["--dataset-path", str(dataset_path)]
    elif dataset == "generated-shared-prefix":
        for k, v in (gsp or {}).items():
            args += [f"--gsp-{k.replace('_', '-')}", str(v)]
    return args


def run_bench_serving(args: Sequence[str], log_path: str | Path, out_file: str | Path,
                      command: Sequence[str] = BENCH_SERVING, timeout: float = 600.0) -> dict:
    """Run sglang's client; its last result line (bench_serving appends one JSON object per run), or
    {"error": ...}."""
    Path(out_file).unlink(missing_ok=True)
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([*command, *args], stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"sglang.bench_serving ran past {timeout:.0f} s"}
    try:
        lines = [ln for ln in Path(out_file).read_text().splitlines() if ln.strip()]
        return json.loads(lines[-1])
    except (OSError, IndexError, ValueError):
        tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"sglang.bench_serving exit status {rc}, no result: {' | '.join(tail)}"}


SUMMARY_KEYS = ("completed", "duration", "output_throughput", "request_throughput", "median_tpot_ms", "p99_tpot_ms",
                "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms", "accept_length",
                "total_output_tokens", "max_concurrency", "request_rate")


def summarize_bench(result: dict) -> dict:
    """The numbers a record keeps of one bench_serving run (the per-request texts go to comparisons)."""
    if "error" in result:
        return {"error": result["error"]}
    out = {k: result.get(k) for k in SUMMARY_KEYS}
    cache = result.get("cache_report") or {}
    out["cached_tokens"], out["prompt_tokens"] = cache.get("total_cached_tokens"), cache.get("total_prompt_tokens")
    errors = [e for e in result.get("errors") or [] if e]
    out["failed_requests"] = len(errors)
    if errors:
        out["first_error"] = " ".join(str(errors[0]).split())[:300]
    return out


def write_sharegpt(path: str | Path, words: Words, conversations: int = 400, seed: int = 0) -> Path:
    """A ShareGPT-format file of random text in the model's vocabulary: what sglang's `random` dataset samples its
    prompt tokens from (it would download ShareGPT otherwise; the GPU machine has no network)."""
    rng = random.Random(seed)
    data = [{"id": str(i), "conversations": [{"from": "human", "value": words.text(rng.randint(64, 1024), rng)},
                                             {"from": "gpt", "value": words.text(rng.randint(16, 256), rng)}]}
            for i in range(conversations)]
    Path(path).write_text(json.dumps(data))
    return Path(path)


# -----------------------------------------------------------------------------------------------------------------
# prompts


class Words:
    """Random text in a model's vocabulary: random ids from its tokenizer, special tokens left out, decoded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.ids = [i for i in range(tokenizer.vocab_size) if i not in special]

    @classmethod
    def load(cls, path: str) -> Words:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def text(self, n: int, rng: random.Random) -> str:
        return self.tokenizer.decode([rng.choice(self.ids) for _ in range(n)])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_prompt(self, messages: list[dict]) -> str:
        """The text a chat request's prompt is, as the server renders it (the model's chat template, the assistant's
        turn opened): what /generate takes to continue the same reply."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# -----------------------------------------------------------------------------------------------------------------
# one streamed request


@dataclass
class Reply:
    text: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # per output token after the first (a chunk's gap spread evenly)
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    aborted: bool = False  # the client closed the stream on purpose
    error: str | None = None
    start: float = 0.0  # time.perf_counter() at the request
    prompt: str | None = None  # the prompt as /generate text (a chat's rendered by its template): margins ask it again


async def stream(http, url: str, payload: dict, *, chat: bool, abort_after: int | None = None) -> Reply:
    """POST `payload` with streaming to sglang's native /generate (`chat` False) or /v1/chat/completions; reads the
    server-sent events to the end, or closes the connection after `abort_after` chunks with text (a client that
    goes away: sglang aborts the request)."""
    rep, t0 = Reply(start=time.perf_counter(), prompt=None if chat else payload.get("text")), time.perf_counter()
    last, chunks = t0, 0
    try:
        async with http.post(url, json=payload) as resp:
            if resp.status != 200:
                rep.error = f"HTTP {resp.status}: {' '.join((await resp.text()).split())[:300]}"
                return rep
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                new_text, tokens = _event(obj, rep, chat)
                if not new_text:  # a role or usage event (chat), or nothing new
                    rep.completion_tokens = max(rep.completion_tokens, tokens)
                    continue
                now = time.perf_counter()
                # /generate says how many tokens came; a chat chunk does not: one per chunk
                added = max(1, tokens - rep.completion_tokens) if tokens else 1
                if rep.ttft_s is None:
                    rep.ttft_s = now - t0
                else:
                    rep.itl_s += [(now - last) / added] * added
                last = now
                rep.text = rep.text + new_text if chat else new_text
                rep.completion_tokens = tokens if tokens else rep.completion_tokens + 1
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    rep.aborted = True
                    resp.close()  # drop the connection: the server sees the client gone
                    return rep
    except Exception as e:  # a server that went away mid-request is what the harness is there to see
        rep.error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return rep


def _event(obj: dict, rep: Reply, chat: bool) -> tuple[str, int]:
    """(the event's text: the whole text so far for /generate, the delta for chat; completion tokens or 0)."""
    if chat:
        usage = obj.get("usage") or {}
        if usage:
            rep.prompt_tokens = usage.get("prompt_tokens")
            rep.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        choices = obj.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            rep.finish_reason = choices[0]["finish_reason"]
        delta = choices[0].get("delta", {}).get("content") if choices else None
        return delta or "", usage.get("completion_tokens", 0) if usage else 0
    meta = obj.get("meta_info") or {}
    rep.prompt_tokens = meta.get("prompt_tokens", rep.prompt_tokens)
    rep.cached_tokens = meta.get("cached_tokens", rep.cached_tokens)
    fr = meta.get("finish_reason")
    if fr:
        rep.finish_reason = fr.get("type") if isinstance(fr, dict) else str(fr)
    return obj.get("text", ""), int(meta.get("completion_tokens") or 0)


def generate_payload(text: str, max_new_tokens: int, **sampling) -> dict:
    return {"text": text, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **sampling}}


def chat_payload(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def top_logprobs_payload(text: str, n: int) -> dict:
    """sglang's /generate request for one greedy token after `text` with its `n` most likely tokens, decoded."""
    return {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}, "return_logprob": True,
            "top_logprobs_num": n, "return_text_in_logprobs": True}


def top_logprobs(url: str, text: str, n: int = 2, timeout: float = 120.0) -> dict:
    """The target's `n` most likely next tokens after `text` (sglang's /generate, one greedy token, its logprobs):
    {"top": [[logprob, token id, token text], ...], "margin": first logprob - second}, or {"error": ...}."""
    from graphcap.bench.server import http_json

    status, body = http_json(url + "/generate", top_logprobs_payload(text, n), timeout=timeout)
    try:
        top = [list(t) for t in body["meta_info"]["output_top_logprobs"][0]]
    except (TypeError, KeyError, IndexError):
        return {"error": f"/generate answered {status}: {str(body)[:300]}"}
    return {"top": top, "margin": round(top[0][0] - top[1][0], 4) if len(top) > 1 else None}


async def _gather_limited(coros, limit: int) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c
    return await asyncio.gather(*(one(c) for c in coros))


def _session():
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=aiohttp.TCPConnector(limit=0))


# -----------------------------------------------------------------------------------------------------------------
# multi-turn conversations


async def multi_turn(url: str, model: str, words: Words, *, conversations: int = 8, rounds: int = 4,
                     system_tokens: int = 1024, user_tokens: int = 64, max_tokens: int = 96, flush: bool = False,
                     seed: int = 0) -> dict:
    """`conversations` chats sharing one system prompt, all in flight together, `rounds` rounds: each round adds a
    user turn, streams the replies, and appends each reply to its conversation - the history grows every round and
    every turn after the first can reuse the cached prefix. `flush`: /flush_cache between rounds (the hits then come
    from the shared system prompt alone, within a round). Per round: the replies and sglang's cached-token counts."""
    from graphcap.bench.server import http_json

    rng = random.Random(seed)
    system = words.text(system_tokens, rng)
    convs = [[{"role": "system", "content": system}] for _ in range(conversations)]
    out = []

    async def flush_cache() -> None:
        status, body = await asyncio.to_thread(http_json, url + "/flush_cache?timeout=60", {})
        if status != 200:
            raise RuntimeError(f"/flush_cache answered {status}: {body}")
    if flush:  # nothing cached from before: every hit is this run's own
        await flush_cache()
    async with _session() as http:
        for r in range(rounds):
            for c in convs:
                c.append({"role": "user", "content": words.text(user_tokens, rng)})
            replies = await asyncio.gather(*(stream(http, url + "/v1/chat/completions",
                                                    chat_payload(model, list(c), max_tokens), chat=True)
                                             for c in convs))
            for c, rep in zip(convs, replies):
                rep.prompt = words.chat_prompt(c)
                c.append({"role": "assistant", "content": rep.text})
            out.append([asdict(rep) for rep in replies])
            if flush and r < rounds - 1:
                await flush_cache()
    return {"rounds": out, "flush_between_rounds": flush}


# -----------------------------------------------------------------------------------------------------------------
# faults


async def faults(url: str, words: Words, *, largest_bucket: int, window: int, chunk: int, seed: int = 0,
                 pressure_requests: int = 48, pressure_tokens: int = 512) -> dict:
    """Each fault a server meets, in turn; after each, one real request must still be served (`alive`). Per fault
    the replies, for comparing with another server given the same faults (an aborted reply is not compared)."""
    rng = random.Random(seed)
    out: dict[str, dict] = {}
    async with _session() as http:
        gen = url + "/generate"

        async def alive() -> bool:
            rep = await stream(http, gen, generate_payload(words.text(16, rng), 4), chat=False)
            return rep.error is None and rep.completion_tokens >= 1

        # clients that disconnect mid-stream, beside requests that run to the end
        aborts = [stream(http, gen, generate_payload(words.text(rng.randint(32, 1500), rng), 256), chat=False,
                         abort_after=rng.randint(1, 24)) for _ in range(48)]
        whole = [stream(http, gen, generate_payload(words.text(rng.randint(32, 1500), rng), 128), chat=False)
                 for _ in range(16)]
        reps = await _gather_limited(aborts + whole, 24)
        out["aborts"] = {"replies": [asdict(r) for r in reps], "alive": await alive()}
        # one output token
        reps = await asyncio.gather(*(stream(http, gen, generate_payload(words.text(rng.randint(8, 600), rng), 1),
                                             chat=False) for _ in range(16)))
        out["one_token"] = {"replies": [asdict(r) for r in reps], "alive": await alive()}
        # prompts longer than the window and than a prefill chunk, beside short ones
        lens = [window + 300, chunk + 1000] + [rng.randint(16, 256) for _ in range(8)]
        reps = await asyncio.gather(*(stream(http, gen, generate_payload(words.text(n, rng), 64), chat=False)
                                      for n in lens))
        out["long_prompts"] = {"prompt_tokens": lens, "replies": [asdict(r) for r in reps], "alive": await alive()}
        # stop strings: each prompt's own greedy continuation, then again stopped at its 10th word
        prompts = [words.text(rng.randint(16, 512), rng) for _ in range(12)]
        free = await asyncio.gather(*(stream(http, gen, generate_payload(p, 24), chat=False) for p in prompts))
        stops = [f.text.split()[9] if len(f.text.split()) > 9 else None for f in free]
        stopped = await asyncio.gather(*(stream(http, gen, generate_payload(p, 24, stop=[s] if s else []),
                                                chat=False) for p, s in zip(prompts, stops)))
        out["stop_strings"] = {"stops": stops, "free": [asdict(r) for r in free],
                               "replies": [asdict(r) for r in stopped], "alive": await alive()}
        # more requests in flight than the largest graph bucket
        n = largest_bucket + 16
        reps = await asyncio.gather(*(stream(http, gen, generate_payload(words.text(rng.randint(8, 64), rng), 32),
                                             chat=False) for _ in range(n)))
        out["over_largest_bucket"] = {"requests": n, "replies": [asdict(r) for r in reps], "alive": await alive()}
        # long replies all at once, more KV than admission reserves for them: a small pool (a `-small` server)
        # must retract running requests and serve them again (counted from sglang's log: `retractions`)
        reps = await asyncio.gather(*(stream(http, gen, generate_payload(words.text(rng.randint(200, 600), rng),
                                                                         pressure_tokens, ignore_eos=True),
                                             chat=False) for _ in range(pressure_requests)))
        out["pool_pressure"] = {"requests": pressure_requests, "replies": [asdict(r) for r in reps],
                                "alive": await alive()}
    return out


def stop_string_errors(fault: dict) -> list[str]:
    """A stopped reply must be its free continuation up to (not including) the stop word."""
    bad = []
    for i, (stop, free, rep) in enumerate(zip(fault["stops"], fault["free"], fault["replies"])):
        if stop is None or rep.get("error"):
            continue
        want = free["text"].split()[:9]
        if rep["text"].split() != want:
            bad.append(f"request {i}: stopped at {stop!r} gave {rep['text'][:80]!r}, expected {' '.join(want)[:80]!r}")
    return bad


# -----------------------------------------------------------------------------------------------------------------
# a sustained mixed load


async def sustained(url: str, model: str, words: Words, *, duration_s: float, concurrency: int, seed: int = 0,
                    max_prompt: int = 4096) -> list[dict]:
    """`concurrency` clients, each sending its next request as soon as the last one ends, for `duration_s`: mostly
    random prompts (16..max_prompt tokens) and outputs (8..512), and among them turns of an ongoing conversation over
    the chat API, clients that go away mid-stream, one-token requests and stop strings. One record per request."""
    rng = random.Random(seed)
    deadline = time.perf_counter() + duration_s
    records: list[dict] = []

    async def client(k: int, http) -> None:
        r = random.Random(rng.random())
        history: list[dict] = [{"role": "system", "content": words.text(r.randint(256, 1024), r)}]
        while time.perf_counter() < deadline:
            kind = r.choices(["random", "turn", "abort", "one_token", "stop"], [60, 20, 8, 6, 6])[0]
            if kind == "turn":
                if len(history) > 9:
                    history = history[:1]
                history.append({"role": "user", "content": words.text(r.randint(16, 128), r)})
                rep = await stream(http, url + "/v1/chat/completions", chat_payload(model, list(history), 96),
                                   chat=True)
                history.append({"role": "assistant", "content": rep.text})
            else:
                text = words.text(min(max_prompt, int(r.paretovariate(1.2) * 64)), r)
                new = {"one_token": 1}.get(kind, r.randint(8, 512))
                extra = {"stop": [words.text(1, r)]} if kind == "stop" else {}
                rep = await stream(http, url + "/generate", generate_payload(text, new, **extra), chat=False,
                                   abort_after=r.randint(1, 16) if kind == "abort" else None)
            rec = asdict(rep)
            rec.update(kind=kind, client=k, text_chars=len(rep.text), text=None, prompt=None)  # thousands: no texts
            records.append(rec)

    async with _session() as http:
        await asyncio.gather(*(client(k, http) for k in range(concurrency)))
    return records
