"""Tables in the book are shown whole: pandas' display options set by ``qkov_lib.tooling``."""

import subprocess
import sys

import pandas as pd

from qkov_lib.tooling import tables


def _long_frame(n_rows: int = 150, text_len: int = 300) -> pd.DataFrame:
    long = "word " * (text_len // 5)
    return pd.DataFrame({"id": range(n_rows), "meaning": [f"{i}: {long}end" for i in range(n_rows)],
                         **{f"c{k}": range(n_rows) for k in range(30)}})


def test_setup_display_shows_every_row_column_and_whole_cell_text():
    frame = _long_frame()
    with pd.option_context(*[x for k in tables.DISPLAY_OPTIONS for x in (k, pd.get_option(k))]):  # restored after
        for k in tables.DISPLAY_OPTIONS:
            pd.reset_option(k)
        cut = frame._repr_html_()
        assert "..." in cut and "rows × 32 columns" in cut  # what pandas does on its own
        before = tables.setup_display()
        assert before["display.max_colwidth"] == 50
        html = frame._repr_html_()
    assert "..." not in html and "rows ×" not in html
    assert html.count("end</td>") == len(frame)  # every row, each cell's text to its last word
    assert "<th>c29</th>" in html  # the last column


def test_importing_the_tooling_package_sets_the_options():
    code = ("import pandas as pd; import qkov_lib.tooling; "
            "print([pd.get_option(k) for k in ('display.max_colwidth', 'display.max_rows', 'display.max_columns')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[None, None, None]"


def test_the_book_stylesheet_reaches_every_page():
    """Jupyter Book 1 adds every .css file of the root ``_static/`` folder to each page: the final
    Sphinx configuration built from ``_config.yml`` lists ``qkov.css``, which keeps wide tables in
    their own scroll box with a sticky header."""
    from pathlib import Path

    from jupyter_book.config import get_final_config

    root = Path(__file__).resolve().parents[1]
    config, _ = get_final_config(user_yaml=root / "_config.yml", cli_config={"latex_individualpages": False},
                                 sourcedir=root)
    assert "_static" in config["html_static_path"] and config["html_css_files"].count("qkov.css") == 1
    css = (root / "_static" / "qkov.css").read_text()
    assert "overflow-x: auto" in css and "position: sticky" in css
