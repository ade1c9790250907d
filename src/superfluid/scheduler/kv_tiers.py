"""Where a context's KV lives: its slots, host memory and the park, and moving prefixes between them.

Every sequence slot of the context is free, runs a lane, or holds an idle entry (the KV a
finished or preempted job left behind, `PrefixCache`). A new lane is `place`d on the
slot that gives it the longest prefix for the least work, fastest tier first:
- a slot: an idle entry it extends is taken over; a running lane's or another entry's
  prefix is copied into a fresh slot (a memory copy inside llama.cpp), unless the entry's
  own slot is the one that keeps the running lanes consecutive: the lane takes it over,
  and the entry goes where an evicted one would;
- the park: a parked state is read and imported when that is quicker than prefilling what
  it adds (the rates come from `calibrate` and from every resume);
- host memory: an exported state is imported back;
- cold: nothing cached, the whole prompt is prefilled.
A slot is found for a lane by evicting the least valuable idle entry: exported to host
memory when it is long enough to be worth it (what host memory cannot keep goes to the
park), unless the park already holds it. Between ticks the scheduler hands idle entries to
the park (`park_idle`) and frees a slot ahead of the next arrival (`free_a_slot`).

The scheduler's thread makes every call; `cache` is read by metrics from others.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..engine.interface import Engine, EngineError, Step
from .park import Park
from .prefix_cache import PrefixCache, Seed
from .stats import SchedulerStats

log = logging.getLogger("superfluid.scheduler")

EXPORT_MIN_TOKENS = 32  # shorter idle entries are dropped, not exported
MIN_COPY_TOKENS = 8  # a slot copy (7-25 ms, by window) costs about as much as prefilling this many tokens
CALIBRATION_TOKENS = 32  # the probe measuring prefill and import rates before the first job (run twice: a warm-up)


def _runs(slots: set[int]) -> int:
    """How many runs of consecutive numbers `slots` makes."""
    return sum(1 for s in slots if s - 1 not in slots)


@dataclass(frozen=True)
class Placement:
    """A new lane's slot, holding the first `length` tokens of its prompt, and the tier they came from."""

    seq: int
    length: int
    tier: str  # one of `stats.TIERS`
    source: str  # for the log: where the prefix came from, in words


