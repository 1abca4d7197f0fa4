"""The capture backends: their names and what each one does, in one place (specs, DraftGraphs, recording,
manifests and the sglang flag all read these).

- `reduce-overhead`: `torch.compile(mode="reduce-overhead")`; CUDA-graph trees record one graph per bucket.
- `inductor-cudagraph` (the default): the same Inductor code with Inductor's graphs off, recorded per bucket with
  `torch.cuda.CUDAGraph` - a replay is one graph launch, no Dynamo guards or graph-tree bookkeeping per call.
- `cudagraph`: the eager function recorded with `torch.cuda.CUDAGraph` (no Inductor).
- `compile`: Inductor without CUDA graphs (the reference replays are compared with; the compiled path on CPU).
- `eager`: no capture, the same static-buffer dispatch.
"""
from __future__ import annotations

GRAPH_BACKENDS = ("reduce-overhead", "inductor-cudagraph", "cudagraph")  # record CUDA graphs: what a spec may pick
ALL_BACKENDS = GRAPH_BACKENDS + ("compile", "eager")  # what DraftGraphs runs and a manifest names
DEFAULT_BACKEND = "inductor-cudagraph"
COMPILED_BACKENDS = ("reduce-overhead", "inductor-cudagraph", "compile")  # go through torch.compile
MANUAL_GRAPH_BACKENDS = ("inductor-cudagraph", "cudagraph")  # torch.cuda.CUDAGraph recorded by graphcap
