"""`reduce-overhead` served the way sglang's engine serves graphcap's draft (issue 44), on CUDA (skipped without).

What differs from tests/engine/test_capture_gpu.py's reduce-overhead replays (graphcap's own loop, compiled whole): here
the captured function breaks its graph inside the step loop, as graphcap's sglang loop does around sglang's residual
bookkeeping - so Dynamo runs the loop's own frame eagerly and CUDA-graph trees replay its pieces one by one, with
eager code between them that updates the pieces' outputs in place and keeps one on a persistent object (sglang's
StageBoundary / ResidualStream) - and it is served as sglang's scheduler serves it: on a forward stream that is not
the capture's, the tokens consumed at once on that stream (build_tree's torch.cat) and by a gather on a plan stream
after plan.wait_stream(forward) (run_eagle_verify), the accepted counts scattered between calls (on_accept), batch
sizes switching buckets, no host sync. Every call must give the same compiled function's bits without CUDA graphs
(backend `compile`, the twin), and nothing may warm up, re-record or skip a CUDA graph while serving.
"""
from __future__ import annotations

import random

import pytest
import torch

from graphcap.engine.capture import DraftGraphs
from graphcap.engine.guards import cudagraph_skips
from graphcap.engine.iteration import DraftOutput
from graphcap.engine.options import CaptureOptions

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("dynamo_limits_restored")]

V, H, SLOTS, STEPS = 2048, 128, 32, 3
BUCKETS = (1, 4, 8)


@torch._dynamo.disable
def _boundary(loop: "PiecewiseLoop", h: torch.Tensor) -> torch.Tensor:
    """sglang's add + norm between pieces: in place on the piece's output and on the kept residual."""
    if loop.residual is None:
        loop.residual = h
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    loop.residual.add_(h)
    h.copy_(loop.residual * torch.rsqrt(loop.residual.pow(2).mean(-1, keepdim=True) + 1e-6))
    return h


@torch._dynamo.disable
def _clear(loop: "PiecewiseLoop") -> None:
    loop.residual = None


class PiecewiseLoop:
    """fn(slots, accepted, tokens, hidden) -> DraftOutput with SglangAssistantLoop's shape: pending counts and window
    lengths (static tensors) updated in the first piece, then per step a forward in pieces between boundaries and a
    greedy pick."""

    graph_breaks = True

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.emb = (torch.randn(V, H, generator=g) * 0.5).cuda()
        self.w = (torch.randn(H, H, generator=g) / H ** 0.5).cuda()
        self.head = (torch.randn(V, H, generator=g) / H ** 0.5).cuda()
        self.lens = torch.zeros(SLOTS + 1, dtype=torch.int64, device="cuda")
        self.pending = torch.zeros(SLOTS + 1, dtype=torch.int32, device="cuda")
        self.residual: torch.Tensor | None = None

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {"emb": self.emb, "w": self.w, "head": self.head, "lens": self.lens, "pending": self.pending}

    def example_inputs(self, b: int):
        return (torch.full((b,), SLOTS, dtype=torch.int64, device="cuda"), torch.zeros(b, dtype=torch.int32,
                device="cuda"), torch.zeros(b, dtype=torch.int64, device="cuda"), torch.zeros(b, H, device="cuda"))

    def take(self, slots, accepted):
        acc = accepted + self.pending.index_select(0, slots)
        self.pending.index_fill_(0, slots, 0)
        self.lens.index_add_(0, slots, acc.to(torch.int64))
        return self.lens.index_select(0, slots).to(torch.float32)

    def forward(self, tokens, hidden, pos):
        h = _boundary(self, self.emb[tokens] + hidden + 1e-3 * pos[:, None])
        h = _boundary(self, torch.tanh(h @ self.w))
        _clear(self)
        return h

    def pick(self, h):
        return (h @ self.head.T).max(-1)

    def __call__(self, slots, accepted, tokens, hidden) -> DraftOutput:
        pos = self.take(slots, accepted)
        toks, scores = [], []
        for _ in range(STEPS):
            h = self.forward(tokens, hidden, pos)
            s, tokens = self.pick(h)
            hidden = h
            toks.append(tokens)
            scores.append(s)
        score = torch.stack(scores, 1)
        return DraftOutput(torch.stack(toks, 1), score, torch.full_like(score, float("nan")), hidden)


def _graphs(loop: PiecewiseLoop, backend: str) -> DraftGraphs:
    g = DraftGraphs(loop, padding_slot=SLOTS, example_inputs=loop.example_inputs, static_tensors=loop.static_tensors(),
                    options=CaptureOptions(buckets=BUCKETS, backend=backend, manifest_path=None))
    capture = torch.cuda.Stream()  # sglang captures inside its own capture-stream context, then serves elsewhere
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        g.capture()
    torch.cuda.synchronize()
    return g


def _tree_work() -> tuple[int, int, int]:
    """(functions warmed up, re-recordings, Inductor's cudagraph skips) so far on this device."""
    from torch._inductor import cudagraph_trees as ct

    m = ct.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert m is not None, "no CUDA-graph tree on this device: reduce-overhead recorded nothing"
    return len(m.warmed_up_functions), m.debug_fail_counter, cudagraph_skips()


