"""Checks of the symmetric reduction (qkov_lib.dynamics) against the full model and against itself.

Every derivation step has a test that fails if it is wrong: the reduced loss and gradients
against autograd, the rescaled ODE against factor-level autograd, the integrated ODE against
full-model gradient descent, the invariants, the straight-line coordinates and the asymptotic
laws against long integrations.
"""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from qkov_lib import dynamics as dy
from qkov_lib.data import synthetic as syn
from qkov_lib.studies import asymptotics
from qkov_lib.studies import reduction as red
from qkov_lib.models import PARAMETERIZATIONS
from qkov_lib.profiles import resolve

TASK = syn.SyntheticTask(n_classes=3, n_common_vocab=2, n_common=(2, 4))
TASK_B = syn.SyntheticTask(n_classes=4, n_common_vocab=3, n_common=(3,))
STATES = [(0.3, 0.2), (2.5, 1.3), (-0.8, 0.7), (1.7, -0.4)]


@pytest.mark.parametrize("task", [TASK, TASK_B])
@pytest.mark.parametrize("w, q", STATES)
def test_reduced_loss_and_gradients_equal_full_autograd(task, w, q):
    sizes = dy.Sizes.from_task(task)
    g = dy.full_model_gradients(task, w, q)
    assert float(g["loss"]) == pytest.approx(float(dy.reduced_loss(w, q, sizes)), abs=1e-13)
    G_QK, G_OV = dy.predicted_gradients(w, q, task)
    # entrywise: components off the symmetric subspace must vanish too
    assert float((g["W_QK"] - G_QK).abs().max()) < 1e-13
    assert float((g["W_OV"] - G_OV).abs().max()) < 1e-13
    assert float(g["W_QK"].abs().max()) > 1e-4 and float(g["W_OV"].abs().max()) > 1e-4  # not trivially zero


def test_reduced_grad_matches_finite_differences():
    sizes = dy.Sizes(4, 3, (2, 4, 8))
    h = 1e-6
    for w, q in STATES:
        gw, gq = dy.reduced_grad(w, q, sizes)
        fw = (dy.reduced_loss(w + h, q, sizes) - dy.reduced_loss(w - h, q, sizes)) / (2 * h)
        fq = (dy.reduced_loss(w, q + h, sizes) - dy.reduced_loss(w, q - h, sizes)) / (2 * h)
        assert float(gw) == pytest.approx(float(fw), abs=1e-8)
        assert float(gq) == pytest.approx(float(fq), abs=1e-8)


@pytest.mark.parametrize("name", PARAMETERIZATIONS)
def test_rescaled_ode_equals_factor_level_autograd(name):
    """T2: gradient flow on the balanced factors moves (w, q) exactly as the rescaled ODE says."""
    sizes = dy.Sizes.from_task(TASK_B)
    for w, q in STATES:
        fw, fq = dy.full_model_velocity(TASK_B, w, q, name, eta_ov=0.7, eta_qk=2.1)
        rw, rq = dy.velocity(name, w, q, sizes, eta_ov=0.7, eta_qk=2.1)
        assert fw == pytest.approx(float(rw), rel=1e-10, abs=1e-15)
        assert fq == pytest.approx(float(rq), rel=1e-10, abs=1e-15)


def test_rate_factors_are_twice_the_singular_values():
    sizes = dy.Sizes.from_task(TASK_B)
    w, q = 1.3, -0.6
    W_QK, W_OV = dy.symmetric_effective(w, q, TASK_B)
    s_ov, s_qk = dy.singular_values(w, q, sizes)
    sv_qk = torch.linalg.svdvals(W_QK)
    sv_ov = torch.linalg.svdvals(W_OV)
    assert float(sv_qk[0]) == pytest.approx(float(s_qk)) and float(sv_qk[1]) < 1e-12  # rank one
    np.testing.assert_allclose(sv_ov[: TASK_B.n_classes - 1].numpy(), float(s_ov))  # K-1 equal values
    assert float(s_ov) == pytest.approx(abs(w))  # T2: sigma_OV is the OV scalar itself
    r_ov, r_qk = dy.rate_factors("FAFO", w, q, sizes)
    assert (float(r_ov), float(r_qk)) == pytest.approx((2 * abs(w), 2 * float(s_qk)))
    assert tuple(float(x) for x in dy.rate_factors("CACO", w, q, sizes)) == (1.0, 1.0)  # exact: ones by definition


def test_symmetric_state_round_trip_and_invisible_shift():
    w, q = 1.1, 0.4
    W_QK, W_OV = dy.symmetric_effective(w, q, TASK_B)
    assert dy.scalars_of(W_QK, W_OV, TASK_B) == pytest.approx((w, q))
    keys = TASK_B.distinct_ids + TASK_B.common_ids
    assert float(W_QK[keys, TASK_B.query_id].sum()) == pytest.approx(0.0, abs=1e-15)  # zero shift
    with pytest.raises(ValueError, match="one-hot"):
        dy.symmetric_effective(w, q, syn.SyntheticTask(embedding="gaussian", d_model=8))


