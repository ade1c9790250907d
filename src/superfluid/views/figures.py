"""A daemon's figures as the terminal views show them, read from its `/metrics` exposition.

`Figures.parse` turns one exposition into a snapshot (summed over models where a figure is
per model); `History` keeps successive snapshots and turns counters into rates, with the
last minutes of each rate for a sparkline. Nothing here reads the daemon itself.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ..metrics import QUEUE_LABELS
from ..protocol.schema import QOS_NAMES
from ..scheduler.stats import TIERS

CLASSES = tuple(QOS_NAMES[i] for i in range(len(QOS_NAMES)))
HISTORY_SAMPLES = 300  # five minutes at one sample a second


@dataclass(frozen=True)
class LaneFigure:
    """One running lane."""

    model: str
    slot: int
    session: str
    klass: str
    phase: str
    tokens: int
    generated: int


@dataclass
class Figures:
    """One reading of a daemon's exposition."""

    ticks: float = 0.0
    tick_in_flight: bool = False
    lanes: list[LaneFigure] = field(default_factory=list)
    lanes_total: int = 0
    kv_slots: int = 0
    kv_slot_tokens: int = 0
    kv_tokens: int = 0
    cache_entries: int = 0
    host_bytes: float = 0.0
    host_budget: float = 0.0
    park_bytes: float = 0.0
    park_budget: float = 0.0
    decode_tokens: float = 0.0
    prefill_tokens: float = 0.0
    preemptions: float = 0.0
    spec_proposed: float = 0.0
    spec_accepted: float = 0.0
    queue: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    hits: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    last_ttft: float = 0.0
    ttft_buckets: list[tuple[float, float]] = field(default_factory=list)  # (upper bound, cumulative count)
    workers: dict[str, bool] = field(default_factory=dict)  # model -> its worker is up
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)  # GPU -> used, free, total bytes
    respawns: float = 0.0
    models: int = 0
    generations: int = 0

    @property
    def queued(self) -> int:
        return sum(self.queue.values())

    def ttft_quantile(self, q: float) -> float | None:
        """The q-quantile of the time to first token since start, interpolated within its bucket
        as Prometheus's histogram_quantile does; None before the first observation."""
        buckets = sorted(self.ttft_buckets)
        if not buckets or buckets[-1][1] <= 0:
            return None
        rank = q * buckets[-1][1]
        lower, below = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if bound == float("inf"):
                    return lower
                share = (rank - below) / (count - below) if count > below else 1.0
                return lower + (bound - lower) * share
            lower, below = bound, count
        return lower

    @classmethod
    def parse(cls, exposition: str) -> Figures:
        """A snapshot of an exposition; figures it lacks stay 0."""
        figures = cls()
        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, sample.value
                if name in ("superfluid_lane_tokens", "superfluid_lane_generated_tokens"):
                    continue  # gathered below, lane by lane
                if name == "superfluid_queue_depth":
                    label = labels.get("class", "")
                    if label in QUEUE_LABELS:
                        figures.queue[CLASSES[QUEUE_LABELS.index(label)]] += int(value)
                elif name == "superfluid_prefix_hits_total" and labels.get("tier") in figures.hits:
                    figures.hits[labels["tier"]] += value
                elif name == "superfluid_ttft_seconds_bucket":
                    figures.ttft_buckets.append((float(labels["le"]), value))
                elif name == "superfluid_device_memory_bytes":  # a GPU shared by models: each reports it
                    figures.gpus.setdefault(labels.get("device", ""), {})[labels.get("kind", "")] = value
                elif name == "superfluid_worker_up":
                    figures.workers[labels.get("model", "")] = value > 0
                elif name == "superfluid_last_ttft_seconds":
                    figures.last_ttft = max(figures.last_ttft, value)
                else:
                    sums[name] = sums.get(name, 0.0) + value
        figures.lanes = _lanes(exposition)
        figures.ticks = sums.get("superfluid_ticks_total", 0.0)
        figures.tick_in_flight = sums.get("superfluid_tick_in_flight", 0.0) > 0
        figures.lanes_total = int(sums.get("superfluid_lanes_total", 0))
        figures.kv_slots = int(sums.get("superfluid_kv_slots", 0))
        figures.kv_slot_tokens = int(sums.get("superfluid_kv_slot_tokens", 0))
        figures.kv_tokens = int(sums.get("superfluid_kv_tokens", 0))
        figures.cache_entries = int(sums.get("superfluid_cache_entries", 0))
        figures.host_bytes = sums.get("superfluid_host_cache_bytes", 0.0)
        figures.host_budget = sums.get("superfluid_host_cache_budget_bytes", 0.0)
        figures.park_bytes = sums.get("superfluid_park_bytes", 0.0)
        figures.park_budget = sums.get("superfluid_park_budget_bytes", 0.0)
        figures.decode_tokens = sums.get("superfluid_decode_tokens_total", 0.0)
        figures.prefill_tokens = sums.get("superfluid_prefill_tokens_total", 0.0)
        figures.preemptions = sums.get("superfluid_preemptions_total", 0.0)
        figures.spec_proposed = sums.get("superfluid_spec_proposed_total", 0.0)
        figures.spec_accepted = sums.get("superfluid_spec_accepted_total", 0.0)
        figures.respawns = sums.get("superfluid_worker_respawns_total", 0.0)
        figures.models = int(sums.get("superfluid_models_loaded", 0))
        figures.generations = int(sums.get("superfluid_generations_running", 0))
        return figures


def _lanes(exposition: str) -> list[LaneFigure]:
    """The running lanes, from the two per-lane gauges (joined on their labels)."""
    tokens: dict[tuple[str, ...], float] = {}
    generated: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(exposition):
        into = {"superfluid_lane_tokens": tokens, "superfluid_lane_generated_tokens": generated}.get(family.name)
        if into is None:
            continue
        for sample in family.samples:
            labels = sample.labels
            key = tuple(labels.get(k, "") for k in ("model", "slot", "session", "class", "phase"))
            into[key] = sample.value
    lanes = [
        LaneFigure(model, int(slot), session, klass, phase, int(value), int(generated.get(key, 0)))
        for key, value in tokens.items()
        for model, slot, session, klass, phase in [key]
    ]
    return sorted(lanes, key=lambda lane: (lane.model, lane.slot))


class History:
    """Successive snapshots: the latest, and the decode and prefill rates of the last minutes."""

    def __init__(self, samples: int = HISTORY_SAMPLES) -> None:
        self.latest: Figures | None = None
        self.decode: deque[float] = deque(maxlen=samples)  # tokens/s between two readings
        self.prefill: deque[float] = deque(maxlen=samples)
        self._at = 0.0

    def add(self, figures: Figures, at: float | None = None) -> None:
        now = time.monotonic() if at is None else at
        previous, elapsed = self.latest, now - self._at
        if previous is not None and elapsed > 0:
            # a counter that went down belongs to a restarted daemon: its rate starts again from 0
            self.decode.append(max(0.0, figures.decode_tokens - previous.decode_tokens) / elapsed)
            self.prefill.append(max(0.0, figures.prefill_tokens - previous.prefill_tokens) / elapsed)
        self.latest, self._at = figures, now

    @property
    def decode_rate(self) -> float:
        return self.decode[-1] if self.decode else 0.0

    @property
    def prefill_rate(self) -> float:
        return self.prefill[-1] if self.prefill else 0.0


def human_bytes(count: float) -> str:
    """1.2 GiB, 340 MiB, 12 KiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}" if count < 10 * size else f"{count / size:.0f} {unit}"
    return f"{count:.0f} B"
