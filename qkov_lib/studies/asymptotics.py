"""The reduced ODEs' asymptotics: long log-time integrations, exponent fits and line coordinates
(T3, T4: the long-time laws page), the effect of the ratio (T5) and the sharpness ranking at equal
rates (T6, and the context of S2: the sharpness page), with the full-model runs that check them at
a practical horizon, verdicts and figures."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from qkov_lib.figure_source import draws
from qkov_lib import dynamics as dy
from qkov_lib.data import synthetic as syn
from qkov_lib.models import SyntheticModel
from qkov_lib import claims as C
from qkov_lib.claims import Verdict, claim
from qkov_lib.runtime import seed_everything
from qkov_lib.train import TrainConfig
from qkov_lib.studies import synthetic as base
from qkov_lib.studies.s2_phase import PAGE
from qkov_lib.studies.trajectory import at_levels
from qkov_lib.studies.reduction import PARAMS, _fig, probed_gd, sizes_of, symmetric_model, task_of  # noqa: F401  (sizes_of: the chapter calls exp.sizes_of)

# Chapter 03 (asymptotics): long ODE integrations, fits, S2 runs.
PROFILES_ASYMPTOTICS: dict[str, dict] = {
    "test": dict(n_classes=3, n_common_vocab=2, n_common=[2, 4], eta_ov=0.5, ratios=[1.0, 10.0],
                 w0=0.1, q0=0.1, t_max=1e100, n_points=150, fit_windows=[1e10, 1e30, 1e100],
                 horizons=[1e2, 1e3, 1e4, 1e6, 1e12, 1e50], full_steps=100, full_ratios=[1.0, 10.0],
                 full_seeds=[0], init_scale=0.1, n_logs=8, q0_small=1e-3, seed=0),
    "cpu": dict(n_classes=4, n_common_vocab=3, n_common=[2, 4, 8, 12], eta_ov=0.5, ratios=[1.0, 3.0, 10.0],
                w0=0.1, q0=0.1, t_max=1e200, n_points=500, fit_windows=[1e10, 1e30, 1e100, 1e200],
                horizons=[1e2, 1e3, 1e4, 1e6, 1e12, 1e50, 1e100], full_steps=1000, full_ratios=[1.0, 10.0],
                full_seeds=[0, 1], init_scale=0.1, n_logs=30, q0_small=1e-3, seed=0),
    "full": dict(n_classes=8, n_common_vocab=4, n_common=[2, 4, 8, 16, 32], eta_ov=0.5, ratios=[1.0, 3.0, 10.0, 100.0],
                 w0=0.1, q0=0.1, t_max=1e200, n_points=800, fit_windows=[1e10, 1e30, 1e100, 1e200],
                 horizons=[1e2, 1e3, 1e4, 1e6, 1e12, 1e50, 1e100], full_steps=20000, full_ratios=[1.0, 10.0],
                 full_seeds=[0, 1, 2, 3, 4], init_scale=0.1, n_logs=40, q0_small=1e-3, seed=0),
}


# --------------------------------------------------------------------------------------
# the long-time laws page (T3, T4) and the sharpness page (T5, T6, S2's context)
# --------------------------------------------------------------------------------------
def long_runs(sizes: dy.Sizes, cfg: dict, ratios: Sequence[float] | None = None, w0: float | None = None,
              q0: float | None = None, t_max: float | None = None) -> pd.DataFrame:
    """Log-time ODE integrations for every parameterization and ratio, long table with columns
    parameterization, ratio, t, w, q, loss, distinct, common, confidence."""
    parts = []
    for p, r in itertools.product(PARAMS, ratios or cfg["ratios"]):
        T = t_max or cfg["t_max"]
        grid = np.unique(np.concatenate([[0.0], np.geomspace(1e-2, T, cfg["n_points"]),
                                         np.geomspace(1.0, min(T, 1e6), 120)]))
        f = dy.integrate(p, cfg["w0"] if w0 is None else w0, cfg["q0"] if q0 is None else q0, sizes,
                         cfg["eta_ov"], r, t_max=T, t_eval=grid)
        f.insert(0, "ratio", float(r))
        f.insert(0, "parameterization", p)
        parts.append(f)
    return pd.concat(parts, ignore_index=True)


def exponent_table(runs: pd.DataFrame, sizes: dy.Sizes, cfg: dict) -> pd.DataFrame:
    """Derived against fitted exponents and constants, per parameterization and ratio, on the
    last fit window ``[fit_windows[-2], fit_windows[-1]]`` (``s = log t``):

    * OV: ``w - ov_loglog log s = a s + b``; derived ``a = 1``, ``b = ov_offset``;
    * QK: ``Z(q) ~ A s^beta`` (``Z = e^q`` or ``Ei(q)``); ``beta`` fitted on log-log axes,
      ``A`` by least squares of ``Z`` on ``s^beta`` (derived ``beta``) with a free offset."""
    lo, hi = cfg["fit_windows"][-2], cfg["fit_windows"][-1]
    rows = []
    for (p, r), g in runs.groupby(["parameterization", "ratio"], sort=False):
        law = dy.asymptotic_law(p, sizes, cfg["eta_ov"], r)
        t = g["t"].to_numpy()
        s = np.log(np.maximum(t, 1.0 + 1e-12))
        wres = g["w"].to_numpy() - law["ov_loglog"] * np.log(np.maximum(s, 1e-300))
        a, b = dy.fit_linear_in_log(t, wres, lo, hi)
        Z = dy.sharpness_coordinate(p, g["q"].to_numpy())
        beta, _ = dy.fit_power(t, Z, lo, hi)
        A, _ = dy.fit_constant(t, Z, law["qk_exponent"], lo, hi)
        rows.append({"parameterization": p, "ratio": r,
                     "OV law": "w ≈ log t" + (" + log log t" if law["ov_loglog"] else "") + " + b",
                     "OV exp. derived": law["ov_exponent"], "OV exp. fitted": a,
                     "b derived": law["ov_offset"], "b fitted": b,
                     "QK law": f"{law['qk_coordinate']} ≈ A log^β t",
                     "β derived": law["qk_exponent"], "β fitted": beta,
                     "A derived": law["qk_const"], "A fitted": A, "A fitted/derived": A / law["qk_const"]})
    return pd.DataFrame(rows)


def t3_table(runs: pd.DataFrame, cfg: dict, ratio: float = 1.0) -> pd.DataFrame:
    """Which QK quantity grows like a power of ``log t`` (T3), at ``ratio``: the log-log slope
    of ``q`` and of ``e^q`` against ``s = log t`` on the last fit window."""
    lo, hi = cfg["fit_windows"][-2], cfg["fit_windows"][-1]
    rows = []
    for p, g in runs[runs["ratio"] == ratio].groupby("parameterization", sort=False):
        t, q = g["t"].to_numpy(), g["q"].to_numpy()
        law = dy.asymptotic_law(p, dy.Sizes(cfg["n_classes"], cfg["n_common_vocab"], tuple(cfg["n_common"])),
                                cfg["eta_ov"], ratio)
        rows.append({"parameterization": p, "ratio": float(ratio), "q at end": q[-1],
                     "exponent of q in log t": dy.fit_power(t, q, lo, hi)[0],
                     "exponent of exp(q) in log t": dy.fit_power(t, np.exp(q), lo, hi)[0],
                     "derived exponent of exp(q)": law["qk_exponent"],
                     "derived log-log factor": "× log log t" if p.startswith("FA") else "none"})
    return pd.DataFrame(rows)


def t5_table(runs: pd.DataFrame, horizons: Sequence[float]) -> pd.DataFrame:
    """Attention mass on common tokens at each horizon (columns) for every parameterization
    and ratio (rows), from the ODE runs (interpolated in log time)."""
    rows = []
    for (p, r), g in runs.groupby(["parameterization", "ratio"], sort=False):
        tt = np.log1p(g["t"].to_numpy())
        rows.append({"parameterization": p, "ratio": r,
                     **{f"t={h:.0e}": float(np.interp(math.log1p(h), tt, g["common"].to_numpy())) for h in horizons}})
    return pd.DataFrame(rows).set_index(["parameterization", "ratio"])


def horizon_ranking(runs: pd.DataFrame, horizons: Sequence[float], ratio: float = 1.0) -> pd.DataFrame:
    """Attention mass on common tokens of each parameterization at each horizon ``t`` (ODE at
    ``ratio``, interpolated in log time; NaN for a parameterization without a run there), with
    the ranking (sharpest = least common mass first) per horizon."""
    rows = []
    for h in horizons:
        vals = {}
        for p, g in runs[runs["ratio"] == ratio].groupby("parameterization", sort=False):
            tt = np.log1p(g["t"].to_numpy())
            vals[p] = float(np.interp(math.log1p(h), tt, g["common"].to_numpy()))
        order = sorted(vals, key=lambda k: vals[k])  # least common mass = sharpest
        rows.append({"t": h, "ratio": float(ratio), **{f"common {p}": vals.get(p, float("nan")) for p in PARAMS},
                     "ranking": " > ".join(order)})
    return pd.DataFrame(rows)


def matched_loss_ranking(runs: pd.DataFrame, losses: Sequence[float], ratio: float = 1.0) -> pd.DataFrame:
    """Common-token mass of each parameterization when its loss first reaches each level
    (interpolated in log loss), and the ranking at that level (sharpest first)."""
    rows = []
    for L in losses:
        vals = {}
        for p, g in runs[runs["ratio"] == ratio].groupby("parameterization", sort=False):
            ll = np.log(g["loss"].to_numpy())[::-1]  # increasing
            if not (ll[0] <= math.log(L) <= ll[-1]):
                vals[p] = float("nan")
                continue
            vals[p] = float(np.exp(np.interp(math.log(L), ll, np.log(g["common"].to_numpy())[::-1])))
        order = sorted((k for k in vals if np.isfinite(vals[k])), key=lambda k: vals[k])
        rows.append({"loss": L, **{f"common {p}": vals[p] for p in PARAMS}, "ranking": " > ".join(order)})
    return pd.DataFrame(rows)


def init_sensitivity(sizes: dy.Sizes, cfg: dict, horizon: float, inits: Sequence[tuple[float, float]]) -> pd.DataFrame:
    """Ranking at equal rates (ratio 1) and one horizon from several symmetric inits."""
    rows = []
    for w0, q0 in inits:
        vals = {p: float(dy.integrate(p, w0, q0, sizes, cfg["eta_ov"], 1.0, t_max=horizon,
                                      t_eval=[0.0, horizon])["distinct"].iloc[-1]) for p in PARAMS}
        rows.append({"w0": w0, "q0": q0, **{f"distinct {p}": v for p, v in vals.items()},
                     "ranking": " > ".join(sorted(vals, key=lambda k: -vals[k]))})
    return pd.DataFrame(rows)


def line_check(sizes: dy.Sizes, cfg: dict, ratios: Sequence[float], single_n: int | None = None) -> pd.DataFrame:
    """T4: ODE trajectories in the line coordinates of :func:`qkov_lib.dynamics.line_coordinates`,
    for the task's mixture over ``n`` or for a single ``n``. Long table with X, Y and the
    residual ``Y - Y0 - slope (X - X0)`` relative to the range of ``Y``."""
    S = dy.Sizes(sizes.n_classes, sizes.n_common_vocab, (single_n,)) if single_n else sizes
    parts = []
    for p, r in itertools.product(PARAMS, ratios):
        f = dy.integrate(p, cfg["w0"], cfg["q0"], S, cfg["eta_ov"], r, t_max=1e12, n_points=120)
        X, Y = dy.line_coordinates(p, f["w"].to_numpy(), f["q"].to_numpy(), S)
        slope = dy.line_slope(r, S)
        f["X"], f["Y"] = X, Y
        f["residual"] = (Y - Y[0] - slope * (X - X[0])) / (Y.max() - Y.min())
        f["slope"] = slope
        f.insert(0, "ratio", float(r))
        f.insert(0, "parameterization", p)
        f["n"] = "mixture" if not single_n else str(single_n)
        parts.append(f)
    return pd.concat(parts, ignore_index=True)


def full_model_runs(cfg: dict, progress: bool = True) -> pd.DataFrame:
    """Full-model GD at ``eta_ov`` for every parameterization x ``full_ratios``: from the
    library's random balanced init (``init_scale``, one run per seed, as in the synthetic
    chapter) and from the symmetric state ``(w0, q0)``; the final population metrics and scalars.
    All runs train together, logged by the reduction chapter's probe (:func:`~qkov_lib.studies.reduction.probed_gd`)."""
    task = task_of(cfg)
    grid = list(itertools.product(PARAMS, cfg["full_ratios"], ["symmetric"] + [f"random {s}" for s in cfg["full_seeds"]]))

    def build(p: str, init: str) -> tuple[SyntheticModel, int]:
        if init == "symmetric":
            return symmetric_model(task, p, cfg["w0"], cfg["q0"]), 0
        seed = int(init.split()[1])
        return SyntheticModel(syn.make_embeddings(task, dtype=torch.float64), task.n_classes, parameterization=p,
                              init_scale=cfg["init_scale"], generator=seed_everything(seed), dtype=torch.float64), seed

    built = [build(p, init) for p, _, init in grid]
    cfgs = [TrainConfig.from_profile(cfg, optimizer="gd", ratio=r, steps=int(cfg["full_steps"]), seed=seed, progress=False)
            for (_, r, _), (_, seed) in zip(grid, built)]
    frames = probed_gd([m for m, _ in built], cfgs, task, cfg["w0"], cfg["q0"], progress, "full-model runs")
    rows = []
    for (p, r, init), (_, seed), f in zip(grid, built, frames):
        fin = f.iloc[-1]
        rows.append({"parameterization": p, "ratio": float(r), "init": "symmetric" if init == "symmetric" else "random",
                     "seed": seed, "loss": fin["loss"], "distinct": fin["attn_relevant"], "common": 1 - fin["attn_relevant"],
                     "ov": fin["ov"], "qk": fin["qk"], "off_subspace": fin["off_subspace"],
                     **{f"common@{lv:g}": c for lv, c in common_at_losses(f, T5_LOSSES).items()}})
    return pd.DataFrame(rows)


