"""Capture specs: the shipped ones load; every kind of bad spec names the file, the field and the reason."""
from __future__ import annotations

import copy
import sys

import pytest

from graphcap.spec import SpecError, builtin_specs, load_spec, parse_spec

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def test_builtin_specs_load():
    names = {load_spec(p).name for p in builtin_specs()}
    assert {"tiny", "gemma4-31b-assistant"} <= names
    g = load_spec("gemma4-31b-assistant")
    assert (g.window, g.page_size, g.target.layers, g.target.sliding_per_full) == (1024, 64, 60, 5)
    assert (g.draft.heads, g.sliding.kv_heads, g.sliding.head_dim, g.full.head_dim, g.draft.vocab) == (32, 16, 256, 512, 262144)
    assert g.draft.layers == ("sliding", "sliding", "sliding", "full")


def test_hash_ignores_formatting_but_not_content(tmp_path):
    src = load_spec("tiny").source
    text = open(src).read()
    (tmp_path / "a.toml").write_text("# another comment\n" + text)
    assert load_spec(tmp_path / "a.toml").hash == load_spec("tiny").hash
    (tmp_path / "b.toml").write_text(text.replace("steps = 3", "steps = 2"))
    assert load_spec(tmp_path / "b.toml").hash != load_spec("tiny").hash


def _tiny() -> dict:
    with open(load_spec("tiny").source, "rb") as f:
        return tomllib.load(f)


def _mutate(path: str, value):
    d = _tiny()
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


BAD = [
    ("window.size", KeyError, "window.size: missing"),
    ("window.size", 0, "window.size: must be >= 1, got 0"),
    ("window.size", -4, "window.size: must be >= 1"),
    ("window.size", "16", "window.size: expected an integer, got '16'"),
    ("window.page_size", True, "window.page_size: expected an integer, got True"),
    ("draft.hidden", 3.5, "draft.hidden: expected an integer"),
    ("draft.layers", ["sliding", "local"], "draft.layers[1]: unknown value 'local'; expected 'sliding' or 'full'"),
    ("draft.layers", [], "draft.layers: expected a non-empty list"),
    ("draft.head", "mixture", "draft.head: unknown value 'mixture'"),
    ("draft.centroids", 15, "draft.centroids: must divide vocab 256"),
    ("draft.centroid_top_k", 17, "draft.centroid_top_k: must be in [1, centroids=16]"),
    ("draft.colour", "red", "draft.colour: unknown key"),
    ("attention.sliding.kv_heads", 3, "attention.sliding.kv_heads: must divide draft.heads=4"),
    ("attention.full.head_dim", 15, "attention.full.head_dim: must be even"),
    ("attention.full", KeyError, "attention.full: missing"),
    ("capture.buckets", [1, 4, 2], "capture.buckets: must be strictly increasing, got [1, 4, 2]"),
    ("capture.buckets", [1, 1, 2], "capture.buckets: must be strictly increasing"),
    ("capture.buckets", [1, 2, 32], "capture.buckets: largest bucket 32 exceeds capture.max_slots=16"),
    ("capture.buckets", [1, 0], "capture.buckets[1]: must be >= 1, got 0"),
    ("capture.top_k", 4, "capture.top_k: only 1 (a chain draft) is supported, got 4"),
    ("capture.backend", "inductor", "capture.backend: unknown value 'inductor'"),
    ("dtype", "float8", "dtype: unknown value 'float8'"),
    ("speed", 11, "speed: unknown key"),
    ("target", 5, "target: expected a table, got 5"),
]


@pytest.mark.parametrize("path, value, message", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_specs_name_file_field_and_reason(path, value, message):
    with pytest.raises(SpecError) as e:
        parse_spec(_mutate(path, value), source="specs/x.toml")
    assert str(e.value).startswith("specs/x.toml: ")
    assert message in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.toml: <file>: cannot read"):
        load_spec(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(SpecError, match=r"bad\.toml: <toml>: "):
        load_spec(bad)


def test_full_vocab_head_variant_is_valid():
    d = _tiny()
    d["draft"] = {k: v for k, v in d["draft"].items() if k not in ("centroids", "centroid_top_k")} | {"head": "full"}
    s = parse_spec(copy.deepcopy(d))
    assert s.draft.head == "full" and s.draft.centroids == 0
