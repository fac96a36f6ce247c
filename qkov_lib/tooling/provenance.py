"""Each page says where its numbers come from (a Sphinx extension).

A chapter's results file (``<name>.json``, :func:`qkov_lib.tooling.results.save_results`) records
the profile it ran with and the git commit of the code. Under the heading of every page that has
one, this adds a line naming both, so a reader of the published book knows whether the page shows
a ``cpu`` build of the current code or a ``full`` run of an earlier commit (the Pages workflow
publishes the GPU workflow's results when there are some). The results folder is
``$QKOV_RESULTS_DIR``, else ``_build/results`` under the book's source (``qkov_source_dir``, set
for builds from executed notebooks, else the Sphinx source folder).
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

RESULTS_ENV = "QKOV_RESULTS_DIR"


def results_name(pagename: str) -> str:
    """The results file's name of a page, as ``qkov run`` names it: ``book/01_synthetic`` ->
    ``synthetic`` (a number prefix dropped), ``book/dynamics-explorer`` -> ``dynamics-explorer``."""
    stem = Path(pagename).name
    head, _, tail = stem.partition("_")
    return tail if head.isdigit() and tail else stem


def provenance(doc: dict) -> str | None:
    """The sentence for a results document: ``"Numbers on this page: profile cpu, commit 1a2b3c4."``
    (None when it names no profile)."""
    profile = (doc.get("params") or {}).get("profile") if isinstance(doc.get("params"), dict) else None
    if not profile:
        return None
    commit = doc.get("git_commit")
    return f"Numbers on this page: profile {profile}, commit {str(commit)[:12] if commit else 'unknown'}."


def line_html(sentence: str, results_file: str) -> str:
    """The line as the page shows it (the results file's name in its title, for the reader who
    wants the file)."""
    return (f'<p class="qkov-provenance" title="from {html.escape(results_file)}"><small>'
            f"{html.escape(sentence)}</small></p>")


def with_line(body: str, line: str) -> str:
    """``body`` with ``line`` after its first heading (at the start when it has none)."""
    at = body.find("</h1>")
    return body[:at + 5] + line + body[at + 5:] if at >= 0 else line + body


def _results_dir(app: Any) -> Path:
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    root = getattr(app.config, "qkov_source_dir", None) or app.srcdir
    return Path(root) / "_build" / "results"


def _page(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    if doctree is None or not context.get("body"):
        return
    path = _results_dir(app) / f"{results_name(pagename)}.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a page without results (the glossary, the introduction) says nothing
    sentence = provenance(doc) if isinstance(doc, dict) else None
    if sentence:
        context["body"] = with_line(context["body"], line_html(sentence, path.name))


def setup(app: Any) -> dict[str, Any]:
    app.connect("html-page-context", _page)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
