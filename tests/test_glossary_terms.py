"""The chapters' links to the glossary, read from the sources (no build): every ``{term}`` role in
``book/*.md`` names a term that ``book/glossary.md`` defines, no role sits where it cannot render
(a code cell, whose text is Python, or a heading), every page of the book but the first and the
glossary links at least one term, every chapter opens with what it finds, and every page stays at
most 300 lines.

Sphinx checks the first of these too: the ``term`` role warns "term not in glossary" for a target
that no glossary defines (it warns whatever ``nitpicky`` says; the book does not set it), and
``make book`` builds with ``-W --keep-going`` (``qkov_lib.tooling.cache.build_book``), so a typo also
fails the whole build, but only after every chapter has run. This test finds it in a second.
Targets are matched as Sphinx matches them: exactly, else ignoring case.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qkov_lib.tooling.cache import toc_files

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
GLOSSARY = BOOK / "glossary.md"
ROLE = re.compile(r"\{term\}`([^`]+)`")
FENCE = re.compile(r"^(`{3,}|:{3,})(.*)$")
TAKEAWAY = re.compile(r"^(`{3,}|:{3,})\{admonition\}\s+What this\b")
GLUED_FIGURE = re.compile(r"^(?:`{3,}|:{3,})\{glue:figure\}\s+(\S+)")


def glossary_terms(text: str) -> set[str]:
    """Every term of the ``{glossary}`` directives of a MyST page: the unindented lines of the
    directive's body (an entry may have several), not its options."""
    terms: set[str] = set()
    fence = None
    for line in text.splitlines():
        m = FENCE.match(line.strip())
        if fence is None:
            if m and m.group(2).strip().startswith("{glossary}"):
                fence = m.group(1)
            continue
        if m and line.strip().startswith(fence) and not m.group(2).strip():
            fence = None
        elif line and not line[0].isspace() and not line.startswith(":"):
            terms.add(line.strip())
    return terms


def lines(text: str):
    """``(line number, line, kind)`` of a MyST notebook: kind is ``front`` (the YAML header),
    ``code`` (a code cell), ``heading`` or ``markdown`` (prose, directives and their bodies)."""
    fence = None  # the fence of the code cell we are in
    rows = text.splitlines()
    front = bool(rows) and rows[0].strip() == "---"
    for i, line in enumerate(rows, 1):
        s = line.strip()
        if front:
            yield i, line, "front"
            if i > 1 and s == "---":
                front = False
            continue
        m = FENCE.match(s)
        if fence is not None:
            yield i, line, "code"
            if m and s.startswith(fence) and not m.group(2).strip():
                fence = None
            continue
        if m and m.group(2).strip().startswith("{code-cell}"):
            fence = m.group(1)
            yield i, line, "code"
        elif s.startswith("#"):
            yield i, line, "heading"
        else:
            yield i, line, "markdown"


def target(content: str) -> str:
    """The glossary term a role names: ``text <term>`` names ``term``, plain ``term`` itself."""
    m = re.fullmatch(r"(.*?)\s*<([^<>]+)>", content.strip(), re.S)
    return (m.group(2) if m else content).strip()


def term_problems(text: str, terms: set[str]) -> list[str]:
    """Each role of ``text`` that names no term of ``terms`` or sits in a code cell or a heading."""
    lower = {t.lower() for t in terms}
    problems = []
    for i, line, kind in lines(text):
        for m in ROLE.finditer(line):
            name = target(m.group(1))
            if kind in ("code", "heading"):
                where = "code cell" if kind == "code" else kind
                problems.append(f"line {i}: {m.group(0)} in a {where} (it would not render as a link)")
            elif name not in terms and name.lower() not in lower:
                problems.append(f"line {i}: {m.group(0)} names no glossary term ({name!r})")
    return problems


def page_files() -> list[Path]:
    return sorted(p for p in BOOK.glob("*.md") if p != GLOSSARY)


