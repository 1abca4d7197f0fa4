"""graphcap.kernels.elementwise.layer_fusions (the draft layer's norm chains, one kernel each) against their torch
twins and against float64 math written here; the op set built on them (LAYER_KERNEL_OPS) against the torch set on
the same model.

Tolerances: fp32 2e-5 relative. bf16: the kernels round after each link of a chain as the reference does, and on CPU
Triton's interpreter truncates fp32 -> bf16 where torch rounds to nearest, so a link may differ by one ulp and the
next one carries it: 2**-6 of the tensor's largest magnitude. Inputs are random and never zero.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import graphcap.models.draft_ops as draft_ops
import graphcap.models.frozen_kv_draft as frozen_kv_draft
from graphcap.kernels.elementwise import layer_fusions as L
from graphcap.kernels import twins_on_cpu
from graphcap.kernels.elementwise.fused_ops import FusedOpError
from graphcap.models import DraftLoop
from graphcap.models.draft_ops import LAYER_KERNEL_OPS, TORCH_OPS
from graphcap.window import WindowBuffers
from random_norms import random_norm_draft
from sm90 import compile_for_sm90
from tiers import examples

DTYPES = [torch.float32, torch.bfloat16]
SETTINGS = dict(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def nonzero(shape, g: torch.Generator, dtype: torch.dtype, device: str, lo: float = 0.1) -> torch.Tensor:
    mag = lo + (2.0 - lo) * torch.rand(shape, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
    return (mag * sign).to(dtype).to(device)


def angles(rows: int, half: int, g: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.rand(rows, half, generator=g, dtype=torch.float64) * 6.28
    return a.cos().float().to(device), a.sin().float().to(device)


def positions(b: int, table_rows: int, g: torch.Generator, device: str, index_dtype=torch.int64):
    """Random slots (distinct, in a lens table with spare rows) and lens: lengths 0 (position 0, as padding rows),
    inside the table, and past its end (the last row), in random order. Returns slots, lens and each row's
    position as the kernels must find it."""
    n_slots = b + 3
    slots = torch.randperm(n_slots, generator=g)[:b]
    lens = torch.randint(0, table_rows + 4, (n_slots,), generator=g)
    lens[slots[0]] = 0
    pos = (lens[slots] - 1).clamp(0, table_rows - 1)
    return slots.to(index_dtype).to(device), lens.to(torch.int32).to(device), pos


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str,
                 scale: float | None = None) -> None:
    """Within a few roundings of `dtype`, relative to `scale` (default: the largest |want|). A sum whose terms cancel
    carries the terms' rounding, not its own: pass the terms' magnitude (`sum_scales`)."""
    got, want = got.double().cpu(), want.double().cpu()
    scale = float(want.abs().max()) if scale is None else scale
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-5 * max(1.0, scale), msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-6 * scale, msg=lambda m: f"{what}: {m}")


def sum_scales(terms: list[torch.Tensor], total64: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """Tolerance scales for a sum of `terms` (float64 value `total64`) and for its norm with weight `w`: a rounding
    of a term moves the sum by the term's ulp however small the sum is, and moves the sum's norm by that much over
    its row's rms."""
    term = max(float(t.double().abs().max()) for t in terms)
    rms = (total64.double() ** 2).mean(-1).sqrt().min().clamp_min(1e-30).item()
    normed = float((1.0 + w.double()).abs().max()) * (total64.double().abs() / rms).max().item()
    return max(term, float(total64.abs().max())), normed * max(1.0, term / rms)


def norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w.double())


def norm_rope64(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                eps: float) -> torch.Tensor:
    """float64 on the CPU: each head of q [B, H, D] normed (norm64), then its halves rotated at row b's position
    pos[b] of the tables cos, sin [P, D/2]."""
    n = norm64(q.cpu(), w.cpu(), eps)
    c, s = cos.double().cpu()[pos.cpu()][:, None], sin.double().cpu()[pos.cpu()][:, None]
    half = q.shape[-1] // 2
    return torch.cat([n[..., :half] * c - n[..., half:] * s, n[..., half:] * c + n[..., :half] * s], -1)


# ---------------------------------------------------------------------------------------------------------------
# each op: kernel vs twin vs float64


@pytest.mark.parametrize("dtype", DTYPES)
@settings(**SETTINGS)
@given(b=st.integers(1, 4), heads=st.integers(1, 4), half=st.integers(1, 24), pad=st.integers(0, 2),
       w32=st.booleans(), eps=st.sampled_from([1e-6, 0.1]), table=st.integers(1, 9), int32_slots=st.booleans(),
       seed=st.integers(0, 2**16))
