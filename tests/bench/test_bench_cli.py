"""`graphcap bench` as a new user meets it: each refusal is one line naming the option, what was wrong and, where a
value would do, that value; --help lists the modes a user picks and states each default once, as the run resolves
it; the table says what its columns mean and, on a CPU, what its ratios are not."""
from __future__ import annotations

import argparse
import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch

from graphcap.bench import options
from graphcap.bench.report import CPU_SCOPE, CPU_TABLE_NOTE, footnotes, format_table
from graphcap.bench.rows import BenchResult, BenchRow
from graphcap.cli import build_parser, main

SPEC_DIR = Path(__file__).resolve().parents[2] / "graphcap" / "capture_specs"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA refuses")


def _config(*argv: str, cuda: bool = False) -> options.BenchConfig:
    return options.config_from_args(build_parser().parse_args(["bench", *argv]), cuda)


def _one_line(capsys, *fragments: str) -> str:
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("graphcap: error: ") and "Traceback" not in err, err
    assert all(f in lines[0] for f in fragments), (fragments, lines[0])
    return lines[0]


@cpu_only
@pytest.mark.parametrize("modes, why", [
    ("sglang", ["sglang: sglang's Triton kernels need CUDA"]),
    ("graph-rebuild", ["graph-rebuild: CUDA graphs need CUDA"]),
    ("sglang,graph-rebuild", ["sglang: sglang's Triton kernels need CUDA", "graph-rebuild: CUDA graphs need CUDA"]),
])
def test_modes_none_of_which_runs_here_are_refused_before_anything_runs(capsys, modes, why):
    assert main(["bench", "--modes", modes]) == 2
    line = _one_line(capsys, f"--modes {modes}: none of them runs on this machine", *why)
    runs_here = line.rsplit("these do: ", 1)[1].split(", ")
    assert set(runs_here) == {"eager-rebuild", "compile", "compile-nosync", "compile-plain", "compile-tuned",
                              "graphcap"}


def test_a_run_whose_every_mode_fails_to_build_is_one_line_not_a_traceback(capsys, monkeypatch):
    """The options refuse modes the machine lacks; a mode can still fail to build (with CUDA, sglang's fused ops
    missing): with none left the run stops on one line naming what was skipped, never a division by zero."""
    from graphcap.bench import runner

    def build_modes(cfg, model, state, steps, notes):
        notes.append("graphcap skipped: fused op set unavailable")
        return []

    monkeypatch.setattr(runner, "build_modes", build_modes)
    assert main(["bench", "--spec", "tiny", "--modes", "graphcap", "--iters", "1", "--warmup", "0", "--context",
                 "8", "--batch", "1"]) == 2
    err = capsys.readouterr().err
    # beside the progress bar's own lines (cleared on a terminal)
    assert [x for x in err.splitlines() if x.strip() and not x.startswith("graphcap bench: ")] == [
        "graphcap: error: --modes graphcap: every mode was skipped (graphcap skipped: fused op set unavailable)"]
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, fragments", [
    (["--batch", "4,,8"], ["argument --batch: an empty item in '4,,8'"]),
    (["--batch", ",4"], ["argument --batch: an empty item"]),
    (["--batch", "4,8,4"], ["argument --batch: 4 given twice in '4,8,4'"]),
    (["--context", "8,-3"], ["argument --context: expected positive integers"]),
    (["--steps", "2,1,2"], ["argument --steps: 2 given twice"]),
    (["--modes", "graphcap,,eager-rebuild"], ["--modes: an empty item in 'graphcap,,eager-rebuild'"]),
    (["--iters", "0"], ["--iters must be >= 1, got 0"]),
    (["--repeats", "-2"], ["--repeats must be >= 1, got -2"]),
    (["--warmup", "-1"], ["--warmup must be >= 0, got -1"]),
])
def test_bad_values_are_one_line_naming_the_option(capsys, argv, fragments):
    assert main(["bench", "--spec", "tiny", "--iters", "2", "--warmup", "1", *argv]) == 2
    _one_line(capsys, *fragments)


def test_an_unknown_spec_lists_the_built_in_ones(capsys):
    builtin = sorted(p.stem for p in SPEC_DIR.glob("*.toml"))
    assert len(builtin) >= 2
    assert main(["bench", "--spec", "nosuchspec"]) == 2
    _one_line(capsys, "--spec: nosuchspec:", "No such file", f"(built-in specs: {', '.join(builtin)})")
    assert main(["specs", "nosuchspec"]) == 2
    _one_line(capsys, "nosuchspec:", f"(built-in specs: {', '.join(builtin)})")


def test_ints_takes_distinct_positive_integers_and_refuses_the_rest():
    rng = random.Random(11)
    for _ in range(100):
        vals = rng.sample(range(1, 5000), rng.randint(1, 6))
        assert options.ints(",".join(map(str, vals))) == tuple(vals)
        items = list(map(str, vals))
        bad = [items[:i] + [""] + items[i:] for i in (rng.randint(0, len(items)),)]  # an empty item anywhere
        bad.append(items + [rng.choice(items)])  # one given twice
        bad.append(items[:-1] + [str(-rng.randint(0, 9))])  # zero or negative
        for b in bad:
            with pytest.raises(argparse.ArgumentTypeError):
                options.ints(",".join(b))


