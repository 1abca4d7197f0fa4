"""lab/tests: the lab scripts' tests, outside both tiers of the suite (`make test-lab`, `lab/gpu-lab.sh tests`).
The suite's set-up is tests/conftest.py's (Triton's interpreter without CUDA, the GPU tests' skip, the fixtures):
loaded here under a name of its own. lab/ is on sys.path for the scripts (as `python lab/<script>.py` puts it), tests/
for the suite's helpers (sm90.py, tiers.py), and the suite's conftest puts its directories of tests there too
(test_skinny_gemm_script.py imports tests/kernels/test_skinny_gemm.py)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "lab"
for _path in (ROOT / "tests", LAB):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

_spec = importlib.util.spec_from_file_location("graphcap_suite_conftest", ROOT / "tests" / "conftest.py")
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
globals().update({name: value for name, value in vars(_suite).items() if not name.startswith("__")})

