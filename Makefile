# The two commands a new user needs: `make demo` and `make test`.
# Each creates .venv when missing, installs torch==2.13.0 first (the CPU wheel; a bare `torch`
# requirement would pull several GB of CUDA wheels), then the package with its extras at the versions
# CI tests (constraints.txt; pyproject.toml keeps open ranges).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	# Not quiet: a first install downloads for minutes and should show it.
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/polyrl train --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest -n 2

lint: $(STAMP)
	$(BIN)/ruff check polyrl tests

docs: $(STAMP)
	$(BIN)/polyrl docs --write docs/methods.md

clean:
	rm -rf $(VENV) runs .pytest_cache
