"""One attention plan per bucket (graphcap.kernels.attention.plan.plan_attention): it decides exactly what the
per-call planning decided (split counts, launch configuration, wave), and it is made on the host before capture -
a compiled draft step (the reference loop, one compile per bucket or one for every bucket, and the sglang plugin's
attention) calls no planner while it is traced or run."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

import graphcap.kernels.attention.decode as attn
import graphcap.kernels.attention.plan as ap
from graphcap.kernels import twins_on_cpu
from graphcap.kernels.arch import device_arch
from graphcap.kernels.attention.plan import (
    AttentionError,
    AttentionPlan,
    choose_num_splits,
    default_config,
    plan_attention,
    plan_config,
    target_programs,
    wave_splits,
)
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.spec import load_spec
from graphcap.bench.state import make_target_state
from graphcap.window import WindowBuffers
from tiers import thorough

SPEC = load_spec("tiny")
# Every function that plans (and the device queries behind them), by module: attention.py re-exports some.
PLANNERS = ("plan_attention", "choose_num_splits", "target_programs", "default_config", "plan_config",
            "wave_splits", "splits_for", "device_sm_count", "plan_for_inputs")


def forbid_planning(monkeypatch) -> list[str]:
    """Make every planner raise (and record its name) from now on."""
    called: list[str] = []

    def trap(name):
        def f(*a, **k):
            called.append(name)
            raise AssertionError(f"planner {name} called after planning")
        return f

    for mod in (ap, attn):
        for name in PLANNERS:
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, trap(name))
    return called


def _old_plan(batch, kv_heads, head_dim, dtype, device):
    """What the per-call path computed (verbatim): the launch config (`_config_for`), the programs and the wave
    (`decode_kernels.launch`)."""
    on_gpu = device.type == "cuda"
    cfg = default_config(head_dim, dtype, on_gpu, smem_bytes=device_arch(device).smem_per_block if on_gpu else None)
    programs = cfg.wave or target_programs(head_dim, dtype, device)
    return cfg, programs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_plan_equals_what_the_per_call_path_computed(device, dtype):
    """Over a grid of (batch, kv heads, head dim, max_len): the plan's split count is the sglang plugin's old
    `splits_for` and the reference model's old `choose_num_splits(batch or grid batch 1, Hkv, max_len,
    target_programs)` (wherever those two agreed: all but fp32 at head dim 512); its launch configuration, programs
    and wave are what `decode_kernels.launch` derived per call."""
    dev = torch.device(device)
    for b, hkv, d, n in itertools.product((1, 2, 3, 5, 8, 16, 32, 64, 256), (1, 2, 4, 8, 16), (64, 128, 256, 512),
                                          (1, 16, 100, 1024, 2048, 8192, 32768, 262144)):
        plan = plan_attention(b, hkv, d, dtype, dev, n)
        cfg, programs = _old_plan(b, hkv, d, dtype, dev)
        model_splits = choose_num_splits(b, hkv, n, target_programs(d, dtype, dev))
        split_cfg = plan_config(d, dtype, dev)
        sglang_splits = choose_num_splits(b, hkv, n, target_programs(d, dtype, dev), split_cfg.max_chunk,
                                          split_cfg.min_chunk)
        assert plan.num_splits == sglang_splits, (b, hkv, d, n)
        # The model's rule took min_chunk 64 / max_chunk 1024 as given; the plan takes them from the configuration
        # the split rule assumes - the same numbers except where shared memory forces 16-key tiles (fp32 at D = 512)
        if (split_cfg.min_chunk, split_cfg.max_chunk) == (64, 1024):
            assert plan.num_splits == model_splits, (b, hkv, d, n)
        else:
            assert dtype == torch.float32 and d == 512
        assert (plan.block_n, plan.num_warps, plan.num_stages, plan.min_chunk, plan.max_chunk,
                plan.combine_warps) == (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.min_chunk, cfg.max_chunk,
                                        cfg.combine_warps)
        assert plan.programs == programs
        assert plan.wave == min(plan.num_splits, wave_splits(b, hkv, programs))
        # one plan for every batch: batch 1's split count as the bound, the wave left to the kernel, and the grid of
        # each batch its own plan's
        anyb = plan_attention(None, hkv, d, dtype, dev, n)
        assert anyb.num_splits == plan_attention(1, hkv, d, dtype, dev, n).num_splits and anyb.wave == 0
        assert anyb.launch_args()[1:-2] == plan_attention(1, hkv, d, dtype, dev, n).launch_args()[1:-2]
        assert anyb.grid_splits(b, hkv) == plan.num_splits, (b, hkv, d, n)
        assert plan.grid_splits(b, hkv) == plan.num_splits and anyb.min_splits == plan.min_splits


def test_grid_splits_of_a_symbolic_batch_is_the_rule_at_every_batch():
    """Under one compile for every bucket the batch is a SymInt: the grid's split count is then an expression of
    it (no guard), and that expression gives each batch exactly what a plan made for that batch gives."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    batch = env.create_unbacked_symint()
    cpu = torch.device("cpu")
    for hkv, d, n, dtype in itertools.product((1, 4, 16), (256, 512), (16, 1024, 4096, 262144),
                                              (torch.bfloat16, torch.float32)):
        anyb = plan_attention(None, hkv, d, dtype, cpu, n)
        expr = anyb.grid_splits(batch, hkv).node.expr
        for b in range(1, 300):
            want = plan_attention(b, hkv, d, dtype, cpu, n).num_splits
            assert int(expr.xreplace({batch.node.expr: b})) == want, (b, hkv, d, n, dtype)
    assert not env.guards  # arithmetic only: nothing specialised the batch


def test_plan_overrides_and_checks():
    cpu = torch.device("cpu")
    cfg = ap.KernelConfig(block_n=16, num_warps=1, num_stages=1, min_chunk=16, combine_warps=1, max_chunk=0)
    p = plan_attention(4, 2, 16, torch.float32, cpu, 100, num_splits=5, config=cfg)
    assert p.num_splits == 5 and p.wave == 5  # no adaptation: every row uses the whole grid
    p = plan_attention(4, 2, 16, torch.float32, cpu, 100, config=ap.KernelConfig(wave=8))
    assert p.programs == 8 and p.wave == min(p.num_splits, wave_splits(4, 2, 8))
    assert plan_attention(0, 2, 16, torch.float32, cpu, 100, num_splits=3).wave >= 1  # an empty batch plans
    assert ap.splits_for(torch.empty(8, 32, 256, dtype=torch.bfloat16),
                         torch.empty(1, 16, 256, dtype=torch.bfloat16), 1024) == 4
    with pytest.raises(AttentionError, match="block_n"):
        AttentionPlan(1, 0, 1, 1, 16, 0, 1, 8, 1)
    with pytest.raises(AttentionError, match="wave"):
        AttentionPlan(1, 16, 1, 1, 16, 0, 1, 8, -1)
    with pytest.raises(AttentionError, match="min_splits"):
        AttentionPlan(2, 16, 1, 1, 16, 64, 1, 8, 0, 3)
    fixed = plan_attention(None, 2, 16, torch.float32, cpu, 100, num_splits=3)  # an explicit count: every batch's
    assert [fixed.grid_splits(b, 2) for b in (1, 7, 64)] == [3, 3, 3]
    with pytest.raises(AttentionError, match="num_splits or a plan"):
        attn.decode_attention(*[None] * 8)
    with pytest.raises(AttentionError, match="num_splits 3 != the plan's 2"):
        attn.decode_attention(*[None] * 8, 3, plan=AttentionPlan(2, 16, 1, 1, 16, 64, 1, 8, 2))


def test_a_planned_call_plans_nothing_and_equals_the_unplanned_one(device, monkeypatch):
    """The Triton launch with a plan handed in (interpreted on CPU) calls no planner, and gives bit for bit what a
    call without one (planned inside the op from its inputs) gives."""
    from test_decode_attention import make_case

    case = make_case(7, lens=[40, 3, 0, 77], heads=4, kv_heads=2, dim=16, window=0, dtype=torch.float32,
                     device=device)
    q, k, _, table = case[:4]
    plan = attn.plan_for_inputs(q, k, table, 0)
    want = attn.decode_attention(*case, plan.num_splits)  # planned inside the op
    forbid_planning(monkeypatch)
    assert torch.equal(attn.decode_attention(*case, plan=plan), want)


def _loop(device):
    n = SPEC.capture.max_slots
    lens = torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    st = make_target_state(SPEC, lens, [x + 60 for x in lens], slots=list(range(n)), seed=0, device=device)
    wb = WindowBuffers.from_spec(SPEC, st.req_to_token, st.full_to_swa)
    wb.reset(list(range(n)), lens)
    return DraftLoop(FrozenKVDraft(SPEC, seed=0, device=device), wb, st.k_swa, st.v_swa, st.k_full, st.v_full)


def _inputs(loop, b, seed):
    g = torch.Generator().manual_seed(seed)
    dev = loop.window.device
    slots = torch.randperm(loop.window.max_slots, generator=g)[:b].to(dev)
    tokens = torch.randint(0, SPEC.draft.vocab, (b,), generator=g).to(dev)
    hidden = torch.randn(b, SPEC.target.hidden, generator=g).to(dev)
    return slots, torch.zeros(b, dtype=torch.int32, device=dev), tokens, hidden


@pytest.mark.compile
@pytest.mark.parametrize("dynamic", [thorough(False, id="per-bucket"), pytest.param(True, id="any-batch")])
def test_compiled_draft_steps_call_no_planner(device, monkeypatch, dynamic):  # any-batch: the default capture
    """The reference loop's steps under torch.compile (aot_eager, fullgraph) at every bucket: planned once before
    (per bucket, or for any batch with the batch symbolic), then every planner raises - the traces plan nothing and
    give what the eager loop gave; nor do the eager loop's Triton launches (interpreted on CPU)."""
    if device == "cuda":
        pytest.skip("CPU check (the twins under torch.compile, Triton's interpreter eagerly)")
    loop = _loop(device)
    buckets = (1, 2, 4)
    if dynamic:
        loop.plan_for_any_batch()
    else:
        loop.plan_for_batches(buckets)
    with twins_on_cpu():  # torch.compile cannot run interpreted Triton kernels on fake tensors: the twins
        want = {b: loop.draft_steps(*_inputs(loop, b, b)) for b in buckets}
    called = forbid_planning(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(loop.draft_steps, backend="aot_eager", fullgraph=True, dynamic=None if dynamic else False)
    with twins_on_cpu():
        for b in buckets:
            inp = _inputs(loop, b, b)
            if dynamic:
                for t in inp:
                    torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="batch", min=1, max=max(buckets))
            got = compiled(*inp)
            for x, y in zip(got, want[b]):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    for b in buckets:  # the kernels themselves, eagerly
        got = loop.draft_steps(*_inputs(loop, b, b))
        torch.testing.assert_close(got.hidden, want[b].hidden, rtol=1e-4, atol=1e-4)
    assert called == []
    torch._dynamo.reset()


def test_sglang_attention_plans_per_layer_and_bucket(device, monkeypatch):
    """The sglang plugin's attention backend plans every (layer, bucket) in `plan_for` (what
    `SglangAssistantLoop.prepare` calls), with the splits the per-call `splits_for` chose, and its forward - eager or
    compiled - plans nothing after."""
    from graphcap.sglang.loop import GraphcapDraftAttention

    loop = _loop(device)
    wb = loop.window
    pools = {0: (loop.sources["sliding"].k_pool, loop.sources["sliding"].v_pool),
             1: (loop.sources["full"].k_pool, loop.sources["full"].v_pool)}
    pool = SimpleNamespace(get_key_buffer=lambda i: pools[i][0], get_value_buffer=lambda i: pools[i][1])
    layers = [SimpleNamespace(layer_id=i, sliding_window_size=SPEC.window - 1 if i == 0 else -1, tp_q_head_num=4,
                              qk_head_dim=pools[i][0].shape[-1], v_head_dim=pools[i][0].shape[-1],
                              scaling=pools[i][0].shape[-1] ** -0.5) for i in (0, 1)]
    backend = GraphcapDraftAttention(wb, pool, SPEC.capture.max_context)
    buckets = (1, 2, 4)
    backend.plan_for(layers, buckets)
    for (lid, b), plan in backend._plans.items():
        q = torch.empty(b, 4, pools[lid][0].shape[-1], dtype=pools[lid][0].dtype, device=device)
        assert plan.num_splits == ap.splits_for(q, pools[lid][0], SPEC.window if lid == 0 else SPEC.capture.max_context)
    want = {}
    for b in buckets:
        slots = _inputs(loop, b, b)[0]
        backend.bind(slots)
        for layer in layers:
            q = torch.randn(b, 4 * layer.qk_head_dim, generator=torch.Generator().manual_seed(b)).to(device)
            want[b, layer.layer_id] = (q, slots, backend.forward(q, None, None, layer, None))
    called = forbid_planning(monkeypatch)
    torch._dynamo.reset()
    with twins_on_cpu():  # Dynamo + the interpreter's launches are the loop test's; here the lookup is the point
        for (b, lid), (q, slots, out) in want.items():
            backend.bind(slots)
            f = torch.compile(lambda x, layer=layers[lid]: backend.forward(x, None, None, layer, None),
                              backend="aot_eager", fullgraph=True, dynamic=False)
            torch.testing.assert_close(f(q), out, rtol=1e-5, atol=1e-5)
    assert called == []
    torch._dynamo.reset()
