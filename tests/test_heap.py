"""The daemon's heap hands a freed exported KV state back to the system (`engine/heap.py`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a process of its own: glibc's settings last as long as the process. It frees a block of a
# state's size while a later one is still held, the hole that glibc's heap keeps by default, and
# prints how much memory that returned.
FREED = """
import sys
from superfluid.engine.heap import map_large_blocks
if sys.argv[1] == "mapped":
    map_large_blocks()

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

size = 3 << 20
first = b"\\x01" * size
del first  # glibc's own threshold rises to a block this large once one is freed
held = b"\\x01" * (size - 4096)
later = b"\\x01" * (size - 4096)
before = resident()
del held
print(before - resident())
"""


def returned(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", FREED, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap and /proc are Linux's")
def test_a_freed_state_goes_back_to_the_system_only_once_large_blocks_are_mapped() -> None:
    assert returned("mapped") >= 2 << 20
    assert returned("default") < 1 << 20  # what the daemon did before: the block stayed in its heap
