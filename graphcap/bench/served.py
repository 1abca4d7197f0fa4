"""`graphcap bench --served`: the draft the plugin serves, timed where it runs - sglang's own engine - against stock
sglang's draft and against no speculation, on a model pair sglang loads (your own, or a synthetic pair).

Each engine runs in a child process of its own (`python -m graphcap.bench.served --child CFG OUT`, in its own process
group, stopped with everything it started): `sglang.Engine` in-process, prompts as token ids (random, seeded: the same
in every engine), greedy. Per batch B: a warm-up run as long as the long run (a first-time cost at any length the timed
runs reach, such as a JIT compile, lands in it and not in whichever engine happens to run first), then `repeats` pairs
of a short and a long run of the same B prompts; decode tokens/s per request = a long run's extra tokens over its extra
time (the prefill is in both), the median over the pairs. The draft phase's GPU time comes from graphcap's draft trace
(`GRAPHCAP_SGLANG_TRACE`, graphcap.sglang.trace) around the draft worker's `draft` in both MTP engines: CUDA events, so
any stall the draft causes is in it; the median over the last three quarters of each long run's full-batch calls, the
median over the pairs. The trace's timestamps give the longest gap between two draft calls of a timed run: a gap far
above the median one is a stall inside the timing, and is named. The graphcap engine has the flag at its defaults.

This module's parent side imports neither torch nor sglang (the CLI asks torch whether there is CUDA); the children
do.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.metadata
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from graphcap.bench.options import SERVED_REPEATS
from graphcap.sglang.settings import DRAFT_CAPTURE_ENV, TRACE_ENV

ENGINES = ("nospec", "sglang", "graphcap")  # no speculation, stock sglang's MTP, MTP with the flag
SHORT_NEW = 32  # the short run's new tokens
REFERENCE_ONLY = ("spec", "modes", "iters", "warmup", "graphcap_backend")  # bench options --served refuses
STALL_FACTOR = 10  # a gap between two draft calls this many times the median gap is named as a stall


class ServedBenchError(ValueError):
    """A bad `--served` option: the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class ServedConfig:
    model_path: str
    draft_model_path: str
    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 2048
    new_tokens: int = 128
    steps: int = 3
    repeats: int = SERVED_REPEATS  # timed pairs of runs per batch
    engines: tuple[str, ...] = ENGINES
    load_format: str | None = None  # "dummy": sglang's random weights (every draft then agrees with the target)
    attention_backend: str = "triton"
    page_size: int = 64
    mem_fraction: float = 0.8
    timeout_s: float = 900.0  # per engine: start, every batch, shutdown
    seed: int = 0
    out: Path | None = None
    command: str = "graphcap bench --served"


def config_from_args(a: argparse.Namespace, command: str) -> ServedConfig:
    """`graphcap bench --served`'s options; ServedBenchError names what is wrong."""
    given = [f"--{k.replace('_', '-')}" for k in REFERENCE_ONLY if getattr(a, k, None) is not None]
    if given:
        raise ServedBenchError(f"{', '.join(given)}: options of the reference bench, not of --served")
    if not a.model_path or not a.draft_model_path:
        raise ServedBenchError("--served needs --model-path (the target) and --draft-model-path (its MTP assistant)")
    engines = tuple(e.strip() for e in (a.engines or ",".join(ENGINES)).split(","))  # an empty item is a bad name
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines or len(set(engines)) != len(engines):
        raise ServedBenchError(f"--engines: expected distinct names from {', '.join(ENGINES)}, got {a.engines!r}")
    for name, vals in (("--context", a.context), ("--steps", a.steps)):
        if vals is not None and len(vals) != 1:
            raise ServedBenchError(f"{name}: --served takes one value, got {','.join(map(str, vals))}")
    new = a.new_tokens if a.new_tokens is not None else ServedConfig.new_tokens
    if new <= SHORT_NEW:
        raise ServedBenchError(f"--new-tokens must exceed the short run's {SHORT_NEW}, got {new}")
    if a.repeats is not None and a.repeats < 1:
        raise ServedBenchError(f"--repeats must be >= 1, got {a.repeats}")
    return ServedConfig(a.model_path, a.draft_model_path, batches=a.batch or ServedConfig.batches,
                        context=a.context[0] if a.context else ServedConfig.context, new_tokens=new,
                        steps=a.steps[0] if a.steps else ServedConfig.steps, engines=engines,
                        repeats=a.repeats if a.repeats is not None else ServedConfig.repeats,
                        load_format=a.load_format, out=a.out, seed=a.seed, command=command)


