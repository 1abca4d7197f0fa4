"""The server harness (bench/sglang_server.py over graphcap.bench.server, .load, .server_report) on a CPU: its pure
parts against independent references, and whole runs against tests/fake_sglang_server.py - sglang's HTTP API over
a "model" whose next token is the last plus one - with sglang's real benchmark client (tests/bench_serving_stubbed.py).
A server that answers differently, stalls or dies must show in the record exactly where it did. The real server
runs on the GPU machine (scripts/gpu-check.sh server)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.bench import load
from graphcap.bench import server_report as rep
from graphcap.bench.server import ServerConfig, http_json, server_command, server_env
from bench_scripts import load_bench_script, tiny_w8a8  # noqa: F401 - a fixture
from tiers import examples

ROOT = Path(__file__).resolve().parents[2]
ck = load_bench_script("sglang_checkpoint")

PY = sys.executable


# -----------------------------------------------------------------------------------------------------------------
# the server's command line and environment


def test_each_kind_is_launched_with_sglangs_defaults_and_only_its_own_flags(tmp_path):
    base = dict(model_path="/m/target", draft_model_path="/m/assistant", port=30123)
    cmds = {k: server_command(ServerConfig(kind=k, **base), manifest_dir=tmp_path) for k in ("nospec", "sglang",
                                                                                             "graphcap")}
    for k, cmd in cmds.items():
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        assert " --attention-backend triton --page-size 64 " in " ".join(cmd) + " "
        for default_off in ("--disable-radix-cache", "--disable-overlap-schedule", "--cuda-graph-bs",
                            "--chunked-prefill-size", "--mem-fraction-static"):
            assert default_off not in cmd, (k, default_off)  # sglang's defaults stay its own
    assert "--speculative-algorithm" not in cmds["nospec"]
    spec = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    for k in ("sglang", "graphcap"):
        assert " ".join(spec) in " ".join(cmds[k])
    assert "--enable-draft-graph-capture" in cmds["graphcap"] and "--enable-draft-graph-capture" not in cmds["sglang"]
    assert cmds["graphcap"][cmds["graphcap"].index("--draft-graph-manifest-dir") + 1] == str(tmp_path)
    # every departure from sglang's defaults is in the record's list
    cfg = ServerConfig(kind="graphcap", extra_args=("--max-total-tokens", "4096"), **base)
    flags = {a for a in server_command(cfg) if a.startswith("--")}
    named = {d.split()[0] for d in cfg.departures}
    assert {"--enable-cache-report", "--enable-metrics", "--disable-prefill-cuda-graph", "--max-total-tokens"} <= named
    assert named <= flags
    assert "--disable-prefill-cuda-graph" not in server_command(ServerConfig(kind="graphcap", prefill_graphs=True,
                                                                             **base))


def _sglang_root(version: str) -> Path | None:
    """Where sglang `version` is installed for the tests: the venv's 0.5.23; 0.5.18 beside it (`make venv`, as
    tests/sglang/test_runtime.py finds it)."""
    import importlib.util

    if version == "0.5.23":
        spec = importlib.util.find_spec("sglang")
        return Path(spec.origin).parent if spec is not None else None
    root = Path(os.environ.get("GRAPHCAP_SGLANG_0518") or Path(sys.prefix) / "sglang-0518") / "sglang"
    return root if root.is_dir() else None


@pytest.mark.parametrize("version", ["0.5.23", "0.5.18"])
def test_sglang_turns_prefill_graphs_off_for_the_users_checkpoint_not_for_the_stand_in(version):
    """Why the harness's --disable-prefill-cuda-graph is the user's own setting: sglang's model config counts Gemma 4's
    multimodal checkpoint as a multimodal model on neither prefill-graph allowlist (its start-up then disables the
    breakable prefill graph), while the text-only Gemma4ForCausalLM the stand-in checkpoints declare is no multimodal
    model and would keep it. Read from each installed sglang's own tables (the module imports torchvision, which
    this machine lacks: the lists are read from its source)."""
    import ast

    root = _sglang_root(version)
    if root is None:
        pytest.skip(f"sglang {version} is not installed")
    src = root / "srt" / "configs" / "model_config.py"
    tables = {n.targets[0].id: {e.value for e in n.value.elts if isinstance(e, ast.Constant)}  # names spelled out
              for n in ast.parse(src.read_text()).body if isinstance(n, ast.Assign)
              and isinstance(n.targets[0], ast.Name) and n.targets[0].id.startswith("multimodal_")
              and isinstance(n.value, ast.List)}
    user, stand_in = "Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"
    assert user in tables["multimodal_model_archs"] and stand_in not in tables["multimodal_model_archs"]
    assert user not in tables["multimodal_breakable_cuda_graph_supported_model_archs"]
    assert user not in tables["multimodal_piecewise_cuda_graph_supported_model_archs"]
    assert stand_in in json.dumps(ServerConfig(kind="nospec", model_path="m").departures)


@pytest.mark.parametrize("kw, match", [
    (dict(kind="eagle"), "server kind"),
    (dict(kind="sglang", draft_model_path=None), "needs the draft"),
    (dict(kind="sglang", check=True), "check mode is graphcap's"),
])
def test_bad_server_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(**{"model_path": "/m", "draft_model_path": "/d", **kw})


@pytest.mark.parametrize("args, says", [
    (["--soak-on", "graphcap,eagle"], "--soak-on: kinds from nospec, sglang, graphcap, got graphcap,eagle"),
    (["--request-rates", "2,inf"], "--request-rates: finite requests per second > 0, got '2,inf'"),
    (["--request-rates", "fast"], "--request-rates: finite requests per second > 0, got 'fast'"),
    (["--phases", "bench,warp"], "--phases from"),
    (["--concurrency", "8,0"], "--concurrency positive"),
    (["--pressure", "48"], "--pressure: REQUESTSxTOKENS, both positive, got '48'"),
    (["--pressure", "0x512"], "--pressure: REQUESTSxTOKENS, both positive, got '0x512'"),
    (["--range-ratio", "1.5"], "--range-ratio from 0 to 1 and --input-len, --output-len positive: got 1.5, 1024, 256"),
    (["--output-len", "0"], "--range-ratio from 0 to 1 and --input-len, --output-len positive: got 0.5, 1024, 0"),
    (["--range-ratio", "half"], "argument --range-ratio: invalid float value: 'half'"),
])
def test_bad_harness_options_are_one_line(tmp_path, capsys, args, says):
    harness_main = load_bench_script("sglang_server").main
    try:
        rc = harness_main(["--ckpt", str(tmp_path / "ck"), "--work", str(tmp_path / "w"), "--out",
                           str(tmp_path / "o.json"), *args])
    except SystemExit as e:  # the parser's own refusals (a value of the wrong type) exit
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w").exists()  # refused before anything was made


@settings(max_examples=examples(60), deadline=None)
@given(left=st.floats(0, 900), startups=st.lists(st.floats(5, 300), max_size=3), need=st.floats(0, 400))
def test_a_server_starts_only_if_its_start_and_phases_end_by_the_deadline(left, startups, need):
    """The longest start-up measured so far (a fresh machine's first start before any) plus the phases' least useful
    time must fit in what is left of the call; no deadline, no limit."""
    sm = load_bench_script("sglang_server")
    why = sm.time_short(1000.0 + left, 1000.0, startups, need)
    expect = max(startups) if startups else sm.FIRST_START_S
    assert (why is None) == (left >= expect + need)
    if why is not None:
        assert f"{left:.0f} s of the call's time left" in why and f"~{expect:.0f} s" in why
    assert sm.time_short(None, 1000.0, startups, need) is None


def test_a_soak_only_server_needs_its_warm_up_and_half_a_minute():
    from types import SimpleNamespace

    sm = load_bench_script("sglang_server")
    a = SimpleNamespace(phases=["soak"], soak_on=["graphcap", "sglang"], soak_warmup_s=60.0)
    assert sm.min_phase_s(a, "graphcap") == 90.0
    assert sm.min_phase_s(a, "nospec") == 60.0  # not soaked: its other phases
    assert sm.min_phase_s(SimpleNamespace(phases=["bench", "soak"], soak_on=["sglang"], soak_warmup_s=60.0),
                          "sglang") == 60.0


def test_the_servers_environment(tmp_path):
    base = {"GRAPHCAP_SGLANG_DRAFT_CAPTURE": '{"enabled": true}', "GRAPHCAP_SGLANG_CHECK": "1", "KEEP": "x"}
    env = server_env(ServerConfig(kind="sglang", model_path="/m", draft_model_path="/d"), tmp_path, base)
    assert "GRAPHCAP_SGLANG_DRAFT_CAPTURE" not in env and "GRAPHCAP_SGLANG_CHECK" not in env  # only the flag
    assert env["GRAPHCAP_SGLANG_TRACE"] == str(tmp_path) and env["KEEP"] == "x"
    env = server_env(ServerConfig(kind="graphcap", model_path="/m", draft_model_path="/d", check=True), None, {})
    assert env["GRAPHCAP_SGLANG_CHECK"] == "1" and "GRAPHCAP_SGLANG_TRACE" not in env


def test_a_server_that_stops_answering_is_waited_for_while_it_dies(tmp_path):
    """A server whose connections are gone is not judged alive while its process is still exiting: `responsive`
    answers False once /health fails, after waiting (within its grace) for the process to end."""
    import subprocess as sp

    from graphcap.bench.server import Server

    srv = Server(ServerConfig(kind="nospec", model_path="m", port=free_port()), tmp_path)
    srv.proc = sp.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    try:
        assert srv.responsive(timeout_s=1, exit_grace_s=20) is False
        assert not srv.alive()  # it waited for the exit, not the whole grace
    finally:
        srv.proc.kill()
        srv.proc.wait()


def test_a_server_starts_with_no_earlier_servers_traces(tmp_path):
    """A warm machine keeps the work dir: an earlier server's trace files under the same label are gone before this
    one starts (they would count in its compiles, draft calls and host samples); other files stay."""
    from graphcap.bench.server import Server, ServerFailed

    srv = Server(ServerConfig(kind="graphcap", model_path="m", draft_model_path="d", port=free_port()), tmp_path,
                 launcher=(sys.executable, "-c", "import sys; sys.exit(3)"))
    srv.trace_dir.mkdir(parents=True)
    for name in ("compiles-11.jsonl", "draft-trace-11.jsonl", "host-samples-11.jsonl", "prefill-trace-11.jsonl"):
        (srv.trace_dir / name).write_text('{"t": 1}\n')
    kept = tmp_path / "graphcap-phases.json"
    kept.write_text("{}")
    with pytest.raises(ServerFailed, match="exited with status 3"):
        srv.start()
    assert not srv.trace_dir.exists() or list(srv.trace_dir.iterdir()) == []
    assert kept.read_text() == "{}"


# -----------------------------------------------------------------------------------------------------------------
# the report's arithmetic


@settings(max_examples=examples(60), deadline=None)
@given(texts=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=30), min_size=1, max_size=12), data=st.data())
def test_compare_texts_finds_each_first_differing_word(texts, data):
    ours = [" ".join(f"w{i}" for i in t) for t in texts]
    theirs, want = list(ours), {}
    for i, t in enumerate(texts):
        if data.draw(st.booleans(), label=f"change {i}"):
            j = data.draw(st.integers(0, len(t) - 1), label=f"word {i}")
            words = ours[i].split()
            words[j] = "other"
            theirs[i], want[i] = " ".join(words), j
    skip = [data.draw(st.booleans(), label="skip") for _ in texts]
    r = rep.compare_texts(ours, theirs, skip)
    expect = {i: j for i, j in want.items() if not skip[i]}
    assert {d["request"]: d["first_word"] for d in r["differ"]} == expect
    assert r["compared"] == sum(not s for s in skip) and r["equal"] == r["compared"] - len(expect)


def test_compare_texts_a_shorter_reply_differs_where_it_ends():
    r = rep.compare_texts(["w1 w2 w3", "w1"], ["w1 w2", "w1"])
    assert r["differ"] == [{"request": 0, "first_word": 2, "ours": "w3", "theirs": "", "lengths": [3, 2]}]
    with pytest.raises(ValueError, match="2 replies against 1"):
        rep.compare_texts(["a", "b"], ["a"])


@settings(max_examples=examples(60), deadline=None)
@given(xs=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=300))
def test_percentiles_are_nearest_rank(xs):
    p = rep.percentiles(xs)
    v = sorted(x * 1e3 for x in xs)
    for q, key in ((0.5, "p50"), (0.99, "p99")):  # nearest rank: the smallest value with >= q of them at or below
        want = next(x for x in v if sum(y <= x for y in v) >= q * len(v))
        assert p[key] == pytest.approx(round(want, 3))
    assert p["max"] == pytest.approx(round(v[-1], 3)) and p["n"] == len(xs)
    assert rep.percentiles([]) == {"n": 0, "p50": None, "p99": None, "max": None}


def test_draft_gaps_names_each_long_gap_with_the_compiles_inside_it():
    rng = random.Random(0)
    t, calls = 100.0, []
    for i in range(400):
        t += 0.004 + rng.random() * 0.002
        if i in (150, 300):
            t += 0.25 if i == 150 else 0.12
        calls.append({"t": t, "rids": ["a"]})
    compiles = [{"kernel": "m:k", "t": calls[150]["t"] - 0.1, "ms": 240.0}, {"kernel": "m:early", "t": 100.0, "ms": 9}]
    profiled = {"t": calls[200]["t"] + 1e-4, "profiled": True}  # a profiled call is no call of the timing
    g = rep.draft_gaps(calls + [profiled], after=calls[20]["t"], limit_ms=100, compiles=compiles)
    assert g["calls"] == 380
    gap_ms = [round((calls[i]["t"] - calls[i - 1]["t"]) * 1e3) for i in (150, 300)]
    assert [(round(x["ms"]), [c["kernel"] for c in x["compiles"]]) for x in g["over_limit"]] == \
        [(gap_ms[0], ["m:k"]), (gap_ms[1], [])]
    ms = [(b["t"] - a["t"]) * 1e3 for a, b in zip(calls[20:], calls[21:])]
    assert g["median_ms"] == pytest.approx(round(statistics.median(ms), 3))
    assert (g["over_limit_joined"], g["over_limit_no_join"]) == (0, 2)


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_draft_gaps_tell_a_prefill_pause_from_a_stall(data):
    """Against a rebuild from the simulated scheduler's own log: each gap is known to hold prefill batches (whose
    requests joined, with their lengths; or a one-token request's, which joins nothing) or none. Read from the joins
    alone (no prefill records) a one-token request's prefill counts as no join; from the prefill records, exactly."""
    rng = random.Random(data.draw(st.integers(0, 2**31)))
    t, running, calls, prefills, truth, next_rid = 0.0, {}, [], [], [], 0
    for _ in range(data.draw(st.integers(2, 80))):
        joined, batches = {}, []
        if rng.random() < 0.3:  # a prefill batch of 1-3 new requests ran before this decode iteration
            batch = {}
            for _ in range(rng.randint(1, 3)):
                batch[f"r{next_rid}"] = rng.randint(1, 4096)
                next_rid += 1
            joined.update(batch)
            batches.append(sum(batch.values()))
        if rng.random() < 0.15:  # a one-token request: prefilled, finished, never in a decode batch
            batches.append(rng.randint(1, 4096))
            next_rid += 1
        for rid in [r for r in running if rng.random() < 0.1]:
            del running[rid]
        gap = rng.choice([0.01, 0.03, 0.15, 0.4]) + 0.2 * len(batches)
        prefills += [{"t": t + (k + 1) * gap / (len(batches) + 1), "extend_tokens": n, "cached_tokens": 7}
                     for k, n in enumerate(batches)]
        t += gap
        running.update(joined)
        if not running:
            running[f"r{next_rid}"] = 10
            joined[f"r{next_rid}"] = 10
            next_rid += 1
        order = list(running)
        rng.shuffle(order)
        calls.append({"t": t, "rids": order, "seq_lens": [running[r] for r in order]})
        truth.append((gap * 1e3, len(joined), sum(joined.values()), batches))
    start = calls[0]["t"]
    window = [x for x in prefills if x["t"] >= start]
    want = [(round(ms, 1), n, tok) for ms, n, tok, _ in truth[1:] if ms > 100.0]
    for records in (None, prefills):
        g = rep.draft_gaps(calls, after=start, limit_ms=100.0, prefills=records)
        assert [(x["ms"], x["joined"], x["joined_tokens"]) for x in g["over_limit"]] == want
        assert g["over_limit_joined"] == sum(n > 0 for _, n, _ in want)
        assert g["over_limit_no_join"] == sum(n == 0 for _, n, _ in want)
        quiet = [ms for ms, n, _, _ in truth[1:] if n == 0]
        assert g["max_ms_no_join"] == (round(max(quiet), 1) if quiet else None)
    assert "over_limit_prefill" not in rep.draft_gaps(calls, after=start, limit_ms=100.0)
    long = [(b, ms) for ms, _, _, b in truth[1:] if ms > 100.0]
    assert [(x["prefills"], x["prefill_tokens"]) for x in g["over_limit"]] == [(len(b), sum(b)) for b, _ in long]
    assert (g["over_limit_prefill"], g["over_limit_no_prefill"]) == (sum(bool(b) for b, _ in long),
                                                                    sum(not b for b, _ in long))
    bare = [ms for ms, _, _, b in truth[1:] if not b]
    assert g["max_ms_no_prefill"] == (round(max(bare), 1) if bare else None)
    assert g["prefill_batches"] == len(window)


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_prefill_time_against_numpy(data):
    """Each column's p50 / p99 is numpy's nearest-rank percentile (inverted CDF) of that column; the idle share is
    the median over the profiled records of 1 - kernel / span; records without a column are left out of it."""
    import numpy as np

    rng = random.Random(data.draw(st.integers(0, 2**31)))
    recs = []
    for _ in range(data.draw(st.integers(1, 60))):
        gpu = rng.uniform(5, 300)
        r = {"t": rng.random(), "extend_tokens": rng.randint(1, 8192), "host_ms": rng.uniform(1, 300),
             "gpu_ms": gpu if rng.random() > 0.1 else None}
        if r["gpu_ms"] and rng.random() < 0.3:
            r.update(kernel_ms=gpu * rng.uniform(0.05, 1.0), launches=rng.randint(100, 4000), profiled=True)
        recs.append(r)
    got = rep.prefill_time(recs)

    def want(key):
        v = [r[key] for r in recs if r.get(key) is not None]
        if not v:
            return {"p50": None, "p99": None}
        return {q: round(float(np.percentile(v, p, method="inverted_cdf")), 3) for q, p in (("p50", 50), ("p99", 99))}

    for key in ("host_ms", "gpu_ms", "kernel_ms"):
        assert got[key] == want(key), key
    assert got["tokens"] == want("extend_tokens")
    idle = [1 - r["kernel_ms"] / r["gpu_ms"] for r in recs if "kernel_ms" in r]
    assert got["profiled"] == len(idle) and got["batches"] == len(recs)
    assert got["gpu_idle_share"] == (round(float(np.median(idle)), 3) if idle else None)
    calls = [{"t": -1.0, "rids": ["a"]}, {"t": 2.0, "rids": ["a"]}]  # every record inside the one gap
    assert rep.draft_gaps(calls, after=-1.0, limit_ms=1.0, prefills=recs)["prefill_time"] == got


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_prefill_share_counts_the_batches_inside_the_run_against_fractions(data):
    """The batches stamped inside the run's window (ends included) with a GPU span, their summed span in seconds and
    its share of the client's duration - against exact fractions over records placed before, inside and after it."""
    from fractions import Fraction

    rng = random.Random(data.draw(st.integers(0, 2**31)))
    lo, hi = sorted(rng.uniform(100, 900) for _ in range(2))
    recs = [{"t": rng.choice([rng.uniform(0, lo), rng.uniform(lo, hi), rng.uniform(hi, 1000), lo, hi]),
             "gpu_ms": rng.uniform(5, 300) if rng.random() > 0.1 else None}
            for _ in range(data.draw(st.integers(0, 80)))]
    duration = data.draw(st.sampled_from([None, 0.0, rng.uniform(1, 60)]))
    got = rep.prefill_share(recs, [lo, hi], duration)
    inside = [r for r in recs if lo <= r["t"] <= hi and r["gpu_ms"] is not None]
    gpu = sum(Fraction(r["gpu_ms"]) for r in inside) / 1000
    assert got["prefill_batches"] == len(inside)
    assert got["prefill_gpu_s"] == round(float(gpu), 3)
    assert got["prefill_share"] == (round(float(gpu / Fraction(duration)), 3) if duration else None)


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_matched_prefills_pair_the_same_loads_batches(data):
    """Two servers' prefill batches of one load, ours in another order, each server with batches the other lacks:
    every shared batch pairs with its twin, and the medians are of the known per-batch differences
    (statistics.median)."""
    keys = data.draw(st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 4096), st.integers(1, 4)), max_size=25,
                              unique=True), label="shared batches")
    n = len(keys)
    dg = data.draw(st.lists(st.floats(-50, 50, allow_nan=False), min_size=n, max_size=n), label="gpu diffs")
    dh = data.draw(st.lists(st.floats(-50, 50, allow_nan=False), min_size=n, max_size=n), label="host diffs")

    def rec(key, gpu, host):
        return {"extend_tokens": key[0], "cached_tokens": key[1], "rids": [f"r{j}" for j in range(key[2])],
                "gpu_ms": gpu, "host_ms": host}
    theirs = [rec(k, 10.0 * (i + 1), 5.0 * (i + 1)) for i, k in enumerate(keys)]
    ours = [rec(k, t["gpu_ms"] + g, t["host_ms"] + h) for k, t, g, h in zip(keys, theirs, dg, dh)]
    ours += [rec((5000 + i, 0, 1), 1.0, 1.0) for i in range(data.draw(st.integers(0, 5), label="ours only"))]
    theirs += [rec((9000 + i, 0, 1), 1.0, 1.0) for i in range(data.draw(st.integers(0, 5), label="theirs only"))]
    ours = [ours[i] for i in data.draw(st.permutations(range(len(ours))), label="our order")]
    got = rep.matched_prefills(ours, theirs)
    assert (got["matched"], got["ours"], got["theirs"]) == (n, len(ours), len(theirs))
    assert got["gpu_ms_diff_p50"] == (round(statistics.median(dg), 3) if n else None)
    assert got["host_ms_diff_p50"] == (round(statistics.median(dh), 3) if n else None)


