"""The (eta_QK, eta_OV) plane of a real-data map: where each claim holds, cell by cell.

A protocol map (:mod:`qkov_lib.protocol`) trains every optimizer at base rates ``eta_ov`` times
ratios ``r``, so each run sits at a point ``(eta_OV, eta_QK) = (eta_ov, r * eta_ov)`` of the
plane. A ratio can be reached two ways, and a reader must see which one an effect follows:

* ``qk_up``: raise ``eta_QK`` at fixed ``eta_OV`` (against the ratio-1 run at the same ``eta_OV``);
* ``ov_down``: lower ``eta_OV`` at fixed ``eta_QK`` (against the ratio-1 run at ``eta_OV = eta_QK``).

With base rates spaced by the ratio step (e.g. decades and ratios 1, 10, 100) one grid gives both
routes. :func:`plane_phase` gives the paired seed changes of every cell along both routes (the
trained-pair view and the all-runs view); :func:`plot_plane` draws them in absolute coordinates.
The claims are read first where the paper reads them: :func:`protocol_cells` takes the cells of
the paper's protocol (tune the base rate at ratio 1, raise ``eta_QK``) and of its control (lower
``eta_OV`` at the tuned ``eta_QK``), and :func:`protocol_verdicts` turns them into words by the one
rule of :mod:`qkov_lib.claims`. :func:`qk_ceiling` (the largest base rate at which ratio-1 training
is stable) marks the cells past it; nothing is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from qkov_lib.figure_source import draws
from qkov_lib import claims, protocol

ROUTES = {"qk_up": "eta_QK raised at fixed eta_OV", "ov_down": "eta_OV lowered at fixed eta_QK"}
ROUTE_MARK = {"qk_up": "↑", "ov_down": "←"}  # the move in the plane (x = eta_OV, y = eta_QK)
ALL_RUN_METRICS = ("accuracy", "macro_f1", "AC@0.5", "attn_relevant")  # the all-runs view
MATCHED = "m_val_"  # prefix of the plane's changes at matched validation loss (:func:`add_matched`)


def rate(x: float) -> float:
    """``x`` to 6 significant digits: the key of a rate, so ``1e-4 * 100`` and ``1e-2`` meet."""
    return float(f"{float(x):.6g}")


def _rates(s: pd.Series) -> pd.Series:
    return s.astype(float).map(rate)


def plane_phase(table: pd.DataFrame, chance: float | None = None) -> pd.DataFrame:
    """:func:`qkov_lib.protocol.phase_table` of a run table (with ``trained``) along both routes:
    one row per (``route``, optimizer, ``eta_ov``, ratio) with ``eta_qk`` (= ratio × eta_ov),
    ``ref_eta_ov`` (the base rate of the ratio-1 reference: ``eta_ov`` for ``qk_up``, ``eta_qk``
    for ``ov_down``), the trained-pair changes ``d_<m>`` and the all-runs changes ``d_all_<m>``
    for m in :data:`ALL_RUN_METRICS`. ``ov_down`` keeps only the fixed-``eta_QK`` lines that hold
    a ratio-1 run and a higher ratio; its ratio-1 rows are those of ``qk_up``, given once."""
    t = table.assign(eta_ov=_rates(table["eta_ov"]))
    qk = protocol.phase_table(t, chance=chance, all_metrics=ALL_RUN_METRICS)
    qk = qk.assign(route="qk_up", eta_qk=_rates(qk["eta_ov"] * qk["ratio"]), ref_eta_ov=qk["eta_ov"])
    by_qk = t.assign(eta_ov=_rates(t["eta_ov"] * t["ratio"]))  # group key = eta_QK
    ov = protocol.phase_table(by_qk, chance=chance, all_metrics=ALL_RUN_METRICS).rename(columns={"eta_ov": "eta_qk"})
    ov = ov.assign(route="ov_down", eta_ov=_rates(ov["eta_qk"] / ov["ratio"]), ref_eta_ov=ov["eta_qk"])
    lines = ov.groupby(["optimizer", "eta_qk"])["ratio"].agg(lambda r: (r == 1.0).any() and (r > 1.0).any())
    keep = ov.set_index(["optimizer", "eta_qk"]).index.map(lines.to_dict()).astype(bool)
    ov = ov[keep & (ov["ratio"] > 1.0)]
    return pd.concat([qk, ov], ignore_index=True)


def pairs_of(phase: pd.DataFrame) -> list[tuple[tuple[str, float, float], tuple[str, float, float]]]:
    """Every comparison of the plane above ratio 1 as ``((optimizer, eta_ov, ratio), (optimizer,
    ref_eta_ov, 1.0))``, both routes (what :func:`qkov_lib.studies.trajectory.matched` pairs)."""
    up = phase[phase["ratio"] > 1.0]
    return [((o, float(e), float(r)), (o, float(f), 1.0))
            for o, e, r, f in zip(up["optimizer"], up["eta_ov"], up["ratio"], up["ref_eta_ov"])]


def add_matched(phase: pd.DataFrame, matched: pd.DataFrame) -> pd.DataFrame:
    """``phase`` with the changes at matched validation loss of :func:`pairs_of` (a frame of
    :func:`qkov_lib.studies.trajectory.at_deepest_common_loss`) as ``m_level`` and
    ``m_val_<metric>`` (+ ``_ci``, ``_n``) columns, joined on (optimizer, eta_ov, ratio,
    ref_eta_ov); NaN where a pair could not be matched."""
    if matched is None or not len(matched):
        return phase
    m = matched.rename(columns={"level": "m_level", **{c: "m_" + c[2:] for c in matched if c.startswith("d_val_")}})
    keep = ["optimizer", "eta_ov", "ratio", "ref_eta_ov", "m_level", *[c for c in m if c.startswith(MATCHED)]]
    m = m[keep].assign(eta_ov=lambda f: f["eta_ov"].map(rate), ref_eta_ov=lambda f: f["ref_eta_ov"].map(rate))
    return phase.merge(m, on=["optimizer", "eta_ov", "ratio", "ref_eta_ov"], how="left")


def qk_ceiling(table: pd.DataFrame) -> dict[str, float]:
    """Per optimizer, the largest base rate of the map below which plain training is stable: the
    largest rate whose ratio-1 runs, and those of every smaller rate, did not diverge (NaN: even
    the smallest rate diverged at ratio 1). A cell whose ``eta_QK`` exceeds it is past the edge:
    there the QK step is larger than any step the map has shown the optimizer to take safely.
    Slow runs that did not train are not instability and do not lower it."""
    ref = table[table["ratio"] == 1.0]
    out = {}
    for opt, g in ref.groupby("optimizer", sort=False):
        ceiling = math.nan
        for e, h in sorted(g.groupby("eta_ov"), key=lambda x: float(x[0])):
            if h["diverged"].astype(bool).any():
                break
            ceiling = float(e)
        out[opt] = ceiling
    return out


def cell_name(row: Mapping) -> str:
    """A cell as regions name it: ``(eta_OV, eta_QK)`` and the route's move (↑ raise eta_QK,
    ← lower eta_OV), e.g. ``(1e-4, 1e-2)↑``."""
    return f"({row['eta_ov']:g}, {row['eta_qk']:g}){ROUTE_MARK[row['route']]}"


# --- the paper's protocol, read first ----------------------------------------------------------
# The paper tunes the base rate at ratio 1, then raises eta_QK x10 and x100 at that eta_OV. Those cells
# are each dataset's first result, nothing excluded. Beside them, the control for "is it only a larger
# QK step?": the same ratios reached by lowering eta_OV at the tuned eta_QK.
PROTOCOL_ROUTES = {"qk_up": "the paper's protocol: eta_QK raised at the tuned eta_OV",
                   "ov_down": "control: eta_OV lowered at the tuned eta_QK"}
OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD"}
# what each claim reads in a cell: the plane's column of paired changes
CLAIM_COLUMN = {"R1": "d_all_accuracy", "R2": "d_AC@0.5", "R3": MATCHED + "attn_relevant"}
# shown beside the claim's own change, never deciding it
BESIDE = {"R2": ("d_ACMC@0.5", "d_sufficiency"), "R1": ("d_all_macro_f1",)}
PROTOCOL_COLUMNS = ["claim", "route", "optimizer", "eta_ov", "eta_qk", "ratio", "cell", "mean", "hw", "n",
                    "past_stable", "note"]


def optimizer_name(opt: str) -> str:
    """``adamw`` -> ``AdamW`` (as a page names an optimizer)."""
    return OPTIMIZER_NAMES.get(str(opt), str(opt))


def protocol_cell_name(route: str, optimizer: str, eta_ov: float, eta_qk: float, ratio: float) -> str:
    """A protocol cell in words: ``AdamW, η_OV 1e-3, ratio 10 vs 1`` (the paper's protocol) or
    ``AdamW, η_QK 1e-3, η_OV ÷10 (ratio 10 vs 1)`` (the control)."""
    if route == "qk_up":
        return f"{optimizer_name(optimizer)}, η_OV {eta_ov:g}, ratio {ratio:g} vs 1"
    return f"{optimizer_name(optimizer)}, η_QK {eta_qk:g}, η_OV ÷{ratio:g} (ratio {ratio:g} vs 1)"


def protocol_cells(plane: pd.DataFrame, selected: Mapping[str, float], ceiling: Mapping[str, float],
                   chance_loss: float = math.inf) -> pd.DataFrame:
    """Every cell the paper's protocol and its control read, per claim: the ``qk_up`` cells at each
    optimizer's tuned ``eta_OV`` (``selected``) and the ``ov_down`` cells at the tuned ``eta_QK``, every
    ratio above 1 of :func:`plane_phase` (``plane``, with :func:`add_matched`). One row per (claim, cell):
    the change the claim reads (:data:`CLAIM_COLUMN`; a fraction) as ``mean``, its 95 % seed half-width
    ``hw`` and seed pairs ``n``; ``past_stable`` where ``eta_QK`` exceeds the largest base rate at which
    ratio-1 training was stable (``ceiling``: marked, read all the same); ``note`` says why a cell has no
    change. R3 is read at matched validation loss only where both runs learned: the matched level lies at
    least :data:`qkov_lib.claims.SAME_LOSS` below ``chance_loss`` (the untrained model's validation loss,
    nats); elsewhere the cell is 'not comparable' (mean NaN). The changes shown beside a claim
    (:data:`BESIDE`) come as extra ``<column>`` / ``<column>_ci`` columns."""
    rows = []
    for route in PROTOCOL_ROUTES:
        for opt, tuned in selected.items():
            key = "eta_ov" if route == "qk_up" else "eta_qk"
            g = plane[(plane["route"] == route) & (plane["optimizer"] == opt) & (plane["ratio"] > 1.0)
                      & (plane[key].map(rate) == rate(tuned))].sort_values("ratio")
            for _, p in g.iterrows():
                eta_ov, eta_qk, r = rate(p["eta_ov"]), rate(p["eta_qk"]), float(p["ratio"])
                past = bool(eta_qk > ceiling.get(opt, math.inf) * (1 + 1e-9))
                for cid, col in CLAIM_COLUMN.items():
                    c, note = protocol._change(p, col), ""
                    if cid == "R3":
                        level = float(p.get("m_level", math.nan))
                        if not math.isfinite(level):
                            c, note = None, "no matched validation loss (a side without trained runs)"
                        elif level > chance_loss - claims.SAME_LOSS:
                            c, note = None, (f"not comparable: matched at validation loss {level:.3f}, not "
                                             f"{claims.threshold_text('SAME_LOSS')} below chance ({chance_loss:.3f})")
                    if c is None or not math.isfinite(c.mean):
                        note = note or "no seed pair to compare"
                    row = {"claim": cid, "route": route, "optimizer": opt, "eta_ov": eta_ov, "eta_qk": eta_qk,
                           "ratio": r, "cell": protocol_cell_name(route, opt, eta_ov, eta_qk, r),
                           "mean": c.mean if c is not None else math.nan,
                           "hw": c.half_width if c is not None else math.nan, "n": c.n if c is not None else 0,
                           "past_stable": past, "note": note}
                    for b in BESIDE.get(cid, ()):
                        row[b], row[f"{b}_ci"] = float(p.get(b, math.nan)), float(p.get(f"{b}_ci", math.nan))
                    rows.append(row)
    return pd.DataFrame(rows, columns=None if rows else PROTOCOL_COLUMNS)


def _readings(cells: pd.DataFrame, cid: str) -> tuple[list[claims.Reading], list[str]]:
    """The claim's readings over ``cells`` (one route of :func:`protocol_cells`) by the one rule, and
    the cells not comparable (left out of the family, named in the reason)."""
    g = cells[cells["claim"] == cid]
    # read back from a results file, a missing change is None, not NaN
    g = g.assign(**{c: pd.to_numeric(g[c], errors="coerce") for c in ("mean", "hw", "n")})
    g = g.assign(n=g["n"].fillna(0), note=g["note"].fillna(""))
    apart = [f"{c} ({n})" for c, n in zip(g["cell"], g["note"]) if str(n).startswith("not comparable")]
    g = g[~g["note"].astype(str).str.startswith("not comparable")]
    changes = {c + (" (η_QK past the stable rate)" if past else ""):
               (claims.Change(m, h, int(n)) if math.isfinite(m) else None)
               for c, m, h, n, past in zip(g["cell"], g["mean"], g["hw"], g["n"], g["past_stable"])}
    return claims.read_cells(changes, claims.ESTIMANDS[cid]), apart


def protocol_verdicts(cells: pd.DataFrame, route: str = "qk_up") -> dict[str, claims.Verdict]:
    """Per claim, the word over the cells of ``route`` (:func:`protocol_cells`) by the one rule
    (:func:`qkov_lib.claims.read_cells` and :func:`qkov_lib.claims.decide`): Bonferroni over the
    claim's cells of this dataset; cells not comparable are named in the reason, not read."""
    out = {}
    sub = cells[cells["route"] == route] if len(cells) else cells
    for cid in CLAIM_COLUMN:
        readings, apart = _readings(sub, cid) if len(sub) else ([], [])
        v = claims.decide(readings, claims.ESTIMANDS[cid], claims.ESTIMANDS[cid].text())
        if apart:
            v = claims.Verdict(v.verdict, v.rule, v.reason + "; not comparable, not read: " + ", ".join(apart),
                               v.region, v.effect)
        out[cid] = v
    return out


def readings_frame(cells: pd.DataFrame) -> pd.DataFrame:
    """The protocol cells as a reader's table: one row per cell (route, optimizer, rates, ratio), per
    claim its change ± the family interval and its outcome (``holds``, ``contradicted``, ``undecided``;
    ``not comparable`` for R3 where a run did not learn), the seeds that would decide an undecided one,
    and ACMC@0.5 and sufficiency beside R2 (± their 95 % seed intervals)."""
    if not len(cells):
        return pd.DataFrame()
    rows: dict[str, dict] = {}
    for route in PROTOCOL_ROUTES:
        sub = cells[cells["route"] == route]
        for cid in CLAIM_COLUMN:
            readings, _ = _readings(sub, cid)
            got = {r.cell.split(" (η_QK past")[0]: r for r in readings}
            for _, c in sub[sub["claim"] == cid].iterrows():
                row = rows.setdefault(c["cell"], {"route": ROUTE_MARK[route] + " " + PROTOCOL_ROUTES[route],
                                                  "cell": c["cell"], "η_QK past the stable rate": c["past_stable"]})
                r = got.get(c["cell"])
                if r is None:
                    row[f"{cid}"] = str(c["note"]).split(":")[0]
                    continue
                row[cid] = f"{r.outcome}: {r.text()}" + (f"; {r.seeds} seeds would decide"
                                                         if r.outcome == "undecided" and r.seeds else "")
                for b in BESIDE.get(cid, ()):
                    if b in c and cid == "R2":
                        row[b.removeprefix("d_")] = fmt_change(c[b], c[f"{b}_ci"])
    return pd.DataFrame(list(rows.values()))


@draws
def plot_forest(cells: Mapping[str, pd.DataFrame], claim_ids: Sequence[str] = ("R2", "R1")):
    """A forest plot of the paper's protocol cells (``qk_up`` rows of :func:`protocol_cells`) of
    several datasets (``{dataset: cells}``): one panel per claim in ``claim_ids``, one row per dataset x
    optimizer x ratio, the change with its family interval (Bonferroni over the claim's cells of that
    dataset) clipped to [-1, 1] (the changes are fractions), coloured by outcome, and the claim's
    margin drawn as a dashed line."""
    import matplotlib.pyplot as plt

    from qkov_lib.plotting import FACE, setup

    setup()
    colours = {"holds": "tab:blue", "contradicted": "tab:red", "undecided": "0.55"}
    fig, axes = plt.subplots(1, len(claim_ids), figsize=(5.2 * len(claim_ids), 0.38 * 12 + 1.2), sharey=True,
                             squeeze=False, facecolor=FACE)
    labels: list[str] = []
    for j, cid in enumerate(claim_ids):
        ax, est, y = axes[0, j], claims.ESTIMANDS[cid], 0
        labels = []
        for ds, frame in cells.items():
            sub = frame[frame["route"] == "qk_up"] if len(frame) else frame
            readings, _ = _readings(sub, cid) if len(sub) else ([], [])
            for r in readings:
                lo, hi = (np.clip([r.change.mean - r.hw, r.change.mean + r.hw], -1, 1)
                          if r.change is not None and math.isfinite(r.hw) else (math.nan, math.nan))
                m = r.change.mean if r.change is not None else math.nan
                ax.plot([lo, hi], [y, y], color=colours[r.outcome], lw=2)
                ax.plot([m], [y], "o", color=colours[r.outcome], ms=5)
                if not math.isfinite(m):
                    ax.annotate("no run trained", (0, y), fontsize=7, color="0.4", va="center")
                labels.append(f"{ds}: {r.cell.replace(' vs 1', '')}")
                y += 1
        ax.axvline(est.margin, ls="--", color="black", lw=1)
        ax.axvline(0, color="0.8", lw=0.8, zorder=0)
        ax.set_title(f"{cid}: {'Δ AC@0.5' if cid == 'R2' else 'Δ accuracy' if cid == 'R1' else 'Δ attention'} "
                     f"(claim's side: {est.side})", fontsize=9)
        ax.set_xlim(-1.05, 1.05)
        ax.tick_params(labelsize=7)
    ax0 = axes[0, 0]
    ax0.set_yticks(range(len(labels)), labels, fontsize=7)
    ax0.invert_yaxis()
    handles = [plt.Line2D([], [], color=c, lw=2, label=o) for o, c in colours.items()]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


@draws
def plot_plane(phase: pd.DataFrame, metric: str, ceiling: Mapping[str, float] | None = None,
               all_runs: bool = False):
    """The change of ``metric`` (``d_<metric>``, or ``d_all_<metric>`` with ``all_runs``) in the
    absolute plane: one panel per (optimizer, route), x = eta_OV and y = eta_QK on log axes, the
    iso-ratio diagonals ``eta_QK = r eta_OV`` dashed and labelled, ratio-1 runs as open circles,
    each higher-ratio cell a square coloured by its change (symmetric scale per optimizer) and
    labelled with :func:`qkov_lib.protocol.phase_label` (``*``: the 95% seed interval excludes 0;
    grey "no run trained": no trained pair), a thin arrow from its reference, and the stable ceiling
    (``ceiling``) as a dotted line above which cells are faded (shown, not read)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    from qkov_lib.plotting import FACE, setup

    setup()
    col = f"d_all_{metric}" if all_runs else f"d_{metric}"
    if col not in phase:
        raise ValueError(f"the phase table has no column {col!r}; metrics: "
                         f"{sorted(c[2:] for c in phase if c.startswith('d_') and not c.endswith(('_ci', '_n', '_sig')))}")
    opts = list(dict.fromkeys(phase["optimizer"]))
    routes = [r for r in ROUTES if (phase["route"] == r).any()]
    fig, axes = plt.subplots(len(opts), len(routes), figsize=(4.2 * len(routes), 3.8 * len(opts)), squeeze=False,
                             facecolor=FACE)
    for i, opt in enumerate(opts):
        sub = phase[phase["optimizer"] == opt]
        vals = sub.loc[sub["ratio"] > 1.0, col].to_numpy(dtype=float)
        lim = float(np.nanmax(np.abs(vals))) if np.isfinite(vals).any() else 1.0
        norm = TwoSlopeNorm(0.0, -(lim or 1.0), lim or 1.0)
        base = sub[(sub["route"] == "qk_up") & (sub["ratio"] == 1.0)]
        lo, hi = float(sub["eta_ov"].min()) / 3, float(sub["eta_qk"].max()) * 3
        for j, route in enumerate(routes):
            ax = axes[i, j]
            xs = np.geomspace(lo, hi, 2)
            for r in sorted(set(sub["ratio"])):
                ax.plot(xs, r * xs, ls="--", lw=0.7, color="0.6", zorder=0)
                x_lab = min(hi, hi / r) / 2.2  # near where the diagonal leaves the panel, away from the cells
                ax.annotate(f"ratio {r:g}", (x_lab, r * x_lab), fontsize=7, color="0.4", rotation=35,
                            ha="right", va="bottom")
            ax.scatter(base["eta_ov"], base["eta_qk"], s=60, facecolors="none", edgecolors="black", zorder=3)
            cells = sub[(sub["route"] == route) & (sub["ratio"] > 1.0)]
            for _, c in cells.iterrows():
                ref = (c["ref_eta_ov"], c["ref_eta_ov"])
                ax.annotate("", (c["eta_ov"], c["eta_qk"]), ref, arrowprops=dict(arrowstyle="->", lw=0.6,
                                                                                   color="0.5"), zorder=1)
            past = cells["eta_qk"] > (ceiling or {}).get(opt, math.inf) * (1 + 1e-9)
            blank = cells[~np.isfinite(cells[col].astype(float))]
            ax.scatter(blank["eta_ov"], blank["eta_qk"], marker="s", s=180, facecolors="0.92", edgecolors="0.5",
                       linewidths=0.5, zorder=4)  # no trained pair: nothing to colour
            sc = None
            for faded in (False, True):  # cells past the stable ceiling are drawn faded: shown, not read
                part = cells[past == faded]
                sc_part = ax.scatter(part["eta_ov"], part["eta_qk"], c=part[col], cmap="RdBu", norm=norm,
                                     marker="s", s=180, edgecolors="black", linewidths=0.5, zorder=4,
                                     alpha=0.4 if faded else 1.0)
                sc = sc if faded and sc is not None else sc_part
            for _, c in cells.iterrows():
                sig = bool(c.get(f"{col}_ci", np.nan) < abs(c[col])) if np.isfinite(c[col]) and \
                    c.get(f"{col}_n", 0) >= 2 else False
                ax.annotate(protocol.phase_label(float(c[col]), sig) or "no run trained", (c["eta_ov"], c["eta_qk"]),
                            xytext=(8, -3), textcoords="offset points", fontsize=7, zorder=5)
            if ceiling and math.isfinite(ceiling.get(opt, math.nan)):
                ax.axhline(ceiling[opt], ls=":", lw=1, color="tab:red")
                ax.annotate("stable ceiling", (hi / 1.2, ceiling[opt] * 1.15), fontsize=7, color="tab:red", ha="right")
            ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
            ax.set_xlabel("eta_OV", fontsize=8)
            ax.set_ylabel("eta_QK" if j == 0 else "", fontsize=8)
            ax.set_title(f"{opt}: Δ {metric} ({'all runs' if all_runs else 'trained pairs'}), "
                         f"{ROUTE_MARK[route]} {ROUTES[route]}", fontsize=8)
            ax.tick_params(labelsize=7)
            fig.colorbar(sc, ax=ax, shrink=0.8, pad=0.02).ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def fmt_change(mean: float, hw: float, digits: int = 3) -> str:
    """A change as a cell: ``+0.051 ± 0.020`` (no interval when ``hw`` is not finite; \"n/a\" for no change)."""
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:+.{digits}f}" + (f" ± {hw:.{digits}f}" if math.isfinite(hw) else "")


def recipe(plane: pd.DataFrame, ceiling: Mapping[str, float]) -> pd.DataFrame:
    """What the plane says to someone turning the knob, per optimizer, over the cells above ratio 1
    whose ``eta_QK`` stays at or below ``ceiling``: the ceiling itself, how many cells were read
    and in how many AC@0.5 rose (its 95% seed interval above 0), the mean change of AC@0.5 along
    each route (↑ raising eta_QK, ← lowering eta_OV: an effect of the ratio shows along both),
    the cell of the largest rise with the all-runs accuracy change there, and the largest
    all-runs accuracy fall (changes are fractions, ± the 95% seed interval)."""
    rows = []
    plane = plane.copy()
    for col in ("ratio", "eta_qk", "d_AC@0.5", "d_AC@0.5_ci", "d_all_accuracy", "d_all_accuracy_ci"):
        if col in plane:  # read back from a results file, a missing change is None, not NaN
            plane[col] = pd.to_numeric(plane[col], errors="coerce")
    for opt, g in plane.groupby("optimizer", sort=False):
        c = ceiling.get(opt, math.nan)
        read = g[(g["ratio"] > 1.0) & (g["eta_qk"] <= c * (1 + 1e-9)) & np.isfinite(g["d_AC@0.5"])]
        row = {"optimizer": opt, "eta_QK ceiling": f"{c:g}" if math.isfinite(c) else "none", "cells read": len(read)}
        if not len(read):
            rows.append(row)
            continue
        up = read["d_AC@0.5"] - read["d_AC@0.5_ci"].fillna(np.inf) > 0
        row["AC@0.5 rises"] = f"{int(up.sum())}/{len(read)}"
        for route in ROUTES:
            r = read[read["route"] == route]["d_AC@0.5"]
            row[f"mean Δ AC@0.5 {ROUTE_MARK[route]}"] = f"{r.mean():+.3f}" if len(r) else "n/a"
        best = read.loc[read["d_AC@0.5"].idxmax()]
        row["largest rise"] = f"{cell_name(best)}: {fmt_change(best['d_AC@0.5'], best['d_AC@0.5_ci'])}"
        row["Δ accuracy there"] = fmt_change(best["d_all_accuracy"], best["d_all_accuracy_ci"])
        acc = read[np.isfinite(read["d_all_accuracy"])]
        if len(acc):
            worst = acc.loc[acc["d_all_accuracy"].idxmin()]
            row["largest accuracy fall"] = f"{cell_name(worst)}: {fmt_change(worst['d_all_accuracy'], worst['d_all_accuracy_ci'])}"
        rows.append(row)
    return pd.DataFrame(rows)


__all__ = ["recipe", "fmt_change", "pairs_of", "add_matched", "MATCHED", "ROUTES", "ROUTE_MARK", "ALL_RUN_METRICS",
           "rate", "plane_phase", "qk_ceiling", "cell_name", "plot_plane", "PROTOCOL_ROUTES", "CLAIM_COLUMN",
           "protocol_cells", "protocol_verdicts", "readings_frame", "plot_forest", "optimizer_name"]