S2_NAMES = {"A": "the first summary (collapsed OV: CACO and FACO)", "B": "the second summary (CAFO and CACO)",
            "neither": "neither summary"}


def top2_verdict(ranking: str) -> tuple[str, str]:
    """``(top two, which S2 summary they match)`` of a ``"A > B > C > D"`` ranking (the pairs of
    ``claims.S2_PAIRS``)."""
    top = ranking.split(" > ")[:2]
    which = next((k for k, pair in C.S2_PAIRS.items() if pair == frozenset(top)), "neither")
    return " and ".join(top), S2_NAMES[which]


def full_ranking(full: pd.DataFrame, ratio: float, init: str) -> tuple[str, dict[str, float]]:
    """Ranking (sharpest first) of the mean attention on the distinct token over seeds."""
    sub = full[(full["ratio"] == ratio) & (full["init"] == init)]
    m = sub.groupby("parameterization")["distinct"].mean().to_dict()
    return " > ".join(sorted(m, key=lambda k: -m[k])), m


def rescaling_along(runs: pd.DataFrame, sizes: dy.Sizes, horizons: Sequence[float], ratio: float = 1.0) -> pd.DataFrame:
    """The implicit-rescaling ratio ``R_QK / R_OV`` (the factor by which factorization multiplies
    ``eta_QK / eta_OV`` in collapsed space) of each parameterization along its ODE run at ``ratio``,
    at each horizon."""
    rows = []
    for h in horizons:
        row = {"t": h}
        for p, g in runs[runs["ratio"] == ratio].groupby("parameterization", sort=False):
            tt = np.log1p(g["t"].to_numpy())
            w = float(np.interp(math.log1p(h), tt, g["w"].to_numpy()))
            q = float(np.interp(math.log1p(h), tt, g["q"].to_numpy()))
            r_ov, r_qk = dy.rate_factors(p, w, q, sizes)
            row[p] = float(r_qk / r_ov)
        rows.append(row)
    return pd.DataFrame(rows)


def crossover(runs: pd.DataFrame, a: str, b: str, ratio: float = 1.0, by: str = "t") -> float:
    """The first ``t`` (or, with ``by="loss"``, the loss level) after which ``b`` keeps less
    mass on common tokens than ``a`` along the ODE runs at ``ratio``; NaN if it never does."""
    sub = runs[runs["ratio"] == ratio]
    ga = sub[sub["parameterization"] == a].reset_index(drop=True)
    gb = sub[sub["parameterization"] == b].reset_index(drop=True)
    if by == "t":
        x = ga["t"].to_numpy()
        ca, cb = ga["common"].to_numpy(), gb["common"].to_numpy()
    else:  # compare at matched loss: interpolate b's common mass at a's loss levels
        x = ga["loss"].to_numpy()
        lb = np.log(gb["loss"].to_numpy())[::-1]
        ca = ga["common"].to_numpy()
        cb = np.exp(np.interp(np.log(x), lb, np.log(gb["common"].to_numpy())[::-1], left=np.nan, right=np.nan))
    keep = np.isfinite(ca) & np.isfinite(cb)
    x, ca, cb = x[keep], ca[keep], cb[keep]
    if not len(x):
        return float("nan")
    ahead = cb < ca
    if not ahead[-1]:
        return float("nan")
    last_behind = np.where(~ahead)[0]
    return float(x[last_behind[-1] + 1]) if len(last_behind) else float(x[0])


