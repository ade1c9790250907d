"""Which llama.cpp library a model runs on, and is it built so that batching never changes a token's arithmetic?

Two builds of the same llama.cpp are installed. The wheel llama-cpp-python loads in every
process is compiled without the kernels that depend on the batch (below). The fast one is
llama.cpp as it builds itself, with every kernel this CPU has and scripts/patches applied;
`make` installs it at `.venv/llama-fast` and a worker loads it through llama-cpp-python's
`LLAMA_CPP_LIB_PATH`.

llama.cpp picks some matrix kernels by how many tokens share a batch: llamafile's sgemm
from two tokens on, repacked weights (gemm for groups of four, gemv for the rest), AMX
tiles, arm64's int8 matrix-multiply kernels for even batch sizes, and the tiled K-quant
kernels from eight rows on. Each of them rounds differently from the one-token kernel, so a
prompt prefilled in bulk, a token decoded alone and a lane batched with others would get
logits that differ in the last bits, and greedy text flips wherever two logits are close.

`--kernels exact` (the default wherever the library allows it) keeps them all out:
- llamafile's sgemm: our patch (scripts/patches/sgemm-one-column.patch) has it take one-token
  products too on x86, so every token goes through the same kernel; the library then names
  `BATCH_INVARIANT_SGEMM` in its system info. On arm64 it leaves products narrower than two, four
  (F32) or eight (F16) tokens to ggml's kernels, which sum in another order; under
  `GGML_CPU_MATMUL_ONE_ORDER=1` it takes every width (scripts/patches/widths-one-order-arm64.patch)
  and the library names `BATCH_INVARIANT_SGEMM` then. The wheel is compiled without sgemm instead.
- repacked weights, AMX and arm64's KleidiAI: llama.cpp runs them only on weights it moves to
  its extra buffer types. They speed up Q4_0, Q4_K and IQ4_NL weights; Q4_1, Q8_0 and F16 ones
  never take them. On x86 the repacked Q4_0 and IQ4_NL kernels sum each output as the one-token
  kernel does, and so do the Q4_K ones with scripts/patches/repack-q4_K-one-order.patch; the
  other K-quant ones do not. Our patch (scripts/patches/repack-exact-types.patch) has the
  library repack only those three types under `GGML_CPU_REPACK_EXACT=1` and name
  `REPACK_EXACT` in its system info, and an exact process uses the extra buffer types only
  then, and never with AMX compiled in (`LlamaModel`, `exact_repacking`).
- the tiled K-quant kernels: they sum an output block by block, each block's integer sums
  scaled by the weights' then the activations' scales; the one-token kernels sum in eight
  lanes and add them at the end. Our patch (scripts/patches/tiled-k-quants-one-order.patch),
  under `GGML_CPU_TILED_EXACT=1`, has the one-token Q2_K, Q3_K, Q5_K, Q6_K and IQ kernels (but IQ1_S and
  IQ1_M's) sum in
  the tiled kernels' order on x86 with AVX2 and the tiled kernels take only those types (Q6_K
  is the rest of a Q4_K_M model, whose Q4_K weights are repacked); the library names
  `TILED_EXACT` in its system info.
  On a library without it (the wheel), they are off through `GGML_CPU_TILED_MM=0`. Either
  switch must be in the environment before the first decode.
- arm64's int8 matrix-multiply kernels (two rows by two tokens, so a batch's last odd token takes the
  one-row kernel): compiled out of the wheel (llama.cpp's build is told the CPU lacks them,
  `GGML_MACHINE_SUPPORTS_i8mm=OFF`); the fast build keeps them for `--kernels fast` and, under
  `GGML_CPU_MATMUL_ONE_ORDER=1`, takes the one-row kernel for every product and leaves `MATMUL_INT8`
  out of its system info (the same patch). `bench/arm64_exactness.sh` checks both builds under
  emulation.
`--kernels fast` runs the fast build with all of them, which makes IQ1_S and IQ1_M weights
prefill faster and gives up exact continuations. A
worker learns which from `SUPERFLUID_EXACT` in its environment; every other process computes
exactly.

On a GPU build (`make serve GPU=cuda` or `GPU=metal`: docs/deployment/gpu.md) the layers on the GPU
run the GPU backend's kernels, which pick their matrix multiplication by batch size too (CUDA's
MMQ, MMVQ and cuBLAS paths, with tiles and split-K by shape) and have not been shown to ignore the
batch: `--kernels exact` is refused there (`gpu_backends`), and `--kernels fast` is what runs.

`pip install superfluid` cannot do the same: a package cannot set the compile flags of its
dependencies, so pip builds llama-cpp-python from source with llama.cpp's defaults. Such a
daemon serves `--kernels fast` on llama-cpp-python's own library, and refuses an explicit
`--kernels exact` with the command that reinstalls it exact (`exact_refusal`).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import llama_cpp as L

FAST_LIBRARY_ENV = "SUPERFLUID_FAST_LIB"  # a directory holding the fast build's libllama.so
LIBRARY_ENV = "LLAMA_CPP_LIB_PATH"  # where llama-cpp-python loads libllama.so from, when set

# system-info features whose kernels depend on the batch shape and run on any weights (REPACK, AMX_INT8 and
# KLEIDIAI do too, but only on weights in llama.cpp's extra buffer types, which an exact process leaves off)
BATCH_DEPENDENT = ("LLAMAFILE", "MATMUL_INT8")
# named by a library whose llamafile sgemm takes one-token products too (scripts/patches/sgemm-one-column.patch)
INVARIANT_SGEMM = "BATCH_INVARIANT_SGEMM"
TILED_ENV = "GGML_CPU_TILED_MM"
# named by a library whose tiled K-quant kernels, when TILED_EXACT_ENV is 1, take only the weight types whose
# one-token kernel sums each output in their order
# (Q2_K, Q3_K, Q5_K, Q6_K and the IQ types but IQ1_S and IQ1_M, on x86: scripts/patches/tiled-k-quants-one-order.patch)
TILED_EXACT = "TILED_EXACT"
TILED_EXACT_ENV = "GGML_CPU_TILED_EXACT"
# named by a library whose flash attention sums each query in one order, whatever its batch, when
# FA_ORDER_ENV is 1 (scripts/patches/tiled-attention-one-order.patch)
FA_ONE_ORDER = "FA_ONE_ORDER"
FA_ORDER_ENV = "GGML_CPU_FA_ONE_ORDER"
# named by a library that, when REPACK_EXACT_ENV is 1, repacks only the weight types whose repacked kernels
# ignore the batch (Q4_0, IQ4_NL and Q4_K on x86: scripts/patches/repack-exact-types.patch)
REPACK_EXACT = "REPACK_EXACT"
REPACK_EXACT_ENV = "GGML_CPU_REPACK_EXACT"
# where 1, an arm64 library with scripts/patches/widths-one-order-arm64.patch runs no int8 matrix-multiply pairs and
# has llamafile's sgemm take products of every width (it then names BATCH_INVARIANT_SGEMM and no MATMUL_INT8)
MATMUL_ORDER_ENV = "GGML_CPU_MATMUL_ONE_ORDER"
EXACT_ENV = "SUPERFLUID_EXACT"  # "0" in a worker on --kernels fast
# platform.machine() on the CPUs our patches hold to one order (Linux and macOS names; Windows says AMD64)
X86_MACHINES = ("x86_64", "AMD64")
ARM64_MACHINES = ("aarch64", "arm64")
# where 1, a library with scripts/patches/kv-pages-on-use.patch takes the KV's host memory as cells are written
# and gives a stream's back when it empties (llama.cpp writes every cell at start); others ignore it
PAGES_ON_USE_ENV = "GGML_PAGES_ON_USE"
# backends that compute on a GPU, as system-info names them (`CUDA : ARCHS = 900 | ...`)
GPU_BACKENDS = ("CUDA", "Metal", "Vulkan", "HIP", "ROCm", "SYCL", "OpenCL", "MUSA", "CANN")


def disable_tiled_kernels() -> None:
    """Keep llama.cpp's tiled K-quant matmul (taken from 8 rows on) out of this process."""
    os.environ.setdefault(TILED_ENV, "0")


