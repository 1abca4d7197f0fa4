"""Run by tests/sglang/test_runtime.py in a fresh interpreter (sglang's Triton backend imports with torchvision
stubbed).

graphcap's verify seat (graphcap/sglang/verify.py) driven by sglang's own
`TritonAttnBackend.forward_extend`: a target-verify call goes through sglang's real dispatch into the seat, gives what
the same call gives through sglang's `extend_attention_fwd` (use_verify_splitkv off), and every case the seat does not
serve falls through to sglang's kernel with nothing written. The backend is a namespace carrying the attributes
forward_extend reads; the kernels run under Triton's interpreter."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("sglang", reason="the real sglang package is not installed")
pytestmark = pytest.mark.sglang

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared case builders
from _sglang_env import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

from sglang.srt.layers.attention import triton_backend as tb  # noqa: E402
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402

from graphcap.sglang.verify import SEAT_ATTR, VerifyAttentionSeat, install, serves  # noqa: E402
from verify_cases import chain_mask, make_case, rel_err  # noqa: E402


class Mode:
    def __init__(self, verify: bool) -> None:
        self.verify = verify

    def is_target_verify(self) -> bool:
        return self.verify

    def is_dllm_extend(self) -> bool:
        return False


def fake_backend(x, lens, n_q, window, seat):
    """The attributes forward_extend reads on a target verify, with the verify's metadata as sglang's backend
    builds it for a topk-1 chain (qo_indptr by n_q, the chain's mask, the window lists' offsets)."""
    batch = len(lens)
    mask, mptr = chain_mask(lens, n_q)
    md = SimpleNamespace(
        qo_indptr=torch.arange(0, (batch + 1) * n_q, n_q, dtype=torch.int32), kv_indptr=x["indptr"],
        kv_indices=x["indices"], window_kv_indptr=x["indptr"], window_kv_indices=x["indices"],
        window_kv_offsets=torch.zeros(batch, dtype=torch.int64), custom_mask=mask,
        mask_indptr=mptr, max_extend_len=n_q, swa_out_cache_loc=None)
    pool = SimpleNamespace(get_key_buffer=lambda i: x["k_pool"], get_value_buffer=lambda i: x["v_pool"])
    self = SimpleNamespace(
        _can_run_dense_fp8_chunked_mha=lambda *a: False, dcp_size=1, enable_deterministic=False, forward_metadata=md,
        use_verify_shared_kv=False, use_verify_splitkv=seat is not None, verify_splitkv_fwd=seat,
        verify_shared_kv_fwd=None, token_to_kv_pool=pool, page_size=1, dllm_attention=None,
        allow_bidirectional_attention_in_extend=False, req_to_token_pool=SimpleNamespace(size=64),
        extend_attention_fwd=extend_attention_fwd)
    self._forward_extend_kernel = lambda layer, *a, **k: tb.TritonAttnBackend._forward_extend_kernel(self, layer, *a,
                                                                                                     **k)
    return self


def layer_of(x, window, logit_cap=0.0):
    h, d = x["q"].shape[1], x["q"].shape[2]
    return SimpleNamespace(tp_q_head_num=h, qk_head_dim=d, v_head_dim=d, layer_id=0, k_scale=None, v_scale=None,
                           sliding_window_size=window - 1 if window > 0 else -1, is_cross_attention=False,
                           attn_type=AttentionType.DECODER, logit_capping_method="tanh", logit_cap=logit_cap,
                           scaling=0.25, xai_temperature_len=-1)


def forward(self, x, layer):
    fb = SimpleNamespace(forward_mode=Mode(True), mha_one_shot=False, attn_attend_prefix_cache=False,
                         extend_seq_lens_cpu=None, out_cache_loc=None)
    q = x["q"].reshape(x["q"].shape[0], -1)
    return tb.TritonAttnBackend.forward_extend(self, q, x["k_new"], x["v_new"], layer, fb, save_kv_cache=False)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 3), n_q=st.integers(1, 4), group=st.integers(1, 2), window=st.sampled_from([0, 12, 40]),
       seed=st.integers(0, 999), data=st.data())
def test_sglang_dispatch_reaches_the_seat_and_matches_its_extend_kernel(batch, n_q, group, window, seed, data):
    # sglang's layer.sliding_window_size is one less than the window its lists hold; both calls get the same one
    lens = data.draw(st.lists(st.integers(0, 45), min_size=batch, max_size=batch))
    lens = [min(n, window - 1) if window else n for n in lens]
    x = make_case(batch, n_q, 2, group, 16, lens, pool=sum(lens) + 20, seed=seed)
    seat = VerifyAttentionSeat(max_context_len=64)
    ours = forward(fake_backend(x, lens, n_q, window, seat), x, layer_of(x, window))
    assert seat.served == 1 and not seat.declined
    theirs = forward(fake_backend(x, lens, n_q, window, None), x, layer_of(x, window))
    assert rel_err(ours, theirs) < 1e-5


def test_cases_the_seat_does_not_serve_run_sglangs_kernel():
    lens, n_q = [9, 17], 3
    x = make_case(2, n_q, 2, 2, 16, lens, pool=40, seed=5)
    seat = VerifyAttentionSeat(max_context_len=64)
    capped = forward(fake_backend(x, lens, n_q, 0, seat), x, layer_of(x, 0, logit_cap=30.0))
    assert seat.served == 0 and seat.declined == {"a logit cap": 1}
    plain = forward(fake_backend(x, lens, n_q, 0, None), x, layer_of(x, 0, logit_cap=30.0))
    torch.testing.assert_close(capped, plain, rtol=0, atol=0)
    o = torch.full_like(x["q"], 7.0)
    common = (x["q"], x["k_new"], x["v_new"], o, x["k_pool"], x["v_pool"],
              torch.arange(0, 3 * n_q, n_q, dtype=torch.int32), x["indptr"], x["indices"], None)
    assert seat(*common, False, None, n_q, 1.0, 1.0, 0.25) is False  # non-causal
    assert seat(*common, True, None, n_q, 0.5, 1.0, 0.25) is False  # fp8 K scale
    assert seat(*common, True, None, n_q + 1, 1.0, 1.0, 0.25) is False  # unequal verify lengths
    assert seat(*common, True, None, n_q, 1.0, 1.0, 0.25, sinks=torch.zeros(4)) is False
    assert (o == 7.0).all()  # nothing written by a declined call
    assert set(seat.declined) == {"a logit cap", "non-causal attention", "scaled or narrower K/V (fp8)",
                                  "verify lengths not all equal to max_extend_len", "attention sinks"}


def test_install_only_on_the_targets_chain_backend():
    def backend(**kw):
        b = SimpleNamespace(topk=1, use_mla=False, enable_deterministic=False, dcp_size=1, use_verify_splitkv=False,
                            use_verify_shared_kv=False, verify_splitkv_fwd=None, max_context_len=4096)
        b.__dict__.update(kw)
        return b

    target, draft = SimpleNamespace(is_draft_worker=False), SimpleNamespace(is_draft_worker=True)
    assert not serves(backend(), draft)
    assert not serves(backend(topk=2), target)
    assert not serves(backend(use_mla=True), target)
    assert not serves(backend(dcp_size=2), target)
    b = backend()
    seat = install(b, target)
    assert seat is getattr(b, SEAT_ATTR) and b.use_verify_splitkv and not b.use_verify_shared_kv
    assert seat.max_context_len == 4096 and b.verify_splitkv_fwd is not None
    assert install(backend(), draft) is None


@pytest.mark.parametrize("name", ["forward_extend", "_forward_extend_kernel"])
def test_sglang_still_has_the_seat(name):
    """The seat's contract with sglang: forward_extend reads use_verify_splitkv and calls verify_splitkv_fwd for a
    target verify (read from sglang's source, so a release that drops the seat fails here, not in a server)."""
    import inspect

    src = inspect.getsource(getattr(tb.TritonAttnBackend, name))
    if name == "forward_extend":
        assert "self.use_verify_splitkv" in src and "self.verify_splitkv_fwd" in src
        assert "is_target_verify()" in src
