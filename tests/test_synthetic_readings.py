"""The synthetic and theory claims (T1-T6, S1-S3 and their extensions) get their words only from
the one rule: cells named in words, each a change with its interval, read by
``claims.read_cells`` and worded by ``claims.decide``. Each reading is driven here, on hand-built
numbers, to a cell that holds, one that is contradicted and one that is undecided."""

import math

import numpy as np
import pandas as pd
import pytest

from qkov_lib import claims as C
from qkov_lib.studies import asymptotics, s2_phase, synthetic_sweeps
from qkov_lib.studies import reduction as red
from qkov_lib.studies import synthetic as base

P4 = ["FAFO", "CAFO", "FACO", "CACO"]


# --- the shared reading and its wording ----------------------------------------------------------
def test_exact_cells_do_not_widen_the_seed_intervals_beside_them():
    est = C.ESTIMANDS["S3"]
    seeded = {"seeded": C.Change.of([0.30, 0.35, 0.40, 0.32, 0.38])}
    exact = {f"ODE {i}": C.Change.exact(1.0) for i in range(50)}
    alone = base.read(est, seeded)[0]
    beside = [r for r in base.read(est, exact, seeded) if r.cell == "seeded"][0]
    assert beside.hw == pytest.approx(alone.hw) and alone.outcome == "holds"
    pooled = [r for r in C.read_cells({**exact, **seeded}, est) if r.cell == "seeded"][0]
    assert pooled.hw > 2 * alone.hw  # one family of 51 cells would have widened it


def test_a_long_verdict_names_the_few_and_counts_the_many():
    est = C.ESTIMANDS["T6"]
    cells = {f"cell {i}": C.Change.exact(1.0) for i in range(30)}
    cells["cell odd"] = C.Change.exact(-1.0)
    v = base.verdict(base.read(est, cells), est)
    assert v.verdict == "mixed" and v.region == "holds at 30 of 31 cells; contradicted at cell odd"
    assert v.effect.startswith("31 cells, from -1.000") and "(cell odd)" in v.effect
    assert v.reason == "30 holds, 1 contradicted of 31 cells"
    short = base.verdict(base.read(est, {"a": C.Change.exact(1.0), "b": C.Change.exact(-1.0)}), est)
    assert short == C.decide(base.read(est, {"a": C.Change.exact(1.0), "b": C.Change.exact(-1.0)}), est)


def test_undecided_cells_say_the_seeds_that_would_decide_them():
    est = C.ESTIMANDS["S3"]
    v = base.verdict(base.read(est, {"x": C.Change.of([0.15, 0.35, 0.05, 0.45])}), est)
    assert v.verdict == "inconclusive" and "seeds would decide x" in v.reason


# --- T1, T2 ----------------------------------------------------------------------------------------
def test_t1_reads_exact_gaps_and_the_ode_gap_each_against_its_own_bound():
    grad = pd.DataFrame({"err_loss": [1e-15], "err_grad_QK": [2e-15], "err_grad_OV": [1e-15]})
    summ = pd.DataFrame({"parameterization": ["FAFO", "CACO"], "ratio": [1.0, 1.0], "err_w": [0.01, 0.3],
                         "err_q": [0.02, 0.0]})
    vel = pd.DataFrame({"parameterization": ["FAFO", "CACO"], "dw_full": [1.0, 1.0], "dw_ode": [1.0, 1.5],
                        "dq_full": [1.0, 1.0], "dq_ode": [1.0, 1.0]})
    v = red.reduction_verdicts(grad, vel, summ)
    assert v["T1"].verdict == "mixed" and "contradicted at ODE vs full-model GD, CACO" in v["T1"].region
    assert "holds at reduced loss vs autograd, reduced gradients vs autograd" in v["T1"].region
    assert v["T2"].verdict == "mixed" and "contradicted at velocity, CACO" in v["T2"].region
    assert {k: x.verdict for k, x in red.reduction_verdicts(grad, vel.iloc[:1], summ.iloc[:1]).items()} == \
        {"T1": "reproduced", "T2": "reproduced"}
    n = red.reduction_numbers(grad, vel, summ)
    assert (n["loss_err"], n["grad_err"], n["overlay_err"]) == (1e-15, 2e-15, 0.3)
    assert n["vel_err"] == pytest.approx(0.5 / 1.0)  # CACO's dw off by 0.5 against the larger component, 1


