"""lab/skinny_gemm.py, the skinny GEMM's bench: its own logic (contestants, the check against the cuBLAS expression,
the read-only ceilings, the config grid and names, the summary and its files) at tiny shapes, a wall clock or a
stand-in in place of its CUDA-graph timer. The kernel itself is tests/kernels/test_skinny_gemm.py's."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lab_scripts import LAB_DIR, load_lab_script
from test_skinny_gemm import OVERFLOW_OK, SETTINGS, make
from tiers import examples

import graphcap.kernels.gemm.skinny as sg
import graphcap.kernels.gemm.skinny_kernels as sgk
from graphcap.kernels.gemm.skinny import CANDIDATES, Config

BENCH = LAB_DIR / "skinny_gemm.py"


@pytest.mark.subprocess
def test_bench_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the bench itself")
    r = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "CUDA" in r.stderr, r.stderr


@OVERFLOW_OK
def test_bench_checks_times_and_reports_at_a_tiny_shape(tmp_path, monkeypatch, device):
    """The bench's own logic (contestants, the check against the cuBLAS expression, the summary and the files) at
    tiny shapes, a wall clock in place of its CUDA-graph timer (interpreted on CPU: the timings mean nothing)."""
    import json
    import time

    from graphcap.bench import environment as bench_env

    bench = load_lab_script("skinny_gemm")

    def wall_us(fn, ws, rep_ms):
        t = time.perf_counter()
        for w in ws:
            fn(w)
        return (time.perf_counter() - t) * 1e6 / len(ws)

    monkeypatch.setattr(bench, "graph_us", wall_us)
    rows = []
    for name, (m, n, k, gated) in {"lin": (3, 40, 96, False), "gu": (20, 24, 64, True)}.items():
        x, w = make(m, m, 2 * n if gated else n, k, device=device, scale=k ** -0.5)
        rows += bench.measure(name, m, [w, w.clone()], x, gated, n, 1.0, 100.0, None, False)
        names = {r["contestant"] for r in rows if r["shape"] == name}
        assert names == {"cublas", "plan"} | {c.name for c in sg.candidates(m, n, k, gated)}
    assert all("failed" not in r and r["err"] < 1e-2 and r["us"] > 0 for r in rows), rows
    bench.write(tmp_path, bench_env.environment(copy_gbps=100.0), rows, ["a note"])
    report = json.loads((tmp_path / "skinny_gemm.json").read_text())
    assert [(s["shape"], s["m"]) for s in report["summary"]] == [("lin", 3), ("gu", 20)]
    assert all("best" in s and "speedup_plan" in s for s in report["summary"])
    assert "| lin " in (tmp_path / "skinny_gemm.md").read_text()


@settings(**{**SETTINGS, "max_examples": examples(10)})
@given(nb=st.integers(1, 3), kb=st.integers(1, 6), split=st.sampled_from([1, 2, 4]), tma=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_bench_read_ceiling_sums_each_programs_tiles(device, nb, kb, split, tma, seed):
    """lab/skinny_gemm.py's read kernel (--ceiling) reads exactly each program's tiles: its sums against float64
    sums of the same blocks (fp32 accumulation of bf16 values: within K * 2**-24 of the absolute sum)."""
    bench = load_lab_script("skinny_gemm")
    cfg = Config(16, 32, split, 4, 2)
    _, w = make(seed, 1, 16 * nb, 32 * kb, device=device)
    got, want = bench.read_sums(w, cfg, tma), bench.read_sums_torch(w, cfg)
    assert got.shape == want.shape == (nb, sg.k_splits(32 * kb, cfg)[1])
    bound = 2 * 2.0 ** -24 * 32 * kb * bench.read_sums_torch(w.abs(), cfg)
    assert ((got.double().cpu() - want.cpu()).abs() <= bound.cpu()).all()
    with pytest.raises(ValueError, match="whole tiles"):
        bench.read_sums(w[:, :31], cfg, tma)


def test_bench_read_ceilings(monkeypatch, device):
    """--ceiling times the two read kernels over the plan's grid after the candidates: never checked against
    cublas, never the best of ours, reported beside the plan in the summary."""
    bench = load_lab_script("skinny_gemm")
    monkeypatch.setattr(bench, "graph_us", lambda fn, ws, rep_ms: (fn(ws[0]), 1.0 + len(ws))[1])
    cfgs = (Config(16, 64, 2, 4, 2, fixup=True), Config(16, 64, 2, 4, 2, dot=False))
    monkeypatch.setattr(sg, "candidates", lambda m, n, k, gated=False: cfgs)
    monkeypatch.setattr(sg, "plan", lambda m, n, k, gated=False: cfgs[0])
    sgk.prepare_fixup(device)
    x, w = make(3, 2, 32, 256, device=device, scale=256 ** -0.5)
    rows = bench.measure("lin", 2, [w], x, False, 32, 1.0, 100.0, None, False, ceiling=True)
    assert [r["contestant"] for r in rows] == ["cublas", "plan", cfgs[0].name, cfgs[1].name, "read", "read-tma"]
    assert all("failed" not in r and r["us"] > 0 for r in rows), rows
    assert [r["err"] is None for r in rows] == [False] * 4 + [True] * 2
    assert rows[-1]["config"] == cfgs[0].name
    (s,) = bench.summarize(rows)
    assert s["read_us"] == s["read_tma_us"] == 2.0 and s["best"] not in bench.CEILINGS


def test_bench_read_grids(monkeypatch, device):
    """--read-grids: the read kernel over other configs' grids, named read@<config>, each reading whole tiles of the
    weights (its sums against float64), never a GEMM result; the summary's fastest read is the fastest of them and
    the plan's read. The sweep tiles every shape whole, its split counts exact, from a quarter wave to 16 waves."""
    bench = load_lab_script("skinny_gemm")
    for name, (n, k, gated) in bench.SHAPES.items():
        sweep = bench.read_grid_configs(n, k, gated)
        rows = 2 * n if gated else n
        assert sweep and len(set(sweep)) == len(sweep), name
        assert all(rows % c.block_n == 0 and k % c.block_k == 0 and sg.k_splits(k, c)[1] == c.split_k
                   and 33 <= rows // c.block_n * c.split_k <= 16 * 132 for c in sweep), name
    grids = (Config(32, 64, 2, 4, 2), Config(16, 32, 4, 4, 3), Config(64, 64, 1, 4, 2))
    assert bench.read_grids_for(False, grids[::2], 32, 256, False) == grids[:1]  # 32 rows: no 64-row tile
    assert bench.read_grids_for(True, grids, 64, 256, True) == bench.read_grid_configs(64, 256, True)
    x, w = make(4, 2, 32, 256, device=device, scale=256 ** -0.5)
    for cfg in grids[:2]:
        got = bench.contestants(x, False, 32, False, read_grids=(cfg,))[f"read@{cfg.name}"](w)
        assert torch.allclose(got.double().cpu(), bench.read_sums_torch(w, cfg).cpu(), rtol=1e-5, atol=1e-4)
    times = iter([5.0, 4.0, 3.5, 3.0, 9.0, 2.5, 1.5])
    monkeypatch.setattr(bench, "graph_us", lambda fn, ws, rep_ms: (fn(ws[0]), next(times))[1])
    monkeypatch.setattr(sg, "candidates", lambda m, n, k, gated=False: (Config(16, 64, 1, 4, 2),))
    monkeypatch.setattr(sg, "plan", lambda m, n, k, gated=False: Config(16, 64, 1, 4, 2))
    rows = bench.measure("lin", 2, [w], x, False, 32, 1.0, 100.0, None, False, ceiling=True, read_grids=grids[:2])
    assert [r["contestant"] for r in rows] == ["cublas", "plan", "n16k64s1w4st2", "read", "read-tma",
                                               *(f"read@{c.name}" for c in grids[:2])]
    assert [r["config"] for r in rows[-2:]] == [c.name for c in grids[:2]] and rows[-1]["err"] is None
    (s,) = bench.summarize(rows)
    assert (s["best"], s["read_us"], s["read_best"], s["read_best_us"]) == ("n16k64s1w4st2", 3.0, grids[1].name, 1.5)


def test_bench_configs_by_name(monkeypatch, device):
    """--configs: every config's name parses back to it (the table's and the grid's), a malformed one is refused
    naming it, and the configs named are timed instead of the class's candidates."""
    bench = load_lab_script("skinny_gemm")
    every = {c for cs in CANDIDATES.values() for c in cs} | set(bench.grid_configs(1, 1536, 8192, False))
    assert all(bench.parse_config(c.name) == c for c in every)
    for bad in ("n64k128s4w4", "n64k128s4w4st5-fixup-bcast", "n48k128s1w4st4", "n64k128s0w4st4", "x"):
        with pytest.raises(ValueError, match=bad):
            bench.parse_config(bad)
    monkeypatch.setattr(bench, "graph_us", lambda fn, ws, rep_ms: (fn(ws[0]), 1.0)[1])
    x, w = make(5, 2, 40, 96, device=device, scale=96 ** -0.5)
    named = (bench.parse_config("n16k64s1w4st6"), bench.parse_config("n16k32s2w4st3-fixup"))
    sgk.prepare_fixup(device)
    rows = bench.measure("lin", 2, [w], x, False, 40, 1.0, 100.0, None, False, configs=named)
    assert [r["contestant"] for r in rows] == ["cublas", "plan", *(c.name for c in named)]
    assert all("failed" not in r and r["err"] < 1e-2 for r in rows), rows


def test_bench_grid_is_the_class_candidates_then_every_fitting_config():
    """lab/skinny_gemm.py --grid: the shape class's candidates first (the table timed in the same run), then the
    grid in one fixed shuffled order; every dot config's pipeline fits the shared memory, no split is empty, splits
    only for the narrow shapes and CUDA-core configs only up to 4 rows."""
    bench = load_lab_script("skinny_gemm")
    for m in (1, 8):
        for n, k, gated in ((8192, 1536, False), (1536, 8192, False), (6144, 1536, True), (1536, 200, False)):
            grid = bench.grid_configs(m, n, k, gated)
            cands = sg.candidates(m, n, k, gated)
            assert grid[:len(cands)] == cands and len(set(grid)) == len(grid)
            assert grid == bench.grid_configs(m, n, k, gated)
            rest = grid[len(cands):]
            narrow = not gated and n < sg.NARROW_N
            assert all((c.split_k > 1) == narrow and c.fixup == narrow for c in rest)
            assert bool(rest) == (not narrow or k >= 4 * 64)  # K = 200 has room for no split of the grid
            assert all(k >= c.split_k * c.block_k for c in rest)
            assert all(sg.pipeline_smem(c, m, gated) <= sg.SMEM_LIMIT for c in rest if c.dot)
            assert any(not c.dot for c in rest) == (m <= 4 and bool(rest))
    assert len(bench.grid_configs(1, 1536, 8192, False)) > 3 * len(sg.candidates(1, 1536, 8192))


def test_bench_grid_stops_at_the_shapes_budget(device, monkeypatch):
    """Past a shape's deadline cuBLAS and the plan are still timed, the rest are reported untimed (one row)."""
    bench = load_lab_script("skinny_gemm")
    monkeypatch.setattr(bench, "graph_us", lambda fn, ws, rep_ms: (fn(ws[0]), 1.0)[1])
    x, w = make(1, 2, 40, 96, device=device, scale=96 ** -0.5)
    rows = bench.measure("lin", 2, [w], x, False, 40, 1.0, 100.0, None, False, wide_grid=True, deadline=0.0)
    assert [r["contestant"] for r in rows] == ["cublas", "plan", "untimed"]
    left = len(bench.grid_configs(2, 40, 96, False))
    assert rows[-1]["failed"].startswith(f"{left} configs left untimed")
