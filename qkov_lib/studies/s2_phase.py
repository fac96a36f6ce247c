"""Claim S2 as a phase diagram: which pair of parameterizations puts the most attention on the
distinct token, over the learning-rate ratio ``eta_QK/eta_OV``, the init scale, the number of
common tokens and the depth of training (matched training loss).

The paper's two summaries disagree: summary A names (CACO, FACO), with a faster QK moving FAFO
toward FACO; summary B names (CAFO, CACO), with FAFO moving toward CACO. Here the reduced ODE of
:mod:`qkov_lib.dynamics` ranks the four parameterizations at every cell of the map (cheap), and
the full model, trained with the batched synthetic engine (:mod:`qkov_lib.train.engine`, GD on
the exact population loss), ranks them at a few cells with seed intervals. The verdict reads each
summary's pair at every cell of both by the one rule (:func:`s2_verdict`), counted per regime.

Two conventions, both because the theory allows them:

* **Matched loss, not matched time.** Each parameterization is read where its training
  (population) loss first reaches the level, so a model is never compared after it has
  saturated. Rankings use the log-odds of the attention on the distinct token, which keeps
  moving near saturation (same order as the attention itself).
* **Stable rates.** Multiplying both rates by ``c`` rescales time by ``1/c`` in the reduced
  dynamics, so at matched loss the ODE depends on the ratio only. The full model runs GD, which
  is stable only below some rate; a ratio is therefore reached by raising ``eta_QK`` up to
  ``eta_qk_max`` and then lowering ``eta_OV`` (:func:`qkov_lib.train.config.stable_rates`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy.integrate import solve_ivp

from qkov_lib.figure_source import draws
from qkov_lib import claims as C
from qkov_lib import dynamics as dy
from qkov_lib.claims import Change, Verdict, claim
from qkov_lib.data import synthetic as syn
from qkov_lib.metrics import seed_half_width
from qkov_lib.models import PARAMETERIZATIONS, SyntheticModel
from qkov_lib.profiles import profile_table
from qkov_lib.runtime import seed_everything
from qkov_lib.train import TrainConfig
from qkov_lib.train.config import stable_rates
from qkov_lib.train import engine
from qkov_lib.studies import synthetic as base

PARAMS = list(PARAMETERIZATIONS)
PAGE = "sharpness"  # the page that decides S2 on the phase map (book/sharpness.md), and T5, T6 beside it
AXES = ("ratio", "init", "n", "loss")  # the map's axes, in the order of a cell key

_BOOK_N = [2, 4, 8, 12]  # the common-token counts of the book's synthetic task (cpu profile)

# Profile table. ODE: every (ratio, init scale, n, loss) cell; full model: the cells of
# ``full_cells`` (each one of the map's cells), every parameterization, ``seeds`` seeds.
PROFILES = profile_table(
    base=dict(n_classes=4, n_common_vocab=3, s2_eta_ov=0.5, s2_eta_qk_max=5.0, s2_t_max=1e200),
    test=dict(n_classes=3, n_common_vocab=2, s2_ratios=[0.1, 1.0, 10.0], s2_init_scales=[1e-3, 1e-1],
              s2_n_common=[[2], [2, 4]], s2_losses=[0.3, 0.1, 1e-3, 1e-8, 1e-16], s2_n_points=400,
              s2_full_cells=[dict(ratio=1.0, init_scale=0.1, n_common=[2, 4], loss=0.3),
                             dict(ratio=10.0, init_scale=0.1, n_common=[2, 4], loss=0.3)],
              s2_seeds=[0, 1, 2], s2_steps=400),
    cpu=dict(s2_ratios=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0], s2_init_scales=[1e-3, 1e-2, 1e-1],
             s2_n_common=[[2], [8], _BOOK_N, [32]],
             s2_losses=[0.3, 0.1, 0.03, 1e-2, 1e-3, 1e-4, 1e-6, 1e-8, 1e-12, 1e-16, 1e-24, 1e-32, 1e-48, 1e-64, 1e-96,
                       1e-128], s2_n_points=600,
             s2_full_cells=[dict(ratio=0.01, init_scale=1e-3, n_common=[2], loss=0.3),
                            dict(ratio=0.1, init_scale=1e-3, n_common=_BOOK_N, loss=0.3),
                            dict(ratio=0.1, init_scale=0.1, n_common=_BOOK_N, loss=0.1),
                            dict(ratio=1.0, init_scale=0.1, n_common=_BOOK_N, loss=0.1),
                            dict(ratio=10.0, init_scale=0.1, n_common=_BOOK_N, loss=0.1),
                            dict(ratio=100.0, init_scale=0.01, n_common=_BOOK_N, loss=0.1),
                            dict(ratio=1.0, init_scale=0.01, n_common=[32], loss=0.1)],
             s2_seeds=[0, 1, 2, 3, 4], s2_steps=4000),
    full=dict(n_classes=8, n_common_vocab=4, s2_ratios=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0],
              s2_init_scales=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1], s2_n_common=[[2], [4], [8], [2, 4, 8, 16], [16], [32]],
              s2_losses=[0.3, 0.1, 0.03, 1e-2, 1e-3, 1e-4, 1e-6, 1e-8, 1e-12, 1e-16, 1e-24, 1e-32, 1e-48, 1e-64, 1e-96],
              s2_n_points=1000,
              s2_full_cells=[dict(ratio=r, init_scale=s, n_common=n, loss=L) for r in (0.01, 0.1, 1.0, 10.0, 100.0)
                             for s in (1e-3, 1e-1) for n in ([2], [2, 4, 8, 16]) for L in (0.3, 0.03)],
              s2_seeds=list(range(10)), s2_steps=40000),
)


def check_settings(cfg: Mapping) -> None:
    """ValueError, naming the setting, unless the map's axes are non-empty and sorted as the map
    needs them (init scales and losses > 0, losses below log K, each n a non-empty list of counts
    >= 1) and every full-model cell is one of the map's cells."""
    for key in ("s2_ratios", "s2_init_scales", "s2_losses", "s2_n_common"):
        if not cfg.get(key):
            raise ValueError(f"{key} must be a non-empty list")
    for key in ("s2_init_scales", "s2_losses"):
        bad = [v for v in cfg[key] if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"each value of {key!r} must be a finite number > 0, got {bad}")
    if max(cfg["s2_losses"]) >= math.log(cfg["n_classes"]):
        raise ValueError(f"s2_losses must lie below the loss at init, log K = {math.log(cfg['n_classes']):.3f}")
    for n in cfg["s2_n_common"]:
        if not isinstance(n, (list, tuple)) or not n or any(not isinstance(k, int) or k < 1 for k in n):
            raise ValueError(f"each entry of 's2_n_common' must be a non-empty list of integers >= 1, got {n!r}")
    for cell in cfg["s2_full_cells"]:
        if set(cell) != {"ratio", "init_scale", "n_common", "loss"}:
            raise ValueError(f"a full-model cell names ratio, init_scale, n_common and loss, got {sorted(cell)}")
        where = {"ratio": (cell["ratio"], cfg["s2_ratios"]), "init_scale": (cell["init_scale"], cfg["s2_init_scales"]),
                 "n_common": (list(cell["n_common"]), [list(n) for n in cfg["s2_n_common"]]),
                 "loss": (cell["loss"], cfg["s2_losses"])}
        for name, (v, axis) in where.items():
            if v not in axis:
                raise ValueError(f"full-model cell {cell}: {name} {v!r} is not on the map's axis {axis}")


