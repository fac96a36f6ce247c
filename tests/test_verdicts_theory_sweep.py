"""Chapters 02-04 take their verdicts from the claims rules, fed with numbers from the chapters'
own tables: each verdict flips when the measured effect flips, and a comparison the grid cannot
make (one ratio, missing parameterizations, no equal rates) says "not tested"."""

import numpy as np
import pandas as pd
import pytest

from qkov_lib import claims as C
from qkov_lib import dynamics as dy
from qkov_lib.data import synthetic as syn
from qkov_lib.studies import synthetic_sweeps
from qkov_lib.studies import asymptotics
from qkov_lib.studies import reduction as red
from qkov_lib.profiles import resolve

TASK = syn.SyntheticTask(n_classes=3, n_common_vocab=2, n_common=(2, 4))
POINTS = [(0.3, 0.2), (2.5, 1.3)]
P4 = ["FAFO", "CAFO", "FACO", "CACO"]


# --- chapter 02: T1, T2 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reduction():
    grad = red.gradient_check(TASK, POINTS)
    vel = red.velocity_check(TASK, POINTS, parameterizations=["FAFO", "CACO"])
    ov = red.overlay(TASK, "FAFO", 0.5, 0.5, red.eta_ov_for(0.1, 4.0), 4.0, 60, n_logs=10)
    return grad, vel, ov


def _negated_prediction_grad(points):
    """gradient_check's table with the reduction's predicted gradients negated."""
    rows = []
    for w, q in points:
        g = dy.full_model_gradients(TASK, w, q)
        G_QK, G_OV = dy.predicted_gradients(w, q, TASK)
        rows.append({"err_loss": abs(float(g["loss"]) - float(dy.reduced_loss(w, q, dy.Sizes.from_task(TASK)))),
                     "err_grad_QK": float((g["W_QK"] + G_QK).abs().max()),
                     "err_grad_OV": float((g["W_OV"] + G_OV).abs().max())})
    return pd.DataFrame(rows)


def test_t1_t2_flip_when_the_reduction_predicts_the_opposite_sign(reduction):
    grad, vel, ov = reduction
    v = red.reduction_verdicts(grad, vel, red.overlay_summary(ov))
    assert (v["T1"].verdict, v["T2"].verdict) == ("reproduced", "reproduced")
    # the ODE trajectory with the opposite sign: GD no longer tracks it -> only the gradients agree
    flipped_ov = ov.assign(err_w=(ov["ov"] + ov["w_ode"]).abs(), err_q=(ov["qk"] + ov["q_ode"]).abs())
    assert red.reduction_verdicts(grad, vel, red.overlay_summary(flipped_ov))["T1"].verdict == "partly"
    # ... and the predicted gradients with the opposite sign too
    v = red.reduction_verdicts(_negated_prediction_grad(POINTS), vel.assign(dw_ode=-vel["dw_ode"], dq_ode=-vel["dq_ode"]),
                              red.overlay_summary(flipped_ov))
    assert (v["T1"].verdict, v["T2"].verdict) == ("not reproduced", "not reproduced")


def test_t2_fails_without_the_rescaling(reduction):
    """Factor-level velocity of FAFO against the collapsed ODE (R = 1): the measured rescaling
    is what makes T2 pass."""
    _, vel, _ = reduction
    sizes = dy.Sizes.from_task(TASK)
    fafo = vel[vel["parameterization"] == "FAFO"].copy()
    ode = [dy.velocity("CACO", w, q, sizes, 1.0, 3.0) for w, q in zip(fafo["w"], fafo["q"])]
    fafo["dw_ode"], fafo["dq_ode"] = [float(a) for a, _ in ode], [float(b) for _, b in ode]
    assert red.reduction_verdicts(vel.iloc[:0], vel, pd.DataFrame())["T2"].verdict == "reproduced"
    assert red.reduction_verdicts(vel.iloc[:0], fafo, pd.DataFrame())["T2"].verdict == "not reproduced"


