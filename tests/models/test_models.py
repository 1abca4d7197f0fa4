"""The reference draft loop against a float64 rebuild written from scratch, and the sglang-style rebuild baseline
against graphcap's in-place loop (same kernels, same state: identical tokens)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from graphcap.bench.baselines import RebuildBaseline
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.models.draft_ops import SKINNY_OPS, TORCH_OPS
from graphcap.models.fused_op_set import fused_ops
from graphcap.spec import load_spec
from graphcap.bench.state import make_target_state
from graphcap.window import WindowBuffers
from random_norms import random_norm_draft

# the model and the loop around the kernels are the point here; the kernels are test_window.py's and
# test_decode_attention.py's: the torch twins on CPU
pytestmark = pytest.mark.usefixtures("cpu_twins")


def build(spec, seq_lens, device, seed=0, capacity=None):
    st = make_target_state(spec, seq_lens, capacity, seed=seed, device=device)
    wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
    wb.reset(st.slots.tolist(), seq_lens)
    model = FrozenKVDraft(spec, seed=seed + 1, device=device)
    return st, wb, DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full)


# ---------------------------------------------------------------------------------------------------------------
# An independent float64 reference: reads the model's weights, but does every step of the math itself, and gathers
# each row's K/V straight from req_to_token (no window ring, no kernels).


def _norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())


def _rope(q, pos, theta):
    d = q.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    q1, q2 = q[..., : d // 2], q[..., d // 2:]
    return torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], -1)


def reference_iteration(loop: DraftLoop, st, lens: list[int], tokens, hidden):
    m, spec = loop.model, loop.model.spec
    P = {n: p.detach().cpu().double() for n, p in m.named_parameters()}
    r2t, f2s = st.req_to_token.cpu().long(), st.full_to_swa.cpu()
    pools = {"sliding": (st.k_swa.cpu().double(), st.v_swa.cpu().double()),
             "full": (st.k_full.cpu().double(), st.v_full.cpu().double())}
    slots = st.slots.cpu().tolist()
    pos = torch.tensor([max(n - 1, 0) for n in lens])
    toks, scores, margins = [], [], []
    tok, h = tokens.cpu(), hidden.cpu().double()
    for _ in range(loop.steps):
        x = torch.cat([P["embed"][tok] * math.sqrt(spec.target.hidden), h], -1) @ P["pre_proj"].t()
        for i, lt in enumerate(spec.draft.layers):
            p = lambda n: P[f"layers.{i}.{n}"]  # noqa: E731
            shape = spec.attention(lt)
            q = (_norm(x, p("input_norm.weight")) @ p("q_proj").t()).view(len(slots), spec.draft.heads, shape.head_dim)
            q = _rope(_norm(q, p("q_norm.weight")), pos, 10_000.0 if lt == "sliding" else 1_000_000.0)
            k_pool, v_pool = pools[lt]
            group = spec.draft.heads // shape.kv_heads
            att = torch.zeros_like(q)
            for r, (s, n) in enumerate(zip(slots, lens)):
                lo = max(0, n - spec.window) if lt == "sliding" else 0
                locs = r2t[s, lo:n]
                if lt == "sliding":
                    locs = f2s[locs]
                if n == 0:
                    continue
                k = k_pool[locs].repeat_interleave(group, dim=1)  # [n, H, D]
                v = v_pool[locs].repeat_interleave(group, dim=1)
                w = torch.softmax(torch.einsum("hd,nhd->hn", q[r], k) * shape.head_dim ** -0.5, -1)
                att[r] = torch.einsum("hn,nhd->hd", w, v)
            x = x + _norm(att.reshape(len(slots), -1) @ p("o_proj").t(), p("post_attn_norm.weight"))
            gate, up = (_norm(x, p("pre_mlp_norm.weight")) @ p("gate_up").t()).chunk(2, -1)
            x = x + _norm((torch.nn.functional.gelu(gate, approximate="tanh") * up) @ p("down").t(), p("post_mlp_norm.weight"))
        x = _norm(x, P["final_norm.weight"])
        d = spec.draft
        top = (x @ P["centroids"].t()).topk(d.centroid_top_k, -1).indices
        cand = m.token_of_cluster.cpu()[top].flatten(1)
        rows = P["lm_head"].view(d.centroids, d.vocab // d.centroids, -1)[top].flatten(1, 2)
        logits = torch.einsum("bnh,bh->bn", rows, x)
        best = logits.topk(2, -1)
        tok = cand.gather(1, best.indices[:, :1])[:, 0]
        toks.append(tok)
        scores.append(best.values[:, 0])
        margins.append(best.values[:, 0] - best.values[:, 1])
        h = x @ P["post_proj"].t()
    return torch.stack(toks, 1), torch.stack(scores, 1), torch.stack(margins, 1), h


@pytest.mark.parametrize("seed", [0, 1])
def test_draft_loop_matches_float64_reference(device, seed):
    spec = load_spec("tiny")  # W = 16: lengths below, at and far past the window, and length 1
    lens0 = [1, 5, 16, 40, 97, 3]
    st, wb, loop = build(spec, lens0, device, seed=seed)
    g = torch.Generator().manual_seed(seed)
    accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=g)
    tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=g)
    hidden = torch.randn(len(lens0), spec.target.hidden, generator=g)
    out = loop(st.slots, accepted.to(device), tokens.to(device), hidden.to(device))
    lens = [n + a for n, a in zip(lens0, accepted.tolist())]
    assert wb.seq_lens[st.slots].tolist() == lens
    ref_tok, ref_score, ref_margin, ref_h = reference_iteration(loop, st, lens, tokens, hidden)
    torch.testing.assert_close(out.scores.cpu().double(), ref_score, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden.cpu().double(), ref_h, rtol=1e-3, atol=1e-3)
    decided = ref_margin > 1e-3  # near-ties may flip under fp32 rounding
    assert decided.float().mean() > 0.8
    assert torch.equal(out.tokens.cpu()[decided], ref_tok[decided])


@pytest.mark.parametrize("graphed", [False, True])
def test_rebuild_baseline_gives_identical_tokens(device, graphed):
    """sglang-style rebuild + sync + steps vs graphcap's in-place advance: bit-identical, iteration after iteration."""
    spec = load_spec("tiny")
    lens0 = [3, 17, 30, 64, 8]
    st_a, wb_a, loop_a = build(spec, lens0, device, seed=4, capacity=[n + 40 for n in lens0])
    st_b, wb_b, loop_b = build(spec, lens0, device, seed=4, capacity=[n + 40 for n in lens0])
    base = RebuildBaseline(loop_b, graphed=graphed, buckets=(2, 8))
    base.capture()
    graphcap = loop_a
    if graphed:  # same bucket padding on both sides: batch shape changes GEMM rounding
        graphcap = DraftGraphs.for_loop(loop_a, CaptureOptions(backend="cudagraph" if device == "cuda" else "eager",
                                                               buckets=(2, 8), manifest_path=None))
        graphcap.capture()
        graphcap = graphcap.run
    g = torch.Generator().manual_seed(9)
    for it in range(6):
        accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=g).to(device)
        tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=g).to(device)
        hidden = torch.randn(len(lens0), spec.target.hidden, generator=g).to(device)
        a = graphcap(st_a.slots, accepted, tokens, hidden)
        b = base.run(st_b.slots, accepted, tokens, hidden)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"iteration {it}"
        assert torch.equal(wb_a.ring, wb_b.ring) and torch.equal(wb_a.seq_lens, wb_b.seq_lens)
    assert base.syncs == 6


