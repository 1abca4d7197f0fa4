"""The process-wide state a test may not leave changed for the tests after it, and the guard that fails the test that
did (tests/conftest.py uses it on every test). A leak makes later tests pass or fail by the order they run in, which
xdist's split hides; the guard names the test and what it changed, then puts the state back so that later tests are
judged on their own. A fixture of wider scope than a test may hold state for its tests: the guard sits inside it.

What is guarded: the environment (all of it: a variable a test sets reaches every child process started after it),
the working directory, sys.path, modules in sys.modules replaced or removed (a second copy of a module makes two
classes of one name), the root logger's handlers (pytest's own aside) and level and graphcap's logger's level,
torch's default dtype and device, thread count, grad mode and determinism, and the torch._dynamo / torch._inductor
config (once imported). What a library does once per process, on its first import or use, whichever test that is,
is not that test's leak: FIRST_USE_ENV, FIRST_USE_PATHS, GENERATED_MODULES."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# Set with setdefault by a library on its first import or use: sglang points the JIT caches at its own cache
# directory (sglang.srt.environ.redirect_third_party_caches), Inductor's first cache_dir() sets its own, and its first
# C++ module load the address its generated code reads. Changing or removing one is still a leak.
# On CUDA, Inductor's first compile points Triton at torch's own ptxas (TRITON_PTXAS_PATH).
# On the GPU machine's image sglang's first import on CUDA also sets Intel OpenMP's KMP_DUPLICATE_LIB_OK and
# KMP_INIT_AT_FORK (seen where a verify test was the first of its process to import sglang).
FIRST_USE_ENV = frozenset({"CUDA_CACHE_PATH", "FLASHINFER_WORKSPACE_BASE", "TILELANG_CACHE_DIR",
                           "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH",
                           "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"})
FIRST_USE_PATHS = ("setuptools/_vendor",)  # appended to sys.path by setuptools' first import
# Generated code, loaded again at will: Inductor's, and the launcher Triton's CUDA driver builds per kernel (each
# loaded under one module name, __triton_launcher)
GENERATED_MODULES = ("torch._inductor.runtime.compile_tasks.", "__triton_launcher")
PYTEST_ENV = frozenset({"PYTEST_CURRENT_TEST"})  # pytest's own, per phase
CONFIG_MODULES = ("torch._dynamo.config", "torch._inductor.config")
_UNSET = "<unset>"


@dataclass
class State:
    env: dict[str, str]
    cwd: str
    path: list[str]
    modules: dict[str, Any]
    root_handlers: list[logging.Handler]
    settings: dict[str, Any]  # name as a failure reports it -> value: loggers' levels, torch's, the configs'


def _own_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """The logger's handlers but pytest's (its capture handlers come and go with each phase of a test)."""
    return [h for h in logger.handlers if type(h).__module__ != "_pytest.logging"]


def snapshot() -> State:
    """The guarded state (~1.5 ms with torch, sglang and both configs imported: run around every test)."""
    settings: dict[str, Any] = {"logging root level": logging.getLogger().level,
                                "logging graphcap level": logging.getLogger("graphcap").level}
    torch = sys.modules.get("torch")
    if torch is not None:
        settings.update({"torch default dtype": torch.get_default_dtype(),
                         "torch default device": str(torch.get_default_device()),
                         "torch threads": torch.get_num_threads(), "torch grad enabled": torch.is_grad_enabled(),
                         "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled()})
    for name in CONFIG_MODULES:
        mod = sys.modules.get(name)
        if mod is not None:
            settings.update({f"{name}.{k}": v for k, v in mod.get_config_copy().items()})
    return State({k: v for k, v in os.environ.items() if k not in PYTEST_ENV}, os.getcwd(), list(sys.path),
                 dict(sys.modules), _own_handlers(logging.getLogger()), settings)


def changes(before: State, after: State) -> list[str]:
    """What differs, one line per variable. A config module first imported in between is not compared (its values
    before are unknown); modules imported in between are new, not changed."""
    out = []
    for k in sorted(before.env.keys() | after.env.keys()):
        old, new = before.env.get(k, _UNSET), after.env.get(k, _UNSET)
        if old != new and not (old is _UNSET and k in FIRST_USE_ENV):
            out.append(f"os.environ[{k!r}]: {old!r} -> {new!r}")
    if before.cwd != after.cwd:
        out.append(f"cwd: {before.cwd!r} -> {after.cwd!r}")
    path = [p for p in after.path if p in before.path or not p.endswith(FIRST_USE_PATHS)]
    if path != before.path:
        added, removed = [p for p in path if p not in before.path], [p for p in before.path if p not in path]
        what = [f"{word} {ps}" for word, ps in (("added", added), ("removed", removed)) if ps]
        out.append(f"sys.path: {'; '.join(what) or 'reordered'}")
    kept = [k for k in before.modules if not k.startswith(GENERATED_MODULES)]
    gone = sorted(k for k in kept if k not in after.modules)
    replaced = sorted(k for k in kept if k in after.modules and after.modules[k] is not before.modules[k])
    if gone:
        out.append(f"sys.modules: {', '.join(gone)} removed")
    if replaced:
        out.append(f"sys.modules: {', '.join(replaced)} replaced")
    if after.root_handlers != before.root_handlers:
        out.append(f"logging root handlers: {before.root_handlers} -> {after.root_handlers}")
    for k in sorted(before.settings.keys() & after.settings.keys()):
        if before.settings[k] != after.settings[k]:
            out.append(f"{k}: {before.settings[k]!r} -> {after.settings[k]!r}")
    return out


def restore_root_handlers(handlers: list[logging.Handler]) -> None:
    """The root logger's own handlers (not pytest's) back to `handlers`: sglang's basicConfig(force=True) swaps them."""
    root = logging.getLogger()
    for h in _own_handlers(root):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)  # a no-op for one still there


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """Around code that configures the root logger (sglang's argument parsing): its level and handlers put back."""
    root = logging.getLogger()
    level, handlers = root.level, _own_handlers(root)
    try:
        yield
    finally:
        root.setLevel(level)
        restore_root_handlers(handlers)