def _overlay(name, eta_max=0.1, ratio=3.0, steps=150):
    eta_ov = red.eta_ov_for(eta_max, ratio)
    return red.overlay(TASK, name, 0.5, 0.5, eta_ov, ratio, steps, n_logs=15)


@pytest.mark.parametrize("name", PARAMETERIZATIONS)
def test_ode_overlays_full_model_gd(name):
    """The ODE tracks full-model GD within the bound, stays on the symmetric subspace, and the
    bound is sharp enough to reject a factor of 2 in either right-hand side."""
    f = _overlay(name)
    err = float(np.maximum(f["err_w"], f["err_q"]).max())
    assert err < 0.05
    assert float(f["off_subspace"].max()) < 1e-12 and float(f["shift"].abs().max()) < 1e-12
    assert f["ov"].iloc[-1] > 1.0 and f["qk"].iloc[-1] > 1.0  # the run went somewhere
    pert = red.perturbed_discrepancy(f, TASK, 0.5, 0.5, 0.1, factor=2.0)
    assert (pert["max_err"] > 0.05).all()


def test_gd_discrepancy_is_first_order_in_the_step():
    cfg = resolve(red.PROFILES_REDUCTION, "test", steps=100, etas_convergence=[0.2, 0.1])
    conv = red.step_convergence(cfg, "FAFO", ratio=3.0)
    e1, e2 = conv["max_err"]
    assert 1.7 < e1 / e2 < 2.3


def test_invariants_of_factorized_training():
    cfg = resolve(red.PROFILES_REDUCTION, "test", steps=100, etas_convergence=[0.2, 0.1])
    f = _overlay("FAFO", steps=60)
    assert float(f[["drift_qk", "drift_ov"]].max().max()) < 1e-12  # symmetric subspace: exact even for GD
    cons = red.conservation_random(cfg, "FAFO")
    d = np.maximum(cons["drift_qk"], cons["drift_ov"]).to_numpy()
    assert d[0] > 1e-5  # off the subspace GD does move them ...
    assert 1.7 < d[0] / d[1] < 2.3  # ... by O(eta) over a fixed horizon: conserved by the flow


@pytest.mark.parametrize("name", PARAMETERIZATIONS)
def test_line_coordinates_exact_for_single_n(name):
    """T4: for a single count n, (X(w), Y(q)) moves on a straight line of slope ratio * n."""
    sizes = dy.Sizes(4, 3, (5,))
    for ratio in (1.0, 7.0):
        f = dy.integrate(name, 0.2, 0.3, sizes, eta_ov=0.5, ratio=ratio, t_max=1e8, n_points=60)
        X, Y = dy.line_coordinates(name, f["w"], f["q"], sizes)
        res = Y - Y[0] - dy.line_slope(ratio, sizes) * (X - X[0])
        assert np.abs(res).max() / (Y.max() - Y.min()) < 1e-7
    # with a mixture over n the line is only asymptotic
    mix = dy.Sizes(4, 3, (2, 12))
    f = dy.integrate(name, 0.2, 0.3, mix, eta_ov=0.5, ratio=1.0, t_max=1e8, n_points=60)
    X, Y = dy.line_coordinates(name, f["w"], f["q"], mix)
    res = Y - Y[0] - dy.line_slope(1.0, mix) * (X - X[0])
    assert np.abs(res).max() / (Y.max() - Y.min()) > 1e-4


@pytest.mark.parametrize("name", PARAMETERIZATIONS)
def test_asymptotic_laws_match_long_integrations(name):
    """T3/T5: fitted exponents and constants on t in [1e30, 1e100] agree with the derived laws."""
    sizes = dy.Sizes(4, 3, (2, 4, 8, 12))
    eta, ratio = 0.5, 3.0
    f = dy.integrate(name, 0.1, 0.1, sizes, eta, ratio, t_max=1e100, n_points=150)
    law = dy.asymptotic_law(name, sizes, eta, ratio)
    t = f["t"].to_numpy()
    s = np.log(np.maximum(t, 2.0))
    a, b = dy.fit_linear_in_log(t, f["w"].to_numpy() - law["ov_loglog"] * np.log(s), 1e30, 1e100)
    assert a == pytest.approx(1.0, abs=0.01) and b == pytest.approx(law["ov_offset"], abs=0.1)
    Z = dy.sharpness_coordinate(name, f["q"].to_numpy())
    beta, _ = dy.fit_power(t, Z, 1e30, 1e100)
    A, _ = dy.fit_constant(t, Z, law["qk_exponent"], 1e30, 1e100)
    assert beta == pytest.approx(law["qk_exponent"], abs=0.03)
    assert A == pytest.approx(law["qk_const"], rel=0.03)
    # T3 wording: q itself is far from a power of log t
    assert dy.fit_power(t, f["q"].to_numpy(), 1e30, 1e100)[0] < 0.3


