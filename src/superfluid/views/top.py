"""`superfluid top HOST:PORT...`: every daemon's `/metrics`, polled once a second, one row each.

A row says whether the daemon is up (or answers 401: the key is missing or wrong, or is
down), its KV pool in use, its decode rate, its lanes busy and its queue depth; below the
table, the decode rate of all of them together over the last minutes. `q` quits.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer, Label, Sparkline, Static

from .figures import HISTORY_SAMPLES, Figures, History

POLL_S = 1.0
TIMEOUT_S = 2.0
COLUMNS = ("daemon", "state", "KV pool", "decode tok/s", "lanes busy", "queued")


@dataclass
class Node:
    """One daemon polled: where, what it answered last, and its figures over time."""

    address: str
    state: str = "…"
    history: History = field(default_factory=History)

    @property
    def url(self) -> str:
        address = self.address if "://" in self.address else f"http://{self.address}"
        return address.rstrip("/") + "/metrics"


def fetch(url: str, api_key: str | None) -> tuple[str, str | None]:
    """(state, exposition): `up` with the text, `401`, or `down` (with the reason) and None."""
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            return "up", reply.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return ("401" if e.code == 401 else f"HTTP {e.code}"), None
    except (OSError, ValueError):
        return "down", None


class Top(App[None]):
    """The table of daemons and the total throughput sparkline."""

    TITLE = "superfluid top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [Binding("q,escape", "quit", "quit"), Binding("ctrl+c", "quit", show=False, priority=True)]
    DEFAULT_CSS = """
    #nodes { height: auto; }
    #total { height: 1; }
    #total > Label { width: 30; }
    Sparkline { height: 1; width: 1fr; margin: 0 1; }
    """

    def __init__(self, addresses: list[str], api_key: str | None = None) -> None:
        super().__init__()
        self.nodes = [Node(address) for address in dict.fromkeys(addresses)]  # each daemon once
        self.api_key = api_key
        self.total: deque[float] = deque(maxlen=HISTORY_SAMPLES)  # all daemons' decode tok/s

    def compose(self) -> ComposeResult:
        yield Static(f"polling {len(self.nodes)} daemon(s) every {POLL_S:.0f} s", id="status")
        yield DataTable(id="nodes", show_cursor=False, zebra_stripes=True)
        with Horizontal(id="total"):
            yield Label("total decode", id="total-rate")
            yield Sparkline([], id="throughput")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#nodes", DataTable)
        table.add_columns(*COLUMNS)
        for node in self.nodes:
            table.add_row(*self.row(node), key=node.address)
        self.set_interval(POLL_S, self.poll)
        self.call_later(self.poll)

    async def poll(self) -> None:
        answers = await asyncio.gather(*(asyncio.to_thread(fetch, n.url, self.api_key) for n in self.nodes))
        now = time.monotonic()
        for node, (state, exposition) in zip(self.nodes, answers, strict=True):
            node.state = state
            if exposition is not None:
                node.history.add(Figures.parse(exposition), now)
        self.draw()

    def row(self, node: Node) -> tuple[str, ...]:
        figures = node.history.latest
        if node.state != "up" or figures is None:
            return (node.address, node.state, "-", "-", "-", "-")
        pool = figures.kv_slots * figures.kv_slot_tokens
        share = f" ({100 * figures.kv_tokens / pool:.0f}%)" if pool else ""
        return (
            node.address,
            "up",
            f"{figures.kv_tokens:,}/{pool:,}{share}",
            f"{node.history.decode_rate:.1f}",
            f"{len(figures.lanes)}/{figures.lanes_total}",
            str(figures.queued),
        )

    def draw(self) -> None:
        table = self.query_one("#nodes", DataTable)
        for node in self.nodes:
            for column, value in zip(table.columns, self.row(node), strict=True):
                table.update_cell(node.address, column, value, update_width=True)  # "561/98,304" outgrows its header
        total = sum(n.history.decode_rate for n in self.nodes if n.state == "up")
        self.total.append(total)
        self.query_one("#total-rate", Label).update(f"total decode {total:8.1f} tok/s")
        self.query_one("#throughput", Sparkline).data = list(self.total)
        up = sum(n.state == "up" for n in self.nodes)
        self.query_one("#status", Static).update(f"{up} of {len(self.nodes)} up · every {POLL_S:.0f} s")
