# The two commands of a fresh machine (see README): `make bench` and `make test`.
# Each builds what it needs: a venv with torch, pytest, and this package (editable,
# built against that torch with --no-build-isolation).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1
PY := $(VENV)/bin/python

.PHONY: env bench bench-selector test cuda-check clean

env: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" pytest numpy
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

bench: env
	$(PY) benchmarks/bench_conv.py --out bench_results/conv.jsonl

bench-selector: env
	$(PY) benchmarks/bench_selector.py --out bench_results/selector.jsonl

test: env
	$(PY) -m pytest

# The torch-free CUDA kernels alone, for sm_90: needs cmake and nvcc, not torch or a GPU.
cuda-check:
	cmake -S . -B build/cmake -DCMAKE_CUDA_COMPILER=$$(command -v nvcc) && cmake --build build/cmake -j 2

clean:
	rm -rf $(VENV) build *.egg-info bench_results
