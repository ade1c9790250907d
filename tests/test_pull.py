"""`superfluid pull` and Ollama's `/api/pull`, against a fake hub on a loopback port (fake_hub.py).

What is checked is what a person sees: the file in the cache that `serve` and `models` read, the
progress on stderr, the exit status and its one line, and on disk: a cut download resumed with a
`Range` request, a damaged one removed, nothing fetched when the file is whole already.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from conftest import HttpDaemon, free_port
from fake_hub import COMMIT, FakeHub, blob_of, tiny_gguf

from superfluid.cli.main import main
from superfluid.cli.pull import pull_model
from superfluid.engine.llama import LlamaModel
from superfluid.model.resolve import resolve_model

REPO = "someone/tiny-GGUF"
OTHER = bytes(range(256)) * 4096  # 1 MiB that is no GGUF: enough for what only downloads
SPLIT = {"big/big-Q6_K-00001-of-00002.gguf": OTHER[:300_000], "big/big-Q6_K-00002-of-00002.gguf": OTHER[300_000:]}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path / "home"))
    for variable in ("HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    with FakeHub() as fake:
        fake.repos[REPO] = {"tiny-Q4_K_M.gguf": tiny_gguf(), "tiny-Q8_0.gguf": OTHER, "README.md": b"# tiny"}
        fake.repos["someone/split-GGUF"] = SPLIT
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def pull(capsys: pytest.CaptureFixture[str], model: str) -> tuple[int, str, str]:
    """`superfluid pull MODEL`: its exit status, stdout and stderr."""
    status = main(["pull", model])
    out, err = capsys.readouterr()
    return status, out, err


def partial_of(blob: Path) -> Path:
    return blob.with_name(blob.name + ".incomplete")


def test_a_pull_fills_the_cache_that_serve_and_models_read(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = pull(capsys, f"{REPO}:Q4_K_M")
    assert status == 0, err
    path = Path(out.strip())
    folder = tmp_path / "hub" / "models--someone--tiny-GGUF"
    blob = blob_of(tmp_path / "hub", REPO, tiny_gguf())
    assert path == folder / "snapshots" / COMMIT / "tiny-Q4_K_M.gguf"
    assert os.readlink(path) == f"../../blobs/{blob.name}" and path.read_bytes() == tiny_gguf()
    assert (folder / "refs" / "main").read_text() == COMMIT
    # off a terminal: plain lines, the last at 100%, with the rate and the time left
    assert "\r" not in err
    assert re.search(r"^tiny-Q4_K_M\.gguf  100%  1\.7/1\.7 MiB  [\d.]+ MiB/s  ETA 0:00$", err, re.MULTILINE), err
    assert err.splitlines()[-1].startswith(f"pulled {REPO}:Q4_K_M (2 MiB) in ")
    assert resolve_model(f"{REPO}:Q4_K_M", offline=True).path == path

    assert main(["models", "--http", f"127.0.0.1:{free_port()}"]) == 0
    listed = capsys.readouterr().out.splitlines()
    row = next(line.split() for line in listed if line.startswith(f"{REPO}:Q4_K_M "))
    metadata = LlamaModel(path, vocab_only=True).metadata
    assert row[1:] == ["2", "MiB", "Q4_K_M", metadata["llama.context_length"], "chatml"]

    asked = len(hub.ranges)
    status, out, err = pull(capsys, f"{REPO}:q4_k_m")
    assert status == 0 and Path(out.strip()) == path
    assert err == f"{REPO}:Q4_K_M is already complete (2 MiB): nothing to download\n"
    assert len(hub.ranges) == asked, "a whole file is not fetched again"


def test_on_a_terminal_the_line_is_redrawn_in_place(hub: FakeHub) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    hub.delay = 0.02  # 27 chunks over half a second: several redraws
    err = Terminal()
    assert pull_model(f"{REPO}:Q8_0", io.StringIO(), err) == 0
    drawn = err.getvalue()
    assert drawn.count("\r") >= 3 and drawn.count("\x1b[K") == drawn.count("\r")
    assert "\rtiny-Q8_0.gguf  100%  1.0/1.0 MiB  " in drawn and "\nverifying tiny-Q8_0.gguf (sha256)\n" in drawn


def test_a_cut_download_resumes_with_a_range_request(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    partial = partial_of(blob_of(tmp_path / "hub", REPO, tiny_gguf()))
    hub.cut_at = 700_000
    status, _, err = pull(capsys, f"{REPO}:Q4_K_M")
    assert status == 1
    assert "superfluid pull: the download of tiny-Q4_K_M.gguf was cut at 1 MiB of 2 MiB" in err
    assert err.strip().endswith("run the pull again to resume from there")
    assert partial.read_bytes() == tiny_gguf()[:700_000]

    hub.cut_at = None
    status, out, err = pull(capsys, f"{REPO}:Q4_K_M")
    assert status == 0, err
    assert "resuming tiny-Q4_K_M.gguf at 1 MiB" in err
    assert hub.ranges == [None, "bytes=700000-"]
    assert Path(out.strip()).read_bytes() == tiny_gguf() and not partial.exists()


def test_a_server_that_ignores_range_is_read_again_from_the_start(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.cut_at = 300_000
    assert pull(capsys, f"{REPO}:Q8_0")[0] == 1
    hub.cut_at, hub.ignore_range = None, True
    status, out, _ = pull(capsys, f"{REPO}:Q8_0")
    assert status == 0 and hub.ranges == [None, "bytes=300000-"]
    assert Path(out.strip()).read_bytes() == OTHER


def test_a_file_whose_hash_or_size_is_not_the_stated_one_is_refused_and_removed(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blob = tmp_path / "hub" / "models--someone--tiny-GGUF" / "blobs" / ("ab" * 32)
    hub.stated["tiny-Q8_0.gguf"] = (len(OTHER), "ab" * 32)
    status, _, err = pull(capsys, f"{REPO}:Q8_0")
    assert status == 1
    actual = hashlib.sha256(OTHER).hexdigest()
    assert f"its sha256 is {actual} where {'ab' * 32} was stated; it was removed" in err
    assert err.splitlines()[-1].startswith("superfluid pull: tiny-Q8_0.gguf from http")
    assert not blob.exists() and not partial_of(blob).exists()

    real = hashlib.sha256(OTHER).hexdigest()
    hub.stated["tiny-Q8_0.gguf"] = (len(OTHER) + 10, real)
    status, _, err = pull(capsys, f"{REPO}:Q8_0")
    assert status == 1
    assert f"its size is {len(OTHER)} bytes where {len(OTHER) + 10} were stated; it was removed" in err
    assert not partial_of(blob.with_name(real)).exists() and not blob.with_name(real).exists()


def test_what_is_not_there_is_named_with_what_is(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = pull(capsys, f"{REPO}:Q5_K_M")
    assert (status, err) == (1, f"superfluid pull: {REPO} has no Q5_K_M; it has: Q4_K_M (2 MiB), Q8_0 (1 MiB)\n")

    status, _, err = pull(capsys, REPO)
    assert status == 2
    assert err.splitlines() == [
        f"superfluid pull: {REPO} has 2 quantisations; name one:",
        f"  superfluid pull {REPO}:Q4_K_M         2 MiB",
        f"  superfluid pull {REPO}:Q8_0           1 MiB",
    ]

    status, _, err = pull(capsys, "someone/nothing-GGUF:Q4_K_M")
    assert status == 1
    assert err == (
        f"superfluid pull: someone/nothing-GGUF is not a repository on {hub.url} (404): check its name; a private "
        "one needs HF_TOKEN\n"
    )

    status, _, err = pull(capsys, "llama3")
    assert status == 1 and err.startswith("superfluid pull: llama3 names no Hugging Face repository")

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    status, _, err = pull(capsys, f"{REPO}:Q4_K_M")
    assert status == 1 and err.startswith("superfluid pull: cannot reach http://127.0.0.1:")
    assert err.count("\n") == 1 and "check the network, or set HF_ENDPOINT" in err


def test_a_file_larger_than_the_free_space_is_refused_before_any_byte(
    hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.stated["tiny-Q8_0.gguf"] = (1 << 60, "cd" * 32)
    status, _, err = pull(capsys, f"{REPO}:Q8_0")
    assert status == 1 and err.startswith(
        "superfluid pull: not enough disk space: tiny-Q8_0.gguf needs 1073741824.0 GiB"
    )
    assert hub.ranges == []


def test_a_url_a_repository_of_one_gguf_and_a_split_model(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{hub.url}/{REPO}/resolve/main/tiny-Q4_K_M.gguf"
    status, out, err = pull(capsys, url)
    path = tmp_path / "home" / "models" / "tiny-Q4_K_M.gguf"
    assert status == 0 and Path(out.strip()) == path and path.read_bytes() == tiny_gguf()
    assert "verifying tiny-Q4_K_M.gguf (sha256)" in err, "the hub's X-Linked-Etag is the hash checked"
    # (before the files below, which are no GGUF: `models` reads each file's metadata)
    assert main(["models", "--http", f"127.0.0.1:{free_port()}"]) == 0
    assert any(line.startswith(f"{path} ") for line in capsys.readouterr().out.splitlines())

    hub.repos["someone/one-GGUF"] = {"one-Q8_0.gguf": OTHER}
    status, out, _ = pull(capsys, "hf.co/someone/one-GGUF")  # the name the hub's Ollama snippet gives
    assert status == 0 and Path(out.strip()).read_bytes() == OTHER

    status, out, _ = pull(capsys, "someone/split-GGUF:Q6_K")
    first = Path(out.strip())
    assert status == 0 and first.name == "big-Q6_K-00001-of-00002.gguf"
    assert first.read_bytes() + first.with_name("big-Q6_K-00002-of-00002.gguf").read_bytes() == OTHER


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeHub, HttpDaemon, Path]]:
    """A daemon whose hub is a fake one, and that hub's cache."""
    root = tmp_path_factory.mktemp("pull")
    with FakeHub() as hub, pytest.MonkeyPatch.context() as env:
        hub.repos[REPO] = {"tiny-Q4_K_M.gguf": tiny_gguf(), "tiny-Q8_0.gguf": OTHER, "tiny-Q6_K.gguf": OTHER[::-1]}
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_HUB_CACHE", str(root / "hub"))
        env.delenv("HF_HUB_OFFLINE", raising=False)
        daemon = HttpDaemon(root, max_context=512, max_batch=1).start()
        try:
            yield hub, daemon, root / "hub"
        finally:
            daemon.stop()


