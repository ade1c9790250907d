"""A worker holds memory for the KV its slots hold, not for every cell its flags allow.

llama.cpp writes every cell of its KV cache when it creates it, so a daemon of five slots of
8,192 tokens would hold all of them from its first second, whatever its sessions hold. On the
fast build (scripts/patches/kv-pages-on-use.patch, switched on for every worker) the cache's
pages are taken as cells are written, and a slot whose entry leaves for host memory gives its
pages back. Measured as the worker's anonymous memory (the model's mapped file aside), against
what one token's KV costs in the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DaemonProcess, forced, new_session, say

from superfluid.core.runtime import SPARE_SLOTS
from superfluid.engine.build import fast_library
from superfluid.engine.llama import LlamaModel
from superfluid.model.resolve import embedded_model

pytestmark = pytest.mark.e2e

WINDOW = 8192
LANES = 1  # five slots with the spares: the sixth session evicts a slot's entry
PROMPT = " ".join(f"Entry {i} of the ledger reads {i * 37 % 1000} units." for i in range(120))


def anonymous_bytes(pid: int) -> int:
    """A process's anonymous memory (its heap and the KV cache; not the model's mapped file)."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return next(int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss_Anon:"))


def worker_of(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    children = Path(f"/proc/{daemon.proc.pid}/task/{daemon.proc.pid}/children").read_text().split()
    assert len(children) == 1, f"one llama.cpp worker, not {children}"
    return int(children[0])


def test_kv_memory_grows_with_what_slots_hold_and_falls_when_an_entry_leaves(tmp_path: Path) -> None:
    assert fast_library() is not None, "the fast build (make) is what workers load"
    model = LlamaModel(embedded_model().path)
    token_bytes = model.kv_shape().token_bytes()
    prompt_tokens = len(model.tokenize(PROMPT, False))
    pool = (LANES + SPARE_SLOTS) * WINDOW * token_bytes
    daemon = DaemonProcess(tmp_path, max_context=WINDOW, max_batch=LANES).start()
    try:
        worker = worker_of(daemon)
        started = anonymous_bytes(worker)
        assert started < pool / 3, f"{started >> 20} MiB at start, for a KV of {pool >> 20} MiB"
        with daemon.client() as client:
            for entry in range(SPARE_SLOTS + LANES):  # one session per slot
                session = new_session(client)
                say(client, session, f"Ledger {entry}. {PROMPT}")
                forced(client, session, 1)
            full = anonymous_bytes(worker)
            written = (SPARE_SLOTS + LANES) * prompt_tokens * token_bytes
            assert full - started > 0.7 * written, f"{(full - started) >> 20} MiB more for {written >> 20} MiB of KV"
            # a sixth, short session takes a slot whose long entry leaves for host memory
            session = new_session(client)
            say(client, session, "A short note.")
            forced(client, session, 1)
            after = anonymous_bytes(worker)
        released = prompt_tokens * token_bytes
        assert full - after > 0.5 * released, f"{(full - after) >> 20} MiB back for an entry of {released >> 20} MiB"
    finally:
        daemon.stop()
