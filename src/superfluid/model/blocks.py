"""Structured blocks (a file diff, an artifact, a citation...) and the text the model sees.

A block's payload is a JSON object with the keys its kind needs; the daemon commits the
payload as given and puts a plain-text projection of it on the model's input, rendered
as a message of the block's role. Images (kind 7) come through `AppendImage`, whose
payload the daemon writes itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..protocol.schema import (
    BLOCK_ARTIFACT,
    BLOCK_CITATION,
    BLOCK_DIAGNOSTIC,
    BLOCK_FILE_DIFF,
    BLOCK_IMAGE,
    BLOCK_PROGRESS,
    BLOCK_WORKSPACE_REF,
)


class BlockError(ValueError):
    """A block the daemon refuses; the text says what is wrong and what is accepted."""


def _text(p: dict[str, Any], key: str) -> str:
    value = p[key]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# kind -> (name, keys it needs, projection)
KINDS: dict[int, tuple[str, tuple[str, ...], Callable[[dict[str, Any]], str]]] = {
    BLOCK_FILE_DIFF: (
        "file diff",
        ("path", "diff"),
        lambda p: f"Diff of {_text(p, 'path')}:\n```diff\n{_text(p, 'diff')}\n```",
    ),
    BLOCK_ARTIFACT: ("artifact", ("title", "content"), lambda p: f"{_text(p, 'title')}\n\n{_text(p, 'content')}"),
    BLOCK_CITATION: (
        "citation",
        ("title", "url", "quote"),
        lambda p: f"{_text(p, 'title')} ({_text(p, 'url')}):\n> {_text(p, 'quote')}",
    ),
    BLOCK_PROGRESS: ("progress", (), lambda p: "Progress: " + json.dumps(p, ensure_ascii=False)),
    BLOCK_DIAGNOSTIC: (
        "diagnostic",
        ("severity", "message", "path", "line"),
        lambda p: f"{_text(p, 'severity')} at {_text(p, 'path')}:{_text(p, 'line')}: {_text(p, 'message')}",
    ),
    BLOCK_WORKSPACE_REF: ("workspace ref", ("path",), lambda p: f"Workspace file: {_text(p, 'path')}"),
}


def project_block(kind: int, payload: str) -> str:
    """The text a block of `kind` puts before the model, or BlockError."""
    if kind == BLOCK_IMAGE:
        raise BlockError("images (block kind 7) are appended with AppendImage, which writes their payload")
    if kind not in KINDS:
        raise BlockError(f"unknown block kind {kind}")
    name, keys, projection = KINDS[kind]
    try:
        parsed = json.loads(payload)
    except json.JSONDecodeError as e:
        raise BlockError(
            f"block payload is not JSON ({e}); a {name} block is an object with {', '.join(keys)}"
        ) from None
    if not isinstance(parsed, dict):
        raise BlockError(f"block payload must be a JSON object; a {name} block has {', '.join(keys) or 'any keys'}")
    missing = [key for key in keys if key not in parsed]
    if missing:
        raise BlockError(f"a {name} block needs {', '.join(keys)}; the payload lacks {', '.join(missing)}")
    return projection(parsed)
