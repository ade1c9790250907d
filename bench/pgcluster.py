"""A PostgreSQL cluster of one's own, for the tests and the bench: a temporary directory, a
free loopback port, user `superfluid` trusted.

As root (CI), the cluster runs as the `postgres` user the Debian package creates, since
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def postgres_binaries() -> Path | None:
    """The directory of PostgreSQL's server programs (Debian keeps them off PATH)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """A running cluster; `url` reaches its `postgres` database."""

    def __init__(self) -> None:
        binaries = postgres_binaries()
        if binaries is None:
            raise RuntimeError("PostgreSQL is needed: apt-get install postgresql (make test does it)")
        # its own temporary directory: the `postgres` user must reach its socket directory
        self.home = Path(tempfile.mkdtemp(prefix="superfluid-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.home, "postgres", "postgres")
            as_user = ["runuser", "-u", "postgres", "--"]
        data, port = self.home / "data", _free_port()
        initdb = [str(binaries / "initdb"), "-D", str(data), "-U", "superfluid", "--auth=trust", "-E", "UTF8"]
        subprocess.run([*as_user, *initdb], check=True, capture_output=True)
        self._options = f"-p {port} -c listen_addresses=127.0.0.1 -k {self.home} -c max_connections=200"
        self._ctl = [*as_user, str(binaries / "pg_ctl"), "-D", str(data), "-l", str(self.home / "server.log")]
        self.url = f"postgresql://superfluid@127.0.0.1:{port}/postgres"
        self.start()

    def start(self) -> None:
        subprocess.run([*self._ctl, "-o", self._options, "-w", "start"], check=True, capture_output=True)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; `fast` cuts every connection, as a restart or a failover does."""
        subprocess.run([*self._ctl, "-m", mode, "-w", "stop"], capture_output=True)

    def database(self) -> str:
        """A new, empty database; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.home, ignore_errors=True)