def test_padding_rows_change_nothing(device):
    """Rows pointing at the padding slot with accepted = 0 leave every live row's result and all buffers as they were."""
    spec = load_spec("tiny")
    lens0 = [9, 33, 2]
    st_a, wb_a, loop_a = build(spec, lens0, device, seed=2)
    st_b, wb_b, loop_b = build(spec, lens0, device, seed=2)
    g = torch.Generator().manual_seed(1)
    accepted = torch.randint(0, 4, (3,), generator=g).to(device)
    tokens = torch.randint(0, spec.draft.vocab, (3,), generator=g).to(device)
    hidden = torch.randn(3, spec.target.hidden, generator=g).to(device)
    pad = 5
    slots_p = torch.cat([st_b.slots, torch.full((pad,), wb_b.padding_slot, device=device)])
    acc_p = torch.cat([accepted, torch.zeros(pad, dtype=accepted.dtype, device=device)])
    tok_p = torch.cat([tokens, torch.randint(0, spec.draft.vocab, (pad,), generator=g).to(device)])
    hid_p = torch.cat([hidden, torch.randn(pad, spec.target.hidden, generator=g).to(device)])
    a = loop_a(st_a.slots, accepted, tokens, hidden)
    b = loop_b(slots_p, acc_p, tok_p, hid_p)
    assert torch.isfinite(b.scores).all() and torch.isfinite(b.hidden).all()
    torch.testing.assert_close(a.scores, b.scores[:3], rtol=1e-5, atol=1e-5)
    assert torch.equal(wb_a.ring, wb_b.ring) and torch.equal(wb_a.seq_lens, wb_b.seq_lens)
    assert int(wb_b.seq_lens[wb_b.padding_slot]) == 0