class KVTiers:
    """The slots of one context with their idle entries, host memory and the park."""

    def __init__(
        self,
        engine: Engine,
        stats: SchedulerStats,
        *,
        host_cache_bytes: int = 0,
        park: Park | None = None,
        now_ms: Callable[[], int],
    ) -> None:
        self.engine = engine
        self.stats = stats
        self.park = park
        self.now_ms = now_ms
        self.cache = PrefixCache(host_cache_bytes, park.put if park is not None else lambda tokens, state: None)
        self.free = list(range(engine.shape.sequences - 1, -1, -1))  # slots holding nothing, popped from the end
        self.read_cost = 0.0  # seconds per parked byte read and imported, measured on each resume

    def reset(self) -> None:
        """Every slot is empty (the worker that held them died)."""
        self.cache.entries.clear()
        self.free = list(range(self.engine.shape.sequences - 1, -1, -1))

    # ---- a lane's slot ----

    def place(self, tokens: np.ndarray, running: dict[int, np.ndarray], token_cost: float) -> Placement:
        """A slot for a lane that will hold `tokens`, seeded with the longest prefix worth its cost.

        `running` maps the running lanes' slots to what they hold; `token_cost` is what prefilling a
        token costs now, in seconds, against which reading from the park is weighed.
        """
        now = self.now_ms()
        busy = set(running)  # the running lanes' slots
        seed = self.cache.lookup(tokens, running, now)
        if seed is not None and not seed.take and seed.length < MIN_COPY_TOKENS:
            seed = None  # copying a whole slot costs more than prefilling a few tokens
        hosted = self.cache.host.lookup(tokens, len(tokens) - 1)
        warm = seed.length if seed else 0
        resumed = self._resume(tokens, max(warm, hosted[1] if hosted else 0), busy, token_cost)
        if resumed is not None:
            seq, length = resumed
            return Placement(seq, length, "park", f"{length} warm from the park")
        if hosted is not None and hosted[1] > warm + EXPORT_MIN_TOKENS:
            entry, length = hosted
            seq = self._import(entry.state, length, busy)
            self.stats.imports += 1
            return Placement(seq, length, "host", f"{length} warm from host memory")
        starved = not self.free and seed is not None and self.cache.victim(now, spare=seed.seq) is None
        if seed is not None and not seed.take and starved:
            # the entry to copy from is the only one left to evict: take it over instead
            seed = Seed(seed.seq, seed.length, take=seed.seq in self.cache.entries)
        runs_saved = self._runs_saved(seed.seq, busy) if seed is not None else 0
        if seed is not None and seed.take and runs_saved < 0 and seed.length >= MIN_COPY_TOKENS:
            seed = Seed(seed.seq, seed.length, take=False)  # copy it next to the running lanes instead
        elif seed is not None and not seed.take and runs_saved > 0 and self._takeable(seed.seq, now):
            # the entry to copy from holds the one slot that keeps the running lanes together: the lane takes it
            # over, and the rest of the entry goes where an evicted entry would (a decode of lanes split over
            # two runs of slots costs a third more: 8 lanes of the embedded model, 38 ms against 29)
            self._save(seed.seq)
            seed = Seed(seed.seq, seed.length, take=True)
        if seed is None:
            return Placement(self._free_slot(busy), 0, "cold", "cold")
        if seed.take:
            self.cache.remove(seed.seq)
            self.engine.truncate(seed.seq, seed.length)
            seq = seed.seq
        else:
            seq = self._free_slot(busy, spare=seed.seq)
            self.engine.copy(seed.seq, seq, seed.length)
            self.cache.touch(seed.seq)
        return Placement(seq, seed.length, "slot", f"{seed.length} warm from slot {seed.seq}")

    def keep(self, seq: int, held: list[int]) -> None:
        """A lane left its slot: what it holds stays there as an idle entry, for whoever shares its prefix."""
        self.cache.add(seq, np.asarray(held, dtype=np.int32), self.now_ms())

    def drop(self, seq: int) -> None:
        """A lane left its slot and what it holds is worth nothing: the slot is free."""
        self.engine.truncate(seq, 0)
        self.free.append(seq)

    def evict(self, spare: int | None = None) -> bool:
        """Move the least valuable idle entry out of its slot (the batch did not fit); False when there is none."""
        victim = self.cache.victim(self.now_ms(), spare=spare)
        if victim is None:
            return False
        self._evict_slot(victim)
        return True

    def pin(self, tokens: list[int], until_ms: int) -> None:
        self.cache.pin(np.asarray(tokens, dtype=np.int32), until_ms)

    # ---- between ticks ----

    def slot_to_free(self) -> int | None:
        """With every slot taken, the least valuable unpinned idle entry's, when host memory or the
        park can keep it: exporting it costs tens of milliseconds, better spent while nothing runs
        than by the next arrival. With neither, entries stay until a job needs their slot (and knows
        which entry it must not lose)."""
        if self.free or self.engine.copy_pending or not (self.cache.host.budget or self.park is not None):
            return None  # a copy still pending moves its slots at the next decode: nothing is exported before
        now = self.now_ms()
        victim = self.cache.victim(now)
        return None if victim is None or self.cache.entries[victim].pinned(now) else victim

    def free_a_slot(self) -> None:
        victim = self.slot_to_free()
        if victim is not None:
            self._evict_slot(victim)

    def park_idle(self, limit: int | None = None, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Hand the idle entries (at most `limit` of them) and host memory's not parked yet to the
        park; where they are keeps them too. An export takes the engine for a while, so a job that
        arrives meanwhile (`interrupted`) stops the slots' exports: the rest are parked at the next
        idle moment."""
        assert self.park is not None
        unparked = [
            entry
            for entry in self.cache.entries.values()
            if len(entry.tokens) >= EXPORT_MIN_TOKENS and not self.park.holds(entry.tokens)
        ]
        for entry in unparked[:limit]:
            if interrupted():
                break
            self.park.put(entry.tokens, self.engine.export(entry.seq))
        for hosted in list(self.cache.host.entries.values()):
            self.park.put(hosted.tokens, hosted.state)

    def park_slot(self, seq: int, held: list[int]) -> None:
        """Park what slot `seq` holds now (`held`), unless the park has it: a long prompt just prefilled,
        so that a crash soon after finds it (the write runs on the park's thread)."""
        assert self.park is not None
        tokens = np.asarray(held, dtype=np.int32)
        if len(tokens) >= EXPORT_MIN_TOKENS and not self.park.holds(tokens):
            self.park.put(tokens, self.engine.export(seq))

    def calibrate(self) -> float | None:
        """Measure, on two free slots, what choosing between the park and a prefill rests on: the
        seconds a byte of parked state costs to check and import (kept here), and those a prefilled
        token costs (returned; None when the probe failed and the first resumes must measure them)."""
        first, second = self.free.pop(), self.free.pop()
        probe = np.arange(100, 100 + CALIBRATION_TOKENS, dtype=np.int32)
        positions = np.arange(len(probe), dtype=np.int32)

        def prefill_into(seq: int) -> float:
            started = time.perf_counter()
            seqs = np.full(len(probe), seq, dtype=np.int32)
            self.engine.step(Step(probe, positions, seqs, np.zeros(len(probe), dtype=np.int8), []))
            return time.perf_counter() - started

        try:
            prefill_into(second)  # a context's first decode also sets up its buffers: not a rate
            self.engine.truncate(second, 0)
            prefill = prefill_into(first)
            state = self.engine.export(first)
            started = time.perf_counter()
            hashlib.blake2b(state, digest_size=16).digest()  # a parked file's check
            self.engine.restore(second, state)
            imported = time.perf_counter() - started
        except Exception as e:  # WorkerGone included: the first tick recovers the worker
            log.warning("the park's rates could not be measured (%s): the first resumes measure them", e)
            return None
        finally:
            for seq in (first, second):  # what the probe left in them goes before they are lent out
                with contextlib.suppress(Exception):
                    self.engine.truncate(seq, 0)
            self.free += [second, first]
        self.read_cost = imported / max(1, len(state))
        log.info(
            "this machine prefills %.0f tokens/s and imports parked states at %.0f tokens/s (%.0f MB/s): "
            "a parked prefix is read back when that is quicker than prefilling it",
            len(probe) / prefill,
            len(probe) / imported,
            len(state) / imported / 1e6,
        )
        return prefill / len(probe)

    # ---- inside ----

    def _slot_cost(self, slot: int, running: set[int], now: int) -> tuple[int, int, bool, bool, float]:
        """Lower is better: keeps lanes consecutive, then spares idle entries (pinned ones most, then
        those that would need an export, then recent ones)."""
        entry = self.cache.entries.get(slot)
        if entry is None:
            return (_runs(running | {slot}), 0, False, False, 0.0)
        return (_runs(running | {slot}), 1, entry.pinned(now), not self._saved(entry.tokens), entry.last_used)

    def _runs_saved(self, slot: int, running: set[int]) -> int:
        """How many fewer runs of consecutive slots the running lanes make with a new lane on `slot` than
        with one on the best other slot it could have (negative: more)."""
        others = [s for s in [*self.free, *self.cache.entries] if s != slot]
        if not running or not others:
            return 0
        return min(_runs(running | {s}) for s in others) - _runs(running | {slot})

    def _takeable(self, slot: int, now: int) -> bool:
        """True when `slot` holds an idle entry a lane may take over (no pin keeps it)."""
        entry = self.cache.entries.get(slot)
        return entry is not None and not entry.pinned(now)

    def _free_slot(self, running: set[int], spare: int | None = None) -> int:
        """A slot for a new lane: a free one, or an idle entry's (never `spare`) moved out.

        llama.cpp decodes sequences with consecutive ids in one pass and splits the rest, so
        the slot is chosen to keep the running lanes consecutive.
        """
        now = self.now_ms()
        candidates = [*self.free, *(seq for seq in self.cache.entries if seq != spare)]
        if not candidates:
            raise EngineError("every sequence slot is in use")
        slot = min(candidates, key=lambda s: self._slot_cost(s, running, now))
        if slot in self.cache.entries:
            self._evict_slot(slot)
        self.free.remove(slot)
        return slot

    def _saved(self, tokens: np.ndarray) -> bool:
        """True when the park already holds these tokens' state: their slot can go without an export."""
        return self.park is not None and self.park.holds(tokens)

    def _evict_slot(self, victim: int) -> None:
        """Empty an idle entry's slot, exporting the entry to host memory when it is worth it (an
        export takes the engine for tens of milliseconds, while someone waits for the slot: an entry
        the park holds is not exported again)."""
        self._save(victim)
        self.cache.remove(victim)
        self.engine.truncate(victim, 0)
        self.free.append(victim)
        self.stats.evictions += 1

    def _save(self, seq: int) -> None:
        """Export idle entry `seq` to host memory when it is worth it and the park does not hold it yet
        (host memory first; the park takes what it cannot keep, on its own thread). An export that
        fails raises and leaves the entry where it was."""
        entry = self.cache.entries[seq]
        worth = len(entry.tokens) >= EXPORT_MIN_TOKENS and (self.cache.host.budget or self.park is not None)
        if worth and not self._saved(entry.tokens):
            self.cache.host.add(entry.tokens, self.engine.export(seq))
            if self.cache.host.budget:
                self.stats.exports += 1

    def _import(self, state: bytes, length: int, running: set[int]) -> int:
        """A free slot holding the first `length` tokens of an exported state."""
        seq = self._free_slot(running)
        self.engine.restore(seq, state)
        self.engine.truncate(seq, length)
        return seq

    def _resume(
        self, tokens: np.ndarray, better_than: int, running: set[int], token_cost: float
    ) -> tuple[int, int] | None:
        """A slot holding a parked prefix of `tokens` longer than `better_than` by enough to beat
        prefilling the difference, and that prefix's length; None when no parked entry pays."""
        if self.park is None:
            return None
        found = self.park.lookup(tokens, len(tokens) - 1)
        if found is None or found[1] <= better_than + EXPORT_MIN_TOKENS:
            return None
        entry, length = found
        if self.read_cost and entry.size * self.read_cost >= (length - better_than) * token_cost:
            return None  # reading it would take longer than prefilling it
        started = time.perf_counter()
        state = self.park.read(entry)
        if state is None:
            return None
        seq = self._import(state, length, running)
        took = time.perf_counter() - started
        self.read_cost = took / max(1, entry.size)
        log.info(
            "resumed %d tokens from the park in %.0f ms (%.0f MB/s); prefilling them would take about %.1f s",
            length,
            took * 1000,
            entry.size / took / 1e6,
            length * token_cost,
        )
        return seq, length
