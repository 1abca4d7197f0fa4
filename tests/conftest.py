"""Test set-up. Without CUDA, Triton kernels run on CPU tensors through Triton's interpreter, so the kernels
themselves (not only their torch twins) are checked in CI. The variable must be set before triton is imported."""
import logging
import os
import shutil
import tempfile

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

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


def pytest_sessionfinish():  # pytest passes only the arguments a hook names
    shutil.rmtree(_HYPOTHESIS_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu-check.sh runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _manifests_in_tmp(tmp_path_factory, monkeypatch):
    """Manifests a test writes without naming a path go to a temporary directory, never the user's cache
    (`graphcap.manifest.default_manifest_dir` reads the variable first). Subprocesses inherit it."""
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
