"""graphcap.sglang.variants: the Triton compile log, the variants file and the start-up compile of what it records.

On CPU Triton's interpreter compiles nothing, so its hooks are called here as Triton calls them (the same keywords);
the GPU test compiles a real kernel variant, records it, drops it from the kernel's cache and has `preload` bring it
back, after which a launch of that variant compiles nothing."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from graphcap import manifest as mf
from graphcap.sglang import variants as v

try:  # a kernel at module level, as sglang's are (the GPU test compiles, records and preloads it)
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)
except ImportError:
    add_one = None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_fn(module: str, qualname: str) -> SimpleNamespace:
    """What Triton passes as `fn` (its JitFunctionInfo): the jit function's module and function."""
    return SimpleNamespace(name=qualname, jit_function=SimpleNamespace(module=module,
                                                                      fn=SimpleNamespace(__qualname__=qualname)))


def compile_(log: v.VariantLog, clock: Clock, kernel: str, variant: str, seconds: float, warmup: bool = False) -> None:
    """One compile as Triton reports it: the cache hook, `seconds`, the post-compile hook."""
    module, name = kernel.split(":")
    spec = json.dumps({"name": f"{module}.{name}", "variant": variant})
    kw = dict(key=f"key-{kernel}-{variant}", repr=f"{name}[{variant}]", fn=fake_fn(module, name),
              compile={"key": "k", "specialization_data": spec}, is_manual_warmup=warmup, already_compiled=False)
    assert log.before_compile(**kw) is False  # never tells Triton to skip the compile
    clock.now += seconds
    log.after_compile(**kw)


def test_start_up_and_serving_compiles_are_told_apart_and_timed(tmp_path):
    clock = Clock()
    log = v.VariantLog(str(tmp_path / "trace"), clock=clock)
    compile_(log, clock, "sglang.a:k1", "bs8", 0.4)
    compile_(log, clock, "sglang.a:k1", "bs4", 0.01, warmup=True)  # a preload: neither start-up nor serving
    log.on_draft()
    clock.now += 5.0
    compile_(log, clock, "sglang.b:k2", "bs1", 0.6)
    log.on_draft()  # only the first draft ends start-up
    compile_(log, clock, "sglang.a:k1", "bs2", 0.5)
    s = log.summary()
    assert (s.at_startup, s.while_serving) == (1, 2)
    assert [(r.kernel, r.variant, round(r.seconds, 6)) for r in s.late] == [("sglang.b:k2", "k2[bs1]", 0.6),
                                                                          ("sglang.a:k1", "k1[bs2]", 0.5)]
    assert s.late[0].t - log.serving_since == pytest.approx(5.0)
    lines = [json.loads(ln) for ln in (tmp_path / "trace").glob("compiles-*.jsonl").__next__().read_text().splitlines()]
    assert [(r["kernel"], r["serving"], r["preload"], round(r["ms"])) for r in lines] == [
        ("sglang.a:k1", False, False, 400), ("sglang.a:k1", False, True, 10), ("sglang.b:k2", True, False, 600),
        ("sglang.a:k1", True, False, 500)]


