# Two entry points (README): `make bench` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.graphcap-installed

.PHONY: bench test test-thorough test-lab venv clean
venv: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/sglang-cpu.txt requirements/sglang-0518-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned, so nothing below can pull a CUDA build onto a CPU machine.
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/cpu.txt torch
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/cpu.txt -e '.[test]'
	# The real sglang for the plugin's tests (marked sglang), without its CUDA stack: --no-deps, and every package
	# its parsing/plugin/speculative/scheduler modules import pinned in the file. Then check torch was not replaced.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/sglang-cpu.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-compile --upgrade --target $(VENV)/sglang-0518 -r requirements/sglang-0518-cpu.txt
	$(BIN)/python -c "import torch; v = torch.__version__; assert v.startswith('2.13.0'), 'torch replaced: ' + v"
	touch $@

bench: venv
	$(BIN)/graphcap bench

# Two tiers (tests/tiers.py): `make test` the CI tier (what CI runs: the heavy variants left out, hypothesis at CI
# counts); `make test-thorough` every test at full counts (before a release; scripts/gpu-check.sh tests on a GPU).
# Both on every core (pytest-xdist; at most 4 workers, each a process with torch and sglang loaded), a test to
# whichever worker is free: the tests' times range from milliseconds to a minute.
WORKERS := -n auto --maxprocesses 4 --dist worksteal
test: venv
	GRAPHCAP_TEST_TIER=ci $(BIN)/python -m pytest -q $(WORKERS)

test-thorough: venv
	GRAPHCAP_TEST_TIER=thorough $(BIN)/python -m pytest -q $(WORKERS)

# The lab scripts' tests (lab/README.md): not in either tier.
test-lab: venv
	$(BIN)/python -m pytest -q lab/tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