@pytest.mark.e2e
def test_ollama_pull_streams_its_progress_and_the_model_is_listed(served: tuple[FakeHub, HttpDaemon, Path]) -> None:
    hub, daemon, cache = served
    client = ollama.Client(host=daemon.url)
    sha = hashlib.sha256(tiny_gguf()).hexdigest()
    steps = list(client.pull(f"hf.co/{REPO}:Q4_K_M", stream=True))
    statuses = [step.status for step in steps]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    pulling = steps[1:-3]
    assert pulling and {(s.status, s.digest, s.total) for s in pulling} == {
        (f"pulling {sha[:12]}", f"sha256:{sha}", len(tiny_gguf()))
    }
    assert pulling[-1].completed == len(tiny_gguf())
    assert blob_of(cache, REPO, tiny_gguf()).read_bytes() == tiny_gguf()
    assert REPO in [m.model for m in client.list().models]

    asked = len(hub.ranges)
    again = client.pull(f"{REPO}:Q4_K_M")  # unstreamed: the last status alone; whole already, so nothing fetched
    assert again.status == "success" and len(hub.ranges) == asked


@pytest.mark.e2e
def test_ollama_pull_refuses_what_cannot_be_pulled(served: tuple[FakeHub, HttpDaemon, Path]) -> None:
    _, daemon, _ = served
    client = ollama.Client(host=daemon.url)
    with pytest.raises(ollama.ResponseError, match="llama3 names no Hugging Face repository") as refused:
        client.pull("llama3")
    assert refused.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match=f"{REPO} has no Q5_K_M; it has: Q4_K_M") as refused:
        list(client.pull(f"{REPO}:Q5_K_M", stream=True))
    assert refused.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="someone/gone-GGUF is not a repository") as refused:
        client.pull("someone/gone-GGUF:Q8_0")
    assert refused.value.status_code == 404
    for manage in (lambda: client.delete("smollm2"), lambda: client.copy("a", "b")):
        with pytest.raises(ollama.ResponseError, match="not served by superfluid") as refused:
            manage()
        assert refused.value.status_code == 501


