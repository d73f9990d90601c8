# The two commands a new user needs: `make demo` and `make test`.
# Each creates .venv when missing, installs torch==2.13.0 first (the CPU wheel; a bare `torch`
# requirement would pull several GB of CUDA wheels), then the package with its extras at the versions
# CI tests (constraints.txt; pyproject.toml keeps open ranges).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs clean trl-venv bench-trl

# Run $(2) with a line every 10 s while it works: pip is silent while it unpacks wheels, and a piped log
# (CI, `make demo > log`) should never look stalled.
define beat
( while sleep 10; do echo "make: still installing $(1)"; done ) & beat=$$!; $(2); status=$$?; kill $$beat; exit $$status
endef

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(call beat,pip,$(BIN)/python -m pip install -q --upgrade pip)
	$(call beat,torch,$(BIN)/python -m pip install -q torch==2.13.0)
	$(call beat,polyrl and its dependencies,$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e '.[dev]')
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/polyrl train --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest -n 2

lint: $(STAMP)
	$(BIN)/ruff check polyrl tests

docs: $(STAMP)
	$(BIN)/polyrl docs --write docs/methods.md

# TRL in its own virtualenv, pinned, for benchmarks/vs_trl.py (polyrl does not depend on TRL).
TRL_VENV := .venv-trl
$(TRL_VENV)/.installed: constraints.txt
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(call beat,TRL,$(TRL_VENV)/bin/python -m pip install -q torch==2.13.0 && $(TRL_VENV)/bin/python -m pip install -q -c constraints.txt trl==1.16.0)
	touch $(TRL_VENV)/.installed

trl-venv: $(TRL_VENV)/.installed

# polyrl vs TRL at the demo settings (see benchmarks/vs_trl.py for scaling, accuracy and memory).
bench-trl: $(STAMP) trl-venv
	$(BIN)/python benchmarks/vs_trl.py demo

clean:
	rm -rf $(VENV) $(TRL_VENV) runs .pytest_cache
