"""Issue 44, hypotheses H1/H2 without sglang: CUDA-graph trees replaying a draft iteration piece by piece between
eager "boundary" code, served on side streams the way sglang's scheduler serves graphcap.

The iteration mirrors what graphcap's sglang loop hands to torch.compile(mode="reduce-overhead"): persistent tensors
marked static and mutated inside the first piece (the pending accepted counts and the window lengths, as
`TakesPending` and `WindowBuffers.advance` do), then per step an embedding gather, a projection and a greedy pick,
with graph breaks at a `torch._dynamo.disable`d boundary that adds and normalises IN PLACE on the pieces' outputs
and keeps the residual on a persistent object between pieces (sglang's StageBoundary / ResidualStream with its
in-place fused_add_rmsnorm). Capture as graphcap's record_bucket does (per bucket, largest first, three calls each
after cudagraph_mark_step_begin, on a capture stream); then serve: the batch written into the bucket's static rows on
a "forward" stream, one call, the tokens consumed at once on that stream (sglang's build_tree: torch.cat) and by a
gather on a "plan" stream after plan.wait_stream(forward) (sglang's run_eagle_verify), an accept scatter between
calls (graphcap's on_accept), no host sync. Every served call's tokens, scores and gathered rows are compared with
the same compiled function without CUDA graphs (Inductor's same kernels: equal bits) run afterwards over the same
inputs; the tree's counters before and after serving say whether anything warmed up or re-recorded while serving.

Reproduced (exit 1): a mismatch, a CUDA error (a stale token used as an index), or warm-ups/re-records at serve.
Expected duration on an H200: ~60-90 s (the compile of two buckets' pieces, twice), then ~1 s per 100 calls.
"""
from __future__ import annotations

import random
import types

import torch

from common import finish, parser, skip_without_cuda, tree_counters

V, H, SLOTS, STEPS = 4096, 256, 64, 3


