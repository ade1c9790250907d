"""A short chat over HTTP is answered while agents prefill long prompts, with or without QoS headers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import HttpDaemon

pytestmark = pytest.mark.e2e

# Four agents with prompts long enough that none finishes its prefill before the chat is answered:
# agent-class work prefills in steps of a second (`pace.STEP_BATCH_S`), which a chat without the QoS
# header waits for. At 1,600 words the first agent's prompt (prefilled alone, about four seconds on
# two cores) once finished 0.01 s before the chat's first token, the chat having been sent two seconds
# into it; twice that leaves seconds to spare.
LANES, AGENT_WORDS, WINDOW = 4, 3200, 4096
WORDS = ["harbour", "lamp", "keeper", "storm", "ledger", "granite", "tide", "signal", "rope", "gull", "reef", "mast"]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("qos"), max_context=WINDOW, max_batch=LANES).start()
    yield proc
    proc.stop()


def _document(seed: int, words: int) -> str:
    return " ".join(np.random.default_rng(seed).choice(WORDS, size=words))


class Stream(threading.Thread):
    """A streaming chat completion on a raw socket; `first_token` is when its first generated chunk arrived."""

    def __init__(self, api: HttpDaemon, content: str, qos: str | None, max_tokens: int) -> None:
        super().__init__()
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        data = json.dumps(body).encode()
        qos_line = f"x-superfluid-qos: {qos}\r\n" if qos else ""
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{qos_line}Content-Length: {len(data)}\r\n\r\n"
        )
        self.request = head.encode() + data
        self.sock = socket.create_connection(("127.0.0.1", api.port))
        self.first_token: float | None = None
        self.done = False  # the stream ended with [DONE]
        self.errors = 0  # error chunks it carried

    def run(self) -> None:
        self.sock.sendall(self.request)
        with self.sock, contextlib.suppress(OSError), self.sock.makefile("rb") as lines:
            for raw in lines:
                line = raw.decode("utf-8", "replace").strip()
                if line == "data: [DONE]":
                    self.done = True
                    return
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                self.errors += "error" in chunk
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                if self.first_token is None and "role" not in delta:
                    self.first_token = time.monotonic()


@pytest.mark.parametrize(("agents_qos", "chat_qos"), [("background", "interactive"), (None, None)])
def test_a_chat_is_answered_before_any_agent_finishes_its_prefill(
    api: HttpDaemon, agents_qos: str | None, chat_qos: str | None
) -> None:
    seed = 0 if agents_qos else 100  # fresh prompts each run: nothing cached from the previous one
    agents = [Stream(api, _document(seed + i, AGENT_WORDS), agents_qos, 16) for i in range(LANES)]
    for agent in agents:
        agent.start()
    deadline = time.monotonic() + 30
    while api.metric("superfluid_lanes_active") < LANES and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api.metric("superfluid_lanes_active") == LANES, "every lane is prefilling an agent's prompt"
    chat = Stream(api, "What is the capital of France? One word.", chat_qos, 8)
    asked = time.monotonic()
    chat.start()
    chat.join(120)
    assert chat.first_token is not None and chat.done and not chat.errors
    waited = [agent.first_token for agent in agents if agent.first_token is not None and agent.first_token < asked]
    assert not waited, "an agent finished its prefill before the chat was sent; the test proves nothing"
    earlier = [agent.first_token for agent in agents if agent.first_token is not None]
    assert all(chat.first_token < first for first in earlier), (
        f"the chat's first token came {chat.first_token - asked:.2f} s after it was sent, "
        f"after an agent's first token ({min(earlier) - asked:.2f} s)"
    )
    if chat_qos == "interactive":
        assert chat.first_token - asked <= 1.0, f"the interactive chat waited {chat.first_token - asked:.2f} s"
    # the agents have made their point; hanging up on them must free their lanes mid-prefill (the rest of
    # their prompts would take the better part of a minute)
    for agent in agents:
        with contextlib.suppress(OSError):
            agent.sock.shutdown(socket.SHUT_RDWR)
        agent.join(30)
    assert not any(agent.errors for agent in agents), "no agent's stream carried an error before it was hung up"
    deadline = time.monotonic() + 30
    while api.metric("superfluid_lanes_active") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api.metric("superfluid_lanes_active") == 0, "the agents' lanes outlived their clients"
