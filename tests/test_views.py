"""The terminal views against live daemons: the monitor `serve` shows (driven by Textual's
pilot, and on a real pseudo-terminal under tmux) and `superfluid top`."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import HttpDaemon, forced, free_port, new_session, say
from terminal import Terminal
from textual.widgets import DataTable

from superfluid.views.figures import Figures
from superfluid.views.monitor import ConfirmQuit, Monitor
from superfluid.views.top import Top

pytestmark = pytest.mark.e2e

SIZE = (170, 50)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("views"), max_context=2048, max_batch=4).start()
    yield proc
    proc.stop()


def reader(url: str) -> Callable[[], object]:
    async def read() -> str:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"{url}/metrics", timeout=5)).text

    return read


def load(daemon: HttpDaemon, sessions: int, tokens: int) -> threading.Thread:
    """`sessions` forced generations of `tokens` tokens each, at once, over the socket."""

    def one() -> None:
        with daemon.client() as c:
            session = new_session(c)
            say(c, session, "Tell me a long story about a lighthouse.")
            forced(c, session, tokens)

    threads = [threading.Thread(target=one) for _ in range(sessions)]
    for t in threads:
        t.start()
    joiner = threading.Thread(target=lambda: [t.join() for t in threads])
    joiner.start()
    return joiner


async def until(pilot: object, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the view never showed it"
        await pilot.pause(0.1)  # type: ignore[attr-defined]


def text(app: Monitor | Top, selector: str) -> str:
    return str(app.query_one(selector).render())


def test_the_monitor_shows_lanes_busy_then_idle_pauses_and_asks_before_quitting(daemon: HttpDaemon) -> None:
    async def scenario() -> bool | None:
        app = Monitor(reader(daemon.url), "superfluid under test")
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: text(app, "#lanes-line").startswith("lanes 0/4 busy"))
            running = load(daemon, 2, 400)
            await until(pilot, lambda: text(app, "#lanes-line").startswith("lanes 2/4 busy"))
            table = app.query_one("#lanes", DataTable)
            assert table.row_count == 2
            assert {str(table.get_row_at(i)[2]) for i in range(2)} == {"agent"}
            await until(pilot, lambda: app.history.decode_rate > 0)
            assert "decode" in text(app, "#decode-rate")

            await pilot.press("p")
            assert app.paused and "paused" in text(app, "#tick")
            frozen = app.history.latest
            await pilot.pause(2.5)
            assert app.history.latest is frozen, "no sampling while paused"
            await pilot.press("p")
            await until(pilot, lambda: app.history.latest is not frozen)

            running.join(120)
            await until(pilot, lambda: text(app, "#lanes-line").startswith("lanes 0/4 busy"))
            assert app.query_one("#lanes", DataTable).row_count == 0

            await pilot.press("q")
            assert isinstance(app.screen, ConfirmQuit), "q asks first"
            await pilot.press("n")
            assert not isinstance(app.screen, ConfirmQuit) and app.is_running
            await pilot.press("q")
            await pilot.press("y")
        return app.return_value

    assert asyncio.run(scenario()) is True, "y stops: the monitor returns True"


def test_figures_read_from_a_live_exposition(daemon: HttpDaemon) -> None:
    with daemon.client() as c:
        session = new_session(c)
        say(c, session, "Hello.")
        forced(c, session, 5)  # its last token is drawn, never decoded: 4 decoded tokens
    figures = Figures.parse(httpx.get(f"{daemon.url}/metrics").text)
    assert figures.lanes_total == 4 and figures.kv_slots >= 4 and figures.kv_slot_tokens == 2048
    assert figures.decode_tokens >= 4 and figures.ticks > 0
    assert sum(figures.hits.values()) >= 1, "every admission is counted in a tier"
    p50, p95 = figures.ttft_quantile(0.5), figures.ttft_quantile(0.95)
    assert p50 is not None and p95 is not None and 0 < p50 <= p95


def test_top_shows_each_daemon_up_refused_or_down(daemon: HttpDaemon, tmp_path: Path) -> None:
    keyed = HttpDaemon(tmp_path, "--api-key", "sekrit", max_context=1024, max_batch=2).start()
    down = f"127.0.0.1:{free_port()}"
    addresses = [daemon.url.removeprefix("http://"), keyed.url.removeprefix("http://"), down]
    try:

        async def scenario(api_key: str | None) -> list[tuple[str, ...]]:
            app = Top(addresses, api_key)
            async with app.run_test(size=SIZE) as pilot:
                table = app.query_one("#nodes", DataTable)
                await until(pilot, lambda: all(str(table.get_row_at(i)[1]) != "…" for i in range(3)))
                rows = [tuple(str(cell) for cell in table.get_row_at(i)) for i in range(3)]
                cut = [
                    (column.label.plain, value)
                    for row in rows
                    for column, value in zip(table.columns.values(), row, strict=True)
                    if len(value) > column.content_width
                ]
                assert not cut, f"cells wider than their column are cut: {cut}"
                await pilot.press("q")
            return rows

        rows = asyncio.run(scenario(None))
        assert [r[1] for r in rows] == ["up", "401", "down"], rows
        assert rows[0][4] == "0/4" and rows[0][2].endswith("%)"), rows[0]
        rows = asyncio.run(scenario("sekrit"))
        assert [r[1] for r in rows] == ["up", "up", "down"], "the key opens the keyed daemon; a keyless one ignores it"
    finally:
        keyed.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="tmux and a pseudo-terminal")
def test_serve_on_a_terminal_shows_the_monitor(tmp_path: Path) -> None:
    command = [
        str(Path(sys.executable).parent / "superfluid"),
        "serve",
        "--sessions",
        str(tmp_path / "sessions"),
        "--socket",
        str(tmp_path / "sf.sock"),
        "--no-http",
        "--max-context",
        "1024",
        "--max-batch",
        "2",
    ]
    with Terminal("serve") as term:
        term.start(command, exit_file=tmp_path / "exit")
        # every panel at once: a capture can land while the first frame is still being drawn
        panels = ("lanes 0/2 busy", "KV slots", "queue:", "first token")
        term.wait_for(lambda screen: all(panel in screen for panel in panels), timeout=120)
        term.keys("q")
        term.wait_for("Stop the daemon?", timeout=10)
        term.keys("y")
        term.wait_for(lambda _: (tmp_path / "exit").exists(), timeout=30)
        assert (tmp_path / "exit").read_text().strip() == "exited 0"
        assert (tmp_path / "sessions" / "logs" / "superfluid.0.jsonl").exists(), "the log also went to disk"
