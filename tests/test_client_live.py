"""clients/python against a real daemon on the embedded model, and its two examples."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import WebDaemon
from superfluid_client import Client, Sampling, SessionBusy, SuperfluidError, drop_events

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parent.parent / "clients" / "python" / "examples"
STORY = "Tell a short story about a lighthouse."


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDaemon]:
    proc = WebDaemon(tmp_path_factory.mktemp("client"), max_batch=4).start()
    yield proc
    proc.stop()


@pytest.fixture
def sf(web: WebDaemon) -> Client:
    return Client(web.url, token_file=web.sessions / "web-token")


def test_session_messages_and_generate(sf: Client) -> None:
    s = sf.session(Sampling.greedy(), system="You are terse.")
    q = s.user("Name three rivers.")
    assert q.kind == "Message" and q.data["role"] == 1 and q.id == 2
    reply = s.generate(12, ignore_eos=True)
    assert reply.tokens == 12 and reply.finish == "length" and reply.text == str(reply)
    assert {e.kind for e in reply.events} <= {"Generated", "ToolUse", "ToolParseFailure"}
    messages = s.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[2]["content"] == reply.text and messages[1]["event"] == q.id
    assert s.assistant("Noted.").data["role"] == 2
    assert s.head == len(s.events())
    assert sf.get(s.id).sampling == Sampling.greedy()


def test_streaming_with_and_without_leaving_early(sf: Client) -> None:
    s = sf.session(Sampling(temperature=0.9, top_k=40, seed=11))
    s.user(STORY)
    chunks = list(s.stream(20, ignore_eos=True))
    assert chunks and all(c.kind in ("text", "reasoning") for c in chunks)

    cut = sf.session(Sampling(temperature=0.9, top_k=40, seed=11))
    cut.user(STORY)
    whole = cut.fork().generate(60, ignore_eos=True)
    for n, _ in enumerate(cut.stream(60, ignore_eos=True), 1):
        if n == 9:
            break
    rest = cut.generate(60, ignore_eos=True)  # the session is idle again at once
    assert rest.warm_prefix > 0
    joined = "".join(m.get("reasoning", "") + m["content"] for m in cut.messages() if m["role"] == "assistant")
    assert joined.startswith(whole.reasoning + whole.text), "cancel + continue draws exactly the uncut text"


def test_busy_and_cancel(sf: Client) -> None:
    s = sf.session(Sampling.greedy())
    s.user(STORY)
    stream = s.stream(400, ignore_eos=True)
    next(stream)
    with pytest.raises(SessionBusy):
        s.user("wait")
    with pytest.raises(SessionBusy):
        s.generate(3)
    assert s.cancel() is True
    for _ in stream:
        pass
    assert stream.reply is not None and stream.reply.finish == "cancelled"
    assert s.cancel() is False


def test_forks_share_their_prefix_warm(sf: Client) -> None:
    base = sf.session(Sampling.greedy(), system="You answer questions about a document.")
    shared = base.user("Here is a document:\n\n" + "Tides rise and fall twice a day because of the moon. " * 30)
    base.assistant("I have read it.")
    primer = base.fork()
    primer.user("Reply with OK.")
    primer.generate(1)
    shared_tokens = base.inspect()["summary"]["tokens"]
    head = base.head
    branch = base.fork(seed=3)
    assert branch.sampling.seed == 3 and branch.sampling.temperature == 0.0
    branch.user("Why are there two tides?")
    reply = branch.generate(8)
    assert reply.warm_prefix >= 0.9 * shared_tokens
    after = base.fork_after(shared)
    assert after.head == shared.id + 2  # the shared events, then its own Forked
    assert (branch.id, base.id, head) in sf.tree()


def test_a_fork_right_after_a_stream_starts_warm(tmp_path: Path) -> None:
    proc = WebDaemon(tmp_path).start()  # fresh: the defect showed on a daemon's first requests
    try:
        sf = Client(proc.url, token_file=proc.sessions / "web-token")
        s = sf.session(Sampling(temperature=0.7, seed=1), system="You are a code reviewer.")
        q = s.user("def add(a, b): return a - b")
        list(s.stream(max_tokens=24))
        sec = s.fork_after(q, seed=2)
        sec.user("Focus on security.")
        reply = sec.generate(16)
        shared = sum(len(e.data["span"]) for e in s.events()[: q.id + 1] if "span" in e.data)
        assert reply.warm_prefix >= shared, "the system and user messages come from the cache"
    finally:
        proc.stop()


def test_edit_rebase_trim(sf: Client) -> None:
    s = sf.session(Sampling.greedy())
    q = s.user("What is the capital of France?")
    s.generate(5)
    edited = s.edit(q, "What is the capital of Italy?")
    assert [m["content"] for m in edited.messages()] == ["What is the capital of Italy?"]
    with pytest.raises(ValueError, match="not a Message"):
        s.edit(0, "x")
    head = s.head
    dropped = s.rebase([drop_events(q.id + 1, head)])
    assert [e.kind for e in dropped.events()][-1] == "Rebased"
    trimmed = s.trim(q.id)
    assert [e.kind for e in trimmed.events()] == ["Created", "Rebased"]


def test_scheduling_metadata_and_listing(sf: Client) -> None:
    s = sf.session(Sampling.greedy())
    assert s.set_qos(0).kind == "QosSet" and s.inspect()["qos_class"] == 0
    deadline = s.pin(30)
    assert deadline > 0 and s.inspect()["pin_deadline_unix_ms"] == deadline
    assert s.set_meta(title="pinned chat") == 1
    assert any(x["id"] == s.id and x["title"] == "pinned chat" for x in sf.sessions())
    sf.set_background_rate(2)
    sf.set_background_rate(1)
    assert "superfluid_generations_total" in sf.metrics()
    assert sf.call("List") == ("Sessions", {"ids": [x["id"] for x in sf.sessions(include_archived=True)]})
    assert s.open_tool_calls() == []
    with pytest.raises(SuperfluidError, match="no FIM dialect"):
        sf.complete("def f(")
    child = s.fork()
    assert child.purge() == [child.id]
    with pytest.raises(SuperfluidError, match="was purged"):
        child.events()
    assert sf.health()


def test_reopen_after_restart(tmp_path: Path) -> None:
    proc = WebDaemon(tmp_path).start()
    try:
        sf = Client(proc.url, token_file=proc.sessions / "web-token")
        s = sf.session(Sampling(temperature=0.8, seed=99), system="Be brief.")
        s.user(STORY)
        first = s.generate(10, ignore_eos=True)
        proc.kill()
        proc.start()
        sf = Client(proc.url, token_file=proc.sessions / "web-token")
        again = sf.get(s.id)
        assert again.sampling == Sampling(temperature=0.8, seed=99)
        assert again.messages()[-1]["content"] == first.text
        rest = again.generate(10, ignore_eos=True)
        assistant = [m["content"] for m in again.messages() if m["role"] == "assistant"]
        assert rest.tokens == 10 and assistant == [first.text, rest.text], "a turn cut by length folds as its own entry"
    finally:
        proc.stop()


def test_fanout_example(web: WebDaemon, tmp_path: Path) -> None:
    document = tmp_path / "notes.txt"
    document.write_text("The harbour light was built in 1871. Its keeper logged every storm. " * 12)
    env = {**os.environ, "SUPERFLUID_WEB_URL": web.url, "SUPERFLUID_WEB_TOKEN": web.token}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "fanout.py"), "--context", str(document), "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "document prefilled once:" in result.stdout
    assert "reused the document's prefix: 4 of 4 forks" in result.stdout, result.stdout


def test_pull_the_plug_example() -> None:
    # a piece of streamed text holds the tokens of one 40 ms hand-over: a fast machine sends fewer, longer
    # pieces, so the kill comes after a few of a reply far longer than they can hold on any machine
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "pull_the_plug.py"),
            "--superfluid",
            str(Path(sys.executable).parent / "superfluid"),
            "--after",
            "8",
            "--max-tokens",
            "240",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "✗ kill -9" in result.stdout and "✓ restarted in" in result.stdout
    assert "✓ the final reply begins with everything committed before the kill" in result.stdout


def test_tool_result_on_a_tool_use(sf: Client) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    s = sf.session(Sampling.greedy(), system="Answer with the tools.", tools=[weather])
    s.user("Is it raining in Paris?")
    # the call is steered by appending its start; a grammar makes the model close it, on any machine
    s.append_tokens(
        [], text='<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    )
    reply = s.generate(16, grammar='root ::= "</tool_call>"')
    assert reply.finish == "grammar" and len(reply.tool_calls) == 1, (reply, reply.warm_prefix)
    call = reply.tool_calls[0]
    assert call.name == "get_weather" and call.json() == {"city": "Paris"}
    assert s.open_tool_calls() == [call]
    result = s.tool_result(call, "Light rain, 14 C")
    assert result.kind == "ToolResult" and result.data["call_id"] == call.id
    assert s.open_tool_calls() == []
    with pytest.raises(SuperfluidError, match="unknown or already closed"):
        s.tool_result(call, "again")
    roles = [m["role"] for m in s.messages()]
    assert "tool_call" in roles and roles[-1] == "tool"