def equal_or_lowest(ratios: Sequence[float]) -> float:
    """1 (equal rates) when it is among ``ratios``, else the lowest ratio (what the chapter shows
    when equal rates were not run)."""
    rs = [float(r) for r in ratios]
    return 1.0 if 1.0 in rs else min(rs)


def end_common(runs: pd.DataFrame) -> pd.Series:
    """Attention mass on common tokens at the last time of each (parameterization, ratio) ODE run."""
    last = runs.loc[runs.groupby(["parameterization", "ratio"])["t"].idxmax()]
    return last.set_index(["parameterization", "ratio"])["common"].sort_index()


def full_means(full: pd.DataFrame, init: str = "random") -> pd.Series:
    """Mean over seeds of the full-model attention on the distinct token, per (parameterization, ratio)."""
    return full[full["init"] == init].groupby(["parameterization", "ratio"])["distinct"].mean()


def constant_scaling(table: pd.DataFrame) -> pd.Series:
    """Per parameterization: the fitted constant A at the highest ratio over the one at the lowest,
    divided by the same quotient of the derived A (1 = A scales with the ratio as derived). Empty
    with one ratio."""
    out = {}
    for p, g in table.groupby("parameterization", sort=False):
        g = g.sort_values("ratio")
        if len(g) >= 2:
            lo, hi = g.iloc[0], g.iloc[-1]
            out[p] = float((hi["A fitted"] / lo["A fitted"]) / (hi["A derived"] / lo["A derived"]))
    return pd.Series(out, dtype=float)


def t3_cells(table: pd.DataFrame, t3: pd.DataFrame) -> dict[str, C.Change]:
    """T3's cells (fits of the ODE, exact values): per parameterization and ratio, the gap between
    the OV scalar's fitted exponent in log t and the derived one (1); per parameterization, the gap
    between the fitted exponent of exp(q) in log t and the claim's 2 (the QK side as exp(q))."""
    ov = {f"OV scalar ~ log t, {r['parameterization']}, ratio {r['ratio']:g}":
          C.Change.exact(abs(float(r["OV exp. fitted"]) - float(r["OV exp. derived"]))) for _, r in table.iterrows()}
    return {**ov, **{f"exp(q) ~ log² t, {r['parameterization']}":
                     C.Change.exact(abs(float(r["exponent of exp(q) in log t"]) - 2.0)) for _, r in t3.iterrows()}}


# T4 reads two quantities: the line at fixed n (its estimand, exact) and with the mixture over n.
T4_MIXTURE = C.Estimand("relative residual of the effective (OV, QK) path off a straight line, mixture over n", -1,
                        C.LINE_APPROX)


def t4_inputs(lines_single: pd.DataFrame, lines_mix: pd.DataFrame) -> tuple[float, float]:
    """The largest |relative residual| off the line for a single n and for the mixture."""
    return float(lines_single["residual"].abs().max()), float(lines_mix["residual"].abs().max())


def t4_cells(lines_single: pd.DataFrame, lines_mix: pd.DataFrame, single_n: str = ""
             ) -> tuple[dict[str, C.Change], dict[str, C.Estimand]]:
    """T4's cells: per parameterization, the largest |residual| off the line over its ratios, at
    a fixed n (``fixed n = k``) and with the mixture over n; and each cell's estimand."""
    cells, est = {}, {}
    for frame, name, e in ((lines_single, f"fixed n{' = ' + single_n if single_n else ''}", C.ESTIMANDS["T4"]),
                           (lines_mix, "mixture over n", T4_MIXTURE)):
        for p, g in frame.groupby("parameterization", sort=False):
            k = f"{name}, {p}"
            cells[k], est[k] = C.Change.exact(float(g["residual"].abs().max())), e
    return cells, est


T5_LOSSES = (0.3, 0.1, 0.03, 0.01)  # training losses at which the ODE's common-token mass is compared across ratios


def ode_common_at_loss(runs: pd.DataFrame, levels: Sequence[float] = T5_LOSSES) -> pd.DataFrame:
    """The ODE's attention mass on common tokens where its loss first reaches each of ``levels``
    (interpolated in log loss along the trajectory), per (parameterization, ratio): rows
    (parameterization, ratio), one column per level (NaN where a trajectory never reaches it)."""
    rows = []
    for (p, r), g in runs.groupby(["parameterization", "ratio"], sort=False):
        g = g.sort_values("t")
        x = -np.log(np.minimum.accumulate(g["loss"].to_numpy()))  # running minimum: increasing in t
        y = g["common"].to_numpy()
        x, idx = np.unique(x, return_index=True)
        rows.append({"parameterization": p, "ratio": float(r),
                     **{lv: float(np.interp(-math.log(lv), x, y[idx])) if x[0] <= -math.log(lv) <= x[-1] else np.nan
                        for lv in levels}})
    return pd.DataFrame(rows).set_index(["parameterization", "ratio"]).sort_index()


def common_at_losses(history: pd.DataFrame, levels: Sequence[float]) -> dict[float, float]:
    """The common-token mass ``1 - attn_relevant`` of one logged run when its training loss first
    reached each of ``levels`` (nats), interpolated linearly in (log loss, log mass) between the
    two logged steps around the crossing; NaN for a level the run never reached."""
    log_c = np.log(np.clip(1.0 - history["attn_relevant"].to_numpy(dtype=float), 1e-300, None))
    at = np.exp(at_levels(history["loss"].to_numpy(dtype=float), log_c, levels))
    return {float(lv): float(c) for lv, c in zip(levels, at)}


def t5_full_level(full: pd.DataFrame) -> float | None:
    """The deepest level of :data:`T5_LOSSES` that every random-init full-model run at the lowest
    and the highest full-model ratio reached (None: none, or one ratio), where T5 compares them."""
    rand = full[full["init"] == "random"]
    ratios = sorted(set(rand["ratio"]))
    if len(ratios) < 2:
        return None
    ends = rand[rand["ratio"].isin([ratios[0], ratios[-1]])]
    reached = [lv for lv in T5_LOSSES if f"common@{lv:g}" in ends and ends[f"common@{lv:g}"].notna().all()]
    return min(reached) if reached else None


def _fall(lo: float, hi: float) -> float:
    """Fall of the log common-token mass from ``lo`` to ``hi`` (nats; positive: it shrank)."""
    return math.log(max(lo, 1e-300)) - math.log(max(hi, 1e-300))


def t5_cells(runs: pd.DataFrame, full: pd.DataFrame) -> tuple[dict[str, C.Change], dict[str, C.Change]]:
    """T5's cells, per parameterization and step of the ratio: in the ODE (exact), at every level
    of :data:`T5_LOSSES` reached at both ratios of the step, the fall of the log common-token mass
    (:func:`ode_common_at_loss`); in the full model, from the lowest to the highest full-model ratio
    at :func:`t5_full_level`, the per-seed fall over the random-init seeds run at both (a
    :class:`qkov_lib.claims.Change`). The log keeps moving where the attention saturates."""
    at = ode_common_at_loss(runs)
    ode = {}
    for p in PARAMS:
        if p not in at.index.get_level_values(0):
            continue
        sub = at.loc[p].sort_index()
        rs = list(sub.index)
        for lo, hi in zip(rs, rs[1:]):
            for lv in sub.columns:
                a, b = sub.loc[lo, lv], sub.loc[hi, lv]
                if np.isfinite(a) and np.isfinite(b):
                    ode[f"ODE, {p}, ratio {lo:g} → {hi:g}, loss {lv:g}"] = C.Change.exact(_fall(a, b))
    rand = full[full["init"] == "random"]
    fratios, level, seeded = sorted(set(rand["ratio"])), t5_full_level(full), {}
    if level is not None:
        lo, hi, col = fratios[0], fratios[-1], f"common@{level:g}"
        for p in PARAMS:
            a = rand[(rand.parameterization == p) & (rand.ratio == lo)].set_index("seed")[col]
            b = rand[(rand.parameterization == p) & (rand.ratio == hi)].set_index("seed")[col]
            seeds = sorted(set(a.index) & set(b.index))
            if seeds:
                seeded[f"full model, {p}, ratio {lo:g} → {hi:g}, loss {level:g}"] = C.Change.of(
                    [_fall(a[s], b[s]) for s in seeds])
    return ode, seeded


T6_PAIRS = (("FACO", "CACO"), ("FAFO", "CAFO"))  # (factorized QK, collapsed QK) with the same OV circuit


