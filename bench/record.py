"""What a bench section measured, and where it is kept: bench/results/SECTION.json.

Every section returns `Result` rows; `save` writes them with the machine they were measured
on, the commit and the date. bench/render.py renders docs/benchmarks.md and the README's
summary table from these files, so no figure is typed by hand. This module imports nothing
heavy: the test of the rendered pages reads it.

A file holds:

    section   the section's name (SECTIONS)
    machine   cpu, cores, ram_gib, os
    commit    `git rev-parse HEAD`, with "+dirty" when the tree differs from it (results left out)
    date      the day of the run (YYYY-MM-DD)
    settings  quick (smaller workloads), rounds (--rounds, or null for the section's own), threads
    rows      one per figure, as `Result` below (`asdict`)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTIONS = (
    "engine",
    "http",
    "socket",
    "park",
    "startup",
    "spec",
    "ui",
    "cluster",
    "agents",
    "engine-large",
    "engine-q4km",
    "engine-q5k",
    "http-large",
    "sustained",
    "sustained-large",
)
ROW_FIELDS = ("name", "value", "unit", "baseline", "better", "target", "passed", "detail", "headline", "rounds")


@dataclass
class Result:
    """One figure.

    `value` is the median of its rounds (for a paired ratio, the median round's ratio); `unit` is
    "x" for a ratio to `baseline` (what it is compared with: llama-server, the raw llama.cpp
    loop, a cold prefill, ...), else "s", "ms", "tok/s", "MiB" or "share". `better` says which side of
    1.0 beats the baseline ("higher" or "lower"), where beating it means something; `target` is
    what the figure is held to, in parentheses when it is only reported. `headline` is the short
    label of a figure the README's summary shows. `rounds` holds each round's raw values, by what
    they are.
    """

    name: str
    value: float
    target: str
    passed: bool
    detail: str
    unit: str = ""
    baseline: str = ""
    better: str = ""
    headline: str = ""
    rounds: dict[str, list[float]] = field(default_factory=dict)


def median_round(ratios: list[float]) -> int:
    """The index of the median round (the upper one of an even count), shown with its own figures."""
    return int(np.argsort(ratios)[len(ratios) // 2])


def machine() -> dict[str, object]:
    """The CPU model, its cores, the memory and the OS."""
    cpu = ""
    with_cpuinfo = Path("/proc/cpuinfo")
    if with_cpuinfo.exists():
        lines = with_cpuinfo.read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram = 0.0
    try:
        distribution = platform.freedesktop_os_release().get("PRETTY_NAME", "")
    except OSError:
        distribution = ""
    kernel = f"{platform.system()} {platform.release()}"
    return {
        "cpu": cpu or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "ram_gib": round(ram, 1),
        "os": f"{distribution} ({kernel})" if distribution else kernel,
    }


def commit() -> str:
    """HEAD, with "+dirty" when the tree differs from it; the results and the rendered page aside."""
    root = HERE.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":(exclude)bench/results", ":(exclude)docs/benchmarks.md"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if changes.stdout.strip() else "")


def _rounded(values: list[float]) -> list[float]:
    return [float(f"{v:.6g}") for v in values]


def save(section: str, results: list[Result], settings: dict[str, object], directory: Path = RESULTS) -> Path:
    """`results` with the machine, the commit, the date and the run's settings, as directory/SECTION.json."""
    rows = []
    for result in results:
        row = asdict(result)
        row["value"] = float(row["value"])
        row["rounds"] = {what: _rounded(values) for what, values in result.rounds.items()}
        rows.append({key: row[key] for key in ROW_FIELDS})
    recorded = {
        "section": section,
        "machine": machine(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": settings,
        "rows": rows,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{section}.json"
    path.write_text(json.dumps(recorded, indent=2) + "\n")
    print(f"{section}: figures written to {path}", flush=True)
    return path
