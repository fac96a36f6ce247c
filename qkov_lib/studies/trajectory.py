"""What attention does over training, read at matched validation loss.

The paper compares the attention of models trained at different ``eta_QK/eta_OV`` "at a similar
training loss": a faster query-key rate also changes how fast the loss falls, so comparing runs
at the same step (or each at its own early-stopping point) mixes the effect of the ratio on the
attention with the effect on how far training got. Here every run of a protocol map
(:func:`qkov_lib.protocol.train_grid` with ``histories_out`` and ``taus=(0.5,)``) is read where
its validation loss first crossed fixed levels:

* :func:`curves` lays the logged validation records of every run out as one long table;
* :func:`at_levels` reads any logged series where the loss first reached each level;
* :func:`loss_levels` chooses the levels a set of compared runs all reached;
* :func:`matched` gives, per map column and ratio above 1, the change of each attention metric
  against ratio 1 at each level, paired by seed (as :func:`qkov_lib.protocol.phase_table` does
  for the final models); :func:`at_deepest_common_loss` reads any pairs of cells at the deepest
  loss both reached;
* :func:`plot_attention_vs_loss` draws an attention metric against the validation loss.

Units: losses are cross-entropies in nats; accuracy, AC and attention mass are fractions in [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from qkov_lib.figure_source import draws
from qkov_lib import claims
from qkov_lib.protocol import Cell
from qkov_lib.train import History

RUN_KEYS = ("optimizer", "eta_ov", "ratio", "seed")  # one training run of the map
CURVE_METRICS = ("val_loss", "val_accuracy", "val_attn_relevant", "val_AC@0.5")
MATCHED_METRICS = ("val_AC@0.5", "val_attn_relevant")

Column = tuple[str, float]  # (optimizer, eta_ov): one column of the map
Side = tuple[str, float, float]  # (optimizer, eta_ov, ratio): the runs of one cell over its seeds
Pair = tuple[Side, Side]  # (compared cell, reference cell)


def curves(histories: Mapping[Cell, History]) -> pd.DataFrame:
    """One row per logged step of every run: ``optimizer, eta_ov, ratio, seed, eta_qk`` (``eta_ov
    * ratio``), ``step`` and :data:`CURVE_METRICS` (validation loss in nats, accuracy, mean
    attention mass on relevant tokens and AC@0.5 as fractions; NaN where a record lacks one, e.g.
    AC@0.5 of a run trained without ``taus=(0.5,)``), sorted by run and step. Raises ValueError
    for no histories or a run logged without validation data (no ``val_loss``)."""
    if not histories:
        raise ValueError("no histories: pass the histories_out of protocol.train_grid")
    rows = []
    for cell, h in histories.items():
        if not isinstance(cell, Cell) or not isinstance(h, History):
            raise TypeError(f"histories must map protocol.Cell to train.History, got {type(cell).__name__} -> "
                            f"{type(h).__name__}")
        if not h.records or any("val_loss" not in r for r in h.records):
            raise ValueError(f"run {cell} has no validation loss in its records: train it with validation data")
        tags = {"optimizer": cell.optimizer, "eta_ov": float(cell.eta_ov), "ratio": float(cell.ratio),
                "seed": int(cell.seed), "eta_qk": float(cell.eta_ov) * float(cell.ratio)}
        rows += [{**tags, "step": int(r["step"]), **{m: float(r.get(m, math.nan)) for m in CURVE_METRICS}}
                 for r in h.records]
    return pd.DataFrame(rows).sort_values([*RUN_KEYS, "step"], ignore_index=True)


def at_levels(loss: Sequence[float], values: Sequence[float], levels: Sequence[float]) -> np.ndarray:
    """The value of a logged series where the loss first reached each of ``levels``.

    ``loss`` and ``values`` are the series at the same logged steps, in step order (1-D, equal
    length; losses positive, in nats). For a level, the crossing is the first logged point with
    ``loss <= level``: its value when it is the first point of all, else the linear interpolation
    of ``values`` in log(loss) between the point before it and it. NaN where the loss never
    reached the level (a non-finite loss reaches none). Returns a float array, one per level."""
    loss, values = np.asarray(loss, dtype=float), np.asarray(values, dtype=float)
    levels = np.asarray(levels, dtype=float)
    if loss.ndim != 1 or values.shape != loss.shape:
        raise ValueError(f"loss and values must be 1-D of equal length, got shapes {loss.shape} and {values.shape}")
    if levels.ndim != 1 or not (np.isfinite(levels) & (levels > 0)).all():
        raise ValueError(f"levels must be a 1-D sequence of positive finite losses, got {levels.tolist()}")
    out = np.full(len(levels), np.nan)
    for k, lv in enumerate(levels):
        hit = np.flatnonzero(loss <= lv)
        if not len(hit):
            continue
        i = int(hit[0])
        if i == 0:
            out[k] = values[0]
            continue
        # loss[i - 1] > lv >= loss[i]: the crossing lies between the two logged points
        w = (math.log(loss[i - 1]) - math.log(lv)) / (math.log(loss[i - 1]) - math.log(loss[i]))
        out[k] = values[i - 1] + w * (values[i] - values[i - 1])
    return out


def _runs(frame: pd.DataFrame) -> list[pd.DataFrame]:
    """The runs (:data:`RUN_KEYS` groups) of a :func:`curves` frame, each in step order."""
    return [g.sort_values("step") for _, g in frame.groupby(list(RUN_KEYS), sort=True)]


def loss_levels(curves_subset: pd.DataFrame, n: int = 3) -> list[float]:
    """Matched validation-loss levels (nats, decreasing) for a set of runs that are compared.

    The rule: ``top`` is the highest first logged validation loss of the runs (their loss at
    initialisation), ``bottom`` the deepest loss every run reached (the largest of the runs'
    minimum validation losses). The levels are the ``n`` points after ``top`` of ``n + 1`` points
    geometrically spaced from ``top`` to ``bottom``: evenly spaced in log loss, the first one step
    below ``top`` (every run has left its start), the last ``bottom``. Empty when ``bottom >=
    top`` (some run never got below the highest starting loss). Runs with no finite loss are left
    out; filter the runs not to be compared (diverged, untrained) before calling."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    _check_curves(curves_subset, ["val_loss"])
    firsts, mins = [], []
    for g in _runs(curves_subset):
        loss = g["val_loss"].to_numpy(dtype=float)
        loss = loss[np.isfinite(loss)]
        if len(loss):
            firsts.append(loss[0])
            mins.append(loss.min())
    if not firsts:
        raise ValueError("no run has a finite validation loss")
    top, bottom = max(firsts), max(mins)
    if not bottom < top:
        return []
    return [float(v) for v in np.geomspace(top, bottom, n + 1)[1:]]