def t6_cells(full: pd.DataFrame, phase_ode: pd.DataFrame | None = None, phase_runs: pd.DataFrame | None = None
             ) -> tuple[dict[str, C.Change], dict[str, C.Change]]:
    """T6's cells at equal rates (ratio 1): the log-odds of the attention on the distinct token,
    factorized QK minus collapsed QK with the same OV circuit (FACO - CACO, FAFO - CAFO). Exact: at
    every cell of the S2 phase map's ODE at ratio 1 (``phase_ode``, :func:`qkov_lib.studies.s2_phase.ode_map`).
    Over seeds (paired by seed): the random-init full-model runs of this chapter (``full``, at their
    last step) and the phase map's full-model cells at ratio 1 (``phase_runs``, at the cell's loss)."""
    exact, seeded = {}, {}
    if phase_ode is not None and len(phase_ode):
        for _, r in phase_ode[phase_ode["ratio"] == 1.0].iterrows():
            for fa, ca in T6_PAIRS:
                exact[f"ODE, {fa} vs {ca}, init {r['init']:g}, n {r['n']}, loss {r['loss']:g}"] = C.Change.exact(
                    float(r[f"logodds {fa}"] - r[f"logodds {ca}"]))
    rand = full[(full["init"] == "random") & (full["ratio"] == 1.0)]
    tabs = {"full model, end of training": rand.pivot_table(index="seed", columns="parameterization",
                                                             values="distinct")} if len(rand) else {}
    if phase_runs is not None and len(phase_runs):
        for (i, n, L), g in phase_runs[phase_runs["ratio"] == 1.0].groupby(["init", "n", "loss"], sort=False):
            tabs[f"full model, init {i:g}, n {n}, loss {L:g}"] = g.pivot_table(index="seed", columns="parameterization",
                                                                               values="attention")
    for where, tab in tabs.items():
        for fa, ca in T6_PAIRS:
            if fa in tab and ca in tab:
                d = (tab[fa].map(C.log_odds) - tab[ca].map(C.log_odds)).dropna()
                seeded[f"{where}: {fa} vs {ca}"] = C.Change.of(d.tolist())
    return exact, seeded


def s2_inputs(full: pd.DataFrame) -> tuple[dict[str, float], str | None]:
    """S2's numbers from the random-init full-model runs: the mean attention on the distinct token
    of each parameterization at ratio 1, and where FAFO moves at the highest ratio above 1
    (:func:`qkov_lib.claims.s2_fafo_move` on its attention gap to FACO and CACO at ratio 1, a tie tested over
    FAFO's random-init seeds; None
    without such a ratio)."""
    fr = full_means(full)
    att = {p: float(fr[(p, 1.0)]) for p in PARAMS if (p, 1.0) in fr.index}
    higher = sorted(r for r in set(fr.index.get_level_values(1)) if r > 1.0)
    if not higher or not {"FAFO", "FACO", "CACO"} <= set(att) or ("FAFO", higher[-1]) not in fr.index:
        return att, None
    fa_hi = float(fr[("FAFO", higher[-1])])
    before = {p: abs(att["FAFO"] - att[p]) for p in ("FACO", "CACO")}
    after = {p: abs(fa_hi - att[p]) for p in ("FACO", "CACO")}
    seeds = full[(full["init"] == "random") & (full["parameterization"] == "FAFO") & (full["ratio"] == higher[-1])]
    gap = C.Change.of([abs(a - att["FACO"]) - abs(a - att["CACO"]) for a in seeds["distinct"]])
    return att, C.s2_fafo_move(before, after, gap)


def law_readings(table: pd.DataFrame, t3: pd.DataFrame, lines_single: pd.DataFrame,
                 lines_mix: pd.DataFrame) -> dict[str, list[C.Reading]]:
    """Every cell of T3 (the fitted growth laws, :func:`t3_cells`) and T4 (the line law,
    :func:`t4_cells`) read by the one rule (:func:`qkov_lib.studies.synthetic.read`): the claims of
    the long-time laws page, all on the reduced ODE."""
    single_n = str(int(lines_single["n"].iloc[0])) if len(lines_single) and "n" in lines_single else ""
    t4, t4_est = t4_cells(lines_single, lines_mix, single_n)
    return {"T3": base.read(C.ESTIMANDS["T3"], t3_cells(table, t3)), "T4": base.read(t4_est, t4)}


def ranking_readings(runs: pd.DataFrame, full: pd.DataFrame, phase_ode: pd.DataFrame | None = None,
                     phase_runs: pd.DataFrame | None = None) -> dict[str, list[C.Reading]]:
    """Every cell of T5 (:func:`t5_cells`: the ODE's long runs ``runs`` and the full-model runs
    ``full``) and T6 (:func:`t6_cells`, which also reads the S2 phase map at ratio 1, ``phase_ode``
    and ``phase_runs``, when given) read by the one rule; the exact ODE cells and the cells over
    seeds are separate Bonferroni families."""
    return {"T5": base.read(C.ESTIMANDS["T5"], *t5_cells(runs, full)),
            "T6": base.read(C.ESTIMANDS["T6"], *t6_cells(full, phase_ode, phase_runs))}


def asymptotics_verdicts(readings: Mapping[str, Sequence[C.Reading]]) -> dict[str, Verdict]:
    """The verdict of each claim of ``readings`` (:func:`law_readings`: T3, T4;
    :func:`ranking_readings`: T5, T6) by :func:`qkov_lib.studies.synthetic.verdict`. (S2 is decided
    on the phase diagram of :mod:`qkov_lib.studies.s2_phase`, which its page adds to these.)"""
    rule = {"T4": f"{C.ESTIMANDS['T4'].text()}; {T4_MIXTURE.text()}"}
    return {k: base.verdict(r, C.ESTIMANDS[k], rule.get(k, "")) for k, r in readings.items()}


def _named(readings: Sequence[C.Reading], outcome: str, prefix: str = "") -> list[str]:
    """The cells of ``readings`` with ``outcome`` whose name starts with ``prefix`` (prefix cut)."""
    return [r.cell[len(prefix):] for r in readings if r.outcome == outcome and r.cell.startswith(prefix)]


def _list(items: Sequence[str]) -> str:
    return ", ".join(items) if items else "none"


def _common_facts(cfg: dict) -> dict[str, Any]:
    """What both theory pages quote of the ODE settings: the thresholds, the one rule, the lowest,
    highest and equal ratio, the fit window and the end of the integration."""
    f: dict[str, Any] = {f"thr_{n.lower()}": C.threshold_text(n)
                         for n in ("SLOPE_TOL", "LITERAL_TOL", "LINE_EXACT", "LINE_APPROX", "SHARPER", "CONST_TOL")}
    f["one_rule"] = C.ONE_RULE
    ratios = sorted(float(r) for r in cfg["ratios"])
    f["r_lo"], f["r_hi"], f["r_eq"] = f"{ratios[0]:g}", f"{ratios[-1]:g}", f"{equal_or_lowest(ratios):g}"
    f["t_fit_lo"], f["t_fit_hi"] = f"{cfg['fit_windows'][-2]:.0e}", f"{cfg['fit_windows'][-1]:.0e}"
    f["t_end"], f["s_end"] = f"{cfg['t_max']:.0e}", f"{math.log(cfg['t_max']):.0f}"
    return f


def law_facts(table: pd.DataFrame, t3: pd.DataFrame, lines_single: pd.DataFrame, lines_mix: pd.DataFrame,
              sizes: dy.Sizes, cfg: dict, readings: Mapping[str, Sequence[C.Reading]],
              verdicts: Mapping[str, Verdict]) -> dict[str, Any]:
    """Every number, verdict, rule and threshold the long-time laws page (T3, T4) quotes, as glue
    strings computed from its tables, plus the comparisons that choose its sentences (bools and
    words); the sentences that count or name cells are computed from T3's ``readings``
    (:func:`law_readings`)."""
    f = _common_facts(cfg)
    ratios = sorted(float(r) for r in cfg["ratios"])
    f.update(_t3_facts(table, t3, equal_or_lowest(ratios), readings["T3"]))
    f.update(_t4_facts(lines_single, lines_mix))
    f["kappa_qk"], f["nbar"] = f"{sizes.kappa_qk:.4g}", f"{sizes.n_mean:g}"
    f["K"], f["M"] = str(sizes.n_classes), str(sizes.n_common_vocab)
    f["n_star_cafo"] = f"{dy.asymptotic_law('CAFO', sizes, cfg['eta_ov'], ratios[0])['n_star']:.2f}"
    f.update(C.verdict_glue(verdicts))
    return f


