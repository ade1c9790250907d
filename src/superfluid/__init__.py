"""superfluid: a local LLM daemon whose conversations are durable, forkable and prefix-cached."""

__version__ = "0.1.0"