def test_norm_rope_matches_twin_and_float64(device, dtype, b, heads, half, pad, w32, eps, table, int32_slots, seed):
    """Each row rotated at the position its slot's length gives, from the tables: against float64 math over the
    rows' positions computed here (lengths 0 and past the table's end included)."""
    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    q = nonzero((b, heads + pad, d), g, dtype, device)[:, :heads]  # a head stride past the rows' own
    w = nonzero((d,), g, torch.float32 if w32 else dtype, device)
    cos, sin = angles(table, half, g, device)
    slots, lens, pos = positions(b, table, g, device, torch.int32 if int32_slots else torch.int64)
    q0 = q.clone()
    got = L.norm_rope(q, w, cos, sin, slots, lens, eps)
    assert torch.equal(q, q0), "q must not change"
    want = norm_rope64(q0, w, cos, sin, pos, eps)
    twin = L.norm_rope_torch(q0, w, cos, sin, slots, lens, eps)
    assert got.shape == q0.shape and got.dtype == dtype
    assert_close(got, twin, dtype, "norm_rope vs twin")
    assert_close(twin, want, dtype, "twin vs float64")
    assert_close(got, want, dtype, "norm_rope vs float64")


@pytest.mark.parametrize("dtype", DTYPES)
@settings(**SETTINGS)
@given(rows=st.integers(1, 5), n=st.integers(1, 96), pad=st.integers(0, 3), w32=st.booleans(),
       eps=st.sampled_from([1e-6, 0.1]), seed=st.integers(0, 2**16))
