"""bench/sglang_engine.py's bookkeeping, on synthetic engine outputs (the engine itself runs on a GPU machine):
drafts line up per (request, k-th draft call), a differing draft or output is counted, acceptance is completion
tokens per verify, the workloads straddle the window, and the record keeps timings only for the batches measured."""
from __future__ import annotations

import json
import os
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bench_scripts import load_bench_script
from graphcap.bench import engine_child as C  # the script's child side: one engine in this process
from tiers import examples

E = load_bench_script("sglang_engine")


def _trace(calls: list[tuple[list[str], list[list[int]]]]) -> list[dict]:
    return [{"rids": rids, "seq_lens": None, "draft": drafts, "gpu_ms": 1.0, "host_ms": 1.0} for rids, drafts in calls]


@settings(max_examples=examples(30), deadline=None)
@given(st.lists(st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True), min_size=1, max_size=12),
       st.integers(0, 2**16))
def test_drafts_line_up_by_each_requests_call_count_whatever_the_batching(batches, seed):
    """The same per-request draft sequence, batched two different ways (as two engines may schedule it), maps to the
    same (rid, k) -> draft table."""
    rng = random.Random(seed)
    per_rid: dict[str, list[list[int]]] = {}
    first = []
    for rids in batches:
        drafts = []
        for r in rids:
            d = [rng.randrange(1000) for _ in range(3)]
            per_rid.setdefault(r, []).append(d)
            drafts.append(d)
        first.append((rids, drafts))
    # the second engine runs each request's calls in the same order, one request per call
    second = [([r], [d]) for r, ds in per_rid.items() for d in ds]
    a, b = E.draft_map(_trace(first)), E.draft_map(_trace(second))
    assert a == b
    assert a == {(r, k): d for r, ds in per_rid.items() for k, d in enumerate(ds)}


def _case(name, outputs):
    return {"name": name, "batch": len(outputs), "outputs": outputs}


def test_compare_counts_differing_outputs_drafts_and_acceptance():
    base = {"cases": [_case("batch2", [{"rid": "x", "tokens": [1, 2, 3], "verify_ct": 2, "completion": 3},
                                       {"rid": "y", "tokens": [4, 5], "verify_ct": 2, "completion": 2}])]}
    other = {"cases": [_case("batch2", [{"rid": "x", "tokens": [1, 2, 3], "verify_ct": 2, "completion": 3},
                                        {"rid": "y", "tokens": [4, 6], "verify_ct": 1, "completion": 2}])]}
    bt = {("x", 0): [1, 2], ("x", 1): [3, 4], ("x", 2): [7, 7], ("y", 0): [5, 6], ("z", 0): [0, 0]}
    ot = {("x", 0): [1, 2], ("x", 1): [3, 5], ("y", 0): [5, 6]}
    (row,) = E.compare(base, other, bt, ot)
    assert row["tokens_equal"] == 1 and row["requests"] == 2
    assert (row["drafts_compared"], row["drafts_equal"]) == (3, 2)  # z is not in this case
    assert row["drafts_unmatched"] == 1  # x's third call is in one trace only: counted, not dropped
    assert row["accept_len_sglang"] == (3 / 2 + 2 / 2) / 2
    assert row["accept_len_graphcap"] == (3 / 2 + 2 / 1) / 2


def test_check_workloads_straddle_the_window_and_are_deterministic():
    cases = E.check_cases(1024)
    assert cases == E.check_cases(1024)
    assert [c["batch"] for c in cases] == [*E.CHECK_BATCHES, 96]
    for c in cases:
        lens = [len(r["prompt"]) for r in c["requests"]]
        assert len(c["requests"]) == c["batch"] and len({r["rid"] for r in c["requests"]}) == c["batch"]
        assert min(lens) < E.WINDOW and (c["batch"] == 1 or max(lens) > E.WINDOW)
        assert all(3 <= t < 1024 for r in c["requests"] for t in r["prompt"])