class State:
    """Persistent tensors (graphcap's static ones) and sglang's per-forward residual stream."""

    def __init__(self, dev: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.emb = (torch.randn(V, H, generator=g) * 0.5).to(dev)
        self.w = (torch.randn(H, H, generator=g) / H ** 0.5).to(dev)
        self.head = (torch.randn(V, H, generator=g) / H ** 0.5).to(dev)
        self.lens = torch.zeros(SLOTS + 1, dtype=torch.int64, device=dev)
        self.pending = torch.zeros(SLOTS + 1, dtype=torch.int32, device=dev)
        self.residual: torch.Tensor | None = None

    def static(self) -> list[torch.Tensor]:
        return [self.emb, self.w, self.head, self.lens, self.pending]


@torch._dynamo.disable
def boundary(st: State, h: torch.Tensor) -> torch.Tensor:
    """Add + norm in place on the piece's output and on the kept residual (both graph outputs)."""
    if st.residual is None:
        st.residual = h
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    st.residual.add_(h)
    h.copy_(st.residual * torch.rsqrt(st.residual.pow(2).mean(-1, keepdim=True) + 1e-6))
    return h


@torch._dynamo.disable
def clear(st: State) -> None:
    st.residual = None


def take(st: State, slots, accepted):
    """graphcap's TakesPending + WindowBuffers.advance: persistent (static) tensors mutated in the graph."""
    acc = accepted + st.pending.index_select(0, slots)
    st.pending.index_fill_(0, slots, 0)
    st.lens.index_add_(0, slots, acc.to(torch.int64))
    return st.lens.index_select(0, slots).to(torch.float32)


def forward(st: State, tokens, hidden, pos):
    """sglang's model forward: pieces between the boundaries."""
    h = boundary(st, st.emb[tokens] + hidden + 1e-3 * pos[:, None])
    h = boundary(st, torch.tanh(h @ st.w))
    clear(st)
    return h


def pick(st: State, h):
    return (h @ st.head.T).max(-1)


def iteration(st: State, slots, accepted, tokens, hidden):
    """SglangAssistantLoop.__call__'s shape: a graph break inside the step loop makes Dynamo run this frame eagerly
    and compile `take`, `forward` (in pieces) and `pick` as frames of their own - graphcap's sglang loop under
    reduce-overhead runs its window advance, positions and stacks eagerly between the tree's graphs the same way."""
    pos = take(st, slots, accepted)
    toks, scores = [], []
    for _ in range(STEPS):
        h = forward(st, tokens, hidden, pos)
        s, tokens = pick(st, h)
        hidden = h
        toks.append(tokens)
        scores.append(s)
    return torch.stack(toks, 1), torch.stack(scores, 1), hidden


def fresh(fn, tag: str):
    """`fn` behind a code object of its own: its own Dynamo cache (graphcap.recording.iteration_function)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--buckets", default="8,1", help="captured batch sizes (served batches are 1..largest)")
    ap.add_argument("--same-stream", action="store_true", help="serve on the capture's stream, no plan stream")
    ap.add_argument("--sync-each", action="store_true", help="synchronize after every call (launch-blocking-like)")
    a = ap.parse_args()
    skip_without_cuda("repro_piecewise_tree")
    dev = torch.device("cuda")
    buckets = sorted({int(x) for x in a.buckets.split(",")}, reverse=True)
    st, twin = State(dev, a.seed), State(dev, a.seed)
    for t in st.static():
        torch._dynamo.mark_static_address(t)
    compiled = torch.compile(fresh(iteration, "tree"), mode="reduce-overhead", fullgraph=False, dynamic=False)
    reference = torch.compile(fresh(iteration, "plain"), fullgraph=False, dynamic=False,
                              options={"triton.cudagraphs": False})

    def pad_inputs(b):
        return (torch.full((b,), SLOTS, dtype=torch.int64, device=dev), torch.zeros(b, dtype=torch.int32, device=dev),
                torch.zeros(b, dtype=torch.int64, device=dev), torch.zeros(b, H, device=dev))

    static = {b: pad_inputs(b) for b in buckets}
    for x in static.values():
        for t in x:
            torch._dynamo.mark_static_address(t)
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        for b in buckets:  # graphcap's record_bucket for reduce-overhead
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                compiled(st, *static[b])
    torch.cuda.synchronize()
    before = tree_counters()

    rng = random.Random(a.seed)
    calls = []
    for _ in range(a.iters):
        b = rng.randint(1, buckets[0])
        calls.append((b, rng.sample(range(SLOTS), b), [rng.randint(0, STEPS) for _ in range(b)],
                      [rng.randrange(V) for _ in range(b)], torch.randn(b, H)))
    fwd = torch.cuda.current_stream() if a.same_stream else torch.cuda.Stream()
    plan = fwd if a.same_stream else torch.cuda.Stream()
    got, error = [], None
    try:
        with torch.cuda.stream(fwd):
            for b, slots, acc, toks, hid in calls:
                bucket = min(x for x in buckets if x >= b)
                s, ac, t, h = static[bucket]
                s.fill_(SLOTS)
                ac.zero_()
                s[:b].copy_(torch.tensor(slots), non_blocking=True)
                t[:b].copy_(torch.tensor(toks), non_blocking=True)
                h[:b].copy_(hid, non_blocking=True)
                torch.compiler.cudagraph_mark_step_begin()
                out_t, out_s, _ = compiled(st, s, ac, t, h)
                kept = torch.cat([t[:b, None], out_t[:b]], 1)  # sglang's build_tree copy, same stream
                plan.wait_stream(fwd)
                with torch.cuda.stream(plan):  # the verify's prepare on the plan stream
                    rows = st.emb[kept].sum(-1)
                kept.record_stream(plan)
                fwd.wait_stream(plan)
                st.pending.index_add_(0, s[:b], torch.tensor(acc, dtype=torch.int32, device=dev))  # on_accept
                got.append((kept, out_s[:b].clone(), rows))
                if a.sync_each:
                    torch.cuda.synchronize()
        torch.cuda.synchronize()
    except RuntimeError as e:  # a CUDA error: what the engine hit
        error = f"{type(e).__name__}: {e}"
    after = tree_counters() if error is None else None

    mismatches = exact = 0

    def out_tokens_of(kept):
        return kept[:, 1:]

    if error is None:
        for (b, slots, acc, toks, hid), (kept, scores, rows) in zip(calls, got):
            s, ac, t, h = pad_inputs(b)
            s.copy_(torch.tensor(slots))
            t.copy_(torch.tensor(toks))
            h.copy_(hid)
            ref_t, ref_s, _ = reference(twin, s, ac, t, h)
            twin.pending.index_add_(0, s, torch.tensor(acc, dtype=torch.int32, device=dev))
            # a near-tie may pick another token in another kernel order, with the same top score: the scores are
            # the comparison; the plan stream's gather is checked against the tokens it was given
            ok = (torch.allclose(scores, ref_s, rtol=1e-3, atol=1e-3)
                  and torch.equal(rows, st.emb[kept].sum(-1)))
            exact += torch.equal(out_tokens_of(kept), ref_t)
            mismatches += not ok
    served_graph_work = None if after is None else {k: after[k] - before.get(k, 0) for k in
                                                    ("warmed_up_functions", "re_records", "cudagraph_skips")}
    reproduced = error is not None or mismatches > 0 or bool(served_graph_work and any(served_graph_work.values()))
    verdict = (f"{error}" if error else f"{mismatches} of {len(calls)} served calls differ from the compiled "
               f"function without CUDA graphs; tree work while serving {served_graph_work}")
    return finish({"hypothesis": "H1/H2: piecewise tree replays around in-place eager boundaries, side streams",
                   "buckets": buckets, "iters": a.iters, "same_stream": a.same_stream, "sync_each": a.sync_each,
                   "error": error, "mismatches": mismatches, "tokens_equal": exact, "counters_before": before,
                   "counters_after": after,
                   "reproduced": reproduced, "verdict": verdict}, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
