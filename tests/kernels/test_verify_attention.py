"""graphcap's verify attention (graphcap/kernels/attention/verify.py) against a float64 computation from absolute
positions, its plain-torch twin, and sglang's own `extend_attention_fwd` - the kernel sglang's Triton backend runs for
a target verify today - on the same inputs. On CPU the kernels run under Triton's interpreter; the GPU tests run the
real shapes of a Gemma-4-31B-shaped target in bf16 and inside a CUDA graph."""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.kernels.attention.plan import AttentionError
from graphcap.kernels.attention.verify import (MAX_QUERY_TOKENS, plan_verify, verify_attention,
                                               verify_attention_torch)
from tiers import examples
from verify_cases import chain_mask, make_case, rel_err

GPU = pytest.mark.gpu


def reference(q, k_new, v_new, k_pool, v_pool, lens, locs, n_q, sm_scale, window):
    """float64, from absolute positions: request b's prefix holds positions [L_b - n_b, L_b) (L_b >= n_b arbitrary),
    its query token i sits at L_b + i; a key at p is visible when p <= the query's position and, with a window,
    when the two are at most `window` apart."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // k_pool.shape[1]
    start = 0
    for b, n in enumerate(lens):
        big_l = n + 7 * b  # any L >= n: only differences of positions matter
        pos_k = torch.tensor([big_l - n + j for j in range(n)] + [big_l + j for j in range(n_q)], dtype=torch.float64)
        rows = slice(b * n_q, (b + 1) * n_q)
        idx = locs[start:start + n]
        start += n
        k = torch.cat([k_pool[idx], k_new[rows]]).double().repeat_interleave(g, dim=1)
        v = torch.cat([v_pool[idx], v_new[rows]]).double().repeat_interleave(g, dim=1)
        pos_q = torch.tensor([big_l + i for i in range(n_q)], dtype=torch.float64)
        visible = pos_k[None, :] <= pos_q[:, None]
        if window > 0:
            visible &= pos_q[:, None] - pos_k[None, :] <= window
        s = torch.einsum("ihd,jhd->hij", q[rows].double(), k) * sm_scale
        s = s.masked_fill(~visible[None], float("-inf"))
        out[rows] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)
    return out


cases = st.fixed_dictionaries({
    "batch": st.integers(1, 3), "n_q": st.integers(1, 5), "hkv": st.integers(1, 2), "group": st.integers(1, 3),
    "d": st.sampled_from([16, 24, 32]), "seed": st.integers(0, 2**16),
    "window": st.one_of(st.just(0), st.integers(1, 6), st.integers(7, 60)),  # small ones cut into the verify
    "splits": st.sampled_from([None, 1, 3]), "rows": st.sampled_from([None, 4, 16]),
})


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases, data=st.data())
def test_kernel_matches_float64_positions(c, data):
    lens = data.draw(st.lists(st.integers(0, 80), min_size=c["batch"], max_size=c["batch"]), label="lens")
    x = make_case(c["batch"], c["n_q"], c["hkv"], c["group"], c["d"], lens, pool=sum(lens) + 40, seed=c["seed"])
    plan = plan_verify(c["batch"], c["hkv"], c["hkv"] * c["group"], c["d"], c["n_q"], torch.float32, "cpu",
                       max(1, max(lens)), rows=c["rows"], num_splits=c["splits"])
    out = torch.full_like(x["q"], float("nan"))  # every element must be written
    verify_attention(**x, n_q=c["n_q"], sm_scale=0.2, window=c["window"], plan=plan, out=out)
    ref = reference(x["q"], x["k_new"], x["v_new"], x["k_pool"], x["v_pool"], lens, x["indices"], c["n_q"], 0.2,
                    c["window"])
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5
    twin = verify_attention_torch(**x, n_q=c["n_q"], sm_scale=0.2, window=c["window"])
    assert rel_err(twin, ref) < 1e-5


def test_window_edge_each_token_loses_one_key():
    """At a window of exactly the prefix's length, token i no longer sees the i oldest prefix keys: a kernel that
    masked by the request (not by the token) or off by one would see them."""
    lens, n_q, w = [20], 4, 20
    x = make_case(1, n_q, 1, 1, 16, lens, pool=40, seed=3)
    out = verify_attention(**x, n_q=n_q, sm_scale=1.0, window=w)
    ref = reference(x["q"], x["k_new"], x["v_new"], x["k_pool"], x["v_pool"], lens, x["indices"], n_q, 1.0, w)
    wide = reference(x["q"], x["k_new"], x["v_new"], x["k_pool"], x["v_pool"], lens, x["indices"], n_q, 1.0, 0)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out[0], wide[0]) < 1e-5  # token 0: the whole prefix is inside the window
    assert rel_err(out[1:], wide[1:]) > 1e-3


@pytest.mark.parametrize("lens,n_q,window", [([0], 3, 1), ([1, 4], 3, 1), ([5, 0], 5, 2), ([9], 4, 3)])
def test_window_narrower_than_the_verify_hides_older_new_tokens(lens, n_q, window):
    """A window shorter than the verify (n_q > window + 1) also hides the request's own older new tokens: token i
    sees new token e only when i - e <= window. Hypothesis rarely draws such windows, so they are pinned here."""
    x = make_case(len(lens), n_q, 1, 2, 16, lens, pool=sum(lens) + 20, seed=5)
    ref = reference(x["q"], x["k_new"], x["v_new"], x["k_pool"], x["v_pool"], lens, x["indices"], n_q, 0.4, window)
    for splits in (None, 2):
        plan = plan_verify(len(lens), 1, 2, 16, n_q, torch.float32, "cpu", max(1, max(lens)), num_splits=splits)
        out = verify_attention(**x, n_q=n_q, sm_scale=0.4, window=window, plan=plan)
        assert rel_err(out, ref) < 1e-5
    twin = verify_attention_torch(**x, n_q=n_q, sm_scale=0.4, window=window)
    assert rel_err(twin, ref) < 1e-5


def _sglang_extend():
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except Exception as e:  # noqa: BLE001 - any import problem: the package is not usable here
        pytest.skip(f"sglang's extend_attention_fwd is not importable here ({type(e).__name__}: {e})")
    return extend_attention_fwd


def sglang_verify(fwd, x, lens, n_q, sm_scale, window):
    """sglang's extend kernel as its Triton backend calls it for a topk-1 verify: the chain's tree mask (every prefix
    key, causal among the new tokens), per request rows of prefix + n_q entries, the window in the list's indices."""
    dev = x["q"].device
    mask, mptr = chain_mask(lens, n_q)
    batch = len(lens)
    o = torch.empty_like(x["q"])
    fwd(x["q"], x["k_new"], x["v_new"], o, x["k_pool"], x["v_pool"],
        torch.arange(0, (batch + 1) * n_q, n_q, dtype=torch.int32, device=dev), x["indptr"], x["indices"],
        mask.to(dev), True, mptr.to(dev), n_q,
        1.0, 1.0, sm_scale, sliding_window_size=window if window > 0 else -1,
        window_kv_offsets=torch.zeros(batch, dtype=torch.int64, device=dev))
    return o


