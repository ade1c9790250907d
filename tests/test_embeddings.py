"""Embeddings over HTTP (OpenAI /v1/embeddings, Ollama /api/embed), with the engine in a worker and in the daemon.

What holds on every machine: an input's vector is the same each time and the same alone or in a
batch, texts that differ get vectors that differ, and computing embeddings beside a generation
changes nothing in it.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import ollama
import openai
import pytest
from conftest import HttpDaemon

pytestmark = pytest.mark.e2e

TEXTS = ["The cat sat on the mat.", "Quarterly revenue grew by four percent.", "Rivers run to the sea."]


@pytest.fixture(scope="module", params=["worker", "in-process"])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    extra = ("--no-worker-process",) if request.param == "in-process" else ()
    proc = HttpDaemon(tmp_path_factory.mktemp("embed"), *extra, max_context=512, max_batch=2).start()
    yield proc
    proc.stop()


def embeddings(api: HttpDaemon, given: object, **extra: object) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/embeddings", json={"model": "smollm2", "input": given, **extra}, timeout=60)


def vectors(api: HttpDaemon, given: object) -> list[np.ndarray]:
    reply = embeddings(api, given)
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [np.asarray(d["embedding"], dtype=np.float32) for d in data]


def close(a: np.ndarray, b: np.ndarray, rel: float = 1e-4) -> bool:
    return bool(np.linalg.norm(a - b) <= rel * np.linalg.norm(b))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_an_input_gets_the_same_vector_each_time_alone_or_in_a_batch(api: HttpDaemon) -> None:
    width = httpx.get(f"{api.url}/props").json()["n_embd"]
    (first,) = vectors(api, TEXTS[0])
    (again,) = vectors(api, TEXTS[0])
    assert first.shape == (width,) and np.array_equal(first, again)
    assert cosine(first, again) == pytest.approx(1.0, abs=1e-6)
    batch = vectors(api, TEXTS)
    assert len(batch) == 3 and all(v.shape == (width,) for v in batch)
    for text, vector in zip(TEXTS, batch, strict=True):
        assert close(vector, vectors(api, text)[0]), text
    assert not close(batch[0], batch[1], 1e-2) and not close(batch[1], batch[2], 1e-2)


def test_the_reply_shape_and_token_id_inputs(api: HttpDaemon) -> None:
    reply = embeddings(api, TEXTS[:2]).json()
    assert reply["object"] == "list" and reply["model"] == "smollm2"
    assert {d["object"] for d in reply["data"]} == {"embedding"}
    tokens = httpx.post(f"{api.url}/v1/tokenize", json={"content": TEXTS[0], "add_special": True}).json()["tokens"]
    assert reply["usage"]["prompt_tokens"] == reply["usage"]["total_tokens"] >= len(tokens)
    by_text = np.asarray(reply["data"][0]["embedding"], dtype=np.float32)
    assert close(vectors(api, tokens)[0], by_text), "one input as token ids"
    assert close(vectors(api, [tokens, tokens])[1], by_text), "a list of token id lists"


def test_base64_is_the_little_endian_float32_vector(api: HttpDaemon) -> None:
    (floats,) = vectors(api, TEXTS[1])
    reply = embeddings(api, TEXTS[1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(reply.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, floats)


def test_refusals_say_what_is_accepted(api: HttpDaemon) -> None:
    reply = embeddings(api, "x", dimensions=8)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "unsupported_parameter" and reply.json()["error"]["param"] == "dimensions"
    reply = embeddings(api, "x", encoding_format="int8")
    assert reply.status_code == 400 and "float, base64" in reply.json()["error"]["message"]
    for empty in ([], "", [""]):
        reply = embeddings(api, empty)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "input", empty
    reply = embeddings(api, [[1, 2, 10**9]])
    assert reply.status_code == 400 and "vocabulary" in reply.json()["error"]["message"]
    reply = embeddings(api, "word " * 600)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    reply = embeddings(api, "x", model="no-such-model")
    assert reply.status_code == 404


def test_the_openai_sdk_asks_for_base64_and_decodes_it(api: HttpDaemon) -> None:
    import httpx2

    sent: list[bytes] = []
    client = openai.OpenAI(
        base_url=f"{api.url}/v1",
        api_key="unused",
        http_client=httpx2.Client(event_hooks={"request": [lambda request: sent.append(request.read())]}),
    )
    result = client.embeddings.create(model="smollm2", input=TEXTS)
    assert b'"encoding_format":"base64"' in sent[-1].replace(b" ", b"")
    expected = vectors(api, TEXTS)
    assert [d.index for d in result.data] == [0, 1, 2]
    for got, want in zip(result.data, expected, strict=True):
        assert close(np.asarray(got.embedding, dtype=np.float32), want)
    assert result.usage.prompt_tokens > 0


def test_ollama_embed_gives_unit_vectors_in_the_same_direction(api: HttpDaemon) -> None:
    client = ollama.Client(host=api.url)
    result = client.embed(model="smollm2", input=TEXTS[:2])
    assert len(result.embeddings) == 2 and result.prompt_eval_count > 0
    for got, want in zip(result.embeddings, vectors(api, TEXTS[:2]), strict=True):
        got = np.asarray(got)
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)
        assert cosine(got, want) == pytest.approx(1.0, abs=1e-5)
    short = client.embed(model="smollm2", input=TEXTS[0], dimensions=16).embeddings[0]
    assert len(short) == 16 and np.linalg.norm(short) == pytest.approx(1.0, abs=1e-5)
    cut = httpx.post(f"{api.url}/api/embed", json={"model": "smollm2", "input": "word " * 600}, timeout=60)
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 512, "truncate defaults to true"
    refused = httpx.post(
        f"{api.url}/api/embed", json={"model": "smollm2", "input": "word " * 600, "truncate": False}, timeout=60
    )
    assert refused.status_code == 400 and "shorten it" in refused.json()["error"]


def streamed_text(api: HttpDaemon, started: threading.Event | None = None) -> str:
    """A forced-length greedy chat, streamed; `started` is set at its first piece of text."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Describe a walk along a long beach at dawn."}],
        "max_tokens": 48,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused")
    text = []
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            if started is not None:
                started.set()
    return "".join(text)