@pytest.mark.e2e
def test_a_client_that_leaves_mid_pull_leaves_a_partial_to_resume(served: tuple[FakeHub, HttpDaemon, Path]) -> None:
    hub, daemon, cache = served
    data = OTHER[::-1]
    partial = partial_of(blob_of(cache, REPO, data))
    hub.delay = 0.05  # 16 chunks of 64 KiB: most of a second
    try:
        body = {"model": f"{REPO}:Q6_K"}
        with httpx.stream("POST", f"{daemon.url}/api/pull", json=body, timeout=30) as reply:
            for line in reply.iter_lines():
                if '"completed"' in line and '"completed": 0' not in line:
                    break  # leave as bytes come
        sizes = [-1]
        while sizes[-1] != (size := partial.stat().st_size):  # until the daemon's thread has stopped writing
            sizes.append(size)
            time.sleep(0.5)
    finally:
        hub.delay = 0.0
    assert 0 < size < len(data) and partial.read_bytes() == data[:size]
    assert not blob_of(cache, REPO, data).exists()

    assert ollama.Client(host=daemon.url).pull(f"{REPO}:Q6_K").status == "success"
    assert hub.ranges[-1] == f"bytes={size}-"
    assert blob_of(cache, REPO, data).read_bytes() == data and not partial.exists()
