# The two entry points the README promises: `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[engine,test]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/baton up

test: $(STAMP)
	bash scripts/install-system-packages.sh
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
