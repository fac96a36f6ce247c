"""Evaluation, tables and figures of the real-data chapters ("SQuAD", "HateXplain", "SVA").

Every model the protocol map of :mod:`.realmap` keeps is evaluated on the test split
(:func:`evaluate_run`), and every attention metric is also computed for two baseline attention
rows on the same model and instances: uniform attention over the keys and random
(flat-Dirichlet) attention. Metrics of one run (``"attention"`` = model | uniform | random;
accuracy and macro-F1 belong to the model and repeat on the baseline rows):

* ``accuracy``, ``macro_f1``, ``loss`` -- all test instances.
* ``attn_relevant``, ``AC@tau``, ``ACMC@tau`` (tau sweep), ``FTPT/FFPT/FTPF/FFPF`` and the DTAP
  histogram -- test instances with at least one relevant token.
* ``comprehensiveness``, ``sufficiency`` -- ERASER AOPC over ``fracs`` (removal = masking keys),
  on ``n_eraser`` evenly spaced test instances; sufficiency is better when *lower*.
* ``token_f1``, ``iou_f1``, ``auprc`` -- plausibility against the relevant tokens (HateXplain:
  human rationales), on instances with a non-empty rationale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from qkov_lib.figure_source import draws
from qkov_lib import faithfulness as fa
from qkov_lib.data.batch import Batch, spread
from qkov_lib.data.text import TextDataset
from qkov_lib.metrics import (FOCUS_CELLS, attention_names, confidence, dtap_histogram, prediction_metrics,
                              relevant_mass, summarize)
from qkov_lib.train import History, predict
from qkov_lib.studies.synthetic import format_summary, seed_summary

TAU_SWEEP = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
FRACS = [0.01, 0.05, 0.1, 0.2, 0.5]
ATTENTIONS = ("model", "uniform", "random")
CHAPTERS = {"squad": "05_squad", "hatexplain": "06_hatexplain", "sva": "07_sva"}
#: dataset key -> the name the pages print
DATASET_NAMES = {"squad": "SQuAD", "hatexplain": "HateXplain", "sva": "SVA"}


def baseline_attention(kind: str, key_mask: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform or random (flat Dirichlet) attention rows (N, T) on the keys of ``key_mask``."""
    if kind == "uniform":
        return fa.uniform_attention(key_mask)
    if kind == "random":
        return fa.random_attention(key_mask, generator)
    raise ValueError(f"unknown baseline attention {kind!r}; expected 'uniform' or 'random'")


def attention_metrics(model: torch.nn.Module, test: Batch, attn: torch.Tensor, probs: torch.Tensor,
                      taus: Sequence[float], fracs: Sequence[float], n_eraser: int,
                      plausibility: bool) -> dict[str, float]:
    """Every attention metric of one attention matrix ``attn`` (N, T) on ``test``: mass on
    relevant tokens, AC/ACMC per tau and the focus table (instances with relevant tokens),
    ERASER AOPC on ``n_eraser`` evenly spaced instances, plausibility if asked."""
    out: dict[str, float] = {}
    has = test.relevant.any(1)
    if bool(has.any()):
        s = summarize(attn[has], probs[has], test.relevant[has], test.y[has], taus)
        out.update({k: v for k, v in s.items() if k not in ("loss", "accuracy", "confidence")})
    idx = spread(len(test), n_eraser).to(attn.device)
    f = fa.faithfulness(model, test.index(idx), attn[idx], fracs)
    out["comprehensiveness"], out["sufficiency"] = f["comprehensiveness"], f["sufficiency"]
    if plausibility and bool(has.any()):
        p = fa.plausibility(attn[has], test.key_mask[has], test.relevant[has])
        out.update({k: p[k] for k in ("token_f1", "iou_f1", "auprc")})
    return out


@dataclass
class RealRun:
    """One trained model: settings, training history (None when not kept), one metrics row per
    attention kind, the DTAP histogram (model attention) and per test instance whether the prediction
    is right (``correct``) and the attention mass on its relevant tokens (``mass``, NaN without any)."""

    ratio: float
    seed: int
    history: History | None
    rows: list[dict[str, Any]]
    dtap: np.ndarray | None
    mass: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    correct: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=bool))
    model: torch.nn.Module | None = field(repr=False, default=None)  # the trained model, for later measurements


