"""The devices llama.cpp computes on, and whether a context's KV fits on its GPUs.

llama.cpp is built for the CPU by default (`make serve`), for CUDA with `make serve GPU=cuda` and for
Metal with `GPU=metal` (docs/deployment/gpu.md); where a model's layers go is `placement.py`.
`devices()` is what ggml's backend registry reports (name, description, kind, memory).
`kv_refusal` compares the KV a context's slots need with what is free on the GPUs once the
weights are there, so lanes of a context that do not fit are refused at start with the
numbers, never by an out-of-memory error in the middle of a request. A CPU build has no GPU
device and nothing to check: its KV is in host memory, like its weights.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as L

from .interface import DeviceFigures, DeviceReport, EngineError

KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # ggml_backend_dev_type, in its order
GIB = 1 << 30
CELL_ROUND = 256  # llama.cpp pads a context's cells to a multiple of this: a window that fits is rounded down to it


@dataclass(frozen=True)
class Device:
    """One device of ggml's backend registry: `CUDA0`, `Metal`, `CPU`, with its memory in bytes."""

    name: str
    description: str
    kind: str  # one of KINDS
    free: int
    total: int
    handle: int = field(default=0, repr=False, compare=False)  # ggml's, for llama_model_params.devices

    @property
    def gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.description})" if self.description else self.name

    def as_dict(self) -> DeviceFigures:
        return {
            "name": self.name,
            "description": self.description,
            "kind": self.kind,
            "free": self.free,
            "total": self.total,
            "used": self.total - self.free,
        }


@functools.cache
def _ggml() -> ctypes.CDLL:
    """libggml beside the libllama this process loaded (its dependency, so the same registry)."""
    folder = Path(L.llama_cpp._lib._name).parent
    found = [folder / name for name in ("libggml.so", "libggml.dylib") if (folder / name).exists()]
    if not found:
        raise EngineError(f"no libggml beside {L.llama_cpp._lib._name}")
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    size = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size, size]
    return lib


def _kind(code: int) -> str:
    return KINDS[code] if 0 <= code < len(KINDS) else str(code)


def devices() -> list[Device]:
    """Every device llama.cpp's backends report, in the registry's order; their memory as of now."""
    lib = _ggml()
    found = []
    for handle in (lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())):
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        found.append(
            Device(
                (lib.ggml_backend_dev_name(handle) or b"").decode("utf-8", "replace"),
                (lib.ggml_backend_dev_description(handle) or b"").decode("utf-8", "replace"),
                _kind(lib.ggml_backend_dev_type(handle)),
                free.value,
                total.value,
                handle,
            )
        )
    return found


def gpus(indices: tuple[int, ...] = ()) -> list[Device]:
    """The GPUs `--gpu` names (every GPU for none); EngineError for an index that is not there."""
    found = [d for d in devices() if d.gpu]
    missing = [i for i in indices if i >= len(found)]
    if missing:
        raise EngineError(f"--gpu {missing[0]}: llama.cpp sees {len(found)} GPU(s) on this machine")
    return [found[i] for i in indices] if indices else found


def offload_supported() -> bool:
    """Whether the loaded llama.cpp can put layers on a GPU (a CUDA or Metal build, with a GPU present)."""
    return bool(L.llama_supports_gpu_offload())


@dataclass(frozen=True)
class KVShape:
    """What one token's KV costs in a model: its layers, KV heads, key and value widths, bytes a value
    (2: llama.cpp's default f16 cache)."""

    layers: int
    kv_heads: int
    key_width: int
    value_width: int
    value_bytes: int = 2

    def token_bytes(self, layers: int | None = None) -> int:
        """One token's KV over `layers` of them (all by default)."""
        held = self.layers if layers is None else layers
        return held * self.kv_heads * (self.key_width + self.value_width) * self.value_bytes


def layers_on_gpu(gpu_layers: int, layers: int) -> int:
    """The repeating layers n_gpu_layers puts on the GPUs (llama.cpp counts the output layer first)."""
    return layers if gpu_layers < 0 else max(0, min(layers, gpu_layers - 1))


def compute_bytes(heads: int, batch: int, window: int, vocab: int) -> int:
    """A bound on a context's compute buffers on the device: one batch's attention scores against a
    window (plain attention), its logits, and a fixed allowance for the rest."""
    return batch * (heads * window + vocab) * 4 + GIB // 2


def gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


def kv_refusal(token_bytes: int, slots: int, window: int, free: int, where: str) -> str | None:
    """Why `slots` KV slots of `window` tokens do not fit in `free` bytes on `where`, with what would; None
    when they fit. `free` is what is left once the weights and compute buffers are placed."""
    need = token_bytes * slots * window
    if need <= free:
        return None
    room = max(0, free)
    fewer = room // (token_bytes * window)
    shorter = room // (token_bytes * slots) // CELL_ROUND * CELL_ROUND
    asked = (
        f"{slots} KV slots of {window} tokens need {gib(need)} of KV on {where}, "
        f"{gib(room)} free after the weights and compute buffers"
    )
    if not fewer and not shorter:
        return f"{asked}: not even one slot of {CELL_ROUND} tokens fits; put fewer layers there (--gpu-layers)"
    options = [f"{fewer} slot{'s' if fewer > 1 else ''} of {window}"] if fewer else []
    options += [f"{slots} slots of {shorter}"] if shorter else []
    return (
        f"{asked}: at most {' or '.join(options)} fit (fewer lanes with --max-batch, a shorter window with "
        "--max-context: a daemon's slots are its lanes and a few spare that keep finished prefixes)"
    )


def describe(report: DeviceReport) -> str | None:
    """A device report in words, such as `33/33 layers on CUDA0 (NVIDIA H200), 21.4 GiB used of 139.7 GiB`;
    None when the model's layers are all in host memory."""
    found = {d["name"]: d for d in report["devices"]}
    parts = []
    for name in report["gpus"]:
        device = found.get(name)
        if device is None:
            parts.append(name)
            continue
        label = f"{name} ({device['description']})" if device["description"] else name
        parts.append(f"{label}, {gib(device['used'])} used of {gib(device['total'])}")
    return f"{report['gpu_layers']}/{report['layers']} layers on {'; '.join(parts)}" if parts else None
