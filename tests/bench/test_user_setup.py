"""Issue 42's harness on CPU: bench/sglang_engine.py's per-engine record (sglang version, steps, kernel paths as
graphcap.kernels.arch names them in the engine's process, the timed draft phase, what broke), its engine children
(stopped with their processes at a deadline; what a failed one got to), the engine arguments against both real
sglang packages, and bench/user_setup.py's merge of partial records into docs/results/user-setup-h200.json's
schema (expected records written out here, not computed by the code under test)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench_scripts import load_bench_script
from graphcap.bench import engine_child as C  # the script's child side: one engine in this process

E = load_bench_script("sglang_engine")
U = load_bench_script("user_setup")
TESTS = Path(__file__).resolve().parents[1]
SGLANG_0518 = Path(os.environ.get("GRAPHCAP_SGLANG_0518") or Path(sys.prefix) / "sglang-0518")


def _ckpt(tmp_path: Path) -> Path:
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 64}))
    return tmp_path


# -----------------------------------------------------------------------------------------------------------------
# bench/sglang_engine.py


def test_the_switch_names_are_graphcaps_own():
    from graphcap import envvars
    from graphcap.kernels import arch

    assert (C.KERNEL_PATHS_ENV, C.TRITON_ARCH_ENV) == (envvars.KERNEL_PATHS_ENV, arch.TRITON_ENV)
    assert E.KERNEL_PATHS == ("native", *arch.PATHS)


def _fake_engine(monkeypatch, seen: list):
    """sglang with an Engine that records the environment it starts in and echoes greedy outputs."""
    import types

    class Engine:
        def __init__(self, **kw):
            seen.append({"kw": kw, **{k: os.environ.get(k) for k in (C.KERNEL_PATHS_ENV, C.TRITON_ARCH_ENV,
                                                                      "GRAPHCAP_SGLANG_CHECK",
                                                                      "GRAPHCAP_MANIFEST_FLUSH_S")}})
            self.calls = []

        def generate(self, input_ids, sampling_params, rid):
            self.calls.append(rid)
            return [{"output_ids": [7] * p["max_new_tokens"],
                     "meta_info": {"spec_verify_ct": 2, "completion_tokens": p["max_new_tokens"]}}
                    for p in sampling_params]

        def shutdown(self):
            pass

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))


@pytest.mark.parametrize("paths, name", [("native", "sm90"), ("sm80", "sm80")])
def test_child_sets_the_kernel_paths_before_sglang_and_records_what_arch_names(monkeypatch, tmp_path, paths, name):
    """sm80: graphcap's switch and Triton's override are in the environment sglang's engine starts with (its
    scheduler inherits it); native: neither, even where the parent had them set. The child records the sglang it
    imported and the paths as graphcap.kernels.arch describes the GPU (a CPU plans an H200's: sm90), and times a
    warm-up and the timed batch after the checks."""
    from graphcap.sglang.compat import sglang_version
    from graphcap.kernels import arch

    seen: list = []
    _fake_engine(monkeypatch, seen)
    for k in (C.KERNEL_PATHS_ENV, C.TRITON_ARCH_ENV, "GRAPHCAP_SGLANG_TRACE", "GRAPHCAP_MANIFEST_FLUSH_S",
              "GRAPHCAP_SGLANG_DRAFT_CAPTURE", "GRAPHCAP_SGLANG_CHECK"):
        monkeypatch.setenv(k, "sm80" if k in (C.KERNEL_PATHS_ENV, C.TRITON_ARCH_ENV) else "x")  # restored after
        monkeypatch.delenv(k)
    monkeypatch.setenv(C.KERNEL_PATHS_ENV, "sm80")  # a parent's setting: the child's own must win
    monkeypatch.setenv(C.TRITON_ARCH_ENV, "sm80")
    arch.kernel_paths.cache_clear()
    timed = [{"rid": f"ts8-r{i}", "prompt": [3, 4, 5], "max_new": 20} for i in range(3)]
    cfg = {"tag": "graphcap-cudagraph", "mode": "graphcap", "backend": "cudagraph", "ckpt": "/ckpt", "steps": 2,
           "kernel_paths": paths, "max_running": 4, "trace_dir": str(tmp_path / "t"), "manifest_dir": str(tmp_path),
           "manifest_flush_s": 1, "progress_path": str(tmp_path / "progress.json"),
           "cases": [{"name": "batch1", "batch": 1, "requests": [{"rid": "b1-r0", "prompt": [1, 2], "max_new": 4}]}],
           "timed": {"requests": timed}}
    try:
        res = C.run_child(cfg)
    finally:
        arch.kernel_paths.cache_clear()
    (start,) = seen
    want_env = "sm80" if paths == "sm80" else None
    assert (start[C.KERNEL_PATHS_ENV], start[C.TRITON_ARCH_ENV]) == (want_env, want_env)
    assert start["GRAPHCAP_SGLANG_CHECK"] is None and start["GRAPHCAP_MANIFEST_FLUSH_S"] == "1"
    assert start["kw"]["speculative_num_steps"] == 2 and start["kw"]["speculative_num_draft_tokens"] == 3
    assert res["kernel_paths"] == name and res["sglang"] == sglang_version()
    assert res["timed"] == {"batch": 3, "wall_s": res["timed"]["wall_s"], "rids": [r["rid"] for r in timed]}
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["started"] and progress["kernel_paths"] == name and progress["cases_done"] == 1


def test_child_refuses_an_sglang_other_than_the_one_asked_for(monkeypatch, tmp_path):
    seen: list = []
    _fake_engine(monkeypatch, seen)
    monkeypatch.setattr(C, "sglang_version", lambda: "0.5.23")
    cfg = {"tag": "sglang", "mode": "sglang", "ckpt": "/c", "cases": [], "max_running": 4, "trace_dir": str(tmp_path),
           "expect_sglang": "0.5.18", "progress_path": str(tmp_path / "p.json")}
    monkeypatch.setenv("GRAPHCAP_SGLANG_TRACE", "x")
    with pytest.raises(RuntimeError, match="asked for sglang 0.5.18, this process finds 0.5.23"):
        C.run_child(cfg)
    assert not seen  # no engine started
    assert json.loads((tmp_path / "p.json").read_text()) == {"sglang": "0.5.23", "kernel_paths": None,
                                                            "started": False}


def _write_trace(cfg: dict, calls: list[tuple[list[str], float]]) -> None:
    os.makedirs(cfg["trace_dir"], exist_ok=True)
    with open(os.path.join(cfg["trace_dir"], "draft-trace-1.jsonl"), "w") as f:
        for rids, ms in calls:
            f.write(json.dumps({"rids": rids, "seq_lens": None, "draft": [[1, 2]] * len(rids), "gpu_ms": ms,
                                "host_ms": 0.1}) + "\n")


def test_check_with_timing_runs_stock_once_graphcap_per_kernel_paths_and_records_each_engine(monkeypatch, tmp_path):
    """--check --time-batch 2 --kernel-paths native,sm80: stock sglang, then graphcap per paths, all with the same
    check cases and timed batch and no per-draft sync; each engine's entry names its sglang, steps and paths (a
    crashed one: what broke and whether it had started); draft_ms is the median of the timed batch's full-batch calls
    after the first quarter, here 8 calls each (ms listed, median of the last 6 taken by hand)."""
    spawned = []
    timed_ms = {"sglang": [9, 9, 3.0, 3.5, 2.75, 3.25, 3.0, 3.75],
                "graphcap-cudagraph": [9, 9, 1.0, 1.5, 1.25, 1.75, 0.75, 2.0]}

    def spawn(cfg, work):
        spawned.append(cfg)
        if cfg["tag"] == "graphcap-cudagraph-sm80":
            return {"config": cfg, "crashed": True, "rc": 1, "log_tail": "x\nRuntimeError: boom", "error":
                    "RuntimeError: boom", "progress": {"sglang": "0.5.18", "kernel_paths": "sm80", "started": True}}
        rids = cfg["timed"]["requests"]
        ids = [r["rid"] for r in rids]
        calls = [([r["rid"]], 0.5) for c in cfg["cases"] for r in c["requests"]]  # the checks' drafts
        calls += [([i + "-warm" for i in ids], 50.0)] + [(ids, ms) for ms in timed_ms[cfg["tag"]]]
        _write_trace(cfg, calls)
        return {"config": cfg, "startup_s": 20.0, "sglang": "0.5.18", "kernel_paths": "sm90",
                "timed": {"batch": len(ids), "wall_s": 1.0, "rids": ids},
                "cases": [{"name": c["name"], "batch": c["batch"], "outputs": [
                    {"rid": r["rid"], "tokens": [1, 2], "verify_ct": 1, "completion": 2} for r in c["requests"]]}
                    for c in cfg["cases"]]}

    monkeypatch.setattr(E, "spawn", spawn)
    cache = tmp_path / "triton-cache"
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "kernel.json").write_text(json.dumps({"arch": "sm80"}))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    out = tmp_path / "p.json"
    assert E.main(["--ckpt", str(_ckpt(tmp_path)), "--check", "--steps", "2", "--backends", "cudagraph",
                   "--kernel-paths", "native,sm80", "--time-batch", "2", "--check-batches", "1,8",
                   "--expect-sglang", "0.5.18", "--out", str(out)]) == 0
    assert [c["tag"] for c in spawned] == ["sglang", "graphcap-cudagraph", "graphcap-cudagraph-sm80"]
    assert [c.get("kernel_paths") for c in spawned] == [None, "native", "sm80"]
    for c in spawned:
        assert [k["batch"] for k in c["cases"]] == [1, 8] and len(c["timed"]["requests"]) == 2
        assert c["manifest_flush_s"] == 1 and not c.get("flush_manifest") and c["expect_sglang"] == "0.5.18"
        assert c["steps"] == 2
    rec = json.loads(out.read_text())
    chk = rec["check"]
    assert rec["expect_sglang"] == "0.5.18" and rec["time_batch"] == 2 and chk["requests"] == 9
    assert chk["check_batches"] == [1, 8]
    # the last 6 of 8: sorted 2.75, 3.0, 3.0, 3.25, 3.5, 3.75 -> 3.125; 0.75, 1.0, 1.25, 1.5, 1.75, 2.0 -> 1.375
    assert chk["stock"]["draft_ms"] == 3.125 and chk["stock"]["draft_calls"] == 8
    ours = chk["engines"]["cudagraph"]
    assert (ours["draft_ms"], ours["sglang"], ours["kernel_paths"], ours["steps"]) == (1.375, "0.5.18", "sm90", 2)
    bad = chk["engines"]["cudagraph-sm80"]
    assert bad["crashed"] and bad["started"] and bad["error"] == "RuntimeError: boom"
    assert (bad["sglang"], bad["kernel_paths"], bad["draft_ms"]) == ("0.5.18", "sm80", None)
    assert bad["triton_kernels_for_paths"] == 1 and "triton_kernels_for_paths" not in ours
    native = [c for c in chk["cases"] if c["engine"] == "cudagraph"]
    assert [(c["case"], c["tokens_equal"], c["drafts_equal"], c["drafts_compared"]) for c in native] == [
        ("batch1", 1, 1, 1), ("batch8", 8, 8, 8)]
    crashed = [c for c in chk["cases"] if c["engine"] == "cudagraph-sm80"]
    assert [(c["crashes"], c["tokens_equal"], c["kernel_paths"]) for c in crashed] == [(1, 0, "sm80")] * 2


def test_deadline_leaves_engines_unstarted_and_the_record_says_so(monkeypatch, tmp_path):
    """--until: with less than MIN_ENGINE_S left no engine starts; each is recorded as not run, none compared."""
    monkeypatch.setattr(E, "spawn", lambda cfg, work: pytest.fail("started an engine past the deadline"))
    out = tmp_path / "p.json"
    assert E.main(["--ckpt", str(_ckpt(tmp_path)), "--check", "--time-batch", "8", "--backends", "cudagraph",
                   "--kernel-paths", "native,sm80",
                   "--until", str(time.time() + E.MIN_ENGINE_S - 10), "--out", str(out)]) == 0
    chk = json.loads(out.read_text())["check"]
    assert chk["stock"]["not_run"] and chk["stock"]["started"] is None
    assert all(e["not_run"] and e["crashed"] is False for e in chk["engines"].values()) and len(chk["engines"]) == 2
    assert chk["cases"] == []


def test_arguments_of_the_new_options_are_checked_before_anything_starts(capsys):
    for argv, named in ((["--kernel-paths", "sm75"], "--kernel-paths"), (["--kernel-paths", "sm80,sm80"],
                                                                         "--kernel-paths"),
                        (["--kernel-paths", ","], "--kernel-paths"), (["--time-batch", "-1"], "--time-batch"),
                        (["--check-batches", "3"], "--check-batches"), (["--check-batches", "x"], "--check-batches")):
        with pytest.raises(SystemExit) as e:
            E.main(["--ckpt", "x", "--check", "--out", "o.json", *argv])
        assert e.value.code == 2 and named in capsys.readouterr().err


FAKE_CHILD = """\
import json, os, subprocess, sys, time
cfg = json.load(open(sys.argv[sys.argv.index("--child") + 1]))
json.dump({"sglang": "0.5.18", "kernel_paths": None, "started": False}, open(cfg["progress_path"], "w"))
if cfg["tag"] == "hang":  # an engine that never ends, with a process of its own (as sglang's scheduler)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(cfg["pid_file"], "w").write(str(p.pid))
    time.sleep(120)