def test_record_takes_timings_only_where_both_runs_have_the_batch(tmp_path):
    check = {"default_backend": "cudagraph", "cases": [
        {"backend": "cudagraph", "batch": b, "requests": b, "tokens_equal": b, "drafts_compared": 5,
         "drafts_equal": 5 if b != 2 else 4, "crashes": 0, "fallbacks": 0, "accept_len_sglang": 2.5,
         "accept_len_graphcap": 2.5} for b in (1, 2)]}
    speed = {"1": {"sglang": {"draft_ms": 2.0, "decode_tok_s": 10.0}, "graphcap-cudagraph": {"draft_ms": 1.5,
                                                                                            "decode_tok_s": 20.0},
                   "nospec": {"draft_ms": None, "decode_tok_s": 30.0}}}
    rec = E.issue_record(check, speed, "abc")
    one, two = rec["cases"]
    assert (one["draft_ms_sglang"], one["draft_ms_graphcap"], one["decode_tok_s_no_spec"]) == (2.0, 1.5, 30.0)
    assert one["near_ties"] == 0 and two["near_ties"] is None  # a differing draft is not waved through as a tie
    assert two["draft_ms_sglang"] is None and two["decode_tok_s_graphcap"] is None
    c, s = tmp_path / "c.json", tmp_path / "s.json"
    c.write_text(json.dumps({"commit": "abc", "check": check}))
    s.write_text(json.dumps({"speed": speed}))
    out = tmp_path / "rec.json"
    assert E.main(["--combine", str(c), str(s), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec))


def test_retractions_are_summed_per_case_and_unknown_when_sglang_does_not_report_them():
    outs = [{"rid": "x", "tokens": [1], "verify_ct": 1, "completion": 1, "retractions": 2},
            {"rid": "y", "tokens": [2], "verify_ct": 1, "completion": 1, "retractions": 1}]
    base = {"cases": [_case("batch2", outs)]}
    other = {"cases": [_case("batch2", [dict(o, retractions=None) if o["rid"] == "y" else o for o in outs])]}
    (row,) = E.compare(base, other, {}, {})
    assert (row["retractions_sglang"], row["retractions_graphcap"]) == (3, None)


def test_retraction_switch_reaches_sglangs_scheduler_environment(monkeypatch):
    """--retract-every sets sglang's own test switch before sglang is imported (the scheduler process inherits it);
    the engine is stubbed: only the environment the child leaves is checked."""
    import os
    import sys
    import types

    seen = {}

    class Engine:
        def __init__(self, **kw):
            seen.update({k: os.environ.get(k) for k in ("SGLANG_TEST_RETRACT", "SGLANG_TEST_RETRACT_INTERVAL")})

        def shutdown(self):
            pass

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    for k in ("SGLANG_TEST_RETRACT", "SGLANG_TEST_RETRACT_INTERVAL", "GRAPHCAP_SGLANG_TRACE"):
        monkeypatch.setenv(k, "")  # recorded, so whatever run_child sets is undone after the test
        monkeypatch.delenv(k)
    cfg = {"mode": "sglang", "ckpt": "/nonexistent", "cases": [], "max_running": 4, "trace_dir": "/tmp/t",
           "retract_every": 7}
    C.run_child(cfg)
    assert seen == {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "7"}


def test_profile_tables_are_read_per_batch_and_cut_to_the_top_kernels(tmp_path):
    table = {"batch": 8, "draft_calls": 5, "gpu_us_per_draft": 30.0, "launches_per_draft": 3.0,
             "kernels": [{"name": f"k{i}", "launches_per_draft": 1.0, "us_per_draft": 10.0 - i} for i in range(3)]}
    (tmp_path / "draft-profile-123-b8.json").write_text(json.dumps(table))
    assert E.read_profile(str(tmp_path), 8, top=2) == {**table, "kernels": table["kernels"][:2]}
    assert E.read_profile(str(tmp_path), 64) is None


@settings(max_examples=examples(30), deadline=None)
@given(batch=st.integers(1, 64), pairs=st.lists(st.tuples(st.floats(0.1, 5.0), st.floats(0.01, 5.0)), min_size=1,
                                                 max_size=4))
