PYTHON ?= python3

.PHONY: install test demo

install:
	$(PYTHON) -m pip install -r requirements-dev.txt
	$(PYTHON) -m pip install -e .

test: install
	$(PYTHON) -m pytest -q

demo: install
	kvsvc demo
