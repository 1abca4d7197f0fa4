"""The contract between the capture engine and the function it captures: one draft iteration's inputs and outputs.

It lives with the engine, not with the reference model, so that the engine (capture, recording, dispatch) imports no
model: any function `fn(slots, accepted, tokens, hidden) -> DraftOutput` can be captured - graphcap's reference
`DraftLoop`, sglang's assistant (`graphcap.sglang.loop.SglangAssistantLoop`), a test's stand-in.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # slots, accepted, tokens, hidden


class DraftOutput(NamedTuple):
    tokens: torch.Tensor  # [B, steps] int64 draft tokens
    scores: torch.Tensor  # [B, steps] fp32 logit of each draft token
    margins: torch.Tensor  # [B, steps] fp32 its margin over the runner-up (NaN from a loop without one: sglang's)
    hidden: torch.Tensor  # [B, target hidden] the last step's post-projection (next iteration's draft input)


DraftFn = Callable[..., DraftOutput]  # fn(slots, accepted, tokens, hidden) -> DraftOutput


class CapturableLoop(Protocol):
    """What `DraftGraphs.for_loop` reads from a loop (graphcap.models.DraftLoop is one). Structural, so the engine
    needs no import of any model to accept one. Optional besides: `pool_dims() -> {static tensor name: dims}`, the
    dimensions sized by the engine's memory settings (DraftGraphs' `pool_dims`)."""

    @property
    def spec(self) -> Any: ...  # the CaptureSpec: default buckets and backend, the manifest's name and hash

    @property
    def padding_slot(self) -> int: ...

    def __call__(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                 hidden: torch.Tensor) -> DraftOutput: ...

    def draft_steps(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                    hidden: torch.Tensor) -> DraftOutput: ...

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]: ...

    def static_tensors(self) -> dict[str, torch.Tensor]: ...

    def plan_for_batches(self, sizes: Sequence[int]) -> None: ...  # called before a capture with its buckets

    def plan_for_any_batch(self) -> None: ...  # called instead before a capture with DraftGraphs' dynamic_batch
