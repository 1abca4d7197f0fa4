"""skinny_linear / skinny_gate_up_gelu (the Triton kernel, interpreted on CPU / native on CUDA, and their torch twins)
against float64 math written here, and against each other.

Tolerances, per output entry, from the kernel's arithmetic (bf16/fp16 inputs, fp32 accumulation, one rounding):
- a product of two bf16 (or fp16) values is exact in fp32, so before the final rounding the only error is fp32
  summation: at most K * 2**-24 * sum_k |x_k w_k| in any summation order (tile, split-K, tensor-core tree). SUM_EPS
  doubles that to 2 * 2**-24 per term for tensor cores, whose fp32 adders may truncate instead of round.
- the output's rounding to bf16 adds at most 2**-8 of its magnitude (8 significant bits; fp16: 2**-11).
- gate/up: gelu_tanh has slope at most 1.13, so errors e_g, e_u in g and u move gelu(g) * u by at most
  1.13 e_g (|u| + e_u) + |gelu(g)| e_u; evaluating gelu in fp32 adds at most 2**-18 |g u| (generous for an
  approximate exp on a GPU). The twin rounds g and u to bf16 first (2**-8 each more).
Kernel and twin are each held to these bounds against float64, and to each other: for skinny_linear both round
values within the summation bound of each other, so they differ by at most that twice plus one ulp of the output.

Inputs are random normals (never zeros), shapes small (N, K <= 256 with odd sizes; M 1..64) so the interpreter stays
fast; every candidate config of the drawn M's class is exercised, split-K and the broadcast path included. The GPU
tests run the Gemma 4 assistant's shapes, every candidate, CUDA graph replay and torch.compile.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphcap.kernels.gemm.skinny as sg
import graphcap.kernels.gemm.skinny_kernels as sgk
from graphcap.kernels import twins_on_cpu
from graphcap.kernels.gemm.skinny import (
    CANDIDATES, MAX_M, Config, SkinnyGemmError, skinny_gate_up_gelu, skinny_gate_up_gelu_torch, skinny_linear,
    skinny_linear_torch,
)
from sm90 import compile_for_sm90
from tiers import examples

SETTINGS = dict(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SUM_EPS = 2 * 2.0 ** -24  # per term of the K-term sum (module docstring)
ROUND = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # relative rounding of one output
PRECISION = {torch.bfloat16: 8, torch.float16: 11}  # significant bits
GELU_SLOPE, GELU_EVAL = 1.13, 2.0 ** -18
# Large negative gate values overflow exp() in the sigmoid form of gelu (to inf, giving 0, as on a GPU); numpy warns.
OVERFLOW_OK = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DIMS = st.one_of(st.integers(1, 16).map(lambda i: 16 * i), st.integers(1, 200))


def make(seed: int, m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
         x_pad: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] (a view with row stride k + x_pad), w [n, k] contiguous: random normals, the rare exact zero
    replaced (a zero would hide a dropped or misplaced term)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + x_pad, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * scale).to(dtype)
    x, w = (t.masked_fill(t == 0, 0.0625).to(device) for t in (x, w))
    return x[:, :k], w


WIDE_N = sg.NARROW_N  # the narrowest wide N: a wide class's rows are m4 at M = 1 as at 2-4 (m1 is narrow-only)


def configs_for(m: int, gated: bool) -> list[Config]:
    """Every candidate of M's class (all of its N classes; the gated kernel takes only unsplit ones, and of the other
    classes' only those whose pipeline, with its second weight tile, fits in shared memory)."""
    rows = sg.shape_class(m, WIDE_N).split("-")[0]
    return sorted({c for key, cs in CANDIDATES.items() if key.startswith(rows + "-") for c in cs
                   if not gated or (c.split_k == 1 and sg.pipeline_smem(c, m, True) <= sg.SMEM_LIMIT)})


