"""bench/draft_host_time.py: it times the served draft call's graph path (pure replays, no forward context) in both
modes, and refuses bad options with one line."""
from __future__ import annotations

import pytest
from bench_scripts import load_bench_script

pytestmark = pytest.mark.usefixtures("cpu_twins")


def test_times_the_pure_replay_path_in_both_modes(capsys):
    m = load_bench_script("draft_host_time")
    assert m.main(["--batches", "1,3", "--iters", "20"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("default", "check"))]
    assert [(r[0], r[1]) for r in rows] == [("default", "1"), ("default", "3"), ("check", "1"), ("check", "3")]
    assert all(float(r[2]) > 0 for r in rows)
    rt, wb, _ = m.build("cpu", check=False, rows=72, width=256, window=16)
    m.batch_of(rt, wb, 3, "cpu", seed=0)
    assert rt.graphs.prepare(3).pure  # the stand-in graphs take the recorded-graph path, as the served backend does


@pytest.mark.parametrize("argv", [["--batches", "x"], ["--batches", "65"], ["--iters", "0"]])
def test_bad_options_exit_2(argv, capsys):
    m = load_bench_script("draft_host_time")
    with pytest.raises(SystemExit) as e:
        m.main(argv)
    assert e.value.code == 2
    assert len([x for x in capsys.readouterr().err.splitlines() if ": error: " in x]) == 1
