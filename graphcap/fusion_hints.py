"""Inductor's fusion scoring under an unbacked batch (experimental, off unless GRAPHCAP_UNBACKED_FUSION_HINTS=1).

One compile for every bucket marks the batch unbacked. Inductor scores a fusion by the bytes two nodes share, and
it sizes a dependency whose size has an unbacked symbol at 0 bytes unless the symbol carries a hint it honours
(`mark_unbacked(..., hint_override=)`: torch 2.13 honours it; on the H200's torch 2.11 the fusions stayed vetoed
with it passed). A zero score vetoes the fusion outright, so on torch 2.11 every RMSNorm's scale-and-cast stays a kernel apart from its reduction: 156 Inductor
kernels per iteration against 83 with a static or backed batch on the H200 (docs/results.md). Fusion scores are a
heuristic - Inductor's legality checks decide what may fuse - so sizing those dependencies at the largest bucket
changes which legal fusions are taken, never what is computed.

`unbacked_fusion_hints(hint)` does that while a capture compiles: it wraps `Scheduler.dep_size_hint` so that a
dependency Inductor sized at 0 because of unbacked symbols gets its size with every unbacked symbol at `hint`, and
sets Inductor's `unbacked_symint_fallback` to `hint` - a config Inductor's compile cache keys on, so code compiled
without the hints is not loaded for a compile with them. It patches a private torch method, so it is opt-in and
falls back to torch's own answer on any surprise."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV = "GRAPHCAP_UNBACKED_FUSION_HINTS"


def enabled() -> bool:
    """Whether the environment asks for the hints (GRAPHCAP_UNBACKED_FUSION_HINTS=1)."""
    return os.environ.get(ENV) == "1"


def sized_at(dep, hint: int, count_bytes: bool = True) -> int:
    """`dep`'s size (bytes, or elements) with every unbacked symbol of it at `hint`; 0 where that cannot be said."""
    import sympy
    from torch._inductor.dependencies import MemoryDep
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(dep, MemoryDep):
        return 0
    numel = sympy.sympify(dep.get_numel())
    numel = numel.xreplace({s: sympy.Integer(hint) for s in free_unbacked_symbols(numel)})
    if not numel.is_number:  # backed symbols left: their hints
        sizevars = V.graph.sizevars
        numel = (getattr(sizevars, "optimization_hint", None) or sizevars.size_hint)(numel, fallback=hint)
    n = int(numel)
    return n * get_dtype_size(V.graph.get_dtype(dep.name)) if count_bytes else n


@contextlib.contextmanager
def unbacked_fusion_hints(hint: int | None) -> Iterator[bool]:
    """While active (and `hint` given and the environment asks for it), Inductor scores dependencies whose sizes
    have unbacked symbols at those symbols = `hint`. Yields whether the hints are on."""
    from torch._inductor.scheduler import Scheduler

    original = getattr(Scheduler, "dep_size_hint", None)
    if hint is None or not enabled() or original is None:
        yield False
        return

    def dep_size_hint(self, dep, *args, **kw):
        size = original(self, dep, *args, **kw)
        if size:
            return size
        count_bytes = args[0] if args else kw.get("count_bytes", True)
        try:
            return sized_at(dep, hint, count_bytes) if dep.has_unbacked_symbols() else size
        except Exception:  # a torch whose internals differ: its own answer
            return size

    import torch._inductor.config as inductor_config

    Scheduler.dep_size_hint = dep_size_hint
    try:
        with inductor_config.patch(unbacked_symint_fallback=hint):
            yield True
    finally:
        Scheduler.dep_size_hint = original
