#!/usr/bin/env bash
# Build llama.cpp programs from the llama.cpp that llama-cpp-python vendors, so the bench
# compares superfluid with the very commit it runs on. Called by `make bench`:
#   bench/build_peers.sh PIP PEERS_DIR VERSION BUILD_NAME "CMAKE ARGS" TARGET...
set -euo pipefail
pip=$1 peers=$2 version=$3 name=$4 cmake_args=$5
shift 5
source_dir="$peers/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -d "$source_dir" ]; then
    echo "fetching the llama-cpp-python $version source distribution"
    mkdir -p "$peers/src"
    "$pip" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$peers/src"
    tar -xzf "$peers/src/llama_cpp_python-$version.tar.gz" -C "$peers/src"
fi
echo "building $* ($name: $cmake_args) in $peers/$name, once"
eval cmake -S "$source_dir" -B "$peers/$name" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF "$cmake_args" >"$peers/$name.cmake.log"
cmake --build "$peers/$name" -j "$(nproc)" --target "$@" >"$peers/$name.build.log"