# --- T3-T6 ---------------------------------------------------------------------------------------
def test_t3_names_where_exp_q_grows_like_log_squared_t():
    table = pd.DataFrame({"parameterization": ["CACO", "FACO"], "ratio": [1.0, 1.0], "OV exp. fitted": [1.01, 0.99],
                          "OV exp. derived": [1.0, 1.0]})
    t3 = pd.DataFrame({"parameterization": ["CACO", "FACO"], "exponent of exp(q) in log t": [2.01, 2.4]})
    rd = base.read(C.ESTIMANDS["T3"], asymptotics.t3_cells(table, t3))
    assert {r.cell: r.outcome for r in rd} == {"OV scalar ~ log t, CACO, ratio 1": "holds",
                                              "OV scalar ~ log t, FACO, ratio 1": "holds",
                                              "exp(q) ~ log² t, CACO": "holds",
                                              "exp(q) ~ log² t, FACO": "contradicted"}
    v = base.verdict(rd, C.ESTIMANDS["T3"])
    assert v.verdict == "mixed" and "contradicted at exp(q) ~ log² t, FACO" in v.region


def test_t4_reads_fixed_n_and_the_mixture_each_against_its_bound():
    single = pd.DataFrame({"parameterization": ["FAFO", "FAFO"], "ratio": [1.0, 10.0], "residual": [1e-9, -2e-9]})
    mix = pd.DataFrame({"parameterization": ["FAFO", "FAFO"], "ratio": [1.0, 10.0], "residual": [0.005, 0.03]})
    cells, est = asymptotics.t4_cells(single, mix, "3")
    assert cells["fixed n = 3, FAFO"].mean == 2e-9 and cells["mixture over n, FAFO"].mean == 0.03
    assert [r.outcome for r in base.read(est, cells)] == ["holds", "contradicted"]


def _ode_runs(common: dict) -> pd.DataFrame:
    """ODE trajectories whose loss falls 1 -> 1e-3 while the common mass is ``common[(p, r)]`` times
    the loss (so at matched loss the mass is proportional to ``common``)."""
    t = np.logspace(0, 6, 60)
    loss = np.logspace(0, -3, 60)
    return pd.concat([pd.DataFrame({"parameterization": p, "ratio": r, "t": t, "loss": loss, "common": c * loss})
                      for (p, r), c in common.items()])


def test_t5_is_read_per_step_of_the_ratio_and_names_a_reversal():
    runs = _ode_runs({("FAFO", 1.0): 1.0, ("FAFO", 10.0): 0.5, ("FAFO", 100.0): 0.9})
    full = pd.DataFrame(columns=["init", "parameterization", "ratio", "seed"])
    ode, seeded = asymptotics.t5_cells(runs, full)
    assert not seeded and len(ode) == 2 * 4  # two steps x four loss levels
    rd = base.read(C.ESTIMANDS["T5"], ode, seeded)
    out = {r.cell: r.outcome for r in rd}
    assert out["ODE, FAFO, ratio 1 → 10, loss 0.1"] == "holds"  # log 2 = 0.69 nats of fall
    assert out["ODE, FAFO, ratio 10 → 100, loss 0.1"] == "contradicted"  # the mass rose again
    v = base.verdict(rd, C.ESTIMANDS["T5"])
    assert v.verdict == "mixed" and "ratio 10 → 100" in v.region


def _matched_frame(rise: dict, seeds=range(5), ratios=(0.1, 1.0, 10.0, 100.0), noise=0.02) -> pd.DataFrame:
    """Runs at one matched loss: parameterization p's log-odds of attention rises by ``rise[p][k-1]``
    from ratio k-1 to k (a number: the same at every step), with seed noise ``noise``."""
    rows = []
    for p, r_ in rise.items():
        steps = list(r_) if isinstance(r_, (list, tuple)) else [r_] * (len(ratios) - 1)
        z0 = math.log(0.6 / 0.4)
        for k, r in enumerate(ratios):
            for s in seeds:
                z = z0 + sum(steps[:k]) + noise * ((s * 7 + k * 3) % 5 - 2)
                rows.append({"parameterization": p, "ratio": r, "seed": s, "attn_relevant": 1 / (1 + math.exp(-z)),
                             "loss": 0.05, "accuracy": 1.0, "stop_step": 10.0, "diverged": 0.0, "optimizer": "gd"})
    return pd.DataFrame(rows)


