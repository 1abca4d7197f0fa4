"""The server record's rows (graphcap.bench.server_cases) and its writer (bench/server_record.py): each row's numbers
against the harness output they came from, read independently; the writer's merge of runs; its one-line errors."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.bench.server_cases import BENCH_KEYS, COLUMNS, case_rows, server_facts
from bench_scripts import load_bench_script
from tiers import examples

ROOT = Path(__file__).resolve().parents[2]
record = load_bench_script("server_record")


def bench_summary(rng: random.Random) -> dict:
    return {"completed": rng.randint(1, 64), "output_throughput": rng.uniform(10, 5000),
            "median_tpot_ms": rng.uniform(1, 50), "p99_tpot_ms": rng.uniform(1, 80),
            "median_itl_ms": rng.uniform(1, 30), "p99_itl_ms": rng.uniform(1, 300),
            "median_ttft_ms": rng.uniform(10, 900), "p99_ttft_ms": rng.uniform(10, 2000),
            "accept_length": rng.uniform(1, 4), "cached_tokens": rng.randint(0, 30000), "failed_requests": 0,
            **({"prefill_share": rng.uniform(0, 0.5)} if rng.random() < 0.5 else {})}  # the server traced prefills


def latency(rng: random.Random, n: int) -> dict:
    return {"requests": n, "ok": n, "errors": rng.randint(0, 2), "aborted": rng.randint(0, n),
            "ttft_ms": {"n": n, "p50": rng.uniform(1, 99), "p99": rng.uniform(100, 999), "max": 1000.0},
            "itl_ms": {"n": n, "p50": rng.uniform(1, 9), "p99": rng.uniform(10, 99), "max": 100.0}}


def harness_output(rng: random.Random) -> dict:
    """A harness output of the shape bench/sglang_server.py writes: stock and graphcap ran bench at two
    concurrencies, multi-turn and faults; graphcap soaked; no-speculation never started."""
    conc = sorted(rng.sample([1, 8, 16, 32], 2))
    rates = rng.sample(["0.5", "2", "4"], rng.randint(0, 2))
    servers, cmp = {}, {}
    for label in ("sglang", "graphcap"):
        s = {"command": f"launch {label}", "died": None if rng.random() < 0.8 else "exit 3",
             "bench": {str(c): bench_summary(rng) for c in conc},
             "rate": {r: bench_summary(rng) for r in rates},
             "multiturn": {"kept": [{"round": i + 1, "cached_tokens": rng.randint(0, 9999),
                                     "prompt_tokens": 10000, **latency(rng, 8)} for i in range(4)]},
             "faults": {"aborts": {"alive_after": True, **latency(rng, 64)},
                        "one_token": {"alive_after": rng.random() < 0.9, **latency(rng, 16)}}}
        if rng.random() < 0.7:  # the log's retractions and pool checks read, or a harness output without them
            s |= {"retractions": {"events": rng.randint(0, 9), "requests": rng.randint(0, 30), "pool_full_events": 0},
                  "pool_check_warnings": rng.randint(0, 3)}
        servers[label] = s
    gaps = {"calls": 100, "median_ms": 30.0, "max_ms": 700.0, "over_limit_joined": rng.randint(0, 9),
            "over_limit_no_join": rng.randint(0, 9), "max_ms_no_join": rng.uniform(0, 99), "over_limit": [{}] * 5}
    if rng.random() < 0.5:  # a trace with prefill records: the gaps read from them too
        gaps.update(over_limit_prefill=rng.randint(0, 5), over_limit_no_prefill=rng.randint(0, 5),
                    max_ms_no_prefill=rng.uniform(0, 99), p99_ms_no_prefill=rng.uniform(0, 99),
                    prefill_batches=rng.randint(0, 500))
    servers["graphcap"]["soak"] = {"requests": 900, "latency": {"random": latency(rng, 800), "abort": latency(rng, 50)},
                                   "gaps": gaps, "memory": {"growth_after_warmup_mib": rng.randint(0, 9)},
                                   "compiles": {"after_warmup": [{"kernel": "k"}] * rng.randint(0, 3)}}
    if rng.random() < 0.5:  # the host sampler ran (GRAPHCAP_SGLANG_TRACE_HOST)
        own = sorted(([f"f.py:{i} g", rng.uniform(1, 50), 0.1] for i in range(7)), key=lambda r: -r[1])
        servers["graphcap"]["soak"]["host"] = {"phases": {"prefill": {"ms": 400.0, "own": own},
                                                          "scheduler": {"ms": rng.uniform(1, 99), "own": []}}}
    servers["graphcap"]["soak_s"] = 300.0
    if rng.random() < 0.5:  # GRAPHCAP_SGLANG_CHECK on: the scheduler's log names each failed check
        servers["graphcap"] |= {"check_mode": True, "draft_calls": rng.randint(1, 5000),
                                "log_errors": rng.sample(["[t] OpenAI Responses API disabled",
                                                          "[t] graphcap (GRAPHCAP_SGLANG_CHECK=1): row 3 stale",
                                                          "[t] graphcap (GRAPHCAP_SGLANG_CHECK=1): seq_lens differ"],
                                                         rng.randint(0, 3))}
    servers["nospec"] = {"not_run": "out of the call's time"}
    pair = {f"bench-c{c}": {"compared": 32, "equal": rng.randint(28, 32),
                            "differ": [{"near_tie": rng.random() < 0.5} for _ in range(rng.randint(0, 3))]}
            for c in conc}
    pair.update({f"rate-r{r}": {"compared": 32, "equal": rng.randint(28, 32), "differ": []} for r in rates})
    pair["multiturn-kept"] = {"compared": 32, "equal": 32, "differ": []}
    pair["faults-aborts"] = {"compared": 16, "equal": 16, "differ": []}
    pair["faults-one_token"] = {"compared": 16, "equal": 15, "differ": [{"near_tie": False}]}
    cmp["graphcap vs sglang"] = pair
    cmp["sglang across concurrencies"] = {"x": {"compared": 32, "equal": 32, "differ": []}}
    out = {"servers": servers, "comparisons": cmp, "command": "bench/sglang_server.py ..."}
    if rng.random() < 0.5:  # a harness that wrote its random requests' lengths (an older one did not)
        out["lengths"] = rng.choice(["1024:256:0.5", "1024:1024:0"])
    return out


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(0, 2**31))
def test_rows_carry_the_harness_numbers(seed):
    rng = random.Random(seed)
    out = harness_output(rng)
    rows = case_rows(out, run="x", pair="p")
    by = {(r["engine"], r["workload"], r.get("concurrency")): r for r in rows}
    assert not any(r["engine"] == "nospec" for r in rows)  # never started: no row
    for label in ("sglang", "graphcap"):
        s = out["servers"][label]
        for c, b in s["bench"].items():
            r = by[(label, "random", int(c))]
            for col, key in BENCH_KEYS.items():  # a number the run did not give is left out of the row
                assert r.get(col) == (b.get(key) if not isinstance(b.get(key), float) else round(b[key], 2))
            assert r["crashes"] == (1 if s["died"] else 0) and r["radix_cache"] is True and r["run"] == "x"
            assert r.get("lengths") == out.get("lengths")
            if label == "graphcap":
                c_ = out["comparisons"]["graphcap vs sglang"][f"bench-c{c}"]
                assert r["tokens_equal"] == f"{c_['equal']}/32"
                assert r["near_ties"] == sum(d["near_tie"] for d in c_["differ"])
            else:
                assert "tokens_equal" not in r  # stock is the reference
        for rate, b in s["rate"].items():  # open loop: no concurrency, the rate instead
            (r,) = [x for x in rows if x["engine"] == label and x.get("request_rate") == float(rate)]
            assert r["workload"] == "random" and "concurrency" not in r and r.get("lengths") == out.get("lengths")
            assert r["output_tok_s"] == round(b["output_throughput"], 2) and r["requests"] == b["completed"]
            if label == "graphcap":
                assert r["tokens_equal"] == f"{out['comparisons']['graphcap vs sglang'][f'rate-r{rate}']['equal']}/32"
        mt = by[(label, "multiturn", 8)]
        assert "lengths" not in mt  # the random requests' alone
        assert mt["radix_hits"] == sum(x["cached_tokens"] for x in s["multiturn"]["kept"])
        assert mt["radix_hits_by_round"] == [x["cached_tokens"] for x in s["multiturn"]["kept"]]
        f = by[(label, "faults", None)]
        assert f["requests"] == 80 and f["aborts"] == sum(v["aborted"] for v in s["faults"].values())
        assert f["answered_after_each"] == all(v["alive_after"] for v in s["faults"].values())
    assert by[("graphcap", "faults", None)]["tokens_equal"] == "31/32"
    soak = by[("graphcap", "soak", 32)]
    sk = out["servers"]["graphcap"]["soak"]
    assert soak["itl_ms_p99"] == sk["latency"]["random"]["itl_ms"]["p99"]
    assert soak["gaps_over_100ms"] == 5 and soak["gaps_over_100ms_joined"] == sk["gaps"]["over_limit_joined"]
    assert soak["max_gap_ms"] == 700.0 and soak["compiles_after_warmup"] == len(sk["compiles"]["after_warmup"])
    split = {"gaps_over_100ms_prefill": "over_limit_prefill", "gaps_over_100ms_no_prefill": "over_limit_no_prefill",
             "max_gap_ms_no_prefill": "max_ms_no_prefill", "prefill_batches": "prefill_batches"}
    assert {k: soak.get(k) for k in split} == {k: sk["gaps"].get(v) for k, v in split.items()}
    assert soak["aborts"] == sum(v["aborted"] for v in sk["latency"].values())
    host = sk.get("host")
    assert ("host_ms_by_phase" in soak) == (host is not None)
    if host is not None:
        assert soak["host_ms_by_phase"] == {p: d["ms"] for p, d in host["phases"].items()}
    for r in rows:  # the server's log counts on each of its rows, where the harness read them
        s = out["servers"][r["engine"]]
        assert r.get("retracted_requests") == (s.get("retractions") or {}).get("requests")
        assert r.get("pool_check_warnings") == s.get("pool_check_warnings")
    g = out["servers"]["graphcap"]
    for r in rows:  # a checked server's rows: its draft calls, and every failed check or a death counted
        if r["engine"] == "graphcap" and g.get("check_mode"):
            fails = sum("GRAPHCAP_SGLANG_CHECK" in ln for ln in g["log_errors"]) + (1 if g["died"] else 0)
            assert (r["checked_drafts"], r["check_failures"]) == (g["draft_calls"], fails)
            assert r["leaked_rows"] == 0  # the log's failed checks name no ring row
        else:
            assert "checked_drafts" not in r and "check_failures" not in r and "leaked_rows" not in r
    for r in rows:  # the schema's columns first and in its order, nothing left as null
        cols = [k for k in r if k in COLUMNS]
        assert cols == [k for k in COLUMNS if k in r] and list(r)[:len(cols)] == cols
        assert None not in r.values()


@settings(max_examples=examples(12), deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_leaked_rows_are_the_rows_the_check_found_stale(seed):
    """leaked_rows counts the ring rows graphcap's check mode found unlike sglang's: the message is the real check's
    (runtime.check_lengths over window buffers with some rows corrupted), as the scheduler's log carries it."""
    from types import SimpleNamespace

    import torch

    from graphcap.sglang.runtime import check_lengths
    from graphcap.window import WindowBuffers

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    slots, width, window = rng.randint(2, 12), 64, rng.choice([4, 8, 16])
    req_to_token = torch.randperm(slots * width, generator=gen).to(torch.int32).view(slots, width)
    wb = WindowBuffers(req_to_token, window, slots)
    rows = rng.sample(range(slots), rng.randint(1, slots))
    lens = [rng.randint(1, width) for _ in rows]
    wb.reset(rows, lens)
    stale = rng.sample(rows, rng.randint(0, len(rows)))
    for r in stale:  # sglang gave the row's pages to someone else; graphcap's ring did not follow
        n = lens[rows.index(r)]
        wb.ring[r, rng.randrange(max(0, n - window), n) % window] += 1  # a position inside its live window
    batch = SimpleNamespace(seq_lens=torch.tensor(lens), req_pool_indices=torch.tensor(rows))
    log = []
    try:
        check_lengths(wb, batch, rows)
    except RuntimeError as e:  # the scheduler logs the raise, one line
        log.append(f"[t] Scheduler hit an exception: RuntimeError: {e}")
    assert bool(log) == bool(stale)
    out = harness_output(rng)
    out["servers"]["graphcap"] |= {"check_mode": True, "draft_calls": 40, "died": bool(stale),
                                   "log_errors": ["[t] OpenAI Responses API disabled"] + log}
    got = {r["leaked_rows"] for r in case_rows(out, run="x", pair="p") if r["engine"] == "graphcap"}
    assert got == {len(stale)}
    assert all("leaked_rows" not in r for r in case_rows(out, run="x", pair="p") if r["engine"] != "graphcap")


