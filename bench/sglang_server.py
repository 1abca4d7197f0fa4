"""sglang's HTTP server as users run it, with and without `--enable-draft-graph-capture`, under sglang's own benchmark
client and graphcap's clients (graphcap.bench.server, graphcap.bench.server_phases, graphcap.bench.load,
graphcap.bench.server_report).

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
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from graphcap.bench import load
from graphcap.bench import target_weights as tw
from graphcap.bench import server_report as rep
from graphcap.bench.options import OneLineParser
from graphcap.bench.served import exit_on_term, machine
from graphcap.bench.server import KINDS, LAUNCHER, Server, ServerConfig, ServerFailed
from graphcap.bench.server_phases import PHASES, margins_while_up, run_phases
from graphcap.bench.server_summary import summarize_server


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


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--range-ratio", type=float, default=0.5,
                    help="bench and rate: each request's lengths drawn from [ratio x len, len] (sglang.bench_serving's "
                         "--random-range-ratio; its own defaults are 1024 / 1024 / 0)")
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
        if not 0.0 <= a.range_ratio <= 1.0 or a.input_len < 1 or a.output_len < 1:
            raise ValueError(f"--range-ratio from 0 to 1 and --input-len, --output-len positive: got "
                             f"{a.range_ratio:g}, {a.input_len}, {a.output_len}")
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
                    "concurrency": a.concurrency, "lengths": f"{a.input_len}:{a.output_len}:{a.range_ratio:g}",
                    "servers": {}}
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
