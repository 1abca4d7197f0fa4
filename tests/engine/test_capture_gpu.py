"""Graph replay on CUDA (skipped without CUDA). For each spec and backend: many consecutive
iterations, random batch sizes covering every bucket, random accepted counts, requests joining (reset) between
iterations. Capture must change nothing:
- reduce-overhead and inductor-cudagraph replays == the same compiled code with CUDA graphs off, exactly; cudagraph
  replays == eager on the same padded bucket (batches that fill it and batches smaller than it), exactly;
- against plain eager: the chosen token's logit and the last hidden state within bf16 tolerance wherever the
  earlier steps chose the same tokens (more than half of all steps), tokens equal wherever eager's margin exceeds it;
- replays under torch.cuda.set_sync_debug_mode("error"), no cudagraph skips, no recompiles (the engine's guard raises).
The same for the Inductor backends with dynamic_batch=True (one compile for every bucket, the twin compiled the same
way), and a precompiled iteration (precompile=True) saved by one capture and loaded by a second over larger pools.
"""
from __future__ import annotations

import os

import pytest
import torch

from graphcap.engine import compile_cache as cc
from graphcap.engine import precompile
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.guards import cache_entries
from graphcap.engine.options import CaptureOptions
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.models.draft_loop import DraftOutput
from graphcap.spec import load_spec
from graphcap.bench.state import make_target_state
from graphcap.window import WindowBuffers

pytestmark = pytest.mark.gpu

# gemma4: three buckets keep Inductor's compile time short (~25 s per bucket and backend cold); tiny covers every bucket. GRAPHCAP_GPU_ALL_BUCKETS=1 runs gemma4 over all of its buckets too
# (scripts/gpu-check.sh capture-all).
_ALL = os.environ.get("GRAPHCAP_GPU_ALL_BUCKETS") == "1"
CASES = [("tiny", None, 16), ("gemma4-31b-assistant", None if _ALL else (1, 8, 64), 28 if _ALL else 24)]