def test_decode_rate_is_per_pair_of_runs_extra_tokens_over_extra_time(batch, pairs):
    """Each (short, long) pair ran the same prompts: the long run's extra tokens over its extra time, one rate per
    pair, computed from scratch here."""
    short = [s for s, _ in pairs]
    long_ = [s + d for s, d in pairs]
    rates = E.decode_rates(batch, 160, short, long_)
    assert len(rates) == len(pairs)
    for r, (_, d) in zip(rates, pairs):
        assert abs(r - batch * (160 - E.SHORT_NEW) / d) <= 1e-9 * r
    assert E.decode_rates(batch, 160, None, None) == []


def test_speed_arguments_are_checked_before_anything_starts(capsys):
    import pytest

    for argv, named in ((["--repeats", "0"], "--repeats"), (["--new", str(E.SHORT_NEW)], "--new"),
                        (["--speed-engines", "sglang,vllm"], "--speed-engines"),
                        (["--speed-engines", "graphcap,graphcap"], "--speed-engines"),
                        (["--speed-engines", "graphcap-pdl"], "--speed-engines"),
                        (["--speed-engines", ","], "--speed-engines"),
                        (["--backends", "reduce-overhead"], "--backends"), (["--backends", ","], "--backends"),
                        (["--projections", "cublas"], "--projections"),
                        (["--projections", "sglang,sglang"], "--projections"), (["--projections", ","], "--projections"),
                        (["--steps", "0"], "--steps"), (["--steps", "-1"], "--steps"), (["--tp", "0"], "--tp")):
        with pytest.raises(SystemExit) as e:
            E.main(["--ckpt", "x", "--speed", "--out", "o.json", *argv])
        assert e.value.code == 2 and named in capsys.readouterr().err


def test_refusal_cases_ask_the_engine_for_their_setting_and_count_only_graphcaps_named_error(monkeypatch, tmp_path):
    """--refusals: each REFUSALS case starts an engine with the flag on, its graphcap backend and its sglang settings
    over the usual ones (stubbed engine here: what it was asked for, and with which environment); a case is ok only
    where the start raised graphcap's DraftCaptureConfigError with the expected phrase - an engine that started, a
    crashed child or another error is not."""
    import os
    import sys
    import types

    from graphcap.sglang.compat import DraftCaptureConfigError

    seen = []

    class Engine:
        def __init__(self, **kw):
            opts = json.loads(os.environ["GRAPHCAP_SGLANG_DRAFT_CAPTURE"])
            seen.append((kw, opts))
            if kw["speculative_eagle_topk"] != 1:
                raise DraftCaptureConfigError("--enable-draft-graph-capture captures a chain draft only: "
                                              "--speculative-eagle-topk must be 1, got 2")
            if kw.get("disable_cuda_graph"):
                raise RuntimeError("Rank 0 scheduler is dead")

        def shutdown(self):
            pass

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    monkeypatch.setenv("GRAPHCAP_SGLANG_DRAFT_CAPTURE", "")
    rows = []
    for case in E.REFUSALS:
        cfg = {"tag": case["name"], "mode": "refusal", "backend": case["backend"], "engine": case["engine"],
               "ckpt": "/ckpt", "cases": [], "max_running": 64, "manifest_dir": str(tmp_path)}
        rows.append(E.refusal_row(case, C.refusal_child(cfg)))
    for (kw, opts), case in zip(seen, E.REFUSALS):
        assert opts == {"enabled": True, "backend": case["backend"], "manifest_dir": str(tmp_path),
                        "projections": "graphcap"}
        assert kw["speculative_algorithm"] == "NEXTN" and all(kw[k] == v for k, v in case["engine"].items())
    assert {c["name"] for c in E.REFUSALS} >= {"reduce-overhead", "eagle-topk-2", "cuda-graphs-off"}
    by = {r["name"]: r for r in rows}
    assert by["eagle-topk-2"]["ok"] and by["eagle-topk-2"]["error_type"] == "DraftCaptureConfigError"
    assert not by["reduce-overhead"]["ok"] and by["reduce-overhead"]["error_type"] is None  # the stub started
    assert not by["cuda-graphs-off"]["ok"] and by["cuda-graphs-off"]["error_type"] == "RuntimeError"
    crashed = E.refusal_row(E.REFUSALS[1], {"crashed": True, "log_tail": "Segmentation fault"})
    assert not crashed["ok"] and crashed["crashed"] and crashed["log_tail"] == "Segmentation fault"


