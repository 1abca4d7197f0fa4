# Two entry points (README): `make bench` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.graphcap-installed

.PHONY: bench test venv clean
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

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
