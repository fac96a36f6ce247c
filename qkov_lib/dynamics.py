"""Gradient-flow dynamics of the symmetric reduction (claims T1-T5 of :data:`qkov_lib.claims.CLAIMS`).

On the one-hot distinct/common-token task (query not a key, ``n`` common tokens drawn
uniformly from the set ``n_common``) a *symmetric* state of the model is described by two
scalars:

* ``w``, the OV margin: the distinct token of class ``k`` raises logit ``k`` by ``w`` over the
  others (``W_OV`` restricted to the distinct columns is ``w (I - 11^T/K)``);
* ``q``, the QK advantage: distinct tokens score ``q`` more than common ones for the query
  (``W_QK e_query = q v`` with ``v = M/(K+M)`` on distinct and ``-K/(K+M)`` on common tokens,
  so the shift ``sum_keys u`` that the softmax cannot see is zero).

With ``alpha_n(q) = 1 / (1 + n e^{-q})`` the attention on the distinct token of a sequence with
``n`` common tokens, the population loss is

    L(w, q) = E_n log(1 + (K - 1) exp(-w alpha_n(q))).

Gradient flow on the full matrices keeps the symmetric subspace invariant and gives

    dw/dt = -eta_OV R_OV(w) kappa_OV dL/dw,   dq/dt = -eta_QK R_QK(q) kappa_QK dL/dq,

with ``kappa_OV = 1/(K-1)``, ``kappa_QK = 1/K + 1/M`` (inverse squared Frobenius norms of the
directions ``dW/dw``, ``dW/dq``) and the rescaling ``R = 1`` for a collapsed circuit and
``R = 2 sigma`` for a balanced factorized one, ``sigma`` being the singular value of the
effective matrix: ``sigma_OV = |w|`` and ``sigma_QK = |q| / sqrt(kappa_QK)`` (claim T2).
Time ``t`` is measured in gradient-descent steps (learning rates inside the ODE).

All reduced functions are NumPy and broadcast over ``w`` and ``q``; the full-matrix helpers
(``symmetric_effective``, ``full_model_velocity``) are torch float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy.integrate import solve_ivp
from scipy.special import expi, expit

from qkov_lib.models import PARAMETERIZATIONS, parse_parameterization

ArrayLike = float | np.ndarray


# --------------------------------------------------------------------------------------
# sizes of the task
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """What the reduced dynamics needs from a task: ``K`` classes, ``M`` common-vocabulary
    tokens and the set ``n_common`` of common-token counts (drawn uniformly)."""

    n_classes: int
    n_common_vocab: int
    n_common: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.n_classes, int) or self.n_classes < 2:
            raise ValueError(f"n_classes (K) must be an integer >= 2, got {self.n_classes!r}")
        if not isinstance(self.n_common_vocab, int) or self.n_common_vocab < 1:
            raise ValueError(f"n_common_vocab (M) must be an integer >= 1, got {self.n_common_vocab!r}")
        counts = tuple(sorted(set(int(n) for n in self.n_common)))
        if not counts or counts[0] < 1:
            raise ValueError(f"n_common must be a non-empty set of counts >= 1, got {self.n_common!r}")
        object.__setattr__(self, "n_common", counts)

    @classmethod
    def from_task(cls, task) -> "Sizes":
        """The sizes of a :class:`qkov_lib.data.synthetic.SyntheticTask`."""
        return cls(task.n_classes, task.n_common_vocab, tuple(task.n_common))

    @property
    def counts(self) -> np.ndarray:
        """The common-token counts ``n`` as a float array (one per mixture component)."""
        return np.asarray(self.n_common, dtype=float)

    @property
    def n_mean(self) -> float:
        """``E[n]``, the mean number of common tokens per sequence."""
        return float(self.counts.mean())

    @property
    def kappa_ov(self) -> float:
        """``1/(K-1) = 1/||dW_OV/dw||_F^2``."""
        return 1.0 / (self.n_classes - 1)

    @property
    def kappa_qk(self) -> float:
        """``1/K + 1/M = 1/||dW_QK/dq||_F^2``."""
        return 1.0 / self.n_classes + 1.0 / self.n_common_vocab


def _wq(w: ArrayLike, q: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    w, q = np.asarray(w, dtype=float), np.asarray(q, dtype=float)
    if w.shape != q.shape:
        w, q = np.broadcast_arrays(w, q)
    return w[..., None], q[..., None]  # trailing axis: mixture over n


# --------------------------------------------------------------------------------------
# reduced loss and gradients (T1)
# --------------------------------------------------------------------------------------
def attention_distinct(q: ArrayLike, n: ArrayLike) -> np.ndarray:
    """``alpha_n(q) = 1/(1 + n e^{-q})``: attention on the distinct token among ``n`` commons."""
    return expit(np.asarray(q, dtype=float) - np.log(np.asarray(n, dtype=float)))


def common_mass(q: ArrayLike, sizes: Sizes) -> np.ndarray:
    """``E_n[1 - alpha_n(q)]``: expected attention mass left on the common tokens."""
    _, qq = _wq(0.0, q)
    return expit(np.log(sizes.counts) - qq).mean(-1)


def distinct_mass(q: ArrayLike, sizes: Sizes) -> np.ndarray:
    """``E_n[alpha_n(q)]``: expected attention on the distinct token."""
    return 1.0 - common_mass(q, sizes)


def reduced_loss(w: ArrayLike, q: ArrayLike, sizes: Sizes) -> np.ndarray:
    """Population cross-entropy ``E_n log(1 + (K-1) exp(-w alpha_n(q)))`` (nats)."""
    ww, qq = _wq(w, q)
    a = attention_distinct(qq, sizes.counts)
    return np.logaddexp(0.0, math.log(sizes.n_classes - 1) - ww * a).mean(-1)


def reduced_grad(w: ArrayLike, q: ArrayLike, sizes: Sizes) -> tuple[np.ndarray, np.ndarray]:
    """``(dL/dw, dL/dq)`` of :func:`reduced_loss`:
    ``dL/dw = -E[alpha rho]`` and ``dL/dq = -E[w rho alpha (1-alpha)]`` with
    ``rho_n = 1 - p_n(y)``, the probability mass the model puts on wrong classes."""
    ww, qq = _wq(w, q)
    log_n = np.log(sizes.counts)
    a = expit(qq - log_n)  # alpha_n
    one_minus_a = expit(log_n - qq)
    rho = expit(math.log(sizes.n_classes - 1) - ww * a)
    return -(a * rho).mean(-1), -(ww * rho * a * one_minus_a).mean(-1)


def confidence(w: ArrayLike, q: ArrayLike, sizes: Sizes) -> np.ndarray:
    """``E_n p_n(y)``: expected probability of the correct class."""
    ww, qq = _wq(w, q)
    a = attention_distinct(qq, sizes.counts)
    return expit(ww * a - math.log(sizes.n_classes - 1)).mean(-1)


# --------------------------------------------------------------------------------------
# implicit rescaling (T2) and the four ODEs
# --------------------------------------------------------------------------------------
def singular_values(w: ArrayLike, q: ArrayLike, sizes: Sizes) -> tuple[np.ndarray, np.ndarray]:
    """``(sigma_OV, sigma_QK) = (|w|, |q| / sqrt(kappa_QK))``: the (repeated) nonzero singular
    value of the effective OV matrix and the single one of the effective QK matrix."""
    return np.abs(np.asarray(w, dtype=float)), np.abs(np.asarray(q, dtype=float)) / math.sqrt(sizes.kappa_qk)


def rate_factors(parameterization: str, w: ArrayLike, q: ArrayLike, sizes: Sizes) -> tuple[np.ndarray, np.ndarray]:
    """``(R_OV, R_QK)``: the state-dependent factors that multiply the nominal learning rates in
    collapsed space -- 1 for a collapsed circuit, ``2 sigma`` for a balanced factorized one."""
    p = parse_parameterization(parameterization)
    s_ov, s_qk = singular_values(w, q, sizes)
    r_ov = 2.0 * s_ov if p.ov_factorized else np.ones_like(s_ov)
    r_qk = 2.0 * s_qk if p.qk_factorized else np.ones_like(s_qk)
    return r_ov, r_qk


def velocity(parameterization: str, w: ArrayLike, q: ArrayLike, sizes: Sizes,
             eta_ov: float = 1.0, eta_qk: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(dw/dt, dq/dt)`` of population gradient flow in the given parameterization, ``t`` in
    gradient-descent steps: ``dw/dt = -eta_OV R_OV kappa_OV dL/dw`` and likewise for ``q``."""
    g_w, g_q = reduced_grad(w, q, sizes)
    r_ov, r_qk = rate_factors(parameterization, w, q, sizes)
    return -eta_ov * r_ov * sizes.kappa_ov * g_w, -eta_qk * r_qk * sizes.kappa_qk * g_q


