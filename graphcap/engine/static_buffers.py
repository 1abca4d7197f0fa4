"""The tensors a captured graph reads by address, and the guard that they stay there.

Two kinds: the persistent tensors the caller owns (weights, window buffers, the target's pools, `req_to_token`), and
each bucket's static inputs, allocated here from the function's example inputs. A graph bakes in their addresses, so
a persistent tensor reallocated in place (`set_`, `resize_`) would make a replay read freed memory: the address guard
turns that into a `CaptureError` before anything is written (then `DraftGraphs.recapture()`).

Some persistent tensors are sized by the server's memory settings, not by the model: the KV pools (token capacity),
`req_to_token` (request rows x context columns), `full_to_swa`, the window buffers' slot rows. Those dimensions
(`pool_dims`) are compiled symbolically in a `dynamic_batch` capture (`mark_pool_dims`), so a restart with other pool
sizes reuses the compiled artifact from Inductor's on-disk caches instead of compiling again (unless a new context
bound changes the full layer's planned split count, a constant of the graph). The marks stay on the
tensors: a later compile in the process over the same pools treats those dimensions as dynamic too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from graphcap.engine.guards import AddressGuard
from graphcap.engine.iteration import Inputs


PoolDims = Mapping[str, Sequence[int]]  # persistent tensor name -> its dimensions sized by memory settings


class StaticBuffers:
    def __init__(self, persistent: dict[str, torch.Tensor], example_inputs: Callable[[int], Inputs],
                 pool_dims: PoolDims | None = None) -> None:
        self.persistent = dict(persistent)
        self.pool_dims = _checked_pool_dims(self.persistent, pool_dims or {})
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

    def mark_pool_dims(self) -> None:
        """Compile the `pool_dims` symbolically (before the first compile: Dynamo reads the marks when it traces).
        `maybe_mark_dynamic`, not `mark_dynamic`: where something does specialise a size, that costs a compile at the
        next restart with other pools, never a failed capture (mark_dynamic raises then). Dynamo honours the marks
        on tensors it reaches as attributes (of the loop, its window buffers, the attention sources), as it does on
        arguments; parameters and module buffers would be forced static (force_parameter_static_shapes), and none is
        pool-sized."""
        for name, dims in self.pool_dims.items():
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(self.persistent[name], d)


def _checked_pool_dims(persistent: dict[str, torch.Tensor], pool_dims: PoolDims) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, dims in pool_dims.items():
        t = persistent.get(name)
        if t is None:
            raise ValueError(f"pool_dims: {name!r} is not one of the static tensors")
        dims = tuple(int(d) for d in dims)
        if any(not 0 <= d < t.ndim for d in dims):
            raise ValueError(f"pool_dims: {name!r} has {t.ndim} dimensions, got {dims}")
        out[name] = dims
    return out
