# The two commands: `make run` (the main job) and `make test` (the suite). Both set up .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# the CPU build of torch when the machine carries it; any torch>=2.6 otherwise
	$(BIN)/pip install -q "torch==2.13.0" 2>/dev/null || $(BIN)/pip install -q "torch>=2.6"
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/asyncrl-launch --config-name quickstart

test: $(STAMP)
	$(BIN)/ruff check asyncrl transport objectstore daemons benchmarks tests
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.rpc

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
