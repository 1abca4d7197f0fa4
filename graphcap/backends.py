"""The capture backends: their names and what each one does, in one place (specs, DraftGraphs, recording,
manifests, the sglang flag and the bench all read these). Names only, no torch: the spec and the manifest, which
`graphcap inspect` reads without torch, sit below everything that captures.

- `reduce-overhead`: `torch.compile(mode="reduce-overhead")`; CUDA-graph trees record one graph per bucket.
- `inductor-cudagraph` (a capture spec's default): the same Inductor code with Inductor's graphs off, recorded per
  bucket with `torch.cuda.CUDAGraph` - a replay is one graph launch, no Dynamo guards or graph-tree bookkeeping per
  call.
- `cudagraph`: the eager function recorded with `torch.cuda.CUDAGraph` (no Inductor; the sglang plugin's default,
  `graphcap.sglang.config.PLUGIN_DEFAULT_BACKEND`).
- `compile`: Inductor without CUDA graphs (the reference replays are compared with; the compiled path on CPU).
- `eager`: no capture, the same static-buffer dispatch.
"""
from __future__ import annotations

GRAPH_BACKENDS = ("reduce-overhead", "inductor-cudagraph", "cudagraph")  # record CUDA graphs: what a spec may pick
ALL_BACKENDS = GRAPH_BACKENDS + ("compile", "eager")  # what DraftGraphs runs and a manifest names
COMPILED_BACKENDS = ("reduce-overhead", "inductor-cudagraph", "compile")  # go through torch.compile
MANUAL_GRAPH_BACKENDS = ("inductor-cudagraph", "cudagraph")  # torch.cuda.CUDAGraph recorded by graphcap
# A capture spec's backend when its file names none, and DraftGraphs' when not told: graphcap's own loop replays in
# half the time of its eager ops recorded (`cudagraph`) at batch 8 (docs/results.md#capture).
SPEC_DEFAULT_BACKEND = "inductor-cudagraph"
