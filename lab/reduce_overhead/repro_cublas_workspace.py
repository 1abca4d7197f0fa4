"""Standalone (torch alone): a CUDA graph captured the way sglang captures its verify graphs loses its cuBLAS
workspace when torch.compile's CUDA-graph trees warm up or record another function afterwards.

Graph S is warmed up eagerly on its own stream, which allocates cuBLAS's workspace for (handle, stream) from the
general pool, then captured there: its split-K GEMMs embed that address. `--other tree` then runs a
`mode="reduce-overhead"` function three times; the tree wraps each warm-up and recording in
`torch._C._cuda_clearCublasWorkspaces()` (cudagraph_trees.clear_cublas_manager), which frees every stream's cached
workspace, S's included. Still mapped, the freed block goes to the next allocation of its size (the sentinel here)
and replaying S writes into that tensor (`clobbered_bytes`); returned to the driver (`--unmap`: `empty_cache`, which
every `torch.cuda.graph` capture also runs - the tree's own recording included, so on torch 2.11 S faults in both
modes), S's replay is an illegal address. `--other manual` records the same function with torch.cuda.CUDAGraph
(graphcap's manual backends); `none` records nothing.

    python repro_cublas_workspace.py --other tree|manual|none [--unmap] [--out OUT.json]
"""
from __future__ import annotations

import argparse
import json

import torch


def active_blocks() -> dict[int, int]:
    return {b["address"]: b["size"] for s in torch.cuda.memory_snapshot() for b in s["blocks"]
            if b["state"] == "active_allocated"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", choices=("tree", "manual", "none"), required=True)
    ap.add_argument("--unmap", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.manual_seed(0)
    # sglang's verify at batch 1 (4 tokens) through Gemma-4-31B-shaped projections: tall-skinny, split-K
    x = torch.randn(4, 5376, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(5376, n, device="cuda", dtype=torch.bfloat16) / 64 for n in (8192, 5376, 43008)]
    w_down = torch.randn(21504, 5376, device="cuda", dtype=torch.bfloat16) / 128
    fn = lambda: [x @ w for w in ws] + [torch.cat([x] * 4, 1) @ w_down]  # noqa: E731
    torch._C._cuda_clearCublasWorkspaces()  # a fresh process's state
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    before = active_blocks()
    with torch.cuda.stream(s):
        ref = fn()  # sglang's eager warm-up on its capture stream
    torch.cuda.synchronize()
    workspace = {p: n for p, n in active_blocks().items() if p not in before and
                 all(t.data_ptr() != p for t in ref)}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        outs = fn()

    y, w2 = torch.randn(8, 4096, device="cuda"), torch.randn(4096, 4096, device="cuda")
    f = lambda a, b: torch.relu(a @ b)  # noqa: E731
    if a.other == "tree":
        g = torch.compile(f, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            torch.compiler.cudagraph_mark_step_begin()
            g(y, w2)
    elif a.other == "manual":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            f(y, w2)
        torch.cuda.current_stream().wait_stream(side)
        other = torch.cuda.CUDAGraph()
        with torch.cuda.graph(other):
            f(y, w2)
        other.replay()
    torch.cuda.synchronize()
    live = active_blocks()
    freed = {p: n for p, n in workspace.items() if p not in live}
    res = {"other": a.other, "torch": torch.__version__, "cuda": torch.version.cuda,
           "workspace_blocks": [{"address": hex(p), "bytes": n} for p, n in workspace.items()],
           "freed_by_other": len(freed)}
    if a.unmap:
        torch.cuda.empty_cache()
        graph.replay()
        try:
            torch.cuda.synchronize()
            res["unmap_replay"] = "ok"
        except Exception as e:  # noqa: BLE001 - the finding is the error
            res["unmap_replay"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    else:
        sentinels = [torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda") for n in freed.values()]
        res["sentinel_on_workspace"] = sum(t.data_ptr() in freed for t in sentinels)
        graph.replay()
        torch.cuda.synchronize()
        res["clobbered_bytes"] = sum(int((t != 0x5A).sum()) for t in sentinels)
        res["outputs_equal_eager"] = all(torch.equal(o, r) for o, r in zip(outs, ref))
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
