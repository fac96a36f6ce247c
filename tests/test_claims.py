"""Every verdict rule reaches every verdict it lists, flips when the measured effect flips, and
says "not tested" when the comparison cannot be made."""

import math

import pytest

from qkov_lib import claims as C

ALL = list(C.VERDICTS)


def ch(mean, half_width=0.005, n=4):
    """A paired seed change (tight interval, four seeds unless told)."""
    return C.Change(mean, half_width, n)



# S2's phase map in two axes: the ODE's top two per (ratio, loss) cell; a full-model gap of five seeds
S2_AXES = ("ratio", "loss")
S2_ODE_A = {(1.0, 0.3): "A", (10.0, 0.3): "A", (1.0, 0.01): "A", (10.0, 0.01): "A"}
S2_ODE_MIX = {(0.1, 0.3): "B", (1.0, 0.3): "A", (10.0, 0.3): "neither", (0.1, 0.01): "A", (1.0, 0.01): "A",
              (10.0, 0.01): "A"}
S2_ODE_NONE = {(1.0, 0.3): "neither", (10.0, 0.3): "neither"}
S2_GAP = C.Change(0.1, 0.02, 5)

# rule -> verdict -> arguments that must give it
CASES = {
    "t1_reduction": {"reproduced": (1e-16, 1e-16, 0.05), "holds where": (1e-16, 1e-16, 0.5),
                     "not reproduced": (1e-3, 1e-3, 0.5), "not tested": (math.nan, 1e-16, 0.05)},
    "t2_rescaling": {"reproduced": (1e-12,), "not reproduced": (1e-3,), "not tested": (math.nan,)},
    "t3_growth": {"reproduced": ([1.0, 1.01], [2.05, 0.1], {"CACO": 2.0}),
                  "holds where": ([1.0, 1.01], [0.1, 0.15], {"CACO": 2.0, "FAFO": 1.2}),
                  "not reproduced": ([1.5, 1.0], [0.1], {"CACO": 2.0}), "not tested": ([], [], {})},
    "t4_line": {"reproduced": (1e-9, 0.005), "holds where": (1e-9, 0.2), "not reproduced": (1e-2, 0.2),
                "not tested": (math.nan, 0.1)},
    "t5_sharpening": {"reproduced": ({"FAFO": [[0.3, 0.1]], "CACO": [[0.2, 0.05]]}, {"FAFO": ch(2.7), "CACO": ch(1.0)}),
                      "holds where": ({"FAFO": [[0.3, 0.1]], "CACO": [[0.2, 0.25]]}, {"FAFO": ch(2.7), "CACO": ch(-1.0)}),
                      "not reproduced": ({"FAFO": [[0.1, 0.3]]}, {"FAFO": ch(-0.5)}),
                      "inconclusive": ({"FAFO": [[0.3, 0.1]]}, {"FAFO": ch(0.2, 0.5)}),
                      "not tested": ({"FAFO": [[0.3]]}, {})},
    "t6_factorized_qk": {"reproduced": ([0.1, 0.2],), "holds where": ({"ODE": 0.1, "full model": -0.2},),
                         "not reproduced": ([-0.1, -0.2],),
                         "not tested": ([],)},
    "s1_ladder": {"reproduced": ({0.3: {("FAFO", "CACO"): C.Change(0.3, 0.05, 5)},
                                  0.1: {("FAFO", "CACO"): C.Change(0.2, 0.05, 5)}},),
                  "holds where": ({0.3: {("FAFO", "CACO"): C.Change(0.3, 0.05, 5)},
                                   0.1: {("FAFO", "CACO"): C.Change(0.02, 0.01, 5)}},),
                  "not reproduced": ({0.3: {("FAFO", "CACO"): C.Change(0.02, 0.01, 5)}},),
                  "inconclusive": ({0.3: {("FAFO", "CACO"): C.Change(0.1, 0.05, 5)}},),
                  "not tested": ({},)},
    "s2_phase": {"reproduced": (S2_ODE_A, {(1.0, 0.3): ("A", S2_GAP), (10.0, 0.3): ("A", S2_GAP)}, S2_AXES),
                 "holds where": (S2_ODE_MIX, {(1.0, 0.3): ("A", S2_GAP), (10.0, 0.3): ("neither", S2_GAP)}, S2_AXES),
                 "not reproduced": (S2_ODE_NONE, {(1.0, 0.3): ("neither", S2_GAP)}, S2_AXES),
                 "inconclusive": (S2_ODE_MIX, {(1.0, 0.3): ("tie", C.Change(0.01, 0.05, 5))}, S2_AXES),
                 "not tested": (S2_ODE_A, {(1.0, 0.3): ("not tested", C.Change(0.1, math.nan, 1))}, S2_AXES)},
    "s3_ratio_sharpens": {"reproduced": ({(0.05, 10.0): {"FAFO": (ch(1.0), ch(0.0), ch(0.0))}},),
                          "holds where": ({(0.05, 10.0): {"FAFO": (ch(1.0), ch(0.0), ch(0.0))},
                                           (0.05, 1.0): {"FAFO": (ch(-1.0), ch(0.0), ch(0.0))}},),
                          "not reproduced": ({(0.05, 10.0): {"FAFO": (ch(1.0), ch(0.2), ch(0.0))}},),
                          "inconclusive": ({(0.05, 10.0): {"FAFO": (ch(0.1, 0.2), ch(0.0), ch(0.0))}},),
                          "not tested": ({},)},
    "r1_performance_stable": {"reproduced": ([ch(0.0), ch(0.01)], [ch(-0.01), ch(0.0)]),
                              "holds where": ([ch(0.0), ch(-0.05)], [ch(0.0), ch(0.0)]),
                              "not reproduced": ([ch(-0.05), ch(-0.05)], [ch(0.0), ch(-0.04)]),
                              "inconclusive": ([ch(0.0, 0.05), ch(-0.01, 0.05)], [ch(0.0), ch(0.0)]),
                              "not tested": ([None], [])},
    "r2_interpretability": {"reproduced": (ch(0.2), ch(0.2), ch(-0.05)), "holds where": (ch(0.2), ch(0.0), None),
                            "not reproduced": (ch(0.0), ch(-0.1), ch(0.05)),
                            "inconclusive": (ch(0.05, 0.05), ch(0.05, 0.05), None), "not tested": (None, None, None)},
    "heads_sharpen": {"reproduced": ([0.05, 0.03],), "holds where": ([0.05, 0.0],), "not reproduced": ([0.0, -0.1],),
                      "not tested": ([],)},
    "tuned_region": {"reproduced": ({"adamw": "reproduced", "sgd": "reproduced"},),
                     "holds where": ({"adamw": "reproduced", "sgd": "not reproduced"},),
                     "not reproduced": ({"adamw": "not reproduced", "sgd": "not tested"},),
                     "inconclusive": ({"adamw": "inconclusive", "sgd": "not reproduced"},),
                     "not tested": ({"adamw": "not tested"},)},
    "r3_decoupled": {"reproduced": ([ch(0.1), ch(0.1)], [ch(0.0), ch(0.0)]),
                     "holds where": ([ch(0.1), ch(0.1)], [ch(0.0), ch(0.1)]),
                     "not reproduced": ([ch(-0.1)], [ch(0.0)]), "inconclusive": ([ch(0.1, 0.2)], [ch(0.0)]),
                     "not tested": ([], [])},
}


