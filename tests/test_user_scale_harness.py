"""bench/sglang_user_scale.py's reading of sglang's profiler trace (a synthetic chrome trace with the annotation names
sglang's by-stage profile writes) and its argument checks; the engine runs themselves need a GPU."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench_script

us = load_bench_script("sglang_user_scale")


def ev(cat, name, ts, dur):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X"}


def synthetic(iterations=4, period=1000.0):
    """Per iteration: a draft (host span 300 us holding a 250 us runtime wait; GPU span 100 with two kernels), a
    verify (GPU span 600: kernels 500 + 50), a draft extend (GPU 40: one kernel 30); the period between verifies."""
    e = []
    for i in range(iterations):
        t = i * period
        e += [ev("user_annotation", "draft", t, 300), ev("cuda_runtime", "cudaStreamSynchronize", t + 10, 250_0),
              ev("gpu_user_annotation", "draft", t, 100), ev("kernel", "draft_k1", t + 5, 40),
              ev("kernel", "draft_k2", t + 50, 40),
              ev("gpu_user_annotation", "step[VERIFY bs=8]", t + 200, 600), ev("kernel", "_fwd_kernel", t + 210, 500),
              ev("kernel", "gemm", t + 720, 50),
              ev("gpu_user_annotation", "draft_extend", t + 850, 40), ev("kernel", "ext", t + 855, 30)]
    return e


def test_phases_spans_kernels_and_the_host_wait():
    r = us.read_trace(synthetic())
    assert r["verify"]["spans"] == 4 and r["verify"]["gpu_span_ms"] == pytest.approx(0.6)
    assert r["verify"]["kernel_ms"] == pytest.approx(0.55)
    assert r["verify"]["top_kernels"][0] == {"name": "_fwd_kernel", "ms_per_span": pytest.approx(0.5)}
    assert r["draft"]["kernel_ms"] == pytest.approx(0.08) and r["draft_extend"]["gpu_span_ms"] == pytest.approx(0.04)
    assert r["iteration_ms"] == pytest.approx(1.0)
    assert r["draft_host"]["calls"] == 4 and r["draft_host"]["host_ms"] == pytest.approx(0.3)
    assert r["draft_host"]["runtime_waits_ms_per_call"] == {"cudaStreamSynchronize": pytest.approx(2.5)}


def test_no_spec_decode_sets_the_period_and_a_gz_trace_loads(tmp_path):
    e = [ev("gpu_user_annotation", "step[DECODE bs=8]", i * 500, 400) for i in range(3)]
    e += [ev("kernel", "k", i * 500 + 1, 300) for i in range(3)]
    p = tmp_path / "t.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": e}, f)
    r = us.read_trace(us.load_trace(str(p)))
    assert r["iteration_ms"] == pytest.approx(0.5) and r["decode"]["kernel_ms"] == pytest.approx(0.3)
    assert "verify" not in r and "draft_host" not in r


@pytest.mark.parametrize("args,msg", [(["--ckpt", "x", "--out", "y", "--engines", "vllm"], "unknown ['vllm']"),
                                      (["--ckpt", "x", "--out", "y", "--batches", "a"], "integers separated")])
def test_bad_arguments_exit_2_naming_them(args, msg):
    r = subprocess.run([sys.executable, us.__file__, *args], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr


class _Engine:
    """sglang's Engine as load_target_structure uses it, recording the calls (the real one needs a GPU)."""

    def __init__(self, update_ok=True, begin_ok=True):
        self.calls, self.update_ok, self.begin_ok = [], update_ok, begin_ok
        self.loop = self
        self.tokenizer_manager = self

    def begin_weight_update(self, selector):
        self.calls.append(("begin", selector))
        return self.begin_ok, "b"

    def _serialize_tensors_per_rank(self, named, load_format):
        self.calls.append(("serialize", [n for n, _ in named], load_format))
        return ["payload"]

    def update_weights_from_tensor(self, req, request):
        self.calls.append(("update", req))
        return self.update_ok, "u"

    def run_until_complete(self, x):
        return x

    def end_weight_update(self):
        self.calls.append(("end",))
        return True, "e"


