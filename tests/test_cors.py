"""The HTTP API called from a web page on another origin, in headless Chromium: a page whose
origin `--cors-origin` lists reads replies (a 401 included) after a preflight; one that is not
listed gets no CORS header, so its browser keeps the reply from it."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import HttpDaemon
from playwright.sync_api import Browser
from test_browser import serve_pages

pytestmark = pytest.mark.e2e

KEY = "cors-test-key"
# a fetch as a front-end makes it: JSON (so the browser sends a preflight first), a key when given
FETCH = """async ([url, key]) => {
  const headers = {"content-type": "application/json"};
  if (key) headers["authorization"] = "Bearer " + key;
  // end-of-generation banned: exactly max_tokens tokens on every machine
  const body = {messages: [{role: "user", content: "Hi"}], max_tokens: 4, temperature: 0, ignore_eos: true};
  try {
    const reply = await fetch(url + "/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
    return {status: reply.status, body: await reply.json(), warm: reply.headers.get("x-superfluid-warm")};
  } catch (e) {
    return {blocked: String(e)};
  }
}"""


@pytest.fixture(scope="module")
def pages() -> Iterator[tuple[str, str]]:
    servers: list[ThreadingHTTPServer] = []
    origins = []
    for _ in range(2):
        server, origin = serve_pages()
        servers.append(server)
        origins.append(origin)
    yield origins[0], origins[1].replace("127.0.0.1", "localhost")  # the second is a loopback page not listed
    for server in servers:
        server.shutdown()


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, pages: tuple[str, str]) -> Iterator[HttpDaemon]:
    root: Path = tmp_path_factory.mktemp("cors")
    proc = HttpDaemon(root, "--api-key", KEY, "--cors-origin", pages[0], "--cors-origin", "https://app.example").start()
    yield proc
    proc.stop()


def fetch_from(browser: Browser, origin: str, api: HttpDaemon, key: str | None) -> dict[str, Any]:
    page = browser.new_page()
    try:
        page.goto(f"{origin}/blank.html")
        return page.evaluate(FETCH, [api.url, key])
    finally:
        page.close()


def test_a_listed_origin_reads_replies_and_refusals(browser: Browser, api: HttpDaemon, pages: tuple[str, str]) -> None:
    answered = fetch_from(browser, pages[0], api, KEY)
    assert answered.get("status") == 200, answered
    assert answered["body"]["usage"]["completion_tokens"] == 4
    assert answered["warm"] is not None, "our own headers are exposed to the page"
    refused = fetch_from(browser, pages[0], api, None)
    assert refused.get("status") == 401, "a page can read why it was refused"


def test_an_unlisted_origin_gets_nothing_it_can_read(browser: Browser, api: HttpDaemon, pages: tuple[str, str]) -> None:
    blocked = fetch_from(browser, pages[1], api, KEY)
    assert "blocked" in blocked and "status" not in blocked, blocked


def test_preflights_and_headers_as_the_protocol_has_them(api: HttpDaemon) -> None:
    asked = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    listed = httpx.options(f"{api.url}/v1/chat/completions", headers={"origin": "https://app.example", **asked})
    assert listed.status_code == 204, "a preflight carries no key and is answered before the keys"
    assert listed.headers["access-control-allow-origin"] == "https://app.example"
    assert listed.headers["access-control-allow-credentials"] == "true" and "Origin" in listed.headers["vary"]
    assert "POST" in listed.headers["access-control-allow-methods"]
    assert listed.headers["access-control-allow-headers"] == "authorization,content-type"
    other = httpx.options(f"{api.url}/v1/chat/completions", headers={"origin": "https://evil.example", **asked})
    assert "access-control-allow-origin" not in other.headers
    key = {"authorization": f"Bearer {KEY}"}
    refused = httpx.get(f"{api.url}/v1/models", headers={"origin": "https://evil.example", **key})
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    allowed = httpx.get(f"{api.url}/v1/models", headers={"origin": "https://app.example", **key})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
