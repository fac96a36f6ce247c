"""Chapter "Synthetic sweeps": parameterization x eta_QK/eta_OV x seed grids on the
distinct/common-token task, trained with the batched engine (:mod:`qkov_lib.engine`), plus
robustness variants (sequence length, common vocabulary, Gaussian embeddings, SGD, AdamW), a
matched-loss comparison and the S2 ranking.

Every run is built exactly as :func:`qkov_lib.experiments.synthetic.train_one` builds it (same
seeding, embeddings, data and init), so a cell of this sweep equals the corresponding run of
the synthetic chapter; the engine is tested to equal :func:`qkov_lib.training.train`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from .. import engine
from ..data import synthetic as syn
from ..data.batch import Batch
from ..metrics import circuit_scalars
from ..models import PARAMETERIZATIONS, SyntheticModel
from ..claims import claim
from ..runtime import seed_everything
from ..training import TrainConfig
from . import synthetic as base

RATIOS = [0.1, 1.0, 10.0, 100.0]

# Robustness variants: a name and the settings they change relative to the main grid.
VARIANTS_CPU = [
    {"name": "short T (n in {2,3})", "n_common": [2, 3]},
    {"name": "long T (n in {16,24})", "n_common": [16, 24]},
    {"name": "M = 2 common tokens", "n_common_vocab": 2},
    {"name": "M = 8 common tokens", "n_common_vocab": 8, "n_common": [2, 4]},
    {"name": "Gaussian embeddings", "embedding": "gaussian"},
    {"name": "SGD (batch 32)", "optimizer": "sgd", "batch_size": 32, "train_data": "sample", "n_train": 2000},
    {"name": "AdamW", "optimizer": "adamw", "eta_ov": 0.01},
]

# Profile table: test = seconds (tests, CI); cpu = default build on 2 cores; full = GPU scale.
PROFILES: dict[str, dict] = {
    "test": dict(parameterizations=list(PARAMETERIZATIONS), ratios=RATIOS, seeds=[0, 1], steps=150, eta_ov=0.5,
                 init_scale=0.1, optimizer="gd", n_classes=3, n_common_vocab=2, n_common=[2, 4],
                 embedding="onehot", n_test=300, dtype="float64", n_logs=15, matched_loss=0.3, robustness=True,
                 variant_ratios=[1.0, 10.0], variant_seeds=[0, 1], variant_steps=80,
                 variants=[{"name": "long T (n in {6})", "n_common": [6]},
                           {"name": "Gaussian embeddings", "embedding": "gaussian"},
                           {"name": "SGD (batch 16)", "optimizer": "sgd", "batch_size": 16, "train_data": "sample",
                            "n_train": 200},
                           {"name": "AdamW", "optimizer": "adamw", "eta_ov": 0.02}]),
    "cpu": dict(parameterizations=list(PARAMETERIZATIONS), ratios=RATIOS, seeds=[0, 1, 2, 3, 4], steps=2000,
                eta_ov=0.5, init_scale=0.1, optimizer="gd", n_classes=4, n_common_vocab=3, n_common=[2, 4, 8, 12],
                embedding="onehot", n_test=4000, dtype="float64", n_logs=30, matched_loss=0.05, robustness=True,
                variant_ratios=RATIOS, variant_seeds=[0, 1, 2], variant_steps=1000, variants=VARIANTS_CPU),
    "full": dict(parameterizations=list(PARAMETERIZATIONS), ratios=[0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0],
                 seeds=list(range(20)), steps=20000, eta_ov=0.5, init_scale=0.1, optimizer="gd", n_classes=8,
                 n_common_vocab=4, n_common=[2, 4, 8, 16], embedding="onehot", n_test=20000, dtype="float64",
                 n_logs=40, matched_loss=0.01, robustness=True, variant_ratios=RATIOS,
                 variant_seeds=list(range(10)), variant_steps=10000, variants=VARIANTS_CPU),
}

METRICS = base.SUMMARY_METRICS + ["weak_attn_confident"]
TAUS = (0.5, 0.7, 0.9)
S2_A = ("CACO", "FACO")  # first summary: collapsed OV concentrates attention; FAFO -> FACO
S2_B = ("CAFO", "CACO")  # second summary; FAFO -> CACO


# --- building and training ------------------------------------------------------------------
def task_of(cfg: dict) -> syn.SyntheticTask:
    """The :class:`SyntheticTask` of a (variant-)settings dict."""
    return syn.SyntheticTask(n_classes=cfg["n_classes"], n_common_vocab=cfg["n_common_vocab"],
                             n_common=tuple(cfg["n_common"]), embedding=cfg["embedding"],
                             d_model=cfg.get("d_model"))


def variant_cfg(cfg: dict, variant: dict) -> dict:
    """The main settings with a robustness ``variant``'s overrides (its ``name`` dropped) and the
    variant grid's steps."""
    unknown = set(variant) - set(cfg) - {"name", "batch_size", "train_data", "n_train", "d_model"}
    if unknown:
        raise ValueError(f"variant {variant.get('name')!r} sets unknown settings {sorted(unknown)}")
    out = {**cfg, "steps": cfg["variant_steps"]}
    out.update({k: v for k, v in variant.items() if k != "name"})
    return out


