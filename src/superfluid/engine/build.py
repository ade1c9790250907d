"""Which llama.cpp library a model runs on, and is it built so that batching never changes a token's arithmetic?

Two builds of the same llama.cpp are installed. The wheel llama-cpp-python loads in every
process is the exact one (below). The fast one is llama.cpp as it builds itself, with every
kernel this CPU has (and scripts/patches, which change no result); `make` installs it at
`.venv/llama-fast` and a worker loads it through llama-cpp-python's `LLAMA_CPP_LIB_PATH`.
The fast build prefills 1.06-1.4x faster, by CPU, and its logits depend on the batch:
`--kernels fast` (the default) trades exact continuations for that speed, `--kernels exact`
keeps them.

llama.cpp picks some matrix kernels by how many tokens share a batch: llamafile's sgemm
from two tokens on, repacked weights (gemm for groups of four, gemv for the rest), AMX
tiles, arm64's int8 matrix-multiply kernels for even batch sizes, and the tiled K-quant
kernels from eight rows on. Each of them rounds differently from the one-token kernel, so a
prompt prefilled in bulk, a token decoded alone and a lane batched with others would get
logits that differ in the last bits, and greedy text flips wherever two logits are close.
The Makefile compiles llama.cpp without the first four; the tiled kernels are switched off
by `GGML_CPU_TILED_MM=0`, which must be in the environment before the first decode.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import llama_cpp as L

FAST_LIBRARY_ENV = "SUPERFLUID_FAST_LIB"  # a directory holding the fast build's libllama.so

# system-info features whose kernels depend on the batch shape
BATCH_DEPENDENT = ("LLAMAFILE", "REPACK", "AMX_INT8", "MATMUL_INT8", "KLEIDIAI")
TILED_ENV = "GGML_CPU_TILED_MM"


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


def exactness_problems(info: str | None = None) -> list[str]:
    """What in the loaded library (or `info`) lets the batch shape change a token's logits; empty when nothing does."""
    present = features(system_info() if info is None else info)
    problems = [f"{name} kernels are compiled in" for name in BATCH_DEPENDENT if present.get(name, "0") != "0"]
    if os.environ.get(TILED_ENV, "1") != "0":
        problems.append(f"tiled K-quant kernels are on ({TILED_ENV} is not 0)")
    return problems


def fast_library() -> Path | None:
    """The directory of llama.cpp's own build (`$SUPERFLUID_FAST_LIB`, else `.venv/llama-fast`), if installed."""
    configured = os.environ.get(FAST_LIBRARY_ENV, "").strip()
    where = Path(configured).expanduser() if configured else Path(sys.prefix) / "llama-fast"
    return where if (where / "libllama.so").exists() else None


def fast_environment(library: Path) -> dict[str, str]:
    """What a worker's environment needs to run on the fast build: its library, its tiled kernels on."""
    return {"LLAMA_CPP_LIB_PATH": str(library), TILED_ENV: "1"}
