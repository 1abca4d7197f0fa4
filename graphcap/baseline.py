"""The sglang-style baselines: graphcap's own model and kernels, driven the way sglang drives the frozen-KV draft.

Every iteration rebuilds every row's window from `req_to_token` - the same gather-and-translate work as sglang's
`update_sliding_window_buffer`, O(batch x min(ctx, W)) - then does sglang's `seq_lens.sum().item()` host sync, then
runs the steps: eagerly (`eager-rebuild`, sglang 0.5.18 at one step) or replayed from a CUDA graph of the steps
alone (`graph-rebuild`, sglang 0.5.23). The rebuild writes the ring in the same canonical layout `advance` keeps,
so on the same state both produce exactly the tokens graphcap's loop produces.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from graphcap.capture import DraftGraphs
from graphcap.kernels.window_update import window_reset
from graphcap.models.draft_loop import DraftLoop, DraftOutput


class RebuildBaseline:
    def __init__(self, loop: DraftLoop, graphed: bool, buckets: Sequence[int] | None = None) -> None:
        self.loop = loop
        self.syncs = 0  # host syncs issued (one per iteration, as in sglang)
        self.graphs: DraftGraphs | None = None
        if graphed:
            backend = "cudagraph" if loop.window.device.type == "cuda" else "eager"
            self.graphs = DraftGraphs.for_loop(loop, backend=backend, buckets=buckets, steps_only=True,
                                               manifest_path=None, progress=False)

    @property
    def name(self) -> str:
        return "graph-rebuild" if self.graphs is not None else "eager-rebuild"

    def capture(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    def run(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
            *, host_slots: Sequence[int] | None = None) -> DraftOutput:
        w = self.loop.window
        new_lens = w.seq_lens[slots] + accepted.to(w.seq_lens.dtype)
        self.seq_lens_sum = int(new_lens.sum().item())  # sglang's per-iteration device-to-host sync
        self.syncs += 1
        window_reset(w.ring, w.seq_lens, w.req_to_token, w.full_to_swa, slots, new_lens)
        if self.graphs is not None:
            return self.graphs.run(slots, accepted, tokens, hidden, host_slots=host_slots)
        return self.loop.draft_steps(slots, accepted, tokens, hidden)
