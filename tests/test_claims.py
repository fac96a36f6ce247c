"""The claims' records: statements, thresholds, verdicts and their regions, scorecard rows, seed
changes, the necessity check and S2's phase-map helpers (the one rule itself: tests/test_one_rule.py)."""

import math

import pytest

from qkov_lib import claims as C

# S2's phase map in two axes: the ODE's top two per (ratio, loss) cell
S2_AXES = ("ratio", "loss")
S2_ODE_A = {(1.0, 0.3): "A", (10.0, 0.3): "A", (1.0, 0.01): "A", (10.0, 0.01): "A"}
S2_ODE_MIX = {(0.1, 0.3): "B", (1.0, 0.3): "A", (10.0, 0.3): "neither", (0.1, 0.01): "A", (1.0, 0.01): "A",
              (10.0, 0.01): "A"}
S2_ODE_NONE = {(1.0, 0.3): "neither", (10.0, 0.3): "neither"}


def test_thresholds_are_registered():
    assert C.THRESHOLDS["SAME_LOSS"].value == C.SAME_LOSS == 0.05
    assert C.threshold_text("SAME_LOSS") == "0.05 nats"
    assert C.THRESHOLDS["MIN_SEEDS"].value == C.MIN_SEEDS == 3 and C.THRESHOLDS["NECESSITY_SHARE"].value == 0.5


def test_estimands_state_their_margins():
    assert C.ESTIMANDS["R2"].side == "Δ ≥ +0.05" and C.ESTIMANDS["R1"].side == "Δ ≥ -0.02"
    assert C.ESTIMANDS["T1"].side == "Δ ≤ +1e-12" and C.ESTIMANDS["T5"].side == "Δ ≥ +0.1 nats"
    assert C.ESTIMANDS["R3"].text().endswith("the claim's side: Δ ≥ +0.005")


def test_a_region_is_required_exactly_for_holds_where_and_the_label_carries_it():
    with pytest.raises(ValueError, match="must name its region"):
        C.Verdict("holds where", "rule", "why")
    v = C.Verdict("holds where", "rule", "why", region="for ratio <= 10")
    assert v.label == "holds where for ratio <= 10" and C.Verdict("inconclusive", "r").label == "inconclusive"
    glue = C.verdict_glue({"R3-synthetic": v})
    assert glue["label_R3_synthetic"] == v.label and glue["effect_R3_synthetic"] == "-"
    assert set(C.VERDICT_MEANING) == set(C.VERDICTS) == set(C.WORD_OUTCOMES)


@pytest.mark.parametrize("rows,want", [
    ([], ("not run", "")),
    ([{"chapter": "SQuAD", "verdict": "not tested"}], ("not tested", "")),
    ([{"chapter": "SQuAD", "verdict": "reproduced"}, {"chapter": "SVA", "verdict": "reproduced"}], ("reproduced", "")),
    ([{"chapter": "SQuAD", "verdict": "reproduced"}, {"chapter": "SVA", "verdict": "not reproduced"}],
     ("mixed", "holds in SQuAD; contradicted in SVA")),
    ([{"chapter": "SQuAD", "verdict": "holds where", "region": "holds at ratio 10"},
      {"chapter": "SVA", "verdict": "inconclusive"}], ("holds where", "holds in SQuAD (holds at ratio 10)")),
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


def test_combine_counts_a_chapter_once():
    rows = [{"chapter": "SVA", "verdict": "inconclusive"}, {"chapter": "SVA", "verdict": "inconclusive"},
            {"chapter": "SQuAD", "verdict": "inconclusive"}]
    assert C.combine(rows)[1] == "2 chapters, each inconclusive"


def test_claim_rows_and_bad_verdicts():
    v = C.decide([], C.ESTIMANDS["S3"])
    row = C.claim("S3", "p", "o", v, "04_sweep")
    assert row["verdict"] == "not tested" and row["rule"] == C.ESTIMANDS["S3"].text()
    with pytest.raises(ValueError, match="verdict must be one of"):
        C.claim("S3", "p", "o", "yes")
    with pytest.raises(KeyError, match="unknown claim ID"):
        C.statement("T9")
    assert C.statement("R3-multilayer").startswith("R3") and C.statement("S3-adam").startswith("S3 under AdamW")
    assert set(C.EXTENSIONS[k][0] for k in C.EXTENSIONS) <= set(C.CLAIMS)


def test_change_interval_from_seed_differences():
    c = C.Change.of([0.10, 0.12, math.nan, 0.11, math.inf])
    assert c.n == 3 and c.mean == pytest.approx(0.11, abs=1e-12)
    # t(0.975, 2) = 4.3027, sd = 0.01, sqrt(3): half-width 0.024841 (to 1e-5)
    assert c.half_width == pytest.approx(4.302653 * 0.01 / math.sqrt(3), abs=1e-5)
    assert c.lo == pytest.approx(c.mean - c.half_width, abs=1e-12) and c.hi > c.mean
    one = C.Change.of([0.3])
    assert one.n == 1 and math.isnan(one.half_width) and (one.lo, one.hi) == (-math.inf, math.inf)
    exact = C.Change.exact(0.2)
    assert exact.bounded and (exact.lo, exact.hi) == (0.2, 0.2)
    with pytest.raises(ValueError, match="whole number"):
        C.Change(0.1, 0.01, 2.5)
    with pytest.raises(ValueError, match="half_width must be >= 0"):
        C.Change(0.1, -0.01, 3)


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


def test_s2_helpers_name_regions_and_the_settled_depth():
    assert C.s2_settled(S2_ODE_MIX, S2_AXES) == (0.01, "A") and C.s2_settled(S2_ODE_NONE, S2_AXES) is None
    assert C.s2_region([(1.0, 0.3)], list(S2_ODE_A), S2_AXES) == "at ratio 1, loss 0.3 (1 of 4 cells)"
    assert C.s2_summary({"CACO": 3, "FACO": 2, "FAFO": 1, "CAFO": 0}) == "A"
    assert C.s2_fafo_move({"FACO": 1.0, "CACO": 1.0}, {"FACO": 0.5, "CACO": 0.8}) == "FACO"
    assert C.s2_fafo_move({"FACO": 1.0, "CACO": 1.0}, {"FACO": 1.5, "CACO": 1.2}) == "neither"
    assert C.is_tie(0.0) and not C.is_tie(0.1) and C.is_tie(0.1, C.Change(0.1, 0.2, 4))


def test_log_odds_keeps_moving_where_attention_saturates():
    assert C.log_odds(0.5) == 0.0
    assert C.log_odds(0.999) - C.log_odds(0.99) == pytest.approx(math.log(999 / 99), abs=1e-9)
    assert math.isfinite(C.log_odds(1.0)) and math.isfinite(C.log_odds(0.0))