@example(rows=1, n=1, pad=0, w32=False, eps=1e-6, seed=1)  # the terms cancel: the sum is 0.33, each term ~1
def test_norm_add_norm_matches_twin_and_float64(device, dtype, rows, n, pad, w32, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = nonzero((rows, n + pad), g, dtype, device)[:, :n]  # a row stride != n
    r = nonzero((rows, n), g, dtype, device)
    wx, ws = (nonzero((n,), g, torch.float32 if w32 else dtype, device) for _ in range(2))
    x0, r0 = x.clone(), r.clone()
    normed, total = L.norm_add_norm(x, r, wx, ws, eps)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not change"
    s64 = r0.double() + norm64(x0, wx, eps)
    t_normed, t_total = L.norm_add_norm_torch(x0, r0, wx, ws, eps)
    sum_scale, norm_scale = sum_scales([r0, norm64(x0, wx, eps)], s64, ws)
    assert_close(total, t_total, dtype, "sum vs twin", sum_scale)
    assert_close(normed, t_normed, dtype, "norm of the sum vs twin", norm_scale)
    assert_close(t_total, s64, dtype, "twin's sum vs float64", sum_scale)
    assert_close(t_normed, norm64(s64, ws, eps), dtype, "twin's norm vs float64", norm_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(**SETTINGS)
@given(rows=st.integers(1, 5), n=st.integers(1, 96), w32=st.booleans(), eps=st.sampled_from([1e-6, 0.1]),
       seed=st.integers(0, 2**16))
def test_norm_add_scale_norm_matches_twin_and_float64(device, dtype, rows, n, w32, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = nonzero((rows, n), g, dtype, device), nonzero((rows, n), g, dtype, device)
    wx, wo = (nonzero((n,), g, torch.float32 if w32 else dtype, device) for _ in range(2))
    scalar = (0.25 + torch.rand((), generator=g)).to(dtype).to(device)
    out, normed = L.norm_add_scale_norm(x, wx, r, scalar, wo, eps)
    o64 = (r.double() + norm64(x, wx, eps)) * scalar.double()
    t_out, t_normed = L.norm_add_scale_norm_torch(x, wx, r, scalar, wo, eps)
    k = float(scalar.double().abs())
    out_scale, norm_scale = sum_scales([r.double() * k, norm64(x, wx, eps) * k], o64, wo)
    assert_close(out, t_out, dtype, "output vs twin", out_scale)
    assert_close(normed, t_normed, dtype, "its norm vs twin", norm_scale)
    assert_close(t_out, o64, dtype, "twin's output vs float64", out_scale)
    assert_close(t_normed, norm64(o64, wo, eps), dtype, "twin's norm vs float64", norm_scale)


def _bf16(t: torch.Tensor, truncate: bool) -> torch.Tensor:
    """fp32 -> bf16 (as fp32) rounded to nearest (CUDA, torch) or truncated (Triton's CPU interpreter)."""
    f = t.float()
    return (f.view(torch.int32) & -65536).view(torch.float32) if truncate else f.to(torch.bfloat16).float()


def test_bf16_rounds_after_each_link_as_the_reference_does(device):
    """The reference rounds the post-norm before adding it and the sum before scaling. Emulated in fp32 with the
    kernel's rounding mode, that chain gives the kernel's output (all but the odd element where the fp32 sums' order
    moves a rounding), while the chain rounded only at its end - what a kernel that skipped the inner roundings
    would give - differs on many elements: the case tells the two apart."""
    truncate = device == "cpu"
    g = torch.Generator().manual_seed(3)
    n = 512
    x = nonzero((4, n), g, torch.bfloat16, device)
    r = (16 + torch.randint(0, 64, (4, n), generator=g).double() / 7).to(torch.bfloat16).to(device)
    w = nonzero((n,), g, torch.float32, device)
    scalar = torch.tensor(1.0 / 3, dtype=torch.bfloat16, device=device)
    out, _ = L.norm_add_scale_norm(x, w, r, scalar, w)
    xf = x.float().cpu()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float().cpu())
    rf, sf = r.float().cpu(), scalar.float().cpu()
    linked = _bf16(_bf16(rf + _bf16(normed, truncate), truncate) * sf, truncate)
    at_end = _bf16((rf + normed) * sf, truncate)
    got = out.float().cpu()
    assert (got == linked).float().mean() > 0.99
    assert (got != at_end).float().mean() > 0.05


def test_cpu_without_interpreter_runs_the_twin(monkeypatch):
    """Which path ran: every launch goes through wrap_triton, made to raise here; under the interpreter the call
    reaches it (the control), without it the twin runs."""
    def no_kernel(*a, **k):
        raise AssertionError("a Triton kernel was launched")

    monkeypatch.setattr(L, "wrap_triton", no_kernel)
    g = torch.Generator().manual_seed(0)
    x, w = nonzero((3, 40), g, torch.float32, "cpu"), nonzero((40,), g, torch.float32, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(AssertionError, match="Triton kernel was launched"):
        L.norm_add_norm(x, x, w, w)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    normed, total = L.norm_add_norm(x, x, w, w)
    assert_close(total, x.double() + norm64(x, w, 1e-6), torch.float32, "twin")


@pytest.mark.compile
def test_torch_compile_traces_the_ops_whole_cpu():
    """Under Dynamo (fullgraph: no break) the three ops trace as ops with fake tensors and give the eager result."""
    def chain(x, r, w, s, q, cos, sin, slots, lens):
        h, t = L.norm_add_norm(x, r, w, w)
        o, h2 = L.norm_add_scale_norm(h, w, t, s, w)
        return o, h2, L.norm_rope(q, w[:16], cos, sin, slots, lens)

    g = torch.Generator().manual_seed(1)
    x, r = nonzero((4, 32), g, torch.float32, "cpu"), nonzero((4, 32), g, torch.float32, "cpu")
    w, s = nonzero((32,), g, torch.float32, "cpu"), torch.tensor(0.7)
    q = nonzero((4, 2, 16), g, torch.float32, "cpu")
    cos, sin = angles(6, 8, g, "cpu")
    slots, lens, _ = positions(4, 6, g, "cpu")
    with twins_on_cpu():
        want = chain(x, r, w, s, q, cos, sin, slots, lens)
        torch._dynamo.reset()
        got = torch.compile(chain, backend="aot_eager", fullgraph=True)(x, r, w, s, q, cos, sin, slots, lens)
        torch._dynamo.reset()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
def test_gemma4_widths_under_inductor_cuda():
    """The draft's widths (hidden 1536; 32 query heads of 256 and of 512) in one block per row, compiled by Inductor
    (the kernels as user kernels in its code) and eagerly, against the twins."""
    g = torch.Generator().manual_seed(5)
    dt = torch.bfloat16
    x, r = nonzero((8, 1536), g, dt, "cuda"), nonzero((8, 1536), g, dt, "cuda")
    w1, w2 = nonzero((1536,), g, dt, "cuda"), nonzero((1536,), g, dt, "cuda")
    s = torch.tensor(0.6, dtype=dt, device="cuda")

    def chain(x, r, q, wq, cos, sin, slots, lens):
        h, t = L.norm_add_norm(x, r, w1, w2)
        return (h, t, *L.norm_add_scale_norm(h, w1, t, s, w2), L.norm_rope(q, wq, cos, sin, slots, lens))

    for d in (256, 512):
        q, wq = nonzero((8, 32, d), g, dt, "cuda"), nonzero((d,), g, dt, "cuda")
        cos, sin = angles(4096, d // 2, g, "cuda")
        slots, lens, _ = positions(8, 4096, g, "cuda")
        want = (*L.norm_add_norm_torch(x, r, w1, w2, 1e-6),)
        want = (*want, *L.norm_add_scale_norm_torch(want[0], w1, want[1], s, w2, 1e-6),
                L.norm_rope_torch(q, wq, cos, sin, slots, lens, 1e-6))
        torch._dynamo.reset()
        args = (x, r, q, wq, cos, sin, slots, lens)
        for got in (chain(*args), torch.compile(chain, fullgraph=True)(*args)):
            for a, b in zip(got, want):
                assert_close(a, b, dt, f"head dim {d}")
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# the op set on the draft model


@pytest.mark.interpreter
def test_layer_kernel_op_set_drafts_what_the_torch_ops_draft(device, monkeypatch):
    """LAYER_KERNEL_OPS on the reference's model (float32 tiny spec, random norm weights and layer scalars, so every
    (1 + w), residual and scalar is checked; on a CPU the kernels run in Triton's interpreter): the same scores and
    hidden states as the torch set to fp32 rounding and the same tokens wherever the margin is clear, over
    iterations that slide the windows - and each of the layer's small ops is one kernel call: per layer one
    norm_add_norm, one gelu-mul, one norm_add_scale_norm (which also norms the next layer's input, or the final
    norm), the query's norm + rotary inside the attention call (decode_attention's q_norm; no norm_rope), plus one
    input norm per step."""
    calls: dict[str, int] = {}

    def counted(mod, name):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name,
                            lambda *a, **k: (calls.__setitem__(name, calls.get(name, 0) + 1), fn(*a, **k))[1])

    for name in ("norm_rope", "norm_add_norm", "norm_add_scale_norm"):
        counted(L, name)
    for name in ("gemma_rmsnorm", "gelu_tanh_and_mul"):
        counted(draft_ops, name)
    attend = frozen_kv_draft.decode_attention
    monkeypatch.setattr(frozen_kv_draft, "decode_attention", lambda *a, q_norm=None, **k: (
        calls.__setitem__("attention with q_norm", calls.get("attention with q_norm", 0) + (q_norm is not None)),
        attend(*a, q_norm=q_norm, **k))[1])
    lens0 = [1, 5, 16, 40, 70, 3]
    spec, st, model = random_norm_draft(device, lens0)
    outs = {}
    for ops in (TORCH_OPS, LAYER_KERNEL_OPS):
        wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
        wb.reset(st.slots.tolist(), lens0)
        loop = DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full, ops=ops)
        g = torch.Generator().manual_seed(9)
        outs[ops.name] = []
        for _ in range(2):
            accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=g).to(device)
            tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=g).to(device)
            hidden = torch.randn(len(lens0), spec.target.hidden, generator=g).to(device)
            outs[ops.name].append(loop(st.slots, accepted, tokens, hidden))
    for a, b in zip(outs[LAYER_KERNEL_OPS.name], outs[TORCH_OPS.name]):
        torch.testing.assert_close(a.scores, b.scores, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=2e-5, atol=2e-5)
        decided = b.margins > 1e-3
        assert decided.float().mean() > 0.8
        assert torch.equal(a.tokens[decided], b.tokens[decided])
    steps = 2 * spec.capture.steps
    layers = steps * len(spec.draft.layers)
    assert calls == {"attention with q_norm": layers, "norm_add_norm": layers, "norm_add_scale_norm": layers,
                     "gelu_tanh_and_mul": layers, "gemma_rmsnorm": steps}


