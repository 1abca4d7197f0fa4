"""The lab scripts' pure parts and their refusals: host_overhead.py runs the graph path and names every call it
times, profile_iteration.py groups kernels by name, and the CUDA-only experiments exit 2 in one line elsewhere."""
from __future__ import annotations

import pytest
import torch
from lab_scripts import LAB_DIR as LAB, load_lab_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check: a GPU host runs the graph path itself")
@pytest.mark.subprocess
def test_host_overhead_bench_runs_the_graph_path_and_prints_its_table():
    """lab/host_overhead.py (a script, run as the docs say) measures run() and replay() on the graph path with a
    launch that does nothing; here only that it runs and reports every call it names (no timing is judged)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(root), os.environ.get("PYTHONPATH")) if x)}
    r = subprocess.run([sys.executable, str(root / "lab" / "host_overhead.py"), "--batches", "5,8", "--iters", "50"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0, r.stderr
    for call in ("run(host_slots=...)", "run()", "replay()", "static address guard", "the no-op launch"):
        assert call in r.stdout


def test_profile_groups_kernels_by_name():
    """lab/profile_iteration.py's kernel groups: Inductor's fused kernels by their prefix, whatever ops their names
    list (the embedding gather fused into the pre-projection's input is named ..._skinny_linear_0 and is no matmul)."""
    mod = load_lab_script("profile_iteration")
    matmul = "matmul (cuBLAS/CUTLASS, graphcap's skinny GEMM)"
    want = {"triton_poi_fused_cat_index_mul_skinny_linear_0": mod.INDUCTOR,
            "triton_red_fused__to_copy_add_mean_pow_0": mod.INDUCTOR,
            "skinny_kernel": matmul, "splitk_sum_kernel": matmul,
            "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT": matmul,
            "void cublasLt::splitKreduce_kernel<32, 16, int, float>": matmul,
            "_split_kernel": "attention split-KV", "combine_kernel": "attention combine",
            "_norm_rope_kernel": "layer small ops (graphcap's kernels)", "_small_topk_kernel": "topk / sort",
            "_centroid_logits_kernel": "centroid head (graphcap's kernel)", "_window_advance_kernel": "window advance",
            "void at::native::multi_tensor_apply_kernel<Copy>": "other"}
    assert {name: mod.group_of(name) for name in want} == want


def test_l2_prefetch_experiment_names_what_it_needs(capsys, tmp_path):
    """lab/l2_prefetch.py issues sm_90's cp.async.bulk.prefetch: elsewhere it exits 2 with one line saying so,
    before it allocates anything."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("an sm_90 GPU is here: the script would run")
    mod = load_lab_script("l2_prefetch")
    with pytest.raises(SystemExit) as e:
        mod.main(["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "compute capability 9.0" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "x").exists()


def test_centroid_config_bench_names_what_it_needs(capsys, tmp_path):
    """lab/centroid_config.py times a CUDA kernel's launch configurations: without CUDA it exits 2 with one line
    saying so, before it allocates anything; a malformed --configs exits 2 naming the option."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    mod = load_lab_script("centroid_config")
    for args, want in (([], "needs a CUDA device"), (["--configs", "16x256"], "--configs: a list of BLOCK_Tx")):
        with pytest.raises(SystemExit) as e:
            mod.main([*args, "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and want in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "x").exists()


def test_recapture_comparison_finds_the_first_difference():
    """lab/reduce_overhead/compare_tokens.py against a from-scratch scan: random greedy outputs, one token changed or
    one output cut short at a random place, and the verdict names that request and position (equal outputs: none)."""
    import random

    mod = load_lab_script("reduce_overhead/compare_tokens")
    rng = random.Random(5)
    for _ in range(200):
        ref = [[rng.randrange(1000) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(1, 9))]
        case = [list(t) for t in ref]
        assert mod.first_difference(case, ref) is None
        i = rng.randrange(len(case))
        j = rng.randrange(len(case[i]))
        if rng.random() < 0.5:
            case[i][j] = (case[i][j] + 1 + rng.randrange(999)) % 1000
            want = {"request": i, "position": j, "case": case[i][j], "reference": ref[i][j]}
        else:
            del case[i][j:]
            want = {"request": i, "position": j, "why": f"{j} tokens against {len(ref[i])}"}
        assert mod.first_difference(case, ref) == want
        summary = {"finished": True, "tokens": case, "probe": {"last_events": [], "draft_calls": 3}, "log_tail": ""}
        verdict = mod.compare(summary, {"finished": True, "tokens": ref})
        assert not verdict["equal"] and verdict["first_difference"] == want and not verdict["late_tree_work"]
    crashed = mod.compare({"finished": False, "tokens": None, "log_tail": "LateTreeWork: ..."},
                          {"finished": True, "tokens": [[1]]})
    assert not crashed["equal"] and crashed["late_tree_work"]


def test_sealed_trees_refuse_every_late_warm_up_recording_and_workspace_clear(monkeypatch):
    """lab/reduce_overhead/site/sitecustomize.py's seal: after it, a CUDA-graph tree's recording, warm-up and cuBLAS
    workspace clear each raise LateTreeWork naming what was attempted (torch's own objects, restored after)."""
    from torch._inductor import cudagraph_trees as ct

    site = load_lab_script("reduce_overhead/site/sitecustomize")
    for name in ("record_function", "run_eager"):
        monkeypatch.setattr(ct.CUDAGraphTreeManager, name, getattr(ct.CUDAGraphTreeManager, name))
    monkeypatch.setattr(ct, "clear_cublass_cache", ct.clear_cublass_cache)
    site.seal_trees()
    for call, what in ((lambda: ct.CUDAGraphTreeManager.record_function(None, [], 0), "recording"),
                       (lambda: ct.CUDAGraphTreeManager.run_eager(None, [], 0), "warm-up"),
                       (lambda: ct.clear_cublas_manager().__enter__(), "cuBLAS workspace clear")):
        with pytest.raises(site.LateTreeWork, match=f"a CUDA-graph tree('s)? {what} after start-up"):
            call()


def test_pdl_chain_computes_the_chain_and_every_peel_gives_the_same_bits():
    """lab/pdl_chain.py's kernel under Triton's interpreter: each step of the chain of dependent GEMVs (the draft MLP's
    widths alternating) against float64 on the same bf16 input: within half a bf16 step of each value (rounded to
    nearest; the fp32 sum's own error is far below that), so at most one step off where fp32 and float64 straddle a
    rounding boundary; the first weight tile loaded before the (here absent) wait gives the same bits as after it."""
    import triton

    mod = load_lab_script("pdl_chain")
    for batch in (1, 5):
        chain = mod.Chain(batch, 4, "cpu", seed=batch)
        chain.run("off")
        for i, out in enumerate(chain.outs):
            x = chain.x0 if i == 0 else chain.outs[i - 1]
            exact = x.double() @ chain.weights[i].double().t()
            size = torch.maximum(exact.abs(), out.double().abs()).clamp_min(2.0 ** -100)
            ulp = 2.0 ** (size.log2().floor() - 7)  # bf16: 8 significant bits, in the larger one's binade
            assert ((out.double() - exact).abs() <= ulp).all(), f"step {i}"
        x, w = chain.x0, chain.weights[0]
        ys = []
        for prefetch in (False, True):
            y = torch.empty(batch, w.shape[0], dtype=torch.bfloat16)
            mod._chain_gemv_kernel[(triton.cdiv(w.shape[0], mod.BLOCK_N),)](
                x, w, y, w.shape[0], w.shape[1], batch, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=16,
                BLOCK_N=mod.BLOCK_N, BLOCK_K=mod.BLOCK_K, GDC=False, PREFETCH=prefetch, LATE=False, F32_DOT=True)
            ys.append(y)
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], mod.gemv(x, w, torch.empty_like(ys[0])))
    with pytest.raises(ValueError, match="variant: one of off, pdl, pdl-prefetch, pdl-late"):
        mod.gemv(x, w, ys[0], "pdl-early")


def test_pdl_chain_names_what_it_needs(capsys, tmp_path):
    """Programmatic dependent launch is sm_90's: elsewhere the script exits 2 with one line, writing nothing; a bad
    option is one line too."""
    mod = load_lab_script("pdl_chain")
    for args, msg in ((["--batches", "0,8"], "--batches: rows between 1 and 16"),
                      (["--launches", "1"], "--launches: a chain of at least 2"),
                      ([], "compute capability 9.0")):
        if not args and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
            continue  # an sm_90 GPU is here: the script would run
        with pytest.raises(SystemExit) as e:
            mod.main(["--out", str(tmp_path / "x"), *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and msg in err[-1] and len(err) == 1
    assert not (tmp_path / "x").exists()


def test_pdl_chain_kernel_compiles_for_sm90_with_its_waits_where_they_belong(tmp_path):
    """Compiled for an H100/H200 (Triton's own compiler and ptxas, no GPU): the PDL variants carry sm_90's
    griddepcontrol.wait and .launch_dependents, `off` neither; with the prefetch a weight load is issued before the
    wait, without it none; launched with PDL the kernel's metadata says so."""
    from sm90 import compile_for_sm90

    script = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("pdl_chain", {str(LAB / "pdl_chain.py")!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
types = {{"x": "*bf16", "w": "*bf16", "y": "*bf16"}}
for name, gdc, prefetch, late in (("off", 0, 0, 0), ("pdl", 1, 0, 0), ("pdl-prefetch", 1, 1, 0), ("pdl-late", 1, 0, 1)):
    consts = dict(BLOCK_M=16, BLOCK_N=mod.BLOCK_N, BLOCK_K=mod.BLOCK_K, GDC=bool(gdc), PREFETCH=bool(prefetch),
                  LATE=bool(late), F32_DOT=False)
    sig = {{p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in mod._chain_gemv_kernel.params}}
    k = triton.compile(ASTSource(mod._chain_gemv_kernel, sig, consts), target=target(),
                       options=options(num_warps=4, num_stages=3, launch_pdl=bool(gdc)))
    ptx = k.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    first_load = ptx.find("ld.global")
    print(name, wait >= 0, "griddepcontrol.launch_dependents" in ptx, 0 <= first_load < wait,
          bool(k.metadata.launch_pdl))
print("compiled")
"""
    out = {line.split()[0]: line.split()[1:] for line in compile_for_sm90(script, tmp_path).splitlines()
           if line.split() and line.split()[0] in ("off", "pdl", "pdl-prefetch", "pdl-late")}
    assert out == {"off": ["False", "False", "False", "False"], "pdl": ["True", "True", "False", "True"],
                   "pdl-prefetch": ["True", "True", "True", "True"], "pdl-late": ["True", "True", "False", "True"]}
