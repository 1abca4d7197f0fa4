"""The sgl_kernel stand-in's Triton kernels for the three ops sglang 0.5.18 takes from sgl_kernel on CUDA -
fast_topk, build_tree_kernel_efficient, verify_tree_greedy (tests/support/sgl_kernel/top_k.py, speculative.py;
loaded here by tests/standin_ops.py, not through the stand-in package) - interpreted on
CPU, native on CUDA, each against its plain-torch twin, against sglang's own implementations where this sglang has
them (0.5.23's Triton versions of the tree ops, `sglang.kernels.ops.speculative.spec_tree`, interpreted too; its
torch fast_topk), and against answers worked out by hand.

Trees come from a draft loop written here the way sglang's builds them (`select_top_k_tokens` then
`organize_draft_results`): random probabilities, scores multiplied down each path, the top D - 1 scores selected
and sorted. graphcap's path - topk 1 chains, 1 to 3 steps, D = steps + 1, batch 1 to 64 - is covered by property
tests; general trees (topk 2 to 4) by fewer examples. Shapes stay small: Triton's interpreter runs every program.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from graphcap.kernels import twins_on_cpu
from sm90 import compile_for_sm90
from standin_ops import speculative as T
from standin_ops import top_k as FT
from standin_ops import run_with_standin

SpecOpError = T.SpecOpError
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SETTINGS = dict(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
without_sglang = pytest.mark.skipif(not HAS_SGLANG, reason="the real sglang package is not installed (make test "
                                                              "installs it)")


def sglang_tree_ops():
    """sglang 0.5.23's own Triton versions of the two tree ops (its XPU path), or None where this sglang lacks them."""
    try:
        from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton
    except ImportError:
        return None
    return sgl_build_tree_kernel_triton, verify_tree_greedy_triton


# ---------------------------------------------------------------------------------------------------------------
# draft trees, as sglang's draft loop builds them