def _check_curves(frame: pd.DataFrame, metrics: Sequence[str]) -> None:
    """ValueError unless ``frame`` is a non-empty :func:`curves` frame with columns ``metrics``."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"expected a curves DataFrame, got {type(frame).__name__}")
    if frame.empty:
        raise ValueError("the curves frame is empty")
    missing = [c for c in (*RUN_KEYS, "step", *metrics) if c not in frame]
    if missing:
        raise ValueError(f"the curves frame has no column(s) {missing}; it has {list(frame.columns)}")


def _column(frame: pd.DataFrame, opt: str, eta: float) -> pd.DataFrame:
    """The rows of the map column ``(opt, eta)``, every ratio (``eta`` matched to 1e-9 relative,
    so a product like ``3e-4 * 10`` finds the column 3e-3); ValueError when it has none."""
    rows = frame[(frame["optimizer"] == opt) & np.isclose(frame["eta_ov"], float(eta), rtol=1e-9, atol=0)]
    if rows.empty:
        raise ValueError(f"no run at optimizer {opt!r}, eta_ov {float(eta):g} in the curves frame")
    return rows


def _side(frame: pd.DataFrame, side: Side) -> pd.DataFrame:
    """The rows of the cell ``(optimizer, eta_ov, ratio)`` over its seeds (rates matched as in
    :func:`_column`); ValueError when it has none."""
    opt, eta, r = side
    rows = _column(frame, opt, eta)
    rows = rows[np.isclose(rows["ratio"], float(r), rtol=1e-9, atol=0)]
    if rows.empty:
        raise ValueError(f"no run at optimizer {opt!r}, eta_ov {float(eta):g}, ratio {float(r):g} in the curves frame")
    return rows


def ratio_pairs(frame: pd.DataFrame) -> list[Pair]:
    """The default comparisons of :func:`matched`: every ``(optimizer, eta_ov, ratio > 1)`` cell
    against the same column at ratio 1, in map order. ValueError for a column without ratio 1."""
    _check_curves(frame, [])
    out = []
    for (opt, eta), g in frame.groupby(["optimizer", "eta_ov"], sort=False):
        ratios = sorted(set(g["ratio"].astype(float)))
        if 1.0 not in ratios:
            raise ValueError(f"column ({opt!r}, eta_ov {eta:g}) has no ratio-1 runs to compare with")
        out += [((opt, float(eta), r), (opt, float(eta), 1.0)) for r in ratios if r > 1.0]
    return out


def _read(run: pd.DataFrame, levels: Sequence[float], metrics: Sequence[str]) -> dict[str, np.ndarray]:
    """Each metric of one run (step order) at ``levels`` (:func:`at_levels`)."""
    loss = run["val_loss"].to_numpy(dtype=float)
    return {m: at_levels(loss, run[m].to_numpy(dtype=float), levels) for m in metrics}


def matched(curves: pd.DataFrame, levels_per_column: Mapping[Column, Sequence[float]] | None = None,
            metrics: Sequence[str] = MATCHED_METRICS, pairs: Sequence[Pair] | None = None) -> pd.DataFrame:
    """The change of each metric against a reference at matched validation loss, paired by seed.

    ``pairs`` lists the comparisons as ``((optimizer, eta_ov, ratio), (optimizer, eta_ov_ref,
    ratio_ref))``, compared cell then reference (default :func:`ratio_pairs`: each ratio above 1
    against ratio 1 of its column; a fixed-``eta_QK`` route pairs ``(o, e, r)`` with ``(o, e * r,
    1.0)``). A pair belongs to the column ``(optimizer, eta_ov)`` of its compared cell; its levels
    are ``levels_per_column[column]`` (nats), by default :func:`loss_levels` of the runs of every
    pair of that column (compared cells and references together).

    At each level, each seed run in both cells gives the difference compared minus reference of
    each metric read by :func:`at_levels`; seeds whose two runs did not both reach the level are
    left out. Returns one row per (pair, level): ``optimizer, eta_ov, ratio, eta_qk, ref_eta_ov,
    ref_ratio, level`` and per metric ``m`` the :class:`qkov_lib.claims.Change` columns ``d_<m>``
    (mean, in the metric's unit), ``d_<m>_ci`` (95% seed half-width) and ``d_<m>_n`` (seed pairs),
    as :func:`qkov_lib.protocol.phase_table`. A column whose runs share no loss range (no default
    level) gives no rows."""
    metrics = list(metrics)
    _check_curves(curves, ["val_loss", *metrics])
    pairs = ratio_pairs(curves) if pairs is None else [(tuple(a), tuple(b)) for a, b in pairs]
    by_col: dict[Column, list[Pair]] = {}
    for a, b in pairs:
        by_col.setdefault((a[0], float(a[1])), []).append((a, b))
    given = {(c[0], float(c[1])): list(v) for c, v in (levels_per_column or {}).items()}
    unknown = [c for c in given if c not in by_col]
    if unknown:
        raise ValueError(f"levels_per_column names column(s) {unknown} that no pair compares; "
                         f"the columns are {list(by_col)}")
    rows = []
    for col, col_pairs in by_col.items():
        sides = {s: _side(curves, s) for p in col_pairs for s in p}
        levels = given.get(col)
        if levels is None:
            levels = loss_levels(pd.concat(list(sides.values())))
        read = {s: {int(run["seed"].iloc[0]): _read(run, levels, metrics) for run in _runs(f)}
                for s, f in sides.items()}
        for a, b in col_pairs:
            seeds = sorted(set(read[a]) & set(read[b]))
            for k, lv in enumerate(levels):
                row = {"optimizer": a[0], "eta_ov": float(a[1]), "ratio": float(a[2]),
                       "eta_qk": float(a[1]) * float(a[2]), "ref_eta_ov": float(b[1]), "ref_ratio": float(b[2]),
                       "level": float(lv)}
                for m in metrics:
                    c = claims.Change.of([read[a][s][m][k] - read[b][s][m][k] for s in seeds])
                    row[f"d_{m}"], row[f"d_{m}_ci"], row[f"d_{m}_n"] = c.mean, c.half_width, c.n
                rows.append(row)
    return pd.DataFrame(rows)


def at_deepest_common_loss(curves: pd.DataFrame, pairs: Sequence[Pair],
                           metrics: Sequence[str] = (*MATCHED_METRICS, "val_accuracy")) -> pd.DataFrame:
    """Each pair (compared cell, reference cell) of :func:`matched` read at one level: the deepest
    validation loss that every run of the pair reached (the last of :func:`loss_levels` of the
    pair's runs, nats), where the comparison is furthest from initialisation and still matched. One
    row per pair that has runs on both sides and a shared loss range: ``optimizer, eta_ov, ratio,
    ref_eta_ov, ref_ratio, level`` and the ``d_<m>``, ``d_<m>_ci``, ``d_<m>_n`` columns of
    :func:`matched`; pairs without runs or without a shared range are left out."""
    rows = []
    for a, b in pairs:
        try:
            both = pd.concat([_side(curves, tuple(a)), _side(curves, tuple(b))])
        except ValueError:  # a side without trained runs: nothing to read
            continue
        levels = loss_levels(both)
        if levels:
            rows.append(matched(both, {(a[0], float(a[1])): [levels[-1]]}, metrics, pairs=[(a, b)]))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


@draws
def plot_attention_vs_loss(curves: pd.DataFrame, columns: Sequence[Column], metric: str = "val_AC@0.5",
                           n_grid: int = 60):
    """``metric`` against the validation loss (nats; the axis is inverted, so training runs left
    to right), one panel per ``(optimizer, eta_ov)`` of ``columns``, one colour per ratio: a thin
    line per seed run (its logged points) and a thick line for the seed mean, read by
    :func:`at_levels` on ``n_grid`` losses geometrically spaced over the panel's logged range
    (where every seed of that ratio reached the loss). White face; returns the figure."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from qkov_lib.plotting import FACE, setup

    _check_curves(curves, ["val_loss", metric])
    columns = [(c[0], float(c[1])) for c in columns]
    if not columns:
        raise ValueError("no columns to plot")
    panels = [_column(curves, o, e) for o, e in columns]
    setup()
    ratios = sorted(set(pd.concat(panels)["ratio"].astype(float)))
    colour = dict(zip(ratios, sns.color_palette("viridis", len(ratios))))
    fig, axes = plt.subplots(1, len(columns), figsize=(3.8 * len(columns) + 1.2, 3.2), squeeze=False,
                             facecolor=FACE, sharey=True)
    for ax, (opt, eta), g in zip(axes[0], columns, panels):
        loss = g["val_loss"].to_numpy(dtype=float)
        loss = loss[np.isfinite(loss) & (loss > 0)]
        grid = np.geomspace(loss.max(), loss.min(), n_grid)
        for r, h in g.groupby("ratio", sort=True):
            runs = _runs(h)
            for run in runs:
                ax.plot(run["val_loss"], run[metric], color=colour[float(r)], lw=0.6, alpha=0.35)
            mean = np.mean([_read(run, grid, [metric])[metric] for run in runs], axis=0)
            ax.plot(grid, mean, color=colour[float(r)], lw=2.0, label=f"{r:g}")
        ax.invert_xaxis()
        ax.set_title(f"{opt}, eta_OV = {eta:g}", fontsize=10)
        ax.set_xlabel("validation loss (nats)")
        ax.set_ylabel(metric)
    from matplotlib.lines import Line2D

    # one legend for every ratio of every panel (a panel may lack a ratio whose runs did not train)
    handles = [Line2D([], [], color=colour[r], lw=2.0, label=f"{r:g}") for r in ratios]
    axes[0, -1].legend(handles=handles, title="eta_QK / eta_OV", loc="center left", bbox_to_anchor=(1.0, 0.5),
                       fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


__all__ = ["curves", "at_levels", "loss_levels", "ratio_pairs", "matched", "plot_attention_vs_loss",
           "RUN_KEYS", "CURVE_METRICS", "MATCHED_METRICS"]