@pytest.mark.parametrize("rule,verdict", [(r, v) for r, vs in CASES.items() for v in vs])
def test_rule_reaches_verdict(rule, verdict):
    out = getattr(C, rule)(*CASES[rule][verdict])
    assert out.verdict == verdict, out
    assert out.rule and out.reason
    assert bool(out.region) == (verdict == "holds where"), out  # a region exactly where the claim holds in part


def test_every_rule_is_covered_and_every_rule_can_fail():
    assert {f.__name__ for f in C.RULES.values()} | {"heads_sharpen", "tuned_region"} == set(CASES)
    for rule, vs in CASES.items():
        assert "not reproduced" in vs and "reproduced" in vs and "not tested" in vs, rule


@pytest.mark.parametrize("rule,args,flip", [
    ("s3_ratio_sharpens", ({(0.05, 10.0): {"FAFO": (ch(1.0), ch(0.0), ch(0.0)), "CACO": (ch(0.5), ch(0.0), ch(0.0))}},),
     lambda a: ({k: {p: (ch(-c[0].mean), c[1], c[2]) for p, c in d.items()} for k, d in a[0].items()},)),
    ("r3_decoupled", ([ch(0.1), ch(0.2)], [ch(0.0), ch(0.01)]), lambda a: ([ch(-x.mean) for x in a[0]], a[1])),
    ("r2_interpretability", (ch(0.2), ch(0.2), ch(-0.05)), lambda a: tuple(ch(-x.mean) for x in a)),
    ("r1_performance_stable", ([ch(0.0), ch(0.01)], [ch(0.0), ch(0.01)]),
     lambda a: ([ch(-0.05), ch(-0.06)], [ch(-0.05), ch(-0.06)])),
    ("t6_factorized_qk", ([0.1, 0.2],), lambda a: ([-x for x in a[0]],)),
    ("s1_ladder", ({0.3: {("FAFO", "CACO"): C.Change(0.3, 0.05, 5)}},),
     lambda a: ({0.3: {("FAFO", "CACO"): C.Change(0.03, 0.05, 5)}},)),
    ("s2_phase", (S2_ODE_A, {(1.0, 0.3): ("A", S2_GAP)}, S2_AXES),
     lambda a: (S2_ODE_NONE, {(1.0, 0.3): ("neither", S2_GAP)}, S2_AXES)),
    ("heads_sharpen", ([0.05, 0.03],), lambda a: ([-x for x in a[0]],)),
    ("t5_sharpening", ({"FAFO": [[0.3, 0.1]]}, {"FAFO": ch(1.0)}), lambda a: ({"FAFO": [[0.1, 0.3]]}, {"FAFO": ch(-1.0)})),
])
def test_flipping_the_effect_flips_the_verdict(rule, args, flip):
    f = getattr(C, rule)
    assert f(*args).verdict == "reproduced"
    assert f(*flip(args)).verdict == "not reproduced"