def test_refusals_alone_are_a_valid_run(monkeypatch, tmp_path):
    """--ckpt with --refusals (no --check or --speed) passes the argument check and writes a record with one row per
    case (children stubbed)."""
    out = tmp_path / "r.json"
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 64}))
    monkeypatch.setattr(E, "spawn", lambda cfg, work: {"config": cfg, "error_type": "DraftCaptureConfigError",
                                                      "message": "x", "seconds": 1.0})
    assert E.main(["--ckpt", str(tmp_path), "--refusals", "--out", str(out)]) == 0
    rec = json.load(open(out))
    assert [r["name"] for r in rec["refusals"]] == [c["name"] for c in E.REFUSALS]
    assert rec["check"] is None and rec["speed"] is None and not any(r["ok"] for r in rec["refusals"])


def test_speed_runs_graphcap_once_per_backend_and_projections_value(monkeypatch, tmp_path):
    """--projections graphcap,sglang: a graphcap engine per (backend, value), in order, each asking the plugin for its
    value (the JSON the engine's child sets); the first value's engines keep the plain graphcap-BACKEND tag."""
    out = tmp_path / "s.json"
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 64}))
    spawned = []
    monkeypatch.setenv("GRAPHCAP_SGLANG_DRAFT_CAPTURE", "")  # recorded as it was: the children's setting undone after

    def spawn(cfg, work):
        if cfg["mode"] == "graphcap":  # what the child would put in the plugin's variable
            C.enable_graphcap(cfg)
            cfg = dict(cfg, asked=json.loads(os.environ["GRAPHCAP_SGLANG_DRAFT_CAPTURE"]))
        spawned.append(cfg)
        return {"config": cfg, "cases": []}

    monkeypatch.setattr(E, "spawn", spawn)
    assert E.main(["--ckpt", str(tmp_path), "--speed", "--speed-engines", "sglang,graphcap", "--backends",
                   "cudagraph,inductor-cudagraph", "--projections", "graphcap,sglang", "--out", str(out)]) == 0
    assert [c["tag"] for c in spawned] == ["speed-sglang", "speed-graphcap-cudagraph",
                                           "speed-graphcap-cudagraph-sglang-proj", "speed-graphcap-inductor-cudagraph",
                                           "speed-graphcap-inductor-cudagraph-sglang-proj"]
    assert [(c["asked"]["backend"], c["asked"]["projections"]) for c in spawned[1:]] == [
        ("cudagraph", "graphcap"), ("cudagraph", "sglang"), ("inductor-cudagraph", "graphcap"),
        ("inductor-cudagraph", "sglang")]
    assert set(json.load(open(out))["speed"]["startup_s"]) == {c["tag"][len("speed-"):] for c in spawned}


def test_speed_runs_graphcap_without_pdl_as_its_own_engine(monkeypatch, tmp_path):
    """--speed-engines graphcap,graphcap-nopdl: two graphcap engines per backend, the second tagged graphcap-nopdl
    and started with GRAPHCAP_PDL=0 (what its child sets); the first leaves the variable as it was."""
    out = tmp_path / "s.json"
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 64}))
    monkeypatch.setenv("GRAPHCAP_SGLANG_DRAFT_CAPTURE", "")
    monkeypatch.setenv("GRAPHCAP_PDL", "1")
    spawned = []

    def spawn(cfg, work):
        os.environ["GRAPHCAP_PDL"] = "1"  # each child starts from this process's environment
        C.enable_graphcap(cfg)
        spawned.append((cfg["tag"], cfg["mode"], os.environ["GRAPHCAP_PDL"]))
        return {"config": cfg, "cases": []}

    monkeypatch.setattr(E, "spawn", spawn)
    assert E.main(["--ckpt", str(tmp_path), "--speed", "--speed-engines", "graphcap,graphcap-nopdl", "--backends",
                   "cudagraph", "--out", str(out)]) == 0
    assert spawned == [("speed-graphcap-cudagraph", "graphcap", "1"),
                       ("speed-graphcap-nopdl-cudagraph", "graphcap", "0")]
    assert set(json.load(open(out))["speed"]["startup_s"]) == {"graphcap-cudagraph", "graphcap-nopdl-cudagraph"}


