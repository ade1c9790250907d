"""Which llama.cpp build a model runs on: llama.cpp's own (`--kernels fast`, the default) or the exact one.

The worker's memory map names the library it loaded, so these tests see the build itself,
not a flag echoed back. What they generate is checked with what holds on every machine
(a forced length with end-of-generation banned), since the fast kernels' text is this CPU's.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import llama_cpp
import pytest
from conftest import DaemonProcess, HttpDaemon, forced, new_session, say

from superfluid.engine.build import fast_library

pytestmark = pytest.mark.e2e


def loaded_libllama(daemon: HttpDaemon) -> tuple[str, Path]:
    """The default model's kernels as /v1/models reports them, and the libllama its worker has mapped."""
    entry = next(m for m in httpx.get(f"{daemon.url}/v1/models").json()["data"] if m["default"])
    pid = entry["runtime"]["worker_pid"]
    maps = Path(f"/proc/{pid}/maps").read_text().split("\n")
    paths = {Path(line.split()[-1]) for line in maps if "libllama.so" in line}
    assert len(paths) == 1, paths
    return entry["runtime"]["kernels"], paths.pop().parent.resolve()


def serves_a_forced_length(daemon: DaemonProcess, tokens: int) -> None:
    """A generation with end-of-generation banned yields exactly `tokens` tokens, on any kernels."""
    with daemon.client() as c:
        session = new_session(c)
        say(c, session, "Count from one to twenty.")
        forced(c, session, tokens)


def test_a_daemon_runs_on_llama_cpps_own_build_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    library = fast_library()
    assert library is not None, "make installs llama.cpp's own build at .venv/llama-fast"
    monkeypatch.delenv("SUPERFLUID_KERNELS")
    daemon = HttpDaemon(tmp_path, max_context=1024, max_batch=2).start()
    try:
        assert "on fast kernels" in daemon.log.read_text()
        kernels, loaded = loaded_libllama(daemon)
        assert (kernels, loaded) == ("fast", library.resolve())
        serves_a_forced_length(daemon, 24)
    finally:
        daemon.stop()


def test_exact_kernels_run_on_the_library_llama_cpp_python_loads(tmp_path: Path) -> None:
    daemon = HttpDaemon(tmp_path, "--kernels", "exact", max_context=1024, max_batch=2).start()
    try:
        assert "on exact kernels" in daemon.log.read_text()
        kernels, loaded = loaded_libllama(daemon)
        assert (kernels, loaded) == ("exact", (Path(llama_cpp.__file__).parent / "lib").resolve())
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