def test_every_candidate_fits_in_shared_memory():
    """Each class's candidates fit the H200's shared memory at the class's largest M (the gated class with its two
    weight tiles): a table entry that does not would fail at its first launch (OutOfResources), on the GPU only."""
    for key, cfgs in CANDIDATES.items():
        rows, kind = key.split("-")
        m = {"m1": 1, "m4": 4, "m16": 16, "m64": 64}[rows]
        for c in cfgs:
            if c.dot:
                assert sg.pipeline_smem(c, m, kind == "gated") <= sg.SMEM_LIMIT, (key, c.name)
    # the one the H200 refused (a wide class's config run gated at M = 40): Triton asked for 294912 bytes
    assert sg.pipeline_smem(Config(64, 256, 1, 8, 3), 40, True) == 294912


def run(x: torch.Tensor, w: torch.Tensor, cfg: Config | None, gated: bool) -> torch.Tensor:
    """The op (its plan) when cfg is None, else the kernel with that config."""
    if cfg is None:
        return skinny_gate_up_gelu(x, w) if gated else skinny_linear(x, w)
    out = torch.empty(x.shape[0], w.shape[0] // 2 if gated else w.shape[0], dtype=x.dtype, device=x.device)
    return sg.launch(x, w, out, cfg, gated)


def gelu64(g: torch.Tensor) -> torch.Tensor:
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ w.T and the fp32 summation bound of each entry."""
    xd, wd = x.double(), w.double()
    return xd @ wd.T, SUM_EPS * x.shape[1] * (xd.abs() @ wd.abs().T)


def assert_within(got: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor, what: str) -> None:
    err = (got.double() - want.double()).abs()
    worst = (err / (allowed + 1e-300)).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g} x the allowed (max abs error {err.max().item():.3g})"


def ulp(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of |a| in dtype (normal range)."""
    _, e = torch.frexp(a.double().abs().clamp_min(1e-30))
    return torch.ldexp(torch.ones_like(a, dtype=torch.float64), e - PRECISION[dtype])


def check_linear(x: torch.Tensor, w: torch.Tensor, got: torch.Tensor) -> None:
    ref, e_sum = linear_ref(x, w)
    ref, e_sum = ref.to(got.device), e_sum.to(got.device)
    twin = skinny_linear_torch(x, w)
    assert got.shape == twin.shape and got.dtype == x.dtype and got.device == x.device
    r = ROUND[x.dtype]
    assert_within(got, ref, (1 + r) * e_sum + r * ref.abs(), "kernel vs float64")
    assert_within(twin, ref, (1 + r) * e_sum + r * ref.abs(), "twin vs float64")
    top = torch.maximum(got.double().abs(), twin.double().abs())
    assert_within(got, twin, 2 * e_sum + ulp(top, x.dtype), "kernel vs twin")


def check_gated(x: torch.Tensor, w: torch.Tensor, got: torch.Tensor) -> None:
    i = w.shape[0] // 2
    (g, eg), (u, eu) = linear_ref(x, w[:i]), linear_ref(x, w[i:])
    g, eg, u, eu = (t.to(got.device) for t in (g, eg, u, eu))
    ref = gelu64(g) * u
    r = ROUND[x.dtype]

    def allowed(pre: float) -> torch.Tensor:  # pre: relative rounding of g and u before the activation
        e_g, e_u = eg + pre * (g.abs() + eg), eu + pre * (u.abs() + eu)
        e = GELU_SLOPE * e_g * (u.abs() + e_u) + gelu64(g).abs() * e_u + GELU_EVAL * (g.abs() + e_g) * (u.abs() + e_u)
        return (1 + r) * e + r * ref.abs()

    twin = skinny_gate_up_gelu_torch(x, w)
    assert got.shape == twin.shape == (x.shape[0], i) and got.dtype == x.dtype
    assert_within(got, ref, allowed(0.0), "kernel vs float64")
    assert_within(twin, ref, allowed(r), "twin vs float64")
    assert_within(got, twin, allowed(0.0) + allowed(r), "kernel vs twin")


# ---------------------------------------------------------------------------------------------------------------
# the kernel on CPU (interpreted) / CUDA, small shapes


@pytest.mark.interpreter
@settings(**SETTINGS)
@given(m=st.integers(1, MAX_M), n=DIMS, k=DIMS, pad=st.sampled_from([0, 0, 3]), data=st.data(),
       seed=st.integers(0, 2 ** 16))
def test_linear_matches_float64_and_twin(device, m, n, k, pad, data, seed):
    cfg = data.draw(st.sampled_from([None] + configs_for(m, gated=False)), label="config")
    x, w = make(seed, m, n, k, device=device, x_pad=pad)
    check_linear(x, w, run(x, w, cfg, gated=False))


@pytest.mark.interpreter
@OVERFLOW_OK
@settings(**SETTINGS)
@given(m=st.integers(1, MAX_M), i=DIMS, k=DIMS, pad=st.sampled_from([0, 0, 3]), data=st.data(),
       seed=st.integers(0, 2 ** 16))
def test_gate_up_gelu_matches_float64_and_twin(device, m, i, k, pad, data, seed):
    cfg = data.draw(st.sampled_from([None] + configs_for(m, gated=True)), label="config")
    x, w = make(seed, m, 2 * i, k, device=device, x_pad=pad, scale=k ** -0.5)  # gates of order 1: gelu's curved part
    check_gated(x, w, run(x, w, cfg, gated=True))


@OVERFLOW_OK
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 16, 16), (64, 256, 256), (7, 33, 300), (16, 128, 512), (33, 48, 17)])
def test_fixed_shapes_both_dtypes(device, dtype, m, n, k):
    """Edges (one entry, M = 64, K longer than a block, odd sizes) through the plan, in both dtypes."""
    x, w = make(m + n + k, m, n, k, dtype, device, x_pad=1)
    assert not x.is_contiguous() or m == 1
    check_linear(x, w, skinny_linear(x, w))
    x, w = make(m + n + k, m, 2 * n, k, dtype, device, scale=k ** -0.5)
    check_gated(x, w, skinny_gate_up_gelu(x, w))


