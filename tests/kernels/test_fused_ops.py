"""graphcap.kernels.elementwise.fused_ops (the ops sglang's Gemma layers take from sgl_kernel): each Triton kernel
(interpreted on CPU, native on CUDA) against its torch twin and against float64 math written here, in-place semantics
included.

Tolerances: fp32 2e-5 relative. bf16 about one unit in the last place (2**-7 relative): on CPU Triton's interpreter
truncates fp32 -> bf16 where CUDA and torch round to nearest, so kernel and twin may differ by one ulp there.
Inputs are random and never zero (magnitudes in [0.1, 2]).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.kernels.elementwise import fused_ops as F
from graphcap.kernels import twins_on_cpu
from tiers import examples

DTYPES = [torch.float32, torch.bfloat16]
RTOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
SETTINGS = dict(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def nonzero(shape, g: torch.Generator, dtype: torch.dtype, device: str) -> torch.Tensor:
    mag = 0.1 + 1.9 * torch.rand(shape, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
    return (mag * sign).to(dtype).to(device)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1.0) -> None:
    """Relative to each element, plus 1e-5 of `scale` for fp32 rounding inside a cancelling sum (rotary)."""
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=RTOL[dtype], atol=1e-5 * scale,
                               msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# norms


def norm64(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (w.double() + offset)


NORMS = {"rmsnorm": (F.rmsnorm, F.rmsnorm_ref, 0.0), "gemma_rmsnorm": (F.gemma_rmsnorm, F.gemma_rmsnorm_ref, 1.0)}
ADD_NORMS = {"fused_add_rmsnorm": (F.fused_add_rmsnorm, F.fused_add_rmsnorm_ref, 0.0),
             "gemma_fused_add_rmsnorm": (F.gemma_fused_add_rmsnorm, F.gemma_fused_add_rmsnorm_ref, 1.0)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NORMS)
@settings(**SETTINGS)
@given(rows=st.integers(1, 5), hidden=st.integers(1, 80), pad=st.integers(0, 3), use_out=st.booleans(),
       w32=st.booleans(), eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**16))
def test_rmsnorm_matches_twin_and_float64(device, name, dtype, rows, hidden, pad, use_out, w32, eps, seed):
    op, ref, offset = NORMS[name]
    g = torch.Generator().manual_seed(seed)
    x = nonzero((rows, hidden + pad), g, dtype, device)[:, :hidden]  # a row stride != hidden
    w = nonzero((hidden,), g, torch.float32 if w32 else dtype, device)
    x0 = x.clone()
    out = torch.full_like(x0, 7.0) if use_out else None
    got = op(x, w, eps, out=out)
    if use_out:
        assert got is out
    assert torch.equal(x, x0), "input must not change"
    want = norm64(x0, w, eps, offset)
    assert_close(got, want, dtype, f"{name} vs float64")
    assert_close(got, ref(x0, w, eps), dtype, f"{name} vs twin")
    assert_close(ref(x0, w, eps), want, dtype, f"{name} twin vs float64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ADD_NORMS)
@settings(**SETTINGS)
@given(rows=st.integers(1, 5), hidden=st.integers(1, 80), eps=st.sampled_from([1e-6, 0.1]), seed=st.integers(0, 2**16))
def test_fused_add_rmsnorm_updates_both_in_place(device, name, dtype, rows, hidden, eps, seed):
    op, ref, offset = ADD_NORMS[name]
    g = torch.Generator().manual_seed(seed)
    x0, r0 = nonzero((rows, hidden), g, dtype, device), nonzero((rows, hidden), g, dtype, device)
    w = nonzero((hidden,), g, dtype, device)
    s64 = x0.double() + r0.double()
    for impl, fn in (("kernel", op), ("twin", ref)):
        x, r = x0.clone(), r0.clone()
        x_ptr, r_ptr = x.data_ptr(), r.data_ptr()
        assert fn(x, r, w, eps) is None
        assert (x.data_ptr(), r.data_ptr()) == (x_ptr, r_ptr)
        assert_close(r, s64, dtype, f"{name} ({impl}): residual += input")
        # against the exact sum (sgl_kernel normalises its fp32 sum, not the residual rounded to bf16)
        assert_close(x, norm64(s64, w, eps, offset), dtype, f"{name} ({impl}): input = norm(sum)")
        if impl == "kernel":
            xk, rk = x, r
    assert_close(xk, x, dtype, f"{name}: kernel vs twin (input)")
    assert_close(rk, r, dtype, f"{name}: kernel vs twin (residual)")


# ---------------------------------------------------------------------------------------------------------------
# gated activations


def act64(kind: str, a: torch.Tensor) -> torch.Tensor:
    a = a.double()
    if kind == "gelu_tanh_and_mul":
        return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
    if kind == "gelu_and_mul":
        return 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))
    return a / (1 + torch.exp(-a))


ACTS = ["gelu_tanh_and_mul", "gelu_and_mul", "silu_and_mul"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ACTS)
@settings(**SETTINGS)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), d=st.integers(1, 70), use_out=st.booleans(),
       seed=st.integers(0, 2**16))
def test_act_and_mul_matches_twin_and_float64(device, name, dtype, lead, d, use_out, seed):
    op, ref = getattr(F, name), getattr(F, name + "_ref")
    g = torch.Generator().manual_seed(seed)
    x = nonzero((*lead, 2 * d), g, dtype, device)
    out = torch.full((*lead, d), 7.0, dtype=dtype, device=device) if use_out else None
    got = op(x, out)
    if use_out:
        assert got is out
    assert got.shape == (*lead, d) and got.dtype == dtype
    want = act64(name, x[..., :d]) * x[..., d:].double()
    assert_close(got, want, dtype, f"{name} vs float64")
    assert_close(got, ref(x), dtype, f"{name} vs twin")
    assert_close(ref(x), want, dtype, f"{name} twin vs float64")


# ---------------------------------------------------------------------------------------------------------------
# rotary


def rope_cache(rot: int, max_pos: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cache as sglang builds it: [cos | sin] per position, float64 angles [max_pos, rot/2])."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float(), ang


def rope64(x: torch.Tensor, pos: torch.Tensor, ang: torch.Tensor, head: int, neox: bool) -> torch.Tensor:
    """[nnz, heads, head] float64, rotated pairwise with angles computed in float64."""
    y = x.double().reshape(x.shape[0], -1, head).clone()
    half = ang.shape[1]
    a = ang[pos.long().cpu()].to(y.device)[:, None, :]
    for i in range(half):
        j1, j2 = (i, i + half) if neox else (2 * i, 2 * i + 1)
        x1, x2 = y[..., j1].clone(), y[..., j2].clone()
        y[..., j1] = x1 * a[..., i].cos() - x2 * a[..., i].sin()
        y[..., j2] = x2 * a[..., i].cos() + x1 * a[..., i].sin()
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["2d", "3d", "qkv"])
@settings(**SETTINGS)
@given(nnz=st.integers(1, 4), hq=st.integers(1, 3), hk=st.integers(1, 2), head=st.sampled_from([2, 4, 6, 8, 16, 24]),
       partial=st.booleans(), neox=st.booleans(), pos32=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_rotates_query_and_key_in_place(device, dtype, layout, nnz, hq, hk, head, partial, neox, pos32, seed):
    g = torch.Generator().manual_seed(seed)
    rot = max(2, (head // 2) & ~1) if partial else head
    max_pos = 32
    cache, ang = rope_cache(rot, max_pos, 10000.0)
    cache = cache.to(device)
    pos = torch.randint(0, max_pos, (nnz,), generator=g).to(torch.int32 if pos32 else torch.int64).to(device)
    buf = nonzero((nnz, (hq + 2 * hk) * head), g, dtype, device)
    results = []
    for impl, fn in (("kernel", F.apply_rope_with_cos_sin_cache_inplace),
                     ("twin", F.apply_rope_with_cos_sin_cache_inplace_ref)):
        b = buf.clone()
        q, k = b[:, :hq * head], b[:, hq * head:(hq + hk) * head]  # slices of one qkv buffer, as sglang passes
        if layout == "2d":
            q, k = q.contiguous(), k.contiguous()
        elif layout == "3d":
            q, k = q.reshape(nnz, hq, head).contiguous(), k.reshape(nnz, hk, head).contiguous()
        assert fn(pos, q, k, head, cache, neox) is None
        for name, t, src in (("query", q, buf[:, :hq * head]), ("key", k, buf[:, hq * head:(hq + hk) * head])):
            got = t.reshape(nnz, -1, head)
            want = rope64(src, pos, ang, head, neox)
            assert_close(got[..., :rot], want[..., :rot], dtype, f"rope {impl} {name}", scale=4.0)
            assert torch.equal(got[..., rot:], src.reshape(nnz, -1, head)[..., rot:]), "dims past rot must not move"
        if layout == "qkv":
            assert torch.equal(b[:, (hq + hk) * head:], buf[:, (hq + hk) * head:]), "v must not move"
        results.append(torch.cat([q.reshape(nnz, -1), k.reshape(nnz, -1)], dim=1))
    assert_close(results[0], results[1], dtype, "rope kernel vs twin", scale=4.0)


# ---------------------------------------------------------------------------------------------------------------
# dispatch, compile, bad input


def test_cpu_without_interpreter_runs_the_twin(monkeypatch):
    """Which path ran, proven: every Triton launch goes through wrap_triton, made to raise here; under the
    interpreter the same call reaches it (the control), without it the twin runs and matches float64."""
    def no_kernel(*a, **k):
        raise AssertionError("a Triton kernel was launched")

    monkeypatch.setattr(F, "wrap_triton", no_kernel)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    w = torch.randn(40, dtype=torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(AssertionError, match="Triton kernel was launched"):
        F.rmsnorm(x, w)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert_close(F.rmsnorm(x, w), norm64(x, w, 1e-6, 0.0), torch.bfloat16, "rmsnorm without the interpreter")
    assert_close(F.gelu_tanh_and_mul(x), act64("gelu_tanh_and_mul", x[:, :20]) * x[:, 20:].double(),
                 torch.bfloat16, "gelu_tanh_and_mul without the interpreter")
    r = x.clone()
    F.fused_add_rmsnorm(x.clone(), r, w)  # the add-norm's twin too
    assert torch.equal(r, (x.float() * 2).to(torch.bfloat16))


def _bf16(t: torch.Tensor, truncate: bool) -> torch.Tensor:
    """float64 -> bf16 through fp32, rounded to nearest (CUDA, torch) or truncated (Triton's CPU interpreter)."""
    f = t.float()
    return (f.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16) if truncate else f.to(torch.bfloat16)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_fused_add_rmsnorm_normalises_the_fp32_sum_not_the_rounded_residual(device, impl):
    """sgl_kernel's fused_add_rmsnorm is flashinfer's FusedAddRMSNormKernel (include/flashinfer/norm.cuh): per element
    x = float(input) + float(residual); residual = (T)x; the fp32 x kept in shared memory; input = x * rrms(x) * w.
    So the norm reads the fp32 sum, the residual is the sum rounded. In bf16 the two readings differ by under one
    output ulp (< the bf16 tolerance), so this crafted case pins it exactly: inputs 1 + k * 2**-10, whose sums are not
    bf16 numbers, and only the elements where the two readings round to different bf16 values are compared."""
    truncate = impl == "kernel" and device == "cpu"  # the interpreter truncates fp32 -> bf16
    op = F.fused_add_rmsnorm if impl == "kernel" else F.fused_add_rmsnorm_ref
    g = torch.Generator().manual_seed(0)
    n = 256
    x0 = torch.ones(4, n, dtype=torch.bfloat16)
    r0 = (torch.randint(1, 8, (4, n), generator=g).double() * 2**-10).to(torch.bfloat16)
    w = (0.5 + torch.rand(n, generator=g)).to(torch.bfloat16)
    s64 = x0.double() + r0.double()
    fp32_sum = _bf16(norm64(s64, w, 1e-6, 0.0), truncate)
    rounded = _bf16(norm64(_bf16(s64, truncate).double(), w, 1e-6, 0.0), truncate)
    apart = fp32_sum != rounded
    assert apart.sum() > 30  # the case tells the two readings apart
    x, r = x0.clone().to(device), r0.clone().to(device)
    op(x, r, w.to(device), 1e-6)
    assert torch.equal(r.cpu(), _bf16(s64, truncate)), "residual = the sum, rounded"
    assert torch.equal(x.cpu()[apart], fp32_sum[apart]), "input = norm of the fp32 sum"


def _decode_step(x, r, w, gate_up, pos, qkv, cache):
    """One draft-layer's worth of the ops, in sglang's order: add+norm, norm, gated MLP activation, rotary on views."""
    F.fused_add_rmsnorm(x, r, w, 1e-6)
    y = F.gemma_rmsnorm(x, w, 1e-6)
    a = F.gelu_tanh_and_mul(gate_up)
    F.apply_rope_with_cos_sin_cache_inplace(pos, qkv[:, :32], qkv[:, 32:48], 16, cache, True)
    return y, a


def _compile_matches_eager(device: str, backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    args = [nonzero(s, g, torch.float32, device) for s in ((4, 32), (4, 32), (32,), (4, 64))]
    args += [torch.tensor([1, 2, 3, 4], device=device), nonzero((4, 64), g, torch.float32, device),
             rope_cache(16, 8, 10000.0)[0].to(device)]
    eager, comp = [t.clone() for t in args], [t.clone() for t in args]
    want = _decode_step(*eager)
    got = torch.compile(_decode_step, backend=backend, fullgraph=True, dynamic=False)(*comp)
    for name, a, b in zip(["y", "a", "x", "r", "w", "gate_up", "pos", "qkv", "cache"], [*got, *comp], [*want, *eager]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.compile
def test_torch_compile_sees_the_mutations_cpu():
    """Inductor cannot lower interpreted Triton kernels, so on CPU the traced bodies are the twins; the mutated
    arguments (input, residual, views of qkv) must come out as in eager mode."""
    with twins_on_cpu():
        _compile_matches_eager("cpu", "aot_eager")
        torch._dynamo.reset()
        _compile_matches_eager("cpu", "inductor")


@pytest.mark.gpu
def test_torch_compile_inductor_runs_the_kernels_cuda():
    _compile_matches_eager("cuda", "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1536, 5376])
def test_gemma4_widths_cuda(hidden):
    """Whole rows of Gemma 4 widths (draft 1536, target 5376) in one block."""
    g = torch.Generator().manual_seed(hidden)
    x, r = nonzero((8, hidden), g, torch.bfloat16, "cuda"), nonzero((8, hidden), g, torch.bfloat16, "cuda")
    w = nonzero((hidden,), g, torch.bfloat16, "cuda")
    assert_close(F.rmsnorm(x, w), norm64(x, w, 1e-6, 0.0), torch.bfloat16, "rmsnorm")
    xs, rs = x.clone(), r.clone()
    F.fused_add_rmsnorm(xs, rs, w)
    assert_close(xs, norm64(x.double() + r.double(), w, 1e-6, 0.0), torch.bfloat16, "fused_add_rmsnorm")
    gu = nonzero((8, 2 * 4 * hidden), g, torch.bfloat16, "cuda")
    assert_close(F.gelu_tanh_and_mul(gu), act64("gelu_tanh_and_mul", gu[:, :4 * hidden]) * gu[:, 4 * hidden:].double(),
                 torch.bfloat16, "gelu_tanh_and_mul")


x2, w2 = torch.ones(2, 8), torch.ones(8)
cache16 = rope_cache(8, 4, 10000.0)[0]
BAD = [
    (lambda: F.rmsnorm(x2, torch.ones(7)), "rmsnorm: weight has 7 entries"),
    (lambda: F.rmsnorm(torch.ones(2, 2, 8), w2), "rmsnorm: input must be a 2-D"),
    (lambda: F.rmsnorm(x2.int(), w2), "rmsnorm: input must be"),
    (lambda: F.rmsnorm(x2, w2, out=torch.ones(2, 9)), "rmsnorm: out must match input"),
    (lambda: F.rmsnorm(x2, w2, eps=-1.0), "rmsnorm: eps"),
    (lambda: F.gemma_rmsnorm(torch.ones(8, 2).t(), torch.ones(8)), "gemma_rmsnorm: input's last dimension"),
    (lambda: F.fused_add_rmsnorm(x2, torch.ones(3, 8), w2), "fused_add_rmsnorm: residual must match input"),
    (lambda: F.gemma_fused_add_rmsnorm(x2, x2.bfloat16(), w2), "gemma_fused_add_rmsnorm: residual must match"),
    (lambda: F.fused_add_rmsnorm(x2, "r", w2), "fused_add_rmsnorm: residual must be a torch.Tensor"),
    (lambda: F.gelu_tanh_and_mul(torch.ones(2, 7)), "gelu_tanh_and_mul: input's last dimension must be even"),
    (lambda: F.silu_and_mul(x2, out=torch.ones(2, 8)), "silu_and_mul: out must have shape"),
    (lambda: F.silu_and_mul(torch.ones(4, 3, 8).transpose(0, 1)), "silu_and_mul: input's leading dimensions"),
    (lambda: F.gelu_and_mul(x2, out=torch.ones(2, 4, dtype=torch.bfloat16)), "gelu_and_mul: out must be"),
    (lambda: F.apply_rope_with_cos_sin_cache_inplace(torch.zeros(2, dtype=torch.long), torch.ones(2, 16),
                                                     torch.ones(2, 8), 8, cache16.double()),
     "apply_rope_with_cos_sin_cache_inplace: cos_sin_cache must be float32"),
    (lambda: F.apply_rope_with_cos_sin_cache_inplace(torch.zeros(3, dtype=torch.long), torch.ones(2, 16),
                                                     torch.ones(2, 8), 8, cache16),
     "apply_rope_with_cos_sin_cache_inplace: query must be"),
    (lambda: F.apply_rope_with_cos_sin_cache_inplace(torch.zeros(2, dtype=torch.long), torch.ones(2, 12),
                                                     torch.ones(2, 8), 8, cache16),
     "apply_rope_with_cos_sin_cache_inplace: query's shape"),
    (lambda: F.apply_rope_with_cos_sin_cache_inplace(torch.zeros(2, dtype=torch.long), torch.ones(2, 16),
                                                     torch.ones(2, 8), 4, cache16),
     "apply_rope_with_cos_sin_cache_inplace: cos_sin_cache's width"),
    (lambda: F.apply_rope_with_cos_sin_cache_inplace(torch.zeros(2), torch.ones(2, 16), torch.ones(2, 8), 8, cache16),
     "apply_rope_with_cos_sin_cache_inplace: positions must be"),
    (lambda: F.apply_rope_with_cos_sin_cache_inplace(torch.zeros(2, dtype=torch.long), torch.ones(2, 16),
                                                     torch.ones(2, 8, dtype=torch.bfloat16), 8, cache16),
     "apply_rope_with_cos_sin_cache_inplace: query and key dtypes differ"),
]


@pytest.mark.parametrize("call,message", BAD, ids=[m.split(":")[0] + ":" + m.split(": ")[1][:24] for _, m in BAD])
def test_bad_input_names_op_and_argument(call, message):
    with pytest.raises(F.FusedOpError, match="^" + message.replace("(", r"\(")):
        call()
    assert issubclass(F.FusedOpError, ValueError)


def test_fused_kv_write_is_not_provided():
    with pytest.raises(NotImplementedError, match="fused_set_kv_buffer_arg"):
        F.apply_rope_with_cos_sin_cache_inplace(torch.zeros(2, dtype=torch.long), torch.ones(2, 16),
                                                torch.ones(2, 8), 8, cache16, fused_set_kv_buffer_arg=object())
