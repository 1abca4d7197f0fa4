"""candidate_greedy (the Triton kernel, interpreted on CPU / native on CUDA, and its plain-torch twin) against the pick
sglang's head implies, rebuilt here: each row's candidates scattered into a full-vocabulary row holding the mask
value elsewhere, then torch's max over that row (the first index among equal maxima: the smallest token id).

Inputs are random normals (bf16 rounding plants natural ties; exact ties are planted too), token orderings are random
permutations of the vocabulary, cluster choices random and distinct per row, rows small enough for the interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.kernels import twins_on_cpu
from graphcap.kernels.head.candidate_pick import (NO_TOKEN, CandidatePickError, candidate_greedy,
                                             candidate_greedy_torch)
from tiers import examples

SETTINGS = dict(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def make_head(seed: int, *, rows: int, clusters: int, k: int, per: int, dtype: torch.dtype, ties: int = 0,
              nan_rows: int = 0, index_dtype: torch.dtype = torch.int64):
    """Random candidates: values [rows, k * per], top [rows, k] (distinct clusters per row), token_ordering [C * per]
    (a permutation of the vocabulary). `ties`: rows whose top value is copied to another candidate; `nan_rows`:
    rows with one NaN candidate."""
    g = torch.Generator().manual_seed(seed)
    top = torch.stack([torch.randperm(clusters, generator=g)[:k] for _ in range(rows)]).to(index_dtype)
    ordering = torch.randperm(clusters * per, generator=g).to(index_dtype)
    values = (torch.randn(rows, k * per, generator=g) * 4).to(dtype)
    for r in range(min(ties, rows)):
        values[r, int(torch.randint(0, k * per, (1,), generator=g))] = values[r].max()
    for r in range(min(nan_rows, rows)):
        values[rows - 1 - r, int(torch.randint(0, k * per, (1,), generator=g))] = math.nan
    return values, top, ordering


def full_row_pick(values: torch.Tensor, top: torch.Tensor, ordering: torch.Tensor,
                  per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What sglang's head and the loop's full-row pick give: scatter into a vocabulary row of mask values, max."""
    rows = values.shape[0]
    ids = ordering.long().view(-1, per)[top.long()].view(rows, -1)
    full = torch.full((rows, ordering.shape[0]), torch.finfo(values.dtype).min / 2, dtype=values.dtype)
    full.scatter_(1, ids, values)
    best, token = full.max(dim=-1)
    return token, best.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(**SETTINGS)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), clusters=st.integers(1, 24), k_frac=st.floats(0, 1),
       per=st.sampled_from([1, 3, 8, 16]), ties=st.integers(0, 3), nan_rows=st.integers(0, 2),
       index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_kernel_and_twin_are_the_full_rows_pick(device, dtype, seed, rows, clusters, k_frac, per, ties, nan_rows,
                                                index_dtype):
    """The same token and logit as the full row's max on rows without NaN; on a row with a NaN, NaN and the
    smallest id among all its candidates (the twin's rule; the full row's max gives its first NaN's id)."""
    k = max(1, round(k_frac * clusters))
    values, top, ordering = make_head(seed, rows=rows, clusters=clusters, k=k, per=per, dtype=dtype, ties=ties,
                                      nan_rows=nan_rows, index_dtype=index_dtype)
    want_tok, want_logit = full_row_pick(values, top, ordering, per)
    ids = ordering.long().view(-1, per)[top.long()].view(rows, -1)
    has_nan = values.isnan().any(-1)
    want_tok = torch.where(has_nan, ids.amin(-1), want_tok)
    with twins_on_cpu():
        twin = candidate_greedy_torch(values, top, ordering, per)
    got = candidate_greedy(values.to(device), top.to(device), ordering.to(device), per)
    for tok, logit in (twin, got):
        assert tok.dtype == torch.int64 and logit.dtype == torch.float32 and tok.shape == logit.shape == (rows,)
        assert torch.equal(tok.cpu(), want_tok)
        torch.testing.assert_close(logit.cpu(), want_logit.masked_fill(has_nan, math.nan), rtol=0, atol=0,
                                   equal_nan=True)


