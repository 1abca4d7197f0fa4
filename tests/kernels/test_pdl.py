"""Programmatic dependent launch (graphcap.kernels.pdl): when a launch takes it (the GPU's description, the
`GRAPHCAP_PDL` switch, the sm80 switch, torch's tracing), and on a GPU that a chain of the draft's kernels captured
in one CUDA graph gives the same bits with it as without it, replay after replay on new inputs (the wait before
every read is what keeps a kernel from reading its predecessor's output early)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import envvars
from graphcap.kernels import arch, pdl
from graphcap.kernels.attention.decode import decode_attention
from graphcap.kernels.elementwise.fused_ops import (apply_rope_with_cos_sin_cache_inplace, gelu_tanh_and_mul,
                                                    gemma_fused_add_rmsnorm, gemma_rmsnorm)
from graphcap.kernels.gemm.skinny import skinny_gate_up_gelu, skinny_linear
from graphcap.kernels.head.candidate_pick import candidate_greedy
from graphcap.kernels.head.centroid import centroid_logits
from graphcap.kernels.head.small_topk import small_topk
from tiers import examples


@pytest.fixture
def switch(monkeypatch):
    """Set GRAPHCAP_PDL / GRAPHCAP_KERNEL_PATHS as a new process would read them (None: unset)."""
    def set_vars(pdl_value: str | None = None, paths: str | None = None) -> None:
        for name, value in ((envvars.PDL_ENV, pdl_value), (envvars.KERNEL_PATHS_ENV, paths)):
            monkeypatch.setenv(name, value or "")  # recorded, so the test's end restores the variable
            if value is None:
                monkeypatch.delenv(name)
        pdl._switched_on.cache_clear()
        arch.kernel_paths.cache_clear()
    yield set_vars
    pdl._switched_on.cache_clear()
    arch.kernel_paths.cache_clear()


class CudaLike:
    """What `enabled` reads of a tensor, for a CUDA device this machine may not have (the planners then describe
    an H200, or an A100 under the sm80 switch)."""
    is_cuda = True
    device = torch.device("cuda")


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("1", True), (" ON ", True), ("on", True),
                                       ("0", False), ("off", False), ("Off", False)])
def test_switch_values(value, on):
    assert envvars.pdl({} if value is None else {envvars.PDL_ENV: value}) is on


@given(st.text(max_size=6).filter(lambda v: v.strip().lower() not in ("", "0", "1", "on", "off")))
@settings(max_examples=examples(50), deadline=None)
def test_switch_names_a_bad_value(value):
    with pytest.raises(ValueError, match=r"^\$GRAPHCAP_PDL: expected 1/on or 0/off \(unset: on\), got "):
        envvars.parse_pdl(value)


def test_plugin_refuses_a_bad_value_at_launch():
    from graphcap.sglang.compat import DraftCaptureConfigError
    from graphcap.sglang.settings import PluginSettings

    assert PluginSettings.from_env({}).pdl is True
    assert PluginSettings.from_env({envvars.PDL_ENV: "off"}).pdl is False
    with pytest.raises(DraftCaptureConfigError, match="GRAPHCAP_PDL"):
        PluginSettings.from_env({envvars.PDL_ENV: "yes"})


def test_who_takes_it(switch, monkeypatch):
    """On for a Hopper description outside tracing; off on a CPU, where switched off, under the sm80 switch (an
    A100's paths: griddepcontrol is sm_90's), while torch.compile traces, and for a wrap_triton launch outside a
    triton_op run eagerly (torch would record it as its higher-order op, which takes no launch_pdl)."""
    switch()
    if torch.cuda.is_available() and not arch.device_arch().hopper:
        pytest.skip("this GPU has no programmatic dependent launch (capability below 9.0)")
    t = CudaLike()
    assert pdl.enabled(t, wrapped=False)
    assert pdl.launch_options(t, wrapped=False) == {"launch_pdl": True, "GDC": True}
    assert not pdl.enabled(torch.ones(1), wrapped=False)
    assert pdl.launch_options(torch.ones(1)) == {"GDC": False}
    assert not pdl.enabled(t, wrapped=True)  # a bare wrap_triton call dispatches through torch's op
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):  # what a triton_op run eagerly does around its body: real launches
        assert pdl.enabled(t, wrapped=True)
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)  # torch.compile tracing the launch
            assert not pdl.enabled(t, wrapped=True) and not pdl.enabled(t, wrapped=False)
        assert pdl.enabled(t, wrapped=True)
    switch(pdl_value="0")
    assert not pdl.enabled(t, wrapped=False)
    switch(paths="sm80")
    assert not pdl.enabled(t, wrapped=False)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the draft's chain of kernels in one CUDA graph, with and without PDL


def _draft_chain(g: torch.Generator, b: int) -> tuple[dict[str, torch.Tensor], callable]:
    """Inputs (static, refilled per replay) and the chain: norm -> q projection -> rotary -> decode attention over
    a paged pool -> o projection -> residual add + norm -> gate/up + gelu -> (cuBLAS + gelu-mul) -> down ->
    centroid scores -> top-k -> candidate scores -> greedy pick; each kernel reads what the one before wrote."""
    dev, dt = "cuda", torch.bfloat16
    hidden, heads, kv_heads, d, inter, c, t, k = 1536, 32, 16, 256, 6144, 2048, 128, 32
    pool = b * 1024 + 64
    w = {name: (torch.randn(shape, generator=g, device=dev) / shape[1] ** 0.5).to(dt) for name, shape in (
        ("q", (heads * d, hidden)), ("o", (hidden, heads * d)), ("gate_up", (2 * inter, hidden)),
        ("down", (hidden, inter)), ("centroids", (c, hidden)), ("lm_head", (c * t, hidden)))}
    static = dict(x=torch.empty(b, hidden, device=dev, dtype=dt),
                  k_pool=torch.randn(pool, kv_heads, d, generator=g, device=dev).to(dt),
                  v_pool=torch.randn(pool, kv_heads, d, generator=g, device=dev).to(dt),
                  table=torch.randperm(pool, generator=g, device=dev)[: b * 1024].view(b, 1024).int(),
                  slots=torch.arange(b, device=dev), lens=torch.empty(b, dtype=torch.int32, device=dev))
    ordering = torch.randperm(c * t, generator=g, device=dev)
    norm_w = torch.randn(hidden, generator=g, device=dev).to(dt)
    angles = torch.arange(2048, device=dev)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, device=dev) / d)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).float()

    def chain() -> tuple[torch.Tensor, ...]:
        x = gemma_rmsnorm(static["x"], norm_w)
        q = skinny_linear(x, w["q"]).view(b, heads, d)
        k_dummy = q[:, :1].clone()
        apply_rope_with_cos_sin_cache_inplace(static["lens"].long(), q, k_dummy, d, cos_sin)
        a = decode_attention(q, static["k_pool"], static["v_pool"], static["table"], static["slots"], static["lens"],
                             1024, d ** -0.5, num_splits=4)
        h = skinny_linear(a.view(b, heads * d), w["o"])
        residual = static["x"].clone()
        gemma_fused_add_rmsnorm(h, residual, norm_w)
        mlp = skinny_gate_up_gelu(h, w["gate_up"]) + gelu_tanh_and_mul(torch.mm(h, w["gate_up"].t()))
        h = skinny_linear(mlp, w["down"])
        top_v, top_i = small_topk(skinny_linear(h, w["centroids"]).float(), k)
        scores = centroid_logits(w["lm_head"], h, top_i, t)
        token, logit = candidate_greedy(scores, top_i, ordering, t)
        return a, h, top_v, top_i, scores, token, logit

    return static, chain


def _run_captured(b: int, feeds: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator(device="cuda").manual_seed(b)
    static, chain = _draft_chain(g, b)
    static["x"].copy_(feeds[0][0])
    static["lens"].copy_(feeds[0][1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()  # compiles every kernel before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    got = []
    for x, lens in feeds:
        static["x"].copy_(x)
        static["lens"].copy_(lens)
        graph.replay()
        got.append(tuple(o.clone() for o in outs))
    torch.cuda.synchronize()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8, 32])
def test_draft_chain_same_bits_with_pdl(b, switch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(100 + b)
    feeds = [((torch.randn(b, 1536, generator=g, device="cuda")).bfloat16(),
              torch.randint(1, 1025, (b,), generator=g, device="cuda", dtype=torch.int32)) for _ in range(4)]
    switch(pdl_value="0")
    plain = _run_captured(b, feeds)
    switch()
    hopper = arch.device_arch(torch.device("cuda")).hopper
    assert pdl.enabled(torch.empty(1, device="cuda"), wrapped=False) is hopper
    with_pdl = _run_captured(b, feeds)
    for i, (p, q) in enumerate(zip(plain, with_pdl)):
        for name, u, v in zip(("attention", "hidden", "top values", "top ids", "scores", "token", "logit"), p, q):
            assert torch.equal(u, v), (b, i, name)
    assert not torch.equal(plain[0][1], plain[1][1])  # the replays saw their own inputs
