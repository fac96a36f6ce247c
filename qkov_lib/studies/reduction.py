"""The symmetric reduction (claims T1, T2): the reduced ODEs of :mod:`qkov_lib.dynamics`
against full-model gradient descent -- gradient and velocity checks, trajectory overlays, step
convergence, conserved quantities off the symmetric subspace -- their verdicts and figures."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from qkov_lib.figure_source import draws
from qkov_lib import dynamics as dy
from qkov_lib.data import synthetic as syn
from qkov_lib.metrics import circuit_scalars
from qkov_lib.models import PARAMETERIZATIONS, SyntheticModel
from qkov_lib import claims as C
from qkov_lib import protocol
from qkov_lib.claims import Verdict, claim
from qkov_lib.runtime import seed_everything
from qkov_lib.train import TrainConfig, engine
from qkov_lib.studies import synthetic as base


# Chapter 02 (reduction): machine checks. ``eta_max`` is the larger of the two learning rates
# (eta_OV = eta_max / ratio when ratio > 1), so every overlay run has the same Euler step. The
# tolerances of the checks are claims.TOL_GRAD, TOL_VELOCITY and TOL_OVERLAY (defined once there).
PROFILES_REDUCTION: dict[str, dict] = {
    "test": dict(n_classes=3, n_common_vocab=2, n_common=[2, 4], check_points=4, eta_max=0.1, ratios=[1.0, 4.0],
                 steps=200, w0=0.5, q0=0.5, etas_convergence=[0.2, 0.1], n_logs=25, init_scale=0.1, seed=0),
    "cpu": dict(n_classes=4, n_common_vocab=3, n_common=[2, 4, 8, 12], check_points=8, eta_max=0.1,
                ratios=[1.0, 10.0], steps=1000, w0=0.5, q0=0.5, etas_convergence=[0.2, 0.1, 0.05], n_logs=40,
                init_scale=0.1, seed=0),
    "full": dict(n_classes=8, n_common_vocab=4, n_common=[2, 4, 8, 16], check_points=16, eta_max=0.05,
                 ratios=[1.0, 10.0, 100.0], steps=10000, w0=0.5, q0=0.5, etas_convergence=[0.2, 0.1, 0.05, 0.025],
                 n_logs=80, init_scale=0.1, seed=0),
}

PARAMS = list(PARAMETERIZATIONS)


def sizes_of(cfg: dict) -> dy.Sizes:
    """The :class:`qkov_lib.dynamics.Sizes` of a resolved settings dict."""
    return dy.Sizes(cfg["n_classes"], cfg["n_common_vocab"], tuple(cfg["n_common"]))


def task_of(cfg: dict) -> syn.SyntheticTask:
    """The one-hot :class:`SyntheticTask` of a resolved settings dict."""
    return syn.SyntheticTask(n_classes=cfg["n_classes"], n_common_vocab=cfg["n_common_vocab"],
                             n_common=tuple(cfg["n_common"]), embedding="onehot")



# --------------------------------------------------------------------------------------
# chapter 02: machine checks of the reduction
# --------------------------------------------------------------------------------------
def check_points(n: int, seed: int) -> list[tuple[float, float]]:
    """``n`` seeded symmetric states ``(w, q)``, ``w`` in [-1, 4], ``q`` in [-2, 3]."""
    rng = np.random.default_rng(seed)
    return [(float(rng.uniform(-1, 4)), float(rng.uniform(-2, 3))) for _ in range(n)]


def gradient_check(task: syn.SyntheticTask, points: Sequence[tuple[float, float]]) -> pd.DataFrame:
    """At each symmetric state: the reduced loss against the full model's population loss, and
    the largest entrywise difference between the autograd matrix gradients and the ones the
    reduction predicts (so components off the symmetric subspace must vanish too)."""
    sizes = dy.Sizes.from_task(task)
    rows = []
    for w, q in points:
        g = dy.full_model_gradients(task, w, q)
        G_QK, G_OV = dy.predicted_gradients(w, q, task)
        rows.append({"w": w, "q": q, "loss_full": float(g["loss"]), "loss_reduced": float(dy.reduced_loss(w, q, sizes)),
                     "err_loss": abs(float(g["loss"]) - float(dy.reduced_loss(w, q, sizes))),
                     "err_grad_QK": float((g["W_QK"] - G_QK).abs().max()),
                     "err_grad_OV": float((g["W_OV"] - G_OV).abs().max()),
                     "scale_grad": float(max(g["W_QK"].abs().max(), g["W_OV"].abs().max()))})
    return pd.DataFrame(rows)


def velocity_check(task: syn.SyntheticTask, points: Sequence[tuple[float, float]], ratio: float = 3.0,
                   parameterizations: Sequence[str] = PARAMS) -> pd.DataFrame:
    """At each symmetric state and parameterization: ``(dw/dt, dq/dt)`` of gradient flow on the
    full model's own parameters (factors included) against the reduced ODE (claim T2)."""
    sizes = dy.Sizes.from_task(task)
    rows = []
    for (w, q), p in itertools.product(points, parameterizations):
        fw, fq = dy.full_model_velocity(task, w, q, p, 1.0, ratio)
        rw, rq = (float(v) for v in dy.velocity(p, w, q, sizes, 1.0, ratio))
        rows.append({"parameterization": p, "w": w, "q": q, "dw_full": fw, "dw_ode": rw, "dq_full": fq, "dq_ode": rq,
                     "rel_err": max(abs(fw - rw), abs(fq - rq)) / max(abs(fw), abs(fq), 1e-300)})
    return pd.DataFrame(rows)


