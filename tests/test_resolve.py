"""Model references: the embedded model, paths, the Hugging Face cache and a download."""

from __future__ import annotations

import hashlib
import importlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest

from superfluid.model.resolve import ModelNotFound, embedded_model, is_hub_id, pick_gguf, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return cache


def put_in_cache(cache: Path, repo: str, files: dict[str, bytes], revision: str = COMMIT) -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / revision
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return snapshot


def test_the_embedded_model_is_found_without_importing_its_package() -> None:
    model = embedded_model()
    assert model.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and model.path.stat().st_size > 50_000_000
    assert resolve_model(None) == model


def test_hub_ids_and_paths() -> None:
    assert is_hub_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M")
    assert is_hub_id("bartowski/SmolLM2-360M-Instruct-GGUF")
    assert not is_hub_id("./models/x.gguf") and not is_hub_id("/abs/x.gguf") and not is_hub_id("dir/model.gguf")
    with pytest.raises(ModelNotFound, match=r"model file .*missing\.gguf does not exist"):
        resolve_model("/nonexistent/missing.gguf")


def test_picking_the_quant_out_of_a_repo() -> None:
    files = [
        "model-Q4_K_M.gguf",
        "model-Q4_K_S.gguf",
        "model-Q8_0.gguf",
        "mmproj-model-f16.gguf",
        "big/model-Q6_K-00001-of-00002.gguf",
        "big/model-Q6_K-00002-of-00002.gguf",
    ]
    assert pick_gguf(files, "Q8_0") == "model-Q8_0.gguf"
    assert pick_gguf(files, "q4_k_s") == "model-Q4_K_S.gguf"
    assert pick_gguf(files, "Q6_K") == "big/model-Q6_K-00001-of-00002.gguf"
    assert pick_gguf(files, None) == "model-Q4_K_M.gguf"
    assert pick_gguf(files, "IQ2_XS") is None


def test_a_hub_id_resolves_from_the_local_cache(hub_cache: Path) -> None:
    snapshot = put_in_cache(hub_cache, "someone/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF", "tiny-Q4_1.gguf": b"GGUF"})
    found = resolve_model("someone/tiny-GGUF:Q4_1", offline=True)
    assert found.path == snapshot / "tiny-Q4_1.gguf" and found.name == "someone/tiny-GGUF"


def test_offline_and_missing_names_what_was_looked_for_and_where(hub_cache: Path) -> None:
    put_in_cache(hub_cache, "someone/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF"})
    with pytest.raises(ModelNotFound) as error:
        resolve_model("someone/tiny-GGUF:Q4_K_M", offline=True)
    message = str(error.value)
    assert "someone/tiny-GGUF:Q4_K_M" in message
    assert str(hub_cache / "models--someone--tiny-GGUF" / "snapshots") in message
    assert "huggingface-cli download someone/tiny-GGUF --include '*Q4_K_M*.gguf'" in message


class FakeHub(BaseHTTPRequestHandler):
    """The two Hugging Face endpoints a download uses: the repo tree and file resolution."""

    files: dict[str, bytes] = {}

    def log_message(self, *args: object) -> None:
        pass

    def _file(self) -> tuple[str, bytes] | None:
        prefix = "/someone/remote-GGUF/resolve/main/"
        if self.path.startswith(prefix):
            name = self.path[len(prefix) :]
            if name in self.files:
                return name, self.files[name]
        return None

    def do_HEAD(self) -> None:
        found = self._file()
        if found is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"' + hashlib.sha256(found[1]).hexdigest() + '"')
        self.send_header("Content-Length", str(len(found[1])))
        self.end_headers()

    def do_GET(self) -> None:
        if self.path.startswith("/api/models/someone/remote-GGUF/tree/main"):
            body = json.dumps(
                [
                    {"type": "file", "path": name, "size": len(data), "oid": "0" * 40}
                    for name, data in self.files.items()
                ]
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        found = self._file()
        if found is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(found[1])))
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"' + hashlib.sha256(found[1]).hexdigest() + '"')
        self.end_headers()
        self.wfile.write(found[1])


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    FakeHub.files = {"remote-Q4_1.gguf": b"GGUF-remote-weights", "remote-Q8_0.gguf": b"GGUF-other"}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    yield endpoint
    server.shutdown()


def test_a_missing_model_is_downloaded_into_the_cache(
    hub_cache: Path, fake_hub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    importlib.reload(huggingface_hub.constants)  # the endpoint and cache are read at import
    try:
        found = resolve_model("someone/remote-GGUF:Q4_1")
        assert found.path.read_bytes() == b"GGUF-remote-weights"
        assert str(found.path).startswith(str(hub_cache / "models--someone--remote-GGUF"))
        # the next start finds it in the cache, with no network at all
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert resolve_model("someone/remote-GGUF:Q4_1").path == found.path
    finally:
        monkeypatch.undo()
        importlib.reload(huggingface_hub.constants)