def test_layer_regions_trace_one_body_per_layer_shape_and_draft_the_same(device):
    """DraftLoop(layer_regions=True): under Dynamo every draft layer of every step is one invoke_subgraph call, with
    one traced body per layer shape (the sliding layers share one, the full layer has its own), and the traced
    function, run eagerly, drafts bit for bit what the loop without regions drafts on a twin state (tokens, scores,
    margins, hidden, windows). Dynamo only (a backend that records the graph and runs it eagerly): Inductor's code
    for the regions is tests/engine/test_capture_gpu.py's."""
    spec = load_spec("tiny")
    lens = [9, 33, 2, 40]
    (st_a, wb_a, plain), (st_b, wb_b, _) = build(spec, lens, device, seed=4), build(spec, lens, device, seed=4)
    regions = DraftLoop(plain.model, wb_b, st_b.k_swa, st_b.v_swa, st_b.k_full, st_b.v_full, layer_regions=True)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    traced = torch.compile(regions, backend=record, fullgraph=True)
    g = torch.Generator().manual_seed(6)
    for _ in range(2):  # the second call reuses the trace: the windows moved, nothing else did
        accepted = torch.randint(1, spec.capture.steps + 2, (4,), generator=g).to(device)
        tokens = torch.randint(0, spec.draft.vocab, (4,), generator=g).to(device)
        hidden = torch.randn(4, spec.target.hidden, generator=g).to(device)
        want = plain(st_a.slots, accepted, tokens, hidden)
        got = traced(st_b.slots, accepted, tokens, hidden)
        for x, y, field in zip(got, want, want._fields):
            assert torch.equal(x, y), field
        assert torch.equal(wb_a.ring, wb_b.ring) and torch.equal(wb_a.seq_lens, wb_b.seq_lens)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    assert len(calls) == spec.capture.steps * len(spec.draft.layers)
    bodies = {n.args[0].target for n in calls}  # get_attr of the traced subgraph each call runs
    assert len(bodies) == len(set(spec.draft.layers)) == 2
    torch._dynamo.reset()


class _Calls:
    """graphcap.kernels.elementwise.fused_ops, counting the calls of each function."""

    def __init__(self, mod):
        self.mod, self.calls = mod, {}

    def __getattr__(self, name):
        fn = getattr(self.mod, name)

        def counted(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **k)
        return counted


