"""Logging to stderr, and live changes to it from a filter directive.

A directive is a comma-separated list of `level` or `target=level`, as in
`superfluid=debug`, `superfluid.scheduler=debug,info` or `warn`. Targets are logger
names (`::` is accepted for `.`); levels are trace, debug, info, warn, error and off.
"""

from __future__ import annotations

import logging
import sys

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


def setup_logging(directive: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
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
            raise ValueError(f"invalid log directive {item!r}: the level must be one of {', '.join(LEVELS)}")
        pairs.append((target.strip().replace("::", "."), level_no))
    if not pairs:
        raise ValueError("empty log directive: give a level such as `info` or `superfluid=debug`")
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
