"""superfluid_client: the session API of a superfluid daemon, over its browser transport.

from superfluid_client import Client, Sampling

sf = Client()                      # http://127.0.0.1:8460, token from ~/.superfluid/sessions/web-token
s = sf.session(Sampling(temperature=0.7, seed=1), system="You are terse.")
s.user("Name three rivers.")
for chunk in s.stream(max_tokens=128):
    print(chunk.text, end="")
"""

from ._client import (
    ASSISTANT,
    REASONING,
    SYSTEM,
    TEXT,
    TOOL,
    TOOL_CALL,
    USER,
    Chunk,
    Client,
    Event,
    Reply,
    Sampling,
    Session,
    SessionBusy,
    Stream,
    SuperfluidError,
    ToolCall,
    drop_events,
    replace_events,
)

__version__ = "0.1.0"

__all__ = [
    "ASSISTANT",
    "REASONING",
    "SYSTEM",
    "TEXT",
    "TOOL",
    "TOOL_CALL",
    "USER",
    "Chunk",
    "Client",
    "Event",
    "Reply",
    "Sampling",
    "Session",
    "SessionBusy",
    "Stream",
    "SuperfluidError",
    "ToolCall",
    "drop_events",
    "replace_events",
]
