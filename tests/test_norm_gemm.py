"""graphcap.kernels.norm_gemm (gate/up with the post-attention norm chain in its prologue) against float64 math written
here, against its twin (the chain's twin, then gate/up's), and against the two kernels it replaces.

The sum s = residual + norm(x) is rounded where the reference rounds; kernel and twin differ only in the order of
the rms sums, so s is held to the chain's tolerance (test_layer_fusions.assert_close). gate/up's product is then
held to float64 math over h = norm(s, w_sum) computed here from the kernel's own s: h's entries in the kernel and
here may differ by one rounding of bf16 each (2**-7 of |h_k|, one ulp), which moves g and u by at most
2**-7 * sum_k |w_k h_k|, on top of test_skinny_gemm's bound for the product itself.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphcap.kernels.norm_gemm as ng
from graphcap.kernels import layer_fusions as L
from graphcap.kernels import twins_on_cpu
from graphcap.kernels.fused_ops import FusedOpError
from graphcap.kernels.skinny_gemm import MAX_M, SkinnyGemmError, skinny_gate_up_gelu
from sm90 import compile_for_sm90
from test_layer_fusions import assert_close, nonzero, norm64, sum_scales
from test_skinny_gemm import GELU_EVAL, GELU_SLOPE, OVERFLOW_OK, ROUND, assert_within, gelu64, linear_ref

SETTINGS = dict(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
H_FLIP = 2.0 ** -7  # one bf16 ulp of h, relative


def case(seed: int, m: int, i: int, k: int, device: str, pad: int = 0, w32: bool = False):
    """x (row stride k + pad), residual [m, k], the two norm weights [k] (fp32 with w32) and w_gate_up [2i, k]:
    random, never zero; gate/up scaled so that the gates are of order 1 (gelu's curved part)."""
    g = torch.Generator().manual_seed(seed)
    x = nonzero((m, k + pad), g, torch.bfloat16, device)[:, :k]
    r = nonzero((m, k), g, torch.bfloat16, device)
    wx, ws = (nonzero((k,), g, torch.float32 if w32 else torch.bfloat16, device) for _ in range(2))
    w = (nonzero((2 * i, k), g, torch.float32, "cpu") * k ** -0.5).to(torch.bfloat16).to(device)
    return x, r, wx, ws, w


def check(x, r, wx, ws, w, eps, act, total) -> None:
    """`total` against the twin and float64; `act` against float64 gate/up over the norm of `total`."""
    m, k = x.shape
    i = w.shape[0] // 2
    assert act.shape == (m, i) and total.shape == (m, k) and act.dtype == total.dtype == x.dtype
    s64 = r.double().cpu() + norm64(x.cpu(), wx.cpu(), eps)
    sum_scale, _ = sum_scales([r.cpu(), norm64(x.cpu(), wx.cpu(), eps)], s64, ws.cpu())
    _, t_total = L.norm_add_norm_torch(x, r, wx, ws, eps)
    assert_close(total, t_total, x.dtype, "sum vs the chain's twin", sum_scale)
    assert_close(total, s64, x.dtype, "sum vs float64", sum_scale)

    h = L._norm(total.cpu(), ws.cpu(), eps)  # bf16, the kernel's h within one rounding per entry
    wc = w.cpu()
    (g, eg), (u, eu) = linear_ref(h, wc[:i]), linear_ref(h, wc[i:])
    eg = eg + H_FLIP * (h.double().abs() @ wc[:i].double().abs().T)
    eu = eu + H_FLIP * (h.double().abs() @ wc[i:].double().abs().T)
    ref = gelu64(g) * u
    rnd = ROUND[x.dtype]
    e = GELU_SLOPE * eg * (u.abs() + eu) + gelu64(g).abs() * eu + GELU_EVAL * (g.abs() + eg) * (u.abs() + eu)
    assert_within(act.cpu(), ref, (1 + rnd) * e + rnd * ref.abs(), "gate/up vs float64")


@OVERFLOW_OK
@settings(**SETTINGS)
@given(m=st.integers(1, 16), i=st.integers(1, 80), k=st.sampled_from([1, 16, 17, 96, 256, 300]),
       pad=st.sampled_from([0, 3]), w32=st.booleans(), eps=st.sampled_from([1e-6, 0.1]), seed=st.integers(0, 2**16))
def test_kernel_matches_twin_and_float64(device, m, i, k, pad, w32, eps, seed):
    """Every K crossing the rms passes' step (256) or not, ragged N and K blocks, padded rows, fp32 norm weights."""
    x, r, wx, ws, w = case(seed, m, i, k, device, pad, w32)
    x0, r0 = x.clone(), r.clone()
    act, total = ng.norm_add_norm_gate_up(x, r, wx, ws, w, eps)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not change"
    check(x0, r0, wx, ws, w, eps, act, total)


def test_sum_rounds_the_norm_before_adding_as_the_reference_does(device):
    """The reference rounds the post-attention norm before adding the residual. Emulated in fp32 (rounded to
    nearest, as the kernel's rounding does on CPU and GPU alike), that chain gives the kernel's sum (all but the odd
    element where the rms sum's order moves a rounding); rounded only once, at the end, it differs on many elements:
    the case tells the two apart."""
    g = torch.Generator().manual_seed(3)
    k = 512
    x = nonzero((4, k), g, torch.bfloat16, device)
    r = nonzero((4, k), g, torch.bfloat16, device)  # as large as the norm: its rounding moves the sum's often
    w_x = nonzero((k,), g, torch.float32, device)
    w = (nonzero((32, k), g, torch.float32, "cpu") * k ** -0.5).to(torch.bfloat16).to(device)
    _, total = ng.norm_add_norm_gate_up(x, r, w_x, w_x, w)
    xf = x.float().cpu()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w_x.float().cpu())
    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    rf = r.float().cpu()
    got = total.float().cpu()
    assert (got == bf16(rf + bf16(normed))).float().mean() > 0.99
    assert (got != bf16(rf + normed)).float().mean() > 0.05


