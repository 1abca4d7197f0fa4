"""small_topk (the Triton kernel, interpreted on CPU / native on CUDA, and its torch.topk twin) against a sort written
here in Python: each row's entries ranked NaN first, then by value descending, equal values by index ascending - the
order the kernel specifies (module docstring). The kernel must give exactly that order, values and indices; the twin
(torch.topk) the same values, and the same indices wherever the value is not tied in its row (torch's tie order is
unspecified).

Inputs are random normals, never zeros, in small rows (N <= 512) so Triton's interpreter stays fast; ties are
planted by drawing entries from a small pool of values, -inf and NaN by overwriting entries. Triton's interpreter
breaks ties leftmost by itself (numpy's argmax), so on CPU the tie tests check the rest of the kernel; the kernel's
`tie_break_left` is checked by the GPU tests (bf16 rows of 2048 and 4096 entries hold ties).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphcap.kernels.head.small_topk as small_topk_mod
from graphcap.kernels import twins_on_cpu
from graphcap.kernels.head.small_topk import MAX_K, MAX_N, SmallTopkError, small_topk, topk_torch
from tiers import examples

SETTINGS = dict(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def make_rows(seed: int, *, batch: int, n: int, dtype: torch.dtype, device: str, pool: int | None = None,
              neg_inf: float = 0.0, nans: int = 0, pad: int = 0) -> torch.Tensor:
    """[batch, n] random normals (a view with row stride n + pad). `pool`: entries drawn from that many values (ties);
    `neg_inf`: that fraction of entries -inf; `nans`: that many entries per row NaN."""
    g = torch.Generator().manual_seed(seed)
    if pool is None:
        x = torch.randn(batch, n + pad, generator=g)
    else:
        values = torch.randn(pool, generator=g)
        x = values[torch.randint(0, pool, (batch, n + pad), generator=g)]
    x = x.to(dtype)
    assert not (x == 0).any()
    if neg_inf:
        x[torch.rand(batch, n + pad, generator=g) < neg_inf] = -math.inf
    for r in range(batch):
        x[r, torch.randperm(n, generator=g)[:nans]] = math.nan
    return x.to(device)[:, :n]


def reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of each row's k first entries in the specified order, by a Python sort (float64 values)."""
    rows = x.detach().cpu().double().tolist()
    order = [sorted(range(len(r)), key=lambda j, r=r: (not math.isnan(r[j]), -r[j] if not math.isnan(r[j]) else 0, j))
             for r in rows]
    return torch.tensor([o[:k] for o in order], dtype=torch.int64).view(len(rows), k)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (the sign of zero included), NaN as NaN: torch's own CPU gather of bf16 does not keep a NaN's
    bits, so NaN payloads are not compared."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(BITS[a.dtype])[~nan], b.view(BITS[b.dtype])[~nan])


def untied(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[B, k] True where values[b, j] occurs once in row b of x (all NaNs count as one value, -0.0 as 0.0)."""
    xd, vd = x.detach().cpu().double(), values.detach().cpu().double()
    eq = (xd[:, None, :] == vd[:, :, None]) | (xd.isnan()[:, None, :] & vd.isnan()[:, :, None])
    return eq.sum(-1) == 1


def check(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel (the op) against the Python sort, exactly; the twin against both where they are specified."""
    values, indices = small_topk(x, k)
    b = x.shape[0]
    assert values.shape == indices.shape == (b, k) and values.is_contiguous() and indices.is_contiguous()
    assert values.dtype == x.dtype and indices.dtype == torch.int64 and values.device == x.device
    want = reference(x, k)
    assert torch.equal(indices.cpu(), want), "kernel indices differ from the sort's"
    assert same_values(values, x.gather(1, indices)), "kernel values are not x's entries at its indices"
    tv, ti = topk_torch(x, k)
    torch.testing.assert_close(values, tv, rtol=0, atol=0, equal_nan=True)  # the same values, in the same order
    assert same_values(tv, x.gather(1, ti))
    distinct = untied(x, values)
    assert torch.equal(indices.cpu()[distinct], ti.cpu()[distinct])
    return values, indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(**SETTINGS)
@given(batch=st.integers(1, 4), n=st.integers(1, 512), k_frac=st.floats(0.0, 1.0), pad=st.integers(0, 3),
       pool=st.one_of(st.none(), st.integers(1, 12)), neg_inf=st.sampled_from([0.0, 0.0, 0.3, 0.97]),
       nans=st.sampled_from([0, 0, 0, 1, 3]), seed=st.integers(0, 2 ** 16))
def test_kernel_matches_the_sort_and_the_twin(device, dtype, batch, n, k_frac, pad, pool, neg_inf, nans, seed):
    k = max(1, min(n, round(k_frac * min(n, MAX_K))))
    x = make_rows(seed, batch=batch, n=n, dtype=dtype, device=device, pool=pool, neg_inf=neg_inf,
                  nans=min(nans, n), pad=pad)
    check(x, k)


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 7), (3, 100, 1), (4, 300, 33), (2, 512, 64), (1, 17, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fixed_shapes(device, shape, dtype):
    """One of everything, N = k, k = 1, N not a power of two, the largest k the kernel takes; each dtype."""
    batch, n, k = shape
    x = make_rows(sum(shape), batch=batch, n=n, dtype=dtype, device=device, pad=1)
    assert not x.is_contiguous() or batch == 1
    check(x, k)


def test_planted_ties_take_the_smallest_indices_in_ascending_order(device):
    """A tie straddling the k-th place: the kernel keeps its smallest indices, ascending; torch the same values."""
    x = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, 1.0, -3.0, 1.0, 2.0],
                      [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], device=device)
    values, indices = check(x, 5)
    assert indices.tolist() == [[1, 3, 8, 2, 4], [0, 1, 2, 3, 4]]
    assert values.tolist() == [[2.0, 2.0, 2.0, 1.0, 1.0], [1.0] * 5]