def test_thresholds_are_registered_and_stated_in_rules():
    assert C.THRESHOLDS["SAME_LOSS"].value == C.SAME_LOSS == 0.05
    assert C.threshold_text("SAME_LOSS") == "0.05 nats"
    assert "0.05 nats" in C.S3_RULE and "0.1" in C.S1_RULE


def test_a_region_is_required_exactly_for_holds_where_and_the_label_carries_it():
    with pytest.raises(ValueError, match="must name its region"):
        C.Verdict("holds where", "rule", "why")
    v = C.Verdict("holds where", "rule", "why", region="for ratio <= 10")
    assert v.label == "holds where for ratio <= 10" and C.Verdict("inconclusive", "r").label == "inconclusive"
    glue = C.verdict_glue({"R3-synthetic": v})
    assert glue["label_R3_synthetic"] == v.label and glue["effect_R3_synthetic"] == "-"
    assert set(C.VERDICT_MEANING) == set(C.VERDICTS)


@pytest.mark.parametrize("rows,want", [
    ([], ("not run", "")),
    ([{"chapter": "SQuAD", "verdict": "not tested"}], ("not tested", "")),
    ([{"chapter": "SQuAD", "verdict": "reproduced"}, {"chapter": "SVA", "verdict": "reproduced"}], ("reproduced", "")),
    ([{"chapter": "SQuAD", "verdict": "reproduced"}, {"chapter": "SVA", "verdict": "not reproduced"}],
     ("holds where", "in SQuAD; not in SVA (not reproduced)")),
    ([{"chapter": "SQuAD", "verdict": "holds where", "region": "at ratio 10"},
      {"chapter": "SVA", "verdict": "inconclusive"}], ("holds where", "in SQuAD at ratio 10; not in SVA (inconclusive)")),
    ([{"chapter": "SQuAD", "verdict": "inconclusive"}, {"chapter": "SVA", "verdict": "not reproduced"}],
     ("not reproduced", "")),
    ([{"chapter": "SQuAD", "verdict": "inconclusive"}, {"chapter": "SVA", "verdict": "not tested"}],
     ("inconclusive", "")),
])
def test_combine_names_where_each_chapter_holds(rows, want):
    verdict, reason, region = C.combine(rows)
    assert (verdict, region) == want
    if len({r["verdict"] for r in rows if r["verdict"] != "not tested"}) > 1:
        assert all(r["chapter"] in reason for r in rows)  # no chapter's negative is hidden


