"""KV parked on disk: the third tier of the prefix cache, after the slots and host memory.

A parked entry is llama.cpp's sequence state for a token prefix, in one file under
`<sessions>/park/` named by a hash of the tokens:

    magic "SFPARK1\\n" | fingerprint (16 bytes) | token count (u32) | tokens (i32 each)
    | payload length (u64) | payload digest (blake2b, 16 bytes) | payload

The fingerprint covers what gives a state its meaning (the model file, the context's
shape, the kernels), so a file from another model or shape is never loaded. A file is
written to a temporary name, fsynced, renamed and its directory fsynced, so a crash
leaves either the whole file or none under its name; one that fails any check when read
is deleted and counted. Writing runs on a thread of its own: the scheduler hands over
bytes it already exported and never waits for the disk, and a state that would take the
states waiting for the writer past `PENDING_LIMIT` bytes is passed over (and counted) rather
than queued, so a disk slower than the evictions costs cache, not memory. The writer gives way to
first tokens (`give_way_to`, `WRITE_PIECE`). Past the byte budget the least
recently used files go first. Like the host tier, the park is a cache: the log is the
truth, and a session with nothing parked is prefilled.

A park may be shared by the daemons of one store (`--park-dir`), so that a session taken over
from a killed daemon resumes from what that daemon parked. Each daemon writes under temporary
names of its own (host and process), and on a lookup that finds nothing it looks for files
the others wrote since it last looked (at most once every `REFRESH_S`); a temporary file is
removed only once it is older than any write takes, and a file another daemon removed is
forgotten when it cannot be read.
"""

from __future__ import annotations

import builtins  # `bytes` in annotations inside Park would name its property
import contextlib
import hashlib
import logging
import os
import queue
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .prefix_tree import PrefixTree

log = logging.getLogger("superfluid.park")

# filesystems whose fsync crosses a network, or that a VM shares with its host: parking on
# them would cost more than the prefill it saves, so the default leaves them alone
REMOTE_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "virtiofs", "ceph", "glusterfs", "afs", "lustre", "fuse.sshfs"}
)
# the default parks only with this much free disk, and never fills more than half of what is free
MIN_FREE_BYTES = 2 << 30

STALE_TEMPORARY_S = 600.0  # a temporary file this old was left by a crash, not being written
REFRESH_S = 1.0  # a shared park looks for the other daemons' new files at most this often

MAGIC = b"SFPARK1\n"
SUFFIX = ".park"
_COUNT = struct.Struct("<I")
_PAYLOAD = struct.Struct("<Q16s")


