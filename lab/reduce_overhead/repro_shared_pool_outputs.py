"""Issue 44, the pools (item 2's question): which later replays rewrite a replay's outputs - CUDA-graph trees
(reduce-overhead) against one torch.cuda.CUDAGraph per bucket sharing one pool (graphcap's manual-graph backends).

The same function, with a graph break as sglang's layers have, captured for two buckets (8 then 1, largest first as
graphcap does). Then bucket 8 runs and its outputs are kept as the views graphcap hands out (`copy=False`), bucket 1
runs, and bucket 8's kept outputs are compared with what bucket 8 computed. Under the tree every bucket's path was
recorded over the same private pool, so bucket 1's replay may rewrite bucket 8's outputs; under manual graphs each
bucket's static outputs stay allocated, so only the same bucket's next replay rewrites them (graphcap's documented
contract, "valid until the next run", holds for both; an engine that kept outputs across calls of other buckets
would see the difference). Reproduced (exit 1): the tree's kept outputs were rewritten by another bucket's replay.
Expected duration on an H200: ~30-40 s (compiles), the replays in milliseconds.
"""
from __future__ import annotations

import torch

from common import finish, parser, skip_without_cuda, tree_counters

H = 512


@torch._dynamo.disable
def boundary(h: torch.Tensor) -> torch.Tensor:
    return h.add_(1.0)  # in place on the first piece's output, as sglang's add + norm does


def fn(w: torch.Tensor, x: torch.Tensor):
    h = boundary(torch.tanh(x @ w))
    return (h @ w).argmax(-1), h.sum(-1)


def main() -> int:
    ap = parser(__doc__)
    a = ap.parse_args()
    skip_without_cuda("repro_shared_pool_outputs")
    torch.manual_seed(a.seed)
    w = torch.randn(H, H, device="cuda") / H ** 0.5
    torch._dynamo.mark_static_address(w)
    xs = {b: torch.randn(b, H, device="cuda") for b in (8, 1)}
    for x in xs.values():
        torch._dynamo.mark_static_address(x)

    tree = torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=False)
    for b in (8, 1):
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            tree(w, xs[b])
    torch.compiler.cudagraph_mark_step_begin()
    kept = tree(w, xs[8])
    kept_then = tuple(t.clone() for t in kept)  # what bucket 8 computed (the clone is ordered after the replay)
    torch.compiler.cudagraph_mark_step_begin()
    tree(w, xs[1])
    torch.cuda.synchronize()
    try:
        tree_kept_ok = all(torch.equal(k, e) for k, e in zip(kept, kept_then))
        tree_note = "readable"
    except RuntimeError as e:  # the tree may also mark the storage as overwritten
        tree_kept_ok, tree_note = False, f"{type(e).__name__}: {str(e)[:160]}"

    pool = torch.cuda.graph_pool_handle()
    graphs, outs = {}, {}
    for b in (8, 1):  # graphcap's record_bucket for the manual backends: warm up on a side stream, record
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn(w, xs[b])
        torch.cuda.current_stream().wait_stream(s)
        graphs[b] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[b], pool=pool):
            outs[b] = fn(w, xs[b])
    graphs[8].replay()
    kept_manual = outs[8]
    manual_then = tuple(t.clone() for t in kept_manual)
    graphs[1].replay()
    torch.cuda.synchronize()
    manual_kept_ok = all(torch.equal(k, e) for k, e in zip(kept_manual, manual_then))
    reproduced = not tree_kept_ok and manual_kept_ok
    verdict = (f"bucket 8's outputs after bucket 1's replay: tree {'intact' if tree_kept_ok else 'rewritten'} "
               f"({tree_note}), manual graphs {'intact' if manual_kept_ok else 'rewritten'}")
    return finish({"hypothesis": "tree paths share one pool: another bucket's replay rewrites kept outputs",
                   "tree_kept_intact": tree_kept_ok, "manual_kept_intact": manual_kept_ok, "tree_note": tree_note,
                   "counters": tree_counters(), "reproduced": reproduced, "verdict": verdict}, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