def test_t5_on_the_sweep_holds_where_the_ratio_sharpens_and_is_contradicted_where_it_reverses():
    ladder = {0.05: _matched_frame({"FAFO": [2.0, 2.0, -2.0], "CAFO": [2.0, 2.0, 0.1]}, noise=0.3)}
    rd = base.read(C.ESTIMANDS["T5"], synthetic_sweeps.t5_named(ladder))
    out = {r.cell: r.outcome for r in rd}
    assert out["FAFO, ratio 1 → 10, loss 0.05"] == "holds"
    assert out["FAFO, ratio 10 → 100, loss 0.05"] == "contradicted"
    assert out["CAFO, ratio 10 → 100, loss 0.05"] == "undecided"
    v = base.verdict(rd, C.ESTIMANDS["T5"])
    assert v.verdict == "mixed" and "contradicted at FAFO, ratio 10 → 100, loss 0.05" in v.region
    assert "would decide CAFO, ratio 10 → 100, loss 0.05" in v.reason


def test_t6_reads_every_ratio_one_cell_of_the_phase_map_and_the_full_model_by_seed():
    ode = pd.DataFrame([{"ratio": r, "init": 0.1, "n": "2", "loss": L, "logodds FACO": 3.0, "logodds CACO": 2.0,
                         "logodds FAFO": 1.0 if L > 0.01 else 2.5, "logodds CAFO": 1.5}
                        for r in (1.0, 10.0) for L in (0.1, 0.001)])
    att = {"FACO": [0.9, 0.901, 0.902], "CACO": [0.8, 0.801, 0.802], "FAFO": [0.70, 0.74, 0.66], "CAFO": [0.7] * 3}
    full = pd.DataFrame([{"init": "random", "ratio": 1.0, "seed": s, "parameterization": p, "distinct": a[s]}
                         for s in range(3) for p, a in att.items()])
    exact, seeded = asymptotics.t6_cells(full, ode)
    assert len(exact) == 4  # ratio 1 only: two losses x two pairs
    assert exact["ODE, FAFO vs CAFO, init 0.1, n 2, loss 0.1"].mean == -0.5
    rd = base.read(C.ESTIMANDS["T6"], exact, seeded)
    out = {r.cell: r.outcome for r in rd}
    assert out["ODE, FAFO vs CAFO, init 0.1, n 2, loss 0.1"] == "contradicted"
    assert out["ODE, FAFO vs CAFO, init 0.1, n 2, loss 0.001"] == "holds"
    assert out["full model, end of training: FACO vs CACO"] == "holds"
    assert out["full model, end of training: FAFO vs CAFO"] == "undecided"  # a tie near 0
    assert base.verdict(rd, C.ESTIMANDS["T6"]).verdict == "mixed"


# --- S1, S3 and the extensions ---------------------------------------------------------------------
def test_s3_reads_each_ratio_against_the_lowest_and_each_outcome_is_reached():
    ladder = {0.05: _matched_frame({"FAFO": 1.0, "CAFO": -1.0, "FACO": 0.1}, noise=0.3)}
    rd = base.read(C.ESTIMANDS["S3"], synthetic_sweeps.s3_named(ladder))
    out = {r.cell: r.outcome for r in rd}
    assert out["FAFO, ratio 0.1 → 100, loss 0.05"] == "holds"
    assert out["CAFO, ratio 0.1 → 100, loss 0.05"] == "contradicted"
    assert out["FACO, ratio 0.1 → 1, loss 0.05"] == "undecided"
    against_one = synthetic_sweeps.s3_named(ladder, min_ratio=1.0)
    assert set(against_one) == {f"{p}, ratio 1 → {r}, loss 0.05" for p in ("FAFO", "CAFO", "FACO") for r in (10, 100)}
    r3 = synthetic_sweeps.r3_named(ladder)
    assert set(r3) == {f"{p}, ratio 0.1 → 100, loss 0.05" for p in ("FAFO", "CAFO", "FACO")}


