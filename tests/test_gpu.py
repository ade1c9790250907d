"""GPU builds, tested where there is no GPU: the flags and their checks, the Makefile's choice of build,
the KV sizing against a GPU's reported memory and its refusal, the device report of a CPU build, and
a CPU build refusing layers on a GPU at start. Nothing here has run on a GPU (docs/deployment/gpu.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from random_model import SIZES

from superfluid.cli.main import build_parser
from superfluid.engine.build import exact_refusal, gpu_backends
from superfluid.engine.devices import (
    GIB,
    KVShape,
    compute_bytes,
    describe,
    devices,
    kv_refusal,
    layers_on_gpu,
    offload_supported,
)
from superfluid.engine.interface import ContextShape, DeviceReport, EngineError
from superfluid.engine.llama import LlamaModel, kv_room
from superfluid.engine.placement import ALL_LAYERS, Placement
from superfluid.metrics import device_memory
from superfluid.model.resolve import embedded_model
from superfluid.views.figures import Figures

ROOT = Path(__file__).resolve().parent.parent
# Llama-3-8B's KV: 32 layers, 8 KV heads of 128, f16: 128 KiB a token
LLAMA_8B = KVShape(layers=32, kv_heads=8, key_width=128, value_width=128)
H200: DeviceReport = {
    "devices": [
        {"name": "CUDA0", "description": "NVIDIA H200", "kind": "gpu", "free": 118 * GIB, "total": 140 * GIB,
         "used": 22 * GIB},
        {"name": "CPU", "description": "Intel Xeon", "kind": "cpu", "free": 900 * GIB, "total": 1000 * GIB,
         "used": 100 * GIB},
    ],
    "gpus": ["CUDA0"],
    "gpu_layers": 33,
    "layers": 33,
}  # fmt: skip


# --- flags -----------------------------------------------------------------------------------


def test_the_gpu_flags_parse_into_the_config() -> None:
    args = build_parser().parse_args(["serve", "--gpu-layers", "all", "--gpu", "0,1", "--tensor-split", "3,1"])
    assert (args.gpu_layers, args.gpu, args.tensor_split) == (ALL_LAYERS, (0, 1), (3.0, 1.0))
    args = build_parser().parse_args(["serve", "--gpu-layers", "12"])
    assert (args.gpu_layers, args.gpu, args.tensor_split) == (12, (), ())
    assert build_parser().parse_args(["serve"]).gpu_layers is None  # all on a GPU build, none on a CPU one


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--gpu-layers", "some", "expected all or a number of layers"),
        ("--gpu", "0,0", "each once"),
        ("--gpu", "cuda0", "GPU indices"),
        ("--tensor-split", "0,0", "not all 0"),
        ("--tensor-split", "3;1", "proportions per GPU"),
    ],
)
def test_a_bad_gpu_flag_is_refused_with_what_is_accepted(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["serve", flag, value])
    assert exit.value.code == 2
    assert says in capsys.readouterr().err


def test_the_gpu_variables_are_read_as_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERFLUID_GPU_LAYERS", "20")
    monkeypatch.setenv("SUPERFLUID_GPU", "1")
    monkeypatch.setenv("SUPERFLUID_TENSOR_SPLIT", "1,1")
    args = build_parser().parse_args(["serve"])
    assert (args.gpu_layers, args.gpu, args.tensor_split) == (20, (1,), (1.0, 1.0))


def test_a_placement_travels_through_its_variables() -> None:
    for placement in (Placement(), Placement(ALL_LAYERS), Placement(0), Placement(12, (0, 1), (3.0, 1.0))):
        assert Placement.from_environment(placement.environment()) == placement
    assert Placement().environment() == {}  # an empty variable would be refused as a flag's value
    with pytest.raises(ValueError, match="does not parse"):
        Placement.from_environment({"SUPERFLUID_GPU_LAYERS": "many"})


def test_layers_on_a_gpu_are_refused_on_a_build_without_one() -> None:
    assert Placement().layers(offload=True) == ALL_LAYERS
    assert Placement().layers(offload=False) == 0
    assert Placement(0).layers(offload=False) == 0
    assert Placement(12).layers(offload=True) == 12
    for asked in (4, ALL_LAYERS):
        with pytest.raises(ValueError, match="built for the CPU only") as refused:
            Placement(asked).layers(offload=False)
        assert "make serve GPU=cuda" in str(refused.value) and "--gpu-layers 0" in str(refused.value)


# --- the Makefile's builds -------------------------------------------------------------------

PRINT = 'vars: ; @printf "%s\\n" "$(LLAMA_CMAKE_ARGS)" "$(FAST_CMAKE_ARGS)" "$(WHEELS)" "$(PEERS)" "$(STAMP)"'


def make_vars(*assignments: str, path: str | None = None) -> list[str]:
    """The Makefile's build variables under `assignments`: cmake args of the wheel and of the fast build, the
    wheel's cache, the peers' directory, the stamp."""
    environment = {**os.environ, "PATH": path} if path is not None else None
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval", PRINT, "vars", *assignments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=environment,
        check=True,
    )
    return done.stdout.splitlines()


def test_the_cpu_build_is_the_default_and_names_nothing_of_a_gpu() -> None:
    llama, fast, _, peers, stamp = make_vars()
    assert llama.startswith("-DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF -DGGML_CPU_KLEIDIAI=OFF ")
    assert "CUDA" not in llama + fast and "METAL" not in llama + fast
    assert not llama.endswith(" ") and not fast.endswith(" ")  # the wheel's name hashes these very characters
    assert stamp == ".venv/.installed" and "cuda" not in peers


def test_a_cuda_build_compiles_both_libraries_for_the_architectures_asked() -> None:
    cpu = make_vars()
    llama, fast, wheels, peers, stamp = make_vars("GPU=cuda", "CUDA_ARCHS=90")
    for args in (llama, fast):
        assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES='90'" in args
    assert llama.startswith(cpu[0]) and fast.startswith(cpu[1])  # the CPU part as the CPU build has it
    assert wheels != cpu[2] and peers.startswith(cpu[3] + "-cuda-") and stamp.startswith(".venv/.installed-cuda-")
    assert "CMAKE_CUDA_ARCHITECTURES='native'" in make_vars("GPU=cuda")[0]
    assert make_vars("GPU=cuda")[2] != wheels  # each list of architectures its own wheel
    recipe = subprocess.run(["make", "-n", "serve", "GPU=cuda", "CUDA_ARCHS=90"], cwd=ROOT, capture_output=True)
    assert b'CMAKE_ARGS="-DGGML_NATIVE=ON' in recipe.stdout and b"-DGGML_CUDA=ON" in recipe.stdout


def test_auto_picks_cuda_where_nvcc_is_found_with_a_gpu_to_build_for(tmp_path: Path) -> None:
    def tool(name: str, says: str) -> None:
        (tmp_path / name).write_text(f"#!/bin/sh\necho '{says}'\n")
        (tmp_path / name).chmod(0o755)

    tool("nvcc", "")
    with_nvcc = f"{tmp_path}:/usr/bin:/bin"
    assert make_vars("GPU=auto", path=with_nvcc) == make_vars(), "nvcc and no GPU: the CPU build"
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES='90'" in make_vars("GPU=auto", "CUDA_ARCHS=90", path=with_nvcc)[0]
    tool("nvidia-smi", "GPU 0: NVIDIA H100 (UUID: GPU-0)")
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES='native'" in make_vars("GPU=auto", path=with_nvcc)[0]
    assert make_vars("GPU=auto", path="/usr/bin:/bin") == make_vars()  # no nvcc: the CPU build
    assert "-DGGML_METAL=ON" in make_vars("GPU=metal")[0]


def test_an_unknown_gpu_is_refused_by_make() -> None:
    done = subprocess.run(["make", "-n", "serve", "GPU=rocm"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and "expected cuda, metal or auto" in done.stderr


# --- KV sizing from a GPU's memory -----------------------------------------------------------


def test_one_token_s_kv_is_counted_over_the_layers_on_the_gpu() -> None:
    assert LLAMA_8B.token_bytes() == 128 << 10
    assert LLAMA_8B.token_bytes(layers_on_gpu(ALL_LAYERS, 32)) == 128 << 10
    assert [layers_on_gpu(n, 32) for n in (0, 1, 4, 32, 33, 99)] == [0, 0, 3, 31, 32, 32]  # output layer first
    assert compute_bytes(32, 512, 8192, 128256) < 2 * GIB


def test_what_fits_is_served_and_what_does_not_is_refused_with_the_numbers() -> None:
    token = LLAMA_8B.token_bytes()
    assert kv_refusal(token, 12, 8192, 12 * GIB, "CUDA0 (NVIDIA H200)") is None  # exactly full
    refusal = kv_refusal(token, 12, 8192, 10 * GIB, "CUDA0 (NVIDIA H200)")
    assert refusal == (
        "12 KV slots of 8192 tokens need 12.0 GiB of KV on CUDA0 (NVIDIA H200), 10.0 GiB free after the weights "
        "and compute buffers: at most 10 slots of 8192 or 12 slots of 6656 fit (fewer lanes with --max-batch, "
        "a shorter window with --max-context: a daemon's slots are its lanes and a few spare that keep finished "
        "prefixes)"
    )
    # 6656 is a multiple of llama.cpp's 256-cell padding, and it fits where 6912 would not
    assert 12 * 6656 * token <= 10 * GIB < 12 * 6912 * token
    short = kv_refusal(token, 12, 32768, 3 * GIB, "CUDA0")
    assert short is not None and "at most 12 slots of 2048 fit" in short  # not one slot of 32768
    one = kv_refusal(token, 12, 32768, 5 * GIB, "CUDA0")
    assert one is not None and "at most 1 slot of 32768 or 12 slots of 3328 fit" in one
    assert "not even one slot" in (kv_refusal(token, 12, 8192, -GIB, "CUDA0") or "")  # the weights took it all


def test_a_cpu_build_has_no_gpu_and_nothing_to_size(tmp_path: Path) -> None:
    assert not offload_supported() and gpu_backends() == []
    found = devices()
    assert found and not any(d.gpu for d in found)
    cpu = next(d for d in found if d.kind == "cpu")
    assert 0 < cpu.free <= cpu.total and cpu.as_dict()["used"] == cpu.total - cpu.free
    model = LlamaModel(embedded_model().path)
    try:
        assert (model.gpus, model.gpu_layers) == ([], 0)
        report = model.device_report()
        assert report["gpus"] == [] and report["gpu_layers"] == 0
        assert report["layers"] == model.kv_shape().layers + 1
        assert [(d["name"], d["kind"]) for d in report["devices"]] == [(d.name, d.kind) for d in found]
        assert describe(report) is None
        assert kv_room(model, ContextShape(1 << 20, 64, 512, 1)) is None  # host memory: no device to size
    finally:
        model.close()
    with pytest.raises(EngineError, match="built for the CPU only"):
        LlamaModel(embedded_model().path, placement=Placement(4))


def test_a_gpu_report_reads_as_a_line_a_gauge_and_a_monitor_figure() -> None:
    assert describe(H200) == "33/33 layers on CUDA0 (NVIDIA H200), 22.0 GiB used of 140.0 GiB"
    runtime = SimpleNamespace(id="llama-8b", engine=SimpleNamespace(device_report=lambda: H200))
    family = device_memory([runtime])
    samples = {(s.labels["device"], s.labels["kind"]): s.value for s in family.samples}
    assert samples == {("CUDA0", "used"): 22 * GIB, ("CUDA0", "free"): 118 * GIB, ("CUDA0", "total"): 140 * GIB}
    cpu_only: DeviceReport = {**H200, "gpus": [], "gpu_layers": 0}
    cpu_runtime = SimpleNamespace(id="m", engine=SimpleNamespace(device_report=lambda: cpu_only))
    assert device_memory([cpu_runtime]).samples == []  # a CPU build: no device rows
    exposition = "".join(
        f'superfluid_device_memory_bytes{{model="llama-8b",device="CUDA0",kind="{kind}"}} {value}\n'
        for (_, kind), value in samples.items()
    )
    assert Figures.parse(exposition).gpus == {"CUDA0": {"used": 22 * GIB, "free": 118 * GIB, "total": 140 * GIB}}


def test_exact_kernels_are_refused_on_a_gpu_build() -> None:
    cuda = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX2 = 1 |"
    assert gpu_backends(cuda) == ["CUDA"]
    refusal = exact_refusal(cuda)
    assert refusal is not None and "not offered on a GPU build" in refusal and "CUDA" in refusal
    assert gpu_backends("Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 |") == ["Metal"]
    assert gpu_backends("CPU : SSE3 = 1 | AVX2 = 1 |") == []


def test_the_gpu_check_is_ready_to_run() -> None:
    """scripts/gpu_check.sh parses, and the model it writes is Llama-3-8B's shape on SmolLM2's vocabulary."""
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
    eight = SIZES["8b"]
    assert (eight.heads, eight.head_dim, eight.kv_heads) == (32, 128, 8)
    assert 7.0e9 < eight.parameters(49152) < 7.5e9
    assert eight.name("f16") == "random-llama-w4096-l32-f14336-kv8-h128-f16"
    assert SIZES["0.7b"].name() == "random-llama-w1536-l24-f4096-kv8-q4_1"  # the cached file keeps its name


# --- at start --------------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_cpu_build_asked_for_gpu_layers_does_not_start(tmp_path: Path) -> None:
    places = ["--sessions", str(tmp_path / "sessions"), "--socket", str(tmp_path / "sf.sock")]
    done = subprocess.run(
        [sys.executable, "-m", "superfluid", "serve", "--gpu-layers", "4", "--no-http", "--no-tui", *places],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "--gpu-layers 4 asks for layers on a GPU" in done.stderr and "make serve GPU=cuda" in done.stderr