def test_matched_prefills_pair_a_repeated_batch_in_time_order():
    """The same batch shape served twice on both servers (two requests of one length): first with first."""
    def rec(gpu):
        return {"extend_tokens": 300, "cached_tokens": 64, "rids": ["a"], "gpu_ms": gpu, "host_ms": gpu}
    got = rep.matched_prefills([rec(11.0), rec(50.0), rec(7.0)], [rec(10.0), rec(20.0)])
    assert (got["matched"], got["gpu_ms_diff_p50"]) == (2, 15.5)  # 11 - 10 and 50 - 20; the third unmatched


def test_prefill_comparisons_order_the_flag_first_and_keep_pools_apart():
    one = [{"extend_tokens": 100, "cached_tokens": 0, "rids": ["a"], "gpu_ms": 30.0, "host_ms": 31.0}]
    slower = [{**one[0], "gpu_ms": 32.5, "host_ms": 31.0}]
    got = rep.prefill_comparisons({"nospec": one, "sglang-small": one, "graphcap": slower, "sglang": one,
                                   "graphcap-small": [], "graphcap-check-small": slower})
    assert set(got) == {"graphcap vs sglang", "graphcap vs nospec", "sglang vs nospec",
                        "graphcap-check-small vs sglang-small"}  # the flag first; an empty trace left out
    assert got["graphcap vs nospec"] == {"matched": 1, "ours": 1, "theirs": 1, "gpu_ms_diff_p50": 2.5,
                                         "host_ms_diff_p50": 0.0}


