"""What lab/row_kernels.py sweeps: the kernels' own launches with a warp count given. The top-k's results do not
depend on it (each round an argmax, ties to the smallest index); the norm chains' stay within one bf16 rounding of the
ops' (another order of the fp32 sums), and without one given the launches are the ops' own, bit for bit. Without CUDA
the bench refuses in one line. Interpreted on CPU: no timing here."""
from __future__ import annotations

import pytest
import torch

from lab_scripts import load_lab_script
from graphcap.kernels.elementwise import layer_fusions as lf
from graphcap.kernels.head import small_topk as st

bench = load_lab_script("row_kernels")


@pytest.mark.parametrize("warps", [1, 2, 8])
def test_topk_warps_change_no_result(device, warps):
    g = torch.Generator().manual_seed(warps)
    x = torch.randn(3, 2048, generator=g).to(device)
    values, indices = st.launch(x, 33, warps)
    want_v, want_i = st.small_topk(x, 33)
    assert torch.equal(indices, want_i) and torch.equal(values, want_v)


@pytest.mark.parametrize("warps", [None, 2])
def test_norm_chain_launches_are_the_ops(device, warps):
    g = torch.Generator().manual_seed(7)
    x, res = (torch.randn(2, bench.HIDDEN, generator=g).bfloat16().to(device) for _ in range(2))
    w1, w2 = ((0.1 * torch.randn(bench.HIDDEN, generator=g)).bfloat16().to(device) for _ in range(2))
    scalar = torch.tensor([0.7]).bfloat16().to(device)
    pairs = [(lf.launch_norm_add_norm(x, res, w1, w2, bench.EPS, warps), lf.norm_add_norm(x, res, w1, w2, bench.EPS)),
             (lf.launch_norm_add_scale_norm(x, w1, res, scalar, w2, bench.EPS, warps),
              lf.norm_add_scale_norm(x, w1, res, scalar, w2, bench.EPS))]
    for got, want in pairs:
        for a, b in zip(got, want):
            if warps is None:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_refuses_without_cuda_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench would run")
    with pytest.raises(SystemExit) as e:
        bench.main([])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "needs a CUDA device" in err


@pytest.mark.parametrize("argv", [["--warps", "3"], ["--warps", "64"], ["--batches", "0"], ["--batches", "x,1"]])
def test_bad_arguments_are_refused_in_one_line(capsys, argv):
    """Checked before anything else (also under `python -O`, which drops asserts): exit 2, one line naming both."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--batches" in err and "--warps" in err