@OVERFLOW_OK
def test_out_argument_and_empty_shapes(device):
    """out= writes the same bits the functional op returns (rows of out may be strided); M = 0 and K = 0 work."""
    x, w = make(1, 5, 48, 80, device=device)
    out = torch.full((5, 64), 7.0, dtype=x.dtype, device=device)[:, :48]
    assert skinny_linear(x, w, out=out) is out and torch.equal(out, skinny_linear(x, w))
    out = torch.empty(5, 24, dtype=x.dtype, device=device)
    assert skinny_gate_up_gelu(x, w, out=out) is out and torch.equal(out, skinny_gate_up_gelu(x, w))
    assert skinny_linear(x[:0], w).shape == (0, 48)
    assert torch.equal(skinny_linear(x[:, :0], w[:, :0].contiguous()), torch.zeros(5, 48, dtype=x.dtype, device=device))


def test_twins_on_cpu_runs_the_twin():
    x, w = make(2, 3, 32, 40)
    with twins_on_cpu():
        assert torch.equal(skinny_linear(x, w), skinny_linear_torch(x, w))
        assert torch.equal(skinny_gate_up_gelu(x, w), skinny_gate_up_gelu_torch(x, w))


def test_bad_inputs_name_the_op_and_argument(device):
    x, w = make(3, 4, 32, 16, device=device)
    bad = [
        ("skinny_linear", (x[0], w), r"x must be a 2-D bfloat16/float16 tensor, got 1-D"),
        ("skinny_linear", (x.float(), w.float()), r"x must be a 2-D bfloat16/float16 tensor, got 2-D torch.float32"),
        ("skinny_linear", (x, w.half()), r"x \(torch.bfloat16\) and w \(torch.float16\) dtypes differ"),
        ("skinny_linear", (x, [[1.0]]), r"w must be a torch.Tensor, got list"),
        ("skinny_linear", (x[:, :8], w), r"x has K = 8 columns, w \(32, 16\) has 16"),
        ("skinny_linear", (x[:1].expand(MAX_M + 1, 16), w), rf"x has {MAX_M + 1} rows, at most MAX_M = {MAX_M}"),
        ("skinny_linear", (x, w.t().contiguous().t()), r"w must be contiguous"),
        ("skinny_linear", (x, w[::2]), r"w must be contiguous"),
        ("skinny_linear", (x.t().contiguous().t(), w), r"x's last dimension must be contiguous"),
        ("skinny_gate_up_gelu", (x, w[:31].contiguous()), r"w must stack gate and up rows .* odd 31 rows"),
        ("skinny_linear", (x, w, torch.empty(4, 31, dtype=x.dtype)), r"out must be a torch.bfloat16 \(4, 32\)"),
        ("skinny_gate_up_gelu", (x, w, torch.empty(4, 16, dtype=torch.half)), r"out must be .* got torch.float16"),
    ]
    if device == "cpu":
        bad.append(("skinny_linear", (x, w.to("meta")), r"x, w must be on one device, got \['cpu', 'meta'\]"))
    for op, args, msg in bad:
        with pytest.raises(SkinnyGemmError, match=f"{op}: {msg}"):
            getattr(sg, op)(*args)
        if len(args) == 2:  # `accepts` says no to the same (x, w), for callers that route elsewhere
            assert not sg.accepts(*args, gated=op == "skinny_gate_up_gelu")
    assert sg.accepts(x, w) and sg.accepts(x, w, gated=True) and not sg.accepts(x, w[:31].contiguous(), gated=True)
    with pytest.raises(SkinnyGemmError, match="skinny_gate_up_gelu: config .* splits K"):
        sg.launch(x, w, torch.empty(4, 16, dtype=x.dtype, device=device), Config(16, 16, 2, 4, 1), gated=True)


