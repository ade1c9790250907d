"""The models a daemon serves: each loaded one with its vocabulary, template, engine and scheduler.

A `Runtime` is one loaded model. The daemon keeps the vocabulary and the chat template
(tokenization stays here); the engine, in a worker process by default, holds the weights
and the KV; the scheduler runs its lanes. `Models` knows every model named at start or
loaded since, by id: the first is the default (the session API generates with it), the
others load when a request names them and unload when told or when idle for
`--idle-timeout`. Sessions do not belong to a model: the log records which model
generated each turn (`GenerationFingerprint`).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..config import SamplingDefaults, ServeConfig
from ..engine.build import (
    LIBRARY_ENV,
    amx_compiled,
    exact_refusal,
    fast_build_exact,
    fast_library,
    flash_attention_on,
    worker_environment,
)
from ..engine.interface import ContextShape, Engine, EngineError
from ..engine.interrupt import Interrupt
from ..engine.llama import LlamaContext, LlamaModel
from ..engine.local import LocalEngine
from ..engine.placement import Placement
from ..engine.worker_client import WorkerEngine
from ..model.dialects import named
from ..model.resolve import ModelNotFound, hub_ref, quant_in_name, resolve_model
from ..model.template import CHATML, ChatTemplate
from ..scheduler.park import Park, default_budget, park_fingerprint
from ..scheduler.prompt_pins import PromptPins
from ..scheduler.scheduler import Scheduler
from ..scheduler.speculate import SpecSettings

log = logging.getLogger("superfluid")

# KV slots beyond the lanes: they keep finished prefixes for forks and continuations.
SPARE_SLOTS = 4
BATCH_TOKENS = 512


class ModelError(Exception):
    """A model that cannot be served: unknown, or it does not load; `status` is the HTTP answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Runtime:
    """One loaded model."""

    id: str
    model: LlamaModel
    template: ChatTemplate
    engine: Engine
    scheduler: Scheduler
    window: int
    fingerprint: int
    kernels: str = "exact"  # the llama.cpp build its engine runs on: "fast" or "exact"
    flash_attention: bool = False  # whether its attention runs on llama.cpp's flash kernels
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # for requests that name none
    max_tokens: int | None = None  # a request's cap when it names none; None fills the window
    pins: PromptPins | None = None  # prefixes that prompt-cache marks keep cached
    last_used: float = field(default_factory=time.monotonic)

    @property
    def worker_pid(self) -> int | None:
        return self.engine.pid if isinstance(self.engine, WorkerEngine) else None

    def close(self) -> None:
        self.scheduler.stop()
        self.engine.close()


def fingerprint(model: LlamaModel, template: ChatTemplate) -> int:
    """What generated a session's tokens: the model file and its template."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(str(model.name).encode())
    digest.update(str(model.size).encode())
    digest.update(template.source.encode())
    return int.from_bytes(digest.digest(), "little")


GGUF_SAMPLING = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repeat_penalty": "general.sampling.penalty_repeat",
}


def model_sampling(metadata: dict[str, str]) -> SamplingDefaults:
    """The sampling a GGUF's author recommends (`general.sampling.*`), where it says."""
    values: dict[str, float] = {}
    for name, key in GGUF_SAMPLING.items():
        raw = metadata.get(key)
        if raw is None:
            continue
        try:
            values[name] = float(raw)
        except ValueError:
            log.warning("%s is %r in the GGUF, not a number; ignored", key, raw)
    top_k = values.pop("top_k", None)
    return SamplingDefaults(**values, top_k=None if top_k is None else int(top_k))


