"""`graphcap inspect` over the manifests of a parallel server's ranks: agreeing, disagreeing, a rank missing, a rank's
file corrupt, replicas, and old files without ranks. The files are written here as plain JSON under the names the
plugin gives them, and every expectation is read from that JSON, not from graphcap's own helpers."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from graphcap.cli import main
from test_cli import one_line_error
from test_manifest import random_manifest

DOCS = Path(__file__).resolve().parents[1] / "docs"
STEM = "sglang-x-w8-s3-cudagraph"
REASON = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")


def ranks(tp_rank: int, tp_size: int, dp_rank: int | None = None, dp_size: int = 1) -> dict:
    return dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, dp_rank=dp_rank, dp_size=dp_size)


def write_rank(directory: Path, parallel: dict | None, statuses: dict[int, str], name: str | None = None,
               spec: tuple[str, str] = ("sglang-x", "w8-s3"), seed: int = 0) -> Path:
    """A rank's manifest as the plugin writes it: random counters, the given bucket statuses and ranks, under the
    plugin's name for that rank (`{stem}-dp1-tp0.json`, the rank of each dimension wider than one)."""
    data = random_manifest(random.Random(seed), backend="cudagraph").to_dict()
    data["spec_name"], data["spec_hash"] = spec
    data["buckets"] = [dict(batch_size=b, status=s, reason=REASON if s == "failed" else None, capture_s=0.25 * b,
                            pool_bytes=b * 2**20, replays=3 * b, fallbacks=0, padded_rows=b)
                       for b, s in statuses.items()]
    data["parallel"] = parallel
    if name is None:
        suffix = "".join(f"-{d}{parallel[f'{d}_rank']}" for d in ("dp", "pp", "tp") if parallel[f"{d}_size"] > 1)
        name = f"{spec[0]}-{spec[1]}-cudagraph{suffix}.json"
    path = directory / name
    path.write_text(json.dumps(data, indent=2))
    return path


def status_table(out: str, labels: list[str]) -> dict[int, list[str]]:
    """The bucket-by-rank table `inspect` prints for a server: {bucket: [status on each rank]}."""
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.split() == ["bucket", *labels]))
    rows = {}
    for line in lines[start + 2:]:  # past the header and its rule
        if not line.strip():
            break
        size, *cells = line.split()
        rows[int(size)] = cells
    return rows


def expected_table(*files: Path) -> dict[int, list[str]]:
    data = [json.loads(f.read_text()) for f in files]
    sizes = sorted({b["batch_size"] for d in data for b in d["buckets"]})
    return {s: [next((b["status"] for b in d["buckets"] if b["batch_size"] == s), "-") for d in data] for s in sizes}


