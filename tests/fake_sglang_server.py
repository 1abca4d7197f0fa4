"""A stand-in for `python -m sglang.launch_server` on a CPU: sglang's HTTP API as far as sglang's benchmark client
and graphcap's server harness use it (/health, /generate and /v1/chat/completions streamed as sglang streams them,
/v1/models, /model_info, /server_info, /flush_cache), over a "model" whose greedy next token after x is x + 1
(special ids skipped), with a prefix cache that reports cached tokens, and - like graphcap's plugin in a scheduler -
a draft trace, a prefill trace and a Triton compile log under $GRAPHCAP_SGLANG_TRACE and a capture manifest with the
flag; and sglang's weight-update routes (/begin_weight_update, /update_weights_from_tensor, /end_weight_update), each
payload unpickled as sglang's scheduler unpickles it and logged (name, shape, dtype, sum) to $FAKE_SGLANG_WEIGHTS_LOG.

    python tests/fake_sglang_server.py --model-path CK/target --port P [any sglang flag]

Non-streamed /generate with return_logprob answers output_top_logprobs (the greedy token, then the next id
FAKE_SGLANG_MARGIN below it). Knobs for tests (environment): FAKE_SGLANG_DIVERGE=N - with the flag, the N-th request
(from 0) answers one token off from its 3rd token on; FAKE_SGLANG_STALL_AT=K - the K-th scheduler tick stalls 0.3 s
after logging a compile of "fake.kernels:_late" (what the harness must find inside the gap); FAKE_SGLANG_EXIT_AT=K -
the process dies at tick K. With --max-total-tokens, running requests whose prompts and replies pass it are
retracted (the youngest first, logged as sglang's scheduler logs it) and resumed when the rest fits.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from aiohttp import web

TICK_S = 0.002  # one "iteration" of the scheduler: every running request gets its next token
MARGIN = float(os.environ.get("FAKE_SGLANG_MARGIN", "4.0"))  # logprob gap between the greedy token and the next one
PREFILL_MS, FLAG_PREFILL_MS = 0.01, 0.25  # a prefill's recorded time: per new token, and added with the flag


class Model:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self.vocab = tokenizer.vocab_size

    def next(self, x: int) -> int:
        y = (x + 1) % self.vocab
        while y in self.special:
            y = (y + 1) % self.vocab
        return y


class Scheduler:
    """Requests in flight share ticks: each tick every request gets a token; the draft trace gets one row."""

    def __init__(self, model: Model, trace_dir: str | None, stall_at: int | None, exit_at: int | None,
                 max_tokens: int | None = None) -> None:
        self.model, self.trace_dir, self.stall_at, self.exit_at = model, trace_dir, stall_at, exit_at
        self.running: dict[str, asyncio.Queue] = {}
        self.max_tokens, self.tokens, self.held = max_tokens, {}, set()  # the pool; each request's KV; retracted
        self.ticks = 0
        self.cache: list[list[int]] = []  # prompts seen: the prefix cache
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)

    def cached(self, ids: list[int]) -> int:
        best = 0
        for p in self.cache:
            n = next((i for i, (a, b) in enumerate(zip(p, ids)) if a != b), min(len(p), len(ids)))
            best = max(best, n)
        self.cache.append(ids)
        return min(best, max(0, len(ids) - 1))

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if not self.running:
                continue
            self.ticks += 1
            if self.exit_at is not None and self.ticks >= self.exit_at:
                os._exit(3)
            t = time.perf_counter()
            if self.trace_dir:
                with open(os.path.join(self.trace_dir, f"draft-trace-{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps({"rids": sorted(self.running), "t": t, "gpu_ms": 0.1, "host_ms": 0.05,
                                        "seq_lens": None, "draft": []}) + "\n")
            if self.stall_at is not None and self.ticks == self.stall_at:
                if self.trace_dir:
                    with open(os.path.join(self.trace_dir, f"compiles-{os.getpid()}.jsonl"), "a") as f:
                        f.write(json.dumps({"kernel": "fake.kernels:_late", "variant": "_late[bs3]", "t": t + 0.001,
                                            "ms": 290.0, "serving": True, "preload": False}) + "\n")
                await asyncio.sleep(0.3)
            if self.max_tokens:
                self.retract_or_resume()
            for rid, q in list(self.running.items()):
                if rid not in self.held:
                    q.put_nowait(True)

    def retract_or_resume(self) -> None:
        live = [r for r in self.running if r not in self.held]
        used = sum(self.tokens.get(r, 0) for r in live)
        if used > self.max_tokens and len(live) > 1:
            young = max(live, key=lambda r: int(r[1:]))
            self.held.add(young)
            print(f"[fake] WARNING scheduler.py: KV cache pool is full. Retract requests. #retracted_reqs: 1, "
                  f"#new_tokens_gained: {self.tokens[young]}, #new_token_ratio: 0.7000 -> 0.9000", flush=True)
        elif self.held:
            old = min(self.held, key=lambda r: int(r[1:]))
            if not live or used + self.tokens.get(old, 0) <= self.max_tokens:  # alone, any request runs
                self.held.discard(old)


def build_app(args: argparse.Namespace, model: Model, sched: Scheduler) -> web.Application:
    diverge = (int(os.environ["FAKE_SGLANG_DIVERGE"]) if os.environ.get("FAKE_SGLANG_DIVERGE")
               and args.enable_draft_graph_capture else None)
    state = {"generates": 0, "rid": 0}
    name = args.model_path

    async def generate_ids(ids: list[int], max_new: int, stop: list[str], request_no: int, cached: int = 0):
        rid = f"r{state['rid']}"
        state["rid"] += 1
        if sched.trace_dir:  # its prefill as the plugin's trace records one: PREFILL_MS a new token, more with the flag
            ms = PREFILL_MS * (len(ids) - cached) + (FLAG_PREFILL_MS if args.enable_draft_graph_capture else 0.0)
            with open(os.path.join(sched.trace_dir, f"prefill-trace-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.perf_counter(), "rids": [rid], "extend_tokens": len(ids) - cached,
                                    "cached_tokens": cached, "host_ms": ms, "gpu_ms": ms}) + "\n")
        q: asyncio.Queue = asyncio.Queue()
        sched.running[rid] = q
        sched.tokens[rid] = len(ids)
        out: list[int] = []
        x = ids[-1] if ids else 4
        try:
            while len(out) < max_new:
                await q.get()
                sched.tokens[rid] += 1
                x = model.next(x)
                y = x + 1 if (request_no == diverge and len(out) >= 2) else x
                out.append(y)
                text = model.tok.decode(out, skip_special_tokens=True)
                hit = next((s for s in stop if s and s in text), None)
                if hit is not None:
                    yield out, text[:text.index(hit)].rstrip(), "stop"
                    return
                yield out, text, None if len(out) < max_new else "length"
        finally:
            sched.running.pop(rid, None)
            sched.tokens.pop(rid, None)
            sched.held.discard(rid)

    async def health(_):
        return web.Response(status=200)

    async def models(_):
        return web.json_response({"data": [{"id": name, "object": "model"}]})

    async def model_info(_):
        return web.json_response({"model_path": name, "tokenizer_path": name, "is_generation": True})

    async def server_info(_):
        return web.json_response({"chunked_prefill_size": 8192, "max_total_num_tokens": args.max_total_tokens or 100000,
                                  "cuda_graph_max_bs": 24, "page_size": 64, "attention_backend": "triton",
                                  "internal_states": [{"avg_spec_accept_length": 2.5}]})

    async def flush(_):
        sched.cache.clear()
        return web.Response(text="Cache flushed.\n")

    weights = {"open": None}

    def weights_log(rec: dict) -> None:
        path = os.environ.get("FAKE_SGLANG_WEIGHTS_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"port": args.port, **rec}) + "\n")

    def answer(ok: bool, message: str = ""):
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def begin_update(request):
        body = await request.json()
        if weights["open"] is not None:
            return answer(False, "a weight update is already open")
        weights["open"] = body.get("selector", "all")
        weights_log({"event": "begin", "selector": weights["open"]})
        return answer(True)

    async def update_tensor(request):
        import base64
        import pickle

        import torch  # noqa: F401 - torch's rebuild functions for the unpickling

        body = await request.json()
        if weights["open"] is None:
            return answer(False, "no weight update is open")
        payloads = body["serialized_named_tensors"]
        named = pickle.loads(base64.b64decode(payloads[0], validate=True))
        weights_log({"event": "update", "selector": body.get("selector"), "load_format": body.get("load_format"),
                     "ranks": len(payloads), "tensors": [[n, list(t.shape), str(t.dtype), float(t.double().sum())]
                                                         for n, t in named]})
        return answer(True)

    async def end_update(_):
        if weights["open"] is None:
            return answer(False, "no weight update is open")
        weights["open"] = None
        weights_log({"event": "end"})
        return answer(True)

    async def sse(request, events):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            async for payload in events:
                await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client went away: the request is dropped, as sglang aborts it
        return resp

    async def generate(request):
        body = await request.json()
        ids = body.get("input_ids") or model.tok.encode(body.get("text", ""), add_special_tokens=False)
        sp = body.get("sampling_params") or {}
        max_new, stop = int(sp.get("max_new_tokens", 16)), list(sp.get("stop") or [])
        request_no = state["generates"]
        state["generates"] += 1
        cached = sched.cached(list(ids))

        async def events():
            async for out, text, fr in generate_ids(list(ids), max_new, stop, request_no, cached):
                yield {"text": text, "meta_info": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                                                   "cached_tokens": cached, "spec_accept_length": 2.5,
                                                   "finish_reason": {"type": fr} if fr else None}}
        if body.get("stream"):
            return await sse(request, events())
        last = None
        async for ev in events():
            last = ev
        if body.get("return_logprob") and last is not None:  # the greedy token first, the next one margin below
            x, tops = ids[-1] if ids else 4, []
            for _ in range(last["meta_info"]["completion_tokens"]):
                y = model.next(x)
                z = model.next(y)
                top = [[-0.05, y, model.tok.decode([y])], [-0.05 - MARGIN, z, model.tok.decode([z])]]
                tops.append(top[:int(body.get("top_logprobs_num") or 1)])
                x = y
            last["meta_info"]["output_top_logprobs"] = tops
        return web.json_response(last)

    async def chat(request):
        body = await request.json()
        prompt = model.tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        ids = model.tok.encode(prompt, add_special_tokens=False)
        cached = sched.cached(list(ids))
        request_no = state["generates"]
        state["generates"] += 1

        async def events():
            yield {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            prev, n = "", 0
            async for out, text, fr in generate_ids(ids, int(body.get("max_tokens", 16)), [], request_no,
                                                    cached):
                delta, prev, n = text[len(prev):], text, len(out)
                yield {"choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": fr}]}
            yield {"choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                                            "prompt_tokens_details": {"cached_tokens": cached}}}
        return await sse(request, events())

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/health_generate", health), web.get("/v1/models", models),
                    web.get("/model_info", model_info), web.get("/server_info", server_info),
                    web.post("/flush_cache", flush), web.get("/flush_cache", flush), web.post("/generate", generate),
                    web.post("/v1/chat/completions", chat), web.post("/begin_weight_update", begin_update),
                    web.post("/update_weights_from_tensor", update_tensor), web.post("/end_weight_update", end_update)])

    async def start_loop(app):
        app["loop"] = asyncio.create_task(sched.loop())
    app.on_startup.append(start_loop)
    return app


def write_manifest(directory: str) -> None:
    """A capture manifest's fields the harness reads, as graphcap's plugin would write them."""
    os.makedirs(directory, exist_ok=True)
    m = {"buckets": [{"batch_size": b, "status": "captured", "replays": 0, "fallbacks": 0} for b in (1, 8, 24)],
         "oversize_fallbacks": 0, "serving": {"joins": 0, "resets": 0, "retracts": 0, "evictions_in_window": 0,
                                             "variants_preloaded": 0, "variants_preload_failed": 0,
                                             "variants_at_startup": 0, "variants_while_serving": 0,
                                             "late_compiles": []}}
    Path(directory, "sglang-assistant-w1024-s3-cudagraph.json").write_text(json.dumps(m))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--draft-graph-manifest-dir")
    ap.add_argument("--enable-draft-graph-capture", action="store_true")
    ap.add_argument("--max-total-tokens", type=int)
    args, _ = ap.parse_known_args()  # every other sglang flag is taken and ignored
    from transformers import AutoTokenizer

    model = Model(AutoTokenizer.from_pretrained(args.model_path))
    env = os.environ
    sched = Scheduler(model, env.get("GRAPHCAP_SGLANG_TRACE"),
                      int(env["FAKE_SGLANG_STALL_AT"]) if env.get("FAKE_SGLANG_STALL_AT") else None,
                      int(env["FAKE_SGLANG_EXIT_AT"]) if env.get("FAKE_SGLANG_EXIT_AT") else None,
                      args.max_total_tokens)
    if args.enable_draft_graph_capture and args.draft_graph_manifest_dir:
        write_manifest(args.draft_graph_manifest_dir)
    print(f"fake sglang server on {args.port}", flush=True)
    web.run_app(build_app(args, model, sched), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    sys.exit(main())
