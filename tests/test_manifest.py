"""Capture manifests: round trip through the real writer, and a named ManifestError for every kind of bad file."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.backends import ALL_BACKENDS
from graphcap.manifest import (
    FORMAT_VERSION, STATUSES, BucketRecord, Manifest, ManifestError, Parallel, default_manifest_dir, environment,
    list_manifests, manifest_path, read_manifest, write_manifest,
)
from graphcap.spec import load_spec
from tiers import examples

CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc).isoformat()  # a fixed past time


def random_manifest(rng: random.Random, spec_name: str = "tiny", backend: str | None = None) -> Manifest:
    sizes = sorted(rng.sample(range(1, 129), rng.randint(1, 7)))
    buckets = []
    for b in sizes:
        status = rng.choice(STATUSES)
        replays = rng.randint(0, 10**6)
        buckets.append(BucketRecord(
            batch_size=b, status=status, reason=f"capture of bucket {b} failed: {rng.random()}" if status == "failed" else None,
            capture_s=rng.uniform(0, 90), pool_bytes=rng.randint(0, 2**40), replays=replays,
            fallbacks=rng.randint(0, 1000), padded_rows=rng.randint(0, replays * (b - 1)),
        ))
    return Manifest(
        format_version=FORMAT_VERSION, spec_name=spec_name, spec_hash=f"{rng.getrandbits(64):016x}",
        spec_source=f"/specs/{spec_name}.toml", backend=backend or rng.choice(ALL_BACKENDS),
        device=rng.choice(["cpu", "NVIDIA H200"]), driver=rng.choice([None, "570.133.20"]),
        torch_version="2.13.0+cu130", triton_version=rng.choice([None, "3.9.0"]), graphcap_version="0.1.0",
        created=CREATED, updated=CREATED, steps=rng.randint(1, 8),
        window=rng.choice([16, 1024, 4096]), buckets=buckets, oversize_fallbacks=rng.randint(0, 99),
        notes=[f"note {rng.random()}" for _ in range(rng.randint(0, 3))],
    )


@settings(max_examples=examples(50), deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_round_trip(tmp_path_factory, seed):
    m = random_manifest(random.Random(seed))
    path = manifest_path(tmp_path_factory.mktemp("m"), m.spec_name, m.spec_hash, m.backend)
    assert write_manifest(m, path) == path
    assert read_manifest(path) == m
    assert json.loads(path.read_text()) == m.to_dict()  # the file holds the raw fields, nothing derived


def test_write_stamps_updated_atomically_and_creates_dir(tmp_path):
    m = random_manifest(random.Random(1))
    path = tmp_path / "a" / "b" / "m.json"
    write_manifest(m, path)
    assert m.updated != m.created and read_manifest(path).updated == m.updated
    m.buckets[0].replays += 5
    write_manifest(m, path)  # overwrite in place
    assert read_manifest(path).buckets[0].replays == m.buckets[0].replays
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.json"]  # no temp file left behind


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    m = random_manifest(random.Random(2))
    path = write_manifest(m, tmp_path / "m.json")
    before = path.read_text()
    m.buckets[0].capture_s = float("nan")  # JSON cannot hold it: the write fails before replacing anything
    with pytest.raises(ValueError):
        write_manifest(m, path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_interrupted_replace_removes_temp_file(tmp_path, monkeypatch):
    m = random_manifest(random.Random(3))
    path = write_manifest(m, tmp_path / "m.json")
    before = path.read_text()

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        write_manifest(m, path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_padding_waste():
    assert BucketRecord(8).padding_waste == 0.0
    assert BucketRecord(8, "captured", replays=4, padded_rows=8).padding_waste == 0.25


def test_for_spec_and_environment():
    spec = load_spec("tiny")
    m = Manifest.for_spec(spec)
    assert (m.spec_name, m.spec_hash, m.backend, m.steps, m.window) == ("tiny", spec.hash, "inductor-cudagraph", 3, 16)
    assert [b.batch_size for b in m.buckets] == [1, 2, 4, 8] and {b.status for b in m.buckets} == {"pending"}
    env = environment()
    assert set(env) == {"device", "driver", "torch_version", "triton_version", "graphcap_version"}
    import torch

    assert env["torch_version"] == torch.__version__
    if not torch.cuda.is_available():
        assert env["device"] == "cpu"
    assert m.bucket(4) is m.buckets[2]
    with pytest.raises(KeyError):
        m.bucket(3)


def test_for_spec_with_a_running_captures_records():
    """What DraftGraphs.manifest() builds on: its own records, creation time and environment; no spec at all."""
    env = dict(device="cpu", driver=None, torch_version="t", triton_version=None, graphcap_version="g")
    recs = [BucketRecord(3, "captured", replays=5)]
    m = Manifest.for_spec(load_spec("tiny"), "eager", env, buckets=recs, created=CREATED)
    assert m.buckets is recs and m.created == CREATED and m.updated >= m.created
    assert (m.backend, m.device, m.spec_name) == ("eager", "cpu", "tiny")
    bare = Manifest.for_spec(None, "compile", env, buckets=[])
    assert (bare.spec_name, bare.spec_hash, bare.spec_source, bare.steps, bare.window) == ("(none)", "", "", 0, 0)
    assert bare.created == bare.updated
    with pytest.raises(ValueError, match="without a spec"):
        Manifest.for_spec(None, "eager", env)
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        Manifest.for_spec(None, "fast", env, buckets=[])


def test_default_manifest_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHCAP_MANIFEST_DIR", str(tmp_path / "x"))
    assert default_manifest_dir() == tmp_path / "x"
    monkeypatch.delenv("GRAPHCAP_MANIFEST_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_manifest_dir() == tmp_path / "cache" / "graphcap" / "manifests"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_manifest_dir() == Path.home() / ".cache" / "graphcap" / "manifests"


def test_manifest_path_and_listing(tmp_path):
    assert manifest_path(tmp_path, "tiny", "ab12", "cudagraph") == tmp_path / "tiny-ab12-cudagraph.json"
    assert manifest_path(tmp_path, "../evil/name", "h", "eager").parent == tmp_path
    assert list_manifests(tmp_path / "missing") == []
    names = ("tiny-ab12-reduce-overhead.json", "gemma-cd34-inductor-cudagraph.json", "bench.json", "notes.txt",
             "capture_cost.json", "x-eager.json")
    for name in names:
        (tmp_path / name).write_text("{}")
    # by name, as the writer names them: a bench's JSON beside the manifests is not one
    assert list_manifests(tmp_path) == [tmp_path / n for n in sorted(
        ("tiny-ab12-reduce-overhead.json", "gemma-cd34-inductor-cudagraph.json", "x-eager.json"))]


# ---------------------------------------------------------------------------------------------------------------
# Corruption: each case is (name, edit of the written JSON text) -> expected field and reason fragment


def _edit(fn):
    def apply(text: str) -> str:
        d = json.loads(text)
        fn(d)
        return json.dumps(d)
    return apply


CORRUPTIONS = {
    "empty": (lambda t: "", "<file>", "empty file"),
    "whitespace": (lambda t: "  \n", "<file>", "empty file"),
    "truncated": (lambda t: t[: len(t) // 2], "<json>", "not valid JSON"),
    "not-an-object": (lambda t: "[1, 2]", "<json>", "expected a JSON object, got a list"),
    "wrong-type": (_edit(lambda d: d.update(steps="3")), "steps", "expected an integer, got '3'"),
    "bool-for-int": (_edit(lambda d: d["buckets"][0].update(replays=True)), "buckets[0].replays", "expected an integer, got True"),
    "missing-field": (_edit(lambda d: d.pop("spec_hash")), "spec_hash", "missing"),
    "missing-bucket-field": (_edit(lambda d: d["buckets"][0].pop("pool_bytes")), "buckets[0].pool_bytes", "missing"),
    "extra-field": (_edit(lambda d: d.update(colour="red")), "colour", "unknown field"),
    "newer-format": (_edit(lambda d: d.update(format_version=7)), "format_version",
                     "written by a newer graphcap (format 7 > 1); upgrade graphcap"),
    "bad-status": (_edit(lambda d: d["buckets"][0].update(status="exploded")), "buckets[0].status",
                   "unknown value 'exploded'; expected 'captured', 'failed' or 'pending'"),
    "bad-backend": (_edit(lambda d: d.update(backend="magic")), "backend", "unknown value 'magic'; expected 'reduce-overhead'"),
    "bad-timestamp": (_edit(lambda d: d.update(updated="yesterday")), "updated", "not an ISO-8601 timestamp"),
    "negative": (_edit(lambda d: d["buckets"][0].update(fallbacks=-1)), "buckets[0].fallbacks", "must be >= 0, got -1"),
    "duplicate-bucket": (_edit(lambda d: d["buckets"].append(dict(d["buckets"][0]))), "buckets[1].batch_size",
                         "duplicate bucket"),
}


def write_corrupt(tmp_path: Path, case: str) -> Path:
    m = random_manifest(random.Random(case), backend="cudagraph")
    m.buckets = m.buckets[:1]
    path = write_manifest(m, tmp_path / f"{case}-cudagraph.json")  # a manifest's name: listed in directory mode
    path.write_text(CORRUPTIONS[case][0](path.read_text()))
    return path


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_manifest_is_named_error(tmp_path, case):
    path = write_corrupt(tmp_path, case)
    _, field, reason = CORRUPTIONS[case]
    with pytest.raises(ManifestError) as err:
        read_manifest(path)
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith(f"{path}: {field}: "), str(err.value)
    assert reason in str(err.value)


def test_missing_file_is_named_error(tmp_path):
    with pytest.raises(ManifestError, match=rf"^{tmp_path / 'nope.json'}: <file>: cannot read: No such file"):
        read_manifest(tmp_path / "nope.json")


def test_newer_format_wins_over_shape_errors(tmp_path):
    """A newer graphcap may have changed every field: say "upgrade", not "missing field"."""
    p = tmp_path / "new.json"
    p.write_text(json.dumps({"format_version": 2, "something": "else"}))
    with pytest.raises(ManifestError, match=r"format 2 > 1\); upgrade graphcap"):
        read_manifest(p)


@pytest.mark.subprocess
def test_manifest_module_does_not_import_torch():
    code = "import sys, graphcap.manifest, graphcap.cli; assert 'torch' not in sys.modules, 'torch imported'"
    # from the repo (python -c puts the working directory first), the environment as it is - as test_cli's own check
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_dynamic_batch_field_is_optional_in_older_files_and_strict_when_present():
    """`dynamic_batch` came after format 1's first files: a file without it reads as False (not "missing"); a
    present one must be a JSON boolean."""
    from graphcap.manifest import ManifestError, parse_manifest

    d = random_manifest(random.Random(5)).to_dict()
    d["dynamic_batch"] = True
    assert parse_manifest(dict(d)).dynamic_batch is True
    del d["dynamic_batch"]
    assert parse_manifest(dict(d)).dynamic_batch is False
    with pytest.raises(ManifestError, match="dynamic_batch"):
        parse_manifest({**d, "dynamic_batch": "yes"})
    d.pop("window")
    with pytest.raises(ManifestError, match="window: missing"):  # other fields are still required
        parse_manifest(d)


# ---------------------------------------------------------------------------------------------------------------
# The ranks of a parallel server: one file per process, the ranks in the file and its name


def _ranks(tp_rank: int, tp_size: int, dp_rank: int | None = None, dp_size: int = 1) -> dict:
    return dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, dp_rank=dp_rank, dp_size=dp_size)


@settings(max_examples=examples(50), deadline=None)
@given(dp=st.integers(1, 3), pp=st.integers(1, 2), tp=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_every_rank_of_a_world_has_a_file_of_its_own(tmp_path_factory, dp, pp, tp, seed):
    """Every process of a dp x pp x tp world writes its own file - the names differ, each lists as a manifest, and each
    file holds its process's ranks as written - and a world of one process keeps the plain name."""
    d = tmp_path_factory.mktemp("ranks")
    base = random_manifest(random.Random(seed), backend="cudagraph")
    written = {}
    for r_dp in range(dp):
        for r_pp in range(pp):
            for r_tp in range(tp):
                ranks = dict(tp_rank=r_tp, tp_size=tp, pp_rank=r_pp, pp_size=pp, dp_rank=r_dp if dp > 1 else None,
                             dp_size=dp)
                m = random_manifest(random.Random(seed), backend="cudagraph")
                m.parallel = Parallel(**ranks)
                path = write_manifest(m, manifest_path(d, m.spec_name, m.spec_hash, m.backend, m.parallel))
                written[path.name] = ranks
    assert len(written) == dp * pp * tp
    assert sorted(p.name for p in list_manifests(d)) == sorted(written)
    stem = f"{base.spec_name}-{base.spec_hash}-cudagraph"
    for name, ranks in written.items():
        data = json.loads((d / name).read_text())
        assert data["parallel"] == ranks
        suffix = "".join(f"-{dim}{ranks[f'{dim}_rank']}" for dim in ("dp", "pp", "tp") if ranks[f"{dim}_size"] > 1)
        assert name == f"{stem}{suffix}.json"
        assert read_manifest(d / name).parallel == Parallel(**ranks)


