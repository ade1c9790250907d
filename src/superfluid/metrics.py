"""Prometheus metrics of one daemon, in the standard text exposition.

Request counters and latencies are kept here; what the scheduler counts (ticks, tokens
prefilled and decoded, warm prefix, lanes, queues) is read from its stats when the
exposition is rendered, so the hot loop never touches a metrics object.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .engine.worker_client import WorkerEngine
from .protocol.schema import QOS_NAMES
from .scheduler.stats import TIERS

QUEUE_LABELS = ("interactive_chat", "inline_completion", "foreground_agent", "background_agent")


def read_metric(exposition: str, name: str) -> float:
    """The sum of every sample of `name` (whatever its labels) in a text exposition; 0 when there is none."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-+0-9.eE]+|NaN|[+-]Inf)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(exposition))


def _stat(field: str) -> Callable[[Any], float]:
    """A scheduler's counter `field`."""
    return lambda s: getattr(s.stats, field)


def _park_stat(field: str) -> Callable[[Any], float]:
    """A scheduler's park's counter `field` (0 without a park)."""
    return lambda s: getattr(s.tiers.park, field) if s.tiers.park else 0


def device_memory(runtimes: list[Any]) -> GaugeMetricFamily:
    """Used, free and total memory of each GPU a model's layers are on, as llama.cpp reports it now; no
    sample on a CPU build (its weights and KV are in host memory, which the process figures count)."""
    memory = GaugeMetricFamily(
        "superfluid_device_memory_bytes",
        "Memory of a GPU the model's layers are on, by kind: used, free, total",
        labels=["model", "device", "kind"],
    )
    for runtime in runtimes:
        report = runtime.engine.device_report()
        for device in report["devices"]:
            if device["name"] in report["gpus"]:
                for kind in ("used", "free", "total"):
                    memory.add_metric([runtime.id, device["name"], kind], device[kind])
    return memory


