"""What a scheduler counts, for `/metrics`, the monitor and the bench; and the names its counters are kept by."""

from __future__ import annotations

from dataclasses import dataclass, field

QOS_CLASSES = 4
TIERS = ("slot", "host", "park", "cold")  # where an admitted job's prefix came from, fastest first


@dataclass
class SchedulerStats:
    """Counters the metrics endpoint reads."""

    ticks: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    warm_prefix_tokens: int = 0
    cold_admissions: int = 0
    tier_hits: list[int] = field(default_factory=lambda: [0] * len(TIERS))  # first admissions, by `TIERS`
    spec_proposed: int = 0  # drafted tokens put into decodes
    spec_accepted: int = 0  # of them, those the lanes would have drawn anyway
    preemptions: int = 0
    held_for_prefix: int = 0
    evictions: int = 0
    exports: int = 0
    imports: int = 0
    respawns: int = 0
    steps_interrupted: int = 0  # steps stopped for an interactive arrival (`engine.interrupt`)
    queue_depth: list[int] = field(default_factory=lambda: [0] * QOS_CLASSES)
    lanes_active: int = 0
    tick_in_flight: bool = False
    decode_tokens_per_second: float = 0.0  # smoothed over the steps that only decode
    prefill_tokens_per_second: float = 0.0  # smoothed over the steps that prefill
    last_ttft_seconds: float | None = None  # submission to first token, of the last job to get one