# -----------------------------------------------------------------------------------------------------------------
# child: one engine


def prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + batch)
    return [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)]


def sglang_engine_kwargs(model_path: str, draft_model_path: str | None, *, steps: int, decode_batches,
                         max_running: int, mem_fraction: float, seed: int = 0, attention_backend: str = "triton",
                         page_size: int = 64, **extra) -> dict:
    """`sglang.Engine`'s settings for every engine graphcap starts (this bench and bench/'s harnesses, on both sglang
    versions): prompts as token ids, bf16, no radix cache (each run prefills its prompts), no prefill graphs, decode
    graphs for `decode_batches`; with a draft model, sglang's MTP chain of `steps` (topk 1, steps + 1 draft tokens).
    `extra` (sglang's own names) goes over these."""
    kw = dict(model_path=model_path, skip_tokenizer_init=True, dtype="bfloat16", attention_backend=attention_backend,
              page_size=page_size, disable_radix_cache=True, disable_prefill_cuda_graph=True,
              cuda_graph_bs_decode=list(decode_batches), max_running_requests=max_running, random_seed=seed,
              mem_fraction_static=mem_fraction, log_level="warning")
    if draft_model_path is not None:
        kw.update(speculative_algorithm="NEXTN", speculative_draft_model_path=draft_model_path,
                  speculative_num_steps=steps, speculative_eagle_topk=1, speculative_num_draft_tokens=steps + 1)
    kw.update(extra)
    return kw


def engine_kwargs(cfg: ServedConfig, engine: str) -> dict:
    """This bench's engines: decode graphs for exactly the batches measured, a context that holds the long run."""
    extra = {"load_format": cfg.load_format} if cfg.load_format else {}
    return sglang_engine_kwargs(
        cfg.model_path, None if engine == "nospec" else cfg.draft_model_path, steps=cfg.steps,
        decode_batches=sorted(set(cfg.batches)), max_running=max(cfg.batches), mem_fraction=cfg.mem_fraction,
        seed=cfg.seed, attention_backend=cfg.attention_backend, page_size=cfg.page_size,
        context_length=cfg.context + cfg.new_tokens + 2 * (cfg.steps + 1) + cfg.page_size, **extra)


def run_child(cfg: ServedConfig, engine_name: str) -> dict:
    import sglang

    from graphcap.sglang.compat import sglang_version

    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(cfg, engine_name))
    out = {"engine": engine_name, "startup_s": time.perf_counter() - t0, "sglang": sglang_version(), "cases": []}
    try:
        vocab = int(engine.tokenizer_manager.model_config.vocab_size)
        for b in cfg.batches:
            ids = prompts(b, cfg.context, vocab, cfg.seed)

            def gen(new: int, tag: str):
                t = time.perf_counter()
                outs = engine.generate(input_ids=ids, rid=[f"b{b}-{tag}-{i}" for i in range(b)], sampling_params=[
                    {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}] * b)
                return outs, time.perf_counter() - t

            gen(cfg.new_tokens, "warm")
            runs, tokens, verify = [], 0, []
            for r in range(cfg.repeats):
                _, short_s = gen(SHORT_NEW, f"short{r}")
                outs, long_s = gen(cfg.new_tokens, f"long{r}")
                runs.append({"short_s": short_s, "long_s": long_s, "rids": [f"b{b}-long{r}-{i}" for i in range(b)]})
                verify += [o["meta_info"].get("spec_verify_ct") for o in outs]
                tokens += sum(o["meta_info"]["completion_tokens"] for o in outs)
            out["cases"].append({"batch": b, "runs": runs, "tokens": [o["output_ids"] for o in outs],
                                 "accept_len": tokens / sum(verify) if all(verify) else None})
    finally:
        engine.shutdown()
    return out


