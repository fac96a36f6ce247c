"""The reproducibility scorecard: claims from results files, verdicts, the MyST table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qkov_lib import claims

from qkov_lib.tooling import cli, results, scorecard

# rules as a chapter states them (the scorecard shows whatever rule a measurement carries)
R1_RULE = "reproduced: attention is sharper at the higher ratio in every decided cell"
R3_RULE = "decoupled: the heads sharpen while accuracy stays within its margin"


@pytest.fixture
def book(tmp_path: Path) -> Path:
    d = tmp_path / "book"
    d.mkdir()
    for name in ("01_synthetic.md", "03_theory.md", "intro.md"):
        (d / name).write_text("# page\n")
    return d


def _results(folder: Path) -> None:
    results.save_results("synthetic", {"profile": "test"}, {"claims": [
        claims.claim("S1", "heatmaps differ", "they differ | a lot", "reproduced", "01_synthetic"),
        claims.claim("S3", "ratio sharpens", "4/4 sharper",
                     claims.Verdict("holds where", "r", "3/4 up", region="for FAFO, CAFO, FACO; not CACO"),
                     "01_synthetic")]},
        path=folder / "synthetic.json", wall_time_s=1.5, device="cpu")
    results.save_results("theory", {"profile": "cpu"}, {"claims": [
        claims.claim("S3", "ratio sharpens", "ODE says yes", "reproduced", "theory"),
        claims.claim("T9", "not a claim", "?", "not tested", "theory"),
        claims.claim("R3-multilayer", "decoupled", "heads sharpen",
                     claims.Verdict("reproduced", R3_RULE, "sharper at equal accuracy"), "theory")]},
        path=folder / "theory.json", wall_time_s=2.0, device="cpu")
    results.save_results("removed", {}, {"claims": [claims.claim("T1", "p", "o", "reproduced", "05_removed")]},
                         path=folder / "removed.json")
    results.save_results("plain", {}, [{"no": "claims"}], path=folder / "plain.json")


def test_claim_ids_are_the_papers():
    assert list(scorecard.CLAIMS) == [f"T{i}" for i in range(1, 7)] + ["S1", "S2", "S3", "R1", "R2", "R3"]
    assert all(re.fullmatch(r"[TSR]\d-[a-z]+", e) for e in scorecard.EXTENSIONS)


def test_load_results_keeps_only_files_with_claims(tmp_path: Path, book: Path):
    _results(tmp_path)
    found = scorecard.load_results(tmp_path)
    assert [p.name for p, _ in found] == ["removed.json", "synthetic.json", "theory.json"]
    with pytest.raises(FileNotFoundError, match="does not exist"):  # not an empty scorecard
        scorecard.load_results(tmp_path / "missing")


def test_find_doc_maps_names_to_numbered_pages(book: Path):
    assert scorecard.find_doc("01_synthetic", book) == "01_synthetic"
    assert scorecard.find_doc("synthetic", book) == "01_synthetic"
    assert scorecard.find_doc("theory", book) == "03_theory"
    assert scorecard.find_doc("sva", book) is None and scorecard.find_doc("", book) is None
    # a page on disk that is not in the table of contents is not part of the book
    assert scorecard.find_doc("theory", book, pages=["book/intro", "book/01_synthetic"]) is None
    assert scorecard.find_doc("synthetic", book, pages=["book/intro", "book/01_synthetic"]) == "01_synthetic"


def test_combine_verdicts_names_disagreeing_chapters():
    def m(v, ch="a", reason=""):
        return {"verdict": v, "chapter": ch, "reason": reason}
    assert claims.combine([])[0] == "not run"
    assert claims.combine([m("reproduced"), m("reproduced", "b")]) == ("reproduced", "2 chapters, each reproduced", "")
    v, why, where = claims.combine([m("reproduced", "01_synthetic", "4/4 up"), m("not reproduced", "04_sweep", "0/4 up")])
    assert v == "mixed" and where == "holds in 01_synthetic; contradicted in 04_sweep"
    assert "01_synthetic: reproduced (4/4 up)" in why and "04_sweep: not reproduced (0/4 up)" in why
    assert claims.combine([m("not tested")])[0] == "not tested"
    assert claims.combine([m("not tested"), m("not reproduced")])[0] == "not reproduced"


def test_scorecard_from_results(tmp_path: Path, book: Path):
    _results(tmp_path)
    rows = scorecard.claim_rows(scorecard.load_results(tmp_path), book_dir=book)
    assert "05_removed" not in set(rows["chapter"])  # its page is gone: stale file dropped
    assert set(rows["doc"]) == {"01_synthetic", "03_theory"}
    only = scorecard.claim_rows(scorecard.load_results(tmp_path), book_dir=book, pages=["book/01_synthetic"])
    assert set(only["doc"]) == {"01_synthetic"} and len(only) == 2
    card = scorecard.build(rows).set_index("id")
    assert list(card.index) == list(scorecard.CLAIMS) + ["R3-multilayer", "T9"]
    assert card.loc["R3-multilayer", "kind"] == "extension" and card.loc["T9", "kind"] == "unknown"
    assert card.loc["R3", "verdict"] == "not run"  # an extension never changes the paper's verdict
    assert card.loc["R3-multilayer", "verdict"] == "reproduced"
    assert card.loc["S1", "verdict"] == "reproduced"
    assert card.loc["S3", "verdict"] == "holds where"  # one chapter reproduced, one in a region
    assert card.loc["S3", "region"] == "holds in 01_synthetic (for FAFO, CAFO, FACO; not CACO); theory"
    assert "chapters differ" in card.loc["S3", "reason"]
    assert len(card.loc["S3", "measurements"]) == 2
    assert card.loc["T1", "verdict"] == "not run" and card.loc["R2", "verdict"] == "not run"
    assert not card.loc["T9", "known"]
    n = scorecard.counts(card.reset_index())
    assert sum(n.values()) == len(scorecard.CLAIMS)  # T9 is not counted
    assert n == {"reproduced": 1, "holds where": 1, "mixed": 0, "not reproduced": 0, "inconclusive": 0,
                 "not tested": 0, "not run": 10}
    assert scorecard.counts(card.reset_index(), "extension")["reproduced"] == 1
    prov = scorecard.provenance(scorecard.load_results(tmp_path))
    assert list(prov["chapter"]) == ["removed", "synthetic", "theory"] and list(prov["claims"]) == [1, 2, 3]


def _table_widths(text: str) -> tuple[int, set[int]]:
    """Rows and the set of cell counts per row of the MyST tables in ``text``."""
    from myst_parser.config.main import MdParserConfig
    from myst_parser.mdit_to_docutils.base import DocutilsRenderer
    from myst_parser.parsers.mdit import create_md_parser

    tokens = create_md_parser(MdParserConfig(), DocutilsRenderer).parse(text)
    widths, n = [], 0
    for t in tokens:
        if t.type == "tr_open":
            n = 0
        elif t.type in ("td_open", "th_open"):
            n += 1
        elif t.type == "tr_close":
            widths.append(n)
    return len(widths), set(widths)


def test_the_matrix_is_one_row_per_claim_with_links_and_the_details_fold_out(tmp_path: Path, book: Path):
    _results(tmp_path)
    card = scorecard.build(scorecard.claim_rows(scorecard.load_results(tmp_path), book_dir=book))
    text = scorecard.to_matrix(card)
    assert "{doc}`01_synthetic`" in text and "{doc}`03_theory`" in text
    assert "{bdg-success}`reproduced`" in text and "{bdg-warning}`holds where`" in text
    # header + one row per claim of the paper + the extension and the unknown ID; five columns
    assert _table_widths(text) == (1 + len(scorecard.CLAIMS) + 2, {5})
    assert R3_RULE.split(":")[0] not in text  # rules are in the details, not the matrix
    s3 = next(line for line in text.splitlines() if line.startswith("| **S3** |"))
    assert "{doc}`01_synthetic`, {doc}`03_theory`" in s3 and s3.count("bdg-") == 3  # combined + one per chapter
    assert "holds in 01_synthetic (for FAFO, CAFO, FACO; not CACO); theory" in s3  # where it holds
    found = scorecard.findings(card)
    assert found.count("\n") == len(scorecard.CLAIMS) - 1 and "- **S3** {bdg-warning}`holds where` holds in 01_synthetic" in found
    details = scorecard.to_details(card)
    assert details.count(":::{dropdown}") == len(card) and "they differ \\| a lot" in details
    assert R3_RULE.split(":")[0] in details
    plain, plain_details = scorecard.to_matrix(card, link=False), scorecard.to_details(card, link=False)
    assert "{doc}" not in plain + plain_details and "{bdg" not in plain + plain_details and "**not run**" in plain
    assert "dropdown" not in plain_details


def test_scorecard_cli(tmp_path: Path, capsys):
    _results(tmp_path)
    assert cli.main(["scorecard", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    counts = json.loads(out.strip().splitlines()[-1])
    assert set(counts["paper"]) == set(scorecard.STATES)
    assert "| **T1** |" in out


def test_results_of_failed_runs_are_ignored_and_named_on_stderr(tmp_path: Path, capsys):
    _results(tmp_path)
    (tmp_path / "synthetic.json").rename(tmp_path / "synthetic.failed.json")
    doc = json.loads((tmp_path / "theory.json").read_text())
    (tmp_path / "theory.json").write_text(json.dumps({**doc, "status": "failed", "error": "RuntimeError: x"}))
    found = scorecard.load_results(tmp_path)
    assert [p.name for p, _ in found] == ["removed.json"]
    err = capsys.readouterr().err
    assert "synthetic.failed.json: written by a run that failed" in err
    assert "theory.json: written by a run that failed (RuntimeError: x)" in err
    moved = results.mark_failed(tmp_path / "removed.json", "ValueError: y")
    assert moved.name == "removed.failed.json" and not (tmp_path / "removed.json").exists()
    assert scorecard.load_results(tmp_path) == [] and results.mark_failed(tmp_path / "gone.json", "e") is None


def _r1_rows(verdicts: dict[str, str], rule: str = R1_RULE):
    import pandas as pd

    return pd.DataFrame([{**claims.claim("R1", "stable", f"{ch} numbers", claims.Verdict(v, rule, f"{ch} why"), ch),
                          "doc": ch} for ch, v in verdicts.items()])


def test_disagreeing_chapters_keep_every_verdict_visible():
    three = {"05_squad": "reproduced", "06_hatexplain": "not reproduced", "07_sva": "inconclusive"}
    card = scorecard.build(_r1_rows({**three, "08_other": "not tested"})).set_index("id")
    assert card.loc["R1", "verdict"] == "mixed"  # one dataset reproduces it, one contradicts it
    assert card.loc["R1", "region"] == "holds in SQuAD; contradicted in HateXplain"
    why = card.loc["R1", "reason"]
    assert ("SQuAD: reproduced (05_squad why) · HateXplain: not reproduced (06_hatexplain why) · "
            "SVA: inconclusive (07_sva why) · 08_other: not tested (08_other why)") in why
    assert card.loc["R1", "per_dataset"] == ("SQuAD reproduced · HateXplain not reproduced · SVA inconclusive · "
                                             "chapter 08 not tested")
    assert card.loc["T1", "per_dataset"] == ""
    assert [scorecard.dataset_name(c) for c in ("squad", "05_squad", "hatexplain", "sva", "01_synthetic")] == \
        ["SQuAD", "SQuAD", "HateXplain", "SVA", "01_synthetic"]
    # the claim's row shows each dataset's verdict as its own badge next to the combined one
    text = scorecard.to_matrix(scorecard.build(_r1_rows(three)))
    row = next(line for line in text.splitlines() if line.startswith("| **R1** |"))
    assert ("{bdg-warning-line}`mixed` SQuAD {bdg-success-line}`reproduced` HateXplain "
            "{bdg-danger-line}`not reproduced` SVA {bdg-info-line}`inconclusive`") in row
    assert "05_squad why" not in row  # reasons fold out below; the row holds the region and effect
    plain = scorecard.to_matrix(scorecard.build(_r1_rows(three)), link=False)
    assert "**mixed** SQuAD reproduced HateXplain not reproduced SVA inconclusive" in plain


def test_a_claims_rule_is_shown_once():
    text = scorecard.to_details(scorecard.build(_r1_rows({"05_squad": "reproduced", "06_hatexplain": "inconclusive",
                                                          "07_sva": "not reproduced"})))
    assert text.count(scorecard.myst_cell(R1_RULE)) == 1
    rows = [line for line in text.splitlines() if "numbers" in line]
    assert len(rows) == 3 and all("*Rule:*" not in line for line in rows)  # the rule folds out once, after them
    # a measurement with a different rule still shows it
    import pandas as pd

    other = pd.concat([_r1_rows({"05_squad": "reproduced"}), _r1_rows({"07_sva": "inconclusive"}, rule="another rule")])
    assert "*Rule:* another rule" in scorecard.to_details(scorecard.build(other))


def test_a_page_that_reads_a_claim_on_several_datasets_names_each():
    ms = [{"chapter": "09_multilayer", "ours": "sva (2 layers x 4 heads): ...", "verdict": "inconclusive"},
          {"chapter": "09_multilayer", "ours": "hatexplain (2 layers x 4 heads): ...", "verdict": "holds where"},
          {"chapter": "05_squad", "ours": "squad, the paper's protocol: ...", "verdict": "mixed"},
          {"chapter": "03_theory_asymptotics", "ours": "16 cells ...", "verdict": "mixed"}]
    assert [scorecard.measurement_name(m) for m in ms] == ["chapter 09 (SVA)", "chapter 09 (HateXplain)", "SQuAD",
                                                          "chapter 03"]
    assert scorecard.per_dataset(ms[:2]) == "chapter 09 (SVA) inconclusive · chapter 09 (HateXplain) holds where"
