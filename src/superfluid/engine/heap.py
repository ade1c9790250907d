"""glibc's heap, tuned for how each of superfluid's processes allocates (elsewhere nothing changes).

A worker allocates the same temporaries at every token it samples: its heap keeps freed memory
for them. The daemon holds exported KV states of megabytes for minutes in its host tier and
frees them as the tier turns over: those blocks are mapped one by one, so that a freed one goes
back to the system.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# Freed memory the heap keeps at its top. A sampled row's temporaries (a 49,152-token row's weights and
# bucket numbers, 0.2-0.4 MB each) would otherwise be handed back to the system when freed and fault their
# pages in again at the next token: with 4 MiB kept, the sampler took 0.16-0.31 ms a row of a random 0.7B
# model's logits against 0.40-0.55 ms.
TOP_PAD = 4 << 20

# Blocks this large or larger are mapped on their own. glibc's own threshold rises to the largest block
# freed, after which exported states (2-3 MB each on the embedded model, more on larger ones) come from the
# heap, whose holes, each a little too small for the next state, it never hands back: eight clients of short
# chats with the host tier full grew the daemon's memory besides the tier from 100 to 263 MB in four
# minutes (290 to 666 MiB in the bench's ten), and 99 to 113 MB with states mapped one by one, which
# fault their pages in when written: 0.3 CPU-seconds more every 30 s.
MMAP_THRESHOLD = 1 << 20


def _mallopt(parameter: int, value: int) -> None:
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(parameter, value)


def keep_heap_slack() -> None:
    """Have this process's heap keep `TOP_PAD` of freed memory (a worker)."""
    _mallopt(M_TOP_PAD, TOP_PAD)


def map_large_blocks() -> None:
    """Have this process map blocks of `MMAP_THRESHOLD` or more on their own, so that freeing one
    returns its memory (the daemon)."""
    _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