def evaluate_run(ds: TextDataset, model: torch.nn.Module, hist: History | None, ratio: float, seed: int,
                 cfg: Mapping[str, Any]) -> RealRun:
    """Evaluate a trained model (run ``ratio``, ``seed``) and the two baseline attentions on the
    test split with :func:`attention_metrics` (``cfg``: ``taus``, ``fracs``, ``n_eraser`` and
    optionally ``plausibility``); the random baseline is seeded by ``seed``."""
    device = next(model.parameters()).device
    test = ds.test.to(device)
    attn, probs = predict(model, test)
    pred = probs.argmax(-1)
    base = {"ratio": float(ratio), "seed": seed, **prediction_metrics(probs, test.y, ds.n_classes)}
    gen = torch.Generator().manual_seed(20_000 + seed)
    rows = []
    for kind in ATTENTIONS:
        A = attn if kind == "model" else baseline_attention(kind, test.key_mask.cpu(), gen).to(device)
        m = attention_metrics(model, test, A, probs, cfg["taus"], cfg["fracs"], cfg["n_eraser"],
                              bool(cfg.get("plausibility", False)))
        rows.append({**base, "attention": kind, **m})
    has = test.relevant.any(1)
    mass = relevant_mass(attn, test.relevant).double().masked_fill(~has, math.nan).cpu()
    dtap = None
    if bool(has.any()):
        dtap = dtap_histogram(mass[has.cpu()], confidence(probs[has], test.y[has]).cpu()).numpy()
    return RealRun(float(ratio), seed, hist, rows, dtap, mass.numpy(), (pred == test.y).cpu().numpy(), model)


def runs_frame(runs: Iterable[RealRun]) -> pd.DataFrame:
    """Long table: one row per (run, attention kind) with every metric."""
    return pd.DataFrame([row for r in runs for row in r.rows])


def mean_dtap(runs: Iterable[RealRun]) -> dict[tuple[str, float], np.ndarray]:
    """DTAP histograms averaged over seeds, keyed by ("model", ratio) for :func:`plotting.dtap_grid`."""
    acc: dict[float, list[np.ndarray]] = {}
    for r in runs:
        if r.dtap is not None:
            acc.setdefault(r.ratio, []).append(r.dtap)
    return {("model", k): np.mean(v, axis=0) for k, v in acc.items()}


def mass_by_correctness(runs: Iterable[RealRun]) -> pd.DataFrame:
    """Mean attention on relevant tokens among correctly and wrongly predicted test instances,
    per ratio and seed (the decoupling check of R3)."""
    rows = []
    for r in runs:
        has = ~np.isnan(r.mass)
        if has.any():
            for ok in (True, False):
                sel = has & (r.correct == ok)
                rows.append({"ratio": r.ratio, "seed": r.seed, "prediction": "correct" if ok else "wrong",
                             "attn_relevant": float(r.mass[sel].mean()) if sel.any() else math.nan,
                             "n": int(sel.sum())})
    return pd.DataFrame(rows)


def by_group(runs: Iterable[RealRun], groups: Sequence[Any], name: str = "group") -> pd.DataFrame:
    """Accuracy and mean attention on relevant tokens per test-instance group (e.g. the SVA
    condition), one row per (ratio, seed, group)."""
    g = np.asarray(list(groups))
    rows = []
    for r in runs:
        if len(g) != len(r.correct):
            raise ValueError(f"{len(g)} group labels for {len(r.correct)} test instances")
        for v in dict.fromkeys(g.tolist()):
            sel = g == v
            m = r.mass[sel]
            rows.append({"ratio": r.ratio, "seed": r.seed, name: v, "n": int(sel.sum()),
                         "accuracy": float(r.correct[sel].mean()),
                         "attn_relevant": float(np.nanmean(m)) if (~np.isnan(m)).any() else math.nan})
    return pd.DataFrame(rows)


def group_table(frame: pd.DataFrame, name: str, metric: str) -> pd.DataFrame:
    """``metric`` per group (rows) and ratio (columns), mean ± half-width over seeds."""
    s = seed_summary(frame, [name, "ratio"], [metric])
    s["cell"] = format_summary(s, [metric]).reset_index()[metric].to_numpy()
    out = s.pivot(index=name, columns="ratio", values="cell")
    out.columns = [f"ratio {c:g}" for c in out.columns]
    return out


def tau_curve(table: pd.DataFrame, taus: Sequence[float]) -> pd.DataFrame:
    """Long table of AC and ACMC against tau (one row per run, attention kind, metric, tau)."""
    rows = []
    for _, r in table.iterrows():
        for t in taus:
            for m in ("AC", "ACMC"):
                key = f"{m}@{t:g}"
                if key in r and not pd.isna(r[key]):
                    rows.append({"ratio": r["ratio"], "seed": r["seed"], "attention": r["attention"],
                                 "metric": m, "tau": t, "value": r[key]})
    return pd.DataFrame(rows)


def summary_metrics(table: pd.DataFrame) -> list[str]:
    """The metric columns of a runs table, in a fixed display order, that are present."""
    order = ["accuracy", "macro_f1", "loss", *attention_names(), *EXPLANATION_METRICS, *FOCUS_CELLS]
    return [m for m in order if m in table.columns and table[m].notna().any()]


