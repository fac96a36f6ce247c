"""What chapter 02 saves for its figures: the rescaling curve and the metrics dict
(qkov_lib.studies.reduction.rescaling_curve, reduction_metrics)."""

import json

import numpy as np
import pandas as pd
import pytest

from qkov_lib.studies import reduction as red
from qkov_lib.tooling.results import jsonable


def test_rescaling_curve_is_one_collapsed_and_two_sigma_factorized():
    c = red.rescaling_curve(sigma_max=2.0, n=5)
    assert c["sigma"].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert c["R_collapsed"].tolist() == [1.0] * 5
    assert c["R_factorized"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    # the two cross where sigma = 1/2: below it the factorized circuit is the slower
    assert c.loc[c["sigma"] == 0.5, "R_factorized"].item() == c.loc[c["sigma"] == 0.5, "R_collapsed"].item()


def test_reduction_metrics_keeps_what_the_figures_draw(monkeypatch):
    monkeypatch.setattr(red, "reduction_claims", lambda facts, verdicts: [{"id": "T1"}])
    ov = pd.DataFrame({c: [1.0, 2.0] for c in red.OVERLAY_COLUMNS} | {"distinct": [0.5, 0.6], "shift": [0.0, 0.0]})
    conv = pd.DataFrame({"eta_max": [0.2, 0.1], "max_err": [0.02, 0.01]})
    cons = pd.DataFrame({"eta_max": [0.2, 0.1], "drift_qk": [4e-3, 2e-3], "drift_ov": [2e-3, 1e-3]})
    empty = pd.DataFrame()
    m = red.reduction_metrics(empty, empty, ov, empty, conv, cons, empty, {"n_points": "4"}, {})
    assert list(m["overlay"].columns) == list(red.OVERLAY_COLUMNS)  # the extra columns are not saved
    assert m["convergence"]["step_convergence"] is conv and m["convergence"]["conservation_random"] is cons
    assert m["facts"] == {"n_points": "4"} and m["claims"] == [{"id": "T1"}]
    doc = json.loads(json.dumps(jsonable(m)))
    assert doc["convergence"]["conservation_random"][1] == {"eta_max": 0.1, "drift_qk": 2e-3, "drift_ov": 1e-3}
    assert np.allclose([r["R_factorized"] for r in doc["rescaling_curve"]][-1], 6.0)


@pytest.mark.parametrize("key", ["metrics.overlay", "metrics.rescaling_curve", "metrics.convergence"])
def test_the_figure_keys_are_in_the_metrics(monkeypatch, key):
    from qkov_lib.tooling.booktext import results_key

    monkeypatch.setattr(red, "reduction_claims", lambda facts, verdicts: [])
    ov = pd.DataFrame({c: [1.0] for c in red.OVERLAY_COLUMNS})
    e = pd.DataFrame()
    assert results_key({"metrics": jsonable(red.reduction_metrics(e, e, ov, e, e, e, e, {}, {}))}, key)
