"""decode_attention (kernels, interpreted on CPU / native on CUDA, and the torch twin) against a float64 reference
computed from scratch: gather K/V by location, softmax, weighted sum. Random data, never zeros."""
from __future__ import annotations

import contextlib
import itertools
import math
import zlib

import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.kernels import twins_on_cpu
from sm90 import compile_for_sm90
from test_layer_fusions import norm_rope64
from tiers import examples, thorough
from graphcap.kernels.attention.decode import decode_attention, decode_attention_with_config
from graphcap.kernels.attention.decode_kernels import decode_attention_torch
from graphcap.kernels.attention.plan import AttentionError, choose_num_splits, default_config

TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def impl_ctx(impl: str, device: str):
    return twins_on_cpu() if impl == "twin" and device == "cpu" else contextlib.nullcontext()


def run(impl: str, device: str, *args):
    if impl == "twin":
        return decode_attention_torch(*args)
    return decode_attention(*args)


def make_case(seed, *, lens, heads, kv_heads, dim, window, dtype, device, cols=None, pad_rows=1, page=4,
              index_dtype=torch.int32):
    """A batch with `len(lens)` live rows plus `pad_rows` padding rows. Live rows use distinct random slots of a
    table with `n` rows; padding rows use slot n, which has a `lens` entry (0) but NO table row. Table entries are
    page-shuffled locations (location 0 never used by a live token); columns past a row's length hold other valid
    locations, so reading past the length would change the result."""
    g = torch.Generator().manual_seed(seed)
    n = len(lens) + 2
    if cols is None:
        cols = window if window > 0 else max([1, *lens]) + 7
    n_pages = n * -(-cols // page) + 1
    pool = n_pages * page
    pages = 1 + torch.randperm(n_pages - 1, generator=g)
    locs = (pages[:, None] * page + torch.arange(page)).reshape(-1)[: n * cols]
    table = locs.reshape(n, cols).to(index_dtype)
    gd = torch.Generator(device=device).manual_seed(seed)  # pools drawn on the device (GPU cases are large)
    k_pool = torch.randn(pool, kv_heads, dim, generator=gd, device=device).to(dtype)
    v_pool = torch.randn(pool, kv_heads, dim, generator=gd, device=device).to(dtype)
    q = torch.randn(len(lens) + pad_rows, heads, dim, generator=g).to(dtype)
    live_slots = torch.randperm(n, generator=g)[: len(lens)]
    slots = torch.cat([live_slots, torch.full((pad_rows,), n)])
    lens_t = torch.zeros(n + 1, dtype=torch.int32)
    lens_t[live_slots] = torch.tensor(lens, dtype=torch.int32)
    sm_scale = 1.0 / math.sqrt(dim)
    return [x.to(device) for x in (q, k_pool, v_pool, table, slots, lens_t)] + [window, sm_scale]


def reference(q, k_pool, v_pool, table, slots, lens, window, sm_scale) -> torch.Tensor:
    """float64, from scratch, one row and head at a time (gathered on the pools' device, returned on CPU)."""
    b, h, d = q.shape
    group = h // k_pool.shape[1]
    cols = window if window > 0 else table.shape[1]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        slot = int(slots[i])
        n = min(int(lens[slot]), cols)
        if n == 0:
            continue
        locs = table[slot, :n].long()
        kk, vv = k_pool[locs].double(), v_pool[locs].double()  # [n, Hkv, D]
        for j in range(h):
            w = torch.softmax((kk[:, j // group] @ q[i, j].double()) * sm_scale, dim=0)
            out[i, j] = (w @ vv[:, j // group]).cpu()
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def check(out, case, dtype):
    ref = reference(*case)
    assert out.shape == case[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"
    # padding rows (the last one at least): exact zeros
    assert (out[-1] == 0).all()


# ---------------------------------------------------------------------------------------------------------------
# seeded sweep: GQA ratios x full/window x splits x dtype x kernel/twin

SHAPES = [(2, 2, 16), (4, 2, 32), (16, 2, 16)]  # (query heads, kv heads, dim): ratios 1, 2, 8
# live lengths: 1, < W, == W, > W (clipped in window mode), not multiples of the tile (16 on CPU, 32 on GPU)
LENS = [37, 1, 24, 11, 50]
SWEEP_DTYPES = (torch.float32, torch.bfloat16)


def sweep_cases():
    """Every shape x window x split count x dtype, kernel and twin. The CI tier runs every twin case and six of the
    interpreted kernel's: each shape at both windows, split counts and dtypes cycled so that each window meets every
    split count and both dtypes; the rest of the kernel's are the thorough tier's."""
    ci = {(shape, window, (1, 3, 8)[i % 3], SWEEP_DTYPES[(i // 2 + i) % 2])
          for i, (shape, window) in enumerate(itertools.product(SHAPES, (0, 24)))}
    for shape, window, splits, dtype, impl in itertools.product(SHAPES, (0, 24), (1, 3, 8), SWEEP_DTYPES,
                                                                ("kernel", "twin")):
        case_id = f"h{shape[0]}kv{shape[1]}d{shape[2]}-{window}-{splits}-{str(dtype).split('.')[1]}-{impl}"
        if impl == "kernel" and (shape, window, splits, dtype) not in ci:
            yield thorough(impl, dtype, splits, window, shape, id=case_id)
        else:
            yield pytest.param(impl, dtype, splits, window, shape, id=case_id)


@pytest.mark.interpreter
@pytest.mark.parametrize("impl, dtype, splits, window, shape", list(sweep_cases()))
def test_sweep_matches_float64_reference(impl, dtype, splits, window, shape, device):
    if impl == "twin" and device == "cuda":
        pytest.skip("the twin is the CPU path")
    h, hkv, d = shape
    seed = zlib.crc32(repr((impl, dtype, splits, window, shape)).encode())
    case = make_case(seed, lens=LENS, heads=h, kv_heads=hkv, dim=d, window=window, dtype=dtype, device=device)
    with impl_ctx(impl, device):
        out = run(impl, device, *case, splits)
    check(out, case, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("impl", ["kernel", "twin"])
@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**20),
    ratio=st.sampled_from([1, 2, 4, 8]),
    kv_heads=st.integers(1, 2),
    dim=st.sampled_from([16, 32, 24]),
    window=st.sampled_from([0, 1, 5, 16, 20]),
    lens=st.lists(st.integers(0, 45), min_size=1, max_size=4),
    pad_rows=st.integers(0, 2),
    splits=st.integers(1, 9),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_random_cases(impl, device, seed, ratio, kv_heads, dim, window, lens, pad_rows, splits, dtype, index_dtype):
    if impl == "twin" and device == "cuda":
        pytest.skip("the twin is the CPU path")
    case = make_case(seed, lens=lens, heads=ratio * kv_heads, kv_heads=kv_heads, dim=dim, window=window,
                     dtype=dtype, device=device, pad_rows=pad_rows, index_dtype=index_dtype)
    with impl_ctx(impl, device):
        out = run(impl, device, *case, splits)
    ref = reference(*case)
    assert torch.isfinite(out).all()
    if ref.norm() > 0:
        assert rel_err(out, ref) < TOL[dtype]
    # rows of length 0 (padding, or a live row with lens 0): exact zeros
    q, _, _, table, slots, lens_t = case[:6]
    cols = window if window > 0 else table.shape[1]
    for i in range(q.shape[0]):
        if min(int(lens_t[int(slots[i])]), cols) == 0:
            assert (out[i] == 0).all()


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**20), batch=st.integers(1, 2), heads=st.integers(1, 3), splits=st.integers(1, 40),
       dim=st.sampled_from([16, 24, 512]), empty=st.sampled_from([0.0, 0.3, 1.0]))
def test_combine_kernel_matches_float64(device, seed, batch, heads, splits, dim, empty):
    """The combine kernel alone over random partials and log-sum-exps, up to 40 splits, head widths that are and are
    not a power of two: the float64 merge of the live splits. An empty split (lse -inf) wrote no partial; its slot
    here holds NaN, which must not reach the output. A row of empty splits gives zeros."""
    from graphcap.kernels.attention.online_softmax import combine_kernel

    g = torch.Generator().manual_seed(seed)
    lse = torch.randn(batch, heads, splits, generator=g) * 4
    lse[torch.rand(batch, heads, splits, generator=g) < empty] = -math.inf
    part = torch.randn(batch, heads, splits, dim, generator=g)
    part[lse == -math.inf] = math.nan
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    args = [t.to(device) for t in (part.flatten(), lse.flatten(), out)]
    combine_kernel[(batch, heads)](*args, splits, out.stride(0), out.stride(1), H=heads, D=dim,
                                   BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_S=triton.next_power_of_2(splits))
    w = torch.exp2(lse.double() - lse.double().amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0))
    num = (w[..., None] * part.double().nan_to_num(0.0)).sum(-2)
    den = w.sum(-1, keepdim=True)
    want = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
    torch.testing.assert_close(args[2].cpu().double(), want, rtol=1e-5, atol=1e-6)


def test_every_argument_reaches_the_registered_op(monkeypatch):
    """torch 2.11's custom-op wrapper failed (IndexError) on a mutated argument left to its default: the public
    function passes all of the op's arguments, positionally."""
    import graphcap.kernels.attention.decode as attn

    schema = torch.ops.graphcap.decode_attention.default._schema
    seen = []
    monkeypatch.setattr(attn, "_decode_attention_op", lambda *a, **k: seen.append((a, k)) or a[0])
    case = make_case(2, lens=[5], heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32, device="cpu")
    attn.decode_attention(*case, 2)
    (args, kwargs), = seen
    assert len(args) == len(schema.arguments) and not kwargs and args[8] == 2  # num_splits, then the plan's ints


def test_only_padding_rows_give_zeros(device):
    case = make_case(3, lens=[], heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32, device=device,
                     cols=8, pad_rows=3)
    for splits in (1, 4):
        out = decode_attention(*case, splits)
        assert out.shape == (3, 4, 16) and (out == 0).all()


def test_non_contiguous_query(device):
    """q as a view into a wider projection output (row stride != H * D)."""
    case = make_case(5, lens=[20, 3], heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32, device=device)
    wide = torch.randn(case[0].shape[0], 4, 48, device=device)
    wide[:, :, 16:32] = case[0]
    case[0] = wide[:, :, 16:32]
    assert not case[0].is_contiguous()
    check(decode_attention(*case, 2), case, torch.float32)


def test_explicit_configs_agree(device):
    """Other tile sizes / minimum chunks (what the bench tunes) give the same answer."""
    from graphcap.kernels.attention.plan import KernelConfig

    case = make_case(11, lens=[45, 17, 2], heads=8, kv_heads=2, dim=32, window=0, dtype=torch.float32, device=device)
    ref = reference(*case)
    for cfg in (KernelConfig(block_n=16, num_warps=1, num_stages=1, min_chunk=16, combine_warps=1, max_chunk=0),
                KernelConfig(block_n=32, num_warps=2, num_stages=1, min_chunk=64, combine_warps=1, max_chunk=0),
                KernelConfig(block_n=16, num_warps=1, num_stages=1, min_chunk=16, combine_warps=1, max_chunk=16)):
        out = decode_attention_with_config(*case, 5, config=cfg)
        assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", [0, *(thorough(s) for s in range(1, 4))])
def test_split_adaptation_never_changes_the_answer(device, seed):
    """However the row-adaptive split count lands (enough to fill the GPU, more for long rows, capped by the static
    grid; batches of mixed lengths, empty rows), the answer is the float64 reference's."""
    from graphcap.kernels.attention.plan import KernelConfig

    g = torch.Generator().manual_seed(100 + seed)
    b = int(torch.randint(1, 6, (1,), generator=g))
    lens = torch.randint(0, 120, (b,), generator=g).tolist()
    case = make_case(200 + seed, lens=lens, heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32,
                     device=device)
    ref = reference(*case)
    for splits in (1, 2, 3, 8):
        for max_chunk, wave in ((0, 0), (16, 4), (48, 6), (1024, 1), (1024, 0)):  # small waves: rows use < splits
            cfg = KernelConfig(block_n=16, num_warps=1, num_stages=1, min_chunk=16, combine_warps=1,
                               max_chunk=max_chunk, wave=wave)
            out = decode_attention_with_config(*case, splits, config=cfg)
            assert rel_err(out, ref) < TOL[torch.float32], (splits, max_chunk, lens)


@pytest.mark.interpreter
@pytest.mark.parametrize("batch", [1, 2, 3, thorough(5), thorough(9)])  # 1-3: the wave's steps 4, 2, 1
def test_wave_from_the_grid_equals_the_hosts(device, batch):
    """One compile for every bucket: with a symbolic batch the split kernel derives its wave from the launched grid
    (`wave_in_kernel`) instead of the host's `wave_splits`. Same splits used per row, so bit-identical outputs, at
    batch sizes on both sides of the wave's steps (programs 8, 2 KV heads: waves 4, 2, 1, 1, 1) and with the grid
    planned for the call's batch and for batch 1 (what `plan_for_any_batch` launches)."""
    import dataclasses

    from graphcap.kernels.attention.plan import KernelConfig, plan_attention, wave_splits
    from graphcap.kernels.attention.decode_kernels import launch

    g = torch.Generator().manual_seed(300 + batch)
    lens = torch.randint(0, 200, (batch,), generator=g).tolist()
    case = make_case(400 + batch, lens=lens, heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32,
                     device=device, pad_rows=0)
    ref = reference(*case)
    cfg = KernelConfig(block_n=16, num_warps=1, num_stages=1, min_chunk=16, combine_warps=1, max_chunk=48, wave=8)
    assert [wave_splits(b, 2, 8) for b in (1, 2, 3, 5, 9)] == [4, 2, 1, 1, 1]
    for splits in (choose_num_splits(batch, 2, 200, 8, 48, 16), choose_num_splits(1, 2, 200, 8, 48, 16)):
        plan = plan_attention(batch, 2, 16, torch.float32, device, 200, num_splits=splits, config=cfg)
        assert plan.wave == min(splits, wave_splits(batch, 2, 8)) and plan.programs == 8
        host = launch(*case, plan)
        grid = launch(*case, dataclasses.replace(plan, wave=0))  # what a plan for any batch launches
        assert torch.equal(host, grid), (batch, splits)
        assert rel_err(grid, ref) < TOL[torch.float32]


def test_sliding_layer_over_window_buffers(device):
    """The sliding-layer wiring: table = WindowBuffers ring (SWA locations), lens = its seq_lens, window = W, against
    attention over the last W tokens read straight from req_to_token and full_to_swa."""
    from graphcap.window import WindowBuffers

    g = torch.Generator().manual_seed(7)
    slots_n, row, w = 4, 40, 12
    r2t = (1 + torch.randperm(slots_n * row, generator=g)).reshape(slots_n, row).to(torch.int32)
    f2s = 1 + torch.randperm(slots_n * row + 1, generator=g)
    f2s[0] = 0
    pool = int(f2s.max()) + 1
    k_swa = torch.randn(pool, 2, 16, generator=g)
    v_swa = torch.randn(pool, 2, 16, generator=g)
    wb = WindowBuffers(r2t.to(device), w, slots_n, f2s.to(device), max_accepted=4)
    lens = {0: 30, 2: 5, 3: 12}
    wb.reset(list(lens), list(lens.values()))
    wb.advance(torch.tensor([0, 2, wb.padding_slot], device=device), torch.tensor([3, 2, 0], device=device))
    lens[0] += 3
    lens[2] += 2
    slots = torch.tensor([0, 2, 3, wb.padding_slot], device=device)
    q = torch.randn(4, 4, 16, generator=g)
    out = decode_attention(q.to(device), k_swa.to(device), v_swa.to(device), wb.ring, slots, wb.seq_lens, w, 0.25, 3)
    ref = torch.zeros(4, 4, 16, dtype=torch.float64)
    for i, s in enumerate([0, 2, 3]):
        n = lens[s]
        locs = f2s[r2t[s, max(0, n - w):n].long()]
        for h in range(4):
            p = torch.softmax(k_swa[locs, h // 2].double() @ q[i, h].double() * 0.25, 0)
            ref[i, h] = p @ v_swa[locs, h // 2].double()
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (out[3] == 0).all()


@pytest.mark.compile
def test_traces_under_torch_compile_on_cpu():
    """The op (twin path) traces with fullgraph=True: static shapes, no graph breaks."""
    case = make_case(13, lens=[9, 30], heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32, device="cpu")

    def f(q, k, v, t, s, n):
        return decode_attention(q, k, v, t, s, n, 0, case[7], 3) * 2

    with twins_on_cpu():
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
        out = compiled(*case[:6])
        eager = f(*case[:6])
    torch.testing.assert_close(out, eager)
    assert rel_err(out / 2, reference(*case)) < TOL[torch.float32]


@torch.library.custom_op("graphcap_test::write_splits", mutates_args=("part", "lse"))
def _write_splits(part: torch.Tensor, lse: torch.Tensor) -> None:
    """A stand-in for the split kernel on CPU (Inductor lowers no interpreted Triton kernel): writes every element."""
    part.copy_(torch.arange(part.numel(), dtype=part.dtype).reshape(part.shape).sin())
    lse.copy_(torch.arange(lse.numel(), dtype=lse.dtype).reshape(lse.shape).cos())


@pytest.mark.compile
def test_split_scratch_costs_no_fill_kernel_under_a_symbolic_batch():
    """Under one compile for every bucket the split count is an expression of the batch (`grid_splits` of a plan
    for any batch); the kernel's scratch must reach it as allocated - no kernel of Inductor's filling it first (a 4-D
    empty tensor got one per buffer: its strides hold max(1, S)). The kernel writes it; the answer equals eager."""
    from torch._inductor.utils import run_and_get_code
    from graphcap.kernels.attention.plan import plan_attention
    from graphcap.kernels.attention.online_softmax import split_scratch

    plan = plan_attention(None, 2, 8, torch.float32, "cpu", 1024)  # what the draft layers plan for any batch
    assert plan.wave == 0 and plan.max_chunk > 0 and plan.min_splits > 0  # so grid_splits follows the batch

    def f(x):
        b = x.shape[0]
        splits = plan.grid_splits(b, 2)
        part, lse = split_scratch(b, 4, splits, 8, x.device)
        _write_splits(part, lse)
        return part.sum() + lse.sum() + x.sum()

    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    torch._dynamo.decorators.mark_unbacked(x, 0)
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(f, fullgraph=True, backend="inductor"), x)
    torch.testing.assert_close(out, f(x))
    code = "\n".join(codes)
    assert "quiet_NaN" not in code and "float(\"nan\")" not in code, "Inductor filled the scratch before the op"


# ---------------------------------------------------------------------------------------------------------------
# errors and the split heuristic


def q_norm_reference(q, w, cos, sin, slots, lens, eps):
    """q normed and rotated in float64 (test_layer_fusions.norm_rope64) at each row's query position lens[slot] - 1,
    clamped to the tables, computed here; on q's device."""
    pos = (lens.cpu().long()[slots.cpu().long()] - 1).clamp(0, cos.shape[0] - 1)
    return norm_rope64(q, w, cos, sin, pos, eps).to(q.device)


@pytest.mark.interpreter
@pytest.mark.parametrize("impl", ["kernel", "twin"])
@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**20), ratio=st.sampled_from([1, 2, 8]), dim=st.sampled_from([16, 32]),
       window=st.sampled_from([0, 5, 16]), lens=st.lists(st.integers(0, 45), min_size=1, max_size=4),
       splits=st.integers(1, 6), table_rows=st.integers(1, 60), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_q_norm_in_the_kernel_matches_float64(impl, device, seed, ratio, dim, window, lens, splits, table_rows,
                                               dtype):
    """`q_norm`: the raw projection normed and rotated in the split kernel (positions from the rows' own lengths,
    some past the tables' end) attends as the float64 reference over the normed, rotated q does - and as the
    kernel over layer_fusions.norm_rope's q, to the query's rounding."""
    from graphcap.kernels.attention.decode_kernels import QueryNormRope
    from graphcap.kernels.elementwise.layer_fusions import norm_rope

    if impl == "twin" and device == "cuda":
        pytest.skip("the twin is the CPU path")
    case = make_case(seed, lens=lens, heads=2 * ratio, kv_heads=2, dim=dim, window=window, dtype=dtype,
                     device=device)
    q, k, v, t, slots, lens_t, w, sc = case
    g = torch.Generator().manual_seed(seed + 1)
    weight = (0.5 * torch.randn(dim, generator=g)).to(dtype).to(device)
    ang = torch.rand(table_rows, dim // 2, generator=g, dtype=torch.float64) * 6.28
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    with impl_ctx(impl, device):
        out = decode_attention(q, k, v, t, slots, lens_t, w, sc, splits,
                               q_norm=QueryNormRope(weight, cos, sin, 1e-6))
        chained = decode_attention(norm_rope(q, weight, cos, sin, slots, lens_t), k, v, t, slots, lens_t, w, sc,
                                   splits)
    ref = reference(q_norm_reference(q, weight, cos, sin, slots, lens_t, 1e-6), k, v, t, slots, lens_t, w, sc)
    tol = {torch.float32: TOL[torch.float32], torch.bfloat16: 3e-2}[dtype]
    assert torch.isfinite(out).all()
    if ref.norm() > 0:
        assert rel_err(out, ref) < tol
        assert rel_err(out, chained.double().cpu()) < tol
    cols = w if w > 0 else t.shape[1]
    for i in range(q.shape[0]):
        if min(int(lens_t[int(slots[i])]), cols) == 0:
            assert (out[i] == 0).all()


def test_q_norm_bad_inputs_name_the_argument():
    from graphcap.kernels.attention.decode_kernels import QueryNormRope

    case = make_case(1, lens=[5], heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32, device="cpu")
    q, k, v, t, s, n, w, sc = case
    cos = sin = torch.ones(9, 8)
    with pytest.raises(AttentionError, match=r"^decode_attention: weight must be a 1-D"):
        decode_attention(q, k, v, t, s, n, w, sc, 1, q_norm=QueryNormRope(torch.ones(16, dtype=torch.int32), cos, sin))
    with pytest.raises(AttentionError, match=r"^decode_attention: cos must be \[positions >= 1, 8\]"):
        decode_attention(q, k, v, t, s, n, w, sc, 1, q_norm=QueryNormRope(torch.ones(16), cos[:, :7], sin[:, :7]))
    with pytest.raises(AttentionError, match=r"^decode_attention: eps must be"):
        decode_attention(q, k, v, t, s, n, w, sc, 1, q_norm=QueryNormRope(torch.ones(16), cos, sin, -1.0))


SM90_ATTENTION = """
import torch
from graphcap.kernels.attention import decode_kernels as A
from graphcap.kernels.arch import SM90
from graphcap.kernels.attention import online_softmax as O
from graphcap.kernels.attention.plan import default_config, query_block

TYPES = dict(q="*bf16", k_pool="*bf16", v_pool="*bf16", table="*i32", slots="*i64", lens="*i32", out="*bf16",
             part="*fp32", lse="*fp32", q_w="*bf16", cos="*fp32", sin="*fp32", sm_scale_log2="fp32", eps="fp32")
n = 0
for heads, kv_heads, d in ((32, 16, 256), (32, 4, 512)):  # the Gemma 4 draft's sliding and full layers
    cfg = default_config(d, torch.bfloat16, True, SM90.smem_per_block)
    group = heads // kv_heads
    block_g = query_block(group, d)
    for single in (True, False):
        for norm_rope in (True, False):
            for wave_in_kernel in (True, False):
                consts = dict(H=heads, GROUP=group, HEAD_TILES=-(-group // block_g), D=d, BLOCK_D=d, BLOCK_G=block_g,
                              BLOCK_N=cfg.block_n, SINGLE=single, F32_DOT=False, WAVE_IN_KERNEL=wave_in_kernel,
                              NORM_ROPE=norm_rope)
                compile(A._split_kernel, TYPES, consts, cfg.num_warps, cfg.num_stages)
                n += 1
    compile(O.combine_kernel, dict(part="*fp32", lse="*fp32", out="*bf16"),
            dict(H=heads, D=d, BLOCK_D=d, BLOCK_S=16), cfg.combine_warps)
    n += 1
print("compiled", n)
"""


@pytest.mark.subprocess
def test_kernels_compile_for_sm90(tmp_path):
    """The split kernel in every variant the op launches (one split or several, the query's norm + rotary in it or
    not, the wave from the host or the grid) and the combine kernel, at the draft's head widths, compiled for sm_90
    (tests/sm90.py): what the CPU interpreter does not check."""
    assert "compiled 18" in compile_for_sm90(SM90_ATTENTION, tmp_path)


def test_bad_inputs_name_the_argument(device):
    case = make_case(1, lens=[5], heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32, device=device)
    q, k, v, t, s, n, w, sc = case
    with pytest.raises(AttentionError, match="multiple of kv heads"):
        decode_attention(q[:, :3], k, v, t, s, n, w, sc, 1)
    with pytest.raises(AttentionError, match="wider than table"):
        decode_attention(q, k, v, t, s, n, t.shape[1] + 1, sc, 1)
    with pytest.raises(AttentionError, match="dtypes differ"):
        decode_attention(q, k.half(), v, t, s, n, w, sc, 1)
    with pytest.raises(AttentionError, match="num_splits"):
        decode_attention(q, k, v, t, s, n, w, sc, 0)
    with pytest.raises(AttentionError, match="slots has"):
        decode_attention(q, k, v, t, s[:0], n, w, sc, 1)
    with pytest.raises(AttentionError, match="table must be"):
        decode_attention(q, k, v, t.float(), s, n, w, sc, 1)


def test_choose_num_splits():
    from graphcap.kernels.attention.plan import splits_for, target_programs, wave_splits

    # batch x kv heads x splits fills the programs asked for without spilling past them
    assert [wave_splits(b, 4) for b in (8, 16)] == [8, 4] and wave_splits(8, 16) == 2
    assert wave_splits(8, 16, 528) == 4 and wave_splits(3, 5, 7) == 1
    # the split plan at the H200 grids' best split counts, timed in-graph at batch 8: full layer 8 splits (256
    # programs), sliding 4 (512 programs), both 256 keys per program
    full_p, sliding_p = (target_programs(d, torch.bfloat16, torch.device("cpu")) for d in (512, 256))
    assert choose_num_splits(8, 4, 2048, full_p) == 8 and choose_num_splits(8, 16, 1024, sliding_p) == 4
    # ... but never programs of one 32-key tile: batch 1 takes 16 splits of the sliding window (the sweep's best)
    assert choose_num_splits(1, 16, 1024, sliding_p) == 16 and choose_num_splits(1, 4, 2048, full_p) == 32
    q = torch.randn(8, 32, 256, dtype=torch.bfloat16)
    assert splits_for(q, torch.empty(10, 16, 256, dtype=torch.bfloat16), 1024) == 4
    for kv_heads in (4, 16):
        for batch in (1, 2, 4, 8):
            w = wave_splits(batch, kv_heads)
            assert 132 <= batch * kv_heads * w <= 264
    # batch x kv heads already (nearly) a wave: no split; short rows are not over-split (>= 64 keys per split)
    assert wave_splits(16, 16) == 1 and choose_num_splits(64, 16, 1024) == 1
    assert choose_num_splits(1, 16, 32) == 1
    assert choose_num_splits(1, 16, 100) == 2
    assert choose_num_splits(1, 4, 1024) == 16
    # long rows: programs of <= 1024 keys (the grid covers the longest row; short rows use a wave's worth)
    assert choose_num_splits(8, 4, 32768) == 32 and choose_num_splits(64, 4, 32768) == 32
    assert all(1 <= choose_num_splits(b, h, n) <= 64 for b in (1, 3, 64) for h in (1, 4) for n in (1, 10**6))
    with pytest.raises(AttentionError):
        choose_num_splits(0, 4, 10)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_target_programs_are_two_waves_of_what_fits_in_shared_memory(head_dim, dtype):
    """CPU plans as an H200 would (132 SMs, 228 KiB of shared memory per SM): target_programs is twice the SMs
    times the most programs whose tiles fit in one SM's shared memory together (and within its 2048 threads)."""
    from graphcap.kernels.attention.plan import plan_config, program_smem, target_programs

    cpu = torch.device("cpu")
    cfg = plan_config(head_dim, dtype, cpu)
    per_program = program_smem(cfg, head_dim, dtype.itemsize)
    programs = target_programs(head_dim, dtype, cpu)
    assert programs % (2 * 132) == 0
    per_sm = programs // (2 * 132)
    assert per_sm >= 1 and per_sm * 32 * cfg.num_warps <= 2048
    assert per_sm * per_program <= 228 * 1024 or per_sm == 1
    assert (per_sm + 1) * per_program > 228 * 1024 or (per_sm + 1) * 32 * cfg.num_warps > 2048


def test_default_config_shapes():
    big = default_config(512, torch.bfloat16, True, smem_bytes=232448)  # H100/H200
    assert (big.block_n, big.num_stages, big.num_warps) == (32, 3, 4)
    small = default_config(512, torch.bfloat16, True, smem_bytes=101376)  # less shared memory: fewer stages
    assert small.num_stages * 2 * small.block_n * 512 * 2 <= 101376
    assert default_config(256, torch.bfloat16, True, smem_bytes=232448).num_warps == 4
    assert default_config(16, torch.float32, False).block_n == 16


# ---------------------------------------------------------------------------------------------------------------
# GPU: Gemma 4 shapes natively

GEMMA = {"sliding": dict(heads=32, kv_heads=16, dim=256, window=1024),
         "full": dict(heads=32, kv_heads=4, dim=512, window=0)}


def _gemma_lens(batch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = [0, 1, 5000, 1023, 1024, 1025, 37, 2048]
    extra = torch.randint(1, 6000, (max(0, batch - len(base)),), generator=g).tolist()
    return (base + extra)[:batch] if batch > 1 else [5000]


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["sliding", "full"])
@pytest.mark.parametrize("batch", [1, 8, 33])
def test_gemma4_shapes_on_gpu(layer, batch):
    shp = GEMMA[layer]
    lens = _gemma_lens(batch, batch)
    cols = shp["window"] if shp["window"] else 6000
    case = make_case(batch, lens=lens, heads=shp["heads"], kv_heads=shp["kv_heads"], dim=shp["dim"],
                     window=shp["window"], dtype=torch.bfloat16, device="cuda", cols=cols, page=64)
    ref = reference(*case)
    max_len = shp["window"] or 6000
    for splits in sorted({1, 7, choose_num_splits(batch + 1, shp["kv_heads"], max_len)}):
        out = decode_attention(*case, splits)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        err = rel_err(out, ref)
        assert err < TOL[torch.bfloat16], f"splits={splits}: relative error {err:.3g}"
        assert (out[-1] == 0).all()
        if 0 in lens:
            assert (out[lens.index(0)] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_q_norm_at_gemma4_widths_on_gpu(layer):
    """The query's norm + rotary in the split kernel at the draft's head widths (256 and 512, bf16), under a
    CUDA graph of Inductor's code: the float64 reference over the normed, rotated q, and the kernel over
    layer_fusions.norm_rope's q."""
    from graphcap.kernels.attention.decode_kernels import QueryNormRope
    from graphcap.kernels.elementwise.layer_fusions import norm_rope

    shp = GEMMA[layer]
    lens = _gemma_lens(8, 8)
    cols = shp["window"] if shp["window"] else 6000
    case = make_case(8, lens=lens, heads=shp["heads"], kv_heads=shp["kv_heads"], dim=shp["dim"],
                     window=shp["window"], dtype=torch.bfloat16, device="cuda", cols=cols, page=64)
    q, k, v, t, slots, n, w, sc = case
    g = torch.Generator().manual_seed(3)
    weight = (0.5 * torch.randn(shp["dim"], generator=g)).to(torch.bfloat16).cuda()
    ang = torch.rand(8192, shp["dim"] // 2, generator=g, dtype=torch.float64) * 6.28
    qn = QueryNormRope(weight, ang.cos().float().cuda(), ang.sin().float().cuda())
    splits = choose_num_splits(9, shp["kv_heads"], shp["window"] or 6000)
    torch._dynamo.reset()  # static ints (window, splits): no automatic dynamic from another parametrisation's compile
    fn = torch.compile(lambda q: decode_attention(q, k, v, t, slots, n, w, sc, splits, q_norm=qn),
                       mode="reduce-overhead", fullgraph=True, dynamic=False)
    for _ in range(3):
        out = fn(q).clone()
    chained = decode_attention(norm_rope(q, weight, qn.cos, qn.sin, slots, n), k, v, t, slots, n, w, sc, splits)
    ref = reference(q_norm_reference(q, weight, qn.cos, qn.sin, slots, n, 1e-6), k, v, t, slots, n, w, sc)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(out, chained.double().cpu()) < TOL[torch.bfloat16]
    assert (out[-1] == 0).all()
    torch._dynamo.reset()


@pytest.mark.gpu
def test_fp16_on_gpu():
    case = make_case(2, lens=[300, 1, 77], heads=32, kv_heads=16, dim=256, window=128, dtype=torch.float16,
                     device="cuda", page=64)
    check(decode_attention(*case, 4), case, torch.float16)


@pytest.mark.gpu
def test_cuda_graph_capture_under_reduce_overhead():
    """Compiled with mode="reduce-overhead": no cudagraph skips, replays follow new lengths written in place."""
    from torch._dynamo.utils import counters

    case = make_case(4, lens=[900, 5, 2000], heads=32, kv_heads=4, dim=512, window=0, dtype=torch.bfloat16,
                     device="cuda", cols=2048, page=64)
    q, k, v, t, s, n, w, sc = case
    for x in (k, v, t, s, n):
        torch._dynamo.mark_static_address(x)

    def f(q):
        return decode_attention(q, k, v, t, s, n, w, sc, 8)

    counters.clear()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for _ in range(3):
        out = compiled(q).clone()
    assert not counters["inductor"]["cudagraph_skips"]
    assert rel_err(out, reference(*case)) < TOL[torch.bfloat16]
    n[s[0]] = 17  # a new length, written in place: the next replay must see it
    out = compiled(q).clone()
    assert rel_err(out, reference(q, k, v, t, s, n, w, sc)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_matches_sglang_decode_kernel(layer):
    """graphcap's op against sglang's own Triton decode kernel (`decode_attention_fwd`) on the same query and pools,
    sglang reading CSR index lists built from the same rows (as its Triton backend does). Needs sglang's kernels
    importable (the wheels scripts/gpu-check.sh installs from ./.whl)."""
    dec = pytest.importorskip("sglang.kernels.ops.attention.decode_attention")
    shp = GEMMA[layer]
    lens = [1, 700, 1024, 1500, 3000, 33, 2048, 5000]
    cols = shp["window"] if shp["window"] else 6000
    q, k, v, table, slots, n, w, sc = make_case(7, lens=lens, heads=shp["heads"], kv_heads=shp["kv_heads"],
                                                dim=shp["dim"], window=shp["window"], dtype=torch.bfloat16,
                                                device="cuda", cols=cols, page=64, pad_rows=0)
    ours = decode_attention(q, k, v, table, slots, n, w, sc, choose_num_splits(len(lens), shp["kv_heads"], cols))
    eff = [min(x, w) if w else x for x in lens]
    indptr = torch.tensor([0] + eff, device="cuda").cumsum(0).to(torch.int32)
    indices = torch.cat([table[s, :m].long() for s, m in zip(slots.tolist(), eff)])
    splits = 16
    b, h, d = q.shape
    theirs = torch.empty_like(q)
    dec.decode_attention_fwd(q, k, v, theirs, indptr, indices,
                             torch.empty(b, h, splits, d, dtype=torch.float32, device="cuda"),
                             torch.empty(b, h, splits, dtype=torch.float32, device="cuda"),
                             torch.full((b,), splits, dtype=torch.int32, device="cuda"), splits, sc, 1.0, 1.0)
    torch.cuda.synchronize()
    err = rel_err(ours, theirs.float().cpu())
    assert err < 1e-2, f"relative difference to sglang's kernel {err:.3g}"


def test_kv_sources_plan_from_their_own_pools():
    """Each layer type's KVSource sizes its split grid from its own pools' head dim: Gemma 4's sliding layers
    (D = 256) fit twice the resident programs of its full layer (D = 512) on an H200, so a source that planned with
    a fixed or the other layer type's program count would launch half or double the grid."""
    from graphcap.models.frozen_kv_draft import KVSource
    from graphcap.spec import load_spec

    spec = load_spec("gemma4-31b-assistant")
    table = torch.empty(1, 1, dtype=torch.int32, device="meta")
    programs = {}
    for lt in ("sliding", "full"):
        a = spec.attention(lt)
        pool = torch.empty(4, a.kv_heads, a.head_dim, dtype=torch.bfloat16, device="meta")
        programs[lt] = KVSource(pool, pool, table, 0, spec.window).plan(1).programs
    assert programs["sliding"] == 2 * programs["full"]