class _SchedulerCollector(Collector):
    def __init__(self) -> None:
        self.daemon: Any = None

    def collect(self) -> Iterator[Any]:
        """The scheduler's figures, one sample per loaded model (label `model`)."""
        if self.daemon is None:
            return
        runtimes = self.daemon.models.loaded()

        def family(kind: type, name: str, doc: str, value: Callable[[Any], float]) -> Any:
            metric = kind(f"superfluid_{name}", doc, labels=["model"])
            for runtime in runtimes:
                metric.add_metric([runtime.id], value(runtime.scheduler))
            return metric

        for name, field, doc in (
            ("ticks", "ticks", "Scheduler ticks run"),
            ("steps", "steps", "llama_decode batches run"),
            ("prefill_tokens", "prefill_tokens", "Prompt tokens prefilled"),
            ("decode_tokens", "decode_tokens", "Tokens decoded after sampling"),
            ("warm_prefix_tokens", "warm_prefix_tokens", "Prompt tokens seeded from the KV cache"),
            ("cold_admissions", "cold_admissions", "Jobs admitted with nothing cached"),
            ("preemptions", "preemptions", "Lanes preempted for a higher class"),
            ("steps_interrupted", "steps_interrupted", "Batch steps stopped for an interactive arrival, run again"),
            ("cache_evictions", "evictions", "Idle KV entries moved out of their slots"),
            ("cache_exports", "exports", "Evicted prefixes exported to host memory"),
            ("cache_imports", "imports", "Prefixes imported back from host memory"),
            ("worker_respawns", "respawns", "llama.cpp workers started again after one died"),
            ("prefix_holds", "held_for_prefix", "Steps a job waited for a lane prefilling its prefix"),
            ("spec_proposed", "spec_proposed", "Drafted tokens put into decodes (speculative decoding)"),
            ("spec_accepted", "spec_accepted", "Drafted tokens the lanes would have drawn anyway"),
        ):
            yield family(CounterMetricFamily, name, doc, _stat(field))
        for name, field, doc in (
            ("parks", "parks", "KV states written to the park"),
            ("resumes", "resumes", "Prefixes imported back from the park"),
            ("park_refused", "refused", "Parked files that failed a check, deleted"),
            ("park_passed_over", "passed_over", "States not parked: the writer was too far behind"),
        ):
            yield family(CounterMetricFamily, name, doc, _park_stat(field))
        for name, doc, value in (
            ("lanes_active", "Lanes running a job", lambda s: s.stats.lanes_active),
            ("lanes_total", "Lanes (--max-batch)", lambda s: s.max_lanes),
            ("cache_entries", "Idle KV entries held for reuse", lambda s: len(s.tiers.cache)),
            ("host_cache_bytes", "Bytes of exported prefixes", lambda s: s.tiers.cache.host.bytes),
            ("host_cache_budget_bytes", "--host-cache-mb in bytes", lambda s: s.tiers.cache.host.budget),
            ("park_bytes", "Bytes of parked KV states on disk", lambda s: s.tiers.park.bytes if s.tiers.park else 0),
            (
                "park_pending_bytes",
                "Bytes of KV states handed to the park's writer and not yet on disk",
                lambda s: s.tiers.park.pending_bytes if s.tiers.park else 0,
            ),
            (
                "park_budget_bytes",
                "--park-budget-gb in bytes (0: unbounded)",
                lambda s: s.tiers.park.budget if s.tiers.park else 0,
            ),
            ("kv_slots", "KV slots (lanes and idle entries)", lambda s: s.engine.shape.sequences),
            ("kv_slot_tokens", "Tokens per KV slot (--max-context)", lambda s: s.engine.shape.window),
            ("kv_tokens", "Tokens whose KV the slots hold, lanes' and idle entries'", lambda s: s.kv_tokens()),
            ("tick_in_flight", "1 while a scheduler tick runs", lambda s: int(s.stats.tick_in_flight)),
            (
                "last_ttft_seconds",
                "Submission to first token of the last job",
                lambda s: s.stats.last_ttft_seconds or 0,
            ),
        ):
            yield family(GaugeMetricFamily, name, doc, value)
        hits = CounterMetricFamily(
            "superfluid_prefix_hits", "Jobs admitted, by the tier their prefix came from", labels=["model", "tier"]
        )
        for runtime in runtimes:
            for tier, count in zip(TIERS, runtime.scheduler.stats.tier_hits, strict=True):
                hits.add_metric([runtime.id, tier], count)
        yield hits
        yield from self._lanes(runtimes)
        depth = GaugeMetricFamily("superfluid_queue_depth", "Jobs waiting, by QoS class", labels=["model", "class"])
        for runtime in runtimes:
            for label, value in zip(QUEUE_LABELS, runtime.scheduler.stats.queue_depth, strict=True):
                depth.add_metric([runtime.id, label], value)
        yield depth
        yield GaugeMetricFamily("superfluid_models_loaded", "Models with a running engine", value=len(runtimes))
        workers = [r for r in runtimes if isinstance(r.engine, WorkerEngine)]
        for name, doc, attr in (
            ("worker_step_seconds", "Engine steps as the daemon timed them, worker channel included", "step_seconds"),
            ("worker_compute_seconds", "The same steps timed inside the worker", "worker_seconds"),
        ):
            metric = CounterMetricFamily(f"superfluid_{name}", doc, labels=["model"])
            for runtime in workers:
                metric.add_metric([runtime.id], getattr(runtime.engine, attr))
            yield metric
        yield device_memory(runtimes)
        up = GaugeMetricFamily("superfluid_worker_up", "1 while the model's llama.cpp worker serves", labels=["model"])
        for runtime in workers:
            up.add_metric([runtime.id], int(runtime.engine.serving))
        yield up
        yield GaugeMetricFamily(
            "superfluid_generations_running", "Generations in flight", value=len(self.daemon.running)
        )
        leases = self.daemon.store.leases
        if leases is not None:  # daemons sharing a PostgreSQL store
            yield GaugeMetricFamily("superfluid_leases_held", "Sessions leased to this daemon", value=len(leases.held))
            yield CounterMetricFamily(
                "superfluid_lease_takeovers", "Sessions taken over from a daemon whose lease ran out", leases.takeovers
            )
            yield CounterMetricFamily(
                "superfluid_leases_lost", "Sessions whose lease this daemon lost to another", leases.lost
            )

    @staticmethod
    def _lanes(runtimes: list[Any]) -> Iterator[GaugeMetricFamily]:
        """Two samples per running lane, labelled with its slot, session, class and phase (prefill or
        decode): the tokens of its stream so far, and those it generated. Lanes are copied whole first."""
        labels = ["model", "slot", "session", "class", "phase"]
        stream = GaugeMetricFamily(
            "superfluid_lane_tokens", "A running lane's tokens: prompt and reply so far", labels=labels
        )
        generated = GaugeMetricFamily(
            "superfluid_lane_generated_tokens", "A running lane's generated tokens", labels=labels
        )
        for runtime in runtimes:
            for lane in list(runtime.scheduler.lanes):
                job = lane.job
                session = "" if job.session is None else str(job.session)
                phase = "prefill" if job.awaits_first_token else "decode"
                values = [runtime.id, str(lane.seq), session, QOS_NAMES[job.qos], phase]
                stream.add_metric(values, len(lane.held) + len(lane.feed))
                generated.add_metric(values, job.generated)
        yield stream
        yield generated