class _Builder:
    """Builds runs exactly as :func:`qkov_lib.experiments.synthetic.train_one` does (seed ->
    embeddings -> training data -> init, all from one generator), caching per seed what does not
    depend on the parameterization."""

    def __init__(self, cfg: dict) -> None:
        self.cfg, self.task = cfg, task_of(cfg)
        self.dtype = getattr(torch, cfg["dtype"])
        self._seed: dict[int, tuple] = {}
        self._pop: Batch | None = None

    def population_or_none(self) -> Batch | None:
        if self.cfg.get("train_data", "population") != "population":
            return None
        if self._pop is None:
            try:
                self._pop = syn.population(self.task)
            except ValueError:
                return None
        return self._pop

    def seed(self, seed: int) -> tuple[torch.Tensor, Batch, torch.Tensor, Batch]:
        """``(E, train data, generator state before the init, test data)`` of ``seed``."""
        if seed not in self._seed:
            gen = seed_everything(seed)
            E = syn.make_embeddings(self.task, gen, self.dtype)
            train = self.population_or_none()
            if train is None:
                train = syn.sample(self.task, self.cfg.get("n_train", 20000), gen)
            test = syn.sample(self.task, self.cfg["n_test"], torch.Generator().manual_seed(10_000 + seed))
            self._seed[seed] = (E, train, gen.get_state(), test)
        return self._seed[seed]

    def model(self, parameterization: str, seed: int) -> SyntheticModel:
        E, _, state, _ = self.seed(seed)
        gen = torch.Generator()
        gen.set_state(state)
        return SyntheticModel(E, self.task.n_classes, parameterization=parameterization,
                              init_scale=self.cfg["init_scale"], generator=gen, dtype=self.dtype)


def scalar_probe(task: syn.SyntheticTask) -> engine.BatchedProbe:
    """Batched probe: the OV and QK scalars of :func:`qkov_lib.metrics.circuit_scalars` per model."""
    d, c, q = task.distinct_ids, task.common_ids, task.query_id

    def probe(stack: engine.Stack) -> dict[str, list[float]]:
        W_QK, W_OV = stack.effective()
        out: dict[str, list[float]] = {"ov": [], "qk": []}
        for b in range(stack.B):
            E = stack.E[b]
            r = circuit_scalars(W_QK[b], W_OV[b], E[d], E[c], E[q])
            out["ov"].append(r["ov"])
            out["qk"].append(r["qk"])
        return out

    return probe


def weak_attention_confident(dtap: np.ndarray) -> float:
    """Fraction of instances with attention on the relevant token < 0.5 and gold confidence
    >= 0.5 (hence a correct prediction): the "correct prediction, weak attention" corner of a
    10 x 10 DTAP histogram."""
    h = np.asarray(dtap)
    k = h.shape[0] // 2
    return float(h[:k, k:].sum())


@dataclass
class Grid:
    """The runs of one grid: ``runs`` after the fixed number of steps and, when a matched loss
    was asked for, ``matched``: the same runs evaluated at the step where their training loss
    first reached it (``test["stop_step"]``; NaN and final weights where it never did)."""

    runs: list[base.Run]
    matched: list[base.Run] | None = None


def _run(p: str, r: float, s: int, h: engine.EngineHistory, row: dict, dt: torch.Tensor, stop: float) -> base.Run:
    dt = dt.numpy()
    test = {**row, "weak_attn_confident": weak_attention_confident(dt),
            "diverged": float(h.diverged_step is not None), "stop_step": stop}
    return base.Run(p, r, s, h, test, dt)


def run_grid(cfg: dict, parameterizations: Sequence[str] | None = None, ratios: Sequence[float] | None = None,
             seeds: Sequence[int] | None = None, steps: int | None = None, matched_loss: float | None = None,
             desc: str = "sweep") -> Grid:
    """Train every (parameterization, ratio, seed) with the batched engine and evaluate on each
    seed's test sample. Diverging runs are frozen, not fatal. Each run's ``test`` dict has the
    metrics of :func:`qkov_lib.training.evaluate` plus ``weak_attn_confident`` and ``diverged``
    (0/1). With ``matched_loss`` the engine also snapshots each run where its training loss
    first reaches that value (``Grid.matched``)."""
    parameterizations = list(parameterizations or cfg["parameterizations"])
    ratios = [float(r) for r in (ratios or cfg["ratios"])]
    seeds = list(seeds or cfg["seeds"])
    steps = int(steps or cfg["steps"])
    b = _Builder(cfg)
    grid = list(itertools.product(parameterizations, ratios, seeds))
    models = [b.model(p, s) for p, _, s in grid]
    pop = b.population_or_none()
    train_data = pop if pop is not None else [b.seed(s)[1] for _, _, s in grid]
    cfgs = [TrainConfig(optimizer=cfg["optimizer"], eta_ov=cfg["eta_ov"], ratio=r, steps=steps, seed=s,
                        batch_size=cfg.get("batch_size"), n_logs=cfg["n_logs"], progress=False)
            for _, r, s in grid]
    hists = engine.train_batched(models, train_data, cfgs, probe=scalar_probe(b.task), snapshot_loss=matched_loss,
                                 on_nonfinite="freeze", progress=True, desc=f"{desc} ({len(grid)} runs)")
    tests = [b.seed(s)[3] for _, _, s in grid]
    rows, dtaps = engine.evaluate_models(models, tests, TAUS)
    runs = [_run(p, r, s, h, row, dt, float("nan")) for (p, r, s), h, row, dt in zip(grid, hists, rows, dtaps)]
    if matched_loss is None:
        return Grid(runs)
    snap = []
    for (p, _, s), h, m in zip(grid, hists, models):
        if h.snapshot is None:
            snap.append(m)
            continue
        ms = b.model(p, s)
        with torch.no_grad():
            for n, w in h.snapshot.items():
                getattr(ms.attention, n).copy_(w)
        snap.append(ms)
    rows, dtaps = engine.evaluate_models(snap, tests, TAUS)
    matched = [_run(p, r, s, h, row, dt, float("nan") if h.snapshot_step is None else float(h.snapshot_step))
               for (p, r, s), h, row, dt in zip(grid, hists, rows, dtaps)]
    return Grid(runs, matched)


