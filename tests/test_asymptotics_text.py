"""The theory pages' sentences (long-time laws, sharpness) and figure data in the library (qkov_lib.studies.asymptotics,
qkov_lib.studies.s2_phase): each sentence is the branch its comparison chose, filled with its
numbers; the phase portraits hold the field and trajectories they draw."""

import json
from collections import defaultdict

import numpy as np
import pandas as pd

from qkov_lib import dynamics as dy
from qkov_lib.studies import asymptotics as asym
from qkov_lib.studies import s2_phase
from qkov_lib.tooling.booktext import results_key
from qkov_lib.tooling.results import jsonable


def facts(**kw):
    """A facts dict whose every number reads 'N' and every comparison is False, but for ``kw``."""
    f = defaultdict(lambda: "N")
    f.update({k: False for k in ("q_literal", "expq_ok", "ov_ok", "A_tested", "t5_tested", "single_exact",
                                 "mix_approx", "cross_t_found", "cross_after_horizon", "fafo_weak", "s2p_top_settled",
                                 "s2p_settled", "s2p_has_B", "s2p_has_neither", "s2p_has_disagree")})
    f.update(A_err_worst="CACO", A_off="", fafo_toward="not tested", cross_loss_kind="never", cafo_last="no",
             rank_last="A > B", rank_full_random="A > B", s2p_deep_level="none")
    f.update(kw)
    return f


def test_t3_sentence_follows_the_literal_reading():
    assert asym.law_sentences(facts(q_literal=True))["t3_sentence"] == "The QK scalar does grow like log² t here."
    s = asym.law_sentences(facts(q_exp_max="0.31", thr_literal_tol="0.5", t_end="1e+100", q_end_CACO="6.2"))
    assert s["t3_sentence"].startswith("The QK scalar grows like log log t, not like log² t")
    assert s["q_sentence"] == ("The QK scalar q does **not** grow like log² t: its fitted exponent in log t is at most "
                               "0.31, more than 0.5 away from 2, and at t = 1e+100 it has only reached q = 6.2 (CACO); "
                               "the derivation gives q ≈ log log t.")


def test_line_and_ranking_sentences_pick_their_branch():
    s = asym.law_sentences(facts(single_exact=True, single_n="3", line_res_single="1e-9", thr_line_exact="1e-6"))
    assert s["t4_single_sentence"] == "For n = 3 the residual is 1e-9, within 1e-6: integration error, so the line is exact."
    s = asym.ranking_sentences(facts())
    assert s["s2_horizon_sentence"] == ("S2 does not depend on the horizon here: the asymptotic ranking and the one at "
                                        "the training horizon are both A > B.")
    s = asym.ranking_sentences(facts(rank_full_random="B > A", cross_t_found=True, cross_t="4e5"))
    assert s["s2_horizon_sentence"].startswith("S2 depends on the horizon. The asymptotic ranking is A > B; at the "
                                               "training horizon it is B > A.")
    assert s["fafo_lead"] == "In this task CACO is already ahead of FAFO at the training horizon."
    assert "FAFO was not run." == s["fafo_sentence"]  # no 'fafo_place' among the facts


def test_phase_sentences():
    s = s2_phase.phase_sentences(facts(s2p_has_B=True, s2p_B_region="at ratio 0.01", s2p_top_settled=True,
                                       s2p_top_last_change="0.1", s2p_settled=True, s2p_last_change="0.1"))
    assert s["s2p_B_sentence"] == "Summary B's pair (CAFO, CACO) is the top two only at ratio 0.01."
    assert s["s2p_settle_sentence"] == ("The top two last change at a training loss of 0.1. The whole ranking stops "
                                        "changing too (last change at loss 0.1).")
    assert s["s2p_neither_sentence"] == "At every cell the top two are one summary's pair or a tie."
    assert s["s2p_disagree_sentence"] == "Wherever the full model's second and third separate, its top two is the ODE's."


def test_phase_portraits_hold_the_field_they_draw():
    sizes = dy.Sizes(3, 2, (2,))
    p = asym.phase_portraits(sizes, {"eta_ov": 0.5}, [1.0], inits=[(0.5, 0.5)], n_grid=5)
    assert [(f["parameterization"], f["ratio"]) for f in p["field"]] == [(q, 1.0) for q in asym.PARAMS]
    f = p["field"][0]
    assert np.asarray(f["dw"]).shape == (5, 5) and f["w"][0] == 0.02 and f["q"][-1] == 10.0
    u, v = dy.flow_field(f["parameterization"], np.array([f["w"][2]]), np.array([f["q"][3]]), sizes, 0.5, 1.0)
    assert np.isclose(f["dw"][3][2], u[0], rtol=1e-3) and np.isclose(f["dq"][3][2], v[0], rtol=1e-3)  # 4 digits
    t = p["trajectories"]
    assert set(t["w0"]) == {0.5} and t.groupby("parameterization").size().nunique() == 1
    assert t.iloc[0][["w", "q"]].tolist() == [0.5, 0.5]  # starts at its init


def test_each_theory_page_saves_every_figure_key_it_names():
    class Phase:
        ode, cells = pd.DataFrame({"ratio": [1.0]}), pd.DataFrame({"ratio": [1.0]})

    runs = pd.DataFrame({c: [1.0] for c in asym.RUN_COLUMNS} | {"loss": [0.1], "distinct": [0.9]})
    lines = pd.DataFrame({c: [1.0] for c in asym.LINE_COLUMNS} | {"w": [0.5]})
    e = pd.DataFrame()
    law = asym.law_metrics(runs, e, e, lines, lines, {"field": [], "trajectories": e}, {}, [])
    ranking = asym.ranking_metrics(runs, e, e, e, Phase, {}, [])
    assert list(law["trajectories"]["ode"].columns) == list(asym.RUN_COLUMNS) == list(ranking["trajectories"]["ode"])
    assert list(law["lines"]["mixture"].columns) == list(asym.LINE_COLUMNS)
    for m, keys in ((law, ("metrics.trajectories.ode", "metrics.lines", "metrics.phase_portraits")),
                    (ranking, ("metrics.trajectories", "metrics.trajectories.full_model", "metrics.s2_phase"))):
        doc = {"metrics": json.loads(json.dumps(jsonable(m)))}
        for key in keys:
            assert results_key(doc, key), key
    assert "s2_phase" not in law and "lines" not in ranking  # each page saves its own figures' data only
