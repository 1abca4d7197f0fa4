#!/usr/bin/env bash
# What sglang's HTTP server imports beyond its engine and the GPU machine lacks, as Python 3.12 wheels into ./.whl
# (beside ../shared/tools/sglang-wheels-for-device.sh's) or DEST (.whl-0.5.18, beside scripts/sglang-0518-wheels.sh's;
# 0.5.18 imports the same): soundfile (its OpenAI audio endpoints import it at module level; the wheel bundles
# libsndfile) and its cffi. About 2 MB. Usage: scripts/sglang-server-wheels.sh [DEST]
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$dest" soundfile==0.13.1 cffi==2.0.0 pycparser==2.23
du -sh "$dest"
