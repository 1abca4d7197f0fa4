"""bench/row_kernels.py times what ships: its direct launches of the small top-k and the layer's norm chains equal the
registered ops' results (the top-k exactly at every warp count it sweeps; the norm chains bit for bit at the shipped
count), and without CUDA it refuses in one line (interpreted on CPU: no timing here)."""
from __future__ import annotations

import pytest
import torch

from bench_scripts import load_bench_script
from graphcap.kernels import layer_fusions as lf
from graphcap.kernels.small_topk import small_topk

bench = load_bench_script("row_kernels")


@pytest.mark.parametrize("warps", [1, 4])
def test_topk_launch_is_the_op(device, warps):
    g = torch.Generator().manual_seed(warps)
    x = torch.randn(3, 2048, generator=g).to(device)
    values, indices = bench.topk_launch(x, 33, warps)
    want_v, want_i = small_topk(x, 33)
    assert torch.equal(indices, want_i) and torch.equal(values, want_v)


def test_norm_chain_launches_are_the_ops(device):
    g = torch.Generator().manual_seed(7)
    x, res = (torch.randn(2, bench.HIDDEN, generator=g).bfloat16().to(device) for _ in range(2))
    w1, w2 = ((0.1 * torch.randn(bench.HIDDEN, generator=g)).bfloat16().to(device) for _ in range(2))
    scalar = torch.tensor([0.7]).bfloat16().to(device)
    shipped = lf._warps(2048)
    got = bench.norm_add_norm_launch(x, res, w1, w2, shipped)
    for a, b in zip(got, lf.norm_add_norm(x, res, w1, w2, bench.EPS)):
        assert torch.equal(a, b)
    got = bench.norm_add_scale_norm_launch(x, res, w1, w2, scalar, shipped)
    for a, b in zip(got, lf.norm_add_scale_norm(x, w1, res, scalar, w2, bench.EPS)):
        assert torch.equal(a, b)


def test_refuses_without_cuda_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench would run")
    with pytest.raises(SystemExit) as e:
        bench.main([])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "needs a CUDA device" in err
