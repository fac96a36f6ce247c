"""The protocol-choices study: each arm changes one choice, and the sentences follow the one rule."""

import math

import pandas as pd
import pytest

from qkov_lib import claims
from qkov_lib.studies import ablation, realmap


def squad_cfg():
    return realmap.map_config("squad", "cpu")


@pytest.mark.parametrize("name, dataset", [("readout", "squad"), ("ov_init", "squad"), ("budget", "squad"),
                                           ("evaluation", "squad"), ("readout", "sva"), ("budget", "hatexplain"),
                                           ("natural", "sva")])
def test_an_arm_differs_from_the_default_in_its_one_choice(name, dataset):
    mcfg = realmap.map_config(dataset, "cpu")
    base, arm = ablation.default_config(mcfg), ablation.arm_config(name, dataset, mcfg, steps_factor=4, eval_rows=300)
    differ = {k for k in base if base[k] != arm.get(k)} | (set(arm) - set(base))
    assert differ == set(ablation.ABLATIONS[name].keys)


def test_each_arm_sets_what_it_says():
    mcfg = squad_cfg()
    assert ablation.arm_config("readout", "squad", mcfg)["relative"] is False
    assert ablation.arm_config("ov_init", "squad", mcfg)["ov_init"] == 0.0 and mcfg["ov_init"] == 1.0
    b = ablation.arm_config("budget", "squad", mcfg, steps_factor=4)
    assert (b["adamw_steps"], b["sgd_steps"], b["patience"]) == (3200, 3200, None)
    assert ablation.arm_config("evaluation", "squad", mcfg, eval_rows=300)["eval_rows"] == 300
    assert ablation.default_config(mcfg)["eval_rows"] is None


def test_which_ablations_apply_where():
    assert ablation.applies("readout", "squad", squad_cfg()) and ablation.applies("readout", "sva",
                                                                                  realmap.map_config("sva", "cpu"))
    hx = realmap.map_config("hatexplain", "cpu")
    assert not ablation.applies("readout", "hatexplain", hx) and not ablation.applies("ov_init", "hatexplain", hx)
    assert not ablation.applies("ov_init", "sva", realmap.map_config("sva", "cpu"))
    assert ablation.applies("natural", "sva", {}) and not ablation.applies("natural", "squad", {})
    assert ablation.applies("budget", "hatexplain", hx) and ablation.applies("evaluation", "hatexplain", hx)


def test_clear_errors():
    with pytest.raises(ValueError, match="unknown ablation 'dropout'; the protocol's choices are readout"):
        ablation.arm_config("dropout", "squad", squad_cfg())
    with pytest.raises(ValueError, match="unknown dataset 'imdb'"):
        ablation.applies("budget", "imdb", {})
    with pytest.raises(ValueError, match="'ov_init' does not apply to hatexplain"):
        ablation.arm_config("ov_init", "hatexplain", realmap.map_config("hatexplain", "cpu"))
    with pytest.raises(ValueError, match="steps_factor must be an integer >= 1"):
        ablation.arm_config("budget", "squad", squad_cfg(), steps_factor=0)
    with pytest.raises(ValueError, match="unknown ablation 'x'"):
        ablation.study_config("test", ablations=["x"])
    with pytest.raises(ValueError, match="'imdb' is not allowed"):
        ablation.study_config("test", datasets=["imdb"])
    with pytest.raises(ValueError, match="at least 2 seeds"):
        ablation.study_config("test", seeds=[0])
    with pytest.raises(ValueError, match="rates_given must be None"):
        ablation.study_config("test", rates_given={"sva": {"adamw": -1.0}})


def cells(rows):
    """Protocol cells (qk_up) from (optimizer, ratio, claim, mean, hw, n)."""
    return pd.DataFrame([{"route": "qk_up", "optimizer": o, "ratio": r, "claim": c, "mean": m, "hw": h, "n": n}
                         for o, r, c, m, h, n in rows])