def throughput(cfg: dict, steps: int, n_loop: int | None = None,
               threads: int | None = engine.DEFAULT_THREADS) -> dict[str, float]:
    """Model-steps per second of the main grid of ``cfg`` trained for ``steps`` steps, one model
    at a time with :func:`qkov_lib.training.train` (on ``n_loop`` evenly spread grid cells, all
    if None) and all at once with :func:`qkov_lib.engine.train_batched`. Same work per model:
    data, configs, logging and the circuit-scalar probe. Also returns the largest parameter
    difference between the two on the looped cells (float tolerance expected). Both run with
    ``threads`` torch threads (the engine's default, 1)."""
    import time

    from ..training import train

    b = _Builder(cfg)
    grid = list(itertools.product(cfg["parameterizations"], [float(r) for r in cfg["ratios"]], cfg["seeds"]))
    pop = b.population_or_none()
    if pop is None:
        raise ValueError("throughput needs population (full-batch) training data")
    tc = lambda r, s: TrainConfig(optimizer=cfg["optimizer"], eta_ov=cfg["eta_ov"], ratio=r, steps=steps, seed=s,  # noqa: E731
                                  n_logs=cfg["n_logs"], progress=False)
    sub = grid if not n_loop else grid[:: max(1, len(grid) // n_loop)][:n_loop]
    loop_models = [b.model(p, s) for p, _, s in sub]
    with engine.torch_threads(threads):
        t0 = time.perf_counter()
        for m, (p, r, s) in zip(loop_models, sub):
            train(m, pop, tc(r, s), probe=base.scalar_probe(b.task, m.E))
        t_loop = time.perf_counter() - t0
        models = [b.model(p, s) for p, _, s in grid]
        t0 = time.perf_counter()
        engine.train_batched(models, pop, [tc(r, s) for _, r, s in grid], probe=scalar_probe(b.task),
                             threads=threads)
        t_batched = time.perf_counter() - t0
        n_threads = torch.get_num_threads()
    with torch.no_grad():
        diff = max(float((x - y).abs().max()) for m, cell in zip(loop_models, sub)
                   for x, y in zip(m.parameters(), models[grid.index(cell)].parameters()))
    loop_rate, batched_rate = len(sub) * steps / t_loop, len(grid) * steps / t_batched
    return {"steps": steps, "n_loop": len(sub), "n_batched": len(grid), "loop_s": t_loop, "batched_s": t_batched,
            "loop_model_steps_per_s": loop_rate, "batched_model_steps_per_s": batched_rate,
            "speedup": batched_rate / loop_rate, "max_param_diff": diff, "threads": n_threads}


# --- tables ---------------------------------------------------------------------------------
def summarize_runs(runs: Sequence[base.Run], metrics: Sequence[str] = METRICS) -> pd.DataFrame:
    """:func:`~qkov_lib.experiments.synthetic.seed_summary` over the runs that did not diverge,
    per (parameterization, ratio), with the count of diverged runs."""
    table = base.runs_frame(runs)
    ok = table[table["diverged"] == 0]
    summ = base.seed_summary(ok, ["parameterization", "ratio"], metrics)
    div = table.groupby(["parameterization", "ratio"], sort=False)["diverged"].sum().rename("n_diverged")
    return summ.merge(div.reset_index(), on=["parameterization", "ratio"], how="right")


def ranking_table(summary: pd.DataFrame, metric: str = "attn_relevant", digits: int = 3) -> pd.DataFrame:
    """Per ratio, the parameterizations ordered by ``metric`` (highest first), each with
    ``mean ± CI``."""
    rows = []
    for r in sorted(summary["ratio"].unique()):
        sub = summary[summary["ratio"] == r].sort_values(metric, ascending=False)
        row = {"ratio": r}
        for k, (_, x) in enumerate(sub.iterrows(), 1):
            ci = x[f"{metric}_ci"]
            row[f"#{k}"] = f"{x['parameterization']} {x[metric]:.{digits}f}" + ("" if np.isnan(ci) else f" ± {ci:.{digits}f}")
        rows.append(row)
    return pd.DataFrame(rows).set_index("ratio")


def order_at(summary: pd.DataFrame, ratio: float, metric: str = "attn_relevant") -> list[str]:
    """Parameterizations at ``ratio`` by ``metric``, highest first (NaN last)."""
    sub = summary[summary["ratio"] == ratio].sort_values(metric, ascending=False, na_position="last")
    return sub["parameterization"].tolist()


def s2_match(top2: Sequence[str]) -> str:
    """Which summary's pair a measured top two matches: ``"A"``, ``"B"`` or ``"neither"``."""
    s = set(top2)
    return "A" if s == set(S2_A) else ("B" if s == set(S2_B) else "neither")


def dtap_distance(h1: np.ndarray, h2: np.ndarray) -> float:
    """Total-variation distance between two DTAP histograms (0 = equal, 1 = disjoint)."""
    return 0.5 * float(np.abs(np.asarray(h1) - np.asarray(h2)).sum())


def fafo_toward(dtaps: dict[tuple[str, float], np.ndarray], ratios: Sequence[float], ref_ratio: float = 1.0
                ) -> pd.DataFrame:
    """DTAP distance of FAFO at each ratio to FACO and to CACO at ``ref_ratio`` (S2's "faster QK
    learning moves FAFO toward ..."), with the closer one."""
    rows = []
    for r in ratios:
        if ("FAFO", r) not in dtaps:
            continue
        d = {p: dtap_distance(dtaps[("FAFO", r)], dtaps[(p, ref_ratio)]) for p in ("FACO", "CACO")
             if (p, ref_ratio) in dtaps}
        if len(d) == 2:
            rows.append({"FAFO at ratio": r, f"TV to FACO@{ref_ratio:g}": d["FACO"],
                         f"TV to CACO@{ref_ratio:g}": d["CACO"], "closer to": min(d, key=d.get)})
    return pd.DataFrame(rows)


def matched_table(runs: Sequence[base.Run]) -> pd.DataFrame:
    """Per (parameterization, ratio): how many seeds reached the target loss, the steps they
    needed (mean) and the test metrics at that point (over the seeds that reached it)."""
    t = base.runs_frame(runs)
    t["reached"] = t["stop_step"].notna() & (t["diverged"] == 0)
    reached = t[t["reached"]]
    summ = base.seed_summary(reached, ["parameterization", "ratio"], ["stop_step", "loss", "attn_relevant", "AC@0.5",
                                                                       "AC@0.9", "weak_attn_confident"])
    n = t.groupby(["parameterization", "ratio"], sort=False)["reached"].agg(["sum", "size"]).reset_index()
    n["reached"] = [f"{a}/{b}" for a, b in zip(n["sum"], n["size"])]
    return summ.merge(n[["parameterization", "ratio", "reached"]], on=["parameterization", "ratio"], how="right")


def matched_summary(runs: Sequence[base.Run]) -> pd.DataFrame:
    """:func:`summarize_runs` over the runs that reached the target loss (metrics at that point)."""
    return summarize_runs([r for r in runs if not math.isnan(r.test["stop_step"])])


def robustness(cfg: dict, progress_desc: str = "robustness") -> pd.DataFrame:
    """Train every robustness variant over (parameterization, variant ratio, variant seed) and
    return the run table with a ``variant`` column."""
    parts = []
    for v in tqdm(cfg["variants"], desc=progress_desc):
        vc = variant_cfg(cfg, v)
        runs = run_grid(vc, ratios=cfg["variant_ratios"], seeds=cfg["variant_seeds"], steps=vc["steps"],
                        desc=v["name"]).runs
        t = base.runs_frame(runs)
        t.insert(0, "variant", v["name"])
        parts.append(t)
    return pd.concat(parts, ignore_index=True)


def robustness_summary(table: pd.DataFrame, metrics: Sequence[str] = ("loss", "accuracy", "attn_relevant",
                                                                        "AC@0.5", "AC@0.9")) -> pd.DataFrame:
    """Seed summary of the robustness runs per (variant, parameterization, ratio)."""
    ok = table[table["diverged"] == 0]
    return base.seed_summary(ok, ["variant", "parameterization", "ratio"], list(metrics))


def robustness_pivot(summary: pd.DataFrame, metric: str = "attn_relevant", digits: int = 2) -> pd.DataFrame:
    """``mean ± CI`` of ``metric``: rows (variant, parameterization), columns ratio."""
    s = summary.copy()
    s["cell"] = [f"{m:.{digits}f}" + ("" if np.isnan(c) else f" ± {c:.{digits}f}")
                 for m, c in zip(s[metric], s[f"{metric}_ci"])]
    out = s.pivot(index=["variant", "parameterization"], columns="ratio", values="cell")
    out.columns = [f"ratio {c:g}" for c in out.columns]
    return out.reindex(pd.MultiIndex.from_tuples(list(dict.fromkeys(zip(s["variant"], s["parameterization"])))))


def robustness_verdicts(table: pd.DataFrame, ref_ratio: float = 1.0) -> pd.DataFrame:
    """Per variant, from the robustness run table: the ranking at ``ref_ratio``, which S2 summary
    its top two match, for how many parameterizations mean attention rose from the lowest ratio
    to the largest ratio ``<= 10 x ref_ratio`` (``mid``), the largest change of mean test loss
    over the ratios up to ``mid``, and how many runs at the largest ratio ended with test
    accuracy below 0.99 ("stuck")."""
    summary = robustness_summary(table)
    rows = []
    for v, sub in summary.groupby("variant", sort=False):
        ratios = sorted(sub["ratio"].unique())
        lo, hi = ratios[0], ratios[-1]
        mid = max([r for r in ratios if r <= 10 * ref_ratio] or [hi])
        by = sub.set_index(["parameterization", "ratio"])
        params = list(dict.fromkeys(sub["parameterization"]))
        up = sum(_val(by, p, mid, "attn_relevant") > _val(by, p, lo, "attn_relevant") for p in params)
        dloss = np.nanmax([abs(_val(by, p, r, "loss") - _val(by, p, lo, "loss")) for p in params for r in ratios
                           if r <= mid])
        runs = table[(table["variant"] == v) & (table["ratio"] == hi)]
        stuck = int((runs["accuracy"] < 0.99).sum() + runs["accuracy"].isna().sum())
        order = order_at(sub, ref_ratio) if ref_ratio in ratios else order_at(sub, lo)
        rows.append({"variant": v, f"ranking at ratio {ref_ratio:g}": " > ".join(order),
                     "top two match": {"A": "summary A", "B": "summary B", "neither": "neither"}[s2_match(order[:2])],
                     f"attention up {lo:g} -> {mid:g}": f"{up}/{len(params)}",
                     f"max test-loss change up to {mid:g}": round(float(dloss), 3),
                     f"stuck or diverged at {hi:g}": f"{stuck}/{len(runs)}"})
    return pd.DataFrame(rows).set_index("variant")


# --- figures --------------------------------------------------------------------------------
def plot_trajectories(hist: pd.DataFrame, metric: str = "attn_relevant", by: str = "parameterization",
                      hue: str = "ratio"):
    """``metric`` against training step (log axis), one panel per ``by`` value, one line per
    ``hue`` value (mean over seeds, band = 1.96 standard errors)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from .. import plotting

    plotting.setup()
    panels = list(dict.fromkeys(hist[by]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels) + 1.2, 3.2), sharey=True,
                             squeeze=False, facecolor=plotting.FACE)
    data = hist[hist["step"] > 0].copy()
    data[hue] = data[hue].map(lambda x: f"{x:g}")
    for k, (ax, p) in enumerate(zip(axes[0], panels)):
        sns.lineplot(data=data[data[by] == p], x="step", y=metric, hue=hue, ax=ax, errorbar=("se", 1.96),
                     palette="viridis", legend=(k == len(panels) - 1))
        ax.set_xscale("log")
        if data[metric].between(0, 1).all():
            ax.set_ylim(-0.03, 1.03)  # a fraction: keep the bands inside [0, 1]
        ax.set_title(p)
    leg = axes[0, -1].get_legend()
    if leg is not None:
        sns.move_legend(axes[0, -1], "upper left", bbox_to_anchor=(1.02, 1), title="eta_QK/eta_OV")
    fig.tight_layout()
    return fig


def plot_decoupling(table: pd.DataFrame, matched: pd.DataFrame | None = None, x: str = "loss",
                    y: str = "AC@0.9"):
    """Left: each fixed-step run's test ``x`` against ``y`` (colour = ratio, marker =
    parameterization). Right (if ``matched``): ``y`` at the matched training loss against the
    ratio, per parameterization, mean over seeds with a band of 1.96 standard errors."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from .. import plotting

    plotting.setup()
    n = 2 if matched is not None else 1
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n + 1.5, 3.8), squeeze=False, facecolor=plotting.FACE)
    t = table[table["diverged"] == 0].copy()
    t["eta_QK/eta_OV"] = t["ratio"].map(lambda r: f"{r:g}")
    ax = axes[0, 0]
    sns.scatterplot(data=t, x=x, y=y, hue="eta_QK/eta_OV", style="parameterization", palette="viridis", ax=ax, s=45)
    if x == "loss":
        ax.set_xscale("log")
    ax.set_title(f"fixed steps: test {x} vs {y}")
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    if matched is not None:
        m = matched[matched["stop_step"].notna() & (matched["diverged"] == 0)]
        ax = axes[0, 1]
        sns.lineplot(data=m, x="ratio", y=y, hue="parameterization", marker="o", errorbar=("se", 1.96), ax=ax)
        ax.set_xscale("log")
        ax.set_title(f"at matched training loss: {y}")
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    return fig