@pytest.fixture(scope="module")
def terms() -> set[str]:
    return glossary_terms(GLOSSARY.read_text(encoding="utf-8"))


def test_the_glossary_defines_the_notation_the_chapters_use(terms):
    assert len(terms) >= 40, sorted(terms)
    needed = {"route ↑", "route ←", "cell", "rescued", "stable ceiling", "DTAP", "AC@0.5", "ACMC", "pair-level",
              "holds", "contradicted", "undecided", "mixed", "matched loss", "parameterization"}
    assert needed <= terms, f"the glossary lacks {sorted(needed - terms)}"


@pytest.mark.parametrize("path", page_files(), ids=lambda p: p.name)
def test_every_term_role_names_a_glossary_term(path, terms):
    problems = term_problems(path.read_text(encoding="utf-8"), terms)
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_a_typo_a_role_in_code_and_a_role_in_a_heading_are_found(terms):
    page = ("---\njupytext: {}\n---\n\n# Title with {term}`cell`\n\nRead at {term}`matched los`, "
            "at {term}`Matched Loss`, at {term}`the matched losses <matched loss>`.\n\n"
            "```{code-cell} ipython3\nglue(\"x\", \"{term}`cell`\")\n```\n\n"
            "::::{admonition} What this chapter finds\n{term}`route ↑` and {term}`seeds <seed intervl>`\n::::\n")
    found = term_problems(page, terms)
    assert len(found) == 4, found
    assert "line 5" in found[0] and "heading" in found[0]
    assert "'matched los'" in found[1] and "code cell" in found[2] and "'seed intervl'" in found[3]


def test_the_glossary_parser_reads_entries_with_several_terms_and_options():
    text = ("# G\n\n```{glossary}\n:sorted:\n\nroute ↑\n  Raising eta_QK.\n\nholds\ncontradicted\n"
            "  A cell's outcome.\n```\n\nholds not a term\n")
    assert glossary_terms(text) == {"route ↑", "holds", "contradicted"}


def test_every_page_but_the_first_links_the_glossary():
    docs = toc_files(ROOT)
    pages = [d for d in docs[1:] if d != "book/glossary"]
    assert pages, docs
    unlinked = [d for d in pages if not ROLE.search((ROOT / f"{d}.md").read_text(encoding="utf-8"))]
    assert not unlinked, f"pages with no link to the glossary: {unlinked}"


@pytest.mark.parametrize("doc", [d for d in toc_files(ROOT)[1:] if d != "book/glossary"])
def test_every_chapter_opens_with_what_it_finds(doc):
    """Right under the title, before any code, a "What this ... finds" admonition; the figure it
    shows (``{glue:figure} key``) is glued by the chapter itself."""
    text = (ROOT / f"{doc}.md").read_text(encoding="utf-8")
    body = [(i, line, kind) for i, line, kind in lines(text) if kind != "front" and line.strip()]
    assert body and body[0][2] == "heading" and body[0][1].startswith("# "), f"{doc}: no title first"
    assert len(body) > 1 and TAKEAWAY.match(body[1][1].strip()), \
        f"{doc}: the line after the title is not a 'What this ...' admonition: {body[1][1] if len(body) > 1 else ''}"
    for i, line, kind in lines(text):
        m = GLUED_FIGURE.match(line.strip())
        if m and kind == "markdown":
            key = m.group(1)
            assert re.search(rf"glue(?:_figure)?\(\s*[\"']{re.escape(key)}[\"']", text), \
                f"{doc}, line {i}: the figure {key!r} is glued nowhere in the chapter"


#: a page is read in one sitting: its source (prose, maths, library calls) stays this short
MAX_LINES = 300


@pytest.mark.parametrize("doc", toc_files(ROOT))
def test_every_page_stays_short(doc):
    """Chapters are thin: narrative, maths and calls into qkov_lib; what grows goes to the library or
    to a page of its own."""
    n = len((ROOT / f"{doc}.md").read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{doc}.md has {n} lines (at most {MAX_LINES})"
