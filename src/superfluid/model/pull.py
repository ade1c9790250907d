"""Downloads of GGUF models, from the Hugging Face hub or any URL, into the local cache.

A repository is listed with one request, `GET {HF_ENDPOINT}/api/models/{repo}/revision/main?blobs=true`:
its answer names the commit (`sha`) and every file (`siblings`: `rfilename`, `size`, and for a file
kept in LFS, as every GGUF is, `lfs.sha256`). Each file of the chosen quantisation (every part of a
split one) comes from `{HF_ENDPOINT}/{repo}/resolve/{commit}/{file}` into huggingface_hub's cache
layout, which `resolve.py` reads: the bytes in `blobs/<sha256>`, `snapshots/<commit>/<file>` a
relative link to them, `refs/main` naming the commit. `HF_TOKEN`, when set, is sent as a Bearer token.

A file is written to `<blob>.incomplete` and a later pull continues it with a `Range` request
(starting over when the server ignores it). The finished file must have the size and sha256 the
hub states; one that does not is removed. A URL to a `.gguf` is fetched the same way into
`downloads_dir()`, checked against the size (and, from the hub's resolve URLs, the sha256) its
server states. Nothing here prints: progress goes to a callback and every failure is a `PullError`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote, unquote, urlparse

import httpx

from ..config import home
from .resolve import _SPLIT, _repo_dir, hub_ref, is_hub_id, pick_gguf, quant_in_name

HUB = "https://huggingface.co"
CHUNK = 1 << 20
REPORT_EVERY = 0.1  # seconds between two progress reports of one file
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PullError(Exception):
    """A pull that cannot go on: the text says why and what to do; `status` is its HTTP answer."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class QuantNeeded(PullError):
    """A repository with several quantisations, and none named: `quants` maps each to its size."""

    def __init__(self, repo: str, quants: dict[str, int]) -> None:
        listed = ", ".join(f"{quant} ({size_text(size)})" for quant, size in quants.items())
        super().__init__(f"{repo} has {len(quants)} quantisations: {listed}; name one, as in {repo}:QUANT", 400)
        self.repo = repo
        self.quants = quants


class PullCancelled(PullError):
    """A pull stopped by its caller; what was downloaded stays for the next pull to resume."""


@dataclass(frozen=True)
class Part:
    """One file of a pull: where it comes from, what its source states of it, and where it goes."""

    name: str  # its path in the repository, or the URL's file name
    url: str
    size: int | None  # None: its server states no size
    sha256: str | None  # None: its source states no hash (a URL off the hub)
    blob: Path  # the bytes, once whole and checked
    link: Path | None = None  # the snapshot's name for them (hub files only)

    @property
    def partial(self) -> Path:
        return self.blob.with_name(self.blob.name + ".incomplete")

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else ""

    def complete(self) -> bool:
        return self.blob.is_file() and self.size in (None, self.blob.stat().st_size)

    def on_disk(self) -> int:
        """Bytes already here: the whole file, or what a cut download left."""
        if self.complete():
            return self.blob.stat().st_size
        return self.partial.stat().st_size if self.partial.is_file() else 0


@dataclass(frozen=True)
class Pull:
    """What one pull fetches, known before any byte of it is."""

    ref: str  # the model as `serve` takes it: org/repo:QUANT, or the downloaded file's path
    parts: tuple[Part, ...]
    commit: str = ""  # the hub commit the parts come from
    refs: Path | None = None  # the file naming the commit of the `main` branch (hub pulls only)

    @property
    def path(self) -> Path:
        """The file `serve` loads: the first part (of a split model)."""
        first = self.parts[0]
        return first.link or first.blob

    @property
    def total(self) -> int:
        return sum(part.size or 0 for part in self.parts)

    def missing(self) -> list[Part]:
        return [part for part in self.parts if not part.complete()]


@dataclass(frozen=True)
class Progress:
    """Where a pull stands: bytes of one part on disk, or its download whole and being checked."""

    part: Part
    done: int
    verifying: bool = False