def test_reduction_with_no_checks_is_not_tested(reduction):
    grad, vel, ov = reduction
    v = red.reduction_verdicts(grad.iloc[:0], vel.iloc[:0], red.overlay_summary(ov).iloc[:0])
    assert (v["T1"].verdict, v["T2"].verdict) == ("not tested", "not tested")


# --- chapter 03: T3-T6, S2 ---------------------------------------------------------------------
def _asym_tables(**overrides) -> dict:
    cfg = resolve(asymptotics.PROFILES_ASYMPTOTICS, "test", **overrides)
    sizes = red.sizes_of(cfg)
    eq = asymptotics.equal_or_lowest(cfg["ratios"])
    runs = asymptotics.long_runs(sizes, cfg)
    return dict(runs=runs, table=asymptotics.exponent_table(runs, sizes, cfg), t3=asymptotics.t3_table(runs, cfg, eq),
                hz=asymptotics.horizon_ranking(runs, cfg["horizons"], eq), ml=asymptotics.matched_loss_ranking(runs, [1e-2, 1e-4], eq),
                lines_single=asymptotics.line_check(sizes, cfg, cfg["ratios"], single_n=3),
                lines_mix=asymptotics.line_check(sizes, cfg, cfg["ratios"]), full=asymptotics.full_model_runs(cfg, progress=False),
                sizes=sizes, cfg=cfg)


def _asym_verdicts(t: dict) -> dict[str, str]:
    v = asymptotics.asymptotics_verdicts(t["runs"], t["table"], t["t3"], t["hz"], t["lines_single"], t["lines_mix"], t["full"])
    return {k: x.verdict for k, x in v.items()}


@pytest.fixture(scope="module")
def asym():
    return _asym_tables()


def test_asymptotics_verdicts_on_the_test_profile(asym):
    assert _asym_verdicts(asym) == {"T3": "partly", "T4": "partly", "T5": "reproduced", "T6": "reproduced"}


def test_t5_flips_when_the_ratio_order_is_reversed(asym):
    """Relabel ratio 1 as 10 and 10 as 1: the common mass now rises with the ratio in the ODE and
    the full-model attention falls."""
    swap = {1.0: 10.0, 10.0: 1.0}
    runs = asym["runs"].assign(ratio=asym["runs"]["ratio"].map(swap))
    full = asym["full"].assign(ratio=asym["full"]["ratio"].map(swap))
    assert C.t5_sharpening(*asymptotics.t5_inputs(asym["runs"], asym["full"])).verdict == "reproduced"
    assert C.t5_sharpening(*asymptotics.t5_inputs(runs, full)).verdict == "not reproduced"


def test_t6_flips_when_factorized_and_collapsed_qk_swap(asym):
    swap = {"FACO": "CACO", "CACO": "FACO", "FAFO": "CAFO", "CAFO": "FAFO"}
    hz = asym["hz"].rename(columns={f"common {a}": f"common {b}" for a, b in swap.items()})
    full = asym["full"].assign(parameterization=asym["full"]["parameterization"].map(swap))
    assert C.t6_factorized_qk(asymptotics.t6_margins(asym["hz"], asym["full"])).verdict == "reproduced"
    assert C.t6_factorized_qk(asymptotics.t6_margins(hz, full)).verdict == "not reproduced"


def test_t3_flips_when_the_ov_scalar_grows_twice_as_fast(asym):
    """Doubling w turns its fitted exponent in log t from 1 into 2: the OV half of T3 fails."""
    runs = asym["runs"].assign(w=2 * asym["runs"]["w"])
    table = asymptotics.exponent_table(runs, asym["sizes"], asym["cfg"])
    assert C.t3_growth(*asymptotics.t3_inputs(asym["table"], asym["t3"])).verdict == "partly"
    assert C.t3_growth(*asymptotics.t3_inputs(table, asym["t3"])).verdict == "not reproduced"


