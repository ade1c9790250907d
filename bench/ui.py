"""The browser UI's figures, in headless Chromium against a real daemon.

- first paint: from navigation to the first rows of a 1,000-event session on screen (the page
  records it as `window.superfluid.painted`), the median of three page loads;
- live tokens: for each committed `Generated` event of a streamed reply, the time from its
  commit timestamp to its arrival in the page (`window.superfluid.latencies`), against the
  scheduler's tick (50 ms).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from peer import Superfluid, free_port
from record import Result

TICK_MS = 50.0  # ServeConfig.tick_ms
EVENTS = 1000
LOADS = 3
PAINT_S = 1.0  # the first paint's limit


def _rpc(url: str, token: str, request: Any) -> dict:
    headers = {"authorization": f"Bearer {token}", "x-superfluid-csrf": token}
    reply = httpx.post(f"{url}/web/rpc", json=request, headers=headers, timeout=60)
    reply.raise_for_status()
    return reply.json()


def _session(url: str, token: str, messages: int) -> int:
    params = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0, "seed": 0}
    session = _rpc(url, token, {"Create": {"parent": None, "params": params}})["Created"]["session"]
    for i in range(messages):
        _rpc(url, token, {"AppendMessage": {"session": session, "role": 1 + i % 2, "text": f"line {i} of a chat"}})
    return session


def ui_figures(root: Path, quick: bool, loads: int | None = None) -> list[Result]:
    """The first paint (seconds, the median of `loads` page loads) and live latency (milliseconds)."""
    loads = loads or LOADS
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    port = free_port()
    daemon = Superfluid(root / "ui", 2048, 4, "--web", f"127.0.0.1:{port}").start()
    web = f"http://127.0.0.1:{port}"
    try:
        token = (root / "ui" / "sessions" / "web-token").read_text()
        big = _session(web, token, (EVENTS // 10 if quick else EVENTS) - 1)
        chat = _session(web, token, 0)
        args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=args)
            painted = []
            for _ in range(loads):
                page = browser.new_page(bypass_csp=True)
                page.goto(f"{web}/web/#token={token}&session={big}")
                page.wait_for_function("window.superfluid.painted !== null", timeout=60_000)
                painted.append(page.evaluate("window.superfluid.painted") / 1000)
                page.close()
            page = browser.new_page(bypass_csp=True)
            page.goto(f"{web}/web/#token={token}&session={chat}")
            page.wait_for_function(f"window.superfluid.selected === {chat} && window.superfluid.sub !== null")
            page.fill("#max-tokens", "64")
            page.check("#to-max")
            page.fill("#message", "Tell me about lighthouses.")
            page.click("#send")
            page.wait_for_function("document.getElementById('generation').textContent.startsWith('64 tokens')")
            latencies = page.evaluate("window.superfluid.latencies")
            browser.close()
    finally:
        daemon.stop()
    first = float(np.median(painted))
    arrival = float(np.median(latencies))
    return [
        Result(
            f"UI first paint of a {EVENTS // 10 if quick else EVENTS}-event session (s)",
            first,
            f"<= {PAINT_S:g} s",
            first <= PAINT_S,
            f"median of {loads} loads: {', '.join(f'{p:.2f}' for p in painted)} s",
            "s",
            rounds={"first paint s": painted},
        ),
        Result(
            "UI: a committed token's arrival after its commit, p50 (ms)",
            arrival,
            f"<= {TICK_MS:g} ms",
            arrival <= TICK_MS,
            f"{len(latencies)} Generated events, max {max(latencies):.0f} ms; one tick is {TICK_MS:.0f} ms",
            "ms",
            rounds={"arrival ms": latencies},
        ),
    ]
