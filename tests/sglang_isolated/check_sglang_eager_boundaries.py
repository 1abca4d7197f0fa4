"""graphcap's `_eager_boundaries` on sglang's real Gemma 4 assistant (tiny checkpoint, CPU; 0.5.23 in the venv,
0.5.18 with its directory in front of PYTHONPATH): torch.compile (fullgraph=False, backend "eager" and "aot_eager")
of the draft steps as SglangAssistantLoop runs them graph-breaks only at the disabled boundary entry points (0.5.23;
0.5.18 has none and compiles the three steps as one graph), compiles the rest (attention incl. the backend call, MLP,
logits head) and returns exactly what the eager model returns; the patch is idempotent. Without it, Dynamo trips over
the msgspec records sglang 0.5.23's residual stream builds. Also: `prepare` plans graphcap's attention for each of
the real model's attention layers; graphcap's centroid head, greedy pick and projections on the real model. Run in
a fresh interpreter (it initialises torch.distributed):
    pytest -o python_files='check_*.py' -o addopts= <this file>
Makes its checkpoint with bench/sglang_checkpoint.py --size tiny --device cpu in a temporary directory."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("sglang", reason="the real sglang package is not installed")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "sglang_isolated")]
from _sglang_env import install_torchvision_stub, install_vllm_rope_stub  # noqa: E402

install_torchvision_stub()
install_vllm_rope_stub()

DTYPE, STEPS = torch.bfloat16, 3


@pytest.fixture(scope="module")
def assistant(tmp_path_factory):
    CKPT = str(tmp_path_factory.mktemp("ckpt-tiny"))
    if not os.path.exists(f"{CKPT}/assistant/model.safetensors"):
        subprocess.run([sys.executable, f"{ROOT}/bench/sglang_checkpoint.py", "--size", "tiny", "--out", CKPT,
                        "--device", "cpu"], check=True, capture_output=True)
    from safetensors import safe_open
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt import runtime_context
    from sglang.srt.runtime_context import get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29000 + os.getpid() % 2000)), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    sa = ServerArgs(model_path=f"{CKPT}/target", speculative_algorithm="NEXTN",
                    speculative_draft_model_path=f"{CKPT}/assistant", skip_tokenizer_init=True, device="cpu",
                    attention_backend="triton", page_size=64, disable_radix_cache=True)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    if hasattr(runtime_context, "SpawnRanks"):  # 0.5.23: the launcher's placement, WORLD as a lasting override
        publish(sa, role="test", ranks=runtime_context.SpawnRanks(world_rank=0))
        if parallel_state._WORLD is not None:
            get_parallel().override_permanently(world_group=parallel_state._WORLD)
    else:  # 0.5.18: the ranks are read off sglang's parallel state
        publish(sa, role="test")
    initialize_model_parallel(backend="gloo")
    from sglang.srt.models.gemma4_causal import Gemma4ForCausalLM
    from sglang.srt.models.gemma4_mtp import Gemma4AssistantForCausalLM

    def build(name, cls, draft):
        mc = ModelConfig(f"{CKPT}/{name}", is_draft_model=draft, dtype="bfloat16")
        torch.set_default_dtype(DTYPE)
        try:
            m = cls(mc.hf_config)
        finally:
            torch.set_default_dtype(torch.float32)
        with safe_open(f"{CKPT}/{name}/model.safetensors", "pt") as f:
            m.load_weights((k, f.get_tensor(k)) for k in f.keys())
        return m.to(DTYPE).eval()

    target = build("target", Gemma4ForCausalLM, False)
    model = build("assistant", Gemma4AssistantForCausalLM, True)
    model.bind_frozen_kv_context(model.build_frozen_kv_mtp_context(target, None))  # KV-shared: q only, as served
    model.set_embed_and_head(target.get_embed_and_head()[0], None)
    return model


class _Attention:
    """The attention backend's place (RadixAttention calls forward): a decode attention over fixed random K/V."""

    def __init__(self, model):
        g = torch.Generator().manual_seed(1)
        self.kv = {}
        for layer in model.model.layers:
            a = layer.self_attn.attn
            self.kv.setdefault(a.layer_id, (torch.randn(8, a.tp_k_head_num, a.qk_head_dim, generator=g).to(DTYPE),
                                            torch.randn(8, a.tp_v_head_num, a.v_head_dim, generator=g).to(DTYPE)))

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        kb, vb = self.kv[layer.layer_id]
        rep = layer.tp_q_head_num // kb.shape[1]
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim).float()
        s = torch.einsum("bhd,shd->bhs", q3, kb.float().repeat_interleave(rep, 1)) * float(layer.scaling)
        o = torch.einsum("bhs,shd->bhd", s.softmax(-1), vb.float().repeat_interleave(rep, 1))
        return o.to(q.dtype).reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    forward_decode = forward


