#!/usr/bin/env bash
# Build llama.cpp targets from the llama.cpp that llama-cpp-python vendors, the very commit
# superfluid runs on: the fast runtime library (`make serve`, `make test`) and the programs
# the bench compares with (`make bench`). Called by the Makefile:
#   scripts/build_llama_cpp.sh PIP BUILDS_DIR VERSION BUILD_NAME "CMAKE ARGS" TARGET...
set -euo pipefail
pip=$1 builds=$2 version=$3 name=$4 cmake_args=$5
shift 5
source_dir="$builds/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -d "$source_dir" ]; then
    echo "fetching the llama-cpp-python $version source distribution"
    mkdir -p "$builds/src"
    "$pip" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$builds/src"
    tar -xzf "$builds/src/llama_cpp_python-$version.tar.gz" -C "$builds/src"
    patches="$(cd "$(dirname "$0")/patches" && pwd)"
    for patch in "$patches"/*.patch; do  # ours: see scripts/patches/README.md
        echo "applying $(basename "$patch")"
        (cd "$source_dir" && git apply -p1 "$patch")
    done
fi
cmake=$(command -v cmake || true)
if [ -z "$cmake" ]; then  # no system cmake: PyPI's, in the virtual environment
    "$pip" install --quiet cmake
    cmake="$(dirname "$pip")/cmake"
fi
echo "building $* ($name: $cmake_args) in $builds/$name, once"
eval "$cmake" -S "$source_dir" -B "$builds/$name" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF "$cmake_args" >"$builds/$name.cmake.log" 2>&1 ||
    { tail -20 "$builds/$name.cmake.log"; exit 1; }
"$cmake" --build "$builds/$name" -j "$(nproc)" --target "$@" >"$builds/$name.build.log" 2>&1 ||
    { tail -20 "$builds/$name.build.log"; exit 1; }