@pytest.mark.sglang
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors reach sglang's kernel only under "
                    "Triton's interpreter; on a GPU test_gpu_real_shapes_against_twin_and_sglang compares the two")
@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases, data=st.data())
def test_kernel_matches_sglang_extend_kernel(c, data):
    fwd = _sglang_extend()
    lens = data.draw(st.lists(st.integers(0, 70), min_size=c["batch"], max_size=c["batch"]), label="lens")
    x = make_case(c["batch"], c["n_q"], c["hkv"], c["group"], c["d"], lens, pool=sum(lens) + 30, seed=c["seed"])
    ours = verify_attention(**x, n_q=c["n_q"], sm_scale=0.3, window=c["window"])
    theirs = sglang_verify(fwd, x, lens, c["n_q"], 0.3, c["window"])
    assert rel_err(ours, theirs) < 1e-5


def test_bad_inputs_are_named():
    x = make_case(2, 3, 2, 2, 16, [5, 9], pool=30)
    with pytest.raises(AttentionError, match="not whole requests of n_q=4"):
        verify_attention(**x, n_q=4, sm_scale=1.0, window=0)
    bad = dict(x, k_new=x["k_new"][:, :1])
    with pytest.raises(AttentionError, match="shapes disagree"):
        verify_attention(**bad, n_q=3, sm_scale=1.0, window=0)
    bad = dict(x, indptr=x["indptr"][:2])
    with pytest.raises(AttentionError, match="indptr has 2 entries for 2 requests"):
        verify_attention(**bad, n_q=3, sm_scale=1.0, window=0)
    bad = dict(x, indices=x["indices"].float())
    with pytest.raises(AttentionError, match="indices must be a 1-D int32/int64 tensor"):
        verify_attention(**bad, n_q=3, sm_scale=1.0, window=0)
    plan = plan_verify(2, 2, 4, 16, 2, torch.float32, "cpu", 16)
    with pytest.raises(AttentionError, match="plan is for 2 query tokens per request, got 3"):
        verify_attention(**x, n_q=3, sm_scale=1.0, window=0, plan=plan)
    with pytest.raises(AttentionError, match=f"1..{MAX_QUERY_TOKENS} supported"):
        plan_verify(2, 2, 4, 16, MAX_QUERY_TOKENS + 1, torch.float32, "cpu", 16)
    with pytest.raises(AttentionError, match="multiple of kv heads"):
        plan_verify(2, 3, 4, 16, 2, torch.float32, "cpu", 16)


