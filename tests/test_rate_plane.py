"""The rate plane: both routes' pairing, cell outcomes, the stable ceiling, tied rates and the
plane's verdicts, on hand-made run tables whose answers are worked out by hand."""

import math

import numpy as np
import pandas as pd
import pytest

from qkov_lib import claims, rate_plane
from qkov_lib.protocol import phase_metrics

SEEDS = [0, 1, 2, 3]


def _table(value, trained=lambda o, e, r, s: True, diverged=lambda o, e, r, s: False, rates=(1e-4, 1e-3, 1e-2),
           ratios=(1.0, 10.0, 100.0)) -> pd.DataFrame:
    """One run per (rate, ratio, seed) of AdamW; every phase metric = ``value(eta_ov, ratio, seed)``,
    validation accuracy too; ``trained``/``diverged`` flag runs."""
    rows = []
    for e in rates:
        for r in ratios:
            for s in SEEDS:
                v = value(e, r, s)
                rows.append({"optimizer": "adamw", "eta_ov": e, "ratio": r, "seed": s,
                             "diverged": diverged("adamw", e, r, s), "trained": trained("adamw", e, r, s),
                             "val_accuracy": v, **{m: v for m in phase_metrics()}})
    return pd.DataFrame(rows)


def test_routes_pair_each_cell_with_its_own_reference():
    # metric = log10(eta_QK) + seed/100: along qk_up the change is log10(ratio) exactly; along ov_down
    # (fixed eta_QK) it is 0
    t = _table(lambda e, r, s: math.log10(e * r) + s / 100)
    p = rate_plane.plane_phase(t)
    up = p[(p["route"] == "qk_up") & (p["ratio"] == 10.0)]
    assert np.allclose(up["d_accuracy"], 1.0) and (up["d_accuracy_n"] == 4).all()
    down = p[p["route"] == "ov_down"]
    # fixed eta_QK lines with a ratio-1 run and a higher ratio: 1e-3 (ratio 10 at 1e-4) and 1e-2 (10, 100)
    assert sorted(zip(down["eta_qk"], down["ratio"])) == [(1e-3, 10.0), (1e-2, 10.0), (1e-2, 100.0)]
    assert np.allclose(down["d_accuracy"], 0.0)
    assert set(down["ref_eta_ov"]) == {1e-3, 1e-2} and (down["eta_ov"] * down["ratio"]).map(rate_plane.rate).equals(
        down["eta_qk"])
    # the all-runs view is there for attention too
    assert np.allclose(up["d_all_AC@0.5"], 1.0)


def test_float_rates_meet():
    assert rate_plane.rate(1e-4 * 100) == rate_plane.rate(1e-2) == 0.01


def test_rescued_and_thin_references():
    # at eta 1e-4 nothing trains at ratio 1 but everything at ratio 10 and 100 (rescued); at 1e-3 two of
    # four seeds train at ratio 1 (a thin reference: inconclusive)
    def trained(o, e, r, s):
        if e == 1e-4 and r == 1.0:
            return False
        if e == 1e-3 and r == 1.0:
            return s < 2
        return True

    t = _table(lambda e, r, s: 0.5 + s / 100, trained=trained)
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(t))
    r1 = out[(out["claim"] == "R1") & (out["route"] == "qk_up")]
    assert set(r1[r1["eta_ov"] == 1e-4]["outcome"]) == {"rescued"}
    assert set(r1[r1["eta_ov"] == 1e-4]["verdict"]) == {"not tested"}
    # 2 of 4 at ratio 1 and 4 of 4 above: training rescued too
    assert set(r1[r1["eta_ov"] == 1e-3]["outcome"]) == {"rescued"}
    assert "2 seed(s) trained at ratio 1, 4 at ratio 10" in r1[(r1["eta_ov"] == 1e-3) & (r1["ratio"] == 10)]["reason"].iloc[0]
    # a thin reference whose cell trains no better stays inconclusive
    thin = _table(lambda e, r, s: 0.5 + s / 100, trained=lambda o, e, r, s: s < 2 or e != 1e-3)
    out2 = rate_plane.cell_outcomes(rate_plane.plane_phase(thin))
    c = out2[(out2["claim"] == "R1") & (out2["route"] == "qk_up") & (out2["eta_ov"] == 1e-3)]
    assert set(c["verdict"]) == {"inconclusive"} and "2 seed(s) trained at ratio 1" in c["reason"].iloc[0]
    # eta 1e-2: unchanged accuracy with 4 seeds -> R1 reproduced
    assert set(r1[r1["eta_ov"] == 1e-2]["verdict"]) == {"reproduced"}


