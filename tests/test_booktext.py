"""qkov_lib.tooling.booktext on small hand-written pages: each check catches the untrue text it is
for (the faults of earlier builds among them) and passes the true text next to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qkov_lib.tooling import booktext as bt


def page(body: str, name: str = "book/05_x", title: str = "X") -> bt.Page:
    return bt.parse_page(f"<html><head><title>{title} &#8212; book</title></head><body><nav><p>the claims page "
                         f"README</p></nav><article><h1>{title}</h1>{body}</article></body></html>", name)


def settings(ratios: str = "[1.0, 3.0, 10.0, 30.0, 100.0]", seeds: str = "[0, 1, 2]") -> str:
    """A settings table as profiles.settings_frame renders it through pandas."""
    return ("<table class='dataframe'><thead><tr><th></th><th>value</th></tr><tr><th>setting</th><th></th></tr>"
            f"</thead><tbody><tr><th>profile</th><td>cpu</td></tr><tr><th>ratios</th><td>{ratios}</td></tr>"
            f"<tr><th>seeds</th><td>{seeds}</td></tr></tbody></table>")


def table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def ratio_texts(body: str, allowed=None) -> list[str]:
    p = page(body)
    return [f.text for f in bt.ratio_findings(p, bt.table_ratio_sets(p) if allowed is None else allowed)]


# ---------------------------------------------------------------- parsing

def test_parse_reads_prose_tables_math_glue_code_and_links_of_the_article_only():
    p = page("<p>Ratio <span class='math notranslate nohighlight'>\\(\\eta_{QK}/\\eta_{OV} \\in \\{1, 10\\}\\)</span>"
             " on <span class='pasted-text'>185</span> questions, see <a href='y.html'>Y</a> and "
             "<code class='docutils literal'><span class='pre'>a/b.py</span></code>.</p>"
             "<div class='cell_input'><pre>ratios = [1, 3]</pre></div>"
             "<table><thead><tr><th></th><th>a</th></tr></thead><tbody>"
             "<tr><th rowspan='2'>FAFO</th><td>1</td></tr><tr><td>2</td></tr></tbody></table>")
    prose = [b for b in p.blocks if b.kind == "prose"]
    assert p.title == "X" and len(prose) == 1
    b = prose[0]
    assert "η_QK/η_OV ∈ {1, 10}" in b.text and "ratios = [1, 3]" not in b.text and "README" not in b.text
    assert b.code == ["a/b.py"] and b.links == [("y.html", "Y")]
    assert b.mask[b.text.index("185")] == "g" and b.mask[b.text.index("Y")] == "l" and b.mask[b.text.index("a/b")] == "c"
    assert "a/b.py" not in b.plain and bt.LINK_MARK in b.plain
    t = next(b for b in p.blocks if b.kind == "table")
    assert t.rows == [["FAFO", "1"], ["FAFO", "2"]]  # the row-spanning index cell repeats


def test_settings_rows_ratio_columns_and_ratio_headers_give_the_pages_ratio_lists():
    p = page(settings("[1.0, 10.0]") + table(["parameterization", "ratio", "loss"], [["FAFO", "1.0", "0.1"],
                                                                                  ["FAFO", "100.0", "0.2"]])
             + table(["condition", "ratio 1", "ratio 30"], [["a", "0.5", "0.6"]]))
    assert bt.table_ratio_sets(p) == [frozenset({1.0, 10.0}), frozenset({1.0, 100.0}), frozenset({1.0, 30.0})]
    assert bt.seed_counts(p) == {3}
    assert bt.results_ratio_sets({"params": {"ratios": [1, 3], "variant_ratios": [1.0], "seeds": [0]}}) == [
        frozenset({1.0, 3.0}), frozenset({1.0})]


# ---------------------------------------------------------------- ratios

def test_a_ratio_set_in_prose_that_differs_from_the_settings_is_caught():
    fault = "<p>Only r ∈ {1, 10, 100} and the seed change.</p>"  # an earlier build's sentence
    found = ratio_texts(settings("[1.0, 3.0, 10.0, 30.0, 100.0]") + fault)
    assert len(found) == 1 and "{1, 10, 100}" in found[0] and "{1, 3, 10, 30, 100}" in found[0]
    assert ratio_texts(settings("[1.0, 10.0, 100.0]") + fault) == []


def test_ratio_sets_in_math_and_typed_lists_after_ratios_are_read():
    math = ("<p>Accuracy holds as <span class='math'>\\(\\eta_{QK}/\\eta_{OV}\\)</span> grows in "
            "<span class='math'>\\(\\{1, 10\\}\\)</span>.</p>")
    assert len(ratio_texts(settings("[1.0, 10.0, 100.0]") + math)) == 1
    assert ratio_texts(settings("[1.0, 10.0]") + math) == []
    typed = "<p>We train at ratios 1, 3 and 10.</p>"
    assert len(ratio_texts(settings("[1.0, 10.0, 100.0]") + typed)) == 1
    assert ratio_texts(settings("[1.0, 3.0, 10.0]") + typed) == []
    # a typed list describes the run: a part of the settings is not the settings
    assert len(ratio_texts(settings("[1.0, 3.0, 10.0, 30.0]") + typed)) == 1


def test_a_glued_ratio_list_must_be_among_the_ratios_run():
    glued = "<p>FACO is on top at the ratios <span class='pasted-text'>{}</span>.</p>"
    assert ratio_texts(settings("[0.1, 1.0, 10.0, 100.0]") + glued.format("0.1, 10, 100")) == []
    found = ratio_texts(settings("[0.1, 1.0, 10.0, 100.0]") + glued.format("0.1, 3, 100"))
    assert len(found) == 1 and "not all among" in found[0]


def test_the_papers_ratios_numbers_that_are_not_ratio_lists_and_code_are_not_held_to_the_settings():
    s = settings("[1.0, 10.0]")
    assert ratio_texts(s + "<p>The paper trains at ratios 1, 3 and 10.</p>") == []
    assert ratio_texts(s + "<p>The paper's claims:</p><ul><li><p>R1: accuracy is stable as the ratio grows in "
                           "{1, 10, 100};</p></li></ul>") == []
    assert ratio_texts(s + "<p>Our claims:</p><ul><li><p>R1: stable as the ratio grows in {1, 10, 100};</p></li>"
                           "</ul>") != []
    for text in ("<p>the top-k% tokens, for k ∈ {1, 5, 10, 20, 50}, with r the ratio.</p>",
                 "<p>At ratio 100, 4 of 8 runs ended below 0.99.</p>",
                 "<p>AC is 15.5% at ratio 1 and 8.0% at ratio 10.</p>",
                 "<p>Rerun with <code>qkov run synthetic -p ratios '[1, 100]'</code>.</p>",
                 "<p>Ratios 1, 10.</p>"):
        assert ratio_texts(s + text) == [], text


# ---------------------------------------------------------------- intervals

def interval_texts(body: str, seeds=()) -> list[str]:
    return [f.text for f in bt.interval_findings(page(body), seeds)]


PLAIN = table(["group", "ratio 1", "ratio 10"], [["a", "0.500", "0.600"], ["b", "0.700", "0.800"]])
WITH_PM = table(["group", "ratio 1", "ratio 10"], [["a", "0.500 ± 0.020", "0.600 ± 0.030"], ["b", "0.700", "0.8"]])


def test_a_claim_of_intervals_before_a_table_without_one_is_caught():
    claim = "<p><strong>By question type</strong> (accuracy, mean ± 95% seed interval):</p>"
    found = interval_texts(claim + PLAIN)
    assert len(found) == 1 and "By question type" in found[0]
    assert interval_texts(claim + WITH_PM) == []
    for other in ("<p>Each cell gives the means with 95% seed intervals over the seeds.</p>",
                  "<p>Ranked by mean attention, with seed intervals, at each ratio.</p>",
                  "<p>The difference of the two with its 95% seed interval.</p>"):
        assert len(interval_texts(other + PLAIN)) == 1, other
        assert interval_texts(other + WITH_PM) == [], other


def test_a_column_that_promises_an_interval_needs_one_in_its_cells():
    fault = table(["claim", "ours (mean ± 95 % seed interval)"], [["R1", "accuracy 0.81 → 0.64"]])
    found = interval_texts(fault)
    assert len(found) == 1 and "ours (mean ± 95 % seed interval)" in found[0]
    assert interval_texts(table(["claim", "ours (mean ± 95 % seed interval)"], [["R1", "0.81 ± 0.02"]])) == []


def test_a_half_width_column_counts_as_an_interval_when_it_has_a_number():
    claim = "<p>The change, mean over seeds with its 95% half-width:</p>"
    shown = table(["ratio", "change", "±"], [["10.0", "-0.027", "0.012"]])
    empty = table(["ratio", "change", "±"], [["10.0", "-0.027", "NaN"]])
    assert interval_texts(claim + shown) == []
    assert interval_texts(claim + table(["ratio", "TV", "± (seeds)"], [["1.0", "0.06", "1.48"]])) == []
    found = interval_texts(claim + empty)
    assert len(found) == 2 and "half-width column '±'" in found[1]
    assert interval_texts(claim + table(["ratio", "accuracy", "accuracy_ci"], [["1.0", "0.50", "0.02"]])) == []
    # columns of a low and a high ratio are not an interval
    assert len(interval_texts(claim + table(["metric", "AC lo", "AC hi"], [["AC", "0.1", "0.4"]]))) == 1


def test_a_claim_that_says_what_one_seed_shows_holds_only_where_one_seed_ran():
    claim = "<p>By condition (accuracy: mean over seeds ± its 95% seed interval; the mean alone with one seed):</p>"
    assert interval_texts(settings(seeds="[0]") + claim + PLAIN, seeds={1}) == []
    assert len(interval_texts(claim + PLAIN, seeds={3})) == 1
    p = page(settings(seeds="[0]") + claim + PLAIN)
    assert bt.interval_findings(p, bt.seed_counts(p)) == []


def test_intervals_used_to_decide_or_far_from_the_table_are_not_claims_about_it():
    assert interval_texts("<p>A * marks a change whose 95% seed interval excludes 0.</p>" + PLAIN) == []
    assert interval_texts("<p>Verdicts are decided on paired seed intervals.</p>" + PLAIN) == []
    assert interval_texts("<p>Mean ± 95% seed interval:</p><h2>Next</h2>" + PLAIN) == []
    assert interval_texts("<p>Mean ± 95% seed interval:</p><img src='f.png'/>" + PLAIN) == []
    # two tables shown by one cell: the claim holds when either shows intervals
    assert interval_texts("<p>Mean ± 95% seed interval:</p>" + PLAIN + WITH_PM) == []


# ---------------------------------------------------------------- references

@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, Path]:
    """A built site (``html/``) and a repository checkout (``repo/``)."""
    html, repo = tmp_path / "html", tmp_path / "repo"
    (html / "book").mkdir(parents=True)
    (html / "_downloads").mkdir()
    (html / "_downloads" / "data.csv").write_text("a\n")
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "README.md").write_text("# b\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_x.py").write_text("def test_a():\n    pass\n")
    (repo / "qkov_lib" / "studies").mkdir(parents=True)
    (repo / "qkov_lib" / "__init__.py").write_text("")
    (repo / "qkov_lib" / "studies" / "__init__.py").write_text("")
    (repo / "qkov_lib" / "studies" / "m.py").write_text("import math\nX = 1\n\n\nclass Head:\n    pass\n")
    return html, repo


TITLES = {"book/05_squad": "SQuAD", "book/07_sva": "Subject–verb agreement", "book/intro": "qkov",
          "book/10_scorecard": "Reproducibility scorecard"}


def ref_texts(body: str, site) -> list[str]:
    html, repo = site
    return [f.text for f in bt.reference_findings(page(body), html / "book" / "05_x.html", html, repo, TITLES)]


def test_a_readme_the_book_does_not_contain_is_caught(site):
    found = ref_texts("<p>The files are listed with their checksums (see the data README).</p>", site)
    assert len(found) == 1 and "README" in found[0]
    (site[0] / "book" / "data.html").write_text("<html></html>")
    assert ref_texts("<p>See the <a href='data.html'>data README</a>.</p>", site) == []
    assert ref_texts("<p>Timings: <code>benchmarks/README.md</code>.</p>", site) == []
    assert len(ref_texts("<p>Timings: <code>benchmarks/TIMES.md</code>.</p>", site)) == 1
    assert len(ref_texts("<p>Timings: see benchmarks/TIMES.md.</p>", site)) == 1


def test_a_page_named_that_the_book_does_not_have_is_caught(site):
    fault = "<p>The metrics are defined on the claims page of this book.</p>"  # an earlier build's sentence
    found = ref_texts(fault, site)
    assert len(found) == 1 and "the claims page" in found[0]
    (site[0] / "book" / "intro.html").write_text("<html></html>")
    assert ref_texts("<p>The metrics are defined on the <a href='intro.html'>claims page</a>.</p>", site) == []
    for ok in ("<p>The prefixes of the SVA chapter.</p>", "<p>As in the SQuAD chapter, and in chapter 10.</p>",
               "<p>The scorecard page lists them; the previous chapters ran them.</p>",
               "<p>The verdict of a chapter is the rule's verdict.</p>"):
        assert ref_texts(ok, site) == [], ok
    assert len(ref_texts("<p>The task of chapter 12.</p>", site)) == 1


def test_links_and_repository_names_must_resolve(site):
    html, repo = site
    (html / "book" / "other.html").write_text("<html></html>")
    ok = ("<p><a href='other.html#x'>o</a>, <a href='../_downloads/data.csv'>d</a>, <a href='#top'>t</a>, "
          "<a href='https://example.org/README'>e</a>, <code>tests/test_x.py::test_a</code>, "
          "<code>qkov_lib.studies.m.Head</code>, <code>qkov_lib.studies.m</code>, <code>runs/out.json</code>, "
          "<code>$QKOV_DATA_DIR/x.json</code>.</p>")
    assert ref_texts(ok, site) == []
    bad = ["<p><a href='missing.html'>m</a>.</p>", "<p><a href='../../outside.html'>m</a>.</p>",
           "<p><code>tests/test_x.py::test_b</code></p>", "<p><code>tests/test_y.py</code></p>",
           "<p><code>qkov_lib.studies.m.Tail</code></p>", "<p><code>qkov_lib.nothing</code></p>"]
    for b in bad:
        assert len(ref_texts(b, site)) == 1, b


# ---------------------------------------------------------------- the whole book

def write_book(html: Path, results: Path, chapter_text: str, ratios=(1, 10, 100)) -> None:
    (html / "index.html").write_text("<html><head><meta http-equiv='refresh' content='0; url=book/intro.html'>"
                                     "</head></html>")
    (html / "book" / "intro.html").write_text("<html><body><article><h1>Intro</h1><p>Chapters ran at "
                                              "ratios 1, 10 and 100.</p></article></body></html>")
    (html / "book" / "05_x.html").write_text(f"<html><body><article><h1>X</h1>{chapter_text}</article></body></html>")
    results.mkdir(exist_ok=True)
    (results / "x.json").write_text(json.dumps({"chapter": "x", "params": {"ratios": list(ratios), "seeds": [0, 1]}}))


def test_check_book_reads_each_pages_results_file_and_holds_pages_without_settings_to_all(site, tmp_path):
    html, repo = site
    results = tmp_path / "results"
    write_book(html, results, "<p>We ran r ∈ {1, 10, 100}.</p>")
    assert bt.check_book(html, results, repo) == []
    write_book(html, results, "<p>We ran r ∈ {1, 10}.</p>")
    assert [(f.page, f.kind) for f in bt.check_book(html, results, repo)] == [("book/05_x", "ratios")]
    write_book(html, results, "<p>We ran r ∈ {1, 10}.</p>", ratios=(1, 10))  # the intro's list is not run
    assert [(f.page, f.kind) for f in bt.check_book(html, results, repo)] == [("book/intro", "ratios")]


def test_main_prints_the_findings_and_exits_1_when_there_are_any(site, tmp_path, capsys):
    html, repo = site
    results = tmp_path / "results"
    write_book(html, results, "<p>See the data README.</p>")
    assert bt.main([str(html), "--results", str(results), "--repo", str(repo)]) == 1
    out = capsys.readouterr().out
    assert "book/05_x [references]" in out and "README" in out
    write_book(html, results, "<p>Fine.</p>")
    assert bt.main([str(html), "--results", str(results), "--repo", str(repo)]) == 0
    assert bt.main([str(tmp_path / "nothing")]) == 2


# ---------------------------------------------------------------- verdicts

def test_an_outcome_cell_must_agree_with_its_own_interval():
    ok = table(["cell", "R2"], [["AdamW ×10", "holds: +0.154 ± 0.030 (n = 8)"],
                                ["SGD ×10", "contradicted: -0.011 ± 0.012 (n = 4)"],
                                ["SGD ×100", "undecided: +0.116 ± 0.172 (n = 4)"]])
    assert bt.verdict_findings(page(ok)) == []
    planted = table(["cell", "R2"], [["AdamW ×10", "holds: +0.010 ± 0.005 (n = 8)"],       # below the +0.05 margin
                                     ["SGD ×10", "contradicted: +0.116 ± 0.172 (n = 4)"],  # straddles it
                                     ["SGD ×100", "undecided: +0.300 ± 0.010 (n = 4)"]])   # wholly above it
    found = bt.verdict_findings(page(planted))
    assert len(found) == 3 and all(f.kind == "verdicts" for f in found)
    assert "says holds, its interval against Δ ≥ +0.05 says contradicted" in found[0].text
    # R1's margin is -0.02: a fall of 0.01 holds
    assert bt.verdict_findings(page(table(["cell", "R1"], [["x", "holds: -0.010 ± 0.005 (n = 4)"]]))) == []
    # a cell on the margin up to the printed rounding may read either way
    assert bt.verdict_findings(page(table(["cell", "R2"], [["x", "holds: +0.080 ± 0.030 (n = 4)"]]))) == []


def test_a_quantifying_sentence_must_be_computed_not_typed():
    typed = page("<p>FAFO moves toward CACO, as summary A says.</p><p>The claim holds everywhere.</p>"
                 "<p>exp(q) grows like log² t for FACO, CACO.</p>")
    found = bt.verdict_findings(typed)
    assert [f.text.split("'")[1] for f in found] == ["as summary A says", "everywhere", "for FACO, CACO"]
    glued = page("<p>The claim holds <span class='pasted-text'>everywhere</span>; exp(q) grows like log² t "
                 "<span class='pasted-text'>for FACO, CACO</span>.</p>")
    assert bt.verdict_findings(glued) == []