def summarize_runs(table: pd.DataFrame) -> pd.DataFrame:
    """Seed mean and 95% Student-t half-width of every metric per (attention, ratio)."""
    return seed_summary(table, ["attention", "ratio"], summary_metrics(table))


# --- formatting ----------------------------------------------------------------------------
def pm(value: float, ci: float, pct: bool = True, digits: int = 1) -> str:
    """``mean ± half-width`` (percent by default); no interval when it is NaN (one seed)."""
    if value is None or math.isnan(value):
        return "n/a"
    s, unit = (100.0, "%") if pct else (1.0, "")
    return f"{value * s:.{digits}f}{unit}" + ("" if math.isnan(ci) else f" ± {ci * s:.{digits}f}{unit}")


# --- chapter tables and figures ------------------------------------------------------------
EXPLANATION_METRICS = ("comprehensiveness", "sufficiency", "token_f1", "iou_f1", "auprc")


def attention_columns() -> list[str]:
    """The attention columns of the chapter tables: the registered attention metrics, AC/ACMC
    at 0.5 and 0.9, ERASER faithfulness and plausibility."""
    return [*attention_names((0.5, 0.9)), *EXPLANATION_METRICS]


def model_table(summary: pd.DataFrame, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """``mean ± half-width`` of the model's metrics per ratio (rows: ratio)."""
    sub = summary[summary["attention"] == "model"].drop(columns="attention")
    metrics = [m for m in (metrics or ["accuracy", "macro_f1", "loss", *attention_columns()]) if m in sub]
    return format_summary(sub[["ratio", *[c for m in metrics for c in (m, f"{m}_ci")], "n_seeds"]], metrics)


def baseline_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Every attention metric for model, uniform and random attention at every ratio."""
    metrics = [m for m in attention_columns() if m in summary and summary[m].notna().any()]
    return format_summary(summary[["attention", "ratio", *[c for m in metrics for c in (m, f"{m}_ci")], "n_seeds"]],
                          metrics)



def focus_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The focus/prediction cells (fractions of instances with relevant tokens) per ratio."""
    return model_table(summary, ["FTPT", "FFPT", "FTPF", "FFPF"])


@draws
def plot_tau_sweep(table: pd.DataFrame, taus: Sequence[float], title: str | None = None):
    """AC and ACMC against the threshold tau, one line per ratio (model) plus the uniform and
    random baselines at the highest ratio (dashed); mean over seeds with a 95% band; ``title``
    above both panels when given."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from qkov_lib.plotting import FACE, setup

    setup()
    curve = tau_curve(table, taus)
    hi = curve["ratio"].max()
    curve["run"] = [f"model, ratio {r:g}" if a == "model" else f"{a} (ratio {r:g})"
                    for a, r in zip(curve["attention"], curve["ratio"])]
    curve = curve[(curve["attention"] == "model") | (curve["ratio"] == hi)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), facecolor=FACE, sharey=True)
    for ax, m in zip(axes, ("AC", "ACMC")):
        sub = curve[curve["metric"] == m]
        sns.lineplot(data=sub, x="tau", y="value", hue="run", style="attention", errorbar=("ci", 95), seed=0, ax=ax,
                     legend=(m == "ACMC"), dashes={"model": "", "uniform": (3, 2), "random": (1, 1)})
        ax.set_title(f"{m} against tau")
        ax.set_ylabel("fraction of instances")
    if axes[1].get_legend() is not None:
        sns.move_legend(axes[1], "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def attractor_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Linzen accuracy per (ratio, number of attractors): ``mean ± half-width`` over seeds,
    one column per attractor count."""
    s = seed_summary(frame, ["ratio", "n_attractors"], ["accuracy"])
    s["cell"] = format_summary(s, ["accuracy"]).reset_index()["accuracy"].to_numpy()
    order = [k for k in ("train", "all") if k in set(s["n_attractors"])]
    order += sorted((k for k in s["n_attractors"].unique() if k not in ("train", "all")), key=int)
    return s.pivot(index="ratio", columns="n_attractors", values="cell")[order]


@draws
def plot_attractors(frame: pd.DataFrame):
    """Linzen test accuracy against the number of attractors, one line per ratio."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from qkov_lib.plotting import FACE, setup

    setup()
    sub = frame[~frame["n_attractors"].isin(["all", "train"])].copy()
    sub["n_attractors"] = sub["n_attractors"].astype(int)
    sub["ratio"] = sub["ratio"].map(lambda r: f"{r:g}")
    fig, ax = plt.subplots(figsize=(5.5, 3.6), facecolor=FACE)
    sns.lineplot(data=sub, x="n_attractors", y="accuracy", hue="ratio", marker="o", errorbar=("ci", 95), seed=0, ax=ax)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("number of attractors")
    ax.set_ylabel("test accuracy")
    ax.legend(title="eta_QK/eta_OV", frameon=False)
    fig.tight_layout()
    return fig
