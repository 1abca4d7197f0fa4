"""`graphcap bench --served` (graphcap.bench.served) on a CPU: its options, and its whole run - engines in children,
the draft trace read back, the table - against a stand-in `sglang.Engine` whose draft times and outputs follow known
formulas (sglang's real engine needs a GPU; scripts/gpu-check.sh runs the real one)."""
from __future__ import annotations

import json
import math
import statistics
import sys
import textwrap
from pathlib import Path

import pytest

from graphcap import cli
from graphcap.bench import served

from fake_sglang import SLEEP_PER_TOKEN_S, STALL_S, VOCAB, install_fake_sglang


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    return install_fake_sglang(tmp_path, monkeypatch)


def _cfg(tmp_path, **kw) -> served.ServedConfig:
    base = dict(model_path="/models/target", draft_model_path="/models/assistant", batches=(2, 5), context=40,
                new_tokens=96, steps=2, repeats=2, out=tmp_path / "out", timeout_s=120)
    return served.ServedConfig(**{**base, **kw})


def _expected_draft_ms(graphcap: bool, batch: int, new: int) -> float:
    ms = [(0.5 if graphcap else 2.0) * (1 + batch / 8) + 0.01 * i for i in range(math.ceil(new / 2.5))]
    return statistics.median(ms[len(ms) // 4:])


@pytest.mark.subprocess
def test_served_bench_times_each_engine_and_compares_tokens(tmp_path, fake_sglang, capsys):
    cfg = _cfg(tmp_path)
    assert served.main(cfg) == 0
    record = json.loads((cfg.out / "served.json").read_text())
    assert [r["batch"] for r in record["rows"]] == [2, 5]
    for r in record["rows"]:
        b = r["batch"]
        assert r["sglang_draft_ms"] == pytest.approx(_expected_draft_ms(False, b, 96))
        assert r["graphcap_draft_ms"] == pytest.approx(_expected_draft_ms(True, b, 96))
        assert r["sglang_draft_calls"] == r["graphcap_draft_calls"] == 2 * math.ceil(96 / 2.5)  # two timed pairs
        assert r["sglang_accept_len"] == r["graphcap_accept_len"] == pytest.approx(96 / math.ceil(96 / 2.5))
        # the stand-in spaces its calls evenly over the run's sleep
        even = 1e3 * 96 * SLEEP_PER_TOKEN_S / (math.ceil(96 / 2.5) + 1)
        assert r["sglang_gap_ms"] == pytest.approx((even, even)) and r["graphcap_gap_ms"] == pytest.approx((even, even))
        assert r["tokens_equal"] == b
        # the long run's 64 extra tokens over its extra time: the stand-in sleeps SLEEP_PER_TOKEN_S per token. A
        # difference of two wall times: on a busy CPU a short run held up longer than its long run reads faster
        # than the stand-in sleeps, so the bound says "of the stand-in's rate", not its last percent
        for e in served.ENGINES:
            assert 0.3 / SLEEP_PER_TOKEN_S < r[f"{e}_tok_s"] <= 1.5 / SLEEP_PER_TOKEN_S
    # what each engine was started with
    kw = {e: json.loads((fake_sglang / f"{e}.json").read_text()) for e in served.ENGINES}
    assert "speculative_algorithm" not in kw["nospec"]["kw"] and kw["nospec"]["capture"] is None
    for e in ("sglang", "graphcap"):
        k = kw[e]["kw"]
        assert (k["speculative_num_steps"], k["speculative_num_draft_tokens"], k["speculative_eagle_topk"]) == (2, 3, 1)
        assert k["speculative_draft_model_path"] == "/models/assistant" and k["model_path"] == "/models/target"
    assert kw["sglang"]["capture"] is None and json.loads(kw["graphcap"]["capture"])["enabled"] is True
    assert len({kw[e]["trace"] for e in served.ENGINES}) == 3  # a trace directory of its own per engine
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("batch"))
    assert header.split() == ["batch", "draft", "it/s", "sglang", "draft", "it/s", "graphcap", "draft", "stock/flag",
                              "tok/s", "nospec", "tok/s", "sglang", "tok/s", "graphcap", "tokens", "equal"]
    ratio = _expected_draft_ms(False, 5, 96) / _expected_draft_ms(True, 5, 96)
    row5 = next(line for line in out.splitlines() if line.split()[:1] == ["5"])
    assert f"{ratio:.2f}x" in row5.split() and "5/5" in row5.split()


@pytest.mark.subprocess
def test_a_first_time_stall_lands_in_the_warm_up(tmp_path, fake_sglang, monkeypatch, capsys):
    """The stand-in's stock engine stalls STALL_S once, at the first run past 40 new tokens (a JIT compile at a length
    first reached): the warm-up, as long as the long run, takes it, so neither timed run holds it."""
    monkeypatch.setenv("FAKE_SGLANG_STALL", "sglang:40")
    cfg = _cfg(tmp_path, engines=("sglang", "graphcap"), batches=(3,))
    assert served.main(cfg) == 0
    (row,) = json.loads((cfg.out / "served.json").read_text())["rows"]
    assert row["sglang_gap_ms"][1] < STALL_S * 1e3 / 10  # a timed run holding it would show a STALL_S gap
    assert "a stall inside the timing" not in capsys.readouterr().out


def test_a_stall_inside_the_timing_is_named():
    """A timed run's trace with one gap far above its median: the engine and batch are named; even gaps are not."""
    def trace(rids, gap_at=None):  # the last calls run one request: the batch shrinks as requests finish
        return [{"rids": rids if i < 24 else rids[:1], "t": 0.005 * i + (0.4 if gap_at is not None and i >= gap_at
                                                                         else 0.0), "gpu_ms": 1.0} for i in range(30)]

    rids = ["b4-long0-0", "b4-long0-1"]
    other = [{"rids": ["b4-long1-0"], "t": 0.07, "gpu_ms": 1.0}]  # another run's call: not this run's
    stalled, even = served.call_gaps_ms(trace(rids, gap_at=26) + other, rids), served.call_gaps_ms(trace(rids), rids)
    assert len(stalled) == 29 and max(stalled) == pytest.approx(405.0) and max(even) == pytest.approx(5.0)
    rows = [{"batch": 4, "sglang_gap_ms": (statistics.median(stalled), max(stalled)),
             "graphcap_gap_ms": (statistics.median(even), max(even))}]
    (line,) = served.stalls(rows, ("nospec", "sglang", "graphcap"))
    assert line.startswith("sglang, batch 4: a 405 ms gap")


def test_a_gap_where_requests_join_is_their_prefill_not_a_stall():
    """A batch admitted in two parts (sglang prefills the rest while the first part decodes): the long gap before the
    joiners' first call is in every run alike and is left out; a gap of the same length later, with nobody joining,
    is kept and named."""
    rids = [f"b6-long0-{i}" for i in range(6)]
    t = [0.005 * i + (0.1 if i >= 3 else 0.0) + (0.1 if i >= 20 else 0.0) for i in range(30)]
    trace = [{"rids": rids[:4] if i < 3 else rids if i < 25 else rids[:2], "t": t[i], "gpu_ms": 1.0} for i in range(30)]
    gaps = served.call_gaps_ms(trace, rids)
    assert len(gaps) == 28 and sorted(gaps)[-1] == pytest.approx(105.0) and sorted(gaps)[-2] == pytest.approx(5.0)
    rows = [{"batch": 6, "sglang_gap_ms": (statistics.median(gaps), max(gaps))}]
    assert served.stalls(rows, ("sglang",))[0].startswith("sglang, batch 6: a 105 ms gap")
    joined_only = served.call_gaps_ms(trace[:20], rids)
    assert max(joined_only) == pytest.approx(5.0) and not served.stalls(
        [{"batch": 6, "sglang_gap_ms": (statistics.median(joined_only), max(joined_only))}], ("sglang",))


@pytest.mark.subprocess
def test_a_failed_engine_is_named_and_its_columns_stay_empty(tmp_path, fake_sglang, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SGLANG_CRASH", "graphcap")
    monkeypatch.setenv("FAKE_SGLANG_DIFF", "1")  # never reached: the graphcap engine does not start
    cfg = _cfg(tmp_path, engines=("sglang", "graphcap"), batches=(3,))
    assert served.main(cfg) == 1
    out = capsys.readouterr().out
    assert "graphcap: the engine failed: RuntimeError: fake sglang: CUDA error: an illegal memory access" in out
    (row,) = json.loads((cfg.out / "served.json").read_text())["rows"]
    assert row["graphcap_draft_ms"] is None and row["tokens_equal"] is None and row["sglang_draft_ms"] is not None
    assert "nospec_tok_s" not in row and "tok/s nospec" not in out  # only the engines run have columns


@pytest.mark.subprocess
def test_tokens_that_differ_from_stock_sglangs_are_counted(tmp_path, fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_DIFF", "1")
    cfg = _cfg(tmp_path, engines=("sglang", "graphcap"), batches=(4,))
    assert served.main(cfg) == 0
    (row,) = json.loads((cfg.out / "served.json").read_text())["rows"]
    assert row["tokens_equal"] == 3


@pytest.mark.parametrize("argv, named", [
    (["--served"], "--served needs --model-path"),
    (["--served", "--model-path", "a"], "--served needs --model-path"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--modes", "graphcap"], "--modes: options of the "
                                                                                          "reference bench"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--spec", "tiny"], "--spec: options of the"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--engines", "nospec,fast"], "--engines: expected"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--engines", "sglang,sglang"], "--engines: expected"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--context", "256,512"], "--context: --served takes "
                                                                                           "one value"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--steps", "1,3"], "--steps: --served takes one"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--new-tokens", "32"], "--new-tokens must exceed"),
    (["--served", "--model-path", "a", "--draft-model-path", "b", "--repeats", "0"], "--repeats must be >= 1"),
    (["--model-path", "a"], "--model-path: options of --served"),
    (["--load-format", "dummy", "--engines", "sglang"], "--engines, --load-format: options of --served"),
])
def test_bad_served_options_are_one_line_and_exit_2(argv, named, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_served_without_a_gpu_says_so(capsys, monkeypatch):
    if served_gpu_here():
        pytest.skip("this machine has a CUDA GPU: the served bench would start sglang's engine")
    monkeypatch.setattr(sys, "argv", ["graphcap"])
    assert cli.main(["bench", "--served", "--model-path", "a", "--draft-model-path", "b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "needs a CUDA GPU" in err or "sglang is not installed" in err


def served_gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


def test_engine_kwargs_follow_the_config():
    cfg = served.ServedConfig("t", "d", batches=(8, 1, 8, 32), context=2048, new_tokens=128, steps=1,
                              load_format="dummy")
    nospec, mtp = served.engine_kwargs(cfg, "nospec"), served.engine_kwargs(cfg, "graphcap")
    assert nospec["cuda_graph_bs_decode"] == [1, 8, 32] and nospec["max_running_requests"] == 32
    assert nospec["load_format"] == "dummy" and "speculative_algorithm" not in nospec
    assert nospec["context_length"] >= 2048 + 128 + 2 * (1 + 1)
    assert {k: mtp[k] for k in ("speculative_algorithm", "speculative_num_steps", "speculative_num_draft_tokens")} \
        == {"speculative_algorithm": "NEXTN", "speculative_num_steps": 1, "speculative_num_draft_tokens": 2}


def test_prompts_are_the_same_for_every_engine_and_in_range():
    a, b = served.prompts(4, 33, VOCAB, seed=7), served.prompts(4, 33, VOCAB, seed=7)
    assert a == b and len(a) == 4 and all(len(p) == 33 and all(3 <= t < VOCAB for t in p) for p in a)
    assert served.prompts(4, 33, VOCAB, seed=8) != a


def test_usage_of_the_child_entry_point():
    import subprocess

    r = subprocess.run([sys.executable, "-m", "graphcap.bench.served"], capture_output=True, text=True)
    assert r.returncode == 1 and "graphcap bench --served starts these" in r.stderr
    assert textwrap.dedent(r.stderr).count("\n") == 1


@pytest.mark.sglang
@pytest.mark.subprocess
@pytest.mark.parametrize("version", ["0.5.23", "0.5.18"])
def test_every_engine_setting_is_a_field_of_sglangs_server_args(version):
    """The settings the served bench starts engines with are ServerArgs fields in both sglang versions graphcap serves
    (sglang.Engine passes them to ServerArgs, which refuses an unknown one), read from each real package in a fresh
    interpreter."""
    import importlib.util
    import os
    import subprocess

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("the real sglang package is not installed (make test installs requirements/sglang-cpu.txt)")
    env = dict(os.environ)
    if version == "0.5.18":
        place = Path(os.environ.get("GRAPHCAP_SGLANG_0518") or Path(sys.prefix) / "sglang-0518")
        if not (place / "sglang").is_dir():
            pytest.skip(f"sglang 0.5.18 is not installed at {place} (make venv installs it)")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(place), env.get("PYTHONPATH")) if p)
    # tests/sglang_isolated/_sglang_env: 0.5.18 imports torchvision at `import sglang`
    isolated = Path(__file__).parents[1] / "sglang_isolated"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(isolated)) if p)
    code = ("import _sglang_env; _sglang_env.prepare_sglang_import(); import dataclasses, importlib.metadata, json; "
            "from sglang.srt.server_args import ServerArgs as S; "  # 0.5.23: a msgspec Struct, 0.5.18: a dataclass
            "names = getattr(S, '__struct_fields__', None) or [f.name for f in dataclasses.fields(S)]; "
            "print(json.dumps([importlib.metadata.version('sglang'), list(names)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    found, fields = json.loads(r.stdout.strip().splitlines()[-1])
    assert found == version and len(fields) > 100 and 'model_path' in fields
    cfg = served.ServedConfig("t", "d", load_format="dummy")
    asked = set(served.engine_kwargs(cfg, "nospec")) | set(served.engine_kwargs(cfg, "graphcap"))
    assert asked - set(fields) == set()


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["timeout", "interrupted"])
def test_a_stopped_engine_takes_the_processes_it_started(tmp_path, how):
    """run_stoppable, which every engine harness runs its children with: past its timeout, or when the wait is
    interrupted (Ctrl-C; bench/sglang_engine.py's SIGTERM handler raises SystemExit the same way), the child and the
    process it started (sglang's scheduler, here a stand-in) are both gone before it returns or re-raises."""
    import signal

    from fake_sglang import hanging_engine, process_gone

    cmd, pid_file = hanging_engine(tmp_path)
    with open(tmp_path / "child.log", "w") as log:
        if how == "timeout":
            rc, timed_out = served.run_stoppable(cmd, log, timeout=2)
            assert timed_out and rc is not None and rc != 0
        else:
            def interrupt(signum, frame):
                raise KeyboardInterrupt

            previous = signal.signal(signal.SIGALRM, interrupt)
            signal.setitimer(signal.ITIMER_REAL, 2.0)
            try:
                with pytest.raises(KeyboardInterrupt):
                    served.run_stoppable(cmd, log, timeout=None)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
    assert pid_file.exists(), "the stand-in child never started its own process"
    assert process_gone(int(pid_file.read_text())), "the engine's own process outlived the stop"
