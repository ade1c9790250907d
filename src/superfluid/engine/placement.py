"""Where a model's layers go: what `--gpu-layers`, `--gpu` and `--tensor-split` ask for.

core/runtime.py hands a `Placement` to the model it loads in the daemon (without workers), and to
a worker process through the flags' `SUPERFLUID_*` variables in its environment, beside
`SUPERFLUID_FAST_LIB`. Nothing here loads llama.cpp: every command reads these parsers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

GPU_LAYERS_ENV = "SUPERFLUID_GPU_LAYERS"
GPUS_ENV = "SUPERFLUID_GPU"
TENSOR_SPLIT_ENV = "SUPERFLUID_TENSOR_SPLIT"
ALL_LAYERS = -1  # llama.cpp's n_gpu_layers for every layer, the output layer included


def parse_gpu_layers(text: str) -> int:
    """`all` (every layer, -1) or a number of layers from 0."""
    if text.strip().lower() == "all":
        return ALL_LAYERS
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected all or a number of layers from 0, not {text!r}") from None
    if value < 0:
        raise ValueError(f"expected all or a number of layers from 0, not {text!r}")
    return value


def parse_gpus(text: str) -> tuple[int, ...]:
    """GPU indices, such as `0` or `0,1`: each once, from 0."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"expected GPU indices such as 0 or 0,1, each once, not {text!r}")
    return tuple(int(p) for p in parts)


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """Proportions of the model per GPU, such as `3,1`: numbers from 0, not all 0."""
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"expected proportions per GPU such as 3,1, not {text!r}") from None
    if not all(math.isfinite(v) and v >= 0 for v in values) or not any(values):
        raise ValueError(f"expected proportions per GPU from 0, not all 0, such as 3,1, not {text!r}")
    return values


@dataclass(frozen=True)
class Placement:
    """Where a model's layers go: `--gpu-layers` (None: every layer on a GPU build, none on a CPU
    one), `--gpu` (GPU indices; empty: every GPU) and `--tensor-split` (proportions per GPU)."""

    gpu_layers: int | None = None
    gpus: tuple[int, ...] = ()
    tensor_split: tuple[float, ...] = ()

    def environment(self) -> dict[str, str]:
        """The `SUPERFLUID_*` variables that say this placement, for a worker's environment; none for a
        default (an empty variable would be refused as a flag's value)."""
        said = {}
        if self.gpu_layers is not None:
            said[GPU_LAYERS_ENV] = "all" if self.gpu_layers < 0 else str(self.gpu_layers)
        if self.gpus:
            said[GPUS_ENV] = ",".join(map(str, self.gpus))
        if self.tensor_split:
            said[TENSOR_SPLIT_ENV] = ",".join(f"{v:g}" for v in self.tensor_split)
        return said

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Placement:
        """The placement the variables say (the defaults where they are unset or empty)."""
        environ = os.environ if environ is None else environ
        layers, gpus, split = (environ.get(name, "").strip() for name in (GPU_LAYERS_ENV, GPUS_ENV, TENSOR_SPLIT_ENV))
        try:
            return cls(
                parse_gpu_layers(layers) if layers else None,
                parse_gpus(gpus) if gpus else (),
                parse_tensor_split(split) if split else (),
            )
        except ValueError as e:
            raise ValueError(f"the GPU placement in the environment does not parse: {e}") from None

    def layers(self, offload: bool) -> int:
        """The n_gpu_layers to load with, on a build that can (`offload`) or cannot put layers on a GPU;
        ValueError, saying why and what to do, when layers are asked of a build with no GPU."""
        if self.gpu_layers is None:
            return ALL_LAYERS if offload else 0
        if self.gpu_layers != 0 and not offload:
            asked = "all" if self.gpu_layers < 0 else str(self.gpu_layers)
            raise ValueError(
                f"--gpu-layers {asked} asks for layers on a GPU, and this llama.cpp has none to put them on: it "
                "is built for the CPU only (build it for CUDA with `make serve GPU=cuda`, for Metal with GPU=metal "
                "on macOS: docs/deployment/gpu.md), or no GPU is visible to it; or serve with --gpu-layers 0"
            )
        return self.gpu_layers
