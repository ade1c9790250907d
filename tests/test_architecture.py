"""docs/architecture.md and the package agree: every module is named on it, every folder has its row,
and nothing below the command line imports from it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "superfluid"
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def modules() -> list[Path]:
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def test_every_module_is_named_on_the_architecture_page() -> None:
    unnamed = [str(path) for path in modules() if f"`{path.name}`" not in PAGE and f"{path.stem}`" not in PAGE]
    assert not unnamed, f"docs/architecture.md does not say what these are: {unnamed}"


def test_every_folder_has_its_row() -> None:
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    rows = set(re.findall(r"^\| `(\w+)/` \|", PAGE, re.MULTILINE))
    assert set(folders) == rows, (
        f"folders {sorted(set(folders) - rows)} have no row; rows {sorted(rows - set(folders))} no folder"
    )


def test_nothing_below_the_command_line_imports_from_it() -> None:
    above = {"cli", "__main__.py"}  # `python -m superfluid` is the command line too
    importing = re.compile(r"^\s*from (\.+cli|superfluid\.cli)\b", re.MULTILINE)
    offenders = [str(p) for p in modules() if p.parts[0] not in above and importing.search((PACKAGE / p).read_text())]
    assert not offenders, offenders