def _probe(task: syn.SyntheticTask, E: torch.Tensor, w0: float, q0: float):
    """Training probe: circuit scalars, invariants of factorized training and the distance of
    the effective matrices from the symmetric subspace."""
    Ed, Ec, eq = E[task.distinct_ids], E[task.common_ids], E[task.query_id]
    ref: dict[str, torch.Tensor] = {}

    def probe(model: SyntheticModel) -> dict[str, float]:
        with torch.no_grad():
            att = model.attention
            W_QK, W_OV = att.effective()
            s = circuit_scalars(W_QK, W_OV, Ed, Ec, eq)
            S_QK, S_OV = dy.symmetric_effective(s["ov"], s["qk"], task)
            out = {"ov": s["ov"], "qk": s["qk"],
                   "off_subspace": float(max((W_QK - S_QK).abs().max(), (W_OV - S_OV).abs().max())),
                   "shift": float(W_QK[task.distinct_ids + task.common_ids, task.query_id].sum())}
            cons = att.conserved()
            if not ref:
                ref.update({k: v.clone() for k, v in cons.items()})
            for k, v in cons.items():
                norm = (att.W_K.norm() ** 2 if k == "qk" else att.W_O.norm() ** 2)
                out[f"drift_{k}"] = float((v - ref[k]).norm() / norm)
            return out

    return probe


def probed_gd(models: Sequence[SyntheticModel], cfgs: Sequence[TrainConfig], task: syn.SyntheticTask, w0: float,
              q0: float, progress: bool = False, desc: str = "gradient descent") -> list[pd.DataFrame]:
    """Train ``models`` (one task, float64) on the exact population loss with their configs, all
    together in the batched engine (:func:`qkov_lib.train.engine.train_batched`, tested to equal
    :func:`qkov_lib.train.train` run one model at a time), each logged by :func:`_probe`. Returns
    each model's history frame, in order; ``progress``: a progress bar ``desc``, left on screen."""
    probe = engine.per_model_probe(models, [_probe(task, m.E, w0, q0) for m in models])
    hists = engine.train_batched(models, syn.population(task), list(cfgs), probe=probe, progress=progress,
                                 leave=progress, desc=f"{desc} ({len(models)} runs)")
    return [h.frame() for h in hists]


def symmetric_model(task: syn.SyntheticTask, parameterization: str, w0: float, q0: float) -> SyntheticModel:
    """A float64 model of ``parameterization`` at the symmetric state ``(w0, q0)`` (balanced factors)."""
    E = syn.make_embeddings(task, dtype=torch.float64)
    model = SyntheticModel(E, task.n_classes, parameterization=parameterization, init_scale=0.0, dtype=torch.float64)
    model.attention.set_effective(*dy.symmetric_effective(w0, q0, task))
    return model


