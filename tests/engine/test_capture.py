"""The capture engine's dispatcher, padding, guards, fallback and manifest, on CPU (backends `eager` and
`compile`). Graph recording and replay are checked on the GPU (tests/engine/test_capture_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from graphcap import manifest as mf
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.guards import CaptureError
from graphcap.engine.options import CaptureOptions
from graphcap.kernels import twins_on_cpu
from graphcap.models import DraftLoop, FrozenKVDraft
from graphcap.engine.observers import CaptureObserver, LoggingProgress
from graphcap.spec import load_spec
from graphcap.bench.state import make_target_state
from graphcap.window import WindowBuffers
from tiers import thorough

SPEC = load_spec("tiny")
# the dispatcher is the point here, not the kernels (test_window.py, test_decode_attention.py): the torch twins
pytestmark = pytest.mark.usefixtures("cpu_twins")


def build(device, seed=0):
    n = SPEC.capture.max_slots
    lens = torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    st = make_target_state(SPEC, lens, [x + 60 for x in lens], slots=list(range(n)), seed=seed, device=device)
    wb = WindowBuffers.from_spec(SPEC, st.req_to_token, st.full_to_swa)
    wb.reset(list(range(n)), lens)
    loop = DraftLoop(FrozenKVDraft(SPEC, seed=seed, device=device), wb, st.k_swa, st.v_swa, st.k_full, st.v_full)
    return st, wb, loop


def random_batch(g, wb, device, b):
    slots = torch.randperm(wb.max_slots, generator=g)[:b]
    accepted = torch.randint(1, SPEC.capture.steps + 2, (b,), generator=g)
    tokens = torch.randint(0, SPEC.draft.vocab, (b,), generator=g)
    hidden = torch.randn(b, SPEC.target.hidden, generator=g)
    return [x.to(device) for x in (slots, accepted, tokens, hidden)]


def assert_drafts_as_eager(graphs, eager, device, batches, seed):
    """`graphs.run` over random batches of these sizes drafts what the eager twin loop `eager` (built like the
    captured one, `build`) drafts: hidden states within 1e-4, the same tokens wherever the margin is clear."""
    g = torch.Generator().manual_seed(seed)
    for b in batches:
        batch = random_batch(g, eager[1], device, b)
        want, got = eager[2](*batch), graphs.run(*batch, copy=True)
        decided = want.margins > 1e-3
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.tokens[decided], want.tokens[decided]), b


def test_dispatch_padding_fallback_and_manifest(tmp_path, device):
    """Random batch sizes (oversize ones included) and slots joining/leaving: every result equals the plain loop on
    a twin state, the windows stay identical, and the manifest counts what happened."""
    _, wb_ref, loop_ref = build(device)
    _, wb, loop = build(device)
    path = tmp_path / "m.json"
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(2, 4, 8), manifest_path=path))
    graphs.capture()
    g = torch.Generator().manual_seed(7)
    sizes = [3, 8, 1, 4, 10, 2, 5, 7, 9, 3]
    for b in sizes:
        slots, accepted, tokens, hidden = random_batch(g, wb, device, b)
        ref = loop_ref(slots, accepted, tokens, hidden)
        out = graphs.run(slots, accepted, tokens, hidden, host_slots=slots.tolist())
        assert out.tokens.shape == (b, SPEC.capture.steps) and out.hidden.shape == (b, SPEC.target.hidden)
        torch.testing.assert_close(out.scores, ref.scores, rtol=1e-4, atol=1e-4)
        decided = ref.margins > 1e-3
        assert torch.equal(out.tokens[decided], ref.tokens[decided])
        assert torch.equal(wb.ring, wb_ref.ring) and torch.equal(wb.seq_lens, wb_ref.seq_lens)
        assert int(wb.seq_lens[wb.padding_slot]) == 0
    graphs.flush()
    m = mf.read_manifest(path)
    by_size = {r.batch_size: r for r in m.buckets}
    assert [r.status for r in m.buckets] == ["captured"] * 3
    assert by_size[2].replays == 2 and by_size[4].replays == 3 and by_size[8].replays == 3
    assert by_size[4].padded_rows == 1 + 0 + 1 and by_size[8].padded_rows == 0 + 3 + 1
    assert m.oversize_fallbacks == 2 and m.spec_hash == SPEC.hash and m.backend == "eager"


def test_views_until_next_run_and_copies(device):
    """run() returns views of the static outputs (the next run overwrites them); copy=True keeps the values. Both
    against the plain loop on a twin state."""
    _, wb_ref, loop_ref = build(device)
    _, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="cudagraph" if device == "cuda" else "eager",
                                                       buckets=(4,), manifest_path=None))
    graphs.capture()
    g = torch.Generator().manual_seed(3)
    first, second = random_batch(g, wb, device, 3), random_batch(g, wb, device, 3)
    want = loop_ref(*first)
    kept = graphs.run(*first, copy=True)
    view = graphs.run(*second)
    want2 = loop_ref(*second)
    for x, y in zip(kept, want):
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-4, atol=1e-4)
    for x, y in zip(view, want2):
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-4, atol=1e-4)
    assert kept.tokens.is_contiguous() and kept.tokens.shape == (3, SPEC.capture.steps)


@pytest.mark.parametrize(
    "host_slots, match",
    [([1, 1, 2], r"run: slot 1 appears more than once in host_slots"),
     ([1, 2, SPEC.capture.max_slots], r"run: slot (\d+) out of range \[0, \1\) in host_slots"),
     ([1, 2], r"2 host_slots for a batch of 3")],
)
def test_bad_batches_are_rejected(device, host_slots, match):
    _, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,), manifest_path=None))
    graphs.capture()
    before = wb.seq_lens.clone()
    g = torch.Generator().manual_seed(3)
    with pytest.raises(CaptureError, match=match):
        graphs.run(*random_batch(g, wb, device, 3), host_slots=host_slots)
    assert torch.equal(before, wb.seq_lens)


@pytest.mark.parametrize(
    "mangle, match",
    [(lambda s, a, t, h: (s[:0], a[:0], t[:0], h[:0]), r"slots must be a non-empty 1-D tensor"),
     (lambda s, a, t, h: (s, a, t, h[:, :5]), r"hidden has shape \(3, 5\), expected \(3, 48\)"),
     (lambda s, a, t, h: (s, a[:2], t, h), r"accepted has shape \(2,\), expected \(3,\)"),
     (lambda s, a, t, h: (s, a, t[:, None], h), r"tokens has shape \(3, 1\), expected \(3,\)"),
     (lambda s, a, t, h: (s.tolist(), a, t, h), r"slots must be a torch.Tensor, got list")],
)
def test_malformed_inputs_are_named_before_anything_is_written(device, mangle, match):
    _, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,), manifest_path=None))
    graphs.capture()
    before = wb.seq_lens.clone(), wb.ring.clone(), [x.clone() for x in graphs._buckets[0].inputs]
    with pytest.raises(CaptureError, match=match):
        graphs.run(*mangle(*random_batch(torch.Generator().manual_seed(1), wb, device, 3)))
    assert torch.equal(before[0], wb.seq_lens) and torch.equal(before[1], wb.ring)
    assert all(torch.equal(x, y) for x, y in zip(before[2], graphs._buckets[0].inputs))


@pytest.mark.parametrize("abandon", ["static_inputs", "run_after_guard"])
def test_rows_written_without_a_replay_become_padding_again(device, abandon):
    """An engine that wrote a larger batch and gave up (or a run() stopped by the address guard) must not replay
    those rows as live at the next smaller batch: only the new batch's windows advance (vs the plain loop)."""
    _, wb_ref, loop_ref = build(device)
    st, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(8,), manifest_path=None))
    graphs.capture()
    g = torch.Generator().manual_seed(13)
    big = random_batch(g, wb, device, 7)
    if abandon == "static_inputs":
        for view, x in zip(graphs.static_inputs(7), big):
            view.copy_(x)
    else:
        k = st.k_full
        old = k.data
        k.set_(k.clone())  # the guard stops the run
        with pytest.raises(CaptureError, match="moved since capture"):
            graphs.run(*big)
        k.set_(old)
    small = random_batch(g, wb, device, 3)
    ref = loop_ref(*small)
    out = graphs.run(*small)
    torch.testing.assert_close(out.scores, ref.scores, rtol=1e-4, atol=1e-4)
    assert torch.equal(wb.seq_lens, wb_ref.seq_lens) and torch.equal(wb.ring, wb_ref.ring)