def _residual(lines: pd.DataFrame, sign: float) -> pd.DataFrame:
    """line_check's relative residual against the line of slope ``sign * slope``."""
    out = []
    for _, g in lines.groupby(["parameterization", "ratio"], sort=False):
        X, Y = g["X"].to_numpy(), g["Y"].to_numpy()
        out.append(g.assign(residual=(Y - Y[0] - sign * g["slope"] * (X - X[0])) / (Y.max() - Y.min())))
    return pd.concat(out)


def test_t4_flips_when_the_line_slope_changes_sign(asym):
    single, mix = asym["lines_single"], asym["lines_mix"]
    assert np.allclose(_residual(single, 1.0)["residual"], single["residual"])  # same residual as the chapter
    assert C.t4_line(*asymptotics.t4_inputs(single, mix)).verdict == "partly"
    assert C.t4_line(*asymptotics.t4_inputs(_residual(single, -1.0), mix)).verdict == "not reproduced"


def _full(att: dict[float, dict[str, float]], seeds: int = 1) -> pd.DataFrame:
    """A full_model_runs-shaped table: ``seeds`` random-init runs per (parameterization, ratio),
    seed ``s`` at ``a + 0.001 (s - mean seed)`` so that the seed means are ``a``."""
    return pd.DataFrame([{"parameterization": p, "ratio": r, "init": "random", "seed": s,
                          "distinct": a + 0.001 * (s - (seeds - 1) / 2)}
                         for r, d in att.items() for p, a in d.items() for s in range(seeds)])


ATT1 = {"FAFO": 0.80, "CAFO": 0.60, "FACO": 0.95, "CACO": 0.90}  # top two FACO, CACO: the first summary


def test_s2_flips_with_the_ranking_and_fafos_move():
    toward_faco = _full({1.0: ATT1, 10.0: {**ATT1, "FAFO": 0.93}}, seeds=4)
    assert asymptotics.s2_inputs(toward_faco)[1] == "FACO"
    # FAFO ends 0.02 from FACO and 0.03 from CACO: with one seed there is no interval, so a tie
    assert asymptotics.s2_inputs(_full({1.0: ATT1, 10.0: {**ATT1, "FAFO": 0.93}}))[1] == "tie"
    att, move = asymptotics.s2_inputs(toward_faco)
    assert C.s2_level(C.s2_summary(att), move) == (True, True)
    flipped = {p: 1 - a for p, a in ATT1.items()}  # ranking reversed: top two CAFO, FAFO
    away = _full({1.0: flipped, 10.0: {**flipped, "FAFO": 0.4}})  # FAFO (0.2) moves away from FACO and CACO
    att, move = asymptotics.s2_inputs(away)
    assert move == "neither" and C.s2_level(C.s2_summary(att), move) == (False, False)


def test_asymptotics_with_one_ratio_say_not_tested():
    t = _asym_tables(ratios=[1.0], full_ratios=[1.0])
    v = asymptotics.asymptotics_verdicts(t["runs"], t["table"], t["t3"], t["hz"], t["lines_single"], t["lines_mix"], t["full"])
    f = asymptotics.asymptotics_facts(t["runs"], t["table"], t["t3"], t["hz"], t["ml"], t["lines_single"], t["lines_mix"],
                             t["full"], t["sizes"], t["cfg"], v)
    assert v["T5"].verdict == "not tested" and not f["t5_tested"] and not f["t5_full_tested"]
    assert f["t5_mono"] == f["t5_full"] == f["A_scaling"] == "not tested (one ratio)" and not f["A_tested"]
    assert f["fafo_toward"] == "not tested" and f["rule_S2"] == C.S2_RULE and "S2" not in v
    rows = asymptotics.asymptotics_claims(f, v)
    assert [r["id"] for r in rows] == ["T3", "T4", "T5", "T6"] and all(r["rule"] and r["reason"] for r in rows)
    # no equal rates: T6 cannot be judged
    t = _asym_tables(ratios=[10.0], full_ratios=[10.0])
    assert {k: x for k, x in _asym_verdicts(t).items() if k in ("T5", "T6")} == {"T5": "not tested", "T6": "not tested"}


