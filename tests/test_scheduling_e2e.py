"""Scheduling on the real model: preemption, shared prefixes, pins across a restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import DaemonProcess, forced, generate, generated_tokens, metric, new_session, say

from superfluid.protocol.schema import Request, Response

pytestmark = pytest.mark.e2e

STORY = "Write a long story about a lighthouse keeper and the sea."


def test_a_preempted_background_generation_finishes_as_it_would_alone(tmp_path: Path) -> None:
    proc = DaemonProcess(tmp_path, max_context=1024, max_batch=1).start()
    try:
        with proc.client() as c:
            alone = new_session(c)
            say(c, alone, STORY)
            expected = generated_tokens(forced(c, alone, 200)[0])

            background = new_session(c)
            c.call(Request.SetQos(background, 3, False))
            say(c, background, STORY)
            chat = new_session(c)
            c.call(Request.SetQos(chat, 0, False))
            say(c, chat, "Hi! Who are you?")
            order: list[str] = []
            result: dict[str, list[int]] = {}

            running = threading.Event()

            def run(name: str, session: int, max_tokens: int) -> None:
                with proc.client() as own:
                    own.send(Request.Generate(session, max_tokens, True))
                    replies = [own.receive()]
                    running.set()
                    while isinstance(replies[-1], Response.Delta):
                        replies.append(own.receive())
                result[name] = generated_tokens([r.event for r in replies if isinstance(r, Response.Delta)])
                order.append(name)

            slow = threading.Thread(target=run, args=("background", background, 200))
            slow.start()
            assert running.wait(60), "the background generation started"
            run("chat", chat, 4)
            slow.join(120)
            assert order == ["chat", "background"], "the chat did not wait for the background lane"
            assert result["background"] == expected, "preempted and resumed: nothing repeated or lost"
            assert metric(c, "superfluid_preemptions_total") >= 1
    finally:
        proc.stop()


def test_a_burst_sharing_a_long_prefix_prefills_it_once(tmp_path: Path) -> None:
    proc = DaemonProcess(tmp_path, max_context=2048, max_batch=4).start()
    try:
        document = "Tides rise and fall twice a day because the moon pulls the oceans. " * 40
        with proc.client() as c:
            sessions = []
            for question in ("Why two tides?", "What about the sun?", "Name a tidal river.", "Spring tides?"):
                s = new_session(c)
                say(c, s, document)
                say(c, s, question)
                sessions.append(s)
            shared = len(c.call(Request.Inspect(sessions[0])).inspection.tokens) - 20
            before = metric(c, "superfluid_prefill_tokens_total")
        warm: list[int] = []

        def run(session: int) -> None:
            with proc.client() as own:
                warm.append(generate(own, session, 2)[1].warm_prefix)

        threads = [threading.Thread(target=run, args=(s,)) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        with proc.client() as c:
            prefilled = metric(c, "superfluid_prefill_tokens_total") - before
        assert prefilled < 2 * shared, f"{prefilled} tokens prefilled for a {shared}-token shared prefix"
        assert sorted(warm)[1] >= shared - 128, warm
    finally:
        proc.stop()


def test_a_pin_survives_a_restart_and_keeps_the_prefix_warm(tmp_path: Path) -> None:
    proc = DaemonProcess(tmp_path, max_context=2048, max_batch=2).start()
    try:
        with proc.client() as c:
            session = new_session(c)
            say(c, session, "Here is a long note. " + "The keeper logged every storm. " * 30)
            deadline = c.call(Request.Pin(session, 600_000)).deadline_unix_ms
            assert deadline > time.time() * 1000
        proc.kill()
        proc.start()
        with proc.client() as c:
            assert c.call(Request.Inspect(session)).inspection.pin_deadline_unix_ms == deadline
            tokens = len(c.call(Request.Inspect(session)).inspection.tokens)
            deadline_s = time.monotonic() + 60
            while metric(c, "superfluid_cache_entries") < 1 and time.monotonic() < deadline_s:
                time.sleep(0.1)  # the pinned prefix is prefilled again in the background
            _, summary = generate(c, session, 3)
            assert summary.warm_prefix >= tokens - 1, (summary.warm_prefix, tokens)
            assert c.call(Request.Pin(session, 0)) == Response.Pinned(0)
    finally:
        proc.stop()