def test_wrong_dtypes_are_named_before_anything_is_written(device):
    _, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,), manifest_path=None))
    graphs.capture()
    before = wb.seq_lens.clone()
    for b in (3, 6):  # a bucket, and the eager path above the largest bucket
        s, a, t, h = random_batch(torch.Generator().manual_seed(2), wb, device, b)
        with pytest.raises(CaptureError, match=r"hidden has dtype torch.float64, expected torch.float32"):
            graphs.run(s, a, t, h.double())
        with pytest.raises(CaptureError, match=r"accepted has dtype torch.float32, expected an integer dtype"):
            graphs.run(s, a.float(), t, h)
    assert torch.equal(before, wb.seq_lens)


def test_unwritable_manifest_does_not_lose_the_iteration(device, tmp_path, caplog):
    _, wb_ref, loop_ref = build(device)
    _, wb, loop = build(device)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,), manifest_path=blocker / "m.json",
                                                       flush_every_s=0.0))
    with pytest.raises(OSError):  # at capture the write is part of the call: the error is the caller's
        graphs.capture()
    batch = random_batch(torch.Generator().manual_seed(4), wb, device, 3)
    out = graphs.run(*batch)  # the periodic flush fails: warned, the outputs still come back
    torch.testing.assert_close(out.scores, loop_ref(*batch).scores, rtol=1e-4, atol=1e-4)
    assert "could not write manifest" in caplog.text


def test_zero_copy_replay_equals_run(device):
    """An engine that writes its batch into static_inputs(b) and calls replay(b) gets what run() gives, including
    when a smaller batch follows a larger one in the same bucket (the rows past it must be padding again)."""
    _, wb_ref, loop_ref = build(device)
    _, wb, loop = build(device)
    ref = DraftGraphs.for_loop(loop_ref, CaptureOptions(backend="eager", buckets=(2, 8), manifest_path=None))
    zc = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(2, 8), manifest_path=None))
    ref.capture()
    zc.capture()
    g = torch.Generator().manual_seed(11)
    for b in (7, 3, 8, 1, 5, 2):
        batch = random_batch(g, wb, device, b)
        want = ref.run(*batch, copy=True)
        for view, x in zip(zc.static_inputs(b), batch):
            view.copy_(x)
        got = zc.replay(b)
        for x, y, name in zip(got, want, got._fields):
            assert torch.equal(x, y), f"batch {b}: {name}"
        assert torch.equal(wb.ring, wb_ref.ring) and torch.equal(wb.seq_lens, wb_ref.seq_lens)
        assert int(wb.seq_lens[wb.padding_slot]) == 0
    assert [r.replays for r in zc.buckets] == [r.replays for r in ref.buckets] == [2, 4]
    for bad in (0, 9, 3.0, True):
        for call in (zc.static_inputs, zc.replay):
            with pytest.raises(CaptureError, match=rf"batch {bad!r} is not an int in the captured buckets' range 1..8"):
                call(bad)


def test_run_writes_any_integer_dtype_and_layout_exactly(device):
    """run()'s input copy (BucketGraph.write): the static dtypes as they are (on CUDA its one-launch byte copy; on a
    CPU the per-pair copy), other integer dtypes and non-contiguous sources (the per-pair copy everywhere), random
    batch sizes within one bucket: the first B static rows equal the batch's values, the rows past them keep what
    they held."""
    _, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(8,), manifest_path=None))
    graphs.capture()
    bucket = graphs.bucket_graph(8)
    g = torch.Generator().manual_seed(5)
    for trial in range(24):
        b = int(torch.randint(1, 9, (), generator=g))
        batch = random_batch(g, wb, device, b)
        batch[3] = batch[3].to(bucket.inputs[3].dtype)
        for i in range(3):  # slots, accepted, tokens: int32 or int64, either way
            batch[i] = batch[i].to((torch.int32, torch.int64)[int(torch.randint(2, (), generator=g))])
        if trial % 3 == 1:  # strided sources: every other element of a twice-as-long tensor
            batch = [torch.stack([x, x], dim=0).transpose(0, 1).reshape(2 * b, *x.shape[1:])[::2] for x in batch]
        if trial % 3 == 2:
            batch[3] = batch[3].t().contiguous().t()  # column-major hidden
        before = [x.clone() for x in bucket.inputs]
        bucket.write(*batch)
        for name, x, static, old in zip(("slots", "accepted", "tokens", "hidden"), batch, bucket.inputs, before):
            assert torch.equal(static[:b], x.to(static.dtype)), f"trial {trial}, batch {b}: {name}"
            assert torch.equal(static[b:], old[b:]), f"trial {trial}, batch {b}: {name} rows past the batch"