def restore(before: State) -> None:
    """Put the guarded state back as it was in `before` (after a leak, so that the tests after it are judged alone).
    Only what differs is set: setting torch's default device to "cpu", say, would install a device mode."""
    now = snapshot()
    for k in now.env.keys() - before.env.keys() - FIRST_USE_ENV:
        del os.environ[k]
    os.environ.update(before.env)
    os.chdir(before.cwd)
    sys.path[:] = before.path + [p for p in now.path if p not in before.path and p.endswith(FIRST_USE_PATHS)]
    for name, mod in before.modules.items():
        if sys.modules.get(name) is not mod:
            sys.modules[name] = mod
    restore_root_handlers(before.root_handlers)
    torch = sys.modules.get("torch")
    setters = {"logging root level": logging.getLogger().setLevel,
               "logging graphcap level": logging.getLogger("graphcap").setLevel}
    if torch is not None:
        setters.update({"torch default dtype": torch.set_default_dtype,
                        "torch default device": lambda v: torch.set_default_device(None if v == "cpu" else v),
                        "torch threads": torch.set_num_threads, "torch grad enabled": torch.set_grad_enabled,
                        "torch deterministic algorithms": torch.use_deterministic_algorithms})
    for key, value in before.settings.items():
        if now.settings.get(key, value) == value:
            continue
        if key in setters:
            setters[key](value)
        else:  # a config key, dotted as torch's own ("triton.cudagraphs")
            name = next(n for n in CONFIG_MODULES if key.startswith(n + "."))
            setattr(sys.modules[name], key[len(name) + 1:], value)


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