def _world(spec, n_slots, base_ctx, iters=64, spare_tokens=0, spare_rows=0):
    """The target's state for `n_slots` requests. `spare_tokens`/`spare_rows`: the same requests in larger pools (what
    another --mem-fraction-static gives): that many more free locations in every KV pool and full_to_swa, more
    request rows in req_to_token (and so in the window buffers)."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, base_ctx, (n_slots,), generator=g).tolist()
    growth = iters * (spec.capture.steps + 1)
    st = make_target_state(spec, lens, [base_ctx + growth] * n_slots, slots=list(range(n_slots)), device="cuda")
    if spare_tokens or spare_rows:
        def grow(t, n):
            return torch.cat([t, torch.zeros(n, *t.shape[1:], dtype=t.dtype, device=t.device)])

        pool = st.k_swa.shape[0]
        for name in ("k_swa", "v_swa", "k_full", "v_full"):
            setattr(st, name, grow(getattr(st, name), spare_tokens))
        st.full_to_swa = torch.cat([st.full_to_swa, torch.arange(pool, pool + spare_tokens, device="cuda")])
        st.req_to_token = grow(st.req_to_token, spare_rows)
    model = FrozenKVDraft(spec, seed=1, device="cuda")
    return st, model, lens


def _loop(spec, st, model, lens, layer_regions=True):
    wb = WindowBuffers(st.req_to_token, spec.window, st.req_to_token.shape[0], st.full_to_swa,
                       max_accepted=spec.capture.steps + 1)
    wb.reset(list(range(len(lens))), lens)
    return DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full, layer_regions=layer_regions)


def _run_without_sync(gr, b, inputs, zero_copy):
    """`gr.run` (or, `zero_copy`, write `static_inputs` and `replay`) under torch.cuda.set_sync_debug_mode("error")."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if zero_copy:  # the zero-copy path: write the static inputs, replay
            for view, x in zip(gr.static_inputs(b), inputs):
                view.copy_(x)
            return gr.replay(b, copy=True)
        return gr.run(*inputs, copy=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _against_eager(out, base, spec, it):
    """The tolerance rule against plain eager for one iteration (see the comments); returns (steps compared, steps
    decided, decided steps agreeing, steps)."""
    # bf16 through 4 layers: ~1-2% relative on the logits; fp32 far less.
    atol, rtol = (0.1, 0.05) if spec.dtype == "bfloat16" else (1e-3, 1e-3)
    # A step's inputs include the previous step's token: compare a row's step only while all earlier steps
    # agreed. Where both chose the same token its logit is the same quantity computed two ways: within bf16
    # tolerance. Tokens must agree where eager's decision margin (runner-up token; for the centroid head also
    # the first cluster left out) exceeds the tolerance - a near-tie may flip under fused bf16 rounding. The
    # centroid head's cluster margin (the 32nd against the 33rd of 2048 centroid scores) is almost never that
    # wide, so for gemma4 the logit and hidden-state comparisons carry the check.
    same = out.tokens == base.tokens
    prefix = torch.cumprod(same.int(), dim=1).bool()
    comparable = torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], dim=1)
    thr = atol + rtol * base.scores.abs()
    close = (out.scores - base.scores).abs() <= thr
    both = comparable & same
    assert close[both].all(), f"iteration {it}: logits of the same token beyond bf16 tolerance"
    rows = prefix[:, -1]  # every step agreed: the last hidden state is the same computation
    h_out, h_ref = out.hidden[rows].float(), base.hidden[rows].float()
    # per row, relative to its norm: thousands of elements per row, so elementwise bounds catch rounding tails
    h_err = ((h_out - h_ref).norm(dim=-1) / h_ref.norm(dim=-1).clamp_min(1e-6)).max() if len(h_ref) else 0.0
    assert h_err <= rtol, f"iteration {it}: last hidden state {float(h_err):.3g} from eager (bf16 bound {rtol})"
    decided = comparable & (base.margins > 2 * thr)
    return int(both.sum()), int(decided.sum()), int(same[decided].sum()), same.numel()


@pytest.mark.parametrize("spec_name, buckets, iters", CASES)
@pytest.mark.parametrize("backend, twin_backend, dynamic_batch, layer_regions", [
    ("reduce-overhead", "compile", False, True), ("inductor-cudagraph", "compile", False, True),
    ("cudagraph", None, False, True), ("reduce-overhead", "compile", True, True),
    ("inductor-cudagraph", "compile", True, True), ("inductor-cudagraph", "compile", True, False)],
    ids=["reduce-overhead", "inductor-cudagraph", "cudagraph", "reduce-overhead-dynamic", "inductor-cudagraph-dynamic",
         "inductor-cudagraph-dynamic-inlined"])