def test_common_word_is_the_widest_view_torch_allows():
    """BucketGraph.write's one-dtype copy views every tensor as `common_word`: against torch's own rule, on random
    dense tensors (dtypes, shapes, storage offsets), every tensor views as it with the same bytes, and none wider
    would do for all of them."""
    from graphcap.engine.bucket_graph import WORDS, common_word

    g = torch.Generator().manual_seed(11)
    dtypes = (torch.int64, torch.int32, torch.bfloat16, torch.float32, torch.uint8, torch.int16)

    def views(x, word) -> bool:
        try:
            x.view(word)
        except RuntimeError:
            return False
        return True

    for _ in range(300):
        ts = []
        for _ in range(int(torch.randint(1, 5, (), generator=g))):
            dt = dtypes[int(torch.randint(len(dtypes), (), generator=g))]
            shape = [int(torch.randint(1, 6, (), generator=g)) for _ in range(int(torch.randint(1, 3, (), generator=g)))]
            off = int(torch.randint(0, 4, (), generator=g))
            n = 1
            for d in shape:
                n *= d
            base = torch.randint(0, 100, (n + off,), generator=g).to(dt)
            ts.append(base[off:].view(shape))
        word = common_word(ts)
        for x in ts:
            assert torch.equal(x.view(word).view(torch.uint8), x.view(torch.uint8))
        wider = [w for w in WORDS if w.itemsize > word.itemsize]
        assert all(not all(views(x, w) for x in ts) for w in wider), ([(x.dtype, x.shape, x.storage_offset())
                                                                      for x in ts], word)


def test_prepared_replay_equals_run_with_one_dispatch_per_batch_size(device):
    """prepare(b) - an engine's one dispatch per call - gives what run() gives: the batch written in one copy (or
    its accepted counts left at 0 for a function that takes them itself), padding rows reset after a larger batch,
    the same handle for the same b, None above the largest bucket (counted there by run(), not by prepare())."""
    _, wb_ref, loop_ref = build(device)
    _, wb, loop = build(device)
    ref = DraftGraphs.for_loop(loop_ref, CaptureOptions(backend="eager", buckets=(2, 8), manifest_path=None))
    ours = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(2, 8), manifest_path=None))
    with pytest.raises(CaptureError, match="prepare.. before capture"):
        ours.prepare(2)
    ref.capture()
    ours.capture()
    g = torch.Generator().manual_seed(13)
    for b in (7, 3, 8, 1, 5, 2, 6):
        batch = random_batch(g, wb, device, b)
        want = ref.run(*batch, copy=True)
        replay = ours.prepare(b)
        assert replay is ours.prepare(b) and not replay.pure  # eager backend: the function's Python runs
        if b % 2:
            replay.write(*batch)
        else:  # accepted left as it is: write the counts through inputs() as an engine's own copy would
            replay.write(batch[0], None, batch[2], batch[3])
            replay.inputs()[1].copy_(batch[1])
        got = replay()
        for x, y, name in zip(got, want, got._fields):
            assert torch.equal(x, y), f"batch {b}: {name}"
        assert torch.equal(wb.ring, wb_ref.ring) and torch.equal(wb.seq_lens, wb_ref.seq_lens)
    assert [r.replays for r in ours.buckets] == [r.replays for r in ref.buckets]
    assert ours.prepare(9) is None and ours.oversize_fallbacks == 0
    with pytest.raises(CaptureError, match=r"batch 0 is not an int in the captured buckets' range 1..8"):
        ours.prepare(0)
    old = ours.prepare(2)
    ours.recapture()
    assert ours.prepare(2) is not old  # a handle never outlives the buckets it replays


@pytest.mark.parametrize("replay_checks", [True, False])
def test_address_guard_every_replay_or_every_interval(device, replay_checks):
    """replay_checks (default): a moved static tensor is refused before the replay. Off (an engine's lean hot path):
    replays go on until the flush interval ends, then the same error names the tensor."""
    st, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,), manifest_path=None,
                                                       flush_every_s=3600.0, replay_checks=replay_checks))
    graphs.capture()
    g = torch.Generator().manual_seed(3)
    st.k_swa.set_(st.k_swa.clone())
    moved = r"static tensor 'sliding.k_pool' moved since capture"
    if replay_checks:
        with pytest.raises(CaptureError, match=moved):
            graphs.run(*random_batch(g, wb, device, 2))
        return
    graphs.run(*random_batch(g, wb, device, 2))  # within the interval: not checked
    graphs.prepare(3)()
    graphs._last_flush -= 3601.0  # the interval is over
    with pytest.raises(CaptureError, match=moved):
        graphs.prepare(2)()
    graphs.run(*random_batch(g, wb, device, 2))  # the next check is an interval later again


def test_moved_static_tensor_is_caught_and_recapture_recovers(device):
    st, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,), manifest_path=None))
    with pytest.raises(CaptureError, match="before capture"):
        graphs.run(*random_batch(torch.Generator(), wb, device, 2))
    graphs.capture()
    # The engine reallocates its SWA K pool (e.g. after a resize): the graphs would read freed memory.
    st.k_swa.set_(st.k_swa.clone())
    g = torch.Generator().manual_seed(5)
    with pytest.raises(CaptureError, match=r"static tensor 'sliding.k_pool' moved since capture.*recapture"):
        graphs.run(*random_batch(g, wb, device, 2))
    graphs.recapture()
    _, wb_ref, loop_ref = build(device)
    batch = random_batch(g, wb, device, 2)
    torch.testing.assert_close(graphs.run(*batch).scores, loop_ref(*batch).scores, rtol=1e-4, atol=1e-4)


