"""Pool-sized dimensions compile symbolically: a capture over KV pools, `req_to_token`, `full_to_swa` and slot rows
of other sizes (another server memory setting) reuses the compiled artifact from Inductor's on-disk caches; a change
of the model still compiles. CPU: the `compile` backend over the kernels' torch twins."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from graphcap.engine import compile_cache as cc
from graphcap.bench.state import make_target_state
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.spec import load_spec
from graphcap.window import WindowBuffers

SPEC = load_spec("tiny")
LIVE = SPEC.capture.max_slots  # requests in every state; the slot rows beyond them stay empty


def build(spec, *, grow: int, rows: int, cols: int, steps: int = 1):
    """A state whose pools hold `grow` more tokens per request than the minimum, whose req_to_token is
    [rows, cols] and whose window buffers have `rows` slots. (cols <= 128 keeps the full layer's split plan, which
    is sized by the context bound, the same: the plan is a constant of the graph.)"""
    lens = torch.randint(1, 40, (LIVE,), generator=torch.Generator().manual_seed(0)).tolist()
    st = make_target_state(spec, lens, [x + 20 + grow for x in lens], slots=list(range(LIVE)), seed=0)
    r2t = torch.zeros(rows, cols, dtype=st.req_to_token.dtype)
    r2t[:LIVE] = st.req_to_token[:, :cols]
    wb = WindowBuffers(r2t, spec.window, rows, st.full_to_swa, max_accepted=steps + 1)
    wb.reset(list(range(LIVE)), lens)
    model = FrozenKVDraft(spec, seed=0)
    return st, wb, DraftLoop(model, wb, st.k_swa, st.v_swa, st.k_full, st.v_full, steps=steps)


def assert_runs_as_eager(graphs, wb, state: dict, seed: int) -> None:
    """`graphs` (captured over `wb` of a `build(SPEC, **state)`) against the eager loop of a twin state, batches 2, 1,
    2 of random live slots: the same decided tokens, hidden within 1e-4, the same windows after each."""
    _, eager_wb, eager = build(SPEC, **state)
    gen = torch.Generator().manual_seed(seed)
    for b in (2, 1, 2):
        slots = torch.randperm(LIVE, generator=gen)[:b]
        batch = (slots, torch.randint(1, 3, (b,), generator=gen), torch.randint(0, SPEC.draft.vocab, (b,), generator=gen),
                 torch.randn(b, SPEC.target.hidden, generator=gen))
        want, got = eager(*batch), graphs.run(*batch, copy=True)
        decided = want.margins > 1e-3
        assert torch.equal(got.tokens[decided], want.tokens[decided]), b
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)
        assert torch.equal(wb.ring, eager_wb.ring) and torch.equal(wb.seq_lens, eager_wb.seq_lens)


@pytest.fixture
def fx_graph_cache():
    """Inductor's on-disk FX graph cache on (the default; an environment may turn it off). A config patch, not
    monkeypatch: Inductor's config module does not take an attribute deleted and set back."""
    with torch._inductor.config.patch(fx_graph_cache=True):
        yield


def test_pool_dims_name_the_memory_sized_dimensions():
    st, wb, loop = build(SPEC, grow=0, rows=LIVE, cols=128)
    dims = loop.pool_dims()
    assert dims == {"window.ring": (0,), "window.seq_lens": (0,), "window.req_to_token": (0, 1),
                    "window.full_to_swa": (0,), "sliding.k_pool": (0,), "sliding.v_pool": (0,),
                    "full.k_pool": (0,), "full.v_pool": (0,)}
    assert set(dims) <= set(loop.static_tensors())
    with pytest.raises(ValueError, match="'nope' is not one of the static tensors"):
        DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", manifest_path=None), pool_dims={"nope": (0,)})
    with pytest.raises(ValueError, match="'window.ring' has 2 dimensions, got \\(2,\\)"):
        DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", manifest_path=None),
                             pool_dims={"window.ring": (2,)})


def test_the_compile_cache_key_leaves_pool_sizes_out():
    """The compile-cache file of a capture is the same whatever the pool sizes (spec, backend, buckets, versions);
    another model is another file."""
    keys = []
    for spec, grow, rows, cols in ((SPEC, 0, LIVE, 128), (SPEC, 60, LIVE + 8, 120),
                                   (dataclasses.replace(SPEC, draft=dataclasses.replace(SPEC.draft, hidden=40)),
                                    0, LIVE, 128)):
        loop = build(spec, grow=grow, rows=rows, cols=cols)[2]
        g = DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", buckets=(1, 2), manifest_path=None,
                                                      dynamic_batch=True, compile_cache="/nonexistent"))
        keys.append(g._compile.cache_key())
    assert keys[0] == keys[1] != keys[2]


@pytest.mark.compile
@pytest.mark.thorough  # Inductor's own cache over other pools; the CI tier's precompiled load over other pools is
# test_compile_cache's, the key without pool sizes the test above
def test_other_pool_sizes_hit_the_on_disk_caches_and_another_model_misses(tmp_path, monkeypatch, cpu_twins,
                                                                          fx_graph_cache):
    """dynamic_batch (which compiles the pool sizes symbolically too): capture on one state; then, in a fresh Dynamo
    state and a fresh Inductor cache
    directory that only the compile cache's artifacts fill, on a state with bigger pools, more slot rows and
    another req_to_token width: Inductor's FX graph cache hits (no compile), every bucket is captured, and the
    outputs equal the eager loop's on that state. A model of another width still misses."""
    from torch._dynamo.utils import counters

    artifacts = tmp_path / "compile-cache"
    buckets = (1, 2)

    def capture(spec, name, **state):
        torch._dynamo.reset()  # nothing compiled in this process is reused: only what is on disk
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / f"inductor-{name}"))
        st, wb, loop = build(spec, **state)
        before = dict(counters["inductor"])
        g = DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", buckets=buckets, manifest_path=None,
                                                      dynamic_batch=True, compile_cache=artifacts,
                                                      precompile=False))  # the FX graph cache
        g.capture()
        delta = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
        assert [r.status for r in g.buckets] == ["captured"] * len(buckets), g.buckets
        return g, wb, delta, state

    _, _, first, _ = capture(SPEC, "first", grow=0, rows=LIVE, cols=128)
    assert first == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}
    g, wb, second, state = capture(SPEC, "other-pools", grow=60, rows=LIVE + 8, cols=120)
    assert g.manifest().compile_cache == cc.HIT  # the same artifacts file (the key has no pool size)
    assert second == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0}
    assert g._static.persistent["sliding.k_pool"].shape[0] > 0 and wb.ring.shape[0] == LIVE + 9
    assert_runs_as_eager(g, wb, state, seed=4)
    wider = dataclasses.replace(SPEC, draft=dataclasses.replace(SPEC.draft, hidden=40))
    g, _, third, _ = capture(wider, "wider", grow=60, rows=LIVE + 8, cols=120)
    assert g.manifest().compile_cache == cc.MISS and third == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}


def test_the_compile_cache_key_names_the_loops_steps_and_what_is_compiled():
    """A loop with another step count, or its steps alone (the rebuild baseline's graph), is other compiled code:
    another cache file, not a reported hit that never saves."""
    keys = set()
    for steps, steps_only in ((1, False), (2, False), (1, True)):
        loop = build(SPEC, grow=0, rows=LIVE, cols=128, steps=steps)[2]
        g = DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", buckets=(1, 2), manifest_path=None,
                                                      compile_cache="/nonexistent"), steps_only=steps_only)
        keys.add(g._compile.cache_key())
    assert len(keys) == 3