def test_claim_rows_and_bad_verdicts():
    row = C.claim("S3", "p", "o", C.s3_ratio_sharpens({}), "04_sweep")
    assert row["verdict"] == "not tested" and row["rule"] == C.S3_RULE
    with pytest.raises(ValueError, match="verdict must be one of"):
        C.claim("S3", "p", "o", "yes")
    with pytest.raises(KeyError, match="unknown claim ID"):
        C.statement("T9")
    assert C.statement("R3-multilayer").startswith("R3")
    assert set(C.EXTENSIONS[k][0] for k in C.EXTENSIONS) <= set(C.CLAIMS)


# --- the real-data rules decide on seed intervals ---------------------------------------------
def test_change_interval_from_seed_differences():
    c = C.Change.of([0.10, 0.12, math.nan, 0.11, math.inf])
    assert c.n == 3 and c.mean == pytest.approx(0.11, abs=1e-12)
    # t(0.975, 2) = 4.3027, sd = 0.01, sqrt(3): half-width 0.024841 (to 1e-5)
    assert c.half_width == pytest.approx(4.302653 * 0.01 / math.sqrt(3), abs=1e-5)
    assert c.lo == pytest.approx(c.mean - c.half_width, abs=1e-12) and c.hi > c.mean
    one = C.Change.of([0.3])
    assert one.n == 1 and math.isnan(one.half_width) and (one.lo, one.hi) == (-math.inf, math.inf)
    empty = C.Change.of([math.nan])
    assert empty.n == 0 and math.isnan(empty.mean)
    with pytest.raises(ValueError, match="whole number of seed pairs"):
        C.Change(0.1, 0.01, 2.5)
    with pytest.raises(ValueError, match="half_width must be >= 0"):
        C.Change(0.1, -0.01, 3)
    with pytest.raises(TypeError, match="take claims.Change values"):
        C.r3_decoupled([0.1], [0.0])  # a bare number has no seed interval


@pytest.mark.parametrize("rule,good,wide", [
    ("r1_performance_stable", ([ch(0.0)], [ch(0.0)]), ([ch(0.0, 0.05)], [ch(0.0)])),
    ("r2_interpretability", (ch(0.2), ch(0.2), ch(-0.05)), (ch(0.2, 0.3), ch(0.2, 0.3), ch(-0.05, 0.3))),
    ("r3_decoupled", ([ch(0.1)], [ch(0.0)]), ([ch(0.1, 0.2)], [ch(0.0)])),
])
def test_a_wide_interval_with_the_same_mean_is_not_reproduced(rule, good, wide):
    f = getattr(C, rule)
    assert f(*good).verdict == "reproduced"
    assert f(*wide).verdict == "inconclusive" and "straddles" in f(*wide).reason


@pytest.mark.parametrize("rule,args", [
    ("r1_performance_stable", ([ch(0.0, 0.001, 2)], [ch(0.0, 0.001, 2)])),
    ("r2_interpretability", (ch(0.2, 0.001, 2), ch(0.2, 0.001, 2), ch(-0.05, 0.001, 2))),
    ("r3_decoupled", ([ch(0.1, 0.001, 2)], [ch(0.0, 0.001, 2)])),
])
def test_two_seeds_cannot_reproduce_even_with_a_tight_interval(rule, args):
    f = getattr(C, rule)
    out = f(*args)
    assert out.verdict == "inconclusive" and "needs 3 trained seed pairs (has 2)" in out.reason
    three = [[C.Change(x.mean, x.half_width, 3) for x in a] if isinstance(a, list) else C.Change(a.mean, a.half_width, 3)
             for a in args]
    assert f(*three).verdict == "reproduced"


def test_one_seed_decides_neither_way_for_r1_and_r3():
    assert C.r1_performance_stable([ch(-0.5, math.nan, 1)], []).verdict == "inconclusive"
    assert C.r3_decoupled([ch(-0.5, math.nan, 1)], [ch(0.0, math.nan, 1)]).verdict == "inconclusive"
    assert "no interval" in C.r3_decoupled([ch(-0.5, math.nan, 1)], [ch(0.0, math.nan, 1)]).reason