def test_asymptotics_sentence_choices_follow_the_numbers(asym):
    """The comparisons that choose chapter 03's sentences follow the numbers: with q's fitted
    exponent set to 2, 'q grows like log² t' is chosen instead of 'it does not'."""
    t = asym
    v = asymptotics.asymptotics_verdicts(t["runs"], t["table"], t["t3"], t["hz"], t["lines_single"], t["lines_mix"], t["full"])
    f = asymptotics.asymptotics_facts(t["runs"], t["table"], t["t3"], t["hz"], t["ml"], t["lines_single"], t["lines_mix"],
                             t["full"], t["sizes"], t["cfg"], v)
    assert f["q_literal"] is False
    assert f["thr_literal_tol"] == C.threshold_text("LITERAL_TOL") and f["rule_T5"] == C.T5_RULE
    t3 = t["t3"].assign(**{"exponent of q in log t": 2.0})
    f2 = asymptotics.asymptotics_facts(t["runs"], t["table"], t3, t["hz"], t["ml"], t["lines_single"], t["lines_mix"],
                              t["full"], t["sizes"], t["cfg"], v)
    assert f2["q_literal"] is True and f2["q_exp_max"] == "2.00"


# --- chapter 04: S1-S3, R3-synthetic, S3-robustness ---------------------------------------------
def _summary(rise: float, params=P4, ratios=(1.0, 10.0), acc_change: float = 0.0, att=ATT1) -> pd.DataFrame:
    """A seed-summary-shaped table: attention rises by ``rise`` from the lowest to the highest ratio."""
    rows = []
    for p in params:
        for k, r in enumerate(ratios):
            frac = k / max(len(ratios) - 1, 1)
            rows.append({"parameterization": p, "ratio": r, "attn_relevant": att[p] + rise * frac, "loss": 0.01,
                         "accuracy": 1.0 - acc_change * frac, "AC@0.9": 0.5 + rise * frac, "weak_attn_confident": 0.1,
                         "n_seeds": 1, "n_diverged": 0})
    return pd.DataFrame(rows)


BINS = {"FAFO": (9, 0), "CAFO": (5, 5), "FACO": (9, 9), "CACO": (0, 9)}


def _heat(p: str, ratio: float, fafo_hi_on_faco: float, jitter: float = 0.0) -> np.ndarray:
    """A heatmap with each parameterization in its own bin; FAFO half on FACO's bin at ratio 1 and
    ``fafo_hi_on_faco`` on it at the higher ratio (``jitter`` moves a little of that share)."""
    h = np.zeros((10, 10))
    if p == "FAFO":
        share = 0.5 if ratio == 1.0 else fafo_hi_on_faco + jitter
        h[BINS["FACO"]], h[BINS["FAFO"]] = share, 1 - share
    else:
        h[BINS[p]] = 1.0
    return h


def _ladder(att=ATT1, fafo_hi_on_faco: float = 0.8, seeds=(0, 1, 2, 3), levels=(0.3, 0.1), same=False,
            params=P4, ratios=(1.0, 10.0)) -> dict:
    """A matched-loss ladder of hand-made runs: at every level, parameterization p has attention
    ``att[p]`` (± 0.001 by seed) and the heatmaps of :func:`_heat` (all alike with ``same``)."""
    from qkov_lib.studies import synthetic as base

    out = {}
    for lv in levels:
        runs = []
        for p in params:
            for r in ratios:
                for s in seeds:
                    h = np.full((10, 10), 0.01) if same else _heat(p, r, fafo_hi_on_faco, 0.01 * s)
                    test = {"attn_relevant": att[p] + 0.001 * s, "stop_step": 10.0, "diverged": 0.0}
                    runs.append(base.Run(p, r, s, None, test, h))
        out[lv] = runs
    return out


