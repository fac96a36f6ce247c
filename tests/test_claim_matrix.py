"""Page 1 from results files: the claim matrix, the forest plot, the SQuAD headline, and a word that
disagrees with its own numbers stopping the page."""

import json

import pandas as pd
import pytest

from qkov_lib.studies import realmap as M
from qkov_lib.tooling import claim_matrix, results, scorecard


def _runs(d_ac: float) -> pd.DataFrame:
    """Two AdamW base rates x ratios 1, 10 x four seeds; AC@0.5 changes by ``d_ac`` at ratio 10."""
    rows = []
    for eta in (1e-3, 1e-2):
        for r in (1.0, 10.0):
            for s in range(4):
                up = r > 1
                rows.append({"optimizer": "adamw", "eta_ov": eta, "ratio": r, "seed": s, "diverged": False,
                             "val_accuracy": 0.9 + 0.01 * (eta == 1e-3), "val_loss": 0.3, "accuracy": 0.8 + 0.001 * s,
                             "macro_f1": 0.8, "attn_relevant": 0.3 + d_ac * up, "AC@0.5": 0.12 + d_ac * up + 0.002 * s,
                             "ACMC@0.5": 0.1, "sufficiency": 0.2})
    return pd.DataFrame(rows)


@pytest.fixture
def folder(tmp_path):
    res = M.analyse(_runs(0.3), chance_rate=0.5)
    metrics = {"claims": M.claims_rows(res, "squad"), **M.map_record(res)}
    results.save_results("squad", {"profile": "test"}, metrics, path=tmp_path / "squad.json")
    return tmp_path


def _rows(folder):
    return scorecard.claim_rows(scorecard.load_results(folder))


def test_matrix_headline_and_forest_read_the_protocol_cells(folder):
    import matplotlib

    matplotlib.use("Agg")
    card = scorecard.build(_rows(folder))
    m = claim_matrix.matrix(card, folder).set_index("claim")
    assert m.loc["R2", "verdict"] == "reproduced"
    assert m.loc["R2", "book"].startswith("SQuAD: +0.300 ±") and "12%" in m.loc["R2", "paper"]
    assert m.loc["T1", "verdict"] == "not run"
    h = claim_matrix.squad_headline(folder)
    assert h["headline_book"] == "12% at ratio 1 → 42% at ratio 10 (AdamW, tuned η_OV 0.001; trained seeds 4, 4)"
    assert h["paper_ac_before"] == "12%"
    fig = claim_matrix.forest(folder)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["SQuAD: AdamW, η_OV 0.001, ratio 10"]
    assert "| **R2** |" in claim_matrix.matrix_myst(m.reset_index(), card)


def test_headline_without_squad(tmp_path):
    assert claim_matrix.squad_headline(tmp_path)["headline_book"].startswith("not measured")
    assert claim_matrix.forest(tmp_path) is None


@pytest.mark.parametrize("planted", ["reproduced", "not reproduced", "inconclusive", "holds where"])
def test_a_word_planted_against_its_numbers_stops_the_page(folder, planted):
    claim_matrix.check_words(_rows(folder))  # the words as written agree
    path = folder / "squad.json"
    doc = json.loads(path.read_text())
    r2 = next(c for c in doc["metrics"]["claims"] if c["id"] == "R2")
    # the numbers printed with it say "reproduced" (AC@0.5 +0.3, far above +0.05): plant a mixed word, or
    # change a number so that the printed word no longer follows from it
    if planted == "reproduced":
        r2["effect"] = r2["effect"].replace("+0.300", "-0.300")
    else:
        r2["verdict"] = planted
        if planted == "holds where":
            r2["region"] = "holds at somewhere"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="disagrees with the numbers printed with it"):
        claim_matrix.check_words(_rows(folder))


def test_a_long_effect_is_cut_at_whole_cells_and_counts_the_rest():
    cells = [f"cell {i}: +0.{i}00 ± 0.010 (n = 4)" for i in range(1, 10)]
    short = claim_matrix._short("; ".join(cells))
    kept = short.split("; ")[:-1]
    assert kept == cells[:len(kept)] and 1 <= len(kept) < len(cells)
    assert short.endswith(f"{len(cells) - len(kept)} more cells in the chapter")
    assert len("; ".join(kept)) <= claim_matrix.MAX_EFFECT
    assert claim_matrix._short(cells[0]) == cells[0]  # one cell: as is, whatever its length
    assert claim_matrix._short("x" * 500) == "x" * 500