# --- facts and claims -----------------------------------------------------------------------
def _val(indexed: pd.DataFrame, p: str, r: float, metric: str) -> float:
    """``indexed.loc[(p, r), metric]``, or NaN when that cell is missing (e.g. every seed diverged)."""
    try:
        return float(indexed.loc[(p, r), metric])
    except KeyError:
        return float("nan")


def _fmt(x: float, digits: int = 3) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ranking_text(summary: pd.DataFrame, ratio: float, metric: str = "attn_relevant") -> str:
    sub = summary[summary["ratio"] == ratio].sort_values(metric, ascending=False)
    return " > ".join(f"{p} ({_fmt(m)} ± {_fmt(c)})" for p, m, c in
                      zip(sub["parameterization"], sub[metric], sub[f"{metric}_ci"]))


def chapter_facts(summary: pd.DataFrame, matched: pd.DataFrame, table: pd.DataFrame, mtable: pd.DataFrame,
                  toward: pd.DataFrame, verdicts: pd.DataFrame | None, dtaps: dict, cfg: dict) -> dict[str, str]:
    """Every number and verdict the chapter's prose quotes, as strings."""
    ratios = sorted(summary["ratio"].unique())
    lo, hi = ratios[0], ratios[-1]
    eq = 1.0 if 1.0 in ratios else lo
    by = summary.set_index(["parameterization", "ratio"])
    params = list(dict.fromkeys(summary["parameterization"]))
    top_eq, top_m = order_at(summary, eq)[:2], order_at(matched, eq)[:2]
    per_ratio = {r: order_at(summary, r) for r in ratios}
    per_ratio_m = {r: order_at(matched, r) for r in ratios}
    match_fixed = {r: s2_match(o[:2]) for r, o in per_ratio.items()}
    match_m = {r: s2_match(o[:2]) for r, o in per_ratio_m.items()}
    # S3: attention and AC along the ratio axis, loss spread
    peak = {p: max(ratios, key=lambda r: _val(by, p, r, "attn_relevant")) for p in params}
    mono = [p for p in params if all(_val(by, p, a, "attn_relevant") <= _val(by, p, b, "attn_relevant")
                                     for a, b in zip(ratios, ratios[1:]))]
    below = [r for r in ratios if r < hi]
    rmid = below[-1] if below else hi
    up_mid = [p for p in params if _val(by, p, rmid, "attn_relevant") > _val(by, p, lo, "attn_relevant")]
    dloss_mid = max(abs(_val(by, p, r, "loss") - _val(by, p, lo, "loss")) for p in params for r in ratios if r <= rmid)
    dacc_mid = max(abs(_val(by, p, r, "accuracy") - _val(by, p, lo, "accuracy")) for p in params for r in ratios
                   if r <= rmid)
    dac_mid = max(_val(by, p, rmid, "AC@0.9") - _val(by, p, lo, "AC@0.9") for p in params)
    # failures at the top ratio: runs whose test accuracy stayed below 0.99
    top = table[(table["ratio"] == hi) & (table["diverged"] == 0)]
    n_fail_hi = int((top["accuracy"] < 0.99).sum())
    n_fail_all = int(((table["ratio"] < hi) & (table["accuracy"] < 0.99)).sum())
    # matched loss
    mt = mtable
    reached = mt[mt["stop_step"].notna() & (mt["diverged"] == 0)]
    spread_m = {p: float(reached[reached.parameterization == p].groupby("ratio")["attn_relevant"].mean().pipe(
        lambda s: s.max() - s.min())) for p in params}
    mby = matched.set_index(["parameterization", "ratio"])
    # S1: how different the heatmaps are at equal rates
    pairs = [(a, b) for i, a in enumerate(params) for b in params[i + 1:] if (a, eq) in dtaps and (b, eq) in dtaps]
    tv = {f"{a}-{b}": dtap_distance(dtaps[(a, eq)], dtaps[(b, eq)]) for a, b in pairs}
    tv_max = max(tv, key=tv.get) if tv else ""
    tv_min = min(tv, key=tv.get) if tv else ""
    weak = lambda r: ", ".join(f"{p} {_fmt(_val(by, p, r, 'weak_attn_confident'))}" for p in params)  # noqa: E731
    toward_hi = toward[toward["FAFO at ratio"] > eq]
    toward_word = (", ".join(f"ratio {r:g}: {c}" for r, c in zip(toward_hi["FAFO at ratio"], toward_hi["closer to"]))
                   if len(toward_hi) else "n/a")
    closer = set(toward_hi["closer to"])
    where = (f"{next(iter(closer))} at every ratio above {eq:g}" if len(closer) == 1 else
             " and ".join(f"{c} at ratio {r:g}" for r, c in zip(toward_hi["FAFO at ratio"], toward_hi["closer to"])))
    fafo_sentence = (f"With faster QK learning, FAFO's heatmap is closest to the equal-rate heatmap of {where or 'n/a'}"
                     + (": FAFO moves toward FACO, as the first summary says." if closer == {"FACO"}
                        else ": FAFO moves toward CACO, as the second summary says." if closer == {"CACO"}
                        else "."))
    facts = {
        "r_lo": f"{lo:g}", "r_hi": f"{hi:g}", "r_eq": f"{eq:g}", "r_mid": f"{rmid:g}",
        "n_runs": str(len(table)), "n_param": str(len(params)), "n_seeds": str(len(cfg["seeds"])),
        "n_diverged": str(int(table["diverged"].sum())),
        "rank_eq": _ranking_text(summary, eq), "rank_eq_matched": _ranking_text(matched, eq),
        "rank_lo": _ranking_text(summary, lo), "rank_hi": _ranking_text(summary, hi),
        "top2_eq": " and ".join(top_eq), "top2_eq_matched": " and ".join(top_m),
        "s2_fixed_counts": f"{sum(v == 'A' for v in match_fixed.values())} (A), "
                           f"{sum(v == 'B' for v in match_fixed.values())} (B), "
                           f"{sum(v == 'neither' for v in match_fixed.values())} (neither) of {len(ratios)}",
        "s2_matched_counts": f"{sum(v == 'A' for v in match_m.values())} (A), "
                             f"{sum(v == 'B' for v in match_m.values())} (B), "
                             f"{sum(v == 'neither' for v in match_m.values())} (neither) of {len(ratios)}",
        "s2_eq_match": {"A": "summary A (CACO, FACO)", "B": "summary B (CAFO, CACO)", "neither": "neither summary"}[
            s2_match(top_eq)],
        "s2_eq_matched_match": {"A": "summary A (CACO, FACO)", "B": "summary B (CAFO, CACO)",
                                "neither": "neither summary"}[s2_match(top_m)],
        "fafo_toward": toward_word, "fafo_sentence": fafo_sentence,
        "weak_lo": weak(lo), "weak_eq": weak(eq),
        "n_mono": str(len(mono)), "mono_list": ", ".join(mono) or "none",
        "n_up_mid": str(len(up_mid)), "peak_list": ", ".join(f"{p} at {peak[p]:g}" for p in params),
        "dloss_mid": _fmt(dloss_mid), "dacc_mid": _fmt(dacc_mid), "dac_mid": _fmt(dac_mid),
        "n_fail_hi": str(n_fail_hi), "n_hi_runs": str(len(top)), "n_fail_below": str(n_fail_all),
        "matched_loss": f"{cfg['matched_loss']:g}", "matched_steps": str(cfg["steps"]),
        "n_reached": str(int(len(reached))), "n_matched_runs": str(len(mt)),
        "spread_m_min": _fmt(min(spread_m.values())), "spread_m_max": _fmt(max(spread_m.values())),
        "spread_m_list": ", ".join(f"{p} {_fmt(v)}" for p, v in spread_m.items()),
        "m_attn_lo_hi": ", ".join(f"{p} {_fmt(_val(mby, p, lo, 'attn_relevant'))} -> {_fmt(_val(mby, p, rmid, 'attn_relevant'))}"
                                  for p in params),
        "tv_max_pair": tv_max, "tv_max": _fmt(tv.get(tv_max, float("nan"))),
        "tv_min": _fmt(min(tv.values())) if tv else "nan", "tv_min_pair": tv_min,
    }
    if verdicts is not None and len(verdicts):
        col = [c for c in verdicts.columns if c.startswith("attention up")][0]
        ok = sum(int(v.split("/")[0]) == int(v.split("/")[1]) for v in verdicts[col])
        facts["rob_n"] = str(len(verdicts))
        facts["rob_s3_ok"] = str(ok)
        facts["rob_match"] = ", ".join(f"{k}: {v}" for k, v in verdicts["top two match"].value_counts().items())
        dcol = [c for c in verdicts.columns if c.startswith("max test-loss change")][0]
        scol = [c for c in verdicts.columns if c.startswith("stuck or diverged")][0]
        facts["rob_dloss_max"] = _fmt(float(verdicts[dcol].max()))
        facts["rob_mid"] = dcol.rsplit(" ", 1)[-1]
        facts["rob_stuck"] = f"{sum(int(x.split('/')[0]) for x in verdicts[scol])} of " \
                             f"{sum(int(x.split('/')[1]) for x in verdicts[scol])}"
        rank_col = [c for c in verdicts.columns if c.startswith("ranking at")][0]
        main_order = " > ".join(order_at(summary, eq))
        facts["rob_same_rank"] = f"{int((verdicts[rank_col] == main_order).sum())} of {len(verdicts)}"
    else:
        facts.update(rob_n="0", rob_s3_ok="0", rob_match="n/a (robustness off)", rob_dloss_max="nan", rob_mid="n/a",
                     rob_stuck="n/a", rob_same_rank="n/a")
    # the implicit-rescaling explanation: effective ratio r * R_QK / R_OV
    def pairs_hold(summ: pd.DataFrame, pairs: Sequence[tuple[str, str]]) -> tuple[int, int]:
        """How many (ratio, pair) comparisons have the first above the second, of how many."""
        b2 = summ.set_index(["parameterization", "ratio"])["attn_relevant"]
        n = ok = 0
        for r in ratios:
            for a, c in pairs:
                if (a, r) in b2.index and (c, r) in b2.index:
                    n += 1
                    ok += int(b2[(a, r)] > b2[(c, r)])
        return ok, n
    qk_pairs, ov_pairs = [("FACO", "CACO"), ("FAFO", "CAFO")], [("FACO", "FAFO"), ("CACO", "CAFO")]
    for name, summ in (("fixed", summary), ("matched", matched)):
        for what, pairs in (("qk", qk_pairs), ("ov", ov_pairs)):
            ok, n = pairs_hold(summ, pairs)
            facts[f"{what}_{name}"] = f"{ok} of {n}"
    fafo_caco = {r: _val(by, "FAFO", r, "attn_relevant") > _val(by, "CACO", r, "attn_relevant") for r in ratios
                 if ("FAFO", r) in by.index and ("CACO", r) in by.index}
    facts["fafo_over_caco"] = ", ".join(f"{r:g}" for r, v in fafo_caco.items() if v) or "none"
    order_eq = order_at(summary, eq)
    t2 = order_eq[:2]
    share = ("a factorized QK circuit, so at this horizon the QK effect decides the top" if all(p[:2] == "FA" for p in t2)
             else "a collapsed OV circuit, so the OV effect decides the top" if all(p[2:] == "CO" for p in t2)
             else "a collapsed QK circuit" if all(p[:2] == "CA" for p in t2)
             else "a factorized OV circuit" if all(p[2:] == "FO" for p in t2) else "no circuit type")
    a_ratios = [f"{r:g}" for r, v in match_fixed.items() if v == "A"]
    b_ratios = [f"{r:g}" for r, v in match_fixed.items() if v == "B"]
    last_cafo = [f"{r:g}" for r, o in per_ratio.items() if o[-1:] == ["CAFO"]]
    facts["top2_share"] = (
        f"The two sharpest at equal rates share {share}. After the fixed steps the collapsed-OV pair "
        f"(summary A) is on top at the ratios {', '.join(a_ratios) or 'none'}, the pair (CAFO, CACO) "
        f"(summary B) at {', '.join(b_ratios) or 'none'}; CAFO is last at {', '.join(last_cafo) or 'none'}.")
    facts["rescaling_sentence"] = (
        f"At ratio {eq:g} the order is {' > '.join(order_eq)}: "
        + ("FACO first and CAFO last, as the effective ratio predicts. " if order_eq[:1] == ["FACO"]
           and order_eq[-1:] == ["CAFO"] else "not the order the effective ratio predicts at the ends. ")
        + f"FAFO is sharper than CACO at the ratios {facts['fafo_over_caco']}.")
    stuck = top[top["accuracy"] < 0.99]
    if n_fail_hi:
        ff = float((stuck["FFPT"] + stuck["FFPF"]).mean())
        facts["fail_sentence"] = (
            f"The largest ratio is where the claim fails. At ratio {hi:g}, {n_fail_hi} of {len(top)} runs ended "
            f"with test accuracy below 0.99 (at smaller ratios {n_fail_all} runs did). In those runs the most-attended "
            f"token is a common token for {ff:.2f} of the test instances. Our diagnosis: with a random small init, "
            f"QK learns {hi:g} times faster than OV while OV is still random. Attention then commits to the tokens "
            "that the random OV happens to favour, sometimes common tokens, before the OV circuit carries any class "
            "signal. Softmax saturates and the run stays stuck. The theory avoids this by assuming a symmetric init.")
    else:
        facts["fail_sentence"] = (f"No run at ratio {hi:g} ended with test accuracy below 0.99 "
                                  f"(at smaller ratios: {n_fail_all}).")
    # verdict sentences
    s2v = s2_verdict(top_eq, top_m)
    facts["s2_verdict"] = s2v
    some = any(v != "neither" for v in list(match_fixed.values()) + list(match_m.values()))
    facts["s2_partial"] = str(bool(some or fafo_sentence.endswith("says.")))
    facts["s2_sentence"] = (
        f"Measured, the two sharpest parameterizations at equal rates are {facts['top2_eq']} after "
        f"{cfg['steps']} steps and {facts['top2_eq_matched']} at matched loss; "
        + {"A": "this is the first summary's pair (collapsed OV), not the second's.",
           "B": "this is the second summary's pair, not the first's.",
           "mixed": "the two regimes disagree, so neither summary holds in general.",
           "neither": "neither summary's pair is measured."}[s2v])
    return facts


