"""The dispatcher alone: batch size -> bucket, against a brute-force search (no torch involved)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphcap.engine.dispatch import BucketDispatcher
from graphcap.engine.guards import CaptureError


@given(st.lists(st.integers(1, 200), min_size=1, max_size=8, unique=True), st.lists(st.integers(1, 300), max_size=20))
def test_smallest_bucket_at_least_b_and_oversize_counted(sizes, batches):
    sizes = sorted(sizes)
    d = BucketDispatcher(sizes)
    for b in batches:
        assert d.index(b) == next((i for i, s in enumerate(sizes) if s >= b), None)
    assert d.oversize == sum(b > sizes[-1] for b in batches)


def test_zero_copy_range_and_bad_sizes():
    d = BucketDispatcher([2, 8])
    assert [d.captured_index("replay", b) for b in range(1, 9)] == [0, 0, 1, 1, 1, 1, 1, 1]
    for bad in (0, 9, 3.0, True):
        with pytest.raises(CaptureError, match=rf"replay: batch {bad!r} is not an int in the captured buckets' range"):
            d.captured_index("replay", bad)
    assert d.oversize == 0  # the zero-copy calls have no eager path: nothing counted
    for sizes in ([], [4, 2], [2, 2], [0, 4], [1, 2.0], ["4"], [True, 2]):
        with pytest.raises(ValueError, match="strictly increasing"):
            BucketDispatcher(sizes)
