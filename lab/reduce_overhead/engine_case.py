"""Issue 44's failing case, one engine: sglang's engine on the draft-shapes pair with graphcap's plugin and a capture
backend (`reduce-overhead`: refused by the plugin, lifted here for this experiment only), greedy, one batch of
requests, optionally under a wrapper (compute-sanitizer). Writes a summary JSON: crashed or not, the first CUDA
error line, the sanitizer's reports, the probe's per-draft events (lab/reduce_overhead/site/sitecustomize.py),
graphcap's manifest replays and the CUDA-graph-tree log lines of TORCH_LOGS=cudagraphs.

The engine is bench/sglang_engine.py's own child (`--child CONFIG`): the same engine arguments as the speed run that
crashed (page 64, triton attention, radix cache off, prefill graphs off, decode graph buckets 1..64,
max_running 64, NEXTN with 3 steps and topk 1), with only the buckets (`--buckets`), batch, prompt length and new
tokens chosen here. Needs CUDA, sglang 0.5.23 and the checkpoint (bench/sglang_checkpoint.py --size draft-shapes);
lab/reduce_overhead/gpu.sh sets those up.

Usage: python lab/reduce_overhead/engine_case.py --ckpt DIR --work DIR --out SUMMARY.json [--backend reduce-overhead]
       [--batch 1] [--prompt-len 2048] [--new 64] [--buckets 1,2,4,8,16,32,64] [--projections graphcap]
       [--wrap "compute-sanitizer --tool memcheck ..."] [--timeout-s 500]
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import random
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"
ENGINE = ROOT / "bench" / "sglang_engine.py"
BACKENDS = ("reduce-overhead", "inductor-cudagraph", "cudagraph")
REFUSED = ("reduce-overhead",)  # graphcap.sglang.config.UNSERVED_BACKENDS when this was written
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # bench/sglang_engine.py's decode graph buckets
CUDA_ERROR = re.compile(r"(CUDA error: [^\n]*|an illegal memory access[^\n]*|device-side assert[^\n]*"
                        r"|CUBLAS_STATUS_[A-Z_]+[^\n]*)")
SAN_SUMMARY = re.compile(r"=+ ERROR SUMMARY: \d+ errors?")
SAN_START = re.compile(r"^=+ (Invalid |Uninitialized |Error: |Race reported|Barrier error|Program hit|Malloc|Leaked)")
TREE_LOG = {"recorded": "Recording function", "warmed_up": "Running warmup function",
            "eager": "Running eager function", "re_recorded": "Re-recording function",
            "skipped": "skipping cudagraph"}


def _site():
    spec = importlib.util.spec_from_file_location("lab_ro_site", SITE / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # under this name it installs nothing (its switches act as `sitecustomize` only)
    return mod


def parse_buckets(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        out = []
    if not out or out[0] < 1:
        raise ValueError(f"--buckets: batch sizes >= 1 separated by commas, got {text!r}")
    return out


def child_config(a: argparse.Namespace, work: Path, vocab: int) -> dict:
    """bench/sglang_engine.py's child configuration for one engine and one case."""
    rng = random.Random(a.seed)
    reqs = [{"rid": f"ro-b{a.batch}-r{i}", "prompt": [rng.randrange(3, vocab) for _ in range(a.prompt_len)],
             "max_new": a.new} for i in range(a.batch)]
    cfg = {"tag": f"ro-{a.backend}", "mode": "graphcap" if a.backend else "sglang", "backend": a.backend,
           "ckpt": str(a.ckpt), "max_running": 64, "steps": a.steps, "tp": 1, "projections": a.projections,
           "trace_dir": str(work / "trace"), "manifest_dir": str(work / "manifests"),
           "progress_path": str(work / "progress.json"),
           "cases": [{"name": f"batch{a.batch}", "batch": a.batch, "requests": reqs}],
           "engine": {"cuda_graph_bs_decode": parse_buckets(a.buckets)}}
    if a.manifest_flush_s is not None:
        cfg["manifest_flush_s"] = a.manifest_flush_s
    return cfg


def child_env(a: argparse.Namespace, work: Path) -> dict:
    env = dict(os.environ)
    paths = [str(SITE), str(ROOT), str(ROOT / "tests" / "support")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                 if p and p not in paths])
    env["PYTHONUNBUFFERED"] = "1"
    if a.backend in REFUSED:
        env["GRAPHCAP_LAB_ALLOW"] = a.backend
    env["GRAPHCAP_LAB_PROBE"] = str(work / "probe")
    return env


def sanitizer_reports(text: str, lines: int = 40) -> list[str]:
    """compute-sanitizer's reports in `text`: each from its head line ("========= Invalid __global__ read ...",
    "========= Uninitialized ...", "========= Error: Race reported ...", "========= Program hit ...") through its
    indented detail lines (kernel, thread, address, host backtrace), at most `lines` lines each."""
    out, cur = [], None
    for line in text.splitlines():
        if SAN_START.match(line):
            cur = [line]
            out.append(cur)
        elif cur is not None and line.startswith("=========     ") and len(cur) < lines:
            cur.append(line)
        else:
            cur = None
    return ["\n".join(r) for r in out]


