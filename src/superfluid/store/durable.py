"""Files that are whole on disk before anyone is told they exist.

`write_atomically` writes a temporary file in the target's directory, fsyncs it, renames it
into place (mode 0600) and fsyncs the directory, so a crash leaves the old file or the new
one, never a part. `append_durably` adds to the end of a file and fsyncs it before returning.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO


def write_atomically(target: Path, data: bytes | BinaryIO) -> None:
    """Replace `target` with `data`: bytes, or a binary file read from where it stands to its end."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=".incoming-")
    try:
        with os.fdopen(fd, "wb") as handle:
            if isinstance(data, bytes):
                handle.write(data)
            else:
                shutil.copyfileobj(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o600)
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    sync_directory(target.parent)


def append_durably(target: Path, data: bytes) -> None:
    """Append `data` to `target` (made, mode 0600, when missing) and fsync it, and its directory when
    the file is new."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        new = os.fstat(fd).st_size == 0
        view = memoryview(data)
        while view:  # a write to a regular file may take only part of a large buffer
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        sync_directory(target.parent)


def sync_directory(directory: Path) -> None:
    """Make a rename or an unlink in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
