"""The book as a site: the Sphinx extensions that serve Plotly from the book (no CDN), point the
launch buttons at the chapters' MyST sources, and say under each page's title which profile and
commit its numbers come from."""

from __future__ import annotations

import json

import pytest

from qkov_lib.tooling import launch, plotlyjs, provenance


def test_plotly_is_served_from_the_installed_package():
    path = plotlyjs.plotly_js()
    head = path.read_bytes()[:400].decode("utf-8", "replace")
    assert path.stat().st_size > 1_000_000 and "plotly.js" in head.lower()
    assert not plotlyjs.needs_plotly("<p>no figure here</p>")


def test_launch_links_open_the_chapters_markdown_source():
    page = "book/01_synthetic"
    binder = "https://mybinder.org/v2/gh/o/qkov/main?urlpath=lab/tree/book/01_synthetic.ipynb"
    hub = "https://hub.example.edu/hub/user-redirect/git-pull?urlpath=lab%2Ftree%2Fqkov%2Fbook%2F01_synthetic.ipynb"
    assert launch.source_url(binder, page).endswith("lab/tree/book/01_synthetic.md")
    assert launch.source_url(hub, page).endswith("book%2F01_synthetic.md")
    assert launch.source_url("https://example.org/other.ipynb", page) == "https://example.org/other.ipynb"


def test_the_environment_sets_the_repository_and_hub_and_a_bad_address_is_refused():
    base = {"repository_url": "https://github.com/a/b", "launch_buttons": {"binderhub_url": "https://mybinder.org"}}
    out = launch.theme_overrides(base, {launch.REPOSITORY_ENV: "https://github.com/owner/qkov/",
                                        launch.BRANCH_ENV: "main", launch.HUB_ENV: "https://hub.example.edu"})
    assert out["repository_url"] == "https://github.com/owner/qkov" and out["repository_branch"] == "main"
    assert out["launch_buttons"] == {"binderhub_url": "https://mybinder.org", "jupyterhub_url": "https://hub.example.edu"}
    assert launch.theme_overrides(base, {}) == base
    with pytest.raises(ValueError, match=r"\$QKOV_JUPYTERHUB_URL must be an https:// address"):
        launch.theme_overrides(base, {launch.HUB_ENV: "http://hub"})


@pytest.mark.parametrize("page, name", [("book/01_synthetic", "synthetic"), ("book/dynamics-explorer", "dynamics-explorer"),
                                        ("book/realdata_protocol", "realdata_protocol"), ("book/intro", "intro")])
def test_a_page_reads_the_results_file_qkov_run_names_for_it(page, name):
    assert provenance.results_name(page) == name


def test_the_line_names_the_profile_and_commit_under_the_title(tmp_path):
    doc = {"chapter": "synthetic", "params": {"profile": "full"}, "git_commit": "0123456789abcdef0123"}
    sentence = provenance.provenance(doc)
    assert sentence == "Numbers on this page: profile full, commit 0123456789ab."
    body = '<section id="x"><h1>Title</h1><p>text</p></section>'
    out = provenance.with_line(body, provenance.line_html(sentence, "synthetic.json"))
    assert out.index("</h1>") < out.index("profile full") < out.index("<p>text")
    assert provenance.provenance({"params": {}, "git_commit": "abc"}) is None
    assert "commit unknown" in provenance.provenance({"params": {"profile": "cpu"}, "git_commit": None})
    assert provenance.with_line("<p>no heading</p>", "<p>L</p>") == "<p>L</p><p>no heading</p>"
