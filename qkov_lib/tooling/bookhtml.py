"""The built pages work offline and offer their sources: a Sphinx extension.

``sphinx: extra_extensions: [qkov_lib.tooling.bookhtml]`` in ``_config.yml``. It does two things that
Jupyter Book 1 / myst-nb do not do on their own:

- **Progress bars without a CDN.** ``tqdm.auto`` in a kernel with ``ipywidgets`` displays a
  widget (``HBox`` of ``HTML`` + ``FloatProgress`` + ``HTML``). myst-nb writes such an output as
  a ``<script type="application/vnd.jupyter.widget-view+json">`` placeholder that a widget
  manager loaded from a CDN would draw. :func:`render_widget` draws the final state saved in the
  notebook (``metadata.widgets``) as static HTML instead (a ``<progress>`` element with the bar's
  text), so the page shows the bar with no JavaScript and no network (set
  ``nb_ipywidgets_js: {}`` so that no CDN script is requested either).
- **Source downloads.** sphinx-book-theme's download menu lists the page source (``.md``) and,
  only when a Binder/JupyterHub launch button is configured, the executed ``.ipynb``. For
  every notebook page this adds whichever of ``.md`` (the Jupytext source from
  ``qkov_source_dir``, default: the source folder) and ``.ipynb`` (the executed notebook that
  myst-nb wrote to ``jupyter_execute/``) is missing, copied into ``_sources/``. Every
  downloadable ``.ipynb`` shows what its page shows: the printed output of cells hidden on the
  page (``remove-cell``/``remove-output``, e.g. "results written to /home/...") is dropped
  (:func:`drop_hidden_outputs`); glued values stay, so the notebook still renders.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_VIEW_SCRIPT = re.compile(r'^\s*<script type="application/vnd\.jupyter\.widget-view\+json">(.*)</script>\s*$', re.S)
_BOXES = {"HBoxModel": "row", "BoxModel": "row", "VBoxModel": "column"}
_PROGRESS = {"FloatProgressModel", "IntProgressModel"}
_BAR_COLOURS = {"success": "#4caf50", "danger": "#e53935", "warning": "#fb8c00", "info": "#1e88e5", "": "#1e88e5"}


def widget_models(state_json: str | Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``model_id -> {"model_name", "state"}`` from a notebook's saved widget state (the
    ``application/vnd.jupyter.widget-state+json`` document, as JSON text or parsed); ``{}`` if none."""
    if not state_json:
        return {}
    doc = json.loads(state_json) if isinstance(state_json, str) else state_json
    if not isinstance(doc, Mapping) or not isinstance(doc.get("state", {}), Mapping):
        raise ValueError("widget state must be a mapping with a 'state' mapping of model ids")
    return {mid: {"model_name": m.get("model_name", ""), "state": m.get("state", {})}
            for mid, m in doc.get("state", {}).items()}


def _progress_html(state: Mapping[str, Any]) -> str:
    lo, hi, value = float(state.get("min", 0)), float(state.get("max", 100)), float(state.get("value", 0))
    span = hi - lo
    frac = min(max((value - lo) / span, 0.0), 1.0) if span > 0 else 0.0
    colour = _BAR_COLOURS.get(state.get("bar_style") or "", _BAR_COLOURS[""])
    # <progress> carries value/max for readers and tests; accent-color draws it in the bar's colour
    return (f'<progress class="qkov-progress" data-bar-style="{html.escape(state.get("bar_style") or "")}" '
            f'value="{value - lo:g}" max="{span:g}" style="width:20em;height:1.1em;accent-color:{colour}">'
            f'{100 * frac:.0f}%</progress>')


def _hidden(model: Mapping[str, Any], models: Mapping[str, Mapping[str, Any]]) -> bool:
    """True when the widget's layout hides it (tqdm hides a finished ``leave=False`` bar this way)."""
    layout_ref = str(model.get("state", {}).get("layout") or "").removeprefix("IPY_MODEL_")
    layout = models.get(layout_ref, {}).get("state", {})
    return layout.get("visibility") == "hidden" or layout.get("display") == "none"


def render_widget(model_id: str, models: Mapping[str, Mapping[str, Any]], _depth: int = 0) -> str:
    """Static HTML of widget ``model_id`` in its saved final state: boxes as flex rows/columns,
    ``HTML``/``Label`` as text, ``FloatProgress``/``IntProgress`` as ``<progress>``. A model that
    is missing from ``models`` or hidden by its layout (a finished tqdm bar with ``leave=False``)
    renders as ``""``, as it disappears in Jupyter; any other widget as a note naming its type."""
    if _depth > 20:
        raise ValueError(f"widget {model_id} nests more than 20 levels deep (a cycle?)")
    model = models.get(model_id)
    if model is None or _hidden(model, models):
        return ""
    name, state = model.get("model_name", ""), model.get("state", {})
    if name in _BOXES:
        kids = "".join(render_widget(str(c).removeprefix("IPY_MODEL_"), models, _depth + 1)
                       for c in state.get("children", []))
        return (f'<div class="qkov-widget" style="display:flex;flex-direction:{_BOXES[name]};'
                f'align-items:center;gap:0.5em">{kids}</div>')
    if name == "HTMLModel":  # HTML widgets hold markup by definition (tqdm escapes its text)
        return f'<span class="qkov-widget-html">{state.get("value", "")}</span>'
    if name == "LabelModel":
        return f'<span class="qkov-widget-label">{html.escape(str(state.get("value", "")))}</span>'
    if name in _PROGRESS:
        return _progress_html(state)
    return (f'<span class="qkov-widget-unrendered">[{html.escape(name or "widget")}: interactive, '
            f'not drawn in the static book]</span>')