# Every process that loads this engine wants them off, before its first decode.
disable_tiled_kernels()


def system_info() -> str:
    """llama.cpp's own description of its build: `CPU : AVX2 = 1 | ...`."""
    return L.llama_print_system_info().decode("utf-8", "replace").strip()


def features(info: str) -> dict[str, str]:
    """The `NAME = value` pairs of a system-info line."""
    found: dict[str, str] = {}
    for part in info.replace("CPU :", "|").split("|"):
        name, sep, value = part.partition("=")
        if sep:
            found[name.strip()] = value.strip()
    return found


def batch_dependent_kernels(info: str | None = None) -> list[str]:
    """The kernels compiled into the loaded library (or `info`) whose results depend on the batch shape and
    that an exact process would run: not those of the extra buffer types, which it leaves off or holds to
    the exact types (`exact_repacking`), nor a patched sgemm."""
    present = features(system_info() if info is None else info)
    compiled = [name for name in BATCH_DEPENDENT if present.get(name, "0") != "0"]
    if present.get(INVARIANT_SGEMM, "0") != "0":
        compiled.remove("LLAMAFILE")
    return compiled


def exact_wanted() -> bool:
    """Whether this process computes so that a token's logits ignore its batch: all but a fast worker's."""
    return os.environ.get(EXACT_ENV, "1") != "0"