def test_a_modified_server_is_compared_with_its_own_stock():
    out = harness_output(random.Random(3))
    out["servers"] = {"graphcap-check-small": out["servers"]["graphcap"], "sglang-small": out["servers"]["sglang"]}
    out["comparisons"] = {"graphcap-check-small vs sglang-small": out["comparisons"]["graphcap vs sglang"]}
    rows = [r for r in case_rows(out, run="x", pair="p") if r["engine"] == "graphcap"]
    assert rows and all(r["server"] == "graphcap-check-small" for r in rows)
    assert all("tokens_equal" in r for r in rows if r["workload"] != "soak")


def test_server_facts_count_what_a_manifest_lists():
    s = {"startup_s": 147.16344, "weights_loaded": {"seconds": 6.4},
         "compiles": {"preloaded": 3, "at_startup": 73, "while_serving": 38, "after_warmup": [{"kernel": "k"}]},
         "manifest": {"buckets": [1, 2, 4], "captured": 3, "replays": 819, "fallbacks": 0, "oversize_fallbacks": 0,
                      "serving": {"joins": 200, "late_compiles": [{"kernel": "a"}, {"kernel": "b"}]}}}
    f = server_facts(s)
    assert f["startup_s"] == 147.16 and f["weights_loaded_s"] == 6.4
    assert f["compiles"] == {"preloaded": 3, "at_startup": 73, "while_serving": 38, "after_warmup": 1}
    assert f["manifest"] == {"buckets": 3, "captured": 3, "replays": 819, "fallbacks": 0, "oversize_fallbacks": 0,
                             "joins": 200, "late_compiles": 2}  # 2 late compiles against the log's 38: both kept
    assert server_facts({"command": "x"}) == {}


