"""The daemon's side of a worker: an `Engine` whose llama.cpp runs in another process.

`WorkerEngine` starts `superfluid-worker-llamacpp` on a socket pair, in the daemon's
process group, with the daemon's environment minus anything that looks like a credential.
Every engine call is one frame out and one back, one call at a time (embeddings come from
other threads than the scheduler's). When the worker dies, the call in flight raises
`WorkerGone` (the channel reads end of file), and a watcher thread notices a death between
calls at once; `restart` starts another worker, waiting longer each time one dies soon
after the last.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from . import wire
from .grammar import GrammarError
from .interface import ContextShape, DeviceReport, EngineError, KVFull, Step, StepInterrupted, WorkerGone
from .interrupt import Interrupt
from .shaping import Shaping

log = logging.getLogger("superfluid.engine")

COMMAND = "superfluid-worker-llamacpp"
READY_TIMEOUT_S = 600.0
# environment variables a worker does not get: it runs a model file, it needs no secrets
_SECRET = re.compile(r"(_TOKEN$|_API_KEY$|KEY|PASSWORD|SECRET)", re.IGNORECASE)


class WorkerFailed(EngineError):
    """A worker could not start: the text is its reason (llama.cpp's, for a model that does not load)."""


def worker_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _SECRET.search(k)}


def _command() -> list[str]:
    beside = Path(sys.executable).parent / COMMAND
    found = str(beside) if beside.exists() else shutil.which(COMMAND)
    return [found] if found else [sys.executable, "-m", "superfluid.engine.worker"]


def describe_exit(status: int | None) -> str:
    if status is None:
        return "it closed its channel"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


