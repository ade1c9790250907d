"""Is the llama.cpp library we loaded built so that batching never changes a token's arithmetic?

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

import llama_cpp as L

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
