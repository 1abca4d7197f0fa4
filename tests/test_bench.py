"""`graphcap bench` (the README's main command) on a CPU: runs the tiny spec end to end and writes its outputs."""
from __future__ import annotations

import csv
import json

import pytest

from graphcap import bench
from graphcap.spec import load_spec


def test_bench_runs_on_cpu_and_writes_outputs(tmp_path, capsys, device):
    if device == "cuda":
        pytest.skip("the GPU run is scripts/gpu-check.sh bench")
    out = tmp_path / "b"
    rc = bench.main(["--spec", "tiny", "--batch", "1,3", "--context", "8,40", "--iters", "2", "--warmup", "1",
                     "--modes", "eager-rebuild,graph-rebuild,graphcap", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "graphs need CUDA" in text  # said plainly on a machine without CUDA
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"]
    assert {(r["batch"], r["context"], r["mode"]) for r in rows} == {
        (b, c, m) for b in (1, 3) for c in (8, 40) for m in ("eager-rebuild", "graphcap")}
    for r in rows:
        assert r["samples"] == 2 and r["wall_ms"] > 0 and r["iter_per_s"] == pytest.approx(1e3 / r["wall_ms"])
        if r["mode"] == "graphcap":
            assert r["speedup_vs_eager-rebuild"] > 0
    with open(out / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (out / "bench.md").read_text().startswith("# graphcap bench")
    assert data["environment"]["spec_hash"] == load_spec("tiny").hash and data["config"]["spec"] == "tiny"


@pytest.mark.parametrize("argv, message", [
    (["--modes", "fast"], "unknown mode 'fast'"),
    (["--batch", "0"], "expected positive integers"),
    (["--batch", "64"], "exceeds max_slots 16"),
    (["--context", "4096"], "exceeds max_context 128"),
    (["--iters", "200", "--batch", "1"], "leaves no room for a context"),
])
def test_bench_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as e:  # explicit iteration counts: the defaults differ with and without CUDA
        bench.parse_args(["--spec", "tiny", "--iters", "4", "--warmup", "1", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_only_the_buckets_the_measured_batches_use_are_captured():
    """Capturing costs compile time per bucket: a run captures the smallest spec bucket >= each measured batch, and
    nothing else (a batch above every bucket gets a bucket of its own size)."""
    import random

    from graphcap.bench_runner import _buckets_for

    rng = random.Random(3)
    for _ in range(50):
        cfg = bench.parse_args(["--spec", "gemma4-31b-assistant", "--iters", "4", "--warmup", "1",
                                "--batch", ",".join(map(str, rng.sample(range(1, 100), rng.randint(1, 6))))])
        spec_b = cfg.spec.capture.buckets
        got = _buckets_for(cfg)
        assert list(got) == sorted(set(got))
        for b in cfg.batches:  # every batch has a bucket that holds it: a spec bucket, or its own when above all
            g = min(x for x in got if x >= b)
            assert g in spec_b or (g == b and b > spec_b[-1])
        for g in got:  # and every captured bucket is the one some batch dispatches to
            below = max([x for x in spec_b if x < g], default=0)
            assert any(below < b <= g for b in cfg.batches)
