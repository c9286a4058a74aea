# Everything runs from a virtualenv in .venv (Debian's system Python refuses `pip install`,
# PEP 668); `make install` creates it. Use it afterwards with `. .venv/bin/activate`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install check test demo bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q -e .

# The layering contracts (.importlinter), the cycle check of ../shared/tools (lazy and
# TYPE_CHECKING imports count there) when it is beside the checkout, and the type check.
check: install
	$(BIN)/lint-imports
	@if [ -f ../shared/tools/import_cycles.py ]; then $(BIN)/python ../shared/tools/import_cycles.py kvsvc; fi
	$(BIN)/mypy

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/python -m kvsvc demo

bench: install
	$(BIN)/python -m bench.run