def test_replay_equals_the_same_function_without_graphs(spec_name, buckets, iters, backend, twin_backend,
                                                        dynamic_batch, layer_regions, tmp_path):
    """dynamic_batch: the iteration compiled once with a symbolic batch (and pool sizes), the twin compiled the same
    way: one Dynamo cache entry each for every bucket, still one after the replays. layer_regions (the default; off
    for "-inlined"): each draft layer a nested compile region, in the graphed loop and its twin (eager ignores it)."""
    spec = load_spec(spec_name)
    buckets = buckets or spec.capture.buckets
    n_slots = min(spec.capture.max_slots, buckets[-1] + 8)
    base_ctx = min(3000, spec.capture.max_context - iters * (spec.capture.steps + 1))
    st, model, lens = _world(spec, n_slots, base_ctx, iters)
    graphed = _loop(spec, st, model, lens, layer_regions)
    twin = _loop(spec, st, model, lens, layer_regions)  # the same function without CUDA graphs
    eager = _loop(spec, st, model, lens)  # plain eager draft_loop
    # dynamic_batch explicit: for_loop's default for compiled backends is True
    opts = CaptureOptions(buckets=buckets, manifest_path=None, dynamic_batch=dynamic_batch)
    gr = DraftGraphs.for_loop(graphed, opts.replace(backend=backend, manifest_path=tmp_path / "m.json"))
    gr.capture()
    tw = None
    if twin_backend:
        tw = DraftGraphs.for_loop(twin, opts.replace(backend=twin_backend))
        tw.capture()
    compiled = [x._compiled for x in (gr, tw) if x is not None and x._compiled is not None]
    if dynamic_batch:
        assert [c.entries for c in compiled] == [1, 1], "dynamic_batch: not one compile for every bucket"
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"cudagraph skips: {skips}"
    g = torch.Generator().manual_seed(3)
    sizes = list(buckets) + [max(1, b - 1) for b in buckets]
    decided_total = agree = compared = steps_total = 0
    for it in range(iters):
        b = sizes[it % len(sizes)]
        slots = torch.randperm(n_slots, generator=g)[:b]
        if it % 5 == 4:  # a request leaves and another joins in its slot: rebuilt off the hot path
            s, n = int(slots[0]), int(torch.randint(1, base_ctx, (1,), generator=g))
            for lp in (graphed, twin, eager):
                lp.window.reset([s], [n])
        accepted = torch.randint(1, spec.capture.steps + 2, (b,), generator=g, dtype=torch.int32).cuda()
        tokens = torch.randint(0, spec.draft.vocab, (b,), generator=g).cuda()
        hidden = torch.randn(b, spec.target.hidden, generator=g).to("cuda", spec.torch_dtype())
        slots = slots.cuda()
        out = _run_without_sync(gr, b, (slots, accepted, tokens, hidden), it % 2 and backend != "reduce-overhead")
        if tw is not None:
            ref = tw.run(slots, accepted, tokens, hidden)
        else:  # cudagraph: eager over the same padded bucket the graph ran (kernels may differ by batch shape)
            ref = _eager_at_bucket(gr, twin, b)
        for x, y, name in zip(out, ref, out._fields):
            assert torch.equal(x, y), f"iteration {it}, batch {b}: {name} differs from the graph-free run"
        base = eager(slots, accepted, tokens, hidden)
        assert torch.equal(graphed.window.ring, eager.window.ring)
        assert torch.equal(graphed.window.seq_lens, eager.window.seq_lens)
        n_compared, n_decided, n_agree, n_steps = _against_eager(out, base, spec, it)
        compared += n_compared
        decided_total += n_decided
        agree += n_agree
        steps_total += n_steps
    assert compared > steps_total // 2, f"only {compared} of {steps_total} draft steps could be compared with eager"
    assert agree == decided_total, f"{decided_total - agree} of {decided_total} decided tokens differ from eager"
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert all(r.status == "captured" for r in gr.buckets)
    assert sum(r.replays for r in gr.buckets) == iters
    assert [cache_entries(c.code) for c in compiled] == [c.entries for c in compiled], "recompiled after capture"