def test_memory_and_compiles_summaries():
    samples = [(0.0, 1000), (1.0, 5000), (2.0, 5100), (3.0, 5050), (4.0, 5300)]
    assert rep.memory_trend(samples, after=1.5) == {"samples": 5, "at_warmup_end_mib": 5100,
                                                    "max_after_warmup_mib": 5300, "at_end_mib": 5300,
                                                    "growth_after_warmup_mib": 200}
    assert rep.memory_trend([], after=0) is None
    compiles = [{"kernel": "a", "t": 1, "ms": 5, "serving": False}, {"kernel": "b", "t": 2, "ms": 400, "serving": True},
                {"kernel": "c", "t": 3, "ms": 2, "serving": True, "preload": True},
                {"kernel": "d", "t": 9, "ms": 300, "serving": True, "variant": "d[bs1]"}]
    s = rep.compiles_summary(compiles, after=5)
    assert (s["preloaded"], s["at_startup"], s["while_serving"]) == (1, 1, 2)
    assert s["after_warmup"] == [{"kernel": "d", "ms": 300, "variant": "d[bs1]"}]


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64), st.integers(0, 9000)), max_size=12),
       st.randoms(use_true_random=False))
@settings(max_examples=examples(60), deadline=None)
def test_retractions_count_sglangs_own_log_lines(events, rnd):
    # the warning as sglang's scheduler builds it (retract_decode's caller, 0.5.18 and 0.5.23), among other lines
    lines = []
    for pool_full, n, gained in events:
        prefix = "KV cache pool is full. Retract requests. " if pool_full else "Testing retraction. "
        details = f"#retracted_reqs: {n}, #new_tokens_gained: {gained}"
        details += f", #new_token_ratio: 0.{rnd.randint(1000, 9999)} -> 0.9000" if pool_full else ""
        lines.append(f"[t] WARNING scheduler.py:1: {prefix}{details}")
    noise = ["Decode batch. #running-req: 12, #token: 900, #retracted-req: 3", "Prefill batch. #new-seq: 1"]
    for ln in noise * 3:
        lines.insert(rnd.randint(0, len(lines)), ln)
    assert rep.retractions("\n".join(lines)) == {
        "events": len(events), "requests": sum(n for _, n, _ in events),
        "pool_full_events": sum(full for full, _, _ in events)}