def test_signed_zeros_tie_and_keep_their_sign(device):
    """-0.0 equals +0.0 (a tie, taken by index) and comes back as -0.0, as torch returns x's own entry."""
    x = torch.tensor([[-1.0, -0.0, 0.0, -0.0, -2.0]], device=device)
    values, indices = check(x, 4)
    assert indices.tolist() == [[1, 2, 3, 0]]
    assert [math.copysign(1.0, v) for v in values[0, :3].tolist()] == [-1.0, 1.0, -1.0]


def test_nan_ranks_above_everything_as_torch(device):
    """torch.topk ranks NaN above +inf (pinned here on torch's side too); the kernel does the same, its NaNs by
    index. A row's NaN indices are the same set in both."""
    x = torch.tensor([[1.0, math.nan, math.inf, 3.0, math.nan, -math.inf],
                      [math.nan] * 6], device=device)
    tv, ti = topk_torch(x, 4)
    assert tv[0, :2].isnan().all() and tv[0, 2:].tolist() == [math.inf, 3.0] and set(ti[0, :2].tolist()) == {1, 4}
    assert tv[1].isnan().all() and len(set(ti[1].tolist())) == 4
    values, indices = check(x, 4)
    assert indices.tolist() == [[1, 4, 2, 3], [0, 1, 2, 3]]
    values, indices = check(x, 6)
    assert indices[0].tolist() == [1, 4, 2, 3, 0, 5]


def test_rows_of_minus_inf_and_fewer_finite_than_k(device):
    """-inf is a value like any other: a row of fewer than k finite entries returns them, then -inf values at the
    -inf entries' indices (the kernel: ascending; torch: the same set, in its order)."""
    inf = math.inf
    x = torch.tensor([[-inf, 2.0, -inf, -inf, 1.0, -inf, -inf],
                      [-inf] * 7], device=device)
    values, indices = check(x, 5)
    assert values[0].tolist() == [2.0, 1.0, -inf, -inf, -inf] and indices[0].tolist() == [1, 4, 0, 2, 3]
    assert values[1].tolist() == [-inf] * 5 and indices[1].tolist() == [0, 1, 2, 3, 4]
    tv, ti = topk_torch(x, 7)
    assert set(ti[0, 2:].tolist()) == {0, 2, 3, 5, 6} and sorted(ti[1].tolist()) == list(range(7))
    values, indices = check(x, 7)
    assert indices[0].tolist() == [1, 4, 0, 2, 3, 5, 6] and indices[1].tolist() == list(range(7))


def test_empty_batch(device):
    x = make_rows(1, batch=2, n=9, dtype=torch.float32, device=device)[:0]
    values, indices = small_topk(x, 3)
    assert values.shape == indices.shape == (0, 3) and indices.dtype == torch.int64


def test_large_rows_and_k_fall_back_to_the_twin(device, monkeypatch):
    """Past MAX_N or MAX_K the op is torch.topk itself (no kernel launch), results identical to it."""
    def no_launch(*args):
        raise AssertionError("the kernel was launched")

    monkeypatch.setattr(small_topk_mod, "launch", no_launch)
    for n, k in ((MAX_N + 3, 2), (MAX_K + 9, MAX_K + 1)):
        x = make_rows(n, batch=2, n=n, dtype=torch.float32, device=device)
        values, indices = small_topk(x, k)
        tv, ti = torch.topk(x, k, dim=-1)
        assert torch.equal(values, tv) and torch.equal(indices, ti)


def test_twin_is_torch_topk(device):
    """The twin is torch.topk op for op (bit-identical), and the op's path where Triton cannot run."""
    x = make_rows(2, batch=3, n=50, dtype=torch.bfloat16, device=device, pool=9)
    tv, ti = torch.topk(x, 6, dim=-1)
    v, i = topk_torch(x, 6)
    assert torch.equal(v, tv) and torch.equal(i, ti)
    if device == "cpu":
        with twins_on_cpu():
            v, i = small_topk(x, 6)
        assert torch.equal(v, tv) and torch.equal(i, ti)


