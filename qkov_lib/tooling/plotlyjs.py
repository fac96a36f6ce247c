"""Plotly's JavaScript served by the book itself, never from a CDN (a Sphinx extension).

The built book must work offline, as MathJax does (``sphinx-mathjax-offline``): this copies the
``plotly.min.js`` that ships inside the pinned ``plotly`` package into ``_static/plotly/`` of the
HTML output and loads it on the pages whose body holds an interactive figure (an element with
:data:`MARKER`, written by :func:`qkov_lib.studies.explorer.figure_html`), and only there: the
file is several megabytes and the other pages do not need it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

#: the attribute that marks a page's interactive figure
MARKER = "data-qkov-plotly"
#: where the script lands, relative to the HTML output's ``_static``
STATIC_PATH = "plotly/plotly.min.js"


def plotly_js() -> Path:
    """The ``plotly.min.js`` bundled with the installed ``plotly`` package (FileNotFoundError,
    naming the package, if it is missing)."""
    from importlib.resources import files

    try:
        path = Path(str(files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError as e:
        raise FileNotFoundError("the plotly package is not installed (pip install -r requirements.txt)") from e
    if not path.is_file():
        raise FileNotFoundError(f"the plotly package has no bundled plotly.min.js at {path}")
    return path


def needs_plotly(body: str) -> bool:
    """Whether a page's HTML body holds an interactive figure."""
    return MARKER in body


def _page(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    if needs_plotly(context.get("body") or ""):
        app.add_js_file(STATIC_PATH)  # on this page only (called from html-page-context)


def _copy(app: Any, exception: Exception | None) -> None:
    if exception is None and getattr(app.builder, "format", "") == "html":
        out = Path(app.outdir) / "_static" / STATIC_PATH
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plotly_js(), out)


def setup(app: Any) -> dict[str, Any]:
    plotly_js()  # fail at the start of the build, not after it, when plotly is missing
    app.connect("html-page-context", _page)
    app.connect("build-finished", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