def test_steps_reach_every_engine_with_a_draft_and_the_record(monkeypatch, tmp_path):
    """--steps N: each engine with a draft (stock sglang's and graphcap's) asks sglang for N draft steps and N + 1
    draft tokens (its chain for topk 1), the target alone for none; the record names N and the sglang that ran.
    Without --steps: 3, as before."""
    from graphcap.sglang.compat import sglang_version

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 64}))
    for argv, steps in (([], 3), (["--steps", "1"], 1), (["--steps", "2"], 2)):
        spawned = []
        monkeypatch.setattr(E, "spawn", lambda cfg, work: spawned.append(cfg) or {"config": cfg, "cases": []})
        out = tmp_path / f"s{steps}.json"
        assert E.main(["--ckpt", str(tmp_path), "--speed", "--out", str(out), "--backends", "cudagraph",
                       *argv]) == 0
        kwargs = {c["mode"]: C.engine_kwargs(c) for c in spawned}
        assert set(kwargs) == {"nospec", "sglang", "graphcap"}
        for mode in ("sglang", "graphcap"):
            kw = kwargs[mode]
            assert (kw["speculative_num_steps"], kw["speculative_num_draft_tokens"]) == (steps, steps + 1)
            assert kw["speculative_eagle_topk"] == 1
        assert "speculative_num_steps" not in kwargs["nospec"]
        rec = json.load(open(out))
        assert rec["steps"] == steps and rec["sglang"] == sglang_version()


def test_tp_reaches_every_engine_and_the_summary_counts_every_ranks_manifest(monkeypatch, tmp_path):
    """--tp N: every engine, the target alone included, asks sglang for tp_size N and the record names N (without
    --tp: 1, as before); the manifest summary counts every rank's file (each rank writes its own)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 64}))
    for argv, tp in (([], 1), (["--tp", "2"], 2)):
        spawned = []
        monkeypatch.setattr(E, "spawn", lambda cfg, work: spawned.append(cfg) or {"config": cfg, "cases": []})
        out = tmp_path / f"tp{tp}.json"
        assert E.main(["--ckpt", str(tmp_path), "--speed", "--out", str(out), "--backends", "cudagraph", *argv]) == 0
        assert sorted(c["mode"] for c in spawned) == ["graphcap", "nospec", "sglang"]
        assert {C.engine_kwargs(c)["tp_size"] for c in spawned} == {tp}
        assert json.load(open(out))["tp"] == tp
    d = tmp_path / "manifests"
    d.mkdir()
    for rank, statuses in ((0, ("captured", "captured")), (1, ("captured", "failed"))):
        buckets = [{"status": s, "reason": "OutOfMemoryError" if s == "failed" else None, "replays": 5,
                    "fallbacks": 2 if s == "failed" else 0} for s in statuses]
        (d / f"x-w8-s3-cudagraph-tp{rank}.json").write_text(json.dumps({"buckets": buckets,
                                                                        "oversize_fallbacks": rank}))
    assert E.manifest_summary(str(d)) == {
        "manifests": 2, "captured": 3, "buckets": 4, "replays": 20, "fallbacks": 3, "reasons": ["OutOfMemoryError"],
        "per_manifest": {"x-w8-s3-cudagraph-tp0.json": [2, 2], "x-w8-s3-cudagraph-tp1.json": [1, 2]}}
