"""Figures (seaborn/matplotlib), all on a white face colour so they read in dark mode too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from qkov_lib.figure_source import draws
from qkov_lib.metrics import seed_half_width

FACE = "white"


def setup() -> None:
    """Seaborn theme with white figure and axes faces."""
    sns.set_theme(style="whitegrid", context="notebook",
                  rc={"figure.facecolor": FACE, "axes.facecolor": FACE, "savefig.facecolor": FACE,
                      "figure.dpi": 90})


@draws
def dtap_grid(hists: Mapping[tuple[str, float], np.ndarray], rows: Sequence[str], cols: Sequence[float],
              row_label: str = "", col_label: str = "eta_QK/eta_OV", vmax: float | None = None) -> plt.Figure:
    """DTAP heatmaps (attention on relevant tokens vs. confidence in the gold class), one panel
    per (row, col) key of ``hists``; each panel is a (bins, bins) array of fractions with the
    attention bin as row index. Colour is the fraction of instances (log-like scale). A panel with
    no histogram (e.g. no run reached that training loss) is left blank; with none at all the
    figure says so."""
    setup()
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(2.4 * len(cols) + 1.2, 2.3 * len(rows) + 0.6),
                             squeeze=False, facecolor=FACE, sharex=True, sharey=True)
    if not hists:
        for ax in axes.flat:
            ax.set_axis_off()
        fig.text(0.5, 0.5, "no run to draw (none reached these training losses)", ha="center", va="center")
        return fig
    bins = next(iter(hists.values())).shape[0]
    vmax = vmax or max(float(h.max()) for h in hists.values())
    from matplotlib.colors import PowerNorm

    norm = PowerNorm(0.4, vmin=0, vmax=vmax)
    edges = np.linspace(0, 1, bins + 1)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i, j]
            h = hists.get((r, c))
            if h is None:
                ax.set_axis_off()
                continue
            # x = confidence, y = attention, origin bottom-left
            # empty bins stay white (masked), so sparse panels read at a glance
            mesh = ax.pcolormesh(edges, edges, np.ma.masked_equal(h, 0.0), cmap="mako_r", norm=norm)
            ax.set_aspect("equal")
            ax.grid(False)
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            if i == 0:
                ax.set_title(f"{col_label} = {c:g}", fontsize=10)
            if j == 0:
                ax.set_ylabel(f"{row_label}{r}\nattention on relevant")
            if i == len(rows) - 1:
                ax.set_xlabel("confidence p(y)")
    fig.colorbar(mesh, ax=axes, shrink=0.8, label="fraction of instances")
    return fig


def seed_band(values) -> tuple[float, float]:
    """``(low, high)``: the mean of ``values`` (one per seed) minus and plus its 95% Student-t
    half-width (:func:`qkov_lib.metrics.seed_half_width`); a single value is its own band. A
    closed form, where seaborn's default bootstrap resamples every point of every curve a
    thousand times."""
    v = np.asarray(values, dtype=float)
    mean, half = float(v.mean()), seed_half_width(v)
    return (mean, mean) if not np.isfinite(half) else (mean - half, mean + half)


@draws
def training_curves(hist: pd.DataFrame, metrics: Sequence[str], hue: str, style: str | None = None,
                    col_wrap: int | None = None, logx: bool = True) -> plt.Figure:
    """Line plots of ``metrics`` against ``step`` from a long history table (one line per
    ``hue``/``style`` value, mean over the remaining columns such as seeds, with a band: the 95%
    Student-t interval of that mean, :func:`seed_band`, the interval the book's verdicts use)."""
    setup()
    n = len(metrics)
    ncols = col_wrap or n
    nrows = int(np.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False, facecolor=FACE)
    data = hist[hist["step"] > 0] if logx else hist
    for k, m in enumerate(metrics):
        ax = axes.flat[k]
        sns.lineplot(data=data, x="step", y=m, hue=hue, style=style, ax=ax, errorbar=seed_band, legend=(k == n - 1))
        if logx:
            ax.set_xscale("log")
        ax.set_title(m)
    for ax in list(axes.flat)[n:]:
        ax.set_axis_off()
    if n and axes.flat[n - 1].get_legend() is not None:
        sns.move_legend(axes.flat[n - 1], "upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return fig


@draws
def role_bars(frames: Mapping[str, pd.DataFrame], roles: Sequence[str], ylabel: str = "mean attention mass"):
    """Stacked bars of the mean attention mass per token role (columns ``roles`` of each frame,
    indexed by ratio), one panel per entry of ``frames`` (e.g. per optimizer); white face."""
    setup()
    frames = {k: f for k, f in frames.items() if not f.empty}
    if not frames:
        raise ValueError("no role table to plot (no trained model was measured)")
    fig, axes = plt.subplots(1, len(frames), figsize=(4.2 * len(frames) + 0.8, 3.4), squeeze=False, facecolor=FACE,
                             sharey=True)
    colours = sns.color_palette("colorblind", len(roles))
    for ax, (name, f) in zip(axes[0], frames.items()):
        missing = [r for r in roles if r not in f]
        if missing:
            raise ValueError(f"panel {name!r} has no column(s) {missing}")
        bottom = np.zeros(len(f))
        labels = [f"{r:g}" for r in f.index]
        for role, c in zip(roles, colours):
            v = f[role].to_numpy(dtype=float)
            ax.bar(labels, v, bottom=bottom, color=c, label=role, edgecolor="white", linewidth=0.5)
            bottom += v
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("eta_QK / eta_OV")
        ax.set_ylabel(ylabel)
    axes[0, -1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
