"""The guard of tests/process_state.py: every kind of leak it watches is named and put back, what a library does on
first use is not a leak, and in a pytest run of its own the guard fails the leaking test (naming it and the
variable) and not the test that undid its change."""
from __future__ import annotations

import logging
import os
import random
import string
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import process_state as ps

pytest_plugins = ["pytester"]


def _name(rng: random.Random, prefix: str) -> str:
    return prefix + "".join(rng.choices(string.ascii_uppercase, k=8))


def _leaks(rng: random.Random, tmp_path: Path) -> dict[str, Callable[[], object]]:
    """One leak of each kind the guard watches: a fragment its report must hold -> the change that leaks."""
    var, value, mod = _name(rng, "GRAPHCAP_PROBE_"), str(rng.randrange(10**6)), rng.choice(["json", "string", "random"])
    limit = torch._dynamo.config.recompile_limit + rng.randint(1, 50)
    dtype = rng.choice([torch.float64, torch.bfloat16])
    return {
        f"os.environ[{var!r}]: '<unset>' -> {value!r}": lambda: os.environ.__setitem__(var, value),
        f"cwd: {os.getcwd()!r} -> {str(tmp_path)!r}": lambda: os.chdir(tmp_path),
        f"sys.path: added [{str(tmp_path)!r}]": lambda: sys.path.insert(rng.randint(0, 3), str(tmp_path)),
        f"sys.modules: {mod} replaced": lambda: sys.modules.__setitem__(mod, types.ModuleType(mod)),
        "logging root handlers: ": lambda: logging.getLogger().addHandler(logging.StreamHandler()),
        f"torch default dtype: torch.float32 -> {dtype}": lambda: torch.set_default_dtype(dtype),
        f"torch._dynamo.config.recompile_limit: {torch._dynamo.config.recompile_limit} -> {limit}":
            lambda: setattr(torch._dynamo.config, "recompile_limit", limit),
    }


@pytest.mark.parametrize("seed", range(3))
def test_each_leak_is_named_and_restored(tmp_path, seed):
    import torch._dynamo  # noqa: F401 - its config watched from here on

    for fragment, leak in _leaks(random.Random(seed), tmp_path).items():
        before = ps.snapshot()
        leak()
        found = ps.changes(before, ps.snapshot())
        ps.restore(before)
        assert len(found) == 1 and found[0].startswith(fragment), (fragment, found)
        assert ps.changes(before, ps.snapshot()) == [], fragment


def test_a_path_a_library_appends_on_first_use_is_no_leak_and_stays(tmp_path, monkeypatch):
    """setuptools' vendor directory appended to sys.path (once per process) is no leak, wherever other entries move;
    restoring after a real leak keeps it."""
    vendor = str(tmp_path / "setuptools" / "_vendor")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not p.endswith(ps.FIRST_USE_PATHS)])
    before = ps.snapshot()
    sys.path.append(vendor)
    assert ps.changes(before, ps.snapshot()) == []
    with_vendor = ps.snapshot()
    sys.path.insert(random.Random(6).randint(0, 3), str(tmp_path))  # an entry before it: the vendor's index moves
    assert ps.changes(with_vendor, ps.snapshot()) == [f"sys.path: added [{str(tmp_path)!r}]"]
    ps.restore(before)
    assert sys.path == before.path + [vendor]


def test_what_a_library_does_on_first_use_is_no_leak(monkeypatch):
    var = sorted(ps.FIRST_USE_ENV)[random.Random(4).randrange(len(ps.FIRST_USE_ENV))]
    monkeypatch.delenv(var, raising=False)
    before = ps.snapshot()
    os.environ[var] = "/first/use"  # set where it was unset: the library's setdefault
    try:
        assert ps.changes(before, ps.snapshot()) == []
        changed = ps.snapshot()
        os.environ[var] = "/changed"  # changing it afterwards is a test's doing
        assert ps.changes(changed, ps.snapshot()) == [f"os.environ[{var!r}]: '/first/use' -> '/changed'"]
    finally:
        os.environ.pop(var)


def test_the_guard_fails_the_leaking_test_alone(pytester):
    var = _name(random.Random(5), "GRAPHCAP_PROBE_")
    pytester.makeconftest("from process_state import process_state_guard  # noqa: F401")
    pytester.makepyfile(f"""
        import os

        def test_leaks():
            os.environ["{var}"] = "1"

        def test_undoes_its_change(monkeypatch):
            monkeypatch.setenv("{var}", "2")

        def test_after_the_leak():
            assert "{var}" not in os.environ  # put back by the guard
        """)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:random_order", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    out = result.stdout.lines
    at = out.index("test_the_guard_fails_the_leaking_test_alone.py::test_leaks left process state changed (restored "
                   "for the tests after it):")
    assert "ERROR at teardown of test_leaks" in out[at - 1]
    assert out[at + 1] == f"  os.environ['{var}']: '<unset>' -> '1'"
    assert var not in os.environ
