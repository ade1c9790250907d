"""Which llama.cpp library and kernels a model runs on: the fast build (scripts/patches applied), exactly by
default (on x86 and arm64) or with every kernel on `--kernels fast`, or llama-cpp-python's own library.

The worker's memory map names the library it loaded and its environment the kernels it was told to run
(`superfluid.engine.build.worker_environment`), so these tests see the process itself, not a flag echoed
back. What they generate is checked with what holds on every machine
(a forced length with end-of-generation banned), since the fast kernels' text is this CPU's.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import llama_cpp
import pytest
from conftest import DaemonProcess, HttpDaemon, forced, new_session, say

from superfluid.engine.build import (
    EXACT_ENV,
    FA_ORDER_ENV,
    MATMUL_ORDER_ENV,
    REPACK_EXACT_ENV,
    TILED_ENV,
    TILED_EXACT_ENV,
    fast_build_exact,
    fast_library,
)

pytestmark = pytest.mark.e2e

WHEEL_LIBRARY = (Path(llama_cpp.__file__).parent / "lib").resolve()  # llama-cpp-python's own libllama


def loaded_libllama(daemon: HttpDaemon) -> tuple[str, Path, dict[str, str]]:
    """The default model's kernels and attention as /v1/models reports them ("exact, flash"), the libllama its
    worker has mapped, and the kernel switches in the worker's environment."""
    entry = next(m for m in httpx.get(f"{daemon.url}/v1/models").json()["data"] if m["default"])
    pid = entry["runtime"]["worker_pid"]
    maps = Path(f"/proc/{pid}/maps").read_text().split("\n")
    paths = {Path(line.split()[-1]) for line in maps if "libllama.so" in line}
    assert len(paths) == 1, paths
    variables = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    switches = {
        name: variables.get(name, "")
        for name in (EXACT_ENV, TILED_ENV, TILED_EXACT_ENV, FA_ORDER_ENV, REPACK_EXACT_ENV, MATMUL_ORDER_ENV)
    }
    reported = f"{entry['runtime']['kernels']}, {entry['runtime']['attention']}"
    return reported, paths.pop().parent.resolve(), switches


def serves_a_forced_length(daemon: DaemonProcess, tokens: int) -> None:
    """A generation with end-of-generation banned yields exactly `tokens` tokens, on any kernels."""
    with daemon.client() as c:
        session = new_session(c)
        say(c, session, "Count from one to twenty.")
        forced(c, session, tokens)


def test_a_daemon_runs_exact_kernels_by_default_on_the_library_that_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = fast_library()
    assert library is not None, "make installs llama.cpp's own build at .venv/llama-fast"
    monkeypatch.delenv("SUPERFLUID_KERNELS")
    daemon = HttpDaemon(tmp_path, max_context=1024, max_batch=2).start()
    try:
        assert "on exact kernels" in daemon.log.read_text()
        kernels, loaded, switches = loaded_libllama(daemon)
        if fast_build_exact():
            expected, tiled = ("exact, flash", library.resolve()), "1"
        else:  # a CPU our patches do not cover (neither x86 nor arm64): the wheel runs exact kernels
            expected, tiled = ("exact, plain", WHEEL_LIBRARY), "0"
        assert (kernels, loaded) == expected
        # repacked weights and tiled kernels only for the types they compute exactly (the wheel's tiled kernels
        # are not held to any type: off); flash attention in one order
        assert switches == {
            EXACT_ENV: "1",
            TILED_ENV: tiled,
            TILED_EXACT_ENV: "1",
            FA_ORDER_ENV: "1",
            REPACK_EXACT_ENV: "1",
            MATMUL_ORDER_ENV: "1",
        }
        serves_a_forced_length(daemon, 24)
    finally:
        daemon.stop()


def test_kernels_fast_runs_the_fast_build_with_every_kernel(tmp_path: Path) -> None:
    library = fast_library()
    assert library is not None
    daemon = HttpDaemon(tmp_path, "--kernels", "fast", max_context=1024, max_batch=2).start()
    try:
        assert "on fast kernels" in daemon.log.read_text()
        kernels, loaded, switches = loaded_libllama(daemon)
        assert (kernels, loaded) == ("fast, flash", library.resolve())
        assert switches == {
            EXACT_ENV: "0",
            TILED_ENV: "1",
            TILED_EXACT_ENV: "0",
            FA_ORDER_ENV: "0",
            REPACK_EXACT_ENV: "0",
            MATMUL_ORDER_ENV: "0",
        }
        serves_a_forced_length(daemon, 24)
    finally:
        daemon.stop()


def test_without_the_fast_build_exact_kernels_run_on_the_library_llama_cpp_python_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUPERFLUID_FAST_LIB", str(tmp_path / "nothing-here"))
    daemon = HttpDaemon(tmp_path, "--kernels", "exact", max_context=1024, max_batch=2).start()
    try:
        assert "on exact kernels" in daemon.log.read_text()
        kernels, loaded, switches = loaded_libllama(daemon)
        assert (kernels, loaded) == ("exact, plain", WHEEL_LIBRARY)
        # the wheel's tiled kernels are not held to any type: off
        assert switches == {
            EXACT_ENV: "1",
            TILED_ENV: "0",
            TILED_EXACT_ENV: "1",
            FA_ORDER_ENV: "1",
            REPACK_EXACT_ENV: "1",
            MATMUL_ORDER_ENV: "1",
        }
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    ("extra", "environment", "said"),
    [
        (("--no-worker-process",), {}, "--kernels fast needs workers"),
        ((), {"SUPERFLUID_FAST_LIB": "{root}/nothing-here"}, "llama.cpp's own build is not installed"),
    ],
)
def test_without_the_fast_build_a_daemon_says_so_and_runs_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...], environment: dict[str, str], said: str
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value.format(root=tmp_path))
    daemon = DaemonProcess(tmp_path, "--kernels", "fast", *extra, max_context=1024, max_batch=2).start()
    try:
        log = daemon.log.read_text()
        assert said in log and "on exact kernels" in log
        serves_a_forced_length(daemon, 8)
    finally:
        daemon.stop()
