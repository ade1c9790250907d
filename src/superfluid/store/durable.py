"""Files that are whole on disk before anyone is told they exist.

`write_atomically` writes a temporary file in the target's directory, fsyncs it, renames it
into place (mode 0600) and fsyncs the directory, so a crash leaves the old file or the new
one, never a part.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(target: Path, data: bytes) -> None:
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=".incoming-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o600)
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    sync_directory(target.parent)


def sync_directory(directory: Path) -> None:
    """Make a rename or an unlink in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
