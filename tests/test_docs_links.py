"""Every relative link in the README and docs/ reaches a file that exists and, with a
``#fragment``, a heading of that file (GitHub's anchor rule: lower-case, punctuation dropped,
spaces to dashes). The benchmark summary links each row to its section; a renamed heading
must not leave a reader at the top of a 2,000-line page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#+ (.*)", line)):
            found.add(slug(m.group(1)))
    return found


def test_slug_follows_githubs_rule() -> None:
    assert slug("Goodput at the SLO: the default (simulator, 8 workers)") == (
        "goodput-at-the-slo-the-default-simulator-8-workers"
    )
    assert slug("`kvgate bench` and `kvgate simulate`") == "kvgate-bench-and-kvgate-simulate"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_reach_their_file_and_heading(page: Path) -> None:
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{link}: no such heading")
    assert not broken, broken