def test_embeddings_beside_a_streaming_chat_change_nothing_in_it(api: HttpDaemon) -> None:
    reference_text = streamed_text(api)
    reference = vectors(api, TEXTS)
    started, done = threading.Event(), threading.Event()
    text: list[str] = []

    def chat() -> None:
        text.append(streamed_text(api, started))
        done.set()

    thread = threading.Thread(target=chat)
    thread.start()
    assert started.wait(60)
    rounds = overlapped = 0
    while not done.is_set() or rounds < 2:
        overlapped += not done.is_set()
        for got, want in zip(vectors(api, TEXTS), reference, strict=True):
            assert close(got, want)
        rounds += 1
    thread.join(60)
    assert overlapped >= 1
    assert text == [reference_text], "the chat's greedy text is the same with embeddings beside it"


@pytest.mark.parametrize("api", ["worker"], indirect=True)  # in the daemon, there is no worker to kill
def test_embeddings_come_back_after_the_worker_dies(api: HttpDaemon) -> None:
    def worker_pid() -> int | None:
        models = httpx.get(f"{api.url}/v1/models").json()["data"]
        return next(m["runtime"]["worker_pid"] for m in models if m["default"])

    killed = worker_pid()
    assert killed is not None
    before = vectors(api, TEXTS)
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while worker_pid() in (killed, None):
        assert time.monotonic() < deadline, "no new worker came up"
        time.sleep(0.1)
    for got, want in zip(vectors(api, TEXTS), before, strict=True):
        assert close(got, want)
