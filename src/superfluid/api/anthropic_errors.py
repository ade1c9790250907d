"""Anthropic's error shape, for every refusal on its routes: `{"type": "error", "error": {"type", "message"}}`.

Kept apart from the routes so the key gate, which runs before them, answers in it too.
"""

from __future__ import annotations

from typing import Any

ROUTE = "/v1/messages"  # and what lies under it (count_tokens)

TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path.startswith(ROUTE)


def body(message: str, status: int) -> dict[str, Any]:
    """The error body for `status`, its type named as Anthropic names it."""
    kind = TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
