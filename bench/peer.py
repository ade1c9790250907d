"""The systems the bench measures, each started on its own and stopped before the next.

`Superfluid` is `superfluid serve` on temporary state with its HTTP API and socket;
`LlamaServer` is llama-server built from the llama.cpp that llama-cpp-python vendors (the
same commit superfluid runs), at its own defaults; `batched_bench` runs llama.cpp's
`llama-batched-bench`, the bare decode loop, with the settings given, and `fastest_loop` at whichever
of llama.cpp's own settings does a piece of work sooner.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from superfluid.client import SocketClient
from superfluid.engine.build import llama_cpp_environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process with an OpenAI-compatible HTTP API at `url`."""

    name = "server"

    def __init__(self, args: list[str], log: Path, port: int, environment: dict[str, str] | None = None) -> None:
        self.args, self.log, self.port = args, log, port
        self.environment = environment  # None: this process's
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=self.environment)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.ready():
                return self
            time.sleep(0.1)
        sys.exit(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Superfluid(Server):
    """`superfluid serve` with its HTTP API and socket, on state of its own.

    With `http=False` it runs with `--no-http` (the session API only), and is ready once its
    log prints the line it prints when every listener is up."""

    name = "superfluid"
    READY = re.compile(rb"^superfluid \S+: serving ", re.MULTILINE)  # the heading, whatever the version

    def __init__(self, root: Path, window: int, lanes: int, *extra: str, http: bool = True) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.socket = root / "sf.sock"
        self.http = http
        self._log_from = 0
        port = free_port()
        listener = ["--http", f"127.0.0.1:{port}"] if http else ["--no-http"]
        args = [sys.executable, "-m", "superfluid", "serve", "--sessions", str(root / "sessions")]
        args += ["--socket", str(self.socket), *listener, "--no-tui", "--log-filter", "warn"]
        args += ["--max-context", str(window), "--max-batch", str(lanes), *extra]
        super().__init__(args, root / "serve.log", port)

    def start(self) -> Superfluid:
        # the log is appended to across starts: only this start's lines say it is ready
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        super().start()
        return self

    def ready(self) -> bool:
        if self.http:
            return super().ready()
        return self.READY.search(self.log.read_bytes()[self._log_from :]) is not None

    def client(self) -> SocketClient:
        return SocketClient(self.socket)


class LlamaServer(Server):
    """llama-server at its defaults: `-np` parallel slots over one unified KV of `-c` tokens."""

    name = "llama-server"

    def __init__(
        self, binary: Path, model: Path, root: Path, lanes: int, window: int, threads: int, *extra: str
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        port = free_port()
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        args += ["-np", str(lanes), "-c", str(lanes * window), "-kvu", "-t", str(threads), "--no-webui", *extra]
        # llama.cpp's own kernel switches: this process's turn the tiled kernels off (superfluid.engine.build)
        super().__init__(args, root / "llama-server.log", port, llama_cpp_environment())


def batched_bench(
    binary: Path,
    model: Path,
    prompt: int,
    tokens: int,
    streams: list[int],
    *flags: str,
    environment: dict[str, str] | None = None,
    repeats: int = 1,
) -> list[dict]:
    """llama-batched-bench's JSON lines: one per stream count, with speed_pp and speed_tg in tokens/s, each
    the median of `repeats` runs in the one process (a short prompt's prefill takes a fraction of a second,
    which one run measures within a few percent); `environment` is added to llama.cpp's defaults
    (`llama_cpp_environment`)."""
    context = max(streams) * (prompt + tokens) + 64
    args = [str(binary), "-m", str(model), "-c", str(context), "-npp", ",".join([str(prompt)] * repeats)]
    args += ["-ntg", str(tokens), "-npl", ",".join(map(str, streams)), "--output-format", "jsonl", *flags]
    environment = {**llama_cpp_environment(), **(environment or {})}
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800, env=environment)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(rows) != repeats * len(streams):
        sys.exit(f"llama-batched-bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [median_row([row for row in rows if row["pl"] == n]) for n in streams]


# llama.cpp's own settings: its defaults (flash attention where it judges it pays, one KV for every sequence),
# and flash attention with a KV stream per sequence, which is faster on some models and context lengths
LLAMA_CPP_DEFAULTS = ("-fa", "auto", "-kvu")
LLAMA_CPP_FLASH = ("-fa", "on")


def fastest_loop(
    binary: Path, model: Path, prompt: int, tokens: int, streams: int, threads: int, phase: str = "t"
) -> dict:
    """llama.cpp's own loop prefilling `streams` prompts of `prompt` tokens together, then decoding `tokens` on
    each of them together: the llama-batched-bench row (`t_pp`, `t_tg` and their sum `t`, in seconds) of
    whichever of llama.cpp's settings took the shorter `phase` (named in `setting`): the work with no server
    around it."""
    settings = {"its defaults": LLAMA_CPP_DEFAULTS, "flash attention, a KV stream per sequence": LLAMA_CPP_FLASH}
    rows = [
        {**batched_bench(binary, model, prompt, tokens, [streams], "-t", str(threads), *flags)[0], "setting": name}
        for name, flags in settings.items()
    ]
    return min(rows, key=lambda row: row[phase])


def median_row(same: Sequence[dict]) -> dict:
    """Rows of llama-batched-bench for one prompt and stream count as one: the first, with the median speeds."""
    return {**same[0], **{key: float(np.median([row[key] for row in same])) for key in ("speed_pp", "speed_tg")}}