def ranking_facts(runs: pd.DataFrame, hz: pd.DataFrame, ml: pd.DataFrame, full: pd.DataFrame, cfg: dict,
                  readings: Mapping[str, Sequence[C.Reading]], verdicts: Mapping[str, Verdict]) -> dict[str, Any]:
    """Every number, verdict, rule and threshold the sharpness page (T5, T6; S2's phase map adds
    :func:`qkov_lib.studies.s2_phase.phase_facts`) quotes, as glue strings computed from its tables
    (the ODE's long runs ``runs``, its rankings ``hz`` and ``ml``, the full-model runs ``full``),
    plus the comparisons that choose its sentences; the sentences that count or name cells are
    computed from the ``readings`` of :func:`ranking_readings`."""
    f = _common_facts(cfg)
    ratios = sorted(float(r) for r in cfg["ratios"])
    f.update(_t5_facts(runs, full, ratios, readings["T5"]))
    f.update(_ranking_facts(runs, hz, ml, full, cfg, equal_or_lowest(ratios)))
    f["t6_sentence"] = _cells_sentence(
        "Factorized QK is sharper than collapsed QK with the same OV circuit (log-odds of the attention on the "
        "distinct token, FACO over CACO and FAFO over CAFO, at equal rates)", readings["T6"])
    att, move = s2_inputs(full)
    f["fafo_toward"] = move or "not tested"
    if move is not None:
        fhi = max(full_means(full).index.get_level_values(1))
        f["fafo_lo"], f["fafo_hi"] = f"{att['FAFO']:.4f}", f"{float(full_means(full)[('FAFO', fhi)]):.4f}"
        f["faco_lo"], f["caco_lo"] = f"{att['FACO']:.4f}", f"{att['CACO']:.4f}"
    f.update(C.verdict_glue(verdicts))
    return f


def _cells_sentence(what: str, readings: Sequence[C.Reading]) -> str:
    """``<what>: holds at k of n cells; contradicted at <named or counted>; undecided at ...``:
    a sentence that counts and names exactly the cells read."""
    if not readings:
        return f"{what}: no cell was measured."
    n, parts = len(readings), []
    for o in C.OUTCOMES:
        c = [r for r in readings if r.outcome == o]
        if c:
            names = ", ".join(f"{r.cell} ({r.text()})" for r in c) if len(c) <= 5 else ""
            parts.append(f"{o} at {len(c)} of {n} cells" + (f": {names}" if names else ""))
    return f"{what}: " + "; ".join(parts) + "."


def _t3_facts(table: pd.DataFrame, t3: pd.DataFrame, eq: float, readings: Sequence[C.Reading]) -> dict[str, Any]:
    """T3: the fitted OV exponents, beta and A against their derived values, the growth exponents
    of q and exp(q) in log t per parameterization, and where exp(q) ~ log² t holds and where it is
    contradicted (from T3's ``readings``)."""
    ov = table["OV exp. fitted"].astype(float)
    a_gap = (table["A fitted/derived"] - 1).abs()
    scale = constant_scaling(table)
    f: dict[str, Any] = {
        "ov_slope_range": f"{ov.min():.3f}–{ov.max():.3f}",
        "beta_err": f"{(table['β fitted'] - table['β derived']).abs().max():.3f}",
        "A_err": f"{a_gap.max() * 100:.1f}%", "A_err_worst": str(table.loc[a_gap.idxmax(), "parameterization"]),
        "A_tested": not scale.empty,
        "A_scaling": ", ".join(f"{p} {v:.2f}" for p, v in scale.items()) or "not tested (one ratio)",
        "A_agree": _list([p for p, v in scale.items() if abs(v - 1) <= C.CONST_TOL]),
        "A_off": ", ".join(f"{p} ({v:.2f})" for p, v in scale.items() if abs(v - 1) > C.CONST_TOL)}
    by = t3.set_index("parameterization")
    for p in PARAMS:
        have = p in by.index
        f[f"q_exp_{p}"] = f"{by.loc[p, 'exponent of q in log t']:.2f}" if have else "nan"
        f[f"eq_exp_{p}"] = f"{by.loc[p, 'exponent of exp(q) in log t']:.2f}" if have else "nan"
        f[f"q_end_{p}"] = f"{by.loc[p, 'q at end']:.1f}" if have else "nan"
    f["t3_ratio"] = f"{float(t3['ratio'].iloc[0]) if 'ratio' in t3 and len(t3) else eq:g}"
    f["ov_ok"] = bool((ov - 1).abs().max() <= C.SLOPE_TOL)
    q_exps = t3["exponent of q in log t"].astype(float)
    f["q_literal"] = bool(((q_exps - 2).abs() <= C.LITERAL_TOL).any())
    caco_exp = float(by.loc["CACO", "exponent of exp(q) in log t"]) if "CACO" in by.index else float("nan")
    f["expq_ok"], f["caco_expq"] = bool(abs(caco_exp - 2) <= C.SLOPE_TOL), f"{caco_exp:.2f}"
    f["q_exp_max"] = f"{q_exps.max():.2f}"
    prefix = "exp(q) ~ log² t, "
    fit = lambda p: f"{by.loc[p, 'exponent of exp(q) in log t']:.2f}"  # noqa: E731
    f["t3_expq_holds"] = _list(_named(readings, "holds", prefix))
    f["t3_law"] = "; ".join(f"exp(q) ~ log² t {label} for " + ", ".join(f"{p} (fitted {fit(p)})" for p in ps)
                            for label, ps in (("holds", _named(readings, "holds", prefix)),
                                              ("is contradicted", _named(readings, "contradicted", prefix)),
                                              ("is undecided", _named(readings, "undecided", prefix))) if ps) or \
        "exp(q) was not fitted"
    f["expq_fits"] = ", ".join(f"{p} {by.loc[p, 'exponent of exp(q) in log t']:.2f} "
                               f"(derived {by.loc[p, 'derived exponent of exp(q)']:g}"
                               + (" × log log t" if p.startswith("FA") else "") + ")" for p in PARAMS if p in by.index)
    return f


def _t5_facts(runs: pd.DataFrame, full: pd.DataFrame, ratios: Sequence[float],
              readings: Sequence[C.Reading]) -> dict[str, Any]:
    """T5: the ODE's attention on common tokens at the end (ratio x value product, whether it
    falls with the ratio), and T5's cells at matched loss (``readings``), ODE and full model, in
    one sentence each."""
    r_lo, r_hi = ratios[0], ratios[-1]
    end = end_common(runs)
    falls = {p: bool(np.all(np.diff(end.loc[p].to_numpy()) < 0)) for p in PARAMS if p in end.index.get_level_values(0)}
    f: dict[str, Any] = {"t5_tested": r_hi > r_lo, "t5_prod": "n/a", "t5_mono": "not tested (one ratio)"}
    if r_hi > r_lo:
        prod = {p: float(end.loc[(p, r_hi)] * r_hi / (end.loc[(p, r_lo)] * r_lo)) for p in falls}
        f["t5_closest"] = closest = min(prod, key=lambda p: abs(prod[p] - 1))
        f["t5_closest_value"] = f"{prod[closest]:.2f}"
        f["t5_prod"] = ", ".join(f"{p} {v:.2f}" for p, v in prod.items())
        f["t5_mono"] = (f"falls strictly with the ratio for {sum(falls.values())} of {len(falls)} parameterizations"
                        + ("" if all(falls.values()) else f" (not for {_list([p for p, v in falls.items() if not v])})"))
    fratios = sorted(set(full_means(full).index.get_level_values(1))) or [math.nan]
    f["full_r_lo"], f["full_r_hi"] = f"{fratios[0]:g}", f"{fratios[-1]:g}"
    fall = "the fall of the log common-token mass from one ratio to the next at matched training loss"
    f["t5_matched_sentence"] = " ".join(_cells_sentence(f"{who}, {fall}", [r for r in readings if r.cell.startswith(k)])
                                        for who, k in (("In the ODE", "ODE"), ("In the full model", "full model")))
    return f


def _t4_facts(lines_single: pd.DataFrame, lines_mix: pd.DataFrame) -> dict[str, Any]:
    """T4: the residuals of the line law on single-class and mixed-class inputs."""
    res_single, res_mix_max = t4_inputs(lines_single, lines_mix)
    res_mix = lines_mix.groupby(["parameterization", "ratio"])["residual"].apply(lambda x: x.abs().max())
    return {"line_res_single": f"{res_single:.1e}", "line_res_mix": f"{res_mix_max * 100:.1f}%",
            "line_res_mix_worst": "{} at ratio {:g}".format(*res_mix.idxmax()),
            "line_res_mix_best": f"{res_mix.min() * 100:.2g}%", "line_approx_pct": f"{C.LINE_APPROX:.0%}",
            "single_n": str(int(lines_single["n"].iloc[0])),
            "single_exact": bool(res_single <= C.LINE_EXACT), "mix_approx": bool(res_mix_max <= C.LINE_APPROX)}