@given(st.lists(st.sampled_from(range(5)), max_size=20))
@settings(max_examples=examples(40), deadline=None)
def test_pool_check_warnings_count_sglangs_idle_check_lines(kinds):
    # the idle check's messages as sglang's invariant_checker builds them; kind 4: a line that is none of them
    made = ["token_to_kv_pool_allocator memory leak detected! available_size=3, evictable_size=0",
            "SWA Pool Mem Leak Detected! full_num_used=9", "KV double free: sub-pool 1 has 2 duplicate pages.",
            "KV page use-after-free: 4 owner page refs are in the free pool, sample pages=[1, 2].",
            "Decode batch. #running-req: 12, #token: 900, memory usage 0.41"]
    log = "\n".join(f"[t] WARNING invariant_checker.py: {made[k]}" for k in kinds)
    assert rep.pool_check_warnings(log) == sum(k < 4 for k in kinds)


def test_retractions_match_the_installed_sglangs_message():
    sglang = pytest.importorskip("sglang", reason="the real sglang package is not installed")
    text = (Path(sglang.__file__).parent / "srt" / "managers" / "scheduler.py").read_text()
    assert '"KV cache pool is full. Retract requests. "' in text and '"Testing retraction. "' in text
    assert 'f"#retracted_reqs: {len(retracted_reqs)}' in text
    checker = (Path(sglang.__file__).parent / "srt" / "managers" / "scheduler_components" / "invariant_checker.py")
    assert all(w.split("!")[0].split(":")[0] in checker.read_text() for w in rep.POOL_CHECK_WARNINGS)


