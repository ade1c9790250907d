"""The browser UI on the main HTTP port of a loopback listener, with no `--web`: a browser
asking for `/` lands on the UI signed in, clients probing `/` get the text they expect."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import HttpDaemon

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("ui-main"), max_context=2048, max_batch=2).start()
    yield proc
    proc.stop()


def test_a_browser_asking_for_the_root_is_sent_to_the_ui_signed_in(api: HttpDaemon) -> None:
    token = (api.sessions / "web-token").read_text()
    page = httpx.get(f"{api.url}/", headers={"accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 302 and page.headers["location"] == f"/web/#token={token}"
    assert httpx.get(f"{api.url}/").text == "superfluid is running", "what a client probing the root reads"
    assert httpx.head(f"{api.url}/").status_code == 200
    printed = re.search(r"^browser UI: (\S+)$", api.log.read_text(), re.MULTILINE)
    assert printed and printed.group(1) == f"{api.url}/web/#token={token}"
    headers = {"authorization": f"Bearer {token}", "x-superfluid-csrf": token}
    listed = httpx.post(f"{api.url}/web/rpc", json="List", headers=headers)
    assert listed.status_code == 200 and "Sessions" in listed.json(), listed.text
    assert httpx.post(f"{api.url}/web/rpc", json="List").status_code == 401


def test_the_ui_opens_from_the_main_port(browser: Any, api: HttpDaemon) -> None:
    # the page forbids eval; Playwright's waits evaluate strings, so its CSP is set aside for them
    page = browser.new_page(bypass_csp=True)
    try:
        page.goto(f"{api.url}/")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('connected')")
        assert page.url == f"{api.url}/web/", "signed in, the token taken out of the address"
    finally:
        page.close()