def test_every_tie_takes_the_smallest_token_id(device):
    """All candidates equal (and all -inf): the smallest id of the row wins, wherever it sits."""
    per, clusters = 4, 6
    ordering = torch.tensor([17, 3, 22, 9, 0, 5, 11, 2, 8, 21, 14, 1, 7, 19, 4, 13, 6, 23, 10, 16, 12, 18, 20, 15])
    top = torch.tensor([[5, 1, 3], [4, 2, 0]])
    for fill in (1.5, -math.inf):
        values = torch.full((2, 3 * per), fill, dtype=torch.bfloat16)
        tok, logit = candidate_greedy(values.to(device), top.to(device), ordering.to(device), per)
        ids = ordering.view(clusters, per)[top].view(2, -1)
        assert tok.cpu().tolist() == ids.amin(-1).tolist() == [0, 1]
        assert logit.cpu().tolist() == [fill, fill]


def test_clusters_out_of_range_are_never_read(device):
    """Cluster ids outside [0, C) take no part in the pick (the kernel reads no id for them); a row of nothing but
    bad clusters returns NO_TOKEN. Only the kernel is checked: the twin's gather raises for such ids."""
    per = 2
    ordering = torch.tensor([7, 4, 6, 1, 0, 3, 5, 2])  # 4 clusters
    top = torch.tensor([[1, 9], [-3, 2], [4, -1]])
    values = torch.tensor([[1.0, 0.5, 3.0, 2.0], [5.0, 5.0, 5.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    tok, logit = candidate_greedy(values.to(device), top.to(device), ordering.to(device), per)
    # row 0: the max (3.0) sits in cluster 9, which is skipped: nothing tied is valid
    # row 1: the 5.0s in cluster -3 are skipped; cluster 2's first token (id 0) ties at 5.0
    assert tok.cpu().tolist() == [NO_TOKEN, 0, NO_TOKEN]
    assert logit.cpu().tolist() == [3.0, 5.0, 2.0]


def test_strided_rows_and_one_candidate(device):
    """values with a row stride beyond k * T (a view), and k * T = 1."""
    values, top, ordering = make_head(5, rows=3, clusters=9, k=4, per=3, dtype=torch.bfloat16, ties=2)
    wide = torch.randn(3, 20).to(torch.bfloat16)
    wide[:, :12] = values
    view = wide[:, :12]
    assert not view.is_contiguous()
    want = full_row_pick(values, top, ordering, 3)
    got = candidate_greedy(view.to(device), top.to(device), ordering.to(device), 3)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    one = candidate_greedy(torch.tensor([[0.25]], device=device), torch.tensor([[0]], device=device),
                           torch.tensor([42], device=device), 1)
    assert one[0].cpu().tolist() == [42] and one[1].cpu().tolist() == [0.25]


@pytest.mark.parametrize("call, match", [
    (lambda: candidate_greedy(torch.zeros(2, 6), torch.zeros(2, 3, dtype=torch.long), torch.arange(7), 2),
     "must divide token_ordering's 7"),
    (lambda: candidate_greedy(torch.zeros(2, 6), torch.zeros(2, 2, dtype=torch.long), torch.arange(8), 2),
     r"must be \[rows, k \* T\]"),
    (lambda: candidate_greedy(torch.zeros(2, 6), torch.zeros(2, 3), torch.arange(6), 2), "top must be a 2-D"),
    (lambda: candidate_greedy(torch.zeros(2, 6, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.long),
                              torch.arange(6), 2), "values must be a 2-D bfloat16"),
    (lambda: candidate_greedy(torch.zeros(2, 6), torch.zeros(2, 3, dtype=torch.long), torch.arange(6), 0),
     "tokens_per_cluster must be an int >= 1"),
    (lambda: candidate_greedy(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.long), torch.arange(6), 2),
     "no candidates"),
    (lambda: candidate_greedy(torch.zeros(6, 2).t(), torch.zeros(2, 3, dtype=torch.long), torch.arange(6), 2),
     "values's last dimension must be contiguous"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(CandidatePickError, match=match):
        call()


@pytest.mark.gpu
def test_gemma4_shapes_on_the_gpu():
    """The spec's head on the GPU: 4096 candidates (32 clusters of 128) per row, bf16, batch 1..64, ties planted;
    against the full row's pick and the twin."""
    for rows in (1, 8, 64):
        values, top, ordering = make_head(rows, rows=rows, clusters=2048, k=32, per=128, dtype=torch.bfloat16,
                                          ties=rows // 2 + 1)
        want = full_row_pick(values, top, ordering, 128)
        got = candidate_greedy(values.cuda(), top.cuda(), ordering.cuda(), 128)
        twin = candidate_greedy_torch(values.cuda(), top.cuda(), ordering.cuda(), 128)
        for tok, logit in (got, twin):
            assert torch.equal(tok.cpu(), want[0]) and torch.equal(logit.cpu(), want[1])
