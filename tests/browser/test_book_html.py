r"""Browser test of the built book (``_build/html``) in headless Chromium.

Serves the HTML on 127.0.0.1 and checks, for every page of ``_toc.yml``: it loads and is linked
from the navigation, every ``<img>`` decoded (natural width > 0), figures are images (no bare
``<Figure size ...>`` text), no output cell shows a traceback, no script comes from another host,
and where the source has math, MathJax (served from the book's ``_static``) has typeset it:
``mjx-container`` elements exist and no raw ``\(``, ``\[`` or ``$$`` is left in the visible text.
On the synthetic chapter: progress bars are drawn (no "IProgress not found") and the download
menu offers the chapter's ``.md`` and ``.ipynb`` (both fetched and parsed); a screenshot shows
both (``book__01_synthetic__progress_downloads.png``). Also checks the search page (Sphinx's local
``searchindex.js``). Saves a full-page screenshot of every page to ``_build/screenshots/``.

Layout, at a desktop width (1300 px) and a phone width (400 px), on every page: the page does not
scroll sideways (``scrollWidth <= innerWidth``), no element of the article reaches past the
article's right edge unless it sits in a box that scrolls sideways by itself (``overflow-x: auto``
or ``scroll``; a table wider than the page scrolls in its box, it is never cut off), no table cell
shows text cut by pandas (``...``), no table is cut to "N rows × M columns", a table taller
than its scroll box keeps its header in view (sticky ``thead``), every image
decoded and every formula typeset. The scorecard's claims matrix (the first table of
``book/10_scorecard``) fits without scrolling at 1300 px. Screenshots of the scorecard and of a
real-data chapter at both widths: ``<page>__1300.png``, ``<page>__400.png``.

Skips when the book is not built or Chromium/chromedriver/selenium are missing; set
``QKOV_BROWSER_REQUIRED=1`` (CI) to make those a failure instead. Paths: ``QKOV_BOOK_ROOT``
(default: the repository), ``QKOV_HTML_DIR`` (default: ``<root>/_build/html``),
``QKOV_SCREENSHOT_DIR`` (default: ``<html>/../screenshots``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qkov_lib.tooling.cache import toc_files

ROOT = Path(os.environ.get("QKOV_BOOK_ROOT", Path(__file__).resolve().parents[2]))
HTML = Path(os.environ.get("QKOV_HTML_DIR", ROOT / "_build" / "html"))
SHOTS = Path(os.environ.get("QKOV_SCREENSHOT_DIR", HTML.parent / "screenshots"))
REQUIRED = os.environ.get("QKOV_BROWSER_REQUIRED", "") not in ("", "0")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1000"]
MATH_SOURCE = re.compile(r"\$[^$\n]+\$|\$\$|\{math\}|\\begin\{")
WIDTH = 1280
RAW_TEX = re.compile(r"\\\(|\\\[|\$\$")  # TeX delimiters MathJax would have consumed
CHAPTER_WITH_BARS = "book/01_synthetic"
LAYOUT_WIDTHS = (1300, 400)  # a desktop and a phone viewport (CSS px)
SCORECARD = "book/10_scorecard"
LAYOUT_SHOTS = (SCORECARD, "book/05_squad", "book/intro")  # pages saved at every layout width
# What reaches past the article's right edge (outside any box that scrolls sideways by itself),
# what pandas cut ("..." cells, "N rows × M columns"), and the page's own sideways scroll.
LAYOUT = r"""
const art = document.querySelector('article.bd-article') || document.querySelector('article')
  || document.querySelector('main');
const edge = art.getBoundingClientRect().right + 1;
const scrolls = e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX);
const inScrollBox = e => { for (let p = e.parentElement; p && p !== art; p = p.parentElement) {
  if (scrolls(p)) return true; } return false; };
const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
  + (typeof e.className === 'string' && e.className.trim() ? '.' + e.className.trim().split(/\s+/).join('.') : '');
const where = e => { const s = e.closest('section[id]'); return s ? s.id : ''; };
const clip = (t, n) => Array.from(t || '').slice(0, n).join('');  // whole characters (no half surrogate)
const wide = [];
for (const e of art.querySelectorAll('*')) {
  const r = e.getBoundingClientRect();
  if ((r.width === 0 && r.height === 0) || r.right <= edge || inScrollBox(e)) continue;
  if (e.closest('mjx-assistive-mml')) continue;  // MathJax's copy for screen readers, clipped to nothing
  // report the outermost element that is too wide, not each of its children
  if (e.parentElement && e.parentElement !== art && e.parentElement.getBoundingClientRect().right > edge
      && !inScrollBox(e.parentElement)) continue;
  wide.push({element: name(e), section: where(e), right: Math.round(r.right), edge: Math.round(edge),
             text: clip((e.innerText || e.textContent || '').trim(), 60)});
}
const cut = Array.from(art.querySelectorAll('table td, table th'))
  .filter(c => /\.\.\.$|…$/.test(c.innerText.trim()) && c.innerText.trim().length > 3)
  .map(c => ({section: where(c), text: Array.from(c.innerText.trim()).slice(-60).join('')}));
