"""Every relative link of README.md and docs/*.md leads somewhere: the file exists (paths from docs/ start with
../ for the repository's files) and the #anchor is a heading of that page (GitHub's slug of it)."""
from __future__ import annotations

import re

import pytest

from tests import docs_pages

# Pages other branches add (the README's "Training recipes" list links them before they are merged): until then
# the link may lead nowhere; once the page is here it is checked like any other.
PENDING: set[str] = set()
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", _outside_code(page.read_text()), re.M)}


def test_slug_is_githubs():
    assert slug("DP-SGD with Opacus: `--dp`") == "dp-sgd-with-opacus---dp"
    assert slug("The Opacus memory profiler's sweep") == "the-opacus-memory-profilers-sweep"


def _links():
    for page in docs_pages.pages():
        for target in _LINK.findall(_outside_code(page.read_text())):
            if not re.match(r"^[a-z]+:", target):
                yield page, target


@pytest.mark.parametrize("page,target", list(_links()), ids=lambda x: str(x)[-40:])
def test_link_leads_somewhere(page, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    rel = dest.relative_to(docs_pages.ROOT).as_posix() if dest.is_relative_to(docs_pages.ROOT) else str(dest)
    if rel in PENDING and not dest.exists():
        pytest.skip(f"{rel}: a page another branch adds")
    assert dest.exists(), f"{page.name}: {target} leads nowhere"
    if anchor:
        assert anchor in anchors(dest), f"{page.name}: {target}: no such heading in {rel}"


def test_the_readme_keeps_its_contract():
    """The README starts with what memlens is, then the two set-up commands; under 300 lines; every docs page is
    linked from it."""
    readme = (docs_pages.ROOT / "README.md").read_text()
    assert readme.startswith("# memlens\n\nmemlens predicts, measures and explains")
    assert "make demo" in readme and "make test" in readme
    assert readme.index("make demo") < readme.index("## Quickstart")
    assert len(readme.splitlines()) < 300
    linked = {t.partition("#")[0] for t in _LINK.findall(readme)}
    assert sorted(p.relative_to(docs_pages.ROOT).as_posix() for p in docs_pages.pages()[1:]
                  if p.relative_to(docs_pages.ROOT).as_posix() not in linked) == []
