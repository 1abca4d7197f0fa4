"""The reading of sglang's profiler trace (graphcap.bench.phase_profile: a synthetic chrome trace with the annotation
names sglang's by-stage profile writes), bench/sglang_user_scale.py's argument checks and plans (the long contexts,
the W8A8 target), and the W8A8 target's int8 projections and their load (against sglang's own model:
tests/sglang_isolated/check_w8a8_target_load.py); the engine runs themselves need a GPU."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench_script, tiny_w8a8  # noqa: F401 - a fixture
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from graphcap.bench import phase_profile, sglang_pool
from graphcap.bench import user_scale_child as usc  # the script's child side
from graphcap.bench import user_scale_rows as usr
from graphcap.sglang.settings import VERIFY_ATTENTION, DraftCaptureOptions

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
    r = phase_profile.read_trace(synthetic())
    assert r["verify"]["spans"] == 4 and r["verify"]["gpu_span_ms"] == pytest.approx(0.6)
    assert r["verify"]["kernel_ms"] == pytest.approx(0.55)
    assert r["verify"]["top_kernels"][0] == {"name": "_fwd_kernel", "ms_per_span": pytest.approx(0.5)}
    assert r["draft"]["kernel_ms"] == pytest.approx(0.08) and r["draft_extend"]["gpu_span_ms"] == pytest.approx(0.04)
    assert r["iteration_ms"] == pytest.approx(1.0)
    assert r["draft_host"]["calls"] == 4 and r["draft_host"]["host_ms"] == pytest.approx(0.3)
    assert r["draft_host"]["runtime_waits_ms_per_call"] == {"cudaStreamSynchronize": pytest.approx(2.5)}
    assert r["step_batches"] == {8: 4}


@pytest.mark.parametrize("seen,batch,below", [({8: 6}, 8, False), ({4: 6}, 8, True), ({4: 2, 8: 4}, 8, False),
                                              ({}, 8, False), ({32: 6}, 8, False)])
def test_a_case_whose_steps_ran_below_its_batch_says_so(seen, batch, below):
    """Where the profiled forward steps ran at a smaller batch than the case's (its requests were not all admitted
    at once: a pool too small for them together), the row says so; JSON turns the batch keys into strings."""
    events = [ev("gpu_user_annotation", f"step[VERIFY bs={b}]", 1000 * i, 10) for b, n in seen.items()
              for i in range(n)]
    profile = json.loads(json.dumps(phase_profile.read_trace(events)))
    case = {"batch": batch, "context": 64, "decode_tok_s_per_req": 10.0, "profile": profile}
    (row,) = usr.summarize({"graphcap": {"config": {"steps": 3}, "cases": [case]}})
    assert ("below_batch" in row) == below
    if below:
        assert f"batch {max(seen)} at most, not {batch}" in row["below_batch"]


@settings(max_examples=examples(80), deadline=None)
@given(steps=st.sampled_from([0, 1, 3]), accept=st.floats(1.0, 4.0), iteration=st.floats(5.0, 300.0),
       off=st.floats(-2.5, 1.0))
def test_a_row_carries_the_profiled_rate_and_says_where_the_wall_rate_disagrees(steps, accept, iteration, off):
    """A profiled row's `profile_tok_s_per_req` is its tokens per iteration (the accept length, 1 without
    speculation) over the profiled period; a wall-time rate off it by more than the tolerance - a negative one
    included, as when the short run re-prefilled and the long one hit the cache - says so, and a rate <= 0 is none."""
    period_rate = 1e3 * (accept if steps else 1.0) / iteration
    wall = period_rate * (1 + off)
    case = {"batch": 8, "context": 64, "decode_tok_s_per_req": wall, "accept_len": accept,
            "profile": {"iteration_ms": iteration, "step_batches": {"8": 6}}}
    (row,) = usr.summarize({"nospec" if steps == 0 else "graphcap": {"config": {"steps": steps}, "cases": [case]}})
    assert row["profile_tok_s_per_req"] == pytest.approx(period_rate, abs=0.006)
    assert ("rate_disagrees" in row) == (abs(off) > usr.RATE_TOLERANCE)
    assert row["decode_tok_s_per_req"] == (round(wall, 2) if wall > 0 else None)
    unprofiled = {k: v for k, v in case.items() if k != "profile"}
    (row,) = usr.summarize({"graphcap": {"config": {"steps": 3}, "cases": [unprofiled]}})
    assert "profile_tok_s_per_req" not in row and "rate_disagrees" not in row


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data(), cases=st.lists(st.tuples(st.integers(1, 48), st.integers(16, 4096)), min_size=1, max_size=4,
                                     unique=True))
def test_each_speculative_row_says_whether_its_tokens_are_stock_sglangs_and_the_targets_own(data, cases):
    """A graphcap row compares its tokens with stock sglang's and with no speculation's for the same case, stock's with
    no speculation's; where either side's tokens are unknown (the engine did not run the case, or its case was read
    back without them) the row says nothing - None, never False."""
    engines = data.draw(st.lists(st.sampled_from(["nospec", "sglang", "graphcap"]), min_size=1, unique=True))
    results, tokens = {}, {}
    for name in engines:
        results[name] = {"config": {"steps": 3}, "cases": []}
        for b, c in cases:
            if data.draw(st.booleans()):  # this engine did not run the case
                continue
            t = None if data.draw(st.integers(0, 4)) == 0 else data.draw(
                st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=1, max_size=2))
            tokens[name, b, c] = t
            results[name]["cases"].append({"batch": b, "context": c, "decode_tok_s_per_req": 1.0, "tokens": t})
    rows = usr.summarize(results)
    assert len(rows) == sum(len(r["cases"]) for r in results.values())
    for row in rows:
        mine = tokens[row["engine"], row["batch"], row["context"]]

        def equal(other):
            theirs = tokens.get((other, row["batch"], row["context"]))
            return None if mine is None or theirs is None else mine == theirs
        assert row["tokens_equal_sglang"] == (equal("sglang") if row["engine"] == "graphcap" else None)
        assert row["tokens_equal_nospec"] == (None if row["engine"] == "nospec" else equal("nospec"))


SHAPE_31B = {"layer_types": ["sliding_attention"] * 5 + ["full_attention"], "num_key_value_heads": 4,
             "head_dim": 512, "swa_num_key_value_heads": 16, "swa_head_dim": 256, "sliding_window": 1024}


def test_the_pool_shape_of_the_31b_target():
    """60 layers of the 31B shape: 10 full (4 KV heads of 512) and 50 sliding (16 of 256), bf16 K and V."""
    shape = sglang_pool.pool_shape({**SHAPE_31B, "layer_types": SHAPE_31B["layer_types"] * 10})
    assert (shape.full_bytes, shape.sliding_bytes, shape.window) == (10 * 2 * 4 * 512 * 2, 50 * 2 * 16 * 256 * 2, 1024)
    assert sglang_pool.pool_shape({"layer_types": ["full_attention"]}) is None


@settings(max_examples=examples(100), deadline=None)
@given(pool=st.integers(20_000, 400_000), ratio=st.floats(0.02, 0.8), need=st.integers(10_000, 600_000),
       batch=st.integers(1, 48), chunk=st.sampled_from([1024, 2048, 4096, 8192]), layers=st.integers(1, 12))
def test_the_ratio_advised_is_the_highest_that_holds_the_batch(pool, ratio, need, batch, chunk, layers):
    """Against a brute force over every two-decimal ratio: the advice names the highest ratio whose full pool (the
    engine's byte budget over the bytes a token takes) holds `need` with the margin and whose sliding pool holds the
    batch's windows and a chunk; where none does, it says so and points at memory."""
    shape = sglang_pool.pool_shape({**SHAPE_31B, "layer_types": SHAPE_31B["layer_types"] * layers})
    budget = pool * (shape.full_bytes + ratio * shape.sliding_bytes)
    windows = batch * (shape.window + sglang_pool.PAGE) + chunk
    fits = [r / 100 for r in range(1, 101)
            if budget / (shape.full_bytes + r / 100 * shape.sliding_bytes) >= need * sglang_pool.MARGIN
            and r / 100 * budget / (shape.full_bytes + r / 100 * shape.sliding_bytes) >= windows]
    advice = sglang_pool.ratio_advice(shape, pool, ratio, need, batch, chunk)
    if fits:
        assert advice.startswith(f"about --swa-full-tokens-ratio {max(fits):.2f} would hold them")
    else:
        assert advice.startswith("no --swa-full-tokens-ratio holds them") and "--mem-fraction" in advice


def test_a_case_the_pool_cannot_hold_names_the_setting_that_would():
    """The engine's own pool facts (sglang's get_server_info) and the target's shape give the skipped case's advice;
    without either the reason still names the setting."""
    class Info:
        def __init__(self, info):
            self.info = info

        def get_server_info(self):
            return self.info

    shape = sglang_pool.pool_shape({**SHAPE_31B, "layer_types": SHAPE_31B["layer_types"] * 10})
    facts = usc.pool_facts(Info({"max_total_num_tokens": 217024, "swa_full_tokens_ratio": 0.07,
                                "chunked_prefill_size": 4096}))
    assert facts == {"tokens": 217024, "ratio": 0.07, "chunk": 4096}
    reason = usc.not_run_reason(262944, 8, facts, shape)
    assert reason.startswith("needs 262944 KV tokens at once; this engine's pool holds 217024 at "
                             "--swa-full-tokens-ratio 0.07: ")
    assert reason.endswith(sglang_pool.ratio_advice(shape, 217024, 0.07, 262944, 8, 4096))
    plain = "needs 262944 KV tokens at once; this engine's pool holds 217024 (a lower --swa-full-tokens-ratio"
    assert usc.not_run_reason(262944, 8, facts, None).startswith(plain)
    assert usc.not_run_reason(262944, 8, {"tokens": 217024}, shape).startswith(plain)
    assert usc.pool_facts(Info({})) == {}


def test_no_spec_decode_sets_the_period_and_a_gz_trace_loads(tmp_path):
    e = [ev("gpu_user_annotation", "step[DECODE bs=8]", i * 500, 400) for i in range(3)]
    e += [ev("kernel", "k", i * 500 + 1, 300) for i in range(3)]
    p = tmp_path / "t.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": e}, f)
    r = phase_profile.read_trace(phase_profile.load_trace(str(p)))
    assert r["iteration_ms"] == pytest.approx(0.5) and r["decode"]["kernel_ms"] == pytest.approx(0.3)
    assert "verify" not in r and "draft_host" not in r


