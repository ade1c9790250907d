"""Where superfluid keeps its state, and the settings of `superfluid serve`, in one place.

`$SUPERFLUID_HOME` (default `~/.superfluid`) holds the sessions directory and the
socket. Every serve flag is a field of `ServeConfig`; the CLI fills it and nothing else
reads the command line.
"""

from __future__ import annotations

import os
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MAX_BATCH = 8
DEFAULT_HTTP = "127.0.0.1:8453"
MAX_FRAME = 64 << 20
KERNELS = ("fast", "exact")  # which llama.cpp build a model runs on (superfluid.engine.build)


# the runtimes a model may name (`--runtime`, a load request's `runtime`), by the names people use for them
RUNTIMES = {"llamacpp": "llamacpp", "llama.cpp": "llamacpp", "llama-cpp": "llamacpp", "auto": "auto"}


def default_host_cache_mb() -> int:
    """Host memory for evicted prefixes: a quarter of the machine's memory, at most 2 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (ValueError, OSError):
        total = 4096
    return max(0, min(2048, total // 4))


def home() -> Path:
    configured = os.environ.get("SUPERFLUID_HOME", "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".superfluid"


def default_sessions() -> Path:
    return home() / "sessions"


def default_socket() -> Path:
    return home() / "superfluid.sock"


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling for requests that name none: `--temperature` and friends, else the model's own
    GGUF `general.sampling.*` values, else the usual ones. `None` leaves a field to the next."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None

    def over(self, other: SamplingDefaults) -> SamplingDefaults:
        """These defaults where set, `other`'s elsewhere."""
        return SamplingDefaults(
            *(mine if mine is not None else theirs for mine, theirs in zip(astuple(self), astuple(other), strict=True))
        )


@dataclass
class ServeConfig:
    """Everything `superfluid serve` is told."""

    models: list[str] = field(default_factory=list)  # the first is the default; none: the embedded model
    sessions: Path = field(default_factory=default_sessions)
    socket: Path = field(default_factory=default_socket)
    max_context: int | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    threads: int = field(default_factory=lambda: os.cpu_count() or 2)
    http: str = DEFAULT_HTTP
    no_http: bool = False
    web: str | None = None
    web_origins: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)  # pages of other origins that may call the HTTP API
    offline: bool = False
    log_filter: str = "info"
    fim_tokens: tuple[int, int, int] | None = None
    fim_model: str | None = None  # the model fill-in-the-middle runs on; None: the default one
    chat_template: Path | None = None  # a Jinja file in place of the GGUF's own template
    tool_call_parser: str | None = None  # a dialect name (superfluid.model.dialects); None: from the template
    tick_ms: float = 50.0
    host_cache_mb: int = field(default_factory=lambda: default_host_cache_mb())
    park: bool | None = None  # KV states on disk under <sessions>/park; None: where the disk suits
    park_dir: Path | None = None  # where parked states go (shared by the daemons on a store); None: <sessions>/park
    park_budget_gb: float = 20.0  # 0: unbounded
    http_default_qos: int = 2  # agent
    http_qos_header: bool = True
    http_allow_batch_invariant: bool = False
    worker_process: bool = True  # llama.cpp in a worker process, so its crash is not the daemon's
    # "exact": a token's logits ignore its batch; "fast": every kernel llama.cpp has; None: exact where the
    # library allows it, else fast (superfluid.engine.build)
    kernels: str | None = None
    # where the weights go (superfluid.engine.devices.Placement): --gpu-layers (-1 all; None: all on a GPU
    # build, none on a CPU one), --gpu (GPU indices; none: every GPU), --tensor-split (shares per GPU)
    gpu_layers: int | None = None
    gpus: tuple[int, ...] = ()
    tensor_split: tuple[float, ...] = ()
    idle_timeout: float = 0.0  # unload a model (never the default) idle this long; 0 never
    max_tokens: int | None = None  # cap of a request that names none; None fills the context
    pin_budget_pct: int = 50  # of the KV pool, at most, held by prefixes that prompt-cache marks pin
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    class_lanes: dict[int, int] = field(default_factory=dict)  # QoS class -> most lanes it may hold
    nonstream_keepalive: float = 0.0  # seconds between the spaces of a non-streaming body; 0 off
    shed_when_busy: int | None = None  # 429 or 503 for a stateless request when every lane is busy; None: queue
    api_key: str | None = None
    keys: list[Any] = field(default_factory=list)  # the keys of --key-policy, read once at start
    rate_limit: int = 0  # requests per minute per client IP; 0 off
    drain_timeout: float = 60.0
    log_file: Path | None = None
    log_dir: Path | None = None
    # OpenTelemetry export (superfluid.telemetry.otlp); None: $OTEL_EXPORTER_OTLP_ENDPOINT and friends, else the default
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    otlp_service_name: str | None = None
    tui: bool = False  # the terminal monitor (--tui; on by default when stdout is a terminal)
    store: str | None = None  # a PostgreSQL URL for the session log; None: SQLite under `sessions`
    advertise: str | None = None  # where clients reach this daemon's --web, told to those sent elsewhere
    forward: bool = True  # a request for a session another daemon serves is sent on to it (with --store)
    lease_renew: float = 2.0  # seconds between renewals of the session leases (with --store)
    lease_expiry: float = 10.0  # seconds a lease lasts unrenewed
    speculate: str = "auto"  # off, auto or prompt-lookup
    spec_draft_tokens: int = 15  # the longest draft; --spec-adaptive picks each one's length below it
    spec_adaptive: bool = True
    spec_min_speedup: float = 1.08