SM90_LAYER_FUSIONS = """
from graphcap.kernels.elementwise import layer_fusions as L

n = 0
for width, dtype in ((1536, "*bf16"), (1536, "*fp32")):  # the draft's hidden rows
    types = {name: dtype for name in ("x", "res", "w_x", "w_sum", "w_out", "scalar", "normed", "total", "out")}
    types["eps"] = "fp32"
    block = triton.next_power_of_2(width)  # as the ops launch them
    for fn in (L._norm_add_norm_kernel, L._norm_add_scale_norm_kernel):
        compile(fn, types, dict(BLOCK=block), L.warps_for(block))
        n += 1
for half in (128, 256):  # query heads of 256 and 512
    types = dict(q="*bf16", w="*bf16", cos="*fp32", sin="*fp32", slots="*i64", lens="*i32", out="*bf16", eps="fp32")
    compile(L._norm_rope_kernel, types, dict(BLOCK=half), L.warps_for(half))
    n += 1
print("compiled", n)
"""


@pytest.mark.subprocess
def test_kernels_compile_for_sm90(tmp_path):
    """The three kernels at the draft's widths, compiled for sm_90 (tests/sm90.py): what the CPU interpreter does not
    check."""
    assert "compiled 6" in compile_for_sm90(SM90_LAYER_FUSIONS, tmp_path)