def test_ceiling_and_edge():
    # one ratio-1 run diverges at 1e-2: the ceiling is 1e-3; cells with eta_QK above it are not read
    t = _table(lambda e, r, s: 0.5 + s / 100, diverged=lambda o, e, r, s: e == 1e-2 and r == 1.0 and s == 0,
               trained=lambda o, e, r, s: not (e == 1e-2 and r == 1.0 and s == 0))
    ceiling = rate_plane.qk_ceiling(t)
    assert ceiling == {"adamw": 1e-3}
    # slow runs that did not train are no instability: the ceiling stays at the top rate
    slow = _table(lambda e, r, s: 0.5, trained=lambda o, e, r, s: e != 1e-4)
    assert rate_plane.qk_ceiling(slow) == {"adamw": 1e-2}
    # divergence at the smallest rate: no stable rate
    assert math.isnan(rate_plane.qk_ceiling(_table(lambda e, r, s: 0.5, diverged=lambda o, e, r, s: True))["adamw"])
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(t))
    v = rate_plane.plane_verdicts(out, ceiling)["R1"]
    # read: the point (1e-4, 1e-3) by both routes (from (1e-4, 1e-4) and from (1e-3, 1e-3));
    # everything else has eta_QK >= 1e-2
    # it holds there both ways, but one point is not a region
    assert v.verdict == "inconclusive"
    assert v.reason.startswith("2 cells within the stable range: 2 reproduced") and "held at 1 point only" in v.reason
    assert "past the stable ceiling, not read" in v.reason


def test_plane_verdict_region_names_cells():
    # accuracy falls by 0.1 at ratio 100 and is unchanged at ratio 10 (every route and rate)
    t = _table(lambda e, r, s: 0.8 - (0.1 if r == 100.0 else 0.0) + s / 1000)
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(t))
    v = rate_plane.plane_verdicts(out, {"adamw": 1.0})["R1"]
    assert v.verdict == "holds where"
    assert "adamw (0.0001, 0.001)↑" in v.region and "not at" in v.region and "(0.0001, 0.01)↑" in v.region
    assert v.effect.startswith("Δ accuracy from -0.100")
    # a plane where the claim holds nowhere, read where stable
    t2 = _table(lambda e, r, s: 0.8 - (0.1 if r > 1 else 0.0) + s / 1000)
    out2 = rate_plane.cell_outcomes(rate_plane.plane_phase(t2))
    assert rate_plane.plane_verdicts(out2, {"adamw": 1.0})["R1"].verdict == "not reproduced"
    # an empty reading is 'not tested'
    assert rate_plane.plane_verdicts(out2, {"adamw": 1e-9})["R1"].verdict == "not tested"


