"""The docs say what the code does: docs/usage.md's example runs, docs/inspect.md's example prints what `graphcap
inspect` prints, the links of the docs this checks resolve, and docs/results/ holds one current record per file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from graphcap.cli import main
from graphcap.manifest import Manifest, manifest_path, write_manifest
from graphcap.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# The docs whose links are checked: the README and the docs that link into results/ (the others are edited elsewhere).
LINKED = [REPO / "README.md", DOCS / "results.md", DOCS / "usage.md", DOCS / "inspect.md"]
DOCS_LIMIT_BYTES = 300 * 1024  # what a reader downloads with the docs; history lives in git
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_usage_example_runs():
    blocks = code_blocks((DOCS / "usage.md").read_text(), "python")
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/usage.md", "exec"), {})


def anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    heads = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]


@pytest.mark.parametrize("md", LINKED, ids=lambda p: p.name)
def test_links_resolve(md):
    for target in links(md):
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        assert dest.exists(), f"{md.name}: link to {target}: no such file"
        if anchor:
            assert dest.suffix == ".md", f"{md.name}: link to {target}: an anchor into a non-markdown file"
            assert anchor in anchors(dest), f"{md.name}: link to {target}: no heading with that anchor in {path}"


def test_results_records_are_current():
    """Each record parses, says what it measured and on what, and is one record per question (no key named after a
    commit: a rerun replaces the record, git keeps the old one); results.md links every record."""
    results_md = (DOCS / "results.md").read_text()
    records = sorted((DOCS / "results").glob("*.json"))
    assert records
    for f in records:
        d = json.loads(f.read_text())
        assert isinstance(d.get("what"), str) and d["what"], f"{f.name}: no 'what'"
        text = json.dumps(d)
        assert ("H200" in text or "H100" in text) and "torch" in text, f"{f.name}: no GPU or versions recorded"
        assert not [k for k in d if COMMIT.search(k)], f"{f.name}: keys named after commits"
        assert f"results/{f.name}" in results_md, f"docs/results.md does not link {f.name}"


def test_docs_stay_small():
    size = sum(p.stat().st_size for p in DOCS.rglob("*") if p.is_file())
    assert size <= DOCS_LIMIT_BYTES, f"docs/ holds {size} bytes, over {DOCS_LIMIT_BYTES}"


# docs/inspect.md's example: the manifest it describes, built by the real writer, then each command of its block.
INSPECT_BUCKETS = {  # batch: (capture s, pool MiB, replays, fallbacks, padded rows)
    1: (0.41, 2, 1200, 0, 0), 2: (0.38, 2, 800, 0, 310), 4: (0.39, 4, 950, 0, 1018), 8: (0.12, 0, 0, 37, 0)}
INSPECT_ENV = dict(device="cpu", driver=None, torch_version="2.13.0+cpu", triton_version="3.9.0",
                   graphcap_version="0.1.0")
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")


def inspect_example(tmp: Path) -> dict[str, Path]:
    m = Manifest.for_spec(load_spec("tiny"), "cudagraph", env=INSPECT_ENV)
    for b in m.buckets:
        b.capture_s, mib, b.replays, b.fallbacks, b.padded_rows = INSPECT_BUCKETS[b.batch_size]
        b.pool_bytes, b.status = mib * 2**20, "captured"
    m.bucket(8).status, m.bucket(8).reason = "failed", "CUDA error: out of memory during capture"
    m.oversize_fallbacks, m.notes = 4, ["example written for docs/inspect.md"]
    good = write_manifest(m, manifest_path(tmp / "gcdoc", m.spec_name, m.spec_hash, m.backend))
    (tmp / "gcbad").mkdir()
    bad = json.loads(good.read_text())
    bad["buckets"][3]["status"] = "exploded"
    (tmp / "gcbad" / "tiny.json").write_text(json.dumps(bad))
    new = json.loads(good.read_text()) | {"format_version": 7}
    (tmp / "gcbad" / "new.json").write_text(json.dumps(new))
    return {"/tmp/gcdoc": tmp / "gcdoc", "/tmp/gcbad": tmp / "gcbad", "/tmp/nowhere": tmp / "nowhere"}


def real_path(doc_path: str, paths: dict[str, Path]) -> str:
    for doc, real in paths.items():
        if doc_path == doc or doc_path.startswith(doc + "/"):
            return str(real) + doc_path[len(doc):]
    return doc_path


def test_inspect_example_prints_what_the_doc_shows(tmp_path, capsys, monkeypatch):
    block = code_blocks((DOCS / "inspect.md").read_text())[-1]
    paths = inspect_example(tmp_path)
    spec_source = str(load_spec("tiny").source)
    runs = re.split(r"^\$ ", block, flags=re.M)[1:]
    assert len(runs) == 4, "the example's four commands"
    for run in runs:
        command, *expected = run.rstrip("\n").split("\n")
        shell = command.split("  #")[0].split(";")
        words = shell[0].split()
        monkeypatch.delenv("GRAPHCAP_MANIFEST_DIR", raising=False)
        if "=" in words[0]:
            name, _, value = words.pop(0).partition("=")
            monkeypatch.setenv(name, real_path(value, paths))
        assert words[0] == "graphcap", command
        code = main([real_path(w, paths) for w in words[1:]])
        out = capsys.readouterr()
        printed = out.out + out.err + (f"exit {code}\n" if len(shell) > 1 else "")
        for doc, real in paths.items():
            printed = printed.replace(str(real), doc)
        printed = printed.replace(spec_source, "/work/main/graphcap/capture_specs/tiny.toml")
        printed = TIMESTAMP.sub("YYYY-MM-DDThh:mm:ss+00:00", printed)
        assert printed.rstrip("\n").split("\n") == expected, f"docs/inspect.md: {command}"