def summarize(log_text: str, work: Path) -> dict:
    """What the run's files say: CUDA errors, sanitizer reports, probe events, manifests, tree log lines."""
    out: dict = {"cuda_errors": sorted(set(CUDA_ERROR.findall(log_text)))[:10]}
    san = [log_text] + [Path(p).read_text(errors="replace") for p in sorted(glob.glob(str(work / "sanitizer*.log")))]
    summaries = [m for text in san for m in SAN_SUMMARY.findall(text)]
    reports = [r for text in san for r in sanitizer_reports(text)]
    out["sanitizer"] = {"summaries": summaries, "reports": len(reports), "first_reports": reports[:6]}
    events = []
    for p in sorted(glob.glob(str(work / "probe" / "probe-*.jsonl"))):
        events += [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]
    events.sort(key=lambda e: e.get("t", 0))
    out["probe"] = {"draft_calls": sum(e.get("event") == "draft-start" for e in events),
                    "sync_failed": [e for e in events if e.get("event") == "sync-failed"][:3],
                    "first_draft": next((e for e in events if e.get("event") == "draft-start"), None),
                    "last_events": events[-6:]}
    manifests = {}
    for p in glob.glob(str(work / "manifests" / "**" / "*.json"), recursive=True):
        try:
            m = json.load(open(p))
        except (OSError, ValueError):
            continue
        manifests[os.path.basename(p)] = {str(b.get("batch_size")): {k: b.get(k) for k in ("status", "replays",
                                                                                         "fallbacks")}
                                          for b in m.get("buckets", [])}
    out["manifests"] = manifests
    out["tree_log"] = {k: log_text.count(v) for k, v in TREE_LOG.items()}
    return out


def run(a: argparse.Namespace) -> dict:
    work = Path(a.work).resolve()
    for sub in ("trace", "manifests", "probe"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    if os.environ.get("GRAPHCAP_LAB_INDUCTOR"):
        _site().parse_inductor(os.environ["GRAPHCAP_LAB_INDUCTOR"])  # refused here, named, before a start
    vocab = json.load(open(Path(a.ckpt) / "target" / "config.json"))["vocab_size"]
    cfg_path, out_path, log_path = work / "child-config.json", work / "child-out.json", work / "child.log"
    json.dump(child_config(a, work, vocab), open(cfg_path, "w"))
    cmd = [*shlex.split(a.wrap), sys.executable, str(ENGINE), "--child", str(cfg_path), "--child-out", str(out_path)]
    from graphcap.bench.served import run_stoppable  # the engine's scheduler and detokenizer stopped with it

    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        rc, timed_out = run_stoppable(cmd, log, a.timeout_s, env=child_env(a, work), cwd=ROOT)
    seconds = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    res = {"backend": a.backend, "batch": a.batch, "prompt_len": a.prompt_len, "new": a.new,
           "buckets": parse_buckets(a.buckets), "projections": a.projections, "wrap": a.wrap or None,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("GRAPHCAP_LAB_", "TORCH_LOGS", "CUDA_LAUNCH",
                                                                          "TORCH_CUDA_SANITIZER", "PYTORCH_"))},
           "rc": rc, "seconds": round(seconds, 1), "timed_out": timed_out,
           "finished": out_path.exists() and rc == 0, **summarize(text, work)}
    res["crashed"] = not res["finished"] and not timed_out
    if out_path.exists():
        child = json.load(open(out_path))
        res["startup_s"] = child.get("startup_s")
        res["tokens"] = [o["tokens"] for c in child.get("cases", []) for o in c["outputs"]]
    res["log_tail"] = text[-4000:]
    return res


def verdict(res: dict) -> str:
    what = ("finished" if res["finished"] else "timed out" if res["timed_out"] else f"crashed (rc {res['rc']})")
    err = res["cuda_errors"][0] if res["cuda_errors"] else "no CUDA error line"
    failed = res["probe"]["sync_failed"]
    where = f"; first failing sync: {failed[0]['phase']} of draft call {failed[0]['call']}" if failed else ""
    san = res["sanitizer"]
    return (f"{res['backend'] or 'stock sglang'} batch {res['batch']}, buckets {res['buckets']}: {what} in "
            f"{res['seconds']} s after {res['probe']['draft_calls']} graphcap draft calls; {err}{where}; sanitizer: "
            f"{', '.join(san['summaries']) or 'none'} ({san['reports']} reports); tree log {res['tree_log']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="bench/sglang_checkpoint.py's output (target/ and assistant/)")
    ap.add_argument("--work", required=True, help="folder for the child's config, log, trace, manifests, probe")
    ap.add_argument("--out", required=True, help="the summary JSON")
    ap.add_argument("--backend", default="reduce-overhead",
                    help=f"graphcap's capture backend, of {', '.join(BACKENDS)}; '' for stock sglang's draft")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=2048, help="the crashing runs had 2048 and 512")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                    help="sglang's decode graph batch sizes, and so graphcap's buckets (default: the crash's)")
    ap.add_argument("--projections", default="graphcap", choices=("graphcap", "sglang"),
                    help="whose kernels run the draft's projections (the crash's commit had only sglang's)")
    ap.add_argument("--manifest-flush-s", type=float, default=None)
    ap.add_argument("--wrap", default="", help="a command the engine runs under, e.g. compute-sanitizer ...")
    ap.add_argument("--timeout-s", type=float, default=500.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    if a.backend and a.backend not in BACKENDS:
        ap.error(f"--backend: one of {', '.join(BACKENDS)} or '', got {a.backend!r}")
    if a.batch < 1 or a.prompt_len < 1 or a.new < 1 or a.steps < 1:
        ap.error("--batch, --prompt-len, --new and --steps must be >= 1")
    try:
        parse_buckets(a.buckets)
    except ValueError as e:
        ap.error(str(e))
    if a.batch > 64:
        ap.error("--batch: at most 64 (max_running)")
    if not (Path(a.ckpt) / "target" / "config.json").exists():
        ap.error(f"--ckpt {a.ckpt}: no target/config.json (make it with bench/sglang_checkpoint.py)")
    res = run(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(a.out, "w"), indent=1)
    print(verdict(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
