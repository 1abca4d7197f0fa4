"""The capture engine's guards: checks that turn a wrong or silently slow replay into an error naming the cause.

- static addresses: every persistent tensor a graph reads (pools, tables, window buffers, weights) must stay where it
  was at capture, or the graph reads freed memory;
- recompiles: a Dynamo cache entry added after capture means a guard failed and the compiled call is no longer the
  captured one;
- cudagraph skips: Inductor's reduce-overhead quietly falls back to no graph on some inputs; at capture we make it
  raise instead, and count its skip counter;
- error descriptions: the root cause behind Dynamo's and Inductor's wrapper exceptions, for the manifest;
- a batch's inputs against the static inputs they are copied into (`check_batch_inputs`).
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Sequence

import torch

from graphcap.window import check_slots


class CaptureError(RuntimeError):
    """A guard tripped: the captured graphs would be wrong or silently slow. The message names the cause."""


_data_ptr = torch.Tensor.data_ptr
# The check CUDA-graph trees run before each replay: every tensor's data pointer against a list, in one C++ loop
# (torch's CUDA builds have it; a CPU build does not). Its cost per call: docs/results.md, host time per call.
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class AddressGuard:
    """The data pointers of the static tensors at capture time; `check()` raises if any moved. `native`: read them
    through torch's C++ check (None: where torch has it) or through a Python loop (False); the host bench times both."""

    def __init__(self, tensors: dict[str, torch.Tensor], native: bool | None = None) -> None:
        self._names = list(tensors)
        self._tensors = tuple(tensors.values())
        # map() over the unbound method makes no bound method per tensor; a subclass that overrides data_ptr keeps
        # its own (then every tensor is asked by name)
        self._plain = all(type(t).data_ptr is _data_ptr for t in self._tensors)
        self._ptrs = self._read()
        # the C++ check's arguments, made once (it takes lists)
        use_native = _ptrs_equal is not None and self._plain and native is not False
        if native and not use_native:
            raise ValueError("AddressGuard(native=True): this torch has no C++ data-pointer check, or a tensor "
                             "overrides data_ptr")
        self._native = (list(self._tensors), list(self._ptrs), list(range(len(self._tensors)))) \
            if use_native else None

    def _read(self) -> tuple[int, ...]:
        if self._plain:
            return tuple(map(_data_ptr, self._tensors))
        return tuple(t.data_ptr() for t in self._tensors)

    def check(self) -> None:
        # Every tensor at every call: one that moved would make the next replay read freed memory, so no sampling.
        # No device work.
        if self._native is not None:
            if _ptrs_equal(*self._native):
                return
        elif self._read() == self._ptrs:
            return
        if self._read() != self._ptrs:
            name = next(n for n, t, p in zip(self._names, self._tensors, self._ptrs) if t.data_ptr() != p)
            raise CaptureError(f"static tensor {name!r} moved since capture (reallocated or resized): the graphs "
                               "would read the old memory; call recapture()")