def test_piecewise_tree_served_on_side_streams_equals_the_compiled_function():
    torch._dynamo.reset()
    rng = random.Random(0)
    served, twin = PiecewiseLoop(seed=1), PiecewiseLoop(seed=1)
    graphs, reference = _graphs(served, "reduce-overhead"), _graphs(twin, "compile")
    calls = []
    for _ in range(120):
        b = rng.randint(1, BUCKETS[-1])
        calls.append((torch.tensor(rng.sample(range(SLOTS), b), device="cuda"),
                      torch.tensor([rng.randint(0, STEPS) for _ in range(b)], dtype=torch.int32, device="cuda"),
                      torch.tensor([rng.randrange(V) for _ in range(b)], device="cuda"),
                      torch.randn(b, H, device="cuda")))
    before = _tree_work()

    forward, plan = torch.cuda.Stream(), torch.cuda.Stream()
    got = []
    forward.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(forward):
        for slots, accepted, tokens, hidden in calls:
            out = graphs.run(slots, torch.zeros_like(accepted), tokens, hidden)  # copy=False: views, as served
            kept = torch.cat([tokens[:, None], out.tokens], 1)  # build_tree's copy, on the forward stream
            plan.wait_stream(forward)
            with torch.cuda.stream(plan):  # the verify's prepare reads the draft on the plan stream
                rows = served.emb[kept].sum(-1)
            kept.record_stream(plan)
            forward.wait_stream(plan)
            served.pending.index_add_(0, slots, accepted)  # on_accept, between calls
            got.append((kept, out.scores.clone(), out.hidden.clone(), rows))
    torch.cuda.synchronize()
    assert _tree_work() == before, "the tree warmed up, re-recorded or skipped a graph while serving"

    for i, ((slots, accepted, tokens, hidden), (kept, scores, last_hidden, rows)) in enumerate(zip(calls, got)):
        ref = reference.run(slots, torch.zeros_like(accepted), tokens, hidden, copy=True)
        twin.pending.index_add_(0, slots, accepted)
        assert torch.equal(kept[:, 1:], ref.tokens), f"call {i}: tokens"
        assert torch.equal(scores, ref.scores), f"call {i}: scores"
        assert torch.equal(last_hidden, ref.hidden), f"call {i}: hidden"
        assert torch.equal(rows, served.emb[kept].sum(-1)), f"call {i}: the plan stream's read of the tokens"
    assert torch.equal(served.lens, twin.lens) and torch.equal(served.pending, twin.pending)
    assert graphs.buckets[-1].replays > 0 and all(b.status == "captured" for b in graphs.buckets)


def _active_blocks() -> dict[int, int]:
    return {b["address"]: b["size"] for s in torch.cuda.memory_snapshot() for b in s["blocks"]
            if b["state"] == "active_allocated"}


@pytest.mark.parametrize("backend", ["cudagraph", "inductor-cudagraph", "reduce-overhead"])
def test_a_graph_captured_before_keeps_its_cublas_workspace(backend):
    """Issue 44's fault: sglang warms up and captures its verify graphs on its own stream before graphcap captures,
    so their split-K GEMMs embed the cuBLAS workspace cached for that stream, allocated from the general pool.
    Capturing and serving graphcap's draft must leave that workspace allocated (else the next allocation of its size
    takes it and sglang's replays write into it; returned to the driver, the replay faults). CUDA-graph trees clear
    every stream's workspace around each warm-up and recording: `reduce-overhead` frees it, which is why the plugin
    refuses that backend - when this case fails, torch stopped doing so and the refusal can be re-checked."""
    torch._dynamo.reset()
    torch._C._cuda_clearCublasWorkspaces()  # a fresh process: the stream's workspace is allocated below
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4, 5376, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(5376, 8192, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    sglang_stream = torch.cuda.Stream()
    sglang_stream.wait_stream(torch.cuda.current_stream())
    before = _active_blocks()
    with torch.cuda.stream(sglang_stream):
        eager = x @ w  # sglang's warm-up run on its capture stream
    torch.cuda.synchronize()
    workspace = {p: n for p, n in _active_blocks().items() if p not in before and p != eager.data_ptr()}
    assert workspace, "no cuBLAS workspace was allocated for the warm-up's stream: the check below checks nothing"
    verify = torch.cuda.CUDAGraph()
    with torch.cuda.graph(verify, stream=sglang_stream):
        out = x @ w

    loop = PiecewiseLoop(seed=3)
    graphs = _graphs(loop, backend)
    b = BUCKETS[-1]
    for _ in range(3):
        graphs.run(torch.arange(b, device="cuda"), torch.ones(b, dtype=torch.int32, device="cuda"),
                   torch.randint(0, V, (b,), device="cuda"), torch.randn(b, H, device="cuda"))
    torch.cuda.synchronize()
    freed = sorted(hex(p) for p in workspace if p not in _active_blocks())
    if backend == "reduce-overhead":
        assert freed, ("CUDA-graph trees left an earlier graph's cuBLAS workspace allocated: torch no longer clears "
                       "it, so re-check the plugin's refusal of reduce-overhead (graphcap.sglang.config)")
        return
    assert not freed, f"{backend}: an earlier graph's cuBLAS workspace was freed ({freed})"
    sentinels = [torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda") for n in workspace.values()]
    verify.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert all(bool((t == 0x5A).all()) for t in sentinels), "the earlier graph's replay wrote into new memory"