def test_tied_rates_and_tuned_line():
    # val accuracy: 1e-3 best (0.80 ± spread), 1e-2 within its interval, 1e-4 far below
    spread = {0: -0.01, 1: 0.01, 2: -0.005, 3: 0.005}
    means = {1e-4: 0.5, 1e-3: 0.80, 1e-2: 0.795}
    t = _table(lambda e, r, s: means[e] + spread[s])
    tied = rate_plane.tied_rates(t, {"adamw": 1e-3})
    assert tied == {"adamw": [1e-3, 1e-2]}
    cols = pd.DataFrame([{"optimizer": "adamw", "eta_ov": 1e-3, "claim": "R2", "verdict": "reproduced", "region": "",
                          "effect": "AC +0.1"},
                         {"optimizer": "adamw", "eta_ov": 1e-2, "claim": "R2", "verdict": "not reproduced",
                          "region": "", "effect": "AC -0.1"}])
    line = rate_plane.tuned_line(cols, tied)["R2"]
    assert line.verdict == "inconclusive" and "0.01: not reproduced" in line.effect
    agree = rate_plane.tuned_line(cols.assign(verdict="reproduced"), tied)["R2"]
    assert agree.verdict == "reproduced"


def test_region_table_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    t = _table(lambda e, r, s: 0.8 - (0.1 if r == 100.0 else 0.0) + s / 1000)
    p = rate_plane.plane_phase(t)
    out = rate_plane.cell_outcomes(p)
    tab = rate_plane.region_table(out, {"adamw": 1e-2})
    assert set(tab.columns) >= {"R1", "R2", "R3", "trained", "ref_trained", "past the edge"}
    assert tab["past the edge"].sum() == len(tab[tab["eta_qk"] > 1e-2])
    fig = rate_plane.plot_plane(p, "accuracy", {"adamw": 1e-2})
    assert len(fig.axes) == 4  # two route panels and their colour bars
    with pytest.raises(ValueError, match="no column"):
        rate_plane.plot_plane(p, "nonsense")


def test_mean_of_paired_change_is_paired():
    # seeds differ a lot, the change per seed is exactly +0.05: the interval is zero-width
    t = _table(lambda e, r, s: s / 10 + (0.05 if r > 1 else 0.0))
    p = rate_plane.plane_phase(t)
    row = p[(p["route"] == "qk_up") & (p["ratio"] == 10.0)].iloc[0]
    assert row["d_accuracy"] == pytest.approx(0.05) and row["d_accuracy_ci"] == pytest.approx(0.0, abs=1e-12)
    assert claims.MIN_SEEDS <= row["d_accuracy_n"]


def test_a_claim_that_holds_only_in_part_is_not_a_region_where_it_holds():
    # AC@0.5 and ACMC fall by 0.1 at every higher ratio, sufficiency improves (falls) by 0.1: R2 holds for
    # sufficiency only in every cell, which is not the claim
    t = _table(lambda e, r, s: 0.5 + s / 1000)
    up = t["ratio"] > 1
    for m in ("AC@0.5", "ACMC@0.5"):
        t.loc[up, m] -= 0.1
    t.loc[up, "sufficiency"] -= 0.1
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(t))
    assert set(out[out["claim"] == "R2"]["verdict"]) == {"holds where"}
    v = rate_plane.plane_verdicts(out, {"adamw": 1.0})["R2"]
    assert v.verdict == "not reproduced" and "in part (some of its measures) at adamw (0.0001, 0.001)↑" in v.reason
    # with one cell where all three improve, the claim holds there and the rest is named
    t2 = t.copy()
    cell = t2["eta_ov"].isin([1e-4, 1e-3]) & (t2["ratio"] == 10.0)
    for m in ("AC@0.5", "ACMC@0.5"):
        t2.loc[cell, m] += 0.2
    v2 = rate_plane.plane_verdicts(rate_plane.cell_outcomes(rate_plane.plane_phase(t2)), {"adamw": 1.0})["R2"]
    # the points (1e-4, 1e-3) and (1e-3, 1e-2), each reached both ways (↑ and ←): a region
    assert v2.verdict == "holds where"
    assert v2.region.startswith("at adamw (0.0001, 0.001)↑, adamw (0.001, 0.01)↑, adamw (0.0001, 0.001)←")
    assert "in part at" in v2.region