def test_layer_kernel_set_rotates_as_the_torch_set(device):
    """LAYER_KERNEL_OPS hands the rotary tables and the rows' slots (its kernels find the positions); its own `rope`
    and `norm_rope` over those inputs give what the torch set gives over its gathered rows."""
    spec, st, model = random_norm_draft(device, [1, 5, 16, 40, 0, 3])
    g = torch.Generator().manual_seed(4)
    slots = torch.randperm(st.slots.shape[0], generator=g).to(device)
    lens = torch.randint(0, spec.capture.max_context + 5, (st.slots.shape[0],), generator=g).to(torch.int32).to(device)
    for lt in ("sliding", "full"):
        d = spec.attention(lt).head_dim
        q = nonzero((slots.shape[0], spec.draft.heads, d), g, torch.float32, device)
        w = model.layers[0 if lt == "sliding" else -1].q_norm.weight
        ours, ref = LAYER_KERNEL_OPS.rope_inputs(model, lt, slots, lens), TORCH_OPS.rope_inputs(model, lt, slots, lens)
        torch.testing.assert_close(LAYER_KERNEL_OPS.rope(q, ours), TORCH_OPS.rope(q, ref), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(LAYER_KERNEL_OPS.norm_rope(q, w, ours), TORCH_OPS.norm_rope(q, w, ref),
                                   rtol=2e-5, atol=2e-5)


x2, w8 = torch.ones(2, 8), torch.ones(8)
rows2 = (torch.tensor([0, 1]), torch.tensor([3, 4], dtype=torch.int32))  # slots, lens
BAD = [
    (lambda: L.norm_add_norm(x2, torch.ones(3, 8), w8, w8), "norm_add_norm: residual must match x"),
    (lambda: L.norm_add_norm(x2, x2, torch.ones(7), w8), "norm_add_norm: w_x has 7 entries"),
    (lambda: L.norm_add_norm(x2, x2, w8, w8, eps=-1.0), "norm_add_norm: eps"),
    (lambda: L.norm_add_norm(torch.ones(8, 2).t(), x2, w8, w8), "norm_add_norm: x's last dimension"),
    (lambda: L.norm_add_scale_norm(x2, w8, x2, torch.ones(2), w8), "norm_add_scale_norm: scalar must be"),
    (lambda: L.norm_add_scale_norm(x2, w8, x2.int(), torch.ones(()), w8), "norm_add_scale_norm: residual must be"),
    (lambda: L.norm_add_scale_norm(x2, w8, x2, torch.ones(()), torch.ones(9)), "norm_add_scale_norm: w_out has 9"),
    (lambda: L.norm_rope(torch.ones(2, 3, 7), torch.ones(7), torch.ones(2, 3), torch.ones(2, 3), *rows2),
     "norm_rope: q's head dim 7 must be even"),
    (lambda: L.norm_rope(torch.ones(2, 3, 8), w8, torch.ones(5, 3), torch.ones(5, 3), *rows2),
     "norm_rope: cos must be [positions >= 1, 4]"),
    (lambda: L.norm_rope(torch.ones(2, 3, 8), w8, torch.ones(5, 4), torch.ones(6, 4), *rows2),
     "norm_rope: cos (5, 4) and sin (6, 4) must have one shape and layout"),
    (lambda: L.norm_rope(torch.ones(2, 3, 8), w8, torch.ones(2, 4).double(), torch.ones(2, 4), *rows2),
     "norm_rope: cos must be a 2-D float32"),
    (lambda: L.norm_rope(torch.ones(2, 8), w8, torch.ones(2, 4), torch.ones(2, 4), *rows2),
     "norm_rope: q must be a 3-D"),
    (lambda: L.norm_rope(torch.ones(2, 3, 8), w8, torch.ones(5, 4), torch.ones(5, 4), rows2[0][:1], rows2[1]),
     "norm_rope: slots must have one entry per row of q (2)"),
    (lambda: L.norm_rope(torch.ones(2, 3, 8), w8, torch.ones(5, 4), torch.ones(5, 4), rows2[0].float(), rows2[1]),
     "norm_rope: slots must be a 1-D int32/int64"),
    (lambda: L.norm_rope(torch.ones(2, 3, 8), w8, torch.ones(5, 4), torch.ones(5, 4), rows2[0], rows2[1][None]),
     "norm_rope: lens must be a 1-D int32/int64"),
]


@pytest.mark.parametrize("call,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_names_op_and_argument(call, message):
    with pytest.raises(FusedOpError, match="^" + re.escape(message)):
        call()
