"""One sglang engine in this process: the child side of bench/sglang_engine.py (its `--child`), which starts
`sglang.Engine` with or without the flag on a checkpoint, runs the cases its config names and returns what came out.

The environment each engine needs (kernel paths, graphcap's flag, trace and check switches) is set here, before
sglang is imported: the scheduler process the engine starts inherits it. Imports neither torch nor Triton at module
level, so that the parent, which imports this module, does not either.
"""
from __future__ import annotations

import json
import os
import time

from graphcap.bench.served import sglang_engine_kwargs
from graphcap.envvars import KERNEL_PATHS_ENV
from graphcap.sglang.compat import sglang_version
from graphcap.sglang.settings import PROJECTIONS

BUCKETS = [1, 2, 4, 8, 16, 32, 64]
STEPS = 3  # speculative_num_steps where a config names none (the script's --steps default)
SHORT_NEW = 32  # the short run's new tokens (speed): decode rate from the long run minus this one
# Triton's knob (graphcap.kernels.arch's TRITON_ENV), named here so that the parent imports no Triton (a test keeps
# them equal)
TRITON_ARCH_ENV = "TRITON_OVERRIDE_ARCH"


def engine_kwargs(cfg: dict) -> dict:
    extra = {"tp_size": cfg.get("tp", 1)}
    if cfg.get("max_total_tokens"):
        extra["max_total_tokens"] = cfg["max_total_tokens"]
    extra.update(cfg.get("engine", {}))  # a refusal case's settings over these
    draft = None if cfg["mode"] == "nospec" else os.path.join(cfg["ckpt"], "assistant")
    return sglang_engine_kwargs(os.path.join(cfg["ckpt"], "target"), draft, steps=cfg.get("steps", STEPS),
                                decode_batches=BUCKETS, max_running=cfg["max_running"], mem_fraction=0.6, **extra)


def enable_graphcap(cfg: dict) -> None:
    """The flag for an engine started in this process (the variable graphcap's plugin reads, as a launcher that
    parsed --enable-draft-graph-capture sets it), and GRAPHCAP_PDL=0 for graphcap-nopdl, before sglang is
    imported."""
    os.environ["GRAPHCAP_SGLANG_DRAFT_CAPTURE"] = json.dumps(
        {"enabled": True, "backend": cfg["backend"], "manifest_dir": cfg["manifest_dir"],
         "projections": cfg.get("projections", PROJECTIONS[0])})
    if cfg.get("pdl") is False:  # graphcap-nopdl: graphcap's kernels without programmatic dependent launch
        os.environ["GRAPHCAP_PDL"] = "0"


def refusal_child(cfg: dict) -> dict:
    """Start an engine with a setting graphcap refuses: the error it raised (type, message, seconds), or None where
    the engine started (then it is shut down)."""
    enable_graphcap(cfg)
    import sglang

    t0 = time.perf_counter()
    try:
        engine = sglang.Engine(**engine_kwargs(cfg))
    except Exception as e:  # what a user's engine start raises
        return {"config": cfg, "error_type": type(e).__name__, "message": str(e),
                "seconds": time.perf_counter() - t0}
    engine.shutdown()
    return {"config": cfg, "error_type": None, "message": None, "seconds": time.perf_counter() - t0}



def set_kernel_paths(cfg: dict) -> None:
    """This engine's kernel paths, before graphcap or sglang is imported (the scheduler inherits the environment):
    native leaves both variables unset; sm80 sets graphcap's switch and Triton's override from the start, so that
    sglang's own Triton kernels, compiled before graphcap's module is imported, lower for 80 too."""
    for k in (KERNEL_PATHS_ENV, TRITON_ARCH_ENV):
        os.environ.pop(k, None)
    paths = cfg.get("kernel_paths") or "native"
    if paths != "native":
        os.environ[KERNEL_PATHS_ENV] = paths
        os.environ[TRITON_ARCH_ENV] = paths  # arch.triton_arch()'s form: "sm80"


def write_progress(cfg: dict, **kw) -> None:
    """What the parent can read of a child that dies (sglang kills its own process tree on a scheduler's error):
    the sglang it imported, its kernel paths, whether the engine started."""
    path = cfg.get("progress_path")
    if not path:
        return
    d = json.load(open(path)) if os.path.exists(path) else {}
    d.update(kw)
    json.dump(d, open(path, "w"))


