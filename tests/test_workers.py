"""llama.cpp in worker processes: a crash there is not the daemon's; several models, loaded and unloaded."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import HttpDaemon, chat_body, children, forced, generated_tokens, new_session, say

from superfluid.model.resolve import embedded_model
from superfluid.protocol.schema import FINISH_ERROR, EventBody, Request, Response

pytestmark = pytest.mark.e2e

STORY = "Write a long story about a lighthouse keeper and the sea."
WORKER = "superfluid-worker-llamacpp"


def workers_of(daemon: HttpDaemon) -> list[int]:
    """Pids of the daemon's worker processes."""
    found = subprocess.run(["pgrep", "-f", WORKER], capture_output=True, text=True).stdout.split()
    assert daemon.proc is not None
    return [int(pid) for pid in found if os.getpgid(int(pid)) == os.getpgid(daemon.proc.pid)]


def wait_for_worker(daemon: HttpDaemon, not_pid: int | None = None, timeout: float = 60) -> int:
    """The pid of the default model's worker once it serves (its model loaded), other than `not_pid`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = httpx.get(f"{daemon.url}/v1/models").json()["data"]
        pid = next(m["runtime"]["worker_pid"] for m in models if m["default"])
        if pid is not None and pid != not_pid and pid in workers_of(daemon):
            return pid
        time.sleep(0.05)
    raise AssertionError("no worker came up")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[HttpDaemon]:
    env_secret = {"SUPERFLUID_TEST_API_KEY": "hush", "MY_TOKEN": "hush", "DB_PASSWORD": "hush"}
    os.environ.update(env_secret)
    try:
        proc = HttpDaemon(tmp_path, max_context=2048, max_batch=8).start()
    finally:
        for key in env_secret:
            os.environ.pop(key)
    yield proc
    proc.stop()


def test_the_engine_runs_in_a_worker_without_credentials(daemon: HttpDaemon) -> None:
    (pid,) = workers_of(daemon)
    environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    names = {entry.split(b"=", 1)[0].decode() for entry in environment if entry}
    assert "PATH" in names and not names & {"SUPERFLUID_TEST_API_KEY", "MY_TOKEN", "DB_PASSWORD"}
    models = httpx.get(f"{daemon.url}/v1/models").json()["data"]
    assert models[0]["loaded"] and models[0]["runtime"]["worker_pid"] == pid


def test_sigkill_of_the_worker_twenty_times_loses_nothing(daemon: HttpDaemon) -> None:
    rng = random.Random(12)
    daemon_pid = daemon.proc.pid if daemon.proc else 0
    # the uncut replies, before any kill
    with daemon.client() as c:
        sessions = [new_session(c) for _ in range(4)]
        for i, session in enumerate(sessions):
            say(c, session, f"{STORY} Chapter {i}.")
        reference_session = new_session(c)
        say(c, reference_session, f"{STORY} Chapter 0.")
        uncut = generated_tokens(forced(c, reference_session, 120)[0])
    http_prompt = "Describe a harbour at dawn."
    http_reference = httpx.post(
        f"{daemon.url}/v1/chat/completions", json=chat_body(http_prompt, 48, False), timeout=120
    ).json()["choices"][0]["message"]["content"]

    seen: dict[int, dict[int, object]] = {s: {} for s in sessions}
    endings: list[object] = []
    stop = threading.Event()

    def socket_load(session: int) -> None:
        with daemon.client() as own:
            while not stop.is_set():
                own.send(Request.Generate(session, 64, True))
                while True:
                    reply = own.receive()
                    if isinstance(reply, Response.Delta):
                        seen[session][reply.event.event_id] = reply.event
                    else:
                        endings.append(reply)
                        break

    def http_load() -> None:
        while not stop.is_set():
            with httpx.stream(
                "POST", f"{daemon.url}/v1/chat/completions", json=chat_body(http_prompt, 400, True), timeout=120
            ) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2][len("data: ") :])
            endings.append("http error" if "error" in last else last["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=socket_load, args=(s,)) for s in sessions]
    threads += [threading.Thread(target=http_load) for _ in range(2)]
    for thread in threads:
        thread.start()
    pid = wait_for_worker(daemon)
    for _ in range(20):
        time.sleep(rng.uniform(0.3, 1.5))
        os.kill(pid, signal.SIGKILL)
        pid = wait_for_worker(daemon, not_pid=pid)
    stop.set()
    for thread in threads:
        thread.join(180)
    assert daemon.proc is not None and daemon.proc.pid == daemon_pid and daemon.alive(), "the daemon never died"
    cut = [e for e in endings if isinstance(e, Response.Generated) and e.finish == FINISH_ERROR]
    assert cut and "http error" in endings, "some generations were cut, and they ended typed"
    assert all(isinstance(e, (Response.Generated, str)) for e in endings), endings
    assert daemon.metric("superfluid_worker_respawns_total") == 20
    with daemon.client() as c:
        for session in sessions:
            events = {e.event_id: e for e in c.call(Request.Read(session, 0)).events}
            assert all(events[i] == event for i, event in seen[session].items()), "every event seen is there"
            forced(c, session, 4)  # every session continues
        replay = new_session(c)
        say(c, replay, f"{STORY} Chapter 0.")
        c.send(Request.Generate(replay, 120, True))
        deltas = 0
        while deltas < 10:  # some of the reply is out, and committed
            reply = c.receive()
            assert isinstance(reply, Response.Delta), reply
            deltas += 1
        killed = wait_for_worker(daemon)
        os.kill(killed, signal.SIGKILL)  # cut mid-reply: the next Generate continues it
        while isinstance(reply, Response.Delta):
            reply = c.receive()
        assert isinstance(reply, Response.Generated) and reply.finish == FINISH_ERROR, reply
        wait_for_worker(daemon, not_pid=killed)
        so_far = generated_tokens(
            [e for e in c.call(Request.Read(replay, 0)).events if isinstance(e.body, EventBody.Generated)]
        )
        rest = generated_tokens(forced(c, replay, 120 - len(so_far))[0])
        assert so_far + rest == uncut, "a greedy run cut by a worker crash continues as the uncut one"
    again = httpx.post(f"{daemon.url}/v1/chat/completions", json=chat_body(http_prompt, 48, False), timeout=120)
    assert again.json()["choices"][0]["message"]["content"] == http_reference, "the same request, the same text"


def test_workers_that_die_before_serving_come_back_ever_more_slowly(daemon: HttpDaemon) -> None:
    pid = wait_for_worker(daemon)
    deadline = time.monotonic() + 60
    while "this machine prefills" not in daemon.log.read_text():  # the first worker has served a step
        assert time.monotonic() < deadline, "the park's rates were never measured"
        time.sleep(0.05)
    started = time.monotonic()
    for _ in range(4):  # the first had served: its death costs nothing; the next three die unserved
        os.kill(pid, signal.SIGKILL)
        pid = wait_for_worker(daemon, not_pid=pid)
    assert time.monotonic() - started >= 0.5 + 1.0, "the third and fourth restarts waited 0.5 s and 1 s"
    log = daemon.log.read_text()
    assert "keep dying (2 in a minute): waiting 0.5 s" in log and "keep dying (3 in a minute): waiting 1.0 s" in log
    answers_a_session(daemon, 4)


def test_a_non_streaming_request_cut_by_a_crash_is_a_server_error(daemon: HttpDaemon) -> None:
    answer: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: answer.append(
            httpx.post(f"{daemon.url}/v1/chat/completions", json=chat_body(STORY, 600, False), timeout=120)
        )
    )
    pid = wait_for_worker(daemon)
    request.start()
    while daemon.metric("superfluid_lanes_active") < 1:
        time.sleep(0.02)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    request.join(60)
    assert answer[0].status_code >= 500 and "worker" in answer[0].json()["error"]["message"]


def truncated_model(root: Path) -> Path:
    source = embedded_model().path
    broken = root / "truncated.gguf"
    with open(source, "rb") as f:
        broken.write_bytes(f.read(source.stat().st_size // 3))
    return broken


def test_a_model_that_does_not_load_is_a_clear_error(tmp_path: Path) -> None:
    broken = truncated_model(tmp_path)
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "superfluid",
            "serve",
            "--sessions",
            str(tmp_path / "s"),
            "--socket",
            str(tmp_path / "s.sock"),
            "--no-http",
            "--model",
            str(broken),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 1
    assert str(broken) in started.stderr and "does not load" in started.stderr, started.stderr


def test_a_template_that_does_not_load_takes_the_worker_started_beside_it(tmp_path: Path) -> None:
    # the worker loads the weights while the daemon reads the template: a load that fails there stops it too
    from superfluid.config import ServeConfig
    from superfluid.core.runtime import open_runtime

    missing = tmp_path / "missing.jinja"
    config = ServeConfig(sessions=tmp_path / "s", chat_template=missing, max_context=512, max_batch=1, threads=2)
    before = set(children(os.getpid()))
    with pytest.raises(ValueError, match=r"--chat-template .*missing\.jinja"):
        open_runtime("embedded", embedded_model().path, config)
    assert set(children(os.getpid())) == before, "a worker outlived the load it was started for"


def two_models(tmp_path: Path, *extra: str, **sizes: int) -> HttpDaemon:
    """A daemon serving the embedded model (the default) and a copy of it named `second`."""
    other = tmp_path / "models" / "second.gguf"
    other.parent.mkdir()
    shutil.copyfile(embedded_model().path, other)
    first = str(embedded_model().path)
    return HttpDaemon(tmp_path, "--model", first, "--model", str(other), *extra, **sizes).start()


def test_several_models_load_unload_and_forget(tmp_path: Path) -> None:
    proc = two_models(tmp_path, max_context=2048, max_batch=4)
    try:
        listed = {m["id"]: m for m in httpx.get(f"{proc.url}/v1/models").json()["data"]}
        assert len(listed) == 2 and all(m["loaded"] for m in listed.values())
        second = next(m for m in listed if listed[m]["default"] is False)
        assert len(workers_of(proc)) == 2
        unknown = httpx.post(f"{proc.url}/v1/chat/completions", json={**chat_body("Hi", 4, False), "model": "nope"})
        assert unknown.status_code == 404 and second in unknown.json()["error"]["message"]
        refused = httpx.post(f"{proc.url}/v1/models/load", json={"id": str(truncated_model(tmp_path))}, timeout=120)
        assert refused.status_code in (400, 422) and "does not load" in refused.json()["error"]["message"]

        streams: list[list[str]] = []

        def stream() -> None:
            body = {**chat_body(STORY, 800, True), "model": second}
            with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json=body, timeout=120) as r:
                streams.append([line for line in r.iter_lines() if line.startswith("data: ")])

        readers = [threading.Thread(target=stream) for _ in range(4)]
        for reader in readers:
            reader.start()
        while proc.metric("superfluid_lanes_active") < 4:
            time.sleep(0.02)
        unloaded = httpx.post(f"{proc.url}/v1/models/unload", json={"model": second}, timeout=60)
        assert unloaded.status_code == 200 and unloaded.json()["loaded"] is False
        for reader in readers:
            reader.join(60)
        assert len(streams) == 4 and all("error" in lines[-2] and lines[-1] == "data: [DONE]" for lines in streams)
        assert len(workers_of(proc)) == 1, "the unloaded model's worker exited"
        default = proc_default(proc)
        other = httpx.post(f"{proc.url}/v1/models/unload", json={"model": default}, timeout=60)
        assert other.status_code == 200, "a model may go while another named model is served"
        assert workers_of(proc) == [], "neither model is loaded now"
        again = httpx.post(
            f"{proc.url}/v1/chat/completions", json={**chat_body("Hi", 4, False), "model": second}, timeout=60
        )
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4, "it loads on demand"
        assert httpx.delete(f"{proc.url}/v1/models/{second}", timeout=60).json()["deleted"] is True
        assert [m["id"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"]] == [default]
        loaded = httpx.post(f"{proc.url}/v1/chat/completions", json=chat_body("Hi", 4, False), timeout=60)
        assert loaded.status_code == 200, "the default model loads on demand"
        only = httpx.post(f"{proc.url}/v1/models/unload", json={"model": default}, timeout=60)
        assert only.status_code == 400 and "only model" in only.json()["error"]["message"]
        answers_a_session(proc, 3)  # the session API runs on the default model throughout
    finally:
        proc.stop()


def answers_a_session(daemon: HttpDaemon, tokens: int) -> None:
    """A new session over the socket gets a forced reply of `tokens` tokens."""
    with daemon.client() as c:
        session = new_session(c)
        say(c, session, "Hello.")
        forced(c, session, tokens)


def proc_default(proc: HttpDaemon) -> str:
    return next(m["id"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"] if m["default"])


def test_without_a_worker_process_the_engine_runs_in_the_daemon(tmp_path: Path) -> None:
    proc = HttpDaemon(tmp_path, "--no-worker-process", max_context=1024, max_batch=2).start()
    try:
        assert workers_of(proc) == []
        answers_a_session(proc, 5)
    finally:
        proc.stop()


def test_the_socket_client_reports_a_cut_generation(daemon: HttpDaemon) -> None:
    with daemon.client() as c:
        session = new_session(c)
        say(c, session, STORY)
        c.send(Request.Generate(session, 1000, True))
        first = c.receive()
        assert isinstance(first, Response.Delta)
        os.kill(wait_for_worker(daemon), signal.SIGKILL)
        reply = first
        while isinstance(reply, Response.Delta):
            reply = c.receive()
        assert isinstance(reply, Response.Generated) and reply.finish == FINISH_ERROR


def test_idle_models_unload_and_ollama_keep_alive_loads_them(tmp_path: Path) -> None:
    proc = two_models(tmp_path, "--idle-timeout", "1")
    try:

        def loaded() -> dict[str, bool]:
            return {m["id"]: m["loaded"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"]}

        deadline = time.monotonic() + 30
        while loaded()["second"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loaded() == {proc_default(proc): True, "second": False}, "idle, it unloaded; the default never does"
        load = httpx.post(f"{proc.url}/api/generate", json={"model": "second", "keep_alive": -1}, timeout=60)
        assert load.json()["done_reason"] == "load" and loaded()["second"]
        unload = httpx.post(f"{proc.url}/api/generate", json={"model": "second", "keep_alive": 0}, timeout=60)
        assert unload.json()["done_reason"] == "unload" and not loaded()["second"]
    finally:
        proc.stop()


def test_the_default_model_answers_while_another_loads(tmp_path: Path) -> None:
    proc = two_models(tmp_path, max_context=4096, max_batch=8)
    try:
        second = next(m["id"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"] if not m["default"])
        assert httpx.post(f"{proc.url}/v1/models/unload", json={"model": second}, timeout=60).status_code == 200
        ended: dict[str, float] = {}

        def load() -> None:
            loaded = httpx.post(f"{proc.url}/v1/models/load", json={"model": second}, timeout=120)
            assert loaded.status_code == 200
            ended["load"] = time.monotonic()

        before = set(workers_of(proc))
        loader = threading.Thread(target=load)
        loader.start()
        while not (loading := set(workers_of(proc)) - before):  # its worker has started and is loading the model
            time.sleep(0.01)
        # held still, the load cannot finish on a fast machine before the session is answered
        (pid,) = loading
        os.kill(pid, signal.SIGSTOP)
        try:
            session = threading.Thread(
                target=lambda: (answers_a_session(proc, 3), ended.update(session=time.monotonic()))
            )
            session.start()
            session.join(60)
            assert "session" in ended, "a session on the default model waited for another model's load"
        finally:
            os.kill(pid, signal.SIGCONT)
        loader.join(120)
        assert "load" in ended, "the second model loaded"
        assert ended["session"] < ended["load"], "a session on the default model waited for another model's load"
    finally:
        proc.stop()


def test_unloading_a_model_whose_workers_keep_dying_starts_no_new_one(tmp_path: Path) -> None:
    proc = two_models(tmp_path, max_context=1024, max_batch=2)
    try:

        def second_worker(not_pid: int | None = None) -> int:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                models = httpx.get(f"{proc.url}/v1/models").json()["data"]
                pid = next(m["runtime"]["worker_pid"] for m in models if not m["default"])
                if pid is not None and pid != not_pid and pid in workers_of(proc):
                    return pid
                time.sleep(0.05)
            raise AssertionError("the second model's worker did not come up")

        second = next(m["id"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"] if not m["default"])
        pid = second_worker()
        deadline = time.monotonic() + 60
        while proc.log.read_text().count("this machine prefills") < 2:  # each model's first worker has served
            assert time.monotonic() < deadline, "the park's rates were never measured"
            time.sleep(0.05)
        for _ in range(6):  # the first had served; then five deaths before any step: the next waits 4 s
            os.kill(pid, signal.SIGKILL)
            pid = second_worker(not_pid=pid)
        os.kill(pid, signal.SIGKILL)  # the sixth unserved: its restart waits 8 s
        deadline = time.monotonic() + 30
        while "keep dying (6 in a minute)" not in proc.log.read_text():
            assert time.monotonic() < deadline, "six workers died unserved, and no restart waited"
            time.sleep(0.05)
        started = time.monotonic()
        unloaded = httpx.post(f"{proc.url}/v1/models/unload", json={"model": second}, timeout=60)
        assert unloaded.status_code == 200
        assert time.monotonic() - started < 4, "the unload waited for the restart's backoff"
        deadline = time.monotonic() + 10
        while "no new worker for second.gguf" not in proc.log.read_text():
            assert time.monotonic() < deadline, "the restart waiting out its backoff was not given up"
            time.sleep(0.05)
        assert len(workers_of(proc)) == 1, "a worker started for a model that was unloaded"
        answers_a_session(proc, 2)
    finally:
        proc.stop()


def test_a_workers_run_sends_each_decodes_tokens_before_its_reply_and_ends_where_cut() -> None:
    import numpy as np

    from superfluid.engine.interface import ContextShape, Draw, Step
    from superfluid.engine.llama import LlamaModel
    from superfluid.engine.worker_client import WorkerEngine
    from superfluid.protocol.schema import GenParams

    greedy = GenParams(0.0, 1.0, 0.0, 0, 0)
    path = embedded_model().path
    model = LlamaModel(path)
    worker = WorkerEngine(path, ContextShape(512, 2, 512, 2), model.end_of_generation)
    worker.start()
    try:
        prompt = model.tokenize(STORY, True)

        def run_of_eight(tokens: list[int], at: int) -> Step:
            """`tokens` from position `at`, then decodes to eight drawn (end of turn banned: all eight)."""
            want = np.zeros(len(tokens), dtype=np.int8)
            want[-1] = 1
            return Step(
                np.asarray(tokens, np.int32),
                np.arange(at, at + len(tokens), dtype=np.int32),
                np.zeros(len(tokens), np.int32),
                want,
                [Draw(greedy, at + len(tokens), True, run=8, limit=8)],
            )

        run = run_of_eight(prompt, 0)  # the prompt and seven decodes after it in one call
        shown: list[list[int]] = []
        run.on_decode = lambda drawn: shown.append(list(drawn[0]))
        (drawn,) = worker.step(run)
        at = len(prompt) + len(drawn) - 1  # the last drawn token is not in the KV yet
        worker.interrupt.cut()  # the worker reads it between decodes, through the shared memory
        cut = run_of_eight([drawn[-1]], at)
        (after_cut,) = worker.step(cut)
        worker.interrupt.clear()
        on = run_of_eight([after_cut[-1]], at + len(after_cut))
        (after_clear,) = worker.step(on)
    finally:
        worker.close()
    assert len(drawn) == 8 and run.decodes == 8
    assert shown == [drawn[:k] for k in range(1, 8)], "each decode's tokens but the last's came before the reply"
    assert len(after_cut) == 1 and cut.decodes == 1, "a cut run ends after its decode in flight"
    assert len(after_clear) == 8 and on.decodes == 8, "with the cut cleared, a run makes all its decodes"
