"""The README links every documentation page, and every relative link in the docs lands
on a file and, where it names one, on a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"),
                REPO / "bench" / "METHOD.md", *(REPO / "services").glob("*/README.md")])


def _anchors(page: Path) -> set[str]:
    """GitHub's heading slugs: lowercase, punctuation dropped, spaces to hyphens."""
    slugs = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return slugs


def test_every_relative_link_lands() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_page_and_stays_short() -> None:
    readme = (REPO / "README.md").read_text()
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    missing = [p.relative_to(REPO).as_posix() for p in PAGES
               if p != REPO / "README.md" and p.resolve() not in linked]
    assert not missing, f"pages the README does not link: {missing}"
    assert len(readme.splitlines()) <= 250
