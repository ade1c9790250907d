"""docs/benchmarks.md and the README's summary table are what bench/render.py makes of
bench/results: no figure edited by hand, and every result file in the shape bench/record.py writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import record  # noqa: E402
import render  # noqa: E402

RUN = "run .venv/bin/python bench/render.py"


def test_the_benchmarks_page_is_rendered_from_the_results() -> None:
    assert list(record.RESULTS.glob("*.json")), "the bench's results are kept"
    assert render.PAGE.read_text() == render.render(), RUN


def test_the_readme_summary_is_rendered_from_the_results() -> None:
    readme = render.README.read_text()
    assert readme.count(render.BEGIN) == 1 and readme.count(render.END) == 1, "the README keeps both markers"
    assert readme == render.with_summary(readme), RUN


def test_every_result_file_says_where_and_when_it_was_measured() -> None:
    for path in record.RESULTS.glob("*.json"):
        recorded = json.loads(path.read_text())
        assert recorded["section"] == path.stem in record.SECTIONS, path
        assert {"cpu", "cores", "ram_gib", "os"} <= set(recorded["machine"]), path
        assert recorded["commit"] and recorded["date"] and "quick" in recorded["settings"], path
        assert recorded["rows"], path
        for row in recorded["rows"]:
            assert tuple(row) == record.ROW_FIELDS, (path, row["name"])
            assert row["better"] in ("", "higher", "lower") and (row["unit"] == "x" or not row["better"]), row
            assert row["rounds"] and all(row["rounds"].values()), (path, row["name"], "every round's raw values")


def test_what_save_writes_is_what_render_reads(tmp_path: Path) -> None:
    rows = [
        record.Result("ahead", 0.5, "<= 1.0", True, "a detail", "x", "llama-server", "lower", "a headline", {"s": [1]}),
        record.Result("behind", 0.8, ">= 0.95", False, "", "x", "the raw loop", "higher", rounds={"tok/s": [2, 3]}),
        record.Result("seconds", 1.25, "(reported)", True, "", "s", rounds={"s": [1.25]}),
    ]
    path = record.save("socket", rows, {"quick": True, "rounds": 1, "threads": 2}, tmp_path)
    assert json.loads(path.read_text())["rows"][1]["rounds"] == {"tok/s": [2, 3]}
    page = render.render(tmp_path)
    assert "| ahead | 0.50x | llama-server | <= 1.0 | yes | a detail |" in page
    assert "| seconds | 1.250 s |  | (reported) | reported |  |" in page
    where_we_lose = page.split("## Where we lose")[1].split("\n## ")[0]
    assert "behind" in where_we_lose and "ahead" not in where_we_lose and "seconds" not in where_we_lose
    block = render.with_summary(f"x\n{render.BEGIN}\nold\n{render.END}\ny\n", tmp_path)
    assert "| a headline | 0.50x | llama-server | lower | <= 1.0 | yes |" in block and "old" not in block
    assert block.startswith("x\n") and block.endswith(f"{render.END}\ny\n")