def draft_tree(g: torch.Generator, bs: int, topk: int, steps: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent_list, selected_index) of a random draft loop: per step each beam's top-k children, scores multiplied
    down the path (strictly decreasing: every selected node's parent is selected), the top d - 1 overall, sorted."""
    p = torch.rand(bs, topk, generator=g, dtype=torch.float64).sort(-1, descending=True).values * 0.9 + 0.05
    scores, parents, beam = [p], [torch.arange(-1, topk).expand(bs, -1)], p
    for i in range(1, steps):
        child = torch.rand(bs, topk, topk, generator=g, dtype=torch.float64).sort(-1, descending=True).values
        expand = (beam[:, :, None] * (child * 0.9 + 0.05)).flatten(1)
        beam, idx = expand.topk(topk, dim=-1)
        scores.append(expand)
        parents.append(idx + topk * topk * (i - 1) + topk)
    selected = torch.cat(scores, 1).topk(d - 1, dim=-1).indices.sort(-1).values
    parent_list = torch.cat(parents[:-1], 1) if steps > 1 else torch.empty(bs, 0, dtype=torch.int64)
    return parent_list.contiguous(), selected


def tree_buffers(seq_lens: torch.Tensor, d: int, mode: int, device: str) -> dict[str, torch.Tensor]:
    """The op's outputs as sglang allocates them: the mask filled (True; zeros when packed), the links -1."""
    bs = seq_lens.shape[0]
    if mode == 0:
        mask = torch.full((int(seq_lens.sum()) * d + d * d * bs,), True, device=device)
    elif mode == 1:
        mask = torch.full((d * d * bs,), True, device=device)
    else:
        packed = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[T._mask_bytes(d)]  # sglang's choice of dtype
        mask = torch.zeros((d * bs,), dtype=packed, device=device)
    links = torch.full((3, bs, d), -1, dtype=torch.int64, device=device)
    return dict(tree_mask=mask, positions=torch.empty(bs * d, dtype=torch.int64, device=device),
                retrive_index=links[0], retrive_next_token=links[1], retrive_next_sibling=links[2])


def build(fn, parent_list, selected, seq_lens, topk, steps, d, mode, device):
    out = tree_buffers(seq_lens, d, mode, device)
    fn(parent_list.to(device), selected.to(device), seq_lens.to(device), out["tree_mask"], out["positions"],
       out["retrive_index"], out["retrive_next_token"], out["retrive_next_sibling"], topk, steps, d, mode)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name in got:
        assert torch.equal(got[name].cpu(), want[name].cpu()), f"{what}: {name}\n{got[name]}\n{want[name]}"


def check_build(g, bs, topk, steps, d, mode, device, shuffle=False) -> dict[str, torch.Tensor]:
    """Kernel against twin (and sglang's Triton version where it has the mode); returns the kernel's outputs."""
    parent_list, selected = draft_tree(g, bs, topk, steps, d)
    if shuffle:  # the ops do not need the selection sorted
        selected = selected[:, torch.randperm(d - 1, generator=g)].contiguous()
    seq_lens = torch.randint(1, 40, (bs,), generator=g)
    got = build(T.build_tree_kernel_efficient, parent_list, selected, seq_lens, topk, steps, d, mode, device)
    assert_same(got, build(T.build_tree_kernel_efficient_torch, parent_list, selected, seq_lens, topk, steps, d,
                           mode, device), "kernel vs twin")
    sg = sglang_tree_ops()
    if sg is not None and mode != 2:  # sglang's Triton version has no bit-packed mask
        assert_same(got, build(sg[0], parent_list, selected, seq_lens, topk, steps, d, mode, device),
                    "kernel vs sglang's Triton build")
    return got


# ---------------------------------------------------------------------------------------------------------------
# build_tree_kernel_efficient


def test_build_tree_by_hand(device):
    """topk 2, 2 steps, 4 tokens: score indices 0, 1 are the root's children, 2-3 and 4-5 those of indices 0 and 1.
    Request 0 selects [0, 1, 3] (seq_len 3): node 3 under node 1. Request 1 selects [1, 4, 5] (seq_len 2): nodes 2
    and 3 under node 1."""
    parent_list = torch.tensor([[-1, 0, 1], [-1, 0, 1]])
    selected = torch.tensor([[0, 1, 3], [1, 4, 5]])
    seq_lens = torch.tensor([3, 2])
    rows = [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]]
    for fn in (T.build_tree_kernel_efficient, T.build_tree_kernel_efficient_torch):
        for mode in (0, 1, 2):
            out = build(fn, parent_list, selected, seq_lens, 2, 2, 4, mode, device)
            assert out["positions"].tolist() == [3, 4, 4, 5, 2, 3, 4, 4]
            assert out["retrive_index"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
            assert out["retrive_next_token"].tolist() == [[1, 3, -1, -1], [1, 2, -1, -1]]
            assert out["retrive_next_sibling"].tolist() == [[-1, 2, -1, -1], [-1, -1, 3, -1]]
            mask = out["tree_mask"].cpu()
            if mode == 2:
                assert mask.tolist() == [1, 3, 5, 11, 1, 3, 7, 11]
                continue
            for b, (start, width) in enumerate(((0, 7), (16 + 12, 6)) if mode == 0 else ((0, 4), (16, 4))):
                full = mask[start:start + 4 * width].view(4, width)
                assert full[:, width - 4:].int().tolist() == rows[b], (fn, mode, b)
                assert full[:, :width - 4].all(), "the prefix columns are the caller's fill"


@settings(**dict(SETTINGS, max_examples=6))
@given(bs=st.integers(1, 64), steps=st.integers(1, 3), mode=st.sampled_from([0, 1, 2]), seed=st.integers(0, 2**16))
@example(bs=64, steps=3, mode=0, seed=1)
@example(bs=1, steps=1, mode=0, seed=2)
def test_build_tree_chains(device, bs, steps, mode, seed):
    """graphcap's path: topk 1, D = steps + 1 - a chain, positions seq_len + i, each node's next token i + 1."""
    g = torch.Generator().manual_seed(seed)
    d = steps + 1
    out = check_build(g, bs, 1, steps, d, mode, device)
    ar = torch.arange(d)
    assert torch.equal(out["retrive_next_token"].cpu(), torch.where(ar < d - 1, ar + 1, -1).expand(bs, d))
    assert (out["retrive_next_sibling"] == -1).all()
    pos = out["positions"].cpu().view(bs, d)
    assert torch.equal(pos - pos[:, :1], ar.expand(bs, d))


@settings(**dict(SETTINGS, max_examples=8))
@given(bs=st.integers(1, 4), topk=st.integers(2, 4), steps=st.integers(1, 4), mode=st.sampled_from([0, 1, 2]),
       frac=st.floats(0.0, 1.0), shuffle=st.booleans(), seed=st.integers(0, 2**16))
def test_build_tree_general(device, bs, topk, steps, mode, frac, shuffle, seed):
    """topk > 1: any number of tokens the draft offers (up to 32 where packed), in sglang's order or shuffled."""
    most = topk + (steps - 1) * topk * topk + 1
    d = 2 + round(frac * (min(most, 32 if mode == 2 else 24) - 2))
    check_build(torch.Generator().manual_seed(seed), bs, topk, steps, d, mode, device, shuffle)


def test_build_tree_single_token_and_empty_batch(device):
    """D = 1 (only the root; selected_index [bs, 0]) and bs = 0 launch nothing wrong."""
    g = torch.Generator().manual_seed(3)
    out = check_build(g, 3, 1, 1, 1, 0, device)
    assert out["retrive_next_token"].tolist() == [[-1]] * 3
    empty = tree_buffers(torch.empty(0, dtype=torch.int64), 4, 1, device)
    T.build_tree_kernel_efficient(torch.empty(0, 3, dtype=torch.int64, device=device),
                                  torch.empty(0, 3, dtype=torch.int64, device=device),
                                  torch.empty(0, dtype=torch.int64, device=device), *empty.values(), 2, 2, 4, 1)


def test_build_tree_orphan(device):
    """A node whose parent was not selected (sgl_kernel warns of an invalid tree) gets no link, and its row and
    position stop at it - as sglang's own Triton version."""
    parent_list = torch.tensor([[-1, 0, 1]])
    selected = torch.tensor([[1, 2, 3]])  # 2 and 3 are children of score index 0, which is not selected
    seq_lens = torch.tensor([5])
    for mode in (0, 1):
        got = build(T.build_tree_kernel_efficient, parent_list, selected, seq_lens, 2, 2, 4, mode, device)
        assert got["positions"].tolist() == [5, 6, 6, 6]
        assert got["retrive_next_token"].tolist() == [[1, -1, -1, -1]]
        assert_same(got, build(T.build_tree_kernel_efficient_torch, parent_list, selected, seq_lens, 2, 2, 4, mode,
                               device), "orphan: kernel vs twin")
        if sglang_tree_ops() is not None:
            assert_same(got, build(sglang_tree_ops()[0], parent_list, selected, seq_lens, 2, 2, 4, mode, device),
                        "orphan: kernel vs sglang")


# ---------------------------------------------------------------------------------------------------------------
# verify_tree_greedy


def verify(fn, tree, candidates, target, s, device):
    bs, d = candidates.shape
    out = dict(predicts=torch.zeros(bs * d, dtype=torch.int32, device=device),
               accept_index=torch.full((bs, s), -1, dtype=torch.int32, device=device),
               accept_token_num=torch.full((bs,), 7, dtype=torch.int32, device=device))
    fn(out["predicts"], out["accept_index"], out["accept_token_num"], candidates.to(device),
       tree["retrive_index"], tree["retrive_next_token"], tree["retrive_next_sibling"], target.to(device))
    return out


def random_tree(g, bs, topk, steps, d, device, fn=T.build_tree_kernel_efficient_torch) -> dict[str, torch.Tensor]:
    """A draft tree's links (FULL_MASK), built by the twin unless `fn` says (the kernel's builds are tested above)."""
    parent_list, selected = draft_tree(g, bs, topk, steps, d)
    return build(fn, parent_list, selected, torch.randint(1, 9, (bs,), generator=g), topk, steps, d, 0, device)


def check_verify(tree, candidates, target, s, device) -> dict[str, torch.Tensor]:
    got = verify(T.verify_tree_greedy, tree, candidates, target, s, device)
    assert_same(got, verify(T.verify_tree_greedy_torch, tree, candidates, target, s, device), "kernel vs twin")
    sg = sglang_tree_ops()
    if sg is not None:
        assert_same(got, verify(sg[1], tree, candidates, target, s, device), "kernel vs sglang's Triton verify")
    return got


def test_verify_by_hand(device):
    """The hand-built trees of test_build_tree_by_hand. Request 0: the root's target 21 is node 2's token (node 1,
    first in the list, is 20), node 2 has no child: 1 accepted. Request 1: 50 is node 1; node 1's target 61 is its
    second child (node 3): 2 accepted, the most 3 levels allow."""
    tree = build(T.build_tree_kernel_efficient_torch, torch.tensor([[-1, 0, 1]] * 2),
                 torch.tensor([[0, 1, 3], [1, 4, 5]]),
                 torch.tensor([3, 2]), 2, 2, 4, 0, device)
    candidates = torch.tensor([[10, 20, 21, 30], [11, 50, 60, 61]])
    target = torch.tensor([[21, 30, 8, 40], [50, 61, 9, 12]])
    for fn in (T.verify_tree_greedy, T.verify_tree_greedy_torch):
        out = verify(fn, tree, candidates, target, 3, device)
        assert out["accept_token_num"].tolist() == [1, 2]
        assert out["accept_index"].tolist() == [[0, 2, -1], [4, 5, 7]]
        assert out["predicts"].tolist() == [21, 0, 8, 0, 50, 61, 0, 12]


@settings(**dict(SETTINGS, max_examples=6))
@given(bs=st.integers(1, 64), steps=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(bs=64, steps=3, seed=1)
@example(bs=1, steps=1, seed=2)
def test_verify_chains(device, bs, steps, seed):
    """graphcap's path: a chain whose first `accept` drafts equal the target's tokens (planted, per request) accepts
    exactly those; predicts holds the target's tokens along them and the bonus after."""
    g = torch.Generator().manual_seed(seed)
    d = steps + 1
    tree = random_tree(g, bs, 1, steps, d, device)
    candidates = torch.randint(1000, 2000, (bs, d), generator=g)
    target = torch.randint(2000, 3000, (bs, d), generator=g)  # never a candidate
    accept = torch.randint(0, d, (bs,), generator=g)
    for b in range(bs):
        target[b, :accept[b]] = candidates[b, 1:accept[b] + 1]
    out = check_verify(tree, candidates, target, d, device)
    assert torch.equal(out["accept_token_num"].cpu(), accept.int())
    for b in range(bs):
        a = int(accept[b])
        assert out["accept_index"][b].tolist() == [b * d + k for k in range(a + 1)] + [-1] * (d - a - 1)
        assert out["predicts"].view(bs, d)[b].tolist() == target[b, :a + 1].tolist() + [0] * (d - a - 1)


@settings(**dict(SETTINGS, max_examples=8))
@given(bs=st.integers(1, 4), topk=st.integers(2, 4), steps=st.integers(1, 4), frac=st.floats(0.0, 1.0),
       vocab=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_verify_general(device, bs, topk, steps, frac, vocab, seed):
    """topk > 1: tokens from a vocabulary of 2 to 4, so paths accept through later siblings and stop at any level."""
    g = torch.Generator().manual_seed(seed)
    d = 2 + round(frac * (min(topk + (steps - 1) * topk * topk + 1, 24) - 2))
    tree = random_tree(g, bs, topk, steps, d, device)
    candidates = torch.randint(0, vocab, (bs, d), generator=g)
    check_verify(tree, candidates, torch.randint(0, vocab, (bs, d), generator=g), steps + 1, device)


def test_verify_one_level_and_long_accept_row(device):
    """accept_index of width 1 (nothing to accept) and wider than any path."""
    g = torch.Generator().manual_seed(5)
    tree = build(T.build_tree_kernel_efficient_torch, *draft_tree(g, 2, 1, 3, 4), torch.tensor([4, 6]), 1, 3, 4, 0,
                 device)
    candidates = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    target = torch.tensor([[2, 3, 4, 5], [2, 3, 9, 9]])
    assert check_verify(tree, candidates, target, 1, device)["accept_token_num"].tolist() == [0, 0]
    assert check_verify(tree, candidates, target, 7, device)["accept_token_num"].tolist() == [3, 2]


# ---------------------------------------------------------------------------------------------------------------
# fast_topk


def rows(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, pool: int | None, nans: int,
         zeros: bool) -> torch.Tensor:
    """Random normals (never 0 unless planted); pool: entries drawn from that many values (ties); nans: that many NaN
    per row; zeros: +0.0 and -0.0 planted (equal: torch.max takes the first)."""
    x = torch.randn(shape, generator=g)
    if pool is not None:
        x = torch.randn(pool, generator=g)[torch.randint(0, pool, shape, generator=g)]
    x = x.to(dtype).view(-1, shape[-1])
    for r in range(x.shape[0]):
        x[r, torch.randperm(shape[-1], generator=g)[:nans]] = math.nan
    if zeros:
        x.abs_().neg_()  # every entry <= 0, so the zeros are the maximum
        x[:, torch.randperm(shape[-1], generator=g)[:2]] = torch.tensor([0.0, -0.0], dtype=dtype)[:min(2, shape[-1])]
    return x.view(shape)


BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = BITS[a.dtype]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(bits), b.cpu().view(bits))


def same_max(got: tuple[torch.Tensor, torch.Tensor], want, x: torch.Tensor) -> bool:
    """The kernel's top-1 against torch.max's (keepdim, last dim): the same index; the value is the row's own entry
    there, bit for bit, which is torch.max's value except a NaN's payload (torch's CUDA reduce hands back 0x7fff for a
    bf16 NaN found after a number). The gather runs on the bits: torch's bf16 gather on a CPU rewrites NaNs too."""
    own, nan = x.view(BITS[x.dtype]).gather(-1, want.indices).view(x.dtype), want.values.isnan()
    return (torch.equal(got[1], want.indices) and same_bits(got[0], own) and torch.equal(got[0].isnan(), nan)
            and same_bits(got[0][~nan], want.values[~nan]))


@settings(**dict(SETTINGS, max_examples=25))
@given(batch=st.integers(0, 9), n=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                             torch.float16]),
       pool=st.sampled_from([None, 2, 5]), nans=st.sampled_from([0, 0, 1, 3]), zeros=st.booleans(),
       split=st.sampled_from([None, 16, 64]), seed=st.integers(0, 2**16))
