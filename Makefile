# The two set-up commands: `make train` and `make test`. Both work on a fresh machine.
# `make test-fast` is the quick tier of the tests for the edit loop.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of this release lies on disk on the development machines; see README.
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_DIR ?= data/stdlib_tiny
TRAIN_CONFIG ?= configs/tiny_cpu.yaml
# Extra train flags, e.g. TRAIN_ARGS="--set checkpoint.resume=none" to start over instead of resuming.
TRAIN_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` / `make test-fast`; a test file stays on one worker
# (--dist loadfile), so its module fixtures are built once. Three on two cores: the multi-process
# tests wait on interpreters starting, subprocess pipes and Ray, and a third worker fills those
# waits (a fresh clone's make test: 650 s with 2 workers, 556 s with 3). TEST_WORKERS=0 runs in
# one process.
TEST_WORKERS ?= 3
# --no-loadscope-reorder: files go out in collection order (tests/conftest.py puts the longest
# first), not most-tests-first, which started the minutes-long files last.
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The AVX2 path on an AVX512 machine (cp_attention/hardware.py): oneDNN and aten's kernels capped at
# AVX2 and our CPU probes switched, as on a CPU without native bf16.
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2

.PHONY: install data train test test-fast lint bench clean train-avx2 test-avx2 gpu-wheels

# pip byte-compiles what it installs (--no-compile would save ~30 s of the install): where
# PYTHONDONTWRITEBYTECODE is set (as on the machines we test on), nothing would cache the compiled modules
# and every process would compile torch's again (2x the CPU of `import torch`).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The bundled corpus: the Python standard library's sources, tokenized with a BPE trained on them.
$(DATA_DIR)/metadata.json: $(STAMP)
	$(BIN)/longctx-pack --source stdlib --train-tokenizer 4096 --seq-len 1024 \
	  --max-docs 400 --seed 0 --output $(DATA_DIR)

data: $(DATA_DIR)/metadata.json

train: data
	$(BIN)/longctx-moe train --config $(TRAIN_CONFIG) --set data.path=$(DATA_DIR) $(TRAIN_ARGS)

# The whole suite (CI: .ci/run), with the 15 slowest tests listed at the end.
test: install
	$(BIN)/python -m pytest -q $(XDIST) --durations=15 $(PYTEST_ARGS)

# The edit loop: everything except the `slow` tier (see the markers in pyproject.toml).
test-fast: install
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" --durations=15 $(PYTEST_ARGS)

train-avx2:
	env $(AVX2_ENV) $(MAKE) train

test-avx2:
	env $(AVX2_ENV) $(MAKE) test

# Benchmarks print a table and write JSON under bench/results/ (minutes each; see docs/PERFORMANCE.md).
bench: install
	mkdir -p bench/results
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python bench/packing.py --out bench/results/packing.json
	$(BIN)/python bench/cp_attention.py --out bench/results/cp_attention.json
	$(BIN)/python bench/attention_kernels.py --out bench/results/attention_kernels.json
	$(BIN)/python bench/moe_dispatch.py --out bench/results/moe_dispatch.json
	$(BIN)/python bench/train_throughput.py --out bench/results/train_throughput.json

# The wheels a GPU device call carries in bench/wheels/ (not in git; gpu_check.sh installs them offline
# into a temporary directory for its peers section): torchtitan 0.3.0 and the pure-Python modules its
# qwen3 model imports that the GPU image lacks (its Requires-Dist spmd_types and tyro; tyro's own
# docstring-parser, typeguard and the typing-extensions typeguard needs). Run it before the call.
GPU_WHEELS := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
	typing-extensions==4.15.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps -d bench/wheels $(GPU_WHEELS)

lint: install
	$(BIN)/ruff check longctx_moe cp_attention data_packing rl_hooks tests bench

clean:
	rm -rf $(VENV) data runs