def _ranking_facts(runs: pd.DataFrame, hz: pd.DataFrame, ml: pd.DataFrame, full: pd.DataFrame, cfg: dict,
                   eq: float) -> dict[str, Any]:
    """The rankings at equal rates: the ODE's by time and by loss, the FAFO/CACO crossover, and
    the full models' (random and symmetric init) with their top two and CAFO's place."""
    nan = float("nan")
    f: dict[str, Any] = {"rank_first": hz["ranking"].iloc[0], "t_first": f"{hz['t'].iloc[0]:.0e}",
                         "rank_last": hz["ranking"].iloc[-1], "t_last": f"{hz['t'].iloc[-1]:.0e}",
                         "rank_ml_first": ml["ranking"].iloc[0], "rank_ml_last": ml["ranking"].iloc[-1],
                         "ml_first": f"{ml['loss'].iloc[0]:.0e}", "ml_last": f"{ml['loss'].iloc[-1]:.0e}"}
    tx = crossover(runs, "FAFO", "CACO", eq, "t")
    lx = crossover(runs, "FAFO", "CACO", eq, "loss")
    first_loss = float(runs[(runs["ratio"] == eq) & (runs["parameterization"] == "FAFO")]["loss"].iloc[0])
    f["cross_t"] = f"{tx:.1e}" if np.isfinite(tx) else "never (within the integration)"
    f["cross_t_found"] = bool(np.isfinite(tx))
    f["cross_after_horizon"] = bool(np.isfinite(tx) and tx > cfg["full_steps"])
    # "never", "always" (already below the first loss level) or "below" cross_loss_short
    f["cross_loss_kind"] = "never" if not np.isfinite(lx) else "always" if lx >= 0.99 * first_loss else "below"
    f["cross_loss_short"] = f"{lx:.1e}" if np.isfinite(lx) else "never"
    f["full_steps"], f["eta_ov"], f["n_seeds"] = str(cfg["full_steps"]), f"{cfg['eta_ov']:g}", str(len(cfg["full_seeds"]))
    feq = equal_or_lowest(sorted(set(full_means(full).index.get_level_values(1))))
    f["full_r_eq"] = f"{feq:g}"
    rank_rand, m_rand = full_ranking(full, feq, "random")
    rank_sym, m_sym = full_ranking(full, feq, "symmetric")
    ode_at = horizon_ranking(runs, [float(cfg["full_steps"])], eq)["ranking"].iloc[0]
    f["rank_full_random"], f["rank_full_sym"], f["rank_ode_full"] = rank_rand, rank_sym, ode_at
    f["full_sym_vs_random"] = f"{max((abs(m_rand[p] - m_sym[p]) for p in m_rand if p in m_sym), default=nan):.4f}"
    f["top2_full"], f["s2_full"] = top2_verdict(rank_rand)
    f["top2_asym"], f["s2_asym"] = top2_verdict(f["rank_last"])
    last_of = {rk.split(" > ")[-1] for rk in [rank_rand, rank_sym, ode_at, *hz["ranking"], *ml["ranking"]] if rk}
    f["cafo_last"] = "last in every regime" if last_of == {"CAFO"} else "not always last"
    for p in PARAMS:
        f[f"full_{p}"] = f"{m_rand[p]:.4f}" if p in m_rand else "nan"
    if "FAFO" in m_rand:
        f["fafo_place"] = rank_rand.split(" > ").index("FAFO") + 1  # 1 = sharpest
        f["fafo_weak"], f["fafo_mean"] = bool(m_rand["FAFO"] < 0.5), f"{m_rand['FAFO']:.3f}"
        f["n_ranked"] = str(len(rank_rand.split(" > ")))
    return f


#: the page that decides T3 and T4 (the long-time laws); T5, T6 and S2 are decided on :data:`RANKING_PAGE`
LAW_PAGE = "03_theory_asymptotics"
RANKING_PAGE = PAGE


def law_claims(f: Mapping[str, str], verdicts: Mapping[str, Verdict]) -> list[dict[str, str]]:
    """Scorecard rows for T3 and T4: numbers from :func:`law_facts`, verdicts (with rule and
    reason) from :func:`asymptotics_verdicts`."""
    ch = LAW_PAGE
    return [
        claim("T3", "OV scalar ~ log t; QK scalar ~ log^2 t (or exp(QK) ~ log^2 t); constants set by the ratio",
              f"fitted exponent of w in log t {f['ov_slope_range']}; of q at most {f['q_exp_max']} (q = "
              f"{f['q_end_CACO']} at t = {f['t_end']} for CACO); of exp(q): {f['expq_fits']}; fitted over derived "
              f"scaling of the constants with the ratio: {f['A_scaling']}", verdicts["T3"], ch),
        claim("T4", "in suitable coordinates the effective OV and QK parameters move along a line; the rates set the relative speed",
              f"straight line of slope ratio*n in (X(w), Y(q)) with residual {f['line_res_single']} when every "
              f"sequence has n = {f['single_n']} common tokens; with the mixture over n residual up to "
              f"{f['line_res_mix']} ({f['line_res_mix_worst']})", verdicts["T4"], ch),
    ]


def ranking_claims(f: Mapping[str, str], verdicts: Mapping[str, Verdict]) -> list[dict[str, str]]:
    """Scorecard rows for T5 and T6: numbers from :func:`ranking_facts`, verdicts (with rule and
    reason) from :func:`asymptotics_verdicts`."""
    ch = RANKING_PAGE
    return [
        claim("T5", "faster QK learning puts more attention on relevant tokens; common-token mass shrinks faster with the ratio",
              f"{f['t5_matched_sentence']} At the end of the ODE the common mass {f['t5_mono']}.", verdicts["T5"], ch),
        claim("T6", "at equal rates factorized and collapsed models differ; factorized QK gives sharper attention",
              f["t6_sentence"], verdicts["T6"], ch),
    ]



def law_sentences(f: Mapping[str, Any]) -> dict[str, str]:
    """The sentences the long-time laws page quotes (glue strings by name: ``t3_sentence``,
    ``t4_single_sentence``, ...), each chosen by a comparison that :func:`law_facts` made (its
    bools and words) and filled with its numbers."""
    s: dict[str, str] = {}
    s["A_err_why"] = ("its tilt correction w e^{-q} ~ 1/(A q) decays only like 1/log log t" if f["A_err_worst"] == "FAFO"
                      else "its corrections decay like 1/log t")
    s["A_sentence"] = (
        f"From ratio {f['r_lo']} to {f['r_hi']} the fitted constants grow by the derived factor within {f['thr_const_tol']} "
        f"(relative) for {f['A_agree']}" + (f"; not for {f['A_off']}" if f["A_off"] else "")
        + f" (fitted over derived scaling: {f['A_scaling']})." if f["A_tested"]
        else "With one ratio, how the constants scale with the ratio is not tested.")
    s["ov_sentence"] = (
        f"The OV scalar grows like log t in all four parameterizations: its fitted exponents lie in "
        f"{f['ov_slope_range']}, within {f['thr_slope_tol']} of 1." if f["ov_ok"] else
        f"The OV scalar's fitted exponents in log t lie in {f['ov_slope_range']}, NOT all within {f['thr_slope_tol']} of 1.")
    s["q_sentence"] = (
        f"The QK scalar q does grow like log² t here: a fitted exponent of q in log t is within {f['thr_literal_tol']} of 2."
        if f["q_literal"] else
        f"The QK scalar q does **not** grow like log² t: its fitted exponent in log t is at most {f['q_exp_max']}, more "
        f"than {f['thr_literal_tol']} away from 2, and at t = {f['t_end']} it has only reached q = {f['q_end_CACO']} "
        "(CACO); the derivation gives q ≈ log log t.")
    s["expq_sentence"] = (
        "It is exp(q), the odds of attending to the distinct token rather than a given common token, that grows like "
        f"log² t for CACO: fitted exponent {f['caco_expq']}, within {f['thr_slope_tol']} of 2." if f["expq_ok"] else
        f"Even exp(q) does not grow like log² t for CACO: fitted exponent {f['caco_expq']}, more than "
        f"{f['thr_slope_tol']} from 2.")
    s["t3_sentence"] = (
        "The QK scalar does grow like log² t here." if f["q_literal"] else
        "The QK scalar grows like log log t, not like log² t: only exp(q) grows like a power of log t, and like log² t "
        f"within the rule for {f['t3_expq_holds']}; a factorized OV circuit learns at rate 2 eta |w| and takes away the "
        "loss that drives QK learning.")
    s["t4_single_sentence"] = (
        f"For n = {f['single_n']} the residual is {f['line_res_single']}, "
        + (f"within {f['thr_line_exact']}: integration error, so the line is exact." if f["single_exact"] else
           f"above {f['thr_line_exact']}, so the line is NOT exact here."))
    s["t4_mix_sentence"] = (
        f"With the mixture over n that the book's task uses, the residual reaches {f['line_res_mix']} "
        f"({f['line_res_mix_worst']}) and is as small as {f['line_res_mix_best']} in the best case: "
        + (f"within {f['thr_line_approx']} ({f['line_approx_pct']}), so the line holds approximately." if f["mix_approx"]
           else f"above {f['thr_line_approx']} ({f['line_approx_pct']}), so with the mixture it is not a line at this "
           "precision (the derivation gives one only asymptotically)."))
    s["t4_sentence"] = (
        f"T4: the line at fixed n is {'exact' if f['single_exact'] else 'NOT exact'} (residual {f['line_res_single']}); "
        f"with the mixture over n the residual reaches {f['line_res_mix']}, "
        + ("within" if f["mix_approx"] else "beyond") + f" {f['thr_line_approx']}.")
    return s