@pytest.mark.parametrize("args,msg", [(["--ckpt", "x", "--out", "y", "--engines", "vllm"], "unknown ['vllm']"),
                                      (["--ckpt", "x", "--out", "y", "--batches", "a"], "integers separated"),
                                      (["--ckpt", "x", "--out", "y", "--restarts", "-1"], "--restarts: a count"),
                                      (["--ckpt", "x", "--out", "y", "--swa-full-tokens-ratio", "0"], "in (0, 1]"),
                                      (["--ckpt", "x", "--out", "y", "--swa-full-tokens-ratio", "1.5"], "got 1.5"),
                                      (["--ckpt", "x", "--out", "y", "--chunked-prefill-size", "0"], "tokens > 0"),
                                      (["--ckpt", "x", "--out", "y", "--triton-attention-num-kv-splits", "0"],
                                       "splits >= 1, got 0"),
                                      (["--ckpt", "x", "--out", "y", "--mem-fraction", "1.2"], "got 1.2")])
def test_bad_arguments_exit_2_naming_them(args, msg):
    r = subprocess.run([sys.executable, us.__file__, *args], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr


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
    s = usr.trace_summary(rows, runs["long0"])
    assert s["calls"] == len(mine) > 0
    assert s["host_ms"]["sum"] == pytest.approx(sum(r["host_ms"] for r in mine))
    assert s["gpu_ms"]["max"] == max(r["gpu_ms"] for r in mine)
    assert [x["host_ms"] for x in s["slowest_host"]] == sorted((r["host_ms"] for r in mine), reverse=True)[:3]
    assert usr.trace_summary(rows, ["nobody"]) is None
    times = sorted(r["t"] for r in rows if set(r["rids"]) <= set(runs["long0"]))  # the tail call included
    gaps = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    line = usr.trace_summary(rows, runs["long0"], window=(times[0] - 0.25, times[-1] + 0.125))["timeline"]
    assert line["calls"] == len(mine) + 1 and line["gap_ms"]["max"] == pytest.approx(max(gaps))
    ordered, mid = sorted(gaps), len(gaps) // 2
    median = ordered[mid] if len(gaps) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    assert line["gap_ms"]["median"] == pytest.approx(median)
    assert line["max_gap_after_call"] == gaps.index(max(gaps)) + 1
    assert line["to_first_call_ms"] == pytest.approx(250) and line["after_last_call_ms"] == pytest.approx(125)
    assert "timeline" not in usr.trace_summary([{k: v for k, v in r.items() if k != "t"} for r in rows], runs["long0"])
    fields = usr.trace_fields({"draft_trace": [s, None]})
    assert fields["trace_draft_calls"] == len(mine)
    assert fields["trace_draft_host_ms_sum"] == round(s["host_ms"]["sum"], 2)
    assert fields["trace_max_gap_ms"] == round(s["timeline"]["gap_ms"]["max"], 2)
    assert usr.trace_fields({}) == {} and usr.trace_fields({"draft_trace": [None]}) == {}


@pytest.mark.subprocess
@pytest.mark.parametrize("engine,verify_attention", [("graphcap", VERIFY_ATTENTION[0]),
                                                     ("graphcap-sglang-verify", "sglang")])
def test_a_traced_child_summarizes_each_timed_run(tmp_path, monkeypatch, engine, verify_attention):
    """The child (`--child`) against the stand-in sglang.Engine (tests/fake_sglang.py: each generate call writes one
    draft-trace record per verify, with GPU ms from a known formula): every timed long run gets its own summary, of
    its own calls only, and every run (warm ones too) its timeline within its own wall-clock window; with
    `fresh_jit_cache` the engine starts with a Triton cache of its own. The engine `graphcap` is the flag as a user
    turns it on (the plugin's default verify attention); `graphcap-sglang-verify` sets sglang's."""
    import math

    from fake_sglang import install_fake_sglang

    log = install_fake_sglang(tmp_path, monkeypatch)
    (tmp_path / "ck" / "target").mkdir(parents=True)
    cfg = {"engine": engine, "ckpt": str(tmp_path / "ck"), "work": str(tmp_path / "work"), "batches": [2],
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
        assert line["calls"] == math.ceil((usc.SHORT_NEW if tag.startswith("short") else 48) / 2.5)
        assert line["to_first_call_ms"] > 0 and line["after_last_call_ms"] > 0
        assert line["gap_ms"]["max"] == pytest.approx(line["gap_ms"]["median"], rel=0.2)
    assert usr.summarize({engine: {"config": cfg, "cases": [case]}})[0]["trace_draft_calls"] == calls
    started = json.loads((log / "graphcap.json").read_text())  # --fresh-jit-cache: a Triton cache of its own
    assert started["triton_cache"] == str(tmp_path / "work" / f"jit-{engine}")
    opts = DraftCaptureOptions.from_mapping(json.loads(started["capture"]), "the child's capture options")
    assert (opts.enabled, opts.verify_attention) == (True, verify_attention)


@pytest.mark.subprocess
@pytest.mark.parametrize("engine", ["nospec", "graphcap"])
def test_a_rate_from_the_profile_alone_runs_one_warm_run_and_the_profiled_one(tmp_path, monkeypatch, engine):
    """`rate_from` profile: a profiled case runs one warm run, then the profiled run, no timed pair (a long batch
    the radix cache does not keep prefills in every run); the accept length and tokens are the profiled run's and
    the row's rate is the profiled iteration's (the stand-in's trace: one step every PROFILE_PERIOD_US). A case
    not profiled in the same engine still runs its timed pair."""
    import math

    from fake_sglang import PROFILE_PERIOD_US, install_fake_sglang

    install_fake_sglang(tmp_path, monkeypatch)
    (tmp_path / "ck" / "target").mkdir(parents=True)
    new = 40
    cfg = {"engine": engine, "ckpt": str(tmp_path / "ck"), "work": str(tmp_path / "work"), "batches": [2, 3],
           "cases": [[2, 30], [3, 20]], "steps": 3, "new": new, "repeats": 1, "profile_cases": [[2, 30]],
           "profile_steps": 6, "structured": False, "trace": False, "mem_fraction": 0.8, "context_length": 512,
           "vocab": 977, "rate_from": "profile"}
    (tmp_path / "work").mkdir()
    res = us.spawn(cfg, str(tmp_path / "work"), timeout=120)
    assert not res.get("crashed"), res.get("log_tail")
    profiled, timed = res["cases"]
    assert list(profiled["runs"]) == ["warm0"] and profiled["rates"] == [] and profiled["decode_tok_s_per_req"] is None
    assert list(timed["runs"]) == ["warm0", "warm1", "short0", "long0"] and timed["decode_tok_s_per_req"] > 0
    accept = new / math.ceil(new / 2.5) if engine != "nospec" else None
    assert profiled["accept_len"] == (pytest.approx(accept) if accept else None)
    assert profiled["tokens"] == [[(p + k + 1) % 977 for k in range(new)] for p in
                                  [row[-1] for row in _prompts(2, 30)]]
    row = usr.summarize({engine: res})[0]
    assert row["decode_tok_s_per_req"] is None and "rate_disagrees" not in row
    assert row["profile_tok_s_per_req"] == pytest.approx(1e3 * (accept or 1.0) / (PROFILE_PERIOD_US / 1e3), abs=0.01)


def _prompts(batch: int, context: int) -> list[list[int]]:
    """The child's prompts for its first case (its generator's first draws, as it seeds it)."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 977) for _ in range(context)] for _ in range(batch)]


@pytest.mark.subprocess
def test_an_engine_keeps_what_it_finished_and_runs_no_case_its_pool_cannot_hold(tmp_path, monkeypatch):
    """Against the stand-in engine with a KV pool of 1000 tokens: a case that needs more at once is not run (its
    rate would be a smaller batch's) and says why; a case that never ends stops the engine at its timeout, and the
    cases it finished before - with their rates and profile - still reach the record, as rows. With `radix_cache`
    the engine starts with sglang's radix cache on, its Python tree core chosen."""
    from fake_sglang import install_fake_sglang

    log = install_fake_sglang(tmp_path, monkeypatch)
    monkeypatch.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", raising=False)
    monkeypatch.setenv("FAKE_SGLANG_POOL", "1000")
    monkeypatch.setenv("FAKE_SGLANG_HANG_CONTEXT", "60")
    (tmp_path / "ck" / "target").mkdir(parents=True)
    cfg = {"engine": "graphcap", "ckpt": str(tmp_path / "ck"), "work": str(tmp_path / "work"), "batches": [1, 2, 8],
           "cases": [[2, 30], [8, 200], [1, 60]], "steps": 3, "new": 24, "repeats": 1, "profile_cases": [],
           "profile_steps": 6, "structured": False, "trace": False, "mem_fraction": 0.8, "context_length": 512,
           "vocab": 977, "radix_cache": True, "sglang_settings": {"swa_full_tokens_ratio": 0.1}}
    (tmp_path / "work").mkdir()
    res = us.spawn(cfg, str(tmp_path / "work"), timeout=12)
    started = json.loads((log / "graphcap.json").read_text())  # the radix cache on, through sglang's Python core
    assert started["kw"]["disable_radix_cache"] is False and started["radix_core"] == "python"
    assert started["kw"]["swa_full_tokens_ratio"] == 0.1  # sglang's own setting reaches sglang.Engine
    assert res["crashed"]
    done, skipped = res["cases"]
    assert (done["batch"], done["context"], done["rates"][0] > 0) == (2, 30, True)
    assert skipped == {"batch": 8, "context": 200,
                       "not_run": f"needs {8 * (200 + 24 + 3 + 1)} KV tokens at once; this engine's pool holds 1000 "
                                  "(a lower --swa-full-tokens-ratio gives the full-attention pool more)"}
    rows = usr.summarize({"graphcap": res})
    assert [(r["batch"], r.get("not_run") is None, r.get("tokens_equal_sglang")) for r in rows] == \
        [(2, True, None), (8, False, None)]
    assert rows[0]["decode_tok_s_per_req"] == round(done["decode_tok_s_per_req"], 2)


@pytest.mark.subprocess
@pytest.mark.parametrize("restarts", [0, 1])
def test_an_engine_that_dies_mid_sweep_is_restarted_on_the_cases_it_left(tmp_path, monkeypatch, restarts):
    """The stand-in engine dies at its second case (once: a restarted engine gets past it). Without restarts the
    record keeps the first case and the crash; with one, a second engine runs the cases left - the one it died in
    included - so every case has its row, and the death stays in the result, with the cases finished before it."""
    from fake_sglang import install_fake_sglang

    install_fake_sglang(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_SGLANG_DIE", f"40:{tmp_path / 'died'}")
    (tmp_path / "ck" / "target").mkdir(parents=True)
    cases = [[2, 30], [2, 40], [2, 50]]
    cfg = {"engine": "sglang", "ckpt": str(tmp_path / "ck"), "work": str(tmp_path / "work"), "batches": [2],
           "cases": cases, "steps": 3, "new": 24, "repeats": 1, "profile_cases": [], "profile_steps": 6,
           "structured": False, "trace": False, "mem_fraction": 0.8, "context_length": 512, "vocab": 977,
           "radix_cache": False}
    (tmp_path / "work").mkdir()
    res = us.spawn_restarting(cfg, str(tmp_path / "work"), timeout=120, restarts=restarts)
    got = [[c["batch"], c["context"]] for c in res["cases"]]
    assert res["config"]["cases"] == cases
    if restarts:
        assert got == cases and not res.get("crashed")
        assert [d["after_cases"] for d in res["restarts"]] == [1]
        assert "IndexError" in res["restarts"][0]["log_tail"]
        assert (tmp_path / "work" / "sglang-restart1.log").exists()  # the first engine's log stays as it was
        assert "IndexError" in (tmp_path / "work" / "sglang.log").read_text()
    else:
        assert got == cases[:1] and res["crashed"] and not res["timed_out"] and "restarts" not in res
    rows = usr.summarize({"sglang": res})
    assert [(r["batch"], r["context"]) for r in rows] == [tuple(c) for c in got]
    assert all(r["decode_tok_s_per_req"] > 0 for r in rows)


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


@pytest.mark.subprocess
def test_a_harness_stopped_at_its_step_limit_stops_its_engine_and_keeps_what_it_finished(tmp_path, monkeypatch):
    """gpu-check's step limit stops the harness with SIGTERM (`timeout`). The engine child runs in a process group of
    its own, so the signal never reaches it: the harness must stop it (sglang's scheduler would hold the GPU's memory
    while the call's next step starts), write the record with the cases the engine finished, start no further
    engine, and exit 143. The stand-in engine finishes its first case, then hangs in its second."""
    import contextlib
    import os
    import signal
    import time

    from fake_sglang import install_fake_sglang, process_gone

    log = install_fake_sglang(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_SGLANG_HANG_CONTEXT", "60")
    (tmp_path / "ck" / "target").mkdir(parents=True)
    (tmp_path / "ck" / "target" / "config.json").write_text(json.dumps({"vocab_size": 977,
                                                                         "max_position_embeddings": 32768}))
    work, out = tmp_path / "work", tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, us.__file__, "--ckpt", str(tmp_path / "ck"), "--out", str(out),
                             "--work", str(work), "--engines", "nospec,graphcap", "--cases", "2x30,1x60",
                             "--new", "24", "--timeout", "300"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    child: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while '"batch": 2' not in ((work / "nospec.log").read_text() if (work / "nospec.log").exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the engine never finished its first case"
            time.sleep(0.2)
        child += [int(d) for d in os.listdir("/proc") if d.isdigit() and _cmdline_has(d, "nospec-config.json", work)]
        assert child, "the engine's child process was not found"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 143, output[-2000:]
        assert all(process_gone(pid) for pid in child), "the engine outlived the harness"
    finally:
        proc.kill()
        for pid in child:  # a failed run leaves no hanging engine behind
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL), output[-2000:]
    assert all(process_gone(pid) for pid in child), "the engine outlived the harness"
    rec = json.loads(out.read_text())
    assert list(rec["engines"]) == ["nospec"] and not (log / "graphcap.json").exists()  # no engine after the stop
    res = rec["engines"]["nospec"]
    assert res["stopped"] and res["crashed"] and not res["timed_out"]
    assert [(c["batch"], c["context"]) for c in res["cases"]] == [(2, 30)]
    assert [(r["engine"], r["batch"], r["decode_tok_s_per_req"] > 0) for r in rec["rows"]] == [("nospec", 2, True)]


def test_a_stop_during_a_restart_keeps_every_start_s_cases_and_the_deaths(monkeypatch):
    """Stopped while a restarted engine runs: the record gets the first start's cases and the restart's, and the
    death that caused the restart (the harness writes `Stopped.result` as the engine's result)."""
    from graphcap.bench import user_scale_engines as use

    cfg = {"engine": "sglang", "cases": [[2, 30], [2, 40], [2, 50]], "profile_cases": []}
    starts = []

    def spawn(script, c, work, timeout, tag=None):
        starts.append([tuple(x) for x in c["cases"]])
        if len(starts) == 1:
            return {"config": c, "crashed": True, "timed_out": False, "log_tail": "IndexError",
                    "cases": [{"batch": 2, "context": 30}]}
        raise use.Stopped(143, {"config": c, "crashed": True, "timed_out": False, "stopped": True,
                                "log_tail": "", "cases": [{"batch": 2, "context": 40}]})

    monkeypatch.setattr(use, "spawn", spawn)
    with pytest.raises(use.Stopped) as stop:
        use.spawn_restarting("x", cfg, "w", timeout=60, restarts=3)
    assert starts == [[(2, 30), (2, 40), (2, 50)], [(2, 40), (2, 50)]]
    r = stop.value.result
    assert r["config"] is cfg and r["stopped"] and stop.value.code == 143
    assert [c["context"] for c in r["cases"]] == [30, 40]
    assert [d["after_cases"] for d in r["restarts"]] == [1]


def test_an_engine_that_dies_before_its_first_case_is_not_started_again(monkeypatch):
    """A death before any case (sglang refusing a KV pool the card cannot hold, at start-up) repeats on every start:
    one start, not `restarts` more, and the result says why. A start that finished a case before dying is still
    restarted, and its restart that then dies before a case of its own is the last."""
    from graphcap.bench import user_scale_engines as use

    cfg = {"engine": "nospec", "cases": [[8, 2048], [32, 2048], [48, 2048]], "profile_cases": [[8, 2048]]}
    starts, finish_first = [], []

    def spawn(script, c, work, timeout, tag=None):
        starts.append(tag)
        done = [{"batch": 8, "context": 2048}] if finish_first and len(starts) == 1 else []
        return {"config": c, "crashed": True, "timed_out": False, "cases": done,
                "log_tail": "RuntimeError: SWA pool cap (93632 tokens, 71.44 GiB) leaves no room"}

    monkeypatch.setattr(use, "spawn", spawn)
    res = use.spawn_restarting("x", cfg, "w", timeout=600, restarts=2)
    assert starts == [None] and res["crashed"] and res["cases"] == []
    assert "before its first case" in res["not_restarted"] and "restarts" not in res

    starts.clear()
    finish_first.append(True)
    res = use.spawn_restarting("x", cfg, "w", timeout=600, restarts=2)
    assert starts == [None, "nospec-restart1"] and res["crashed"]
    assert [c["batch"] for c in res["cases"]] == [8] and [d["after_cases"] for d in res["restarts"]] == [1]
    assert "before its first case" in res["not_restarted"]


def _cmdline_has(pid: str, name: str, work: Path) -> bool:
    try:
        return str(work / name) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_a_w8a8_checkpoint_holds_the_structure_alone(tiny_w8a8):
    """At every size a w8a8 target's checkpoint holds no projection (the harness loads the int8 ones), only what stays
    bf16 in the user's checkpoint: embeddings, lm_head, norms, layer scalars; the assistant keeps its layers."""
    import json

    from safetensors.torch import load_file

    names = set(load_file(str(tiny_w8a8 / "target" / "model.safetensors")))
    assert not [n for n in names if n.endswith("_proj.weight")]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.3.layer_scalar",
            "model.layers.0.self_attn.k_norm.weight"} <= names
    assistant = set(load_file(str(tiny_w8a8 / "assistant" / "model.safetensors")))
    assert "model.layers.0.self_attn.q_proj.weight" in assistant
    assistant_cfg = json.loads((tiny_w8a8 / "assistant" / "config.json").read_text())
    assert "quantization_config" not in assistant_cfg
    summary = json.loads((tiny_w8a8 / "summary.json").read_text())
    assert (summary["weights"], summary["target_matrices"], summary["max_position_embeddings"]) == ("w8a8", False,
                                                                                                    135168)


# ---------------------------------------------------------------------------------------------------------------
# the run's plan: the long contexts, the W8A8 target


def plan(capsys, ckpt, *args):
    assert us.main(["--ckpt", str(ckpt), "--out", "unused.json", "--plan-only", *args]) == 0
    import json

    return json.loads(capsys.readouterr().out)


def refused(capsys, ckpt, *args) -> str:
    with pytest.raises(SystemExit) as e:
        us.main(["--ckpt", str(ckpt), "--out", "unused.json", "--plan-only", *args])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_the_long_context_cases_plan(capsys, tiny_w8a8):
    """The issue's long contexts - batch 1 at 32k and 128k, batch 8 at 32k, each profiled - as gpu-check's
    USER_CASES passes them, on a checkpoint whose max_position_embeddings holds 128k and its new tokens."""
    p = plan(capsys, tiny_w8a8, "--cases", "1x32768,8x32768,1x131072", "--profile-batches", "1,8", "--structured",
             "--weights", "w8a8", "--engines", "nospec,graphcap", "--batches", "8", "--contexts", "2048")
    assert p == {"cases": [[1, 32768], [8, 32768], [1, 131072]], "profile_cases": [[1, 32768], [8, 32768], [1, 131072]],
                 "batches": [1, 8], "context_length": 131072 + 96 + 8 + 64, "weights": "w8a8",
                 "engines": ["nospec", "graphcap"], "radix_cache": False, "sglang_settings": {}, "mem_fraction": 0.88,
                 "rate_from": "timed"}
    assert plan(capsys, tiny_w8a8, "--cases", "8x32768,1x131072", "--structured", "--weights", "w8a8")[
        "profile_cases"] == [[8, 32768]]  # the default profiled batch: 8
    # long contexts on an 80 GB card: sglang's own pool and chunk settings, passed through as sglang names them
    assert plan(capsys, tiny_w8a8, "--cases", "1x131072", "--structured", "--weights", "w8a8", "--radix-cache",
                "--swa-full-tokens-ratio", "0.1", "--chunked-prefill-size", "2048")["sglang_settings"] == \
        {"swa_full_tokens_ratio": 0.1, "chunked_prefill_size": 2048}


def test_the_short_context_plan_is_unchanged(capsys, tiny_w8a8):
    """The recorded runs' plans: batch 8 at 2048 (and the sweep at batch 8), the engine's context length 8192."""
    p = plan(capsys, tiny_w8a8, "--batches", "8", "--contexts", "2048", "--sweep", "220,2460", "--structured",
             "--weights", "w8a8")
    assert p["cases"] == [[8, 2048], [8, 220], [8, 2460]] and p["profile_cases"] == p["cases"]
    assert p["batches"] == [8] and p["context_length"] == 8192
    # a sweep at a batch not in --batches gets its decode graphs too
    assert plan(capsys, tiny_w8a8, "--batches", "8", "--sweep", "4096", "--profile-batch", "1", "--structured",
                "--weights", "w8a8")["batches"] == [1, 8]


def test_plans_refused_naming_what_is_wrong(capsys, tiny_w8a8, tmp_path):
    ck = load_bench_script("sglang_checkpoint")
    ck.make_pair("tiny", tmp_path / "bf16", device="cpu", sample=64)  # max_position_embeddings 32768
    w8 = ("--structured", "--weights", "w8a8")
    assert "--weights w8a8 needs --structured" in refused(capsys, tiny_w8a8, "--weights", "w8a8")
    assert "declares a w8a8 target" in refused(capsys, tiny_w8a8, "--structured")
    assert "declares a bf16 target (write the checkpoint with bench/sglang_checkpoint.py --weights w8a8)" in refused(
        capsys, tmp_path / "bf16", *w8)
    err = refused(capsys, tmp_path / "bf16", "--cases", "1x131072")
    assert "exceeds the checkpoint's max_position_embeddings 32768" in err and "--max-pos 131240" in err
    assert "--context-length 4096: the longest case's context with its 96 new tokens needs 4264" in refused(
        capsys, tiny_w8a8, *w8, "--contexts", "4096", "--context-length", "4096")
    assert "'8k32768' is not BATCHxCONTEXT" in refused(capsys, tiny_w8a8, *w8, "--cases", "8k32768")
    assert "give the sweep's cases in --cases" in refused(capsys, tiny_w8a8, *w8, "--cases", "1x2048", "--sweep", "220")
    assert "no target/config.json" in refused(capsys, tmp_path / "none")
    assert "--rate-from profile: 1x32768 not profiled" in refused(
        capsys, tiny_w8a8, *w8, "--cases", "8x2048,1x32768", "--profile-batches", "8", "--rate-from", "profile")
    assert "--repeats: timed runs per case >= 1, got 0" in refused(capsys, tiny_w8a8, *w8, "--repeats", "0")


# ---------------------------------------------------------------------------------------------------------------
# scripts/gpu-check.sh's user-scale stage: its command lines, as a GPU machine runs them

GPU_CHECK = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def gpu_check_steps(tmp_path, name: str = "user-scale", **knobs) -> tuple[int, list[list[str]], str]:
    """A stage of scripts/gpu-check.sh (default user-scale) run by bash with its steps recorded instead of run (and
    engine_env a no-op): (exit status, each step's command line, stderr)."""
    rec = tmp_path / "steps"
    stage = GPU_CHECK.read_text()
    run_stage = stage[stage.index("run_stage() {"):]
    run_stage = run_stage[:run_stage.index("\n}\n") + 3]
    script = (f"set -uo pipefail\nWORK={tmp_path}/work; LOG={tmp_path}/log\n"
              f"step() {{ local a; for a in \"$@\"; do printf '%s\\037' \"$a\"; done >> {rec}; echo >> {rec}; }}\n"
              f"engine_env() {{ :; }}\n{run_stage}\nrun_stage {name}\nexit 0\n")  # gpu_main ignores its status
    env = {"PATH": "/usr/bin:/bin", **knobs}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    steps = [line.split("\x1f")[:-1] for line in rec.read_text().splitlines()] if rec.exists() else []
    return r.returncode, steps, r.stderr


def replay(steps: list[list[str]], capsys) -> dict:
    """The stage's checkpoint step at the tiny size on CPU (the user-scale one builds 5.6 GB of embeddings), then its
    harness step with --plan-only: the plan the GPU machine's command line gives."""
    ckpt, harness = steps[-2], steps[-1]
    assert ckpt[0] == "ckpt-user-scale" and harness[0] == "user-scale"
    args = ckpt[ckpt.index("bench/sglang_checkpoint.py") + 1:]
    args[args.index("--size") + 1], args[args.index("--device") + 1] = "tiny", "cpu"
    assert load_bench_script("sglang_checkpoint").main([*args, "--sample", "64"]) == 0
    capsys.readouterr()
    assert us.main([*harness[harness.index("bench/sglang_user_scale.py") + 1:], "--plan-only"]) == 0
    import json

    return json.loads(capsys.readouterr().out)


def test_gpu_check_runs_the_w8a8_long_context_cases(tmp_path, capsys):
    """USER_WEIGHTS=w8a8 with USER_CASES: the checkpoint writer and the harness both get --weights w8a8, the
    checkpoint its own directory and a max_position_embeddings that holds 128k; the harness plans the three cases."""
    rc, steps, err = gpu_check_steps(tmp_path, USER_WEIGHTS="w8a8", USER_STRUCTURED="1", USER_VERIFY_ALONE="0",
                                     USER_CASES="1x32768,8x32768,1x131072", USER_PROFILE="1,8")
    assert rc == 0, err
    ckpt = steps[0]
    assert ckpt[ckpt.index("--out") + 1] == f"{tmp_path}/work/ckpt-us-w8a8"
    assert ckpt[ckpt.index("--weights") + 1] == "w8a8" and ckpt[ckpt.index("--max-pos") + 1] == str(131072 + 4096)
    p = replay(steps, capsys)
    assert p["weights"] == "w8a8" and p["cases"] == [[1, 32768], [8, 32768], [1, 131072]]
    assert p["profile_cases"] == p["cases"] and p["context_length"] == 131072 + 96 + 8 + 64
    assert p["radix_cache"] is True  # a case's runs share their prompts: one prefill of each long batch
    rc, steps, err = gpu_check_steps(tmp_path, USER_WEIGHTS="w8a8", USER_STRUCTURED="1", USER_VERIFY_ALONE="0",
                                     USER_CASES="1x32768", USER_RADIX="0")
    assert rc == 0 and replay(steps, capsys)["radix_cache"] is False, err


def test_gpu_check_default_is_the_recorded_bf16_run(tmp_path, capsys):
    """No new knob: the bf16 checkpoint in $WORK/ckpt-us at max_position_embeddings 32768, batch 8 at 2048."""
    rc, steps, err = gpu_check_steps(tmp_path, USER_STRUCTURED="1", USER_VERIFY_ALONE="0")
    assert rc == 0, err
    ckpt = steps[0]
    assert ckpt[ckpt.index("--out") + 1] == f"{tmp_path}/work/ckpt-us" and ckpt[ckpt.index("--max-pos") + 1] == "32768"
    p = replay(steps, capsys)
    assert (p["weights"], p["cases"], p["context_length"], p["radix_cache"]) == ("bf16", [[8, 2048]], 8192, False)
    assert "--weights" in steps[1] and "--structured" in steps[1]
    assert steps[1][steps[1].index("--restarts") + 1] == "0"  # an engine's death ends it unless asked


def test_gpu_check_passes_the_restarts_asked(tmp_path, capsys):
    rc, steps, err = gpu_check_steps(tmp_path, USER_STRUCTURED="1", USER_VERIFY_ALONE="0", USER_RESTARTS="4")
    assert rc == 0, err
    assert steps[1][steps[1].index("--restarts") + 1] == "4"
    replay(steps, capsys)  # the harness takes it


def test_gpu_check_passes_sglang_pool_settings_for_long_contexts(tmp_path, capsys):
    """USER_SWA_RATIO, USER_CHUNK, USER_MEM and USER_KV_SPLITS reach the engines as sglang's
    --swa-full-tokens-ratio, --chunked-prefill-size, --mem-fraction-static and --triton-attention-num-kv-splits
    (long contexts on an 80 GB card, and the no-speculation baseline tuned for them), USER_RATE_FROM the harness;
    a long context gets a longer default timeout. Without them sglang keeps its own, the harness its defaults."""
    rc, steps, err = gpu_check_steps(tmp_path, USER_WEIGHTS="w8a8", USER_STRUCTURED="1", USER_VERIFY_ALONE="0",
                                     USER_CASES="8x32768", USER_SWA_RATIO="0.04", USER_CHUNK="2048", USER_MEM="0.92",
                                     USER_KV_SPLITS="64", USER_RATE_FROM="profile", USER_PROFILE="8")
    assert rc == 0, err
    assert steps[-1][steps[-1].index("--timeout") + 1] == "450"  # a long context's default
    plan = replay(steps, capsys)
    assert plan["rate_from"] == "profile"
    assert plan["sglang_settings"] == {"swa_full_tokens_ratio": 0.04, "chunked_prefill_size": 2048,
                                       "triton_attention_num_kv_splits": 64}
    assert plan["mem_fraction"] == 0.92
    rc, steps, err = gpu_check_steps(tmp_path, USER_STRUCTURED="1", USER_VERIFY_ALONE="0")
    assert rc == 0, err
    assert steps[-1][steps[-1].index("--timeout") + 1] == "215"
    plan = replay(steps, capsys)
    assert plan["sglang_settings"] == {} and plan["mem_fraction"] == 0.88 and plan["rate_from"] == "timed"


def test_gpu_check_names_a_tagged_runs_step_record_and_logs(tmp_path):
    """USER_TAG: two settings in one device call keep each its own record, logs and work directory."""
    rc, steps, err = gpu_check_steps(tmp_path, USER_STRUCTURED="1", USER_VERIFY_ALONE="0", USER_TAG="kv64")
    assert rc == 0, err
    step = steps[-1]
    assert step[0] == "user-scale-kv64"
    assert step[step.index("--out") + 1] == f"{tmp_path}/log/user-scale-kv64.json"
    assert step[step.index("--work") + 1] == f"{tmp_path}/work/user-scale-kv64"
    rc, steps, err = gpu_check_steps(tmp_path / "bad", USER_TAG="a b")
    assert rc == 2 and "USER_TAG: letters, digits, - and _, got a b" in err and not steps


def test_gpu_check_refuses_w8a8_without_the_structure(tmp_path):
    rc, steps, err = gpu_check_steps(tmp_path, USER_WEIGHTS="w8a8", USER_VERIFY_ALONE="0")
    assert rc == 2 and "USER_WEIGHTS=w8a8 needs USER_STRUCTURED=1" in err and not steps
    rc, _, err = gpu_check_steps(tmp_path, USER_WEIGHTS="int4")
    assert rc == 2 and "USER_WEIGHTS: bf16 or w8a8, got int4" in err


def test_gpu_check_serves_the_w8a8_31b_pair(tmp_path):
    """SERVER_PAIR=user-scale-w8a8: the server stage writes the W8A8 31B-shaped checkpoint in its own directory and
    hands it to the server harness (which loads its weights over HTTP), SERVER_ARGS reaching every server as
    --server-arg items; a bad pair is refused naming the knob."""
    rc, steps, err = gpu_check_steps(tmp_path, "server", SERVER_PAIR="user-scale-w8a8",
                                     SERVER_ARGS="--context-length 8192", SERVER_RATES="1.5,3")
    assert rc == 0, err
    ckpt, server = steps[0], steps[-1]
    assert server[server.index("--request-rates") + 1] == "1.5,3"
    assert ckpt[0] == "ckpt-user-scale" and ckpt[ckpt.index("--weights") + 1] == "w8a8"
    assert ckpt[ckpt.index("--out") + 1] == f"{tmp_path}/work/ckpt-us-w8a8"
    assert server[0] == "server" and server[server.index("--ckpt") + 1] == f"{tmp_path}/work/ckpt-us-w8a8"
    assert [a for a in server if a.startswith("--server-arg")] == ["--server-arg=--context-length",
                                                                   "--server-arg=8192"]
    rc, steps, err = gpu_check_steps(tmp_path / "bad", "server", SERVER_PAIR="31b")
    assert rc == 2 and "SERVER_PAIR: draft-shapes, user-scale or user-scale-w8a8, got 31b" in err
