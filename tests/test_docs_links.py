"""Documentation: every relative link and anchor resolves, every cited docs/ page and
"docs/spec.md section N" exists."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "tests/golden/README.md",
                *(ROOT / "docs").glob("*.md")])
CITING = sorted(p for pattern in ("delta_jax/**/*.py", "tests/*.py", "configs/*.yaml",
                                  "launch/*", "Makefile", "*.md", "docs/*.md")
                for p in ROOT.glob(pattern) if p.is_file())
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def headings(page: Path) -> list[str]:
    """The page's headings (outside code blocks), in order."""
    out, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.append(line.lstrip("#").strip())
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(ROOT)}: link {target!r} names a missing file"
        assert file.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: {target!r} leaves the repo"
        if fragment and file.suffix == ".md":
            assert fragment in map(anchor, headings(file)), (
                f"{page.relative_to(ROOT)}: link {target!r}: no heading with that anchor")


def test_cited_docs_exist():
    spec_sections = {m.group(1) for h in headings(ROOT / "docs/spec.md")
                     if (m := re.match(r"(\d+)\. ", h))}
    for source in CITING:
        text = source.read_text(errors="replace")
        for cited in re.findall(r"\bdocs/[\w\-/]+\.md", text):
            assert (ROOT / cited).exists(), f"{source.relative_to(ROOT)} cites missing {cited}"
        for numbers in re.findall(r"docs/spec\.md,? sections? ([\d, and]+\d)", text):
            for n in re.findall(r"\d+", numbers):
                assert n in spec_sections, (
                    f"{source.relative_to(ROOT)} cites docs/spec.md section {n}, which does "
                    f"not exist (sections: {sorted(spec_sections, key=int)})")


def test_no_citation_leaves_the_repository():
    """The repository stands alone: nothing cites the spec or goldens outside it."""
    for source in CITING:
        if source == Path(__file__).resolve():
            continue
        text = source.read_text(errors="replace")
        for outside in ("SPEC.md", "../shared"):
            assert outside not in text, f"{source.relative_to(ROOT)} cites {outside}"