def test_a_difference_is_a_near_tie_only_where_stock_also_differs_and_carries_its_margin():
    """The continuation asked where two replies part is the prompt and the words they share; stock's differences with
    itself are gathered from every run a key takes part in (None where stock ran the requests once); a difference is
    annotated with the margin asked for it and is a near-tie only at a position stock also differs at."""
    assert rep.continuation({"prompt": "p q", "text": "x  y z"}, 2) == "p q x y"
    assert rep.continuation({"prompt": "p q", "text": "x y"}, 0) == "p q"
    assert rep.continuation({"text": "x y"}, 1) is None
    across = {"bench-c1 vs bench-c8": {"differ": [{"request": 1, "first_word": 3}]},
              "bench-c1 vs bench-c32": {"differ": [{"request": 4, "first_word": 0}]}}
    assert rep.self_differences(across, "bench-c8") == {(1, 3)}
    assert rep.self_differences(across, "bench-c1") == {(1, 3), (4, 0)}
    assert rep.self_differences(across, "gsp") is None and rep.self_differences(None, "bench-c8") is None
    cmp = rep.compare_texts(["a b c d", "a b c", "e f"], ["a b x d", "a b c", "e g"])
    margins = {(0, 2): {"margin": 0.01, "top": [[-0.69, 5, "x"], [-0.70, 6, "c"]]}}
    out = rep.annotate_differences(cmp, margins, {(0, 2)})
    first, second = out["differ"]
    assert (first["margin"], first["stock_also_differs"], first["near_tie"]) == (0.01, True, True)
    assert "margin" not in second and (second["stock_also_differs"], second["near_tie"]) == (False, False)
    assert rep.annotate_differences(rep.compare_texts(["a"], ["b"]), {}, None)["differ"][0]["near_tie"] is False