@pytest.mark.parametrize("layer_regions", [False, True], ids=["inlined", "regions"])
def test_precompiled_iteration_replays_as_compiled_over_larger_pools(layer_regions, tmp_path):
    """precompile=True (inductor-cudagraph, dynamic_batch, the tiny spec): a first capture compiles the iteration and
    saves it (0600 in a 0700 compile cache); a second, after torch._dynamo.reset(), over larger pools (more free KV
    locations and request rows: another --mem-fraction-static) loads it - nothing traced - and records every bucket.
    Both: every bucket's replay (full and padded batches) equals the saved function loaded over a twin state and run
    without graphs, exactly, and plain eager within the tolerance rule; the same windows; no sync, no cudagraph skip,
    nothing traced while replaying. With and without layer regions (DraftLoop(layer_regions=True))."""
    from torch._dynamo.utils import counters

    spec = load_spec("tiny")
    buckets, iters = spec.capture.buckets, 16
    n_slots = min(spec.capture.max_slots, buckets[-1] + 8)
    base_ctx = spec.capture.max_context - iters * (spec.capture.steps + 1)
    cache = tmp_path / "compile-cache"
    cache.mkdir()
    os.chmod(cache, 0o700)
    pools = 0
    for first, (spare_tokens, spare_rows) in ((True, (0, 0)), (False, (4096, 8))):
        torch._dynamo.reset()
        frames = counters["stats"]["unique_graphs"]
        st, model, lens = _world(spec, n_slots, base_ctx, iters, spare_tokens, spare_rows)
        graphed, twin, eager = (_loop(spec, st, model, lens, layer_regions) for _ in range(3))
        gr = DraftGraphs.for_loop(graphed, CaptureOptions(backend="inductor-cudagraph", buckets=buckets,
                                                          manifest_path=None, dynamic_batch=True, compile_cache=cache,
                                                          precompile=True))
        gr.capture()
        assert all(r.status == "captured" for r in gr.buckets), gr.buckets
        traced = counters["stats"]["unique_graphs"] - frames
        k_pool = gr._static.persistent["sliding.k_pool"].shape[0]
        if first:
            assert traced == 1 and gr.manifest().compile_cache == cc.MISS
            (aot,) = cache.glob(f"*{precompile.SUFFIX}")
            assert (aot.stat().st_mode & 0o777, cache.stat().st_mode & 0o777) == (0o600, 0o700)
            pools = k_pool
        else:
            assert traced == 0 and gr.manifest().compile_cache == cc.HIT
            assert "precompiled: the iteration was loaded, not traced" in gr.manifest().notes
            assert k_pool > pools and graphed.window.ring.shape[0] == spec.capture.max_slots + spare_rows + 1
        twin.plan_for_any_batch()  # as for_loop planned the graphed loop
        saved, state = precompile.load(cache, gr._compile.aot_key(), {"fn": twin})  # the saved function over the twin
        assert state == cc.HIT
        g = torch.Generator().manual_seed(7)
        sizes = list(buckets) + [max(1, b - 1) for b in buckets]
        compared = steps_total = 0
        for it in range(iters):
            b = sizes[it % len(sizes)]
            inputs = (torch.randperm(n_slots, generator=g)[:b].cuda(),
                      torch.randint(1, spec.capture.steps + 2, (b,), generator=g, dtype=torch.int32).cuda(),
                      torch.randint(0, spec.draft.vocab, (b,), generator=g).cuda(),
                      torch.randn(b, spec.target.hidden, generator=g).to("cuda", spec.torch_dtype()))
            out = _run_without_sync(gr, b, inputs, zero_copy=bool(it % 2))
            ref = _eager_at_bucket(gr, saved, b)
            for x, y, name in zip(out, ref, out._fields):
                assert torch.equal(x, y), f"iteration {it}, batch {b}: {name} differs from the saved function's"
            base = eager(*inputs)
            for lp in (twin, eager):
                assert torch.equal(graphed.window.ring, lp.window.ring)
                assert torch.equal(graphed.window.seq_lens, lp.window.seq_lens)
            n_compared, n_decided, n_agree, n_steps = _against_eager(out, base, spec, it)
            assert n_agree == n_decided, f"iteration {it}: decided tokens differ from eager"
            compared += n_compared
            steps_total += n_steps
        assert compared > steps_total // 2, f"only {compared} of {steps_total} draft steps compared with eager"
        assert counters["stats"]["unique_graphs"] - frames == traced, "traced while replaying"
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
        assert sum(r.replays for r in gr.buckets) == iters


