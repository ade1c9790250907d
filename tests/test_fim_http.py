"""Fill in the middle over HTTP: OpenAI /v1/completions with suffix, llama.cpp's /infill and
Ollama /api/generate with suffix build the socket's `Complete` prompt and run it like any
completion (streamed or whole, in the completion class, on `--fim-model`'s model).

The model text is never asserted: each route's greedy text is compared with `Complete`'s.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from conftest import HttpDaemon

from superfluid.core.fim import FimError, check_fim, fim_prompt, fim_runtime, missing_markers, repo_context
from superfluid.engine.llama import LlamaModel
from superfluid.model.resolve import embedded_model
from superfluid.protocol.schema import FIM_PSM, FIM_SPM, QOS_BACKGROUND, QOS_COMPLETION, Request, Response

pytestmark = pytest.mark.e2e

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))"
FIM_TOKENS = (3, 5, 6)  # what tests/test_tools_e2e.py names for SmolLM2, whose GGUF has none
MAX = 8
TIMEOUT = 120


class FakeModel:
    """A vocabulary of one token per character, for the prompt's layout alone."""

    name = "fake"

    def __init__(self, fim: dict[str, int]) -> None:
        self.fim = fim

    def tokenize(self, text: str, special: bool) -> list[int]:
        return [1000 + ord(c) for c in text]


def _ids(text: str) -> list[int]:
    return FakeModel({}).tokenize(text, False)


def test_the_fim_prompt_is_one_layout_for_every_route(monkeypatch: pytest.MonkeyPatch) -> None:
    model = FakeModel({"prefix": 1, "suffix": 2, "middle": 3})
    assert fim_prompt(model, "ab", "c") == [1, *_ids("ab"), 2, *_ids("c"), 3]
    assert fim_prompt(model, "ab", "c", FIM_SPM) == [2, *_ids("c"), 1, *_ids("ab"), 3]
    assert fim_prompt(model, "", "") == [1, 2, 3]
    with pytest.raises(FimError, match="unknown FIM mode 5"):
        fim_prompt(model, "a", "b", 5)
    lacking = FakeModel({"prefix": 1, "suffix": -1, "middle": -1})
    assert missing_markers(lacking) == ["suffix", "middle"]
    with pytest.raises(FimError, match="no FIM dialect: fake has no suffix, middle token"):
        check_fim(lacking, 5)  # the missing markers are named before the mode is looked at
    # input_extra: nothing without chunks; the snippet separator without repo tokens
    assert repo_context(model, []) == []
    assert repo_context(model, [("a.py", "x = 1")]) == _ids("\n\n--- snippet ---\n\n") + _ids("x = 1")
    monkeypatch.setattr("superfluid.core.fim.repo_tokens", lambda m: (7, 8))
    assert repo_context(model, [("a.py", "x"), ("b.py", "y")]) == [
        *[7, *_ids("myproject\n")],
        *[8, *_ids("a.py\n"), *_ids("x")],
        *[8, *_ids("b.py\n"), *_ids("y")],
        *[8, *_ids("filename\n")],
    ]


def test_fim_model_picks_the_model_fim_runs_on() -> None:
    runtimes = {"chat": "chat runtime", "coder": "coder runtime"}

    def models(fim_model: str | None) -> Any:
        return SimpleNamespace(
            config=SimpleNamespace(fim_model=fim_model),
            default_id="chat",
            known=runtimes,
            find=lambda name: name if name in runtimes else None,
            runtime=runtimes.__getitem__,
        )

    assert fim_runtime(models(None)) == "chat runtime"
    assert fim_runtime(models("coder")) == "coder runtime"
    with pytest.raises(FimError, match="--fim-model 'nope' is not served here; known models: chat, coder"):
        fim_runtime(models("nope"))


