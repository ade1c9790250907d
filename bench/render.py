"""Render docs/benchmarks.md from the figures the bench wrote to bench/results/*.json.

    .venv/bin/python bench/render.py

Each section gets the machine it was measured on and one row per figure: its value, the
target it is held to, whether it met it, and what it is made of. The docs cite this page
instead of copying figures by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGE = HERE.parent / "docs" / "benchmarks.md"


def render(results: Path = HERE / "results") -> str:
    lines = [
        "# Benchmark figures",
        "",
        "Rendered by `bench/render.py` from `bench/results/*.json`, which `bench/run.py` writes; do not edit by hand.",
    ]
    for path in sorted(results.glob("*.json")):
        recorded = json.loads(path.read_text())
        machine = recorded["machine"]
        lines += ["", f"## {path.stem}", "", f"{machine['cpu']}, {machine['cores']} cores, {machine['date']}.", ""]
        lines += ["| figure | value | target | met | detail |", "|---|---|---|---|---|"]
        for row in recorded["rows"]:
            met = "yes" if row["passed"] else "**no**"
            lines.append(f"| {row['name']} | {row['value']:.3f} | {row['target']} | {met} | {row['detail']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