def test_constants_scale_with_ratio_and_tilt():
    sizes = dy.Sizes(4, 3, (2, 4, 8, 12))
    for name in ("CACO", "FACO", "FAFO"):
        assert dy.asymptotic_law(name, sizes, 0.5, 10.0)["qk_const"] == pytest.approx(
            10 * dy.asymptotic_law(name, sizes, 0.5, 1.0)["qk_const"])
    single = dy.Sizes(4, 3, (6,))
    assert dy.tilted_count(0.3, single) == pytest.approx(6.0)
    assert dy.tilted_count(0.0, sizes) == pytest.approx(sizes.n_mean)
    assert dy.tilted_count(0.2, sizes) > sizes.n_mean
    law = dy.asymptotic_law("CAFO", sizes, 0.5, 1.0)  # fixed point A = a * n*(1/A)
    assert law["qk_const"] == pytest.approx(law["qk_const"] / law["n_star"] * dy.tilted_count(1 / law["qk_const"], sizes))
    assert dy.asymptotic_law("CAFO", single, 0.5, 1.0)["n_star"] == 6.0  # exact: the mean of the single count 6


def test_integrate_is_deterministic_and_starts_at_init():
    sizes = dy.Sizes.from_task(TASK)
    a = dy.integrate("FAFO", 0.3, 0.2, sizes, 0.5, 2.0, t_max=1e4, n_points=20)
    b = dy.integrate("FAFO", 0.3, 0.2, sizes, 0.5, 2.0, t_max=1e4, n_points=20)
    pd.testing.assert_frame_equal(a, b)  # exact: the same call twice
    assert (a["w"].iloc[0], a["q"].iloc[0]) == (0.3, 0.2)  # exact: the initial state is stored as given
    assert a["loss"].is_monotonic_decreasing


def test_crossover_and_verdict_helpers():
    t = np.array([1.0, 10.0, 100.0, 1000.0])
    runs = pd.DataFrame({"parameterization": ["A"] * 4 + ["B"] * 4, "ratio": 1.0, "t": np.tile(t, 2),
                         "loss": np.tile([1.0, 0.1, 0.01, 0.001], 2),
                         "common": [0.5, 0.2, 0.1, 0.05, 0.6, 0.3, 0.05, 0.01]})
    assert asymptotics.crossover(runs, "A", "B") == 100.0  # exact: a grid value of t, not interpolated
    assert math.isnan(asymptotics.crossover(runs, "B", "A"))
    assert asymptotics.top2_verdict("FACO > CACO > FAFO > CAFO")[1].startswith("the first summary")
    assert asymptotics.top2_verdict("CACO > CAFO > FAFO > FACO")[1].startswith("the second summary")
    assert asymptotics.top2_verdict("FACO > FAFO > CACO > CAFO")[1] == "neither summary"


@pytest.mark.parametrize("kw, err, msg", [
    (dict(parameterization="XAXO"), ValueError, "unknown parameterization"),
    (dict(t_max=-1.0), ValueError, "t_max"),
    (dict(eta_ov=0.0), ValueError, "eta_ov"),
    (dict(ratio=float("nan")), ValueError, "ratio"),
    (dict(t_eval=[5.0, 1.0]), ValueError, "t_eval"),
])
def test_integrate_bad_input(kw, err, msg):
    args = dict(parameterization="CACO", w0=0.1, q0=0.1, sizes=dy.Sizes.from_task(TASK), t_max=10.0)
    args.update(kw)
    with pytest.raises(err, match=msg):
        dy.integrate(**args)


def test_bad_sizes_and_coordinates():
    with pytest.raises(ValueError, match="n_classes"):
        dy.Sizes(1, 3, (2,))
    with pytest.raises(ValueError, match="n_common_vocab"):
        dy.Sizes(3, 0, (2,))
    with pytest.raises(ValueError, match="n_common"):
        dy.Sizes(3, 2, ())
    with pytest.raises(ValueError, match="q > 0"):
        dy.line_coordinates("FACO", 1.0, -0.5, dy.Sizes(3, 2, (2,)))
    with pytest.raises(ValueError, match="at least 3 points"):
        dy.fit_power(np.array([1e3, 1e4]), np.array([1.0, 2.0]), 1e2, 1e5)


def test_theory_profiles_resolve():
    for table in (red.PROFILES_REDUCTION, asymptotics.PROFILES_ASYMPTOTICS):
        assert set(table) == {"test", "cpu", "full"}
        assert all(set(table[p]) == set(table["test"]) for p in table)
        assert resolve(table, "test")["profile"] == "test"
        # the checks' tolerances are the claims module's thresholds, not per-profile settings
        assert not {k for k in table["test"] if k.startswith("tol_")}
    with pytest.raises(TypeError, match="ratios"):
        resolve(asymptotics.PROFILES_ASYMPTOTICS, "test", ratios=3)