@pytest.mark.parametrize("sglang_post_norm", [True, False], ids=["sglang-post-norm", "three-kernel-post-norm"])
def test_fused_op_set_drafts_what_the_torch_ops_draft(device, sglang_post_norm):
    """The sglang op set (one fused kernel per norm, add-norm, gelu-mul, rotary; sglang's own post-MLP kernel) on the
    reference's model: the same logits (float32 tiny spec, tight tolerance) and the same draft tokens, over
    iterations that slide the windows. Norm weights and layer scalars are random, so (1 + w), the residual order and
    the scalar are all checked; on a CPU the Triton kernels run in Triton's interpreter."""
    if sglang_post_norm:
        pytest.importorskip("sglang.kernels.ops.layernorm.gemma4_fused_ops")
    lens0 = [1, 5, 16, 40, 70, 3]
    spec, st, model = random_norm_draft(device, lens0)
    ops = fused_ops(sglang_post_norm=sglang_post_norm)
    assert (ops.post_norm is not None) == sglang_post_norm
    counted = _Calls(ops.mod)
    ops = dataclasses.replace(ops, mod=counted)
    logits: dict[str, list[torch.Tensor]] = {"torch": [], "fused": []}
    outs: dict[str, list] = {"torch": [], "fused": []}
    for name, op_set in (("torch", TORCH_OPS), ("fused", ops)):
        wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
        wb.reset(st.slots.tolist(), lens0)
        loop = DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full, ops=op_set)
        head = model.head
        model.head = lambda x, *rest, name=name: (logits[name].append(x @ model.lm_head.t()), head(x, *rest))[1]
        try:
            g = torch.Generator().manual_seed(9)
            for _ in range(3):
                accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=g).to(device)
                tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=g).to(device)
                hidden = torch.randn(len(lens0), spec.target.hidden, generator=g).to(device)
                outs[name].append(loop(st.slots, accepted, tokens, hidden))
        finally:
            del model.head
    assert len(logits["fused"]) == len(logits["torch"]) == 3 * spec.capture.steps
    for a, b in zip(logits["fused"], logits["torch"]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    for a, b in zip(outs["fused"], outs["torch"]):
        torch.testing.assert_close(a.scores, b.scores, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=2e-5, atol=2e-5)
        decided = b.margins > 1e-3
        assert decided.float().mean() > 0.8
        assert torch.equal(a.tokens[decided], b.tokens[decided])
    # one fused call per op: per step and layer 3 norms (input, q, post-attention), 1 add-norm, 1 gelu-mul,
    # 1 rotary, the post-MLP norm (a 4th norm call without sglang's kernel); the final norm once per step
    n = 3 * spec.capture.steps
    layers = n * len(spec.draft.layers)
    assert counted.calls == {"gemma_rmsnorm": 3 * layers + n + (0 if sglang_post_norm else layers),
                             "gemma_fused_add_rmsnorm": layers, "gelu_tanh_and_mul": layers,
                             "apply_rope_with_cos_sin_cache_inplace": layers}



def test_skinny_gemm_op_set_runs_every_projection_through_the_kernel_and_drafts_the_same(device, monkeypatch):
    """SKINNY_OPS (the bench's graphcap-skinny-gemm): every projection of a bf16 model goes through
    graphcap.kernels.gemm.skinny - per step pre_proj, q / o / down of each layer, the centroid scores with post_proj
    (one call, merge_head_proj) as skinny_linear, each layer's gate/up with its gelu-mul as skinny_gate_up_gelu - and
    it drafts as close to the
    float32 model (same seed) as the bf16 cuBLAS set does: the first step's tokens wherever the float32 margin is
    clear, and on rows whose every token agrees, a last hidden state within 1.5x the cuBLAS set's bf16 error. A
    float32 model keeps cuBLAS (the kernel is bf16/fp16 only). (The kernel's own accuracy: test_skinny_gemm.py.)"""
    import graphcap.models.draft_ops as draft_ops

    calls = {"skinny_linear": 0, "skinny_gate_up_gelu": 0}
    for name in calls:
        fn = getattr(draft_ops, name)
        monkeypatch.setattr(draft_ops, name, lambda *a, _fn=fn, _n=name, **k: (calls.__setitem__(_n, calls[_n] + 1),
                                                                               _fn(*a, **k))[1])
    spec = load_spec("tiny")
    lens0 = [1, 5, 16, 40, 70, 3, 9, 30]
    st = make_target_state(spec, lens0, [n + 20 for n in lens0], seed=11, device=device)
    per_step = {"skinny_linear": 2 + 3 * len(spec.draft.layers), "skinny_gate_up_gelu": len(spec.draft.layers)}
    outs = {}
    for dtype, ops in ((torch.float32, TORCH_OPS), (torch.float32, SKINNY_OPS), (torch.bfloat16, TORCH_OPS),
                       (torch.bfloat16, SKINNY_OPS)):
        calls.update({k: 0 for k in calls})
        model = FrozenKVDraft(spec, seed=12, device=device, dtype=dtype)
        wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
        wb.reset(st.slots.tolist(), lens0)
        pools = (st.k_swa, st.v_swa, st.k_full, st.v_full)
        loop = DraftLoop(model, wb, *(t.to(dtype) for t in pools), ops=ops)
        g = torch.Generator().manual_seed(13)
        accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=g).to(device)
        tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=g).to(device)
        hidden = torch.randn(len(lens0), spec.target.hidden, generator=g).to(device, dtype)
        outs[dtype, ops.name] = loop(st.slots, accepted, tokens, hidden)
        skinny = ops is SKINNY_OPS and dtype == torch.bfloat16
        assert calls == ({k: v * spec.capture.steps for k, v in per_step.items()} if skinny else
                         {k: 0 for k in calls}), (dtype, ops.name)
    ref = outs[torch.float32, TORCH_OPS.name]
    for a, b in zip(outs[torch.float32, SKINNY_OPS.name], ref):
        if device == "cpu":  # float32: the same math in the same order (the layer kernels' twins, cuBLAS's)
            assert torch.equal(a, b)
        else:  # the layer kernels and the merged head GEMM round float32 in another order than torch's ops
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, equal_nan=True)
    decided = ref.margins[:, 0] > 0.05  # bf16 rounds logits of this size by ~0.01
    assert decided.sum() >= 2
    err = {}
    for name in (TORCH_OPS.name, SKINNY_OPS.name):
        out = outs[torch.bfloat16, name]
        assert torch.equal(out.tokens[decided, 0], ref.tokens[decided, 0]), name
        same = (out.tokens == ref.tokens).all(1)
        assert same.float().mean() >= 0.5, name
        h, hr = out.hidden[same].float(), ref.hidden[same]
        err[name] = float(((h - hr).norm(dim=-1) / hr.norm(dim=-1)).max())
    assert 0 < err[SKINNY_OPS.name] <= 1.5 * err[TORCH_OPS.name], err


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_head_projection_is_post_proj_and_the_centroid_scores(device, monkeypatch, seed):
    """merge_head_proj (the default set): post_proj and the centroid scores, which read the same final-norm rows, as
    one projection over the stacked weights. The model's two parameters are views of that one tensor (an in-place
    update of either is what the merged projection reads), and the loop drafts what the same set without the merge
    drafts - tokens, scores, margins and hidden states to fp32 rounding - with one projection fewer per step."""
    import graphcap.models.draft_ops as draft_ops
    from graphcap.models.draft_ops import DEFAULT_OPS

    spec = load_spec("tiny")
    lens0 = [1, 5, 16, 40, 70, 3]
    st = make_target_state(spec, lens0, [n + 20 for n in lens0], seed=seed, device=device)
    model = FrozenKVDraft(spec, seed=seed + 1, device=device)
    ht = spec.target.hidden
    both = model.post_proj_and_centroids
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # updated in place through the parameters: the stacked tensor holds the new values
        model.post_proj.add_(0.1 * torch.randn(model.post_proj.shape, generator=g).to(device))
        model.centroids.mul_(1 + torch.rand(model.centroids.shape, generator=g).to(device))
    assert torch.equal(both[:ht], model.post_proj) and torch.equal(both[ht:], model.centroids)

    projections = []
    linear = draft_ops.TorchOps.linear
    monkeypatch.setattr(draft_ops.TorchOps, "linear",
                        lambda self, x, w: (projections.append((w.data_ptr(), tuple(w.shape))), linear(self, x, w))[1])
    outs = {}
    assert DEFAULT_OPS.merge_head_proj
    for ops in (DEFAULT_OPS, dataclasses.replace(DEFAULT_OPS, merge_head_proj=False)):
        projections.clear()
        outs[ops.merge_head_proj] = _draft_once(spec, st, model, lens0, ops, seed + 3)
        head = {both.data_ptr(), model.centroids.data_ptr()}  # post_proj starts where the stacked tensor does
        heads = [p for p in projections if p[0] in head]
        per_step = [(both.data_ptr(), tuple(both.shape))] if ops.merge_head_proj else [
            (model.centroids.data_ptr(), tuple(model.centroids.shape)),
            (model.post_proj.data_ptr(), tuple(model.post_proj.shape))]
        assert heads == per_step * spec.capture.steps, ops.merge_head_proj
    _assert_drafts_agree(outs[True], outs[False])


