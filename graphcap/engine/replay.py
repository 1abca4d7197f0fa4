"""`Replay`: one batch size's bucket, dispatched once - the handle an engine's hot path holds (`DraftGraphs.prepare`).

vLLM's runner gets a batch descriptor from its dispatcher and replays the wrapper it names; here the handle carries
both, made once per batch size, so a draft call costs one dict lookup of dispatch.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from graphcap.engine.bucket_graph import BucketGraph
from graphcap.engine.iteration import DraftOutput, Inputs


class Replay:
    """One batch size's bucket, dispatched once (`DraftGraphs.prepare`): write the batch into its static rows, then
    call it to replay. `pure`: the replay is a recorded graph alone - none of the function's Python runs, so an engine
    need not set up what that Python reads (sglang's forward context, say); false for the compiled backends that
    replay through Python (reduce-overhead, compile), the eager one and a bucket whose capture failed."""

    __slots__ = ("_bucket", "_b", "_replay", "pure")

    def __init__(self, bucket: BucketGraph, b: int,
                 replay: Callable[[BucketGraph, int, bool], DraftOutput]) -> None:
        """`replay(bucket, b, copy)`: the owning DraftGraphs' replay of a bucket (its guard, flush and row slicing)."""
        self._bucket, self._b, self._replay = bucket, b, replay
        self.pure = bucket.captured and bucket.graph is not None

    def inputs(self) -> Inputs:
        """The first b rows of the static inputs (slots, accepted, tokens, hidden), to be written before the call."""
        return self._bucket.claim(self._b)

    def write(self, slots: torch.Tensor, accepted: torch.Tensor | None, tokens: torch.Tensor,
              hidden: torch.Tensor) -> None:
        """Copy the batch into the static rows, one launch on CUDA where the dtypes allow (BucketGraph.write).
        `accepted` None: its rows are left as they are (0, for a function that takes the counts itself)."""
        self._bucket.write(slots, accepted, tokens, hidden)

    def __call__(self, *, copy: bool = False) -> DraftOutput:
        return self._replay(self._bucket, self._b, copy)