def test_bad_construction(device):
    _, _, loop = build(device)
    with pytest.raises(ValueError, match=r"^CaptureOptions: backend must be one of .*cudagraph.*, got 'fast'$"):
        CaptureOptions(backend="fast", manifest_path=None)
    with pytest.raises(ValueError, match="strictly increasing"):
        DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4, 2), manifest_path=None))
    if device == "cpu":
        for backend in ("cudagraph", "inductor-cudagraph", "reduce-overhead"):
            with pytest.raises(ValueError, match=f"backend '{backend}' records CUDA graphs"):
                DraftGraphs.for_loop(loop, CaptureOptions(backend=backend, manifest_path=None))


@pytest.mark.compile
@pytest.mark.thorough  # one compile per bucket: a variant of the default one compile for every bucket (below)
def test_compiled_backend_matches_eager_and_never_recompiles(device, tmp_path):
    """Inductor (no CUDA graphs: the CPU path) over two buckets, one compile per bucket (`dynamic_batch=False`; the
    default one compile for all is the dynamic_batch test's); a run at each bucket size, then more runs at other
    sizes that map onto the same buckets - no new compilation."""
    if device == "cuda":
        pytest.skip("the GPU file checks the compiled backends with graphs")
    with twins_on_cpu():  # Inductor cannot lower interpreted Triton kernels: the twins are the CPU path
        _, wb_ref, loop_ref = build(device)
        _, wb, loop = build(device)
        graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", buckets=(2, 4), manifest_path=None,
                                                           dynamic_batch=False))
        graphs.capture()
        g = torch.Generator().manual_seed(11)
        for b in (2, 4, 1, 3, 4):
            batch = random_batch(g, wb, device, b)
            ref = loop_ref(*batch)
            out = graphs.run(*batch)
            torch.testing.assert_close(out.scores, ref.scores, rtol=1e-3, atol=1e-3)
            assert torch.equal(wb.ring, wb_ref.ring)
        assert all(r.status == "captured" for r in graphs.buckets)


@pytest.mark.subprocess
@pytest.mark.parametrize("register", [False, True])
def test_counters_reach_the_manifest_at_exit_only_where_the_program_asks(tmp_path, device, register):
    """The library registers no exit hook: replays after the last timed flush reach the file at exit only in a
    program that registered `atexit.register(g.flush)` itself (as the sglang plugin does); otherwise the file keeps
    what capture wrote (no replays). Nothing is printed either way."""
    import subprocess
    import sys
    import textwrap

    if device == "cuda":
        pytest.skip("CPU subprocess check")
    path = tmp_path / "m.json"
    code = textwrap.dedent(f"""
        import atexit, sys, torch
        sys.path[:0] = {[str(p) for p in __import__('pathlib').Path(__file__).parents[:2]]!r}  # its directory, tests/
        from test_capture import build, random_batch
        from graphcap.engine.capture import DraftGraphs
        from graphcap.engine.options import CaptureOptions
        from graphcap.kernels import twins_on_cpu
        with twins_on_cpu():
            _, wb, loop = build("cpu")
            g = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,),
                                                          manifest_path={str(path)!r}, flush_every_s=1e9))
            if {register}:
                atexit.register(g.flush)
            g.capture()
            for _ in range(3):
                g.run(*random_batch(torch.Generator(), wb, "cpu", 3))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "graphcap" not in r.stderr
    rec = mf.read_manifest(path).buckets[0]
    assert (rec.status, rec.replays, rec.padded_rows) == (("captured", 3, 3) if register else ("captured", 0, 0))


class _Recorder(CaptureObserver):
    def __init__(self):
        self.events = []

    def on_bucket_start(self, size, index, total):
        self.events.append(("start", size, index, total))

    def on_bucket_captured(self, record, index, total):
        self.events.append(("captured", record.batch_size, record.status, index, total))

    def on_capture_done(self, summary):
        self.events.append(("done", summary))

    def on_flush(self, manifest):
        self.events.append(("flush", [(r.batch_size, r.replays) for r in manifest.buckets]))


def test_observers_see_every_bucket_the_summary_and_the_flushes(device, capfd, caplog):
    """Hooks in order (largest bucket first), the summary's numbers, the periodic and explicit flushes with the
    counters; the library writes nothing to stdout/stderr unless progress=True, and LoggingProgress logs the same
    summary instead."""
    import logging

    _, wb, loop = build(device)
    rec, logged = _Recorder(), LoggingProgress(logging.getLogger("graphcap.test"))
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(2, 4, 8), manifest_path=None,
                                                       flush_every_s=1e9), observers=[rec, logged])
    with caplog.at_level(logging.INFO, logger="graphcap.test"):
        graphs.capture()
    starts = [e for e in rec.events if e[0] == "start"]
    assert starts == [("start", 8, 1, 3), ("start", 4, 2, 3), ("start", 2, 3, 3)]
    assert [e for e in rec.events if e[0] == "captured"] == [("captured", s, "captured", i, 3)
                                                             for s, i in ((8, 1), (4, 2), (2, 3))]
    assert rec.events[-2] == ("flush", [(2, 0), (4, 0), (8, 0)])  # the capture's own flush, then the summary
    done = rec.events[-1][1]
    assert (done.captured, done.buckets, done.backend, done.manifest_path) == (3, (2, 4, 8), "eager", None)
    assert caplog.messages == ["graphcap: " + done.text()] and done.text().startswith("captured 3/3 buckets (2..8)")
    g = torch.Generator().manual_seed(1)
    for b in (3, 3, 1):
        graphs.run(*random_batch(g, wb, device, b))
    assert rec.events[-1][0] == "done"  # flush_every_s not reached: no periodic flush
    graphs.flush()
    assert rec.events[-1] == ("flush", [(2, 1), (4, 2), (8, 0)])
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    shown = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(4,), manifest_path=None, progress=True))
    shown.capture()
    err = capfd.readouterr().err
    assert "graphcap: capturing bucket    4 (1/1)" in err
    assert "graphcap: captured 1/1 buckets (4..4) with eager in " in err and err.endswith(" MiB graph memory\n")


def test_failed_bucket_falls_back_to_eager_and_is_recorded(device, tmp_path):
    """A bucket whose capture fails (here: the function raises while being compiled) is marked failed with the reason,
    and its batches run the same function eagerly, counted - results equal the plain loop's."""
    if device == "cuda":
        pytest.skip("CPU check of the fallback path")
    with twins_on_cpu():
        _, wb_ref, loop_ref = build(device)
        _, wb, loop = build(device)
        failing = {"on": True}

        def fn(slots, accepted, tokens, hidden):
            if failing["on"]:
                raise RuntimeError("simulated capture failure")
            return loop(slots, accepted, tokens, hidden)

        path = tmp_path / "m.json"
        graphs = DraftGraphs(fn, example_inputs=loop.example_inputs, static_tensors=loop.static_tensors(),
                             padding_slot=wb.padding_slot, spec=SPEC,
                             options=CaptureOptions(backend="compile", buckets=(4,), manifest_path=path))
        graphs.capture()
        rec = graphs.buckets[0]
        assert rec.status == "failed" and "simulated capture failure" in rec.reason
        failing["on"] = False
        g = torch.Generator().manual_seed(2)
        for b in (3, 4):
            batch = random_batch(g, wb, device, b)
            ref = loop_ref(*batch)
            out = graphs.run(*batch)
            assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.scores, ref.scores)
        assert torch.equal(wb.ring, wb_ref.ring)
        graphs.flush()
        m = mf.read_manifest(path)
        assert m.buckets[0].fallbacks == 2 and m.buckets[0].replays == 0 and m.buckets[0].status == "failed"


