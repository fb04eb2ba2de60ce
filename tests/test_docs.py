"""The README and docs stand alone: every link resolves inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target): the target up to a space or ')'; an optional "#anchor" is ignored.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _local_links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]


def test_every_local_link_resolves_inside_the_repository() -> None:
    seen = 0
    for doc in DOCS:
        for target in _local_links(doc):
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            assert path.is_relative_to(REPO), f"{doc.name}: {target} points outside the repository"
            assert path.exists(), f"{doc.name}: {target} does not exist"
            seen += 1
    assert seen >= 30  # the README alone links every doc: a broken regex would find none


def test_the_link_check_catches_an_outside_link(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("see [ctx](../shared/CONTEXT.md) and [web](https://example.com/a)\n")
    assert _local_links(doc) == ["../shared/CONTEXT.md"]
