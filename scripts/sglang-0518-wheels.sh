#!/usr/bin/env bash
# sglang 0.5.18 (the user's version) for a GPU machine without network access: its wheel and the packages its engine
# imports that the machine lacks, as Python 3.12 wheels, into ./.whl-0.5.18 (or DEST) - what
# /work/shared/tools/sglang-wheels-for-device.sh does for 0.5.23 into ./.whl. The two sets do not fit in one call's
# 64 MiB: carry one of .whl and .whl-0.5.18 per call. DEST must hold no wheels yet (the script will not mix the two sets
# in one directory).
# The machine has torch 2.11, triton 3.6, transformers 5.17, torchvision (0.5.23's engine imports it there), uvloop,
# no network. What this set differs in from 0.5.23's:
# - sglang 0.5.18 (24 MB; the wheel asks for torch 2.13, unused with --no-deps: nothing of 0.5.18 that runs here uses
#   a torch or Triton API 0.5.23 does not - which ran on torch 2.11 - beyond ones torch has had for years, and its
#   only binaries, three Rust extensions, link no libtorch; 0.5.23's Rust radix tree, which did, is not in it);
# - transformers 5.12.1 (its own pin): 0.5.18 registers a qwen3_asr config, which transformers 5.17 has already, so
#   `import sglang.srt.server_args` fails on the machine's; and tokenizers 0.22.2, which 5.12.1 checks for
#   (<= 0.23.0; the machine's is newer, for 5.17). huggingface_hub: the machine's (5.17 asks for the same range);
# - xgrammar 0.2.7 as for 0.5.23 (0.5.18 pins 0.2.1, a 44 MB wheel; 0.2.7 has every name 0.5.18 imports at load);
# - a `flashinfer` stand-in (built here, ~2 KB): on CUDA, 0.5.18 imports flashinfer.sampling (layers/sampler.py),
#   flashinfer.bmm_fp8 (quantization/fp8_utils.py) and flashinfer.prefill (attention/vision.py) at module load;
#   flashinfer_python is 16 MB and would not fit. Every name answers, and raises naming itself when called (none is
#   on the greedy Gemma 4 path). Run with SGLANG_IS_FLASHINFER_AVAILABLE=false, so that sglang's availability checks
#   (find_spec) choose none of flashinfer's paths.
# sgl_kernel is the stand-in in tests/support (as for 0.5.23; 0.5.18 also calls fast_topk, build_tree_kernel_efficient
# and verify_tree_greedy from it). On the machine, `scripts/gpu-check.sh user-setup` installs .whl-0.5.18/ into its own
# --target dir, /tmp/site-0.5.18, once, and puts it in front of PYTHONPATH (with SGLANG_IS_FLASHINFER_AVAILABLE=false)
# for 0.5.18's engines alone, so that a machine that also has 0.5.23 in /tmp/site runs both without reinstalling:
#   carry .whl-0.5.18; USER_SETUP_SGLANG=0.5.18 scripts/gpu-check.sh user-setup
# Usage: scripts/sglang-0518-wheels.sh [DEST]      (--standin-only DEST: only the flashinfer stand-in wheel)
set -euo pipefail
standin_only=0
if [ "${1:-}" = "--standin-only" ]; then standin_only=1; shift; fi
dest=${1:-.whl-0.5.18}
if ls "$dest"/*.whl >/dev/null 2>&1; then
  echo "$dest holds wheels already (0.5.23's?); the two sets do not fit in one call: remove them first" >&2
  exit 2
fi
mkdir -p "$dest"
PY=${PYTHON:-python3}

# The flashinfer stand-in as a wheel (pip installs it like the others, offline).
"$PY" - "$dest" <<'EOF'
import base64, hashlib, sys, zipfile

NAME, VERSION = "flashinfer_standin", "0.0.1"
SOURCE = '''"""A stand-in for flashinfer, so that sglang 0.5.18 imports on a machine without it (it imports flashinfer.sampling,
flashinfer.bmm_fp8 and flashinfer.prefill at module load on CUDA). Every attribute and submodule answers; calling
anything raises NotImplementedError naming it. Made by graphcap's scripts/sglang-0518-wheels.sh."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+graphcap-standin"
__graphcap_standin__ = True


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"flashinfer stand-in: {self._name} is not available (graphcap's sglang 0.5.18 "
                                  "runs carry no flashinfer)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):  # a class deriving from a stand-in name still defines
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.modules[__name__].__class__ = _Module
sys.meta_path.append(_Finder())
'''
files = {
    "flashinfer/__init__.py": SOURCE,
    f"{NAME}-{VERSION}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
                                            "Summary: graphcap's flashinfer stand-in for sglang 0.5.18 runs\n",
    f"{NAME}-{VERSION}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: graphcap\nRoot-Is-Purelib: true\n"
                                         "Tag: py3-none-any\n",
    f"{NAME}-{VERSION}.dist-info/top_level.txt": "flashinfer\n",
}
record = f"{NAME}-{VERSION}.dist-info/RECORD"
lines = []
for path, text in files.items():
    data = text.encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    lines.append(f"{path},sha256={digest},{len(data)}")
files[record] = "\n".join(lines + [f"{record},,"]) + "\n"
with zipfile.ZipFile(f"{sys.argv[1]}/{NAME}-{VERSION}-py3-none-any.whl", "w") as z:
    for path, text in files.items():
        z.writestr(path, text)
EOF
[ "$standin_only" = 1 ] && exit 0

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$dest" \
  sglang==0.5.18 transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.7 \
  orjson pybase64 msgspec pydantic pydantic_core annotated_types typing_inspection starlette \
  python-multipart pyzmq dill setproctitle ipython traitlets jedi parso prompt_toolkit wcwidth decorator \
  matplotlib-inline pexpect ptyprocess stack_data asttokens executing pure_eval \
  fastapi==0.165.0 uvicorn==0.54.0 gguf==0.19.0 compressed-tensors==0.18.0 openai==2.8.0 loguru==0.7.3 \
  partial-json-parser==0.2.1.1.post7 apache-tvm-ffi==0.1.11 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  truststore==0.10.5 opentelemetry-api==1.45.2 annotated-doc==0.0.7 \
  jsonschema jsonschema-specifications referencing rpds-py
du -sh "$dest"
