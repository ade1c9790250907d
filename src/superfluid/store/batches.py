"""The batches of OpenAI's `/v1/batches` under `<sessions>/batches`: `<id>.json` is a batch's
record (rewritten whole, atomically, as its status changes) and `<id>.jsonl` the lines of
its requests that finished, each appended and fsynced as it finishes, so a restart knows
exactly which requests are done. A line cut by a crash is dropped when the lines are read.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from .durable import append_durably, sync_directory, write_atomically

BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")


class BatchRecords:
    """Batch records and their finished lines, by batch id."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._appending = threading.Lock()  # one line at a time: lines never interleave

    def _path(self, batch_id: str, suffix: str) -> Path:
        # only well-formed ids reach the file system: an id is never a path
        if not BATCH_ID.match(batch_id):
            raise ValueError(f"{batch_id!r} is not a batch id (batch_ and 32 hex digits)")
        return self.directory / f"{batch_id}{suffix}"

    def put(self, batch_id: str, record: dict[str, Any]) -> None:
        write_atomically(self._path(batch_id, ".json"), json.dumps(record, ensure_ascii=False).encode())

    def all(self) -> list[dict[str, Any]]:
        """Every record, oldest first."""
        if not self.directory.is_dir():
            return []
        paths = sorted(self.directory.glob("batch_*.json"))
        return [json.loads(path.read_text(encoding="utf-8")) for path in paths]

    def append(self, batch_id: str, line: dict[str, Any]) -> None:
        """Add one finished request's line, durably."""
        data = json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        with self._appending:
            append_durably(self._path(batch_id, ".jsonl"), data)

    def lines(self, batch_id: str) -> list[dict[str, Any]]:
        """The lines written so far, in the order they finished. A last line a crash cut short is
        cut off the file too, so the next one starts on a line of its own."""
        path = self._path(batch_id, ".jsonl")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            with self._appending:
                os.truncate(path, len(whole))
        return [json.loads(line) for line in whole.splitlines()]

    def drop_lines(self, batch_id: str) -> None:
        """Forget the lines of a finished batch (its output files hold them now)."""
        path = self._path(batch_id, ".jsonl")
        if path.exists():
            path.unlink()
            sync_directory(self.directory)