class _Req:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("update_ok", [True, False])
def test_target_structure_goes_to_the_target_runner_alone(tmp_path, update_ok):
    """--structured: every tensor of the target checkpoint, as written by sglang_checkpoint.py, reaches sglang's
    update_weights_from_tensor with selector "target" between begin_weight_update and end_weight_update (ended also
    when the update fails), so the draft runner - whose load of the target's embeddings fails - is never asked."""
    ck = load_bench_script("sglang_checkpoint")
    from safetensors.torch import load_file

    ck.make_pair("tiny", tmp_path, device="cpu", sample=64)
    want = sorted(load_file(str(tmp_path / "target" / "model.safetensors")))
    eng = _Engine(update_ok=update_ok)
    r = us.load_target_structure(eng, str(tmp_path / "target"), device="cpu", request_cls=_Req)
    assert [c[0] for c in eng.calls] == ["begin", "serialize", "update", "end"]
    assert eng.calls[0] == ("begin", "target") and sorted(eng.calls[1][1]) == want and len(want) == r["tensors"]
    req = eng.calls[2][1]
    assert req.selector == "target" and req.serialized_named_tensors == ["payload"] and req.flush_cache
    assert r["ok"] is update_ok


def test_a_refused_begin_loads_nothing(tmp_path):
    ck = load_bench_script("sglang_checkpoint")

    ck.make_pair("tiny", tmp_path, device="cpu", sample=64)
    eng = _Engine(begin_ok=False)
    r = us.load_target_structure(eng, str(tmp_path / "target"), device="cpu", request_cls=_Req)
    assert not r["ok"] and "begin_weight_update" in r["message"] and [c[0] for c in eng.calls] == ["begin"]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        us.load_target_structure(eng, str(tmp_path), device="cpu", request_cls=_Req)


def test_profile_plan_covers_the_asked_batches_and_every_sweep_case():
    """Per-phase profiles at batches 1, 8 and 32 (first context) and at each context of the sweep at batch 8: the
    issue's cases, each once."""
    plan = us.profile_plan([1, 8, 32], [2048], [1, 8, 32], 8, [220, 2048, 2460])
    assert plan == [(1, 2048), (8, 2048), (32, 2048), (8, 220), (8, 2460)]
    assert us.profile_plan([1, 8], [2048, 4096], [8, 64], 8, []) == [(8, 2048)]  # a batch not run is not profiled


def test_trace_summary_takes_the_timed_runs_calls_only():
    """Random draft-trace records of several runs (request-id sets), interleaved: the summary of one run counts,
    sums and ranks exactly that run's calls (a plain loop over the records is the reference); no call of the run,
    None; a row carries the first timed run's sums. With each call's start (`t`), the run's timeline: its calls in
    time, the tail of fewer requests included, and the gaps between them against a plain walk."""
    import random

    rng = random.Random(3)
    runs = {t: [f"b4-c220-{t}-{i}" for i in range(4)] for t in ("warm", "short0", "long0", "profile")}
    rows, t = [], 100.0
    for _ in range(200):
        tag = rng.choice(list(runs))
        t += rng.uniform(0.001, 0.5)
        rows.append({"rids": rng.sample(runs[tag], 4), "seq_lens": [rng.randrange(220, 400) for _ in range(4)],
                     "draft": [[0]] * 4, "gpu_ms": rng.uniform(0.5, 2.0), "host_ms": rng.uniform(0.05, 30.0),
                     "t": t})
    rows.append({"rids": runs["long0"][:3], "seq_lens": None, "draft": [[0]] * 3, "gpu_ms": 9.0, "host_ms": 99.0,
                 "t": t + 0.7})
    rng.shuffle(rows)
    mine = [r for r in rows if sorted(r["rids"]) == sorted(runs["long0"])]
    s = us.trace_summary(rows, runs["long0"])
    assert s["calls"] == len(mine) > 0
    assert s["host_ms"]["sum"] == pytest.approx(sum(r["host_ms"] for r in mine))
    assert s["gpu_ms"]["max"] == max(r["gpu_ms"] for r in mine)
    assert [x["host_ms"] for x in s["slowest_host"]] == sorted((r["host_ms"] for r in mine), reverse=True)[:3]
    assert us.trace_summary(rows, ["nobody"]) is None
    times = sorted(r["t"] for r in rows if set(r["rids"]) <= set(runs["long0"]))  # the tail call included
    gaps = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    line = us.trace_summary(rows, runs["long0"], window=(times[0] - 0.25, times[-1] + 0.125))["timeline"]
    assert line["calls"] == len(mine) + 1 and line["gap_ms"]["max"] == pytest.approx(max(gaps))
    ordered, mid = sorted(gaps), len(gaps) // 2
    median = ordered[mid] if len(gaps) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    assert line["gap_ms"]["median"] == pytest.approx(median)
    assert line["max_gap_after_call"] == gaps.index(max(gaps)) + 1
    assert line["to_first_call_ms"] == pytest.approx(250) and line["after_last_call_ms"] == pytest.approx(125)
    assert "timeline" not in us.trace_summary([{k: v for k, v in r.items() if k != "t"} for r in rows], runs["long0"])
    fields = us.trace_fields({"draft_trace": [s, None]})
    assert fields["trace_draft_calls"] == len(mine)
    assert fields["trace_draft_host_ms_sum"] == round(s["host_ms"]["sum"], 2)
    assert fields["trace_max_gap_ms"] == round(s["timeline"]["gap_ms"]["max"], 2)
    assert us.trace_fields({}) == {} and us.trace_fields({"draft_trace": [None]}) == {}


