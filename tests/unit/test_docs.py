"""The documentation: the README stays a front door (small, with the commands a newcomer runs), and
every relative link in the README, docs/*.md, deploy/README.md, bench/report.md and bench/results/
points at a file that exists and, with a `#anchor`, at a heading of that page (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_BYTES = 15_000
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy/README.md", ROOT / "bench/report.md",
         *sorted((ROOT / "bench/results").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but `-` and `_` dropped,
    spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        if m := HEADING.match(line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


def relative_links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose(page.read_text()) for m in LINK.finditer(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(1))]  # http:, https:, mailto: are not checked


def test_slug_follows_github():
    assert slug("The second topology: local SGD (`topology: local_sgd`)") == \
        "the-second-topology-local-sgd-topology-local_sgd"
    assert slug("Inspecting a run: `brigade ctl`") == "inspecting-a-run-brigade-ctl"


def test_readme_is_a_front_door():
    assert README.stat().st_size <= MAX_README_BYTES, (
        f"README.md is {README.stat().st_size} bytes, over {MAX_README_BYTES}: move reference text to docs/")
    text = README.read_text()
    for command in ("make demo", "make test"):
        assert command in text, f"README.md does not show `{command}`"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_configuration_tables_are_generated_from_the_declarations():
    """docs/configuration.md's tables (each service's settings, the run spec, the wire limits) are
    what `make docs-tables` writes from their declarations today."""
    from brigade_cli.docs_tables import with_tables

    page = ROOT / "docs/configuration.md"
    assert with_tables(page.read_text()) == page.read_text(), (
        "docs/configuration.md's generated tables are stale: run `make docs-tables` and commit")
