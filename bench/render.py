"""Render docs/benchmarks.md and the README's summary table from bench/results/*.json.

    .venv/bin/python bench/render.py

bench/run.py writes one file per section (bench/record.py says what a file holds). The page
gets, for each section, the machine, commit, date and settings it was measured with and one
row per figure: its value, what it is compared with, the target it is held to, whether it met
it, and what it is made of. "Where we lose" lists, from the same rows, every figure that missed
its target or trails its baseline. The README's summary table, between its two marker
comments, shows the figures a section marks as headlines. Nothing here is typed by hand:
tests/test_bench_docs.py checks both agree with the files.
"""

from __future__ import annotations

import json
from pathlib import Path

from record import RESULTS, SECTIONS

HERE = Path(__file__).resolve().parent
PAGE = HERE.parent / "docs" / "benchmarks.md"
README = HERE.parent / "README.md"
BEGIN, END = "<!-- bench:summary -->", "<!-- /bench:summary -->"


def load(results: Path = RESULTS) -> list[tuple[str, dict]]:
    """(section, recorded) for every file, in the bench's order of sections."""
    found = {path.stem: json.loads(path.read_text()) for path in results.glob("*.json")}
    order = [s for s in SECTIONS if s in found] + sorted(set(found) - set(SECTIONS))
    return [(section, found[section]) for section in order]


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def shown(row: dict) -> str:
    """A row's value in its unit."""
    value, unit = row["value"], row.get("unit", "")
    if unit == "x":
        return f"{value:.2f}x" if value >= 0.1 else f"{value:.3f}x"
    if unit == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    if unit == "ms":
        return f"{value:.1f} ms"
    if unit == "share":
        return f"{value:.1%}"
    if unit == "tok/s":
        return f"{value:.1f} tok/s"
    if unit == "MiB":
        return f"{value:.0f} MiB"
    return f"{value:.3f}"


def reported_only(row: dict) -> bool:
    """A figure with no target to meet: only shown ("(reported)", "(the price of exactness)", ...)."""
    return row["target"].startswith("(")


def trails(row: dict) -> bool:
    """Whether a ratio is on the wrong side of 1.0 against its baseline."""
    better = row.get("better", "")
    return (better == "higher" and row["value"] < 1.0) or (better == "lower" and row["value"] > 1.0)


def losses(recorded: list[tuple[str, dict]]) -> list[str]:
    """A line for each row that missed its target or trails its baseline."""
    lines = []
    for section, file in recorded:
        for row in file["rows"]:
            missed, behind = not row["passed"], trails(row)
            if not (missed or behind):
                continue
            why = []
            if missed:
                why.append(f"missed its target ({row['target']})")
            if behind:
                why.append(f"behind its baseline ({row['better']} is better)")
            of = f" of {row['baseline']}" if row.get("baseline") else ""
            detail = f" {row['detail']}." if row["detail"] else ""
            lines.append(f"- `{section}`, {row['name']}: **{shown(row)}**{of}; {' and '.join(why)}.{detail}")
    return lines


def machine_line(file: dict) -> str:
    machine = file["machine"]
    parts = [machine.get("cpu") or "an unrecorded CPU", f"{machine.get('cores', '?')} cores"]
    if machine.get("ram_gib"):
        parts.append(f"{machine['ram_gib']:g} GiB RAM")
    if machine.get("os"):
        parts.append(machine["os"])
    commit = file.get("commit", "not recorded")
    short = commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")
    return f"{', '.join(parts)}; commit `{short}`, {file.get('date') or machine.get('date', '')}."


def settings_line(file: dict) -> str:
    settings = file.get("settings")
    if settings is None:
        return "Settings not recorded."
    workloads = "quick workloads" if settings.get("quick") else "full workloads"
    rounds = settings.get("rounds")
    rounds_text = f"{rounds} round{'s' if rounds != 1 else ''} of each repeated measure" if rounds else "default rounds"
    return f"Settings: {workloads}, {rounds_text}, {settings.get('threads', '?')} threads."


def render(results: Path = RESULTS) -> str:
    recorded = load(results)
    lines = [
        "# Benchmark figures",
        "",
        "Rendered by `bench/render.py` from `bench/results/*.json`, which `bench/run.py` writes; do not edit by hand.",
        "A ratio (`x`) is superfluid's figure over its baseline's; each file also keeps every round's raw values.",
        "",
        "## Where we lose",
        "",
        "Every figure below that missed its target, or whose ratio is on the wrong side of its baseline:",
        "",
    ]
    lines += losses(recorded) or ["- none measured."]
    for section, file in recorded:
        lines += ["", f"## {section}", "", machine_line(file), settings_line(file), ""]
        lines += ["| figure | value | baseline | target | met | detail |", "|---|---|---|---|---|---|"]
        for row in file["rows"]:
            met = "reported" if reported_only(row) else "yes" if row["passed"] else "**no**"
            cells = [row["name"], shown(row), row.get("baseline") or "", row["target"], met, row["detail"]]
            lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def summary(results: Path = RESULTS) -> str:
    """The README's summary table: the headline figures, and where they were measured."""
    recorded = load(results)
    headlines = [(section, row) for section, file in recorded for row in file["rows"] if row.get("headline")]
    if not headlines:
        return "No headline figure has been measured yet: `make bench` measures them."
    lines = ["| figure | superfluid / baseline | baseline | better | target | met |", "|---|---|---|---|---|---|"]
    for _, row in headlines:
        met = "reported" if reported_only(row) else "yes" if row["passed"] else "**no**"
        cells = [row["headline"], shown(row), row.get("baseline", ""), row.get("better", ""), row["target"], met]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    where: dict[str, list[str]] = {}
    files = dict(recorded)
    for section in dict.fromkeys(section for section, _ in headlines):
        file = files[section]
        machine = f"{file['machine'].get('cpu', '?')}, {file['machine'].get('cores', '?')} cores"
        quick = " (quick workloads)" if (file.get("settings") or {}).get("quick") else ""
        where.setdefault(machine, []).append(f"`{section}`{quick}")
    measured = "; ".join(f"{machine}: {', '.join(sections)}" for machine, sections in where.items())
    lines += ["", f"Measured on {measured}. Every figure, and where we lose: [docs/benchmarks.md](docs/benchmarks.md)."]
    return "\n".join(lines)


def with_summary(readme: str, results: Path = RESULTS) -> str:
    """`readme` with the text between its markers replaced by the summary table."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + summary(results) + "\n" + readme[end:]


if __name__ == "__main__":
    PAGE.write_text(render())
    README.write_text(with_summary(README.read_text()))
    print(f"wrote {PAGE} and the summary in {README}")
