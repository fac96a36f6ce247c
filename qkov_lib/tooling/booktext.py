"""Checks that the built book's prose agrees with what the book shows and ships.

Reads the HTML that Jupyter Book 1 (Sphinx) wrote to ``_build/html`` and returns findings
``(page, kind, text)``: ``page`` is the page's path without ``.html`` (``book/05_squad``),
``kind`` one of :data:`KINDS`, ``text`` the sentence (or reference) at fault and why. Only a page's
``<article>`` is read; code cell inputs and printed outputs (``<pre>``) are not prose. Text that a
chapter glued (``{glue:text}``, computed when the book was built) is told apart from typed text.

- ``ratios`` (:func:`ratio_findings`): a list of ratios eta_QK/eta_OV in prose: a set
  ("r ∈ {1, 10, 100}", "η_QK/η_OV grows in {1, 10, 100}", "ratios {1, 10}") or a list after
  "ratios" ("ratios 1, 3 and 10"). The lists the page shows or ran are the ``ratios``/``*_ratios``
  rows and columns of its tables (the settings table), the values of a ``ratio`` column and the
  ``N`` of ``ratio N`` headers, and the ``ratios``/``*_ratios`` parameters of the page's results
  file (``<results>/<chapter>.json``, the chapter being the page's name without its number:
  ``05_squad`` -> ``squad``); a page with none of its own is held to those of every page. A set,
  and a list typed in the source, must equal one of them (as sets); a list in glued text, computed
  by the chapter (say, the ratios at which something holds), must be part of one. A list whose
  sentence, or the lead-in of the bullet list it sits in, names the paper states the paper and is
  not held to the build.
- ``intervals`` (:func:`interval_findings`): a sentence that says a table shows intervals
  ("mean ± 95% seed interval", "with 95% seed intervals", "with its 95% half-width"), in the last
  prose block before the table (no heading, figure or other prose between), needs an interval in
  the table or the tables shown with it: a cell with ``±`` or ``[lo, hi]``, or a half-width
  column (header ``±``, ``X ±``, ``± (seeds)``, ``*_ci``, ``ci_lo``/``ci_hi``, ``half-width``)
  with a number in it. A sentence that says what happens with one seed ("blank with one seed")
  holds with no interval where the page ran one seed (a ``seeds``/``*_seeds`` list of length 1,
  or a ``seeds`` column of 1s). A column whose header says "X ± Y" or "interval" needs a cell with
  an interval itself, a half-width column a number.
- ``verdicts`` (:func:`verdict_findings`): a table cell under a claim's column (``R1`` ... ``T6``,
  an ID of :data:`qkov_lib.claims.ESTIMANDS`) that reads ``holds: +0.154 ± 0.030 (n = 8)`` must say the
  outcome its interval gives against that claim's margin (:func:`qkov_lib.claims.outcome`, up to the
  printed rounding); and a sentence that states a finding over cells ("everywhere", "over the whole
  range", "as summary A says", "for FACO, CACO") must be glued (computed from the cells it quantifies
  over), never typed.
- ``references`` (:func:`reference_findings`): a relative link must resolve to a file of the
  built site; a file path in a code span (``tests/test_head_model.py``, ``benchmarks/README.md``,
  ``tests/test_realmap.py::test_x``) must exist in the repository checkout (and the test it names
  must be defined there), unless it lies under a folder the build or a command creates
  (:data:`GENERATED_DIRS`) or holds a placeholder (``$``, ``<``, ``*``, ``{``); a dotted
  ``qkov_lib.`` name in a code span must be a module of the checkout, and the name after it one
  that module defines at top level; a README named in prose outside a link is a file the book
  does not contain; "the <name> page/chapter", in a sentence with no link, must name a page of the
  book (every word of ``<name>`` in its title or file name), and "chapter N" a numbered page.
- ``sources`` (:func:`source_findings`): every figure (an image of the page) is followed, before the
  next figure or heading, by its source line (:mod:`qkov_lib.figure_source`: "Drawn by `f` from
  `x.json`, key `k`"), and the key is in that results file (the function's existence is a
  ``references`` check).

:func:`check_book` runs all five over every page; ``python -m qkov_lib.tooling.booktext
_build/html`` prints the findings and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

KINDS = ("ratios", "intervals", "references", "verdicts", "sources")
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
        "track", "wbr"}
BLOCK_TAGS = {"p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "caption", "figcaption"}
CONTAINERS = {"ul", "ol", "dl", "table", "div", "img", "section", "blockquote", "figure"}
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
SKIP_TAGS = {"script", "style", "pre", "nav", "template", "noscript", "button"}
SKIP_CLASSES = {"cell_input", "headerlink", "toctree-wrapper"}
GLUE_CLASSES = {"pasted-text", "pasted-inline"}
# folders the build or a command writes (not in a checkout), and absolute paths: not checked
GENERATED_DIRS = ("_build/", "runs/", ".venv/", "/")
PLACEHOLDER = re.compile(r"[$<>*{}~]")
FILE_EXT = ("md", "py", "json", "yml", "yaml", "toml", "txt", "ipynb", "csv", "cfg", "sh", "ini", "html", "rst",
            "parquet", "jsonl", "tsv", "lock")
PATH_TOKEN = re.compile(r"^(?:\.{1,2}/)?[\w.+-]+(?:/[\w.+-]+)*\.(?:%s)(?:::[\w\[\]-]+)*$" % "|".join(FILE_EXT))
MODULE_TOKEN = re.compile(r"^qkov_lib(?:\.\w+)+$")
NUM = r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"
_END = r"(?!\d|\.\d|\s*%|\s*/|\s+of\b|\s+(?:runs?|seeds?|steps?|layers?|heads?)\b)"
LIST = rf"(?:{NUM}(?:\s*,\s*{NUM})*\s*,?\s*(?:and|or)\s+{NUM}|{NUM}(?:\s*,\s*{NUM})+){_END}"
RATIO_EXPR = r"(?:η_QK\s*/\s*η_OV|eta_QK\s*/\s*eta_OV|learning[- ]rate ratio)"
# a set: "r ∈ {1, 10, 100}", "η_QK/η_OV grows in {1, 10, 100}", "ratios {1, 10}"
_RATIO_SET = re.compile(rf"(?:\br\s*[∈=]\s*|(?:{RATIO_EXPR}|\bratios?\b)[^.;{{}}\[\]]{{0,60}}?"
                        rf"(?:[∈=:]|\bin\b|\bover\b|\bof\b)?\s*)[{{\[]\s*({LIST})\s*[}}\]]")
# a list after "ratios": "ratios 1, 3 and 10", "at the ratios 0.1, 10, 100"
_RATIO_LIST = re.compile(rf"\bratios\s+(?:(?:of|in|from|at)\s+|[∈=:]\s*)?({LIST})")
_SETTING_KEY = re.compile(r"^(?:\w+_)?ratios$")
_SEEDS_KEY = re.compile(r"^(?:\w+_)?seeds$")
_NUM_LIST = re.compile(rf"^[\[({{]\s*(?:{NUM}(?:\s*,\s*{NUM})*)?\s*,?\s*[\])}}]$")
_RATIO_HEADER = re.compile(rf"^ratio\s+({NUM})$")
_INTERVAL_CLAIM = re.compile(r"±|\bhalf[- ]widths?\b|\b(?:seed|confidence|student-t)\s+intervals?\b"
                             r"|\b95\s*%\s*(?:[\w-]+\s+){0,2}intervals?\b|\bwith\s+(?:its|their|the)\s+intervals?\b",
                             re.I)
# a sentence that uses an interval (to decide, to test) rather than saying that a table shows one
_INTERVAL_USE = re.compile(r"intervals?\s+(?:excludes?|contains?|includes?|clears?|lies|is\s+above|is\s+below)"
                           r"|\b(?:decided|computed)\s+(?:on|from)\b|\breads?\s+the\b|\bapplied\s+to\b", re.I)
_ONE_SEED = re.compile(r"\b(?:one|a single|1)\s+seed\b", re.I)
_CELL_INTERVAL = re.compile(rf"±|\[\s*-?{NUM}\s*,\s*-?{NUM}\s*\]")
_HALF_WIDTH_HEADER = re.compile(r"^(?:[\w@.-]+\s+)?±(?:\s*\(.*\))?$|\bhalf[- ]?width\b"
                                r"|(?:^|[_\s])ci(?:95)?(?:[_\s](?:lo|hi|low|high|lower|upper))?$", re.I)
_CLAIM_HEADER = re.compile(r"±\s*[\w(]*\w|\binterval", re.I)
_MISSING_CELL = re.compile(r"^(?:|nan|none|null|n/a|—|–|-|not run)$", re.I)
_README = re.compile(r"\bREADME\b")
_STOP = r"(?:of|this|that|these|those|the|a|an|in|on|for|to|and|or|is|are|was|its|their|each|every|our|with|by|from)"
_PAGE_REF = re.compile(rf"\b(?:the|this book's|our)\s+((?:(?!{_STOP}\b)[\w’'&–-]+\s+){{1,3}})(?:page|chapter)s?\b"
                       rf"(?!\s+\d)", re.I)
_NUMBERED_REF = re.compile(r"\bchapters?\s+(\d+)\b", re.I)
GENERIC = {"next", "previous", "last", "first", "following", "same", "one", "own", "whole", "later", "earlier",
           "above", "below", "present", "current", "final", "second", "third", "two", "three", "other",
           "dataset", "book's"}
LINK_MARK = "\u2058"  # stands in the plain text where a link was


class Finding(NamedTuple):
    """One untrue or unresolvable piece of text: the page, the check that caught it, the text."""

    page: str
    kind: str
    text: str


@dataclass
class Block:
    """A prose block (paragraph, list item, heading, caption), a table or a figure of a page.

    ``text``: everything shown, math as plain symbols (:func:`tex_to_text`); ``mask``: one letter
    per character of ``text``: ``t`` typed, ``g`` glued, ``l`` in a link, ``c`` in a code span;
    ``code``: the code spans; ``links``: ``(href, text)`` of every link; ``lead``: for a list item,
    the text of the prose block that introduced its list. A table has ``header`` (one string per
    column, its header rows joined) and ``rows`` (every body row as a full grid row: a cell that
    spans rows or columns repeats in each)."""

    kind: str  # "prose" | "heading" | "table" | "figure"
    tag: str = ""
    text: str = ""
    mask: str = ""
    code: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    lead: str = ""
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)

    @property
    def text_without_code(self) -> str:
        """``text`` with each character of a code span replaced by a space (same length)."""
        return "".join(" " if m == "c" else ch for ch, m in zip(self.text, self.mask))

    @property
    def plain(self) -> str:
        """``text`` outside links and code spans (a link as one :data:`LINK_MARK`, code as spaces)."""
        out, prev = [], ""
        for ch, m in zip(self.text, self.mask):
            if m == "l":
                if prev != "l":
                    out.append(LINK_MARK)
            else:
                out.append(" " if m == "c" else ch)
            prev = m
        return "".join(out)


@dataclass
class Page:
    """A built page: its name (path without ``.html``), title and blocks in reading order."""

    name: str
    title: str
    blocks: list[Block]


def tex_to_text(tex: str) -> str:
    """The plain reading of a TeX fragment as far as the checks need it: delimiters dropped,
    ``\\{``/``\\}`` as braces, ``\\in`` as ``∈``, ``\\eta_{QK}`` as ``η_QK``, ``\\pm`` as ``±``."""
    t = re.sub(r"^\s*(?:\\\(|\\\[|\$\$?)|(?:\\\)|\\\]|\$\$?)\s*$", "", tex.strip())
    t = re.sub(r"\\eta_\{?(\w+)\}?", r"η_\1", t)
    for a, b in ((r"\{", "{"), (r"\}", "}"), (r"\in", " ∈ "), (r"\pm", "±"), (r"\,", " "), (r"\ldots", "…"),
                 (r"\dots", "…"), (r"\cdot", "·"), (r"\times", "×"), (r"\%", "%")):
        t = t.replace(a, b)
    return re.sub(r"\s+", " ", t).strip()


class _Node:
    __slots__ = ("tag", "attrs", "children", "parent")

    def __init__(self, tag: str, attrs: Mapping[str, str], parent: _Node | None):
        self.tag, self.attrs, self.children, self.parent = tag, dict(attrs), [], parent

    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())


class _TreeBuilder(HTMLParser):
    """A forgiving element tree from :mod:`html.parser`: void elements have no children and an end
    tag closes the nearest open element of its name (and those inside it)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = _Node("#root", {}, None)
        self.cur = self.root

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    # <x/>: HTMLParser's handle_startendtag calls handle_starttag, then handle_endtag

    def handle_endtag(self, tag):
        node = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.cur = node.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def _find(node: _Node, pred) -> _Node | None:
    for c in node.children:
        if isinstance(c, _Node):
            if pred(c):
                return c
            hit = _find(c, pred)
            if hit is not None:
                return hit
    return None


