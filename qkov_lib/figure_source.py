"""Where a figure came from: the line under each figure of the book.

Every library function that returns a figure is decorated with :func:`draws`, which records its
dotted name on the figure. A chapter shows a figure with :func:`show` (or glues it with
:func:`glue_figure`), naming the results file and key that hold the figure's numbers; the line
reads "Drawn by `qkov_lib.rate_plane.plot_plane` from `squad.json`, key `metrics.plane`." The built
book is checked for it (:func:`qkov_lib.tooling.booktext.source_findings`): every figure has the
line, the function it names exists, and its key is in that page's results file.

No plotting library is imported here, so that decorating a module's figure functions costs its
import nothing (matplotlib loads where a figure is drawn)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

#: the figure attribute :func:`draws` sets: the dotted name of the function that drew it
DRAWN_BY = "qkov_drawn_by"
#: a source line as :func:`caption` writes it (Markdown) or as the built page shows it (code spans
#: as plain text): function, results file, key
LINE = re.compile(r"Drawn by `?(\w+(?:\.\w+)+)`? from `?([\w.-]+)\.json`?, key `?([\w.@\[\]-]+?)`?\.?$")


def draws(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for a function that returns a matplotlib figure: records the function's dotted
    name (``module.qualname``) on the figure it returns, for :func:`caption`. A function that has
    nothing to draw (no trained run, say) may return None, which passes through (:func:`show` says so)."""
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def drawing(*args, **kwargs):
        fig = fn(*args, **kwargs)
        if fig is None:
            return None
        if not hasattr(fig, "savefig"):
            raise TypeError(f"{name} returned {type(fig).__name__}, not a matplotlib figure")
        setattr(fig, DRAWN_BY, name)
        return fig

    return drawing


def caption(fig: Any, results: str, key: str) -> str:
    """The source line of ``fig`` (Markdown): the function that drew it and where its numbers are.
    ``results``: the results file's name without ``.json`` (the chapter's, e.g. ``"squad"``);
    ``key``: a dotted path into that file (``"metrics.plane"``). A figure that no :func:`draws`
    function made has no true line: TypeError."""
    name = getattr(fig, DRAWN_BY, None)
    if name is None:
        raise TypeError("this figure was not drawn by a qkov_lib function decorated with figure_source.draws; "
                        "draw it in the library so that its line can name the function")
    if not re.fullmatch(r"[\w.-]+", results or "") or results.endswith(".json"):
        raise ValueError(f"results {results!r}: the results file's name without .json, such as 'squad'")
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"key {key!r}: a dotted path into the results file, such as 'metrics.plane'")
    return f"Drawn by `{name}` from `{results}.json`, key `{key}`."


def parse(text: str) -> tuple[str, str, str] | None:
    """``(function, results name, key)`` of a source line (as written or as shown), else None."""
    m = LINE.search(text.strip())
    return (m.group(1), m.group(2), m.group(3)) if m else None


#: what :func:`show` displays in place of a figure that had nothing to draw
NOTHING_DRAWN = "*No figure here: in this build no run gave it anything to draw.*"


def show(fig: Any, results: str, key: str) -> None:
    """Display ``fig`` and, under it, its :func:`caption` line; then close the figure, so that the
    notebook does not show it again (without its line) at the end of the cell. ``fig`` None (a
    :func:`draws` function with nothing to draw): a line that says so, :data:`NOTHING_DRAWN`."""
    import matplotlib.pyplot as plt
    from IPython.display import Markdown, display

    if fig is None:
        display(Markdown(NOTHING_DRAWN))
        return
    text = caption(fig, results, key)
    display(fig)
    display(Markdown(text))
    plt.close(fig)


def glue_figure(name: str, fig: Any, results: str, key: str) -> None:
    """Glue ``fig`` as ``name`` and its :func:`caption` line as ``name + "_source"`` (Markdown: end
    the ``{glue:figure}`` caption with ``{glue:md}`name_source```), then :func:`show` it here too."""
    from IPython.display import Markdown
    from myst_nb import glue

    text = caption(fig, results, key)
    glue(name, fig, display=False)
    glue(f"{name}_source", Markdown(text), display=False)
    show(fig, results, key)