def symmetric_runs(task: syn.SyntheticTask, runs: Sequence[tuple[str, float, float]], w0: float, q0: float,
                   steps: int, n_logs: int = 40, progress: bool = False) -> list[pd.DataFrame]:
    """Full-model gradient descent (float64, exact population loss) from the symmetric state
    ``(w0, q0)`` for each ``(parameterization, eta_ov, ratio)`` of ``runs``, all trained together
    (:func:`probed_gd`); per run one row per logged step with the loss, attention on the distinct
    token, the scalars ``ov``/``qk``, the drift of the conserved quantities and the distance from the
    symmetric subspace. ``progress``: a progress bar, left on screen."""
    models = [symmetric_model(task, p, w0, q0) for p, _, _ in runs]
    cfgs = [TrainConfig(optimizer="gd", eta_ov=eta_ov, ratio=float(ratio), steps=int(steps), n_logs=n_logs,
                        progress=False) for _, eta_ov, ratio in runs]
    frames = probed_gd(models, cfgs, task, w0, q0, progress, "ODE vs GD")
    for f, (p, _, ratio) in zip(frames, runs):
        f.insert(0, "ratio", float(ratio))
        f.insert(0, "parameterization", p)
    return frames


def train_symmetric(task: syn.SyntheticTask, parameterization: str, w0: float, q0: float, eta_ov: float,
                    ratio: float, steps: int, n_logs: int = 40) -> pd.DataFrame:
    """:func:`symmetric_runs` of one run."""
    return symmetric_runs(task, [(parameterization, eta_ov, ratio)], w0, q0, steps, n_logs)[0]


def with_ode(gd: pd.DataFrame, task: syn.SyntheticTask, w0: float, q0: float, eta_ov: float) -> pd.DataFrame:
    """A :func:`symmetric_runs` frame of one run (its ``parameterization`` and ``ratio`` columns) next to
    the reduced ODE at the same times (``t`` = step): adds ``w_ode``, ``q_ode``, ``distinct_ode``,
    ``err_w``, ``err_q``."""
    p, ratio = str(gd["parameterization"].iloc[0]), float(gd["ratio"].iloc[0])
    t = gd["step"].to_numpy(dtype=float)
    ode = dy.integrate(p, w0, q0, dy.Sizes.from_task(task), eta_ov, ratio, t_max=float(t.max()), t_eval=t)
    gd["w_ode"], gd["q_ode"] = ode["w"].to_numpy(), ode["q"].to_numpy()
    gd["distinct_ode"] = ode["distinct"].to_numpy()
    gd["err_w"] = (gd["ov"] - gd["w_ode"]).abs()
    gd["err_q"] = (gd["qk"] - gd["q_ode"]).abs()
    return gd


def overlay(task: syn.SyntheticTask, parameterization: str, w0: float, q0: float, eta_ov: float, ratio: float,
            steps: int, n_logs: int = 40) -> pd.DataFrame:
    """Full-model GD next to the reduced ODE at the same times (``t`` = step); columns of
    :func:`train_symmetric` plus ``w_ode``, ``q_ode``, ``err_w``, ``err_q``."""
    return with_ode(train_symmetric(task, parameterization, w0, q0, eta_ov, ratio, steps, n_logs), task, w0, q0, eta_ov)


def eta_ov_for(eta_max: float, ratio: float) -> float:
    """The OV rate that makes the larger of ``eta_ov`` and ``eta_ov * ratio`` equal ``eta_max``."""
    return eta_max / max(float(ratio), 1.0)


def overlay_grid(cfg: dict) -> pd.DataFrame:
    """:func:`overlay` for every parameterization and ratio of ``cfg``, each with its larger
    learning rate equal to ``eta_max``; the runs train together (:func:`symmetric_runs`)."""
    task = task_of(cfg)
    runs = [(p, eta_ov_for(cfg["eta_max"], r), r) for p, r in itertools.product(PARAMS, cfg["ratios"])]
    frames = symmetric_runs(task, runs, cfg["w0"], cfg["q0"], cfg["steps"], cfg["n_logs"], progress=True)
    return pd.concat([with_ode(f, task, cfg["w0"], cfg["q0"], eta) for f, (_, eta, _) in zip(frames, runs)],
                     ignore_index=True)


