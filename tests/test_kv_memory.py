"""A worker holds memory for the KV its slots hold, not for every cell its flags allow.

llama.cpp writes every cell of its KV cache when it creates it, so a daemon of five slots of
8,192 tokens would hold all of them from its first second, whatever its sessions hold. On the
fast build (scripts/patches/kv-pages-on-use.patch, switched on for every worker) the cache's
pages are taken as cells are written, and a slot whose entry leaves for host memory gives its
pages back. Measured as what is resident of the KV buffer's mapping in the worker, against what
one token's KV costs in the model.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import DaemonProcess, children, forced, new_session, say

from superfluid.client import SocketClient
from superfluid.core.runtime import SPARE_SLOTS
from superfluid.engine.build import fast_library
from superfluid.engine.llama import LlamaModel
from superfluid.model.resolve import embedded_model

pytestmark = pytest.mark.e2e

WINDOW = 8192
LANES = 1  # five slots with the spares: the sixth session evicts a slot's entry
PROMPT = " ".join(f"Entry {i} of the ledger reads {i * 37 % 1000} units." for i in range(50))


def kv_resident_bytes(pid: int, pool: int) -> int:
    """What is resident of the worker's KV buffer: its one anonymous mapping of at least `pool` bytes.

    The mapping alone, not the process's anonymous memory: an exported entry passes through the
    worker's heap on its way to host memory, and the allocator keeps some of that as it likes."""
    resident: list[int] = []
    size = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        field, _, value = line.partition(":")
        if field == "Size":
            size = int(value.split()[0]) * 1024
        elif field == "Anonymous" and size >= pool:
            resident.append(int(value.split()[0]) * 1024)
    assert len(resident) == 1, f"one mapping of at least {pool >> 20} MiB holds the KV, not {len(resident)}"
    return resident[0]


def worker_of(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    workers = children(daemon.proc.pid)
    assert len(workers) == 1, f"one llama.cpp worker, not {workers}"
    return workers[0]


def prefilled(client: SocketClient, text: str) -> None:
    """A new session of `text`, prefilled and one token drawn: its KV sits in a slot."""
    session = new_session(client)
    say(client, session, text)
    forced(client, session, 1)


def test_kv_memory_grows_with_what_slots_hold_and_falls_when_an_entry_leaves(tmp_path: Path) -> None:
    assert fast_library() is not None, "the fast build (make) is what workers load"
    model = LlamaModel(embedded_model().path)
    token_bytes = model.kv_shape().token_bytes()
    prompt_tokens = len(model.tokenize(PROMPT, False))
    pool = (LANES + SPARE_SLOTS) * WINDOW * token_bytes
    daemon = DaemonProcess(tmp_path, max_context=WINDOW, max_batch=LANES).start()
    try:
        worker = worker_of(daemon)
        started = kv_resident_bytes(worker, pool)
        assert started < pool / 3, f"{started >> 20} MiB at start, for a KV of {pool >> 20} MiB"
        entry = prompt_tokens * token_bytes  # one long session's KV
        with daemon.client() as client:
            # every slot but one: with a slot free, the daemon keeps every entry where it is
            for number in range(SPARE_SLOTS + LANES - 1):
                prefilled(client, f"Ledger {number}. {PROMPT}")
            held = kv_resident_bytes(worker, pool)
            written = (SPARE_SLOTS + LANES - 1) * entry
            assert held - started > 0.9 * written, f"{(held - started) >> 20} MiB more for {written >> 20} MiB of KV"
            # one more long session takes the last slot, then a short one needs a slot: a long entry leaves for
            # host memory (at the short one's admission, or ahead of it while the daemon idles)
            prefilled(client, f"Ledger {SPARE_SLOTS + LANES}. {PROMPT}")
            prefilled(client, "A short note.")
            deadline = time.monotonic() + 30
            while (after := kv_resident_bytes(worker, pool)) > held + 0.2 * entry and time.monotonic() < deadline:
                time.sleep(0.2)
        assert after < held + 0.2 * entry, (
            f"{(after - held) >> 20} MiB over what {SPARE_SLOTS + LANES - 1} entries held, once one more came and "
            f"one of {entry >> 20} MiB left"
        )
    finally:
        daemon.stop()
