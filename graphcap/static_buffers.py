"""The tensors a captured graph reads by address, and the guard that they stay there.

Two kinds: the persistent tensors the caller owns (weights, window buffers, the target's pools, `req_to_token`), and
each bucket's static inputs, allocated here from the function's example inputs. A graph bakes in their addresses, so
a persistent tensor reallocated in place (`set_`, `resize_`) would make a replay read freed memory: the address guard
turns that into a `CaptureError` before anything is written (then `DraftGraphs.recapture()`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from graphcap.guards import AddressGuard
from graphcap.iteration import Inputs


class StaticBuffers:
    def __init__(self, persistent: dict[str, torch.Tensor], example_inputs: Callable[[int], Inputs]) -> None:
        self.persistent = dict(persistent)
        self._example_inputs = example_inputs
        self._guard = AddressGuard({})  # armed at capture (`arm`): nothing to check before

    def new_inputs(self, size: int) -> Inputs:
        """A bucket's static inputs: its own copies of the example inputs for `size` padding rows (warm-up and capture
        run on these without touching any live slot)."""
        return tuple(t.clone() for t in self._example_inputs(size))  # type: ignore[return-value]

    def arm(self) -> None:
        """Take the persistent tensors' addresses as the captured ones (at the start of every capture)."""
        self._guard = AddressGuard(self.persistent)

    def check(self) -> None:
        """Raise `CaptureError` naming a persistent tensor that moved since `arm` (a few microseconds, no device
        work: called before every replay of a captured bucket)."""
        self._guard.check()

    def all_tensors(self, bucket_inputs: Iterator[torch.Tensor]) -> list[torch.Tensor]:
        """Every tensor a graph reads by address - the persistent ones and the buckets' inputs - for
        `mark_static_address` (a tensor Dynamo sees as a plain input is copied into the graph at every replay)."""
        return [*self.persistent.values(), *bucket_inputs]