Report = Callable[[Progress], None]


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT", "").strip() or HUB).rstrip("/")


def downloads_dir() -> Path:
    """Where a model pulled by URL goes: `$SUPERFLUID_HOME/models`."""
    return home() / "models"


def size_text(size: int) -> str:
    return f"{size / 2**20:.0f} MiB" if size < 2**30 else f"{size / 2**30:.1f} GiB"


def hub_name(name: str) -> str:
    """`org/repo[:QUANT]` of the names people copy (`hf.co/org/repo:QUANT`, a hub page's URL), with
    Ollama's `latest` tag meaning no quantisation; PullError for a name that is no hub repository."""
    repo, _, tag = hub_ref(name).partition(":")
    if "/" not in repo or repo.split("/")[0] in ("library", "registry.ollama.ai", "ollama.com"):
        raise PullError(
            f"{name} names no Hugging Face repository (Ollama's own library is not pulled from): superfluid "
            "pulls GGUF models from Hugging Face, named org/repo-GGUF:QUANT or hf.co/org/repo-GGUF:QUANT (for "
            "example hf.co/bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M), or a URL to a .gguf file",
            400,
        )
    if repo.count("/") != 1 or not is_hub_id(repo):
        raise PullError(f"{name} is not a Hugging Face repository: name one as org/repo-GGUF[:QUANT]", 400)
    return f"{repo}:{tag}" if tag else repo


def client() -> httpx.Client:
    """An HTTP client for the hub: its token, redirects followed (to its file servers), patient reads."""
    token = os.environ.get("HF_TOKEN", "").strip()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(headers=headers, follow_redirects=True, timeout=httpx.Timeout(60.0, connect=10.0))


def plan(ref: str, http: httpx.Client, *, default_quant: bool = False) -> Pull:
    """What pulling `ref` (`org/repo[:QUANT]`, a name `hub_name` takes, or a URL to a .gguf) fetches.

    With no quantisation named, a repository of one GGUF gives it; one of several raises
    QuantNeeded, unless `default_quant` picks the first of resolve's defaults it has."""
    if re.match(r"https?://", ref) and urlparse(ref).path.lower().endswith(".gguf"):
        return _plan_url(ref, http)
    repo, _, quant = hub_name(ref).partition(":")
    commit, files = _listing(repo, http)
    quants = quantisations(files)
    names = list(files)
    if not quants:
        raise PullError(f"{repo} has no GGUF file (it has: {', '.join(names) or 'nothing'})", 404)
    choice = pick_gguf(names, quant or None) if quant or default_quant or len(quants) == 1 else None
    if choice is None and quant:
        listed = ", ".join(f"{q} ({size_text(size)})" for q, size in quants.items())
        raise PullError(f"{repo} has no {quant}; it has: {listed}", 404)
    if choice is None:
        raise QuantNeeded(repo, quants)
    split = _SPLIT.search(choice)
    chosen = (
        sorted(n for n in names if n.startswith(choice[: split.start()]) and _SPLIT.search(n)) if split else [choice]
    )
    folder = _repo_dir(repo)
    parts = []
    for name in chosen:
        size, sha256 = files[name]
        if sha256 is None:
            raise PullError(f"{repo} states no sha256 for {name} (it is not in LFS), so it cannot be checked", 502)
        url = f"{hub_endpoint()}/{repo}/resolve/{commit}/{quote(name)}"
        parts.append(Part(name, url, size, sha256, folder / "blobs" / sha256, folder / "snapshots" / commit / name))
    label = quant_in_name(Path(choice).name) or quant
    return Pull(f"{repo}:{label}" if label else repo, tuple(parts), commit, folder / "refs" / "main")