def step_convergence(cfg: dict, parameterization: str = "FAFO", ratio: float | None = None) -> pd.DataFrame:
    """The largest ODE-vs-GD discrepancy over a fixed horizon (``steps * eta_max`` in units of
    the faster circuit's time) for each larger-rate ``eta_max`` in ``etas_convergence``: GD is the
    Euler scheme of the flow, so the discrepancy must shrink in proportion to the step."""
    task = task_of(cfg)
    ratio = max(cfg["ratios"]) if ratio is None else ratio
    horizon = cfg["steps"] * cfg["eta_max"]
    rows = []
    for eta in cfg["etas_convergence"]:
        f = overlay(task, parameterization, cfg["w0"], cfg["q0"], eta_ov_for(eta, ratio), ratio,
                    int(round(horizon / eta)), cfg["n_logs"])
        rows.append({"parameterization": parameterization, "ratio": ratio, "eta_max": eta,
                     "max_err": float(np.maximum(f["err_w"], f["err_q"]).max())})
    out = pd.DataFrame(rows)
    out["err / eta_max"] = out["max_err"] / out["eta_max"]
    return out


def conservation_random(cfg: dict, parameterization: str = "FAFO", ratio: float = 1.0) -> pd.DataFrame:
    """Drift of the invariants ``W_K W_K^T - W_Q W_Q^T`` and ``W_O^T W_O - W_V W_V^T`` (relative
    to ``||W_K||^2``, ``||W_O||^2``) over a fixed horizon from the library's random *balanced*
    init (off the symmetric subspace), for each ``eta_max`` in ``etas_convergence``. Gradient
    flow conserves them exactly; a GD step changes them by ``O(eta^2)``, so the total drift
    over a fixed horizon must shrink in proportion to the step."""
    task = task_of(cfg)
    horizon = cfg["steps"] * cfg["eta_max"]

    def one(eta: float) -> dict:
        E = syn.make_embeddings(task, dtype=torch.float64)
        model = SyntheticModel(E, task.n_classes, parameterization=parameterization, init_scale=cfg["init_scale"],
                               generator=seed_everything(cfg["seed"]), dtype=torch.float64)
        tc = TrainConfig.from_profile(cfg, optimizer="gd", eta_ov=eta_ov_for(eta, ratio), ratio=ratio,
                                      steps=int(round(horizon / eta)), progress=False)
        f = probed_gd([model], [tc], task, cfg["w0"], cfg["q0"])[0]
        return {"parameterization": parameterization, "eta_max": eta, "drift_qk": float(f["drift_qk"].max()),
                "drift_ov": float(f["drift_ov"].max()), "final_loss": float(f["loss"].iloc[-1])}

    # one run per step size: they differ in length, so each trains alone
    return pd.DataFrame(protocol.run_each([(eta,) for eta in cfg["etas_convergence"]], one, "conservation",
                                          progress=False))


def perturbed_discrepancy(ov: pd.DataFrame, task: syn.SyntheticTask, w0: float, q0: float, eta_max: float,
                          factor: float = 2.0) -> pd.DataFrame:
    """How the ODE-vs-GD check reacts to a wrong derivation: the GD runs of ``ov`` against the
    ODE with ``dq/dt`` (or ``dw/dt``) multiplied by ``factor``. Scaling ``dq/dt`` is integrating at
    ``ratio * factor``; scaling ``dw/dt`` is ``eta_ov * factor`` at ``ratio / factor``."""
    sizes = dy.Sizes.from_task(task)
    rows = []
    for (p, r), g in ov.groupby(["parameterization", "ratio"], sort=False):
        eta = eta_ov_for(eta_max, r)
        t = g["step"].to_numpy(dtype=float)
        for which, (e, rr) in (("dq/dt", (eta, r * factor)), ("dw/dt", (eta * factor, r / factor))):
            f = dy.integrate(p, w0, q0, sizes, e, rr, t_max=float(t.max()), t_eval=t)
            err = np.maximum(np.abs(g["ov"].to_numpy() - f["w"].to_numpy()), np.abs(g["qk"].to_numpy() - f["q"].to_numpy()))
            rows.append({"parameterization": p, "ratio": r, "perturbed": f"{factor:g} x {which}", "max_err": float(err.max())})
    return pd.DataFrame(rows)


def overlay_summary(ov: pd.DataFrame) -> pd.DataFrame:
    """Per (parameterization, ratio): largest ODE-vs-GD discrepancy, largest conserved-quantity
    drift and largest distance from the symmetric subspace."""
    cols = {"err_w": "max", "err_q": "max", "off_subspace": "max", "shift": lambda s: s.abs().max()}
    for c in ("drift_qk", "drift_ov"):
        if c in ov:
            cols[c] = "max"
    return ov.groupby(["parameterization", "ratio"], sort=False).agg(cols).reset_index()