@example(batch=1, n=2, dtype=torch.bfloat16, pool=None, nans=1, zeros=False, split=None, seed=0)  # NaN after a number
def test_fast_topk_top1_is_torch_max(device, batch, n, dtype, pool, nans, zeros, split, seed):
    """topk 1, the kernel: torch.max's (keepdim) index exactly and its value's bits (same_max: a NaN's payload is the
    row's own) - first index on ties, the first NaN, +0.0 and -0.0 equal; `split` forces short blocks, so rows run over
    several programs and the last one reduces."""
    x = rows(torch.Generator().manual_seed(seed), (batch, n), dtype, pool, min(nans, n), zeros).to(device)
    want = torch.max(x, dim=-1, keepdim=True)
    got = FT.fast_topk(x, 1, -1) if split is None else FT._top1_launch(x, split, 2)
    assert same_max(got, want, x)
    assert got[1].dtype == torch.int64 and got[0].shape == (batch, 1)


def test_fast_topk_shapes_dims_and_strides(device):
    """Any dim of a 3-D tensor, a row stride and a column stride != 1, a vocabulary-long row split over programs."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 40, 6, generator=g).to(device)
    for dim in (0, 1, 2, -1, -2):
        got, want = FT.fast_topk(x, 1, dim), torch.max(x, dim=dim, keepdim=True)
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices), dim
        assert got[0].is_contiguous()
    strided = torch.randn(5, 70, generator=g).to(device)[:, 3:60]
    assert torch.equal(FT.fast_topk(strided.t(), 1, 0)[1], torch.max(strided.t(), 0, keepdim=True).indices)
    long = torch.randn(2, 3 * FT.MAX_BLOCK + 5, generator=g).to(device)
    long[1, -1] = 100.0
    assert FT.fast_topk(long, 1, -1)[1].tolist() == [[int(long[0].argmax())], [long.shape[1] - 1]]


def test_fast_topk_other_cases_are_sgl_kernels_code(device):
    """topk > 1 is torch.topk, as in sgl_kernel; so are dtypes the kernel does not take."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 16, generator=g).to(device)
    got, want = FT.fast_topk(x, 3, -1), torch.topk(x, 3, dim=-1)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
    ints = torch.randint(0, 50, (3, 9), generator=g).to(device)
    assert torch.equal(FT.fast_topk(ints, 1, -1)[1], torch.max(ints, -1, keepdim=True).indices)