@settings(max_examples=examples(40), deadline=None)
@given(log=st.fixed_dictionaries({k: st.integers(0, 3) for k in ("preloaded", "at_startup", "while_serving")}),
       counters=st.fixed_dictionaries({k: st.integers(0, 3) for k in (
           "variants_preloaded", "variants_at_startup", "variants_while_serving", "late_compiles", "joins")}))
def test_a_manifest_counter_is_left_out_only_where_the_compile_log_says_the_same(log, counters):
    s = {"compiles": dict(log), "manifest": {"buckets": [1], "captured": 1, "replays": 5, "fallbacks": 0,
                                             "oversize_fallbacks": 0, "serving": {
                                                 **{k: v for k, v in counters.items() if k != "late_compiles"},
                                                 "late_compiles": [{"kernel": "k"}] * counters["late_compiles"]}}}
    m = server_facts(s)["manifest"]
    same = {"variants_preloaded": "preloaded", "variants_at_startup": "at_startup",
            "variants_while_serving": "while_serving", "late_compiles": "while_serving"}
    for k, v in counters.items():
        if k in same and log[same[k]] == v:
            assert k not in m
        else:
            assert m[k] == v


@settings(max_examples=examples(40), deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                    max_leaves=30))
def test_layout_is_the_same_json(value):
    assert json.loads(record.layout(value)) == value


