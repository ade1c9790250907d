"""The files of OpenAI's `/v1/files` under `<sessions>/files`: `<id>.data` holds a file's
bytes, `<id>.json` what is known of it (OpenAI's file object, and the key that owns it).

The bytes are written whole and fsynced before the metadata, and a file exists once its
metadata does, so a crash leaves a whole file or none. Deleting removes the metadata first.
Ids are `file-` and 32 hex digits that start with the time they were made, so they sort in
the order the files were made.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import Any, BinaryIO

from .durable import sync_directory, write_atomically

FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")


def new_id(prefix: str) -> str:
    """`prefix` and 32 hex digits: the time in nanoseconds, then 64 random bits, so ids sort by age."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(8)}"


class FileStore:
    """Files and their metadata in one directory, by id."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _paths(self, file_id: str) -> tuple[Path, Path] | None:
        # only well-formed ids reach the file system: an id is never a path
        if not FILE_ID.match(file_id):
            return None
        return self.directory / f"{file_id}.json", self.directory / f"{file_id}.data"

    def add(
        self, data: bytes | BinaryIO, filename: str, purpose: str, owner: str | None, file_id: str | None = None
    ) -> dict[str, Any]:
        """Store `data` (bytes, or a binary file from where it stands) durably; returns its metadata.
        With `file_id`, under that id (what was there is replaced)."""
        file_id = file_id or new_id("file-")
        paths = self._paths(file_id)
        if paths is None:
            raise ValueError(f"{file_id!r} is not a file id (file- and 32 hex digits)")
        meta_path, data_path = paths
        write_atomically(data_path, data)
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": data_path.stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "owner": owner,
        }
        write_atomically(meta_path, json.dumps(meta, ensure_ascii=False).encode())
        return meta

    def get(self, file_id: str) -> dict[str, Any] | None:
        """A file's metadata, None when there is no such file."""
        paths = self._paths(file_id)
        if paths is None:
            return None
        try:
            meta: dict[str, Any] = json.loads(paths[0].read_text(encoding="utf-8"))
        except FileNotFoundError:  # never made, or deleted meanwhile
            return None
        return meta

    def content(self, file_id: str) -> Path | None:
        """Where a file's bytes are, None when there is no such file."""
        paths = self._paths(file_id)
        return paths[1] if paths is not None and paths[0].is_file() else None

    def all(self) -> list[dict[str, Any]]:
        """Every file's metadata, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (self.get(path.stem) for path in sorted(self.directory.glob("file-*.json")))
        return [meta for meta in found if meta is not None]

    def delete(self, file_id: str) -> bool:
        """Remove a file; False when there was none."""
        paths = self._paths(file_id)
        if paths is None or not paths[0].is_file():
            return False
        meta_path, data_path = paths
        meta_path.unlink()
        data_path.unlink(missing_ok=True)
        sync_directory(self.directory)
        return True