class WorkerEngine:
    """A llama.cpp context in a worker process, driven over its channel."""

    def __init__(
        self,
        model_path: Path,
        shape: ContextShape,
        end_of_generation: np.ndarray,
        *,
        environment: Mapping[str, str] | None = None,
        on_death: Callable[[], None] = lambda: None,
    ) -> None:
        self.model_path = model_path
        self.environment = dict(environment or {})  # set in the worker's environment, over the daemon's
        self.shape = shape
        self.end_of_generation = end_of_generation
        self.on_death = on_death
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        self._starting: tuple[subprocess.Popen[bytes], socket.socket] | None = None  # spawned, not yet ready
        self._copying = False
        self._deaths: list[float] = []  # deaths of workers that never finished a step
        self._served = False
        self._stopping = False
        self._abandoned = threading.Event()  # a restart waiting out its backoff gives up when this is set
        # the scheduler's thread makes most calls, HTTP routes' threads embed: one call on the channel at a
        # time (a KV state's trip through the shared region holds it around its call)
        self._calling = threading.RLock()
        self._shared = wire.SharedRegion()  # kept across workers: each new one maps the same file
        self.interrupt = Interrupt()  # the same
        # a step's time in all, and its time inside the worker: the difference is the channel's cost
        self.step_seconds = 0.0
        self.worker_seconds = 0.0
        self.started_report: DeviceReport = {"devices": [], "gpus": [], "gpu_layers": 0, "layers": 0}  # at its start

    # ---- lifecycle ----

    def start(self) -> None:
        """Start a worker and wait until its model is loaded; WorkerFailed with its reason otherwise."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start a worker without waiting for it: its imports and model load (half a second for the embedded
        model) go on beside whatever the caller does until `wait_ready`."""
        ours, theirs = socket.socketpair()
        command = [*_command(), "--fd", str(theirs.fileno()), "--model", str(self.model_path)]
        command += ["--shared-fd", str(self._shared.fd), "--interrupt-fd", str(self.interrupt.fd)]
        command += ["--window", str(self.shape.window), "--sequences", str(self.shape.sequences)]
        command += ["--batch", str(self.shape.batch), "--threads", str(self.shape.threads)]
        command += ["--flash-attention"] if self.shape.flash_attention else []
        environment = {**worker_environment(), **self.environment}
        try:
            proc = subprocess.Popen(
                command, pass_fds=(theirs.fileno(), self._shared.fd, self.interrupt.fd), env=environment
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._starting = (proc, ours)

    def wait_ready(self) -> None:
        """Wait until the worker `spawn` started has loaded its model; WorkerFailed with its reason otherwise."""
        assert self._starting is not None, "wait_ready before spawn"
        (proc, ours), self._starting = self._starting, None
        ours.settimeout(READY_TIMEOUT_S)
        try:
            kind, payload = wire.receive(ours)
        except (wire.ChannelClosed, TimeoutError) as e:
            proc.kill()
            ours.close()
            raise WorkerFailed(f"the llama.cpp worker did not start ({describe_exit(proc.wait())}): {e}") from None
        if kind != wire.READY:
            proc.wait()
            ours.close()
            raise WorkerFailed(bytes(payload).decode("utf-8", "replace"))
        ours.settimeout(None)
        self.started_report = json.loads(bytes(payload))
        self._proc, self._channel, self.pid, self._copying, self._served = proc, ours, proc.pid, False, False
        threading.Thread(target=self._watch, args=(proc,), name="superfluid-worker-watch", daemon=True).start()

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        status = proc.wait()
        if not self._stopping and proc is self._proc:
            log.error("the llama.cpp worker (pid %d) died: %s", proc.pid, describe_exit(status))
            self.on_death()

    def restart(self) -> None:
        """Start a new worker after one died.

        A worker that had served steps comes back at once: whatever killed it (the OOM killer, a
        crash on one request, whose job has failed) is gone. Workers that die before their first
        step are a loop, and each waits longer than the last.
        """
        if self._channel is not None:
            self._channel.close()
        now = time.monotonic()
        self._deaths = [] if self._served else [t for t in self._deaths if now - t < 60] + [now]
        self._served = False  # until the new worker serves a step: one that fails to start counts as a death
        delay = min(30.0, 0.25 * 2 ** (len(self._deaths) - 1)) if len(self._deaths) > 1 else 0.0
        if delay:
            log.warning("workers keep dying (%d in a minute): waiting %.1f s before the next", len(self._deaths), delay)
        if self._abandoned.wait(delay):
            log.info("no new worker for %s: its model is being unloaded", self.model_path.name)
            return
        self.start()
        log.info("a new llama.cpp worker (pid %d) serves %s", self.pid, self.model_path.name)

    @property
    def serving(self) -> bool:
        """True while a worker is up: started and not seen dead."""
        return self._proc is not None and self._proc.poll() is None

    def abandon_restart(self) -> None:
        """A restart in progress starts no worker: its model is being unloaded."""
        self._abandoned.set()

    def close(self) -> None:
        """Stop the worker: it reads the end of its channel and exits."""
        self._stopping = True
        if self._starting is not None:  # spawned, and the load failed before it was waited for
            (proc, ours), self._starting = self._starting, None
            ours.close()
            proc.kill()
            proc.wait()
        if self._channel is not None:
            self._channel.close()  # the worker reads end of file and exits
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._shared.close()
        self.interrupt.close()

    def exit_description(self) -> str:
        status = None
        if self._proc is not None:
            try:
                status = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
        return describe_exit(status)

    # ---- calls ----

    def _call(self, kind: int, payload: bytes = b"", step: Step | None = None) -> memoryview:
        """One call's reply payload; a `step`'s DRAWN frames before it go to its `on_decode`."""
        if self._channel is None:
            raise WorkerGone("no llama.cpp worker is running")
        try:
            with self._calling:
                wire.send(self._channel, kind, payload)
                reply, body = wire.receive(self._channel)
                while reply == wire.DRAWN and step is not None:
                    if step.on_decode is not None:
                        try:
                            step.on_decode(wire.decode_tokens(body, len(step.draws))[0])
                        except Exception:  # showing tokens early is a courtesy: the reply must still be read
                            log.exception("showing a run's tokens before its step ended failed")
                    reply, body = wire.receive(self._channel)
        except (wire.ChannelClosed, OSError):
            raise WorkerGone(f"the model's worker stopped ({self.exit_description()})") from None
        if reply == wire.OK:
            return body
        message = bytes(body).decode("utf-8", "replace")
        if reply == wire.KV_FULL:
            raise KVFull(message)
        if reply == wire.INTERRUPTED:
            raise StepInterrupted(message)
        if kind == wire.OPEN_GRAMMAR:
            raise GrammarError(message)
        raise EngineError(message)

    @property
    def copy_pending(self) -> bool:
        return self._copying

    def device_report(self) -> DeviceReport:
        """The worker's device report (`LlamaModel.device_report`): asked anew where the model's layers
        are on GPUs, whose free memory moves; as it started otherwise (a CPU build), or once it is gone."""
        if not self.started_report["gpus"] or not self.serving:
            return self.started_report
        try:
            report: DeviceReport = json.loads(bytes(self._call(wire.DEVICES)))
            return report
        except EngineError:
            return self.started_report

    def step(self, step: Step) -> list[list[int]]:
        started = time.perf_counter()
        try:
            reply = self._call(wire.STEP, wire.encode_step(step), step)
        except (KVFull, StepInterrupted):
            self._copying = False  # the decode ran its pending copies before it looked for room
            raise
        self._copying, self._served = False, True
        step.first_decode_s, inside = struct.unpack_from("<dd", reply, len(reply) - 16)
        self.step_seconds += time.perf_counter() - started
        self.worker_seconds += inside
        return wire.decode_drawn(reply[:-16], step)

    def copy(self, source: int, target: int, length: int) -> None:
        (pending,) = wire.read_ints(self._call(wire.COPY, wire.ints(source, target, length)), 1)
        self._copying = bool(pending)

    def truncate(self, seq: int, length: int) -> None:
        self._call(wire.TRUNCATE, wire.ints(seq, length))

    def export(self, seq: int) -> bytes:
        with self._calling:
            (size,) = wire.read_ints(self._call(wire.EXPORT, wire.ints(seq)), 1)
            try:
                return bytes(self._shared.view(size))  # the host tier's copy: it outlives the worker
            except OSError as e:
                raise EngineError(f"a KV state of {size} bytes could not be read from shared memory: {e}") from None
            finally:
                self._shared.release()

    def restore(self, seq: int, data: bytes) -> None:
        with self._calling:
            try:
                self._shared.view(len(data))[:] = data
            except OSError as e:
                raise EngineError(f"no shared memory for a KV state of {len(data)} bytes: {e}") from None
            try:
                self._call(wire.RESTORE, wire.ints(seq, len(data)))
            finally:
                self._shared.release()

    def open_grammar(self, gbnf: str) -> int:
        (handle,) = wire.read_ints(self._call(wire.OPEN_GRAMMAR, gbnf.encode("utf-8")), 1)
        return handle

    def close_grammar(self, handle: int) -> None:
        self._call(wire.CLOSE_GRAMMAR, wire.ints(handle))

    def embed(self, tokens: list[int]) -> np.ndarray:
        reply = self._call(wire.EMBED, np.asarray(tokens, dtype="<i4").tobytes())
        return np.frombuffer(reply, dtype="<f4").copy()

    def open_shaping(self, shaping: Shaping, recent: list[int]) -> int:
        (handle,) = wire.read_ints(self._call(wire.OPEN_SHAPING, wire.encode_shaping(shaping, recent)), 1)
        return handle

    def close_shaping(self, handle: int) -> None:
        self._call(wire.CLOSE_SHAPING, wire.ints(handle))

    def open_drafter(self, stream: list[int]) -> int:
        (handle,) = wire.read_ints(self._call(wire.OPEN_DRAFTER, np.asarray(stream, dtype="<i4").tobytes()), 1)
        return handle

    def close_drafter(self, handle: int) -> None:
        self._call(wire.CLOSE_DRAFTER, wire.ints(handle))