def write_run(tmp_path: Path, name: str, seed: int, commit: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "server.json").write_text(json.dumps(harness_output(random.Random(seed))))
    (d / "env-server.txt").write_text(json.dumps({"device": "GPU X", "commit": commit}, indent=1)
                                      + "\nname, driver\nGPU X, 1\n")
    return d / "server.json"


def test_the_writer_replaces_a_run_whole_and_keeps_the_rest(tmp_path):
    rec = tmp_path / "server.json"
    rec.write_text(json.dumps({"what": "w", "runs": {"old": {"commit": "abc1234", "pair": "p0"}},
                               "cases": [{"run": "old", "engine": "sglang"}], "goals": {"g": 1}}))
    a, b = write_run(tmp_path, "a", 1, "1111111"), write_run(tmp_path, "b", 2, "2222222")
    assert record.main(["--record", str(rec), "--run", f"x={a}", "--pair", "x=p1", "--gpu-check", "x=K=1 gpu"]) == 0
    first = json.loads(rec.read_text())
    assert first["what"] == "w" and first["goals"] == {"g": 1}
    assert first["runs"]["x"]["commit"] == "1111111" and first["runs"]["x"]["gpu_check"] == "K=1 gpu"
    assert first["runs"]["x"]["order"] == ["sglang", "graphcap"]
    n_x = sum(r["run"] == "x" for r in first["cases"])
    assert n_x == len(case_rows(json.loads(a.read_text()), run="x", pair="p1"))
    # the same run again from other data: its rows and commit replaced, its gpu-check kept, the old run untouched
    assert record.main(["--record", str(rec), "--run", f"x={b}", "--pair", "x=p1"]) == 0
    second = json.loads(rec.read_text())
    assert second["runs"]["x"]["commit"] == "2222222" and second["runs"]["x"]["gpu_check"] == "K=1 gpu"
    assert [r for r in second["cases"] if r["run"] == "old"] == [{"run": "old", "engine": "sglang"}]
    assert [r for r in second["cases"] if r["run"] == "x"] == case_rows(json.loads(b.read_text()), run="x", pair="p1")


