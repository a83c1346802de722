# ringflash developer commands. `make demo` and `make test` work on a fresh Debian machine: both
# install what they need first (`make setup`), and setup does nothing when everything is there.
#
#   make setup       system packages (apt), Python packages (pip), the ringflash Python package
#   make build       C++ library, tests and benchmarks in build/ (Release, Ninja)
#   make demo        CPU kernel against a float64 reference, then every strategy over 4 CPU ranks
#                    (ringflash-bench, S = 16384) against the single-device kernel, then `make train`
#   make train       a small Llama trains with every strategy over 4 CPU ranks (torchrun, gloo)
#   make test        C++ tests (ctest), then Python tests (pytest)
#   make test-asan   C++ tests built with AddressSanitizer and UBSan in build-asan/
#   make cuda-check  compiles the library with CUDA and NCCL (headers from pip's nvidia-nccl-cu13) in
#                    build-cuda/ when nvcc is present; fails where ptxas serialized wgmma (its C75xx
#                    notes), which costs the sm_90a kernels most of their speed without an error
#   make bench       CPU benchmark against torch SDPA (full sweep)
#   make example     installs the library and builds and runs examples/cpp through find_package
#   make clean       removes the build directories
#
# Variables: PYTHON, BUILD_DIR, CMAKE_ARGS (extra -D options for build/), BENCH_ARGS, DEMO_ARGS
# (extra ringflash-bench flags), TRAIN_ARGS (extra examples/python/train_llama.py flags), CTEST_ARGS, CTEST_JOBS
# (tests run at once; default: the number of cores).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

PYTHON ?= python3
BUILD_DIR ?= build
ASAN_DIR ?= build-asan
CUDA_DIR ?= build-cuda
INSTALL_PREFIX ?= /tmp/ringflash-install
EXAMPLE_DIR ?= $(BUILD_DIR)/example-cpp
CMAKE_ARGS ?=
BENCH_ARGS ?=
DEMO_ARGS ?=
TRAIN_ARGS ?=
CTEST_ARGS ?=
CTEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CUDA_ARCHITECTURES ?= 80;90

TORCH_VERSION := 2.13.0
TRANSFORMERS_VERSION := 5.23.0
APT_PACKAGES := cmake ninja-build g++ libgtest-dev googletest libopenmpi-dev openmpi-bin
PIP_PACKAGES := torch==$(TORCH_VERSION) transformers==$(TRANSFORMERS_VERSION) nanobind scikit-build-core ninja \
                pytest numpy
NCCL_PACKAGE := nvidia-nccl-cu13==2.32.3
PIP_IMPORTS := torch, transformers, nanobind, scikit_build_core, ninja, pytest, numpy
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The Python package is reinstalled when a file it is built from changes.
PY_STAMP := $(BUILD_DIR)/.python-package-installed
PY_SOURCES := $(shell find pyproject.toml CMakeLists.txt cmake include src python -type f \
                -not -path '*/__pycache__/*' 2>/dev/null)
# ...or when it is not importable (uninstalled, or a different Python).
ifneq ($(shell $(PYTHON) -c "import importlib.util as u, sys; sys.exit(u.find_spec('ringflash') is None)" \
               2>/dev/null && echo yes),yes)
.PHONY: $(PY_STAMP)
endif

.PHONY: setup setup-system setup-python build demo train test test-cpp test-python test-asan cuda-check \
        bench example clean

setup: setup-system setup-python $(PY_STAMP)

setup-system:
	@if ! command -v dpkg-query >/dev/null; then \
	  echo "setup: not a Debian system; install these yourself: $(APT_PACKAGES)"; exit 0; fi; \
	missing=$$(for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "setup: installing" $$missing; \
	  $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

setup-python:
	@if ! $(PYTHON) -m pip --version >/dev/null 2>&1; then \
	  echo "setup: $(PYTHON) has no pip; use a Python with pip, e.g. make PYTHON=/path/to/venv/bin/python"; exit 1; fi
	@if ! $(PYTHON) -c "import sys, $(PIP_IMPORTS); \
	  sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)' \
	           or transformers.__version__ != '$(TRANSFORMERS_VERSION)')" 2>/dev/null; then \
	  echo "setup: pip install $(PIP_PACKAGES)"; \
	  $(PYTHON) -m pip install -q --root-user-action=ignore $(PIP_PACKAGES); \
	fi

$(PY_STAMP): $(PY_SOURCES) | setup-system setup-python
	@if [ ! -f pyproject.toml ]; then echo "setup: no pyproject.toml, the Python package is not built"; exit 0; fi; \
	echo "setup: pip install --no-build-isolation ."; \
	$(PYTHON) -m pip install -q --root-user-action=ignore --no-build-isolation . ; \
	mkdir -p $(@D) && touch $@

build: setup-system
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DRINGFLASH_BUILD_TESTS=ON -DRINGFLASH_BUILD_BENCH=ON $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR)