def test_a_single_process_keeps_the_plain_name_and_old_files_still_read(tmp_path):
    m = random_manifest(random.Random(7), backend="eager")
    one = Parallel(**_ranks(0, 1))
    assert manifest_path(tmp_path, "tiny", "ab12", "eager", one) == tmp_path / "tiny-ab12-eager.json"
    assert manifest_path(tmp_path, "tiny", "ab12", "eager", None) == tmp_path / "tiny-ab12-eager.json"
    # a replica sglang does not number cannot be told apart by name: it keeps the name of its TP rank alone
    assert manifest_path(tmp_path, "t", "h", "eager", Parallel(**_ranks(1, 2, None, 2))).name == "t-h-eager-tp1.json"
    old = m.to_dict()
    del old["parallel"]  # written before the field existed
    (tmp_path / "old-eager.json").write_text(json.dumps(old))
    assert read_manifest(tmp_path / "old-eager.json").parallel is None
    for path in sorted((Path(__file__).parent / "data" / "h200-manifests").glob("*.json")):
        assert "parallel" not in json.loads(path.read_text()) and read_manifest(path).parallel is None


def test_manifest_names_with_ranks_are_listed_and_others_are_not(tmp_path):
    names = ("a-h-eager-tp1.json", "a-h-cudagraph-dp1-tp0.json", "a-h-inductor-cudagraph-pp1-tp3.json",
             "a-h-eager-tp.json", "a-h-eager-tp1-dp0.json", "a-h-tp1.json", "results-tp1.json")
    for name in names:
        (tmp_path / name).write_text("{}")
    assert [p.name for p in list_manifests(tmp_path)] == sorted(names[:3])


@pytest.mark.parametrize("edit, field, reason", [
    (dict(tp_rank=2, tp_size=2), "parallel", "tp_rank 2 is not below tp_size 2"),
    (dict(dp_rank=3, dp_size=2), "parallel", "dp_rank 3 is not below dp_size 2"),
    (dict(tp_size=0), "parallel.tp_size", "must be >= 1"),
    (dict(tp_rank=-1), "parallel.tp_rank", "must be >= 0"),
    (dict(tp_rank="1"), "parallel.tp_rank", "expected an integer"),
    (dict(rank=1), "parallel.rank", "unknown field"),
])
def test_bad_ranks_are_named_errors(tmp_path, edit, field, reason):
    d = random_manifest(random.Random(8)).to_dict() | {"parallel": _ranks(1, 2) | edit}
    path = tmp_path / "x-eager-tp1.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ManifestError) as err:
        read_manifest(path)
    assert str(err.value).startswith(f"{path}: {field}: ") and reason in str(err.value), str(err.value)
