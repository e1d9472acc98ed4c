# One-command set-up: `make demo` and `make test` create .venv and install everything first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=
# `make test` runs on TEST_WORKERS pytest-xdist workers (about 9.5 min on 2 cores); 0 runs it in one process (slower).
# Timed end-to-end tests (kills with deadlines) share one worker, so two of them never overlap.
TEST_WORKERS ?= 2

.PHONY: setup demo test bench bench-full lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(PY) -m swarm.demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

bench: setup
	$(PY) -m benchmarks.run --quick

bench-full: setup
	$(PY) -m benchmarks.run --full

lint: setup
	$(PY) -m ruff check swarm peers averaging bootstrap tests benchmarks examples
	$(PY) -m ruff format --check swarm peers averaging bootstrap tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info demo-out