def chat_template(model: LlamaModel, config: ServeConfig | None = None) -> ChatTemplate:
    """The model's chat template (or `--chat-template`'s) with its tool-call dialect (or `--tool-call-parser`'s)."""
    source = model.chat_template
    if config is not None and config.chat_template is not None:
        try:
            source = config.chat_template.read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {config.chat_template}: {e.strerror or e}") from None
    elif source is None:
        log.warning("%s carries no chat template; using ChatML", model.path.name)
    parser = config.tool_call_parser if config is not None else None
    template = ChatTemplate(
        source or CHATML,
        model.tokenize,
        bos_text=model.token_text(model.bos) if model.bos >= 0 else "",
        eos_text=model.token_text(model.eos) if model.eos >= 0 else "",
        bos_token=model.bos if model.add_bos and model.bos >= 0 else None,
        dialect=named(parser) if parser else None,
    )
    log.info("%s: tool calls and reasoning in the %s dialect", model.path.name, template.dialect.name)
    return template


NO_FAST_BUILD = (
    "llama.cpp's own build is not installed (`make serve` builds it into .venv/llama-fast, or point "
    "$SUPERFLUID_FAST_LIB at a directory with its libllama.so): running on the exact build, which prefills slower"
)


def kernels_for(config: ServeConfig) -> tuple[str, dict[str, str] | None]:
    """The kernels a model runs on ("exact" or "fast") and what a worker's environment needs for them; the
    log says why where that is not what was asked. Exact, unless `--kernels fast` asks otherwise: on the
    fast build in a worker (which refuses to start on a library that cannot keep the promise), else on
    llama-cpp-python's own library. Where that library cannot, an explicit `--kernels exact` is refused with
    the reason and the fix (`exact_refusal`), and the default falls back to fast."""
    library = fast_library() if config.worker_process else None
    refusal = exact_refusal()  # why llama-cpp-python's own library cannot be exact; None where it can
    if config.kernels != "fast":
        if library is not None and fast_build_exact():
            return "exact", worker_environment(library, exact=True)
        if refusal is None:
            if not config.worker_process:
                return "exact", None
            if library is None:
                log.warning(NO_FAST_BUILD)
            else:
                log.info(
                    "exact kernels run on llama-cpp-python's library here: our patches hold the fast build's "
                    f"kernels to one order on x86 and arm64, and this is {platform.machine()}"
                )
            return "exact", worker_environment(None, exact=True)
        if config.kernels == "exact":
            raise ModelError(refusal)
        log.warning("serving --kernels fast: %s", refusal)
    # llama-cpp-python's own library: the exact build `make` compiles, or, after a plain
    # `pip install`, llama.cpp as it builds itself
    own = "fast" if refusal else "exact"
    if not config.worker_process:
        log.warning(
            "--no-worker-process runs llama.cpp in the daemon, on llama-cpp-python's library (%s kernels); "
            "--kernels fast needs workers",
            own,
        )
        return own, None
    if library is not None:
        return "fast", worker_environment(library, exact=False)
    if own == "fast":
        log.info(
            "no separate fast build is installed: running on llama-cpp-python's, which is llama.cpp's own%s",
            " (its AMX kernels left off)" if amx_compiled() else "",
        )
        return "fast", worker_environment(None, exact=False)
    log.warning(NO_FAST_BUILD)
    return "exact", worker_environment(None, exact=True)


def open_park(config: ServeConfig, identity: bytes) -> Park | None:
    """The park of one model's context, as `--park` asks (by default where the disk suits it)."""
    if config.park is False:
        return None
    shared = config.park_dir is not None
    directory = (config.park_dir or config.sessions / "park") / identity.hex()
    budget = int(config.park_budget_gb * (1 << 30))
    if config.park is None:
        budget, why = default_budget(directory, budget)
        if not budget:
            log.warning("KV states are not parked on disk: %s", why)
            return None
        log.info("KV states are parked in %s, %s", directory, why)
    return Park(directory, identity, budget, shared=shared)