def test_changes_the_answer_by_hand():
    # R2 margin +0.05; two cells per claim (Bonferroni over 2). Default ratio 10: +0.20 ± 0.01 with n = 8 holds;
    # ablated: -0.10 ± 0.01 is contradicted. Ratio 100: both +0.30 ± 0.01: holds in both arms.
    default = cells([("adamw", 10.0, "R2", 0.20, 0.01, 8), ("adamw", 100.0, "R2", 0.30, 0.01, 8)])
    ablated = cells([("adamw", 10.0, "R2", -0.10, 0.01, 8), ("adamw", 100.0, "R2", 0.30, 0.01, 8)])
    t = ablation.delta_table(ablation.delta_rows("squad", "readout", default, ablated))
    assert list(t["default outcome"]) == ["holds", "holds"]
    assert list(t["ablated outcome"]) == ["contradicted", "holds"]
    assert list(t["changes"]) == [True, False]
    s = ablation.verdict_changes(t)["readout"]
    assert s.startswith("relative readout (α − u) against plain readout (α): changes the answer in 1 of 2 cells")
    assert "squad, AdamW, ratio 10 (R2: holds → contradicted)" in s
    same = ablation.delta_table(ablation.delta_rows("squad", "readout", default, default))
    assert ablation.verdict_changes(same)["readout"].endswith("does not change the answer (the same outcome in all 2 cells)")


def test_an_undecided_cell_that_becomes_decided_changes_the_answer():
    # R1 margin -0.02: -0.01 ± 0.05 straddles it (undecided); +0.01 ± 0.005 lies above it (holds)
    t = ablation.delta_table(ablation.delta_rows("sva", "budget", cells([("adamw", 100.0, "R1", -0.01, 0.05, 4)]),
                                                 cells([("adamw", 100.0, "R1", 0.01, 0.005, 4)])))
    assert (t["default outcome"].item(), t["ablated outcome"].item(), t["changes"].item()) == ("undecided", "holds", True)


def test_a_cell_missing_in_one_arm_is_not_a_change():
    t = ablation.delta_table(ablation.delta_rows("sva", "natural", cells([("adamw", 10.0, "R1", 0.0, 0.01, 4),
                                                                          ("adamw", 10.0, "R2", 0.3, 0.01, 4)]),
                                                 cells([])))
    assert list(t["claim"]) == ["R1"]  # the natural prefixes read R1 only
    assert t["ablated outcome"].item() == "not measured" and not t["changes"].item()
    assert "not measured (no cell read in both arms)" in ablation.verdict_changes(t)["natural"]


def test_outcomes_are_the_one_rules():
    est = claims.ESTIMANDS["R2"]
    c = claims.Change(0.08, 0.02, 4)
    t = ablation.delta_rows("squad", "budget", cells([("adamw", 10.0, "R2", 0.08, 0.02, 4)]),
                            cells([("adamw", 10.0, "R2", 0.08, 0.02, 4)]))
    assert t[0]["default outcome"] == claims.outcome(c, est, 1) == "holds"


def test_word_changes_and_sentence():
    words = pd.DataFrame([("squad", "default", "R2", "not reproduced"), ("squad", "ov_init", "R2", "inconclusive"),
                          ("squad", "budget", "R2", "not reproduced")], columns=["dataset", "arm", "claim", "word"])
    ch = ablation.word_changes(words)
    assert list(ch["changes"]) == [True, False]
    assert ablation.word_sentence(ch) == "W_OV starts small and random on squad: R2 not reproduced → inconclusive"
    assert ablation.word_sentence(ch[~ch["changes"]]).startswith("none: every word")


def test_settle_step_by_hand():
    steps = [0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]
    # moving by 0.05 a log until step 500, then flat: at step 1000 the window [800, 1000] holds 3 flat logs;
    # at 600 the window [480, 600] holds two logs only
    v = [0.0, 0.05, 0.10, 0.15, 0.20, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25]
    assert ablation.settle_step(steps, v) == 1000.0
    assert ablation.settle_step(steps, v, min_logs=2) == 600.0
    assert math.isnan(ablation.settle_step(steps, [0.1 * i for i in range(11)]))
    with pytest.raises(ValueError, match="one length"):
        ablation.settle_step([0, 1], [0.0])


def test_one_rate_config_keeps_the_grids_budget_and_fills_both_processes():
    mcfg = realmap.map_config("squad", "full")  # step_growth 2: a rate a decade below the top gets twice the steps
    cfg = ablation.one_rate_config(mcfg, {"adamw": 1e-3}, [1.0, 10.0, 100.0], [0, 1, 2, 3])
    assert cfg["adamw_rates"] == [1e-3] and cfg["optimizers"] == ["adamw"]
    assert cfg["adamw_steps"] == realmap.run_steps(mcfg, "adamw", 1e-3) == 16000
    cpu = ablation.one_rate_config(squad_cfg(), {"adamw": 1e-3}, [1.0, 100.0], [0, 1, 2, 3])
    assert cpu["max_stack"] == 4  # 8 runs, 2 processes


