"""The glossary: enough terms, each with the chapter that first uses it, and every chapter's link to it resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "GLOSSARY.md"
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"GLOSSARY\.md#([\w-]+)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation and backticks dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def entries() -> dict[str, str]:
    """Each term's anchor and its text, up to the next heading."""
    parts = re.split(r"(?m)^### (.+)$", GLOSSARY.read_text(encoding="utf-8"))
    return {anchor(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def markdown(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_the_glossary_has_at_least_30_terms_each_with_its_first_chapter():
    found = entries()
    assert len(found) >= 30
    names = {p.stem for p in CHAPTERS} | {"14_long_context"}
    for key, text in found.items():
        first = re.search(r"First used: chapter (\d\d) \(`([\w]+)`\)", text)
        assert first, f"{key}: no 'First used: chapter NN (`name`)' line"
        assert first.group(2) in names, f"{key}: unknown chapter {first.group(2)}"


@pytest.mark.parametrize("path", [p for p in CHAPTERS if p.stem[:2] != "00"], ids=lambda p: p.stem)
def test_every_chapter_links_the_glossary_and_every_link_resolves(path):
    links = LINK.findall(markdown(path))
    assert links, f"{path.name} links no term to docs/GLOSSARY.md"
    missing = sorted(set(links) - set(entries()))
    assert not missing, f"{path.name} links terms the glossary does not have: {missing}"