def test_fast_topk_traces_like_sglangs_draft_step():
    """The call in sglang's `_select_top_k_tokens_later` (torch.compile, dynamic=True, topk an int argument) traces
    in one graph (the twins here: Inductor cannot lower interpreted kernels; the GPU test compiles the kernel)."""
    @torch.compile(dynamic=True, backend="aot_eager", fullgraph=True)
    def later(topk_p, scores, topk):
        return FT.fast_topk((scores.unsqueeze(2) * topk_p.view(-1, topk, topk)).flatten(start_dim=1), topk, dim=-1)

    g = torch.Generator().manual_seed(6)
    with twins_on_cpu():
        for b, topk in ((3, 1), (5, 1), (4, 2)):
            s, p = torch.rand(b, topk, generator=g), torch.rand(b * topk, topk, generator=g)
            got, want = later(p, s, topk), FT.fast_topk_torch((s.unsqueeze(2) * p.view(-1, topk, topk)).flatten(1),
                                                             topk, -1)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.sglang
@without_sglang
def test_fast_topk_is_sglangs_fast_topk(device):
    """sglang's own fast_topk (srt/utils/common.py, the code sgl_kernel ships) gives the same results."""
    from sglang.srt.utils.common import fast_topk as sglang_fast_topk

    g = torch.Generator().manual_seed(7)
    x = rows(g, (6, 300), torch.float32, 7, 1, False).to(device)
    for k in (1, 2):
        got, want = FT.fast_topk(x, k, -1), sglang_fast_topk(x, k, -1)
        assert torch.equal(got[1], want[1]) and same_bits(got[0], want[0])