def n_label(n: Sequence[int]) -> str:
    """The map's label of a set of common-token counts: ``"2"`` (every sequence has 2) or
    ``"{2,4,8,12}"`` (drawn uniformly from the set)."""
    body = ",".join(str(int(k)) for k in n)
    return body if len(n) == 1 else "{" + body + "}"


# --- the reduced ODE over the map ---------------------------------------------------------------
def _time_grid(t_max: float, n_points: int) -> np.ndarray:
    """Times 0 and ``n_points`` log-spaced times up to ``t_max``, half of them before ``t = 1e6``
    steps, where the shallow loss levels are crossed and the curves bend most."""
    early = np.geomspace(1e-2, min(1e6, t_max), n_points // 2)
    late = np.geomspace(min(1e6, t_max), t_max, n_points - n_points // 2 + 1)[1:]
    return np.concatenate([[0.0], early, late])


def integrate_cells(parameterization: str, sizes: dy.Sizes, ratios: Sequence[float], inits: Sequence[float],
                    eta_ov: float, t_max: float, rtol: float = 1e-9):
    """The reduced ODE (:func:`qkov_lib.dynamics.velocity`) of one parameterization for every
    (ratio, init scale) pair at once, from the symmetric state ``w0 = q0 = init scale``, in log
    time ``tau = log(1 + t)`` as :func:`qkov_lib.dynamics.integrate` does (one solver call for all
    cells: the cells share nothing but the step-size control, which tracks the hardest one).
    Returns the solver's dense solution: ``sol.sol(tau)`` has rows ``w`` of each cell, then ``q``
    of each cell (``len(ratios) * len(inits)`` cells, ratio-major)."""
    R, I = (a.ravel() for a in np.meshgrid(np.asarray(ratios, float), np.asarray(inits, float), indexing="ij"))
    k = len(R)

    def f(tau: float, y: np.ndarray) -> np.ndarray:
        dw, dq = dy.velocity(parameterization, y[:k], y[k:], sizes, eta_ov, eta_ov * R)
        return math.exp(tau) * np.concatenate([dw, dq])

    sol = solve_ivp(f, (0.0, math.log1p(t_max)), np.concatenate([I, I]), method="DOP853", dense_output=True,
                    rtol=rtol, atol=1e-14)
    if not sol.success:
        raise RuntimeError(f"ODE integration failed for {parameterization}: {sol.message}")
    return sol


def log_odds(distinct: np.ndarray) -> np.ndarray:
    """``log(a / (1 - a))`` of the attention ``a`` on the distinct token."""
    a = np.asarray(distinct, dtype=float)
    return np.log(a) - np.log1p(-a)


def at_losses(sol, sizes: dy.Sizes, tau: np.ndarray, levels: Sequence[float], steps: int = 36
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(w, q)`` of every cell of a dense solution (:func:`integrate_cells`) where its loss first
    reaches each level, each of shape (cells, levels); NaN where a cell never reaches a level
    within ``tau`` or starts below it. The crossing is bracketed on the log-time grid ``tau``
    (loss is non-increasing along gradient flow) and located by ``steps`` bisections in log time
    on the dense solution, so the state is the solver's own there (a reading interpolated between
    grid points would be off where the attention jumps, e.g. when a factorized QK leaves its
    saddle)."""
    Y = sol.sol(tau)
    k = Y.shape[0] // 2
    ll = np.minimum.accumulate(np.log(dy.reduced_loss(Y[:k], Y[k:], sizes)), axis=1)
    x = np.log(np.asarray(levels, dtype=float))
    i = (ll[:, :, None] > x[None, None, :]).sum(1)  # (cells, levels): first grid index at or below the level
    ok = (i > 0) & (i < len(tau))
    i = np.clip(i, 1, len(tau) - 1)
    lo, hi = tau[i - 1], tau[i]
    diag = np.arange(k)

    def state(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        Z = sol.sol(t.ravel()).reshape(2 * k, k, -1)  # every cell at every cell's time: keep its own
        return Z[diag, diag], Z[k + diag, diag]

    for _ in range(steps):
        mid = (lo + hi) / 2
        above = np.log(dy.reduced_loss(*state(mid), sizes)) > x  # still above the level: crossing later
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    w, q = state(hi)
    return np.where(ok, w, np.nan), np.where(ok, q, np.nan)


def ode_map(cfg: Mapping) -> pd.DataFrame:
    """The reduced ODE over the whole map: one row per cell (ratio, init, n, loss) with each
    parameterization's attention on the distinct token (``att FAFO``...) and its log-odds
    (``logodds FAFO``...) where its loss first reaches the level, the ranking (most attention
    first), the top two (:func:`qkov_lib.claims.s2_top_two`) and the log-odds gap between the
    second and the third."""
    check_settings(cfg)
    tau = np.log1p(_time_grid(cfg["s2_t_max"], cfg["s2_n_points"]))
    ratios, inits, levels = cfg["s2_ratios"], cfg["s2_init_scales"], cfg["s2_losses"]
    rows: dict[tuple, dict] = {}
    for n in cfg["s2_n_common"]:
        sizes = dy.Sizes(cfg["n_classes"], cfg["n_common_vocab"], tuple(n))
        for p in PARAMS:
            sol = integrate_cells(p, sizes, ratios, inits, cfg["s2_eta_ov"], cfg["s2_t_max"])
            w, q = at_losses(sol, sizes, tau, levels)
            with np.errstate(invalid="ignore"):
                att = dy.distinct_mass(np.nan_to_num(q, nan=0.0), sizes).reshape(q.shape)
            att = np.where(np.isnan(q), np.nan, att)
            for j, (r, s) in enumerate(itertools.product(ratios, inits)):
                for L, aa, ll in zip(levels, att[j], log_odds(att[j])):
                    row = rows.setdefault((float(r), float(s), n_label(n), float(L)), {})
                    row[f"att {p}"], row[f"logodds {p}"] = float(aa), float(ll)
    out = []
    for key, row in rows.items():
        vals = {p: row[f"logodds {p}"] for p in PARAMS}
        order = sorted(vals, key=lambda p: -vals[p]) if all(np.isfinite(list(vals.values()))) else []
        out.append({**dict(zip(AXES, key)), **row, "ranking": " > ".join(order),
                    "top two": C.s2_top_two(vals),
                    "2nd − 3rd": vals[order[1]] - vals[order[2]] if order else math.nan})
    return pd.DataFrame(out)


def ranking_settles(ode: pd.DataFrame, column: str = "ranking") -> dict[str, float]:
    """Depth at which the ODE ranking (``column``: ``"ranking"``, or ``"top two"``) stops changing:
    ``last_change``, the deepest loss level at which some (ratio, init, n) has a different value
    than one level shallower (NaN: never), and ``settled``, whether the map goes at least one
    level deeper than that (the ladder reaches the depth from which it no longer changes)."""
    levels = sorted(ode["loss"].unique(), reverse=True)
    last = math.nan
    for _, g in ode.groupby(["ratio", "init", "n"]):
        rk = g.set_index("loss")[column]
        for hi, lo in zip(levels, levels[1:]):
            if rk.get(hi) != rk.get(lo):
                last = lo if math.isnan(last) else min(last, lo)
    return {"last_change": last, "settled": bool(math.isnan(last) or last > min(levels))}


def fafo_moves(ode: pd.DataFrame) -> pd.DataFrame:
    """Where a faster QK moves FAFO, along the ratio axis: for each (init, n, loss) and each pair of
    neighbouring ratios, :func:`qkov_lib.claims.s2_fafo_move` on FAFO's log-odds distance to FACO
    and to CACO (each at the same ratio as FAFO) before and after. Columns init, n, loss, from,
    to, ``toward``."""
    rows = []
    for (s, n, L), g in ode.groupby(["init", "n", "loss"]):
        g = g.sort_values("ratio")
        d = [{p: abs(x["logodds FAFO"] - x[f"logodds {p}"]) for p in ("FACO", "CACO")} for _, x in g.iterrows()]
        rs = g["ratio"].tolist()
        for i in range(len(rs) - 1):
            rows.append({"init": s, "n": n, "loss": L, "from": rs[i], "to": rs[i + 1],
                         "toward": C.s2_fafo_move(d[i], d[i + 1]) or "not tested"})
    return pd.DataFrame(rows, columns=["init", "n", "loss", "from", "to", "toward"])


# --- the full model at a few cells --------------------------------------------------------------
def moves_table(moves: pd.DataFrame) -> pd.DataFrame:
    """:func:`fafo_moves` counted per step of the ratio (rows ``from -> to``) and where FAFO moves
    (columns), over every init scale, n and loss."""
    t = moves.assign(step=[f"{a:g} → {b:g}" for a, b in zip(moves["from"], moves["to"])])
    order = list(dict.fromkeys(t.sort_values("from")["step"]))
    return pd.crosstab(t["step"], t["toward"]).reindex(order).rename_axis("ratio step", axis=0)


def full_cost(cfg: Mapping) -> str:
    """What the full-model runs cost, in words (said before they start)."""
    k = len(cfg["s2_full_cells"])
    runs = k * len(PARAMS) * len(cfg["s2_seeds"])
    return (f"{runs} full-model runs ({k} cells x {len(PARAMS)} parameterizations x {len(cfg['s2_seeds'])} seeds), "
            f"GD on the population loss, up to {cfg['s2_steps']} steps each, stopping at the cell's loss")


def full_runs(cfg: Mapping, progress: bool = True) -> pd.DataFrame:
    """Train the full model at every cell of ``s2_full_cells`` for every parameterization and seed
    (the library's random balanced init at the cell's init scale; GD at :func:`qkov_lib.train.config.stable_rates`) until
    its population loss first reaches the cell's loss, or ``s2_steps``. Cells that share n and
    loss train in one stack. One row per run: ratio, init, n, loss, parameterization, seed,
    eta_ov, eta_qk, ``step`` (where the loss was reached; NaN: not reached or diverged) and
    ``attention`` (population mean attention on the distinct token there)."""
    check_settings(cfg)
    if progress:
        print(f"S2 phase map, full model: {full_cost(cfg)}")
    groups: dict[tuple, list[dict]] = {}
    for cell in cfg["s2_full_cells"]:
        groups.setdefault((tuple(cell["n_common"]), float(cell["loss"])), []).append(cell)
    rows = []
    for (n, L), cells in groups.items():
        task = syn.SyntheticTask(n_classes=cfg["n_classes"], n_common_vocab=cfg["n_common_vocab"], n_common=n,
                                 embedding="onehot")
        data = syn.population(task)
        models, cfgs, keys = [], [], []
        for cell, seed in itertools.product(cells, cfg["s2_seeds"]):
            gen = seed_everything(seed)
            E = syn.make_embeddings(task, gen, torch.float64)
            state = gen.get_state()  # the same effective init for the four parameterizations of a seed
            eta_ov = stable_rates(cell["ratio"], cfg["s2_eta_ov"], cfg["s2_eta_qk_max"])[0]
            eta_qk = eta_ov * cell["ratio"]
            for p in PARAMS:
                g = torch.Generator()
                g.set_state(state)
                models.append(SyntheticModel(E, task.n_classes, parameterization=p, init_scale=cell["init_scale"],
                                             generator=g, dtype=torch.float64))
                cfgs.append(TrainConfig(optimizer="gd", eta_ov=eta_ov, ratio=float(cell["ratio"]),
                                        steps=int(cfg["s2_steps"]), seed=seed, n_logs=2, progress=False))
                keys.append((cell, p, seed, eta_ov, eta_qk))
        hists = engine.train_batched(models, data, cfgs, stop_loss=L, on_nonfinite="freeze", progress=progress,
                                     desc=f"S2 full model, n {n_label(n)}, loss {L:g} ({len(models)} runs)")
        for (cell, p, seed, eta_ov, eta_qk), h in zip(keys, hists):
            ok = h.stop_step is not None and h.diverged_step is None
            rows.append({"ratio": float(cell["ratio"]), "init": float(cell["init_scale"]), "n": n_label(n),
                         "loss": L, "parameterization": p, "seed": seed, "eta_ov": eta_ov, "eta_qk": eta_qk,
                         "step": float(h.stop_step) if ok else math.nan,
                         "attention": float(h.records[-1]["attn_relevant"]) if ok else math.nan})
    return pd.DataFrame(rows)


def full_cells(runs: pd.DataFrame, ode: pd.DataFrame) -> pd.DataFrame:
    """Per full-model cell: the ranking by mean attention (± 95 % seed interval), the per-seed
    attention gap between the second and the third (mean, half-width, seeds), the top two
    (:func:`qkov_lib.claims.s2_top_two` with that gap), the ODE's top two at the same cell and
    whether they agree (``"yes"``, ``"no"``, or ``"undecided"`` when the full model's is a tie or
    not tested). Only seeds at which all four parameterizations reached the loss count."""
    ode_at = ode.set_index(list(AXES))
    out = []
    for key, g in runs.groupby(list(AXES), sort=False):
        per = g.pivot(index="seed", columns="parameterization", values="attention").dropna()
        means = {p: float(per[p].mean()) if p in per and len(per) else math.nan for p in PARAMS}
        ok = len(per) > 0 and all(np.isfinite(list(means.values())))
        order = sorted(means, key=lambda p: -means[p]) if ok else []
        gap = Change.of((per[order[1]] - per[order[2]]).tolist()) if ok else Change(math.nan, math.nan, 0)
        call = C.s2_top_two(means, gap) if ok else "not tested"
        ode_call = ode_at.loc[key, "top two"] if key in ode_at.index else "not tested"
        ranking = " > ".join(f"{p} {means[p]:.3f}" + (f" ± {seed_half_width(per[p]):.3f}" if len(per) > 1 else "")
                             for p in order)
        out.append({**dict(zip(AXES, key)), "seeds": len(per), "eta_ov": float(g["eta_ov"].iloc[0]),
                    "eta_qk": float(g["eta_qk"].iloc[0]), "steps (mean)": float(g["step"].mean()),
                    "ranking (full model)": ranking or "not reached", "2nd − 3rd": gap.mean, "±": gap.half_width,
                    "top two (full model)": call, "ranking (ODE)": ode_at.loc[key, "ranking"] if key in ode_at.index
                    else "", "top two (ODE)": ode_call,
                    "agree": "undecided" if call in ("tie", "not tested") else "yes" if call == ode_call else "no"})
    return pd.DataFrame(out)


# --- verdict, facts and figure ------------------------------------------------------------------
def _key(row: Mapping) -> tuple:
    return tuple(row[a] for a in AXES)


PRACTICAL = 1e-4  # training loss at or above which a cell is at practical depth; below it, asymptotic
_SHOWN = ["FACO", "CACO", "FAFO", "CAFO"]  # the order in which a pair is named


def regime(loss: float) -> str:
    """``practical`` at a training loss of at least :data:`PRACTICAL`, else ``asymptotic``."""
    return "practical" if loss >= PRACTICAL else "asymptotic"


def _where(key: tuple) -> str:
    return ", ".join(f"{a} {v:g}" if isinstance(v, float) else f"{a} {v}" for a, v in zip(AXES, key))


def _margin(logodds: Mapping[str, float], pair: frozenset) -> float:
    """A pair's log-odds margin: its lower member's log-odds minus the best other parameterization's."""
    return min(logodds[p] for p in pair) - max(logodds[p] for p in PARAMS if p not in pair)


def s2_cells(ode: pd.DataFrame, runs: pd.DataFrame | None = None
             ) -> tuple[dict[str, Change], dict[str, Change], dict[str, tuple[str, str, str]]]:
    """S2's cells, one per summary's pair and cell of the map: the pair's log-odds margin over the
    best other parameterization (S2's estimand). Exact at every ODE cell where all four reached the
    loss; over seeds (paired by seed) at the full-model cells (``runs``, :func:`full_runs`). Also,
    per cell name, (summary, regime, ``ODE`` or ``full model``)."""
    exact, seeded, meta = {}, {}, {}
    for _, r in ode.iterrows():
        lo = {p: float(r[f"logodds {p}"]) for p in PARAMS}
        if all(np.isfinite(list(lo.values()))):
            for k, pair in C.S2_PAIRS.items():
                name = f"{C.S2_SHORT[k]}, ODE, {_where(_key(r))}"
                exact[name], meta[name] = Change.exact(_margin(lo, pair)), (k, regime(r["loss"]), "ODE")
    if runs is not None and len(runs):
        for key, g in runs.groupby(list(AXES), sort=False):
            per = g.pivot(index="seed", columns="parameterization", values="attention").dropna()
            if set(PARAMS) <= set(per) and len(per):
                for k, pair in C.S2_PAIRS.items():
                    name = f"{C.S2_SHORT[k]}, full model, {_where(key)}"
                    seeded[name] = Change.of([_margin({p: C.log_odds(x[p]) for p in PARAMS}, pair)
                                              for _, x in per.iterrows()])
                    meta[name] = (k, regime(key[AXES.index("loss")]), "full model")
    return exact, seeded, meta


def s2_readings(ode: pd.DataFrame, runs: pd.DataFrame | None = None
                ) -> tuple[list[C.Reading], dict[str, tuple[str, str, str]]]:
    """:func:`s2_cells` read by the one rule (the ODE's exact cells and the full model's cells over
    seeds are separate Bonferroni families), with each cell's (summary, regime, source)."""
    exact, seeded, meta = s2_cells(ode, runs)
    return base.read(C.ESTIMANDS["S2"], exact, seeded), meta


def regime_region(readings: Sequence[C.Reading], meta: Mapping[str, tuple[str, str, str]]) -> str:
    """Where each summary's pair holds and is contradicted, counted per source and regime:
    ``(CACO, FACO), ODE: holds at 400 of 480 asymptotic cells, 20 of 384 practical ...``."""
    parts = []
    for k in C.S2_PAIRS:
        for src in ("ODE", "full model"):
            mine = [r for r in readings if meta[r.cell][0] == k and meta[r.cell][2] == src]
            if not mine:
                continue
            by = []
            for reg in ("practical", "asymptotic"):
                rr = [r for r in mine if meta[r.cell][1] == reg]
                if rr:
                    by.append(f"{reg} ({'loss ≥' if reg == 'practical' else 'loss <'} {PRACTICAL:g}): "
                              + base.outcome_counts(rr))
            parts.append(f"{C.S2_SHORT[k]}, {src}: " + "; ".join(by))
    return " · ".join(parts)


def s2_verdict(ode: pd.DataFrame, runs: pd.DataFrame | None = None) -> Verdict:
    """S2 by the one rule over :func:`s2_cells`; its region counts the outcomes per summary,
    source and regime (:func:`regime_region`)."""
    readings, meta = s2_readings(ode, runs)
    v = base.verdict(readings, C.ESTIMANDS["S2"])
    return Verdict(v.verdict, v.rule, v.reason, region=regime_region(readings, meta) if v.region else "", effect=v.effect)


def _pair(ranking: str) -> str:
    """The top two of a ``"A > B > C > D"`` ranking as a pair: a summary's pair as that summary names
    it, ``(CACO, FACO)``, any other in the naming order, ``(FACO, FAFO)``."""
    top = ranking.split(" > ")[:2]
    if len(top) != 2:
        return "none"
    k = next((k for k, pair in C.S2_PAIRS.items() if pair == frozenset(top)), None)
    return C.S2_SHORT[k] if k else "(" + ", ".join(sorted(top, key=_SHOWN.index)) + ")"


def regime_table(ode: pd.DataFrame, moves: pd.DataFrame) -> pd.DataFrame:
    """Per regime (:func:`regime`) and side of equal rates (ratio below 1, ratio 1 and above): the
    cells, the leading pair (the most frequent top two by ranking, ties of the ODE included) and its
    share, the shares of summary A's pair, summary B's pair, neither and a tie (``top two``), and
    where a faster QK moves FAFO from a ratio on that side (:func:`fafo_moves`: steps toward FACO,
    toward CACO, others)."""
    rows = []
    o = ode.assign(regime=ode["loss"].map(regime), side=np.where(ode["ratio"] >= 1.0, "ratio ≥ 1", "ratio < 1"))
    m = moves.assign(regime=moves["loss"].map(regime), side=np.where(moves["from"] >= 1.0, "ratio ≥ 1", "ratio < 1"))
    for reg in ("practical", "asymptotic"):
        for side in ("ratio < 1", "ratio ≥ 1"):
            g = o[(o["regime"] == reg) & (o["side"] == side)]
            if not len(g):
                continue
            pairs = g["ranking"].map(_pair).value_counts()
            share = g["top two"].value_counts(normalize=True)
            mv = m[(m["regime"] == reg) & (m["side"] == side)]["toward"].value_counts()
            rows.append({"regime": f"{reg} (loss {'≥' if reg == 'practical' else '<'} {PRACTICAL:g})", "side": side,
                         "cells": len(g), "leading pair": pairs.index[0], "its share": pairs.iloc[0] / len(g),
                         **{C.S2_SHORT[k] if k in C.S2_SHORT else k: float(share.get(k, 0.0))
                            for k in ("A", "B", "neither", "tie")},
                         "FAFO → FACO": int(mv.get("FACO", 0)), "FAFO → CACO": int(mv.get("CACO", 0)),
                         "FAFO other": int(mv.sum() - mv.get("FACO", 0) - mv.get("CACO", 0))})
    return pd.DataFrame(rows).set_index(["regime", "side"])


def phase_facts(ode: pd.DataFrame, cells: pd.DataFrame, moves: pd.DataFrame, verdict: Verdict,
                cfg: Mapping) -> dict[str, object]:
    """The numbers and words the S2 phase map's section quotes (glue strings, ``s2p_*``), and the
    comparisons that choose its sentences."""
    settle, settle_top = ranking_settles(ode), ranking_settles(ode, "top two")
    n = len(ode)
    everywhere = [_key(r) for _, r in ode.iterrows()]
    region = lambda sub: C.s2_region([_key(r) for _, r in sub.iterrows()], everywhere, AXES)  # noqa: E731
    settled = C.s2_settled({_key(r): r["top two"] for _, r in ode.iterrows()}, AXES)
    neither_pairs = Counter(tuple(sorted(rk.split(" > ")[:2], key=_SHOWN.index))
                            for rk in ode[ode["top two"] == "neither"]["ranking"])
    share = ode["top two"].value_counts().to_dict()
    dis = cells[cells["agree"] == "no"]
    fmt = lambda r: f"ratio {r['ratio']:g}, init {r['init']:g}, n {r['n']}, loss {r['loss']:g}"  # noqa: E731
    top = max(cfg["s2_ratios"])
    top_ov = stable_rates(top, cfg["s2_eta_ov"], cfg["s2_eta_qk_max"])[0]
    f: dict[str, object] = {
        "s2p_cells": str(n), "s2p_full_cells": str(len(cells)), "s2p_seeds": str(len(cfg["s2_seeds"])),
        "s2p_ratios": f"{min(cfg['s2_ratios']):g} to {max(cfg['s2_ratios']):g}",
        "s2p_inits": ", ".join(f"{s:g}" for s in cfg["s2_init_scales"]),
        "s2p_ns": ", ".join(n_label(x) for x in cfg["s2_n_common"]),
        "s2p_losses": f"{max(cfg['s2_losses']):g} to {min(cfg['s2_losses']):g}",
        "s2p_eta_qk_max": f"{cfg['s2_eta_qk_max']:g}", "s2p_eta_ov": f"{cfg['s2_eta_ov']:g}",
        "s2p_tie": C.threshold_text("S2_ODE_TIE"),
        **{f"s2p_share_{k}": f"{share.get(k, 0) / n:.0%}" for k in ("A", "B", "neither", "tie")},
        "s2p_last_change": f"{settle['last_change']:g}" if np.isfinite(settle["last_change"]) else "never",
        "s2p_settled": settle["settled"],
        "s2p_top_last_change": f"{settle_top['last_change']:g}" if np.isfinite(settle_top["last_change"]) else "never",
        "s2p_top_settled": settle_top["settled"],
        "s2p_deep_level": f"{settled[0]:g}" if settled else "none",
        "s2p_deep_call": C.S2_WORDS[settled[1]] if settled else "none",
        "s2p_agree": str(int((cells["agree"] == "yes").sum())),
        "s2p_decided": str(int((cells["agree"] != "undecided").sum())),
        "s2p_disagree": "; ".join(f"{fmt(r)} (ODE {C.S2_WORDS[r['top two (ODE)']]}, full model "
                                  f"{C.S2_WORDS[r['top two (full model)']]})" for _, r in dis.iterrows()) or "none",
        **{f"s2p_{k}_region": region(ode[ode["top two"] == k]) for k in ("A", "B", "neither", "tie")},
        "s2p_has_B": bool(share.get("B", 0)), "s2p_has_neither": bool(share.get("neither", 0)),
        "s2p_neither_pairs": ", ".join(f"({a}, {b}) at {k}" for (a, b), k in neither_pairs.most_common()),
        "s2p_top_rates": f"eta_QK = {top * top_ov:g} and eta_OV = {top_ov:g} at ratio {top:g}",
        "s2p_has_disagree": bool(len(dis)),
    }
    f.update(_regime_facts(ode, moves))
    f.update(C.verdict_glue({"S2": verdict}))
    return f


def _regime_facts(ode: pd.DataFrame, moves: pd.DataFrame) -> dict[str, str]:
    """The S2 sentences that count cells, computed from the cells they count: per regime and side of
    equal rates the leading pair and the shares of each summary's pair (``s2p_regime_sentence``), and
    FAFO's moves along the ratio axis, per regime, with the summary whose direction more steps take
    (``s2p_move_sentence``)."""
    t = regime_table(ode, moves)
    parts = [f"{reg}, {side}: {int(r['cells'])} cells, leading pair {r['leading pair']} at {r['its share']:.0%}, "
             f"summary A's pair at {r[C.S2_SHORT['A']]:.0%}, summary B's at {r[C.S2_SHORT['B']]:.0%}"
             for (reg, side), r in t.iterrows()]
    mv = moves["toward"].value_counts()
    by = {reg: moves[moves["loss"].map(regime) == reg]["toward"].value_counts() for reg in ("practical", "asymptotic")}
    k, m = int(mv.get("FACO", 0)), int(mv.get("CACO", 0))
    side = "summary A (toward FACO)" if k > m else "summary B (toward CACO)" if m > k else "neither summary"
    return {"s2p_regime_sentence": "Per regime and side of equal rates: " + "; ".join(parts) + ".",
            "s2p_move_sentence": (
                f"a faster QK moves FAFO toward FACO at {k} of {int(mv.sum())} steps and toward CACO at {m} (others: "
                + (", ".join(f"{x} {int(n)}" for x, n in mv.items() if x not in ("FACO", "CACO")) or "none") + "); "
                + "; ".join(f"at {reg} depth {int(c.get('FACO', 0))} toward FACO and {int(c.get('CACO', 0))} toward CACO"
                            for reg, c in by.items() if c.sum())
                + f". By the count of steps the map sides with {side} on FAFO's move:")}


def s2_claim(facts: Mapping[str, object], verdict: Verdict) -> dict[str, str]:
    """The scorecard row of S2 (decided on the phase map of the sharpness page, :data:`PAGE`)."""
    return claim("S2", "summaries disagree: (CACO, FACO) with faster QK moving FAFO toward FACO, or (CAFO, CACO) "
                       "with FAFO moving toward CACO",
                 f"reduced ODE over {facts['s2p_cells']} cells (ratio {facts['s2p_ratios']}, init "
                 f"{facts['s2p_inits']}, n {facts['s2p_ns']}, loss {facts['s2p_losses']}): summary A's pair at "
                 f"{facts['s2p_share_A']}, "
                 f"summary B's at {facts['s2p_share_B']}, neither at {facts['s2p_share_neither']}, ties "
                 f"{facts['s2p_share_tie']}; the full model ({facts['s2p_full_cells']} cells) agrees with it at "
                 f"{facts['s2p_agree']} of the {facts['s2p_decided']} cells where its 2nd and 3rd separate", verdict,
                 PAGE)


def phase_sentences(f: Mapping[str, Any]) -> dict[str, str]:
    """The sentences the sharpness page quotes about the S2 phase map (``s2p_settle_sentence``,
    ``s2p_B_sentence``, ``s2p_neither_sentence``, ``s2p_disagree_sentence``), each chosen by a
    comparison that :func:`phase_facts` made and filled with its numbers."""
    s: dict[str, str] = {}
    s["s2p_settle_sentence"] = (
        (f"The top two last change at a training loss of {f['s2p_top_last_change']}"
         + (f"; from loss {f['s2p_deep_level']} down every cell has {f['s2p_deep_call']}" if f["s2p_deep_level"] != "none"
            else "") + ". " if f["s2p_top_settled"] else
         f"The top two still change at the deepest loss read ({f['s2p_top_last_change']}). ")
        + ("The whole ranking stops changing too (last change at loss " + f"{f['s2p_last_change']})." if f["s2p_settled"]
           else f"Below that only the third and fourth places still swap, down to the deepest loss read "
                f"({f['s2p_last_change']})."))
    s["s2p_B_sentence"] = (f"Summary B's pair (CAFO, CACO) is the top two only {f['s2p_B_region']}." if f["s2p_has_B"]
                           else "Summary B's pair (CAFO, CACO) is the top two at no cell of the map.")
    s["s2p_neither_sentence"] = (
        f"Neither pair is the top two {f['s2p_neither_region']}; the top two there are {f['s2p_neither_pairs']}."
        if f["s2p_has_neither"] else "At every cell the top two are one summary's pair or a tie.")
    s["s2p_disagree_sentence"] = (
        f"They part at {f['s2p_disagree']}. The ODE starts on the symmetric line w0 = q0; the random init also has "
        "components off it, which the reduction of the previous chapter does not follow." if f["s2p_has_disagree"] else
        "Wherever the full model's second and third separate, its top two is the ODE's.")
    return s


CALL_COLOURS = {"A": "#4c72b0", "B": "#dd8452", "neither": "#c9c9c9", "tie": "#f2e394", "not tested": "white"}


@draws
def plot_phase(ode: pd.DataFrame, cells: pd.DataFrame):
    """The phase diagram: one panel per (init scale: rows, n: columns); in each, the ODE's top two
    at every (ratio, loss) cell as a colour (summary A's pair, summary B's, neither, a tie), and the
    full-model cells as markers: a black dot where the full model's top two agrees with the ODE's,
    a cross in the colour of the full model's own top two where it disagrees, an open circle where
    it is undecided (a tie or too few seeds)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from qkov_lib.plotting import FACE, setup

    setup()
    inits, ns = sorted(ode["init"].unique()), list(dict.fromkeys(ode["n"]))
    ratios, losses = sorted(ode["ratio"].unique()), sorted(ode["loss"].unique(), reverse=True)
    codes = list(CALL_COLOURS)
    cmap = ListedColormap([CALL_COLOURS[k] for k in codes])
    fig, axes = plt.subplots(len(inits), len(ns), figsize=(2.6 * len(ns) + 1.6, 2.4 * len(inits) + 0.8),
                             squeeze=False, sharex=True, sharey=True, facecolor=FACE)
    for i, s in enumerate(inits):
        for j, n in enumerate(ns):
            ax = axes[i, j]
            g = ode[(ode["init"] == s) & (ode["n"] == n)].set_index(["loss", "ratio"])["top two"]
            grid = np.array([[codes.index(g.get((L, r), "not tested")) for r in ratios] for L in losses])
            ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(codes) - 0.5, aspect="auto", origin="upper")
            ax.grid(False)
            for _, c in cells[(cells["init"] == s) & (cells["n"] == n)].iterrows():
                x, y = ratios.index(c["ratio"]), losses.index(c["loss"])
                col = CALL_COLOURS.get(c["top two (full model)"], "white")
                if c["agree"] == "yes":
                    ax.plot(x, y, "o", ms=7, mfc="k", mec="white", mew=1.0)
                elif c["agree"] == "no":
                    ax.plot(x, y, "X", ms=12, mfc=col, mec="k", mew=1.2)
                else:
                    ax.plot(x, y, "o", ms=9, mfc="white", mec="k", mew=1.5)
    for j, n in enumerate(ns):
        axes[0, j].set_title(f"n = {n}", fontsize=10)
        axes[-1, j].set_xlabel("eta_QK / eta_OV")
    for i, s in enumerate(inits):
        axes[i, 0].set_ylabel(f"init {s:g}\ntraining loss")
    axes[0, 0].set_yticks(range(len(losses)), [f"{L:g}" for L in losses])
    axes[0, 0].set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
    for ax in axes.flat:
        ax.tick_params(labelsize=7)
        plt.setp(ax.get_xticklabels(), rotation=90)
    handles = [Patch(fc=CALL_COLOURS[k], ec="k", label=C.S2_WORDS[k]) for k in ("A", "B", "neither", "tie")]
    handles += [plt.Line2D([], [], marker=m, ls="", mfc=fc, mec=ec, ms=8, label=lab) for m, fc, ec, lab in (
        ("o", "k", "white", "full model agrees"), ("X", "0.6", "k", "full model disagrees (colour: its top two)"),
        ("o", "white", "k", "full model undecided"))]
    fig.legend(handles=handles, loc="upper center", ncol=4, frameon=False, fontsize=8, bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


@dataclass
class Phase:
    """Everything the S2 section shows: the ODE map, FAFO's moves, the full-model runs and cells,
    and the verdict."""

    ode: pd.DataFrame
    moves: pd.DataFrame
    runs: pd.DataFrame
    cells: pd.DataFrame
    verdict: Verdict


def run_phase(cfg: Mapping, progress: bool = True) -> Phase:
    """The whole S2 study of a resolved profile (:data:`PROFILES`): ODE map, FAFO's moves,
    full-model cells and the verdict."""
    ode = ode_map(cfg)
    moves = fafo_moves(ode)
    runs = full_runs(cfg, progress)
    cells = full_cells(runs, ode)
    return Phase(ode, moves, runs, cells, s2_verdict(ode, runs))
