"""graphcap.fusion_hints: under an unbacked batch Inductor vetoes fusing a reduction with its epilogue (it sizes the
shared dependency at 0 bytes); with the hints on it fuses them as it does for a static batch, and computes the
same. On CPU with Inductor's C++ backend, whose fusion scoring is the one the GPU's Triton backend uses: the batch
is marked without hint_override, which reproduces on torch 2.13 what torch 2.11 does with it."""
from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.scheduler import Scheduler
from torch._inductor.utils import run_and_get_code

from graphcap import fusion_hints as fh

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
H = 256


def rms_mlp(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A matmul, an RMSNorm (a row reduction and its scale-and-cast epilogue), a matmul: the draft layer's pattern."""
    h = (x @ w).float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (y * (1.0 + g.float())).to(x.dtype) @ w


def compiled_loops(batch_mark: str, hints: bool, monkeypatch, seed: int = 0) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(loops in the C++ code Inductor generated, compiled output, eager output) for a random batch of 8 rows. The
    C++ backend writes the norm's nodes into one kernel function either way; fused, the reduction and its epilogue
    share their row loop (one loop fewer)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, H, generator=g)
    w, gain = torch.randn(H, H, generator=g) / H ** 0.5, torch.randn(H, generator=g)
    if batch_mark == "unbacked":
        torch._dynamo.decorators.mark_unbacked(x, 0)
    monkeypatch.setenv(fh.ENV, "1" if hints else "0")
    torch._dynamo.reset()
    fn = torch.compile(rms_mlp, fullgraph=True, dynamic=False if batch_mark == "static" else None)
    with torch._inductor.config.patch(fx_graph_cache=False), fh.unbacked_fusion_hints(8) as on:
        assert on is hints
        out, codes = run_and_get_code(fn, x, w, gain)
    loops = sum(len(re.findall(r"\bfor\s*\(", c)) for c in codes)
    return loops, out, rms_mlp(x, w, gain)


def test_hints_give_an_unbacked_batch_the_static_fusion_and_the_same_result(monkeypatch):
    static, out_s, ref = compiled_loops("static", False, monkeypatch)
    vetoed, out_u, _ = compiled_loops("unbacked", False, monkeypatch)
    hinted, out_h, _ = compiled_loops("unbacked", True, monkeypatch)
    assert vetoed > static, "an unbacked batch no longer splits the norm: the hints may be unneeded"
    assert hinted == static
    for out in (out_s, out_u, out_h):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_h, out_u, rtol=1e-5, atol=1e-5)


def test_hints_are_opt_in_and_leave_inductor_as_it_was(monkeypatch):
    original = Scheduler.dep_size_hint
    monkeypatch.delenv(fh.ENV, raising=False)
    with fh.unbacked_fusion_hints(8) as on:
        assert on is False and Scheduler.dep_size_hint is original
    monkeypatch.setenv(fh.ENV, "1")
    with fh.unbacked_fusion_hints(None) as on:  # no batch to hint (a per-bucket compile)
        assert on is False
    with pytest.raises(RuntimeError, match="boom"):
        with fh.unbacked_fusion_hints(8) as on:
            assert on is True and Scheduler.dep_size_hint is not original
            assert torch._inductor.config.unbacked_symint_fallback == 8
            raise RuntimeError("boom")
    assert Scheduler.dep_size_hint is original
    assert torch._inductor.config.unbacked_symint_fallback != 8
    assert fh.sized_at(object(), 8) == 0  # not a memory dependency: nothing to size


def test_a_dynamic_capture_with_the_hints_as_torch_2_11_marks_the_batch(tmp_path, monkeypatch):
    """DraftGraphs with the hints on, the batch marked as on a torch that honours no hint_override (torch 2.11, the
    H200's; simulated by hiding the parameter): one compile for every bucket, every bucket captured, the manifest
    says the hints were on, and the replays draft what the eager loop drafts; Inductor is left unpatched after."""
    import inspect

    from test_capture import build, random_batch

    from graphcap import manifest as mf
    from graphcap import recording
    from graphcap.capture import DraftGraphs
    from graphcap.kernels import twins_on_cpu

    params = set(inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters) - {"hint_override"}
    monkeypatch.setattr(recording, "_MARK_UNBACKED_PARAMS", frozenset(params))
    monkeypatch.setenv(fh.ENV, "1")
    original = Scheduler.dep_size_hint
    with twins_on_cpu():
        eager, dyn = build("cpu"), build("cpu")
        path = tmp_path / "m.json"
        graphs = DraftGraphs.for_loop(dyn[2], backend="compile", buckets=(1, 2, 4), manifest_path=path)
        graphs.capture()
        assert Scheduler.dep_size_hint is original
        assert [r.status for r in graphs.buckets] == ["captured"] * 3 and graphs._compiled.entries == 1
        assert "unbacked fusion hints" in mf.read_manifest(path).notes
        g = torch.Generator().manual_seed(9)
        for b in (4, 1, 3):
            batch = random_batch(g, eager[1], "cpu", b)
            want, got = eager[2](*batch), graphs.run(*batch, copy=True)
            decided = want.margins > 1e-3
            torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)
            assert torch.equal(got.tokens[decided], want.tokens[decided]), b
