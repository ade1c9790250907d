"""Speculative decoding's figures: decode tok/s with drafts against without, in one run.

Three daemons are up at once, `--speculate off`, `prompt-lookup` and `auto` (each at its
default draft settings), and take turns measure by measure, in an order that rotates, five
rounds (this machine drifts by 10-20% over minutes, so a ratio is the median of the rounds'
ratios). Two workloads, at 1, 4 and 8 concurrent streams: an agent rewriting a 40-line Python
module with type hints (it repeats most of what it was shown: what prompt lookup drafts well;
the embedded model copies it rather than adding the hints), and free-form chat (less to draft:
where `auto` must cost nothing). Each stream is 256 greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import load
import numpy as np
from peer import Superfluid
from record import Result

from superfluid.metrics import read_metric

MODES = ("off", "prompt-lookup", "auto")
TOKENS = 256
ROUNDS = 5  # of each measure, taking turns
LOG_GATE = ("--log-filter", "superfluid.scheduler=info,warn")


NAMES = ("grid", "route", "shape", "track", "field", "plot", "zone", "path", "area", "mesh", "chart", "patch")


def module(seed: int) -> str:
    """A 40-line Python module without type hints (six small geometry functions), different for every seed."""
    return f"""\"\"\"Helpers for polygons given as lists of (x, y) points.\"\"\"

import math

ORIGIN = (0.0, 0.0)


def distance(a, b):
    dx = a[0] - b[0]
    dy = a[1] - b[1]
    return math.sqrt(dx * dx + dy * dy)


def centroid(points):
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return sum(xs) / len(xs), sum(ys) / len(ys)


def scale(points, factor={seed}):
    return [(x * factor, y * factor) for x, y in points]


def bounding_box(points):
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return min(xs), min(ys), max(xs), max(ys)


def perimeter(points):
    total = 0.0
    for i in range(len(points)):
        total += distance(points[i], points[i - 1])
    return total


def describe_{NAMES[seed % len(NAMES)]}(name, points):
    box = bounding_box(points)
    size = perimeter(points)
    return f"{{name}}: {{len(points)}} points, box {{box}}, perimeter {{size:.2f}}"
"""


def rewrite(seed: int) -> load.Chat:
    ask = f"Rewrite this Python module with type hints, changing nothing else:\n\n{module(seed)}"
    return load.Chat([{"role": "user", "content": ask}], TOKENS)


def chat(seed: int) -> load.Chat:
    return load.Chat([{"role": "user", "content": f"Tell me a long story about lighthouse keeper {seed}."}], TOKENS)


def spec_figures(root: Path, quick: bool, threads: int, rounds: int | None = None) -> list[Result]:
    """Each mode's decode rate over `off`'s, by workload and streams; how many drafts were kept."""
    rounds = rounds or (1 if quick else ROUNDS)
    daemons = {  # the gate's decisions go to each log
        mode: Superfluid(
            root / f"spec-{mode}", 4096, 8, "--threads", str(threads), "--no-park", "--speculate", mode, *LOG_GATE
        )
        for mode in MODES
    }
    rates: dict[tuple[str, str, int], list[float]] = {}
    try:
        for daemon in daemons.values():
            daemon.start()
            load.send(daemon.url, load.Chat([{"role": "user", "content": "Hello."}], 4))
        seed = 1
        for workload, make in (("rewrite", rewrite), ("chat", chat)):
            for streams in (1, 4, 8):
                for turn in range(rounds):
                    for mode in MODES[turn % len(MODES) :] + MODES[: turn % len(MODES)]:  # who goes first rotates
                        chats = [make(seed + i) for i in range(streams)]
                        rate = load.decode_rate(load.together(daemons[mode].url, chats))
                        rates.setdefault((workload, mode, streams), []).append(rate)
                    seed += streams
                print(
                    f"spec: {workload}, {streams} streams: "
                    + ", ".join(
                        f"{m} {np.median(rates[(workload, m, streams)]):.1f} tok/s "
                        f"({', '.join(f'{r:.0f}' for r in rates[(workload, m, streams)])})"
                        for m in MODES
                    ),
                    flush=True,
                )
        acceptance = {}
        for mode, daemon in daemons.items():
            exposition = httpx.get(f"{daemon.url}/metrics", timeout=10).text
            proposed = read_metric(exposition, "superfluid_spec_proposed_total")
            accepted = read_metric(exposition, "superfluid_spec_accepted_total")
            acceptance[mode] = (accepted, proposed)
    finally:
        for daemon in daemons.values():
            daemon.stop()
    rows = []
    for workload in ("rewrite", "chat"):
        for streams in (1, 4, 8):
            plain = rates[(workload, "off", streams)]
            off = float(np.median(plain))
            for mode in ("prompt-lookup", "auto"):
                mine = float(np.median(rates[(workload, mode, streams)]))
                # each round's ratio is of measures taken seconds apart: the machine's drift cancels out
                ratios = [r / o for r, o in zip(rates[(workload, mode, streams)], plain, strict=True)]
                ratio = float(np.median(ratios))
                if mode == "auto":
                    target = ">= 1.5" if (workload, streams) == ("rewrite", 1) else ">= 0.97"
                    passed = ratio >= (1.5 if target == ">= 1.5" else 0.97)
                else:
                    target, passed = "(reported)", True
                rows.append(
                    Result(
                        f"{workload}, {streams} stream{'s' if streams > 1 else ''}: {mode} / off",
                        ratio,
                        target,
                        passed,
                        f"{mine:.1f} vs {off:.1f} tok/s; rounds {', '.join(f'{r:.2f}' for r in ratios)}",
                        "x",
                        "--speculate off",
                        "higher",
                        rounds={
                            f"{mode} tok/s": rates[(workload, mode, streams)],
                            "off tok/s": plain,
                            "ratio": ratios,
                        },
                    )
                )
    for mode in ("prompt-lookup", "auto"):
        accepted, proposed = acceptance[mode]
        share = accepted / proposed if proposed else 0.0
        rows.append(
            Result(
                f"drafted tokens accepted, {mode}",
                share,
                "(reported)",
                True,
                f"{accepted:.0f} of {proposed:.0f}",
                "share",
                rounds={"accepted": [accepted], "proposed": [proposed]},
            )
        )
    log = daemons["auto"].log.read_text()
    kept = log.count("speculation on at ")
    dropped = log.count("speculation off at ")
    rows.append(
        Result(
            "auto's probes that kept drafts",
            kept / max(1, kept + dropped),
            "(reported)",
            True,
            f"{kept} of {kept + dropped}",
            "share",
            rounds={"kept": [kept], "dropped": [dropped]},
        )
    )
    return rows
