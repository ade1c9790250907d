"""Content-addressed media blobs under `<sessions>/media`.

A blob is stored once under the lowercase hex SHA-256 of its bytes, written to a
temporary file, fsynced and renamed into place (mode 0600), so it is durable before
any session can reference it. `gc` removes every blob no live session references.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .durable import write_atomically

HASH = re.compile(r"^[0-9a-f]{64}$")


class MediaStore:
    """Blobs by hash in one directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        target = self.directory / digest
        if target.exists():
            return digest
        write_atomically(target, data)
        return digest

    def has(self, digest: str) -> bool:
        return bool(HASH.match(digest)) and (self.directory / digest).is_file()

    def path(self, digest: str) -> Path:
        if not HASH.match(digest):
            raise ValueError(f"{digest!r} is not a media hash (64 lowercase hex digits)")
        return self.directory / digest

    def gc(self, referenced: set[str]) -> tuple[int, int]:
        """Remove blobs outside `referenced`; returns (kept, removed)."""
        kept = removed = 0
        if not self.directory.is_dir():
            return 0, 0
        for entry in self.directory.iterdir():
            if entry.name in referenced:
                kept += 1
            elif HASH.match(entry.name) or entry.name.startswith(".incoming-"):
                entry.unlink(missing_ok=True)
                removed += 1
        return kept, removed
