"""Stored Responses API records under `<sessions>/responses/<id>.json`.

A record is written to a temporary file, fsynced, renamed into place and its directory
fsynced, so it is on disk before the response that made it is returned; a crash leaves
either the old file or the new one, never half of one. Records never expire: they go
when they are deleted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .durable import sync_directory, write_atomically

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


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
        write_atomically(path, json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode())

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