# ---------------------------------------------------------------------------------------------------------------
# registration: fake tensors, torch.compile


def test_fake_implementations_give_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(5, 96, dtype=torch.bfloat16), torch.empty(64, 96, dtype=torch.bfloat16)
        for out, shape in ((skinny_linear(x, w), (5, 64)), (skinny_gate_up_gelu(x, w), (5, 32))):
            assert out.shape == shape and out.dtype == torch.bfloat16
        with pytest.raises(SkinnyGemmError, match="skinny_linear: x has K = 95 columns"):
            skinny_linear(x[:, :95], w)


@OVERFLOW_OK
def test_opcheck():
    """torch.library's own checks of the registrations (schema, fake vs real, dispatch under aot_autograd)."""
    x, w = make(4, 3, 32, 48)
    for rows in (64, 1):  # the kernel; cuBLAS (3 rows > 1)
        for op, args in ((torch.ops.graphcap.skinny_linear.default, (x, w, rows)),
                         (torch.ops.graphcap.skinny_gate_up_gelu.default, (x, w, rows)),
                         (torch.ops.graphcap.skinny_linear_out.default, (torch.empty(3, 32, dtype=x.dtype), x, w,
                                                                        rows)),
                         (torch.ops.graphcap.skinny_gate_up_gelu_out.default, (torch.empty(3, 16, dtype=x.dtype), x,
                                                                              w, rows))):
            torch.library.opcheck(op, args)


@pytest.mark.interpreter
@settings(**{**SETTINGS, "max_examples": examples(40)})
@given(m=st.integers(1, MAX_M), n=DIMS, k=DIMS, splits=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 2 ** 16))
def test_fixup_equals_the_two_kernel_split_bit_for_bit(device, m, n, k, splits, seed):
    """Split K in one kernel (Config.fixup: the last split of each n-block sums the partials) gives the sum kernel's
    bits - the same partials summed in the same order - and leaves every counter at 0 for the next launch."""
    x, w = make(seed, m, n, k, device=device)
    sgk.prepare_fixup(x.device)
    cfg = Config(16, 32, splits, 4, 2)
    two = run(x, w, cfg, False)
    one = run(x, w, cfg._replace(fixup=True), False)
    assert torch.equal(one, two)
    check_linear(x, w, one)
    assert not sgk.fixup_counters(x.device, 1).any()