def _sweep_verdicts(summary, matched, ladder=None, rob=None) -> dict[str, str]:
    ladder = _ladder() if ladder is None else ladder
    params = list(dict.fromkeys(summary["parameterization"]))
    pairs = synthetic_sweeps.ladder_pairs(ladder, 1.0, params)
    _, calls = synthetic_sweeps.ladder_s2(ladder, 1.0, params)
    return {k: v.verdict for k, v in synthetic_sweeps.chapter_verdicts(summary, matched, pairs, calls, rob).items()}


def test_sweep_verdicts_flip_with_the_measured_effects():
    up, down = _summary(+0.03), _summary(-0.03)
    v = _sweep_verdicts(up, up)
    # R3-synthetic is fed mean changes without seed pairs: no interval, so it cannot be decided
    assert v == {"S1": "reproduced", "S2": "reproduced", "S3": "reproduced", "R3-synthetic": "partly",
                 "S3-robustness": "not tested"}
    # attention falls with the ratio (fixed steps and at matched loss)
    v = _sweep_verdicts(down, down)
    assert v["S3"] == "not reproduced" and v["R3-synthetic"] == "partly"
    pairs = synthetic_sweeps.ladder_pairs(_ladder(), 1.0, P4)
    _, calls = synthetic_sweeps.ladder_s2(_ladder(), 1.0, P4)
    reason = synthetic_sweeps.chapter_verdicts(down, down, pairs, calls, None)["R3-synthetic"].reason
    assert "no interval" in reason and "too few seeds" in reason and "-0.030" in reason
    # identical heatmaps at every level: S1 flips
    assert _sweep_verdicts(up, up, _ladder(same=True))["S1"] == "not reproduced"
    # ranking reversed and FAFO moving away from FACO (and CACO): S2 flips
    assert _sweep_verdicts(up, up, _ladder(att={p: 1 - a for p, a in ATT1.items()}, fafo_hi_on_faco=0.2))["S2"] == \
        "not reproduced"
    # sharper only with an accuracy change at matched loss: R3-synthetic partly
    assert _sweep_verdicts(up, _summary(+0.03, acc_change=0.1))["R3-synthetic"] == "partly"
    # no ratio above the lowest at matched loss: not tested
    assert _sweep_verdicts(up, up[up.ratio == 1.0])["R3-synthetic"] == "not tested"


def test_the_ladder_tables_decide_ties_and_moves_from_seed_intervals():
    """At each level the top two are a tie when the second and third are equal within their seed
    interval; FAFO's move is measured at the highest faster ratio two seeds reached."""
    lad = _ladder()
    t, calls = synthetic_sweeps.ladder_s2(lad, 1.0, P4)
    assert list(t.columns) == synthetic_sweeps.LADDER_S2_COLUMNS and list(t["training loss"]) == [0.3, 0.1]
    assert calls == {0.3: ("A", "FACO"), 0.1: ("A", "FACO")} and set(t["FAFO at ratio"]) == {10.0}
    assert t["ranking at equal rates"][0].startswith("FACO 0.95") and " ± " in t["ranking at equal rates"][0]
    # CACO and FAFO equal on average (seed noise only): the top two are a tie at every level
    tie = _ladder(att={**ATT1, "FAFO": ATT1["CACO"]})
    jittered = {lv: [r if not (r.parameterization == "FAFO" and r.ratio == 1.0) else
                     type(r)(r.parameterization, r.ratio, r.seed, None,
                             {**r.test, "attn_relevant": r.test["attn_relevant"] + (0.002 if r.seed % 2 else -0.004)},
                             r.dtap) for r in runs] for lv, runs in tie.items()}
    _, calls = synthetic_sweeps.ladder_s2(jittered, 1.0, P4)
    assert {p for p, _ in calls.values()} == {"tie"}
    # one FAFO seed at the faster ratio: its move is not measured, and S2 cannot be refuted
    one = {lv: [r for r in runs if not (r.parameterization == "FAFO" and r.ratio == 10.0 and r.seed > 0)]
           for lv, runs in _ladder(att={p: 1 - a for p, a in ATT1.items()}).items()}
    t, calls = synthetic_sweeps.ladder_s2(one, 1.0, P4)
    assert set(t["FAFO moves toward"]) == {"not tested"} and C.s2_ladder(calls).verdict == "not tested"
    # S1 pairs: one row per pair, one column per level, each cell with its interval and call
    s1 = synthetic_sweeps.ladder_s1_table(synthetic_sweeps.ladder_pairs(lad, 1.0, P4))
    assert list(s1.columns) == ["loss 0.3", "loss 0.1"] and len(s1) == 6
    assert s1.loc["CAFO vs FACO", "loss 0.3"] == "1.000 ± 0.000 (4 seeds): differ"
    maps = synthetic_sweeps.ladder_dtaps(lad, 1.0)
    assert set(maps) == {(p, lv) for p in P4 for lv in (0.3, 0.1)}