# -----------------------------------------------------------------------------------------------------------------
# parent: engines in children


ERROR_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*|Segmentation fault.*|Killed$)")
# sglang's own words for "a scheduler failed, see above": the line above them says what broke
WRAPPERS = ("Initialization failed", "scheduler died during initialization", "scheduler is dead")


def failure(log: str) -> str | None:
    """The line that says what broke: the last exception line of a child's log (its scheduler's traceback lands in
    the same log) that is not sglang's wrapper for a scheduler's failure, else the last wrapper line, else None."""
    lines = [ln.strip() for ln in log.splitlines() if ERROR_LINE.match(ln)]
    own = [ln for ln in lines if not any(w in ln for w in WRAPPERS)]
    return (own or lines or [None])[-1]


def _exit_on_term(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_term() -> Iterator[None]:
    """SIGTERM as SystemExit(143) while the block runs. gpu-check's step limit stops a harness with `timeout`'s
    SIGTERM, which never reaches the engines and servers it started in process groups of their own: the exit passes
    through `run_stoppable`'s wait and the harness's `finally`s, which stop them (one left behind holds the GPU's
    memory while the call's next step starts)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop(proc: subprocess.Popen) -> None:
    """The child and every process it started (sglang's scheduler and detokenizer share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_stoppable(cmd: list[str], log, timeout: float | None, env: dict | None = None,
                  cwd: str | Path | None = None) -> tuple[int | None, bool]:
    """Run `cmd` (an engine's child) in a process group of its own, its output to the open file `log`: (exit status,
    timed out). Past `timeout` seconds (None: no limit), or on an exception while waiting (Ctrl-C, a SIGTERM handler's
    SystemExit), the child and every process it started are killed first: an engine left behind holds the GPU's
    memory while the next one starts. (`start_new_session`, not `process_group=`, which needs Python 3.11.)"""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        stop(proc)
        return proc.returncode, True
    except BaseException:
        stop(proc)
        raise


def run_engine(cfg: ServedConfig, engine: str, work: Path) -> dict:
    """One engine in a child process: its result, or {"crashed": True, "error": the line that says why, "log": path}."""
    out, log_path = work / f"{engine}.json", work / f"{engine}.log"
    cfg_path = work / f"{engine}-config.json"
    cfg_path.write_text(json.dumps({**asdict(cfg), "out": None}))
    env = {k: v for k, v in os.environ.items() if k != DRAFT_CAPTURE_ENV}
    env[TRACE_ENV] = str(work / f"trace-{engine}")
    if engine == "graphcap":  # the flag at its defaults, as `Engine(...)` users give it (docs/sglang.md)
        env[DRAFT_CAPTURE_ENV] = json.dumps({"enabled": True, "manifest_dir": str(work / "manifests")})
    with open(log_path, "w") as log:
        rc, timed_out = run_stoppable([sys.executable, "-m", "graphcap.bench.served", "--child", str(cfg_path),
                                       engine, str(out)], log, cfg.timeout_s, env=env)
    why = f"stopped after its {cfg.timeout_s:.0f} s" if timed_out else None
    if rc != 0 or not out.exists():
        return {"engine": engine, "crashed": True, "log": str(log_path),
                "error": why or failure(log_path.read_text(errors="replace")) or f"exit status {rc}"}
    return json.loads(out.read_text())


def read_trace(trace_dir: str | Path) -> list[dict]:
    rows = []
    for p in sorted(glob.glob(os.path.join(trace_dir, "draft-trace-*.jsonl"))):
        rows += [json.loads(line) for line in open(p)]
    return rows


def _full_batch(rows: list[dict], rids: list[str] | set[str]) -> list[dict]:
    want = set(rids)
    return [t for t in rows if len(t["rids"]) == len(want) and set(t["rids"]) == want and not t.get("profiled")]


def timed_draft_ms(rows: list[dict], rids: list[str] | set[str]) -> tuple[float | None, int]:
    """The median GPU time of the draft calls that ran exactly `rids` (the full batch of one timed run), over the last
    three quarters of them (the first calls warm up), profiled calls left out; and how many there were."""
    ms = [t["gpu_ms"] for t in _full_batch(rows, rids)]
    return (statistics.median(ms[len(ms) // 4:]) if ms else None), len(ms)


def call_gaps_ms(rows: list[dict], rids: list[str] | set[str]) -> list[float]:
    """The wall-clock gaps between consecutive draft calls of one timed run (the trace's `t`), ms: every call that ran
    any of its requests, the tail included: there the batch shrinks as requests finish and the run reaches lengths
    no shorter run does, so a first-time cost at those lengths shows as one long gap. A gap into a call that one of
    the run's requests joins is left out: it holds that request's prefill (a batch larger than the engine admits in
    one prefill joins in parts), the same in the short and the long run, so the tok/s difference cancels it."""
    want = set(rids)
    calls = sorted((t["t"], want.intersection(t["rids"])) for t in rows if "t" in t and want.intersection(t["rids"]))
    return [(b - a) * 1e3 for (a, ran), (b, runs) in zip(calls, calls[1:]) if runs <= ran]


def machine() -> dict:
    """The machine, as the parent sees it without importing torch or starting CUDA (a child's engine does)."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = driver = cc = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        if out:
            gpu, driver, cc = (x.strip() for x in out[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return {"gpu": gpu, "driver": driver, "compute_capability": cc, "python": platform.python_version(),
            "torch": version("torch"), "triton": version("triton")}  # sglang: each engine's child says its own


def rows_of(cfg: ServedConfig, results: dict[str, dict], work: Path) -> list[dict]:
    """One row per batch: each engine's decode tokens/s per request; the MTP engines' draft-phase ms and acceptance;
    whether graphcap's output tokens equal stock sglang's."""
    rows = []
    for b in cfg.batches:
        row: dict = {"batch": b}
        cases = {e: next((c for c in r.get("cases", []) if c["batch"] == b), None) for e, r in results.items()}
        for e, c in cases.items():
            extra = cfg.new_tokens - SHORT_NEW
            runs = c["runs"] if c else []
            row[f"{e}_tok_s"] = (statistics.median(extra / max(r["long_s"] - r["short_s"], 1e-9) for r in runs)
                                 if runs else None)
            if e != "nospec":
                trace = read_trace(work / f"trace-{e}")
                timed = [timed_draft_ms(trace, r["rids"]) for r in runs]
                ms = [m for m, _ in timed if m is not None]
                row[f"{e}_draft_ms"] = statistics.median(ms) if ms else None
                row[f"{e}_draft_calls"] = sum(n for _, n in timed)
                row[f"{e}_accept_len"] = c["accept_len"] if c else None
                gaps = [g for r in runs for g in call_gaps_ms(trace, r["rids"])]
                row[f"{e}_gap_ms"] = (statistics.median(gaps), max(gaps)) if gaps else None  # median, longest
        stock, ours = cases.get("sglang"), cases.get("graphcap")
        row["tokens_equal"] = (sum(x == y for x, y in zip(stock["tokens"], ours["tokens"])) if stock and ours
                               else None)  # requests whose output tokens are stock sglang's
        rows.append(row)
    return rows


def stalls(rows: list[dict], engines: tuple[str, ...]) -> list[str]:
    """A line per engine and batch whose timed runs hold a gap between two draft calls STALL_FACTOR times the
    median one: a stall inside the timing (its tok/s is then no steady rate; its draft ms, a median, is)."""
    out = []
    for r in rows:
        for e in engines:
            gap = r.get(f"{e}_gap_ms")
            if gap and gap[1] > STALL_FACTOR * gap[0]:
                out.append(f"{e}, batch {r['batch']}: a {gap[1]:.0f} ms gap between two draft calls in a timed run "
                           f"(median gap {gap[0]:.1f} ms): a stall inside the timing; its tok/s is not the steady "
                           "rate")
    return out


def table(rows: list[dict], engines: tuple[str, ...]) -> str:
    """Draft iterations/s (1000 / draft ms) and decode tokens/s per request against batch: only the engines run."""
    from tabulate import tabulate

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    head, body = ["batch"], []
    mtp = [e for e in ("sglang", "graphcap") if e in engines]
    head += [f"draft it/s {e}" for e in mtp] + (["draft stock/flag"] if len(mtp) == 2 else [])
    head += [f"tok/s {e}" for e in engines] + (["tokens equal"] if len(mtp) == 2 else [])
    for r in rows:
        line = [r["batch"]] + [f(1000 / r[f"{e}_draft_ms"] if r.get(f"{e}_draft_ms") else None) for e in mtp]
        if len(mtp) == 2:
            s, g = r.get("sglang_draft_ms"), r.get("graphcap_draft_ms")
            line.append(f(s / g if s and g else None, "{:.2f}x"))
        line += [f(r.get(f"{e}_tok_s")) for e in engines]
        if len(mtp) == 2:
            line.append("-" if r["tokens_equal"] is None else f"{r['tokens_equal']}/{r['batch']}")
        body.append(line)
    return tabulate(body, headers=head, disable_numparse=True)


def run(cfg: ServedConfig, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for e in cfg.engines:
        print(f"graphcap bench --served: {e} engine ...", file=sys.stderr, flush=True)
        results[e] = run_engine(cfg, e, work)
    return {"what": __doc__.split("\n\n")[0], "command": cfg.command, "config": {**asdict(cfg), "out": str(cfg.out)},
            "machine": machine(), "engines": {e: {k: r.get(k) for k in ("startup_s", "sglang", "crashed", "error",
                                                                          "log")} for e, r in results.items()},
            "rows": rows_of(cfg, results, work)}


def main(cfg: ServedConfig) -> int:
    """Run every engine, print the table (and a line per failed engine), write served.json under --out. 1 if an
    engine failed."""
    import tempfile

    work = Path(cfg.out) if cfg.out else Path(tempfile.mkdtemp(prefix="graphcap-served-"))
    with exit_on_term():
        record = run(cfg, work)
    print(f"sglang's engine on {record['machine']['gpu'] or 'an unnamed GPU'}, context {cfg.context}, {cfg.steps} "
          f"draft steps, {cfg.new_tokens} new tokens (records and logs: {work}). draft it/s: 1000 / the draft call's "
          "GPU ms; tok/s: decode tokens/s per request")
    print(table(record["rows"], cfg.engines))
    for line in stalls(record["rows"], cfg.engines):
        print(line)
    failed = {e: r for e, r in record["engines"].items() if r.get("crashed")}
    for e, r in failed.items():
        print(f"{e}: the engine failed: {r['error']} (log: {r['log']})")
    (work / "served.json").write_text(json.dumps(record, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":  # the child: python -m graphcap.bench.served --child CFG ENGINE OUT
    if len(sys.argv) != 5 or sys.argv[1] != "--child":
        sys.exit("usage: python -m graphcap.bench.served --child CONFIG.json ENGINE OUT.json (graphcap bench "
                 "--served starts these)")
    raw = json.loads(Path(sys.argv[2]).read_text())
    child_cfg = replace(ServedConfig(raw["model_path"], raw["draft_model_path"]),
                        **{k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k != "out"})
    Path(sys.argv[4]).write_text(json.dumps(run_child(child_cfg, sys.argv[3])))
