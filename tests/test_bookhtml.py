"""The built pages: static progress bars from saved widget state, the .md/.ipynb download menu,
MathJax from the build, and papermill's injected cell hidden without machine paths.

Unit tests of :mod:`qkov_lib.tooling.bookhtml` and :func:`qkov_lib.tooling.cache.hide_injected_parameters`, plus
two real Sphinx builds of a one-chapter project with the book's extensions: one executes a
chapter that uses ``tqdm.auto`` (force mode, as ``make book``), one renders a papermill-executed
notebook without executing it (as ``qkov book --mode executed``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from qkov_lib.tooling import bookhtml, cache

ROOT = Path(__file__).resolve().parents[1]
MACHINE_DIR = "/home/alice/qkov/runs/full"  # a path of "the machine that ran it"


def _tqdm_state(value: float, total: float, style: str = "success", hidden: bool = False) -> dict:
    """Saved widget state of one finished tqdm.notebook bar (HBox of HTML, FloatProgress, HTML)."""
    return {"state": {
        "box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_left", "IPY_MODEL_bar", "IPY_MODEL_right"],
                                                     "layout": "IPY_MODEL_lay"}},
        "lay": {"model_name": "LayoutModel", "state": {"visibility": "hidden" if hidden else None}},
        "left": {"model_name": "HTMLModel", "state": {"value": "synthetic grid: 100%"}},
        "bar": {"model_name": "FloatProgressModel", "state": {"value": value, "min": 0, "max": total, "bar_style": style}},
        "right": {"model_name": "HTMLModel", "state": {"value": " 8/8 [00:02&lt;00:00,  3.9it/s]"}},
    }}


def test_render_widget_draws_a_finished_tqdm_bar():
    models = bookhtml.widget_models(json.dumps(_tqdm_state(8, 8)))
    out = bookhtml.render_widget("box", models)
    bar = re.search(r'<progress [^>]*value="([\d.]+)" max="([\d.]+)"[^>]*>(\d+)%</progress>', out)
    assert bar and bar.groups() == ("8", "8", "100"), out
    assert 'data-bar-style="success"' in out
    # description, bar, counter in the widget's order; the HTML widget's markup is kept as markup
    assert out.index("synthetic grid: 100%") < out.index("<progress") < out.index("8/8 [00:02&lt;00:00")


def test_render_widget_partial_bar_min_offset_and_label_escaping():
    models = {"p": {"model_name": "IntProgressModel", "state": {"value": 15, "min": 10, "max": 30}},
              "l": {"model_name": "LabelModel", "state": {"value": "<b>not bold</b>"}}}
    assert re.search(r'value="5" max="20"[^>]*>25%<', bookhtml.render_widget("p", models))
    assert "&lt;b&gt;not bold&lt;/b&gt;" in bookhtml.render_widget("l", models)


def test_render_widget_hidden_missing_unknown_and_cyclic():
    assert bookhtml.render_widget("box", bookhtml.widget_models(_tqdm_state(3, 3, hidden=True))) == ""  # leave=False
    assert bookhtml.render_widget("gone", {}) == ""  # a closed widget: nothing, as in Jupyter
    note = bookhtml.render_widget("s", {"s": {"model_name": "IntSliderModel", "state": {}}})
    assert "IntSliderModel" in note and "<progress" not in note
    loop = {"a": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_a"]}}}
    with pytest.raises(ValueError, match="nests more than"):
        bookhtml.render_widget("a", loop)


def test_widget_view_id_and_state_parsing():
    view = '<script type="application/vnd.jupyter.widget-view+json">{"version_major": 2, "model_id": "abc"}</script>'
    assert bookhtml.widget_view_id(view) == "abc"
    assert bookhtml.widget_view_id("<div>abc</div>") is None
    assert bookhtml.widget_models(None) == {}
    with pytest.raises(ValueError, match="'state' mapping"):
        bookhtml.widget_models({"state": ["not", "a", "mapping"]})


def _papermill_notebook() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Alpha\n\nInline $x_i^\\top W_{QK} x_q$."),
        nbformat.v4.new_code_cell("profile = None\nresults_path = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(f'# Parameters\nprofile = "full"\nresults_path = "{MACHINE_DIR}/alpha.json"\n',
                                  metadata={"tags": ["injected-parameters"]}),
        nbformat.v4.new_code_cell("print(profile)", outputs=[nbformat.v4.new_output("stream", name="stdout", text="full\n")]),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["papermill"] = {"parameters": {"profile": "full", "results_path": f"{MACHINE_DIR}/alpha.json"},
                                "input_path": f"{MACHINE_DIR}/alpha.input.ipynb",
                                "output_path": f"{MACHINE_DIR}/alpha.ipynb"}
    return nb


def test_hide_injected_parameters_hides_the_cell_says_why_and_drops_machine_paths():
    nb = _papermill_notebook()
    assert cache.hide_injected_parameters(nb) == 1
    injected = next(c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert "remove-cell" in injected.metadata["tags"]
    assert 'results_path = "alpha.json"' in injected.source and 'profile = "full"' in injected.source
    note = nb.cells[nb.cells.index(injected) + 1]
    assert note.cell_type == "markdown" and "`profile = 'full'`" in note.source and "`results_path`" in note.source
    assert MACHINE_DIR not in nbformat.writes(nb), "a machine path is left in the notebook"
    assert nb.metadata.papermill["output_path"] == "alpha.ipynb"
    plain = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    assert cache.hide_injected_parameters(plain) == 0 and len(plain.cells) == 1


def test_drop_hidden_outputs_keeps_glue_and_visible_cells():
    glued = nbformat.v4.new_output("display_data", {"application/papermill.record/text/plain": "0.93"},
                                   metadata={"scrapbook": {"name": "acc", "mime_prefix": "application/papermill.record/"}})
    printed = nbformat.v4.new_output("stream", name="stdout", text=f"results written to {MACHINE_DIR}/a.json\n")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("glue(...); print(...)", metadata={"tags": ["remove-cell"]}, outputs=[glued, printed]),
        nbformat.v4.new_code_cell("x", metadata={"tags": ["remove-output"]}, outputs=[printed]),
        nbformat.v4.new_code_cell("y", outputs=[printed]),
    ])
    assert bookhtml.drop_hidden_outputs(nb) == 2
    assert [len(c.outputs) for c in nb.cells] == [1, 0, 1]
    assert "scrapbook" in nb.cells[0].outputs[0].metadata  # the glued value other pages read
    assert nb.cells[2].outputs[0].text.startswith("results written")  # visible on the page: kept


CHAPTER = """---
jupytext:
  text_representation: {extension: .md, format_name: myst}