def test_save_merges_and_preload_compiles_each_recorded_variant(tmp_path, monkeypatch):
    clock, path = Clock(), tmp_path / "m-cudagraph-variants.json"
    first = v.VariantLog(clock=clock)
    compile_(first, clock, "sglang.a:k1", "bs8", 0.3)
    first.on_draft()
    compile_(first, clock, "sglang.a:k1", "bs1", 0.3)
    compile_(first, clock, "sglang.b:k2", "bs1", 0.3)
    assert first.save(path) and not first.save(path)  # nothing new the second time
    second = v.VariantLog(clock=clock)
    second.on_draft()
    compile_(second, clock, "sglang.b:k2", "bs1", 0.3)  # a variant the file already has
    compile_(second, clock, "sglang.c:k3", "x", 0.3)
    compile_(second, clock, "sglang.a:k1", "bs8", 0.3)  # first met while serving this time
    assert second.save(path)
    data = json.loads(path.read_text())
    # what a start-up compiled (k1 at bs8 in the first process) is recorded only once serving met it first
    assert {k: len(s) for k, s in data["variants"].items()} == {"sglang.a:k1": 2, "sglang.b:k2": 1, "sglang.c:k3": 1}

    loaded: list[tuple[str, str]] = []

    class Jit:
        def __init__(self, kernel: str) -> None:
            self.kernel = kernel

        def preload(self, spec: str) -> None:
            if self.kernel == "sglang.c:k3":
                raise RuntimeError("Specialization data is for another target")
            loaded.append((self.kernel, json.loads(spec)["variant"]))

    monkeypatch.setattr(v, "_jit_function", lambda k: None if k == "sglang.b:k2" else Jit(k))
    third = v.VariantLog(clock=clock)
    assert third.preload(path) == 2
    assert sorted(loaded) == [("sglang.a:k1", "bs1"), ("sglang.a:k1", "bs8")]
    assert (third.preloaded, third.preload_failed) == (2, 2)  # k2 gone from this process, k3 another target
    assert any("sglang.b:k2" in e for e in third.preload_errors) and any("target" in e for e in third.preload_errors)


@pytest.mark.parametrize("content", ["", "{", "[]", '{"format": 1}', '{"format": 99, "variants": {}}'])
def test_an_unreadable_variants_file_preloads_nothing_and_is_replaced(tmp_path, content):
    path = tmp_path / "x-variants.json"
    path.write_text(content)
    clock = Clock()
    log = v.VariantLog(clock=clock)
    assert log.preload(path) == 0 and log.preload_failed == 0
    log.on_draft()
    compile_(log, clock, "m:k", "a", 0.1)
    assert log.save(path)
    assert list(json.loads(path.read_text())["variants"]) == ["m:k"]


def test_another_tritons_file_is_not_preloaded(tmp_path, monkeypatch):
    path = tmp_path / "x-variants.json"
    path.write_text(json.dumps({"format": v.FORMAT, "triton": "0.0.0", "variants": {"m:k": ["{}"]}}))
    monkeypatch.setattr(v, "_jit_function", lambda k: pytest.fail("nothing is preloaded from another Triton"))
    assert v.VariantLog().preload(path) == 0


def _plain(x_ptr):  # a kernel body for the lookup test (never compiled)
    pass


def test_a_kernel_is_found_by_module_and_name_through_its_wrappers(monkeypatch):
    """Where Triton keeps no registry (or not this kernel), the kernel is found by its module and qualified name,
    through autotune/heuristics wrappers (`.fn`); a kernel gone from the module, or its module, is None."""
    import sys
    import types

    from triton.runtime import jit

    jf = jit.JITFunction(_plain)
    mod = types.ModuleType("graphcap_test_kernels")
    mod.ns = SimpleNamespace(tuned=SimpleNamespace(fn=SimpleNamespace(fn=jf)))
    monkeypatch.setitem(sys.modules, "graphcap_test_kernels", mod)
    monkeypatch.setattr(jit, "_triton_jit_function_registry", {}, raising=False)
    assert v._jit_function("graphcap_test_kernels:ns.tuned") is jf
    assert v._jit_function("graphcap_test_kernels:ns.gone") is None
    assert v._jit_function("graphcap_no_such_module:k") is None


def test_variants_path_sits_beside_the_manifest_and_is_not_listed_as_one(tmp_path):
    m = mf.manifest_path(tmp_path, "sglang-asst", "w8-s3", "cudagraph")
    p = v.variants_path(m)
    assert p.parent == m.parent and p.name == m.stem + "-variants.json"
    m.write_text("{}")
    p.write_text("{}")
    assert mf.list_manifests(tmp_path) == [m]


