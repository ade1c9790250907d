"""Logging to stderr (or `--log-file`), JSON lines under `--log-dir`, and live changes to
both from a filter directive.

Log lines are content-free: they name sessions, models and counts, never a prompt or a
reply. A directive is a comma-separated list of `level` or `target=level`, as in
`superfluid=debug`, `superfluid.scheduler=debug,info` or `warn`. Targets are logger
names (`::` is accepted for `.`); levels are trace, debug, info, warn, error and off.
"""

from __future__ import annotations

import io
import json
import logging
import logging.handlers
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}

_configured: set[str] = set()


LOG_FILE_BYTES = 64 << 20
LOG_FILES_KEPT = 8


class JsonLines(logging.Formatter):
    """One JSON object a line: time, level, logger and message, and the fields of a structured line (an access
    line's, passed as `extra={"fields": {...}}`) as keys of their own."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "target": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line |= fields
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class NumberedFiles(logging.handlers.RotatingFileHandler):
    """`superfluid.0.jsonl` is written; when it is full it becomes `.1`, and so on up to the
    oldest kept. Every file is created mode 0600."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(
            directory / "superfluid.0.jsonl", maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILES_KEPT - 1, delay=True
        )
        self.namer = lambda name: str(directory / f"superfluid.{name.rsplit('.', 1)[-1]}.jsonl")

    def _open(self) -> io.TextIOWrapper:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "a", encoding="utf-8")


LINE_FORMAT = logging.Formatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S")


class LogPane(logging.Handler):
    """Log lines for the terminal monitor's pane: formatted on the thread that logs, drawn by the monitor."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.setFormatter(LINE_FORMAT)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.put(self.format(record))
        except Exception:
            self.handleError(record)

    def detach(self) -> None:
        """The monitor is gone: what it did not draw, and what is logged from now on, goes to stderr."""
        root = logging.getLogger()
        root.removeHandler(self)
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setFormatter(LINE_FORMAT)
        root.addHandler(stderr)
        while True:
            try:
                print(self.lines.get_nowait(), file=sys.stderr)
            except queue.Empty:
                return


def setup_logging(
    directive: str = "info", log_file: Path | None = None, log_dir: Path | None = None, pane: LogPane | None = None
) -> None:
    """Log to stderr, or appended to `log_file`; with `log_dir`, also as rotated JSON lines. With a
    `pane` (the terminal monitor owns the terminal), the pane takes what stderr would."""
    handlers: list[logging.Handler] = []
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        stream = open(log_file, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (lives as long as the process)
        handlers.append(logging.StreamHandler(stream))
    elif pane is None:
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        handler.setFormatter(LINE_FORMAT)
    if pane is not None:
        handlers.append(pane)
    if log_dir is not None:
        files = NumberedFiles(log_dir)
        files.setFormatter(JsonLines())
        handlers.append(files)
    root = logging.getLogger()
    root.handlers[:] = handlers
    set_log_directive(directive)


def parse_directive(directive: str) -> list[tuple[str, int]]:
    """(logger name, level) pairs; "" is the root logger. Raises ValueError on a bad directive."""
    pairs = []
    for item in directive.split(","):
        item = item.strip()
        if not item:
            continue
        target, _, level = item.rpartition("=")
        level_no = LEVELS.get(level.strip().lower())
        if level_no is None:
            raise ValueError(
                f"invalid log directive {item!r}: expected LEVEL or TARGET=LEVEL, where LEVEL is one of "
                f"{', '.join(LEVELS)} (a directive such as superfluid.scheduler=debug,info)"
            )
        pairs.append((target.strip().replace("::", "."), level_no))
    if not pairs:
        raise ValueError("empty log directive: expected a level such as info, or TARGET=LEVEL such as superfluid=debug")
    return pairs


def set_log_directive(directive: str) -> None:
    """Apply a directive now; targets a previous directive named but this one does not are reset."""
    pairs = parse_directive(directive)
    for name in _configured:
        logging.getLogger(name).setLevel(logging.NOTSET)
    _configured.clear()
    root_level = logging.INFO
    for target, level in pairs:
        if target:
            logging.getLogger(target).setLevel(level)
            _configured.add(target)
        else:
            root_level = level
    logging.getLogger().setLevel(root_level)
