"""sglang's HTTP server as users run it, with and without `--enable-draft-graph-capture`, under sglang's own benchmark
client and graphcap's clients (graphcap.bench.server, graphcap.bench.load, graphcap.bench.server_report).

    python3 bench/sglang_server.py --ckpt CK --servers graphcap,sglang,nospec --phases bench,gsp,multiturn \
        --work W --out W/server.json

CK is a pair bench/sglang_checkpoint.py wrote (CK/target, CK/assistant, with their tokenizer); a target that holds
its structure alone (the 31B-shaped `user-scale` pair, any `--weights w8a8` target) starts on random layers
(`--load-format dummy`) and gets its structure - and the W8A8 target its seeded int8 layers first - through the
server's own weight-update API before any phase (`load_weights`, graphcap.bench.target_weights). Servers, one at a time,
each started as `python -m sglang.launch_server` with sglang's defaults (graphcap.bench.server.ServerConfig says
which settings differ and why): `nospec` (the target alone), `sglang` (stock MTP), `graphcap` (MTP with the flag),
and any of them with `-small` (a KV pool of --small-pool tokens: the radix cache evicts and sglang retracts) or,
for graphcap, `-check` (GRAPHCAP_SGLANG_CHECK=1: every draft checked against sglang's own tables, the window rings
included). Phases, each on every server:
- bench: sglang.bench_serving, random dataset (prompts from a ShareGPT-format file of the model's own words), the
  same requests at each --concurrency, after a warm-up run;
- rate: the same requests arriving at each --request-rates (Poisson, sglang.bench_serving's own), none capped;
- gsp: sglang.bench_serving's generated-shared-prefix dataset (prefix-cache hits across requests);
- multiturn: graphcap's chat client, 8 conversations x 4 rounds over /v1/chat/completions, streamed, each reply
  appended to its conversation; then again with /flush_cache between rounds;
- faults: disconnecting clients, one-token requests, prompts past the window and a prefill chunk, stop strings,
  more requests than the largest graph bucket; the server must answer after each;
- soak: --soak-s seconds of sustained mixed load at --soak-concurrency, on the servers --soak-on names (stock MTP
  beside the flag by default: the same load's pauses on both): gaps between draft calls (the draft trace; those a
  joining request's prefill held counted apart), Triton compiles after warm-up, GPU memory, latency per request kind.
Greedy throughout: the same requests give the same text on every server unless the numerics differ; the record
compares graphcap's texts with stock sglang's, and stock sglang's across its own runs (batching differs), and each
two servers' prefill batches of the same requests (`prefill_matched`: what one adds to a prefill pause).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import sys
import threading
import time
from pathlib import Path

from graphcap.bench import load
from graphcap.bench import target_weights as tw
from graphcap.bench import server_report as rep
from graphcap.bench.served import exit_on_term, machine
from graphcap.bench.server import KINDS, LAUNCHER, Server, ServerConfig, ServerFailed, http_json
from graphcap.bench.server_summary import summarize_server

PHASES = ("bench", "rate", "gsp", "multiturn", "faults", "soak")


def structure_only(ckpt: Path) -> bool:
    """A pair whose target checkpoint holds its structure alone (bench/sglang_checkpoint.py at the user-scale size,
    or any w8a8 target: `target_matrices` false in its summary)."""
    f = ckpt / "summary.json"
    return f.exists() and json.loads(f.read_text()).get("target_matrices") is False


def server_config(label: str, ckpt: Path, args: argparse.Namespace, port: int) -> ServerConfig:
    kind, *mods = label.split("-")
    extra: tuple[str, ...] = tuple(args.server_arg)
    if "small" in mods:
        extra += ("--max-total-tokens", str(args.small_pool))
    if structure_only(ckpt):  # random layers, then the structure (and int8 layers) over HTTP: load_weights
        extra += ("--load-format", "dummy")
        if kind != "nospec":
            extra += ("--speculative-draft-load-format", "auto")  # the structured assistant, from disk
    return ServerConfig(kind=kind, model_path=str(ckpt / "target"),
                        draft_model_path=None if kind == "nospec" else str(ckpt / "assistant"), steps=args.steps,
                        port=port, prefill_graphs=args.prefill_graphs, check="check" in mods, extra_args=extra,
                        name=label)


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


FIRST_START_S = 120.0  # a first server's start on a fresh machine (empty Triton cache, the 31B-shaped pair)


def min_phase_s(args: argparse.Namespace, kind: str) -> float:
    """The least time after its start that makes a server worth starting: a soak's warm-up and half a minute of it
    where a soak is all this server would run, else a minute of phases."""
    if args.phases == ["soak"] and kind in args.soak_on:
        return args.soak_warmup_s + 30.0
    return 60.0


def time_short(deadline: float | None, now: float, startups: list[float], need_s: float) -> str | None:
    """Why a server should not start with `deadline` (epoch s) this close - its expected start-up (the longest this
    run has measured, FIRST_START_S before any) plus `need_s` of phases would not end by it - or None."""
    if deadline is None:
        return None
    expect = max(startups, default=FIRST_START_S)
    left = deadline - now
    if left >= expect + need_s:
        return None
    return f"{left:.0f} s of the call's time left; a start (~{expect:.0f} s) and its phases ({need_s:.0f} s) need more"


OPEN_LOOP = 4096  # bench_serving's --max-concurrency for the rate phase: more than any server here admits


def rate_key(rate: float) -> str:
    return f"{rate:g}"


def random_run(cfg: ServerConfig, args: argparse.Namespace, work: Path, data: Path, key: str, *, concurrency: int,
               request_rate: float = float("inf")) -> dict:
    """sglang.bench_serving's random dataset - the same --num-prompts requests in every run (seed 1) - at one
    concurrency cap and request rate: its summary and the generated texts."""
    f = work / f"{cfg.label}-{key}.jsonl"
    a = load.bench_serving_args(cfg.url, cfg.model_path, f, dataset="random", num_prompts=args.num_prompts,
                                concurrency=concurrency, input_len=args.input_len, output_len=args.output_len,
                                range_ratio=0.5, seed=1, dataset_path=data, request_rate=request_rate)
    res = load.run_bench_serving(a, work / f"{cfg.label}-{key}.log", f, command=args.bench_serving)
    return {"summary": load.summarize_bench(res), "texts": res.get("generated_texts")}


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


def load_weights(srv: Server, ckpt: Path, device: str) -> dict:
    """A structure-only target's weights, through the server's weight-update API (graphcap.bench.target_weights):
    the W8A8 target's seeded int8 layers first where its config declares them, then the structure. Both to the target
    runner alone; the structure in batches of at most 1 GiB beside the server on the GPU."""
    target = ckpt / "target"
    config = json.loads((target / "config.json").read_text())
    updates = tw.HttpUpdates(srv.cfg.url)
    out: dict = {"weights": tw.checkpoint_weights(config)}
    t0 = time.perf_counter()
    if out["weights"] == "w8a8":
        out["int8"] = tw.load_target_w8a8(updates, config, device=device)
        if not out["int8"]["ok"]:
            return {**out, "ok": False, "seconds": round(time.perf_counter() - t0, 1)}
    out["structure"] = tw.load_target_structure(updates, str(target), device=device, batch_bytes=2**30)
    return {**out, "ok": out["structure"]["ok"], "seconds": round(time.perf_counter() - t0, 1)}


def earlier_phases(directory: Path, labels: list[str]) -> dict[str, dict]:
    """The phases (replies included) an earlier run wrote for its servers (`<label>-phases.json` in its --work), for
    labels this run does not start. Raises ValueError naming the file that is missing, unreadable or not one."""
    if not directory.is_dir():
        raise ValueError(f"--phases-from: {directory} is not a directory")
    out = {}
    for f in sorted(directory.glob("*-phases.json")):
        label = f.name.removesuffix("-phases.json")
        if label in labels:
            continue
        try:
            phases = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--phases-from: {f} is not a phases file ({e})") from None
        if not isinstance(phases, dict):
            raise ValueError(f"--phases-from: {f} holds {type(phases).__name__}, not a server's phases")
        out[label] = phases
    if not out:
        raise ValueError(f"--phases-from: {directory} holds no <server>-phases.json of a server this run does not "
                         "start")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--servers", default="graphcap,sglang,nospec")
    ap.add_argument("--phases", default="bench,gsp,multiturn")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--request-rates", default="2,4", help="the rate phase's request rates (requests/s)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--window", type=int, default=1024, help="the checkpoint's sliding window (faults: past it)")
    ap.add_argument("--largest-bucket", type=int, default=None, help="faults: default sglang's cuda_graph_max_bs")
    ap.add_argument("--small-pool", type=int, default=24576, help="KV tokens of a -small server")
    ap.add_argument("--pressure", default="48x512",
                    help="faults' pool pressure: REQUESTSxTOKENS long replies at once (a -small server retracts)")
    ap.add_argument("--soak-s", type=float, default=480.0)
    ap.add_argument("--soak-concurrency", type=int, default=32)
    ap.add_argument("--soak-on", type=lambda v: tuple(v.split(",")), default=("graphcap", "sglang"),
                    help="the server kinds that run the soak phase (default graphcap,sglang)")
    ap.add_argument("--soak-warmup-s", type=float, default=60.0, help="the soak's first seconds: warm-up")
    ap.add_argument("--prefill-graphs", action="store_true", help="keep sglang's breakable prefill CUDA graphs")
    ap.add_argument("--startup-timeout", type=float, default=420.0)
    ap.add_argument("--until", type=float, default=None, help="epoch seconds: start no server after this")
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds: start no phase after this; a soak ends by then")
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                    help="one more sglang flag (or its value) for every server, e.g. --server-arg=--context-length "
                         "--server-arg=8192; listed with the record's departures from sglang's defaults")
    ap.add_argument("--phases-from", type=Path, default=None,
                    help="an earlier run's --work directory (or a copy of its <server>-phases.json files): the replies "
                         "of its servers that this run does not start are compared with this run's, as if they had "
                         "run here (for a comparison split over device calls)")
    ap.add_argument("--variants-from", type=Path, default=None,
                    help="a directory of graphcap variants files (an earlier run's manifest directory) for every "
                         "graphcap server to compile at start-up")
    # for tests on a CPU: a stand-in server, sglang's client with stubs for what it imports and never uses there
    ap.add_argument("--launcher", default=" ".join(LAUNCHER), help=argparse.SUPPRESS)
    ap.add_argument("--bench-serving", default=" ".join(load.BENCH_SERVING), help=argparse.SUPPRESS)
    ap.add_argument("--weights-device", default="cuda", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.launcher, a.bench_serving = tuple(shlex.split(a.launcher)), tuple(shlex.split(a.bench_serving))
    try:
        a.concurrency = [int(x) for x in a.concurrency.split(",")]
        raw, a.request_rates = a.request_rates, []
        try:
            a.request_rates = [float(x) for x in raw.split(",") if x]
        except ValueError:
            pass
        if not a.request_rates or not all(0 < r < float("inf") for r in a.request_rates):
            raise ValueError(f"--request-rates: finite requests per second > 0, got {raw!r}")
        n, _, t = a.pressure.partition("x")
        if not (n.isdigit() and t.isdigit() and int(n) > 0 and int(t) > 0):
            raise ValueError(f"--pressure: REQUESTSxTOKENS, both positive, got {a.pressure!r}")
        a.pressure = (int(n), int(t))
        a.phases = [p for p in a.phases.split(",") if p]
        bad = [p for p in a.phases if p not in PHASES]
        if bad or any(c < 1 for c in a.concurrency):
            raise ValueError(f"--phases from {', '.join(PHASES)}, --concurrency positive: got {bad or a.concurrency}")
        if not set(a.soak_on) <= set(KINDS):
            raise ValueError(f"--soak-on: kinds from {', '.join(KINDS)}, got {','.join(a.soak_on)}")
        labels = [s for s in a.servers.split(",") if s]
        for i, label in enumerate(labels):
            server_config(label, a.ckpt, a, a.port + i)
        earlier = earlier_phases(a.phases_from, labels) if a.phases_from is not None else {}
    except ValueError as e:
        print(f"sglang_server: {e}", file=sys.stderr)
        return 2
    a.work.mkdir(parents=True, exist_ok=True)
    words = load.Words.load(str(a.ckpt / "target"))
    record: dict = {"command": " ".join(sys.argv), "machine": machine(), "phases": a.phases,
                    "concurrency": a.concurrency, "servers": {}}
    texts: dict[str, dict] = {label: rep.texts_of(ph) for label, ph in earlier.items()}
    if earlier:
        record["phases_from"] = {label: str(a.phases_from / f"{label}-phases.json") for label in earlier}
    margins: dict = {}  # pair -> phase key -> (request, word) -> the target's top two tokens there
    shared: dict = {}
    startups: list[float] = []  # this run's measured start-ups: what the next start is expected to take
    prefills: dict[str, list] = {}  # each server's prefill batches: the same load's pauses compared across servers
    for i, label in enumerate(labels):
        if a.until is not None and time.time() > a.until:
            record["servers"][label] = {"not_run": "out of the call's time"}
            continue
        short = time_short(a.deadline, time.time(), startups, min_phase_s(a, label.split("-")[0]))
        if short is not None:
            record["servers"][label] = {"not_run": short}
            print(f"{label}: not started: {short}", flush=True)
            continue
        srv = Server(server_config(label, a.ckpt, a, a.port + i), a.work, startup_timeout_s=a.startup_timeout,
                     launcher=a.launcher)
        if a.variants_from and srv.cfg.kind == "graphcap":  # an earlier run's variants: compiled at this start-up
            srv.manifest_dir.mkdir(parents=True, exist_ok=True)
            for f in a.variants_from.glob("*-variants.json"):
                shutil.copy(f, srv.manifest_dir / f.name)
        try:
            srv.start()
        except ServerFailed as e:
            record["servers"][label] = {"failed_to_start": str(e), "log": str(srv.log_path)}
            print(f"{label}: {e}", flush=True)
            continue
        print(f"{label}: up in {srv.startup_s:.0f} s", flush=True)
        startups.append(srv.startup_s)
        weights = None
        try:
            if structure_only(a.ckpt):
                weights = load_weights(srv, a.ckpt, a.weights_device)
                print(f"{label}: weights {'loaded' if weights['ok'] else 'NOT loaded'} in {weights['seconds']} s",
                      flush=True)
            phases = run_phases(srv, a, words, a.work, shared) if weights is None or weights["ok"] else {}
            if phases and srv.alive():  # where its replies part from an earlier server's: the margin, asked now
                texts[label] = rep.texts_of(phases)
                for pair, by_key in margins_while_up(label, srv.cfg.url, texts).items():
                    for k, m in by_key.items():
                        margins.setdefault(pair, {}).setdefault(k, {}).update(m)
        finally:
            srv.stop()
        if weights is not None and not weights["ok"]:  # random layers would serve noise: no phase runs on them
            record["servers"][label] = {"weights_loaded": weights, "startup_s": srv.startup_s,
                                        "log": str(srv.log_path)}
            a.out.write_text(json.dumps(record, indent=1, default=str))
            continue
        (a.work / f"{label}-phases.json").write_text(json.dumps(phases))
        texts[label] = rep.texts_of(phases)
        record["servers"][label] = summarize_server(label, srv, phases)
        prefills[label] = rep.read_jsonl(srv.trace_dir / "prefill-trace-*.jsonl")
        if weights is not None:
            record["servers"][label]["weights_loaded"] = weights
        record["comparisons"] = rep.comparisons(texts, margins)
        a.out.write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps({label: {k: v for k, v in record["servers"][label].items()
                                  if k in ("startup_s", "died", "bench", "log_errors")}}, default=str)[:3000],
              flush=True)
    record["comparisons"] = rep.comparisons(texts, margins)
    record["prefill_matched"] = rep.prefill_comparisons(prefills)
    a.out.write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    with exit_on_term():  # a step limit's SIGTERM: each server is stopped on the way out (srv.stop in a finally)
        raise SystemExit(main())
