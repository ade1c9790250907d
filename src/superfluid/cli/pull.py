"""`superfluid pull MODEL`: download a GGUF model into the Hugging Face cache, with a progress line.

MODEL is `org/repo-GGUF:QUANT` (or `hf.co/org/repo-GGUF:QUANT`), `org/repo-GGUF` when the
repository has one GGUF, or a URL to a .gguf file; `model/pull.py` does the work. Progress goes to
stderr, redrawn in place on a terminal and as a plain line every tenth of the way elsewhere; the
pulled file's path goes to stdout. Exit status: 0 pulled or already here, 1 failed (one line saying
what to do), 2 a repository of several quantisations and none named (they are listed).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from ..model.pull import Part, Progress, PullError, QuantNeeded, client, fetch, plan, size_text

PLAIN_EVERY_S = 30.0  # off a terminal, a line at least this often even when a tenth takes longer


class ProgressLine:
    """A part's progress (percent, MiB done of the total, MiB/s, time left), written to `out`."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tty = out.isatty()
        self.part: Part | None = None
        self.started = 0.0
        self.resumed_at = 0
        self.tenth = -1  # off a terminal: the tenth of the way, the bytes and the time of the last line
        self.printed = -1
        self.at = 0.0
        self.drawn = False

    def __call__(self, progress: Progress) -> None:
        part = progress.part
        if part is not self.part:
            self._start(part, progress.done)
        if progress.verifying:
            self._draw(part, progress.done, last=True)
            self._line(f"verifying {part.name}" + (" (sha256)" if part.sha256 else ""))
            return
        self._draw(part, progress.done, last=False)

    def _start(self, part: Part, done: int) -> None:
        self.part, self.resumed_at, self.started = part, done, time.monotonic()
        self.tenth = self.printed = -1
        if done:
            self._line(f"resuming {part.name} at {size_text(done)}")

    def _draw(self, part: Part, done: int, last: bool) -> None:
        elapsed = time.monotonic() - self.started
        rate = (done - self.resumed_at) / elapsed if elapsed > 0 else 0.0
        mib = 2**20
        if part.size:
            tenth = done * 10 // part.size
            left = (part.size - done) / rate if rate > 0 else None
            eta = f"{int(left) // 60}:{int(left) % 60:02d}" if left is not None else "?"
            text = (
                f"{part.name}  {done * 100 // part.size:3d}%  {done / mib:.1f}/{part.size / mib:.1f} MiB  "
                f"{rate / mib:.1f} MiB/s  ETA {eta}"
            )
        else:
            tenth = -1
            text = f"{part.name}  {done / mib:.1f} MiB  {rate / mib:.1f} MiB/s"
        if self.tty:
            self.out.write(f"\r{text}\x1b[K" + ("\n" if last else ""))
            self.drawn = not last
        elif done != self.printed and (last or tenth > self.tenth or time.monotonic() - self.at >= PLAIN_EVERY_S):
            self.out.write(text + "\n")
            self.tenth, self.printed, self.at = tenth, done, time.monotonic()
        self.out.flush()

    def _line(self, text: str) -> None:
        self.out.write(("\n" if self.drawn else "") + text + "\n")
        self.drawn = False
        self.out.flush()

    def close(self) -> None:
        """End a line left drawn in place (a pull that stopped half way)."""
        if self.drawn:
            self._line("")


def pull_model(model: str, out: IO[str], err: IO[str]) -> int:
    """Pull `model`, showing progress on `err`; an exit status."""
    progress = ProgressLine(err)
    started = time.monotonic()
    try:
        with client() as http:
            pull = plan(model, http)
            whole = not pull.missing()
            path = fetch(pull, http, progress)  # links a whole file into the snapshot, if need be
    except QuantNeeded as e:
        print(f"superfluid pull: {e.repo} has {len(e.quants)} quantisations; name one:", file=err)
        for quant, size in e.quants.items():
            print(f"  superfluid pull {e.repo}:{quant:<10} {size_text(size):>9}", file=err)
        return 2
    except PullError as e:
        progress.close()
        print(f"superfluid pull: {e}", file=err)
        return 1
    except KeyboardInterrupt:
        progress.close()
        print("superfluid pull: stopped; run the same command again to resume", file=err)
        return 130
    took = time.monotonic() - started
    if whole:
        print(f"{pull.ref} is already complete ({size_text(pull.total)}): nothing to download", file=err)
    else:
        print(
            f"pulled {pull.ref} ({size_text(pull.total)}) in {took:.1f} s; serve it: superfluid serve {pull.ref}",
            file=err,
        )
    print(path, file=out)
    return 0


def main_pull(args: Any) -> int:
    return pull_model(args.model, sys.stdout, sys.stderr)
