"""Chapter 01's verdicts come from the claims rules: they flip with the measured effect and say
"not tested" when the grid cannot make the comparison."""

import numpy as np
import pandas as pd

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
    assert exp.chapter_verdicts(_summary(+0.03), _dtaps(), cfg)["S3"].verdict == "reproduced"
    assert exp.chapter_verdicts(_summary(-0.03), _dtaps(), cfg)["S3"].verdict == "not reproduced"


def test_s1_flips_when_heatmaps_coincide():
    cfg = {"ratios": [1.0, 10.0]}
    assert exp.chapter_verdicts(_summary(0.03), _dtaps(), cfg)["S1"].verdict == "reproduced"
    same = {k: np.eye(10) / 10 for k in _dtaps()}
    assert exp.chapter_verdicts(_summary(0.03), same, cfg)["S1"].verdict == "not reproduced"


def test_one_ratio_one_parameterization_is_not_tested():
    cfg = {"ratios": [100.0]}
    v = exp.chapter_verdicts(_summary(0.0, ["FAFO"], (100.0,)), _dtaps(["FAFO"], (100.0,)), cfg)
    assert {k: x.verdict for k, x in v.items()} == {"S1": "not tested", "S2": "not tested", "S3": "not tested"}
    f = exp.chapter_facts(_summary(0.0, ["FAFO"], (100.0,)), _dtaps(["FAFO"], (100.0,)), cfg)
    assert "not tested" in f["s1_sentence"] and "not tested" in f["s3_sentence"] and "not tested" in f["s2_sentence"]
    rows = exp.claims_rows(f, v)
    assert [r["verdict"] for r in rows] == ["not tested"] * 3 and all(r["rule"] for r in rows)