def s2_verdict(top_fixed: Sequence[str], top_matched: Sequence[str]) -> str:
    """``A``/``B`` when both regimes' top two match that summary, ``mixed`` when each matches a
    different one or only one matches, ``neither`` otherwise."""
    a, b = s2_match(top_fixed), s2_match(top_matched)
    return a if a == b else "mixed"


def claims(facts: dict[str, str]) -> list[dict[str, str]]:
    """Scorecard rows for S1, S2, S3 and the synthetic analogue of R3."""
    ch = "04_sweep"
    n = int(facts["n_param"])
    s1 = "reproduced" if float(facts["tv_max"]) > 0.1 else "partly"
    s2v = facts["s2_verdict"]
    s2 = ("reproduced" if s2v in ("A", "B")
          else "partly" if s2v == "mixed" or facts["s2_partial"] == "True" else "not reproduced")
    up, fail_hi = int(facts["n_up_mid"]), int(facts["n_fail_hi"])
    s3 = ("reproduced" if up == n and fail_hi == 0 and float(facts["dloss_mid"]) < 0.05
          else "partly" if up > 0 else "not reproduced")
    r3 = "reproduced" if float(facts["spread_m_min"]) > 0.05 else ("partly" if float(facts["spread_m_max"]) > 0.05
                                                                   else "not reproduced")
    return [
        claim("S1", "DTAP heatmaps differ between the four parameterizations",
              f"{facts['n_runs']} runs ({facts['n_seeds']} seeds per cell); at ratio {facts['r_eq']} the DTAP "
              f"total-variation distance between parameterizations is {facts['tv_min']}-{facts['tv_max']} "
              f"(largest {facts['tv_max_pair']})", s1, ch),
        claim("S2", "summaries disagree: (CACO, FACO) or (CAFO, CACO) concentrate attention; FAFO moves toward "
                    "FACO or CACO",
              f"ranking at ratio {facts['r_eq']}: {facts['rank_eq']}; at matched loss {facts['matched_loss']}: "
              f"{facts['rank_eq_matched']}; top two per ratio match {facts['s2_fixed_counts']}; FAFO with faster QK "
              f"is closest to {facts['fafo_toward']} (DTAP distance to the equal-rate heatmaps)", s2, ch),
        claim("S3", "a larger eta_QK/eta_OV moves DTAP mass to high attention, loss about the same",
              f"attention rose from ratio {facts['r_lo']} to {facts['r_mid']} for {facts['n_up_mid']}/{n} "
              f"parameterizations (AC@0.9 up to +{facts['dac_mid']}), test loss moved at most {facts['dloss_mid']} "
              f"nats; at ratio {facts['r_hi']} {facts['n_fail_hi']}/{facts['n_hi_runs']} runs got stuck "
              f"(accuracy < 0.99); robustness variants agreeing: {facts['rob_s3_ok']}/{facts['rob_n']}", s3, ch),
        claim("R3", "sharpness and accuracy are decoupled (synthetic analogue)",
              f"at the same training loss {facts['matched_loss']}, attention on the distinct token still spans "
              f"{facts['spread_m_list']} across ratios", r3, ch),
    ]