# ---------------------------------------------------------------------------------------------------------------
# bad input


def _good_build(d: int = 4, mode: int = 1) -> list:
    out = tree_buffers(torch.tensor([3, 2]), d, mode, "cpu")
    return [torch.tensor([[-1, 0, 1]] * 2), torch.zeros(2, d - 1, dtype=torch.int64), torch.tensor([3, 2]),
            *out.values(), 2, 2, d, mode]


def _with(i: int, v) -> list:
    a = _good_build()
    a[i] = v
    return a


BAD_BUILD = [
    (_with(0, torch.zeros(2, 4, dtype=torch.int64)), SpecOpError, "parent_list must have topk \\* \\(depth - 1\\)"),
    (_with(1, torch.zeros(2, 3, dtype=torch.int32)), SpecOpError, "selected_index must be a tensor of dtype int64"),
    (_with(2, torch.tensor([3.0, 2.0])), SpecOpError, "verified_seq_len must be a tensor of dtype int64"),
    (_with(4, torch.empty(7, dtype=torch.int64)), SpecOpError, "positions must be .* int64 and shape \\(8,\\)"),
    (_with(6, torch.full((2, 5), -1)), SpecOpError, "retrive_next_token must be .* int64 and shape \\(2, 4\\)"),
    (_with(3, torch.ones(31, dtype=torch.bool)), SpecOpError, "tree_mask holds 31 bytes, QLEN_ONLY writes 32"),
    (_with(3, torch.ones(8, 8, dtype=torch.bool)), SpecOpError, "tree_mask must be a contiguous 1-D"),
    (_with(8, 0), SpecOpError, "topk must be an int >= 1"),
    (_with(11, 3), SpecOpError, "tree_mask_mode must be one of"),
    (_good_build(33, 2), NotImplementedError, "QLEN_ONLY_BITPACKING holds at most 32 draft tokens"),
    (_good_build(T.MAX_TREE_DRAFT_TOKENS + 1, 1), NotImplementedError,
     f"^build_tree_kernel_efficient: .* at most {T.MAX_TREE_DRAFT_TOKENS} draft tokens, got draft_token_num"),
]


