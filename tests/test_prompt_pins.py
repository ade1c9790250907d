"""Prompt-cache pins within their budget: the least recently marked prefix goes first."""

from __future__ import annotations

from typing import cast

from superfluid.scheduler.prompt_pins import PromptPins
from superfluid.scheduler.scheduler import Scheduler


class PinLedger:
    """Stands in for the scheduler: what is pinned, until when."""

    def __init__(self) -> None:
        self.pins: dict[tuple[int, ...], int] = {}

    def pin(self, tokens: list[int], until_ms: int) -> None:
        if until_ms:
            self.pins[tuple(tokens)] = until_ms
        else:
            self.pins.pop(tuple(tokens), None)


def test_pins_past_the_budget_release_the_least_recently_marked() -> None:
    ledger = PinLedger()
    pins = PromptPins(cast(Scheduler, ledger), budget_tokens=10)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]
    assert pins.pin(a) and pins.pin(b)
    assert pins.pin(a)  # marked again: now the most recent
    assert pins.pin(c)  # 11 tokens: b, the least recently marked, is released
    assert set(ledger.pins) == {tuple(a), tuple(c)} and pins.tokens == 7
    assert not pins.pin(list(range(11)))  # alone over the budget: not pinned, nothing released
    assert set(ledger.pins) == {tuple(a), tuple(c)}


def test_a_renewed_mark_keeps_the_later_deadline() -> None:
    ledger = PinLedger()
    pins = PromptPins(cast(Scheduler, ledger), budget_tokens=100)
    pins.pin([1, 2, 3], ttl_ms=3_600_000)
    hour = ledger.pins[(1, 2, 3)]
    pins.pin([1, 2, 3], ttl_ms=300_000)  # a five-minute mark does not shorten an hour's
    assert ledger.pins[(1, 2, 3)] == hour and len(pins) == 1


def test_no_budget_pins_nothing() -> None:
    ledger = PinLedger()
    assert not PromptPins(cast(Scheduler, ledger), budget_tokens=0).pin([1, 2])
    assert ledger.pins == {}
