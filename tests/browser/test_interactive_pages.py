r"""Browser test of the interactive dynamics page, the glossary and the launch menu in headless
Chromium (the server, driver and helpers of ``test_book_html.py``).

* Moving a control of the dynamics figure (the ratio slider with the keyboard, the init-scale
  menu) changes the curves Plotly drew (the SVG path of a trace) and the ranking line; a click on
  a cell of the phase map selects that cell. Screenshots before and after, at 1300 and 400 px:
  ``book__dynamics-explorer__{before,after}__{1300,400}.png``.
* The page works with the network off: served with every other host unresolvable, the figure
  draws and Chrome's request log holds no request to another host; opened from disk
  (``file://``) with the network emulated offline, it draws too, and every source its elements
  name is the book's own.
* Every glossary link on every page leads to a term the glossary defines; the glossary page is
  saved at both widths (``book__glossary__{1300,400}.png``).
* A chapter's launch menu opens its ``.md`` on Binder.

Skips as ``test_book_html.py`` does when the book is not built or Chromium is missing, and when a
page of this file is not in the build's ``_toc.yml``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse

import pytest
from test_book_html import DOCS, FLAGS, HTML, SHOTS, _open, _viewport, driver, site  # noqa: F401  (fixtures)

EXPLORER = "book/dynamics-explorer"
GLOSSARY = "book/glossary"
WIDTHS = (1300, 400)

# The figure's state as the page drew it: the first trace's SVG path, the data Plotly holds,
# the ranking line and the phase map's marker.
STATE = r"""
const root = document.querySelector('.qkov-explorer');
if (!root || !window.Plotly) return null;
const curves = root.querySelector('.qkov-explorer-curves'), phase = root.querySelector('.qkov-explorer-phase');
if (!curves.data || !phase.data) return null;
const path = curves.querySelector('.scatterlayer .trace path.js-line');
return {traces: curves.data.length, y0: curves.data[0].y, d: path ? path.getAttribute('d') : '',
        ranking: root.querySelector('.qkov-explorer-ranking').textContent,
        marker: phase.layout.shapes[0].x0 + ',' + phase.layout.shapes[0].y0,
        ratio: root.querySelector('[data-control="ratio"]').value,
        level: root.querySelector('[data-control="level"]').value};
"""
# Every source the page's elements name: scripts, images, frames, stylesheets, icons, preloads.
NAMED = r"""
const named = [];
document.querySelectorAll('script[src], img[src], iframe[src], source[src]').forEach(e => named.push(e.src));
document.querySelectorAll('link[href]').forEach(e => {
  if (/stylesheet|preload|icon|modulepreload|manifest/.test(e.rel)) named.push(e.href); });
return named;
"""


def _need(doc: str) -> None:
    if doc not in DOCS:
        pytest.skip(f"{doc} is not in this build's _toc.yml")


def _wait_state(driver, timeout: float = 30) -> dict:
    end = time.time() + timeout
    state = driver.execute_script(STATE)
    while state is None and time.time() < end:
        time.sleep(0.2)
        state = driver.execute_script(STATE)
    assert state is not None, "the interactive figure did not draw (Plotly missing, or the script failed)"
    return state


def _shot(driver, name: str, width: int) -> None:
    """The figure as the window shows it (the window is tall enough for all of it)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.execute_script("window.scrollTo(0, document.querySelector('.qkov-explorer').getBoundingClientRect().top"
                          " + window.scrollY - 80)")  # below the sticky header
    time.sleep(0.5)
    path = SHOTS / f"{name}__{width}.png"
    driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("width", WIDTHS)
def test_moving_a_control_changes_the_plotted_curve(site, driver, width):
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    _need(EXPLORER)
    _viewport(driver, width, 2000)  # loaded at this width: no relayout between the shots
    try:
        _open(driver, f"{site}/{EXPLORER}.html")
        before = _wait_state(driver)
        assert before["traces"] == 8 and before["d"], "four attention and four OV-margin curves"
        _shot(driver, "book__dynamics-explorer__before", width)

        # the ratio slider, moved with the keyboard as a reader would: a real input event
        driver.find_element("css selector", '.qkov-explorer [data-control="ratio"]').send_keys(Keys.END)
        after = _wait_state(driver)
        assert after["ratio"] != before["ratio"]
        assert after["y0"] != before["y0"], "the data of the first curve did not change with the ratio"
        assert after["d"] != before["d"], "the drawn curve did not change with the ratio"
        assert after["marker"] != before["marker"], "the phase map's marker did not follow the ratio"
        assert "top two" in after["ranking"] or "reaches this loss" in after["ranking"]
        _shot(driver, "book__dynamics-explorer__after", width)

        # the init-scale menu changes the curves too
        Select(driver.find_element("css selector", '.qkov-explorer [data-control="init"]')).select_by_index(0)
        other = _wait_state(driver)
        assert other["d"] != after["d"], "the drawn curve did not change with the init scale"

        # the loss slider moves the ranking line's level
        driver.find_element("css selector", '.qkov-explorer [data-control="level"]').send_keys(Keys.END)
        deep = _wait_state(driver)
        assert deep["level"] != other["level"] and deep["ranking"] != other["ranking"]
    finally:
        _viewport(driver, 1280)