const dims = (art.innerText.match(/\d+ rows × \d+ columns/g) || []);
// a table taller than its scroll box keeps its header row in view (a sticky thead)
const unstuck = Array.from(art.querySelectorAll('table')).filter(t => {
  const box = t.closest('div.output, div.pst-scrollable-table-container');
  return box && box.scrollHeight > box.clientHeight + 1 && t.tHead
    && getComputedStyle(t.tHead).position !== 'sticky';
}).map(t => where(t));
return {wide: wide, cut: cut, dims: dims, unstuck: unstuck, scrollWidth: document.documentElement.scrollWidth,
        innerWidth: window.innerWidth};
"""
# Resolves when MathJax has typeset the page ('ok'), or says why not.
WAIT_MATHJAX = """
const done = arguments[arguments.length - 1];
const t0 = Date.now();
(function poll() {
  const mj = window.MathJax;
  if (mj && mj.startup && mj.startup.promise) {
    mj.startup.promise.then(() => done('ok'), e => done('MathJax error: ' + e));
  } else if (Date.now() - t0 > 20000) {
    done('MathJax did not start within 20 s');
  } else { setTimeout(poll, 100); }
})();
"""
# The article's visible text without code (cells, inline code may hold any characters).
VISIBLE_PROSE = """
const art = document.querySelector('article') || document.querySelector('main') || document.body;
const code = Array.from(art.querySelectorAll('pre, code, .highlight, .cell_input'));
const saved = code.map(e => e.style.display);
code.forEach(e => { e.style.display = 'none'; });
const text = art.innerText;
code.forEach((e, i) => { e.style.display = saved[i]; });
return text;
"""


DOCS = toc_files(ROOT) if (ROOT / "_toc.yml").exists() else []


def _unavailable(reason: str):
    if REQUIRED:
        pytest.fail(f"browser test required but {reason}")
    pytest.skip(reason)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest output clean
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # the browser dropped a request it no longer needed (navigation, screenshot)
        super().handle_error(request, client_address)


@pytest.fixture(scope="session")
def site() -> str:
    """Base URL of ``_build/html`` served on 127.0.0.1 by a thread of this test."""
    if not (HTML / "index.html").exists():
        _unavailable(f"the book is not built ({HTML / 'index.html'} missing; run `make book`)")
    server = _Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(HTML)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def driver(site):
    """Headless Chromium (Debian's ``chromium`` + ``chromium-driver``) with a fresh profile."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install selenium)")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if not browser or not chromedriver:
        _unavailable("chromium or chromedriver not found (apt-get install chromium chromium-driver)")
    profile = tempfile.mkdtemp(prefix="qkov-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        opts.add_argument(flag)
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=chromedriver))
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _open(driver, url: str, timeout: float = 30) -> None:
    driver.get(url)
    end = time.time() + timeout
    while driver.execute_script("return document.readyState") != "complete":
        if time.time() > end:
            raise TimeoutError(f"{url} did not finish loading in {timeout} s")
        time.sleep(0.1)


def _images(driver, timeout: float = 20) -> list[dict]:
    """Every <img> once all have finished loading (or ``timeout``)."""
    js = "return Array.from(document.images).map(i => ({src: i.currentSrc || i.src, complete: i.complete, " \
         "w: i.naturalWidth, h: i.naturalHeight}))"
    end = time.time() + timeout
    imgs = driver.execute_script(js)
    while any(not i["complete"] for i in imgs) and time.time() < end:
        time.sleep(0.2)
        imgs = driver.execute_script(js)
    return imgs


def _source(doc: str) -> Path | None:
    for suffix in (".md", ".ipynb"):
        if (ROOT / f"{doc}{suffix}").exists():
            return ROOT / f"{doc}{suffix}"
    return None


def _viewport(driver, width: int, height: int = 1000) -> None:
    """Resize the window so that the page's viewport (``window.innerWidth``) is ``width`` CSS px."""
    driver.set_window_size(width, height)
    inner = driver.execute_script("return window.innerWidth")
    if inner != width:  # window decorations: widen the window by the difference
        driver.set_window_size(2 * width - inner, height)
    time.sleep(0.2)