def test_the_writer_refuses_bad_arguments_in_one_line(tmp_path):
    rec = tmp_path / "r.json"
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    for args, says in ((["--run", "x"], "NAME=VALUE"), (["--run", f"x={tmp_path}/none.json", "--pair", "x=p"], "none"),
                       (["--run", "x=a.json"], "--pair missing for run x"),
                       (["--run", f"x={tmp_path}/other.json", "--pair", "x=p"], "run x: ")):
        p = subprocess.run([sys.executable, str(ROOT / "bench/server_record.py"), "--record", str(rec), *args],
                           capture_output=True, text=True, cwd=tmp_path)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not rec.exists() and not list(tmp_path.glob("*.tmp"))


def test_a_corrupt_record_is_named_and_left_as_it_was(tmp_path, capsys):
    rec = tmp_path / "r.json"
    rec.write_text('{"cases": [')
    run = write_run(tmp_path, "a", 1, "1111111")
    assert record.main(["--record", str(rec), "--run", f"x={run}", "--pair", "x=p"]) == 2
    err = capsys.readouterr().err
    assert f"server_record: {rec}: not JSON" in err and len(err.strip().splitlines()) == 1
    assert rec.read_text() == '{"cases": ['


def test_layout_keeps_each_case_on_one_line_with_its_small_tables():
    """A row of a list (a case) stays one line when its tables hold only scalars (a soak row's host time by phase);
    a row whose table holds tables, and a dict's values, go one key a line."""
    rec = {"cases": [{"run": "j", "host_ms_by_phase": {"prefill": 3.5, "draft": 1.0}, "tokens": [1, 2]},
                     {"run": "k", "deep": {"a": {"b": 1}}}],
           "goals": {"soak": {"goal": "x", "met": True}}}
    lines = record.layout(rec).splitlines()
    assert '  {"run": "j", "host_ms_by_phase": {"prefill": 3.5, "draft": 1.0}, "tokens": [1, 2]},' in lines
    assert not any(ln.lstrip().startswith('{"run": "k"') and ln.rstrip().endswith(("}", "},")) for ln in lines)
    assert '  "soak": {"goal": "x", "met": true}' in lines and json.loads("\n".join(lines)) == rec