def test_bad_inputs_name_the_argument(device):
    x = make_rows(3, batch=2, n=8, dtype=torch.float32, device=device)
    bad = [
        ((x[0], 2), r"x must be a 2-D bfloat16/float16/float32 tensor, got 1-D"),
        ((x[None], 2), r"x must be a 2-D .* got 3-D"),
        ((x.long(), 2), r"x must be a 2-D .* got 2-D torch.int64"),
        ((x.double(), 2), r"x must be a 2-D .* got 2-D torch.float64"),
        ((x.tolist(), 2), r"x must be a torch.Tensor, got list"),
        ((x, 0), r"k must be an int in \[1, 8\] \(x's last dimension\), got 0"),
        ((x, 9), r"k must be an int in \[1, 8\] .* got 9"),
        ((x, -1), r"k must be .* got -1"),
        ((x, 2.0), r"k must be .* got 2.0"),
        ((x, True), r"k must be .* got True"),
        ((x[:, :0], 1), r"k must be an int in \[1, 0\]"),
        ((x.t().contiguous().t(), 2), r"x's last dimension must be contiguous"),
    ]
    for args, msg in bad:
        with pytest.raises((SmallTopkError, RuntimeError), match=f"small_topk: {msg}"):
            small_topk(*args)


@pytest.mark.compile
def test_traces_under_torch_compile_on_cpu():
    """The op traces with fullgraph=True: static shapes, no graph breaks. On a CPU through the twin (Triton's
    interpreter cannot run on fake tensors, twins_on_cpu); the kernel's trace is the GPU tests' (reduce-overhead)."""
    x = make_rows(4, batch=3, n=40, dtype=torch.float32, device="cpu")

    def f(x):
        v, i = small_topk(x * 2, 5)
        return v / 2, i

    torch._dynamo.reset()
    with twins_on_cpu():
        v, i = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)(x)
    torch._dynamo.reset()
    tv, ti = torch.topk(x, 5, dim=-1)
    assert torch.equal(v, tv) and torch.equal(i, ti)


def test_model_head_through_the_kernel_matches_torch_topk(device):
    """The tiny draft model's head with graphcap's kernels (torch set; the top-ks interpreted on CPU) and with the
    plain loop's torch.topk and gather head (PLAIN_OPS): the same scores and margins to fp32 rounding (the two
    heads' scoring differs by it), the same tokens where the decision is clear."""
    from graphcap.models import FrozenKVDraft
    from graphcap.models.draft_ops import PLAIN_OPS, TORCH_OPS
    from graphcap.spec import load_spec

    spec = load_spec("tiny")
    model = FrozenKVDraft(spec, seed=5, device=device)
    x = torch.randn(4, spec.draft.hidden, generator=torch.Generator().manual_seed(5)).to(device)
    tok_k, score_k, margin_k = model.head(x, TORCH_OPS)
    tok_p, score_p, margin_p = model.head(x, PLAIN_OPS)
    torch.testing.assert_close(score_k, score_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(margin_k, margin_p, rtol=1e-4, atol=1e-4)
    clear = margin_p > 1e-3
    assert clear.any() and torch.equal(tok_k[clear], tok_p[clear])


# the draft head's two selections at the Gemma 4 assistant's sizes: 33 of 2048 centroid scores, 2 of 4096 logits
GEMMA = [(2048, 33), (4096, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("n,k", GEMMA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma4_sizes_on_gpu(batch, n, k, dtype):
    """Random rows at the real sizes against torch.topk on CUDA and the Python sort."""
    g = torch.Generator(device="cuda").manual_seed(batch * n + k)
    x = torch.randn(batch, n + 8, generator=g, device="cuda").to(dtype)[:, :n]
    values, indices = check(x, k)
    torch.cuda.synchronize()
    tv, ti = torch.topk(x, k, dim=-1)
    assert torch.equal(values, tv)


@pytest.mark.gpu
def test_captures_in_a_cuda_graph_and_follows_new_rows():
    """Captured once, replayed: the graph reads the rows written into x in place and allocates nothing."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 2048, generator=g, device="cuda")
    small_topk(x, 33)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, indices = small_topk(x, 33)
    for seed in (1, 2):
        x.copy_(torch.randn(8, 2048, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        tv, ti = torch.topk(x, 33, dim=-1)
        assert torch.equal(values, tv) and torch.equal(indices, reference(x, 33).cuda())


@pytest.mark.gpu
def test_torch_compile_reduce_overhead_on_gpu():
    """The op inside an Inductor-compiled, CUDA-graphed function: no cudagraph skips, same results as eager."""
    from torch._dynamo.utils import counters

    g = torch.Generator(device="cuda").manual_seed(1)
    cent = torch.randn(2048, 64, generator=g, device="cuda").bfloat16()
    torch._dynamo.mark_static_address(cent)

    def f(x):
        return small_topk((x @ cent.t()).float(), 33)

    counters.clear()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    x = torch.randn(8, 64, generator=g, device="cuda").bfloat16()
    for _ in range(3):
        v, i = (t.clone() for t in compiled(x))
    assert not counters["inductor"]["cudagraph_skips"]
    ev, ei = f(x)
    assert torch.equal(v, ev) and torch.equal(i, ei)
