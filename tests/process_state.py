"""The process-wide state a test may not leave changed for the tests after it, and the guard that fails the test that
did (tests/conftest.py uses it on every test). A leak makes later tests pass or fail by the order they run in, which
xdist's split hides; the guard names the test and what it changed, then puts the state back so that later tests are
judged on their own. A fixture of wider scope than a test may hold state for its tests: the guard sits inside it.

What is guarded: the environment (all of it: a variable a test sets reaches every child process started after it),
the working directory, sys.path, modules in sys.modules replaced or removed (a second copy of a module makes two
classes of one name), torch's default dtype and device, thread count, grad mode and determinism, the
torch._dynamo / torch._inductor config (once imported), and the root and graphcap loggers' levels. A variable that a
library sets where it is unset, once per process, whichever test first imports or uses it, is not that test's leak
(FIRST_USE_ENV); changing or removing it is."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

# Set with setdefault by a library on its first import or use: sglang points the JIT caches at its own cache
# directory (sglang.srt.environ.redirect_third_party_caches), Inductor's first cache_dir() sets its own.
FIRST_USE_ENV = frozenset({"CUDA_CACHE_PATH", "FLASHINFER_WORKSPACE_BASE", "TILELANG_CACHE_DIR",
                           "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})
PYTEST_ENV = frozenset({"PYTEST_CURRENT_TEST"})  # pytest's own, per phase
CONFIG_MODULES = ("torch._dynamo.config", "torch._inductor.config")
_UNSET = "<unset>"


def snapshot() -> dict[str, Any]:
    """The guarded state, each entry keyed by the name a failure reports. ~0.5 ms: run around every test."""
    state: dict[str, Any] = {f"os.environ[{k!r}]": v for k, v in os.environ.items() if k not in PYTEST_ENV}
    state["cwd"] = os.getcwd()
    state["sys.path"] = tuple(sys.path)
    state["sys.modules"] = dict(sys.modules)
    state["logging root level"] = logging.getLogger().level
    state["logging graphcap level"] = logging.getLogger("graphcap").level
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch default dtype"] = torch.get_default_dtype()
        state["torch default device"] = str(torch.get_default_device())
        state["torch threads"] = torch.get_num_threads()
        state["torch grad enabled"] = torch.is_grad_enabled()
        state["torch deterministic algorithms"] = torch.are_deterministic_algorithms_enabled()
    for name in CONFIG_MODULES:
        mod = sys.modules.get(name)
        if mod is not None:
            state.update({f"{name}.{k}": v for k, v in mod.get_config_copy().items()})
    return state


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs, one entry per variable. A config module first imported in between is not compared (its values
    before are unknown); modules imported in between are new, not changed."""
    out = []
    for key in sorted(before.keys() | after.keys()):
        if key == "sys.modules":
            old, new = before[key], after[key]
            gone = sorted(k for k in old if k not in new)
            replaced = sorted(k for k in old if k in new and new[k] is not old[k])
            if gone:
                out.append(f"sys.modules: {', '.join(gone)} removed")
            if replaced:
                out.append(f"sys.modules: {', '.join(replaced)} replaced")
            continue
        if key.startswith(CONFIG_MODULES) and key not in before:
            continue
        if key not in before and key[len("os.environ['"):-2] in FIRST_USE_ENV:
            continue
        old, new = before.get(key, _UNSET), after.get(key, _UNSET)
        if old != new:
            out.append(f"{key}: {old!r} -> {new!r}")
    return out


def restore(before: dict[str, Any]) -> None:
    """Put the guarded state back as it was in `before` (after a leak, so that the tests after it are judged alone).
    Only what differs is set: setting torch's default device to "cpu", say, would install a device mode."""
    now = snapshot()
    env = {k[len("os.environ['"):-2]: v for k, v in before.items() if k.startswith("os.environ[")}
    for k in list(os.environ):
        if k not in env and k not in PYTEST_ENV | FIRST_USE_ENV:
            del os.environ[k]
    os.environ.update(env)
    os.chdir(before["cwd"])
    sys.path[:] = before["sys.path"]
    for name, mod in before["sys.modules"].items():
        if sys.modules.get(name) is not mod:
            sys.modules[name] = mod
    logging.getLogger().setLevel(before["logging root level"])
    logging.getLogger("graphcap").setLevel(before["logging graphcap level"])
    torch = sys.modules.get("torch")
    setters = {"torch default dtype": lambda v: torch.set_default_dtype(v),
               "torch default device": lambda v: torch.set_default_device(None if v == "cpu" else v),
               "torch threads": lambda v: torch.set_num_threads(v),
               "torch grad enabled": lambda v: torch.set_grad_enabled(v),
               "torch deterministic algorithms": lambda v: torch.use_deterministic_algorithms(v)}
    for key, set_to in setters.items():
        if key in before and now.get(key) != before[key]:
            set_to(before[key])
    for name in CONFIG_MODULES:
        prefix = name + "."
        for key, value in before.items():
            if key.startswith(prefix) and now.get(key) != value:  # a dotted key ("triton.cudagraphs") as torch's own
                setattr(sys.modules[name], key[len(prefix):], value)


@pytest.fixture(autouse=True)
def process_state_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails (at teardown) the test that leaves guarded state changed, naming it and each variable. Set up before
    any other function-scoped fixture (conftest's autouse fixture asks for it first), so that `monkeypatch` and the
    like have undone their changes by the time it compares."""
    before = snapshot()
    yield
    changed = changes(before, snapshot())
    if changed:
        restore(before)
        pytest.fail(f"{request.node.nodeid} left process state changed (restored for the tests after it):\n  "
                    + "\n  ".join(changed), pytrace=False)
