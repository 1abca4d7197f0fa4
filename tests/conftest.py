"""Test set-up. Without CUDA, Triton kernels run on CPU tensors through Triton's interpreter, so the kernels
themselves (not only their torch twins) are checked in CI. The variable must be set before triton is imported.

The tiers (tests/tiers.py): GRAPHCAP_TEST_TIER=ci (the default) leaves out the tests marked `thorough` and loads the
`ci` hypothesis profile; GRAPHCAP_TEST_TIER=thorough runs every test under the `thorough` profile.

The layout: the tests mirror the package (tests/kernels/ holds graphcap/kernels/' tests, tests/sglang/
graphcap/sglang/'s and the sgl_kernel stand-in's, ...; a top-level module's tests are in tests/), in directories
without __init__.py, so pytest imports each test module by its file name: a name must be unique across tests/
(pytest refuses a second one: "import file mismatch"). The shared helpers stay in tests/, imported by module name
(`from tiers import examples`): pytest puts tests/ on sys.path to import this file, and `_test_dirs_on_path` puts the
directories of tests there too, once, at collection, before any test runs (process_state's guard compares each test's
state with the state it started in)."""
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

TESTS = Path(__file__).resolve().parent
TEST_DIRS = tuple(sorted(d for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py"))))


def _test_dirs_on_path() -> None:
    """tests/ and each directory of tests on sys.path, where pytest would put each one only when it imports a test
    module from it: a test module imported by another from a directory of its own (bench/test_bench.py imports
    models/test_models.py) is then found whichever is collected first, in a run of one file too. A directory on
    sys.path is also a namespace package of its name wherever nothing else has the name: where the real sglang is
    not installed, `import sglang` would find tests/sglang/ and the tests that skip without sglang would fail. Such a
    name is taken out of the import system (None in sys.modules: find_spec gives None, an import raises
    ModuleNotFoundError); a real package of the name is left alone."""
    for d in (TESTS, *TEST_DIRS):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    for d in TEST_DIRS:
        if d.name in sys.modules:
            continue
        spec = importlib.util.find_spec(d.name)
        if spec is not None and spec.origin is None and all(Path(p).resolve().is_relative_to(TESTS)
                                                             for p in spec.submodule_search_locations or ()):
            sys.modules[d.name] = None


_test_dirs_on_path()

from process_state import process_state_guard  # noqa: E402, F401 - an autouse fixture, registered by its import here
from tiers import CI_EXAMPLES, THOROUGH_EXAMPLES, TIER, TIERS  # noqa: E402

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# hypothesis keeps its example database and caches in a temporary directory, not .hypothesis/ in the working one.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="graphcap-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)


# No deadline in either: an example's time under Triton's interpreter or a first compile says nothing about the code.
# CI draws the same examples for the same code (a red CI names a commit, not a seed); the thorough tier explores.
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None, print_blob=True, derandomize=True)
settings.register_profile("thorough", max_examples=THOROUGH_EXAMPLES, deadline=None, print_blob=True)
settings.load_profile(TIER if TIER in TIERS else "ci")


def pytest_configure(config):
    if TIER not in TIERS:
        raise pytest.UsageError(f"GRAPHCAP_TEST_TIER={TIER!r}: expected one of {', '.join(TIERS)}")


def pytest_report_header(config):
    if TIER == "ci":
        return "graphcap test tier: ci (tests marked thorough left out; GRAPHCAP_TEST_TIER=thorough runs every test)"
    return "graphcap test tier: thorough (every test, hypothesis at each test's full count)"


def pytest_sessionfinish():  # pytest passes only the arguments a hook names
    shutil.rmtree(_HYPOTHESIS_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if TIER == "ci":  # deselected, not skipped: the summary line counts them apart from the GPU's skips
        left_out = [item for item in items if item.get_closest_marker("thorough")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker("thorough")]
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu-check.sh runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _manifests_in_tmp(process_state_guard, tmp_path_factory, monkeypatch):
    """Manifests a test writes without naming a path go to a temporary directory, never the user's cache
    (`graphcap.manifest.default_manifest_dir` reads the variable first). Subprocesses inherit it. The guard first:
    it must see the state before `monkeypatch` is set up and after it has undone every change."""
    monkeypatch.setenv("GRAPHCAP_MANIFEST_DIR", str(tmp_path_factory.mktemp("manifests")))


@pytest.fixture
def dynamo_limits_restored(process_state_guard):
    """Capturing a function with graph breaks raises Dynamo's recompile limits for the process on purpose
    (graphcap.engine.recording.compile_iteration: a serving process keeps them, so a guard that fails after capture
    recompiles and is counted instead of running eagerly unseen); a test that does so puts them back."""
    import torch

    keys = ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")
    with torch._dynamo.config.patch(**{k: getattr(torch._dynamo.config, k) for k in keys}):
        yield


@pytest.fixture
def cpu_twins():
    """CPU tensors through the kernels' torch twins, for tests of what is built on the kernels (dispatch, capture
    logic, the draft model) where Triton's interpreter would only make them slow. The kernels themselves are tested
    against their twins and references in test_window.py and test_decode_attention.py; CUDA tensors still use them."""
    from graphcap.kernels import twins_on_cpu

    with twins_on_cpu():
        yield


@pytest.fixture
def device() -> str:
    return "cuda" if _HAS_CUDA else "cpu"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def glog():
    """graphcap's log records, through a handler of its own: sglang's prepare_server_args re-configures the root
    logger, dropping caplog's."""
    h = _Records()
    logger = logging.getLogger("graphcap")
    logger.addHandler(h)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield h
    logger.removeHandler(h)
    logger.setLevel(old)
