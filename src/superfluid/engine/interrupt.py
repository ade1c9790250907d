"""A flag that stops the step in flight: an interactive arrival need not wait for a long batch prefill.

llama.cpp asks a context's abort callback after every operation of a graph; when it answers
true, `llama_decode` returns 2 and `LlamaContext.decode` takes the batch's positions back out
of the KV (llama.cpp removes only the micro-batch it stopped in), so the step has left
nothing behind and can run again. The scheduler prefills batch work in long
steps (larger chunks prefill faster on larger models) and sets the flag when interactive
work arrives.

The flag is the first two bytes of a memory file, so the daemon can set it while a worker process
decodes. The callback is libc's `strlen` over them: it reads `"\\x01\\0"` as 1 and `"\\0\\0"`
as 0, which is what a callback returning bool must say, and it runs in the graph's thread
without Python (a Python callback would take the GIL after every operation, a thousand
times a step on the embedded model).

A third byte, after the zero that ends the string, cuts a run: an engine call that makes several
decodes (`Draw.run`) asks it between two decodes and returns with what it drew, so a job that
arrives meanwhile waits for one decode, not the whole run, and no decode's work is thrown away.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import typing

# the abort callback llama.cpp is given (`LlamaContext`), with `Interrupt.address` as its argument
CALLBACK = typing.cast(int, ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value)


_DECODE, _RUN = 0, 2  # the flags' bytes; byte 1 stays zero
_SIZE = 3


class Interrupt:
    """Shared memory flags: while set, a decode stops after the operation it is in; while cut, a run of
    decodes ends after the decode in flight."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.memfd_create("superfluid-interrupt") if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, _SIZE)
        self._map = mmap.mmap(self.fd, _SIZE)
        self._flag = ctypes.c_char.from_buffer(self._map)

    def set(self) -> None:
        self._map[_DECODE] = 1

    def cut(self) -> None:
        self._map[_RUN] = 1

    def clear(self) -> None:
        """Both flags down."""
        self._map[_DECODE] = 0
        self._map[_RUN] = 0

    def is_set(self) -> bool:
        return self._map[_DECODE] == 1

    def is_cut(self) -> bool:
        return self._map[_RUN] == 1

    @property
    def address(self) -> int:
        """Where the flag is in this process: `CALLBACK`'s argument."""
        return ctypes.addressof(self._flag)

    def close(self) -> None:
        del self._flag  # the mmap refuses to close while a ctypes object points into it
        self._map.close()
        os.close(self.fd)
