"""The documentation's relative links: every one names a file in the repository, and an anchor a heading in it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "infra" / "README.md",
               ROOT / "kernels" / "README.md", *(ROOT / "workers" / "assets").glob("*/README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
EXTERNAL = ("http://", "https://", "mailto:")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (lowercase, punctuation dropped, spaces to dashes)."""
    text = FENCE.sub("", path.read_text())
    slugs: set[str] = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = 0
        while (f"{slug}-{n}" if n else slug) in slugs:
            n += 1
        slugs.add(f"{slug}-{n}" if n else slug)
    return slugs


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Relative links in ``path`` whose file is missing (or outside ``root``), or whose anchor is not a heading."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or not linked.is_relative_to(root):
            broken.append(f"{target}: not a file in the repository")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_the_readme_links_to_every_page_in_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name}" not in readme] == []


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    page = repo / "page.md"
    page.write_text("# Top\n\n## Run, operate, deploy\n\n[a](#top) [b](#run-operate-deploy) [c](gone.md) [d](#nope) "
                    "[e](https://example.com/x) [f](page.md#top)\n\n```\n[g](in-code.md)\n```\n")
    (repo / "docs" / "inside.md").write_text("[up](../page.md#top) [out](../../elsewhere.md)\n")
    (tmp_path / "elsewhere.md").write_text("# outside the repository\n")
    assert broken_links(page, repo) == ["gone.md: not a file in the repository", "#nope: no heading #nope"]
    assert broken_links(repo / "docs" / "inside.md", repo) == ["../../elsewhere.md: not a file in the repository"]