def _loop(model, b):
    """SglangAssistantLoop's ForwardBatch and per-step calls, over the real model (no window buffers)."""
    from graphcap.sglang.loop import SglangAssistantLoop, greedy_pick

    worker = types.SimpleNamespace(draft_model_runner=types.SimpleNamespace(model=model, spec_algorithm=None),
                                   model_config=types.SimpleNamespace(dtype=DTYPE))
    window = types.SimpleNamespace(device=torch.device("cpu"))
    attention = _Attention(model)
    attention.max_context = 8
    loop = SglangAssistantLoop(worker, window, attention, STEPS)
    loop.prepare([b])  # builds the batch and patches the boundaries
    fb = loop.forward_batch(b)

    def steps(tokens, positions, hidden):
        toks = []
        for _ in range(STEPS):
            fb.spec_info.hidden_states = hidden
            out = model.forward(tokens, positions, fb)
            tokens, score = greedy_pick(out)
            hidden = out.hidden_states
            toks.append(score)
            toks.append(tokens.float())
        return torch.stack(toks, 1), hidden

    return loop, steps


def _inputs(model, b, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, model.vocab_size, (b,), generator=g), torch.randint(0, 6, (b,), generator=g),
            torch.randn(b, int(model.backbone_hidden_size), generator=g).to(DTYPE))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_assistant_matches_eager(assistant, backend):
    from torch._dynamo.utils import counters

    from graphcap.sglang import loop as rt
    from graphcap.sglang.compat import layer_boundary_owners
    from graphcap.kernels import twins_on_cpu

    torch._dynamo.reset()
    counters.clear()
    loop, steps = _loop(assistant, 3)
    rt._eager_boundaries()  # idempotent: a second call wraps nothing twice
    owners = layer_boundary_owners(rt._EAGER_BOUNDARY_ENTRIES)  # none in sglang 0.5.18: nothing to wrap
    for owner, attr, _ in owners:
        fn = vars(owner)[attr]
        assert getattr(fn, rt._EAGER_MARK)
        assert not getattr(fn._torchdynamo_orig_callable, rt._EAGER_MARK, False)
    compiled = torch.compile(steps, backend=backend, fullgraph=False, dynamic=False)
    # the centroid head's kernel as its torch twin: Dynamo cannot trace interpreted Triton on CPU (on CUDA it does)
    with loop.context(), twins_on_cpu():
        for seed in range(3):
            inp = _inputs(assistant, 3, seed)
            want = steps(*inp)
            got = compiled(*inp)
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
    reasons = [k.splitlines()[0] for k in counters["graph_break"]]
    if owners:  # 0.5.23: breaks only at the disabled boundaries
        assert reasons and all("torch.compiler.disable" in r for r in reasons), reasons
        assert counters["stats"]["unique_graphs"] >= 6  # attention / MLP / post-FFN pieces per layer type, head, ...
    else:  # 0.5.18: no records to build, the three steps are one graph
        assert not reasons and counters["stats"]["unique_graphs"] == 1, (reasons, counters["stats"])


