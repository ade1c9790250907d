#!/usr/bin/env bash
# The GPU check of docs/deployment/gpu.md, for a machine with one NVIDIA GPU and no network, run from the
# repository's root:   scripts/gpu_check.sh [BENCH OPTIONS, such as --quick --rounds 1]
# It needs: nvidia-smi, nvcc, cmake; the CPU build done (.venv/.installed: `make serve` once, offline with
# PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR holding the wheels and llama-cpp-python's sdist); llama.cpp's source at
# $LLAMA_SRC, with scripts/patches applied (default: the CPU peers' copy; models/ and docs/ may be left out). It
# 1. builds llama.cpp with CUDA for this GPU's architecture only: the workers' libllama (--kernels fast),
#    llama-server and llama-quantize, from one tree (the daemon keeps the CPU wheel: it loads no weights);
# 2. writes a random-weight 8B Llama-shaped GGUF in f16 (bench/random_model.py) and quantizes it to Q4_K_M;
# 3. exports a sequence's KV from the GPU, imports it back and compares the bytes and the next logits;
# 4. runs the http bench section against llama-server (both with every layer on the GPU);
# 5. runs the session tests that matter on a GPU (continuation, forks, park) with their layers there.
# Everything it measures goes to bench/results/gpu/, with the device named in device.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
bench_options=("$@")
py=.venv/bin/python
out=bench/results/gpu
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader | tee "$out/device.txt"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
date -u +%Y-%m-%dT%H:%M:%SZ >>"$out/device.txt"

make_var() { make -s --no-print-directory --eval "print-$1: ; @echo \$($1)" "print-$1" "${@:2}"; }
test -e .venv/.installed || make .venv/.installed
cpu_peers=$(make_var PEERS)
peers=$(make_var PEERS GPU=cuda CUDA_ARCHS="$arch")
version=$(make_var LLAMA_VERSION)
src=${LLAMA_SRC:-$cpu_peers/src/llama_cpp_python-$version/vendor/llama.cpp}
mkdir -p "$peers/src/llama_cpp_python-$version/vendor"
ln -sfn "$(realpath "$src")" "$peers/src/llama_cpp_python-$version/vendor/llama.cpp"  # no download
echo "== building llama.cpp for sm_$arch in $peers/fast"
scripts/build_llama_cpp.sh .venv/bin/pip "$peers" "$version" fast "$(make_var FAST_CMAKE_ARGS GPU=cuda CUDA_ARCHS="$arch")" \
    llama llama-server llama-quantize
export SUPERFLUID_FAST_LIB=$peers/fast/bin SUPERFLUID_KERNELS=fast SUPERFLUID_GPU_LAYERS=all

echo "== the model"
f16=$($py bench/random_model.py --peers "$peers" --size 8b --weights f16)
model=${f16%-f16.gguf}-q4_k_m.gguf
test -e "$model" || "$peers/fast/bin/llama-quantize" "$f16" "$model" Q4_K_M "$(nproc)" >"$out/quantize.log" 2>&1
echo "$model" >>"$out/device.txt"

echo "== KV from the GPU to host memory and back"
if ! LLAMA_CPP_LIB_PATH=$SUPERFLUID_FAST_LIB $py - "$model" >"$out/kv_roundtrip.txt" 2>&1 <<'EOF'
import sys
from pathlib import Path

import numpy as np

from superfluid.engine.interface import ContextShape
from superfluid.engine.llama import LlamaContext, LlamaModel

model = LlamaModel(Path(sys.argv[1]))
print(model.device_report())
context = LlamaContext(model, ContextShape(4096, 2, 512, 8))
prompt = np.arange(1, 501, dtype=np.int32)  # one batch
want = np.zeros(len(prompt), np.int8)
want[-1] = 1
context.decode(prompt, np.arange(len(prompt), dtype=np.int32), np.zeros(len(prompt), np.int32), want)
state = context.export(0)
context.restore(1, state)
again = context.export(1)
next_token = np.array([7], np.int32)
rows = [context.decode(next_token, np.array([len(prompt)], np.int32), np.array([s], np.int32), np.ones(1, np.int8)).copy()
        for s in (0, 1)]
print(f"state {len(state)} bytes; exported again bit-identical: {state == again}; "
      f"next logits bit-identical: {np.array_equal(rows[0], rows[1])}")
EOF
then
    echo "the KV round trip failed" >>"$out/kv_roundtrip.txt"
fi
cat "$out/kv_roundtrip.txt"

echo "== the http bench against llama-server"
$py bench/run.py --only http --peers "$peers" --model "$model" --gpu-layers all --results "$out" "${bench_options[@]}" |
    tee "$out/http.log" || true

echo "== the session tests on the GPU"
.venv/bin/pytest -q tests/test_sessions_e2e.py tests/test_park.py tests/test_kv_tiers.py \
    -k "continu or fork or park or host" --junitxml="$out/tests.xml" | tee "$out/tests.log" || true
echo "figures and logs in $out"