@pytest.mark.parametrize("case", range(len(BAD_BUILD)))
def test_build_tree_refuses_bad_input(case):
    args, err, msg = BAD_BUILD[case]
    for fn in (T.build_tree_kernel_efficient, T.build_tree_kernel_efficient_torch):
        with pytest.raises(err, match=msg):
            fn(*args)


def _good_verify() -> list:
    i64 = torch.zeros(2, 4, dtype=torch.int64)
    return [torch.zeros(8, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            i64, i64, i64, i64, i64]


@pytest.mark.parametrize("i,v,msg", [
    (0, torch.zeros(8, dtype=torch.int64), "predicts must be a tensor of dtype int32 and shape \\(8,\\)"),
    (1, torch.zeros(2, 3, dtype=torch.int64), "accept_index must be a tensor of dtype int32"),
    (2, torch.zeros(3, dtype=torch.int32), "accept_token_num must be a tensor of dtype int32 and shape \\(2,\\)"),
    (4, torch.zeros(2, 5, dtype=torch.int64), "retrive_index must be a tensor of dtype int64 and shape \\(2, 4\\)"),
    (7, torch.zeros(2, 4, dtype=torch.int32), "target_predict must be a tensor of dtype int64"),
    (3, torch.zeros(8, dtype=torch.int64), "candidates must be a 2-D int64 tensor"),
])
def test_verify_refuses_bad_input(i, v, msg):
    args = _good_verify()
    args[i] = v
    for fn in (T.verify_tree_greedy, T.verify_tree_greedy_torch):
        with pytest.raises(SpecOpError, match="^verify_tree_greedy: " + msg):
            fn(*args)


@pytest.mark.parametrize("args,msg", [
    ((torch.ones(3, 4), 0, -1), "topk must be an int >= 1"),
    ((torch.ones(3, 4), 5, -1), "topk \\(5\\) exceeds values' size along dim -1 \\(4\\)"),
    ((torch.ones(3, 4), 1, 2), "dim 2 is out of range for a 2-D tensor"),
    (([1.0], 1, 0), "values must be a torch.Tensor"),
])
def test_fast_topk_refuses_bad_input(args, msg):
    with pytest.raises(FT.TopkError, match="^fast_topk: " + msg):
        FT.fast_topk(*args)


# ---------------------------------------------------------------------------------------------------------------
# the stand-in, sm_80 / sm_90 compiles, GPU


def test_standin_exports_the_ops_with_sglang_0518s_call_pattern():
    """tests/support/sgl_kernel re-exports the three ops under sgl_kernel's names, called as sglang 0.5.18 calls them
    (eagle_utils.py: keyword `retrive_*`, its own buffers; spec_utils.py: fast_topk(probs, topk, dim=-1))."""
    out = run_with_standin("""
        import torch
        import sgl_kernel
        from sgl_kernel import speculative, top_k

        assert sgl_kernel.fast_topk is top_k.fast_topk
        assert sgl_kernel.build_tree_kernel_efficient is speculative.build_tree_kernel_efficient
        assert sgl_kernel.verify_tree_greedy is speculative.verify_tree_greedy
        bs, steps, d = 2, 2, 3
        seq_lens = torch.tensor([4, 6])
        tree_mask = torch.full((int(seq_lens.sum()) * d + d * d * bs,), True)
        retrieve_index, retrieve_next_token, retrieve_next_sibling = torch.full((3, bs, d), -1, dtype=torch.long)
        positions = torch.empty((bs * d,), dtype=torch.long)
        sgl_kernel.build_tree_kernel_efficient(torch.tensor([[-1, 0]] * bs), torch.tensor([[0, 1]] * bs), seq_lens,
                                               tree_mask, positions, retrieve_index, retrieve_next_token,
                                               retrieve_next_sibling, 1, steps, d, 0)
        assert positions.tolist() == [4, 5, 6, 6, 7, 8]
        predict = torch.zeros((bs * d,), dtype=torch.int32)
        accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
        num_correct_drafts = torch.empty((bs,), dtype=torch.int32)
        candidates = torch.tensor([[5, 6, 7], [5, 6, 7]])
        sgl_kernel.verify_tree_greedy(predicts=predict, accept_index=accept_index, accept_token_num=num_correct_drafts,
                                      candidates=candidates, retrive_index=retrieve_index,
                                      retrive_next_token=retrieve_next_token,
                                      retrive_next_sibling=retrieve_next_sibling,
                                      target_predict=torch.tensor([[6, 7, 8], [6, 1, 2]]))
        assert num_correct_drafts.tolist() == [2, 1] and accept_index.tolist() == [[0, 1, 2], [3, 4, -1]]
        probs = torch.softmax(torch.randn(3, 50), dim=-1)
        topk_p, topk_index = sgl_kernel.fast_topk(probs, 1, dim=-1)
        assert torch.equal(topk_index, probs.argmax(-1, keepdim=True))
        print("spec ops ok")
    """)
    assert "spec ops ok" in out


# The kernels at every block size the ops launch (the tree's D up to MAX_TREE_DRAFT_TOKENS; the top-1 in one block
# and split), in the form of tests/kernels/test_sm80.py's KERNEL_SCRIPTS.
SPEC_TREE_OPS_SCRIPT = """
from sgl_kernel import speculative as T

n = 0
i64 = ("parent_list", "selected", "seq_lens", "positions", "r_index", "r_next", "r_sib", "candidates", "target")
for mode, blocks in ((0, (2, 4, 16, 64)), (1, (4, 64)), (2, (4, 32))):
    for block in blocks:
        types = dict({k: "*i64" for k in i64}, mask="*u8")
        compile(T._build_tree_kernel, types, dict(MODE=mode, NBYTES=T._mask_bytes(block), BLOCK_D=block,
                                                  BLOCK_B=256), T._warps(block))
        n += 1
types = dict({k: "*i64" for k in i64}, predicts="*i32", accept_index="*i32", accept_num="*i32")
compile(T._verify_greedy_kernel, types, {}, 1)
n += 1
print("compiled", n)
"""
FAST_TOPK_SCRIPT = """
from sgl_kernel import top_k as F

n = 0
for dtype in ("*fp32", "*bf16", "*fp16"):
    for block, split in ((16, False), (F.MAX_BLOCK, True)):
        types = dict(x=dtype, values=dtype, indices="*i64", part_key="*i32", part_idx="*i32", tickets="*i32")
        compile(F._top1_kernel, types, dict(BLOCK=block, SPLIT=split, RBLOCK=64), max(1, min(8, block // 512)))
        n += 1
print("compiled", n)
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The three kernels compiled for sm_90 (tests/sm90.py), no register spilled: what the interpreter cannot check."""
    out = compile_for_sm90(SPEC_TREE_OPS_SCRIPT, tmp_path)
    assert "compiled 9" in out and "spilled" not in out, out
    out = compile_for_sm90(FAST_TOPK_SCRIPT, tmp_path)
    assert "compiled 6" in out and "spilled" not in out, out


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_topk_vocabulary_rows_on_gpu(batch, dtype):
    """Gemma 4's vocabulary (262144) split over programs, bf16 ties included: torch.max's bits and indices; captured
    in a CUDA graph and replayed on new rows; and under Inductor with dynamic shapes, as sglang compiles its call."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.softmax(torch.randn(batch, 262144, generator=g, device="cuda"), -1).to(dtype)
    want = torch.max(x, -1, keepdim=True)
    got = FT.fast_topk(x, 1, -1)
    assert same_bits(got[0], want.values) and torch.equal(got[1], want.indices)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = FT.fast_topk(x, 1, -1)
    x.copy_(torch.softmax(torch.randn(batch, 262144, generator=g, device="cuda"), -1).to(dtype))
    graph.replay()
    assert torch.equal(captured[1], torch.max(x, -1, keepdim=True).indices)
    compiled = torch.compile(lambda p, s: FT.fast_topk((s.unsqueeze(2) * p.view(-1, 1, 1)).flatten(1), 1, dim=-1),
                             dynamic=True)
    for b in (batch, batch + 3):
        p, s = torch.rand(b, 1, device="cuda"), torch.rand(b, 1, device="cuda")
        assert torch.equal(compiled(p, s)[1], torch.zeros(b, 1, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("topk,steps", [(1, 1), (1, 2), (1, 3), (4, 4)])
def test_tree_ops_on_gpu(topk, steps):
    """The tree kernels on CUDA against the twins (run on CPU), at batch 64."""
    g = torch.Generator().manual_seed(steps)
    d = steps + 1 if topk == 1 else 16
    for mode in (0, 1, 2):
        check_build(g, 64, topk, steps, d, mode, "cuda")
    tree = random_tree(g, 64, topk, steps, d, "cuda", T.build_tree_kernel_efficient)
    check_verify(tree, torch.randint(0, 3, (64, d), generator=g), torch.randint(0, 3, (64, d), generator=g),
                 steps + 1, "cuda")
