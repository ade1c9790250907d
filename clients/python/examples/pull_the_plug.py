"""Kill the server with SIGKILL in the middle of a reply, restart it, and finish the same reply.

    python examples/pull_the_plug.py                      # the embedded model
    python examples/pull_the_plug.py path/to/model.gguf --after 40

It starts its own `superfluid serve` on temporary directories and a free loopback port,
streams a long story, kills the server after N pieces of text, starts it again on the
same state, reopens the session by id and continues the cut turn. Every committed token
survived the kill; the reply goes on from the last committed event. It exits non-zero if
the text committed before the kill is not the beginning of the final reply.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from superfluid_client import Client, Sampling

STARTUP_TIMEOUT_S = 300


class Server:
    """`superfluid serve` with the browser transport, restartable on the same state."""

    def __init__(self, binary: list[str], model: str | None, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.command = [
            *binary,
            "serve",
            *([model] if model else []),
            "--sessions",
            str(root / "sessions"),
            "--socket",
            str(root / "sf.sock"),
            "--web",
            f"127.0.0.1:{port}",
            "--no-http",
            "--no-tui",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Client:
        with open(self.root / "serve.log", "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        token = self.root / "sessions" / "web-token"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"the server exited; see {self.root / 'serve.log'}")
            probe = Client(f"http://127.0.0.1:{self.port}", token="-")
            if probe.health():
                # health answers once the new token is written: read it now, not before
                return Client(f"http://127.0.0.1:{self.port}", token_file=token)
            time.sleep(0.2)
        sys.exit("the server did not come up")

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="model for `superfluid serve` (default: the embedded one)")
    parser.add_argument(
        "--superfluid", default=shutil.which("superfluid") or "superfluid", help="the superfluid command"
    )
    parser.add_argument("--after", type=int, default=80, help="pieces of text to stream before the kill")
    parser.add_argument("--max-tokens", type=int, default=600)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="superfluid-plug-"))
    server = Server([args.superfluid], args.model, root, free_port())
    try:
        sf = server.start()
        story = sf.session(
            Sampling(temperature=0.8, seed=2026), system="You are a storyteller. Answer directly, without deliberating."
        )
        story.user("Tell a story, about 300 words, about a lighthouse keeper who receives a letter from the sea.")

        shown = ""
        pieces = 0
        killed = False
        for chunk in story.stream(args.max_tokens, ignore_eos=True):  # the whole length: long enough to cut
            if chunk.kind != "text":
                continue
            print(chunk.text, end="", flush=True)
            shown += chunk.text
            pieces += 1
            if pieces == args.after:
                server.kill()
                killed = True
                break
        print()
        if not killed:
            print(f"the story ended before {args.after} pieces of text; nothing was killed")
            return 0
        print(f"✗ kill -9 {server.process.pid if server.process else '?'}")

        started = time.monotonic()
        sf = server.start()
        print(f"✓ restarted in {time.monotonic() - started:.1f}s")
        story = sf.get(story.id)
        kept = "".join(m["content"] for m in story.messages() if m["role"] == "assistant")
        lost = len(shown) - len(kept)
        print(f"committed before the kill ({len(kept)} characters):\n{kept}", end="", flush=True)
        reply = story.generate(
            args.max_tokens, on_text=lambda c: print(c.text, end="", flush=True) if c.kind == "text" else None
        )
        print()
        final = "".join(m["content"] for m in story.messages() if m["role"] == "assistant")
        note = f"; {lost} characters shown but not yet committed were drawn again" if lost > 0 else ""
        print(f"resumed mid-sentence: {len(kept)} characters were durable{note}")
        print(f"the continuation added {reply.tokens} tokens, finish {reply.finish}")
        if not final.startswith(kept):
            print("✗ the committed text is not the beginning of the final reply", file=sys.stderr)
            return 1
        same = "identical" if final.startswith(shown) else "different"
        print(f"✓ the final reply begins with everything committed before the kill; what was shown is {same}")
        return 0
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