def quantisations(files: dict[str, tuple[int, str | None]]) -> dict[str, int]:
    """Each quantisation of a repository's GGUF files (a file's name where it says none) and its size,
    every part of a split model counted; projectors (`mmproj`) are not models."""
    quants: dict[str, int] = {}
    for name, (size, _) in sorted(files.items()):
        if not name.lower().endswith(".gguf") or "mmproj" in name.lower():
            continue
        quant = quant_in_name(Path(name).name) or _SPLIT.sub(".gguf", name)
        quants[quant] = quants.get(quant, 0) + size
    return quants


def _listing(repo: str, http: httpx.Client) -> tuple[str, dict[str, tuple[int, str | None]]]:
    """The commit of `repo`'s main branch, and each file's size and LFS sha256."""
    endpoint = hub_endpoint()
    try:
        reply = http.get(f"{endpoint}/api/models/{repo}/revision/main", params={"blobs": "true"})
    except httpx.TransportError as e:
        raise PullError(
            f"cannot reach {endpoint} ({e or type(e).__name__}): check the network, or set HF_ENDPOINT to a "
            "mirror; models already downloaded serve without it (superfluid models lists them)",
            502,
        ) from None
    if reply.status_code in (401, 404):
        raise PullError(
            f"{repo} is not a repository on {endpoint} ({reply.status_code}): check its name; a private one "
            "needs HF_TOKEN",
            404,
        )
    if reply.status_code == 403:
        raise PullError(f"{repo} is gated on {endpoint}: accept its terms on its page, then set HF_TOKEN", 403)
    if reply.status_code != 200:
        raise PullError(f"{endpoint} answered {reply.status_code} listing {repo}: {reply.text[:200]}", 502)
    try:
        info = reply.json()
        files = {
            s["rfilename"]: (int((s.get("lfs") or {}).get("size") or s["size"]), (s.get("lfs") or {}).get("sha256"))
            for s in info["siblings"]
        }
        return str(info["sha"]), files
    except (ValueError, KeyError, TypeError) as e:
        raise PullError(f"{endpoint} listed {repo} in a shape not understood here ({e!r})", 502) from None


def _plan_url(url: str, http: httpx.Client) -> Pull:
    """A URL's file, its size from the server, its sha256 when the hub states it (`X-Linked-Etag` of a
    resolve URL, on the answer before the redirect to its file servers)."""
    name = unquote(urlparse(url).path.rsplit("/", 1)[-1])
    try:
        reply = http.head(url)
    except httpx.TransportError as e:
        raise PullError(f"cannot reach {url} ({e or type(e).__name__}): check the network and the URL", 502) from None
    if reply.status_code != 200:
        raise PullError(f"{url} answered {reply.status_code}: check the URL (a private file needs HF_TOKEN)", 404)
    headers = [r.headers for r in (*reply.history, reply)]
    size = next((h.get("x-linked-size") for h in headers if h.get("x-linked-size")), None)
    size = size or reply.headers.get("content-length")
    tag = next((h["x-linked-etag"] for h in headers if "x-linked-etag" in h), "").removeprefix("W/").strip('"')
    blob = downloads_dir() / name
    return Pull(str(blob), (Part(name, url, int(size) if size else None, tag if _SHA256.match(tag) else None, blob),))


def fetch(pull: Pull, http: httpx.Client, report: Report | None = None, stop: threading.Event | None = None) -> Path:
    """Download every missing part of `pull` and check it; the path `serve` loads.

    A part already whole is left as it is. `report` hears of each part's bytes now and then;
    setting `stop` ends the pull at the next chunk, keeping what was written for a later resume."""
    missing = pull.missing()
    try:
        _check_space(missing)
        for part in missing:
            _fetch_part(part, http, report or (lambda progress: None), stop)
        for part in pull.parts:
            if part.link is not None:
                _link(part.link, part.blob)
        if pull.refs is not None:
            pull.refs.parent.mkdir(parents=True, exist_ok=True)
            pull.refs.write_text(pull.commit)
    except OSError as e:  # a cache folder that cannot be written (a full disk is told apart as it streams)
        raise PullError(
            f"cannot write {e.filename or 'the model'}: {e.strerror}; check the cache folder", 500
        ) from None
    return pull.path