def _screenshot(driver, doc: str, width: int = WIDTH, suffix: str = "") -> Path:
    """Full-page PNG at viewport ``width``: the window is resized to the page height (capped) for
    the shot, then back to ``WIDTH`` x 1000."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    _viewport(driver, width)
    height = driver.execute_script("return Math.max(document.body.scrollHeight, "
                                   "document.documentElement.scrollHeight)")
    _viewport(driver, width, min(max(int(height) + 150, 800), 16000))
    time.sleep(0.3)
    path = SHOTS / f"{doc.replace('/', '__')}{suffix}.png"
    driver.save_screenshot(str(path))
    _viewport(driver, WIDTH)
    return path


def _assert_math_typeset(driver, site: str, doc: str) -> int:
    """MathJax is loaded from the book's own ``_static``, has finished, drew ``mjx-container``
    elements, and left no raw TeX delimiter in the visible prose. Returns the number drawn."""
    loaders = driver.execute_script(
        "return Array.from(document.querySelectorAll('script[src*=\"mathjax\" i]')).map(s => s.src)")
    assert loaders, f"{doc}: no MathJax loader on a page with math"
    assert all(u.startswith(f"{site}/_static/") for u in loaders), f"{doc}: MathJax not served by the book: {loaders}"
    driver.set_script_timeout(30)
    state = driver.execute_async_script(WAIT_MATHJAX)
    assert state == "ok", f"{doc}: {state}"
    n = driver.execute_script("return document.querySelectorAll('mjx-container').length")
    assert n > 0, f"{doc}: the source has math but MathJax drew none"
    prose = driver.execute_script(VISIBLE_PROSE)
    raw = [prose[max(m.start() - 40, 0):m.end() + 40] for m in RAW_TEX.finditer(prose)]
    assert not raw, f"{doc}: {len(raw)} formulas left as raw TeX, e.g. {raw[:3]}"
    return n


def test_toc_lists_pages():
    if not DOCS:
        _unavailable(f"no _toc.yml in {ROOT}")
    assert len(DOCS) >= 2, DOCS


@pytest.mark.parametrize("doc", DOCS)
def test_page(site, driver, doc):
    url = f"{site}/{doc}.html"
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200, f"{url}: HTTP {resp.status}"
    _open(driver, url)
    title = driver.title
    assert title and "404" not in title, f"{doc}: bad title {title!r}"
    h1 = driver.execute_script("const h = document.querySelector('article h1, main h1'); return h ? h.innerText : ''")
    assert h1.strip(), f"{doc}: no page heading"

    # the page is reachable from the navigation sidebar
    nav = driver.execute_script(
        "return Array.from(document.querySelectorAll('nav.bd-docs-nav a, .bd-sidebar-primary a'))"
        ".map(a => a.href)")
    assert any(h.split("#")[0].endswith(f"/{doc}.html") for h in nav) or doc == DOCS[0], \
        f"{doc} is not linked from the navigation"

    # every image decoded; no figure left as its text repr
    imgs = _images(driver)
    broken = [i["src"] for i in imgs if not i["complete"] or i["w"] <= 0]
    assert not broken, f"{doc}: images that did not decode: {broken}"
    outputs = driver.execute_script(
        "return Array.from(document.querySelectorAll('.cell_output, .output')).map(e => e.innerText)")
    bare = [t for t in outputs if re.search(r"<Figure size \d+x\d+ with \d+ Axes>", t)]
    assert not bare, f"{doc}: a figure was rendered as text, not as an image: {bare[:1]}"

    # no traceback in any output
    n_tb = driver.execute_script(
        "return document.querySelectorAll('.output.traceback, .output.error, div.traceback').length")
    tb = [t for t in outputs if "Traceback (most recent call last)" in t or re.search(r"\w+Error\s+Traceback", t)]
    assert n_tb == 0 and not tb, f"{doc}: an output cell shows a traceback: {(tb or ['(error output)'])[0][:500]}"

    # no path of the machine that built the book (papermill's results_path, "results written to ...")
    leaked = [d for d in {str(ROOT.resolve()), str(HTML.resolve().parent)} if d in driver.page_source]
    assert not leaked, f"{doc}: the page shows a path of the build machine: {leaked}"

    # the book works offline: every script is served by the book itself
    scripts = driver.execute_script("return Array.from(document.scripts).map(s => s.src).filter(u => u)")
    foreign = [u for u in scripts if not u.startswith(f"{site}/")]
    assert not foreign, f"{doc}: scripts from other hosts (a CDN?): {foreign}"

    # where the source has math, MathJax (local) has typeset it
    src = _source(doc)
    if src is not None and MATH_SOURCE.search(src.read_text(encoding="utf-8")):
        _assert_math_typeset(driver, site, doc)

    shot = _screenshot(driver, doc)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


@pytest.mark.parametrize("width", LAYOUT_WIDTHS)
@pytest.mark.parametrize("doc", DOCS)
def test_page_fits_its_width(site, driver, doc, width):
    """At a desktop and a phone width: nothing is wider than the page, no table is cut, every
    image decoded and every formula typeset (screenshots of ``LAYOUT_SHOTS`` at this width)."""
    _viewport(driver, width)
    try:
        _open(driver, f"{site}/{doc}.html")
        src = _source(doc)
        if src is not None and MATH_SOURCE.search(src.read_text(encoding="utf-8")):
            _assert_math_typeset(driver, site, doc)  # typeset first: formulas change the widths
        imgs = _images(driver)
        broken = [i["src"] for i in imgs if not i["complete"] or i["w"] <= 0]
        assert not broken, f"{doc} at {width} px: images that did not decode: {broken}"
        time.sleep(0.2)
        lay = driver.execute_script(LAYOUT)
        assert lay["innerWidth"] == width, f"the viewport is {lay['innerWidth']} px, not {width}"
        problems = []
        if lay["wide"]:
            problems.append(f"{len(lay['wide'])} element(s) reach past the article and are not in a box that "
                            f"scrolls sideways: {lay['wide'][:8]}")
        if lay["scrollWidth"] > lay["innerWidth"]:
            problems.append(f"the page scrolls sideways (scrollWidth {lay['scrollWidth']} > {width})")
        if lay["cut"]:
            problems.append(f"{len(lay['cut'])} table cell(s) cut by pandas: {lay['cut'][:5]}")
        if lay["dims"]:
            problems.append(f"tables shown in part: {lay['dims']}")
        if lay["unstuck"]:
            problems.append(f"tables that scroll in their box without a sticky header, in sections {lay['unstuck']}")
        assert not problems, f"{doc} at {width} px:\n" + "\n".join(problems)
        if doc in LAYOUT_SHOTS:
            shot = _screenshot(driver, doc, width, f"__{width}")
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    finally:
        _viewport(driver, WIDTH)


@pytest.mark.parametrize("width", LAYOUT_WIDTHS)
def test_scorecard_matrix_fits_at_desktop_width(site, driver, width):
    """The scorecard's claims matrix (its first table) is seen whole at 1300 px, with no sideways
    scroll of its own; at a phone width it may scroll in its own box but never widens the page."""
    if SCORECARD not in DOCS:
        pytest.fail(f"{SCORECARD} is not in _toc.yml any more; name the scorecard page here")
    _viewport(driver, width)
    try:
        _open(driver, f"{site}/{SCORECARD}.html")
        m = driver.execute_script("""
            const t = document.querySelector('article table');
            if (!t) return null;
            let box = t.parentElement;  // the table's own scroll box, if any
            while (box && !['auto', 'scroll'].includes(getComputedStyle(box).overflowX)
                   && box.tagName !== 'ARTICLE') box = box.parentElement;
            const head = Array.from(t.querySelectorAll('thead th')).map(h => h.innerText.trim());
            return {head: head, right: t.getBoundingClientRect().right, width: t.getBoundingClientRect().width,
                    boxScroll: box ? box.scrollWidth : 0, boxClient: box ? box.clientWidth : 0,
                    boxRight: box ? box.getBoundingClientRect().right : 0, viewport: window.innerWidth,
                    page: document.documentElement.scrollWidth};""")
        assert m is not None, f"{SCORECARD}: no table"
        assert m["head"][:2] == ["claim", "verdict"], f"{SCORECARD}: the first table is not the claims matrix: {m}"
        assert m["page"] <= m["viewport"], f"{SCORECARD} at {width} px: the matrix widens the page: {m}"
        assert m["boxRight"] <= m["viewport"], f"{SCORECARD} at {width} px: the matrix's box is wider than the view: {m}"
        if width >= 1000:
            assert m["boxScroll"] <= m["boxClient"] and m["right"] <= m["viewport"], \
                f"{SCORECARD} at {width} px: the claims matrix needs a sideways scroll: {m}"
    finally:
        _viewport(driver, WIDTH)


def test_index_redirects_to_root_page(site, driver):
    _open(driver, f"{site}/index.html")
    end = time.time() + 10
    while not driver.current_url.split("#")[0].endswith(f"/{DOCS[0]}.html") and time.time() < end:
        time.sleep(0.2)
    assert driver.current_url.split("#")[0].endswith(f"/{DOCS[0]}.html"), driver.current_url


@pytest.mark.parametrize("query", ["attention", "softmax"])
def test_search_page(site, driver, query):
    _open(driver, f"{site}/search.html?q={query}")
    summary = ""
    end = time.time() + 30
    while time.time() < end:
        summary = driver.execute_script("const s = document.querySelector('.search-summary'); "
                                        "return s ? s.innerText : ''")
        if summary:
            break
        time.sleep(0.2)
    assert summary, f"the search for {query!r} never finished (searchindex.js not loaded?)"
    hits = driver.execute_script("return Array.from(document.querySelectorAll('ul.search li a')).map(a => a.href)")
    assert hits, f"no search results for {query!r}: {summary}"
    pages = {f"/{d}.html" for d in DOCS}
    assert any(h.split("?")[0].split("#")[0].endswith(tuple(pages)) for h in hits), hits


@pytest.mark.parametrize("doc", ["book/intro", "book/02_theory_reduction"])
def test_equations_typeset(site, driver, doc):
    """The intro and a theory chapter show typeset formulas."""
    if doc not in DOCS:
        pytest.fail(f"{doc} is not in _toc.yml any more; name another page with math here")
    _open(driver, f"{site}/{doc}.html")
    n = _assert_math_typeset(driver, site, doc)
    print(f"{doc}: {n} formulas typeset by the local MathJax")


def test_chapter_progress_bars_and_source_downloads(site, driver):
    doc = CHAPTER_WITH_BARS
    if doc not in DOCS:
        pytest.fail(f"{doc} is not in _toc.yml any more; name the chapter with a progress bar here")
    _open(driver, f"{site}/{doc}.html")
    text = driver.execute_script("return document.body.innerText")
    assert "IProgress not found" not in text, f"{doc}: tqdm fell back to text (ipywidgets missing at build time)"
    bars = driver.execute_script(
        "return Array.from(document.querySelectorAll('.cell_output progress'))"
        ".map(p => ({value: p.value, max: p.max, shown: p.getBoundingClientRect().width > 0}))")
    assert bars and all(b["shown"] for b in bars), f"{doc}: no visible progress bar in the outputs: {bars}"
    assert any(b["value"] == b["max"] > 0 for b in bars), f"{doc}: no finished progress bar: {bars}"

    # the download menu: .md (the Jupytext source) and .ipynb (the executed notebook), both served
    links = driver.execute_script(
        "return Array.from(document.querySelectorAll('.dropdown-download-buttons a'))"
        ".map(a => ({href: a.href, text: a.innerText.trim()}))")
    by_text = {link["text"]: link["href"] for link in links}
    assert {".md", ".ipynb"} <= set(by_text), f"{doc}: download menu lacks .md/.ipynb: {links}"
    with urllib.request.urlopen(by_text[".md"], timeout=30) as resp:
        md = resp.read().decode()
    assert md.startswith("---") and "jupytext:" in md.split("---")[1] and ":tags: [parameters]" in md
    with urllib.request.urlopen(by_text[".ipynb"], timeout=30) as resp:
        nb = json.loads(resp.read())
    tags = [t for c in nb["cells"] for t in c.get("metadata", {}).get("tags", [])]
    assert "parameters" in tags and any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
    outputs = json.dumps([c.get("outputs", []) for c in nb["cells"]])
    assert str(ROOT.resolve()) not in outputs, f"{doc}: the .ipynb download shows a path of the build machine"

    # screenshot: the first progress bar in view, the download menu open above it (after MathJax
    # has typeset the page, which moves everything below the formulas)
    driver.set_script_timeout(30)
    assert driver.execute_async_script(WAIT_MATHJAX) == "ok"
    # open the menu first: opening it scrolls the page; the sticky header keeps it in view
    driver.execute_script("document.querySelector('.dropdown-download-buttons button').click()")
    time.sleep(0.5)
    driver.execute_script("document.querySelector('.cell_output progress').scrollIntoView({block: 'center'})")
    time.sleep(0.5)
    shown = driver.execute_script(
        "return Array.from(document.querySelectorAll('.dropdown-download-buttons a'))"
        ".filter(a => a.getBoundingClientRect().height > 0).map(a => a.innerText.trim())")
    assert {".md", ".ipynb"} <= set(shown), f"{doc}: the download menu did not open: {shown}"
    in_view = driver.execute_script(
        "const r = document.querySelector('.cell_output progress').getBoundingClientRect();"
        "return r.top >= 0 && r.bottom <= window.innerHeight")
    assert in_view, f"{doc}: the progress bar is not in view for the screenshot"
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / f"{doc.replace('/', '__')}__progress_downloads.png"
    driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