@OVERFLOW_OK
def test_above_fold_rows_runs_the_two_ops_it_replaces(device):
    """More rows than `fold_rows`: norm_add_norm's kernel, then skinny_gate_up_gelu's (cuBLAS above `cublas_above`),
    bit for bit what the two ops give called one after the other; at most `fold_rows`: the one kernel."""
    x, r, wx, ws, w = case(5, 6, 24, 64, device)
    h, s = L.norm_add_norm(x, r, wx, ws, 1e-6)
    for cublas_above in (64, 2):
        act, total = ng.norm_add_norm_gate_up(x, r, wx, ws, w, fold_rows=5, cublas_above=cublas_above)
        assert torch.equal(total, s) and torch.equal(act, skinny_gate_up_gelu(h, w, cublas_above=cublas_above))
    act, total = ng.norm_add_norm_gate_up(x, r, wx, ws, w, fold_rows=6)
    check(x, r, wx, ws, w, 1e-6, act, total)


def test_cpu_without_interpreter_runs_the_twin(device):
    x, r, wx, ws, w = case(2, 3, 8, 32, "cpu")
    with twins_on_cpu():
        got = ng.norm_add_norm_gate_up(x, r, wx, ws, w)
    want = ng.norm_add_norm_gate_up_torch(x, r, wx, ws, w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bad_input_names_op_and_argument():
    x, r, wx, ws, w = case(1, 2, 8, 16, "cpu")
    op = "norm_add_norm_gate_up"
    bad = [
        ((x, r[:, :8], wx, ws, w), FusedOpError, rf"{op}: residual must match x"),
        ((x, r, wx[:8], ws, w), FusedOpError, rf"{op}: w_x has 8 entries, rows have 16"),
        ((x, r, wx, ws, w[:15]), SkinnyGemmError, rf"{op}: w must stack gate and up rows"),
        ((x, r, wx, ws, w[:, :8].contiguous()), SkinnyGemmError, rf"{op}: x has K = 16 columns"),
        ((x.float(), r.float(), wx, ws, w), SkinnyGemmError, rf"{op}: x must be a 2-D bfloat16/float16 tensor"),
    ]
    for args, err, msg in bad:
        with pytest.raises(err, match=msg):
            ng.norm_add_norm_gate_up(*args)
    with pytest.raises(SkinnyGemmError, match=rf"{op}: fold_rows must be an int >= 0, got -1"):
        ng.norm_add_norm_gate_up(x, r, wx, ws, w, fold_rows=-1)
    with pytest.raises(FusedOpError, match=rf"{op}: eps must be a float >= 0"):
        ng.norm_add_norm_gate_up(x, r, wx, ws, w, -1.0)
    big = x[:1].expand(MAX_M + 1, 16)
    with pytest.raises(SkinnyGemmError, match=rf"{op}: x has {MAX_M + 1} rows"):
        ng.norm_add_norm_gate_up(big, big, wx, ws, w)


@OVERFLOW_OK
def test_fake_implementation_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, r = torch.empty(5, 96, dtype=torch.bfloat16), torch.empty(5, 96, dtype=torch.bfloat16)
        wx, ws = torch.empty(96, dtype=torch.bfloat16), torch.empty(96, dtype=torch.bfloat16)
        act, total = ng.norm_add_norm_gate_up(x, r, wx, ws, torch.empty(64, 96, dtype=torch.bfloat16))
        assert act.shape == (5, 32) and total.shape == (5, 96) and act.dtype == torch.bfloat16
    x, r, wx, ws, w = case(3, 3, 16, 48, "cpu")
    with twins_on_cpu():  # the schema and fake-vs-real checks; the kernel itself is the tests' above
        for fold_rows in (64, 1):
            torch.library.opcheck(torch.ops.graphcap.norm_add_norm_gate_up.default,
                                  (x, r, wx, ws, w, 1e-6, fold_rows, 64))


SM90_COMPILE = """
import graphcap.kernels.norm_gemm as ng
from graphcap.kernels.skinny_gemm import CANDIDATES
seen = set()
for m in (1, 4, 8, 16):
    cfg = CANDIDATES[f"m{4 if m <= 4 else 16}-gated"][0]
    bm = max(16, m)
    for even in (True, False):
        consts = dict(BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_P=ng.BLOCK_P, DOT=cfg.dot,
                      INTERPRET=False, EVEN_K=even, EVEN_N=even)
        if (bm, cfg, even) in seen:
            continue
        seen.add((bm, cfg, even))
        types = {n: "*bf16" for n in ("x", "res", "w_x", "w_sum", "w", "y", "total")}
        types["eps"] = "fp32"
        compile(ng._norm_add_norm_gate_up_kernel, types, consts, cfg.num_warps, cfg.num_stages)
print("compiled")
"""


def test_kernel_compiles_for_sm90(tmp_path):
    compile_for_sm90(SM90_COMPILE, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# on the GPU: the Gemma 4 assistant's widths, CUDA graph replay

GEMMA = (6144, 1536)  # I, hidden


@OVERFLOW_OK
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gemma4_widths_on_gpu(m):
    x, r, wx, ws, w = case(m, m, *GEMMA, "cuda")
    act, total = ng.norm_add_norm_gate_up(x, r, wx, ws, w)
    check(x, r, wx, ws, w, 1e-6, act, total)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_replay_equals_eager_exactly(m):
    """Captured once, replayed on new inputs written in place: the bits of an eager call on them."""
    x, r, wx, ws, w = case(m, m, *GEMMA, "cuda")
    ng.norm_add_norm_gate_up(x, r, wx, ws, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act, total = ng.norm_add_norm_gate_up(x, r, wx, ws, w)
    x2, r2 = case(m + 7, m, *GEMMA, "cuda")[:2]
    x.copy_(x2)
    r.copy_(r2)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    e_act, e_total = ng.norm_add_norm_gate_up(x, r, wx, ws, w)
    assert torch.equal(act, e_act) and torch.equal(total, e_total)