def ranking_sentences(f: Mapping[str, Any]) -> dict[str, str]:
    """The sentences the sharpness page quotes outside the S2 phase map (glue strings by name:
    ``t5_ode_sentence``, ``fafo_lead``, ``s2_horizon_sentence``, ...), each chosen by a comparison
    that :func:`ranking_facts` made and filled with its numbers (``second_pair`` also quotes the
    phase map's ``s2p_share_B``, :func:`qkov_lib.studies.s2_phase.phase_facts`)."""
    s: dict[str, str] = {}
    s["t5_ode_sentence"] = (
        f"In the ODE the attention mass on common tokens at t = {f['t_end']} {f['t5_mono']}. The derivation predicts 1/r "
        f"at late times: the product (mass × ratio) at ratio {f['r_hi']} divided by the same product at ratio "
        f"{f['r_lo']} is {f['t5_prod']}. A value of 1 would mean exactly 1/r; {f.get('t5_closest')} comes closest "
        f"({f.get('t5_closest_value')})." if f["t5_tested"] else
        f"With one ODE ratio ({f['r_lo']}) the dependence on the ratio is not tested.")
    cross_loss = {"never": "CACO never becomes sharper than FAFO at matched loss (within the integration)",
                  "always": "at matched loss, CACO is sharper than FAFO at every loss level"}.get(
        f["cross_loss_kind"], f"at matched loss, CACO is sharper than FAFO only below a loss of {f['cross_loss_short']} nats")
    s["cross_sentence"] = (f"at equal time, CACO becomes sharper than FAFO after t ≈ {f['cross_t']} steps" if f["cross_t_found"]
                           else "at equal time, CACO does not become sharper than FAFO within the integration") + f"; {cross_loss}"
    s["fafo_lead"] = (f"FAFO therefore leads CACO early, and CACO overtakes it only after t ≈ {f['cross_t']} steps."
                      if f["cross_after_horizon"] else "In this task CACO is already ahead of FAFO at the training horizon."
                      if f["cross_t_found"] else "In this task CACO does not overtake FAFO within the integration.")
    s["fafo_move_sentence"] = (
        "FAFO's move under a faster QK is not tested here: it needs full-model runs at equal rates and at a higher ratio."
        if f["fafo_toward"] == "not tested" else
        f"From ratio 1 to {f['full_r_hi']}, FAFO's attention on the distinct token went from {f['fafo_lo']} to "
        f"{f['fafo_hi']}; at equal rates FACO has {f['faco_lo']} and CACO {f['caco_lo']}, so FAFO moved "
        + {"neither": "away from both.",
           "tie": "toward both and ended equally far from them within the seed interval: a tie, which supports neither "
                  "summary."}.get(f["fafo_toward"], f"toward {f['fafo_toward']}."))
    s["s2_sentence"] = (
        f"These two rankings at equal rates match {f['s2_full']} (the runs' horizon) and {f['s2_asym']} (the ODE's "
        "longest horizon); the phase map reads S2 over every regime.")
    s["second_pair"] = (
        ("CAFO is the least sharp in every ranking of the tables above (ODE horizons, matched losses, full-model runs)"
         if f["cafo_last"] == "last in every regime" else "CAFO is not the least sharp in every ranking of the tables above")
        + f"; on the phase map, summary B's pair (CAFO, CACO) is the top two at {f['s2p_share_B']} of the cells.")
    s["s2_horizon_sentence"] = (
        f"S2 does not depend on the horizon here: the asymptotic ranking and the one at the training horizon are both "
        f"{f['rank_full_random']}." if f["rank_last"] == f["rank_full_random"] else
        f"S2 depends on the horizon. The asymptotic ranking is {f['rank_last']}; at the training horizon it is "
        f"{f['rank_full_random']}. The implicit rescaling explains the difference (see above).")
    s["fafo_sentence"] = (
        "FAFO was not run." if "fafo_place" not in f else
        f"After {f['full_steps']} steps at ratio {f['full_r_eq']} FAFO is the "
        + {1: "sharpest", 2: "second-sharpest", 3: "third-sharpest", 4: "least sharp"}.get(f["fafo_place"], f"#{f['fafo_place']}")
        + f" of the {f['n_ranked']} (mean attention on the distinct token {f['fafo_mean']}), so the summaries' claim that FAFO "
        "puts instances in the 'correct prediction, weak attention' region (attention below 0.5) "
        + ("holds here." if f["fafo_weak"] else "does not hold from our balanced small inits."))
    return s


#: the columns of :func:`long_runs` that the figures draw and the results keep
RUN_COLUMNS = ("parameterization", "ratio", "t", "w", "q", "common")
#: the columns of :func:`line_check` that :func:`plot_lines` draws and the results keep
LINE_COLUMNS = ("parameterization", "ratio", "n", "t", "X", "Y", "slope", "residual")
#: the symmetric inits of the phase portraits' trajectories, ``(w0, q0)``
PORTRAIT_INITS = ((0.1, 0.1), (0.1, 2.0), (2.0, 0.1))


def phase_portraits(sizes: dy.Sizes, cfg: dict, ratios: Sequence[float],
                    inits: Sequence[tuple[float, float]] = PORTRAIT_INITS, n_grid: int = 40) -> dict[str, Any]:
    """What the (w, q) phase portraits draw. ``field``: one record per ratio and parameterization
    with the grid axes ``w`` (``n_grid`` points in [0.02, 12]) and ``q`` (in [-2, 10]) and the ODE
    vector field ``dw``, ``dq`` (per unit time, :func:`qkov_lib.dynamics.flow_field`) as
    ``n_grid`` x ``n_grid`` arrays indexed ``[q, w]``, to 4 significant digits (the streamlines
    need no more, and the results file stays small); ``trajectories``: the ODE from each symmetric
    init ``(w0, q0)`` up to ``t = 1e5`` (60 points), a long table."""
    sig4 = np.vectorize(lambda x: float(f"{x:.4g}"))
    w, q = np.linspace(0.02, 12, n_grid), np.linspace(-2, 10, n_grid)
    W, Q = np.meshgrid(w, q)
    fields, paths = [], []
    for r in ratios:
        for p in PARAMS:
            U, V = dy.flow_field(p, W, Q, sizes, cfg["eta_ov"], r)
            fields.append({"parameterization": p, "ratio": float(r), "w": w, "q": q, "dw": sig4(U), "dq": sig4(V)})
            for w0, q0 in inits:
                f = dy.integrate(p, w0, q0, sizes, cfg["eta_ov"], r, t_max=1e5, n_points=60, rtol=1e-8, atol=1e-10)
                paths.append(pd.DataFrame({"parameterization": p, "ratio": float(r), "w0": w0, "q0": q0,
                                           "t": f["t"].to_numpy(), "w": f["w"].to_numpy(), "q": f["q"].to_numpy()}))
    return {"field": fields, "trajectories": pd.concat(paths, ignore_index=True)}


def law_metrics(runs: pd.DataFrame, table: pd.DataFrame, t3: pd.DataFrame, lines_single: pd.DataFrame,
                lines_mix: pd.DataFrame, portraits: Mapping[str, pd.DataFrame], facts: Mapping[str, Any],
                rows: Sequence[Mapping[str, str]]) -> dict:
    """The metrics the long-time laws page saves: its tables (records), ``trajectories.ode`` (the
    long ODE runs' :data:`RUN_COLUMNS`, what :func:`plot_asymptotics` draws), ``lines``
    (:data:`LINE_COLUMNS`, :func:`plot_lines`), ``phase_portraits`` (:func:`phase_portraits`), the
    facts and the scorecard rows."""
    return {"exponent_table": table, "t3": t3, "trajectories": {"ode": runs[list(RUN_COLUMNS)]},
            "lines": {"single_n": lines_single[list(LINE_COLUMNS)], "mixture": lines_mix[list(LINE_COLUMNS)]},
            "phase_portraits": dict(portraits), "facts": dict(facts), "claims": list(rows)}


