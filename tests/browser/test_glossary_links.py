r"""Browser test of the glossary links of the built book (``_build/html``) in headless Chromium
(the server, driver and helpers of ``test_book_html.py``).

* On every page of ``_toc.yml``, every link to a glossary term (an ``a.reference`` holding a
  ``.std-term``, what MyST's ``{term}`` role renders) points to ``glossary.html#term-...``, and
  that anchor is a term the glossary page defines (a ``dl.glossary dt`` with that id).
* Every page but the first (which someone reading the book meets before any term) and the
  glossary itself links at least one term, and each chapter's "What this ... finds" box, drawn
  before any code, is there on the page.

Skips as ``test_book_html.py`` does when the book is not built or Chromium is missing
(``QKOV_BROWSER_REQUIRED=1`` makes that a failure).
"""

from __future__ import annotations

import urllib.parse

import pytest
from test_book_html import DOCS, _open, driver, site  # noqa: F401  (fixtures)

GLOSSARY = "book/glossary"
# every term link of the page: where it points, what it says, and the section it sits in
TERM_LINKS = """
return Array.from(document.querySelectorAll('article a.reference')).filter(a => a.querySelector('.std-term'))
  .map(a => ({href: a.href, text: a.innerText.trim(),
              section: (a.closest('section[id]') || {id: ''}).id}));
"""
TAKEAWAY = """
const box = Array.from(document.querySelectorAll('article .admonition'))
  .find(a => /^What this\\b/.test((a.querySelector('.admonition-title') || {innerText: ''}).innerText.trim()));
if (!box) return null;
const firstCode = document.querySelector('article .cell_input, article div.highlight');
return {text: box.innerText.trim().slice(0, 200),
        beforeCode: !firstCode || !!(box.compareDocumentPosition(firstCode) & Node.DOCUMENT_POSITION_FOLLOWING)};
"""


@pytest.fixture(scope="module")
def defined(site, driver) -> set[str]:
    if GLOSSARY not in DOCS:
        pytest.fail(f"{GLOSSARY} is not in _toc.yml any more; name the glossary page here")
    _open(driver, f"{site}/{GLOSSARY}.html")
    ids = set(driver.execute_script(
        "return Array.from(document.querySelectorAll('dl.glossary dt[id]')).map(e => e.id)"))
    assert len(ids) >= 40, f"the glossary defines only {len(ids)} terms"
    return ids


@pytest.mark.parametrize("doc", DOCS)
def test_every_term_link_leads_to_a_term_the_glossary_defines(site, driver, defined, doc):
    _open(driver, f"{site}/{doc}.html")
    links = driver.execute_script(TERM_LINKS)
    bad = []
    for link in links:
        url = urllib.parse.urlsplit(link["href"])
        anchor = urllib.parse.unquote(url.fragment)
        if not url.path.endswith("/glossary.html") or not anchor.startswith("term-") or anchor not in defined:
            bad.append(link)
    assert not bad, f"{doc}: term links that lead to no glossary term: {bad[:5]}"
    if doc not in (DOCS[0], GLOSSARY):
        assert links, f"{doc}: no link to the glossary"


@pytest.mark.parametrize("doc", [d for d in DOCS[1:] if d != GLOSSARY])
def test_every_chapter_shows_what_it_finds_before_any_code(site, driver, doc):
    _open(driver, f"{site}/{doc}.html")
    box = driver.execute_script(TAKEAWAY)
    assert box is not None, f"{doc}: no 'What this ...' box"
    assert box["beforeCode"], f"{doc}: the 'What this ...' box comes after code"
    assert len(box["text"]) > 80, f"{doc}: the 'What this ...' box is nearly empty: {box['text']!r}"