def test_install_chains_the_hooks_already_there(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append("pre") or True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append("post"))
    clock = Clock()
    log = v.install(v.VariantLog(clock=clock))
    kw = dict(key="k", repr="r", fn=fake_fn("m", "k"), compile={}, is_manual_warmup=False, already_compiled=False)
    assert knobs.runtime.jit_cache_hook(**kw) is True  # the earlier hook's answer stands
    knobs.runtime.jit_post_compile_hook(**kw)
    assert seen == ["pre", "post"] and len(log.records) == 1


def test_the_manifest_holds_the_serving_section(tmp_path):
    rec = mf.Serving(joins=3, resets=4, retracts=1, variants_preloaded=5, variants_while_serving=1,
                     late_compiles=[mf.LateCompile("m:k", "k[bs1]", 0.45, 12.5)])
    m = mf.Manifest.for_spec(None, "cudagraph", env=dict(device="cpu", driver=None, torch_version="t",
                                                         triton_version=None, graphcap_version="g"),
                             buckets=[mf.BucketRecord(1)])
    m.serving = rec
    path = mf.write_manifest(m, tmp_path / "a-cudagraph.json")
    assert mf.read_manifest(path).serving == rec
    d = json.loads(path.read_text())
    d["serving"]["late_compiles"][0]["seconds"] = -1
    path.write_text(json.dumps(d))
    with pytest.raises(mf.ManifestError, match=r"serving\.late_compiles\.0\.seconds|serving"):
        mf.read_manifest(path)


@pytest.mark.gpu
def test_a_preloaded_variant_is_not_compiled_at_launch(tmp_path, monkeypatch):
    """A real kernel: the variant a launch compiled is recorded; with the kernel's compiled variants dropped,
    `preload` compiles it again from the file, and the next launch of that variant compiles nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import triton

    for hook in ("jit_cache_hook", "jit_post_compile_hook"):  # restored after the test
        monkeypatch.setattr(triton.knobs.runtime, hook, getattr(triton.knobs.runtime, hook))
    # add_one is at this module's level, as sglang's kernels are: preload finds it by module and name
    log = v.install(v.VariantLog())
    x = torch.randn(1000, device="cuda")
    add_one[(4,)](x, 1000, BLOCK=256)
    log.on_draft()
    add_one[(8,)](x, 1000, BLOCK=128)  # a new constexpr: a new variant, compiled while serving
    assert [r.kernel.rsplit(":", 1)[1] for r in log.summary().late] == ["add_one"]
    path = tmp_path / "v.json"
    assert log.save(path)
    for cache in add_one.device_caches.values():
        cache[0].clear()  # the compiled variants of this process
    fresh = v.install(v.VariantLog())
    assert fresh.preload(path) == 1 and fresh.preload_failed == 0
    n = len(fresh.records)
    add_one[(8,)](x, 1000, BLOCK=128)
    assert len(fresh.records) == n  # the launch found it compiled
    add_one[(4,)](x, 1000, BLOCK=256)  # a variant the file does not hold compiles at launch, as before
    assert len(fresh.records) == n + 1


def test_inspect_shows_the_rows_and_each_late_compile(tmp_path):
    from graphcap.cli import format_manifest

    m = mf.Manifest.for_spec(None, "cudagraph", env=dict(device="cpu", driver=None, torch_version="t",
                                                         triton_version=None, graphcap_version="g"),
                             buckets=[mf.BucketRecord(1)])
    m.serving = mf.Serving(joins=7, resets=9, retracts=2, evictions_in_window=1, variants_preloaded=11,
                           variants_preload_failed=1, variants_at_startup=3, variants_while_serving=1,
                           late_compiles=[mf.LateCompile("sglang.x:_kernel", "_kernel[bs1]", 0.512, 42.0)])
    text = format_manifest(m)
    assert "rows: 7 joins, 9 rebuilt, 2 retracted, 1 in-window SWA evictions" in text
    assert "11 recorded ones compiled at start-up (1 could not be), 3 more before the first draft, 1 while serving" \
        in text
    assert "42.0 s after the first draft: sglang.x:_kernel (512 ms) _kernel[bs1]" in text