def test_s1_cells_hold_differ_or_are_the_same():
    pairs = {0.3: {("FAFO", "CAFO"): C.Change.of([0.5, 0.52, 0.49]), ("FACO", "CACO"): C.Change.of([0.01, 0.02, 0.0]),
                   ("FAFO", "FACO"): C.Change.of([0.05, 0.2, 0.12])}}
    rd = base.read(C.ESTIMANDS["S1"], synthetic_sweeps.s1_named(pairs))
    assert [r.outcome for r in rd] == ["holds", "contradicted", "undecided"]
    t = synthetic_sweeps.readings_table(rd)
    assert list(t["outcome"]) == ["holds", "contradicted", "undecided"] and t.iloc[2]["seeds to decide"] != ""


def test_s3_under_adam_reads_the_adamw_variant_against_ratio_one_beside_gradient_descent():
    from qkov_lib.studies.synthetic import Run

    gd = _matched_frame({p: 1.0 for p in P4}, ratios=(0.1, 1.0, 10.0, 100.0))
    ladder = {0.05: [Run(r.parameterization, r.ratio, int(r.seed), None, r.to_dict(), np.zeros((10, 10)))
                     for _, r in gd.iterrows()]}
    adam = _matched_frame({p: -1.0 for p in P4}, ratios=(0.1, 1.0, 10.0, 100.0)).assign(
        optimizer="adamw", variant="AdamW", matched_level=0.05)
    rd = synthetic_sweeps.variant_readings(adam, gd, 0.05)  # gradient descent: the main grid's runs at the loss
    assert {r.outcome for r in rd["S3-adam"]} == {"contradicted"} and len(rd["S3-adam"]) == 8
    assert {r.outcome for r in rd["S3-gd"]} == {"holds"} and rd["S3-gd"][0].cell.startswith("gradient descent, ")
    v = synthetic_sweeps.chapter_verdicts(rd)
    assert v["S3-adam"].verdict == "not reproduced" and "S3" not in v
    assert synthetic_sweeps.chapter_verdicts(synthetic_sweeps.chapter_readings(ladder, {}))["S3"].verdict == "reproduced"
    f = synthetic_sweeps._adam_facts(rd, v)
    assert "S3 under AdamW reads not reproduced (8 contradicted of 8 cells)" in f["adam_sentence"]
    assert "gradient descent read reproduced (8 holds of 8 cells)" in f["adam_sentence"]
    alone = synthetic_sweeps.variant_readings(adam, None, 0.05)  # the sweep page's results not at hand
    assert alone["S3-gd"] == [] and alone["S3-adam"] == rd["S3-adam"]
    assert "gradient descent's same cells are not at hand" in synthetic_sweeps._adam_facts(alone, v)["adam_sentence"]
    none = synthetic_sweeps.variant_readings(None, gd, 0.05)
    assert none["S3-adam"] == [] and synthetic_sweeps.chapter_verdicts(none)["S3-adam"].verdict == "not tested"


def test_class_lock_in_is_counted_per_parameterization_and_ratio():
    table = pd.DataFrame({"parameterization": ["FAFO"] * 4 + ["CACO"] * 2, "ratio": [1.0, 1.0, 100.0, 100.0, 1.0, 100.0],
                          "lowest_class_acc": [0.99, 0.98, 0.0, 0.97, 1.0, 0.3], "diverged": [0, 0, 0, 0, 0, 0]})
    t = synthetic_sweeps.lockin_table(table)
    assert t.loc["FAFO", "ratio 100"] == "1 of 2" and t.loc["FAFO", "ratio 1"] == "0 of 2"
    assert t.loc["CACO", "ratio 100"] == "1 of 1"


def test_lowest_class_accuracy_sees_a_class_that_never_learned():
    import torch

    from qkov_lib.data import synthetic as syn
    from qkov_lib.models import SyntheticModel

    task = syn.SyntheticTask(n_classes=3, n_common_vocab=2, n_common=(2, 4))
    E = syn.make_embeddings(task, torch.Generator().manual_seed(0), torch.float64)
    test = syn.sample(task, 300, torch.Generator().manual_seed(1))
    m = SyntheticModel(E, task.n_classes, parameterization="CACO", init_scale=0.1, dtype=torch.float64)
    with torch.no_grad():  # OV maps every token to class 0: classes 1 and 2 never learned
        for p in m.attention.parameters():
            p.zero_()
    low = synthetic_sweeps.lowest_class_accuracy([m], [test])
    assert low == [0.0]


