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


def test_plot_plane():
    import matplotlib

    matplotlib.use("Agg")
    t = _table(lambda e, r, s: 0.8 - (0.1 if r == 100.0 else 0.0) + s / 1000)
    p = rate_plane.plane_phase(t)
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


def test_recipe_reads_a_plane_back_from_a_results_file():
    import json

    t = _table(lambda e, r, s: 0.5 + (0.1 if r > 1 else 0.0) + s / 1000)
    p = rate_plane.plane_phase(t)
    p.loc[p.index[-1], "d_AC@0.5"] = np.nan
    back = pd.DataFrame(json.loads(json.dumps(p.astype(object).where(p.notna(), None).to_dict("records"))))
    rec = rate_plane.recipe(back, {"adamw": 1e-2})
    assert rec.loc[0, "cells read"] == len(p[(p["ratio"] > 1) & (p["eta_qk"] <= 1e-2) & p["d_AC@0.5"].notna()])
    assert rec.loc[0, "mean Δ AC@0.5 ↑"] == "+0.100"


def _protocol(value, **kw):
    t = _table(value, **kw)
    return rate_plane.plane_phase(t), rate_plane.qk_ceiling(t)


def test_the_protocol_reads_the_tuned_rate_raised_and_its_control_lowered():
    # AC@0.5 (and every phase metric) rises by 0.1 per decade of eta_QK, the same for every seed but a
    # small spread: along the protocol (eta_QK raised at the tuned 1e-3) +0.1 at ratio 10, +0.2 at 100;
    # the control (eta_OV lowered at eta_QK 1e-3) reaches ratio 10 at (1e-4, 1e-3): no change
    plane, ceiling = _protocol(lambda e, r, s: 0.1 * math.log10(e * r) + 1.0 + s / 1000 * (r > 1))
    cells = rate_plane.protocol_cells(plane, {"adamw": 1e-3}, ceiling)
    up = cells[(cells["route"] == "qk_up") & (cells["claim"] == "R2")].sort_values("ratio")
    assert list(up["ratio"]) == [10.0, 100.0] and np.allclose(up["mean"], [0.1 + 0.0015, 0.2 + 0.0015])
    assert list(up["cell"]) == ["AdamW, η_OV 0.001, ratio 10 vs 1", "AdamW, η_OV 0.001, ratio 100 vs 1"]
    down = cells[(cells["route"] == "ov_down") & (cells["claim"] == "R2")]
    assert list(zip(down["eta_ov"], down["eta_qk"], down["ratio"])) == [(1e-4, 1e-3, 10.0)]
    assert abs(float(down["mean"].iloc[0])) < 0.01
    v, ctl = rate_plane.protocol_verdicts(cells, "qk_up"), rate_plane.protocol_verdicts(cells, "ov_down")
    assert v["R2"].verdict == "reproduced" and ctl["R2"].verdict == "not reproduced"
    # nothing is dropped: eta_QK 0.1 lies past the largest stable base rate (1e-2) and is marked, and read
    assert up["past_stable"].tolist() == [False, True]
    assert "past the stable rate" in v["R2"].effect


def test_the_protocol_words_come_out_each_way():
    # accuracy: no change at ratio 10, a fall of 0.2 at ratio 100: R1 holds at 10, is contradicted at 100
    plane, ceiling = _protocol(lambda e, r, s: 0.8 - (0.2 if r == 100.0 else 0.0) + s / 1000 * (r > 1))
    v = rate_plane.protocol_verdicts(rate_plane.protocol_cells(plane, {"adamw": 1e-3}, ceiling))
    assert v["R1"].verdict == "mixed"
    assert "holds at AdamW, η_OV 0.001, ratio 10 vs 1" in v["R1"].region
    assert "contradicted at AdamW, η_OV 0.001, ratio 100 vs 1" in v["R1"].region
    # noise wide enough to straddle every margin: inconclusive, with the seeds that would decide
    plane, ceiling = _protocol(lambda e, r, s: 0.5 + (0.1 if r > 1 else 0.0) + (s - 1.5) * 0.1 * (r > 1))
    v = rate_plane.protocol_verdicts(rate_plane.protocol_cells(plane, {"adamw": 1e-3}, ceiling))
    assert v["R2"].verdict == "inconclusive" and "seeds would decide" in v["R2"].reason


def test_r3_is_read_only_where_both_runs_learned():
    plane, ceiling = _protocol(lambda e, r, s: 0.5 + (0.1 if r > 1 else 0.0) + s / 1000 * (r > 1))
    sel = {"adamw": 1e-3}
    pairs = rate_plane.pairs_of(plane)
    matched = pd.DataFrame([{"optimizer": a[0], "eta_ov": a[1], "ratio": a[2], "ref_eta_ov": b[1], "level": 0.69,
                             "d_val_attn_relevant": 0.2, "d_val_attn_relevant_ci": 0.01, "d_val_attn_relevant_n": 4}
                            for a, b in pairs])
    plane = rate_plane.add_matched(plane, matched)
    learned = rate_plane.protocol_cells(plane, sel, ceiling, chance_loss=1.1)
    assert rate_plane.protocol_verdicts(learned)["R3"].verdict == "reproduced"
    # matched at 0.69 where chance is ln 2 = 0.693: the runs never left chance, not comparable
    stuck = rate_plane.protocol_cells(plane, sel, ceiling, chance_loss=math.log(2))
    r3 = stuck[stuck["claim"] == "R3"]
    assert r3["note"].str.startswith("not comparable").all() and r3["mean"].isna().all()
    v = rate_plane.protocol_verdicts(stuck)["R3"]
    assert v.verdict == "not tested" and "not comparable" in v.reason
    assert (rate_plane.readings_frame(stuck)["R3"] == "not comparable").all()


def test_readings_frame_prints_what_the_word_reads():
    plane, ceiling = _protocol(lambda e, r, s: 0.5 + (0.1 if r > 1 else 0.0) + s / 1000 * (r > 1))
    frame = rate_plane.readings_frame(rate_plane.protocol_cells(plane, {"adamw": 1e-3}, ceiling))
    assert len(frame) == 3 and frame["R2"].str.startswith("holds: +0.10").iloc[0]
    assert {"ACMC@0.5", "sufficiency", "η_QK past the stable rate"} <= set(frame.columns)


def test_forest_plot_draws_every_protocol_cell():
    import matplotlib

    matplotlib.use("Agg")
    plane, ceiling = _protocol(lambda e, r, s: 0.5 + (0.1 if r > 1 else 0.0) + s / 1000 * (r > 1))
    cells = rate_plane.protocol_cells(plane, {"adamw": 1e-3}, ceiling)
    fig = rate_plane.plot_forest({"A": cells, "B": cells})
    ax = fig.axes[0]
    assert len(ax.get_yticklabels()) == 4  # two datasets x two ratios
    lo, hi = ax.get_xlim()
    assert lo >= -1.1 and hi <= 1.1  # intervals clipped to the range of a fraction's change