def inspect(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_agreeing_ranks(tmp_path, capsys):
    statuses = {1: "captured", 2: "captured", 4: "failed"}
    files = [write_rank(tmp_path, ranks(r, 2), statuses, seed=r) for r in (0, 1)]
    code, out, err = inspect(capsys, str(tmp_path))
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == ("sglang-x (spec w8-s3), backend cudagraph: tensor parallel 2, manifests of 2 of 2 "
                                   "ranks")
    assert status_table(out, ["tp0", "tp1"]) == expected_table(*files)
    assert "ranks agree: every rank has buckets 1, 2, 4, each with the same status" in out
    assert "disagree" not in out
    for r, f in enumerate(files):  # then each rank's own manifest, its counters as written
        assert f"sglang-x (spec w8-s3), backend cudagraph, rank tp{r}\n  file:     {f}\n" in out
    assert out.count(f"failed bucket 4: {REASON}") == 2


def test_disagreeing_ranks_say_so_bucket_by_bucket(tmp_path, capsys):
    files = [write_rank(tmp_path, ranks(0, 2), {1: "captured", 2: "captured", 4: "captured"}),
             write_rank(tmp_path, ranks(1, 2), {1: "captured", 2: "failed", 8: "pending"})]
    code, out, err = inspect(capsys, str(tmp_path))
    assert (code, err) == (0, "")  # the files read: a disagreement is shown, not an error
    assert status_table(out, ["tp0", "tp1"]) == expected_table(*files)
    said = out.split("ranks disagree:\n")[1].split("\n\n")[0].splitlines()
    assert said == ["  bucket 2: captured on tp0; failed on tp1", "  bucket 4: captured on tp0; absent on tp1",
                    "  bucket 8: absent on tp0; pending on tp1"]
    assert "ranks agree" not in out


@pytest.mark.parametrize("tp_size", [2, 4])
def test_a_rank_missing_from_the_world(tmp_path, capsys, tp_size):
    write_rank(tmp_path, ranks(0, tp_size), {1: "captured", 2: "captured"})
    code, out, err = inspect(capsys, str(tmp_path))
    assert (code, err) == (0, "")
    assert out.splitlines()[0].endswith(f"tensor parallel {tp_size}, manifests of 1 of {tp_size} ranks")
    said = out.split("ranks disagree:\n")[1].split("\n\n")[0].splitlines()
    assert said == [f"  tp{r}: no manifest ({tmp_path / f'{STEM}-tp{r}.json'} does not exist)"
                    for r in range(1, tp_size)]


def test_one_file_given_names_the_ranks_beside_it(tmp_path, capsys):
    tp0 = write_rank(tmp_path, ranks(0, 2), {1: "captured"})
    write_rank(tmp_path, ranks(1, 2), {1: "captured"})
    code, out, _ = inspect(capsys, str(tp0))
    assert code == 0 and "  tp1: no manifest (not read: inspect the directory to compare it)" in out


def test_a_corrupt_rank_file_is_one_error_line_naming_it(tmp_path, capsys):
    tp0 = write_rank(tmp_path, ranks(0, 2), {1: "captured", 2: "captured"})
    tp1 = write_rank(tmp_path, ranks(1, 2), {1: "captured", 2: "failed"})
    tp1.write_text(tp1.read_text()[:200])  # cut mid-write by hand: graphcap's own writes are atomic
    assert main(["inspect", str(tmp_path)]) == 2
    out = one_line_error(capsys, str(tp1), "not valid JSON")
    assert status_table(out, ["tp0"]) == expected_table(tp0)
    assert "  tp1: no manifest (unreadable, see the error below)" in out
    assert main(["inspect", "--json", str(tmp_path)]) == 2
    out = one_line_error(capsys, str(tp1))
    assert [d["parallel"] for d in json.loads(out)] == [json.loads(tp0.read_text())["parallel"]]


def test_replicas_and_tp_ranks_together(tmp_path, capsys):
    statuses = {1: "captured", 2: "captured"}
    files = {(d, t): write_rank(tmp_path, ranks(t, 2, d, 2), statuses) for d in (0, 1) for t in (0, 1)}
    files.pop((1, 0)).unlink()
    code, out, err = inspect(capsys, str(tmp_path))
    assert (code, err) == (0, "")
    assert out.splitlines()[0].endswith("data parallel 2, tensor parallel 2, manifests of 3 of 4 ranks")
    labels = ["dp0-tp0", "dp0-tp1", "dp1-tp1"]
    assert status_table(out, labels) == expected_table(*files.values())
    said = out.split("ranks disagree:\n")[1].split("\n\n")[0].splitlines()
    assert said == [f"  dp1-tp0: no manifest ({tmp_path / f'{STEM}-dp1-tp0.json'} does not exist)"]


def test_servers_of_other_worlds_and_specs_are_shown_apart(tmp_path, capsys):
    """A single-GPU run and a TP 2 run of the same spec, a stale file of an older TP 4 run, another spec's TP 2 run:
    four servers, each with its own ranks."""
    single = write_rank(tmp_path, ranks(0, 1), {1: "captured"})
    pair = [write_rank(tmp_path, ranks(r, 2), {1: "captured"}) for r in (0, 1)]
    stale = write_rank(tmp_path, ranks(3, 4), {1: "captured"}, name=f"{STEM}-tp3-old-cudagraph.json")
    other = [write_rank(tmp_path, ranks(r, 2), {1: "captured"}, spec=("sglang-y", "w8-s3")) for r in (0, 1)]
    code, out, err = inspect(capsys, str(tmp_path))
    assert (code, err) == (0, "")
    heads = [line for line in out.splitlines() if line.startswith("sglang-") and "(spec" in line]
    assert heads == [  # in the order of the files' names, each server where its first file comes
        "sglang-x (spec w8-s3), backend cudagraph: tensor parallel 2, manifests of 2 of 2 ranks",
        "sglang-x (spec w8-s3), backend cudagraph, rank tp0", "sglang-x (spec w8-s3), backend cudagraph, rank tp1",
        "sglang-x (spec w8-s3), backend cudagraph: tensor parallel 4, manifests of 1 of 4 ranks",
        "sglang-x (spec w8-s3), backend cudagraph, rank tp3",
        "sglang-x (spec w8-s3), backend cudagraph",  # the single process: shown as before, no rank
        "sglang-y (spec w8-s3), backend cudagraph: tensor parallel 2, manifests of 2 of 2 ranks",
        "sglang-y (spec w8-s3), backend cudagraph, rank tp0", "sglang-y (spec w8-s3), backend cudagraph, rank tp1"]
    assert out.count("ranks agree") == 2 and all(str(f) in out for f in [single, *pair, stale, *other])
    said = out.split("ranks disagree:\n")[1].split("\n\n")[0].splitlines()  # the TP 4 run's
    assert said == [f"  tp{r}: no manifest ({STEM}-tp{r}.json is another run's: tensor parallel 2)" for r in (0, 1)] \
        + [f"  tp2: no manifest ({tmp_path / f'{STEM}-tp2.json'} does not exist)"]


def test_old_files_without_ranks_print_as_before(tmp_path, capsys):
    """A file written before `parallel` existed, and one a single process writes now, print the same as one file
    always has: no rank, no grouping, nothing about ranks."""
    (tmp_path / "new").mkdir()
    new = write_rank(tmp_path / "new", ranks(0, 1), {1: "captured", 2: "failed"})
    data = json.loads(new.read_text())
    del data["parallel"]
    (tmp_path / "old").mkdir()
    old = tmp_path / "old" / new.name
    old.write_text(json.dumps(data))
    outs = []
    for path in (new, old):
        code, out, err = inspect(capsys, str(path))
        assert (code, err) == (0, "")
        outs.append(out.replace(str(path), "FILE"))
    assert outs[0] == outs[1]
    assert outs[0].splitlines()[:2] == ["sglang-x (spec w8-s3), backend cudagraph", "  file:     FILE"]
    assert "rank" not in outs[0]
    code, out, _ = inspect(capsys, "--json", str(old))
    assert code == 0 and json.loads(out)[0]["parallel"] is None


def test_json_lists_every_rank_as_written(tmp_path, capsys):
    files = [write_rank(tmp_path, ranks(r, 2), {1: "captured", 2: "captured"}, seed=r) for r in (0, 1)]
    code, out, _ = inspect(capsys, "--json", str(tmp_path))
    assert code == 0
    listed = json.loads(out)
    for d in listed:
        for b in d["buckets"]:
            b.pop("padding_waste")
    assert listed == [json.loads(f.read_text()) for f in files]


def test_the_docs_example_is_what_inspect_prints(tmp_path, capsys):
    block = re.findall(r"```\n(.*?)```", (DOCS / "inspect.md").read_text(), flags=re.S)
    block = next(b for b in block if b.startswith("$ graphcap inspect /tmp/gctp"))
    command, *expected = block.rstrip("\n").split("\n")
    d = tmp_path / "gctp"
    d.mkdir()
    statuses = {1: "captured", 2: "captured", 4: "captured", 8: "captured"}
    for r in (0, 1):
        write_rank(d, ranks(r, 2), statuses | ({8: "failed"} if r else {}), spec=("sglang-assistant", "w1024-s3"))
    assert main(command[2:].replace("/tmp/gctp", str(d)).split()[1:]) == 0
    printed = TIMESTAMP.sub("T", capsys.readouterr().out.replace(str(d), "/tmp/gctp"))
    assert printed.split("\n")[:len(expected)] == expected
