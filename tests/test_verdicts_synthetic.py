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


def test_the_chapter_decides_no_claim_and_points_to_where_each_is_decided():
    """The runs end after a fixed number of steps (saturated): S1 and S3 are decided at matched
    loss in the sweep chapter and S2 by chapter 03's map, so the facts carry their rules only."""
    cfg = {"ratios": [1.0, 10.0]}
    assert not hasattr(exp, "chapter_verdicts") and not hasattr(exp, "claims_rows")
    f = exp.chapter_facts(_summary(0.03), _dtaps(), cfg)
    assert f["rule_S1"] == C.ESTIMANDS["S1"].text() and f["rule_S3"] == C.ESTIMANDS["S3"].text()
    assert f["one_rule"] == C.ONE_RULE
    assert not any(k.startswith(("verdict_", "rule_S2")) for k in f)
    assert "1.000 to 1.000 apart" in f["s1_sentence"]  # one bin each: every pair at distance 1
    assert "FACO and CACO" in f["s2_sentence"] and "the first summary" in f["s2_sentence"]
    assert "for 4 of 4" in f["s3_sentence"]
    assert "for 0 of 4" in exp.chapter_facts(_summary(-0.03), _dtaps(), cfg)["s3_sentence"]


def test_one_ratio_one_parameterization_is_not_tested():
    cfg = {"ratios": [100.0]}
    f = exp.chapter_facts(_summary(0.0, ["FAFO"], (100.0,)), _dtaps(["FAFO"], (100.0,)), cfg)
    assert "not tested" in f["s3_sentence"] and "no heatmaps to compare" in f["s1_sentence"]
    assert "no ranking to show" in f["s2_sentence"]