def test_r1_names_the_worst_interval_and_the_cause():
    v = C.r1_performance_stable([ch(0.0), ch(-0.031, 0.012)], [ch(0.0), ch(-0.01)], ratios=[10, 100])
    assert v.verdict == "holds where" and v.region == "at ratio 10; undecided at ratio 100"
    assert "largest drop -3.1 % ± 1.2 % over 4 seeds (accuracy, ratio 100)" in v.reason
    assert v.effect == "accuracy -3.1 % ± 1.2 % over 4 seeds"
    # a drop beyond the band in either metric at the only ratio contradicts the claim
    assert C.r1_performance_stable([ch(-0.1)], [ch(0.0)]).verdict == "not reproduced"
    # stable at 10, a drop at 100: the region says where it holds
    v = C.r1_performance_stable([ch(0.0), ch(-0.1)], [ch(0.0), ch(0.0)], ratios=[10, 100])
    assert (v.verdict, v.region) == ("holds where", "at ratio 10; not at ratio 100")
    # a ratio where nothing was compared keeps it from 'reproduced'
    v = C.r1_performance_stable([ch(0.0), None], [], ratios=[10, 100])
    assert v.verdict == "holds where" and v.region == "at ratio 10; not compared at ratio 100"


def test_r3_reads_the_highest_ratio():
    """A rise at ratio 3 with a fall at ratio 100 holds at 3 only; the reason quotes ratio 100."""
    v = C.r3_decoupled([ch(0.1), ch(-0.1)], [ch(0.0), ch(0.0)], ratios=[3, 100])
    assert v.verdict == "holds where" and v.region == "at ratio 3; not at ratio 100"
    assert "ratio 100" in v.reason and "-0.100 ± 0.005" in v.reason
    up = C.r3_decoupled([ch(-0.1), ch(0.1)], [ch(0.0), ch(0.0)], ratios=[3, 100])
    assert up.verdict == "holds where" and up.region == "at ratio 100; not at ratio 3"
    assert C.r3_decoupled([ch(-0.1), ch(-0.1)], [ch(0.0), ch(0.0)]).verdict == "not reproduced"
    # the highest ratio with a change on both sides is read (ratio 100 was not compared)
    assert C.r3_decoupled([ch(0.1), None], [ch(0.0), None]).verdict == "holds where"
    # a rise with an accuracy change beyond the band
    assert C.r3_decoupled([ch(0.1)], [ch(-0.1)]).verdict == "not reproduced"
    v = C.r3_decoupled([ch(0.1), ch(0.1)], [ch(0.0), ch(-0.1)], ratios=[10, 100])
    assert (v.verdict, v.region) == ("holds where", "at ratio 10; not at ratio 100")


def test_r3_is_not_tested_when_the_attention_is_not_necessary():
    args = ([ch(0.1)], [ch(0.0)])
    v = C.r3_decoupled(*args, necessary=False)
    assert v.verdict == "not tested" and v.reason == "the prediction does not need the head's attention"
    assert C.r3_decoupled(*args, necessary=True).verdict == C.r3_decoupled(*args, necessary=None).verdict == "reproduced"


@pytest.mark.parametrize("model,uniform,chance,want", [
    (0.24, 0.015, 0.015, True),     # SQuAD-like: uniform attention falls to chance
    (0.64, 0.62, 0.40, False),      # bag-of-words-like: uniform keeps 0.22 of the 0.24 above chance
    (0.90, 0.65, 0.40, True),       # loses exactly half (0.25 of 0.50)
    (0.90, 0.66, 0.40, False),      # loses 0.24 of 0.50
    (0.40, 0.30, 0.40, None),       # not above chance
    (math.nan, 0.3, 0.1, None),
])
def test_head_necessary_on_hand_worked_cases(model, uniform, chance, want):
    assert C.head_necessary(model, uniform, chance) is want


def test_real_data_rules_state_their_thresholds():
    assert C.THRESHOLDS["MIN_SEEDS"].value == C.MIN_SEEDS == 3 and C.THRESHOLDS["NECESSITY_SHARE"].value == 0.5
    for rule in (C.R1_RULE, C.R2_RULE, C.R3_RULE):
        assert "95 % seed interval" in rule and "at least 3 seeds" in rule
    assert "0.02" in C.R1_RULE and "0.05" in C.R2_RULE and "0.01" in C.R2_RULE and "0.005" in C.R3_RULE
    assert "0.5" in C.R3_RULE and C.RULE_TEXT["R3"] == C.R3_RULE