def ranking_metrics(runs: pd.DataFrame, hz: pd.DataFrame, ml: pd.DataFrame, full: pd.DataFrame, phase: Any,
                    facts: Mapping[str, Any], rows: Sequence[Mapping[str, str]]) -> dict:
    """The metrics the sharpness page saves: its rankings (records), ``trajectories`` (the long ODE
    runs' :data:`RUN_COLUMNS` as ``ode`` and the full-model runs as ``full_model``: what
    :func:`plot_ranking` draws), ``s2_phase`` (the phase map's ODE cells and full-model cells,
    :func:`qkov_lib.studies.s2_phase.plot_phase`), the facts and the scorecard rows. ``phase``: a
    :class:`qkov_lib.studies.s2_phase.Phase`."""
    return {"horizon_ranking": hz, "matched_loss_ranking": ml,
            "trajectories": {"ode": runs[list(RUN_COLUMNS)], "full_model": full},
            "s2_phase": {"ode_map": phase.ode, "full_cells": phase.cells}, "facts": dict(facts), "claims": list(rows)}


@draws
def plot_asymptotics(runs: pd.DataFrame, sizes: dy.Sizes, cfg: dict):
    """Left: ``w`` minus its derived law; middle: ``Z(q) / (A s^beta)`` (tends to 1); right: the
    common-token mass against ``t``, each for every parameterization (colour) and ratio (line
    style), log time axis."""
    import seaborn as sns

    fig, axes = _fig(1, 3, w=4.0, h=3.3)
    pal = dict(zip(PARAMS, sns.color_palette(n_colors=len(PARAMS))))
    ratios = list(dict.fromkeys(runs["ratio"]))
    styles = dict(zip(ratios, ["-", "--", ":", "-."] * len(ratios)))
    for (p, r), g in runs.groupby(["parameterization", "ratio"], sort=False):
        g = g[g["t"] > 10]
        law = dy.asymptotic_law(p, sizes, cfg["eta_ov"], r)
        t = g["t"].to_numpy()
        s = np.log(t)
        kw = dict(color=pal[p], ls=styles[r], lw=1.3)
        axes[0, 0].plot(t, g["w"].to_numpy() - s - law["ov_loglog"] * np.log(s) - law["ov_offset"], **kw)
        axes[0, 1].plot(t, dy.sharpness_coordinate(p, g["q"].to_numpy()) / (law["qk_const"] * s ** law["qk_exponent"]), **kw)
        axes[0, 2].plot(t, g["common"], label=f"{p}, ratio {r:g}", **kw)
    axes[0, 0].axhline(0, color="k", lw=0.8, ls="--")
    axes[0, 1].axhline(1, color="k", lw=0.8, ls="--")
    axes[0, 1].set_ylim(0, 2)
    for ax, lab in zip(axes[0], ("w − derived law", "Z(q) / (A log^β t)", "common-token mass")):
        ax.set(xscale="log", xlabel="t (steps)", ylabel=lab)
    axes[0, 2].set_yscale("log")
    axes[0, 2].legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return fig


@draws
def plot_phase_portraits(portraits: Mapping[str, pd.DataFrame]):
    """(w, q) phase portraits of :func:`phase_portraits`: the ODE direction field (streamlines,
    darker = faster) and the trajectories from their symmetric inits (dots), one row per ratio and
    one column per parameterization."""
    fields = {(f["parameterization"], f["ratio"]): f for f in portraits["field"]}
    paths = portraits["trajectories"]
    ratios = list(dict.fromkeys(r for _, r in fields))
    fig, axes = _fig(len(ratios), len(PARAMS), w=3.2, h=3.0, sharex=True, sharey=True)
    for i, r in enumerate(ratios):
        for j, p in enumerate(PARAMS):
            ax = axes[i, j]
            g = fields[(p, r)]
            W, Q = np.meshgrid(g["w"], g["q"])
            U, V = np.asarray(g["dw"]), np.asarray(g["dq"])
            speed = np.hypot(U, V)
            ax.streamplot(W, Q, U / (speed + 1e-300), V / (speed + 1e-300), color=np.log10(speed + 1e-300),
                          cmap="Greys", density=0.7, linewidth=0.6, arrowsize=0.6)
            for (w0, q0), f in paths[(paths["parameterization"] == p) & (paths["ratio"] == r)].groupby(
                    ["w0", "q0"], sort=False):
                ax.plot(f["w"], f["q"], lw=1.6)
                ax.plot([w0], [q0], "k.", ms=4)
            ax.set(xlim=(0, 12), ylim=(-2, 10))
            if i == 0:
                ax.set_title(p)
            if j == 0:
                ax.set_ylabel(f"ratio {r:g}\nq (QK)")
            if i == len(ratios) - 1:
                ax.set_xlabel("w (OV)")
    fig.tight_layout()
    return fig


@draws
def plot_lines(single: pd.DataFrame, mix: pd.DataFrame):
    """T4: trajectories in the line coordinates ``(X(w), Y(q))`` (log-log axes, where a line
    through the start shows as a curve tending to slope 1) and the relative residual from the
    predicted line, for a single ``n`` (top) and the mixture (bottom)."""
    import seaborn as sns

    fig, axes = _fig(2, 2, w=4.3, h=3.2)
    for i, (d, lab) in enumerate(((single, f"single n = {single['n'].iloc[0]}"), (mix, "mixture over n"))):
        d = d[d["t"] > 0].assign(**{"Y − Y0": lambda f: f["Y"] - f.groupby(["parameterization", "ratio"])["Y"].transform("first"),
                                    "slope·(X − X0)": lambda f: f["slope"] * (f["X"] - f.groupby(["parameterization", "ratio"])["X"].transform("first")),
                                    "|residual|": lambda f: f["residual"].abs().clip(lower=1e-16)})
        sns.lineplot(data=d, x="slope·(X − X0)", y="Y − Y0", hue="parameterization", style="ratio", ax=axes[i, 0],
                     legend=False, errorbar=None)
        lim = [max(d["Y − Y0"][d["Y − Y0"] > 0].min(), 1e-3), d["Y − Y0"].max()]
        axes[i, 0].plot(lim, lim, "k--", lw=0.8)
        axes[i, 0].set(xscale="log", yscale="log", title=f"{lab}: Y vs predicted line")
        sns.lineplot(data=d, x="t", y="|residual|", hue="parameterization", style="ratio", ax=axes[i, 1], legend=(i == 0),
                     errorbar=None)
        axes[i, 1].set(xscale="log", yscale="log", title=f"{lab}: relative residual")
    sns.move_legend(axes[0, 1], "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    return fig


@draws
def plot_ranking(runs: pd.DataFrame, full: pd.DataFrame, cfg: dict, ratio: float = 1.0):
    """Common-token mass at ``ratio`` (equal rates by default) for the four parameterizations (ODE from the
    symmetric init). Left: the training range (log t), with the full-model runs at their last
    step (dots: random inits, crosses: symmetric init); right: the whole integration against
    ``log10 t`` on a log axis, where the late crossings show."""
    import seaborn as sns

    fig, axes = _fig(1, 2, w=4.6, h=3.6)
    pal = dict(zip(PARAMS, sns.color_palette(n_colors=len(PARAMS))))
    sub = runs[(runs["ratio"] == ratio) & (runs["t"] >= 1)]
    t_cut = 30 * cfg["full_steps"]
    for p in PARAMS:
        g = sub[sub["parameterization"] == p]
        early = g[g["t"] <= t_cut]
        axes[0, 0].plot(early["t"], early["common"], color=pal[p], label=f"{p} (ODE)")
        late = g[g["t"] >= 10]
        axes[0, 1].plot(np.log10(late["t"]), late["common"], color=pal[p], label=p)
        fr = full[(full["parameterization"] == p) & (full["ratio"] == ratio)]
        for init, mk in (("random", "o"), ("symmetric", "x")):
            v = fr[fr["init"] == init]["common"]
            axes[0, 0].plot([cfg["full_steps"]] * len(v), v, mk, color=pal[p], ms=6)
    axes[0, 0].set(xscale="log", yscale="log", xlabel="t (steps)", ylabel="attention mass on common tokens",
                   title="training range (dots/crosses: full model)")
    axes[0, 1].set(xscale="log", yscale="log", xlabel="log10 t", title="whole integration")
    axes[0, 0].legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