def widget_view_id(raw_html: str) -> str | None:
    """The ``model_id`` of a myst-nb widget-view placeholder (``<script type="...widget-view+json">``),
    else None."""
    m = _VIEW_SCRIPT.match(raw_html)
    if not m:
        return None
    data = json.loads(m.group(1).replace(r"<\/script>", "</script>"))
    if isinstance(data, str):  # myst-nb may hand the mime data over as JSON text
        data = json.loads(data)
    return data.get("model_id") if isinstance(data, Mapping) else None


HIDDEN_OUTPUT_TAGS = ("remove-cell", "remove-output")


def drop_hidden_outputs(nb: Any) -> int:
    """Drop (in place) the outputs of ``nb``'s cells tagged ``remove-cell``/``remove-output``,
    except myst-nb glue outputs (``metadata.scrapbook``), which other pages' text is built from.
    Returns the number of outputs dropped."""
    dropped = 0
    for cell in nb.cells:
        if cell.get("cell_type") != "code" or not (set(cell.get("metadata", {}).get("tags", []))
                                                    & set(HIDDEN_OUTPUT_TAGS)):
            continue
        keep = [o for o in cell.get("outputs", []) if "scrapbook" in o.get("metadata", {})]
        dropped += len(cell.get("outputs", [])) - len(keep)
        cell["outputs"] = keep
    return dropped


# ----------------------------------------------------------------------------- Sphinx handlers


def _static_widgets(app, doctree, docname: str) -> None:
    from docutils import nodes

    models = None
    for node in list(doctree.findall(nodes.raw)):
        if "html" not in node.get("format", "").split():
            continue
        mid = widget_view_id(node.astext())
        if mid is None:
            continue
        if models is None:  # the page's saved widget state, read at its first widget
            js = getattr(app.env, "nb_metadata", {}).get(docname, {}).get("js_files", {})
            entry = js.get("ipywidgets_state")
            models = widget_models(entry[1].get("body")) if entry else {}
        node.replace_self(nodes.raw("", render_widget(mid, models), format="html"))


def is_notebook_page(app, pagename: str) -> bool:
    """True for a page made from a notebook (a kernelspec in its metadata, or an .ipynb source)."""
    meta = app.env.metadata.get(pagename, {}) if app.env else {}
    return "kernelspec" in meta or str(app.env.doc2path(pagename, False)).endswith(".ipynb")


def source_downloads(app, pagename: str) -> dict[str, Path]:
    """``{".md": path, ".ipynb": path}``: the files this notebook page can offer for download."""
    out: dict[str, Path] = {}
    md = Path(app.config.qkov_source_dir or app.srcdir) / f"{pagename}.md"
    if md.is_file():
        out[".md"] = md
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    ipynb = next((p for p in (executed, Path(app.srcdir) / f"{pagename}.ipynb") if p.is_file()), None)
    if ipynb is not None:
        out[".ipynb"] = ipynb
    return out


def _download_buttons(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    if doctree is None or not is_notebook_page(app, pagename):
        return
    group = next((b for b in context.get("header_buttons", []) if b.get("label") == "download-buttons"), None)
    if group is None:  # use_download_button: false, or a theme without the menu
        return
    have = {b.get("text") for b in group.get("buttons", [])}
    for suffix, path in source_downloads(app, pagename).items():
        if suffix in have:
            continue
        dest = Path(app.outdir) / "_sources" / f"{pagename}{suffix}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        group["buttons"].append({
            "type": "link", "url": f"{context['pathto']('_sources', 1)}/{pagename}{suffix}", "text": suffix,
            "icon": "fas fa-code" if suffix == ".ipynb" else "fas fa-file",
            "tooltip": "Download notebook file" if suffix == ".ipynb" else "Download source file",
            "label": f"download-{suffix.lstrip('.')}-button"})
    order = {".md": 0, ".ipynb": 1}  # sources first, then the theme's other entries (.pdf)
    group["buttons"].sort(key=lambda b: order.get(b.get("text"), len(order)))


def _scrub_downloads(app, exc) -> None:
    """After the build (Sphinx copies page sources last): hidden outputs out of every ``.ipynb``."""
    import nbformat

    sources = Path(app.outdir) / "_sources"
    if exc is not None or app.builder.format != "html" or not sources.is_dir():
        return
    for path in sorted(sources.rglob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if drop_hidden_outputs(nb):
            nbformat.write(nb, path)


def setup(app) -> dict[str, Any]:
    """Sphinx entry point (``extra_extensions: [qkov_lib.tooling.bookhtml]``)."""
    app.add_config_value("qkov_source_dir", "", "html")
    app.connect("doctree-resolved", _static_widgets)
    # after sphinx-book-theme has built its download menu (add_header_buttons, priority 501)
    app.connect("html-page-context", _download_buttons, priority=502)
    app.connect("build-finished", _scrub_downloads)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
