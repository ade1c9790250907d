"""The terminal monitor `superfluid serve` shows on a terminal (`--tui`, `--no-tui`).

Once a second it reads the daemon's `/metrics` exposition (in process) and draws: the tick,
each running lane, the KV tiers against their budgets, decode and prefill rates with the
last minutes as sparklines, time to first token, prefix-cache hits by tier, preemptions,
queue depth by class, the workers and the memory of the GPUs they use; below, the daemon's
log. Keys: `q`, Esc or Ctrl-C ask before stopping the daemon; `p` pauses sampling; arrows and
PgUp/PgDn scroll the log, `g` goes to its oldest line and End follows it again.
"""

from __future__ import annotations

import queue
from collections.abc import Awaitable, Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label, RichLog, Sparkline, Static

from ..logsetup import LogPane
from .figures import CLASSES, TIERS, Figures, History, human_bytes

SAMPLE_S = 1.0
LOG_DRAIN_S = 0.25
LOG_LINES = 5000

Read = Callable[[], Awaitable[str]]


class ConfirmQuit(ModalScreen[bool]):
    """Stop the daemon? y or n."""

    BINDINGS = [
        Binding("y", "answer(True)", "stop"),
        Binding("n,escape", "answer(False)", "keep serving"),
    ]
    DEFAULT_CSS = """
    ConfirmQuit { align: center middle; }
    ConfirmQuit > Label { border: thick $error; padding: 1 3; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        yield Label("Stop the daemon? Generations in flight are cut and continue at the next start.  [y/n]")

    def action_answer(self, stop: bool) -> None:
        self.dismiss(stop)


class Monitor(App[bool]):
    """The live view of one daemon; its result is True when the user chose to stop the daemon."""

    TITLE = "superfluid"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q,escape", "ask_quit", "quit"),
        Binding("ctrl+c", "ask_quit", "quit", priority=True, show=False),
        Binding("p", "pause", "pause"),
        Binding("up", "scroll('up')", "scroll", show=False),
        Binding("down", "scroll('down')", show=False),
        Binding("pageup", "scroll('page_up')", show=False),
        Binding("pagedown", "scroll('page_down')", show=False),
        Binding("g", "oldest", "oldest"),
        Binding("end", "follow", "follow"),
    ]
    DEFAULT_CSS = """
    #figures { height: auto; }
    #heading { height: auto; color: $text-muted; }
    .line { height: 1; }
    #lanes { height: auto; max-height: 12; }
    Sparkline { height: 1; width: 1fr; margin: 0 1; }
    .rate { height: 1; }
    .rate > Label { width: 28; }
    #log { height: 1fr; border-top: solid $primary; }
    """

    def __init__(self, read: Read, heading: str, log_lines: LogPane | None = None) -> None:
        super().__init__()
        self.read = read
        self.heading = heading
        self.log_lines = log_lines
        self.history = History()
        self.paused = False
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="figures"):
            yield Static(self.heading, id="heading")
            yield Static("", id="tick", classes="line")
            yield Static("lanes", id="lanes-line", classes="line")
            yield DataTable(id="lanes", show_cursor=False, zebra_stripes=True)
            yield Static("", id="kv", classes="line")
            with Horizontal(classes="rate"):
                yield Label("decode", id="decode-rate")
                yield Sparkline([], id="decode")
            with Horizontal(classes="rate"):
                yield Label("prefill", id="prefill-rate")
                yield Sparkline([], id="prefill")
            yield Static("", id="ttft", classes="line")
            yield Static("", id="queue", classes="line")
            yield Static("", id="workers", classes="line")
        yield RichLog(id="log", max_lines=LOG_LINES, wrap=False, auto_scroll=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#lanes", DataTable)
        table.add_columns("slot", "session", "class", "phase", "tokens", "generated", "model")
        self.set_interval(SAMPLE_S, self.sample)
        if self.log_lines is not None:
            self.set_interval(LOG_DRAIN_S, self.drain_log)
        self.call_later(self.sample)

    async def sample(self) -> None:
        """Read the exposition once and redraw (nothing while paused)."""
        if self.paused:
            return
        try:
            exposition = await self.read()
        except Exception as e:  # a daemon stopping, a read that timed out: say so, keep the last figures
            self.error = str(e) or type(e).__name__
            self.query_one("#tick", Static).update(Text(f"metrics unavailable: {self.error}", style="bold red"))
            return
        self.error = None
        self.history.add(Figures.parse(exposition))
        self.draw()

    def draw(self) -> None:
        figures = self.history.latest
        if figures is None:
            return
        state = "paused" if self.paused else ("tick in flight" if figures.tick_in_flight else "idle")
        self.query_one("#tick", Static).update(
            f"tick {figures.ticks:,.0f} · {state} · {figures.generations} generations running · "
            f"{figures.models} model{'s' if figures.models != 1 else ''} loaded"
        )
        busy = len(figures.lanes)
        prefilling = sum(lane.phase == "prefill" for lane in figures.lanes)
        self.query_one("#lanes-line", Static).update(
            f"lanes {busy}/{figures.lanes_total} busy ({prefilling} prefilling, {busy - prefilling} decoding)"
        )
        table = self.query_one("#lanes", DataTable)
        table.clear()
        for lane in figures.lanes:
            table.add_row(
                str(lane.slot),
                lane.session or "-",
                lane.klass,
                lane.phase,
                f"{lane.tokens:,}",
                f"{lane.generated:,}",
                lane.model,
            )
        pool = figures.kv_slots * figures.kv_slot_tokens
        used_slots = busy + figures.cache_entries
        park = f"park {human_bytes(figures.park_bytes)}"
        park += f" of {human_bytes(figures.park_budget)}" if figures.park_budget else " (unbounded)"
        self.query_one("#kv", Static).update(
            f"KV slots {used_slots}/{figures.kv_slots} · {figures.kv_tokens:,} of {pool:,} tokens · "
            f"host {human_bytes(figures.host_bytes)} of {human_bytes(figures.host_budget)} · {park}"
        )
        history = self.history
        self.query_one("#decode-rate", Label).update(f"decode  {history.decode_rate:8.1f} tok/s")
        self.query_one("#prefill-rate", Label).update(f"prefill {history.prefill_rate:8.1f} tok/s")
        self.query_one("#decode", Sparkline).data = list(history.decode)
        self.query_one("#prefill", Sparkline).data = list(history.prefill)
        p50, p95 = figures.ttft_quantile(0.5), figures.ttft_quantile(0.95)
        hits = " · ".join(f"{tier} {figures.hits[tier]:,.0f}" for tier in TIERS)
        self.query_one("#ttft", Static).update(
            f"first token: last {_seconds(figures.last_ttft or None)} · p50 {_seconds(p50)} · p95 {_seconds(p95)}"
            f"   prefix hits: {hits}   preemptions {figures.preemptions:,.0f}"
        )
        queued = " · ".join(f"{klass} {figures.queue[klass]}" for klass in CLASSES)
        spec = "nothing drafted"
        if figures.spec_proposed:
            rate = figures.spec_accepted / figures.spec_proposed
            spec = f"{figures.spec_accepted:,.0f} of {figures.spec_proposed:,.0f} drafted tokens accepted ({rate:.0%})"
        self.query_one("#queue", Static).update(f"queue: {queued}   speculation: {spec}")
        if figures.workers:
            up = sum(figures.workers.values())
            workers = f"workers: {up}/{len(figures.workers)} up"
            down = [model for model, alive in figures.workers.items() if not alive]
            if down:
                workers += f" (restarting: {', '.join(down)})"
        else:
            workers = "workers: none (llama.cpp runs in the daemon)"
        workers += f" · respawns {figures.respawns:,.0f}"
        for gpu, memory in figures.gpus.items():
            workers += f" · {gpu} {human_bytes(memory.get('used', 0))} of {human_bytes(memory.get('total', 0))} used"
        self.query_one("#workers", Static).update(workers)

    def drain_log(self) -> None:
        assert self.log_lines is not None
        pane = self.query_one("#log", RichLog)
        while True:
            try:
                pane.write(self.log_lines.lines.get_nowait())
            except queue.Empty:
                return

    def action_ask_quit(self) -> None:
        def answered(stop: bool | None) -> None:
            if stop:
                self.exit(True)

        if not isinstance(self.screen, ConfirmQuit):
            self.push_screen(ConfirmQuit(), answered)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.draw()
        if not self.paused:
            self.call_later(self.sample)

    def action_scroll(self, where: str) -> None:
        pane = self.query_one("#log", RichLog)
        pane.auto_scroll = False
        getattr(pane, f"scroll_{where}")(animate=False)

    def action_oldest(self) -> None:
        pane = self.query_one("#log", RichLog)
        pane.auto_scroll = False
        pane.scroll_home(animate=False)

    def action_follow(self) -> None:
        pane = self.query_one("#log", RichLog)
        pane.auto_scroll = True
        pane.scroll_end(animate=False)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
