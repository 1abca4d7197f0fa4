"""`graphcap` CLI: inspect (files, directories, default dir, --json), specs, bench forwarding, one-line errors."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from graphcap.cli import layer_pattern, main
from graphcap.manifest import manifest_path, write_manifest
from test_manifest import CORRUPTIONS, random_manifest, write_corrupt

REPO = Path(__file__).resolve().parents[1]
H200_MANIFESTS = Path(__file__).resolve().parent / "data" / "h200-manifests"


def write_two(directory: Path):
    ms = [random_manifest(random.Random(10), "tiny", "cudagraph"),
          random_manifest(random.Random(11), "gemma4-31b-assistant", "reduce-overhead")]
    ms[0].buckets[0].status, ms[0].buckets[0].reason = "failed", "cudagraph_skips: mutated input x"
    for m in ms:
        write_manifest(m, manifest_path(directory, m.spec_name, m.spec_hash, m.backend))
    return ms


def test_inspect_directory_lists_both(tmp_path, capsys):
    ms = write_two(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for m in ms:
        assert f"{m.spec_name} (spec {m.spec_hash}), backend {m.backend}" in out
        assert f"oversize fallbacks: {m.oversize_fallbacks}" in out
    assert "failed bucket" in out and "cudagraph_skips: mutated input x" in out
    for col in ("bucket", "status", "capture s", "pool MiB", "replays", "fallbacks", "padding waste (%)"):
        assert col in out


def test_inspect_table_values(tmp_path, capsys):
    m = random_manifest(random.Random(5), backend="eager")
    b = m.buckets[0]
    b.batch_size, b.status, b.replays, b.padded_rows, b.pool_bytes, b.fallbacks = 8, "captured", 10, 20, 3 * 2**20, 7
    path = write_manifest(m, tmp_path / "m.json")
    assert main(["inspect", str(path)]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["8", "captured"])
    assert row == ["8", "captured", f"{b.capture_s:.2f}", "3.0", "10", "7", "25.0"]


def test_inspect_json_equals_written_data(tmp_path, capsys):
    write_two(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    files = sorted(tmp_path.glob("*.json"))
    assert len(data) == 2
    for d, f in zip(data, files):
        written = json.loads(f.read_text())
        for b in d["buckets"]:
            waste = b.pop("padding_waste")
            assert waste == (b["padded_rows"] / (b["replays"] * b["batch_size"]) if b["replays"] else 0.0)
        assert d == written


def test_inspect_honours_env_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAPHCAP_MANIFEST_DIR", str(tmp_path / "d"))
    assert main(["inspect"]) == 0
    assert capsys.readouterr().out.strip() == f"no manifests in {tmp_path / 'd'}"  # missing default dir: not an error
    ms = write_two(tmp_path / "d")
    assert main(["inspect", "--json"]) == 0
    assert sorted(d["spec_name"] for d in json.loads(capsys.readouterr().out)) == sorted(m.spec_name for m in ms)


@pytest.mark.parametrize("others", [(), ("bench.json", "capture_cost.json", "tiny.json", "notes.txt")])
def test_inspect_explicit_dir_without_manifests_exits_2_naming_it(tmp_path, capsys, others):
    """A directory the user names that holds no manifest (empty, or only other files, JSON ones too) is a mistake,
    as a missing file is: one line naming it, exit 2, with --json too. The default directory is not (below)."""
    for name in others:
        (tmp_path / name).write_text(json.dumps({"rows": [random.random()]}))
    for argv in (["inspect", str(tmp_path)], ["inspect", "--json", str(tmp_path)]):
        assert main(argv) == 2
        assert one_line_error(capsys, f"{tmp_path}: holds no capture manifests") == ""


def test_inspect_path_the_system_refuses_is_one_line(tmp_path, capsys):
    name = str(tmp_path / ("x" * 300))  # longer than a file name may be
    assert main(["inspect", name]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "File name too long" in err


def one_line_error(capsys, *fragments: str) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphcap: error: "), err
    for f in fragments:
        assert f in lines[0]
    return out


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_inspect_corrupt_exits_2_with_one_line(tmp_path, capsys, case):
    path = write_corrupt(tmp_path, case)
    assert main(["inspect", str(path)]) == 2
    assert one_line_error(capsys, str(path), CORRUPTIONS[case][2]) == ""
    assert main(["inspect", str(path), "--json"]) == 2
    assert one_line_error(capsys, str(path)) == ""


def test_inspect_missing_explicit_path_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.json")]) == 2
    one_line_error(capsys, "nope.json", "no such file")


def test_inspect_directory_with_one_bad_file_shows_the_rest(tmp_path, capsys):
    ms = write_two(tmp_path)
    bad = write_corrupt(tmp_path, "truncated")
    assert main(["inspect", str(tmp_path)]) == 2
    out = one_line_error(capsys, str(bad), "not valid JSON")
    assert all(m.spec_hash in out for m in ms)


@pytest.mark.parametrize("argv, fragment", [
    ([], "missing command"),
    (["frobnicate"], "invalid choice"),
    (["inspect", "--bogus"], "unrecognized arguments: --bogus"),
    (["inspect", "a", "b"], "unrecognized arguments: b"),
    (["specs", "/no/such/spec.toml"], "/no/such/spec.toml: <file>: cannot read"),
])
def test_bad_usage_exits_2_with_one_line(capsys, argv, fragment):
    assert main(argv) == 2
    one_line_error(capsys, fragment)


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    assert main(["inspect", "--help"]) == 0


def test_specs_lists_builtins(capsys):
    assert main(["specs"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "gemma4-31b-assistant" in out and "3S+F" in out and "1,2,4,8,16,32,64" in out
    for col in ("name", "model", "draft", "W", "page", "layers", "steps", "buckets", "hash"):
        assert col in out.splitlines()[0].split()


def test_specs_bad_spec_file(tmp_path, capsys):
    p = tmp_path / "bad.toml"
    p.write_text((REPO / "graphcap/capture_specs/tiny.toml").read_text().replace("steps = 3", "steps = 0"))
    assert main(["specs", str(p)]) == 2
    one_line_error(capsys, f"{p}: capture.steps: must be >= 1")


def test_layer_pattern():
    assert layer_pattern(("sliding", "sliding", "sliding", "full")) == "3S+F"
    assert layer_pattern(("full", "sliding", "full", "full")) == "F+S+2F"


def test_bench_is_a_command_of_the_one_parser(capsys):
    """`graphcap bench`'s options live in the `graphcap` parser: --help lists them, a bad spec is one line."""
    assert main(["bench", "--help"]) == 0
    assert "--graphcap-backend" in capsys.readouterr().out
    assert main(["bench", "--spec", "no-such-spec"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphcap: error:") and len(err.strip().splitlines()) == 1


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphcap.cli", *argv], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.subprocess
def test_subprocess_exit_codes(tmp_path):
    bad = write_corrupt(tmp_path, "bad-status")
    r = _run("inspect", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [f"graphcap: error: {bad}: buckets[0].status: unknown value 'exploded'; "
                                     "expected 'captured', 'failed' or 'pending'"]
    good = tmp_path / "good"
    write_two(good)
    r = _run("inspect", "--json", env={"GRAPHCAP_MANIFEST_DIR": str(good)})
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 2


@pytest.mark.subprocess
def test_inspect_and_specs_do_not_import_torch(tmp_path):
    write_two(tmp_path)
    code = ("import sys; from graphcap.cli import main; "
            f"assert main(['inspect', {str(tmp_path)!r}]) == 0 and main(['specs']) == 0; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr


def test_inspect_reads_the_manifests_of_the_h200_run(capsys):
    """Manifests written by real GPU captures on the H200 (tests/data/h200-manifests) read back and list their
    buckets."""
    assert main(["inspect", str(H200_MANIFESTS)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "gemma4-31b-assistant" in out and "cudagraph" in out
    path = H200_MANIFESTS / "gemma4-31b-assistant-e9b1a9dc5c052cb3-reduce-overhead.json"
    assert main(["inspect", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["batch_size"] for b in data[0]["buckets"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(b["status"] == "captured" and b["replays"] > 0 for b in data[0]["buckets"])


def test_inspect_reads_the_inductor_cudagraph_manifest_of_the_h200_run(capsys):
    """A capture-cost run's manifest (backend inductor-cudagraph, all seven buckets) reads back."""
    path = H200_MANIFESTS / "gemma4-31b-assistant-71beb232c64e347c-inductor-cudagraph.json"
    assert main(["inspect", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)[0]
    assert data["backend"] == "inductor-cudagraph" and data["device"] == "NVIDIA H200"
    assert [b["batch_size"] for b in data["buckets"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(b["status"] == "captured" and b["pool_bytes"] > 0 for b in data["buckets"])
    assert sum(b["replays"] for b in data["buckets"]) > 0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU defaults and refusals")
@pytest.mark.parametrize("args, fragment", [
    (["--modes", "graphcap,graphcap"], "names a mode twice"),
    (["--graphcap-backend", "cudagraph"], "records CUDA graphs and this machine has no CUDA"),
])
def test_bench_refuses_bad_options_in_one_line_before_running(capsys, args, fragment):
    assert main(["bench", *args]) == 2
    one_line_error(capsys, fragment)


def test_bench_refuses_an_unwritable_out_before_running(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    # options that resolve on a CPU and on a GPU alike (the GPU's default iterations outgrow the tiny spec's context)
    assert main(["bench", "--spec", "tiny", "--iters", "2", "--warmup", "1", "--context", "8",
                 "--out", str(blocker / "sub")]) == 2
    one_line_error(capsys, "--out", "sub")