class _KeyCollector(Collector):
    """Requests by API key and outcome, and each key's requests in flight (`--key-policy`)."""

    def __init__(self) -> None:
        self.gate: Any = None

    def collect(self) -> Iterator[Any]:
        if self.gate is None or not self.gate.keyed:
            return
        admitted = CounterMetricFamily("superfluid_key_requests", "Requests admitted, by key", labels=["key"])
        rejected = CounterMetricFamily(
            "superfluid_key_rejected", "Requests refused, by key and reason", labels=["key", "reason"]
        )
        for (name, outcome), count in sorted(self.gate.counts.items()):
            if outcome == "admitted":
                admitted.add_metric([name], count)
            else:
                rejected.add_metric([name, outcome], count)
        in_flight = GaugeMetricFamily("superfluid_key_in_flight", "Requests running, by key", labels=["key"])
        for key in self.gate.keys:
            in_flight.add_metric([key.name], key.in_flight)
        yield from (admitted, rejected, in_flight)


class Metrics:
    """The daemon's metrics registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "superfluid_requests", "Session API requests, by verb", ["verb"], registry=self.registry
        )
        self.request_seconds = Histogram(
            "superfluid_request_seconds", "Time to answer a non-streaming request", registry=self.registry
        )
        self.generations = Counter("superfluid_generations", "Generations started", registry=self.registry)
        self.tokens_generated = Counter(
            "superfluid_generated_tokens", "Tokens generated by finished generations", registry=self.registry
        )
        self.warm_prefix_tokens = Counter(
            "superfluid_generation_warm_prefix_tokens",
            "Prompt tokens of finished generations that came from the cache",
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "superfluid_commit_seconds",
            "Time to make one tick's records durable",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "superfluid_ttft_seconds",
            "Admission to first committed token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40),
            registry=self.registry,
        )
        self.fim_completions = Counter(
            "superfluid_fim_completions", "Complete requests, by result", ["result"], registry=self.registry
        )
        # with --otlp-endpoint (superfluid.telemetry): what the export lost
        self.otlp_spans_dropped = Counter(
            "superfluid_otlp_spans_dropped",
            "Spans not exported: the queue was full, or the collector could not be reached or refused them",
            registry=self.registry,
        )
        self.otlp_export_failures = Counter(
            "superfluid_otlp_export_failures", "OTLP exports that failed, by signal", ["signal"], registry=self.registry
        )
        self._scheduler = _SchedulerCollector()
        self.registry.register(self._scheduler)
        self._keys = _KeyCollector()
        self.registry.register(self._keys)

    def attach(self, daemon: Any) -> None:
        self._scheduler.daemon = daemon

    def watch_gate(self, gate: Any) -> None:
        """Count the HTTP listener's requests by API key."""
        self._keys.gate = gate

    def exposition(self) -> str:
        return generate_latest(self.registry).decode("utf-8")
