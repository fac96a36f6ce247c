"""qkov_lib.figure_source: the line under each figure names the function that drew it and the
results file and key of its numbers; the built-book check (booktext ``sources``) catches a figure
without it and a key its results file lacks."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from qkov_lib import figure_source as fs  # noqa: E402
from qkov_lib import plotting  # noqa: E402
from qkov_lib.tooling import booktext as bt  # noqa: E402


@fs.draws
def _drawing():
    return plt.figure()


def test_a_decorated_function_names_itself_on_its_figure_and_the_line_parses_back():
    fig = _drawing()
    line = fs.caption(fig, "squad", "metrics.plane")
    assert line == f"Drawn by `{__name__}._drawing` from `squad.json`, key `metrics.plane`."
    assert fs.parse(line) == (f"{__name__}._drawing", "squad", "metrics.plane")
    # as the built page shows it: code spans become plain text
    assert fs.parse(line.replace("`", "")) == (f"{__name__}._drawing", "squad", "metrics.plane")
    plt.close(fig)


def test_the_library_figures_carry_their_function():
    hist = pd.DataFrame({"step": [1, 2, 1, 2], "loss": [1.0, 0.5, 0.9, 0.4], "run": ["a", "a", "b", "b"]})
    fig = plotting.training_curves(hist, ["loss"], hue="run")
    assert fs.parse(fs.caption(fig, "synthetic", "metrics.history"))[0] == "qkov_lib.plotting.training_curves"
    plt.close(fig)


def test_a_figure_not_drawn_by_the_library_or_a_bad_key_gets_a_clear_error():
    fig = plt.figure()
    with pytest.raises(TypeError, match="not drawn by a qkov_lib function"):
        fs.caption(fig, "squad", "metrics.plane")
    fig = _drawing()
    for key in ("", "metrics..plane", ".plane"):
        with pytest.raises(ValueError, match="dotted path"):
            fs.caption(fig, "squad", key)
    with pytest.raises(ValueError, match="without .json"):
        fs.caption(fig, "squad.json", "metrics.plane")
    plt.close("all")

    @fs.draws
    def not_a_figure():
        return 3

    with pytest.raises(TypeError, match="not a matplotlib figure"):
        not_a_figure()


def test_nothing_to_draw_passes_through_and_shows_a_line_that_says_so(monkeypatch):
    @fs.draws
    def nothing():
        return None

    assert nothing() is None
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    fs.show(None, "squad", "metrics.curves")
    assert [getattr(x, "data", x) for x in shown] == [fs.NOTHING_DRAWN]


def test_a_key_with_a_dot_inside_one_step_resolves():
    doc = {"metrics": {"curves": {"val_AC@0.5": [1, 2]}, "plane": []}}
    assert bt.results_key(doc, "metrics.plane")
    assert bt.results_key(doc, "metrics.curves.val_AC@0.5")
    assert not bt.results_key(doc, "metrics.curves.val_AC@0.9")
    assert not bt.results_key(doc, "metrics.phase")


def _page(body: str) -> bt.Page:
    return bt.parse_page(f"<html><head><title>X</title></head><body><article><h1>X</h1>{body}</article>"
                         "</body></html>", "book/05_squad")


def test_the_book_check_wants_a_line_under_every_figure_and_its_key_in_the_results(tmp_path):
    (tmp_path / "squad.json").write_text(json.dumps({"metrics": {"plane": [1]}}))
    good = "<p>Drawn by <code>qkov_lib.rate_plane.plot_plane</code> from <code>squad.json</code>, key <code>metrics.plane</code>.</p>"
    img = "<div class='cell_output'><img src='a.png'/></div>"
    assert bt.source_findings(_page(img + good), tmp_path) == []
    # a glued figure: the line ends its caption
    fig = f"<figure><img src='a.png'/><figcaption><p>The plane. {good[3:-4]}</p></figcaption></figure>"
    assert bt.source_findings(_page(fig), tmp_path) == []
    # two figures and one line; a line with a key the file lacks; a file that is not there
    assert [f.kind for f in bt.source_findings(_page(img + img + good), tmp_path)] == ["sources"]
    assert bt.source_findings(_page(img + "<h2>Next</h2>" + good), tmp_path)[0].text.startswith("a figure without")
    missing = bt.source_findings(_page(img + good.replace("metrics.plane", "metrics.phase")), tmp_path)
    assert len(missing) == 1 and "has no key 'metrics.phase'" in missing[0].text
    nofile = bt.source_findings(_page(img + good.replace("squad.json", "sva.json")), tmp_path)
    assert len(nofile) == 1 and "no results file sva.json" in nofile[0].text


def test_a_source_line_names_a_results_file_the_build_writes_but_its_function_must_exist(tmp_path):
    line = ("<p>Drawn by <code>qkov_lib.rate_plane.plot_plane</code> from <code>squad.json</code>, key "
            "<code>metrics.plane</code>.</p>")
    page, repo = _page(line), Path(__file__).resolve().parents[1]
    assert bt.reference_findings(page, tmp_path / "05_squad.html", tmp_path, repo, {}) == []
    gone = bt.reference_findings(_page(line.replace("plot_plane", "plot_nothing")), tmp_path / "05_squad.html",
                                 tmp_path, repo, {})
    assert len(gone) == 1 and "plot_nothing" in gone[0].text
    # outside a source line, a .json name is still a repository path to check
    other = bt.reference_findings(_page("<p>See <code>squad.json</code>.</p>"), tmp_path / "05_squad.html",
                                  tmp_path, repo, {})
    assert len(other) == 1 and "squad.json is not in the repository" in other[0].text