def _check_rates(eta_ov: float, ratio: float) -> None:
    for name, v in (("eta_ov", eta_ov), ("ratio", ratio)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def integrate(parameterization: str, w0: float, q0: float, sizes: Sizes, eta_ov: float = 1.0,
              ratio: float = 1.0, t_max: float = 1e6, t_eval: Sequence[float] | None = None,
              n_points: int = 200, rtol: float = 1e-10, atol: float = 1e-12) -> pd.DataFrame:
    """Integrate the reduced ODE from ``(w0, q0)`` to ``t_max`` (steps) in log time
    ``tau = log(1 + t)``, which resolves both the fast start and the logarithmically slow tail
    (up to ``t_max = 1e250``). Returns one row per time of ``t_eval`` (default ``n_points``
    log-spaced times and 0) with columns t, w, q, loss, distinct (mean attention on the
    distinct token), common (mass on common tokens), confidence.

    A factorized scalar cannot change sign under the exact flow (zero is a saddle); started
    negative it creeps toward 0, and once it is below ``atol`` the integrator may step across, so
    start factorized circuits at positive values."""
    parse_parameterization(parameterization)
    _check_rates(eta_ov, ratio)
    if not (0 < t_max <= 1e250):
        raise ValueError(f"t_max must lie in (0, 1e250], got {t_max}")
    if t_eval is None:
        t_eval = np.concatenate([[0.0], np.geomspace(min(1e-2, t_max), t_max, n_points)])
    t_eval = np.asarray(t_eval, dtype=float)
    if t_eval.min() < 0 or t_eval.max() > t_max or np.any(np.diff(t_eval) < 0):
        raise ValueError("t_eval must be sorted and lie in [0, t_max]")
    eta_qk = eta_ov * ratio

    def f(tau: float, y: np.ndarray) -> np.ndarray:
        dw, dq = velocity(parameterization, y[0], y[1], sizes, eta_ov, eta_qk)
        return math.exp(tau) * np.array([float(dw), float(dq)])  # dt/dtau = 1 + t = e^tau

    sol = solve_ivp(f, (0.0, math.log1p(t_max)), [float(w0), float(q0)], method="DOP853",
                    t_eval=np.log1p(t_eval), rtol=rtol, atol=atol)
    if not sol.success:
        raise RuntimeError(f"ODE integration failed: {sol.message}")
    w, q = sol.y
    return pd.DataFrame({"t": t_eval, "w": w, "q": q, "loss": reduced_loss(w, q, sizes),
                         "distinct": distinct_mass(q, sizes), "common": common_mass(q, sizes),
                         "confidence": confidence(w, q, sizes)})


def flow_field(parameterization: str, w: np.ndarray, q: np.ndarray, sizes: Sizes, eta_ov: float = 1.0,
               ratio: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The ODE vector field ``(dw/dt, dq/dt)`` on a grid (for phase portraits)."""
    return velocity(parameterization, w, q, sizes, eta_ov, eta_ov * ratio)


# --------------------------------------------------------------------------------------
# T4: coordinates in which trajectories are straight lines
# --------------------------------------------------------------------------------------
def line_coordinates(parameterization: str, w: ArrayLike, q: ArrayLike, sizes: Sizes,
                     n: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(X(w), Y(q))`` with ``dY/dq = (e^q + n) / (kappa_QK R_QK(q))`` and
    ``dX/dw = w / (kappa_OV R_OV(w))``:

    * OV: ``X = (K-1) w^2 / 2`` (collapsed) or ``(K-1) |w| / 2`` (factorized);
    * QK: ``Y = (e^q + n q) / kappa_QK`` (collapsed) or
      ``(Ei(q) + n log q) / (2 sqrt(kappa_QK))`` (factorized, ``q > 0``).

    When every sequence has the same ``n`` common tokens the ODE gives
    ``dY/dX = eta_QK / eta_OV * n`` exactly, so ``(X, Y)`` moves on a straight line of slope
    ``ratio * n``. For a mixture over ``n`` this holds only asymptotically, with ``n = E[n]``
    (the default)."""
    p = parse_parameterization(parameterization)
    n = sizes.n_mean if n is None else float(n)
    w = np.asarray(w, dtype=float)
    q = np.asarray(q, dtype=float)
    K = sizes.n_classes
    X = (K - 1) * (np.abs(w) / 2 if p.ov_factorized else w ** 2 / 2)
    if p.qk_factorized:
        if np.any(q <= 0):
            raise ValueError("the factorized-QK line coordinate needs q > 0")
        Y = (expi(q) + n * np.log(q)) / (2 * math.sqrt(sizes.kappa_qk))
    else:
        Y = (np.exp(q) + n * q) / sizes.kappa_qk
    return X, Y


def line_slope(ratio: float, sizes: Sizes, n: float | None = None) -> float:
    """The slope ``dY/dX = ratio * n`` of :func:`line_coordinates` (``n`` defaults to ``E[n]``)."""
    return float(ratio) * (sizes.n_mean if n is None else float(n))


# --------------------------------------------------------------------------------------
# T3 / T5: long-time asymptotics
# --------------------------------------------------------------------------------------
def sharpness_coordinate(parameterization: str, q: ArrayLike) -> np.ndarray:
    """``Z(q) = e^q`` (collapsed QK) or ``Ei(q) ~ e^q / q`` (factorized QK): the QK quantity
    with a pure power law in ``log t`` (see :func:`asymptotic_law`)."""
    p = parse_parameterization(parameterization)
    q = np.asarray(q, dtype=float)
    return expi(q) if p.qk_factorized else np.exp(q)


def tilted_count(c: float, sizes: Sizes) -> float:
    """``E[n e^{c n}] / E[e^{c n}]``: the mean of ``n`` tilted toward long sequences by the
    factor ``e^{w (1 - alpha_n)} ~ e^{c n}`` (``c = lim w e^{-q}``) that the loss keeps when
    the OV scalar outgrows ``e^q``; equals ``E[n]`` at ``c = 0`` or for a single ``n``."""
    n = sizes.counts
    x = c * n
    e = np.exp(x - x.max())
    return float((n * e).sum() / e.sum())


def asymptotic_law(parameterization: str, sizes: Sizes, eta_ov: float = 1.0, ratio: float = 1.0) -> dict[str, float]:
    """Leading-order long-time behaviour derived from the ODE (``s = log t``):

    * OV: ``w ~ log(eta_OV t)`` (collapsed OV) or ``e^w / w ~ 2 eta_OV m t`` (factorized OV),
      i.e. ``w = s + ov_loglog * log s + ov_offset + o(1)``;
    * QK: ``Z(q) ~ qk_const * s^qk_exponent`` with ``Z`` from :func:`sharpness_coordinate`;
      ``qk_const = r kappa_QK (K-1) n* / 2`` (collapsed QK) or ``r sqrt(kappa_QK) (K-1) n*``
      (factorized QK), ``qk_exponent = 2`` with collapsed OV and ``1`` with factorized OV;
    * common mass ``E[1 - alpha] ~ E[n] e^{-q}``.

    ``n* = E[n]`` except for CAFO, where ``w e^{-q}`` tends to ``c = 1/qk_const > 0`` and
    ``n* = tilted_count(c)`` solves the fixed point (and ``m = E[e^{c n}]``); a single ``n``
    gives ``n* = n`` in every case. Returns these numbers as a dict."""
    from scipy.optimize import brentq

    p = parse_parameterization(parameterization)
    _check_rates(eta_ov, ratio)
    K, kq = sizes.n_classes, sizes.kappa_qk
    a = ratio * (K - 1) * (math.sqrt(kq) if p.qk_factorized else kq / 2)
    n_star, m = sizes.n_mean, 1.0
    if p.ov_factorized and not p.qk_factorized and len(sizes.n_common) > 1:
        lo, hi = a * sizes.n_mean, a * max(sizes.n_common)
        A = brentq(lambda A: A - a * tilted_count(1.0 / A, sizes), lo, hi, xtol=1e-14)
        n_star = A / a
        m = float(np.mean(np.exp(sizes.counts / A)))
    return {"ov_exponent": 1.0, "ov_loglog": 1.0 if p.ov_factorized else 0.0,
            "ov_offset": math.log(2 * eta_ov * m) if p.ov_factorized else math.log(eta_ov),
            "qk_exponent": 1.0 if p.ov_factorized else 2.0, "qk_const": a * n_star, "n_star": n_star,
            "qk_coordinate": "Ei(q)" if p.qk_factorized else "exp(q)"}


def fit_power(t: np.ndarray, value: np.ndarray, t_min: float, t_max: float) -> tuple[float, float]:
    """Least-squares ``log value = log A + beta log log t`` over ``t_min <= t <= t_max``;
    returns ``(beta, A)`` (a power law in ``s = log t``)."""
    t, value = np.asarray(t, dtype=float), np.asarray(value, dtype=float)
    sel = (t >= t_min) & (t <= t_max) & (value > 0)
    if sel.sum() < 3:
        raise ValueError(f"need at least 3 points in [{t_min:g}, {t_max:g}] to fit, got {int(sel.sum())}")
    x, y = np.log(np.log(t[sel])), np.log(value[sel])
    beta, logA = np.polyfit(x, y, 1)
    return float(beta), float(math.exp(logA))


def fit_constant(t: np.ndarray, value: np.ndarray, beta: float, t_min: float, t_max: float) -> tuple[float, float]:
    """Least-squares ``value = A s^beta + B`` (``s = log t``, ``beta`` given) over
    ``t_min <= t <= t_max``; returns ``(A, B)``. The free offset ``B`` absorbs the transient."""
    t, value = np.asarray(t, dtype=float), np.asarray(value, dtype=float)
    sel = (t >= t_min) & (t <= t_max)
    if sel.sum() < 3:
        raise ValueError(f"need at least 3 points in [{t_min:g}, {t_max:g}] to fit, got {int(sel.sum())}")
    A, B = np.polyfit(np.log(t[sel]) ** beta, value[sel], 1)
    return float(A), float(B)


def fit_linear_in_log(t: np.ndarray, value: np.ndarray, t_min: float, t_max: float) -> tuple[float, float]:
    """Least-squares ``value = a log t + b`` over ``t_min <= t <= t_max``; returns ``(a, b)``."""
    t, value = np.asarray(t, dtype=float), np.asarray(value, dtype=float)
    sel = (t >= t_min) & (t <= t_max)
    if sel.sum() < 3:
        raise ValueError(f"need at least 3 points in [{t_min:g}, {t_max:g}] to fit, got {int(sel.sum())}")
    a, b = np.polyfit(np.log(t[sel]), value[sel], 1)
    return float(a), float(b)


# --------------------------------------------------------------------------------------
# the symmetric subspace inside the full matrix model
# --------------------------------------------------------------------------------------
def _check_onehot(task) -> None:
    if task.embedding != "onehot" or task.query_is_key:
        raise ValueError("the symmetric reduction needs one-hot embeddings and a query that is not a key")


def symmetric_effective(w: float, q: float, task) -> tuple[torch.Tensor, torch.Tensor]:
    """The effective matrices ``(W_QK (d, d), W_OV (K, d))`` (float64) of the symmetric state
    ``(w, q)`` of a one-hot task: ``W_QK e_query = q v`` with ``v`` zero-sum over the keys, and
    ``W_OV`` = ``w (I - 11^T / K)`` on the distinct columns, zero elsewhere."""
    _check_onehot(task)
    K, M, d = task.n_classes, task.n_common_vocab, task.width
    W_QK = torch.zeros(d, d, dtype=torch.float64)
    W_QK[task.distinct_ids, task.query_id] = q * M / (K + M)
    W_QK[task.common_ids, task.query_id] = -q * K / (K + M)
    W_OV = torch.zeros(K, d, dtype=torch.float64)
    W_OV[:, :K] = w * (torch.eye(K, dtype=torch.float64) - 1.0 / K)
    return W_QK, W_OV


def predicted_gradients(w: float, q: float, task) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients ``(dL/dW_QK (d, d), dL/dW_OV (K, d))`` of the population loss at the
    symmetric state, as the reduction predicts them: ``dL/dW_OV = (dL/dw) kappa_OV P`` on the
    distinct columns and ``dL/dW_QK[:, query] = dL/dq (1/K on distinct, -1/M on common)``."""
    _check_onehot(task)
    sizes = Sizes.from_task(task)
    g_w, g_q = (float(g) for g in reduced_grad(w, q, sizes))
    K, M, d = task.n_classes, task.n_common_vocab, task.width
    G_QK = torch.zeros(d, d, dtype=torch.float64)
    G_QK[task.distinct_ids, task.query_id] = g_q / K
    G_QK[task.common_ids, task.query_id] = -g_q / M
    G_OV = torch.zeros(K, d, dtype=torch.float64)
    G_OV[:, :K] = g_w * sizes.kappa_ov * (torch.eye(K, dtype=torch.float64) - 1.0 / K)
    return G_QK, G_OV


def _symmetric_model(task, w: float, q: float, parameterization: str):
    from qkov_lib.data.synthetic import make_embeddings
    from qkov_lib.models import SyntheticModel

    E = make_embeddings(task, dtype=torch.float64)
    model = SyntheticModel(E, task.n_classes, parameterization=parameterization, init_scale=0.0,
                           dtype=torch.float64)
    model.attention.set_effective(*symmetric_effective(w, q, task))
    return model


def full_model_gradients(task, w: float, q: float) -> dict[str, torch.Tensor]:
    """Autograd of the full collapsed model's exact population loss at the symmetric state:
    ``loss`` and the matrix gradients ``W_QK`` (d, d), ``W_OV`` (K, d)."""
    from qkov_lib.data.synthetic import population
    from qkov_lib.train import loss_fn

    model = _symmetric_model(task, w, q, "CACO")
    data = population(task)
    loss = loss_fn(model(data.tokens, data.key_mask)[0], data.y, data.weight)
    loss.backward()
    att = model.attention
    return {"loss": loss.detach(), "W_QK": att.W_QK.grad.detach(), "W_OV": att.W_OV.grad.detach()}


def scalars_of(W_QK: torch.Tensor, W_OV: torch.Tensor, task) -> tuple[float, float]:
    """``(w, q)`` of effective matrices, by :func:`qkov_lib.metrics.circuit_scalars` (linear)."""
    from qkov_lib.metrics import circuit_scalars

    E = torch.eye(task.width, dtype=W_QK.dtype)
    s = circuit_scalars(W_QK, W_OV, E[task.distinct_ids], E[task.common_ids], E[task.query_id])
    return s["ov"], s["qk"]


def full_model_velocity(task, w: float, q: float, parameterization: str, eta_ov: float = 1.0,
                        eta_qk: float = 1.0) -> tuple[float, float]:
    """``(dw/dt, dq/dt)`` of gradient flow on the *full* model's own parameters (factors for a
    factorized circuit, from balanced factors of the symmetric state), by autograd:
    ``dW_QK/dt = -eta_QK (W_K^T dL/dW_Q + (dL/dW_K)^T W_Q)`` and
    ``dW_OV/dt = -eta_OV ((dL/dW_O) W_V + W_O dL/dW_V)``, read out with :func:`scalars_of`."""
    from qkov_lib.data.synthetic import population
    from qkov_lib.train import loss_fn

    model = _symmetric_model(task, w, q, parameterization)
    data = population(task)
    loss_fn(model(data.tokens, data.key_mask)[0], data.y, data.weight).backward()
    a = model.attention
    with torch.no_grad():
        if a.param.qk_factorized:
            dQK = -eta_qk * (a.W_K.T @ a.W_Q.grad + a.W_K.grad.T @ a.W_Q)
        else:
            dQK = -eta_qk * a.W_QK.grad
        if a.param.ov_factorized:
            dOV = -eta_ov * (a.W_O.grad @ a.W_V + a.W_O @ a.W_V.grad)
        else:
            dOV = -eta_ov * a.W_OV.grad
    return scalars_of(dQK, dOV, task)


__all__ = [
    "PARAMETERIZATIONS", "Sizes", "attention_distinct", "common_mass", "distinct_mass", "reduced_loss",
    "reduced_grad", "confidence", "singular_values", "rate_factors", "velocity", "integrate", "flow_field",
    "line_coordinates", "line_slope", "sharpness_coordinate", "tilted_count", "asymptotic_law", "fit_power",
    "fit_constant", "fit_linear_in_log", "symmetric_effective", "predicted_gradients", "full_model_gradients", "scalars_of",
    "full_model_velocity",
]