def test_a_click_on_the_phase_map_selects_its_cell(site, driver):
    _need(EXPLORER)
    _viewport(driver, 1300)
    _open(driver, f"{site}/{EXPLORER}.html")
    before = _wait_state(driver)
    # Plotly's own click event on the heat map, as a click on cell (row 2, column 0) raises it
    driver.execute_script(
        "const p = document.querySelector('.qkov-explorer-phase');"
        "p.emit('plotly_click', {points: [{pointIndex: [2, 0]}]});")
    after = _wait_state(driver)
    assert (after["ratio"], after["level"]) == ("0", "2") and after["d"] != before["d"]


@pytest.fixture
def walled_driver():
    """Headless Chromium for which every host but 127.0.0.1 (the book's server) does not resolve,
    logging every request the page makes (Chrome's performance log)."""
    import shutil
    import tempfile

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser or not shutil.which("chromedriver"):
        pytest.skip("chromium or chromedriver not found")
    profile = tempfile.mkdtemp(prefix="qkov-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in FLAGS + [f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _requests(driver) -> list[str]:
    """Every URL the page requested since the last call (Chrome's performance log)."""
    out = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg.get("method") == "Network.requestWillBeSent":
            out.append(msg["params"]["request"]["url"])
    return out


def test_the_page_requests_nothing_from_another_host(site, walled_driver):
    _need(EXPLORER)
    _open(walled_driver, f"{site}/{EXPLORER}.html")
    state = _wait_state(walled_driver)
    assert state["traces"] == 8 and state["d"], "the figure did not draw with only the book's server reachable"
    from selenium.webdriver.common.keys import Keys

    walled_driver.find_element("css selector", '.qkov-explorer [data-control="ratio"]').send_keys(Keys.END)
    _wait_state(walled_driver)
    time.sleep(1)
    urls = _requests(walled_driver)
    assert any("/_static/plotly/plotly.min.js" in u for u in urls), "Plotly was not loaded from the book"
    # every request that goes over a network (the browser's own chrome:// pages do not)
    network = [u for u in urls if urllib.parse.urlsplit(u).scheme in ("http", "https", "ws", "wss")]
    foreign = [u for u in network if not u.startswith(site + "/")]
    assert not foreign, f"the page asked other hosts for: {foreign[:5]}"


def test_the_page_works_from_disk_with_the_network_off(driver):
    _need(EXPLORER)
    page = (HTML / f"{EXPLORER}.html").resolve()
    if not page.is_file():
        pytest.skip(f"{page} is not built")
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
        "offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0})
    try:
        _open(driver, page.as_uri())
        state = _wait_state(driver)
        assert state["traces"] == 8 and state["d"]
        named = driver.execute_script(NAMED)
    finally:
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    root = HTML.resolve().as_uri()
    foreign = [u for u in named if not u.startswith(root) and not u.startswith("data:")]
    assert not foreign, f"the page names resources outside the book: {foreign[:5]}"


def test_every_glossary_link_leads_to_a_defined_term(site, driver):
    _need(GLOSSARY)
    _open(driver, f"{site}/{GLOSSARY}.html")
    defined = set(driver.execute_script(
        "return Array.from(document.querySelectorAll('dl.glossary dt[id]')).map(e => e.id)"))
    assert len(defined) >= 40, f"the glossary defines only {len(defined)} terms"
    for width in WIDTHS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        _viewport(driver, width)
        driver.save_screenshot(str(SHOTS / f"book__glossary__{width}.png"))
    _viewport(driver, 1300)
    linked = 0
    for doc in DOCS:
        _open(driver, f"{site}/{doc}.html")
        hrefs = driver.execute_script(
            "return Array.from(document.querySelectorAll('a.reference')).filter(a => a.querySelector('.std-term'))"
            ".map(a => a.href)")
        for href in hrefs:
            url = urllib.parse.urlsplit(href)
            assert url.path.endswith("/glossary.html"), f"{doc}: a term links to {href}, not the glossary"
            assert urllib.parse.unquote(url.fragment) in defined, f"{doc}: {href} names no glossary entry"
        linked += len(hrefs)
    if EXPLORER in DOCS:
        assert linked >= 5, "the dynamics page links its terms to the glossary"


def test_a_chapters_launch_menu_opens_its_markdown_source_on_binder(site, driver):
    _need(EXPLORER)
    _open(driver, f"{site}/{EXPLORER}.html")
    links = driver.execute_script(
        "return Array.from(document.querySelectorAll('.dropdown-launch-buttons a, a[href*=\"mybinder\"]'))"
        ".map(a => a.href)")
    binder = [u for u in links if "mybinder.org" in u]
    assert binder, "no Binder launch button"
    assert all(re.search(r"urlpath=lab/tree/book/dynamics-explorer\.md$", urllib.parse.unquote(u)) for u in binder), \
        binder
    downloads = driver.execute_script(
        "return Array.from(document.querySelectorAll('.dropdown-download-buttons a')).map(a => a.href)")
    assert any(u.endswith(".md") for u in downloads) and any(u.endswith(".ipynb") for u in downloads), downloads
