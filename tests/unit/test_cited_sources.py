"""What the code and the tests cite lives in the repository: a clone has its oracle (docs/algorithms.md for the
formulas), and no file points at a path outside it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile("/" + "work/|" + r"\.\./" + "shared/")  # written apart, so this file does not match itself
CITED = re.compile(r"docs/[\w./-]+\.md")


def sources() -> list[Path]:
    roots = [REPO / name for name in ("relax_core", "relax_cli", "tests", "docs", "recipes")]
    return [p for root in roots for p in root.rglob("*") if p.suffix in (".py", ".md", ".yaml") and p.is_file()]


def test_no_file_cites_a_path_outside_the_repository():
    found = [f"{p.relative_to(REPO)}:{n}" for p in sources()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, found


def test_every_cited_document_exists_and_the_formulas_have_theirs():
    cited = {m for p in [*sources(), REPO / "README.md"] for m in CITED.findall(p.read_text(errors="replace"))}
    assert "docs/algorithms.md" in cited
    assert all((REPO / doc).is_file() for doc in cited), sorted(doc for doc in cited if not (REPO / doc).is_file())