# --- S2 per regime ---------------------------------------------------------------------------------
def _ode(rows: list[tuple]) -> pd.DataFrame:
    """A phase-map-shaped table from (ratio, loss, log-odds of FACO, CACO, FAFO, CAFO)."""
    out = []
    for r, L, *lo in rows:
        vals = dict(zip(["FACO", "CACO", "FAFO", "CAFO"], lo))
        order = sorted(vals, key=lambda p: -vals[p])
        out.append({"ratio": r, "init": 0.1, "n": "2", "loss": L, **{f"logodds {p}": v for p, v in vals.items()},
                    "ranking": " > ".join(order), "top two": C.s2_top_two(vals)})
    return pd.DataFrame(out)


def test_s2_reads_each_summary_pair_per_cell_and_counts_per_regime():
    ode = _ode([(1.0, 0.1, 3.0, 1.0, 2.0, 0.0),      # practical: (FACO, FAFO) leads, A contradicted
                (10.0, 0.1, 3.0, 1.0, 2.0, 0.0),
                (1.0, 1e-8, 3.0, 2.5, 2.0, 0.0)])    # asymptotic: A's pair leads
    exact, seeded, meta = s2_phase.s2_cells(ode)
    assert len(exact) == 6 and not seeded
    rd = base.read(C.ESTIMANDS["S2"], exact)
    out = {r.cell: r.outcome for r in rd}
    assert out["(CACO, FACO), ODE, ratio 1, init 0.1, n 2, loss 1e-08"] == "holds"
    assert out["(CACO, FACO), ODE, ratio 1, init 0.1, n 2, loss 0.1"] == "contradicted"
    v = s2_phase.s2_verdict(ode)
    assert v.verdict == "mixed"
    assert "(CACO, FACO), ODE: practical (loss ≥ 0.0001): 2 contradicted of 2 cells; asymptotic (loss < 0.0001): " \
           "1 holds of 1 cells" in v.region
    moves = s2_phase.fafo_moves(ode)
    t = s2_phase.regime_table(ode, moves)
    assert t.loc[("practical (loss ≥ 0.0001)", "ratio ≥ 1"), "leading pair"] == "(FACO, FAFO)"
    assert t.loc[("asymptotic (loss < 0.0001)", "ratio ≥ 1"), "(CACO, FACO)"] == 1.0
    f = s2_phase._regime_facts(ode, moves)
    assert "practical (loss ≥ 0.0001), ratio ≥ 1: 2 cells, leading pair (FACO, FAFO) at 100%, summary A's pair at 0%" \
        in f["s2p_regime_sentence"]
    assert f["s2p_move_sentence"].startswith("a faster QK moves FAFO toward FACO at ")


def test_a_variant_may_run_its_own_ratios_and_seeds():
    from qkov_lib.profiles import resolve

    adam = {"name": "AdamW", "optimizer": "adamw", "eta_ov": 0.02, "variant_ratios": [1.0, 10.0], "variant_seeds": [0, 1, 2]}
    cfg = resolve(synthetic_sweeps.PROFILES, "test", parameterizations=["FAFO"], variant_ratios=[0.1, 1.0],
                  variant_seeds=[0], variants=[adam, {"name": "plain", "n_common": [2]}])
    table, matched = synthetic_sweeps.robustness(cfg)
    got = {v: (sorted(set(g["ratio"])), sorted(set(g["seed"]))) for v, g in table.groupby("variant")}
    assert got == {"AdamW": ([1.0, 10.0], [0, 1, 2]), "plain": ([0.1, 1.0], [0])}
    assert set(matched[matched["variant"] == "AdamW"]["optimizer"]) == {"adamw"}
    rv = synthetic_sweeps.robustness_verdicts(table, matched)
    assert rv.loc["AdamW", "optimizer"] == "adamw" and rv.loc["AdamW", "ratios"] == "1 -> 10"
    gd = synthetic_sweeps.run_grid(cfg, ratios=[1.0, 10.0], seeds=[0, 1], matched_loss=0.3).matched[0.3]
    rd = synthetic_sweeps.variant_readings(matched, base.runs_frame(gd), 0.3)
    assert rd["S3-gd"] and rd["S3-adam"]  # gradient descent's cells beside AdamW's
    f = synthetic_sweeps._adam_facts(rd, synthetic_sweeps.chapter_verdicts(rd), rv)
    assert f["adam_sentence"].endswith(f"Under AdamW one class never learned in {rv.loc['AdamW', 'locked in']} runs at "
                                       "ratio 10.")