def test_stop_string_errors_compares_with_the_free_continuation():
    fault = {"stops": ["w9", None, "w19"],
             "free": [{"text": " ".join(f"w{i}" for i in range(20))}, {"text": "w1"},
                      {"text": " ".join(f"w{i}" for i in range(10, 30))}],
             "replies": [{"text": " ".join(f"w{i}" for i in range(9))}, {"text": "anything"},
                         {"text": "w10 w11"}]}
    errs = load.stop_string_errors(fault)
    assert len(errs) == 1 and errs[0].startswith("request 2:")


# -----------------------------------------------------------------------------------------------------------------
# whole runs against the stand-in server


def needs(*modules: str) -> None:
    """Skip unless `modules` are installed, without importing them here: the harness's children import them, and an
    import of transformers in this process leaves module aliases that a later sglang import replaces (which the
    process-state guard would count against whichever test comes next)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    needs("aiohttp", "transformers")
    d = tmp_path_factory.mktemp("ck")
    for name in ("target", "assistant"):
        (d / name).mkdir()
        ck.write_tokenizer(d / name, 2048, 8192)
    return d


def harness(ckpt: Path, work: Path, *args: str, env: dict | None = None, port: int) -> tuple[int, dict, str]:
    cmd = [PY, str(ROOT / "bench" / "sglang_server.py"), "--ckpt", str(ckpt), "--work", str(work),
           "--out", str(work / "server.json"), "--port", str(port), "--window", "64", "--largest-bucket", "8",
           "--launcher", f"{PY} {ROOT / 'tests' / 'fake_sglang_server.py'}",
           "--bench-serving", f"{PY} {ROOT / 'tests' / 'bench_serving_stubbed.py'}", *args]
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=600, cwd=str(work))
    out = json.loads((work / "server.json").read_text()) if (work / "server.json").exists() else {}
    return p.returncode, out, p.stdout + p.stderr


def free_port(block: int = 4) -> int:
    """A port with the `block - 1` after it free too: the harness starts its i-th server on port + i, and a port
    taken by another test's server still stopping fails that start."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + block > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for p in range(base, base + block):
                    t = stack.enter_context(socket.socket())
                    t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {block} consecutive free ports")


@pytest.mark.subprocess
def test_a_server_that_answers_differently_is_named_where_it_does(ckpt, tmp_path):
    """graphcap's (stand-in) server answers one request one token off from its third token: the comparison with
    stock's names that request at that word, in the multi-turn phase where it happened, and nothing else; faults
    leave both servers answering; one-token and stop-string requests are checked."""
    rc, out, log = harness(ckpt, tmp_path, "--servers", "graphcap,sglang", "--phases", "multiturn,faults",
                           "--pressure", "8x32", env={"FAKE_SGLANG_DIVERGE": "3"}, port=free_port())
    assert rc == 0, log
    cmp = out["comparisons"]["graphcap vs sglang"]
    kept = cmp["multiturn-kept"]
    assert kept["compared"] == 32 and [(d["request"], d["first_word"]) for d in kept["differ"]] == [(3, 2)]
    # the target's top two next tokens where the replies part, asked of stock's server (up second) with the chat's
    # prompt and the two words both replies share: the greedy one is stock's third word, 4.0 above the next; stock
    # answered the multi-turn requests once, so nothing tells a near-tie
    d = kept["differ"][0]
    assert d["margin"] == 4.0 and d["top"][0][2].strip() == d["theirs"].split()[0] != d["ours"].split()[0]
    assert d["stock_also_differs"] is None and d["near_tie"] is False
    assert all(not v["differ"] for k, v in cmp.items() if k != "multiturn-kept"), cmp
    for label in ("graphcap", "sglang"):
        s = out["servers"][label]
        assert s["died"] is None and all(s["alive_after"].values())
        faults = s["faults"]
        assert faults["aborts"]["aborted"] == 48 and faults["aborts"]["ok"] == 16
        assert faults["one_token"]["one_token_errors"] == []
        assert faults["stop_strings"]["stop_errors"] == []
        assert faults["over_largest_bucket"]["requests"] == 8 + 16
        rounds = s["multiturn"]["kept"]
        assert [r["round"] for r in rounds] == [1, 2, 3, 4]
        assert all(r["cached_tokens"] > 0 for r in rounds[1:])  # each later turn reuses the conversation so far
    assert out["servers"]["graphcap"]["manifest"]["buckets"] == [1, 8, 24]
    # both servers' prefills of the same requests paired (the stand-in records 0.25 ms more per prefill with the flag)
    pm = out["prefill_matched"]["graphcap vs sglang"]
    assert pm["matched"] >= 32 and pm["gpu_ms_diff_p50"] == pytest.approx(0.25, abs=1e-3), pm


