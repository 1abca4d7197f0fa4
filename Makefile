# Two entry points (README): `make bench` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.graphcap-installed

.PHONY: bench test venv clean
venv: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned, so nothing below can pull a CUDA build onto a CPU machine.
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/cpu.txt torch
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/cpu.txt -e '.[test]' numpy
	touch $@

bench: venv
	$(BIN)/graphcap bench

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