def test_a_run_that_outgrows_max_context_names_the_value_of_each_option_that_fits():
    """Random --warmup, --iters, --steps (and --context or not) on the tiny spec: where the rows outgrow its
    max_context, the error names the options that set the growth with their values, and each `--X <= v` it offers
    fits with v (the others as given) and not with v + 1; an option it does not offer fits at no value."""
    cap = options.load_spec("tiny").capture.max_context
    rng, refused = random.Random(12), 0
    for _ in range(40):
        given = {"--warmup": rng.randint(0, 6), "--iters": rng.randint(1, 60), "--steps": rng.randint(1, 6)}
        if rng.random() < 0.5:
            given["--context"] = rng.randint(1, cap)
        argv = [x for k, v in given.items() for x in (k, str(v))]
        try:
            _config("--spec", "tiny", *argv)
            continue
        except options.OptionError as e:
            msg = str(e)
        refused += 1
        assert f"max_context {cap}" in msg
        assert all(f"{k} {v}" in msg for k, v in given.items() if k != "--context"), msg
        offered = {k: int(v) for k, v in re.findall(r"(--\w+) <= (\d+)", msg)}
        for option in ("--iters", "--steps", "--context"):
            if option in offered:
                _config("--spec", "tiny", *argv, option, str(offered[option]))  # argparse: the later value wins
                with pytest.raises(options.OptionError):
                    _config("--spec", "tiny", *argv, option, str(offered[option] + 1))
            else:
                with pytest.raises(options.OptionError):
                    _config("--spec", "tiny", *argv, option, "1")
    assert refused >= 10


def test_help_lists_the_modes_a_user_picks_and_states_each_default_once_as_resolved(capsys):
    assert main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"comma-separated subset of (\S+) \(", text.replace("- ", "-")).group(1).split(",")
    assert listed == ["eager-rebuild", "graph-rebuild", "sglang", "compile", "compile-nosync", "compile-plain",
                      "compile-tuned", "graphcap"]
    assert not [v for v in options.VARIANTS if v in text.replace("- ", "-")]  # accepted, not listed
    _config("--spec", "tiny", "--modes", options.VARIANTS[-1], "--iters", "2")  # accepted all the same
    big = "gemma4-31b-assistant"  # the tiny spec's context holds no GPU-default run
    with_cuda, without = _config("--spec", big, cuda=True), _config("--spec", big, cuda=False)
    for option in ("iters", "warmup", "repeats"):
        stated = re.search(rf"--{option} {option.upper()} [^()]*\((default [^)]*)\)", text).group(1)
        a, b = getattr(with_cuda, option), getattr(without, option)
        assert stated == (f"default {a}" if a == b else f"default {a} with CUDA, {b} without"), stated
    assert "; 3 without CUDA" not in text and "default none" in text  # --out: nothing written unless given


def _row(mode: str, ms: float, **kw: object) -> BenchRow:
    return BenchRow(batch=4, context=8, steps=3, mode=mode, window=16, wall_ms=ms, wall_p90_ms=ms, host_ms=ms,
                    gpu_ms=None, iter_per_s=1e3 / ms, syncs_per_iter=0, syncs_how="", kernels_per_iter=None,
                    kernels_how="", capture_s=0.0, samples=3, **kw)


def _result(rows: list[BenchRow], notes: tuple[str, ...]) -> BenchResult:
    return BenchResult({}, {}, tuple(rows), {"3": {}}, None, notes, 1.0)


def test_the_table_explains_its_columns_and_on_a_cpu_what_its_ratios_are_not():
    """host ms only beside a GPU time (on a CPU it equals ms/iter); a legend line for the x columns and for host
    ms where shown; on a CPU the note under the table that the ratios are no speed claim."""
    rng = random.Random(13)
    base, ours = rng.uniform(1, 9), rng.uniform(1, 9)
    cpu = [_row("compile", base), _row("graphcap", ours, x_compile=base / ours)]
    head = format_table(cpu).splitlines()[0]
    assert "host ms" not in head and "x compile" in head
    lines = footnotes(_result(cpu, (CPU_SCOPE,)))
    assert lines[0].startswith("legend: x <mode>: graphcap's speed-up over that mode") and len(
        [x for x in lines if x.startswith("legend:")]) == 1
    assert lines[1] == f"note: {CPU_TABLE_NOTE}" and "no regression" in CPU_TABLE_NOTE
    gpu = [dataclasses.replace(r, gpu_ms=r.wall_ms * rng.uniform(0.5, 1), host_ms=rng.uniform(0.01, 0.1))
           for r in cpu]
    assert "host ms" in format_table(gpu).splitlines()[0]
    lines = footnotes(_result(gpu, ()))
    assert [x.split(":")[1].strip() for x in lines if x.startswith("legend:")] == ["x <mode>", "host ms"]
    assert f"note: {CPU_TABLE_NOTE}" not in lines
    alone = footnotes(_result([_row("eager-rebuild", base)], (CPU_SCOPE,)))
    assert not [x for x in alone if x.startswith("legend:")]  # no x column: nothing to explain
