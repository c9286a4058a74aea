PYTHON ?= python3

.PHONY: install test demo bench

install:
	$(PYTHON) -m pip install -r requirements-dev.txt
	$(PYTHON) -m pip install -e .

test: install
	$(PYTHON) -m pytest -q

demo: install
	kvsvc demo

bench:
	$(PYTHON) -m bench.run