def gpu_backends(info: str | None = None) -> list[str]:
    """The GPU backends compiled into the loaded library (or `info`): empty on a CPU build."""
    named = {part.split(" :", 1)[0].strip() for part in (system_info() if info is None else info).split("|")}
    return [name for name in GPU_BACKENDS if name in named]


def amx_compiled(info: str | None = None) -> bool:
    """Whether the loaded library (or `info`) has AMX kernels. llama.cpp runs them only on weights in its
    extra buffer types, which `LlamaModel` then leaves off (repacked weights go with them): AMX faults in
    some virtual machines, and its results depend on the batch. llama.cpp's default build has them on a CPU
    with AMX, as a plain `pip install` compiles it; the Makefile compiles them out."""
    return features(system_info() if info is None else info).get("AMX_INT8", "0") != "0"


def exact_repacking(info: str | None = None) -> bool:
    """Whether an exact process may put weights in llama.cpp's extra buffer types: where the loaded library (or
    `info`) repacks only the types whose kernels ignore the batch, that switch is on, and no AMX is compiled
    in (its buffer type would take the other types)."""
    info = system_info() if info is None else info
    if amx_compiled(info) or features(info).get(REPACK_EXACT, "0") == "0":
        return False
    return os.environ.get(REPACK_EXACT_ENV, "0") == "1"


def tiled_holdable(info: str | None = None) -> bool:
    """Whether the loaded library (or `info`) can hold its tiled K-quant kernels to the types they compute
    exactly (it names TILED_EXACT)."""
    return features(system_info() if info is None else info).get(TILED_EXACT, "0") != "0"


def tiled_problem(info: str | None = None) -> str | None:
    """Why llama.cpp's tiled K-quant kernels would let the batch change a token's logits in this process (see
    `disable_tiled_kernels`), or None: they are off, or held to the types they compute exactly."""
    if os.environ.get(TILED_ENV, "1") == "0":
        return None
    if not tiled_holdable(info):
        return f"tiled K-quant kernels are on ({TILED_ENV} is not 0)"
    if os.environ.get(TILED_EXACT_ENV, "0") != "1":
        return f"tiled K-quant kernels take every K-quant type ({TILED_EXACT_ENV} is not 1)"
    return None


def flash_attention_problem(info: str | None = None) -> str | None:
    """Why flash attention would let the batch change a token's logits in this process, or None."""
    if features(system_info() if info is None else info).get(FA_ONE_ORDER, "0") == "0":
        return "this llama.cpp's flash attention splits its work by the batch's size (it lacks our patch)"
    if os.environ.get(FA_ORDER_ENV, "0") == "0":
        return f"its flash attention is not held to one order ({FA_ORDER_ENV} is not 1)"
    return None


def exactness_problems(info: str | None = None) -> list[str]:
    """What in the loaded library (or `info`) lets the batch shape change a token's logits in an exact process
    (whose extra buffer types hold only exact types, if any); empty when nothing does."""
    problems = [f"{name} kernels are compiled in" for name in batch_dependent_kernels(info)]
    problems += [f"the {name} backend is compiled in" for name in gpu_backends(info)]
    if tiled := tiled_problem(info):
        problems.append(tiled)
    return problems


def exact_cmake_args(machine: str | None = None) -> str:
    """The CMAKE_ARGS that compile llama-cpp-python without the batch-dependent kernels, for this CPU
    (the Makefile's LLAMA_CMAKE_ARGS; the Dockerfile's, but for a portable baseline)."""
    if (machine or platform.machine()) in ARM64_MACHINES:
        # llama.cpp's own probe of the CPU then adds +noi8mm to -mcpu; a -U__ARM_FEATURE_MATMUL_INT8 among
        # the C flags would not hold with GCC, whose arm_neon.h defines the macro again from the -mcpu
        arch = "-DGGML_MACHINE_SUPPORTS_i8mm=OFF"
    else:
        amx_off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        arch = f"-DCMAKE_C_FLAGS='{amx_off}' -DCMAKE_CXX_FLAGS='{amx_off}'"
    return f"-DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF -DGGML_CPU_KLEIDIAI=OFF {arch}"


