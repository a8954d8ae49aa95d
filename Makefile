# The two commands of a fresh machine (see README): `make bench` and `make test`.
# Each builds what it needs: a venv with torch, pytest, and this package (editable,
# built against that torch with --no-build-isolation).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1
PY := $(VENV)/bin/python
# Everything the extension is built from: an edit to any of them rebuilds it (ninja
# then recompiles only what the edit affects).
EXTENSION_INPUTS := $(shell find csrc -type f) setup.py pyproject.toml dflash2_kernels/_cuda_archs.py

.PHONY: env bench bench-selector traffic test test-asan test-oldest-torch check-cpu fuzz cuda-check clean gpu-check-dry-run

env: $(VENV)/.built

# Re-made when the upstream pins change (an existing venv gets the new packages).
$(VENV)/.ready: requirements/upstream.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" pytest numpy ninja "matplotlib>=3.5"
	$(PY) -m pip install --quiet --no-deps -r requirements/upstream.txt
	touch $@

$(VENV)/.built: $(VENV)/.ready $(EXTENSION_INPUTS)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

bench: env
	$(PY) benchmarks/bench_conv.py --out bench_results/conv.jsonl

bench-selector: env
	$(PY) benchmarks/bench_selector.py --out bench_results/selector.jsonl

# The traffic model (benchmarks/traffic.py): every GPU kernel's bytes counted on the CPU.
traffic: $(VENV)/.ready
	$(PY) benchmarks/traffic.py --out bench_results/traffic.jsonl

# The suite against the installed build, then again against the sanitized build, which
# adds the CUDA kernels run on the CPU's SIMT emulator (scripts/asan.py), then the
# contract-judged and fuzz tests under the CPU dispatch paths other machines take
# (scripts/host_variants.py --quick: the ones this CPU can reach, a few cases each), the
# GPU script's dry run (below), then the op tests against the oldest torch pyproject.toml
# admits (scripts/oldest_torch.py: its download starts first and overlaps the rest;
# OLDEST_TORCH=skip skips it, saying so).
test: env
	$(PY) scripts/oldest_torch.py prepare --background
	$(PY) -m pytest
	$(PY) scripts/asan.py test
	$(PY) scripts/host_variants.py --quick
	$(MAKE) gpu-check-dry-run
	$(PY) scripts/oldest_torch.py test

# scripts/gpu_check.sh on this machine, no GPU needed (~3 min): the benchmarks' profile
# pass on the CPU's kernels, the profile tables, the wheelhouse for the GPU machine built
# and checked, the summary and the archive, so the script cannot rot between GPU runs.
GPU_CHECK_DRY_OUT ?= /tmp/dflash2-gpu-check-dry-run
gpu-check-dry-run: env
	rm -rf $(GPU_CHECK_DRY_OUT)
	OUT=$(GPU_CHECK_DRY_OUT) PYTHON=$(abspath $(PY)) GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh

test-oldest-torch: $(VENV)/.ready
	$(PY) scripts/oldest_torch.py test

# A user's check of their own CPU: the numerics and fuzz tests as this machine runs
# them, then under the other dispatch paths it can take.
check-cpu: env
	$(PY) scripts/host_variants.py --as-is --quick

test-asan: env
	$(PY) scripts/asan.py test

# The fuzz suite alone, longer than the suite's 300 cases per target (tests/test_fuzz.py;
# FUZZ_SEED draws other cases). Sanitized: `make fuzz FUZZ_ASAN=1`.
FUZZ_CASES ?= 5000
FUZZ_SEED ?= 0
fuzz: env
	DFLASH2_FUZZ_CASES=$(FUZZ_CASES) DFLASH2_FUZZ_SEED=$(FUZZ_SEED) \
	  $(if $(FUZZ_ASAN),$(PY) scripts/asan.py test tests/test_fuzz.py,$(PY) -m pytest tests/test_fuzz.py)

# The plots and tables of docs/BENCHMARKS.md (and the README's headline table) from the
# committed records (docs/results/records.jsonl) and any new ones in bench_results/: the
# newest run of each op wins, and docs/results/records.jsonl is rewritten to hold it.
# matplotlib is the optional `bench` extra (pyproject.toml), installed here if missing.
.PHONY: plots
plots: $(VENV)/.ready
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet "matplotlib>=3.5"
	$(PY) benchmarks/plot.py docs/results/records.jsonl $(wildcard bench_results/*.jsonl) --save docs/results/records.jsonl

# The torch-free CUDA kernels alone, for every architecture of the default list (a build
# without a GPU: dflash2_kernels/_cuda_archs.py), register spills as errors, then each
# kernel's registers and shared memory against its architecture's limits (with a
# cuobjdump: the toolkit's or Triton's). Needs cmake and nvcc, not torch or a GPU.
CHECK_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
cuda-check:
	cmake -S . -B build/cmake -DCMAKE_CUDA_COMPILER=$$(command -v nvcc) \
	  -DCMAKE_CUDA_ARCHITECTURES="$$($(CHECK_PY) dflash2_kernels/_cuda_archs.py --cmake --nvcc $$(command -v nvcc))"
	cmake --build build/cmake -j 2
	$(CHECK_PY) dflash2_kernels/_cuda_archs.py --check-resources build/cmake/libdflash2_cuda_kernels.a

clean:
	rm -rf $(VENV) .venv-oldest build *.egg-info bench_results dflash2_kernels/*.so
