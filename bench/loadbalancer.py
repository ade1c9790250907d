"""HAProxy in front of daemons, for the tests and the bench: the configuration shipped in
docs/deployment/haproxy.cfg, run as it is (its server lines past the daemons given left out),
on a free loopback port, with every daemon's health check passed before it is used."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
from peer import free_port

CONFIG = Path(__file__).resolve().parent.parent / "docs" / "deployment" / "haproxy.cfg"
NAMES = "abc"  # the config's server names, whose addresses come from SUPERFLUID_A, _B and _C
CHECKED_S = 2.5  # a server enters the rotation after two passed checks a second apart (rise 2, inter 1s)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class HAProxy:
    """HAProxy balancing over `servers` (host:port, at most three); `url` reaches it once started."""

    def __init__(self, servers: list[str], workdir: Path) -> None:
        if not 1 <= len(servers) <= len(NAMES):
            raise ValueError(f"the shipped configuration names {len(NAMES)} servers, not {len(servers)}")
        self.servers = servers
        self.workdir = workdir
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def _config(self) -> Path:
        if len(self.servers) == len(NAMES):
            return CONFIG
        names = NAMES[: len(self.servers)]
        kept = [line for line in CONFIG.read_text().splitlines() if not re.match(rf"\s+server [^{names}] ", line)]
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / f"haproxy-{len(self.servers)}.cfg"
        path.write_text("\n".join(kept) + "\n")
        return path

    def start(self) -> HAProxy:
        port = free_port()
        env = {**os.environ, "SUPERFLUID_BIND": f"127.0.0.1:{port}"}
        env |= {f"SUPERFLUID_{name.upper()}": server for name, server in zip(NAMES, self.servers, strict=False)}
        self.proc = subprocess.Popen(
            ["haproxy", "-db", "-f", str(self._config())], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not _answers(f"{self.url}/health"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not come up: {self.stop()}")
            time.sleep(0.1)
        time.sleep(CHECKED_S)
        return self

    def stop(self) -> str:
        """Stops it; what it wrote on stderr."""
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.terminate()
        _, err = self.proc.communicate(timeout=10)
        self.proc = None
        return err.decode(errors="replace")

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
