"""How the book shows tables: pandas' display options for every chapter, so that no table of the
book is cut. A cell's text is shown whole (pandas would cut it to 50 characters and "..."), every
row and every column is shown (pandas would show 10 of a table longer than 60 rows, and a
"N rows × M columns" note). :mod:`qkov_lib.tooling` sets them when it is imported, which the
first cell of every chapter does. The page's stylesheet (``_static/qkov.css``) then lets a wide
table scroll sideways in its own box and a long one scroll down in it with its header in view;
``tests/browser/test_book_html.py`` checks the built pages at a desktop and a phone width."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DISPLAY_OPTIONS: Mapping[str, Any] = {
    "display.max_colwidth": None,  # a cell's whole text, never cut to "..."
    "display.max_rows": None,      # every row
    "display.max_columns": None,   # every column
}


def setup_display() -> dict[str, Any]:
    """Set pandas' :data:`DISPLAY_OPTIONS` for this process (a chapter's kernel); returns the
    values they had before."""
    import pandas as pd

    before = {k: pd.get_option(k) for k in DISPLAY_OPTIONS}
    for k, v in DISPLAY_OPTIONS.items():
        pd.set_option(k, v)
    return before


__all__ = ["DISPLAY_OPTIONS", "setup_display"]
