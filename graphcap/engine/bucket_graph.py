"""One batch bucket's captured iteration: its static inputs, how it was recorded, and one replay over them.

The graph wrapper of vLLM's cudagraph dispatcher split: the dispatcher (graphcap.engine.dispatch) picks the bucket, this
records and replays it. A replay of B rows reads the bucket's static inputs, whose rows [B:] must be padding (the
padding slot, accepted = 0: length 0, so they read and write nothing); rows a larger batch wrote last time are reset
first. What comes back are views of the first B rows, valid until the bucket's next replay.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphcap import manifest as mf
from graphcap.engine.iteration import DraftFn, DraftOutput, Inputs
from graphcap.engine.recording import CompiledIteration, record_bucket


WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def common_word(tensors) -> torch.dtype:
    """The widest integer dtype every one of these dense tensors (of one dimension or more) can be viewed as
    (`Tensor.view(dtype)`: its last dimension's bytes and its storage offset's are whole words); uint8 always can."""
    for word in WORDS:
        n = word.itemsize
        if all((x.shape[-1] * x.element_size()) % n == 0 and (x.storage_offset() * x.element_size()) % n == 0
               for x in tensors):
            return word
    return torch.uint8


@dataclass
class BucketGraph:
    size: int
    inputs: Inputs  # static input buffers, rows [used_rows:] always padding
    record: mf.BucketRecord
    graph: torch.cuda.CUDAGraph | None = None  # manual-graph backends
    outputs: DraftOutput | None = None  # manual-graph backends: the graph's static outputs
    used_rows: int = 0  # live rows written since the last replay's reset (rows past it are padding)
    views: dict[int, tuple[Inputs, DraftOutput | None]] = field(default_factory=dict)  # first-B-row views, by B
    tails: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # slots, accepted rows [B:]
    word_views: dict[tuple[int, bool], list[torch.Tensor]] = field(default_factory=dict)  # as one word, by B

    @property
    def captured(self) -> bool:
        return self.record.status == "captured"

    def capture(self, backend: str, fn: DraftFn, compiled: CompiledIteration | None, pool) -> None:
        """Warm up and record over the static inputs (graphcap.engine.recording), filling the manifest record."""
        self.views.clear()  # views of the old static outputs must not outlive them
        self.graph, self.outputs = record_bucket(self.inputs, self.record, backend, fn,
                                                 compiled.fn if compiled is not None else None, pool)

    def rows(self, b: int) -> tuple[Inputs, DraftOutput | None]:
        """Views of the first b rows of the static inputs (and static outputs), made once per b: slicing costs
        host time on every call otherwise."""
        v = self.views.get(b)
        if v is None:
            outs = DraftOutput(*(x[:b] for x in self.outputs)) if self.outputs is not None else None
            v = self.views[b] = (tuple(x[:b] for x in self.inputs), outs)  # type: ignore[assignment]
        return v

    def tail(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows [b:] of the static slots and accepted counts, made once per b. A reset to padding writes
        all of them, not only up to the rows last used: the rest are padding already, and the views depend on b
        alone."""
        v = self.tails.get(b)
        if v is None:
            v = self.tails[b] = (self.inputs[0][b:], self.inputs[1][b:])
        return v

    def claim(self, b: int) -> Inputs:
        """The first b rows' static inputs, to be written by the caller: they are padding again at the next replay
        of a smaller batch (even if this batch is never replayed)."""
        self.used_rows = max(self.used_rows, b)
        return self.rows(b)[0]

    def word_rows(self, b: int, with_accepted: bool = True) -> list[torch.Tensor]:
        """The first b rows' static inputs (without the accepted counts: `with_accepted` False) viewed as one integer
        word (`common_word`, made once per b), for `write`'s one-dtype copy."""
        v = self.word_views.get((b, with_accepted))
        if v is None:
            rows = self.rows(b)[0]
            rows = rows if with_accepted else (rows[0], *rows[2:])
            word = common_word(rows)
            v = self.word_views[(b, with_accepted)] = [x.view(word) for x in rows]
        return v

    def write(self, slots: torch.Tensor, accepted: torch.Tensor | None, tokens: torch.Tensor,
              hidden: torch.Tensor) -> None:
        """Copy a live batch of B rows into the first B static rows (`run`'s path; `accepted` None: those rows are
        left as they are)."""
        b = slots.shape[0]
        rows = self.claim(b)
        if accepted is None:
            src, dst = (slots, tokens, hidden), (rows[0], *rows[2:])
        else:
            src, dst = (slots, accepted, tokens, hidden), rows
        if self.inputs[0].is_cuda and all(s.dtype == d.dtype and s.is_contiguous() for s, d in zip(src, dst)):
            # Same dtypes, both dense: the same bytes. As views of one integer word the four pairs share a dtype,
            # which puts torch._foreach_copy_ on its multi-tensor path: one kernel launch instead of four copies.
            # The widest word both sides allow: the multi-tensor kernel gives each chunk one block, whose threads
            # then make a load per word - as bytes, eight times as many as int64 (docs/results.md, run()'s input
            # copy). (CUDA only: on a CPU the views would cost more than they save.)
            dst_words = self.word_rows(b, accepted is not None)
            try:
                src_words = [s.view(dst_words[0].dtype) for s in src]
            except RuntimeError:  # a source less aligned than the static rows: a word both allow
                word = common_word((*src, *dst))
                dst_words, src_words = [d.view(word) for d in dst], [s.view(word) for s in src]
            torch._foreach_copy_(dst_words, src_words)
        else:  # e.g. int32 slots into the int64 static slots: torch converts pair by pair
            torch._foreach_copy_(dst, src)

    def replay(self, b: int, fn: DraftFn, compiled: CompiledIteration | None, padding_slot: int
               ) -> tuple[DraftOutput, bool]:
        """One iteration over the first b rows. Returns the outputs and whether they are already the first b rows
        (a recorded graph's static-output views) or still the whole bucket's. A bucket whose capture failed runs
        `fn` eagerly on the first b rows (counted as a fallback, not a replay)."""
        rec = self.record
        if self.used_rows > b:  # rows a larger batch used last time become padding again
            s, a = self.tail(b)
            s.fill_(padding_slot)
            a.zero_()
        self.used_rows = b
        if not self.captured:
            rec.fallbacks += 1
            return fn(*self.rows(b)[0]), True  # already b rows
        if self.graph is not None:
            self.graph.replay()
            out, sliced = self.rows(b)[1], True
        elif compiled is not None:
            out, sliced = compiled(self.size, *self.inputs), False
        else:  # eager backend: same dispatch, no capture
            out, sliced = fn(*self.inputs), False
        rec.replays += 1
        rec.padded_rows += self.size - b
        return out, sliced  # type: ignore[return-value]