def _check_space(parts: list[Part]) -> None:
    if not parts:
        return
    needed = sum((part.size or 0) - part.on_disk() for part in parts)
    folder = parts[0].blob.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise PullError(
            f"not enough disk space: {parts[0].name} needs {size_text(needed)} more and {existing} has "
            f"{size_text(free)} free; free some space, or point HF_HUB_CACHE (or SUPERFLUID_HOME for a URL) "
            "at a larger disk",
            507,
        )


def _fetch_part(part: Part, http: httpx.Client, report: Report, stop: threading.Event | None) -> None:
    part.blob.parent.mkdir(parents=True, exist_ok=True)
    with open(part.partial, "ab") as out:  # appends: what a cut download left stays
        try:
            fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PullError(f"another pull is downloading {part.partial}: wait for it to finish", 409) from None
        done = out.tell()
        if part.size is not None and done > part.size:
            out.truncate(0)
            done = 0
        report(Progress(part, done))
        if part.size is None or done < part.size:
            done = _stream(part, http, out, done, report, stop)
        report(Progress(part, done, verifying=True))
        _check(part, done)
        os.replace(part.partial, part.blob)


def _stream(
    part: Part, http: httpx.Client, out: BinaryIO, done: int, report: Report, stop: threading.Event | None
) -> int:
    """Append the rest of `part`, from byte `done` on, to `out`; the bytes then on disk."""
    try:
        # the bytes as stored (no transfer encoding) and as they arrive, so that a cut keeps all it got
        headers = {"accept-encoding": "identity", **({"range": f"bytes={done}-"} if done else {})}
        with http.stream("GET", part.url, headers=headers) as reply:
            if done and reply.status_code == 416:  # a server that will not resume this file: start over
                out.truncate(0)
                return _stream(part, http, out, 0, report, stop)
            if reply.status_code not in (200, 206):
                raise PullError(f"{part.url} answered {reply.status_code}: check the URL, then pull again", 502)
            if done and reply.status_code == 200:  # a server that ignores Range sends it all again
                out.truncate(0)
                done = 0
            reported = time.monotonic()
            for chunk in reply.iter_raw():
                if stop is not None and stop.is_set():
                    raise PullCancelled(f"the pull of {part.name} was stopped at {size_text(done)}", 499)
                out.write(chunk)
                done += len(chunk)
                if part.size is not None and done > part.size:
                    break  # longer than stated: the size check refuses it
                if time.monotonic() - reported >= REPORT_EVERY:
                    report(Progress(part, done))
                    reported = time.monotonic()
            out.flush()
    except httpx.TransportError as e:
        out.flush()
        stated = f" of {size_text(part.size)}" if part.size else ""
        raise PullError(
            f"the download of {part.name} was cut at {size_text(done)}{stated} ({e or type(e).__name__}): run "
            "the pull again to resume from there",
            502,
        ) from None
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise PullError(
            f"the disk filled up at {size_text(done)} of {part.name}: free some space and run the pull again to resume",
            507,
        ) from None
    report(Progress(part, done))
    return done


def _check(part: Part, size: int) -> None:
    """Refuse a whole download whose size or sha256 is not what its source stated, removing it."""
    wrong = None
    if part.size is not None and size != part.size:
        wrong = f"its size is {size} bytes where {part.size} were stated"
    elif part.sha256 is not None and (found := _sha256(part.partial)) != part.sha256:
        wrong = f"its sha256 is {found} where {part.sha256} was stated"
    if wrong is not None:
        part.partial.unlink()
        raise PullError(f"{part.name} from {part.url} is damaged: {wrong}; it was removed, pull it again", 502)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _link(link: Path, blob: Path) -> None:
    """A snapshot's name for a blob, as huggingface_hub makes it: a relative symbolic link."""
    link.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, link.parent)
    if link.is_symlink() and os.readlink(link) == target:
        return
    link.unlink(missing_ok=True)
    link.symlink_to(target)
