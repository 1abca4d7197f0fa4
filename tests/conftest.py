"""Test set-up. Without CUDA, Triton kernels run on CPU tensors through Triton's interpreter, so the kernels
themselves (not only their torch twins) are checked in CI. The variable must be set before triton is imported.

The tiers (tests/tiers.py): GRAPHCAP_TEST_TIER=ci (the default) leaves out the tests marked `thorough` and loads the
`ci` hypothesis profile; GRAPHCAP_TEST_TIER=thorough runs every test under the `thorough` profile."""
import logging
import os
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from process_state import process_state_guard  # noqa: F401 - an autouse fixture, registered by its import here
from tiers import CI_EXAMPLES, THOROUGH_EXAMPLES, TIER, TIERS

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
def cpu_twins():
    """CPU tensors through the kernels' torch twins, for tests of what is built on the kernels (dispatch, capture
    logic, the draft model) where Triton's interpreter would only make them slow. The kernels themselves are tested
    against their twins and references in test_window.py and test_attention.py; CUDA tensors still use them."""
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