print("Traceback (most recent call last):")
print("ImportError: cannot import name 'x' from 'torch._C' (sglang 0.5.18 on torch 2.11)")
print("[2026] Rank 0 scheduler is dead. Please check if there are relevant logs.")
sys.exit(1)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped by its parent is a zombie: dead for our purpose
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_spawn_reports_what_broke_and_stops_a_hung_engine_with_its_processes(monkeypatch, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    monkeypatch.setattr(E, "__file__", str(script))
    r = E.spawn({"tag": "dead", "mode": "sglang"}, str(tmp_path))
    assert r["crashed"] and not r["timed_out"] and r["rc"] == 1
    assert r["error"] == "ImportError: cannot import name 'x' from 'torch._C' (sglang 0.5.18 on torch 2.11)"
    assert r["progress"] == {"sglang": "0.5.18", "kernel_paths": None, "started": False}
    info = E.engine_info(r)
    assert (info["started"], info["sglang"], info["kernel_paths_asked"]) == (False, "0.5.18", "native")
    t = time.perf_counter()
    r = E.spawn({"tag": "hang", "mode": "sglang", "timeout_s": 3, "pid_file": str(tmp_path / "pid")}, str(tmp_path))
    assert r["crashed"] and r["timed_out"] and r["error"] == "stopped after its 3 s (--until)"
    assert time.perf_counter() - t < 60
    grandchild = int((tmp_path / "pid").read_text())
    deadline = time.time() + 10
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_triton_kernels_are_counted_by_the_capability_they_were_compiled_for(tmp_path):
    for d, meta in (("a", {"arch": "sm80", "name": "k"}), ("b", {"arch": "sm90"}), ("c", {"arch": "sm80"})):
        (tmp_path / d).mkdir()
        (tmp_path / d / "k.json").write_text(json.dumps(meta))
    (tmp_path / "c" / "__grp__k.json").write_text(json.dumps({"arch": "sm80"}))  # a group index, not a kernel
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "k.json").write_text("{torn")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "k.json").write_text("[1]")
    assert E.triton_kernels_for("sm80", str(tmp_path)) == 2 and E.triton_kernels_for("sm90", str(tmp_path)) == 1