def worst_case(summ: pd.DataFrame) -> tuple[str, float]:
    """``(parameterization, ratio)`` of the largest ODE-vs-GD discrepancy in an overlay summary."""
    row = summ.loc[np.maximum(summ["err_w"], summ["err_q"]).idxmax()]
    return str(row["parameterization"]), float(row["ratio"])


def rescaling_table(sizes: dy.Sizes, points: Sequence[tuple[float, float]]) -> pd.DataFrame:
    """The implicit rescaling (T2) at sample states: ``R = 2 sigma`` of each factorized circuit,
    next to ``2|w|`` and ``2|q|``."""
    rows = []
    for w, q in points:
        s_ov, s_qk = dy.singular_values(w, q, sizes)
        rows.append({"w": w, "q": q, "R_OV = 2 sigma_OV": 2 * float(s_ov), "2|w|": 2 * abs(w),
                     "R_QK = 2 sigma_QK": 2 * float(s_qk), "2|q|": 2 * abs(q)})
    return pd.DataFrame(rows)


def _order(errs: np.ndarray, etas: np.ndarray) -> float:
    """Mean observed order of convergence ``log(e1/e2) / log(eta1/eta2)`` over consecutive pairs."""
    return float(np.mean(np.log(errs[:-1] / errs[1:]) / np.log(etas[:-1] / etas[1:])))


def reduction_numbers(grad: pd.DataFrame, vel: pd.DataFrame, summ: pd.DataFrame) -> dict[str, float]:
    """The largest gaps of T1's and T2's cells (:func:`t1_cells`, :func:`t2_cells`), as floats (NaN
    for an empty table): ``loss_err``, ``grad_err`` (reduced vs autograd), ``overlay_err`` (ODE vs
    GD, any parameterization) and ``vel_err`` (relative velocity gap, any parameterization)."""
    cells, _ = t1_cells(grad, summ)
    at = lambda k: cells[k].mean if k in cells else math.nan  # noqa: E731
    top = lambda cs: max((c.mean for c in cs), default=math.nan)  # noqa: E731
    return {"loss_err": at("reduced loss vs autograd"), "grad_err": at("reduced gradients vs autograd"),
            "overlay_err": top(c for k, c in cells.items() if k.startswith("ODE")),
            "vel_err": top(t2_cells(vel).values()) if len(vel) else math.nan}


# T1 reads two quantities: the exact gaps (its estimand) and the ODE-vs-GD gap (a bound of its own).
T1_OVERLAY = C.Estimand("largest gap of w or q between the ODE and full-model GD", -1, C.TOL_OVERLAY)


def t1_cells(grad: pd.DataFrame, summ: pd.DataFrame) -> tuple[dict[str, C.Change], dict[str, C.Estimand]]:
    """T1's cells (exact values, no seeds): the reduced loss and the reduced gradients against
    autograd at the checked states, and the ODE against full-model GD per parameterization (largest
    gap over its ratios); and each cell's estimand."""
    cells, est = {}, {}
    if len(grad):
        cells["reduced loss vs autograd"] = C.Change.exact(float(grad["err_loss"].max()))
        cells["reduced gradients vs autograd"] = C.Change.exact(float(max(grad["err_grad_QK"].max(),
                                                                           grad["err_grad_OV"].max())))
        est.update(dict.fromkeys(cells, C.ESTIMANDS["T1"]))
    for p, g in (summ.groupby("parameterization", sort=False) if len(summ) else ()):
        k = f"ODE vs full-model GD, {p}"
        cells[k], est[k] = C.Change.exact(float(np.maximum(g["err_w"], g["err_q"]).max())), T1_OVERLAY
    return cells, est


def t2_cells(vel: pd.DataFrame) -> dict[str, C.Change]:
    """T2's cells: per parameterization, the largest relative gap between factor-level autograd and
    the rescaled ODE velocity over the checked states (exact values)."""
    rel = (np.maximum((vel["dw_full"] - vel["dw_ode"]).abs(), (vel["dq_full"] - vel["dq_ode"]).abs())
           / np.maximum(np.maximum(vel["dw_full"].abs(), vel["dq_full"].abs()), 1e-300))
    return {f"velocity, {p}": C.Change.exact(float(rel[vel["parameterization"] == p].max()))
            for p in dict.fromkeys(vel["parameterization"])}


