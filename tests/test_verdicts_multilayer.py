"""The multi-layer chapter's extension verdicts come from the claims rules on paired seed
changes, flip with the effect, and cannot be decided by one seed."""

import pandas as pd

from qkov_lib.studies import multilayer as ml

CFG = {"ratios": [1.0, 10.0], "datasets": ["sva"], "n_layers": 2, "n_heads": 2, "seeds": [0, 1, 2]}


def _frames(gain: float, dacc: float = 0.0, df1: float = 0.0, seeds=(0, 1, 2)):
    """Head and score rows: at ratio 10 every head's attention moves by ``gain``, accuracy by
    ``dacc`` and macro-F1 by ``df1``; each seed adds 0.001 * seed to both ratios (so the paired
    changes are exact, with a zero-width interval)."""
    heads, scores = [], []
    for r in CFG["ratios"]:
        up = gain if r == 10.0 else 0.0
        for s in seeds:
            for layer in (1, 2):
                heads.append({"dataset": "sva", "ratio": r, "seed": s, "layer": layer, "head": "mean",
                              "rank": float("nan"), "attn_relevant": 0.3 + up + 0.001 * s, "AC": 0.2, "focus": 0.2,
                              "uniform": 0.1})
                for h in (0, 1):
                    heads.append({"dataset": "sva", "ratio": r, "seed": s, "layer": layer, "head": h, "rank": h + 1.0,
                                  "attn_relevant": 0.3 + up + 0.001 * s, "AC": 0.2, "focus": 0.2, "uniform": 0.1})
            scores.append({"dataset": "sva", "ratio": r, "seed": s,
                           "accuracy": 0.9 + (dacc if r == 10.0 else 0.0) + 0.001 * s,
                           "macro_f1": 0.9 + (df1 if r == 10.0 else 0.0)})
    return pd.DataFrame(scores), pd.DataFrame(heads)


def test_extension_verdicts_flip_with_the_head_attention_change():
    up = ml.chapter_verdicts(*_frames(+0.1), CFG)["sva"]
    down = ml.chapter_verdicts(*_frames(-0.1), CFG)["sva"]
    assert up["R2-multilayer"].verdict == "reproduced" and down["R2-multilayer"].verdict == "not reproduced"
    assert up["R3-multilayer"].verdict == "reproduced" and down["R3-multilayer"].verdict == "not reproduced"
    assert up["R1-multilayer"].verdict == "reproduced"
    assert "(n = 3)" in up["R3-multilayer"].effect and "ratio 10" in up["R3-multilayer"].effect
    # a fall beyond the band in accuracy alone contradicts R1 as much as a fall in both
    assert ml.chapter_verdicts(*_frames(0.1, dacc=-0.2), CFG)["sva"]["R1-multilayer"].verdict == "not reproduced"
    assert ml.chapter_verdicts(*_frames(0.1, dacc=-0.2, df1=-0.2), CFG)["sva"]["R1-multilayer"].verdict == \
        "not reproduced"


def test_one_seed_cannot_decide_r1_or_r3():
    """With one seed there is no interval: every extension is 'inconclusive' whichever way the effect goes,
    and says why no seed count is given."""
    one = {**CFG, "seeds": [0]}
    for g in (+0.1, -0.1):
        v = ml.chapter_verdicts(*_frames(g, seeds=(0,)), one)["sva"]
        assert v["R1-multilayer"].verdict == v["R3-multilayer"].verdict == "inconclusive"
        assert v["R2-multilayer"].verdict == "inconclusive"
        assert "1 seed pair, no interval yet" in v["R3-multilayer"].reason


def test_one_ratio_is_not_tested():
    scores, heads = _frames(0.1)
    one = {**CFG, "ratios": [1.0]}
    v = ml.chapter_verdicts(scores[scores.ratio == 1.0], heads[heads.ratio == 1.0], one)["sva"]
    assert {k: x.verdict for k, x in v.items()} == {k: "not tested" for k in v}