@pytest.mark.subprocess
def test_engine_imports_no_model():
    """The engine captures any fn -> DraftOutput: importing it (and its types) must not import the reference model,
    and the models' DraftOutput is the engine's."""
    import subprocess
    import sys

    code = ("import sys, graphcap.engine.capture, graphcap.engine.recording, graphcap.engine.iteration; "
            "print(sorted(m for m in sys.modules if m.startswith('graphcap.models')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    from graphcap.engine import iteration
    from graphcap.models import DraftOutput
    assert DraftOutput is iteration.DraftOutput


@pytest.mark.compile
@pytest.mark.parametrize("names", [("dynamic",), thorough(("static", "dynamic"), id="static,dynamic")], ids=",".join)
def test_dynamic_batch_compiles_once_for_every_bucket(device, tmp_path, names):
    """dynamic_batch=True: three buckets, one Dynamo frame compile (one cache entry, one unique graph; the static
    compile: three), and the outputs agree with the eager loop's - and in the thorough tier with the per-bucket
    static compile's (three compiles more) - each on its own twin state, at batch sizes that pad into every bucket:
    the same windows, the same decided tokens, scores and hidden within 1e-4. The manifest says which was used."""
    if device == "cuda":
        pytest.skip("CPU check with the compile backend; the GPU backends need a GPU run")
    from torch._dynamo.utils import counters

    from graphcap.engine.guards import cache_entries

    with twins_on_cpu():  # Inductor cannot lower interpreted Triton kernels: the twins are the CPU path
        loops = {name: build(device) for name in ("eager", *names)}
        buckets = (1, 2, 5)
        graphs = {}
        for name in names:
            before = counters["stats"]["unique_graphs"]
            graphs[name] = DraftGraphs.for_loop(loops[name][2], CaptureOptions(backend="compile", buckets=buckets,
                                                                               manifest_path=tmp_path / f"{name}.json",
                                                                               dynamic_batch=name == "dynamic"))
            graphs[name].capture()
            assert [r.status for r in graphs[name].buckets] == ["captured"] * 3, graphs[name].buckets
            want = 1 if name == "dynamic" else len(buckets)
            assert cache_entries(graphs[name]._compiled.code) == want
            assert counters["stats"]["unique_graphs"] - before == want
        g = torch.Generator().manual_seed(21)
        for b in (5, 1, 2, 4, 3, 1, 5, 7):  # 7: above the largest bucket, eager in both
            batch = random_batch(g, loops["eager"][1], device, b)
            want = loops["eager"][2](*batch)
            got = {name: gr.run(*batch, copy=True) for name, gr in graphs.items()}
            # Bit for bit against the static compile except at bucket 1, where Inductor's code for a static batch of
            # 1 differs from the symbolic batch's (~1e-6 here); Inductor differs from eager per bucket too (fp32
            # reductions' last bits). Same decided tokens everywhere.
            if b > 1 and "static" in got:
                for x, y, field in zip(got["dynamic"], got["static"], want._fields):
                    assert torch.equal(x, y), (b, field)
            decided = want.margins > 1e-3
            for name in graphs:
                for field in ("scores", "margins", "hidden"):
                    torch.testing.assert_close(getattr(got[name], field), getattr(want, field), rtol=1e-4, atol=1e-4)
                assert torch.equal(got[name].tokens[decided], want.tokens[decided]), (name, b)
                assert torch.equal(loops[name][1].ring, loops["eager"][1].ring)
                assert torch.equal(loops[name][1].seq_lens, loops["eager"][1].seq_lens)
        for name, gr in graphs.items():
            assert cache_entries(gr._compiled.code) == (1 if name == "dynamic" else 3)  # nothing compiled since
            gr.flush()
            assert mf.read_manifest(tmp_path / f"{name}.json").dynamic_batch is (name == "dynamic")
    with pytest.raises(ValueError, match="dynamic_batch compiles once for every bucket; backend 'eager'"):
        DraftGraphs.for_loop(build(device)[2], CaptureOptions(backend="eager", manifest_path=None, dynamic_batch=True))


def test_for_loop_compiles_once_for_every_bucket_by_default(device):
    """The loop is built for one symbolic-batch compile, so for_loop asks for it with every compiled backend and
    never with the ones that compile nothing (where dynamic_batch would be refused); an explicit choice wins."""
    compiled = ["compile"] + (["inductor-cudagraph", "reduce-overhead"] if device == "cuda" else [])
    plain = ["eager"] + (["cudagraph"] if device == "cuda" else [])
    for backend in compiled + plain:
        graphs = DraftGraphs.for_loop(build(device)[2], CaptureOptions(backend=backend, buckets=(1, 2),
                                                                       manifest_path=None))
        assert graphs.dynamic_batch is (backend in compiled), backend
    graphs = DraftGraphs.for_loop(build(device)[2], CaptureOptions(backend="compile", buckets=(1, 2),
                                                                   manifest_path=None, dynamic_batch=False))
    assert graphs.dynamic_batch is False


@pytest.mark.compile
@pytest.mark.thorough  # the skinny GEMM's op set: a variant of the default op set's compile (above)
def test_skinny_gemm_op_set_compiles_once_for_every_bucket(device):
    """SKINNY_OPS under the default one compile for all buckets: its row-count rule (<= MAX_M rows) and the opaque
    ops' fakes hold for the symbolic batch - one Dynamo entry, every bucket captured - and the replays draft what
    the same op set drafts eagerly (decided tokens; scores within bf16 rounding)."""
    if device == "cuda":
        pytest.skip("CPU check with the compile backend; the GPU runs it in the bench's graphcap-skinny-gemm mode")
    from graphcap.models.draft_ops import SKINNY_OPS

    n = SPEC.capture.max_slots
    lens = [5 + 3 * i for i in range(n)]
    st = make_target_state(SPEC, lens, [x + 60 for x in lens], slots=list(range(n)), seed=1)
    model = FrozenKVDraft(SPEC, seed=2, dtype=torch.bfloat16)
    loops = []
    for _ in range(2):
        wb = WindowBuffers.from_spec(SPEC, st.req_to_token, st.full_to_swa)
        wb.reset(list(range(n)), lens)
        pools = (t.to(torch.bfloat16) for t in (st.k_swa, st.v_swa, st.k_full, st.v_full))
        loops.append(DraftLoop(model, wb, *pools, ops=SKINNY_OPS))
    with twins_on_cpu():
        graphs = DraftGraphs.for_loop(loops[0], CaptureOptions(backend="compile", buckets=(1, 2, 4),
                                                               manifest_path=None))
        graphs.capture()
        assert [r.status for r in graphs.buckets] == ["captured"] * 3 and graphs._compiled.entries == 1
        g = torch.Generator().manual_seed(5)
        for b in (3, 1, 4):
            slots = torch.randperm(n, generator=g)[:b]
            accepted = torch.randint(1, SPEC.capture.steps + 2, (b,), generator=g)
            tokens = torch.randint(0, SPEC.draft.vocab, (b,), generator=g)
            hidden = torch.randn(b, SPEC.target.hidden, generator=g).to(torch.bfloat16)
            got, want = graphs.run(slots, accepted, tokens, hidden, copy=True), loops[1](slots, accepted, tokens,
                                                                                          hidden)
            decided = want.margins[:, 0] > 0.05
            assert torch.equal(got.tokens[decided, 0], want.tokens[decided, 0]), b
            torch.testing.assert_close(got.scores[:, 0], want.scores[:, 0], rtol=2e-2, atol=2e-2)


@pytest.mark.compile
def test_dynamic_batch_on_a_torch_whose_unbacked_marks_take_no_range(device, tmp_path, monkeypatch):
    """torch 2.11's mark_unbacked has no min/max (the H200's torch): the batch's range [1, largest bucket] is then
    stated inside the compiled function. Simulated here by hiding the range parameters: still one compile for every
    bucket, every bucket captured, the same decided tokens as the eager loop."""
    if device == "cuda":
        pytest.skip("CPU check with the compile backend; the GPU backends need a GPU run")
    import inspect

    from graphcap.engine import recording
    from graphcap.engine.guards import cache_entries

    params = set(inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters) - {"min", "max"}
    monkeypatch.setattr(recording, "_MARK_UNBACKED_PARAMS", frozenset(params))
    seen = []
    real = torch._dynamo.decorators.mark_unbacked
    monkeypatch.setattr(torch._dynamo.decorators, "mark_unbacked", lambda t, i, **kw: (seen.append(kw), real(t, i, **kw)))
    with twins_on_cpu():
        eager, dyn = build(device), build(device)
        graphs = DraftGraphs.for_loop(dyn[2], CaptureOptions(backend="compile", buckets=(1, 2, 5), manifest_path=None,
                                                             dynamic_batch=True))
        graphs.capture()
        assert seen and all("min" not in kw and "max" not in kw for kw in seen)
        assert [r.status for r in graphs.buckets] == ["captured"] * 3
        assert_drafts_as_eager(graphs, eager, device, (5, 1, 3, 2), seed=5)
        assert cache_entries(graphs._compiled.code) == 1


@pytest.mark.compile
def test_compile_max_batch_sizes_the_one_compile_beyond_the_captured_buckets(device, monkeypatch):
    """compile_max_batch (what the benches pass: the spec's largest bucket while capturing only the measured ones):
    the batch is marked and ranged up to it, not up to the largest captured bucket - the code a server capturing
    every bucket compiles - and it is part of the compile cache's key; the buckets still capture and draft as the
    eager loop does. A value below the largest bucket, not an int, or without the one compile is refused, named."""
    if device == "cuda":
        pytest.skip("CPU check with the compile backend; the GPU backends need a GPU run")
    import graphcap.engine.shared_compile as shared_compile

    tops, ranges = [], []
    real_mark, real_compile = shared_compile.mark_batch_unbacked, shared_compile.compile_iteration
    monkeypatch.setattr(shared_compile, "mark_batch_unbacked", lambda t, top: (tops.append(top), real_mark(t, top)))
    monkeypatch.setattr(shared_compile, "compile_iteration",
                        lambda *a, **kw: (ranges.append(kw["batch_range"]), real_compile(*a, **kw))[1])
    with twins_on_cpu():
        eager, dyn = build(device), build(device)
        graphs = DraftGraphs.for_loop(dyn[2], CaptureOptions(backend="compile", buckets=(1, 2), manifest_path=None,
                                                             compile_max_batch=7))
        plain = DraftGraphs.for_loop(build(device)[2], CaptureOptions(backend="compile", buckets=(1, 2),
                                                                      manifest_path=None))
        assert graphs._compile.cache_key() != plain._compile.cache_key()
        graphs.capture()
        assert set(tops) == {7} and ranges == [(1, 7)] and graphs._compiled.entries == 1
        assert_drafts_as_eager(graphs, eager, device, (2, 1), seed=9)
    for bad, kw in ((1, {}), (8, {"dynamic_batch": False})):
        with pytest.raises(ValueError, match=rf"compile_max_batch .* largest bucket 2 .*got {bad!r}"):
            DraftGraphs.for_loop(build(device)[2], CaptureOptions(backend="compile", buckets=(1, 2),
                                                                  manifest_path=None, compile_max_batch=bad, **kw))
    with pytest.raises(ValueError, match=r"^CaptureOptions: compile_max_batch must be an int >= 1 or None, got '8'$"):
        CaptureOptions(compile_max_batch="8")


class _GraphStandIn:
    """Stands in for a recorded CUDA graph (none on a CPU): its replay runs the function over the bucket's
    static inputs into its static outputs - what a replay of the recorded graph computes - so run() and replay()
    take the manual-graph backends' path (cached views of the static outputs, padding resets)."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self):
        for static, x in zip(self.outputs, self.fn(*self.inputs)):
            static.copy_(x)


def graphs_with_cpu_graphs(loop, buckets):
    from graphcap.engine.iteration import DraftOutput

    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=buckets, manifest_path=None))
    graphs.capture()
    for size in buckets:
        bucket = graphs.bucket_graph(size)
        outputs = DraftOutput(*(x.clone() for x in loop(*bucket.inputs)))  # padding rows only: no window moves
        bucket.graph, bucket.outputs = _GraphStandIn(loop, bucket.inputs, outputs), outputs
        bucket.views.clear()
    return graphs


def test_graph_path_reuses_its_views_resets_padding_and_equals_the_loop(device):
    """The graph path's views of the first b rows are made once per b and reused; after a larger batch in the same
    bucket the rows past b are padding again; run() and the zero-copy replay(), interleaved over batch sizes that
    go up and down within each bucket, equal the plain loop on a twin state, windows included."""
    _, wb_ref, loop_ref = build(device)
    _, wb, loop = build(device)
    graphs = graphs_with_cpu_graphs(loop, (2, 8))
    g = torch.Generator().manual_seed(17)
    seen = {}
    for i, b in enumerate((7, 3, 8, 1, 5, 2, 7, 3, 6, 5, 1, 2)):
        batch = random_batch(g, wb, device, b)
        want = loop_ref(*batch)
        if i % 2:
            for view, x in zip(graphs.static_inputs(b), batch):
                view.copy_(x)
            out = graphs.replay(b)
        else:
            out = graphs.run(*batch, host_slots=batch[0].tolist())
        bucket = graphs.bucket_graph(b)
        assert out is seen.setdefault(b, out), b  # one set of views per b
        assert out.tokens.shape == (b, SPEC.capture.steps) and out.hidden.shape == (b, SPEC.target.hidden)
        assert out.tokens.data_ptr() == bucket.outputs.tokens.data_ptr()  # views of the static outputs
        slots, accepted = bucket.inputs[:2]
        assert bool((slots[b:] == wb.padding_slot).all()) and bool((accepted[b:] == 0).all()), b
        decided = want.margins > 1e-3
        assert torch.equal(out.tokens[decided], want.tokens[decided]), b
        for name in ("scores", "margins", "hidden"):
            torch.testing.assert_close(getattr(out, name), getattr(want, name), rtol=1e-4, atol=1e-4)
        assert torch.equal(wb.ring, wb_ref.ring) and torch.equal(wb.seq_lens, wb_ref.seq_lens)
        assert int(wb.seq_lens[wb.padding_slot]) == 0
    batch = random_batch(g, wb, device, 3)
    kept, want = graphs.run(*batch, copy=True), loop_ref(*batch)
    graphs.run(*random_batch(g, wb, device, 3))  # overwrites the views, not the copy
    torch.testing.assert_close(kept.scores, want.scores, rtol=1e-4, atol=1e-4)
    assert kept.tokens.data_ptr() != graphs.bucket_graph(3).outputs.tokens.data_ptr()


def _variants(b, slots, accepted, tokens, hidden):
    """Batches check_batch must judge exactly as its full check does: valid ones in unusual forms and broken ones."""
    yield "as is", (slots, accepted, tokens, hidden)
    yield "no accepted", (slots, None, tokens, hidden)
    for dtype in (torch.int16, torch.uint8, torch.int64, torch.bool, torch.float32, torch.complex64):
        yield f"accepted {dtype}", (slots, accepted.to(dtype), tokens, hidden)
    for dtype in (torch.int32, torch.float32):
        yield f"slots {dtype}", (slots.to(dtype), accepted, tokens, hidden)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        yield f"hidden {dtype}", (slots, accepted, tokens, hidden.to(dtype))
    yield "hidden non-contiguous", (slots, accepted, tokens, hidden.t().contiguous().t())
    yield "hidden a Parameter", (slots, accepted, tokens, torch.nn.Parameter(hidden, requires_grad=False))
    yield "hidden too narrow", (slots, accepted, tokens, hidden[:, :-1])
    yield "tokens 2-D", (slots, accepted, tokens[:, None], hidden)
    yield "accepted short", (slots, accepted[:-1], tokens, hidden)
    yield "slots 2-D", (slots[:, None], accepted, tokens, hidden)
    yield "slots 0-D", (slots[0], accepted, tokens, hidden)
    yield "slots a list", (slots.tolist(), accepted, tokens, hidden)
    yield "tokens a list", (slots, accepted, tokens.tolist(), hidden)
    for i, name in enumerate(("slots", "accepted", "tokens", "hidden")):
        batch = [slots, accepted, tokens, hidden]
        batch[i] = batch[i].to("meta")  # another device than the graphs', without a second GPU
        yield f"{name} on meta", tuple(batch)


def test_check_batch_remembers_only_what_the_full_check_passed(device):
    """DraftGraphs.check_batch (a BatchCheck) remembers the tensor metadata of batches its full check passed: over
    valid batches in unusual forms and broken ones, in random orders and again once every valid kind is remembered,
    with and without host_slots (good, short, duplicated, out of range), it raises exactly when the full check
    (guards.check_batch_inputs) raises, with the same message - and a remembered kind skips the full check."""
    import random

    import graphcap.engine.guards as guards

    st, wb, loop = build(device)
    graphs = DraftGraphs.for_loop(loop, CaptureOptions(backend="eager", buckets=(2, 8), manifest_path=None))
    ref = graphs._buckets[0].inputs
    g = torch.Generator().manual_seed(31)
    rng = random.Random(5)
    cases = []
    for b in (1, 3, 8, 9):
        slots, accepted, tokens, hidden = random_batch(g, wb, device, b)
        good = slots.tolist()
        hosts = [None, good, good[:-1] or [0, 1], [good[0]] * b, [wb.padding_slot] + good[1:]]
        cases += [(f"{name}, host_slots {h}", batch, h) for name, batch in _variants(b, slots, accepted, tokens, hidden)
                  for h in hosts]

    def verdict(fn, batch, h):
        s, a, t, x = batch
        try:
            fn(s, t, x, accepted=a, host_slots=h, call="run")
        except CaptureError as e:
            return str(e)
        return None

    full = {i: verdict(lambda *a, **k: guards.check_batch_inputs(ref, graphs.device, graphs.padding_slot, *a, **k),
                       batch, h) for i, (_, batch, h) in enumerate(cases)}
    assert sum(v is None for v in full.values()) > 20 and sum(v is not None for v in full.values()) > 100
    for _ in range(2):  # the second round with every valid kind remembered
        order = list(range(len(cases)))
        rng.shuffle(order)
        for i in order:
            name, batch, h = cases[i]
            assert verdict(graphs.check_batch, batch, h) == full[i], name
    checked = []
    real = guards.check_batch_inputs
    guards.check_batch_inputs = lambda *a, **k: (checked.append(1), real(*a, **k))[1]
    try:
        name, batch, h = next(c for i, c in enumerate(cases) if full[i] is None and c[2] is not None)
        assert verdict(graphs.check_batch, batch, h) is None and not checked, name
    finally:
        guards.check_batch_inputs = real


def _ptrs_equal_twin(tensors, data_ptrs, indices):
    """torch._C._tensors_data_ptrs_at_indices_equal as torch's CUDA builds define it (a CPU build has none)."""
    return all(tensors[i].data_ptr() == data_ptrs[i] for i in indices)


@pytest.mark.parametrize("check", ["native", "python"])
@pytest.mark.parametrize("move", ["set_", "data", "resize_", "offset"])
def test_a_static_tensor_moved_after_warm_runs_is_refused(device, move, check, monkeypatch):
    """Every way a static tensor's address can change in place is refused by run() and replay() after calls that
    made every per-call cache (the guard checks every tensor at every call), and nothing was replayed - through
    torch's C++ check where torch has it (its twin here where it does not) and through the Python loop."""
    import graphcap.engine.guards as guards

    native = guards._ptrs_equal or _ptrs_equal_twin
    calls = []
    monkeypatch.setattr(guards, "_ptrs_equal", (lambda *a: (calls.append(1), native(*a))[1]) if check == "native"
                        else None)
    st, wb, loop = build(device)
    graphs = graphs_with_cpu_graphs(loop, (2, 8))
    g = torch.Generator().manual_seed(23)
    for b in (7, 3, 8, 1):
        graphs.run(*random_batch(g, wb, device, b))
        graphs.replay(b)
    name = {"set_": "full.k_pool", "data": "model.embed", "resize_": "sliding.v_pool", "offset": "window.ring"}[move]
    t = graphs._static.persistent[name]
    if move == "set_":
        t.set_(t.clone())
    elif move == "data":
        t.data = t.data.clone()
    elif move == "resize_":
        t.resize_(2 * t.shape[0], *t.shape[1:])  # beyond its storage: reallocated
    else:
        t.set_(t.data[1:])  # the same storage, one row further
    replays = [r.replays for r in graphs.buckets]
    for b in (3, 7):
        with pytest.raises(CaptureError, match=rf"static tensor '{name}' moved since capture"):
            graphs.run(*random_batch(g, wb, device, b))
        with pytest.raises(CaptureError, match=rf"static tensor '{name}' moved since capture"):
            graphs.replay(b)
    assert [r.replays for r in graphs.buckets] == replays
    assert (len(calls) > 8) == (check == "native")


def test_address_guard_asks_a_subclass_that_overrides_data_ptr_its_own():
    """The guard reads plain tensors' addresses through the unbound method; a subclass with its own data_ptr is
    asked through it, and a move of either kind is named."""
    from graphcap.engine.guards import AddressGuard

    asked = []

    class Own(torch.Tensor):
        def data_ptr(self):
            asked.append(1)
            return super().data_ptr()

    plain, own = torch.zeros(4), torch.zeros(4).as_subclass(Own)
    guard = AddressGuard({"plain": plain, "own": own})
    before = len(asked)
    guard.check()
    assert len(asked) > before
    own.set_(torch.zeros(4))
    with pytest.raises(CaptureError, match="static tensor 'own' moved"):
        guard.check()
    only_plain = AddressGuard({"plain": plain})
    plain.set_(torch.zeros(4))
    with pytest.raises(CaptureError, match="static tensor 'plain' moved"):
        only_plain.check()


def test_address_guard_takes_the_path_it_is_asked_for(monkeypatch):
    """native=False reads the addresses in Python even where torch has the C++ check; native=True refuses a torch
    without it (or a tensor with its own data_ptr) instead of silently taking the other path; both catch a move."""
    import graphcap.engine.guards as guards
    from graphcap.engine.guards import AddressGuard

    calls = []
    monkeypatch.setattr(guards, "_ptrs_equal", lambda *a: (calls.append(1), _ptrs_equal_twin(*a))[1])
    g = torch.Generator().manual_seed(5)
    tensors = {f"t{i}": torch.randn(int(torch.randint(1, 9, (1,), generator=g)), generator=g) for i in range(6)}
    for native, expect_calls in ((None, True), (True, True), (False, False)):
        calls.clear()
        guard = AddressGuard(tensors, native=native)
        guard.check()
        assert bool(calls) == expect_calls, native
    moved = next(iter(tensors))
    for native in (True, False):
        guard = AddressGuard(tensors, native=native)
        tensors[moved].set_(tensors[moved].clone())
        with pytest.raises(CaptureError, match=f"static tensor '{moved}' moved"):
            guard.check()
    monkeypatch.setattr(guards, "_ptrs_equal", None)
    with pytest.raises(ValueError, match="native=True"):
        AddressGuard(tensors, native=True)
    AddressGuard(tensors, native=None).check()  # falls back to the loop