def reduction_verdicts(grad: pd.DataFrame, vel: pd.DataFrame, summ: pd.DataFrame) -> dict[str, Verdict]:
    """T1 and T2 by the one rule (:func:`qkov_lib.studies.synthetic.read`, ``verdict``) on
    :func:`t1_cells` and :func:`t2_cells`."""
    cells, est = t1_cells(grad, summ)
    rule1 = f"{C.ESTIMANDS['T1'].text()}; {T1_OVERLAY.text()}"
    return {"T1": base.verdict(base.read(est, cells), C.ESTIMANDS["T1"], rule1),
            "T2": base.verdict(base.read(C.ESTIMANDS["T2"], t2_cells(vel)), C.ESTIMANDS["T2"])}


def perturbation_facts(pert: pd.DataFrame) -> dict[str, str]:
    """How many of the perturbed-ODE cases of :func:`perturbed_discrepancy` break the overlay
    bound ``claims.TOL_OVERLAY``, as glue strings."""
    caught = int((pert["max_err"] > C.TOL_OVERLAY).sum())
    return {"pert_min": f"{pert['max_err'].min():.3g}", "pert_caught": str(caught), "pert_total": str(len(pert)),
            "pert_verdict": ("every perturbed ODE breaks the bound, so the overlay check would catch a factor of 2 "
                             "in either equation" if caught == len(pert) else
                             "not every perturbed ODE breaks the bound, so the overlay check alone would miss some "
                             "factor-of-2 errors")}


_OK_WORDS = {"reproduced": "hold", "holds where": "hold only in part", "mixed": "hold only in part",
             "not reproduced": "do NOT hold",
             "inconclusive": "are undecided",
             "not tested": "were not run"}


def reduction_facts(grad: pd.DataFrame, vel: pd.DataFrame, summ: pd.DataFrame, conv: pd.DataFrame,
                    cons: pd.DataFrame, cfg: dict, sizes: dy.Sizes,
                    verdicts: Mapping[str, Verdict] | None = None) -> dict[str, str]:
    """The numbers, verdicts, rules and computed sentences chapter 02 quotes, as glue strings.
    ``verdicts`` defaults to :func:`reduction_verdicts` of the same tables."""
    verdicts = verdicts or reduction_verdicts(grad, vel, summ)
    n = reduction_numbers(grad, vel, summ)
    g_err, o_err = n["grad_err"], n["overlay_err"]
    drift_sym = float(summ[[c for c in ("drift_qk", "drift_ov") if c in summ]].max().max())
    off = float(summ["off_subspace"].max())
    etas = conv["eta_max"].to_numpy()
    errs = conv["max_err"].to_numpy()
    c_drift = np.maximum(cons["drift_qk"].to_numpy(), cons["drift_ov"].to_numpy())
    t1, t2 = verdicts["T1"].verdict, verdicts["T2"].verdict
    exact = g_err <= C.TOL_GRAD and n["loss_err"] <= C.TOL_GRAD
    f = {
        "n_points": str(len(grad)), "grad_err": f"{g_err:.1e}", "loss_err": f"{n['loss_err']:.1e}",
        "tol_grad": C.threshold_text("TOL_GRAD"), "vel_err": f"{n['vel_err']:.1e}",
        "tol_velocity": C.threshold_text("TOL_VELOCITY"), "overlay_err": f"{o_err:.3g}",
        "tol_overlay": C.threshold_text("TOL_OVERLAY"),
        "drift_sym": f"{drift_sym:.1e}", "off_subspace": f"{off:.1e}",
        "conv_order": f"{_order(errs, etas):.2f}", "conv_etas": ", ".join(f"{e:g}" for e in etas),
        "conv_errs": ", ".join(f"{e:.2g}" for e in errs),
        "cons_drifts": ", ".join(f"{e:.2g}" for e in c_drift), "cons_order": f"{_order(c_drift, cons['eta_max'].to_numpy()):.2f}",
        "eta_max": f"{cfg['eta_max']:g}", "steps": str(cfg["steps"]), "ratios": ", ".join(f"{r:g}" for r in cfg["ratios"]),
        "kappa_qk": f"{sizes.kappa_qk:.4g}", "kappa_ov": f"{sizes.kappa_ov:.4g}",
        "sigma_qk_per_q": f"{1 / math.sqrt(sizes.kappa_qk):.4g}",
        "t1_ok": _OK_WORDS[t1], "t2_ok": "holds" if t2 == "reproduced" else _OK_WORDS[t2],
        "subspace_sentence": (
            "Off-subspace components therefore vanish, and the symmetric subspace is invariant" if exact else
            f"Off-subspace components do NOT vanish within {C.threshold_text('TOL_GRAD')}, so the symmetric subspace "
            "need not be invariant") + f": along every GD run the effective matrices stayed within {off:.1e} of it.",
        "overlay_sentence": (
            f"For every parameterization at ratios {', '.join(f'{r:g}' for r in cfg['ratios'])}, full-model GD with "
            f"larger step {cfg['eta_max']:g} stayed within {o_err:.3g} of the ODE"
            if o_err <= C.TOL_OVERLAY else
            f"Full-model GD with larger step {cfg['eta_max']:g} departed from the ODE by up to {o_err:.3g}")
            + f" (bound {C.threshold_text('TOL_OVERLAY')}).",
    }
    f["one_rule"] = C.ONE_RULE
    f.update(C.verdict_glue(verdicts))
    return f


