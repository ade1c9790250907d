"""A fake Hugging Face hub on a loopback port: what a pull asks of the real one, with switches to misbehave.

It answers `GET /api/models/{repo}/revision/main?blobs=true` (the commit and each file's size and
LFS sha256) and `GET`/`HEAD /{repo}/resolve/{revision}/{file}`, which it redirects, as the hub does
to its file servers, to `/files/{repo}/{file}`, where `Range` is honoured. `cut_at` ends the
connection once a file's first bytes up to that offset are sent, `ignore_range` answers every
request whole, `stated` lists another size or sha256 than the bytes have, `delay` paces the chunks.

    with FakeHub() as hub:
        hub.repos["someone/tiny-GGUF"] = {"tiny-Q8_0.gguf": b"..."}
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

from superfluid.model.resolve import embedded_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 64 << 10
# the sizes of GGUF's fixed-size metadata values, by type number (8 is a string, 9 an array)
GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class FakeHub:
    """The hub's listing and file routes over `repos` (repository -> file name -> bytes); a context manager."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.stated: dict[str, tuple[int, str]] = {}  # a file name -> the (size, sha256) listed instead
        self.cut_at: int | None = None
        self.ignore_range = False
        self.delay = 0.0
        self.ranges: list[str | None] = []  # the Range header of each file request, in order
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"hub": self}))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def listing(self, repo: str) -> dict[str, object]:
        siblings = []
        for name, data in self.repos[repo].items():
            size, sha256 = self.stated.get(name, (len(data), hashlib.sha256(data).hexdigest()))
            lfs = {"sha256": sha256, "size": size, "pointerSize": 134} if name.endswith(".gguf") else None
            siblings.append({"rfilename": name, "size": size, "blobId": "0" * 40, "lfs": lfs})
        return {"id": repo, "sha": COMMIT, "siblings": siblings}


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlparse(self.path).path).strip("/")
        listing = path.removeprefix("api/models/").removesuffix("/revision/main")
        if path.startswith("api/models/"):
            if listing not in self.hub.repos:
                self._plain(404, b'{"error": "Repository not found"}')
            else:
                self._plain(200, json.dumps(self.hub.listing(listing)).encode())
            return
        repo, found = self._file(path)
        if found is None:
            self._plain(404, b"Entry not found")
        elif "/resolve/" in path:
            name, data = found
            self.send_response(302)
            self.send_header("Location", f"/files/{repo}/{quote(name)}")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(found[1], body)

    def _file(self, path: str) -> tuple[str, tuple[str, bytes] | None]:
        """The repository and (name, bytes) of a resolve or file path."""
        for repo, files in self.hub.repos.items():
            for prefix in (f"{repo}/resolve/main/", f"{repo}/resolve/{COMMIT}/", f"files/{repo}/"):
                name = path.removeprefix(prefix)
                if path.startswith(prefix) and name in files:
                    return repo, (name, files[name])
        return "", None

    def _plain(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send(self, data: bytes, body: bool) -> None:
        asked = self.headers.get("Range")
        if body:
            self.hub.ranges.append(asked)
        start = int(asked.removeprefix("bytes=").split("-")[0]) if asked and not self.hub.ignore_range else 0
        if start >= len(data) and start:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if not body:
            return
        end = len(data) if self.hub.cut_at is None else max(start, self.hub.cut_at)
        try:
            for at in range(start, end, CHUNK):
                self.wfile.write(data[at : min(at + CHUNK, end)])
                time.sleep(self.hub.delay)
        except OSError:  # the client left
            pass
        self.close_connection = end < len(data)


@functools.cache
def tiny_gguf() -> bytes:
    """A small GGUF that llama.cpp reads the vocabulary and metadata of: the embedded model's header
    (architecture, context length, tokenizer, chat template) with no tensors, about 1.7 MB."""
    data = embedded_model().path.read_bytes()
    magic, version, _, count = struct.unpack_from("<4sIQQ", data, 0)
    at = 24
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", data, at)
        (kind,) = struct.unpack_from("<I", data, at + 8 + length)
        at = _skip_value(data, at + 12 + length, kind)
    header = struct.pack("<4sIQQ", magic, version, 0, count) + data[24:at]
    return header + b"\0" * (-len(header) % 32)


def _skip_value(data: bytes, at: int, kind: int) -> int:
    """The offset after a GGUF metadata value of type `kind` that starts at `at`."""
    if kind == 8:
        return at + 8 + struct.unpack_from("<Q", data, at)[0]
    if kind == 9:
        inner, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if inner in GGUF_SIZES:
            return at + GGUF_SIZES[inner] * count
        for _ in range(count):
            at = _skip_value(data, at, inner)
        return at
    return at + GGUF_SIZES[kind]


def blob_of(cache: Path, repo: str, data: bytes) -> Path:
    """Where huggingface_hub's layout keeps `data` of `repo` under `cache`."""
    return cache / ("models--" + repo.replace("/", "--")) / "blobs" / hashlib.sha256(data).hexdigest()