@pytest.mark.subprocess
def test_a_traced_child_summarizes_each_timed_run(tmp_path, monkeypatch):
    """The child (`--child`) against the stand-in sglang.Engine (tests/fake_sglang.py: each generate call writes one
    draft-trace record per verify, with GPU ms from a known formula): every timed long run gets its own summary, of
    its own calls only, and every run (warm ones too) its timeline within its own wall-clock window; with
    `fresh_jit_cache` the engine starts with a Triton cache of its own."""
    import math

    from fake_sglang import install_fake_sglang

    log = install_fake_sglang(tmp_path, monkeypatch)
    (tmp_path / "ck" / "target").mkdir(parents=True)
    cfg = {"engine": "graphcap", "ckpt": str(tmp_path / "ck"), "work": str(tmp_path / "work"), "batches": [2],
           "cases": [[2, 30]], "steps": 3, "new": 48, "repeats": 2, "profile_cases": [], "profile_steps": 6,
           "structured": False, "trace": True, "mem_fraction": 0.8, "context_length": 512, "vocab": 977,
           "fresh_jit_cache": True}
    (tmp_path / "work").mkdir()
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    script = Path(us.__file__)
    r = subprocess.run([sys.executable, str(script), "--child", str(tmp_path / "cfg.json"), "--child-out",
                        str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (case,) = json.loads((tmp_path / "out.json").read_text())["cases"]
    calls = math.ceil(48 / 2.5)
    assert len(case["draft_trace"]) == 2 and len(case["rates"]) == 2
    for t in case["draft_trace"]:
        assert t["calls"] == calls
        assert t["gpu_ms"]["sum"] == pytest.approx(sum(0.5 * (1 + 2 / 8) + 0.01 * i for i in range(calls)))
    assert sorted(case["draft_trace_runs"]) == ["long0", "long1", "short0", "short1", "warm0", "warm1"]
    for tag, t in case["draft_trace_runs"].items():
        line = t["timeline"]  # the fake spreads a run's calls evenly over its sleep, inside the run's window
        assert line["calls"] == math.ceil((us.SHORT_NEW if tag.startswith("short") else 48) / 2.5)
        assert line["to_first_call_ms"] > 0 and line["after_last_call_ms"] > 0
        assert line["gap_ms"]["max"] == pytest.approx(line["gap_ms"]["median"], rel=0.2)
    assert us.summarize({"graphcap": {"config": cfg, "cases": [case]}})[0]["trace_draft_calls"] == calls
    started = json.loads((log / "graphcap.json").read_text())  # --fresh-jit-cache: a Triton cache of its own
    assert started["triton_cache"] == str(tmp_path / "work" / "jit-graphcap")


@pytest.mark.subprocess
def test_an_engine_past_its_time_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    """spawn's timeout ends the child's whole process group, as sglang's scheduler and detokenizer are children of the
    engine's process: an engine left behind would hold the GPU's memory while the next one starts. A stand-in child
    starts a grandchild, then hangs; both must be gone when spawn returns its crash record."""
    import time

    from fake_sglang import hanging_engine, process_gone

    cmd, pid_file = hanging_engine(tmp_path)
    monkeypatch.setattr(us, "__file__", cmd[1])
    t = time.perf_counter()
    res = us.spawn({"engine": "nospec"}, str(tmp_path), timeout=3)
    assert res["crashed"] and time.perf_counter() - t < 30
    assert process_gone(int(pid_file.read_text())), "the engine's child outlived the timeout"
