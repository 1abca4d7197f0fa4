"""Batch size -> bucket: which captured graph serves a batch of B rows (vLLM's cudagraph dispatcher's job).

The smallest bucket >= B serves B (its rows past B are padding). B above the largest bucket has no graph: the caller
runs the function eagerly, and the dispatcher counts it (the manifest's `oversize_fallbacks`). A bucket whose capture
failed is still dispatched to; its graph wrapper runs eagerly and counts it there.
"""
from __future__ import annotations

from collections.abc import Sequence

from graphcap.engine.guards import CaptureError


def bucket_sizes(sizes: Sequence[int], owner: str) -> tuple[int, ...]:
    """`sizes` as a tuple; a ValueError naming `owner` unless they are positive, strictly increasing ints."""
    sizes = tuple(sizes)
    if not sizes or any(type(s) is not int for s in sizes) or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
        raise ValueError(f"{owner}: buckets must be positive, strictly increasing ints, got {list(sizes)}")
    return sizes


class BucketDispatcher:
    """The bucket sizes and a table from every batch size up to the largest to its bucket's index."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes: tuple[int, ...] = bucket_sizes(sizes, "DraftGraphs")
        sizes = list(self.sizes)
        self.largest = sizes[-1]
        # A list index per call: a search (bisect) would cost host time on every iteration.
        self._index_of: list[int] = [0] * (self.largest + 1)
        j = 0
        for b in range(1, self.largest + 1):
            while sizes[j] < b:
                j += 1
            self._index_of[b] = j
        self.oversize = 0  # batches above the largest bucket (run eagerly by the caller)

    def index(self, b: int) -> int | None:
        """The index of the bucket that serves a batch of `b` >= 1 rows, or None (counted) above the largest."""
        if b > self.largest:
            self.oversize += 1
            return None
        return self._index_of[b]

    def captured_index(self, caller: str, b: int) -> int:
        """`index` for the zero-copy calls (`static_inputs`, `replay`), which have no eager path: `b` must be an int
        within the buckets' range."""
        if type(b) is not int or not 1 <= b <= self.largest:
            raise CaptureError(f"{caller}: batch {b!r} is not an int in the captured buckets' range "
                               f"1..{self.largest}; use run() (larger batches run eagerly)")
        return self._index_of[b]