def test_a_part_hold_whose_other_measures_straddle_their_margins_decides_nothing():
    """Sufficiency improves by 0.1 in every cell while AC@0.5 and ACMC@0.5 move by +-0.5 from seed to
    seed (intervals far wider than their margins): the claim that all three rise is neither shown
    nor contradicted there. Before, such cells counted against the claim, and two of them made a
    'not reproduced' region that another seed set's noise could make or unmake (SVA's R2, seeds 0-3
    against 4-7)."""
    t = _table(lambda e, r, s: 0.5 + s / 1000)
    up = t["ratio"] > 1
    swing = np.where(t["seed"] % 2 == 0, 0.5, -0.5)
    for m in ("AC@0.5", "ACMC@0.5"):
        t.loc[up, m] = t.loc[up, m] + swing[up]
    t.loc[up, "sufficiency"] -= 0.1
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(t))
    r2 = out[out["claim"] == "R2"]
    assert set(r2["verdict"]) == {"holds where"} and not r2["contradicts"].any()
    v = rate_plane.plane_verdicts(out, {"adamw": 1.0})["R2"]
    assert v.verdict == "inconclusive"
    assert "in part (some of its measures) at adamw (0.0001, 0.001)↑" in v.reason and "the others undecided" in v.reason
    # the same cells with AC@0.5 short of its margin in every seed do count against it
    t.loc[up, "AC@0.5"] = 0.4
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(t))
    assert out[out["claim"] == "R2"]["contradicts"].all()
    assert rate_plane.plane_verdicts(out, {"adamw": 1.0})["R2"].verdict == "not reproduced"


def test_recipe_reads_a_plane_back_from_a_results_file():
    import json

    t = _table(lambda e, r, s: 0.5 + (0.1 if r > 1 else 0.0) + s / 1000)
    p = rate_plane.plane_phase(t)
    p.loc[p.index[-1], "d_AC@0.5"] = np.nan
    back = pd.DataFrame(json.loads(json.dumps(p.astype(object).where(p.notna(), None).to_dict("records"))))
    rec = rate_plane.recipe(back, {"adamw": 1e-2})
    assert rec.loc[0, "cells read"] == len(p[(p["ratio"] > 1) & (p["eta_qk"] <= 1e-2) & p["d_AC@0.5"].notna()])
    assert rec.loc[0, "mean Δ AC@0.5 ↑"] == "+0.100"


def test_a_word_needs_a_region_of_cells():
    # accuracy falls by 0.1 in one cell only ((1e-4, 1e-3)↑ at ratio 10): one cell decides no word
    def acc(e, r, s):  # seed noise that differs between ratios: the unchanged cells stay undecided
        return 0.8 - (0.3 if (e, r) == (1e-4, 10.0) else 0.0) + 0.03 * ((7 * s + {1.0: 0, 10.0: 1, 100.0: 2}[r]) % 3 - 1)
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(_table(acc)))
    r1 = out[out["claim"] == "R1"]
    # the point's runs are compared along both routes (↑ from (1e-4, 1e-4), ← from (1e-3, 1e-3)): still one point
    assert set(r1[r1["verdict"] == "not reproduced"]["eta_qk"]) == {1e-3}
    v = rate_plane.plane_verdicts(out, {"adamw": 1.0})["R1"]
    assert v.verdict != "not reproduced"
    assert "contradicted at 1 point only (adamw (0.0001, 0.001)↑, adamw (0.0001, 0.001)←)" in v.reason
    # the same fall in two cells is a region: not reproduced there
    def acc2(e, r, s):
        return 0.8 - (0.1 if r > 1 else 0.0) + (s % 2) * 0.05
    out2 = rate_plane.cell_outcomes(rate_plane.plane_phase(_table(acc2)))
    assert rate_plane.plane_verdicts(out2, {"adamw": 1.0})["R1"].verdict == "not reproduced"
    assert "MIN_REGION_CELLS" not in rate_plane.PLANE_RULE and "at least 2 points" in rate_plane.PLANE_RULE


