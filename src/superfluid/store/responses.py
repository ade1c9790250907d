"""Stored Responses API records: files under `<sessions>/responses/<id>.json`, or rows of the
shared store for daemons that share one (`--store`), so that any of them finds a response
another one stored.

A file is written to a temporary name, fsynced, renamed into place and its directory
fsynced, so it is on disk before the response that made it is returned; a crash leaves
either the old file or the new one, never half of one. A row is committed before the
response is returned. Records never expire: they go when they are deleted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .durable import sync_directory, write_atomically

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


RESPONSES_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id     TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
"""


class ResponseStore(Protocol):
    """Where stored responses are kept, by id."""

    def put(self, response_id: str, record: dict[str, Any]) -> None: ...

    def get(self, response_id: str) -> dict[str, Any] | None: ...

    def delete(self, response_id: str) -> bool:
        """Remove a record; False when there was none."""
        ...


def _encoded(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


class ResponseRecords:
    """One JSON file per stored response, by id."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, response_id: str) -> Path | None:
        # only well-formed ids reach the file system: an id is never a path
        return self.directory / f"{response_id}.json" if RESPONSE_ID.match(response_id) else None

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        path = self._path(response_id)
        if path is None:
            raise ValueError(f"{response_id!r} is not a response id (resp_ and 32 hex digits)")
        write_atomically(path, _encoded(record).encode())

    def get(self, response_id: str) -> dict[str, Any] | None:
        path = self._path(response_id)
        if path is None or not path.is_file():
            return None
        record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return record

    def delete(self, response_id: str) -> bool:
        """Remove a record; False when there was none."""
        path = self._path(response_id)
        if path is None or not path.is_file():
            return False
        path.unlink()
        sync_directory(self.directory)
        return True


class SharedResponseRecords:
    """Stored responses as rows of the PostgreSQL store, which `run(work)` reaches (`PostgresLog.run`)."""

    def __init__(self, run: Callable[[Callable[[Any], Any]], Any]) -> None:
        self._run = run

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        if not RESPONSE_ID.match(response_id):
            raise ValueError(f"{response_id!r} is not a response id (resp_ and 32 hex digits)")
        query = (
            "INSERT INTO responses (id, record) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record"
        )
        self._run(lambda db: db.execute(query, (response_id, _encoded(record))))

    def get(self, response_id: str) -> dict[str, Any] | None:
        if not RESPONSE_ID.match(response_id):
            return None
        row = self._run(lambda db: db.execute("SELECT record FROM responses WHERE id = %s", (response_id,)).fetchone())
        if row is None:
            return None
        record: dict[str, Any] = json.loads(row[0])
        return record

    def delete(self, response_id: str) -> bool:
        row = self._run(
            lambda db: db.execute("DELETE FROM responses WHERE id = %s RETURNING id", (response_id,)).fetchone()
        )
        return row is not None