def open_runtime(model_id: str, path: Path, config: ServeConfig, spawned: Callable[[], None] = lambda: None) -> Runtime:
    """Load a model: its vocabulary here, its weights in a worker (or here, without one); `spawned` is called
    once the worker is on its way."""
    kernels, environment = kernels_for(config)
    placement = Placement(config.gpu_layers, config.gpus, config.tensor_split)
    model = LlamaModel(path, vocab_only=config.worker_process, placement=placement, exact=kernels == "exact")
    if config.fim_tokens is not None:
        model.set_fim(*config.fim_tokens)
    trained = model.n_ctx_train or 8192
    window = config.max_context or min(trained, 8192)
    if window > trained:
        log.warning("--max-context %d is beyond the %d tokens %s was trained on", window, trained, model_id)
    loaded = (environment or {}).get(LIBRARY_ENV)
    flash = flash_attention_on(Path(loaded) if loaded else None)
    shape = ContextShape(window, min(config.max_batch + SPARE_SLOTS, 256), BATCH_TOKENS, config.threads, flash)
    worker = None
    if config.worker_process:
        # a worker learns where the weights go from its environment (placement.py)
        environment = {**(environment or {}), **placement.environment()}
        worker = WorkerEngine(path, shape, model.end_of_generation, environment=environment)
    try:
        if worker is not None:
            # it loads the weights while the template and the token tables are made here: the embedded model's
            # worker takes half a second to serve, and this a quarter of one
            worker.spawn()
            spawned()
        template = chat_template(model, config)
        model.pieces, model.special_pieces  # noqa: B018  # made now rather than in the first reply
        if worker is not None:
            worker.wait_ready()
    except BaseException:
        if worker is not None:
            worker.close()  # its process and its shared memory go with it
        raise
    engine: Engine = worker if worker is not None else LocalEngine(LlamaContext(model, shape, Interrupt()))
    # a state is computed by one library: the fast build's and the wheel's exact kernels round differently
    # (the fast build's directory is named after its version, patches and CPU: resolved, it names its contents)
    library = str(Path(loaded).resolve()) if loaded else "llama-cpp-python"
    park = open_park(config, park_fingerprint(model.name, model.size, window, kernels, library, shape.flash_attention))
    scheduler = Scheduler(
        engine,
        lanes=config.max_batch,
        window=window,
        tick_ms=config.tick_ms,
        host_cache_bytes=config.host_cache_mb << 20,
        class_lanes=config.class_lanes,
        park=park,
        speculation=SpecSettings(
            config.speculate,
            config.spec_draft_tokens,
            config.spec_adaptive,
            config.spec_min_speedup,
            kernels == "exact",
        ),
    )
    if isinstance(engine, WorkerEngine):
        engine.on_death = scheduler.worker_died
    return Runtime(
        model_id,
        model,
        template,
        engine,
        scheduler,
        window,
        fingerprint(model, template),
        kernels,
        shape.flash_attention,
        sampling=config.sampling.over(model_sampling(model.metadata)),
        max_tokens=config.max_tokens,
        pins=PromptPins(scheduler, shape.pool_tokens * config.pin_budget_pct // 100),
    )


@dataclass
class Known:
    """A model the daemon knows: where it is, and its runtime while loaded."""

    path: Path
    runtime: Runtime | None = None
    # held while this model loads or unloads (seconds), so that other models are served meanwhile
    loading: threading.Lock = field(default_factory=threading.Lock)


class Models:
    """Every model the daemon knows, the loaded ones with their runtimes; the first is the default."""

    def __init__(self, config: ServeConfig, on_load: Callable[[Runtime], None] = lambda runtime: None) -> None:
        self.config = config
        self.on_load = on_load  # the daemon wires a new runtime's scheduler to its commits
        self.on_spawn: Callable[[], None] = lambda: None  # a model's worker was spawned: its weights load meanwhile
        self.known: dict[str, Known] = {}
        self.default_id = ""
        self._lock = threading.RLock()

    def add(self, ref: str | None) -> str:
        """Know a model by reference (a path, a hub id, or None for the embedded one); its id."""
        try:
            resolved = resolve_model(ref, offline=self.config.offline)
        except ModelNotFound as e:
            raise ModelError(str(e), 404) from None
        with self._lock:
            for model_id, known in self.known.items():
                if known.path == resolved.path:
                    return model_id
            model_id = resolved.name if resolved.name not in self.known else f"{resolved.name}-{resolved.path.stem}"
            self.known[model_id] = Known(resolved.path)
            if not self.default_id:
                self.default_id = model_id
            return model_id

    def find(self, name: str | None) -> str | None:
        """The id a request's `model` names: an id, a file name or path, either without its case or a
        `:latest` tag, a hub id with its quantisation (`hf.co/org/repo:Q4_K_M`), or the start of exactly
        one id (`smollm2` for `SmolLM2-135M-Instruct`)."""
        if not name:
            return self.default_id
        with self._lock:
            if name in self.known:
                return name
            wanted = hub_ref(name).lower().removesuffix(":latest")
            repo, _, quant = wanted.partition(":")
            for model_id, known in self.known.items():
                if wanted in (model_id.lower(), known.path.stem.lower(), known.path.name.lower(), str(known.path)):
                    return model_id
                if quant and repo == model_id.lower() and quant == quant_in_name(known.path.name).lower():
                    return model_id  # the hub's `org/repo:QUANT`, as Ollama's clients name a pulled model
            starting = [model_id for model_id in self.known if model_id.lower().startswith(wanted)]
        return starting[0] if len(starting) == 1 else None

    def runtime(self, model_id: str) -> Runtime:
        """The model's runtime, loading it first if it is not loaded."""
        with self._lock:
            known = self._known(model_id)
            runtime = known.runtime
        if runtime is None:
            with known.loading:
                if known.runtime is None:
                    self._load(model_id, known)
                runtime = known.runtime
        assert runtime is not None
        runtime.last_used = time.monotonic()
        return runtime

    def default(self) -> Runtime:
        return self.runtime(self.default_id)

    def _known(self, model_id: str) -> Known:
        known = self.known.get(model_id)
        if known is None:
            raise ModelError(f"model {model_id!r} is not known here; known: {', '.join(self.known)}", 404)
        return known

    def _load(self, model_id: str, known: Known) -> None:
        started = time.monotonic()
        try:
            runtime = open_runtime(model_id, known.path, self.config, self.on_spawn)
        except EngineError as e:
            raise ModelError(f"{known.path} does not load: {e}", 422) from None
        known.runtime = runtime
        self.on_load(runtime)
        runtime.scheduler.start()
        log.info("loaded %s in %.1f s", model_id, time.monotonic() - started)

    def unload(self, model_id: str) -> None:
        """Stop a model's worker and free its memory (it loads again on demand); a daemon that knows
        only this model keeps it, since it would be left serving nothing."""
        with self._lock:
            known = self._known(model_id)
        with known.loading:
            with self._lock:
                if known.runtime is None:
                    return
                if len(self.known) == 1:
                    raise ModelError(f"{model_id} is the only model served here; add another before unloading it")
                runtime, known.runtime = known.runtime, None
            runtime.close()
        log.info("unloaded %s", model_id)

    def forget(self, model_id: str) -> None:
        """Unload a model if it is loaded, and forget it; the default model cannot be forgotten."""
        if model_id == self.default_id:
            raise ModelError(f"{model_id} is the default model; it cannot be forgotten")
        self.unload(model_id)
        with self._lock:
            self.known.pop(model_id, None)

    def loaded(self) -> list[Runtime]:
        with self._lock:
            return [k.runtime for k in self.known.values() if k.runtime is not None]

    def unload_idle(self, idle_s: float) -> None:
        """Unload every model but the default one that has not served a request for `idle_s` seconds."""
        now = time.monotonic()
        for runtime in self.loaded():
            busy = runtime.scheduler.lanes or runtime.scheduler.queued()
            if runtime.id != self.default_id and not busy and now - runtime.last_used > idle_s:
                self.unload(runtime.id)

    def close(self) -> None:
        for runtime in self.loaded():
            runtime.close()
