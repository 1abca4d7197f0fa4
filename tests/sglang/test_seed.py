"""graphcap.sglang.seed: a prefill batch's seed rows (each request's last prompt token) gathered without a host sync,
against a from-scratch walk over the requests, and the hook that seats it (sglang's own function is the reference in
tests/sglang_isolated/check_sglang_runtime.py, on both sglang versions)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from graphcap.sglang import hooks
from graphcap.sglang.seed import last_extend_hidden


def _walk(extend_lens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """Each request's last row, found by walking the requests' token runs one by one."""
    rows, start = [], 0
    for n in extend_lens:
        start += n
        rows.append(hidden[start - 1])
    return torch.stack(rows)


@settings(max_examples=examples(200), deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=24), pad=st.integers(0, 5), width=st.integers(1, 9),
       seed=st.integers(0, 2 ** 16))
def test_each_requests_last_prompt_row(lens, pad, width, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(sum(lens) + pad, width, generator=g, dtype=torch.float64)  # rows past the prompts: padding
    got = last_extend_hidden(lens, len(lens), hidden)
    if hidden.shape[0] == len(lens):  # one row per request already: sglang hands the tensor back as it is
        assert got is hidden
    else:
        assert torch.equal(got, _walk(lens, hidden))


def test_past_the_rows_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"sum to 7, past the 6 rows"):
        last_extend_hidden([3, 4], 2, torch.randn(6, 2))


class _Runtime:
    def __init__(self, active: bool):
        self.active = active


@pytest.mark.parametrize("runtime", [None, _Runtime(False), _Runtime(True)], ids=["none", "inactive", "active"])
def test_the_hook_serves_only_a_worker_graphcap_serves(runtime):
    calls = []

    def original(worker, batch, hidden):
        calls.append(hidden)
        return "sglang's"

    worker = SimpleNamespace(_graphcap_runtime=runtime)
    batch = SimpleNamespace(extend_lens=[2, 3], batch_size=lambda: 2)
    hidden = torch.randn(5, 4)
    got = hooks.around_select_last_extend_hidden(original, worker, batch, hidden)
    if runtime is not None and runtime.active:
        assert not calls and torch.equal(got, hidden[[1, 4]])
    else:
        assert got == "sglang's" and calls == [hidden]


@pytest.mark.gpu
def test_no_host_sync_on_the_gpu_where_sglangs_index_syncs():
    """Behind queued GPU work: torch's sync-debug mode refuses sglang's index (a copy from pageable memory) and lets
    graphcap's through, and both give the same rows."""
    lens = [300, 1, 57, 512, 9]
    hidden = torch.randn(sum(lens), 64, device="cuda")
    want = _walk(lens, hidden)
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            busy = busy @ busy.T * 1e-3  # the GPU still busy when the seed is gathered
        got = last_extend_hidden(lens, len(lens), hidden)
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor(lens, device="cuda")  # what sglang's select_last_extend_hidden does
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)