@pytest.mark.interpreter
@settings(**{**SETTINGS, "max_examples": examples(40)})  # the interpreter runs every program: few, small cases
@given(m=st.integers(1, 3), n=st.integers(1, 48), k=DIMS, gated=st.booleans(), bn=st.sampled_from([1, 4, 16]),
       bk=st.sampled_from([16, 32, 64]), stages=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_gemv_configs_match_float64_and_twin(device, m, n, k, gated, bn, bk, stages, seed):
    """A gemv config (one row per program over all of K, the tile reduced once) at any tile and depth, rows above
    one included, against float64 and the twin; a gemv config that splits K, uses tensor cores or a fixup is
    refused naming it."""
    cfg = Config(bn, bk, 1, 2, stages, dot=False, gemv=True)
    x, w = make(seed, m, 2 * n if gated else n, k, device=device, scale=k ** -0.5 if gated else 1.0)
    (check_gated if gated else check_linear)(x, w, run(x, w, cfg, gated))
    for bad in (cfg._replace(split_k=2), cfg._replace(dot=True), cfg._replace(fixup=True)):
        with pytest.raises(sg.SkinnyGemmError, match=bad.name):
            sg.launch(x, w, x.new_empty(m, n), bad, gated)


def test_fixup_only_with_prepared_counters_else_the_sum_kernel(device, monkeypatch):
    """A fixup config runs in one kernel only with counters `prepare_fixup` made beforehand and enough of them;
    otherwise the two-kernel split (the same bits), and a call never makes counters itself (inside a CUDA graph
    capture or torch.compile's graph warm-up they would come from the graph's memory pool)."""
    x, w = make(3, 2, 80, 96, device=device)
    cfg = Config(16, 32, 3, 4, 2, fixup=True)
    want = run(x, w, cfg._replace(fixup=False), False)
    sums = []
    real_sum = sgk.splitk_sum_kernel
    monkeypatch.setattr(sgk, "splitk_sum_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: (sums.append(grid), real_sum[grid])[1]})())
    monkeypatch.setattr(sgk, "_counters", {})
    assert torch.equal(run(x, w, cfg, False), want) and len(sums) == 1 and sgk._counters == {}  # not prepared
    sgk.prepare_fixup(x.device)
    assert torch.equal(run(x, w, cfg, False), want) and len(sums) == 1  # one kernel
    monkeypatch.setattr(sgk, "MAX_FIXUP_BLOCKS", 4)  # 80 columns / 16 = 5 blocks
    assert sgk.fixup_counters(x.device, 5) is None
    assert torch.equal(run(x, w, cfg, False), want) and len(sums) == 2


def test_kernel_rows_by_shape_class():
    """The op sets' routing by shape class: a wide, a gated and a narrow (split-K) class, each with its own rows."""
    assert sg.kernel_rows(8192) == sg.kernel_rows(5376) == sg.KERNEL_ROWS["wide"]
    assert sg.kernel_rows(6144, gated=True) == sg.KERNEL_ROWS["gated"]
    assert sg.kernel_rows(1536) == sg.kernel_rows(2048) == sg.KERNEL_ROWS["narrow"]
    assert all(0 <= r <= MAX_M for r in sg.KERNEL_ROWS.values())


def test_cublas_above_sends_larger_batches_to_cublas(device, monkeypatch):
    """cublas_above=R: calls of at most R rows launch the kernel, larger ones do not (cuBLAS: the linear bit for bit
    the twin, gate/up cuBLAS's product then the gelu-mul, within one rounding of the twin); decided per call, so
    one traced function serves both."""
    launched = []
    real = sg.launch
    monkeypatch.setattr(sg, "launch", lambda *a, **k: (launched.append(a[2].shape[0]), real(*a, **k))[1])
    for m in (1, 4, 5, 9):
        x, w = make(m, m, 64, 48, device=device)
        for fn, twin in ((skinny_linear, sg.skinny_linear_torch), (skinny_gate_up_gelu, sg.skinny_gate_up_gelu_torch)):
            launched.clear()
            got = fn(x, w, cublas_above=4)
            assert launched == ([m] if m <= 4 else []), (fn.__name__, m)
            want = twin(x, w)
            if m > 4 and fn is skinny_linear:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3 * want.abs().max())
    with pytest.raises(SkinnyGemmError, match="skinny_linear: cublas_above must be an int >= 0"):
        skinny_linear(x, w, cublas_above=-1)
    with pytest.raises(SkinnyGemmError, match="skinny_gate_up_gelu: cublas_above must be an int"):
        skinny_gate_up_gelu(x, w, cublas_above=2.5)


@pytest.mark.compile
@OVERFLOW_OK
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_traces_under_torch_compile_as_opaque_calls(device, backend):
    """fullgraph=True: the ops trace through their fake implementations (no graph break) and run the kernel, the
    same bits as eager (interpreted on CPU: the custom op is opaque, so nothing traces into Triton)."""
    x, w1 = make(5, 6, 64, 48, device=device)
    _, w2 = make(6, 6, 96, 64, device=device, scale=0.125)
    _, w3 = make(7, 6, 40, 48, device=device)

    def f(x):
        out = torch.empty(x.shape[0], 40, dtype=x.dtype, device=x.device)
        skinny_linear(x, w3, out=out)
        return skinny_gate_up_gelu(skinny_linear(x, w1), w2) * 2, out

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=backend, dynamic=False)(x)
    torch._dynamo.reset()
    want = f(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_plan_and_candidates():
    """Static properties of the table: the Gemma 4 assistant's shapes land in the intended classes, gated classes
    never split K, and every candidate's pipeline fits an H200's shared memory (weights + x tile per stage)."""
    classes = {(8192, 1536): "wide", (16384, 1536): "wide", (1536, 8192): "narrow", (1536, 16384): "narrow",
               (1536, 6144): "narrow", (1536, 10752): "narrow", (2048, 1536): "narrow"}
    for (n, k), want in classes.items():
        assert sg.plan(8, n, k) == CANDIDATES[f"m16-{want}"][0]
    assert sg.shape_class(1, 6144, gated=True) == "m4-gated" and sg.shape_class(64, 1536) == "m64-narrow"
    assert (sg.shape_class(1, 1536), sg.shape_class(2, 1536), sg.shape_class(1, 8192)) == \
        ("m1-narrow", "m4-narrow", "m4-wide")
    assert sg.plan(1, 1536, 8192).gemv and not sg.plan(2, 1536, 8192).gemv
    for key, cfgs in CANDIDATES.items():
        assert cfgs and len(set(cfgs)) == len(cfgs), key
        max_m = {"m1": 1, "m4": 4, "m16": 16, "m64": 64}[key.split("-")[0]]
        for c in cfgs:
            assert "gated" not in key or c.split_k == 1, (key, c)
            assert c.dot or max_m <= 4, (key, c)
            block_m = max(16, max_m) if c.dot else max_m
            rows = c.block_n * (2 if "gated" in key else 1)
            assert c.num_stages * (rows + block_m) * c.block_k * 2 <= 227 * 1024, (key, c)
    assert sg.k_splits(16384, Config(32, 256, 8, 4, 4)) == (2048, 8)
    assert sg.k_splits(1536, Config(32, 256, 4, 4, 4)) == (512, 3)  # no empty split
    assert sg.k_splits(100, Config(32, 256, 4, 4, 4)) == (256, 1)


# Compiles every candidate for an H100/H200 (sm_90), no GPU needed (tests/sm90.py), with the divisibility hints a
# launch's aligned pointers and strides give.
SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import graphcap.kernels.gemm.skinny as sg
import graphcap.kernels.gemm.skinny_kernels as sgk

ARGS = ["x", "w", "y", "out", "counters", "M", "N", "K", "k_split", "stride_xm", "stride_wn", "stride_ym", "stride_ys",
        "stride_om"]
GEMV_ARGS = ["x", "w", "out", "M", "N", "K", "stride_xm", "stride_wn", "stride_om"]
seen = set()
for key, cfgs in sg.CANDIDATES.items():
    gated = "gated" in key
    for i, cfg in enumerate(cfgs):
        if cfg.gemv:  # its own kernel, the same for every M
            for even in (True, False):
                if (cfg, gated, even) in seen:
                    continue
                seen.add((cfg, gated, even))
                sig = {a: "*bf16" if a in ("x", "w", "out") else "i32" for a in GEMV_ARGS}
                consts = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated, INTERPRET=False, EVEN_K=even,
                              EVEN_N=even, STAGES=cfg.num_stages, GDC=True)  # GDC: as an H100/H200 launches it
                sig.update({c: "constexpr" for c in consts})
                attrs = {(j,): [["tt.divisibility", 16]] for j in (0, 1, 2, 5, 6, 7, 8)}
                k = triton.compile(ASTSource(sgk.gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=cfg.num_warps))
                assert k.metadata.shared <= 227 * 1024, (key, cfg, k.metadata.shared)
                assert cfg.num_stages == 1 or "cp.async" in k.asm["ptx"], (key, cfg)  # the loads pipelined
                print(key, cfg.name, even, k.metadata.shared)
            continue
        for m in {"m1": (1,), "m4": (1, 4), "m16": (16,), "m64": (32, 64)}[key.split("-")[0]]:
            bm = max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m)
            for even in (True, False) if i == 0 else (True,):
                if (cfg, bm, gated, even) in seen:
                    continue
                seen.add((cfg, bm, gated, even))
                fixup = cfg.fixup and cfg.split_k > 1
                sig = {a: "*bf16" if a in ("x", "w", "out") else "i32" for a in ARGS}
                sig.update(y="*fp32" if fixup else "*bf16", counters="*i32" if fixup else "*bf16")
                consts = dict(BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated, DOT=cfg.dot,
                              INTERPRET=False, EVEN_K=even, EVEN_N=even, FIXUP=fixup,
                              SPLITS=cfg.split_k if fixup else 1, GDC=True)
                sig.update({c: "constexpr" for c in consts})
                attrs = {(j,): [["tt.divisibility", 16]] for j in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)}
                k = triton.compile(ASTSource(sgk.skinny_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
                assert k.metadata.shared <= 227 * 1024, (key, cfg, bm, k.metadata.shared)
                assert "griddepcontrol.wait" in k.asm["ptx"], (key, cfg)  # programmatic dependent launch taken
                print(key, cfg.name, bm, even, k.metadata.shared)
sig = dict(ws="*fp32", out="*bf16", M="i32", N="i32", SPLITS="i32", stride_om="i32", BLOCK="constexpr",
           INTERPRET="constexpr", GDC="constexpr")
triton.compile(ASTSource(sgk.splitk_sum_kernel, sig, dict(BLOCK=1024, INTERPRET=False, GDC=True)),
               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print("compiled", len(seen) + 1)
"""


@pytest.mark.subprocess
def test_every_candidate_compiles_for_sm90(tmp_path):
    compile_for_sm90(SM90_COMPILE, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the Gemma 4 assistant's shapes (docstring of graphcap/kernels/gemm/skinny.py)

GEMMA = {"q_proj_sliding": (8192, 1536), "q_proj_full": (16384, 1536), "o_proj_sliding": (1536, 8192),
         "o_proj_full": (1536, 16384), "down": (1536, 6144), "pre_proj": (1536, 10752), "centroids": (2048, 1536)}
GATE_UP = (6144, 1536)  # I, K


@pytest.fixture(autouse=True)
def fp32_cublas(monkeypatch):
    """cuBLAS (the twin on CUDA) reduces split-K partials in fp32: torch's default lets it use bf16, whose rounding
    is outside the twin's bound (module docstring). Every test here: the device-parametrised ones run on CUDA too
    (a CPU build of torch has no such switch)."""
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)


def gpu_case(seed: int, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    return x, w


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("name", list(GEMMA) + ["gate_up"])
def test_gemma4_shapes_on_gpu(name, m, fp32_cublas):
    n, k = (2 * GATE_UP[0], GATE_UP[1]) if name == "gate_up" else GEMMA[name]
    x, w = gpu_case(m + n + k, m, n, k)
    if name == "gate_up":
        check_gated(x, w, skinny_gate_up_gelu(x, w))
    else:
        check_linear(x, w, skinny_linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 12, 40])
def test_every_candidate_on_gpu(m, fp32_cublas):
    """Each candidate config of M's class compiles and is correct at one wide, one narrow and the gated shape."""
    for name, gated in (("q_proj_sliding", False), ("o_proj_full", False), ("gate_up", True)):
        n, k = (2 * GATE_UP[0], GATE_UP[1]) if gated else GEMMA[name]
        x, w = gpu_case(m, m, n, k)
        for cfg in configs_for(m, gated):
            (check_gated if gated else check_linear)(x, w, run(x, w, cfg, gated))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("name", ["q_proj_sliding", "o_proj_full", "pre_proj", "gate_up"])
def test_cuda_graph_replay_equals_eager_exactly(name, m):
    """Captured once, replayed on new x written in place: the same bits as an eager call on that x (split-K included:
    the reduction order is fixed), and two eager calls agree bit for bit."""
    gated = name == "gate_up"
    n, k = (2 * GATE_UP[0], GATE_UP[1]) if gated else GEMMA[name]
    x, w = gpu_case(m, m, n, k)
    op = skinny_gate_up_gelu if gated else skinny_linear
    sgk.prepare_fixup(x.device)  # a narrow plan splits K in one kernel
    op(x, w)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, w)
    x.copy_(gpu_case(m + 1, m, 1, k)[0])
    graph.replay()
    torch.cuda.synchronize()
    eager = op(x, w)
    assert torch.equal(out, eager) and torch.equal(eager, op(x, w))
    replays = []
    for _ in range(5):  # a fixup split K's counters are back at 0 after each replay
        graph.replay()
        replays.append(out.clone())
    assert all(torch.equal(r, eager) for r in replays)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("name", ["o_proj_sliding", "o_proj_full", "down", "pre_proj"])
def test_fixup_on_gpu_equals_the_two_kernel_split(name, m, fp32_cublas):
    """On the GPU (where programs of one launch really race for the counters), every fixup candidate gives the sum
    kernel's bits over repeated launches, within the float64 bound."""
    n, k = GEMMA[name]
    x, w = gpu_case(m, m, n, k)
    sgk.prepare_fixup(x.device)
    for cfg in {c for cs in CANDIDATES.values() for c in cs if c.fixup}:
        want = run(x, w, cfg._replace(fixup=False), False)
        for _ in range(3):
            assert torch.equal(run(x, w, cfg, False), want), cfg.name
        check_linear(x, w, want)
    assert not sgk.fixup_counters(x.device, 1).any()


@pytest.mark.gpu
def test_torch_compile_reduce_overhead_on_gpu():
    """Both ops inside an Inductor-compiled, CUDA-graphed function: no cudagraph skips, the same bits as eager."""
    from torch._dynamo.utils import counters

    _, w_qkv = gpu_case(1, 1, 1536, 8192)
    _, w_gu = gpu_case(2, 1, 2 * 6144, 1536)
    _, w_down = gpu_case(4, 1, 1536, 6144)  # narrow: its plan splits K in one kernel, counters made first
    sgk.prepare_fixup("cuda")
    for w in (w_qkv, w_gu, w_down):
        torch._dynamo.mark_static_address(w)

    def f(x):
        return skinny_linear(skinny_gate_up_gelu(skinny_linear(x, w_qkv), w_gu), w_down)

    counters.clear()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    x = gpu_case(3, 8, 1, 8192)[0]
    for _ in range(3):
        out = compiled(x).clone()
    assert not counters["inductor"]["cudagraph_skips"]
    assert torch.equal(out, f(x))