def _skipped(node: _Node) -> bool:
    return node.tag in SKIP_TAGS or bool(node.classes() & SKIP_CLASSES)


def _text(node: _Node | str, math: bool = False) -> str:
    """Visible text of ``node`` (math as :func:`tex_to_text`, skipped subtrees left out)."""
    if isinstance(node, str):
        return tex_to_text(node) if math else node
    if _skipped(node):
        return ""
    math = math or "math" in node.classes()
    return (" " if node.tag == "br" else "").join(_text(c, math) for c in node.children)


def _squash(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip()


def _grid(rows: list[list[tuple[str, int, int]]]) -> list[list[str]]:
    """Rows of ``(text, rowspan, colspan)`` cells as full rows: a spanning cell repeats."""
    pending: dict[int, list] = {}  # column -> [text, rows still to fill]
    out = []
    for cells in rows:
        row: list[str] = []
        it = iter(cells)
        while True:
            col = len(row)
            if col in pending:
                text, left = pending[col]
                row.append(text)
                pending[col][1] -= 1
                if pending[col][1] == 0:
                    del pending[col]
                continue
            cell = next(it, None)
            if cell is None:
                if any(c > col for c in pending):  # a spanning cell further right
                    row.append("")
                    continue
                break
            text, rs, cs = cell
            for _ in range(cs):
                if rs > 1:
                    pending[len(row)] = [text, rs - 1]
                row.append(text)
        out.append(row)
    return out


def _span(cell: _Node, attr: str) -> int:
    v = str(cell.attrs.get(attr) or "1")
    return max(int(v), 1) if v.isdigit() else 1


class _Walker:
    def __init__(self):
        self.blocks: list[Block] = []
        self.lead = ""  # text of the last prose block outside a list

    def prose(self, node: _Node, tag: str) -> None:
        chars: list[tuple[str, str]] = []
        code, links = [], []

        def add(s: str, flag: str):
            for ch in s:
                if ch.isspace():
                    if not chars or chars[-1][0] == " ":
                        continue
                    ch = " "
                chars.append((ch, flag))

        def walk(n, flag: str, math: bool):
            if isinstance(n, str):
                add(tex_to_text(n) if math else n, flag)
                return
            cls = n.classes()
            if _skipped(n) or n.tag in BLOCK_TAGS or n.tag in CONTAINERS - {"div"}:
                return
            if n.tag == "a" and n.attrs.get("href") is not None:
                links.append((n.attrs["href"], _squash(_text(n))))
                flag = "l"
            elif n.tag == "code" and flag != "l":
                code.append(_squash(_text(n)))
                flag = "c"
            elif cls & GLUE_CLASSES and flag == "t":
                flag = "g"
            for c in n.children:
                walk(c, flag, math or "math" in cls)

        for c in node.children:
            walk(c, "t", "math" in node.classes())
        while chars and chars[-1][0] == " ":
            chars.pop()
        text = "".join(ch for ch, _ in chars)
        if not text:
            return
        kind = "heading" if tag in HEADINGS else "prose"
        in_list = tag == "li" or _ancestor(node, {"li"})
        self.blocks.append(Block(kind, tag, text, "".join(f for _, f in chars), code, links,
                                 lead=self.lead if in_list else ""))
        if not in_list:
            self.lead = text if kind == "prose" else ""

    def table(self, node: _Node) -> None:
        head: list[list[tuple[str, int, int]]] = []
        body: list[list[tuple[str, int, int]]] = []
        caption = None

        def collect(n: _Node, in_head: bool):
            nonlocal caption
            for c in n.children:
                if not isinstance(c, _Node):
                    continue
                if c.tag == "caption":
                    caption = c
                elif c.tag == "tr":
                    cells = [(_squash(_text(x)), _span(x, "rowspan"), _span(x, "colspan")) for x in c.children
                             if isinstance(x, _Node) and x.tag in ("td", "th")]
                    (head if in_head else body).append(cells)
                    if not in_head and len(body) == 1 and not head and all(
                            x.tag == "th" for x in c.children if isinstance(x, _Node)) and n.tag != "tbody":
                        head.append(body.pop())
                elif c.tag != "table":
                    collect(c, in_head or c.tag == "thead")

        collect(node, False)
        head_rows, body_rows = _grid(head), _grid(body)
        width = max((len(r) for r in head_rows + body_rows), default=0)
        header = []
        for j in range(width):
            parts = [r[j] for r in head_rows if j < len(r) and r[j]]
            header.append(" ".join(dict.fromkeys(parts)))
        if caption is not None:
            t = _squash(_text(caption))
            self.blocks.append(Block("prose", "caption", t, "t" * len(t)))
        self.blocks.append(Block("table", "table", header=header, rows=body_rows))

    def walk(self, node: _Node) -> None:
        for c in node.children:
            if not isinstance(c, _Node) or _skipped(c):
                continue
            cls = c.classes()
            if c.tag == "table":
                self.table(c)
                self.lead = ""
            elif c.tag == "img":
                self.blocks.append(Block("figure", "img"))
                self.lead = ""
            elif c.tag in BLOCK_TAGS:
                self.prose(c, c.tag)
                self.walk_nested(c)
            elif c.tag == "div" and "math" in cls:
                t = tex_to_text(_text(c))
                self.blocks.append(Block("prose", "math", t, "t" * len(t)))
            else:
                self.walk(c)

    def walk_nested(self, node: _Node) -> None:
        """Block-level children of a block (a list inside a list item, a table in a cell)."""
        for c in node.children:
            if isinstance(c, _Node) and not _skipped(c):
                if c.tag in CONTAINERS or c.tag in BLOCK_TAGS:
                    holder = _Node("#wrap", {}, None)
                    holder.children = [c]
                    self.walk(holder)
                else:
                    self.walk_nested(c)


def _ancestor(node: _Node, tags: set[str]) -> bool:
    p = node.parent
    while p is not None and p.tag not in tags:
        p = p.parent
    return p is not None


def parse_page(html_text: str, name: str = "") -> Page:
    """The blocks of a built page's ``<article>`` (else ``<main>``, else the whole document), in
    reading order, and its title (the first ``<h1>``, else ``<title>`` up to its " — ")."""
    b = _TreeBuilder()
    b.feed(html_text)
    b.close()
    article = (_find(b.root, lambda n: n.tag == "article")
               or _find(b.root, lambda n: n.tag == "main") or b.root)
    w = _Walker()
    w.walk(article)
    title = next((x.text for x in w.blocks if x.tag == "h1"), "")
    if not title:
        t = _find(b.root, lambda n: n.tag == "title")
        title = _squash(_text(t)).split(" — ")[0] if t is not None else ""
    return Page(name, title, w.blocks)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each sentence of ``text``: cut after ``.``, ``!``, ``?`` or ``;`` followed
    by a space and a capital, a digit, a bracket or a quote."""
    spans, start = [], 0
    for m in re.finditer(r"(?<=[.!?;])\s+(?=[A-Z0-9(*\"“\u2058])", text):
        spans.append((start, m.start()))
        start = m.end()
    spans.append((start, len(text)))
    return [(a, b) for a, b in spans if text[a:b].strip()]


def sentences(text: str) -> list[str]:
    """The sentences of ``text`` (:func:`sentence_spans`)."""
    return [text[a:b] for a, b in sentence_spans(text)]


def number_list(s: str) -> frozenset[float]:
    """The numbers of a list written in prose (``1, 3 and 10``, ``[1.0, 10.0]``) as a set."""
    return frozenset(float(x) for x in re.findall(NUM, s))


class RatioList(NamedTuple):
    """A list of ratios found in prose: where it is in the text, as what it was written, its values,
    whether it is written as a set and whether any of its numbers were glued."""

    start: int
    end: int
    match: str
    values: frozenset[float]
    is_set: bool
    glued: bool


def prose_ratio_lists(text: str, mask: str | None = None) -> list[RatioList]:
    """Every list of two or more ratios named in ``text`` (see the module's ``ratios`` rule);
    ``mask`` (as :attr:`Block.mask`) tells glued numbers (``g``) from typed ones."""
    mask = mask if mask is not None else "t" * len(text)
    out, seen = [], set()
    for rx, is_set in ((_RATIO_SET, True), (_RATIO_LIST, False)):
        for m in rx.finditer(text):
            if any(a < m.end(1) and m.start(1) < b for a, b in seen):
                continue
            seen.add(m.span(1))
            vals = number_list(m.group(1))
            if len(vals) >= 2:
                out.append(RatioList(m.start(), m.end(), m.group(0), vals, is_set, "g" in mask[m.start(1):m.end(1)]))
    return out


def _header_key(h: str) -> str:
    return h.strip().lower().split(" ")[-1] if h.strip() else ""


def _setting_cells(t: Block, key: re.Pattern) -> Iterator[tuple[str, bool]]:
    """``(cell, in_column)`` of every cell of a row named ``key`` (its first cell, the settings
    table) and of a column whose header's last word is ``key``, row by row."""
    keys = [_header_key(h) for h in t.header]
    for row in t.rows:
        if row and key.match(row[0].strip().lower()):
            yield from ((c, False) for c in row[1:])
        yield from ((c, True) for j, c in enumerate(row) if j < len(keys) and key.match(keys[j]))


def table_ratio_sets(page: Page) -> list[frozenset[float]]:
    """The ratio lists a page's tables show: the value of every ``ratios``/``*_ratios`` row (the
    settings table) or column, the values of a ``ratio`` column and the ``N`` of ``ratio N`` headers."""
    out = []
    for t in (b for b in page.blocks if b.kind == "table"):
        out += [number_list(c) for c, _ in _setting_cells(t, _SETTING_KEY) if _NUM_LIST.match(c.strip())]
        out += [frozenset(float(r[j]) for r in t.rows if j < len(r) and re.fullmatch(NUM, r[j].strip()))
                for j, h in enumerate(t.header) if _header_key(h) == "ratio"]
        out.append(frozenset(float(m.group(1)) for h in t.header
                             for m in [_RATIO_HEADER.match(h.strip().lower())] if m))
    return [s for s in out if s]


def results_ratio_sets(doc: Mapping | None) -> list[frozenset[float]]:
    """The ``ratios``/``*_ratios`` lists of a results file's ``params``."""
    return [frozenset(float(v) for v in val) for key, val in ((doc or {}).get("params") or {}).items()
            if _SETTING_KEY.match(str(key)) and isinstance(val, (list, tuple)) and val
            and all(isinstance(v, (int, float)) for v in val)]


def seed_counts(page: Page, doc: Mapping | None = None) -> set[int]:
    """How many seeds the page ran: the length of every ``seeds``/``*_seeds`` list (settings rows,
    columns, the results file's ``params``) and the integers of a ``seeds`` column."""
    out: set[int] = set()
    for t in (b for b in page.blocks if b.kind == "table"):
        for c, in_column in _setting_cells(t, _SEEDS_KEY):
            if _NUM_LIST.match(c.strip()):
                out.add(len(number_list(c)))
            elif in_column and re.fullmatch(r"\d+(?:\.0)?", c.strip()):
                out.add(int(float(c)))
    for key, val in ((doc or {}).get("params") or {}).items():
        if _SEEDS_KEY.match(str(key)) and isinstance(val, (list, tuple)):
            out.add(len(val))
    return out


def _names_paper(s: str) -> bool:
    return bool(re.search(r"\bpaper(?:'s|’s)?\b", s, re.I))


def _fmt(vals: Iterable[float]) -> str:
    return "{" + ", ".join(f"{v:g}" for v in sorted(vals)) + "}"


def _sentence_at(text: str, pos: int) -> str:
    for a, b in sentence_spans(text):
        if a <= pos < b:
            return text[a:b]
    return text


def ratio_findings(page: Page, allowed: Sequence[frozenset[float]]) -> list[Finding]:
    """Every ratio list in the page's prose that is none of the ``allowed`` lists (a set, or a typed
    list) or part of none (a glued list), unless its sentence or list lead-in names the paper."""
    allowed_set = {frozenset(a) for a in allowed}
    shown = ", ".join(_fmt(a) for a in sorted(allowed_set, key=sorted)) or "none"
    out = []
    for b in page.blocks:
        if b.kind not in ("prose", "heading"):
            continue
        for r in prose_ratio_lists(b.text_without_code, b.mask):
            s = _sentence_at(b.text, r.start)
            if _names_paper(s) or (b.lead and _names_paper(b.lead)):
                continue
            ok = (r.values in allowed_set) if (r.is_set or not r.glued) else any(r.values <= a for a in allowed_set)
            if not ok:
                how = "are not" if (r.is_set or not r.glued) else "are not all among"
                out.append(Finding(page.name, "ratios", f"{s!r}: ratios {_fmt(r.values)} ('{r.match}') {how} "
                                                        f"the ratios the page shows or ran ({shown})"))
    return out


def _numeric(c: str) -> bool:
    return bool(re.fullmatch(rf"[-+]?{NUM}", c.strip()))


def table_has_interval(t: Block) -> bool:
    """True when a table shows an interval: a cell with ``±`` or ``[lo, hi]``, or a half-width
    column (:data:`_HALF_WIDTH_HEADER`) with a number in it."""
    if any(_CELL_INTERVAL.search(c) for r in t.rows for c in r):
        return True
    return any(_HALF_WIDTH_HEADER.search(h.strip()) and any(j < len(r) and _numeric(r[j]) and
                                                            r[j].strip().lower() != "nan" for r in t.rows)
               for j, h in enumerate(t.header))


def interval_claims(text: str) -> list[str]:
    """The sentences of ``text`` that say intervals are shown (not those that use one to decide)."""
    return [s for s in sentences(text) if _INTERVAL_CLAIM.search(s) and not _INTERVAL_USE.search(s)]


def interval_findings(page: Page, seeds: Iterable[int] = ()) -> list[Finding]:
    """A claim of intervals in the prose block just before a table (or the tables shown with it)
    none of which shows one, and a column whose header promises an interval none of whose cells
    has one. ``seeds``: the seed counts the page ran (:func:`seed_counts`); with one among them, a
    claim that says what happens with one seed holds without an interval."""
    one_seed = 1 in set(seeds)
    out, blocks, i = [], page.blocks, 0
    while i < len(blocks):
        if blocks[i].kind != "table":
            i += 1
            continue
        j = i
        while j < len(blocks) and (blocks[j].kind == "table" or blocks[j].tag == "caption"):
            j += 1
        k = i - 1
        while k >= 0 and blocks[k].tag == "caption":
            k -= 1
        group = [b for b in blocks[i:j] if b.kind == "table"]
        texts = [blocks[k].text] if k >= 0 and blocks[k].kind == "prose" else []
        texts += [b.text for b in blocks[k + 1:j] if b.tag == "caption"]
        claims = [s for t in texts for s in interval_claims(t) if not (one_seed and _ONE_SEED.search(s))]
        if claims and not any(table_has_interval(t) for t in group):
            out += [Finding(page.name, "intervals", f"{s!r}: the table it introduces shows no interval (no ± or "
                                                    f"[lo, hi] cell, no half-width column with a number)")
                    for s in claims]
        for t in group:
            for c, h in enumerate(t.header):
                cells = [r[c] for r in t.rows if c < len(r) and not _MISSING_CELL.match(r[c].strip())]
                if _HALF_WIDTH_HEADER.search(h.strip()):
                    if not any(_numeric(x) for x in cells) and not one_seed:
                        out.append(Finding(page.name, "intervals", f"half-width column {h!r}: no cell has a number"))
                elif _CLAIM_HEADER.search(h) and cells and not any(_CELL_INTERVAL.search(x) for x in cells):
                    out.append(Finding(page.name, "intervals",
                                       f"column {h!r}: none of its {len(cells)} cells shows an interval"))
        i = j
    return out


_OUTCOME_CELL = re.compile(rf"^(holds|contradicted|undecided): ([+-]?{NUM}) ± ({NUM}) \(n = \d+\)")
# the words by which a sentence states a finding over cells (definitions say "every cell" and are not findings)
_QUANTIFIER = re.compile(r"\beverywhere\b|\bover the whole range\b|\bas summary [AB] says\b"
                         r"|\bfor (?:FAFO|CAFO|FACO|CACO)(?:, (?:FAFO|CAFO|FACO|CACO))+\b")


def verdict_findings(page: Page) -> list[Finding]:
    """Outcome words in tables that their own interval contradicts, and typed sentences that quantify over
    cells (see the module docstring, ``verdicts``)."""
    from qkov_lib import claims

    out = []
    for b in page.blocks:
        if b.kind == "table":
            cols = [i for i, h in enumerate(b.header) if h.strip() in claims.ESTIMANDS]
            for row in b.rows:
                for i in cols:
                    m = _OUTCOME_CELL.match(row[i].strip()) if i < len(row) else None
                    if not m:
                        continue
                    est = claims.ESTIMANDS[b.header[i].strip()]
                    x, hw = float(m.group(2)), float(m.group(3))
                    allowed = {claims.outcome(claims.Change(x + d, hw + e, 2 if hw > 0 else 1), est)
                               for d in (-5e-4, 0, 5e-4) for e in ((0,) if hw == 0 else (-5e-4, 0, 5e-4))}
                    if m.group(1) not in allowed:
                        out.append(Finding(page.name, "verdicts", f"{b.header[i].strip()} cell '{row[i].strip()}' says "
                                           f"{m.group(1)}, its interval against {est.side} says "
                                           f"{' or '.join(sorted(allowed))}"))
        elif b.kind in ("prose", "heading"):
            for m in _QUANTIFIER.finditer(b.text):
                if "t" in b.mask[m.start():m.end()]:
                    out.append(Finding(page.name, "verdicts", f"typed quantifier '{m.group(0)}' (not computed from "
                                       f"the cells it speaks of): {_sentence_at(b.text, m.start())}"))
    return out


def _defines(module_file: Path, name: str) -> bool:
    try:
        tree = ast.parse(module_file.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name
                                                                  for a in node.names):
            return True
    return False


def module_problem(dotted: str, repo: Path) -> str | None:
    """Why ``qkov_lib.a.b.Name`` does not name a module of the checkout ``repo`` (and, after the
    module, a name it defines at top level or a submodule), or None when it does."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = repo.joinpath(*parts[:k])
        f = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if f.is_file():
            rest = parts[k:]
            if not rest or _defines(f, rest[0]):
                return None
            return f"{'.'.join(parts[:k])} defines no {rest[0]!r}"
    return f"no module {parts[0]!r} in the checkout"


def path_problem(token: str, repo: Path) -> str | None:
    """Why the repository path ``token`` (``a/b.py``, ``a/b.py::test_x``) does not exist in the
    checkout ``repo`` (or its test is not defined there), or None when it does; paths under
    :data:`GENERATED_DIRS` or with a placeholder are not checked."""
    if PLACEHOLDER.search(token) or token.startswith(GENERATED_DIRS):
        return None
    path, *tests = token.split("::")
    f = repo / path
    if not f.exists():
        return f"{path} is not in the repository"
    for t in tests:
        name = t.split("[")[0]
        if f.suffix == ".py" and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b",
                                               f.read_text(errors="replace"), re.M):
            return f"{path} defines no {name}"
    return None


def link_problem(href: str, page_file: Path, html_root: Path) -> str | None:
    """Why a relative link of ``page_file`` does not resolve to a file of the built site at
    ``html_root``, or None (also for a link to another site, ``mailto:`` or an anchor)."""
    u = urlsplit(href)
    if u.scheme or u.netloc or not u.path:
        return None
    target = (page_file.parent / unquote(u.path)).resolve()
    try:
        target.relative_to(html_root.resolve())
    except ValueError:
        return f"{href} points outside the built book"
    if target.is_file() or (target.is_dir() and (target / "index.html").is_file()):
        return None
    return f"{href} is not a file of the built book"


def _words(s: str) -> set[str]:
    return set(re.findall(r"[\w’']+", s.lower().replace("_", " ")))


def reference_findings(page: Page, page_file: Path, html_root: Path, repo: Path,
                       page_names: Mapping[str, str]) -> list[Finding]:
    """The module's ``references`` rule over one page: links, code spans and prose naming files or
    pages that do not exist. ``page_names``: every page of the book, name (``book/05_squad``) -> title."""
    from qkov_lib import figure_source

    out: list[Finding] = []

    def bad(text: str) -> None:
        out.append(Finding(page.name, "references", text))

    known = [_words(title) | _words(name.rsplit("/", 1)[-1]) for name, title in page_names.items()]
    numbers = {int(m.group(1)) for name in page_names for m in [re.match(r"(\d+)_", name.rsplit("/", 1)[-1])] if m}
    for b in page.blocks:
        if b.kind not in ("prose", "heading"):
            continue
        # a figure's source line names its results file, which the build writes (``sources`` checks it)
        source = figure_source.parse(b.text) if b.kind == "prose" else None
        built = {f"{source[1]}.json"} if source else set()
        for href, text in b.links:
            why = link_problem(href, page_file, html_root)
            if why:
                bad(f"link {text!r}: {why}")
        for span in b.code:
            for token in span.split():
                token = token.strip("'\",;()`")
                if MODULE_TOKEN.match(token):
                    why = module_problem(token, repo)
                elif PATH_TOKEN.match(token):
                    why = None if token in built else path_problem(token, repo)
                elif _README.search(token):
                    why = f"{token} names no file of the repository or the book"
                else:
                    continue
                if why:
                    bad(f"`{span}`: {why}")
        for token in b.plain.split():
            token = token.strip("'\",;:()`.").rstrip(".")
            why = path_problem(token, repo) if "/" in token and PATH_TOKEN.match(token) else None
            if why:
                bad(f"{token}: {why}")
        for s in sentences(b.plain):
            shown = _squash(s.replace(LINK_MARK, "[link]"))
            if _README.search(s):
                bad(f"{shown!r}: names a README, which the book does not contain (link a page of the book, or "
                    f"name the repository file as a path in a code span)")
            if LINK_MARK in s:
                continue
            for m in _PAGE_REF.finditer(s):
                words = _words(m.group(1)) - GENERIC
                if words and not any(words <= k for k in known):
                    bad(f"{shown!r}: '{_squash(m.group(0))}' names no page of the book and links none")
            for m in _NUMBERED_REF.finditer(s):
                if int(m.group(1)) not in numbers:
                    bad(f"{shown!r}: no page of the book is numbered {m.group(1)}")
    return out


def pages(html_root: Path) -> list[Path]:
    """The built pages of the book: every ``.html`` file outside ``_static``, ``_sources``,
    ``_images``, ``_downloads`` and ``jupyter_execute``, and not Sphinx's ``genindex``/``search``."""
    skip = {"_static", "_sources", "_images", "_downloads", "jupyter_execute"}
    return sorted(p for p in html_root.rglob("*.html")
                  if not (set(p.relative_to(html_root).parts[:-1]) & skip)
                  and p.name not in ("genindex.html", "search.html"))


def results_key(doc: Mapping, key: str) -> bool:
    """Whether the dotted ``key`` is a path into ``doc``; a step may be a key that itself holds a dot
    (``val_AC@0.5``), so every split is tried."""
    if key in doc:
        return True
    parts = key.split(".")
    for i in range(1, len(parts)):
        head = ".".join(parts[:i])
        if isinstance(doc.get(head), Mapping) and results_key(doc[head], ".".join(parts[i:])):
            return True
    return False


def source_findings(page: Page, results_dir: Path | None) -> list[Finding]:
    """Figures without a source line, and source lines whose results file lacks the key (see the
    module docstring, ``sources``)."""
    from qkov_lib import figure_source

    out, pending = [], 0
    for b in page.blocks + [Block("heading")]:
        line = figure_source.parse(b.text) if b.kind == "prose" else None
        if b.kind in ("figure", "heading") and pending:
            out.append(Finding(page.name, "sources", f"a figure without a line that says where it came from "
                                                      f"({pending} before {b.text[:60] or 'the end'!r})"))
            pending = 0
        if b.kind == "figure":
            pending += 1
        elif line is not None:
            pending = max(pending - 1, 0)
            _, name, key = line
            doc = read_results(results_dir, name)
            if doc is None:
                out.append(Finding(page.name, "sources", f"{b.text!r}: no results file {name}.json"))
            elif not results_key(doc, key):
                out.append(Finding(page.name, "sources", f"{b.text!r}: {name}.json has no key {key!r}"))
    return out


def chapter_of(page_name: str) -> str:
    """The results file's chapter of a page: its file name without a leading number
    (``book/05_squad`` -> ``squad``)."""
    return re.sub(r"^\d+_", "", page_name.rsplit("/", 1)[-1])


def read_results(results_dir: Path | None, chapter: str) -> Mapping | None:
    """The parsed ``<results_dir>/<chapter>.json``, or None when missing or unreadable."""
    if results_dir is None:
        return None
    try:
        doc = json.loads((results_dir / f"{chapter}.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, Mapping) else None


def check_book(html_root: str | Path, results_dir: str | Path | None = None,
               repo: str | Path | None = None) -> list[Finding]:
    """Every finding of the five checks over every page of the built book at ``html_root``.
    ``results_dir``: the chapters' results files (default ``<html_root>/../results``); ``repo``:
    the checkout that repository paths are resolved in (default ``<html_root>/../..``, the
    repository of ``_build/html``)."""
    html_root = Path(html_root)
    results_dir = Path(results_dir) if results_dir is not None else html_root.parent / "results"
    repo = Path(repo) if repo is not None else html_root.resolve().parent.parent
    parsed = []
    for f in pages(html_root):
        name = f.relative_to(html_root).with_suffix("").as_posix()
        page = parse_page(f.read_text(errors="replace"), name)
        if page.blocks:
            parsed.append((f, page, read_results(results_dir, chapter_of(name))))
    own = {page.name: table_ratio_sets(page) + results_ratio_sets(doc) for _, page, doc in parsed}
    everywhere = [s for sets in own.values() for s in sets]
    names = {page.name: page.title for _, page, _ in parsed}
    out: list[Finding] = []
    for f, page, doc in parsed:
        out += ratio_findings(page, own[page.name] or everywhere)
        out += interval_findings(page, seed_counts(page, doc))
        out += reference_findings(page, f, html_root, repo, names)
        out += verdict_findings(page)
        out += source_findings(page, results_dir)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qkov_lib.tooling.booktext HTML_DIR [--results DIR] [--repo DIR]``: print every
    finding (``page [kind] text``); exit status 1 when there is any, 2 when there is no built book
    at ``HTML_DIR``, else 0."""
    ap = argparse.ArgumentParser(prog="python -m qkov_lib.tooling.booktext", description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path, help="the built book (e.g. _build/html)")
    ap.add_argument("--results", type=Path, default=None, help="results files (default: <html>/../results)")
    ap.add_argument("--repo", type=Path, default=None, help="the repository checkout (default: <html>/../..)")
    a = ap.parse_args(argv)
    if not a.html.is_dir() or not pages(a.html):
        print(f"{a.html}: no built book there", file=sys.stderr)
        return 2
    found = check_book(a.html, a.results, a.repo)
    for f in found:
        print(f"{f.page} [{f.kind}] {f.text}")
    print(f"{len(found)} finding(s) in {a.html}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