@given(n_q=st.integers(1, MAX_QUERY_TOKENS), hkv=st.integers(1, 16), group=st.integers(1, 16),
       d=st.sampled_from([64, 128, 256, 512]), batch=st.integers(1, 64))
@settings(max_examples=examples(200), deadline=None)
def test_plan_tiles_cover_every_query_head_and_token(n_q, hkv, group, d, batch):
    p = plan_verify(batch, hkv, hkv * group, d, n_q, torch.bfloat16, "cpu", 2048)
    assert p.heads * p.head_tiles >= group > (p.head_tiles - 1) * p.heads  # every head, no empty tile
    assert p.block_m >= p.heads * p.n_q and p.block_m >= 16 and p.block_m & (p.block_m - 1) == 0


# ---------------------------------------------------------------------------------------------------------------
# GPU: the real shapes (Gemma-4-31B-shaped target: sliding 32 q / 16 kv heads x 256, window 1023; full 32 / 4 x 512)

SHAPES = {"sliding": (16, 2, 256, 1023), "full": (4, 8, 512, 0)}


@GPU
@pytest.mark.parametrize("layer", sorted(SHAPES))
@pytest.mark.parametrize("batch,n_q", [(1, 4), (8, 4), (32, 4), (8, 2), (8, 3)])
def test_gpu_real_shapes_against_twin_and_sglang(layer, batch, n_q):
    hkv, group, d, window = SHAPES[layer]
    ctx = 2048
    lens = [min(ctx - 37 * i, window) if window else ctx - 37 * i for i in range(batch)]
    x = make_case(batch, n_q, hkv, group, d, lens, pool=sum(lens) + 4096, dtype=torch.bfloat16, device="cuda",
                  seed=batch)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(x["q"], float("nan"))
    verify_attention(**x, n_q=n_q, sm_scale=scale, window=window, out=out)
    twin = verify_attention_torch(**{k: (v.float() if v.is_floating_point() else v) for k, v in x.items()},
                                  n_q=n_q, sm_scale=scale, window=window)
    assert not out.isnan().any()
    assert rel_err(out, twin) < 1e-2
    theirs = sglang_verify(_sglang_extend(), x, lens, n_q, scale, window)
    assert rel_err(out, theirs) < 1e-2


@GPU
def test_gpu_replays_in_a_cuda_graph_with_new_prefixes():
    """Captured once, replayed over other prefix lists of the same buffers (sglang refills them before each
    replay): each replay equals an eager call on what the buffers hold then."""
    hkv, group, d, window = SHAPES["sliding"]
    batch, n_q = 8, 4
    lens = [window] * batch
    x = make_case(batch, n_q, hkv, group, d, lens, pool=20000, dtype=torch.bfloat16, device="cuda")
    plan = plan_verify(batch, hkv, hkv * group, d, n_q, torch.bfloat16, "cuda", window)
    out = torch.empty_like(x["q"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        verify_attention(**x, n_q=n_q, sm_scale=0.06, window=window, plan=plan, out=out)  # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_attention(**x, n_q=n_q, sm_scale=0.06, window=window, plan=plan, out=out)
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        new_lens = torch.randint(0, window + 1, (batch,), generator=g)
        x["indptr"][1:] = new_lens.cumsum(0).to(x["indptr"])
        x["indices"].copy_(torch.randperm(20000, generator=g)[:x["indices"].numel()].to(x["indices"]))
        x["q"].normal_()
        graph.replay()
        eager = verify_attention(**x, n_q=n_q, sm_scale=0.06, window=window, plan=plan)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_plan_without_wgmma_keeps_the_wide_tiles_in_registers():
    """An sm_80 plan of the full layer (D = 512) takes 8 warps and 16-key tiles, where ptxas spills ~670 bytes per
    thread at the H200's 4 warps (tests/kernels/test_sm80.py compiles both); the H200's plan is the one
    measured there."""
    from graphcap.kernels.arch import SM80, SM90

    a = plan_verify(8, 4, 32, 512, 4, torch.bfloat16, "cuda", 8192, arch=SM80).attention
    h = plan_verify(8, 4, 32, 512, 4, torch.bfloat16, "cuda", 8192, arch=SM90).attention
    assert (a.num_warps, a.block_n) == (8, 16) and (h.num_warps, h.block_n) == (4, 32)
    s = plan_verify(8, 16, 32, 256, 4, torch.bfloat16, "cuda", 1023, arch=SM80).attention
    assert s.num_warps == 4  # the sliding layer's tiles fit