kernelspec: {display_name: Python 3, language: python, name: python3}
---
# Alpha

Inline $x_i^\\top W_{QK} x_q$ and display

$$ \\alpha_i = \\operatorname{softmax}_i(z) $$

```{code-cell} ipython3
from tqdm.auto import tqdm
for i in tqdm(range(8), desc="synthetic grid"):
    for j in tqdm(range(3), desc="inner", leave=False):
        pass
```

```{code-cell} ipython3
:tags: [remove-cell]
print("results written to /home/alice/qkov/_build/results/alpha.json")
```
"""


def _sphinx(src: Path, conf: str) -> str:
    """Build ``src`` (``index`` -> ``alpha``) with the book's extensions; the HTML of ``alpha``."""
    (src / "conf.py").write_text(
        "extensions = ['myst_nb', 'sphinx_book_theme', 'qkov_lib.tooling.bookhtml', 'sphinx-mathjax-offline']\n"
        "html_theme = 'sphinx_book_theme'\nmathjax_path = 'mathjax/tex-chtml.js'\nnb_ipywidgets_js = {}\n"
        "myst_enable_extensions = ['dollarmath', 'amsmath']\nhtml_sourcelink_suffix = ''\n"
        "exclude_patterns = ['_build']\n" + conf)
    (src / "index.md").write_text("# Home\n\n```{toctree}\nalpha\n```\n")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", str(src), str(src / "_build" / "html")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (src / "_build" / "html" / "alpha.html").read_text()


def _downloads(html: str) -> dict[str, str]:
    return dict((text, href) for href, text in re.findall(
        r'<a href="([^"]*_sources/[^"]+)"[^>]*>.*?<span class="btn__text-container">([^<]+)</span>', html, re.S))


def _assert_offline_math(html: str, out: Path) -> None:
    scripts = re.findall(r'<script[^>]*\bsrc="([^"]+)"', html)
    assert any(s.startswith("_static/mathjax/tex-chtml.js") for s in scripts), scripts
    assert not [s for s in scripts if re.match(r"(https?:)?//", s)], f"scripts from the network: {scripts}"
    assert (out / "_static" / "mathjax" / "tex-chtml.js").stat().st_size > 100_000


def test_force_build_draws_progress_bars_offers_md_and_ipynb_and_serves_mathjax(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "alpha.md").write_text(CHAPTER)
    html = _sphinx(src, "nb_execution_mode = 'force'\n")
    out = src / "_build" / "html"
    bars = re.findall(r'<progress [^>]*value="([\d.]+)" max="([\d.]+)"', html)
    assert bars == [("8", "8")], bars  # the outer bar, finished; the leave=False inner bars are gone
    assert "widget-view+json" not in html and "IProgress not found" not in html
    links = _downloads(html)
    assert set(links) == {".md", ".ipynb"}, links
    assert (out / links[".md"]).read_text() == CHAPTER
    executed = nbformat.read(out / links[".ipynb"], as_version=4)
    assert [c for c in executed.cells if c.cell_type == "code"][0].outputs  # executed, with outputs
    outputs = json.dumps([c.get("outputs", []) for c in executed.cells])
    assert "/home/alice" not in outputs  # the hidden cell's printed path is dropped from the download
    _assert_offline_math(html, out)


def test_executed_notebook_page_hides_injected_cell_and_offers_the_md_source(tmp_path: Path):
    src, sources = tmp_path / "stage", tmp_path / "repo"
    src.mkdir()
    sources.mkdir()
    (sources / "alpha.md").write_text(CHAPTER)
    nb = _papermill_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("save_results(...)", metadata={"tags": ["remove-cell"]}, outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=f"results written to {MACHINE_DIR}/alpha.json\n")]))
    cache.hide_injected_parameters(nb)
    nbformat.write(nb, src / "alpha.ipynb")
    html = _sphinx(src, f"nb_execution_mode = 'off'\nqkov_source_dir = {str(sources)!r}\n")
    assert MACHINE_DIR not in html and "alpha.json" not in html  # the injected cell is not on the page
    text = re.sub(r"<[^>]+>", "", html)
    assert "executed with papermill" in text and "profile = 'full'" in text and "results_path" in text
    links = _downloads(html)
    assert set(links) == {".md", ".ipynb"}
    assert (src / "_build" / "html" / links[".md"]).read_text() == CHAPTER  # from qkov_source_dir
    assert MACHINE_DIR not in (src / "_build" / "html" / links[".ipynb"]).read_text()
    _assert_offline_math(html, src / "_build" / "html")
