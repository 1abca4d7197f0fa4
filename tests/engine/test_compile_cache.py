"""graphcap.engine.compile_cache: the key, the rules that refuse an untrusted cache, a corrupt file, and one CPU capture
that saves its artifacts and a second that loads them (DraftGraphs(compile_cache=...))."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from graphcap.engine import compile_cache as cc

BASE = dict(spec_hash="c5014fdd5fe74bb2", backend="compile", buckets=(1, 2, 4), dynamic_batch=False, device="cpu")


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_key_is_stable_and_covers_what_must_miss(monkeypatch):
    k = cc.cache_key(**BASE)
    assert k == cc.cache_key(**BASE) and len(k) == 64 and int(k, 16) >= 0
    changed = [dict(BASE, spec_hash="0000000000000000"), dict(BASE, backend="inductor-cudagraph"),
               dict(BASE, buckets=(1, 2, 8)), dict(BASE, dynamic_batch=True),
               dict(BASE, spec_hash=None, key="/models/x {'layers': 1}")]
    keys = {cc.cache_key(**kw) for kw in changed}
    assert k not in keys and len(keys) == len(changed)
    assert cc.cache_key(**dict(BASE, buckets=(4, 2, 1))) == k  # the set of buckets, not their order
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cc.cache_key(**BASE) != k
    monkeypatch.undo()
    monkeypatch.setattr(cc, "VERSION", "9.9.9")
    assert cc.cache_key(**BASE) != k
    monkeypatch.undo()
    assert cc.cache_key(**BASE) == k
    with pytest.raises(ValueError, match="cache_key"):
        cc.cache_key(**dict(BASE, spec_hash=None))


@pytest.fixture
def loads(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: calls.append(data) or object())
    return calls


def _cache(tmp_path, dir_mode=0o700, file_mode=0o600, data=b"artifacts"):
    d = tmp_path / "cache"
    d.mkdir()
    f = cc.cache_file(d, "k")
    f.write_bytes(data)
    os.chmod(f, file_mode)
    os.chmod(d, dir_mode)
    return d, f


def test_missing_directory_is_created_0700_and_misses(tmp_path, loads):
    d = tmp_path / "a" / "cache"
    assert cc.load(d, "k") == "miss" and _mode(d) == 0o700 and loads == []


def test_a_private_cache_loads(tmp_path, loads, glog):
    d, _ = _cache(tmp_path)
    assert cc.load(d, "k") == "hit"
    assert loads == [b"artifacts"] and not [r for r in glog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("dir_mode,file_mode,why", [(0o777, 0o600, "writable by others (mode 0777)"),
                                                    (0o770, 0o600, "writable by others (mode 0770)"),
                                                    (0o700, 0o666, "writable by others (mode 0666)")])
def test_a_shared_writable_cache_is_refused(tmp_path, loads, glog, dir_mode, file_mode, why):
    d, f = _cache(tmp_path, dir_mode, file_mode)
    try:
        state = cc.load(d, "k")
    finally:
        os.chmod(d, 0o700)
    assert state.startswith("refused: ") and why in state and loads == []
    warned = [r.getMessage() for r in glog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and str(f) in warned[0] and why in warned[0] and "compiling instead" in warned[0]
    assert f.exists()


def test_a_foreign_owner_or_a_symlink_is_refused(tmp_path, loads, glog, monkeypatch):
    d, f = _cache(tmp_path)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)
    assert "owned by uid" in cc.load(d, "k")
    monkeypatch.undo()
    real = tmp_path / "elsewhere.bin"
    f.rename(real)
    f.symlink_to(real)
    assert cc.load(d, "k") == "refused: the file is a symlink"
    assert loads == [] and len([r for r in glog.records if r.levelname == "WARNING"]) == 2


def test_a_corrupt_cache_warns_once_and_is_left_in_place(tmp_path, glog):
    d, f = _cache(tmp_path, data=b"\x00not a cache")
    assert cc.load(d, "k") == "miss"
    warned = [r.getMessage() for r in glog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and str(f) in warned[0] and "left in place" in warned[0]
    assert f.read_bytes() == b"\x00not a cache"


def test_save_writes_0600_atomically(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"abc", object()))
    p = cc.save(tmp_path / "c", "k")
    assert p == cc.cache_file(tmp_path / "c", "k") and p.read_bytes() == b"abc"
    assert _mode(p) == 0o600 and _mode(p.parent) == 0o700 and os.listdir(p.parent) == ["k.bin"]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    assert cc.save(tmp_path / "d", "k") is None


@pytest.mark.compile
@pytest.mark.thorough  # torch's artifacts alone (precompile=False); the default, precompiled, is the CI tier's below
def test_capture_saves_and_a_fresh_process_state_loads(tmp_path, monkeypatch, cpu_twins):
    """What this shows on a CPU: the first capture (`compile` backend, one bucket) writes the artifacts file (0600,
    directory 0700); after `torch._dynamo.reset()`, with Inductor's own local cache pointed at an empty directory
    (so the second capture cannot just reuse the first's files), a fresh DraftGraphs loads the file (manifest
    "hit", load_cache_artifacts called with its bytes) and its compile gives outputs equal to the first's. Not
    the speed-up: that needs a GPU."""
    from graphcap import manifest as mf
    from graphcap.engine.capture import DraftGraphs
    from graphcap.engine.options import CaptureOptions

    from test_capture import build, random_batch

    def fresh_inductor_cache(name):
        d = tmp_path / name
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(d))
        return d

    cache = tmp_path / "cc"
    fresh_inductor_cache("inductor1")
    torch._dynamo.reset()
    _, wb1, loop1 = build("cpu")
    g1 = DraftGraphs.for_loop(loop1, CaptureOptions(backend="compile", buckets=(4,), manifest_path=tmp_path / "m1.json",
                                                    compile_cache=cache, precompile=False))  # torch's artifacts alone
    g1.capture()
    files = list(cache.iterdir())
    assert [p.name for p in files] == [f"{g1._compile.cache_key()}.bin"]
    assert _mode(files[0]) == 0o600 and _mode(cache) == 0o700
    assert mf.read_manifest(tmp_path / "m1.json").compile_cache == "miss"
    batch = random_batch(torch.Generator().manual_seed(3), wb1, "cpu", 3)
    out1 = g1.run(*batch, copy=True)

    torch._dynamo.reset()
    fresh_inductor_cache("inductor2")
    real_load, loaded = torch.compiler.load_cache_artifacts, []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: (loaded.append(data), real_load(data))[1])
    _, wb2, loop2 = build("cpu")
    g2 = DraftGraphs.for_loop(loop2, CaptureOptions(backend="compile", buckets=(4,), manifest_path=tmp_path / "m2.json",
                                                    compile_cache=cache, precompile=False))
    g2.capture()
    assert loaded == [files[0].read_bytes()]
    assert g2.manifest().compile_cache == "hit" and mf.read_manifest(tmp_path / "m2.json").compile_cache == "hit"
    out2 = g2.run(*batch, copy=True)
    for a, b in zip(out1, out2):
        torch.testing.assert_close(a, b)
    assert torch.equal(wb1.ring, wb2.ring)


def test_compile_cache_without_spec_needs_a_key():
    from graphcap.engine.capture import DraftGraphs
    from graphcap.engine.options import CaptureOptions

    def ex(b):
        return (torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long),
                torch.zeros(b, 2))

    with pytest.raises(ValueError, match="cache_key"):
        DraftGraphs(lambda *a: a, example_inputs=ex, static_tensors={}, padding_slot=0,
                    options=CaptureOptions(backend="compile", buckets=(1,), manifest_path=None,
                                           compile_cache="/nonexistent"))


def test_manifest_field_is_optional_and_inspect_shows_it(tmp_path):
    from graphcap import manifest as mf
    from graphcap.cli import format_manifest
    from graphcap.spec import load_spec

    m = mf.Manifest.for_spec(load_spec("tiny"), "compile", dict(device="cpu", driver=None, torch_version="2",
                                                                 triton_version=None, graphcap_version="0"))
    d = m.to_dict()
    assert d["compile_cache"] is None and "compile cache" not in format_manifest(m)
    del d["compile_cache"]  # a file written before the field existed
    assert mf.parse_manifest(d).compile_cache is None
    m.compile_cache = "refused: the file is a symlink"
    mf.write_manifest(m, tmp_path / "m.json")
    back = mf.read_manifest(tmp_path / "m.json")
    assert back.compile_cache == m.compile_cache
    assert "  compile cache: refused: the file is a symlink" in format_manifest(back).splitlines()


def test_nothing_is_saved_where_others_could_replace_it(tmp_path, monkeypatch, caplog):
    """A directory writable by others gets no artifact (the next load would refuse it anyway): one warning, no file."""
    import torch

    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifact", None))
    with caplog.at_level("WARNING", logger="graphcap"):
        assert cc.save(d, "k" * 64) is None
    assert list(d.iterdir()) == []
    assert [r for r in caplog.records if "not saving the compile cache" in r.getMessage()]


@pytest.mark.compile
def test_precompiled_iteration_loads_without_tracing_over_other_pools(tmp_path, monkeypatch):
    """precompile=True: the first capture compiles (AOT) and saves the iteration; a capture in a fresh Dynamo state,
    on a state with bigger pools and more slot rows, loads it - no frame traced - records every bucket and equals
    the eager loop. A file others can write is refused (one warning) and compiled instead."""
    import os

    from torch._dynamo.utils import counters

    from graphcap.engine import precompile
    from graphcap.engine.capture import DraftGraphs
    from graphcap.engine.options import CaptureOptions
    from graphcap.kernels import twins_on_cpu
    from test_pool_dims import LIVE, SPEC, assert_runs_as_eager, build

    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def capture(**state):
        torch._dynamo.reset()
        st, wb, loop = build(SPEC, **state)
        frames = counters["stats"]["unique_graphs"]
        # precompile: for_loop's default with a compile cache
        g = DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", buckets=(1, 2), manifest_path=None,
                                                      dynamic_batch=True, compile_cache=cache))
        assert g.precompile
        g.capture()
        assert [r.status for r in g.buckets] == ["captured"] * 2
        return g, wb, loop, counters["stats"]["unique_graphs"] - frames

    with twins_on_cpu():
        g, _, _, traced = capture(grow=0, rows=LIVE, cols=128)
        assert traced == 1 and g.manifest().compile_cache == cc.MISS
        (aot,) = cache.glob(f"*{precompile.SUFFIX}")
        assert oct(aot.stat().st_mode & 0o777) == oct(0o600)
        g, wb, loop, traced = capture(grow=60, rows=LIVE + 8, cols=128)
        assert traced == 0 and g.manifest().compile_cache == cc.HIT
        assert "precompiled: the iteration was loaded, not traced" in g.manifest().notes
        assert_runs_as_eager(g, wb, dict(grow=60, rows=LIVE + 8, cols=128), seed=3)
        os.chmod(aot, 0o666)
        g, _, _, traced = capture(grow=0, rows=LIVE, cols=128)
        assert traced == 1 and g.manifest().compile_cache.startswith("refused: the file is writable by others")


@pytest.mark.compile
def test_a_failing_aot_compile_costs_the_warm_start_not_the_capture(tmp_path, monkeypatch, caplog):
    """torch's AOT compile is experimental: where it raises, the capture compiles as without precompile - every
    bucket captured, runs equal to the eager loop - warns once, notes why in the manifest and saves no .aot file."""
    from graphcap.engine import precompile
    from graphcap.engine.capture import DraftGraphs
    from graphcap.engine.options import CaptureOptions
    from graphcap.kernels import twins_on_cpu
    from test_pool_dims import LIVE, SPEC, assert_runs_as_eager, build

    def broken(*a, **k):
        raise RuntimeError("aot_compile: unsupported\nmore detail")

    monkeypatch.setattr(precompile, "compile_aot", broken)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    state = dict(grow=0, rows=LIVE, cols=128)
    st, wb, loop = build(SPEC, **state)
    with twins_on_cpu(), caplog.at_level("WARNING", logger="graphcap"):
        g = DraftGraphs.for_loop(loop, CaptureOptions(backend="compile", buckets=(1, 2), manifest_path=None,
                                                      dynamic_batch=True, compile_cache=tmp_path / "cache",
                                                      precompile=True))
        g.capture()
        assert [r.status for r in g.buckets] == ["captured"] * 2
        assert_runs_as_eager(g, wb, state, seed=4)
    note = ("precompile: torch's AOT compile failed (RuntimeError: aot_compile: unsupported); compiled without it, "
            "nothing precompiled saved")
    assert note in g.manifest().notes
    assert [r.getMessage() for r in caplog.records if "AOT compile failed" in r.getMessage()] == [f"graphcap: {note}"]
    assert not list((tmp_path / "cache").glob(f"*{precompile.SUFFIX}"))


def test_for_loop_precompiles_by_default_only_where_it_applies(tmp_path):
    """for_loop's precompile default: on with a compile cache, one compile for every bucket, a backend it serves and a
    loop with a precompile signature; off without any of them or when asked; DraftGraphs itself never assumes it; a
    precompile that is not a bool is refused by name."""
    from test_pool_dims import LIVE, SPEC, build

    from graphcap.engine.capture import DraftGraphs
    from graphcap.engine.options import CaptureOptions

    loop = build(SPEC, grow=0, rows=LIVE, cols=128)[2]
    opts = CaptureOptions(backend="compile", manifest_path=None)
    cases = [(dict(compile_cache=tmp_path), {}, True), (dict(), {}, False),
             (dict(compile_cache=tmp_path, dynamic_batch=False), {}, False),
             (dict(compile_cache=tmp_path, backend="eager"), {}, False),
             (dict(compile_cache=tmp_path, precompile=False), {}, False),
             (dict(compile_cache=tmp_path), dict(steps_only=True), True)]
    for changes, kw, want in cases:
        g = DraftGraphs.for_loop(loop, opts.replace(**changes), **kw)
        assert g.precompile is want, (changes, kw)
    loop.precompile_signature = None  # a loop that does not say what its compile depends on: no default
    g = DraftGraphs.for_loop(loop, opts.replace(compile_cache=tmp_path))
    assert g.precompile is False
    del loop.precompile_signature
    with pytest.raises(ValueError, match=r"^CaptureOptions: precompile must be True, False or None .*got 'yes'$"):
        opts.replace(compile_cache=tmp_path, precompile="yes")
    g = DraftGraphs(loop, example_inputs=loop.example_inputs, static_tensors=loop.static_tensors(),
                    padding_slot=loop.padding_slot, spec=SPEC,
                    options=CaptureOptions(backend="compile", buckets=(1, 2), manifest_path=None, dynamic_batch=True,
                                           compile_cache=tmp_path))
    assert g.precompile is False


def test_precompile_refuses_what_it_cannot_serve(tmp_path):
    from test_pool_dims import LIVE, SPEC, build

    from graphcap.engine.capture import DraftGraphs
    from graphcap.engine.options import CaptureOptions

    loop = build(SPEC, grow=0, rows=LIVE, cols=128)[2]
    for kw in (dict(dynamic_batch=False, compile_cache=tmp_path), dict(dynamic_batch=True),
               dict(dynamic_batch=True, compile_cache=tmp_path, backend="eager")):
        # (the eager backend is refused by dynamic_batch's own check first)
        with pytest.raises(ValueError, match="precompile needs dynamic_batch=True|dynamic_batch compiles once"):
            DraftGraphs.for_loop(loop, CaptureOptions(**{"backend": "compile", "manifest_path": None,
                                                         "precompile": True, **kw}))


def test_compile_aot_works_where_the_aot_flag_is_off(tmp_path, monkeypatch):
    """torch 2.11 gives torch.compile's function an `.aot_compile` only while dynamo's `enable_aot_compile` is set (off
    by default there, on in 2.13): compile_aot sets it for its compile and leaves it as it was. The flag off here, as
    on 2.11 (torch 2.11 itself is not installed on the CPU machines); the compiled function computes what the plain
    one does."""
    from graphcap.engine import precompile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def fn(a, b, c, d):
        return a * b + c - d

    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(enable_aot_compile=False):
        assert not hasattr(torch.compile(fn), "aot_compile")  # what compile_aot is up against
        compiled = precompile.compile_aot(fn, inputs)
        assert torch._dynamo.config.enable_aot_compile is False
        torch.testing.assert_close(compiled(*inputs), fn(*inputs))
