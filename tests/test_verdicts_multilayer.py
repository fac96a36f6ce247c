"""The multi-layer chapter's extension verdicts come from the claims rules and flip with the effect."""

import pandas as pd

from qkov_lib.experiments import multilayer as ml

CFG = {"ratios": [1.0, 10.0], "datasets": ["sva"], "n_layers": 2, "n_heads": 2, "seeds": [0]}


def _frames(gain: float, dacc: float = 0.0):
    heads, scores = [], []
    for r in CFG["ratios"]:
        up = gain if r == 10.0 else 0.0
        for layer in (1, 2):
            heads.append({"dataset": "sva", "ratio": r, "seed": 0, "layer": layer, "head": "mean", "rank": float("nan"),
                          "attn_relevant": 0.3 + up, "AC": 0.2, "focus": 0.2, "uniform": 0.1})
            for h in (0, 1):
                heads.append({"dataset": "sva", "ratio": r, "seed": 0, "layer": layer, "head": h, "rank": h + 1.0,
                              "attn_relevant": 0.3 + up, "AC": 0.2, "focus": 0.2, "uniform": 0.1})
        scores.append({"dataset": "sva", "ratio": r, "seed": 0, "accuracy": 0.9 + (dacc if r == 10.0 else 0.0),
                       "macro_f1": 0.9})
    return pd.DataFrame(scores), pd.DataFrame(heads)


def test_extension_verdicts_flip_with_the_head_attention_change():
    up = ml.chapter_verdicts(*_frames(+0.1), CFG)["sva"]
    down = ml.chapter_verdicts(*_frames(-0.1), CFG)["sva"]
    assert up["R2-multilayer"].verdict == "reproduced" and down["R2-multilayer"].verdict == "not reproduced"
    assert up["R3-multilayer"].verdict == "reproduced" and down["R3-multilayer"].verdict == "not reproduced"
    assert ml.chapter_verdicts(*_frames(0.1, dacc=-0.2), CFG)["sva"]["R1-multilayer"].verdict == "partly"


def test_one_ratio_is_not_tested():
    scores, heads = _frames(0.1)
    one = {**CFG, "ratios": [1.0]}
    v = ml.chapter_verdicts(scores[scores.ratio == 1.0], heads[heads.ratio == 1.0], one)["sva"]
    assert {k: x.verdict for k, x in v.items()} == {k: "not tested" for k in v}