@pytest.fixture(scope="module")
def vocab() -> LlamaModel:
    model = LlamaModel(embedded_model().path, vocab_only=True)
    model.set_fim(*FIM_TOKENS)
    return model


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    """The embedded model (the default) and a copy of it, `second`, that FIM runs on; exact kernels,
    so that a warm prefix gives the logits of a cold one and greedy texts compare on any CPU."""
    root = tmp_path_factory.mktemp("fim")
    second = root / "models" / "second.gguf"
    second.parent.mkdir()
    try:
        os.link(embedded_model().path, second)
    except OSError:
        shutil.copyfile(embedded_model().path, second)
    fim = ",".join(map(str, FIM_TOKENS))
    proc = HttpDaemon(
        root,
        *("--model", str(embedded_model().path), "--model", str(second)),
        *("--fim-tokens", fim, "--fim-model", "second", "--kernels", "exact"),
        max_context=1024,
        max_batch=2,
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    """The embedded model as its GGUF has it: no FIM tokens."""
    proc = HttpDaemon(tmp_path_factory.mktemp("plain"), max_context=1024, max_batch=1).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def complete(api: HttpDaemon) -> Response.Completion:
    """What the socket's Complete makes of the gap, greedy."""
    with api.client() as c:
        reply = c.call(Request.Complete(PREFIX, SUFFIX, FIM_PSM, MAX))
    assert isinstance(reply, Response.Completion), reply
    return reply


def post(api: HttpDaemon, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", json=body, headers=headers, timeout=TIMEOUT)


def sse(api: HttpDaemon, path: str, body: dict[str, Any]) -> list[Any]:
    """The `data:` objects of a streamed reply (`[DONE]` as the string)."""
    with httpx.stream("POST", f"{api.url}{path}", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


OPENAI = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": MAX, "temperature": 0}
INFILL = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": MAX, "temperature": 0}
OLLAMA = {"model": "second", "prompt": PREFIX, "suffix": SUFFIX, "options": {"num_predict": MAX, "temperature": 0}}


def test_three_http_shapes_fill_in_the_gap_as_complete_does(
    api: HttpDaemon, complete: Response.Completion, vocab: LlamaModel
) -> None:
    prompt = len(fim_prompt(vocab, PREFIX, SUFFIX))
    assert prompt == len(vocab.tokenize(PREFIX, False)) + len(vocab.tokenize(SUFFIX, False)) + 3
    openai = post(api, "/v1/completions", OPENAI)
    assert openai.status_code == 200, openai.text
    body = openai.json()
    assert body["choices"][0]["text"] == complete.text and body["model"] == "second", "--fim-model ran it"
    assert body["usage"]["prompt_tokens"] == prompt and body["usage"]["completion_tokens"] == len(complete.tokens)
    infill = post(api, "/infill", INFILL).json()
    assert infill["content"] == complete.text and infill["stop"] is True and infill["model"] == "second"
    assert infill["tokens_evaluated"] == prompt and infill["tokens_predicted"] == len(complete.tokens)
    assert infill["stop_type"] in ("eos", "limit")
    ollama = post(api, "/api/generate", {**OLLAMA, "stream": False}).json()
    assert ollama["response"] == complete.text and ollama["done"] is True
    assert ollama["prompt_eval_count"] == prompt and ollama["eval_count"] == len(complete.tokens)
    # the default model, named: the same weights, so the same text; chat stays on the default
    named = post(api, "/v1/completions", {**OPENAI, "model": "smollm2"}).json()
    assert named["choices"][0]["text"] == complete.text and named["model"] == "smollm2"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "ignore_eos": True}
    default = next(m["id"] for m in httpx.get(f"{api.url}/v1/models").json()["data"] if m["default"])
    assert default != "second" and post(api, "/v1/chat/completions", chat).json()["model"] == default
    shown = post(api, "/api/show", {"model": "second"}).json()
    assert "insert" in shown["capabilities"], "Ollama's word for a model that fills in the middle"


def test_each_shape_streams(api: HttpDaemon, complete: Response.Completion, vocab: LlamaModel) -> None:
    prompt = len(fim_prompt(vocab, PREFIX, SUFFIX))
    chunks = sse(api, "/v1/completions", OPENAI)
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["prompt_tokens"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == complete.text
    lines = sse(api, "/infill", INFILL)
    *parts, last = lines
    assert all(p["stop"] is False for p in parts) and last["stop"] is True and last["tokens_evaluated"] == prompt
    assert "".join(p["content"] for p in lines) == complete.text
    with httpx.stream("POST", f"{api.url}/api/generate", json=OLLAMA, timeout=TIMEOUT) as r:
        objects = [json.loads(line) for line in r.iter_lines() if line]
    assert objects[-1]["done"] is True and objects[-1]["prompt_eval_count"] == prompt
    assert not any(o["done"] for o in objects[:-1])
    assert "".join(o["response"] for o in objects) == complete.text


def test_completions_echo_and_legacy_logprobs(api: HttpDaemon, complete: Response.Completion) -> None:
    body = post(api, "/v1/completions", {**OPENAI, "echo": True, "logprobs": 2}).json()
    choice = body["choices"][0]
    assert choice["text"] == PREFIX + complete.text
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == complete.text and len(logprobs["tokens"]) == len(complete.tokens)
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"])
    offsets = [len(PREFIX)]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets, "where each token starts in the text, after the echoed prompt"
    rows = zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    for token, logprob, top in rows:
        assert logprob <= 0 and top[token] == logprob and len(top) <= 3
    chunks = sse(api, "/v1/completions", {**OPENAI, "echo": True, "logprobs": 1})[:-1]
    assert chunks[0]["choices"][0]["text"] == PREFIX, "the echoed prompt comes first"
    assert "".join(c["choices"][0]["text"] for c in chunks) == PREFIX + complete.text
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == logprobs["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == offsets
    raw = post(api, "/v1/completions", {"prompt": "The sea is", "max_tokens": 3, "echo": True, "logprobs": 0})
    assert raw.json()["choices"][0]["text"].startswith("The sea is"), "echo without suffix too"
    refused = post(api, "/v1/completions", {**OPENAI, "logprobs": 21})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"


def test_infill_puts_extra_files_first_and_trims_them_to_fit(
    api: HttpDaemon, complete: Response.Completion, vocab: LlamaModel
) -> None:
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    chunks = [(e["filename"], e["text"]) for e in extra]
    expected = len(repo_context(vocab, chunks)) + len(fim_prompt(vocab, PREFIX, SUFFIX))
    reply = post(api, "/infill", {**INFILL, "input_extra": extra}).json()
    assert reply["tokens_evaluated"] == expected > len(fim_prompt(vocab, PREFIX, SUFFIX))
    # the current line (`prompt`) follows input_prefix: the same gap as the prefix holding it
    split = post(api, "/infill", {**INFILL, "input_prefix": PREFIX[:-7], "prompt": PREFIX[-7:]}).json()
    assert split["content"] == complete.text
    huge = [{"filename": f"f{i}.py", "text": "x = 1\n" * 200} for i in range(4)]
    trimmed = post(api, "/infill", {**INFILL, "input_extra": huge})
    assert trimmed.status_code == 200, trimmed.text
    assert trimmed.json()["tokens_evaluated"] <= 1024 - MAX, "the oldest extra context made room for the reply"


def _last_session_events(api: HttpDaemon) -> list[Any]:
    with api.client() as c:
        ids = c.call(Request.List()).ids
        return c.call(Request.Read(max(ids), 0)).events


def _qos(events: list[Any]) -> list[int]:
    return [e.body.class_ for e in events if type(e.body).__name__ == "QosSet"]


def test_completions_default_to_the_completion_class(api: HttpDaemon) -> None:
    assert post(api, "/v1/completions", {**OPENAI, "max_tokens": 1}).status_code == 200
    assert _qos(_last_session_events(api)) == [QOS_COMPLETION]
    headers = {"x-superfluid-qos": "background"}
    assert post(api, "/infill", {**INFILL, "n_predict": 1}, **headers).status_code == 200
    assert _qos(_last_session_events(api)) == [QOS_BACKGROUND], "the header still wins"
    assert post(api, "/api/generate", {**OLLAMA, "stream": False}).status_code == 200
    assert _qos(_last_session_events(api)) == [QOS_COMPLETION]
    assert post(api, "/v1/completions", {"prompt": "The sea is", "max_tokens": 1}).status_code == 200
    assert _qos(_last_session_events(api)) == [QOS_COMPLETION], "every /v1/completions"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert post(api, "/v1/chat/completions", chat).status_code == 200
    assert _qos(_last_session_events(api)) == [], "chat keeps the agent class"


def test_a_model_without_fim_tokens_is_refused_on_every_shape(plain: HttpDaemon) -> None:
    def says_what_it_lacks(message: str) -> None:
        assert "no FIM dialect" in message and "no prefix, suffix, middle token" in message, message

    openai = post(plain, "/v1/completions", OPENAI)
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "suffix"
    says_what_it_lacks(openai.json()["error"]["message"])
    infill = post(plain, "/infill", INFILL)
    assert infill.status_code == 400
    says_what_it_lacks(infill.json()["error"]["message"])
    ollama = post(plain, "/api/generate", {**OLLAMA, "model": "smollm2"})
    assert ollama.status_code == 400
    says_what_it_lacks(ollama.json()["error"])
    with plain.client() as c:
        says_what_it_lacks(c.call(Request.Complete(PREFIX, SUFFIX, FIM_PSM, MAX)).message)
    assert "insert" not in post(plain, "/api/show", {}).json()["capabilities"]
    still = post(plain, "/v1/completions", {"prompt": "The sea is", "max_tokens": 2, "ignore_eos": True})
    assert still.status_code == 200 and still.json()["usage"]["completion_tokens"] == 2, "no suffix, no FIM"