def test_ladder_calls_need_an_interval():
    """S1's per-pair call: an interval straddling the threshold, or one seed, decides nothing."""
    assert C.s1_pair(C.Change(0.3, 0.05, 5)) == "differ" and C.s1_pair(C.Change(0.03, 0.05, 5)) == "same"
    assert C.s1_pair(C.Change(0.1, 0.05, 5)) == "undecided" and C.s1_pair(C.Change(0.9, math.nan, 1)) == "undecided"
    only_undecided = {0.3: {("FAFO", "CACO"): C.Change(0.9, math.nan, 1)}}
    assert C.s1_ladder(only_undecided).verdict == "inconclusive"


def test_s2_phase_names_each_summary_region_and_what_a_tie_would_need():
    """S2 on the phase map: the region names each summary's pair where the ODE has it (and where the
    full model confirms it), a tie at a full-model cell decides nothing and the reason says how
    many seeds would separate it, and a full-model cell that decides for a pair the ODE never has
    still cannot refute the ODE's region."""
    v = C.s2_phase(S2_ODE_MIX, {(0.1, 0.3): ("B", S2_GAP), (1.0, 0.3): ("A", C.Change(0.2, 0.02, 5))}, S2_AXES)
    assert v.verdict == "holds where"
    assert "(CACO, FACO) at 4 of 6 cells" in v.region and "at every cell from loss 0.01 down" in v.region
    assert "(CAFO, CACO) at ratio 0.1, loss 0.3 (1 of 6 cells), confirmed by the full model at 1 cell" in v.region
    assert "neither pair at ratio 10, loss 0.3 (1 of 6 cells)" in v.region
    assert v.effect == "attention gap between the 2nd and the 3rd at 2 full-model cells: +0.1 ± 0.02 over 5 seeds " \
                       "to +0.2 ± 0.02 over 5 seeds"
    assert "agrees with the ODE at 2 of the 2 cells" in v.reason
    tie = C.s2_phase(S2_ODE_MIX, {(1.0, 0.3): ("tie", C.Change(0.01, 0.02, 5))}, S2_AXES)
    assert tie.verdict == "inconclusive" and "would need about 21 seeds" in tie.reason  # 5 * (0.02 / 0.01)^2 + 1
    assert "no full-model cell confirms the ODE's region" in tie.reason
    only_neither = C.s2_phase(S2_ODE_MIX, {(10.0, 0.3): ("neither", S2_GAP)}, S2_AXES)
    assert only_neither.verdict == "inconclusive"  # the ODE's pairs elsewhere are not refuted by this cell
    assert C.s2_phase({}, {(1.0, 0.3): ("A", S2_GAP)}, S2_AXES).verdict == "not tested"
    assert C.s2_settled(S2_ODE_MIX, S2_AXES) == (0.01, "A") and C.s2_settled(S2_ODE_NONE, S2_AXES) is None
    assert C.s2_region([(1.0, 0.3)], list(S2_ODE_A), S2_AXES) == "at ratio 1, loss 0.3 (1 of 4 cells)"


def test_the_tuned_rate_verdict_carries_each_optimizers_effect():
    v = C.tuned_region({"adamw": "reproduced", "sgd": "not reproduced"}, {},
                       {"adamw": "accuracy +0.1 % ± 0.4 % over 4 seeds", "sgd": "accuracy -9.0 % ± 1.0 % over 4 seeds",
                        "lion": "not run"})
    assert v.effect == "adamw: accuracy +0.1 % ± 0.4 % over 4 seeds; sgd: accuracy -9.0 % ± 1.0 % over 4 seeds"


def test_r2_is_contradicted_when_none_rises_and_one_is_shown_short_of_its_margin():
    # AC straddles its margin, sufficiency is shown not to fall by its margin: "all three rise" fails
    v = C.r2_interpretability(ch(0.0, 0.08), ch(0.02, 0.08), ch(0.001, 0.001))
    assert v.verdict == "not reproduced" and "sufficiency short of its margin" in v.reason
    # every interval straddles: nothing decided
    assert C.r2_interpretability(ch(0.0, 0.08), ch(0.02, 0.08), ch(0.0, 0.05)).verdict == "inconclusive"
    # one rises, one falls short: in part, not a contradiction of the part that rose
    assert C.r2_interpretability(ch(0.2), ch(0.0), ch(0.0, 0.05)).verdict == "holds where"
