"""KV tiers on the fake engine: where a new lane's prefix comes from, and what eviction, host memory and the park keep.

Each test drives `KVTiers` as the scheduler does (place a lane, prefill it, keep or drop it)
and checks the fake's slots: a prefix placed from any tier must hold exactly the tokens it
claims, since the fake's next token is a function of the slot's whole content.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine

from superfluid.engine.interface import EngineError, Step
from superfluid.scheduler.kv_tiers import EXPORT_MIN_TOKENS, MIN_COPY_TOKENS, KVTiers
from superfluid.scheduler.park import Park, park_fingerprint
from superfluid.scheduler.stats import SchedulerStats

TOKEN_COST = 0.001  # seconds a prefilled token costs, as the scheduler would pass it


def tiers_of(engine: FakeEngine, **kw: object) -> KVTiers:
    return KVTiers(engine, SchedulerStats(), now_ms=lambda: time.time_ns() // 1_000_000, **kw)  # type: ignore[arg-type]


def prefill(engine: FakeEngine, seq: int, tokens: list[int], start: int) -> None:
    """Put `tokens[start:]` into slot `seq` after the `start` it holds, as a prefill step does."""
    rest = np.asarray(tokens[start:], dtype=np.int32)
    positions = np.arange(start, len(tokens), dtype=np.int32)
    engine.step(Step(rest, positions, np.full(len(rest), seq, dtype=np.int32), np.zeros(len(rest), np.int8), []))


def lane(
    tiers: KVTiers, engine: FakeEngine, tokens: list[int], running: dict[int, np.ndarray] | None = None
) -> tuple[int, int, str]:
    """Place a lane for `tokens`, check the slot holds the claimed prefix, fill the rest; (slot, warm, tier)."""
    placed = tiers.place(np.asarray(tokens, dtype=np.int32), running or {}, TOKEN_COST)
    assert engine.llama.slots[placed.seq] == tokens[: placed.length], f"slot {placed.seq} holds the wrong prefix"
    prefill(engine, placed.seq, tokens, placed.length)
    return placed.seq, placed.length, placed.tier


def test_a_lane_with_nothing_cached_starts_cold_on_a_free_slot() -> None:
    engine = FakeEngine(sequences=2)
    tiers = tiers_of(engine)
    seq, warm, tier = lane(tiers, engine, [1, 2, 3])
    assert (warm, tier) == (0, "cold") and seq not in tiers.free


def test_a_continuation_takes_over_its_idle_entry() -> None:
    engine = FakeEngine(sequences=2)
    tiers = tiers_of(engine)
    history = list(range(100, 140))
    seq, _, _ = lane(tiers, engine, history)
    tiers.keep(seq, history)
    again, warm, tier = lane(tiers, engine, [*history, 7, 8])
    assert (again, warm, tier) == (seq, len(history), "slot"), "the entry's own slot, not a copy"
    assert seq not in tiers.cache.entries


def test_a_shared_prefix_of_a_running_lane_is_copied_into_another_slot() -> None:
    engine = FakeEngine(sequences=3)
    tiers = tiers_of(engine)
    shared = list(range(100, 120))
    first, _, _ = lane(tiers, engine, [*shared, 1])
    running = {first: np.asarray(engine.llama.slots[first], dtype=np.int32)}
    second, warm, tier = lane(tiers, engine, [*shared, 2], running)
    assert second != first and (warm, tier) == (len(shared), "slot")
    assert engine.llama.slots[first] == [*shared, 1], "the source is untouched"


def test_a_prefix_shorter_than_a_copy_is_worth_is_prefilled() -> None:
    engine = FakeEngine(sequences=3)
    tiers = tiers_of(engine)
    short = list(range(100, 100 + MIN_COPY_TOKENS - 1))
    first, _, _ = lane(tiers, engine, [*short, 1])
    running = {first: np.asarray(engine.llama.slots[first], dtype=np.int32)}
    _, warm, tier = lane(tiers, engine, [*short, 2], running)
    assert (warm, tier) == (0, "cold")


def test_a_lane_takes_over_the_entry_it_shares_a_prefix_with_when_that_keeps_the_lanes_together() -> None:
    # llama.cpp decodes lanes on consecutive slots in one pass and splits the rest: with the entry to copy from
    # in the one slot next to the running lane, the new lane takes that slot, and the entry goes to host memory
    engine = FakeEngine(sequences=3)
    tiers = tiers_of(engine, host_cache_bytes=1 << 20)
    shared = list(range(100, 120))
    running_seq, _, _ = lane(tiers, engine, [1, 2, 3])
    running = {running_seq: np.asarray(engine.llama.slots[running_seq], dtype=np.int32)}
    history = [*shared, *range(500, 540)]  # an earlier conversation: the shared prompt and its reply
    entry_seq, _, _ = lane(tiers, engine, history, running)
    tiers.keep(entry_seq, history)
    assert abs(entry_seq - running_seq) == 1 and len(tiers.free) == 1 and abs(tiers.free[0] - running_seq) == 2
    seq, warm, tier = lane(tiers, engine, [*shared, 7, 8, 9], running)
    assert (seq, warm, tier) == (entry_seq, len(shared), "slot"), "the entry's slot, next to the running lane"
    assert len(tiers.cache.host) == 1 and tiers.stats.exports == 1
    tiers.drop(seq)
    _, warm, tier = lane(tiers, engine, [*history, 9], running)
    assert (warm, tier) == (len(history), "host"), "the whole earlier conversation comes back"


def test_waves_of_requests_sharing_a_prompt_stay_on_one_run_of_slots() -> None:
    # eight clients, each sending its next request when all eight replies are done (the soak's pattern): every
    # wave's lanes copy the shared prompt from the last wave's entries and must still sit on consecutive slots
    engine = FakeEngine(sequences=12)
    tiers = tiers_of(engine, host_cache_bytes=1 << 30)
    system = list(range(1000, 1030))
    order = list(range(8))
    for wave in range(30):
        random.Random(wave).shuffle(order)
        running: dict[int, np.ndarray] = {}
        for client in order:
            seq, _, _ = lane(tiers, engine, [*system, 2000 + client, 3000 + wave, 5000], running)
            reply = [*engine.llama.slots[seq], *range(6000, 6040)]
            prefill(engine, seq, reply, len(engine.llama.slots[seq]))
            running[seq] = np.asarray(reply, dtype=np.int32)
        assert max(running) - min(running) == len(running) - 1, f"wave {wave} on slots {sorted(running)}"
        for seq, held in running.items():
            tiers.keep(seq, list(held))
        tiers.free_a_slot()


def test_an_evicted_entry_comes_back_from_host_memory() -> None:
    engine = FakeEngine(sequences=2)
    tiers = tiers_of(engine, host_cache_bytes=1 << 20)
    document = list(range(200, 200 + EXPORT_MIN_TOKENS + 10))
    seq, _, _ = lane(tiers, engine, document)
    tiers.keep(seq, document)
    other = list(range(300, 340))
    seq2, _, _ = lane(tiers, engine, other)
    tiers.keep(seq2, other)
    third, _, tier = lane(tiers, engine, [1, 2, 3])  # no free slot: the older entry (the document) goes to host
    assert tier == "cold" and third == seq
    assert tiers.stats.exports == 1 and tiers.stats.evictions == 1 and len(tiers.cache.host) == 1
    tiers.drop(third)
    _, warm, tier = lane(tiers, engine, [*document, 5])
    assert (warm, tier) == (len(document), "host") and tiers.stats.imports == 1


def test_short_entries_are_dropped_not_exported() -> None:
    engine = FakeEngine(sequences=1)
    tiers = tiers_of(engine, host_cache_bytes=1 << 20)
    seq, _, _ = lane(tiers, engine, [1, 2, 3])
    tiers.keep(seq, [1, 2, 3])
    lane(tiers, engine, [4, 5, 6])
    assert tiers.stats.evictions == 1 and tiers.stats.exports == 0 and len(tiers.cache.host) == 0


def test_pinned_entries_are_evicted_last() -> None:
    engine = FakeEngine(sequences=2)
    tiers = tiers_of(engine)
    pinned, newer = list(range(200, 240)), list(range(300, 340))
    seq, _, _ = lane(tiers, engine, pinned)
    tiers.keep(seq, pinned)
    tiers.pin(pinned, int(time.time() * 1000) + 60_000)
    seq2, _, _ = lane(tiers, engine, newer)
    tiers.keep(seq2, newer)
    taken, _, _ = lane(tiers, engine, [31, 32, 33])
    assert taken == seq2 and seq in tiers.cache.entries, "the unpinned, newer entry went"


def test_idle_entries_are_freed_ahead_of_the_next_arrival_only_when_something_can_keep_them() -> None:
    for host, freed in ((0, False), (1 << 20, True)):
        engine = FakeEngine(sequences=1)
        tiers = tiers_of(engine, host_cache_bytes=host)
        tokens = list(range(100, 100 + EXPORT_MIN_TOKENS))
        seq, _, _ = lane(tiers, engine, tokens)
        tiers.keep(seq, tokens)
        assert (tiers.slot_to_free() == seq) is freed
        tiers.free_a_slot()
        assert (seq in tiers.free) is freed and (len(tiers.cache.host) == 1) is freed


def test_a_batch_that_does_not_fit_evicts_an_idle_entry_and_nothing_else() -> None:
    engine = FakeEngine(sequences=2)
    tiers = tiers_of(engine)
    assert not tiers.evict(), "no idle entry: nothing to evict"
    seq, _, _ = lane(tiers, engine, [1, 2, 3])
    tiers.keep(seq, [1, 2, 3])
    assert not tiers.evict(spare=seq)
    assert tiers.evict() and seq in tiers.free and engine.llama.slots[seq] == []


def test_with_every_slot_running_a_new_lane_is_refused() -> None:
    engine = FakeEngine(sequences=1)
    tiers = tiers_of(engine)
    seq, _, _ = lane(tiers, engine, [1, 2, 3])
    with pytest.raises(EngineError, match="every sequence slot is in use"):
        tiers.place(np.asarray([9, 9], dtype=np.int32), {seq: np.asarray([1, 2, 3], dtype=np.int32)}, TOKEN_COST)


def parked_history(tmp_path: Path) -> tuple[FakeEngine, Park, KVTiers, list[int], int]:
    """Tiers with a park, holding one history idle in a slot and parked too: (engine, park, tiers, history, slot)."""
    engine = FakeEngine(sequences=2)
    park = Park(tmp_path / "park", park_fingerprint("fake"), 0)
    tiers = tiers_of(engine, park=park)
    history = list(range(400, 400 + 3 * EXPORT_MIN_TOKENS))
    seq, _, _ = lane(tiers, engine, history)
    tiers.keep(seq, history)
    tiers.park_idle()
    park.flush()
    return engine, park, tiers, history, seq


def test_the_park_keeps_a_prefix_across_a_lost_worker(tmp_path: Path) -> None:
    engine, park, tiers, history, _ = parked_history(tmp_path)
    assert park.holds(np.asarray(history, dtype=np.int32)) and park.parks == 1
    for slot in engine.llama.slots.values():  # the worker died: its slots are gone
        slot.clear()
    tiers.reset()
    _, warm, tier = lane(tiers, engine, [*history, 1])
    assert (warm, tier) == (len(history), "park") and tiers.read_cost > 0


def test_a_park_read_that_costs_more_than_the_prefill_is_skipped(tmp_path: Path) -> None:
    engine, _, tiers, history, seq = parked_history(tmp_path)
    tiers.drop(seq)
    tiers.reset()
    tiers.read_cost = 1.0  # a second per byte: any prefill is quicker
    _, warm, tier = lane(tiers, engine, [*history, 1])
    assert (warm, tier) == (0, "cold")


def test_parking_stops_when_a_job_arrives(tmp_path: Path) -> None:
    engine = FakeEngine(sequences=3)
    park = Park(tmp_path / "park", park_fingerprint("fake"), 0)
    tiers = tiers_of(engine, park=park)
    for base in (100, 200):
        tokens = list(range(base, base + EXPORT_MIN_TOKENS))
        seq, _, _ = lane(tiers, engine, tokens)
        tiers.keep(seq, tokens)
    tiers.park_idle(interrupted=lambda: True)
    park.flush()
    assert park.parks == 0
    tiers.park_idle(limit=1)
    park.flush()
    assert park.parks == 1


def test_calibration_measures_a_prefill_and_leaves_the_slots_empty() -> None:
    engine = FakeEngine(sequences=2, delay=0.002)
    tiers = tiers_of(engine)
    cost = tiers.calibrate()
    assert cost is not None and cost > 0 and tiers.read_cost > 0
    assert sorted(tiers.free) == [0, 1] and all(slot == [] for slot in engine.llama.slots.values())