def exact_refusal(info: str | None = None) -> str | None:
    """Why `--kernels exact` cannot run on the loaded library (or `info`), and how to fix it, in one line;
    None when it can."""
    on_gpu = gpu_backends(info)
    if on_gpu:
        return (
            f"--kernels exact is not offered on a GPU build, and this llama.cpp has {', '.join(on_gpu)}: its "
            "promise, a token's logits whatever shares its batch, rests on CPU kernels chosen at build time, and "
            "the GPU kernels llama.cpp picks by batch size have not been shown to keep it; serve --kernels fast "
            "here, or --kernels exact on a CPU build (`make serve`; docs/deployment/gpu.md)"
        )
    compiled = batch_dependent_kernels(info)
    if compiled:
        # pip caches the wheel it built by the source's address, not its flags: --no-cache-dir builds anew
        install = (
            f'CMAKE_ARGS="{exact_cmake_args()}" {sys.executable} -m pip install --force-reinstall --no-deps '
            f"--no-cache-dir --no-binary llama-cpp-python llama-cpp-python=={L.__version__}"
        )
        return (
            f"--kernels exact needs llama-cpp-python compiled without the kernels whose results depend on the batch, "
            f"and this one has {', '.join(compiled)} (pip compiles it with llama.cpp's defaults, since a package "
            f"cannot set its dependencies' flags); recompile it with: {install}"
        )
    if tiled_problem(info) is None:
        return None
    if not tiled_holdable(info):
        return f"--kernels exact needs llama.cpp's tiled K-quant kernels off: unset {TILED_ENV} or set it to 0"
    return (
        "--kernels exact needs llama.cpp's tiled K-quant kernels held to the weight types they compute exactly: "
        f"set {TILED_EXACT_ENV}=1, or {TILED_ENV}=0"
    )


def fast_library() -> Path | None:
    """The directory of llama.cpp's own build (`$SUPERFLUID_FAST_LIB`, else `.venv/llama-fast`), if installed."""
    configured = os.environ.get(FAST_LIBRARY_ENV, "").strip()
    where = Path(configured).expanduser() if configured else Path(sys.prefix) / "llama-fast"
    return where if (where / "libllama.so").exists() else None


def fast_build_exact() -> bool:
    """Whether the fast build `make` installs can run exact kernels here: on x86 and arm64, where our patches
    hold its kernels to one order (on other CPUs llamafile's sgemm takes no one-token products), and not on a
    GPU build (whose backend both libraries have)."""
    return platform.machine() in X86_MACHINES + ARM64_MACHINES and not gpu_backends()


def flash_attention_on(library: Path | None) -> bool:
    """Whether a worker on `library` (None: the one llama-cpp-python loads by itself) runs flash attention: on
    the fast build, whose patch holds it to one order on exact kernels (`worker_environment` sets the switch),
    and not on the wheel, whose flash attention splits its work by the batch."""
    return library is not None


def llama_cpp_environment() -> dict[str, str]:
    """This process's environment without the switches `worker_environment` sets: what llama.cpp's own programs
    (llama-server, llama-batched-bench) run with at their defaults, tiled kernels on, whatever this process runs."""
    ours = {LIBRARY_ENV, *worker_environment(None, exact=True)}
    return {name: value for name, value in os.environ.items() if name not in ours}


def worker_environment(library: Path | None, exact: bool) -> dict[str, str]:
    """What a worker's environment needs to run on `library` (None: the one llama-cpp-python loads by
    itself): exactly (tiled kernels and repacked weights only for the types whose kernels ignore the batch, on
    the wheel no tiled kernels, flash attention in one order), or with every fast kernel; on either, KV memory
    taken as it is written."""
    switch = str(int(exact))
    environment = {
        TILED_ENV: str(int(not exact or library is not None)),
        TILED_EXACT_ENV: switch,
        EXACT_ENV: switch,
        FA_ORDER_ENV: switch,
        REPACK_EXACT_ENV: switch,
        MATMUL_ORDER_ENV: switch,
        PAGES_ON_USE_ENV: "1",
    }
    return environment if library is None else {LIBRARY_ENV: str(library), **environment}
