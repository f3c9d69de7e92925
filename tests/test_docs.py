"""The documentation's size budget and its relative links: every ``[text](target)`` in README.md,
records/README.md and docs/*.md that is not a web address names a file or folder that exists, and
an ``#anchor`` names a heading of its page (GitHub's slug: lower case, punctuation dropped, spaces
to hyphens)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "records" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading):
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def links(page):
    """Relative link targets of a page, outside code blocks."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_slug_matches_githubs_form():
    assert slug("compare.py: is B better than A?") == "comparepy-is-b-better-than-a"
    assert slug("Tolerances of `--rerun`") == "tolerances-of---rerun"
    assert slug("Running on 1, 2, 4 or 8 GPUs, and on CPU") == "running-on-1-2-4-or-8-gpus-and-on-cpu"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_pages_stay_within_their_budget():
    """Issue 45: the README at most 15,000 characters; README, records/README.md and docs/ at most 110,000."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8")) for p in PAGES}
    assert sizes["README.md"] <= 15_000 and sizes[str(Path("records", "README.md"))] <= 15_000, sizes
    assert sum(sizes.values()) <= 110_000, sizes


def test_every_docs_page_is_linked_from_the_readme():
    readme = set(links(ROOT / "README.md"))
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md links no docs/{missing}"
