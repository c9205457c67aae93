# The two entry points the README promises: `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# `make test` installs the Python packages and the Debian ones at once.
MAKEFLAGS += --jobs=2

.PHONY: up test install system-packages clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[engine,test]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/baton up

# The tests start hundreds of Python processes that import Baton's modules: compiled once here, not by each
# (an environment with PYTHONDONTWRITEBYTECODE set keeps none of their compilations).
test: $(STAMP) system-packages
	$(BIN)/python -m compileall -q -j 2 engine kernels services loadgen protos cli.py
	$(BIN)/python -m pytest -q

system-packages:
	bash scripts/install-system-packages.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
