"""Chapter 01's verdicts come from the claims rules: they flip with the measured effect and say
"not tested" when the grid cannot make the comparison."""

import numpy as np
import pandas as pd

from qkov_lib import claims as C
from qkov_lib.studies import synthetic as exp

PARAMS = ["FAFO", "CAFO", "FACO", "CACO"]
ATT = {"FAFO": 0.80, "CAFO": 0.60, "FACO": 0.95, "CACO": 0.90}


def _summary(rise: float, params=PARAMS, ratios=(1.0, 10.0)) -> pd.DataFrame:
    rows = []
    for p in params:
        for r in ratios:
            up = rise if r == max(ratios) else 0.0
            rows.append({"parameterization": p, "ratio": r, "attn_relevant": ATT[p] + up, "loss": 0.01,
                         "accuracy": 1.0, "AC@0.9": 0.5 + up})
    return pd.DataFrame(rows)


def _dtaps(params=PARAMS, ratios=(1.0, 10.0)) -> dict:
    out = {}
    for k, p in enumerate(params):
        for r in ratios:
            h = np.zeros((10, 10))
            h[9 - k, 9] = 1.0  # each parameterization in its own attention bin: heatmaps differ
            out[(p, r)] = h
    return out


def test_s3_flips_with_the_sign_of_the_attention_change():
    cfg = {"ratios": [1.0, 10.0]}
    assert exp.chapter_verdicts(_summary(+0.03), cfg)["S3"].verdict == "reproduced"
    assert exp.chapter_verdicts(_summary(-0.03), cfg)["S3"].verdict == "not reproduced"


def test_the_chapter_decides_s3_only_and_shows_s1_and_s2():
    """S1 and S2 are decided on the sweep chapter's matched-loss ladder: this chapter gives no
    verdict on them, only their numbers and the rule that decides them there."""
    cfg = {"ratios": [1.0, 10.0]}
    assert set(exp.chapter_verdicts(_summary(0.03), cfg)) == {"S3"}
    f = exp.chapter_facts(_summary(0.03), _dtaps(), cfg)
    assert f["rule_S1"] == C.S1_RULE and f["rule_S2"] == C.S2_RULE and "verdict_S2" not in f
    assert "1.000 to 1.000 apart" in f["s1_sentence"]  # one bin each: every pair at distance 1
    assert "FACO and CACO" in f["s2_sentence"] and "the first summary" in f["s2_sentence"]


def test_one_ratio_one_parameterization_is_not_tested():
    cfg = {"ratios": [100.0]}
    v = exp.chapter_verdicts(_summary(0.0, ["FAFO"], (100.0,)), cfg)
    assert {k: x.verdict for k, x in v.items()} == {"S3": "not tested"}
    f = exp.chapter_facts(_summary(0.0, ["FAFO"], (100.0,)), _dtaps(["FAFO"], (100.0,)), cfg)
    assert "not tested" in f["s3_sentence"] and "no heatmaps to compare" in f["s1_sentence"]
    assert "no ranking to show" in f["s2_sentence"]
    rows = exp.claims_rows(f, v)
    assert [(r["id"], r["verdict"]) for r in rows] == [("S3", "not tested")] and rows[0]["rule"]
