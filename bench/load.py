"""An OpenAI-speaking load generator: streaming chat requests timed to their first token.

The same code drives superfluid and llama-server, so the two are measured alike: each
request runs on a thread of its own, streams, and records when it was sent, when its
first generated chunk arrived and when it ended, with the usage the server reported.
Each thread keeps its client (and so its connections) from one request to the next, as
an application does: building an httpx client costs about 45 ms here, which would count
against both servers and hide the difference between them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

WORDS = ["harbour", "lamp", "keeper", "storm", "ledger", "granite", "tide", "signal", "rope", "gull", "reef", "mast"]


@dataclass
class Reply:
    """One request as the client saw it."""

    sent: float
    first: float | None = None
    done: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)  # when each chunk of generated text came

    @property
    def gaps(self) -> list[float]:
        """Seconds between one chunk of text and the next: what a reader of the stream waits."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.done) - self.sent


@dataclass
class Chat:
    """A request: its messages and how it asks to be run."""

    messages: list[dict[str, str]]
    max_tokens: int
    qos: str | None = None
    extra: dict = field(default_factory=dict)


def document(seed: int, words: int) -> str:
    """Filler text of about `words` tokens, different for every seed (no shared prefix)."""
    return " ".join(np.random.default_rng(seed).choice(WORDS, size=words))


_local = threading.local()


def _client() -> httpx.Client:
    client = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpx.Client(timeout=900)
    return client


def send(url: str, chat: Chat) -> Reply:
    """Stream one chat completion with greedy sampling and end-of-generation banned."""
    body = {  # no model: each server runs its default one
        "messages": chat.messages,
        "max_tokens": chat.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **chat.extra,
    }
    headers = {"x-superfluid-qos": chat.qos} if chat.qos else {}
    client = _client()
    reply = Reply(time.monotonic())
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                reply.error = f"{r.status_code} {r.read()[:200]!r}"
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                choices = chunk.get("choices") or []
                delta = choices[0].get("delta", {}) if choices else {}
                if delta.get("content") or delta.get("reasoning_content"):
                    reply.arrivals.append(time.monotonic())
                    if reply.first is None:
                        reply.first = reply.arrivals[-1]
                usage = chunk.get("usage")
                if usage:
                    reply.completion_tokens = usage.get("completion_tokens", 0)
                    reply.prompt_tokens = usage.get("prompt_tokens", 0)
                    reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if "error" in chunk:
                    reply.error = str(chunk["error"])
    except httpx.HTTPError as e:
        reply.error = str(e)
    reply.done = time.monotonic()
    return reply


def together(url: str, chats: list[Chat], delays: list[float] | None = None) -> list[Reply]:
    """Send every chat on a thread of its own (each after its delay); their replies in order."""
    replies: list[Reply | None] = [None] * len(chats)
    start = time.monotonic()

    def run(i: int) -> None:
        if delays:
            time.sleep(max(0.0, start + delays[i] - time.monotonic()))
        replies[i] = send(url, chats[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = [r for r in replies if r is not None]
    failed = [r.error for r in out if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return out


def decode_rate(replies: list[Reply]) -> float:
    """Tokens per second while every stream was generating: from the first first-token to the last end."""
    started = min(r.first for r in replies if r.first is not None)
    ended = max(r.done for r in replies)
    return sum(r.completion_tokens for r in replies) / (ended - started)


def gap_p99(replies: list[Reply]) -> float:
    """The 99th percentile of the gaps between chunks, over every stream."""
    gaps = [gap for reply in replies for gap in reply.gaps]
    return float(np.percentile(gaps, 99)) if gaps else 0.0


def timed(block: Callable[[], list[Reply]]) -> tuple[list[Reply], float]:
    started = time.monotonic()
    replies = block()
    return replies, time.monotonic() - started
