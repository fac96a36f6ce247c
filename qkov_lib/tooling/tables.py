"""How the book shows tables: pandas' display options for every chapter, so that no table of the
book is cut. A cell's text is shown whole (pandas would cut it to 50 characters and "..."), every
row and every column is shown (pandas would show 10 of a table longer than 60 rows, and a
"N rows × M columns" note). :mod:`qkov_lib.tooling` sets them when it is imported, which the
first cell of every chapter does. The page's stylesheet (``_static/qkov.css``) then lets a wide
table scroll sideways in its own box and a long one scroll down in it with its header in view;
``tests/browser/test_book_html.py`` checks the built pages at a desktop and a phone width."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Mapping
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


class _AfterImport(importlib.abc.MetaPathFinder):
    """Import hook: once module ``name`` has been run by its own loader, call ``then()``; used once."""

    def __init__(self, name: str, then: Callable[[], Any]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the real finders, this hook gone
        if spec is not None and spec.loader is not None:
            run, then = spec.loader.exec_module, self.then

            def run_then(module: Any) -> None:
                run(module)
                then()

            spec.loader.exec_module = run_then  # this spec's loader object only
        return spec


def setup_display_when_imported() -> None:
    """:func:`setup_display` now when pandas is loaded, else right after it is first imported, so
    that importing the tooling (the ``qkov`` command line) does not pay pandas' import time."""
    if "pandas" in sys.modules:
        setup_display()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("pandas", setup_display))


__all__ = ["DISPLAY_OPTIONS", "setup_display", "setup_display_when_imported"]