def _draft_once(spec, st, model, lens0, ops, seed):
    """One iteration of a fresh loop with `ops` over windows at `lens0`, on random inputs from `seed`."""
    device = st.slots.device
    wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
    wb.reset(st.slots.tolist(), lens0)
    loop = DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full, ops=ops)
    gi = torch.Generator().manual_seed(seed)
    accepted = torch.randint(1, spec.capture.steps + 2, (len(lens0),), generator=gi).to(device)
    tokens = torch.randint(0, spec.draft.vocab, (len(lens0),), generator=gi).to(device)
    hidden = torch.randn(len(lens0), spec.target.hidden, generator=gi).to(device)
    return loop(st.slots, accepted, tokens, hidden)


def _assert_drafts_agree(a, b):
    """The same math computed two ways: the same tokens on every row whose decisions are clear (at least half the
    rows), scores and hidden states there to fp32 rounding."""
    clear = (b.margins > 1e-3).all(1)
    assert clear.sum() >= len(clear) // 2
    assert torch.equal(a.tokens[clear], b.tokens[clear])
    for name in ("scores", "hidden"):
        torch.testing.assert_close(getattr(a, name)[clear], getattr(b, name)[clear], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("seed", [0, 1])
def test_query_norm_in_the_attention_or_as_its_own_kernel_drafts_the_same(device, monkeypatch, seed):
    """q_norm_in_attention (the default set): the query's norm + rotary inside the attention's split kernel; off
    (QNORM_KERNEL_OPS, the bench's graphcap-qnorm-kernel) the norm_rope kernel runs before the attention, once per
    layer call, and the attention takes the normed query. The same math and roundings either way: the loop drafts
    the same tokens, and scores, margins and hidden states to fp32 rounding."""
    import graphcap.kernels.elementwise.layer_fusions as lf
    from graphcap.models.draft_ops import DEFAULT_OPS, QNORM_KERNEL_OPS

    calls = []
    norm_rope = lf.norm_rope
    monkeypatch.setattr(lf, "norm_rope", lambda *a, **k: (calls.append(a[0].shape), norm_rope(*a, **k))[1])
    spec = load_spec("tiny")
    lens0 = [1, 5, 16, 40, 70, 3]
    st = make_target_state(spec, lens0, [n + 20 for n in lens0], seed=seed, device=device)
    model = FrozenKVDraft(spec, seed=seed + 1, device=device)
    outs = {}
    for ops in (DEFAULT_OPS, QNORM_KERNEL_OPS):
        calls.clear()
        outs[ops.q_norm_in_attention] = _draft_once(spec, st, model, lens0, ops, seed + 3)
        want = [] if ops.q_norm_in_attention else [
            (len(lens0), spec.draft.heads, spec.attention(lt).head_dim) for lt in spec.draft.layers]
        assert calls == want * spec.capture.steps, ops.name
    _assert_drafts_agree(outs[True], outs[False])


def test_default_op_set_routes_each_projection_by_its_shape_class(monkeypatch):
    """The default set (LAYER_KERNEL_OPS) hands a bf16 projection to the skinny GEMM with cublas_above = its shape
    class's KERNEL_ROWS (capped by skinny_rows), and a class with 0 rows, a float32 input or more than MAX_M rows
    straight to cuBLAS (no op at all); the other sets keep their fixed rule. Whatever the route, the result is the
    projection (the ops' twins here)."""
    import graphcap.kernels.gemm.skinny as sg
    import graphcap.models.draft_ops as draft_ops
    from graphcap.models.draft_ops import LAYER_KERNEL_OPS, SKINNY_4ROWS_OPS

    seen = []
    for name in ("skinny_linear", "skinny_gate_up_gelu"):
        fn = getattr(draft_ops, name)
        monkeypatch.setattr(draft_ops, name, lambda x, w, _fn=fn, _n=name, **k: (seen.append((_n, k["cublas_above"])),
                                                                                 _fn(x, w, **k))[1])
    monkeypatch.setattr(sg, "KERNEL_ROWS", {"wide": 8, "gated": 2, "narrow": 0})
    g = torch.Generator().manual_seed(5)
    wide, narrow = torch.randn(sg.NARROW_N, 24, generator=g), torch.randn(40, 24, generator=g)
    gated = torch.randn(2 * 48, 24, generator=g)
    for rows, dtype in ((3, torch.bfloat16), (3, torch.float32), (sg.MAX_M + 1, torch.bfloat16)):
        x = torch.randn(rows, 24, generator=g).to(dtype)
        for ops, want in ((LAYER_KERNEL_OPS, [("skinny_linear", 8), ("skinny_gate_up_gelu", 2)]),
                          (SKINNY_4ROWS_OPS, [("skinny_linear", 4), ("skinny_linear", 4), ("skinny_gate_up_gelu", 4)]),
                          (TORCH_OPS, [])):
            seen.clear()
            outs = [ops.linear(x, wide.to(dtype)), ops.linear(x, narrow.to(dtype)),
                    ops.gate_up_gelu(x, gated.to(dtype))]
            assert seen == (want if dtype == torch.bfloat16 and rows <= sg.MAX_M else []), (ops.name, rows, dtype)
            for got, w in zip(outs[:2], (wide, narrow)):
                torch.testing.assert_close(got.float(), (x @ w.to(dtype).t()).float(), rtol=2e-2, atol=2e-2)


def test_binding_an_op_set_with_the_skinny_gemm_makes_its_split_k_counters(monkeypatch):
    """A loop whose op set sends projections to the skinny GEMM makes the one-kernel split K's counters on the
    model's device when it binds - before anything compiles or captures (a call never makes them: inside a graph's
    warm-up they would come from the graph's memory pool); the torch set, which never calls the kernel, makes none."""
    import graphcap.kernels.gemm.skinny_kernels as sgk
    from graphcap.models.draft_ops import LAYER_KERNEL_OPS

    spec = load_spec("tiny")
    for ops, made in ((TORCH_OPS, False), (LAYER_KERNEL_OPS, True)):
        monkeypatch.setattr(sgk, "_counters", {})
        st = make_target_state(spec, [3, 7], [10, 10], seed=1)
        wb = WindowBuffers.from_spec(spec, st.req_to_token, st.full_to_swa)
        DraftLoop(FrozenKVDraft(spec, seed=2), wb, st.k_swa, st.v_swa, st.k_full, st.v_full, ops=ops)
        assert (sgk.fixup_counters(torch.device("cpu"), 1) is not None) == made, ops.name


def test_fused_post_norm_weight_unbound_is_an_error_and_refresh_follows_in_place_updates():
    """The (1 + w) tensors sglang's post-MLP kernel reads are made at bind, keyed by the weight: a weight bind never
    saw is an error naming what was bound (never a silent three-kernel fallback); an in-place update of a bound
    weight is picked up by refresh(), in place."""
    spec = load_spec("tiny")
    model = FrozenKVDraft(spec, seed=7)
    calls = []

    def post_norm(x, w1, residual, scalar, eps):
        calls.append(w1)
        return x

    ops = dataclasses.replace(fused_ops(sglang_post_norm=False), post_norm=post_norm).bind(model)
    x = torch.randn(2, spec.draft.hidden)
    w = model.layers[1].post_mlp_norm.weight
    ops.norm_add_scale(x, w, x, torch.ones(()))
    table = calls[-1]
    assert table is ops.tables["post_mlp_norm_1"] and torch.equal(table, 1.0 + w.float())
    with torch.no_grad():
        w.add_(0.25)
    assert not torch.equal(table, 1.0 + w.float())  # stale until refresh
    ops.refresh()
    ops.norm_add_scale(x, w, x, torch.ones(()))
    assert calls[-1] is table and torch.equal(table, 1.0 + w.float())  # the same tensor, new values
    stranger = torch.zeros_like(w)
    with pytest.raises(RuntimeError, match=r"post-MLP norm weight \(32,\) torch.float32 was not bound .*"
                                           r"layers.0.post_mlp_norm.weight"):
        ops.norm_add_scale(x, stranger, x, torch.ones(()))

def test_bad_state_and_loop_arguments_are_named():
    spec = load_spec("tiny")
    with pytest.raises(ValueError, match=r"1 capacities for 3 seq_lens"):
        make_target_state(spec, [5, 6, 7], [40])
    with pytest.raises(ValueError, match=r"slots \[1, 1\] must be 2 distinct values"):
        make_target_state(spec, [5, 6], slots=[1, 1])
    st, wb, loop = build(spec, [5, 9], "cpu")
    with pytest.raises(ValueError, match=r"k_full must be \[pool, 1, 32\]"):
        DraftLoop(loop.model, wb, st.k_swa, st.v_swa, st.k_swa, st.v_full)
    with pytest.raises(ValueError, match=r"layer_regions must be True or False, got 'no'"):
        DraftLoop(loop.model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full, layer_regions="no")