def describe(e: BaseException) -> str:
    """`Type: first line`, plus the root cause when a wrapper (Dynamo, Inductor) hides it."""
    def line(x: BaseException) -> str:
        text = str(x).strip()
        return f"{type(x).__name__}: {text.splitlines()[0]}" if text else type(x).__name__

    root, seen = e, {id(e)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        root = nxt
    return line(e) if root is e else f"{line(e)} (cause: {line(root)})"


def cache_entries(code: types.CodeType) -> int:
    """Dynamo cache entries (one per compiled specialisation) of a code object."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))


def cudagraph_skips() -> int:
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def reserved_bytes() -> int:
    return torch.cuda.memory_stats().get("reserved_bytes.all.current", 0)


@contextlib.contextmanager
def cudagraph_or_error(enabled: bool):
    """While capturing, make Inductor raise (with its reason) instead of quietly skipping CUDA graphs."""
    cfg = torch._inductor.config.triton
    if not enabled or not hasattr(cfg, "cudagraph_or_error"):
        yield
        return
    old, cfg.cudagraph_or_error = cfg.cudagraph_or_error, True
    try:
        yield
    finally:
        cfg.cudagraph_or_error = old


def check_batch_inputs(ref_inputs: Sequence[torch.Tensor], device: torch.device, padding_slot: int,
                       slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, *,
                       accepted: torch.Tensor | None = None, host_slots: Sequence[int] | None = None,
                       call: str = "run") -> None:
    """`DraftGraphs.check_batch`: a batch's (slots, accepted, tokens, hidden) against a bucket's static inputs
    `ref_inputs` - shapes past the batch dimension, `device`, dtypes - and with `host_slots` that they match the batch
    and are distinct and below `padding_slot`. Tensor metadata and host ints only, no device sync. (`BatchCheck`
    remembers what passed.)"""
    for name, x in (("slots", slots), ("accepted", accepted), ("tokens", tokens), ("hidden", hidden)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise CaptureError(f"{call}: {name} must be a torch.Tensor, got {type(x).__name__}")
    b = slots.shape[0] if slots.ndim == 1 else -1
    if b < 1:
        raise CaptureError(f"{call}: slots must be a non-empty 1-D tensor, got shape {tuple(slots.shape)}")
    if host_slots is not None and len(host_slots) != b:
        raise CaptureError(f"{call}: {len(host_slots)} host_slots for a batch of {b} (slots {tuple(slots.shape)})")
    given = [("slots", slots, ref_inputs[0]), ("accepted", accepted, ref_inputs[1]),
             ("tokens", tokens, ref_inputs[2]), ("hidden", hidden, ref_inputs[3])]
    given = [g for g in given if g[1] is not None]
    for name, x, r in given[1:]:
        if tuple(x.shape) != (b, *r.shape[1:]):
            raise CaptureError(f"{call}: {name} has shape {tuple(x.shape)}, expected {(b, *r.shape[1:])}")
    for name, x, r in given:
        if x.device != device:
            raise CaptureError(f"{call}: {name} is on {x.device}, the captured graphs on {device}")
        # integer inputs may be any integer dtype (copied into the static buffers); hidden must match exactly
        ok = x.dtype == r.dtype if r.is_floating_point() else not (x.is_floating_point() or x.is_complex()
                                                                   or x.dtype == torch.bool)
        if not ok:
            want = r.dtype if r.is_floating_point() else "an integer dtype"
            raise CaptureError(f"{call}: {name} has dtype {x.dtype}, expected {want}")
    if host_slots is not None:
        check_slots(host_slots, padding_slot, error=CaptureError, call=call, arg="host_slots")


class BatchCheck:
    """`check_batch_inputs` for one capture's static inputs, remembering the tensor metadata it has passed: an engine
    sends batches of a few shapes, dtypes and devices over and over, so after the first batch of each kind the check
    is one tuple of those attributes and a set lookup (the H200 host spent ~12 us a call on the full check). The
    host-slot check runs every call (its values change). The verdict depends on nothing but the key's attributes:
    an object that is no tensor fails the full check, so it never enters the set."""

    MAX_KINDS = 1024  # distinct (shape, dtype, device) combinations remembered; past it, every call checks in full

    def __init__(self, ref_inputs: Sequence[torch.Tensor], device: torch.device, padding_slot: int) -> None:
        self._ref, self._device, self._padding = tuple(ref_inputs), device, padding_slot
        self._passed: set[tuple] = set()

    def __call__(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, *,
                 accepted: torch.Tensor | None = None, host_slots: Sequence[int] | None = None,
                 call: str = "run") -> None:
        try:
            key = (slots.shape, slots.dtype, slots.device, tokens.shape, tokens.dtype, tokens.device, hidden.shape,
                   hidden.dtype, hidden.device,
                   None if accepted is None else (accepted.shape, accepted.dtype, accepted.device))
        except AttributeError:  # no tensor: the full check names it
            key = None
        if key is None or key not in self._passed:  # the full check, host slots included (its order of errors)
            check_batch_inputs(self._ref, self._device, self._padding, slots, tokens, hidden, accepted=accepted,
                               host_slots=host_slots, call=call)
            if key is not None and len(self._passed) < self.MAX_KINDS:
                self._passed.add(key)
        elif host_slots is not None:  # the metadata passed before: only the host slots' checks can fail
            if len(host_slots) != slots.shape[0]:
                raise CaptureError(f"{call}: {len(host_slots)} host_slots for a batch of {slots.shape[0]} "
                                   f"(slots {tuple(slots.shape)})")
            check_slots(host_slots, self._padding, error=CaptureError, call=call, arg="host_slots")