def test_graphcap_attention_plans_every_draft_layer_per_bucket(assistant):
    """`prepare` plans graphcap's attention for every RadixAttention of the real assistant at every bucket (what its
    traced forward then looks up), sliding layers for the window and full layers for the context."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from graphcap.sglang.loop import GraphcapDraftAttention, SglangAssistantLoop
    from graphcap.kernels.attention.plan import plan_attention

    layers = [m for m in assistant.modules() if isinstance(m, RadixAttention)]
    kv = {a.layer_id: torch.empty(8, a.tp_k_head_num, a.qk_head_dim, dtype=DTYPE) for a in layers}
    pool = types.SimpleNamespace(get_key_buffer=kv.__getitem__, get_value_buffer=kv.__getitem__)
    window = types.SimpleNamespace(device=torch.device("cpu"), window=4)
    attention = GraphcapDraftAttention(window, pool, 64)
    worker = types.SimpleNamespace(draft_model_runner=types.SimpleNamespace(model=assistant, spec_algorithm=None),
                                   model_config=types.SimpleNamespace(dtype=DTYPE))
    SglangAssistantLoop(worker, window, attention, STEPS).prepare([1, 3], compiled=False)
    assert layers and set(attention._plans) == {(a.layer_id, b) for a in layers for b in (1, 3)}
    assert {a.sliding_window_size > -1 for a in layers} == {True, False}  # both layer types
    for a in layers:
        n = 4 if a.sliding_window_size > -1 else 64
        assert attention._plans[a.layer_id, 3] == plan_attention(3, a.tp_k_head_num, a.qk_head_dim, DTYPE,
                                                                 torch.device("cpu"), n)


def test_graphcap_centroid_head_is_sglangs_with_the_rows_read_in_place(assistant):
    """graphcap's centroid masking (its kernel for the gather + product; under TRITON_INTERPRET=1 here, as the suite
    runs) against sglang's own `_apply_centroid_masking` on the real tiny assistant: the same clusters unmasked, the
    same mask elsewhere, each candidate's logit within one bf16 step (the fp32 sums run in another order), and
    `install` routes the instance's method to it."""
    from sglang.srt.models.gemma4_mtp import Gemma4AssistantForCausalLM

    from graphcap.sglang import head as sglang_head

    g = torch.Generator().manual_seed(3)
    h = (torch.randn(5, assistant.lm_head.weight.shape[1], generator=g) * 4).to(DTYPE)
    want = Gemma4AssistantForCausalLM._apply_centroid_masking(assistant, h)
    got = sglang_head.centroid_masking(assistant, h)
    mask = torch.finfo(DTYPE).min / 2
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got == mask, want == mask) and (want != mask).sum() == 5 * assistant.centroid_intermediate_top_k * assistant.vocab_size_per_centroid
    live = want != mask
    step = torch.finfo(DTYPE).eps * want[live].float().abs().clamp(min=2.0**-14)  # one bf16 step at each value
    assert ((got[live].float() - want[live].float()).abs() <= step).all()
    assert sglang_head.install(assistant) and sglang_head.install(assistant)  # idempotent
    assert torch.equal(assistant._apply_centroid_masking(h), got)
    assert type(assistant)._apply_centroid_masking is Gemma4AssistantForCausalLM._apply_centroid_masking
    assert not sglang_head.install(types.SimpleNamespace(use_ordered_embeddings=False, centroids=None))


def test_the_loops_greedy_pick_from_candidates_is_the_full_rows(assistant):
    """In graphcap's marked forward batches the real assistant's centroid head returns its candidates (no vocabulary
    row), and the loop's pick from them equals greedy_token over the full row that sglang's processor returns for the
    same batch unmarked: tokens, logits and stored hidden states, step after step."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    from graphcap.sglang import head as sglang_head
    from graphcap.sglang.loop import greedy_pick, greedy_token

    loop, _ = _loop(assistant, 3)
    marked = loop.forward_batch(3)
    plain = loop._new_forward_batch(3)
    setattr(plain, sglang_head.CANDIDATES_MARK, False)  # as sglang's own batches: no mark
    assert getattr(marked, sglang_head.CANDIDATES_MARK)
    tokens, positions, hidden = _inputs(assistant, 3, 11)
    with loop.context():
        for _ in range(STEPS):
            marked.spec_info.hidden_states = plain.spec_info.hidden_states = hidden
            got = assistant.forward(tokens, positions, marked)
            want = assistant.forward(tokens, positions, plain)
            assert isinstance(got, sglang_head.HeadCandidates) and isinstance(want, LogitsProcessorOutput)
            assert got.values.shape == (3, assistant.centroid_intermediate_top_k * assistant.vocab_size_per_centroid)
            tok, score = greedy_pick(got)
            want_tok, want_score = greedy_token(want.next_token_logits)
            assert torch.equal(tok, want_tok) and torch.equal(score, want_score)
            assert torch.equal(got.hidden_states, want.hidden_states)
            tokens, hidden = tok, got.hidden_states


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_the_loop_drafts_a_chain_of_steps_tokens(assistant, steps):
    """SglangAssistantLoop's call at 1, 2 and 3 steps (what it captures): the seed step on (bonus token, target hidden
    state) and steps - 1 more, each on the last token and hidden state, every row at its last position
    (seq_len - 1) - the chain sglang's draft_forward builds for topk 1 - against the real model stepped by hand with
    sglang's unmarked forward batches (full-vocabulary logits, the first index of their max)."""
    from graphcap.sglang import head as sglang_head
    from graphcap.sglang.loop import SglangAssistantLoop

    b = 3
    lens = torch.tensor([6, 1, 9, 4])  # per pool row
    window = types.SimpleNamespace(device=torch.device("cpu"), seq_lens=lens, advance=lambda slots, accepted: None)
    attention = _Attention(assistant)
    attention.max_context, attention.bind = 8, lambda slots: None
    worker = types.SimpleNamespace(draft_model_runner=types.SimpleNamespace(model=assistant, spec_algorithm=None),
                                   model_config=types.SimpleNamespace(dtype=DTYPE))
    loop = SglangAssistantLoop(worker, window, attention, steps)
    loop.prepare([b], compiled=False)
    slots = torch.tensor([2, 0, 3])
    tokens, _, hidden = _inputs(assistant, b, 30 + steps)
    with loop.context():
        out = loop(slots, torch.zeros(b, dtype=torch.int32), tokens, hidden)
        plain = loop._new_forward_batch(b)
        setattr(plain, sglang_head.CANDIDATES_MARK, False)
        positions, want, t, h = lens[slots] - 1, [], tokens, hidden
        for _ in range(steps):
            plain.spec_info.hidden_states = h
            o = assistant.forward(t, positions, plain)
            t, h = o.next_token_logits.argmax(-1), o.hidden_states
            want.append(t)
    assert out.tokens.shape == (b, steps) and out.scores.shape == (b, steps)
    assert torch.equal(out.tokens, torch.stack(want, 1))
    assert torch.equal(out.hidden, h)


