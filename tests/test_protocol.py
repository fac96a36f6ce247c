"""The base rate x ratio protocol: grid, trained-run filter, base-rate selection on validation,
paired changes, verdicts per map column and at the tuned base rate."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from qkov_lib import claims
from qkov_lib.experiments import protocol as P
from qkov_lib.models import TokenModel
from qkov_lib.training import TrainConfig, evaluate


def test_grid_needs_ratio_one_and_base_rates():
    cells = P.grid(["adamw", "sgd"], {"adamw": [1e-3, 3e-3], "sgd": [0.1]}, [1, 10], [0, 1])
    assert len(cells) == (2 + 1) * 2 * 2 and cells[0] == P.Cell("adamw", 1e-3, 1.0, 0)
    with pytest.raises(ValueError, match="must include 1"):
        P.grid(["adamw"], {"adamw": [1e-3]}, [10], [0])
    with pytest.raises(ValueError, match="no base rates"):
        P.grid(["sgd"], {"adamw": [1e-3]}, [1], [0])


def _table(d_acc=0.0, d_attn=0.1, fail_seed=None):
    rows = []
    for opt, etas in (("adamw", (1e-3, 1e-2)), ("sgd", (0.1,))):
        for eta in etas:
            for r in (1.0, 10.0):
                for s in (0, 1, 2):
                    up = r > 1
                    rows.append({"optimizer": opt, "eta_ov": eta, "ratio": r, "seed": s, "diverged": False,
                                 "val_accuracy": 0.9 - (0.5 if (fail_seed == s and up) else 0.0) + 0.01 * (eta == 1e-3),
                                 "accuracy": 0.8 + d_acc * up + 0.001 * s, "macro_f1": 0.7 + d_acc * up,
                                 "attn_relevant": 0.3 + d_attn * up + 0.001 * s,
                                 "AC@0.5": 0.2 + 2 * d_attn * up + 0.002 * s, "ACMC@0.5": 0.2 + 2 * d_attn * up,
                                 "sufficiency": 0.3 - d_attn * up})
    return pd.DataFrame(rows)


def test_trained_filter_and_selection_use_validation_only():
    t = _table(fail_seed=1)
    t["trained"] = P.trained(t, chance=0.5)
    assert int((~t["trained"]).sum()) == 3  # seed 1 at ratio 10 in each column
    assert P.select_base_rates(t) == {"adamw": 1e-3, "sgd": 0.1}
    f = P.failures(t)
    assert f.loc[(f.optimizer == "adamw") & (f.eta_ov == 1e-3) & (f.ratio == 10.0), "failed"].item() == 1
    ph = P.phase_table(t)
    row = ph[(ph.optimizer == "adamw") & (ph.eta_ov == 1e-3) & (ph.ratio == 10.0)].iloc[0]
    assert row["trained_runs"] == 2 and row["failure_rate"] == pytest.approx(1 / 3)
    assert row["d_attn_relevant"] == pytest.approx(0.1) and bool(row["d_attn_relevant_sig"])


def test_region_verdicts_flip_with_the_effect():
    for d_attn, want in ((0.1, "reproduced"), (-0.1, "not reproduced")):
        t = _table(d_attn=d_attn)
        t["trained"] = P.trained(t, chance=0.5)
        cells = P.cell_verdicts(P.phase_table(t))
        out = P.region_verdicts(cells, P.select_base_rates(t))
        assert out["R3"][0].verdict == want and out["R2"][0].verdict == want
        assert out["R1"][0].verdict == "reproduced"
    assert "adamw: eta_ov 0.001, eta_ov 0.01" in P.region_verdicts(
        P.cell_verdicts(P.phase_table(t.assign(trained=True))), {"adamw": 1e-3})["R1"][1]


def test_equal_validation_accuracy_is_broken_by_validation_loss():
    t = pd.DataFrame({"optimizer": "adamw", "eta_ov": [1e-4, 3e-4, 1e-3], "ratio": 1.0, "seed": 0, "trained": True,
                      "val_accuracy": [0.9, 0.97, 0.97], "val_loss": [0.2, 0.074, 0.070]})
    assert P.select_base_rates(t) == {"adamw": 1e-3}
    assert P.select_base_rates(t.assign(val_loss=[0.2, 0.07, 0.07])) == {"adamw": 3e-4}  # then the smaller rate
    assert P.select_base_rates(t.drop(columns="val_loss")) == {"adamw": 3e-4}


def test_r2_reads_the_highest_ratio_that_trained():
    """Ratio 100 fails in every seed: R2 is judged at ratio 10 (not 'not tested'), and the
    failures stay visible in the failure counts."""
    rows = []
    for r in (1.0, 10.0, 100.0):
        for s in (0, 1, 2):
            up = r > 1
            rows.append({"optimizer": "sgd", "eta_ov": 0.3, "ratio": r, "seed": s, "diverged": r == 100.0,
                         "val_accuracy": 0.9, "accuracy": 0.8, "macro_f1": 0.8, "attn_relevant": 0.3 + 0.2 * up,
                         "AC@0.5": 0.2 + 0.2 * up + 0.001 * s, "ACMC@0.5": 0.2 + 0.2 * up,
                         "sufficiency": 0.3 - 0.1 * up})
    t = pd.DataFrame(rows)
    t["trained"] = P.trained(t, chance=0.5)
    cells = P.cell_verdicts(P.phase_table(t)).set_index("claim")
    assert cells.loc["R2", "verdict"] == "reproduced"
    f = P.failures(t).set_index("ratio")
    assert f.loc[100.0, "failed"] == 3 and f.loc[10.0, "failed"] == 0


def test_one_ratio_is_not_tested():
    t = _table()
    t = t[t.ratio == 1.0].assign(trained=True)
    out = P.region_verdicts(P.cell_verdicts(P.phase_table(t)), P.select_base_rates(t))
    assert {k: v.verdict for k, (v, _) in out.items()} == {"R1": "not tested", "R2": "not tested", "R3": "not tested"}


def test_train_grid_on_a_tiny_task_learns_and_is_deterministic():
    train, val, test = P.synthetic_demo(n=300)

    def make_model(seed):
        return TokenModel(12, 8, 4, 8, parameterization="CACO", generator=torch.Generator().manual_seed(seed))

    def config(c):
        return TrainConfig(optimizer=c.optimizer, eta_ov=c.eta_ov, ratio=c.ratio, steps=60, batch_size=64, seed=c.seed,
                           n_logs=4, progress=False, patience=5)

    def measure(model, batch):
        return {k: v for k, v in evaluate(model, batch).items() if k in ("accuracy", "attn_relevant", "AC@0.5")}

    cells = P.grid(["adamw"], {"adamw": [0.05]}, [1, 10], [0])
    a = P.train_grid(cells, make_model, train, val, test, config, measure)
    b = P.train_grid(cells, make_model, train, val, test, config, measure)
    pd.testing.assert_frame_equal(a, b)
    assert (a["val_accuracy"] > 0.5).all() and not a["diverged"].any()
    fig = P.plot_phase(P.phase_table(a.assign(trained=True), ["accuracy", "attn_relevant"]), ["accuracy"],
                       {"adamw": 0.05})
    assert fig.get_facecolor()[:3] == (1.0, 1.0, 1.0)