def park_fingerprint(*parts: object) -> bytes:
    """16 bytes naming what a state depends on (model identity, context shape, kernels)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path`, from /proc/mounts ("" where it is unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    resolved, found, longest = str(path.resolve()), "", -1
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > longest:
            found, longest = fields[2], len(point)
    return found


def default_budget(directory: Path, budget: int) -> tuple[int, str]:
    """The budget the default `--park` gets in `directory` (0 bytes: no park) and why, for the log.

    The default parks on a local disk with at least `MIN_FREE_BYTES` free, and within half
    of what is free, so the park never fills the disk the log needs.
    """
    probe = directory
    while not probe.exists():
        probe = probe.parent
    kind = filesystem_type(probe)
    if kind in REMOTE_FILESYSTEMS:
        return 0, f"{probe} is on {kind}, not a local disk (--park parks there anyway)"
    free = shutil.disk_usage(probe).free
    if free < MIN_FREE_BYTES:
        return 0, f"{probe} has {free / (1 << 30):.1f} GiB free, under {MIN_FREE_BYTES >> 30} GiB (--park parks anyway)"
    if budget == 0 or budget > free // 2:
        return free // 2, f"at most {free / 2 / (1 << 30):.1f} GiB, half of the free disk"
    return budget, f"at most {budget / (1 << 30):.1f} GiB"


def _name(tokens: np.ndarray) -> str:
    return hashlib.blake2b(tokens.astype("<i4").tobytes(), digest_size=16).hexdigest() + SUFFIX


@dataclass(slots=True)
class ParkedEntry:
    """A parked file: its directory and name, the tokens its state covers, its size, when it was last written
    or read. A park indexes thousands (its budget's worth), so an entry keeps its name, which the index shares,
    rather than a `Path` of its own: 988 bytes an entry of the index against 1,196 (tracemalloc, 5,000 entries
    of 340 tokens sharing their first 40)."""

    directory: Path
    name: str
    tokens: np.ndarray
    size: int
    used: float

    @property
    def path(self) -> Path:
        return self.directory / self.name


# states handed to the writer and not yet on disk. Unbounded, the queue would grow whenever the
# host tier overflows faster than the disk takes its states: eight clients of short chats on the
# embedded model push a state of about 2 MB out at every request, and the writer runs at the
# lowest priority on cores llama.cpp fills. 64 MiB is about thirty such states
PENDING_LIMIT = 64 << 20

# A state is hashed and written in pieces of this size, and before each piece (and before the
# fsync) the writer gives way while a job waits for its first token (`Park.give_way_to`): a
# Claude Code turn's state is 61 MiB on the embedded model, and writing it whole right after
# the turn delayed the next turn's first token from 0.13-0.17 s (--no-park) to 0.18-0.66 s here
WRITE_PIECE = 4 << 20
GIVE_WAY_S = 2.0  # the longest one piece waits, so that a daemon never idle still parks


class Park:
    """Parked states of one model's context, bounded by `budget` bytes (0: unbounded)."""

    def __init__(self, directory: Path, fingerprint: bytes, budget: int, shared: bool = False) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.budget = budget
        self.shared = shared  # other daemons write here too
        self._looked = 0.0  # when a shared park last looked for their files
        self.entries: dict[str, ParkedEntry] = {}
        self._bytes = 0  # the entries' sizes summed: read at every write and scrape, over thousands of entries
        self._tree: PrefixTree[str] = PrefixTree()  # the entries' tokens by name, for `lookup`
        self.parks = self.resumes = self.refused = 0
        self.passed_over = 0  # states not parked because the writer was PENDING_LIMIT behind
        self._lock = threading.Lock()
        self._indexed = threading.Event()
        self._writes: queue.Queue[tuple[np.ndarray, bytes] | threading.Event] = queue.Queue()
        self._pending: set[str] = set()  # names handed to the writer and not on disk yet
        self.pending_bytes = 0  # of the states in `_pending`: memory until the writer has them on disk
        self.give_way_to: Callable[[], bool] = lambda: False  # the scheduler's: a job waits for its first token
        directory.mkdir(parents=True, exist_ok=True)
        self._writer = threading.Thread(target=self._write_loop, name="superfluid-park", daemon=True)
        self._writer.start()

    @property
    def bytes(self) -> int:
        return self._bytes

    def _scan(self) -> None:
        """Index the files a previous run left: headers only; leftovers of torn writes go.

        It runs on the writer thread before its first write, so start-up does not wait for it
        however many files there are; the first lookup does.
        """
        try:
            self._index()
        finally:
            self._indexed.set()

    def _index(self) -> None:
        for path in self.directory.iterdir():
            if path.suffix != SUFFIX:
                self._drop_temporary(path)
                continue
            with self._lock:
                if path.name in self.entries:
                    continue
            tokens = self._header(path)
            if tokens is None:
                self._refuse(path, "its header does not match this model and context")
                continue
            stat = path.stat()
            with self._lock:
                if path.name not in self.entries:
                    self._hold(ParkedEntry(self.directory, path.name, tokens, stat.st_size, stat.st_mtime))

    def _drop_temporary(self, path: Path) -> None:
        """Remove a temporary file a crash interrupted: any, in a park of one daemon's own; in a shared one,
        only one old enough that no daemon is still writing it."""
        try:
            if not self.shared or time.time() - path.stat().st_mtime > STALE_TEMPORARY_S:
                path.unlink(missing_ok=True)
        except OSError:
            pass

    def _refresh(self) -> None:
        """In a shared park, index what the other daemons parked since the last look (rate-limited)."""
        now = time.monotonic()
        if not self.shared or now - self._looked < REFRESH_S:
            return
        self._looked = now
        try:
            self._index()
        except OSError as e:
            log.warning("could not look for new parked states in %s: %s", self.directory, e)

    def _header(self, path: Path) -> np.ndarray | None:
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 16 + _COUNT.size)
                if len(head) < len(MAGIC) + 16 + _COUNT.size or head[: len(MAGIC)] != MAGIC:
                    return None
                if head[len(MAGIC) : len(MAGIC) + 16] != self.fingerprint:
                    return None
                (count,) = _COUNT.unpack_from(head, len(MAGIC) + 16)
                raw = f.read(4 * count)
        except OSError:
            return None
        if len(raw) != 4 * count or path.name != _name(np.frombuffer(raw, dtype="<i4")):
            return None
        return np.frombuffer(raw, dtype="<i4").astype(np.int32)

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("parked state %s refused and deleted: %s", path.name, why)
        path.unlink(missing_ok=True)
        self.refused += 1

    # ---- writing ----

    def put(self, tokens: np.ndarray, state: builtins.bytes) -> None:
        """Park `state` (the KV of `tokens`) on the writer thread; returns at once. A state parked
        already, or on its way, is not queued twice."""
        name = _name(tokens)
        with self._lock:
            if name in self.entries or name in self._pending:
                return
            if self._pending and self.pending_bytes + len(state) > PENDING_LIMIT:
                self.passed_over += 1
                return
            self._pending.add(name)
            self.pending_bytes += len(state)
        self._writes.put((np.array(tokens, dtype=np.int32), state))

    def holds(self, tokens: np.ndarray) -> bool:
        """True when the state of `tokens` is parked, or handed to the writer."""
        name = _name(tokens)
        return name in self.entries or name in self._pending

    def flush(self) -> None:
        """Wait until every state handed over is on disk (and the files found at start are indexed)."""
        done = threading.Event()
        self._writes.put(done)
        done.wait(timeout=60)

    def _write_loop(self) -> None:
        # the lowest priority: digests and writes take what llama.cpp's threads leave
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        self._scan()
        while True:
            item = self._writes.get()
            if isinstance(item, threading.Event):
                item.set()  # everything before it is written
                continue
            tokens, state = item
            try:
                self._write(tokens, state)
            except OSError as e:
                log.warning("could not park a state of %d tokens: %s", len(tokens), e)
            finally:
                with self._lock:
                    self._pending.discard(_name(tokens))
                    self.pending_bytes -= len(state)

    def _write(self, tokens: np.ndarray, state: builtins.bytes) -> None:
        name = _name(tokens)
        path = self.directory / name
        temporary = self.directory / f".{name}.{socket.gethostname()}.{os.getpid()}.tmp"
        pieces = [memoryview(state)[at : at + WRITE_PIECE] for at in range(0, len(state), WRITE_PIECE)]
        digest = hashlib.blake2b(digest_size=16)
        for piece in pieces:
            self._give_way()
            digest.update(piece)
        with open(temporary, "wb") as f:
            f.write(MAGIC + self.fingerprint + _COUNT.pack(len(tokens)) + tokens.astype("<i4").tobytes())
            f.write(_PAYLOAD.pack(len(state), digest.digest()))
            for piece in pieces:
                self._give_way()
                f.write(piece)
            f.flush()
            self._give_way()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        with self._lock:
            self._hold(ParkedEntry(self.directory, name, tokens, path.stat().st_size, time.time()))
            self.parks += 1
        self._trim()

    def _give_way(self) -> None:
        """Wait while a job waits for its first token, GIVE_WAY_S at most."""
        until = time.monotonic() + GIVE_WAY_S
        while self.give_way_to() and time.monotonic() < until:
            time.sleep(0.02)  # a glance each 20 ms: a first token takes 100 ms or more, even warm

    def _hold(self, entry: ParkedEntry) -> None:
        """Index a parked file (the caller holds the lock)."""
        self._let_go(entry.name)  # another daemon's write of the same state, indexed meanwhile
        self.entries[entry.name] = entry
        self._bytes += entry.size
        self._tree.add(entry.name, entry.tokens)

    def _let_go(self, name: str) -> ParkedEntry | None:
        """Forget a parked file's entry, if it has one (the caller holds the lock)."""
        self._tree.remove(name)
        entry = self.entries.pop(name, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry

    def _trim(self) -> None:
        """Least recently used files go first beyond the budget."""
        if not self.budget:
            return
        with self._lock:
            if self._bytes <= self.budget:
                return  # most writes: no need to order thousands of entries
            for entry in sorted(self.entries.values(), key=lambda e: e.used):
                if self._bytes <= self.budget:
                    break
                self._let_go(entry.name)
                entry.path.unlink(missing_ok=True)

    # ---- reading ----

    def lookup(self, tokens: np.ndarray, limit: int) -> tuple[ParkedEntry, int] | None:
        """The parked entry sharing the longest prefix with `tokens` (at most `limit` of them)."""
        self._indexed.wait()
        found = self._best(tokens, limit)
        if self.shared and (found is None or found[1] < limit):
            self._refresh()
            found = self._best(tokens, limit)
        return found

    def _best(self, tokens: np.ndarray, limit: int) -> tuple[ParkedEntry, int] | None:
        with self._lock:
            found = self._tree.longest(tokens, limit)
            return None if found is None else (self.entries[found[0]], found[1])

    def read(self, entry: ParkedEntry) -> builtins.bytes | None:
        """The state of a parked entry; None (the file deleted, counted) when it fails a check."""
        try:
            data = entry.path.read_bytes()
        except OSError as e:
            self._forget(entry, f"unreadable: {e}")
            return None
        start = len(MAGIC) + 16 + _COUNT.size + 4 * len(entry.tokens)
        if len(data) < start + _PAYLOAD.size or data[: len(MAGIC)] != MAGIC:
            self._forget(entry, "truncated")
            return None
        if data[len(MAGIC) : len(MAGIC) + 16] != self.fingerprint:
            self._forget(entry, "written for another model or context")
            return None
        length, digest = _PAYLOAD.unpack_from(data, start)
        state = data[start + _PAYLOAD.size :]
        if len(state) != length or hashlib.blake2b(state, digest_size=16).digest() != digest:
            self._forget(entry, "its payload fails its checksum")
            return None
        entry.used = time.time()
        os.utime(entry.path)
        self.resumes += 1
        return state

    def _forget(self, entry: ParkedEntry, why: str) -> None:
        with self._lock:
            self._let_go(entry.name)
        self._refuse(entry.path, why)