#: the columns of an overlay frame (:func:`overlay_grid`) that the figures draw and the results keep
OVERLAY_COLUMNS = ("parameterization", "ratio", "step", "ov", "qk", "w_ode", "q_ode", "err_w", "err_q")


def reduction_metrics(grad: pd.DataFrame, vel: pd.DataFrame, ov: pd.DataFrame, summ: pd.DataFrame,
                      conv: pd.DataFrame, cons: pd.DataFrame, pert: pd.DataFrame, facts: Mapping[str, str],
                      verdicts: Mapping[str, Verdict]) -> dict:
    """The metrics chapter 02 saves: every check's table (records), the overlay runs' scalars
    (:data:`OVERLAY_COLUMNS`, what :func:`plot_overlay` and :func:`plot_discrepancy` draw), the
    rescaling curve (:func:`plot_rescaling`), ``convergence`` = the step-convergence and
    random-init conservation tables (:func:`plot_convergence`), the facts and the scorecard rows."""
    return {"gradient_check": grad, "velocity_check": vel, "overlay_summary": summ,
            "overlay": ov[list(OVERLAY_COLUMNS)], "rescaling_curve": rescaling_curve(),
            "convergence": {"step_convergence": conv, "conservation_random": cons}, "perturbation": pert,
            "facts": dict(facts), "claims": reduction_claims(facts, verdicts)}


def reduction_claims(f: Mapping[str, str], verdicts: Mapping[str, Verdict]) -> list[dict[str, str]]:
    """Scorecard rows for T1 and T2: the measured numbers from :func:`reduction_facts`, the
    verdicts (with rule and reason) from :func:`reduction_verdicts`."""
    ch = "02_theory_reduction"
    t1 = claim("T1", "from a symmetric init each circuit reduces to one scalar with closed-form ODEs",
               f"reduced loss and gradients equal autograd of the full model to {f['loss_err']} / {f['grad_err']} "
               f"at {f['n_points']} states; ODE vs full-model GD max discrepancy {f['overlay_err']} "
               f"(bound {f['tol_overlay']}), fitted order {f['conv_order']} in the step; "
               f"distance from the symmetric subspace {f['off_subspace']}", verdicts["T1"], ch)
    t2 = claim("T2", "a balanced factorized scalar has effective rate about 2 eta |param|",
               f"derived: exactly 2 eta sigma, sigma the singular value of the effective matrix: sigma_OV = |w| "
               f"(the OV margin itself), sigma_QK = {f['sigma_qk_per_q']} |q| here (sqrt(KM/(K+M)) |q|); "
               f"factor-level autograd matches the rescaled ODE to {f['vel_err']} (relative); invariants drift "
               f"at most {f['cons_drifts']} over a fixed horizon under GD (order {f['cons_order']} in the step; "
               f"{f['drift_sym']} on the symmetric subspace)", verdicts["T2"], ch)
    return [t1, t2]

# --------------------------------------------------------------------------------------
# figures (white face colour via qkov_lib.plotting.setup)
# --------------------------------------------------------------------------------------
def _fig(nrows: int, ncols: int, w: float = 3.4, h: float = 2.8, **kw):
    import matplotlib.pyplot as plt

    from qkov_lib.plotting import FACE, setup

    setup()
    return plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, facecolor=FACE, **kw)