def test_failure_names_the_last_exception_line_of_a_log():
    log = textwrap.dedent("""\
        [12:00:00] WARNING server_args.py: something harmless
        Traceback (most recent call last):
          File "/tmp/site-0.5.18/sglang/srt/managers/scheduler.py", line 10, in run_scheduler_process
            raise ValueError("inner")
        ValueError: inner
        During handling of the above exception, another exception occurred:
        torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
        [12:00:01] Received sigquit from a child process. It usually means the child failed.
        Traceback (most recent call last):
          File "bench/sglang_engine.py", line 200, in run_child
        RuntimeError: Initialization failed. Please see the error messages above.
        """)
    # sglang's wrapper in the engine's own process says only "see above": the scheduler's error is the answer
    assert E.failure(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    died = "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9)."
    assert E.failure(f"loading\n{died}\n") == died  # nothing better in the log: the wrapper it is
    assert E.failure("all fine\nshutting down\n") is None
    assert E.failure("x\nSegmentation fault (core dumped)\n") == "Segmentation fault (core dumped)"


def _server_args_probe(pythonpath: str | None) -> subprocess.CompletedProcess:
    probe = textwrap.dedent(f"""\
        import inspect, json, sys
        sys.path.insert(0, {str(TESTS / "sglang_isolated")!r})
        from _sglang_env import prepare_sglang_import
        prepare_sglang_import()
        import importlib.metadata
        from sglang.srt.server_args import ServerArgs
        print(json.dumps([importlib.metadata.version("sglang"), sorted(inspect.signature(ServerArgs).parameters)]))
        """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.sglang
def test_engine_arguments_are_server_arguments_of_both_sglang_versions():
    """Every keyword the harness gives sglang.Engine (stock, graphcap, the target alone) is a ServerArgs field of
    the real 0.5.23 and 0.5.18 packages (an unknown one fails every engine of that version at once on the GPU)."""
    pytest.importorskip("sglang", reason="the real sglang package is not installed (make test installs it)")
    runs = {"0.5.23": None}
    if (SGLANG_0518 / "sglang").is_dir():
        runs["0.5.18"] = str(SGLANG_0518)
    with ThreadPoolExecutor(len(runs)) as pool:
        done = {v: pool.submit(_server_args_probe, p) for v, p in runs.items()}
    base = {"ckpt": "/c", "max_running": 64, "max_total_tokens": 100, "steps": 1}
    kws = set()
    for mode in ("nospec", "sglang", "graphcap"):
        kws |= set(C.engine_kwargs(dict(base, mode=mode)))
    for version, fut in done.items():
        r = fut.result()
        assert r.returncode == 0, r.stderr[-3000:]
        have, params = json.loads(r.stdout.strip().splitlines()[-1])
        assert have == version
        assert kws <= set(params), f"sglang {version} has no {sorted(kws - set(params))}"
    if "0.5.18" not in runs:
        pytest.skip(f"sglang 0.5.18 is not installed at {SGLANG_0518} (checked 0.5.23 only)")


# -----------------------------------------------------------------------------------------------------------------
# bench/user_setup.py


MACHINE = {"gpu": "NVIDIA H200", "driver": "580.159.04", "compute_capability": "9.0", "python": "3.12.3",
           "torch": "2.11.0+cu130", "triton": "3.6.0"}


def _engine(tag, backend=None, paths="native", **kw):
    return {"tag": tag, "mode": "graphcap" if backend else "sglang", "backend": backend, "steps": kw.pop("steps", 1),
            "sglang": kw.pop("sglang", "0.5.23"), "kernel_paths": kw.pop("kp", "sm90" if paths == "native" else paths),
            "kernel_paths_asked": paths, "startup_s": 20.0, "started": True, "crashed": False, "not_run": None,
            "error": None, "log_tail": None, "draft_ms": kw.pop("draft_ms", None), "draft_calls": 10,
            "manifest": {"fallbacks": kw.pop("fallbacks", 0)}, **kw}


def _rows(engine, steps, eq=(1, 8), drafts=((5, 5), (40, 40))):
    return [{"engine": engine, "backend": "cudagraph", "case": f"batch{b}", "batch": b, "requests": b,
             "tokens_equal": t, "drafts_compared": dc, "drafts_equal": de, "crashes": 0, "fallbacks": 0,
             "steps": steps} for b, t, (dc, de) in zip((1, 8), eq, drafts)]


def _partial(version, steps, stock, engines, cases, commit="abc1234", machine=MACHINE):
    return {"commit": commit, "steps": steps, "sglang": version, "expect_sglang": version, "kernel_paths":
            ["native", "sm80"], "time_batch": 8, "context": 2048, "new": 160, "machine": dict(machine),
            "check": {"requests": 9, "check_batches": [1, 8], "stock": stock, "engines": engines, "cases": cases}}


def _partials():
    """0.5.23 at 1 step (both paths ran, sm80 with one differing output), 0.5.18 at 1 step (stock failed to start;
    graphcap's sm80 engine was not reached before the deadline), 0.5.23 at 2 steps in two calls (the first ran out
    of time for sm80, the second ran only sm80)."""
    crash_tail = "\n".join(f"line {i}" for i in range(20)) + "\nImportError: boom"
    a = _partial("0.5.23", 1, _engine("sglang", draft_ms=2.5), {
        "cudagraph": _engine("graphcap-cudagraph", "cudagraph", draft_ms=1.25),
        "cudagraph-sm80": _engine("graphcap-cudagraph-sm80", "cudagraph", "sm80", draft_ms=1.5, fallbacks=2)},
        _rows("cudagraph", 1) + _rows("cudagraph-sm80", 1, eq=(1, 7), drafts=((5, 5), (40, 38))))
    b = _partial("0.5.18", 1, _engine("sglang", sglang="0.5.18", started=False, crashed=True, kp=None,
                                      error="ImportError: boom", log_tail=crash_tail, manifest=None), {
        "cudagraph": _engine("graphcap-cudagraph", "cudagraph", sglang="0.5.18", kp=None, started=False, crashed=True,
                             error="ImportError: boom", log_tail="ImportError: boom", manifest={"manifests": 0}),
        "cudagraph-sm80": _engine("graphcap-cudagraph-sm80", "cudagraph", "sm80", sglang=None, kp=None, started=None,
                                  not_run="40 s left before --until, 75 s wanted", manifest={"manifests": 0})}, [])
    c1 = _partial("0.5.23", 2, _engine("sglang", steps=2, draft_ms=2.75), {
        "cudagraph": _engine("graphcap-cudagraph", "cudagraph", steps=2, draft_ms=1.0),
        "cudagraph-sm80": _engine("graphcap-cudagraph-sm80", "cudagraph", "sm80", steps=2, sglang=None, kp=None,
                                  started=None, not_run="10 s left before --until, 75 s wanted",
                                  manifest={"manifests": 0})}, _rows("cudagraph", 2))
    c2 = _partial("0.5.23", 2, _engine("sglang", steps=2, draft_ms=2.5), {
        "cudagraph-sm80": _engine("graphcap-cudagraph-sm80", "cudagraph", "sm80", steps=2, draft_ms=1.5)},
        _rows("cudagraph-sm80", 2), machine=dict(MACHINE, driver="580.160.00"))
    return [("a.json", a), ("b.json", b), ("c1.json", c1), ("c2.json", c2)]


def _case(sglang, steps, paths, tokens, dc, de, crashes, fallbacks, ms_s, ms_g, error=None):
    return {"sglang": sglang, "steps": steps, "kernel_paths": paths, "backend": "cudagraph", "requests": 9,
            "tokens_equal": tokens, "drafts_compared": dc, "drafts_equal": de, "crashes": crashes,
            "fallbacks": fallbacks, "draft_ms_sglang": ms_s, "draft_ms_graphcap": ms_g, "error": error}


def test_combine_merges_partial_records_into_the_issues_schema(tmp_path):
    crash_tail = "\n".join(f"line {i}" for i in range(9, 20)) + "\nImportError: boom"
    stock_failed = {"phase": "start", "message": "ImportError: boom", "log_tail": crash_tail}
    expected = [
        _case("0.5.23", 1, "sm90", 9, 45, 45, 0, 0, 2.5, 1.25),
        _case("0.5.23", 1, "sm80", 8, 45, 43, 0, 2, 2.5, 1.5),
        _case("0.5.23", 2, "sm90", 9, 45, 45, 0, 0, 2.75, 1.0),
        _case("0.5.23", 2, "sm80", 9, 45, 45, 0, 0, 2.5, 1.5),  # the second call's run replaced the one not run
        _case("0.5.18", 1, "sm90", None, None, None, 1, None, None, None, error={
            "graphcap": {"phase": "start", "message": "ImportError: boom", "log_tail": "ImportError: boom"},
            "sglang": stock_failed}),
        _case("0.5.18", 1, "sm80", None, None, None, None, None, None, None, error={
            "graphcap": {"phase": "not run", "message": "40 s left before --until, 75 s wanted"},
            "sglang": stock_failed}),
    ]
    paths = []
    for name, p in _partials():
        (tmp_path / name).write_text(json.dumps(p))
        paths.append(str(tmp_path / name))
    out = tmp_path / "user-setup-h200.json"
    assert U.main([*paths, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["cases"] == expected
    assert rec["commit"] == "abc1234"
    assert rec["machine"] == {"gpu": "NVIDIA H200", "driver": ["580.159.04", "580.160.00"],
                              "compute_capability": "9.0", "python": "3.12.3", "torch": "2.11.0+cu130",
                              "triton": "3.6.0", "sglang": ["0.5.23", "0.5.18"]}
    assert rec["missing"] == [f"sglang {v}, steps {s}, kernel paths {kp}, cudagraph"
                              for v, steps in (("0.5.23", (3,)), ("0.5.18", (2, 3))) for s in steps
                              for kp in ("sm90", "sm80")]
    assert set(rec) == {"what", "commit", "machine", "cases", "missing"}
    # what tests/test_docs.py asks of every record
    assert isinstance(rec["what"], str) and "H200" in json.dumps(rec) and "torch" in json.dumps(rec)
    assert "batches 1, 8 (9 requests" in rec["what"] and "8 requests of 2048-token prompts" in rec["what"]


def test_combine_refuses_mixed_commits_machines_and_a_cell_run_twice():
    parts = _partials()
    a = parts[0]
    with pytest.raises(U.CombineError, match="different commits: abc1234 \\(a.json\\), def5678 \\(b.json\\)"):
        U.combine([a, ("b.json", dict(parts[1][1], commit="def5678"))])
    with pytest.raises(U.CombineError, match="different machines \\(gpu: NVIDIA H200 in a.json, NVIDIA A100"):
        U.combine([a, ("b.json", dict(parts[1][1], machine=dict(MACHINE, gpu="NVIDIA A100")))])
    with pytest.raises(U.CombineError, match="sglang 0.5.23, steps 1, kernel paths sm90, cudagraph: in a.json and "
                                             "again.json"):
        U.combine([a, ("again.json", a[1])])
    with pytest.raises(U.CombineError, match="give --commit"):
        U.combine([("x.json", dict(a[1], commit=None))])
    assert U.combine([("x.json", dict(a[1], commit=None))], commit="fff0000")["commit"] == "fff0000"
    with pytest.raises(U.CombineError, match="not a partial record"):
        U.combine([("speed.json", {"commit": "abc", "check": None, "speed": {}})])


def test_an_sm80_engine_with_no_kernel_lowered_for_80_is_named_in_the_record(capsys):
    source, a = _partials()[0]
    a = json.loads(json.dumps(a))
    a["check"]["engines"]["cudagraph-sm80"]["triton_kernels_for_paths"] = 0
    a["check"]["engines"]["cudagraph"]["triton_kernels_for_paths"] = None
    rec = U.combine([(source, a)])
    assert rec["not_lowered_for_sm80"] == ["a.json: cudagraph-sm80"]
    assert "TRITON_OVERRIDE_ARCH" in capsys.readouterr().err
    a["check"]["engines"]["cudagraph-sm80"]["triton_kernels_for_paths"] = 12
    assert "not_lowered_for_sm80" not in U.combine([(source, a)])


def test_a_later_failure_replaces_a_cell_not_run_and_a_rerun_replaces_a_failure():
    """Ran beats failed beats not run, whatever the order the files come in; of two failures the later is kept."""
    parts = _partials()
    c1, c2 = parts[2], parts[3]
    for order in ([c1, c2], [c2, c1]):
        (case,) = [c for c in U.combine(order)["cases"] if c["kernel_paths"] == "sm80"]
        assert case["crashes"] == 0 and case["draft_ms_graphcap"] == 1.5
    failed = dict(c2[1], check=dict(c2[1]["check"], cases=[], engines={"cudagraph-sm80": _engine(
        "graphcap-cudagraph-sm80", "cudagraph", "sm80", steps=2, crashed=True, error="RuntimeError: x")}))
    (case,) = [c for c in U.combine([c1, ("f.json", failed)])["cases"] if c["kernel_paths"] == "sm80"]
    assert case["crashes"] == 1 and case["error"]["graphcap"]["message"] == "RuntimeError: x"
    assert case["tokens_equal"] is None  # no rows of a crashed engine in this record: nothing compared
