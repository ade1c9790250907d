"""Read a document once, then ask several questions about it from forks, all at the same time.

    superfluid serve --web 127.0.0.1:8460        # in another terminal
    python examples/fanout.py --context notes.txt

The document is prefilled once (by a one-token "primer" fork); every question runs in a
fork that starts from the cached prefix, so each branch reports a warm prefix close to
the document's token count, and the four answers stream concurrently.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from superfluid_client import Chunk, Client, Reply, Sampling

QUESTIONS = [
    "Give three bullet points an executive would want.",
    "Explain it to a ten-year-old.",
    "What is the most surprising detail? Quote it.",
    "Write a haiku about it.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=Path, required=True, help="the document to ask about")
    parser.add_argument("--question", action="append", help="a question (repeatable; replaces the built-in four)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--lines", type=int, default=4, help="lines of each answer shown while streaming")
    args = parser.parse_args()
    questions = args.question or QUESTIONS

    sf = Client()
    base = sf.session(
        Sampling(temperature=0.7, seed=args.seed), system="You answer questions about a document. Be concise."
    )
    shared = base.user(f"Here is a document:\n\n{args.context.read_text()}\n\nI will ask you about it.")
    base.assistant("I have read it. Ask away.")

    started = time.monotonic()
    primer = base.fork()
    primer.user("Reply with OK.")
    primer.generate(1)
    shared_tokens = base.inspect()["summary"]["tokens"]
    print(f"document prefilled once: {shared_tokens} tokens in {time.monotonic() - started:.2f}s")

    branches = []
    for i, question in enumerate(questions):
        branch = base.fork(seed=args.seed + i)
        branch.user(question)
        branches.append(branch)

    texts = ["" for _ in branches]
    replies: list[Reply | None] = [None for _ in branches]
    first_chunk: list[float | None] = [None for _ in branches]
    begin = time.monotonic()

    def run(i: int) -> None:
        def on_text(chunk: Chunk) -> None:
            if first_chunk[i] is None:
                first_chunk[i] = time.monotonic() - begin
            if chunk.kind == "text":
                texts[i] += chunk.text

        replies[i] = branches[i].generate(args.max_tokens, on_text=on_text)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(branches))]
    for thread in threads:
        thread.start()
    live = sys.stdout.isatty()
    while any(thread.is_alive() for thread in threads):
        if live:
            draw(questions, texts, args.lines)
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    if live:
        draw(questions, texts, args.lines)
    else:
        for question, text in zip(questions, texts):
            print(f"\n## {question}\n{text.strip()}")

    print()
    finished = [r for r in replies if r is not None]
    print(f"{sum(r.tokens for r in finished)} tokens in {time.monotonic() - begin:.2f}s across {len(finished)} forks")
    for i, reply in enumerate(finished):
        ttft = f"{first_chunk[i]:.2f}s" if first_chunk[i] is not None else "-"
        print(f"  fork {branches[i].id}: warm_prefix {reply.warm_prefix} of {shared_tokens}, first text at {ttft}")
    reused = sum(1 for r in finished if r.warm_prefix >= 0.9 * shared_tokens)
    print(f"reused the document's prefix: {reused} of {len(finished)} forks")
    forks = ", ".join(str(b.id) for b in branches)
    print(f"tree: session {base.id} -> forks {forks} (forked after event {shared.id + 1})")
    return 0


def draw(questions: list[str], texts: list[str], lines: int) -> None:
    out = ["\x1b[2J\x1b[H"]
    for question, text in zip(questions, texts):
        tail = text.strip().splitlines()[-lines:]
        out.append(f"\x1b[1m{question}\x1b[0m\n" + "\n".join(tail) + "\n")
    sys.stdout.write("\n".join(out))
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
