"""The status and tokenizer routes of the main listener: /v1/tokenize, /v1/detokenize, /props, /slots."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import HttpDaemon

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("status"), max_context=1024, max_batch=2).start()
    yield proc
    proc.stop()


def test_tokenize_then_detokenize_gives_the_text_back(api: HttpDaemon) -> None:
    for text in ("Hello, world! Ünïcödé and emoji 🌊.", "a <|im_end|> marker is its token", "  spaced  out  "):
        tokens = httpx.post(f"{api.url}/v1/tokenize", json={"content": text}).json()["tokens"]
        assert tokens and all(isinstance(t, int) for t in tokens)
        assert httpx.post(f"{api.url}/v1/detokenize", json={"tokens": tokens}).json() == {"content": text}
    marker = httpx.post(f"{api.url}/tokenize", json={"input": "<|im_end|>"}).json()["tokens"]
    assert len(marker) == 1, "marker text is its token; no chat scaffold is added"


def test_tokenize_refusals(api: HttpDaemon) -> None:
    reply = httpx.post(f"{api.url}/v1/tokenize", json={"add_special": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "content"
    reply = httpx.post(f"{api.url}/v1/detokenize", json={"tokens": [1, -5]})
    assert reply.status_code == 400 and "vocabulary" in reply.json()["error"]["message"]
    reply = httpx.post(f"{api.url}/v1/tokenize", json={"content": "x", "model": "no-such-model"})
    assert reply.status_code == 404


def test_props(api: HttpDaemon) -> None:
    props = httpx.get(f"{api.url}/props").json()
    assert props["model"] == httpx.get(f"{api.url}/props", params={"model": "smollm2"}).json()["model"]
    assert props["max_context"] == props["default_generation_settings"]["n_ctx"] == 1024
    settings = props["default_generation_settings"]
    assert {"temperature", "top_p", "top_k", "min_p"} <= set(settings)
    assert "im_start" in props["chat_template"]
    assert props["total_slots"] == 2 and props["n_embd"] > 0
    kv = props["kv_cache"]
    assert kv["slot_tokens"] == 1024 and kv["slots"] >= 2 and kv["pool_tokens"] == kv["slots"] * 1024
    assert {"chat", "embeddings", "tokenize"} <= set(props["capabilities"])
    assert httpx.get(f"{api.url}/props", params={"model": "no-such-model"}).status_code == 404


def slot(api: HttpDaemon) -> dict:
    entries = httpx.get(f"{api.url}/slots").json()
    assert len(entries) == 1 and entries[0]["id"] == 0
    return entries[0]


def test_slots_follow_a_forced_length_generation(api: HttpDaemon) -> None:
    idle = slot(api)
    expected = {
        "lanes",
        "lanes_active",
        "n_ctx",
        "kv_tokens_used",
        "tick_in_flight",
        "decode_tokens_per_second",
        "prefill_tokens_per_second",
        "last_ttft_seconds",
        "is_processing",
    }
    assert expected <= set(idle)
    assert idle["lanes"] == 2 and idle["n_ctx"] == 1024 and idle["lanes_active"] == 0 and not idle["is_processing"]
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply: list[httpx.Response] = []
    chat = threading.Thread(
        target=lambda: reply.append(httpx.post(f"{api.url}/v1/chat/completions", json=body, timeout=300))
    )
    chat.start()
    seen: list[dict] = []
    while chat.is_alive():
        seen.append(slot(api))
        time.sleep(0.05)
    chat.join()
    assert reply[0].json()["usage"]["completion_tokens"] == 64
    busy = [s for s in seen if s["lanes_active"] == 1]
    assert busy and all(s["is_processing"] for s in busy)
    assert any(s["tick_in_flight"] for s in seen)
    after = slot(api)
    assert after["lanes_active"] == 0 and not after["is_processing"]
    assert after["kv_tokens_used"] >= 64, "the finished conversation stays cached"
    assert after["decode_tokens_per_second"] > 0 and after["prefill_tokens_per_second"] > 0
    assert after["last_ttft_seconds"] > 0


def test_saving_and_restoring_slots_is_retired(api: HttpDaemon) -> None:
    for path in ("/slots/0/save", "/slots/0/restore", "/slots/0?action=save"):
        reply = httpx.post(f"{api.url}{path}", json={"filename": "x.bin"})
        assert reply.status_code == 501 and reply.json()["error"]["code"] == "route_retired", path
