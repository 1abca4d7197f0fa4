"""centroid_logits (the Triton kernel, interpreted on CPU / native on CUDA, and its gather twin) against float64 math
written here: for each row and chosen cluster, that cluster's T lm_head rows times x.

Tolerances: the kernel multiplies in fp32 and sums in fp32; a product of two bf16 (or fp16) values is exact in fp32,
so in every dtype its error is fp32 summation error, bounded here by 1e-5 x sum |w| |x| (`bound`). The twin's
batched product returns the inputs' dtype, so in bf16 each of its logits is also rounded once to bf16 (2**-9
relative, half an ulp); the kernel and the twin are compared with that allowance.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.kernels import twins_on_cpu
from graphcap.kernels.head.centroid import CentroidHeadError, centroid_logits, centroid_logits_torch
from tiers import examples

SETTINGS = dict(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SUM_EPS = 1e-5  # fp32 summation error, relative to sum |w| |x|
TWIN_RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # the twin's output rounding


def make_case(seed: int, *, batch: int, clusters: int, tokens: int, hidden: int, k: int, dtype: torch.dtype,
              device: str, index_dtype: torch.dtype = torch.int64, row_pad: int = 0, x_pad: int = 0):
    """lm_head [C * T, H] (a view with row stride H + row_pad), x [B, H] (row stride H + x_pad), top [B, k] distinct
    clusters per row (a non-contiguous view, as a slice of topk's indices is). Values random, never all zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(clusters * tokens, hidden + row_pad, generator=g).to(dtype)[:, :hidden]
    x = torch.randn(batch, hidden + x_pad, generator=g).to(dtype)[:, :hidden]
    top = torch.stack([torch.randperm(clusters, generator=g)[:k] for _ in range(batch)]) if batch else \
        torch.zeros(0, k, dtype=torch.int64)
    top = torch.cat([top, torch.zeros(batch, 1, dtype=torch.int64)], 1).to(index_dtype)[:, :k]  # row stride k + 1
    return w.to(device), x.to(device), top.to(device), tokens


def reference(w: torch.Tensor, x: torch.Tensor, top: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits [B, k * T] and the bound sum |w| |x| of each, one row and cluster at a time."""
    wd, xd = w.cpu().double(), x.cpu().double()
    b, k = top.shape
    out = torch.zeros(b, k * tokens, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for i in range(b):
        for j in range(k):
            c = int(top[i, j])
            rows = wd[c * tokens:(c + 1) * tokens]
            out[i, j * tokens:(j + 1) * tokens] = rows @ xd[i]
            bound[i, j * tokens:(j + 1) * tokens] = rows.abs() @ xd[i].abs()
    return out, bound


def assert_near(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, rtol: float, what: str) -> None:
    err = (got.cpu().double() - want).abs()
    allowed = SUM_EPS * bound + rtol * want.abs() + 1e-30
    worst = (err / allowed).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g} x the allowed (max abs error {err.max().item():.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(**SETTINGS)
@given(batch=st.integers(1, 5), clusters=st.integers(1, 9), tokens=st.integers(1, 40), hidden=st.integers(1, 300),
       k_frac=st.floats(0.0, 1.0), int32=st.booleans(), row_pad=st.integers(0, 3), x_pad=st.integers(0, 2),
       seed=st.integers(0, 2 ** 16))
def test_kernel_and_twin_match_float64(device, dtype, batch, clusters, tokens, hidden, k_frac, int32, row_pad, x_pad,
                                       seed):
    k = max(1, min(clusters, round(k_frac * clusters)))
    case = make_case(seed, batch=batch, clusters=clusters, tokens=tokens, hidden=hidden, k=k, dtype=dtype,
                     device=device, index_dtype=torch.int32 if int32 else torch.int64, row_pad=row_pad, x_pad=x_pad)
    want, bound = reference(*case)
    got = centroid_logits(*case)
    assert got.dtype == torch.float32 and got.shape == (batch, k * tokens) and got.is_contiguous()
    assert_near(got, want, bound, 0.0, "kernel")
    w, x, top, t = case
    twin = centroid_logits_torch(w.contiguous(), x, top, t)  # the twin views lm_head by clusters: contiguous
    assert_near(twin, want, bound, TWIN_RTOL[dtype], "twin")
    assert_near(got, twin.double().cpu(), bound, TWIN_RTOL[dtype], "kernel vs twin")


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 128, 1536, 3), (3, 5, 7, 513, 5), (4, 16, 16, 32, 4)])
def test_fixed_shapes_fp16_and_bf16(device, shape):
    """A few fixed shapes: one of everything, the real T x H with few clusters, non-powers of two, the tiny spec's."""
    batch, clusters, tokens, hidden, k = shape
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        case = make_case(sum(shape), batch=batch, clusters=clusters, tokens=tokens, hidden=hidden, k=k, dtype=dtype,
                         device=device)
        want, bound = reference(*case)
        assert_near(centroid_logits(*case), want, bound, 0.0, f"kernel {dtype}")


def test_twin_is_the_gather_and_einsum(device):
    """The twin is the gather-then-einsum head math, op for op (bit-identical), and the op's path where Triton
    cannot run."""
    w, x, top, t = make_case(3, batch=3, clusters=6, tokens=8, hidden=24, k=4, dtype=torch.bfloat16, device=device)
    w = w.contiguous()
    gathered = torch.einsum("bkth,bh->bkt", w.view(6, 8, 24)[top], x).flatten(1).float()
    assert torch.equal(centroid_logits_torch(w, x, top, t), gathered)
    if device == "cpu":
        with twins_on_cpu():
            assert torch.equal(centroid_logits(w, x, top, t), gathered)


def test_out_of_range_clusters_read_nothing_and_give_nan(device):
    """A cluster id outside [0, C) is never dereferenced: its T logits are NaN, every other logit is unchanged."""
    w, x, top, t = make_case(4, batch=2, clusters=5, tokens=6, hidden=20, k=3, dtype=torch.float32, device=device)
    good = centroid_logits(w, x, top, t)
    bad = top.clone()
    bad[0, 1], bad[1, 2] = 5, -1
    got = centroid_logits(w, x, bad, t)
    nan = torch.zeros_like(got, dtype=torch.bool)
    nan[0, 6:12], nan[1, 12:18] = True, True
    assert torch.isnan(got[nan]).all()
    assert torch.equal(got[~nan], good[~nan])


def test_empty_batch_and_no_clusters(device):
    w, x, top, t = make_case(5, batch=2, clusters=4, tokens=3, hidden=8, k=2, dtype=torch.float32, device=device)
    assert centroid_logits(w, x[:0], top[:0], t).shape == (0, 6)
    assert centroid_logits(w, x, top[:, :0], t).shape == (2, 0)


def test_bad_inputs_name_the_argument(device):
    w, x, top, t = make_case(6, batch=2, clusters=4, tokens=3, hidden=8, k=2, dtype=torch.float32, device=device)
    bad = [
        ((w[0], x, top, t), r"lm_head must be a 2-D bfloat16/float16/float32 tensor, got 1-D"),
        ((w.long(), x, top, t), r"lm_head must be a 2-D .* got 2-D torch.int64"),
        ((w, x[0], top, t), r"x must be a 2-D"),
        ((w, x, top.float(), t), r"top must be a 2-D int32/int64 tensor, got 2-D torch.float32"),
        ((w, x, [[0, 1]], t), r"top must be a torch.Tensor, got list"),
        ((w, x.double(), top, t), r"x must be a 2-D bfloat16/float16/float32 tensor, got 2-D torch.float64"),
        ((w, x.bfloat16(), top, t), r"x \(torch.bfloat16\) and lm_head \(torch.float32\) dtypes differ"),
        ((w, x[:, :7], top, t), r"x has hidden size 7, lm_head \(12, 8\) has 8"),
        ((w, x, top[:1], t), r"top has 1 rows, x has 2"),
        ((w, x, top, 0), r"tokens_per_cluster must be an int >= 1, got 0"),
        ((w, x, top, 3.0), r"tokens_per_cluster must be an int >= 1, got 3.0"),
        ((w, x, top, 5), r"tokens_per_cluster 5 must divide lm_head's 12 rows"),
        ((w.t().contiguous().t(), x, top, t), r"lm_head's last dimension must be contiguous"),
        ((w, x.t().contiguous().t(), top, t), r"x's last dimension must be contiguous"),
    ]
    if device == "cpu":
        bad.append(((w, x, top.to("meta"), t), r"lm_head, x, top must be on one device, got \['cpu', 'meta'\]"))
    for args, msg in bad:
        with pytest.raises((CentroidHeadError, RuntimeError), match=f"centroid_logits: {msg}"):
            centroid_logits(*args)


@pytest.mark.compile
def test_traces_under_torch_compile_on_cpu():
    """The op traces with fullgraph=True: static shapes, no graph breaks. On a CPU through the twin (Triton's
    interpreter cannot run on fake tensors, twins_on_cpu); the kernel's trace is the GPU tests' (reduce-overhead)."""
    w, x, top, t = make_case(7, batch=3, clusters=5, tokens=6, hidden=40, k=2, dtype=torch.float32, device="cpu")
    want, bound = reference(w, x, top, t)

    def f(w, x, top):
        return centroid_logits(w, x, top, t) * 2

    torch._dynamo.reset()
    with twins_on_cpu():
        out = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)(w, x, top)
    torch._dynamo.reset()
    assert_near(out / 2, want, bound, 0.0, "compiled")


def test_model_head_kernel_matches_twin_head(device):
    """The tiny draft model's head through the kernel (the torch op set; interpreted on CPU) and through the twin
    (the fused op set, sglang's gather): same scores to fp32 rounding, same tokens where the decision is clear."""
    from graphcap.models import FrozenKVDraft
    from graphcap.models.draft_ops import TORCH_OPS
    from graphcap.models.fused_op_set import fused_ops
    from graphcap.spec import load_spec

    spec = load_spec("tiny")
    model = FrozenKVDraft(spec, seed=3, device=device)
    x = torch.randn(5, spec.draft.hidden, generator=torch.Generator().manual_seed(3)).to(device)
    gather = fused_ops(sglang_post_norm=False)
    tok_k, score_k, margin_k = model.head(x, TORCH_OPS)
    tok_t, score_t, margin_t = model.head(x, gather)
    torch.testing.assert_close(score_k, score_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(margin_k, margin_t, rtol=1e-4, atol=1e-4)
    clear = margin_t > 1e-3
    assert torch.equal(tok_k[clear], tok_t[clear])


GEMMA = dict(clusters=2048, tokens=128, hidden=1536, k=32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gemma4_shapes_on_gpu(batch):
    """The Gemma 4 assistant's head (2048 clusters of 128 tokens, hidden 1536, top 32) in bf16, against the
    twin and float64; clusters drawn as topk draws them (distinct per row, shared across rows)."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    c, t, h, k = GEMMA["clusters"], GEMMA["tokens"], GEMMA["hidden"], GEMMA["k"]
    w = (torch.randn(c * t, h, generator=g, device="cuda") / h ** 0.5).bfloat16()
    x = torch.randn(batch, h, generator=g, device="cuda").bfloat16()
    cent = (torch.randn(c, h, generator=g, device="cuda") / h ** 0.5).bfloat16()
    top = (x @ cent.t()).float().topk(k + 1, dim=-1).indices[:, :k]  # a non-contiguous slice, as in the model
    got = centroid_logits(w, x, top, t)
    twin = centroid_logits_torch(w, x, top, t)
    torch.cuda.synchronize()
    assert got.shape == (batch, k * t) and torch.isfinite(got).all()
    rows = w.view(c, t, h)[top].double()  # [B, k, T, H]
    want = torch.einsum("bkth,bh->bkt", rows, x.double()).flatten(1)
    bound = torch.einsum("bkth,bh->bkt", rows.abs(), x.double().abs()).flatten(1)
    assert_near(got, want.cpu(), bound.cpu(), 0.0, "kernel")
    assert_near(got, twin.double().cpu(), bound.cpu(), TWIN_RTOL[torch.bfloat16], "kernel vs twin")


@pytest.mark.gpu
def test_captures_in_a_cuda_graph_and_follows_new_clusters():
    """Captured once, replayed: a graph reads the clusters written into `top` in place, allocates nothing."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64 * 16, 96, generator=g, device="cuda").bfloat16()
    x = torch.randn(4, 96, generator=g, device="cuda").bfloat16()
    top = torch.randint(0, 64, (4, 8), generator=g, device="cuda")
    centroid_logits(w, x, top, 16)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = centroid_logits(w, x, top, 16)
    top.copy_(torch.randint(0, 64, (4, 8), generator=g, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want, bound = reference(w, x, top, 16)
    assert_near(out, want, bound, 0.0, "replay")


@pytest.mark.gpu
def test_torch_compile_reduce_overhead_on_gpu():
    """The op inside an Inductor-compiled, CUDA-graphed function: no cudagraph skips, same logits as eager."""
    from torch._dynamo.utils import counters

    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(32 * 8, 64, generator=g, device="cuda").bfloat16()
    cent = torch.randn(32, 64, generator=g, device="cuda").bfloat16()
    torch._dynamo.mark_static_address(w)
    torch._dynamo.mark_static_address(cent)

    def f(x):
        top = (x @ cent.t()).float().topk(5, dim=-1).indices[:, :4]
        return centroid_logits(w, x, top, 8).topk(2, dim=-1).values

    counters.clear()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    x = torch.randn(3, 64, generator=g, device="cuda").bfloat16()
    for _ in range(3):
        out = compiled(x).clone()
    assert not counters["inductor"]["cudagraph_skips"]
    torch.testing.assert_close(out, f(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sglang_style_head_gathers_with_a_contiguous_index_and_scores_as_the_torch_set(dtype):
    """The fused op set's head (sglang's _apply_centroid_masking: contiguous gather, batched product) against the
    torch set's (graphcap's kernel) and float64: the same candidates, scores within the dtype's rounding, the same
    greedy token where the float64 runner-up is not within it; a strided cluster index (a slice of topk's output)
    gives exactly what a contiguous one does."""
    from graphcap.models.draft_ops import TORCH_OPS
    from graphcap.models.fused_op_set import fused_ops

    clusters, tokens, hidden, k = 16, 12, 40, 5
    w, x, top, t = make_case(7, batch=6, clusters=clusters, tokens=tokens, hidden=hidden, k=k, dtype=dtype, device="cpu")
    w = w.contiguous()  # the model's lm_head: one block, viewed by clusters
    g = torch.Generator().manual_seed(8)
    token_of_cluster = torch.randperm(clusters * tokens, generator=g).view(clusters, tokens)
    assert not top.is_contiguous()
    with twins_on_cpu():
        fused, fused_ids = fused_ops().centroid_head(w, token_of_cluster, x, top)
        fused_c, _ = fused_ops().centroid_head(w, token_of_cluster, x, top.contiguous())
        mine, ids = TORCH_OPS.centroid_head(w, token_of_cluster, x, top)
    assert torch.equal(fused, fused_c) and torch.equal(fused_ids, ids)
    assert torch.equal(ids, token_of_cluster[top].flatten(1)) and fused.dtype == mine.dtype == torch.float32
    want, _ = reference(w, x, top, t)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    for got in (fused, mine):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    top2 = want.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > 4 * tol * want.abs().max()
    assert decided.any()
    assert torch.equal(fused.argmax(1)[decided], mine.argmax(1)[decided])


@pytest.mark.parametrize("config", [(8, 256, 2), (32, 128, 4), (4, 16, 1)])
def test_other_launch_configurations_match_float64(device, config):
    """The kernel at the launch configurations lab/centroid_config.py sweeps (tokens per program, hidden columns
    per iteration, warps): the same logits within fp32 summation error, tokens and hidden not multiples of them."""
    from graphcap.kernels.head.centroid import launch

    case = make_case(sum(config), batch=3, clusters=7, tokens=37, hidden=300, k=4, dtype=torch.bfloat16,
                     device=device)
    want, bound = reference(*case)
    assert_near(launch(*case, *config), want, bound, 0.0, f"kernel at {config}")
