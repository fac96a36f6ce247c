"""Every verdict rule reaches every verdict it lists, flips when the measured effect flips, and
says "not tested" when the comparison cannot be made."""

import math

import pytest

from qkov_lib import claims as C

ALL = ["reproduced", "partly", "not reproduced", "not tested"]
P4 = {"FAFO": 0.6, "CAFO": 0.5, "FACO": 0.95, "CACO": 0.7}  # top two: CACO, FACO (summary A)

# rule -> verdict -> arguments that must give it
CASES = {
    "t1_reduction": {"reproduced": (1e-16, 1e-16, 0.05), "partly": (1e-16, 1e-16, 0.5),
                     "not reproduced": (1e-3, 1e-3, 0.5), "not tested": (math.nan, 1e-16, 0.05)},
    "t2_rescaling": {"reproduced": (1e-12,), "not reproduced": (1e-3,), "not tested": (math.nan,)},
    "t3_growth": {"reproduced": ([1.0, 1.01], [2.05, 0.1], 2.0), "partly": ([1.0, 1.01], [0.1, 0.15], 2.0),
                  "not reproduced": ([1.5, 1.0], [0.1], 2.0), "not tested": ([], [], math.nan)},
    "t4_line": {"reproduced": (1e-9, 0.005), "partly": (1e-9, 0.2), "not reproduced": (1e-2, 0.2),
                "not tested": (math.nan, 0.1)},
    "t5_sharpening": {"reproduced": ({"FAFO": [0.3, 0.1], "CACO": [0.2, 0.05]}, {"FAFO": 0.1, "CACO": 0.1}),
                      "partly": ({"FAFO": [0.3, 0.1], "CACO": [0.2, 0.25]}, {"FAFO": 0.1, "CACO": -0.1}),
                      "not reproduced": ({"FAFO": [0.1, 0.3]}, {"FAFO": -0.1}),
                      "not tested": ({"FAFO": [0.3]}, {})},
    "t6_factorized_qk": {"reproduced": ([0.1, 0.2],), "partly": ([0.1, -0.2],), "not reproduced": ([-0.1, -0.2],),
                         "not tested": ([],)},
    "s1_heatmaps_differ": {"reproduced": ({("FAFO", "CACO"): 0.3, ("FAFO", "FACO"): 0.2},),
                           "partly": ({("FAFO", "CACO"): 0.3, ("FAFO", "FACO"): 0.01},),
                           "not reproduced": ({("FAFO", "CACO"): 0.02},), "not tested": ({},)},
    "s2_which_pair": {"reproduced": (P4, "FACO"), "partly": (P4, "CAFO"),
                      "not reproduced": ({"FAFO": 0.99, "CAFO": 0.5, "FACO": 0.95, "CACO": 0.7}, "CAFO"),
                      "not tested": ({"FAFO": 0.9}, "FACO")},
    "s3_ratio_sharpens": {"reproduced": ([0.1, 0.02], [0.01, -0.01], [0.0, 0.0]),
                          "partly": ([0.1, 0.02], [0.2, 0.0], [0.0, 0.0]),
                          "not reproduced": ([-0.1, 0.0], [0.0, 0.0], [0.0, 0.0]), "not tested": ([], [], [])},
    "r1_performance_stable": {"reproduced": ([0.0, 0.01], [-0.01, 0.0]), "partly": ([-0.05, 0.0], [0.0, 0.0]),
                              "not reproduced": ([0.0, -0.05], [0.0, -0.04]), "not tested": ([], [])},
    "r2_interpretability": {"reproduced": (0.2, 0.2, -0.05), "partly": (0.2, 0.0, None),
                            "not reproduced": (0.0, -0.1, 0.05), "not tested": (None, None, None)},
    "heads_sharpen": {"reproduced": ([0.05, 0.03],), "partly": ([0.05, 0.0],), "not reproduced": ([0.0, -0.1],),
                      "not tested": ([],)},
    "tuned_region": {"reproduced": ({"adamw": "reproduced", "sgd": "reproduced"},),
                     "partly": ({"adamw": "reproduced", "sgd": "not reproduced"},),
                     "not reproduced": ({"adamw": "not reproduced", "sgd": "not tested"},),
                     "not tested": ({"adamw": "not tested"},)},
    "r3_decoupled": {"reproduced": ([0.1], [0.0]), "partly": ([0.1], [0.1]), "not reproduced": ([-0.1], [0.0]),
                     "not tested": ([], [])},
}


@pytest.mark.parametrize("rule,verdict", [(r, v) for r, vs in CASES.items() for v in vs])
def test_rule_reaches_verdict(rule, verdict):
    out = getattr(C, rule)(*CASES[rule][verdict])
    assert out.verdict == verdict, out
    assert out.rule and out.reason


def test_every_rule_is_covered_and_every_rule_can_fail():
    assert {f.__name__ for f in C.RULES.values()} | {"heads_sharpen", "tuned_region"} == set(CASES)
    for rule, vs in CASES.items():
        assert "not reproduced" in vs and "reproduced" in vs and "not tested" in vs, rule


@pytest.mark.parametrize("rule,args,flip", [
    ("s3_ratio_sharpens", ([0.1, 0.05], [0.0, 0.0], [0.0, 0.0]), lambda a: ([-x for x in a[0]], a[1], a[2])),
    ("r3_decoupled", ([0.1, 0.2], [0.0, 0.01]), lambda a: ([-x for x in a[0]], a[1])),
    ("r2_interpretability", (0.2, 0.2, -0.05), lambda a: tuple(-x for x in a)),
    ("r1_performance_stable", ([0.0, 0.01], [0.0, 0.01]), lambda a: ([-0.05, -0.06], [-0.05, -0.06])),
    ("t6_factorized_qk", ([0.1, 0.2],), lambda a: ([-x for x in a[0]],)),
    ("heads_sharpen", ([0.05, 0.03],), lambda a: ([-x for x in a[0]],)),
    ("t5_sharpening", ({"FAFO": [0.3, 0.1]}, {"FAFO": 0.1}), lambda a: ({"FAFO": [0.1, 0.3]}, {"FAFO": -0.1})),
])
def test_flipping_the_effect_flips_the_verdict(rule, args, flip):
    f = getattr(C, rule)
    assert f(*args).verdict == "reproduced"
    assert f(*flip(args)).verdict == "not reproduced"


def test_thresholds_are_registered_and_stated_in_rules():
    assert C.THRESHOLDS["SAME_LOSS"].value == C.SAME_LOSS == 0.05
    assert C.threshold_text("SAME_LOSS") == "0.05 nats"
    assert "0.05 nats" in C.S3_RULE and "0.1" in C.S1_RULE


def test_claim_rows_and_bad_verdicts():
    row = C.claim("S3", "p", "o", C.s3_ratio_sharpens([], [], []), "01_synthetic")
    assert row["verdict"] == "not tested" and row["rule"] == C.S3_RULE
    with pytest.raises(ValueError, match="verdict must be one of"):
        C.claim("S3", "p", "o", "yes")
    with pytest.raises(KeyError, match="unknown claim ID"):
        C.statement("T9")
    assert C.statement("R3-multilayer").startswith("R3")
    assert set(C.EXTENSIONS[k][0] for k in C.EXTENSIONS) <= set(C.CLAIMS)