demo: setup build
	$(PYTHON) bench/reference_check.py
	$(BUILD_DIR)/bench/ringflash-bench --world 4 --seqlen 16384 --iters 3 --warmup 1 $(DEMO_ARGS)
	$(MAKE) --no-print-directory train

# A small Llama trains on one long packed sequence with every strategy over 4 CPU ranks (torchrun).
train: setup
	$(PYTHON) -m torch.distributed.run --nproc_per_node 4 examples/python/train_llama.py $(TRAIN_ARGS)

test: test-cpp test-python

test-cpp: setup build
	ctest --test-dir $(BUILD_DIR) -j $(CTEST_JOBS) --output-on-failure --no-tests=error $(CTEST_ARGS)

# pytest exits with 5 when it collects no tests; make treats that as a failure like any other.
test-python: setup
	$(PYTHON) -m pytest -q tests/python

# CUDA is off here: ASan's shadow memory and the CUDA runtime's address reservations do not mix,
# and without a GPU the CUDA code would not run anyway (compute-sanitizer checks it on a GPU).
test-asan: setup-system
	cmake -S . -B $(ASAN_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DRINGFLASH_SANITIZE=address,undefined -DRINGFLASH_BUILD_PYTHON=OFF \
	  -DRINGFLASH_BUILD_TESTS=ON -DRINGFLASH_BUILD_BENCH=OFF -DRINGFLASH_CUDA=OFF
	@echo '*' > $(ASAN_DIR)/.gitignore
	cmake --build $(ASAN_DIR)
	ctest --test-dir $(ASAN_DIR) -j $(CTEST_JOBS) --output-on-failure --no-tests=error $(CTEST_ARGS)

cuda-check: setup-system
	@nvcc=$$(command -v nvcc || true); \
	if [ -z "$$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi; \
	if [ -z "$$nvcc" ]; then echo "cuda-check: skipped, nvcc is not in PATH or /usr/local/cuda/bin"; exit 0; fi; \
	echo "cuda-check: $$nvcc ($$($$nvcc --version | grep -o 'release [0-9.]*'))"; \
	set -x; \
	$(PYTHON) -c "import nvidia.nccl" 2>/dev/null || $(PYTHON) -m pip install -q --root-user-action=ignore $(NCCL_PACKAGE); \
	cmake -S . -B $(CUDA_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGFLASH_CUDA=ON -DRINGFLASH_NCCL=ON \
	  -DCMAKE_CUDA_COMPILER=$$nvcc -DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHITECTURES)" \
	  -DRINGFLASH_BUILD_TESTS=OFF -DRINGFLASH_BUILD_BENCH=OFF -DRINGFLASH_BUILD_PYTHON=OFF; \
	echo '*' > $(CUDA_DIR)/.gitignore; \
	cmake --build $(CUDA_DIR) --target ringflash 2>&1 | tee $(CUDA_DIR)/build.log; \
	if grep -E "\(C75[0-9][0-9]\)" $(CUDA_DIR)/build.log; then \
	  echo "cuda-check: ptxas serialized wgmma or injected waits into a wgmma pipeline (above)"; exit 1; fi

bench: setup build
	$(PYTHON) bench/cpu_bench.py $(BENCH_ARGS)

# find_package(ringflash) from an installed tree, as a C++ consumer sees it.
example: build
	rm -rf $(INSTALL_PREFIX) $(EXAMPLE_DIR)
	cmake --install $(BUILD_DIR) --prefix $(INSTALL_PREFIX)
	cmake -S examples/cpp -B $(EXAMPLE_DIR) -G Ninja -DCMAKE_PREFIX_PATH=$(INSTALL_PREFIX)
	cmake --build $(EXAMPLE_DIR)
	$(EXAMPLE_DIR)/attention_example
	@if command -v mpiexec >/dev/null; then set -x; \
	  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	  mpiexec --oversubscribe -n 4 $(EXAMPLE_DIR)/zigzag_example; \
	else echo "example: mpiexec not found, zigzag_example not run"; fi

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) $(CUDA_DIR) $(INSTALL_PREFIX)