def test_graphcap_projections_on_the_real_assistant(assistant, monkeypatch):
    """`sglang_linear.install` on the real tiny assistant: every unquantized linear layer routed, each MLP's gate/up
    and gelu-mul one kernel (Triton's interpreter here, as the suite runs). A routed layer at 1..8 rows equals a
    float64 product within one bf16 rounding, the fused MLP a float64 MLP within bf16 error; more rows, or a bias,
    take sglang's own `apply` exactly. A KV-shared attention's qkv projection reads only its query rows (sglang drops
    K and V there), the query columns as above. A draft step's hidden states through the routed model stay within
    bf16 error of sglang's own layers', and after `restore` the draft steps give sglang's own results bit for bit."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from graphcap.sglang import linear as sl

    calls = {"linear": 0, "gate_up": 0}
    weights_read: list[torch.Tensor] = []  # the weight each skinny_linear call read

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            weights_read.append(args[1])
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(sl, "skinny_linear", counted("linear", sl.skinny_linear))
    monkeypatch.setattr(sl, "skinny_gate_up_gelu", counted("gate_up", sl.skinny_gate_up_gelu))
    linears = [m for m in assistant.modules() if isinstance(m, LinearBase)
               and isinstance(m.quant_method, UnquantizedLinearMethod)]
    mlps = [m for m in assistant.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "act_fn")]
    assert linears and len(mlps) == len(assistant.model.layers)
    attns = {id(layer.self_attn.qkv_proj): layer.self_attn for layer in assistant.model.layers}
    assert attns and all(sl.drops_kv(a) and a.kv_size > 0 for a in attns.values())  # bound KV-shared, as served
    loop, steps = _loop(assistant, 3)
    inp = _inputs(assistant, 3, 21)
    fb = loop.forward_batch(3)

    def hidden_after_one_step(tokens, positions, hidden):  # the layers' output; the head's picks can flip on a tie
        fb.spec_info.hidden_states = hidden
        return assistant.forward(tokens, positions, fb).hidden_states

    with loop.context():
        want, want_hidden = steps(*inp), hidden_after_one_step(*inp)
    try:
        assert sl.install(assistant) == len(linears) == sl.install(assistant)  # idempotent: nothing wrapped twice
        assert all(not hasattr(getattr(vars(m.quant_method)["apply"], sl._MARK), sl._MARK) for m in linears)
        g = torch.Generator().manual_seed(5)
        for layer in linears:
            w = layer.weight
            # a KV-shared layer's qkv_proj holds k/v rows its checkpoint never wrote (torch.empty; sglang computes
            # and drops them): only rows with loaded-looking values are compared
            loaded = torch.isfinite(w.float()).all(1) & (w.float().abs().amax(1) < 1e3)
            assert loaded.float().mean() > 0.2, layer
            attn = attns.get(id(layer))
            # a KV-shared qkv projection: the query's columns alone are computed, from the query's rows alone
            cols = torch.arange(w.shape[0]) < attn.q_size if attn is not None else loaded
            assert (cols <= loaded).all() and cols.any(), layer
            for rows in (1, 3, 8):
                x = torch.randn(rows, w.shape[1], generator=g).to(DTYPE)
                before = calls["linear"]
                out = layer.quant_method.apply(layer, x)
                assert out.shape == (rows, w.shape[0]), layer
                got = out[:, cols]
                ref = x.double() @ w[cols].double().T
                step = torch.finfo(DTYPE).eps * ref.abs().clamp(min=2.0**-14)
                assert calls["linear"] == before + 1 and ((got.double() - ref).abs() <= step).all(), layer
                read = weights_read[-1]
                rows_read = attn.q_size if attn is not None else w.shape[0]
                assert read.data_ptr() == w.data_ptr() and read.shape[0] == rows_read, layer
            x = torch.randn(9, w.shape[1], generator=g).to(DTYPE)  # above kernel_rows: sglang's own path
            before = calls["linear"]
            same = dict(rtol=0, atol=0, equal_nan=True)  # bit for bit, the never-written rows' NaNs included
            torch.testing.assert_close(layer.quant_method.apply(layer, x), torch.nn.functional.linear(x, w), **same)
            bias = torch.randn(w.shape[0], generator=g).to(DTYPE)  # a bias: sglang's own path too
            torch.testing.assert_close(layer.quant_method.apply(layer, x[:2], bias),
                                       torch.nn.functional.linear(x[:2], w, bias), **same)
            assert calls["linear"] == before
        attn = next(iter(attns.values()))  # the query-rows route traced whole (Dynamo + AOT): the same query columns
        qkv = attn.qkv_proj
        x = torch.randn(4, qkv.weight.shape[1], generator=g).to(DTYPE)
        traced = torch.compile(lambda x: qkv.quant_method.apply(qkv, x), backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(traced(x)[:, :attn.q_size], qkv.quant_method.apply(qkv, x)[:, :attn.q_size],
                                   rtol=0, atol=0)
        for mlp in mlps:
            x = torch.randn(4, mlp.gate_up_proj.weight.shape[1], generator=g).to(DTYPE)
            before = dict(calls)
            got = mlp(x)
            gate, up = (x.double() @ mlp.gate_up_proj.weight.double().T).chunk(2, dim=-1)
            ref = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ mlp.down_proj.weight.double().T
            assert calls["gate_up"] == before["gate_up"] + 1 and calls["linear"] == before["linear"] + 1
            assert (got.double() - ref).norm() / ref.norm() < 1e-2
        before = dict(calls)
        with loop.context():
            got = hidden_after_one_step(*inp)
        assert calls["gate_up"] == before["gate_up"] + len(mlps) and calls["linear"] > before["linear"] + len(mlps)
        assert (got.double() - want_hidden.double()).norm() / want_hidden.double().norm() < 2e-2
    finally:
        sl.restore(assistant)
    assert all("apply" not in vars(m.quant_method) or not hasattr(vars(m.quant_method)["apply"], sl._MARK)
               for m in linears) and all("forward" not in vars(m) for m in mlps)
    with loop.context():
        again = steps(*inp)
    for w, o in zip(want, again):
        assert torch.equal(o, w)


def test_graphcap_projections_stand_down_where_sglang_routes_bf16_gemms(assistant, monkeypatch):
    """Under sglang's batch-invariant mode (or another bf16 GEMM backend) install routes nothing and says why."""
    import sglang.srt.batch_invariant_ops as bio
    from sglang.srt.layers.quantization import unquant

    from graphcap.sglang import linear as sl

    assert sl.sglang_routes_bf16_elsewhere() is None
    monkeypatch.setattr(unquant, "get_bf16_gemm_backend", lambda: unquant.Bf16GemmBackend.TORCH)
    assert sl.sglang_routes_bf16_elsewhere() == "sglang's bf16 GEMM backend is torch"
    monkeypatch.delattr(unquant, "get_bf16_gemm_backend")  # another sglang layout: leave its GEMMs alone
    assert "could not be read (AttributeError" in sl.sglang_routes_bf16_elsewhere()
    monkeypatch.undo()
    monkeypatch.setattr(bio, "is_batch_invariant_mode_enabled", lambda: True)
    assert "batch-invariant" in sl.sglang_routes_bf16_elsewhere()
    assert sl.install(assistant) == 0
    assert not any(sl._shadowed(m.quant_method, "apply") for m in assistant.modules()
                   if getattr(m, "quant_method", None) is not None)
