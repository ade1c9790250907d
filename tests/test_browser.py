"""A web page in headless Chromium talks to /web/ws: allowed from a listed origin, refused otherwise."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import WebDaemon, free_port
from playwright.sync_api import Browser

pytestmark = pytest.mark.e2e

PAGES = Path(__file__).parent / "browser"


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def serve_pages() -> tuple[ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(PAGES))
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def pages() -> Iterator[tuple[str, str]]:
    listed, listed_origin = serve_pages()
    unlisted, unlisted_origin = serve_pages()
    yield listed_origin, unlisted_origin
    listed.shutdown()
    unlisted.shutdown()


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory, pages: tuple[str, str]) -> Iterator[WebDaemon]:
    proc = WebDaemon(tmp_path_factory.mktemp("browser"), origins=(pages[0],)).start()
    yield proc
    proc.stop()


def open_chat(browser: Browser, origin: str, web: WebDaemon) -> tuple[str, str]:
    page = browser.new_page()
    try:
        page.goto(f"{origin}/chat.html#ws=ws://127.0.0.1:{web.port}/web/ws&token={web.token}")
        page.wait_for_function(
            "() => ['done', 'refused', 'error'].some(s => document.getElementById('status').textContent.startsWith(s))",
            timeout=60_000,
        )
        return page.inner_text("#status"), page.inner_text("#out")
    finally:
        page.close()


def test_a_listed_origin_chats_over_the_websocket(browser: Browser, web: WebDaemon, pages: tuple[str, str]) -> None:
    status, text = open_chat(browser, pages[0], web)
    assert status.startswith("done session ") and status.endswith(" finish 2"), status
    session = int(status.split()[2])
    events = httpx.post(
        f"{web.url}/web/rpc", json={"Read": {"session": session, "cursor": 0}}, headers=web.headers()
    ).json()["Events"]["events"]
    committed = "".join(e["body"]["Generated"]["text"] for e in events if "Generated" in e["body"])
    assert text == committed


def test_an_unlisted_origin_is_refused(browser: Browser, web: WebDaemon, pages: tuple[str, str]) -> None:
    status, text = open_chat(browser, pages[1], web)
    assert status == "refused" and text == ""