def _rob(rises: dict[str, float]) -> pd.DataFrame:
    return pd.concat([_summary(r).assign(variant=name) for name, r in rises.items()], ignore_index=True)


def test_s3_robustness_combines_the_variants_and_flips():
    up = _summary(+0.03)
    assert _sweep_verdicts(up, up, rob=_rob({"a": 0.03, "b": 0.02}))["S3-robustness"] == "reproduced"
    assert _sweep_verdicts(up, up, rob=_rob({"a": 0.03, "b": -0.02}))["S3-robustness"] == "partly"
    assert _sweep_verdicts(up, up, rob=_rob({"a": -0.03, "b": -0.02}))["S3-robustness"] == "not reproduced"
    one = _rob({"a": 0.0}).query("ratio == 1.0")
    assert _sweep_verdicts(up, up, rob=one)["S3-robustness"] == "not tested"


def test_robustness_verdicts_table_uses_the_rule_and_the_stuck_threshold():
    rows = []
    for name, rise in (("up", 0.05), ("down", -0.05)):
        for p in P4:
            for r in (1.0, 10.0):
                for seed in (0, 1):
                    acc = C.STUCK_ACC - 0.01 if (name == "down" and r == 10.0 and seed == 0) else 1.0
                    rows.append({"variant": name, "parameterization": p, "ratio": r, "seed": seed, "diverged": 0.0,
                                 "loss": 0.01, "accuracy": acc, "attn_relevant": ATT1[p] + (rise if r == 10.0 else 0),
                                 "AC@0.5": 0.5, "AC@0.9": 0.5})
    rv = synthetic_sweeps.robustness_verdicts(pd.DataFrame(rows))
    assert rv.loc["up", "S3 verdict"] == "reproduced" and rv.loc["up", "stuck or diverged"] == 0
    assert rv.loc["down", "S3 verdict"] == "not reproduced" and rv.loc["down", "stuck or diverged"] == 4
    assert rv.loc["up", "attention up"] == 4 and rv.loc["down", "attention up"] == 0


