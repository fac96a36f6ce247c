"""The sweep and robustness pages' sentences, closing numbers and figure data in the library
(qkov_lib.studies.synthetic_sweeps.sweep_sentences, robustness_sentences, speed_facts, readings_points,
sweep_metrics, robustness_metrics)."""

import json
from collections import defaultdict

import numpy as np
import pandas as pd

from qkov_lib import claims as C
from qkov_lib.studies import synthetic_sweeps as sw
from qkov_lib.tooling.booktext import results_key
from qkov_lib.tooling.results import jsonable


def facts(**kw):
    """A facts dict whose every number reads 'N' and every comparison is False, but for ``kw``."""
    f = defaultdict(lambda: "N")
    f.update({k: False for k in ("s1_tested", "order_as_predicted", "check_agrees", "check_tested", "rob_tested")})
    f.update(fafo_toward="not tested", n_param="4", s2_pair_kind="A", top2_shared="FA", n_ratios_run=4,
             first_unstable="none", verdict_R3_synthetic="reproduced")
    f.update(kw)
    return f


def test_sentences_pick_their_branch():
    s = sw.sweep_sentences(facts(n_param="1"))
    assert s["s2_sentence"] == "Only 1 of the four parameterizations was run, so S2 is not tested."
    assert s["stability_sentence"] == "No run's training loss rose: gradient descent is stable at every ratio of the grid."
    assert s["check_sentence"] == ""  # no check was run
    s = sw.sweep_sentences(facts(top2_eq="(FACO, CACO)", matched_steps="500", top2_eq_matched="(FACO, CACO)"))
    assert s["s2_sentence"] == ("The two sharpest parameterizations at equal rates are (FACO, CACO) after 500 steps and "
                                "(FACO, CACO) at matched loss; this is the first summary's pair (collapsed OV), not "
                                "the second's.")
    s = sw.sweep_sentences(facts(n_ratios_run=1, r_lo="1"))
    assert s["s3_sentence"] == "Only ratio 1 was run, so the effect of the ratio (S3) is not tested."
    assert s["fail_sentence"] == "" and "rob_sentence" not in s  # the robustness page's
    assert sw.robustness_sentences(facts())["rob_sentence"].startswith("The robustness variants were not run")
    s = sw.robustness_sentences(facts(rob_tested=True, rob_main_rank="FACO > CACO", rob_same_rank="2", rob_n="3"))
    assert "main grid after its fixed steps (FACO > CACO) reappears in 2 of 3 variants" in s["rob_sentence"]


def test_speed_facts_formats_the_measurement():
    f = sw.speed_facts({"speedup": 12.345, "loop_model_steps_per_s": 99.6, "batched_model_steps_per_s": 1230.2,
                        "max_param_diff": 3.2e-7, "n_batched": 16}, 61.4, "test")
    assert f == {"speedup": "12.3x", "speed_loop": "100", "speed_batched": "1230", "speed_diff": "3.2e-07",
                 "speed_n": "16", "wall_time": "61 s", "profile_name": "test"}


def test_readings_points_keep_the_drawn_numbers():
    r = [C.Reading("FAFO, ratio 10 vs 1, loss 0.1", C.Change(0.4, 0.1, 3), "holds", 0.2, None),
         C.Reading("CACO, ratio 10 vs 1, loss 0.1", None, "not tested", float("nan"), None)]
    t = sw.readings_points({"S3-gd": r[:1], "S3-adam": r}, ("S3-gd", "S3-adam", "S3-none"))
    assert t["key"].tolist() == ["S3-gd", "S3-adam", "S3-adam"]
    assert t["change"].tolist()[:2] == [0.4, 0.4] and np.isnan(t["change"].iloc[2])  # not read: null in the file
    assert t["half_width"].iloc[0] == 0.2 and np.isnan(t["half_width"].iloc[2])


def test_sweep_metrics_keep_the_tables_and_the_figure_keys(monkeypatch):
    monkeypatch.setattr(sw, "claims", lambda facts, verdicts: [{"id": "S3"}])
    runs = pd.DataFrame({"parameterization": ["FAFO"], "ratio": [1.0], "seed": [0], "diverged": [0], "loss": [0.1],
                         "AC@0.9": [0.5], "attn_relevant": [0.7]})
    hist = pd.DataFrame({"parameterization": ["FAFO"], "ratio": [1.0], "seed": [0], "step": [10], "loss": [0.3],
                         "attn_relevant": [0.6], "ov": [1.0]})
    tables = {"runs": runs, "summary": runs, "matched_runs": runs.assign(stop_step=[40])}
    m = sw.sweep_metrics(tables, hist, {("FAFO", 1.0): np.eye(2)}, {("FAFO", 0.1): np.eye(2)}, {"x": "1"}, {})
    assert m["runs"] is runs and m["claims"] == [{"id": "S3"}]  # the tables the sweep tooling reads stay as they are
    assert list(m["history"].columns) == ["parameterization", "ratio", "seed", "step", "attn_relevant", "loss"]
    assert "stop_step" in m["decoupling"]["matched_loss"] and "attn_relevant" not in m["decoupling"]["fixed_steps"]
    doc = {"metrics": json.loads(json.dumps(jsonable(m)))}
    assert doc["metrics"]["dtap"]["FAFO / 1"] == [[1.0, 0.0], [0.0, 1.0]]
    for key in ("metrics.dtap", "metrics.history", "metrics.decoupling", "metrics.ladder_dtap"):
        assert results_key(doc, key), key
    monkeypatch.setattr(sw, "robustness_claims", lambda facts, verdicts: [{"id": "S3-adam"}])
    r = sw.robustness_metrics({"robustness": runs}, {"S3-adam": []}, {}, {})
    assert r["robustness"] is runs and r["claims"] == [{"id": "S3-adam"}]
    assert results_key({"metrics": json.loads(json.dumps(jsonable(r)))}, "metrics.adam")


def test_grid_glue_quotes_the_grid():
    cfg = {"ratios": [0.1, 1, 10.0], "seeds": [0, 1, 2], "loss_ladder": [0.3, 0.1], "matched_loss": 0.05}
    g = sw.grid_glue(cfg)
    assert g["ratios_list"] == "{0.1, 1, 10}" and g["n_seeds_cfg"] == "3" and g["r_eq_ladder"] == "1"
    assert g["ladder_levels"] == "0.3, 0.1, 0.05"  # the ladder and the matched loss, highest first