def generate(engine, reqs: list[dict], suffix: str = "", new_tokens: int | None = None) -> tuple[list, float]:
    params = [{"temperature": 0.0, "max_new_tokens": new_tokens or r["max_new"], "ignore_eos": True} for r in reqs]
    t = time.perf_counter()
    outs = engine.generate(input_ids=[r["prompt"] for r in reqs], sampling_params=params,
                           rid=[r["rid"] + suffix for r in reqs])
    return outs, time.perf_counter() - t


def run_child(cfg: dict) -> dict:
    set_kernel_paths(cfg)
    version = sglang_version()
    write_progress(cfg, sglang=version, kernel_paths=cfg.get("kernel_paths") if cfg.get("kernel_paths") != "native"
                   else None, started=False)
    if cfg.get("expect_sglang") and version != cfg["expect_sglang"]:
        raise RuntimeError(f"asked for sglang {cfg['expect_sglang']}, this process finds {version} (PYTHONPATH="
                           f"{os.environ.get('PYTHONPATH')!r})")
    if cfg.get("manifest_flush_s") is not None:  # timed checks: the manifest current within a second, no sync
        os.environ["GRAPHCAP_MANIFEST_FLUSH_S"] = str(cfg["manifest_flush_s"])
    if cfg.get("flush_manifest"):  # correctness runs (not timed): the engine is killed at shutdown, so keep the
        os.environ["GRAPHCAP_MANIFEST_FLUSH_S"] = "0"  # manifest current; and check every length graphcap reads
        os.environ["GRAPHCAP_SGLANG_CHECK"] = "1"  # or hands on against sglang's after each draft (one sync)
        os.environ["GRAPHCAP_SGLANG_TRACE_FLUSH"] = "1"  # the trace loses no draft call when the engine is killed
    if cfg.get("retract_every"):  # sglang's own test switch: retract running requests every N forwards (they are
        # re-queued and prefilled again), in the scheduler process the engine starts with this environment
        os.environ["SGLANG_TEST_RETRACT"] = "1"
        os.environ["SGLANG_TEST_RETRACT_INTERVAL"] = str(cfg["retract_every"])
    if cfg["mode"] == "graphcap":
        enable_graphcap(cfg)
    os.environ["GRAPHCAP_SGLANG_TRACE"] = cfg["trace_dir"]
    if cfg.get("profile_batches"):  # kernel tables of a few draft calls per batch (graphcap.sglang.trace)
        os.environ["GRAPHCAP_SGLANG_TRACE_PROFILE"] = ",".join(map(str, cfg["profile_batches"]))
    import sglang

    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(cfg))
    result = {"config": cfg, "startup_s": time.perf_counter() - t0, "cases": []}
    try:
        from graphcap.kernels.arch import device_arch  # after the start: the child's CUDA context changes nothing

        result["kernel_paths"] = device_arch().name  # as graphcap's planners see the GPU in this environment
        result["sglang"] = version
        write_progress(cfg, started=True, startup_s=result["startup_s"], kernel_paths=result["kernel_paths"])
        for case in cfg["cases"]:
            reqs = case["requests"]
            short_s, long_s = [], []
            if case.get("decode_rate"):  # warm up, then pairs of a short and a long run of the same prompts: the
                # decode rate is the extra tokens over the extra time, per pair (the last long run is the case's)
                generate(engine, reqs, "-warm", 8)
                for i in range(case.get("repeats", 1) - 1):
                    short_s.append(generate(engine, reqs, f"-short{i}", SHORT_NEW)[1])
                    long_s.append(generate(engine, reqs, f"-long{i}")[1])
                short_s.append(generate(engine, reqs, "-short", SHORT_NEW)[1])
            outs, wall = generate(engine, reqs)
            if case.get("decode_rate"):
                long_s.append(wall)
            result["cases"].append({"name": case["name"], "batch": case["batch"], "wall_s": wall,
                                    "short_s": short_s or None, "long_s": long_s or None, "outputs": [
                {"rid": r["rid"], "tokens": o["output_ids"], "verify_ct": o["meta_info"].get("spec_verify_ct"),
                 "completion": o["meta_info"].get("completion_tokens"),
                 "retractions": o["meta_info"].get("num_retractions")} for r, o in zip(reqs, outs)]})
            write_progress(cfg, cases_done=len(result["cases"]))
        if cfg.get("timed"):  # after the checks: their trace records are flushed by the timed calls' own flushes
            reqs = cfg["timed"]["requests"]
            generate(engine, reqs, "-warm", 8)
            _, wall = generate(engine, reqs)
            result["timed"] = {"batch": len(reqs), "wall_s": wall, "rids": [r["rid"] for r in reqs]}
    finally:
        engine.shutdown()
    return result