def _eager_at_bucket(gr: DraftGraphs, loop, b: int) -> DraftOutput:
    """`loop` (a draft loop, or a compiled function over one) run without graphs on exactly the inputs the graph of
    `b`'s bucket just replayed - the live rows and the padding rows after them - cut to the first `b` rows, as the
    graph's outputs are."""
    bucket = min(r.batch_size for r in gr.buckets if r.batch_size >= b)
    padded = [t.clone() for t in gr.static_inputs(bucket)]
    return DraftOutput(*(y[:b] for y in loop(*padded)))


def test_cudagraph_replay_equals_eager_at_padded_buckets():
    """Manual CUDA graphs replay exactly what the eager function computes on the same padded inputs, for batches
    that fill their bucket and batches smaller than it (padding rows), and leave the same windows."""
    spec = load_spec("gemma4-31b-assistant")
    st, model, lens = _world(spec, 16, 2048)
    a, b_ = _loop(spec, st, model, lens), _loop(spec, st, model, lens)
    gr = DraftGraphs.for_loop(a, CaptureOptions(backend="cudagraph", buckets=(4, 8), manifest_path=None))
    gr.capture()
    g = torch.Generator().manual_seed(5)
    for b in (8, 5, 1, 8, 3, 4, 7, 2):
        slots = torch.randperm(16, generator=g)[:b].cuda()
        accepted = torch.randint(1, 5, (b,), generator=g, dtype=torch.int32).cuda()
        tokens = torch.randint(0, spec.draft.vocab, (b,), generator=g).cuda()
        hidden = torch.randn(b, spec.target.hidden, generator=g).to("cuda", torch.bfloat16)
        out = gr.run(slots, accepted, tokens, hidden, copy=True)
        ref = _eager_at_bucket(gr, b_, b)
        for x, y, name in zip(out, ref, out._fields):
            assert torch.equal(x, y), f"batch {b}: {name} differs from eager at the bucket's shape"
        assert torch.equal(a.window.ring, b_.window.ring) and torch.equal(a.window.seq_lens, b_.window.seq_lens)
    assert sum(r.padded_rows for r in gr.buckets) > 0


def test_run_copies_a_batch_of_the_static_dtypes_in_one_launch():
    """run()'s input copy (BucketGraph.write): a batch in the static inputs' dtypes, contiguous, is one device launch
    (the multi-tensor copy over views of one integer word: int64 at an even batch, int32 at an odd one, a narrower
    word where a source sits at an odd offset), and its rows arrive exactly; int32 slots take the per-pair copies."""
    spec = load_spec("tiny")
    st, model, lens = _world(spec, 16, 32, iters=4)
    gr = DraftGraphs.for_loop(_loop(spec, st, model, lens), CaptureOptions(backend="eager", buckets=(8,),
                                                                           manifest_path=None))
    gr.capture()
    bucket = gr.bucket_graph(8)
    g = torch.Generator().manual_seed(3)

    def launches(inputs) -> int:
        bucket.write(*inputs)  # warm
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            bucket.write(*inputs)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    for b in (6, 5):
        batch = [torch.randperm(16, generator=g)[:b], torch.randint(1, 4, (b,), generator=g, dtype=torch.int32),
                 torch.randint(0, spec.draft.vocab, (b,), generator=g), torch.randn(b, spec.target.hidden, generator=g)]
        batch = [x.to("cuda", s.dtype) for x, s in zip(batch, bucket.inputs)]
        unaligned = torch.cat([batch[1][:1], batch[1]])[1:]  # int32 at an odd offset: no int64 view
        assert bucket.word_rows(b)[0].dtype == (torch.int64 if b % 2 == 0 else torch.int32)
        for inputs in (batch, [batch[0], unaligned, *batch[2:]]):
            assert launches(inputs) == 1, b
            for x, s in zip(inputs, bucket.inputs):
                assert torch.equal(s[:b], x), b
        assert launches([batch[0].int(), *batch[1:]]) > 1  # a conversion kernel plus copies
        assert torch.equal(bucket.inputs[0][:b], batch[0])
