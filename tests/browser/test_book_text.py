r"""The built book's prose agrees with what the book shows and ships (``qkov_lib.tooling.booktext``).

Over every page of the built ``_build/html``: no list of ratios in prose differs from the page's
settings or the ratios it ran, no sentence or column promises intervals that its table does not
show, and no reference names a file or page that is not there (a broken link, a repository path
or ``qkov_lib`` name in a code span that the checkout lacks, a README the book does not contain,
"the <name> page" of no page). No browser is needed: the pages are read as files. Also checks that
the checks saw the book: every page of ``_toc.yml`` was read and has prose, and every ratio list
of a chapter's results file is one the check read from that chapter's tables.

Skips when the book is not built; set ``QKOV_BROWSER_REQUIRED=1`` (CI) to make that a failure
instead. Paths: ``QKOV_BOOK_ROOT`` (default: the repository), ``QKOV_HTML_DIR`` (default:
``<root>/_build/html``), ``QKOV_RESULTS_DIR`` (default: ``<html>/../results``, the chapters'
results files).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qkov_lib.tooling import booktext
from qkov_lib.tooling.cache import toc_files

ROOT = Path(os.environ.get("QKOV_BOOK_ROOT", Path(__file__).resolve().parents[2]))
HTML = Path(os.environ.get("QKOV_HTML_DIR", ROOT / "_build" / "html"))
RESULTS = Path(os.environ.get("QKOV_RESULTS_DIR", HTML.parent / "results"))
REQUIRED = os.environ.get("QKOV_BROWSER_REQUIRED", "") not in ("", "0")


@pytest.fixture(scope="module")
def html() -> Path:
    if not (HTML / "index.html").exists():
        if REQUIRED:
            pytest.fail(f"book text test required but the book is not built ({HTML / 'index.html'} missing)")
        pytest.skip(f"the book is not built ({HTML / 'index.html'} missing; run `make book`)")
    return HTML


@pytest.fixture(scope="module")
def findings(html) -> list[booktext.Finding]:
    return booktext.check_book(html, RESULTS, ROOT)


def test_the_checks_read_every_page_and_the_ratios_each_chapter_ran(html):
    docs = toc_files(ROOT)
    assert docs, "no page in _toc.yml"
    assert {p.relative_to(html).with_suffix("").as_posix() for p in booktext.pages(html)} >= set(docs)
    for doc in docs:
        page = booktext.parse_page((html / f"{doc}.html").read_text(errors="replace"), doc)
        assert page.title and any(b.kind == "prose" for b in page.blocks), f"{doc}: no title or no prose read"
        ran = booktext.results_ratio_sets(booktext.read_results(RESULTS, booktext.chapter_of(doc)))
        shown = booktext.table_ratio_sets(page)
        for ratios in ran:  # what the chapter ran is what its settings table shows, as the check reads it
            assert ratios in shown, f"{doc}: ran ratios {sorted(ratios)}, the check read {[sorted(s) for s in shown]}"


@pytest.mark.parametrize("kind", booktext.KINDS)
def test_no_untrue_text_in_the_built_book(findings, kind):
    found = [f for f in findings if f.kind == kind]
    assert not found, f"{len(found)} {kind} finding(s):\n" + "\n".join(f"{f.page}: {f.text}" for f in found)
