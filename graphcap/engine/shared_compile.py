"""The compiled iteration every bucket of a capture shares (compiled backends): how a capture obtains it, and what it
saves once every bucket is recorded.

Obtaining it: the batch marked as one unbacked symbol over all buckets' inputs and the pool-sized dimensions marked
dynamic (`dynamic_batch`), torch's compile artifacts loaded from the compile cache, then the precompiled iteration
loaded (or compiled ahead of time) where `precompile` asks for it, else a plain compile. Saving: the compile
artifacts and the precompiled iteration, under the keys that name what they hold. `DraftGraphs` owns one per capture
configuration; `recording` compiles and records, `compile_cache` and `precompile` keep the files.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from graphcap.engine import compile_cache as cc
from graphcap.engine import precompile as precompile_mod
from graphcap.engine.iteration import DraftFn, Inputs
from graphcap.engine.recording import (CompiledIteration, compile_iteration, iteration_function, mark_batch_unbacked,
                                mark_static)
from graphcap.engine.static_buffers import StaticBuffers


@dataclass
class SharedCompile:
    """One capture configuration's compiled iteration: its keys, `obtain` before recording, `save` after; `state` and
    `notes` go to the manifest."""

    fn: DraftFn
    backend: str
    spec: object | None
    device: torch.device
    sizes: tuple[int, ...]  # the capture's buckets
    static: StaticBuffers
    tag: str  # names the compiled code object (recording.iteration_function)
    compile_max: int  # the largest batch the one compile is sized for (DraftGraphs' compile_max_batch)
    dynamic_batch: bool = False
    compile_cache: str | os.PathLike | None = None
    cache_key_text: str | None = None  # what is compiled, beyond the spec (DraftGraphs' cache_key)
    precompile: bool = False
    state: str | None = None  # the manifest's compile_cache: hit, miss, refused: <why>
    notes: list[str] = field(default_factory=list)  # for the manifest
    _aot_to_save: DraftFn | None = None  # a precompiled iteration compiled by this capture, saved after it

    def cache_key(self) -> str:
        """The compile cache's key (graphcap.engine.compile_cache.cache_key) for this configuration."""
        sized = f";compile_max_batch={self.compile_max}" if self.compile_max != self.sizes[-1] else ""
        return cc.cache_key(spec_hash=getattr(self.spec, "hash", None),
                            key=(self.cache_key_text or "") + sized or None, backend=self.backend,
                            buckets=self.sizes, dynamic_batch=self.dynamic_batch, device=self.device)

    def aot_key(self) -> str:
        """The precompiled iteration's key: the cache key plus what stands in for Dynamo's guards
        (graphcap.engine.precompile.signature)."""
        return f"{self.cache_key()}-{precompile_mod.signature(self.static.persistent, self.static.pool_dims, self.fn)}"

    def obtain(self, bucket_inputs: Sequence[Inputs], warn: Callable[[str, str], None]) -> CompiledIteration:
        """The compiled iteration over every bucket's static inputs (`bucket_inputs`, smallest bucket first), the
        marks made and the caches read first. `warn(key, message)` reports a precompile that failed (the capture then
        compiles as without it)."""
        self._aot_to_save = None  # nothing left over from a capture that raised
        inputs = [t for b in bucket_inputs for t in b]
        if self.dynamic_batch:
            # One symbol for the batch of all four inputs of every bucket (shape_id), so one graph serves them all.
            # Unbacked, not mark_dynamic: a backed size is specialised at 1 (bucket 1 would compile again - an
            # error under mark_dynamic's range) and each input would get its own symbol. (strict=True, which
            # should refuse a specialisation, made Dynamo specialise at 1 again in torch 2.13: the entry count
            # after capture is checked instead.) hint_override: Inductor's size hints (autotuning) take the
            # largest batch (compile_max_batch), not its default for unbacked sizes.
            for t in inputs:
                mark_batch_unbacked(t, self.compile_max)
            self.static.mark_pool_dims()  # the per-bucket compile specialises on every shape anyway
        static = self.static.all_tensors(iter(inputs))
        if self.compile_cache is not None:
            self.state = cc.load(self.compile_cache, self.cache_key())
        batch_range = (1, self.compile_max) if self.dynamic_batch else None
        got = self._precompiled(static, batch_range, bucket_inputs[-1], warn) if self.precompile else None
        if got is not None:
            return got
        return CompiledIteration(*compile_iteration(self.fn, self.backend, static, len(self.sizes), tag=self.tag,
                                                    dynamic_batch=self.dynamic_batch, batch_range=batch_range))

    def _precompiled(self, static: list[torch.Tensor], batch_range: tuple[int, int] | None, largest: Inputs,
                     warn: Callable[[str, str], None]) -> CompiledIteration | None:
        """The precompiled iteration from the cache directory, else compiled now (saved once every bucket is
        captured); None where torch's AOT compile fails: the capture then compiles as without precompile (warned,
        noted), saving nothing (graphcap.engine.precompile.load_or_compile)."""
        def fresh() -> DraftFn:
            mark_static(static)
            return iteration_function(self.fn, self.tag, batch_range)[0]

        got = precompile_mod.load_or_compile(self.compile_cache, self.aot_key(), {"fn": self.fn}, fresh, largest)
        self.state, self._aot_to_save = got.state, got.to_save
        self.notes += [got.note] if got.note else []
        if got.fn is None:
            warn("precompile", f"graphcap: {got.note}")
            return None
        return CompiledIteration(got.fn, None)

    def save(self, all_captured: bool) -> None:
        """After a capture: torch's compile artifacts (unless they were a hit) and a precompiled iteration this
        capture compiled, both only when every bucket was captured."""
        if all_captured and self.compile_cache is not None and self.state != cc.HIT:
            cc.save(self.compile_cache, self.cache_key())
        if all_captured and self._aot_to_save is not None:
            precompile_mod.save(self.compile_cache, self.aot_key(), self._aot_to_save, {"fn": self.fn})
        self._aot_to_save = None