@draws
def plot_overlay(ov: pd.DataFrame):
    """Top: ``w``, bottom: ``q`` against the step (log axis); full-model GD as dots, the ODE as
    lines, one column per parameterization, one colour per ratio."""
    import seaborn as sns

    fig, axes = _fig(2, len(PARAMS), sharex=True)
    ratios = list(dict.fromkeys(ov["ratio"]))
    pal = sns.color_palette(n_colors=len(ratios))
    for j, p in enumerate(PARAMS):
        for k, r in enumerate(ratios):
            g = ov[(ov["parameterization"] == p) & (ov["ratio"] == r) & (ov["step"] > 0)]
            for i, (gd, ode, lab) in enumerate((("ov", "w_ode", "w (OV)"), ("qk", "q_ode", "q (QK)"))):
                ax = axes[i, j]
                ax.plot(g["step"], g[ode], color=pal[k], lw=1.5, label=f"ODE, ratio {r:g}")
                ax.plot(g["step"], g[gd], "o", color=pal[k], ms=3, label=f"GD, ratio {r:g}")
                ax.set_xscale("log")
                ax.set_ylabel(lab if j == 0 else "")
        axes[0, j].set_title(p)
        axes[1, j].set_xlabel("step")
    axes[0, -1].legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


@draws
def plot_discrepancy(ov: pd.DataFrame, tol: float):
    """``max(|w_GD - w_ODE|, |q_GD - q_ODE|)`` against the step, with the stated bound."""
    import seaborn as sns

    fig, axes = _fig(1, 1, w=5.5, h=3.3)
    ax = axes[0, 0]
    d = ov[ov["step"] > 0].assign(discrepancy=lambda f: np.maximum(f["err_w"], f["err_q"]).clip(lower=1e-16))
    # one value per (run, step): no interval to draw, and none bootstrapped (same build, same picture)
    sns.lineplot(data=d, x="step", y="discrepancy", hue="parameterization", style="ratio", errorbar=None, ax=ax)
    ax.axhline(tol, color="k", ls="--", lw=1, label="bound")
    ax.set(xscale="log", yscale="log", ylabel="|GD − ODE| (max of w, q)")
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    return fig


@draws
def plot_convergence(conv: pd.DataFrame, cons: pd.DataFrame):
    """Log-log: the ODE-vs-GD discrepancy and the drift of the invariants over a fixed horizon
    against the step size, with a slope-1 guide (first-order convergence)."""
    fig, axes = _fig(1, 2, w=4.0, h=3.2)
    for ax, (x, ys, title) in zip(axes[0], ((conv["eta_max"], {"max |GD − ODE|": conv["max_err"]}, "ODE vs GD"),
                                            (cons["eta_max"], {"W_K W_Kᵀ − W_Q W_Qᵀ": cons["drift_qk"],
                                                               "W_Oᵀ W_O − W_V W_Vᵀ": cons["drift_ov"]},
                                             "invariants, random init"))):
        for lab, y in ys.items():
            ax.plot(x, y, "o-", label=lab)
        y0 = float(next(iter(ys.values())).iloc[0])
        ax.plot(x, y0 * x / x.iloc[0], "k--", lw=1, label="slope 1")
        ax.set(xscale="log", yscale="log", xlabel="step size (larger rate)", title=title)
        ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def rescaling_curve(sigma_max: float = 3.0, n: int = 31) -> pd.DataFrame:
    """The rate multiplier ``R`` of T2 against the singular value ``sigma`` of the effective matrix,
    at ``n`` evenly spaced ``sigma`` in ``[0, sigma_max]``: columns ``sigma``, ``R_collapsed`` (1)
    and ``R_factorized`` (``2 sigma``, a balanced factorized circuit)."""
    s = np.linspace(0.0, sigma_max, n)
    return pd.DataFrame({"sigma": s, "R_collapsed": np.ones_like(s), "R_factorized": 2 * s})


@draws
def plot_rescaling(curve: pd.DataFrame):
    """The factor ``R`` multiplying the nominal rate in collapsed space against the singular value
    (a :func:`rescaling_curve` table)."""
    fig, axes = _fig(1, 1, w=4.5, h=3.0)
    ax = axes[0, 0]
    ax.plot(curve["sigma"], curve["R_collapsed"], label="collapsed: R = 1")
    ax.plot(curve["sigma"], curve["R_factorized"], label="balanced factorized: R = 2σ")
    ax.axvline(0.5, color="grey", ls=":", lw=1)
    ax.set(xlabel="singular value σ of the effective matrix", ylabel="rate multiplier R")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
