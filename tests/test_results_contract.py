"""The results file as a contract (:mod:`qkov_lib.tooling.schema`): the scorecard, the summary pages'
loaders and ``qkov scorecard`` publish only results files that hold to it. Each test plants one fault
in an otherwise good results folder and checks that it is an error naming the file and the field,
with nothing published."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qkov_lib import claims
from qkov_lib.tooling import cli, scorecard, schema
from qkov_lib.tooling.results import save_results


def good_folder(folder: Path) -> Path:
    """Two results files as the chapters write them: theory_reduction (T1, T2) and synthetic (S1)."""
    save_results("theory_reduction", {"profile": "test"}, {"claims": [
        claims.claim("T1", "symmetric reduction", "gap 1e-16", "reproduced", "02_theory_reduction"),
        claims.claim("T2", "implicit rescaling", "ratio 2.0", "reproduced", "02_theory_reduction")]},
        path=folder / "theory_reduction.json", wall_time_s=3.0, device="cpu")
    save_results("synthetic", {"profile": "test"}, {"claims": [
        claims.claim("S1", "heatmaps differ", "they differ", "reproduced", "01_synthetic")]},
        path=folder / "synthetic.json", wall_time_s=2.0, device="cpu")
    return folder


def edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))  # Python's json writes NaN and Infinity as a hand edit could


def set_verdict(value):
    return lambda doc: doc["metrics"]["claims"][0].update(verdict=value)


TEXT = json.dumps({"chapter": "theory_reduction", "params": {}, "metrics": {"claims": []}})
# fault -> (how it is planted in theory_reduction.json, the field the message names, what it says)
FAULTS = {
    "verdict NaN": (set_verdict(math.nan), "metrics.claims[0] (T1).verdict", "found a number (NaN)"),
    "verdict 5": (set_verdict(5), "metrics.claims[0] (T1).verdict", "found a number (5)"),
    "verdict misspelt": (set_verdict("reproducd"), "metrics.claims[0] (T1).verdict", 'found a string ("reproducd")'),
    "verdict missing": (lambda d: d["metrics"]["claims"][0].pop("verdict"), "metrics.claims[0] (T1).verdict",
                        "missing"),
    "claim id missing": (lambda d: d["metrics"]["claims"][1].pop("id"), "metrics.claims[1].id", "missing"),
    "claim not an object": (lambda d: d["metrics"]["claims"].append("T3"), "metrics.claims[2]",
                            "must be an object"),
    "claims a dict": (lambda d: d["metrics"].update(claims={c["id"]: c for c in d["metrics"]["claims"]}),
                      "metrics.claims", "must be a list of claim rows, found an object"),
    "infinite wall time": (lambda d: d.update(wall_time_s=math.inf), "wall_time_s", "non-finite number"),
    "NaN deep in the metrics": (lambda d: d["metrics"].update(curve=[1.0, math.nan]), "metrics.curve[1]",
                                "non-finite number"),
    "metrics missing": (lambda d: d.pop("metrics"), "metrics", "missing (a required key)"),
    "chapter missing": (lambda d: d.pop("chapter"), "chapter", "missing (a required key)"),
    "params not an object": (lambda d: d.update(params=[1]), "params", "must be an object, found a list"),
    "text field not a string": (lambda d: d["metrics"]["claims"][0].update(ours=3.5), "metrics.claims[0] (T1).ours",
                                "must be a string"),
}
# faults of the file itself: (its bytes, what the message says)
BAD_FILES = {
    "cut short": (TEXT[: len(TEXT) // 2].encode(), "is not whole JSON"),
    "byte-order mark": (b"\xef\xbb\xbf" + TEXT.encode(), "byte-order mark"),
    "top-level list": (json.dumps([json.loads(TEXT)]).encode(), "the top level must be a JSON object, found a list"),
    "not UTF-8": (TEXT.replace("theory_reduction", "th\xe9ory").encode("latin-1"), "is not UTF-8"),
    "empty": (b"", "is not whole JSON"),
}


def planted(tmp_path: Path, fault: str) -> Path:
    folder = good_folder(tmp_path / "results")
    path = folder / "theory_reduction.json"
    if fault in FAULTS:
        edit(path, FAULTS[fault][0])
    else:
        path.write_bytes(BAD_FILES[fault][0])
    return folder


def expected(fault: str) -> list[str]:
    return [FAULTS[fault][1] + ": ", FAULTS[fault][2]] if fault in FAULTS else [BAD_FILES[fault][1]]


@pytest.mark.parametrize("fault", [*FAULTS, *BAD_FILES])
def test_a_planted_fault_is_an_error_naming_the_file_and_the_field(tmp_path, fault):
    folder = planted(tmp_path, fault)
    with pytest.raises(schema.ResultsFileError) as err:
        scorecard.load_results(folder)  # the scorecard page's and the intro page's loader
    text = str(err.value)
    assert str(folder / "theory_reduction.json") in text and "synthetic.json" not in text
    for part in expected(fault):
        assert part in text, text


@pytest.mark.parametrize("fault", [*FAULTS, *BAD_FILES])
def test_qkov_scorecard_publishes_nothing_from_a_broken_results_folder(tmp_path, capsys, fault):
    folder = planted(tmp_path, fault)
    assert cli.main(["scorecard", "--results", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("qkov scorecard: ") and "Traceback" not in err
    assert str(folder / "theory_reduction.json") in err and all(part in err for part in expected(fault))


def test_every_fault_of_a_folder_is_named_at_once(tmp_path):
    folder = good_folder(tmp_path)
    edit(folder / "theory_reduction.json", set_verdict("reproducd"))
    edit(folder / "synthetic.json", lambda d: d.update(wall_time_s=math.nan))
    with pytest.raises(schema.ResultsFileError) as err:
        scorecard.load_results(folder)
    assert [(Path(f).name, field) for f, field, _ in err.value.problems] == [
        ("synthetic.json", "wall_time_s"), ("theory_reduction.json", "metrics.claims[0] (T1).verdict")]


def test_a_good_folder_loads_and_the_verdict_words_are_the_claims_modules(tmp_path, monkeypatch):
    folder = good_folder(tmp_path)
    assert [p.name for p, _ in scorecard.load_results(folder)] == ["synthetic.json", "theory_reduction.json"]
    assert schema.verdict_words() == (*claims.VERDICTS, "not run") == scorecard.STATES
    for word in schema.verdict_words():  # every verdict word is accepted...
        edit(folder / "synthetic.json", set_verdict(word))
        scorecard.load_results(folder)
    # ...and the words are read from claims.VERDICTS when a file is checked, not copied
    monkeypatch.setattr(claims, "VERDICTS", (*claims.VERDICTS, "newly added"))
    edit(folder / "synthetic.json", set_verdict("newly added"))
    assert len(scorecard.load_results(folder)) == 2


@pytest.mark.parametrize("where", ["missing", "a file"])
def test_a_results_folder_that_is_not_there_is_an_error(tmp_path, capsys, where):
    folder = tmp_path / "nonexistent"
    if where == "a file":
        folder.write_text("root:x:0:0\n")
    with pytest.raises(OSError):
        scorecard.load_results(folder)
    assert cli.main(["scorecard", "--results", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"qkov scorecard: results folder {folder} " in err


def test_the_real_data_summary_reads_its_files_by_the_same_contract(tmp_path):
    folder = good_folder(tmp_path)
    save_results("sva", {"profile": "test"}, {"claims": [claims.claim("R1", "p", "o", "reproduced", "07_sva")]},
                 path=folder / "sva.json")
    assert scorecard.read_results("sva", folder)["chapter"] == "sva"
    assert scorecard.read_results("squad", folder) is None  # not run: no file
    edit(folder / "sva.json", set_verdict(math.nan))
    with pytest.raises(schema.ResultsFileError, match=r"sva\.json: metrics\.claims\[0\] \(R1\)\.verdict"):
        scorecard.r_table(folder)


def test_a_failed_runs_record_is_left_out_with_a_line_not_checked(tmp_path, capsys):
    folder = good_folder(tmp_path)
    (folder / "sva.failed.json").write_text("{cut")  # a failed run's record is not a results file
    assert len(scorecard.load_results(folder)) == 2
    assert "sva.failed.json: written by a run that failed" in capsys.readouterr().err


def test_without_a_build_the_default_scorecard_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QKOV_RESULTS_DIR", str(tmp_path / "no_build_yet"))
    assert cli.main(["scorecard"]) == 0
    out, err = capsys.readouterr()
    assert f"no results folder {tmp_path / 'no_build_yet'} yet" in err and "| **T1** | **not run** |" in out