@pytest.mark.subprocess
def test_a_comparison_split_over_two_runs_finds_what_one_run_finds(ckpt, tmp_path):
    """graphcap's server in one run, stock's in the next with --phases-from the first run's work directory: the
    comparison names the same request at the same word as one run with both servers, with the margin asked of
    stock's server while it is up; the record names where the earlier replies came from."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    env = {"FAKE_SGLANG_DIVERGE": "3"}
    rc, out1, log = harness(ckpt, first, "--servers", "graphcap", "--phases", "multiturn", env=env, port=free_port())
    assert rc == 0, log
    assert out1["comparisons"] == {}
    rc, out, log = harness(ckpt, second, "--servers", "sglang", "--phases", "multiturn", "--phases-from", str(first),
                           env=env, port=free_port())
    assert rc == 0, log
    assert set(out["servers"]) == {"sglang"} and out["phases_from"] == {"graphcap": str(first / "graphcap-phases.json")}
    kept = out["comparisons"]["graphcap vs sglang"]["multiturn-kept"]
    assert kept["compared"] == 32 and [(d["request"], d["first_word"]) for d in kept["differ"]] == [(3, 2)]
    assert kept["differ"][0]["margin"] == 4.0


def test_phases_from_refuses_what_it_cannot_use_in_one_line(tmp_path, capsys):
    harness_main = load_bench_script("sglang_server").main
    (tmp_path / "sglang-phases.json").write_text("{}")  # this run's own server: not an earlier one
    cases = [(tmp_path / "none", None, "is not a directory"), (tmp_path, None, "holds no <server>-phases.json"),
             (tmp_path, "[1, 2]", "holds list, not a server's phases"), (tmp_path, "{", "is not a phases file")]
    for where, earlier, says in cases:
        if earlier is not None:
            (tmp_path / "graphcap-phases.json").write_text(earlier)
        rc = harness_main(["--ckpt", str(tmp_path / "ck"), "--work", str(tmp_path / "w"), "--out",
                           str(tmp_path / "o.json"), "--servers", "sglang", "--phases-from", str(where)])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w").exists()  # refused before anything was made


@pytest.mark.subprocess
def test_a_small_pool_retracts_under_pressure_and_the_retractions_are_counted(ckpt, tmp_path):
    # the stand-in retracts the youngest request while its pool is over --max-total-tokens, logging it as sglang does
    rc, out, log = harness(ckpt, tmp_path, "--servers", "graphcap-small,sglang-small", "--phases", "faults",
                           "--small-pool", "6000", "--pressure", "24x96", port=free_port())
    assert rc == 0, log
    for label in ("graphcap-small", "sglang-small"):
        s = out["servers"][label]
        assert s["died"] is None and s["faults"]["pool_pressure"]["alive_after"]
        assert s["retractions"]["events"] >= 1 and s["retractions"]["pool_full_events"] == s["retractions"]["events"]
        assert s["faults"]["pool_pressure"]["ok"] == 24 and s["facts"]["max_total_num_tokens"] == 6000
        assert s["pool_check_warnings"] == 0
    cmp = out["comparisons"]["graphcap-small vs sglang-small"]["faults-pool_pressure"]
    assert cmp["compared"] == 24 and not cmp["differ"]


@pytest.mark.subprocess
def test_a_stall_in_the_soak_is_placed_with_its_compile(ckpt, tmp_path):
    # the stand-in ticks every 2 ms or more while requests run: tick 200 is past the warm-up and, on a busy CPU
    # too, well inside the soak
    rc, out, log = harness(ckpt, tmp_path, "--servers", "graphcap", "--phases", "soak", "--soak-s", "8",
                           "--soak-warmup-s", "0.2", "--soak-concurrency", "4",
                           env={"FAKE_SGLANG_STALL_AT": "200"}, port=free_port())
    assert rc == 0, log
    soak = out["servers"]["graphcap"]["soak"]
    assert soak["requests"] > 20 and {"random", "turn"} <= set(soak["latency"])
    over = soak["gaps"]["over_limit"]
    assert len(over) == 1 and over[0]["ms"] >= 290, soak["gaps"]
    assert over[0]["compiles"] == [{"kernel": "fake.kernels:_late", "ms": 290.0}]
    assert soak["compiles"]["after_warmup"][0]["kernel"] == "fake.kernels:_late"


@pytest.mark.subprocess
def test_stock_soaks_beside_the_flag_and_no_speculation_only_when_asked(ckpt, tmp_path):
    rc, out, log = harness(ckpt, tmp_path, "--servers", "sglang,nospec", "--phases", "soak", "--soak-s", "3",
                           "--soak-warmup-s", "0.5", "--soak-concurrency", "4", port=free_port())
    assert rc == 0, log
    stock, nospec = out["servers"]["sglang"], out["servers"]["nospec"]
    assert stock["soak"]["requests"] > 0 and stock["soak"]["gaps"]["calls"] > 0  # stock's draft trace read too
    assert "soak" not in nospec and nospec["not_run"] == ["soak"]


@pytest.mark.subprocess
def test_no_server_starts_that_could_not_serve_before_the_deadline(ckpt, tmp_path):
    import time

    rc, out, log = harness(ckpt, tmp_path, "--servers", "graphcap,sglang", "--phases", "soak",
                           "--deadline", str(time.time() + 60), port=free_port())
    assert rc == 0, log
    for label in ("graphcap", "sglang"):  # a first start is expected to take FIRST_START_S, the soak 90 s more
        assert "s of the call's time left; a start (~120 s)" in out["servers"][label]["not_run"], out


@pytest.mark.subprocess
def test_a_harness_stopped_at_its_step_limit_stops_its_server(ckpt, tmp_path):
    """gpu-check's step limit stops the harness with SIGTERM (`timeout`); the server runs in a process group of its
    own, so the signal never reaches it: the harness stops it on the way out (a server left behind holds the GPU's
    memory and its port while the call's next step starts) and exits 143."""
    import signal
    import time

    from fake_sglang import process_gone

    port = free_port()
    cmd = [PY, str(ROOT / "bench" / "sglang_server.py"), "--ckpt", str(ckpt), "--work", str(tmp_path),
           "--out", str(tmp_path / "server.json"), "--port", str(port), "--window", "64", "--largest-bucket", "8",
           "--launcher", f"{PY} {ROOT / 'tests' / 'fake_sglang_server.py'}",
           "--bench-serving", f"{PY} {ROOT / 'tests' / 'bench_serving_stubbed.py'}",
           "--servers", "nospec", "--phases", "soak", "--soak-on", "nospec", "--soak-s", "120",
           "--soak-warmup-s", "0.5", "--soak-concurrency", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(tmp_path))
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not servers:  # the server is up once it answers; its process is the launcher's, on this port
            assert proc.poll() is None and time.monotonic() < deadline, "the server never started"
            time.sleep(0.3)
            if http_json(f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200:
                servers = [int(d) for d in os.listdir("/proc") if d.isdigit() and _runs_server(d, port)]
        time.sleep(1.0)  # into the soak
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 143, output[-2000:]
        assert all(process_gone(pid, within_s=15) for pid in servers), "the server outlived the harness"
    finally:
        proc.kill()
        for pid in servers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _runs_server(pid: str, port: int) -> bool:
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any("fake_sglang_server.py" in a for a in line) and str(port) in line


@pytest.mark.subprocess
def test_a_server_that_dies_is_recorded_with_why_and_the_run_goes_on(ckpt, tmp_path):
    rc, out, log = harness(ckpt, tmp_path, "--servers", "graphcap,nospec", "--phases", "faults,multiturn",
                           env={"FAKE_SGLANG_EXIT_AT": "60"}, port=free_port())
    assert rc == 0, log
    for label in ("graphcap", "nospec"):
        s = out["servers"][label]
        assert s["died"] and "multiturn" not in (s["seconds"] or {}), s  # stopped after the phase it died in


@pytest.mark.subprocess
def test_sglangs_own_client_runs_and_its_numbers_are_kept(ckpt, tmp_path):
    """sglang.bench_serving, its random dataset from the harness's own ShareGPT file, the same requests at two
    concurrencies and, open loop, at a request rate, then its generated-shared-prefix dataset: throughput,
    TPOT/ITL/TTFT, acceptance and cached tokens in the record; the stock server's texts compared across the runs."""
    rc, out, log = harness(ckpt, tmp_path, "--servers", "sglang", "--phases", "bench,rate,gsp", "--concurrency", "1,3",
                           "--request-rates", "25", "--num-prompts", "5", "--input-len", "48", "--output-len", "12",
                           "--range-ratio", "1", port=free_port())
    assert rc == 0, log
    s = out["servers"]["sglang"]
    assert out["lengths"] == "48:12:1"
    for c in ("1", "3"):
        b = s["bench"][c]
        assert b["completed"] == 5 and b["failed_requests"] == 0 and b["max_concurrency"] == int(c), b
        assert b["total_output_tokens"] == 5 * 12, b  # ratio 1: every reply the whole --output-len
        # the stand-in traces one prefill batch a request: the run's five alone (no client warm-up, no other run's)
        assert b["prefill_batches"] == 5 and b["prefill_share"] is not None, b
        assert b["output_throughput"] > 0 and b["median_tpot_ms"] > 0 and b["accept_length"] == 2.5
    r = s["rate"]["25"]
    assert r["completed"] == 5 and r["request_rate"] == 25.0 and r["max_concurrency"] > 5, r  # no cap
    assert s["gsp"]["completed"] == 32 and s["gsp"]["cached_tokens"] > 0
    across = out["comparisons"]["sglang across concurrencies"]
    assert {k: (v["compared"], v["equal"]) for k, v in across.items()} == {"bench-c1 vs bench-c3": (5, 5),
                                                                           "bench-c1 vs rate-r25": (5, 5)}


@pytest.mark.subprocess
def test_a_structure_only_target_gets_its_weights_over_http_before_any_phase(tiny_w8a8, tmp_path):
    """Every server of a structure-only pair starts on random layers (--load-format dummy; the MTP ones load the
    assistant from disk) and, before its first phase, gets through sglang's weight-update routes - one update each,
    to the target runner alone - the W8A8 target's seeded int8 layers (load format direct), then the checkpoint's
    structure: the stand-in server's log of what it unpickled equals the harness's own tensors, name by name."""
    needs("aiohttp", "transformers")
    from safetensors.torch import load_file

    from graphcap.bench import target_weights as tw

    w8a8_ckpt, log_path = tiny_w8a8, tmp_path / "weights.jsonl"
    rc, out, log = harness(w8a8_ckpt, tmp_path, "--servers", "graphcap,nospec", "--phases", "multiturn",
                           "--weights-device", "cpu", env={"FAKE_SGLANG_WEIGHTS_LOG": str(log_path)},
                           port=free_port())
    assert rc == 0, log
    config = json.loads((w8a8_ckpt / "target" / "config.json").read_text())
    int8 = [dict(tw.int8_layer(projs, i, 0, "cpu")) for i, projs in enumerate(tw.target_projections(config))]
    structure = load_file(str(w8a8_ckpt / "target" / "model.safetensors"))
    events = [json.loads(x) for x in log_path.read_text().splitlines()]
    for label in ("graphcap", "nospec"):
        s = out["servers"][label]
        w = s["weights_loaded"]
        assert w["ok"] and w["weights"] == "w8a8" and w["int8"]["layers_loaded"] == len(int8)
        assert w["structure"]["tensors"] == len(structure) and w["structure"]["batches"] == 1
        assert "--load-format dummy" in s["command"] and s["multiturn"]["kept"], s
        assert ("--speculative-draft-load-format auto" in s["command"]) == (label == "graphcap")
        port = int(s["command"].split("--port ")[1].split()[0])
        mine = [e for e in events if e["port"] == port]
        assert [e["event"] for e in mine] == ["begin"] + ["update"] * len(int8) + ["end", "begin", "update", "end"]
        assert all(e["selector"] == "target" for e in mine if e["event"] != "end")
        updates = [e for e in mine if e["event"] == "update"]
        for sent, e in zip(int8 + [structure], updates):
            assert e["load_format"] == ("direct" if sent is not structure else None) and e["ranks"] == 1
            assert {n: (shape, dtype) for n, shape, dtype, _ in e["tensors"]} == {
                n: (list(t.shape), str(t.dtype)) for n, t in sent.items()}
            for n, _, _, total in e["tensors"]:
                assert total == pytest.approx(float(sent[n].double().sum()), rel=1e-12, abs=1e-9), n
