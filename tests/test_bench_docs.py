"""docs/benchmarks.md is what bench/render.py makes of bench/results: no figure edited by hand."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import render  # noqa: E402


def test_the_benchmarks_page_is_rendered_from_the_results() -> None:
    assert list((BENCH / "results").glob("*.json")), "the bench's results are kept"
    assert render.PAGE.read_text() == render.render(), "run .venv/bin/python bench/render.py"