@pytest.mark.parametrize("overrides, expect", [
    (dict(ratios=[1.0]), {"S1": "not tested", "S2": "not tested", "S3": "not tested", "R3-synthetic": "not tested",
                          "S3-robustness": "not tested"}),
    (dict(ratios=[100.0], parameterizations=["FAFO"]),
     {"S1": "not tested", "S2": "not tested", "S3": "not tested", "R3-synthetic": "not tested",
      "S3-robustness": "not tested"}),
])
def test_sweep_chapter_with_one_ratio_says_not_tested(overrides, expect):
    from qkov_lib.studies import synthetic as base

    cfg = resolve(synthetic_sweeps.PROFILES, "test", seeds=[0], steps=20, robustness=False, **overrides)
    grid = synthetic_sweeps.run_grid(cfg, matched_loss=synthetic_sweeps.ladder_levels(cfg))
    mruns = grid.matched[cfg["matched_loss"]]
    table, mtable = base.runs_frame(grid.runs), base.runs_frame(mruns)
    summary, matched = synthetic_sweeps.summarize_runs(grid.runs), synthetic_sweeps.matched_summary(mruns)
    dtaps = base.mean_dtap(grid.runs)
    eq = synthetic_sweeps.equal_rate(cfg["ratios"])
    toward = synthetic_sweeps.fafo_toward(dtaps, cfg["ratios"], eq)
    pairs = synthetic_sweeps.ladder_pairs(grid.matched, eq, cfg["parameterizations"])
    _, calls = synthetic_sweeps.ladder_s2(grid.matched, eq, cfg["parameterizations"])
    v = synthetic_sweeps.chapter_verdicts(summary, matched, pairs, calls, None)
    assert {k: v[k].verdict for k in expect} == expect
    f = synthetic_sweeps.chapter_facts(summary, matched, table, mtable, toward, None, dtaps, cfg, v, pairs)
    assert f["n_ratios_run"] == 1 and not f["rob_tested"] and "s3_n_up" not in f and "r3_moves" not in f
    assert f["thr_same_loss"] == "0.05 nats" and f["verdict_R3_synthetic"] == "not tested"
    rows = synthetic_sweeps.claims(f, v)
    assert [r["id"] for r in rows] == ["S1", "S2", "S3", "R3-synthetic", "S3-robustness"]
    assert all(r["rule"] and r["reason"] and r["verdict"] in C.VERDICTS for r in rows)
    assert rows[2]["ours"] == rows[3]["ours"] == f"only ratio {cfg['ratios'][0]:g} run"
    assert rows[4]["ours"] == "robustness variants not run"
    if len(cfg["ratios"]) == 1 and len(cfg["parameterizations"]) == 4 and v["S2"].verdict != "not tested":
        raise AssertionError(f"one seed and one ratio cannot decide S2: {v['S2']}")


# --- the claims helpers added for these chapters ------------------------------------------------
def _v(verdict: str) -> C.Verdict:
    return C.Verdict(verdict, C.S3_RULE, "x")


@pytest.mark.parametrize("per_variant, expect", [
    ({"a": _v("reproduced"), "b": _v("reproduced")}, "reproduced"),
    ({"a": _v("reproduced"), "b": _v("not tested")}, "partly"),
    ({"a": _v("reproduced"), "b": _v("not reproduced")}, "partly"),
    ({"a": _v("not reproduced"), "b": _v("not reproduced")}, "not reproduced"),
    ({"a": _v("not tested")}, "not tested"),
    ({}, "not tested"),
])
def test_s3_robustness_reaches_every_verdict(per_variant, expect):
    out = C.s3_robustness(per_variant)
    assert out.verdict == expect and out.rule == C.S3_ROBUST_RULE and out.reason


def test_s2_fafo_move_and_verdict_glue():
    assert C.s2_fafo_move({"FACO": 0.5, "CACO": 0.4}, {"FACO": 0.1, "CACO": 0.3}) == "FACO"
    assert C.s2_fafo_move({"FACO": 0.5, "CACO": 0.4}, {"FACO": 0.6, "CACO": 0.45}) == "neither"
    assert C.s2_fafo_move({"FACO": 0.5, "CACO": 0.4}, {"FACO": float("nan"), "CACO": 0.3}) is None
    g = C.verdict_glue({"R3-synthetic": _v("partly")})
    assert g == {"verdict_R3_synthetic": "partly", "rule_R3_synthetic": C.S3_RULE, "reason_R3_synthetic": "x"}
    assert C.verdict_frame({"S3": _v("partly")}).loc["S3", "verdict"] == "partly"
    assert C.THRESHOLDS["CONST_TOL"].value == C.CONST_TOL


