"""The one rule of qkov_lib.claims: every outcome in both directions, Bonferroni, seeds to decide, the
words from outcomes, and a printed word checked against its own numbers."""

import math

import pytest
from scipy import stats

from qkov_lib import claims as C

UP = C.Estimand("a rise", 1, 0.05)        # the claim: the change is at least +0.05
DOWN = C.Estimand("a fall", -1, -0.01)    # the claim: the change is at most -0.01


@pytest.mark.parametrize("est, change, want", [
    (UP, C.Change(0.20, 0.03, 4), "holds"),            # interval [0.17, 0.23] above +0.05
    (UP, C.Change(-0.10, 0.03, 4), "contradicted"),    # interval below +0.05
    (UP, C.Change(0.05, 0.03, 4), "undecided"),        # straddles
    (UP, C.Change(0.08, 0.03, 4), "holds"),            # [0.05, 0.11]: the margin itself is the claim's side
    (DOWN, C.Change(-0.20, 0.03, 4), "holds"),         # a fall wholly below -0.01
    (DOWN, C.Change(0.10, 0.03, 4), "contradicted"),   # a rise wholly above -0.01
    (DOWN, C.Change(0.00, 0.03, 4), "undecided"),
    (UP, C.Change(0.20, math.nan, 1), "undecided"),    # one seed: no interval, decides nothing either way
    (UP, C.Change(-0.20, math.nan, 1), "undecided"),
    (UP, C.Change.exact(0.06), "holds"),               # a value without seeds decides by its sign alone
    (UP, C.Change.exact(0.04), "contradicted"),
    (UP, None, "undecided"),
])
def test_outcome_in_both_directions(est, change, want):
    assert C.outcome(change, est) == want


def test_the_same_bar_confirms_and_refutes():
    """Mirror a change about the margin: holds turns into contradicted with the same distance."""
    for mean, hw in [(0.2, 0.1), (0.12, 0.05), (0.051, 0.0009)]:
        c, mirror = C.Change(mean, hw, 5), C.Change(2 * UP.margin - mean, hw, 5)
        assert {C.outcome(c, UP), C.outcome(mirror, UP)} == {"holds", "contradicted"}


def test_bonferroni_widens_with_the_cells_read():
    c = C.Change(0.10, 0.04, 4)
    t = stats.t.ppf(1 - 0.05 / 8, 3) / stats.t.ppf(0.975, 3)
    assert C.family_half_width(c, 4) == pytest.approx(0.04 * t)
    assert C.family_half_width(c, 1) == 0.04
    assert C.outcome(c, UP, 1) == "holds" and C.outcome(c, UP, 4) == "undecided"


def test_seeds_to_decide_are_the_fewest_that_decide():
    c = C.Change(0.116, 0.113, 4)  # undecided against +0.05 over 4 cells
    n = C.seeds_to_decide(c, UP, 4)
    assert n is not None and n > 4
    sd = 0.113 * math.sqrt(4) / stats.t.ppf(0.975, 3)
    at = lambda k: stats.t.ppf(1 - 0.05 / 8, k - 1) * sd / math.sqrt(k)  # noqa: E731
    assert at(n) < 0.116 - 0.05 <= at(n - 1)
    assert C.seeds_to_decide(C.Change(0.2, 0.03, 4), UP) == 4        # decided already
    assert C.seeds_to_decide(C.Change(0.05, 0.03, 4), UP) is None    # on the margin: no number of seeds
    assert C.seeds_to_decide(C.Change(0.2, math.nan, 1), UP) is None  # spread unknown


@pytest.mark.parametrize("outcomes, want", [
    (["holds", "holds"], "reproduced"),
    (["holds", "undecided"], "holds where"),
    (["holds", "contradicted", "undecided"], "mixed"),
    (["contradicted", "undecided"], "not reproduced"),
    (["contradicted", "contradicted"], "not reproduced"),
    (["undecided", "undecided"], "inconclusive"),
    ([], "not tested"),
])
def test_words_from_outcomes(outcomes, want):
    assert C.word(outcomes) == want


def test_word_refuses_unknown_outcomes():
    with pytest.raises(ValueError, match="outcomes must be among"):
        C.word(["holds", "rescued"])


def test_decide_names_where_and_the_seeds_needed():
    r = C.read_cells({"a": C.Change(0.3, 0.02, 8), "b": C.Change(-0.1, 0.02, 8), "c": C.Change(0.1, 0.2, 4)}, UP)
    v = C.decide(r, UP)
    assert v.verdict == "mixed" and "holds at a" in v.region and "contradicted at b" in v.region
    assert "seeds would decide c" in v.reason
    assert "a: +0.300 ±" in v.effect and v.rule == UP.text()


def test_every_claim_has_an_estimand_on_a_finite_margin():
    assert set(C.CLAIMS) <= set(C.ESTIMANDS)
    for e in C.ESTIMANDS.values():
        assert e.direction in (1, -1) and math.isfinite(e.margin)
    with pytest.raises(ValueError):
        C.Estimand("x", 0, 0.1)


def test_a_printed_word_is_checked_against_its_own_numbers():
    r = C.read_cells({"a": C.Change(0.154, 0.021, 4), "b": C.Change(-0.011, 0.008, 4),
                      "c": C.Change(0.116, 0.113, 4)}, UP)
    v = C.decide(r, UP)
    assert C.word_problem(v.verdict, v.rule, v.effect) is None
    for planted in ("reproduced", "not reproduced", "inconclusive", "holds where"):
        why = C.word_problem(planted, v.rule, v.effect)
        assert why and "read as 'mixed'" in why
    # a row not written by the one rule is not read
    assert C.word_problem("reproduced", "some other rule", "4/4 up") is None


def test_chapters_combine_by_the_same_word():
    m = lambda v, ch: {"verdict": v, "chapter": ch}  # noqa: E731
    assert C.combine([m("reproduced", "a"), m("not reproduced", "b")])[0] == "mixed"
    assert C.combine([m("reproduced", "a"), m("inconclusive", "b")])[0] == "holds where"
    assert C.combine([m("not reproduced", "a"), m("inconclusive", "b")])[0] == "not reproduced"
    assert C.combine([m("reproduced", "a"), m("reproduced", "b")])[0] == "reproduced"
    assert C.combine([m("not tested", "a")])[0] == "not tested"
    assert C.combine([])[0] == "not run"
    with pytest.raises(ValueError, match="must be one of"):
        C.combine([m("reproducd", "a")])
