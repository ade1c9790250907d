"""The session API's verbs on an in-process daemon (`harness.py`): what they answer, what they write, what
they refuse, with the embedded model in this process and no daemon to start."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import InProcessDaemon

from superfluid.core.constraints import ConstraintError, constraint_grammar
from superfluid.core.errors import ContextTooLong, DaemonError
from superfluid.protocol.schema import FINISH_LENGTH, EventBody, PurgeMode, Request, Response

B = EventBody


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    with InProcessDaemon(tmp_path_factory.mktemp("verbs")) as harness:
        yield harness


def events(daemon: InProcessDaemon, session: int) -> list:
    reply = daemon.call(Request.Read(session, 0))
    assert isinstance(reply, Response.Events), reply
    return reply.events


def asked(daemon: InProcessDaemon, text: str) -> int:
    session = daemon.created()
    assert isinstance(daemon.call(Request.AppendMessage(session, 1, text)), Response.Committed)
    return session


def test_a_forced_generation_commits_exactly_its_tokens(daemon: InProcessDaemon) -> None:
    session = asked(daemon, "Name three rivers.")
    outcomes, done = daemon.generate(session, 12, ignore_eos=True)
    assert done.finish == FINISH_LENGTH and done.tokens_generated == 12
    generated = [e.body for e in events(daemon, session) if isinstance(e.body, B.Generated)]
    assert sum(len(body.span) for body in generated) == 12
    committed = [o.event.body for o in outcomes if hasattr(o, "event") and isinstance(o.event.body, B.Generated)]
    assert committed == generated, "the caller saw exactly what was committed"


def test_the_same_request_twice_gives_the_same_tokens(daemon: InProcessDaemon) -> None:
    runs = []
    for _ in range(2):
        session = asked(daemon, "Write a haiku about the sea.")
        daemon.generate(session, 10, ignore_eos=True)
        runs.append([t for e in events(daemon, session) if isinstance(e.body, B.Generated) for t in e.body.span])
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_a_refused_request_writes_nothing(daemon: InProcessDaemon) -> None:
    listed = daemon.call(Request.List())
    reply = daemon.call(Request.AppendMessage(10_000, 1, "Hello?"))
    assert isinstance(reply, Response.Err) and reply.message == "unknown session 10000"
    session = daemon.created()
    before = events(daemon, session)
    reply = daemon.call(Request.AppendMessage(session, 9, "Hello?"))
    assert isinstance(reply, Response.Err) and "unknown message role 9" in reply.message
    assert events(daemon, session) == before
    assert set(daemon.call(Request.List()).ids) == {*listed.ids, session}
    with pytest.raises(DaemonError, match="has no content to generate from"):
        daemon.generate(session, 4)


def test_a_prompt_longer_than_the_window_is_refused_with_its_length_and_nothing_written(
    daemon: InProcessDaemon,
) -> None:
    session = daemon.created()
    assert isinstance(daemon.call(Request.Append(session, None, [100] * 1030)), Response.Committed)
    before = events(daemon, session)
    with pytest.raises(ContextTooLong, match=r"maximum context length is 1024 tokens, but your request has 1030"):
        daemon.generate(session, 4)
    assert events(daemon, session) == before


def test_a_fork_starts_with_its_parents_events_up_to_the_fork_point(daemon: InProcessDaemon) -> None:
    parent = asked(daemon, "Tell me about lighthouses.")
    daemon.call(Request.AppendMessage(parent, 1, "And canals."))
    reply = daemon.call(Request.Fork(parent, 2, None))
    assert isinstance(reply, Response.Created)
    child = events(daemon, reply.session)
    assert [e.body for e in child[:2]] == [e.body for e in events(daemon, parent)[:2]], "its parent's, up to 2"
    assert isinstance(child[2].body, B.Forked) and len(child) == 3, "then the fork, and not the later turn"
    reply = daemon.call(Request.Fork(parent, 99, None))
    assert isinstance(reply, Response.Err) and "fork point 99 is outside" in reply.message


def test_a_purged_session_answers_no_more(daemon: InProcessDaemon) -> None:
    session = asked(daemon, "Forget me.")
    generation = daemon.call(Request.Inspect(session)).inspection.summary.generation
    reply = daemon.call(Request.Purge(session, generation, PurgeMode.Reroot()))
    assert isinstance(reply, Response.Purged) and reply.sessions == [session]
    reply = daemon.call(Request.Read(session, 0))
    assert isinstance(reply, Response.Err) and reply.message == f"session {session} was purged"


def test_one_constraint_at_a_time_and_an_unsatisfiable_one_says_why(daemon: InProcessDaemon) -> None:
    assert daemon.daemon is not None
    template = daemon.daemon.template
    with pytest.raises(ConstraintError, match="give one constraint, not grammar and json_schema"):
        constraint_grammar(template, gbnf='root ::= "a"', json_schema={"type": "object"})
    assert constraint_grammar(template, json_schema=True) is not None
    assert constraint_grammar(template) is None
    with pytest.raises(ConstraintError, match="constraint unsatisfiable"):
        constraint_grammar(template, json_schema={"type": "nonsense"})