def test_sweep_facts_with_two_ratios_give_the_s3_and_r3_numbers():
    """With two ratios the S3 and R3-synthetic comparisons are made: their counts are numbers
    the scorecard line quotes, and the S1 distances of four parameterizations are there."""
    from qkov_lib.studies import synthetic as base

    cfg = resolve(synthetic_sweeps.PROFILES, "test", seeds=[0, 1], steps=30, robustness=False, ratios=[1.0, 10.0])
    grid = synthetic_sweeps.run_grid(cfg, matched_loss=synthetic_sweeps.ladder_levels(cfg))
    mruns = grid.matched[cfg["matched_loss"]]
    table, mtable = base.runs_frame(grid.runs), base.runs_frame(mruns)
    summary, matched = synthetic_sweeps.summarize_runs(grid.runs), synthetic_sweeps.matched_summary(mruns)
    dtaps = base.mean_dtap(grid.runs)
    toward = synthetic_sweeps.fafo_toward(dtaps, cfg["ratios"], 1.0)
    pairs = synthetic_sweeps.ladder_pairs(grid.matched, 1.0, cfg["parameterizations"])
    s2_table, calls = synthetic_sweeps.ladder_s2(grid.matched, 1.0, cfg["parameterizations"])
    v = synthetic_sweeps.chapter_verdicts(summary, matched, pairs, calls, None)
    f = synthetic_sweeps.chapter_facts(summary, matched, table, mtable, toward, None, dtaps, cfg, v, pairs)
    assert f["s1_tested"] and f["tv_n_pairs"] == "6" and 0 <= int(f["tv_n_differ"]) <= 6
    assert 0 <= int(f["s3_n_up"]) <= 4 and not f["s3_mid_tested"] and {f["r3_lo"], f["r3_hi"]} <= {"1", "10"}
    rows = {r["id"]: r["ours"] for r in synthetic_sweeps.claims(f, v)}
    assert rows["S3"].startswith("ratio 1 -> 10: attention up by at least") and f["s3_dloss"] in rows["S3"]
    assert rows["R3-synthetic"].startswith(f"{f['n_reached']} of {f['n_matched_runs']} runs reached loss")
    assert f["tv_range"] in rows["S1"] and f["s1_ladder_counts"] in rows["S1"] and rows["S2"] == v["S2"].reason
    assert list(s2_table["training loss"]) == synthetic_sweeps.ladder_levels(cfg) == [0.6, 0.3]


def test_equal_distances_are_a_tie_that_supports_neither_summary():
    """FAFO closer to both candidates, ending equally far from them: a tie, not "toward FACO"
    (which taking the first minimum would say); decided by the seed interval when there is one."""
    before, after = {"FACO": 0.9, "CACO": 0.9}, {"FACO": 0.448, "CACO": 0.448}
    assert C.s2_fafo_move(before, after) == "tie"
    assert C.s2_fafo_move(before, {"FACO": 0.40, "CACO": 0.45}) == "FACO"  # no seeds: unequal is not a tie
    noisy = C.Change.of([-0.08, 0.02, 0.03, -0.01])  # per-seed FACO - CACO: the interval contains 0
    assert C.s2_fafo_move(before, {"FACO": 0.40, "CACO": 0.41}, noisy) == "tie"
    clear = C.Change.of([-0.05, -0.051, -0.049, -0.05])
    assert C.s2_fafo_move(before, {"FACO": 0.40, "CACO": 0.45}, clear) == "FACO"
    assert C.s2_fafo_move(before, {"FACO": 0.40, "CACO": 0.45}, C.Change.of([-0.05])) == "tie"  # one seed: no interval
    v = C.s2_ladder({0.3: ("A", "tie")})
    assert v.verdict == "partly" and "tie" in v.reason  # the pair matches A, but a tie is no move toward FACO
    assert C.s2_ladder({0.3: ("A", "FACO")}).verdict == "reproduced"
    # the chapter table names a tie, not the first of two equal distances
    h = np.zeros((10, 10)); h[9, 9] = 1.0
    g = np.zeros((10, 10)); g[0, 9] = 1.0
    dtaps = {("FAFO", 1.0): h, ("FAFO", 10.0): h, ("FACO", 1.0): g, ("CACO", 1.0): g}
    t = synthetic_sweeps.fafo_toward(dtaps, [1.0, 10.0], 1.0, {("FAFO", 10.0): [h, h]})
    assert list(t["closer to"]) == ["tie", "tie"] and synthetic_sweeps.fafo_move(t, 1.0) == "neither"
