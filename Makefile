# Everything runs from a virtualenv in .venv (Debian's system Python refuses `pip install`,
# PEP 668); `make install` creates it. Use it afterwards with `. .venv/bin/activate`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install check test test-fast test-rest demo bench docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q -e .

# The layering contracts (.importlinter), the cycle check of ../shared/tools (lazy and
# TYPE_CHECKING imports count there; IMPORT_CYCLES names it elsewhere) and the type check.
# Without the cycle tool the check fails under CI and says it was skipped otherwise.
IMPORT_CYCLES ?= ../shared/tools/import_cycles.py
check: install
	$(BIN)/lint-imports
	@if [ -f "$(IMPORT_CYCLES)" ]; then $(BIN)/python "$(IMPORT_CYCLES)" kvsvc; \
	elif [ -n "$$CI" ]; then echo "make check: $(IMPORT_CYCLES) not found (set IMPORT_CYCLES)"; exit 1; \
	else echo "make check: cycle check SKIPPED: $(IMPORT_CYCLES) not found (set IMPORT_CYCLES)"; fi
	$(BIN)/mypy

# Test tiers (tests/conftest.py): `test-fast` is the unit tier (tests/unit: rules and objects, no
# sockets, no sleeps, seconds); `test-rest` every other test (integration, e2e, fuzz: real sockets,
# etcd, gunicorn, the soaks); `test` all of them. Markers: `-m etcd`, `-m slow`, `-m "not slow"`.
test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q tests/unit

test-rest: install
	$(BIN)/python -m pytest -q --ignore=tests/unit

demo: install
	$(BIN)/python -m kvsvc demo

bench: install
	$(BIN)/python -m bench.run

# The reference generated from the tables in code (kvsvc/settings.py, kvsvc/config.py): the
# settings and §8 tables of docs/configuration.md and config/kvsvc.env. Run it after adding or
# changing a setting; tests/unit/test_generated_docs.py fails until it is run.
docs: install
	$(BIN)/python -m kvsvc.reference --write
