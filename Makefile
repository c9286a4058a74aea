# Everything runs from a virtualenv in .venv (Debian's system Python refuses `pip install`,
# PEP 668); `make install` creates it. Use it afterwards with `. .venv/bin/activate`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test demo bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q -e .

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/python -m kvsvc demo

bench: install
	$(BIN)/python -m bench.run