def test_a_tiny_study_end_to_end(monkeypatch):
    """The test profile on SVA's test data with a 4-step budget: every arm trains and is read."""
    from qkov_lib import profiles

    monkeypatch.setattr(profiles, "_dry_run", False)
    scfg = ablation.study_config("test", seeds=[0, 1], ratios=[1.0, 10.0])
    res = ablation.run_study(scfg)
    assert set(res.table["ablation"]) == {"readout", "budget", "evaluation"}
    assert set(res.table["claim"]) == {"R1", "R2"}
    assert set(res.sentences) == {"readout", "budget", "evaluation"}
    assert set(res.words["arm"]) == {"default", "readout", "budget", "evaluation"}
    assert res.arms["sva"]["readout"].models and not next(iter(res.arms["sva"]["readout"].models.values())).relative
    assert len(res.settle["sva"]) == 4


def test_the_cost_model_counts_every_arm_that_trains():
    from qkov_lib import cost

    parts = cost.work("protocol_choices", ablation.study_config("cpu"))
    assert [(p.name, p.runs, p.steps, p.probe) for p in parts] == [
        ("squad: default arm, adamw", 8, 800, "map:squad"), ("squad: readout arm, adamw", 8, 800, "map:squad"),
        ("squad: ov_init arm, adamw", 8, 800, "map:squad"), ("squad: budget arm, adamw", 8, 3200, "map:squad"),
        ("sva: default arm, adamw", 8, 2000, "map:sva"), ("sva: readout arm, adamw", 8, 2000, "map:sva"),
        ("sva: budget arm, adamw", 8, 8000, "map:sva")]
    full = cost.work("protocol_choices", ablation.study_config("full"))
    assert any(p.name.startswith("squad: tuning, adamw") for p in full)  # no rate given: tuned here
    assert any(p.name == "sva: natural prefixes" for p in full)


def test_the_default_arm_trains_the_rate_its_dataset_chapter_tuned_in_the_same_profile(tmp_path):
    import json

    scfg = ablation.study_config("cpu")
    assert scfg["rates_given"]["squad"] == {"adamw": 1e-3}
    write = lambda name, profile, selected: (tmp_path / f"{name}.json").write_text(  # noqa: E731
        json.dumps({"params": {"profile": profile}, "metrics": {"map_selected": selected}}))
    write("squad", "cpu", {"adamw": 0.01, "sgd": 0.3})
    write("sva", "test", {"adamw": 0.01})  # another profile's file: not this build's
    out = ablation.with_chapter_rates(scfg, tmp_path)
    assert out["rates_given"]["squad"] == {"adamw": 0.01} and out["rates_given"]["sva"] == {"adamw": 1e-3}
    assert out["rates_source"] == {"squad": "tuned by its chapter in this build (squad.json)", "sva": "given"}
    # the reader's own rates win; a file that chose no AdamW rate (no run trained) is passed over
    assert ablation.with_chapter_rates(scfg, tmp_path, keep_given=True)["rates_given"]["squad"] == {"adamw": 1e-3}
    write("squad", "cpu", {"sgd": 0.3})
    assert ablation.with_chapter_rates(scfg, tmp_path)["rates_source"]["squad"] == "given"
    # no file and no given rate: tuned here
    bare = dict(scfg, rates_given=None)
    assert ablation.with_chapter_rates(bare, tmp_path / "none")["rates_source"] == {"squad": "tuned here", "sva": "tuned here"}


def test_the_table_shows_beside_each_cell_how_many_runs_of_each_arm_trained():
    """The control for R1, read over every run: an arm where nothing trains keeps its accuracy."""
    from types import SimpleNamespace

    table = pd.DataFrame({"optimizer": ["adamw"] * 4, "ratio": [1.0, 1.0, 100.0, 100.0],
                          "trained": [True, True, True, False]})
    dead = table.assign(trained=False)
    got = ablation.trained_counts(SimpleNamespace(table=table))
    assert got == {("adamw", 1.0): "2/2", ("adamw", 100.0): "1/2"}
    rows = ablation.delta_rows("squad", "ov_init", cells([("adamw", 100.0, "R1", -0.1, 0.02, 2)]),
                               cells([("adamw", 100.0, "R1", 0.0, 0.001, 2)]),
                               (got, ablation.trained_counts(SimpleNamespace(table=dead))))
    assert rows[0]["trained (default)"] == "ratio 1: 2/2, ratio 100: 1/2"
    assert rows[0]["trained (ablated)"] == "ratio 1: 0/2, ratio 100: 0/2"
    assert ablation.delta_rows("squad", "ov_init", cells([("adamw", 100.0, "R1", -0.1, 0.02, 2)]),
                               cells([("adamw", 100.0, "R1", 0.0, 0.001, 2)]))[0]["trained (ablated)"] == "-"
