"""`superfluid chat`: on a real pseudo-terminal (tmux) against the embedded model, and its parts alone.

The model's words differ from CPU to CPU, so the checks read what the chat showed against what the
session log holds, never against expected wording.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import free_port
from terminal import Terminal

from superfluid.cli.chat import Chat, ChatError, _interruptible, parse_params, read_conversation, read_message
from superfluid.client import SocketClient
from superfluid.protocol.schema import EventBody, EventMsg, GenParams, Request, Response

B = EventBody


def lines(*typed: str) -> Callable[[str], str]:
    """An `input` that answers with these lines."""
    answers = iter(typed)
    return lambda _prompt: next(answers)


def test_a_message_spans_lines_in_a_block_or_after_a_backslash() -> None:
    assert read_message(lines("one line")) == "one line"
    assert read_message(lines("first \\", "second")) == "first \nsecond"
    assert read_message(lines('"""def f():', "    return 1", '"""')) == "def f():\n    return 1"
    assert read_message(lines('"""all on one"""')) == "all on one"


def test_params_take_key_value_words_and_name_what_is_accepted() -> None:
    current = GenParams(0.7, 0.95, 0.05, 40, 1)
    wanted, length = parse_params(["temperature=0", "seed=9", "max_tokens=20"], current, 100)
    assert (wanted.temperature, wanted.seed, wanted.top_p, length) == (0.0, 9, 0.95, 20)
    for bad, said in (("temp=1", "key of temperature"), ("top_k=x", "not a number"), ("max_tokens=0", "at least")):
        with pytest.raises(ChatError, match=said):
            parse_params([bad], current, 100)


def test_ctrl_c_cancels_the_reply_and_reads_it_to_its_end() -> None:
    cancelled: list[bool] = []

    def replies() -> Iterator[int]:
        yield 1
        raise KeyboardInterrupt

    assert list(_interruptible(replies(), lambda: cancelled.append(True))) == [1]
    assert cancelled == [True]


def test_generated_runs_make_one_numbered_assistant_message() -> None:
    bodies = [
        B.Created(None, GenParams(0.0, 1.0, 0.0, 0, 0)),
        B.Message(1, "Hi", []),
        B.GenerationPrompt([]),
        B.Generated([], "mull", 1, 0),
        B.Generated([], "Hel", 0, 0),
        B.Generated([], "lo", 0, 1),
        B.Message(1, "Again", []),
    ]
    talk = read_conversation([EventMsg(i, 0, 0, body) for i, body in enumerate(bodies)])
    shown = [(m.number, m.role, m.text, m.event, m.reasoning) for m in talk.messages]
    assert shown == [(1, "user", "Hi", 1, ""), (2, "assistant", "Hello", 2, "mull"), (3, "user", "Again", 6, "")]
    assert talk.next_event == 7 and talk.params == GenParams(0.0, 1.0, 0.0, 0, 0)


def _messages(client: SocketClient, session: int) -> list[tuple[str, str]]:
    events = client.call(Request.Read(session, 0))
    assert isinstance(events, Response.Events), events
    return [(m.role, m.text) for m in read_conversation(events.events).messages]


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform != "linux", reason="tmux and a pseudo-terminal")
def test_chat_streams_forks_edits_and_resumes_after_a_restart(tmp_path: Path) -> None:
    home, socket = tmp_path / "home", tmp_path / "sf.sock"
    env = {"SUPERFLUID_HOME": str(home), "SUPERFLUID_KERNELS": "exact"}
    superfluid = str(Path(sys.executable).parent / "superfluid")
    chat = [superfluid, "chat", "--socket", str(socket), "--http", f"127.0.0.1:{free_port()}", "--max-tokens", "24"]

    stop = [superfluid, "stop"]
    try:
        # no daemon answers: the chat starts one, as launch does
        with Terminal("chat") as term:
            term.start([*chat, "--temperature", "0"], env=env)
            term.wait_for("session 1: a new conversation", timeout=180)
            term.type("Name a colour.")
            with SocketClient(socket) as client:
                screen = term.wait_for(lambda s: s.count(">>>") >= 2)
                reply = _messages(client, 1)
                assert [role for role, _ in reply] == ["user", "assistant"], reply
                assert reply[1][1].strip()[:20] in screen, "the reply on screen is the one in the log"

                term.type("/fork")
                term.wait_for("session 2: a fork of 1")
                term.type("/edit 1 Name a fruit.")
                term.wait_for(lambda s: "session 3: a branch of 2 from message 1" in s and s.count(">>>") >= 4)
                tree = client.call(Request.Tree())
                assert isinstance(tree, Response.Tree)
                assert {(s, parent) for s, parent, _ in tree.nodes} == {(1, None), (2, 1), (3, 2)}
                assert _messages(client, 2) == reply, "a fork holds the conversation so far"
                branch = _messages(client, 3)
                assert branch[0] == ("user", "Name a fruit.") and [r for r, _ in branch] == ["user", "assistant"]

                term.type("/history")
                term.wait_for("[1] user: Name a fruit.")
                term.type("/bye")
        assert subprocess.run(stop, env={**os.environ, **env}).returncode == 0

        # a new daemon, started by the chat again, resumes session 3 from the log
        with Terminal("resume") as term:
            term.start([*chat, "--session", "3"], env=env)
            term.wait_for("[1] user: Name a fruit.", timeout=180)
            term.type("And a vegetable?")
            term.wait_for(lambda s: s.count(">>>") >= 2)
            with SocketClient(socket) as client:
                resumed = _messages(client, 3)
            assert resumed[:2] == branch and resumed[2] == ("user", "And a vegetable?") and len(resumed) == 4
    finally:
        subprocess.run(stop, env={**os.environ, **env}, capture_output=True)


class ScriptedDaemon:
    """The two calls a chat's reply makes of its client, answered from a script of generated events."""

    def __init__(self, bodies: list[EventBody]) -> None:
        self.bodies = bodies

    def generate(self, session: int, max_tokens: int) -> Iterator[object]:
        for i, body in enumerate(self.bodies):
            yield Response.Delta(EventMsg(10 + i, 0, 0, body))
        yield Response.Generated([], 3, 1, 0)


def test_reasoning_is_folded_into_one_line_and_think_unfolds_it(tmp_path: Path) -> None:
    out = io.StringIO()
    script = ScriptedDaemon(
        [B.Generated([], "The user wants ", 1, 0), B.Generated([], "a colour.", 1, 0), B.Generated([], "Blue.", 0, 1)]
    )
    chat = Chat(tmp_path / "sf.sock", 1, 16, out, script)  # type: ignore[arg-type]
    chat.reply()
    shown = out.getvalue()
    assert "(reasoned in 5 words; /think shows them)" in shown and shown.rstrip().endswith("Blue.")
    assert "The user wants" not in shown, "the reasoning itself is folded away"
    chat.commands["think"]("")
    assert out.getvalue().endswith("The user wants a colour.\n")