def test_a_word_that_one_seed_turns_is_inconclusive():
    # accuracy falls by 0.1 at every higher ratio for seeds 0-2 and by 0.03 for seed 3: with all four
    # the fall clears -0.02 (R1 contradicted at every point); without seed 0, 1 or 2 the interval of
    # the three left straddles it, without seed 3 it does not
    def acc(e, r, s):
        return 0.8 - (0.0 if r == 1.0 else (0.03 if s == 3 else 0.1))
    t = _table(acc)
    ceiling = {"adamw": 1.0}
    out = rate_plane.cell_outcomes(rate_plane.plane_phase(t))
    assert rate_plane.plane_verdicts(out, ceiling)["R1"].verdict == "not reproduced"
    loo = {s: rate_plane.cell_outcomes(rate_plane.plane_phase(t[t["seed"] != s])) for s in SEEDS}
    v = rate_plane.one_seed_out(out, loo, ceiling)["R1"]
    assert v.verdict == "inconclusive" and "one seed decides it" in v.reason
    assert "not reproduced with every seed, but inconclusive without seed 0" in v.reason
    assert "seeds 0, 1, 2)" in v.reason and v.effect == rate_plane.plane_verdicts(out, ceiling)["R1"].effect
    # a clear fall for every seed stands with any one left out
    t2 = _table(lambda e, r, s: 0.8 - (0.0 if r == 1.0 else 0.1 + s / 1000))
    out2 = rate_plane.cell_outcomes(rate_plane.plane_phase(t2))
    loo2 = {s: rate_plane.cell_outcomes(rate_plane.plane_phase(t2[t2["seed"] != s])) for s in SEEDS}
    assert rate_plane.one_seed_out(out2, loo2, ceiling)["R1"].verdict == "not reproduced"
    # seed 3 never trained at ratio 1: leaving out another seed leaves two pairs, fewer than the rules'
    # minimum; that shortfall is the minimum's to judge, so those cells keep their outcome
    t3 = _table(lambda e, r, s: 0.8 - (0.0 if r == 1.0 else 0.1 + s / 1000), trained=lambda o, e, r, s: s != 3 or r > 1)
    out3 = rate_plane.cell_outcomes(rate_plane.plane_phase(t3))
    assert set(out3[out3["claim"] == "R2"]["pairs"]) == {3}
    loo3 = {s: rate_plane.cell_outcomes(rate_plane.plane_phase(t3[t3["seed"] != s])) for s in SEEDS}
    assert rate_plane.one_seed_out(out3, loo3, ceiling)["R1"].verdict == "not reproduced"


def test_the_fixed_qk_route_needs_more_steps_for_the_slower_ov_to_read_endpoints():
    # every run identical: R1 holds everywhere; with equal budgets the ← cells are not read on R1/R2
    t = _table(lambda e, r, s: 0.8 + s / 1000)
    plane = rate_plane.plane_phase(t)
    equal = {("adamw", e): 1000 for e in (1e-4, 1e-3, 1e-2)}
    out = rate_plane.cell_outcomes(plane, budgets=equal)
    down = out[out["route"] == "ov_down"]
    assert set(down[down["claim"].isin(["R1", "R2"])]["verdict"]) == {"not tested"}
    assert "no more than its reference" in down[down["claim"] == "R1"]["reason"].iloc[0]
    assert set(out[out["route"] == "qk_up"]["verdict"]) != {"not tested"}
    # R3 is read at matched loss: the budget rule leaves it alone
    assert set(down[down["claim"] == "R3"]["verdict"]) == set(
        rate_plane.cell_outcomes(plane)[lambda o: (o["route"] == "ov_down") & (o["claim"] == "R3")]["verdict"])
    # twice the steps per decade below the top rate: the slower eta_OV had more, its endpoints are read
    scaled = {("adamw", 1e-4): 4000, ("adamw", 1e-3): 2000, ("adamw", 1e-2): 1000}
    out2 = rate_plane.cell_outcomes(plane, budgets=scaled)
    assert set(out2[(out2["route"] == "ov_down") & (out2["claim"] == "R1")]["verdict"]) == {"reproduced"}
