"""CaptureOptions (graphcap.engine.options): every field checked when the options are made, a bad one named with what
it takes; the constructors resolve what None stands for; option fields given as keywords are the same options."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from graphcap.backends import SPEC_DEFAULT_BACKEND
from graphcap.engine.capture import DraftGraphs
from graphcap.engine.options import CaptureOptions
from graphcap.engine.iteration import DraftOutput

# (field, a bad value, what the error says it takes)
BAD = [
    ("backend", "fast", r"one of .*cudagraph"),
    ("backend", 3, r"one of "),
    ("buckets", (4, 2), r"positive, strictly increasing ints"),
    ("buckets", (0, 2), r"positive, strictly increasing ints"),
    ("buckets", (), r"positive, strictly increasing ints"),
    ("buckets", (1, 2.0), r"positive, strictly increasing ints"),
    ("buckets", 8, r"a sequence of positive, strictly increasing ints"),
    ("buckets", "8", r"a sequence of positive, strictly increasing ints"),
    ("dynamic_batch", "yes", r"True, False or None"),
    ("dynamic_batch", 1, r"True, False or None"),
    ("precompile", "no", r"True, False or None"),
    ("compile_max_batch", 0, r"an int >= 1 or None"),
    ("compile_max_batch", "8", r"an int >= 1 or None"),
    ("compile_max_batch", True, r"an int >= 1 or None"),
    ("compile_cache", 7, r"a directory \(str or path\) or None"),
    ("cache_key", b"k", r"a string or None"),
    ("manifest_path", 1, r"'default', a path or None"),
    ("flush_every_s", -1.0, r"seconds >= 0"),
    ("flush_every_s", float("nan"), r"seconds >= 0"),
    ("flush_every_s", "10", r"seconds >= 0"),
    ("flush_every_s", True, r"seconds >= 0"),
    ("progress", 1, r"True or False"),
    ("replay_checks", None, r"True or False"),
]


@pytest.mark.parametrize("name, value, expected", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_option_is_named_with_what_it_takes(name, value, expected):
    with pytest.raises(ValueError) as e:
        CaptureOptions(**{name: value})
    msg = str(e.value)
    assert (msg.startswith(f"CaptureOptions: {name} must be ") or "buckets must be" in msg) and "\n" not in msg, msg
    assert re.search(expected, msg), msg


def test_every_field_has_a_bad_case():
    assert {n for n, _, _ in BAD} == {f.name for f in dataclasses.fields(CaptureOptions)}


def test_good_options_are_kept_frozen_and_buckets_become_a_tuple(tmp_path):
    opts = CaptureOptions(backend="eager", buckets=[1, 2, 8], dynamic_batch=False, compile_max_batch=8,
                          compile_cache=tmp_path, cache_key="k", precompile=False, manifest_path=Path("m.json"),
                          flush_every_s=0, progress=True, replay_checks=False)
    assert opts.buckets == (1, 2, 8) and opts.flush_every_s == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.backend = "compile"
    assert opts.replace(backend="compile").backend == "compile" and opts.backend == "eager"
    with pytest.raises(ValueError, match=r"^CaptureOptions has no option 'backnd'; its options: backend, buckets"):
        opts.replace(backnd="compile")
    with pytest.raises(ValueError, match=r"^CaptureOptions: backend must be one of"):
        opts.replace(backend="fast")


def _function():
    """The smallest function DraftGraphs captures: (slots, accepted, tokens, hidden) -> DraftOutput, on CPU."""
    def fn(slots, accepted, tokens, hidden):
        return DraftOutput(tokens[:, None].repeat(1, 2), hidden[:, :2], hidden[:, :2], hidden)

    def example_inputs(b):
        return (torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int32),
                torch.zeros(b, dtype=torch.int64), torch.zeros(b, 4))
    return fn, example_inputs


def test_draft_graphs_resolves_the_defaults_of_its_options():
    fn, ex = _function()
    opts = CaptureOptions(backend="eager", buckets=(1, 4), manifest_path=None, flush_every_s=1.0)
    given = DraftGraphs(fn, example_inputs=ex, static_tensors={}, padding_slot=0, options=opts)
    # what None stands for, resolved: DraftGraphs over any function compiles per bucket and precompiles nothing
    assert given.options == opts.replace(dynamic_batch=False, precompile=False)
    assert (given.backend, given.dynamic_batch, given.precompile, given.replay_checks) == ("eager", False, False, True)
    with pytest.raises(TypeError, match="buckets"):  # the options are one value, not keywords beside it
        DraftGraphs(fn, example_inputs=ex, static_tensors={}, padding_slot=0, options=opts, buckets=(2,))
    with pytest.raises(ValueError, match=r"^DraftGraphs: CaptureOptions.buckets is None: name the batch sizes"):
        DraftGraphs(fn, example_inputs=ex, static_tensors={}, padding_slot=0, options=CaptureOptions())
    with pytest.raises(ValueError, match=r"^DraftGraphs: options must be a CaptureOptions, got \{'backend'"):
        DraftGraphs(fn, example_inputs=ex, static_tensors={}, padding_slot=0, options={"backend": "eager"})
    # no backend named: the library's default, which records CUDA graphs (refused on a CPU, naming it)
    with pytest.raises(ValueError, match=rf"backend '{SPEC_DEFAULT_BACKEND}' records CUDA graphs"):
        DraftGraphs(fn, example_inputs=ex, static_tensors={}, padding_slot=0, options=CaptureOptions(buckets=(1,)))
