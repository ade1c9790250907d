"""OpenAI's files and batches (/v1/files, /v1/batches), driven by the official `openai` client.

Every assertion holds on any machine: forced lengths (`ignore_eos`) and a batch's reply
equal to the same request sent directly (greedy: the same request twice gives the same
text). A daemon killed mid-batch finishes it once started again, every request exactly once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import HttpDaemon, chat_body, openai_at

pytestmark = pytest.mark.e2e

ENDED = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("batches"), max_context=1024, max_batch=4).start()
    yield proc
    proc.stop()


@pytest.fixture
def oa(api: HttpDaemon) -> openai.OpenAI:
    return openai_at(api.url)


def chat_line(custom_id: str, content: str, tokens: int) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": chat_body(content, tokens, False),
    }


def sent(body: dict[str, Any]) -> dict[str, Any]:
    """A request body as the SDK's arguments: `ignore_eos` (end-of-generation banned, so the reply
    is exactly `max_tokens` long on every machine), which the SDK has no parameter for, in extra_body."""
    fields = dict(body)
    extra = {"ignore_eos": fields.pop("ignore_eos")}
    return {**fields, "extra_body": extra}


def jsonl(lines: list[Any]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def upload(oa: openai.OpenAI, lines: list[Any]) -> str:
    return oa.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch").id


def create(oa: openai.OpenAI, file_id: str, endpoint: str = "/v1/chat/completions") -> openai.types.Batch:
    return oa.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")


def wait(oa: openai.OpenAI, batch_id: str, until: tuple[str, ...] = ENDED, timeout: float = 120) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while (batch := oa.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def lines_of(oa: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [] if file_id is None else [json.loads(line) for line in oa.files.content(file_id).text.splitlines()]


def test_files_round_trip(oa: openai.OpenAI) -> None:
    first = oa.files.create(file=("a.jsonl", b'{"a": 1}\n'), purpose="batch")
    second = oa.files.create(file=("notes.txt", b"plain bytes"), purpose="user_data")
    assert first.id.startswith("file-") and first.object == "file" and first.status == "processed"
    assert (first.bytes, first.filename, first.purpose) == (9, "a.jsonl", "batch")
    assert oa.files.retrieve(second.id).model_dump() == second.model_dump()
    assert oa.files.content(first.id).content == b'{"a": 1}\n'

    newest = [f.id for f in oa.files.list()]
    assert newest.index(second.id) < newest.index(first.id)  # newest first by default
    assert [f.id for f in oa.files.list(purpose="user_data")] == [second.id]
    page = oa.files.list(order="asc", limit=1, after=first.id)
    assert [f.id for f in page.data] == [second.id] and page.has_more is False
    assert oa.files.list(order="asc", limit=1).has_more is True

    assert oa.files.delete(second.id).model_dump() == {"id": second.id, "object": "file", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        oa.files.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        oa.files.content(second.id)
    assert second.id not in [f.id for f in oa.files.list()]
    with pytest.raises(openai.BadRequestError, match="purpose 'nonsense' is not one of batch"):
        oa.files.create(file=("a.jsonl", b"{}"), purpose="nonsense")


def test_an_upload_over_the_limit_is_refused(api: HttpDaemon) -> None:
    """Sent without a length, so it is the upload route that counts and refuses it."""
    limit = 100 << 20

    def body() -> Iterator[bytes]:
        yield b'--xx\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--xx\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        for _ in range(limit // (1 << 20) + 1):
            yield b"x" * (1 << 20)
        yield b"\r\n--xx--\r\n"

    kind = {"content-type": "multipart/form-data; boundary=xx"}
    reply = httpx.post(f"{api.url}/v1/files", content=body(), headers=kind, timeout=60)
    assert reply.status_code == 413 and "104857600-byte limit" in reply.json()["error"]["message"]


def test_a_batch_of_chats_answers_as_the_requests_sent_directly(oa: openai.OpenAI) -> None:
    requests = [chat_line(f"q{i}", f"Say something about the number {i}.", 3 + i % 3) for i in range(6)]
    batch = create(oa, upload(oa, requests))
    assert batch.id.startswith("batch_") and batch.status == "validating" and batch.endpoint == "/v1/chat/completions"
    done = wait(oa, batch.id)
    assert done.status == "completed" and done.error_file_id is None and done.errors is None
    assert done.request_counts is not None and done.request_counts.model_dump() == {
        "total": 6,
        "completed": 6,
        "failed": 0,
    }
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.output_file_id in [f.id for f in oa.files.list(purpose="batch_output")]
    lines = lines_of(oa, done.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == [f"q{i}" for i in range(6)]
    bodies = {request["custom_id"]: request["body"] for request in requests}
    for line in lines:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "length"
        request = bodies[line["custom_id"]]
        assert body["usage"]["completion_tokens"] == request["max_tokens"]
        direct = oa.chat.completions.create(**sent(request))
        assert body["choices"][0]["message"] == direct.choices[0].message.model_dump(exclude_none=True)
    assert batch.id in [b.id for b in oa.batches.list()]


def test_a_batch_of_completions_with_failing_lines(oa: openai.OpenAI) -> None:
    """Lines the endpoint refuses are the error file's, with their status and error."""

    def line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}

    good = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    requests = [
        line("good", good),
        line("no-prompt", {"model": "smollm2", "max_tokens": 4}),
        line("streamed", {**good, "stream": True}),
    ]
    done = wait(oa, create(oa, upload(oa, requests), "/v1/completions").id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    [reply] = lines_of(oa, done.output_file_id)
    direct = oa.completions.create(**sent(good))
    assert reply["custom_id"] == "good" and reply["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    failed = {line["custom_id"]: line for line in lines_of(oa, done.error_file_id)}
    assert set(failed) == {"no-prompt", "streamed"}
    for entry in failed.values():
        assert entry["response"]["status_code"] == 400 and entry["error"]["message"]
    assert "prompt" in failed["no-prompt"]["error"]["message"]
    assert "stream" in failed["streamed"]["error"]["message"]


def test_a_bad_input_file_fails_the_batch_line_by_line(oa: openai.OpenAI) -> None:
    good = chat_line("a", "Hi", 2)
    bad = [
        good,
        "not json",
        {**good, "method": "GET", "custom_id": "b"},
        {**good, "url": "/v1/completions", "custom_id": "c"},
        {**good},  # custom_id "a" again
    ]
    data = b"".join((raw if isinstance(raw, str) else json.dumps(raw)).encode() + b"\n" for raw in bad)
    file_id = oa.files.create(file=("bad.jsonl", data), purpose="batch").id
    done = wait(oa, create(oa, file_id).id)
    assert done.status == "failed" and done.failed_at and done.errors is not None and done.errors.data is not None
    found = [(e.line, e.code) for e in done.errors.data]
    assert found == [(2, "invalid_json_line"), (3, "invalid_method"), (4, "invalid_url"), (5, "duplicate_custom_id")]
    assert done.output_file_id is None

    with pytest.raises(openai.BadRequestError, match="/v1/embeddings is not served in a batch"):
        create(oa, file_id, "/v1/embeddings")
    with pytest.raises(openai.BadRequestError, match="completion_window must be 24h"):
        oa.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError, match="no file file-"):
        create(oa, "file-" + "0" * 32)
    notes = oa.files.create(file=("n.jsonl", jsonl([good])), purpose="user_data").id
    with pytest.raises(openai.BadRequestError, match="purpose batch"):
        create(oa, notes)


def test_interactive_work_runs_beside_a_batch_which_is_then_cancelled(oa: openai.OpenAI) -> None:
    file_id = upload(oa, [chat_line(f"c{i}", f"Write a long story number {i}.", 64) for i in range(24)])
    batch = wait(oa, create(oa, file_id).id, ("in_progress", *ENDED))
    interactive = {"x-superfluid-qos": "interactive"}
    body = chat_body("Hello!", 4, False)
    reply = oa.chat.completions.create(**sent(body), extra_headers=interactive)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert oa.batches.retrieve(batch.id).status == "in_progress"  # answered while the batch runs, not after it
    with pytest.raises(openai.ConflictError, match="cancel it or let it end"):
        oa.files.delete(file_id)
    assert oa.batches.cancel(batch.id).status == "cancelling"
    done = wait(oa, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at and done.request_counts is not None
    finished = [line["custom_id"] for line in lines_of(oa, done.output_file_id)]
    assert len(finished) == len(set(finished)) == done.request_counts.completed < 24
    assert oa.batches.cancel(batch.id).status == "cancelled"
    assert oa.files.delete(file_id).deleted


def journal(daemon: HttpDaemon, batch_id: str) -> list[dict[str, Any]]:
    """The lines of a batch's requests that finished, as the daemon wrote them to disk."""
    path = daemon.sessions / "batches" / f"{batch_id}.jsonl"
    whole = path.read_text().split("\n")[:-1] if path.exists() else []  # less a line being written
    return [json.loads(line) for line in whole]


def test_a_batch_survives_restarts_and_belongs_to_its_key(tmp_path: Path) -> None:
    """Stopped (SIGTERM) then killed (SIGKILL) mid-batch, the daemon finishes it once started again:
    what it had written stays as written, and each request is in the output once. Under a key
    policy, the batch and its files are its key's alone."""
    policy = tmp_path / "keys.json"
    policy.write_text(json.dumps({"keys": [{"name": "alice", "key": "alice-key"}, {"name": "bob", "key": "bob-key"}]}))
    daemon = HttpDaemon(tmp_path, "--key-policy", str(policy), max_context=1024, max_batch=4).start()

    def as_(key: str) -> openai.OpenAI:
        return openai_at(daemon.url, api_key=key)

    try:
        total = 8
        requests = [chat_line(f"r{i}", f"Tell me about the year {1900 + i}.", 12) for i in range(total)]
        batch = create(as_("alice-key"), upload(as_("alice-key"), requests))
        written: list[dict[str, Any]] = []
        for stop in (daemon.stop, daemon.kill):
            deadline = time.monotonic() + 120
            while len(journal(daemon, batch.id)) <= len(written):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            stop()
            written = journal(daemon, batch.id)
            assert len(written) < total
            daemon.start()
        alice, bob = as_("alice-key"), as_("bob-key")
        done = wait(alice, batch.id)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (total, total)
        lines = lines_of(alice, done.output_file_id)
        assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(total))
        assert all(line in lines for line in written)  # nothing written before a stop was run again

        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            bob.files.content(done.output_file_id or "")
        assert bob.batches.list().data == [] and bob.files.list().data == []
        with pytest.raises(openai.AuthenticationError):
            as_("wrong-key").files.list()
    finally:
        daemon.stop()
