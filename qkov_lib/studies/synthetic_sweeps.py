"""Chapter "Synthetic sweeps": parameterization x eta_QK/eta_OV x seed grids on the
distinct/common-token task, trained with the batched engine (:mod:`qkov_lib.train.engine`), plus
robustness variants (sequence length, common vocabulary, Gaussian embeddings, SGD, AdamW), a
matched-loss comparison and the S2 ranking.

Every run is built exactly as :func:`qkov_lib.studies.synthetic.train_one` builds it (same
seeding, embeddings, data and init), so a cell of this sweep equals the corresponding run of
the synthetic chapter; the engine is tested to equal :func:`qkov_lib.train.train`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from qkov_lib.figure_source import draws
from qkov_lib.train import engine
from qkov_lib.data import synthetic as syn
from qkov_lib.data.batch import Batch
from qkov_lib import claims as C
from qkov_lib.claims import Verdict, claim
from qkov_lib.metrics import circuit_scalars, dtap_distance, seed_half_width  # noqa: F401  (dtap_distance re-exported for the chapter)
from qkov_lib.models import PARAMETERIZATIONS, SyntheticModel
from qkov_lib.runtime import seed_everything
from qkov_lib.train import TrainConfig
from qkov_lib.train.config import stable_rates
from qkov_lib.studies import synthetic as base
from qkov_lib.studies.asymptotics import equal_or_lowest as equal_rate  # 1 (equal rates) when run, else the lowest ratio

RATIOS = [0.1, 1.0, 10.0, 100.0]

# Robustness variants: a name and the settings they change relative to the main grid.
VARIANTS_CPU = [
    {"name": "short T (n in {2,3})", "n_common": [2, 3]},
    {"name": "long T (n in {16,24})", "n_common": [16, 24]},
    {"name": "M = 2 common tokens", "n_common_vocab": 2},
    {"name": "M = 8 common tokens", "n_common_vocab": 8, "n_common": [2, 4]},
    {"name": "Gaussian embeddings", "embedding": "gaussian"},
    {"name": "SGD (batch 32)", "optimizer": "sgd", "batch_size": 32, "train_data": "sample", "n_train": 2000},
    # S3 under Adam is read against ratio 1 on this variant, at the paper's ratios
    {"name": "AdamW", "optimizer": "adamw", "eta_ov": 0.01, "variant_ratios": [1.0, 10.0, 100.0]},
]

# Profile table: test = seconds (tests, CI); cpu = default build on 2 cores; full = GPU scale.
PROFILES: dict[str, dict] = {
    "test": dict(parameterizations=list(PARAMETERIZATIONS), ratios=RATIOS, seeds=[0, 1], steps=150, eta_ov=0.5, eta_qk_stable=5.0, rescale_steps=40,
                 init_scale=0.1, optimizer="gd", n_classes=3, n_common_vocab=2, n_common=[2, 4],
                 embedding="onehot", n_test=300, dtype="float64", n_logs=15, matched_loss=0.3, loss_ladder=[0.6, 0.3],
                 variant_ratios=[1.0, 10.0], variant_seeds=[0, 1], variant_steps=80,
                 variants=[{"name": "long T (n in {6})", "n_common": [6]},
                           {"name": "Gaussian embeddings", "embedding": "gaussian"},
                           {"name": "SGD (batch 16)", "optimizer": "sgd", "batch_size": 16, "train_data": "sample",
                            "n_train": 200},
                           {"name": "AdamW", "optimizer": "adamw", "eta_ov": 0.02}]),
    "cpu": dict(parameterizations=list(PARAMETERIZATIONS), ratios=RATIOS, seeds=[0, 1, 2, 3, 4], steps=2000,
                eta_ov=0.5, eta_qk_stable=5.0, rescale_steps=200, init_scale=0.1, optimizer="gd", n_classes=4, n_common_vocab=3, n_common=[2, 4, 8, 12],
                embedding="onehot", n_test=4000, dtype="float64", n_logs=30, matched_loss=0.05, loss_ladder=[0.3, 0.1, 0.05],
                variant_ratios=RATIOS, variant_seeds=[0, 1, 2], variant_steps=1000, variants=VARIANTS_CPU),
    "full": dict(parameterizations=list(PARAMETERIZATIONS), ratios=[0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0],
                 seeds=list(range(20)), steps=20000, eta_ov=0.5, eta_qk_stable=5.0, rescale_steps=1000, init_scale=0.1, optimizer="gd", n_classes=8,
                 n_common_vocab=4, n_common=[2, 4, 8, 16], embedding="onehot", n_test=20000, dtype="float64",
                 n_logs=40, matched_loss=0.01, loss_ladder=[0.3, 0.1, 0.05, 0.01],
                 variant_ratios=RATIOS,
                 variant_seeds=list(range(10)), variant_steps=10000, variants=VARIANTS_CPU),
}

METRICS = base.SUMMARY_METRICS + ["weak_attn_confident"]
TAUS = (0.5, 0.7, 0.9)


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


#: where the batched engine trains and evaluates every run of these grids (the chapters record it):
#: the CPU, one thread. Each model has a few hundred parameters, so one stacked step of a whole grid
#: costs milliseconds there; the engine has only been exercised on the CPU.
DEVICE = torch.device("cpu")


class _Builder:
    """Builds runs exactly as :func:`qkov_lib.studies.synthetic.train_one` does (seed ->
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

    def train_set(self) -> str:
        """What the runs train on, in the words of :attr:`qkov_lib.studies.synthetic.Run.train_set`."""
        if self.population_or_none() is not None:
            return "exact population"
        return f"i.i.d. sample of {self.cfg.get('n_train', 20000)}"

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
    """The runs of one grid: ``runs`` after the fixed number of steps and, per matched loss level
    asked for, ``matched[level]``: the same runs evaluated at the step where their training loss
    first reached that level (``test["stop_step"]``; NaN and final weights where it never did)."""

    runs: list[base.Run]
    matched: dict[float, list[base.Run]] = field(default_factory=dict)


def _run(p: str, r: float, s: int, h: engine.EngineHistory, row: dict, dt: torch.Tensor, stop: float,
         rates: tuple[float, int], train_set: str) -> base.Run:
    dt = dt.numpy()
    test = {**row, "weak_attn_confident": weak_attention_confident(dt),
            "diverged": float(h.diverged_step is not None), "stop_step": stop, "eta_ov": rates[0],
            "eta_qk": rates[0] * r, "steps": float(rates[1]), "loss_rises": float(h.loss_rises)}
    return base.Run(p, r, s, h, test, dt, train_set)


LOCKED_CLASS_ACC = 0.5  # a class whose test accuracy at the end is below this never learned (class lock-in)


def lowest_class_accuracy(models: Sequence[SyntheticModel], tests: Sequence[Batch]) -> list[float]:
    """Each model's lowest per-class test accuracy on its own test sample (models sharing a test
    sample are evaluated in one stack): near 0 or chance when one class never learned."""
    out = [math.nan] * len(models)
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tests):
        groups.setdefault(id(t), []).append(i)
    for idx in groups.values():
        stack = engine.Stack([models[i] for i in idx])
        bag = engine.bag_of(tests[idx[0]], stack.E.shape[1])
        with torch.no_grad():
            _, probs = engine.predict_bag(stack, bag)
        pred, y = probs.argmax(-1), bag.y.reshape(1, -1).expand(len(idx), -1)
        acc = torch.stack([((pred == k) & (y == k)).sum(-1) / (y == k).sum(-1).clamp(min=1)
                           for k in range(probs.shape[-1])], -1)
        for j, i in enumerate(idx):
            out[i] = float(acc[j].min())
    return out


def lockin_table(table: pd.DataFrame) -> pd.DataFrame:
    """Class lock-in per parameterization (rows) and ratio (columns): the runs (not diverged) in
    which one class never learned, its lowest per-class test accuracy at the end below
    :data:`LOCKED_CLASS_ACC`, as ``k of n``."""
    ok = table[table["diverged"] == 0]
    g = ok.groupby(["parameterization", "ratio"], sort=False)["lowest_class_acc"]
    out = (g.apply(lambda x: f"{int((x < LOCKED_CLASS_ACC).sum())} of {len(x)}")).unstack("ratio")
    out.columns = [f"ratio {c:g}" for c in out.columns]
    return out.reindex(list(dict.fromkeys(ok["parameterization"])))


def run_grid(cfg: dict, parameterizations: Sequence[str] | None = None, ratios: Sequence[float] | None = None,
             seeds: Sequence[int] | None = None, steps: int | None = None,
             matched_loss: float | Sequence[float] | None = None, desc: str = "sweep",
             eta_qk_max: float | None = None, on_nonfinite: str = "freeze", leave: bool = False) -> Grid:
    """Train every (parameterization, ratio, seed) with the batched engine and evaluate on each
    seed's test sample. Diverging runs are frozen, not fatal (``on_nonfinite="raise"``: the first
    one raises :class:`~qkov_lib.train.NonFiniteError`, naming its step and group; ``leave``: the
    progress bars stay on screen). Each run's ``test`` dict has the
    metrics of :func:`qkov_lib.train.evaluate` plus ``weak_attn_confident``, ``diverged`` (0/1),
    its rates and steps (``eta_ov``, ``eta_qk``, ``steps``: the profile's, or with ``eta_qk_max``
    those of :func:`qkov_lib.train.config.stable_rates`) and ``loss_rises`` (steps at which its full-batch training loss
    rose: for gradient descent, the mark of an unstable rate). Runs with the same rates train
    together in one stack. With ``matched_loss`` (one training loss or a ladder of them)
    the engine also snapshots each run where its training loss first reaches each level
    (``Grid.matched``)."""
    parameterizations = list(parameterizations or cfg["parameterizations"])
    ratios = [float(r) for r in (ratios or cfg["ratios"])]
    seeds = list(seeds or cfg["seeds"])
    steps = int(steps or cfg["steps"])
    b = _Builder(cfg)
    grid = list(itertools.product(parameterizations, ratios, seeds))
    rate = {r: stable_rates(r, float(cfg["eta_ov"]), eta_qk_max, int(steps or cfg["steps"])) for r in ratios}
    models = [b.model(p, s) for p, _, s in grid]
    pop = b.population_or_none()
    hists: list[engine.EngineHistory | None] = [None] * len(grid)
    for (eta, n) in dict.fromkeys(rate.values()):
        idx = [i for i, (_, r, _) in enumerate(grid) if rate[r] == (eta, n)]
        data = pop if pop is not None else [b.seed(grid[i][2])[1] for i in idx]
        cfgs = [TrainConfig.from_profile(cfg, ratio=grid[i][1], eta_ov=eta, steps=n, seed=grid[i][2], progress=False)
                for i in idx]
        label = desc if len(set(rate.values())) == 1 else f"{desc}, eta_OV {eta:g} x {n} steps"
        for i, h in zip(idx, engine.train_batched([models[i] for i in idx], data, cfgs, probe=scalar_probe(b.task),
                                                  snapshot_loss=matched_loss, on_nonfinite=on_nonfinite, progress=True, leave=leave,
                                                  desc=f"{label} ({len(idx)} runs)")):
            hists[i] = h
    tests = [b.seed(s)[3] for _, _, s in grid]
    rows, dtaps = engine.evaluate_models(models, tests, TAUS)
    for row, low in zip(rows, lowest_class_accuracy(models, tests)):
        row["lowest_class_acc"] = low
    runs = [_run(p, r, s, h, row, dt, float("nan"), rate[r], b.train_set())
            for (p, r, s), h, row, dt in zip(grid, hists, rows, dtaps)]
    levels = [] if matched_loss is None else sorted({float(x) for x in (
        matched_loss if isinstance(matched_loss, (list, tuple)) else [matched_loss])}, reverse=True)
    matched = {}
    for level in levels:
        snap = []
        for (p, _, s), h, m in zip(grid, hists, models):
            if level not in h.snapshots:
                snap.append(m)
                continue
            ms = b.model(p, s)
            with torch.no_grad():
                for n, w in h.snapshots[level].weights.items():
                    getattr(ms.attention, n).copy_(w)
            snap.append(ms)
        rows, dtaps = engine.evaluate_models(snap, tests, TAUS)
        matched[level] = [_run(p, r, s, h, row, dt, float(h.snapshots[level].step) if level in h.snapshots
                               else float("nan"), rate[r], b.train_set())
                           for (p, r, s), h, row, dt in zip(grid, hists, rows, dtaps)]
    return Grid(runs, matched)


RESCALING_COLUMNS = ["parameterization", "seed", "eta_QK", "steps", "loss rises", "eta_QK stable", "steps stable",
                     "loss rises stable", "loss", "loss stable", "attention", "attention stable"]


def rescaling_check(cfg: dict, ratio: float, steps: int) -> pd.DataFrame:
    """The main grid's cells at ``ratio`` trained twice for the same training time: for ``steps``
    steps at the profile's rates (eta_QK = ``ratio * eta_ov``), and at the stable QK rate
    ``eta_qk_stable`` with eta_OV and the steps rescaled (:func:`qkov_lib.train.config.stable_rates`). One row per run
    (:data:`RESCALING_COLUMNS`): the rates, steps, the steps at which the full-batch training loss
    rose (which gradient descent at a stable rate never does on a smooth loss), and the final
    training loss and attention on the distinct token (population, nats and fraction) of both. If
    the theory's time rescaling holds, the two agree up to the discretisation of time."""
    runs = {cap: {(r.parameterization, r.seed): r for r in run_grid(
        cfg, ratios=[ratio], steps=steps, desc=f"rescaling check at ratio {ratio:g}", eta_qk_max=cap).runs}
        for cap in (None, float(cfg["eta_qk_stable"]))}
    fast, slow = runs[None], runs[float(cfg["eta_qk_stable"])]
    rows = []
    for k, a in fast.items():
        b = slow[k]
        rows.append(dict(zip(RESCALING_COLUMNS, [
            *k, a.test["eta_qk"], int(a.test["steps"]), int(a.test["loss_rises"]), b.test["eta_qk"], int(b.test["steps"]),
            int(b.test["loss_rises"]), a.history.final["loss"], b.history.final["loss"],
            a.history.final["attn_relevant"], b.history.final["attn_relevant"]])))
    return pd.DataFrame(rows, columns=RESCALING_COLUMNS)


def throughput(cfg: dict, steps: int, n_loop: int | None = None,
               threads: int | None = engine.DEFAULT_THREADS) -> dict[str, float]:
    """Model-steps per second of the main grid of ``cfg`` trained for ``steps`` steps, one model
    at a time with :func:`qkov_lib.train.train` (on ``n_loop`` evenly spread grid cells, all
    if None) and all at once with :func:`qkov_lib.train.engine.train_batched`. Same work per model:
    data, configs, logging and the circuit-scalar probe. Also returns the largest parameter
    difference between the two on the looped cells (float tolerance expected). Both run with
    ``threads`` torch threads (the engine's default, 1)."""
    import time

    from qkov_lib.train import train

    b = _Builder(cfg)
    grid = list(itertools.product(cfg["parameterizations"], [float(r) for r in cfg["ratios"]], cfg["seeds"]))
    pop = b.population_or_none()
    if pop is None:
        raise ValueError("throughput needs population (full-batch) training data")
    tc = lambda r, s: TrainConfig.from_profile(cfg, ratio=r, steps=steps, seed=s, progress=False)  # noqa: E731
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
    """:func:`~qkov_lib.studies.synthetic.seed_summary` over the runs that did not diverge,
    per (parameterization, ratio), with the count of diverged runs (no rows for no runs, e.g.
    when no run reached the matched loss; NaN metrics for a cell whose runs all diverged)."""
    table = base.runs_frame(runs)
    cols = ["parameterization", "ratio", *[c for m in metrics for c in (m, f"{m}_ci")], "n_seeds"]
    if table.empty:
        return pd.DataFrame(columns=[*cols, "n_diverged"]).astype({"ratio": float})
    ok = table[table["diverged"] == 0]
    summ = (base.seed_summary(ok, ["parameterization", "ratio"], metrics) if len(ok) else
            pd.DataFrame(columns=cols).astype({"ratio": float}))
    div = table.groupby(["parameterization", "ratio"], sort=False)["diverged"].sum().rename("n_diverged")
    return summ.merge(div.reset_index(), on=["parameterization", "ratio"], how="right")


def ranking_table(summary: pd.DataFrame, metric: str = "attn_relevant", digits: int = 3) -> pd.DataFrame:
    """Per ratio, the parameterizations ordered by ``metric`` (highest first), each with
    ``mean ± CI``."""
    rows = []
    for r in sorted(summary["ratio"].unique()):
        sub = summary[summary["ratio"] == r].dropna(subset=[metric]).sort_values(metric, ascending=False)
        row = {"ratio": r}
        for k, (_, x) in enumerate(sub.iterrows(), 1):
            ci = x[f"{metric}_ci"]
            row[f"#{k}"] = f"{x['parameterization']} {x[metric]:.{digits}f}" + ("" if np.isnan(ci) else f" ± {ci:.{digits}f}")
        rows.append(row)
    return pd.DataFrame(rows, columns=["ratio"] if not rows else None).set_index("ratio")


def order_at(summary: pd.DataFrame, ratio: float, metric: str = "attn_relevant") -> list[str]:
    """Parameterizations at ``ratio`` by ``metric``, highest first (NaN last)."""
    sub = summary[summary["ratio"] == ratio].sort_values(metric, ascending=False, na_position="last")
    return sub["parameterization"].tolist()


def s2_match(top2: Sequence[str]) -> str:
    """Which summary's pair (``claims.S2_PAIRS``) a measured top two matches: ``"A"``, ``"B"`` or
    ``"neither"``."""
    return next((k for k, pair in C.S2_PAIRS.items() if pair == frozenset(top2)), "neither")


TOWARD_COLUMNS = ["FAFO at ratio", "TV to FACO", "TV to CACO", "FACO − CACO", "± (seeds)", "seeds", "closer to"]


def fafo_toward(dtaps: Mapping[tuple[str, float], np.ndarray], ratios: Sequence[float], ref_ratio: float = 1.0,
                seeds: Mapping[tuple[str, float], Sequence[np.ndarray]] | None = None) -> pd.DataFrame:
    """DTAP total-variation distance of FAFO at each ratio to FACO and to CACO at ``ref_ratio``
    (S2's "faster QK learning moves FAFO toward ..."), the per-seed difference of the two
    (:func:`.synthetic.fafo_gap` over FAFO's heatmaps in ``seeds``: mean, 95 % half-width, seeds)
    and the closer one, or ``"tie"`` when the two are equal within that interval
    (:func:`qkov_lib.claims.is_tie`; exactly equal without ``seeds``); columns
    :data:`TOWARD_COLUMNS` (no rows when a heatmap is missing)."""
    rows = []
    for r in ratios:
        if ("FAFO", r) not in dtaps:
            continue
        d = {p: dtap_distance(dtaps[("FAFO", r)], dtaps[(p, ref_ratio)]) for p in ("FACO", "CACO")
             if (p, ref_ratio) in dtaps}
        if len(d) == 2:
            gap = base.fafo_gap(seeds[("FAFO", r)], dtaps, ref_ratio) if seeds and ("FAFO", r) in seeds else None
            rows.append({"FAFO at ratio": float(r), "TV to FACO": d["FACO"], "TV to CACO": d["CACO"],
                         "FACO − CACO": d["FACO"] - d["CACO"], "± (seeds)": gap.half_width if gap else math.nan,
                         "seeds": gap.n if gap else 0,
                         "closer to": "tie" if C.is_tie(d["FACO"] - d["CACO"], gap) else min(d, key=d.get)})
    return pd.DataFrame(rows, columns=TOWARD_COLUMNS)


def fafo_move(toward: pd.DataFrame, ref_ratio: float) -> str | None:
    """Where FAFO moves from ``ref_ratio`` to the highest ratio above it, from a
    :func:`fafo_toward` table: :func:`qkov_lib.claims.s2_fafo_move` on its DTAP distances to FACO
    and CACO at ``ref_ratio``. None without both rows."""
    before = toward[toward["FAFO at ratio"] == ref_ratio]
    after = toward[toward["FAFO at ratio"] > ref_ratio].sort_values("FAFO at ratio")
    if before.empty or after.empty:
        return None
    b, a = before.iloc[0], after.iloc[-1]
    gap = C.Change(a["FACO − CACO"], a["± (seeds)"], int(a["seeds"])) if int(a["seeds"]) else None
    return C.s2_fafo_move({p: b[f"TV to {p}"] for p in ("FACO", "CACO")}, {p: a[f"TV to {p}"] for p in ("FACO", "CACO")},
                          gap)


# --- the matched-loss ladder: S1 and S2 before saturation --------------------------------------
def _reached_by(runs: Sequence[base.Run], ratio: float) -> dict[str, dict[int, base.Run]]:
    """The runs at ``ratio`` that reached the loss level and did not diverge: parameterization ->
    seed -> run."""
    out: dict[str, dict[int, base.Run]] = {}
    for r in runs:
        if r.ratio == ratio and not math.isnan(r.test["stop_step"]) and not r.test["diverged"]:
            out.setdefault(r.parameterization, {})[r.seed] = r
    return out


def ladder_pairs(ladder: Mapping[float, Sequence[base.Run]], ratio: float, params: Sequence[str]
                 ) -> dict[float, dict[tuple[str, str], C.Change]]:
    """S1's numbers on the matched-loss ladder: per training-loss level, for every pair of
    ``params`` at ``ratio``, the DTAP total-variation distance between the two runs of each seed
    both reached that level with (a :class:`qkov_lib.claims.Change` over those seeds)."""
    out = {}
    for level, runs in ladder.items():
        by = _reached_by(runs, ratio)
        have = [p for p in params if p in by]
        out[level] = {(a, b): C.Change.of([dtap_distance(by[a][s].dtap, by[b][s].dtap)
                                           for s in sorted(set(by[a]) & set(by[b]))])
                      for a, b in itertools.combinations(have, 2)}
    return out


def ladder_levels(cfg: Mapping[str, Any]) -> list[float]:
    """The training-loss levels a grid snapshots: the ``loss_ladder`` and the ``matched_loss``,
    highest first."""
    return sorted({float(x) for x in cfg["loss_ladder"]} | {float(cfg["matched_loss"])}, reverse=True)


def s1_named(pairs: Mapping[float, Mapping[tuple[str, str], C.Change]]) -> dict[str, C.Change]:
    """S1's cells named in words (``FAFO vs CAFO, loss 0.05``): :func:`ladder_pairs` flattened,
    highest loss first."""
    return {f"{a} vs {b}, loss {lv:g}": c for lv in sorted(pairs, reverse=True) for (a, b), c in pairs[lv].items()}


def readings_table(readings: Sequence[C.Reading], digits: int = 3) -> pd.DataFrame:
    """Readings as a table: one row per cell with its change (mean ± family half-width, seeds), its
    outcome and the seeds that would decide it (undecided cells only); no row when no cell was read (no run
    reached the matched loss, as in a dry run)."""
    cols = ["cell", "change", "outcome", "seeds to decide"]
    return pd.DataFrame([{"cell": r.cell, "change": r.text(digits), "outcome": r.outcome,
                          "seeds to decide": (r.seeds if r.seeds is not None else "none ≤ 1000")
                          if r.outcome == "undecided" else ""} for r in readings], columns=cols).set_index("cell")


def ladder_dtaps(ladder: Mapping[float, Sequence[base.Run]], ratio: float) -> dict[tuple[str, float], np.ndarray]:
    """Mean DTAP heatmap at ``ratio`` of the runs that reached each training-loss level, keyed by
    (parameterization, level)."""
    return {(p, lv): np.mean([r.dtap for r in by.values()], axis=0)
            for lv, runs in ladder.items() for p, by in _reached_by(runs, ratio).items()}


LADDER_S2_COLUMNS = ["training loss", "ranking at equal rates", "2nd − 3rd", "± (seeds)", "top two",
                     "FAFO at ratio", "FACO − CACO", "± (FAFO seeds)", "FAFO moves toward"]


def ladder_s2(ladder: Mapping[float, Sequence[base.Run]], ratio: float, params: Sequence[str]
              ) -> tuple[pd.DataFrame, dict[float, tuple[str, str | None]]]:
    """S2's numbers on the matched-loss ladder, at equal rates ``ratio``. Per training-loss level:
    the ranking by mean attention on the distinct token (± 95 % seed interval); the per-seed
    difference between the second and third, whose interval decides a tie (then the top two are
    ``"tie"``, else which summary's pair they are, :func:`s2_match`); and FAFO's move
    (:func:`qkov_lib.claims.s2_fafo_move`) from ``ratio`` to the highest faster ratio at which
    two or more FAFO seeds reached the level, on mean heatmaps at that level, its tie decided
    over FAFO's per-seed heatmaps (:func:`.synthetic.fafo_gap`). Without two seeds (for the
    second and third, or for FAFO at every faster ratio) that part is ``"not tested"``. Returns
    the table (:data:`LADDER_S2_COLUMNS`) and (top two, move) of each level reached by all four
    parameterizations at ``ratio`` (evidence for S2, decided on the sharpness page's phase map)."""
    rows, calls = [], {}
    for level, runs in ladder.items():
        by = _reached_by(runs, ratio)
        att = {p: [by[p][s].test["attn_relevant"] for s in sorted(by[p])] for p in params if p in by}
        order = sorted(att, key=lambda p: -np.mean(att[p]))
        ranking = " > ".join(f"{p} {np.mean(att[p]):.3f}" + (f" ± {seed_half_width(att[p]):.3f}"
                                                             if len(att[p]) > 1 else "") for p in order)
        row = {"training loss": level, "ranking at equal rates": ranking or "no run reached it",
               "2nd − 3rd": math.nan, "± (seeds)": math.nan, "top two": "not tested", "FAFO at ratio": math.nan,
               "FACO − CACO": math.nan, "± (FAFO seeds)": math.nan, "FAFO moves toward": "not tested"}
        if len(order) >= 3:
            second, third = order[1], order[2]
            gap = C.Change.of([by[second][s].test["attn_relevant"] - by[third][s].test["attn_relevant"]
                               for s in sorted(set(by[second]) & set(by[third]))])
            row.update({"2nd − 3rd": gap.mean, "± (seeds)": gap.half_width,
                        "top two": "not tested" if not gap.bounded else "tie" if C.is_tie(gap.mean, gap)
                        else s2_match(order[:2])})
        move = None
        faster = sorted(r.ratio for r in runs if r.ratio > ratio)
        means = {(p, ratio): np.mean([x.dtap for x in by[p].values()], axis=0) for p in ("FAFO", "FACO", "CACO")
                 if p in by}
        for hi in sorted(set(faster), reverse=True):
            fafo_hi = _reached_by(runs, hi).get("FAFO", {})
            if len(fafo_hi) >= 2 and len(means) == 3:  # a move needs a seed interval
                heat = [x.dtap for x in fafo_hi.values()]
                d = {when: {p: dtap_distance(h, means[(p, ratio)]) for p in ("FACO", "CACO")}
                     for when, h in (("before", means[("FAFO", ratio)]), ("after", np.mean(heat, axis=0)))}
                gap = base.fafo_gap(heat, means, ratio)
                move = C.s2_fafo_move(d["before"], d["after"], gap)
                row.update({"FAFO at ratio": hi, "FACO − CACO": d["after"]["FACO"] - d["after"]["CACO"],
                            "± (FAFO seeds)": gap.half_width, "FAFO moves toward": move})
                break
        rows.append(row)
        if set(att) == set(PARAMETERIZATIONS):
            calls[level] = (row["top two"], move)
    return pd.DataFrame(rows, columns=LADDER_S2_COLUMNS), calls


def matched_table(runs: Sequence[base.Run]) -> pd.DataFrame:
    """Per (parameterization, ratio): how many seeds reached the target loss, the steps they
    needed (mean) and the test metrics at that point (over the seeds that reached it)."""
    t = base.runs_frame(runs)
    t["reached"] = t["stop_step"].notna() & (t["diverged"] == 0)
    reached = t[t["reached"]]
    summ = base.seed_summary(reached, ["parameterization", "ratio"], MATCHED_METRICS)
    n = t.groupby(["parameterization", "ratio"], sort=False)["reached"].agg(["sum", "size"]).reset_index()
    n["reached"] = [f"{a}/{b}" for a, b in zip(n["sum"], n["size"])]
    return summ.merge(n[["parameterization", "ratio", "reached"]], on=["parameterization", "ratio"], how="right")


MATCHED_METRICS = ["stop_step", "loss", "attn_relevant", "AC@0.5", "AC@0.9", "weak_attn_confident"]


def summary_view(summary: pd.DataFrame) -> pd.DataFrame:
    """:func:`summarize_runs`' table as the page shows it: ``mean ± half-width`` per metric, then the
    seeds summarised and the diverged runs left out (``n_seeds``, ``n_diverged``)."""
    shown = base.format_summary(summary.drop(columns="n_diverged"), METRICS)
    return shown.join(summary.set_index(["parameterization", "ratio"])[["n_seeds", "n_diverged"]])


def matched_view(runs: Sequence[base.Run]) -> pd.DataFrame:
    """:func:`matched_table` as the page shows it: ``mean ± half-width`` of the steps to the target
    loss and the test metrics there, then how many seeds reached it (``reached``, as ``k/n``)."""
    mt = matched_table(runs)
    return base.format_summary(mt.drop(columns="reached"), MATCHED_METRICS).join(
        mt.set_index(["parameterization", "ratio"])["reached"])


def matched_summary(runs: Sequence[base.Run]) -> pd.DataFrame:
    """:func:`summarize_runs` over the runs that reached the target loss (metrics at that point)."""
    return summarize_runs([r for r in runs if not math.isnan(r.test["stop_step"])])


# --- S3 and R3-synthetic at matched training loss ----------------------------------------------
def _reached_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of a run table that reached the matched loss and did not diverge."""
    return frame[frame["stop_step"].notna() & (frame["diverged"] == 0)]


def _paired(lo: pd.DataFrame, hi: pd.DataFrame) -> tuple[C.Change, C.Change, C.Change]:
    """Per-seed changes from ``lo`` to ``hi`` (one parameterization's runs at two ratios, same
    loss level): log-odds of the attention on the distinct token, test loss, test accuracy."""
    a, b = lo.set_index("seed"), hi.set_index("seed")
    seeds = sorted(set(a.index) & set(b.index))
    lo_ = [C.log_odds(a.loc[s, "attn_relevant"]) for s in seeds]
    hi_ = [C.log_odds(b.loc[s, "attn_relevant"]) for s in seeds]
    return (C.Change.of([y - x for x, y in zip(lo_, hi_)]),
            C.Change.of([b.loc[s, "loss"] - a.loc[s, "loss"] for s in seeds]),
            C.Change.of([b.loc[s, "accuracy"] - a.loc[s, "accuracy"] for s in seeds]))


def _frames(ladder: Mapping[float, Any]) -> dict[float, pd.DataFrame]:
    return {float(lv): runs if isinstance(runs, pd.DataFrame) else base.runs_frame(runs) for lv, runs in ladder.items()}


def s3_cells(ladder: Mapping[float, Sequence[base.Run] | pd.DataFrame]
             ) -> tuple[dict[tuple[float, float], dict[str, tuple[C.Change, C.Change, C.Change]]], float]:
    """S3's numbers at matched training loss: per (loss level, ratio above the lowest), per
    parameterization, the paired changes (log-odds of attention on the distinct token, test loss,
    accuracy) from the lowest ratio, over the seeds that reached the level at both and did not
    diverge (:func:`_paired`). ``ladder``: loss level -> runs (or their table) at that level.
    Returns the cells and the lowest ratio."""
    frames = _frames(ladder)
    ratios = sorted({float(r) for f in frames.values() for r in f["ratio"]})
    if len(ratios) < 2:
        return {}, ratios[0] if ratios else math.nan
    lo, cells = ratios[0], {}
    for lv, f in frames.items():
        ok = _reached_frame(f)
        for r in ratios[1:]:
            cell = {}
            for p in dict.fromkeys(f["parameterization"]):
                a, b = ok[(ok.parameterization == p) & (ok.ratio == lo)], ok[(ok.parameterization == p) & (ok.ratio == r)]
                if len(a) and len(b):
                    cell[p] = _paired(a, b)
            if cell:
                cells[(lv, r)] = cell
    return cells, lo


def s3_named(ladder: Mapping[float, Sequence[base.Run] | pd.DataFrame], min_ratio: float | None = None
             ) -> dict[str, C.Change]:
    """S3's cells named in words (``FAFO, ratio 0.1 → 100, loss 0.05``): the log-odds change of
    :func:`s3_cells` per (loss level, higher ratio, parameterization); ``min_ratio`` drops the
    ratios below it first (S3 against ratio 1)."""
    frames = _frames(ladder)
    if min_ratio is not None:
        frames = {lv: f[f["ratio"] >= min_ratio] for lv, f in frames.items()}
    cells, lo = s3_cells(frames)
    return {f"{p}, ratio {lo:g} → {r:g}, loss {lv:g}": c[0]
            for (lv, r), d in sorted(cells.items(), key=lambda kv: (-kv[0][0], kv[0][1])) for p, c in d.items()}


def r3_named(ladder: Mapping[float, Sequence[base.Run] | pd.DataFrame]) -> dict[str, C.Change]:
    """R3-synthetic's cells: :func:`s3_named` at the highest ratio only."""
    cells = s3_named(ladder)
    hi = max((k.split(" → ")[1].split(",")[0] for k in cells), key=float, default=None)
    return {k: c for k, c in cells.items() if k.split(" → ")[1].split(",")[0] == hi}


def t5_named(ladder: Mapping[float, Sequence[base.Run] | pd.DataFrame]) -> dict[str, C.Change]:
    """T5's cells on the sweep: per parameterization, step of the ratio (each ratio to the next)
    and loss level, the per-seed fall of the log common-token mass, log(1 - a) at the lower ratio
    minus at the higher, over the seeds that reached the level at both (nats; positive: sharper)."""
    out = {}
    for lv, f in sorted(_frames(ladder).items(), reverse=True):
        ok = _reached_frame(f)
        ratios = sorted({float(r) for r in f["ratio"]})
        for p in dict.fromkeys(f["parameterization"]):
            for lo, hi in zip(ratios, ratios[1:]):
                a = ok[(ok.parameterization == p) & (ok.ratio == lo)].set_index("seed")["attn_relevant"]
                b = ok[(ok.parameterization == p) & (ok.ratio == hi)].set_index("seed")["attn_relevant"]
                seeds = sorted(set(a.index) & set(b.index))
                if seeds:
                    out[f"{p}, ratio {lo:g} → {hi:g}, loss {lv:g}"] = C.Change.of(
                        [math.log(max(1 - a[s_], 1e-300)) - math.log(max(1 - b[s_], 1e-300)) for s_ in seeds])
    return out


def robustness(cfg: dict, progress_desc: str = "robustness") -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train every robustness variant over (parameterization, variant ratio, variant seed; a variant
    may set its own ``variant_ratios`` and ``variant_seeds``) at
    :func:`qkov_lib.train.config.stable_rates`; return the run table after the variant's steps and the table of the
    same runs at the variant's matched training loss (``matched_loss``; only full-batch variants,
    a minibatch variant has no full-batch loss to match), each with a ``variant`` column."""
    parts, mparts = [], []
    for v in tqdm(cfg["variants"], desc=progress_desc):
        vc = variant_cfg(cfg, v)
        full_batch = vc.get("batch_size") is None
        g = run_grid(vc, ratios=vc["variant_ratios"], seeds=vc["variant_seeds"], steps=vc["steps"], desc=v["name"],
                     matched_loss=float(cfg["matched_loss"]) if full_batch else None)
        for runs, out in ((g.runs, parts), (next(iter(g.matched.values()), []), mparts)):
            t = base.runs_frame(runs)
            t.insert(0, "variant", v["name"])
            t["optimizer"] = vc["optimizer"]
            if out is mparts:
                t["matched_level"] = float(cfg["matched_loss"])
            out.append(t)
    return pd.concat(parts, ignore_index=True), pd.concat(mparts, ignore_index=True)


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


def ratio_changes(summary: pd.DataFrame, metrics: Sequence[str] = ("attn_relevant", "loss", "accuracy")
                  ) -> dict[str, list[float]]:
    """Per parameterization (in table order), the change of each metric of a seed summary from the
    lowest to the highest ratio (NaN for a missing cell); empty lists with one ratio."""
    ratios = sorted(summary["ratio"].unique())
    params = list(dict.fromkeys(summary["parameterization"]))
    by = summary.set_index(["parameterization", "ratio"])
    if len(ratios) < 2:
        return {m: [] for m in metrics}
    lo, hi = ratios[0], ratios[-1]
    return {m: [_val(by, p, hi, m) - _val(by, p, lo, m) for p in params] for m in metrics}


def robustness_readings(rob_matched: pd.DataFrame) -> dict[str, list[C.Reading]]:
    """S3's cells for each robustness variant at its matched training loss (:func:`robustness`'s
    second table), read by the one rule with each variant its own Bonferroni family; a minibatch
    variant has no matched runs and no cell."""
    out = {}
    for v in dict.fromkeys(rob_matched.get("variant", pd.Series(dtype=str))):
        sub = rob_matched[rob_matched["variant"] == v]
        level = float(sub["matched_level"].iloc[0]) if "matched_level" in sub else math.nan
        out[str(v)] = base.read(C.ESTIMANDS["S3"], {f"{v}: {k}": c for k, c in s3_named({level: sub}).items()})
    return out


def robustness_verdicts(table: pd.DataFrame, matched: pd.DataFrame, ref_ratio: float = 1.0) -> pd.DataFrame:
    """Per variant: its optimizer, the ranking after the variant's steps at ``ref_ratio`` (the lowest ratio if
    it was not run) and which S2 summary its top two match (evidence for the sharpness page's phase map), the
    highest ratio's eta_QK and, for full-batch gradient descent (the only optimizer whose loss never
    rises at a stable rate), the runs there whose training loss rose; how many runs at the highest ratio ended with
    test accuracy below ``claims.STUCK_ACC`` or diverged ("stuck"), and S3's verdict for the
    variant at its matched training loss (:func:`robustness_s3`: the label and the effect)."""
    summary = robustness_summary(table)
    rr = robustness_readings(matched)
    s3 = {v: base.verdict(r, C.ESTIMANDS["S3"]) for v, r in rr.items()}
    none = Verdict("not tested", C.ESTIMANDS["S3"].text(), "minibatch training: no full-batch loss to match")
    rows = []
    for v, sub in summary.groupby("variant", sort=False):
        ratios = sorted(sub["ratio"].unique())
        lo, hi = ratios[0], ratios[-1]
        runs = table[(table["variant"] == v) & (table["ratio"] == hi)]
        order = order_at(sub, ref_ratio if ref_ratio in ratios else lo)
        rows.append({"variant": v, "optimizer": str(runs["optimizer"].iloc[0]),
                     "ranking at equal rates": " > ".join(order),
                     "top two match": {"A": "summary A", "B": "summary B", "neither": "neither"}[s2_match(order[:2])],
                     "ratios": f"{lo:g} -> {hi:g}", "eta_QK at highest ratio": float(runs["eta_qk"].max()),
                     "GD runs whose loss rose": (int((runs["loss_rises"] > 0).sum())
                                                 if (runs["optimizer"] == "gd").all() else math.nan),
                     "stuck or diverged": int((runs["accuracy"] < C.STUCK_ACC).sum() + runs["accuracy"].isna().sum()),
                     "locked in": f"{int((runs['lowest_class_acc'] < LOCKED_CLASS_ACC).sum())} of {len(runs)}"
                     if "lowest_class_acc" in runs else "",
                     "runs at highest ratio": len(runs), "S3 verdict": s3.get(str(v), none).verdict,
                     "S3 counts": base.outcome_counts(rr.get(str(v), []))})
    return pd.DataFrame(rows).set_index("variant")


# --- figures --------------------------------------------------------------------------------
@draws
def plot_trajectories(hist: pd.DataFrame, metric: str = "attn_relevant", by: str = "parameterization",
                      hue: str = "ratio"):
    """``metric`` against training step (log axis), one panel per ``by`` value, one line per
    ``hue`` value (mean over seeds, band = 1.96 standard errors)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from qkov_lib import plotting

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


@draws
def plot_decoupling(table: pd.DataFrame, matched: pd.DataFrame | None = None, x: str = "loss",
                    y: str = "AC@0.9"):
    """Left: each fixed-step run's test ``x`` against ``y`` (colour = ratio, marker =
    parameterization). Right (if ``matched``): ``y`` at the matched training loss against the
    ratio, per parameterization, mean over seeds with a band of 1.96 standard errors."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from qkov_lib import plotting

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
    if len(t):
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    if matched is not None:
        m = matched[matched["stop_step"].notna() & (matched["diverged"] == 0)]
        ax = axes[0, 1]
        ax.set_title(f"at matched training loss: {y}")
        if len(m):
            sns.lineplot(data=m, x="ratio", y=y, hue="parameterization", marker="o", errorbar=("se", 1.96), ax=ax)
            ax.set_xscale("log")
            sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
        else:  # e.g. a dry run, capped before any run reached the loss: an empty panel that says so
            ax.text(0.5, 0.5, "no run reached the matched loss", ha="center", va="center", transform=ax.transAxes)
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


def s1_inputs(dtaps: Mapping[tuple[str, float], np.ndarray], params: Sequence[str], ratio: float
              ) -> dict[tuple[str, str], float]:
    """S1's numbers: the DTAP total-variation distance of every pair of ``params`` with a heatmap at
    ``ratio`` (empty with fewer than two)."""
    have = [p for p in params if (p, ratio) in dtaps]
    return base.pairwise_tv(dtaps, have, ratio)


def adam_frames(gd_matched: pd.DataFrame | None, rob_matched: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """The runs S3-adam compares at matched training loss, ratios 1 and above: gradient descent
    (``gd_matched``, the main grid's runs table at the matched loss, at the ratios AdamW ran; None
    when not at hand) and AdamW (the robustness variant whose optimizer is ``adamw``; absent when
    the variants were not run)."""
    gd = gd_matched if gd_matched is not None else pd.DataFrame()
    out = {"gradient descent": gd[gd["ratio"] >= 1.0]} if len(gd) else {}
    if rob_matched is not None and len(rob_matched) and "optimizer" in rob_matched:
        ad = rob_matched[(rob_matched["optimizer"] == "adamw") & (rob_matched["ratio"] >= 1.0)]
        if len(ad):
            out["AdamW"] = ad
            if out.get("gradient descent") is not None:  # the same ratios on both sides
                out["gradient descent"] = out["gradient descent"][out["gradient descent"]["ratio"].isin(set(ad["ratio"]))]
    return out


def chapter_readings(ladder: Mapping[float, Sequence[base.Run]],
                     pairs: Mapping[float, Mapping[tuple[str, str], C.Change]]) -> dict[str, list[C.Reading]]:
    """Every cell the sweep page's claims read, by the one rule, all at matched training loss on the
    ladder (``ladder``: loss level -> runs there, ``Grid.matched``): S1 (:func:`s1_named`), S3 against
    the lowest ratio (:func:`s3_named`), T5 per step of the ratio (:func:`t5_named`) and R3-synthetic
    (:func:`r3_named`)."""
    return {"S1": base.read(C.ESTIMANDS["S1"], s1_named(pairs)), "S3": base.read(C.ESTIMANDS["S3"], s3_named(ladder)),
            "T5": base.read(C.ESTIMANDS["T5"], t5_named(ladder)),
            "R3-synthetic": base.read(C.ESTIMANDS["S3"], r3_named(ladder))}


def variant_readings(rob_matched: pd.DataFrame | None, gd_matched: pd.DataFrame | None,
                     level: float) -> dict[str, list[C.Reading]]:
    """Every cell the robustness page reads, by the one rule, at matched training loss ``level``:
    S3-robustness (:func:`robustness_readings`, one family per variant; empty when the variants
    were not run), S3 under AdamW against ratio 1 (``S3-adam``) and gradient descent's same cells
    beside it (``S3-gd``, shown, not a claim; from ``gd_matched``, the main grid's runs at
    ``level``, empty when None)."""
    out = {"S3-robustness": [r for rr in robustness_readings(rob_matched).values() for r in rr]
           if rob_matched is not None and len(rob_matched) else []}
    frames = adam_frames(gd_matched, rob_matched)
    for key, name in (("S3-gd", "gradient descent"), ("S3-adam", "AdamW")):
        out[key] = base.read(C.ESTIMANDS["S3"], {f"{name}, {k}": c for k, c in s3_named({level: frames[name]}).items()}
                             if name in frames else {})
    return out


def main_grid_tables(results_dir: str | os.PathLike | None, cfg: Mapping[str, Any]
                     ) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """``(matched runs, summary)`` of the main grid as the sweep page saved them (``sweep.json`` in
    ``results_dir``; None: :func:`qkov_lib.runtime.results_file`): its runs table at
    the matched loss (``matched_runs``) and its seed summary after the fixed steps (``summary``), or
    ``(None, None)`` when the file is missing or unreadable or was written under another profile or
    matched loss than ``cfg``'s."""
    from qkov_lib.runtime import results_file

    path = Path(results_dir) / "sweep.json" if results_dir else results_file("sweep")
    try:
        doc = json.loads(path.read_text())
        params, m = doc["params"], doc["metrics"]
        same = params.get("profile") == cfg.get("profile") and float(params["matched_loss"]) == float(cfg["matched_loss"])
        return (pd.DataFrame(m["matched_runs"]), pd.DataFrame(m["summary"])) if same else (None, None)
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def chapter_verdicts(readings: Mapping[str, Sequence[C.Reading]]) -> dict[str, Verdict]:
    """The claims of ``readings`` (:func:`chapter_readings`: S1, S3, T5, R3-synthetic;
    :func:`variant_readings`: S3-robustness, S3-adam) by :func:`qkov_lib.studies.synthetic.verdict`,
    the only source of their words. S2 is decided by the sharpness page's phase map, not here."""
    est = {"S1": "S1", "S3": "S3", "T5": "T5", "R3-synthetic": "S3", "S3-robustness": "S3", "S3-adam": "S3"}
    return {k: base.verdict(readings[k], C.ESTIMANDS[e]) for k, e in est.items() if k in readings}


@draws
def plot_adam(readings: Mapping[str, Sequence[C.Reading]]):
    """S3 under gradient descent and under AdamW: per cell (parameterization, ratio against 1), the
    log-odds change at matched training loss with its family interval, and the margin."""
    import matplotlib.pyplot as plt

    from qkov_lib.plotting import FACE, setup

    setup()
    fig, ax = plt.subplots(figsize=(7.5, 3.2), facecolor=FACE)
    labels = list(dict.fromkeys(r.cell.split(", ", 1)[1] for key in ("S3-gd", "S3-adam") for r in readings[key]))
    for j, (key, name, mk) in enumerate((("S3-gd", "gradient descent", "o"), ("S3-adam", "AdamW", "s"))):
        by = {r.cell.split(", ", 1)[1]: r for r in readings[key]}
        xs = [i + (j - 0.5) * 0.3 for i, lab in enumerate(labels) if lab in by]
        rs = [by[lab] for lab in labels if lab in by]
        ax.errorbar(xs, [r.change.mean for r in rs], yerr=[r.hw if np.isfinite(r.hw) else 0 for r in rs], fmt=mk,
                    capsize=3, label=name)
    ax.axhline(C.ESTIMANDS["S3"].margin, color="k", ls="--", lw=1, label="margin")
    ax.axhline(0, color="0.6", lw=0.8)
    ax.set_xticks(range(len(labels)), [lab.replace(", loss", "\nloss") for lab in labels], rotation=60, fontsize=7)
    ax.set_ylabel("Δ log-odds of attention\non the distinct token")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _counts(match: Mapping[float, str], n: int) -> str:
    return (f"{sum(v == 'A' for v in match.values())} (A), {sum(v == 'B' for v in match.values())} (B), "
            f"{sum(v == 'neither' for v in match.values())} (neither) of {n}")


def chapter_facts(summary: pd.DataFrame, matched: pd.DataFrame, table: pd.DataFrame, mtable: pd.DataFrame,
                  toward: pd.DataFrame, dtaps: dict, cfg: dict, verdicts: Mapping[str, Verdict],
                  pairs: Mapping[float, Mapping[tuple[str, str], C.Change]] | None = None) -> dict[str, Any]:
    """Every number, threshold and verdict (with rule and reason) the chapter's prose quotes, as
    glue strings, and the comparisons that choose its sentences (bools, counts and words, from
    the thresholds of :mod:`qkov_lib.claims`; the sentences are the chapter's). Comparisons the
    grid cannot make leave their ``*_tested`` flag False."""
    ratios = sorted(summary["ratio"].unique())
    eq = equal_rate(ratios)
    params = list(dict.fromkeys(summary["parameterization"]))
    f: dict[str, Any] = {f"thr_{k.lower()}": C.threshold_text(k)
                         for k in ("SHARPER", "SAME_LOSS", "SAME_ACC", "DTAP_TV", "STUCK_ACC")}
    f.update(C.verdict_glue(verdicts))
    f["one_rule"] = C.ONE_RULE
    f.update({"r_lo": f"{ratios[0]:g}", "r_hi": f"{ratios[-1]:g}", "r_eq": f"{eq:g}", "n_runs": str(len(table)),
              "n_param": str(len(params)), "n_seeds": str(len(cfg["seeds"])),
              "n_diverged": str(int(table["diverged"].sum())), "matched_loss": f"{cfg['matched_loss']:g}",
              "matched_steps": str(cfg["steps"]), "n_ratios_run": len(ratios)})
    f.update(_s1_facts(summary, dtaps, pairs, params, ratios))
    f.update(_s2_facts(summary, matched, toward, ratios))
    f.update(_s3_facts(summary, table, params, ratios))
    f.update(_r3_facts(matched, mtable, params, ratios))
    return f


def robustness_facts(rob_verdicts: pd.DataFrame | None, readings: Mapping[str, Sequence[C.Reading]],
                     verdicts: Mapping[str, Verdict], cfg: Mapping[str, Any],
                     main_summary: pd.DataFrame | None = None) -> dict[str, Any]:
    """Every number, threshold and verdict the robustness page quotes, as glue strings: per variant
    (``rob_verdicts``, :func:`robustness_verdicts`) the S3 verdicts counted, the runs stuck or whose
    loss rose at the highest ratio, how many variants keep the main grid's equal-rate ranking
    (``main_summary``, the main grid's seed summary, :func:`main_grid_tables`; "not compared" without
    it) and which summary's pair their top two match; S3 under AdamW beside gradient descent
    (:func:`_adam_facts`)."""
    f: dict[str, Any] = {"thr_stuck_acc": C.threshold_text("STUCK_ACC"), "one_rule": C.ONE_RULE,
                         "matched_loss": f"{cfg['matched_loss']:g}"}
    f.update(C.verdict_glue(verdicts))
    f.update(_adam_facts(readings, verdicts, rob_verdicts))
    f["rob_tested"] = rob_verdicts is not None and len(rob_verdicts) > 0
    if f["rob_tested"]:
        rv = rob_verdicts
        main = " > ".join(order_at(main_summary, equal_rate(sorted(main_summary["ratio"].unique())))) \
            if main_summary is not None and len(main_summary) else None
        f.update(rob_counts=", ".join(f"{k} {n}" for k, n in rv["S3 verdict"].value_counts().items()),
                 rob_n=str(len(rv)), rob_stuck=str(int(rv["stuck or diverged"].sum())),
                 rob_hi_runs=str(int(rv["runs at highest ratio"].sum())),
                 rob_rises=str(int(rv["GD runs whose loss rose"].sum())),
                 rob_gd_runs=str(int(rv.loc[rv["GD runs whose loss rose"].notna(), "runs at highest ratio"].sum())),
                 rob_main_rank=main or "not at hand",
                 rob_same_rank=str(int((rv["ranking at equal rates"] == main).sum())) if main else "not compared",
                 rob_top2=", ".join(f"{k}: {n}" for k, n in rv["top two match"].value_counts().items()))
    return f


def _adam_facts(readings: Mapping[str, Sequence[C.Reading]], verdicts: Mapping[str, Verdict],
                rob_verdicts: pd.DataFrame | None = None) -> dict[str, Any]:
    """S3 under AdamW beside gradient descent, in one sentence computed from both sets of cells, with
    the AdamW runs locked in at its highest ratio (``rob_verdicts``, :func:`robustness_verdicts`)."""
    gd, ad = readings.get("S3-gd", []), readings.get("S3-adam", [])
    if not ad:
        return {"adam_tested": False, "adam_sentence": "The AdamW variant was not run, so S3 under Adam is not tested."}
    adam = rob_verdicts[rob_verdicts["optimizer"] == "adamw"] if rob_verdicts is not None else None
    locked = (f" Under AdamW one class never learned in {adam['locked in'].iloc[0]} runs at ratio "
              f"{adam['ratios'].iloc[0].split(' -> ')[-1]}." if adam is not None and len(adam) else "")
    beside = (f"the same cells under gradient descent read {C.word([r.outcome for r in gd])} "
              f"({base.outcome_counts(gd)})" if gd else
              "gradient descent's same cells are not at hand (the sweep page's results of this profile were not found)")
    return {"adam_tested": True, "adam_sentence": (
        f"At matched training loss, against ratio 1, S3 under AdamW reads {verdicts['S3-adam'].verdict} "
        f"({base.outcome_counts(ad)}); {beside}.{locked}")}


def stability_facts(table: pd.DataFrame, check: pd.DataFrame | None, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Where gradient descent stops being stable, and what the time rescaling says about the
    runs past it: per ratio, the main grid's eta_QK and how many of its runs' full-batch training
    loss rose at some step (the mark of an unstable rate); from :func:`rescaling_check`'s
    ``check``, the same at the highest ratio and at the stable QK rate ``eta_qk_stable``, and the
    largest gaps of final training loss and attention between the two, and how many of its runs
    had not reached the top of the loss ladder at either rate (stuck at both)."""
    by = table.groupby("ratio").agg(eta_qk=("eta_qk", "first"), rises=("loss_rises", lambda x: int((x > 0).sum())),
                                    n=("loss_rises", "size"))
    unstable = [float(r) for r, x in by.iterrows() if x.rises > 0]
    f: dict[str, Any] = {
        "rises_by_ratio": "; ".join(f"ratio {r:g} (eta_QK {x.eta_qk:g}): {int(x.rises)} of {int(x.n)}"
                                    for r, x in by.iterrows()),
        "first_unstable": f"{min(unstable):g}" if unstable else "none",
        "stable_at": _listing([f"{r:g}" for r in by.index if not unstable or r < min(unstable)]),
        "eta_qk_stable": f"{float(cfg['eta_qk_stable']):g}", "check_tested": check is not None and len(check) > 0}
    if f["check_tested"]:
        c = check
        f.update(check_eta_qk=f"{float(c['eta_QK'].iloc[0]):g}", check_steps=str(int(c["steps"].iloc[0])),
                 check_eta_ov_stable=f"{float(c['eta_QK stable'].iloc[0]) / float(c['eta_QK'].iloc[0]) * float(cfg['eta_ov']):g}",
                 check_steps_stable=str(int(c["steps stable"].iloc[0])), check_n=str(len(c)),
                 check_rises=str(int((c["loss rises"] > 0).sum())),
                 check_rises_stable=str(int((c["loss rises stable"] > 0).sum())),
                 check_dloss=f"{float((c['loss'] - c['loss stable']).abs().max()):.1e}",
                 check_datt=f"{float((c['attention'] - c['attention stable']).abs().max()):.1e}",
                 # the time rescaling holds when the two ends agree within the rules' own tolerances
                 check_agrees=bool((c["loss"] - c["loss stable"]).abs().max() <= C.SAME_LOSS
                                   and (c["attention"] - c["attention stable"]).abs().max() <= C.SHARPER),
                 check_n_agree=str(int(((c["loss"] - c["loss stable"]).abs() <= C.SAME_LOSS)
                                       .mul((c["attention"] - c["attention stable"]).abs() <= C.SHARPER).sum())),
                 check_level=f"{max(ladder_levels(cfg)):g}",
                 check_stuck_both=str(int(((c["loss"] > max(ladder_levels(cfg)))
                                           & (c["loss stable"] > max(ladder_levels(cfg)))).sum())))
    return f


def _listing(xs: Sequence[str]) -> str:
    return ", ".join(xs) or "none"


def _s1_facts(summary: pd.DataFrame, dtaps: dict, pairs: Mapping[float, Mapping[tuple[str, str], C.Change]] | None,
              params: Sequence[str], ratios: Sequence[float]) -> dict[str, Any]:
    """S1 on the matched-loss ladder (the verdict's inputs) and the DTAP distances at equal rates."""
    eq, by, f = equal_rate(ratios), summary.set_index(["parameterization", "ratio"]), {}
    outcome = {r.cell: r.outcome for r in base.read(C.ESTIMANDS["S1"], s1_named(pairs or {}))}
    calls = {lv: [outcome[f"{a} vs {b}, loss {lv:g}"] for a, b in d] for lv, d in (pairs or {}).items() if d}
    f["ladder"] = ", ".join(f"{lv:g}" for lv in sorted(calls, reverse=True)) or "none"
    f["s1_all_differ_at"] = ", ".join(f"{lv:g}" for lv in sorted(calls, reverse=True)
                                      if all(c == "holds" for c in calls[lv])) or "none"
    deepest = min((lv for lv in calls if all(c == "holds" for c in calls[lv])), default=None)
    f["s1_deepest_differ"] = "none" if deepest is None else f"{deepest:g}"
    f["s1_ladder_counts"] = "; ".join(f"loss {lv:g}: " + ", ".join(f"{cs.count(o)} {o}" for o in C.OUTCOMES
                                                                   if o in cs) + f" of {len(cs)} pairs"
                                      for lv, cs in sorted(calls.items(), reverse=True)) or "no level reached"
    tv = s1_inputs(dtaps, params, eq)
    weak = lambda r: ", ".join(f"{p} {_fmt(_val(by, p, r, 'weak_attn_confident'))}" for p in params)  # noqa: E731
    f["weak_lo"], f["weak_eq"] = weak(ratios[0]), weak(eq)
    f["s1_tested"], f["tv_range"] = bool(tv), "n/a"
    if tv:
        (a, b), t_max = max(tv.items(), key=lambda kv: kv[1])
        (c, d), t_min = min(tv.items(), key=lambda kv: kv[1])
        f["tv_range"] = f"{t_min:.3f}–{t_max:.3f}"
        f.update(tv_min=f"{t_min:.3f}", tv_min_pair=f"{c} vs {d}", tv_max=f"{t_max:.3f}", tv_max_pair=f"{a} vs {b}",
                 tv_n_differ=str(sum(x >= C.DTAP_TV for x in tv.values())), tv_n_pairs=str(len(tv)))
    return f


def _pairs_hold(summary: pd.DataFrame, ratios: Sequence[float], pairs: Sequence[tuple[str, str]]) -> str:
    """"k of n": the (ratio, pair) comparisons with the first above the second in attention."""
    b2 = summary.set_index(["parameterization", "ratio"])["attn_relevant"]
    n = ok = 0
    for r in ratios:
        for x, y in pairs:
            if (x, r) in b2.index and (y, r) in b2.index:
                n += 1
                ok += int(b2[(x, r)] > b2[(y, r)])
    return f"{ok} of {n}"


def _s2_facts(summary: pd.DataFrame, matched: pd.DataFrame, toward: pd.DataFrame,
              ratios: Sequence[float]) -> dict[str, Any]:
    """S2: the rankings at fixed steps and matched loss, which summary their top two match, the
    QK and OV pair comparisons, and where FAFO moves as its ratio rises."""
    eq, by = equal_rate(ratios), summary.set_index(["parameterization", "ratio"])
    per_ratio = {r: order_at(summary, r) for r in ratios}
    per_ratio_m = {r: order_at(matched, r) for r in ratios}
    top_eq, top_m = order_at(summary, eq)[:2], order_at(matched, eq)[:2]
    match_fixed = {r: s2_match(o[:2]) for r, o in per_ratio.items()}
    names = {"A": "summary A (CACO, FACO)", "B": "summary B (CAFO, CACO)", "neither": "neither summary"}
    f: dict[str, Any] = {
        "rank_eq": _ranking_text(summary, eq), "rank_eq_matched": _ranking_text(matched, eq),
        "top2_eq": " and ".join(top_eq), "top2_eq_matched": " and ".join(top_m),
        "s2_fixed_counts": _counts(match_fixed, len(ratios)),
        "s2_matched_counts": _counts({r: s2_match(o[:2]) for r, o in per_ratio_m.items()}, len(ratios)),
        "s2_eq_match": names[s2_match(top_eq)], "s2_eq_matched_match": names[s2_match(top_m)],
        "s2_pair_kind": s2_verdict(top_eq, top_m)}
    move = fafo_move(toward, eq)
    f["fafo_toward"] = move or "not tested"
    if move is not None:
        b0 = toward[toward["FAFO at ratio"] == eq].iloc[0]
        a0 = toward[toward["FAFO at ratio"] > eq].sort_values("FAFO at ratio").iloc[-1]
        f.update(fafo_to_ratio=f"{a0['FAFO at ratio']:g}", tv_faco_before=f"{b0['TV to FACO']:.3f}",
                 tv_faco_after=f"{a0['TV to FACO']:.3f}", tv_caco_before=f"{b0['TV to CACO']:.3f}",
                 tv_caco_after=f"{a0['TV to CACO']:.3f}")
    qk_pairs, ov_pairs = [("FACO", "CACO"), ("FAFO", "CAFO")], [("FACO", "FAFO"), ("CACO", "CAFO")]
    for name, summ in (("fixed", summary), ("matched", matched)):
        for what, pairs in (("qk", qk_pairs), ("ov", ov_pairs)):
            f[f"{what}_{name}"] = _pairs_hold(summ, ratios, pairs)
    f["fafo_over_caco"] = _listing([f"{r:g}" for r in ratios if ("FAFO", r) in by.index and ("CACO", r) in by.index
                                    and _val(by, "FAFO", r, "attn_relevant") > _val(by, "CACO", r, "attn_relevant")])
    order_eq = order_at(summary, eq)
    t2 = order_eq[:2]
    # which circuit type the two sharpest share: "FA" / "CO" / "CA" / "FO" (QK first), or "none"
    f["top2_shared"] = next((k for k, sel in (("FA", lambda p: p[:2]), ("CO", lambda p: p[2:]), ("CA", lambda p: p[:2]),
                                               ("FO", lambda p: p[2:])) if all(sel(p) == k for p in t2)), "none")
    f["a_ratios"] = _listing([f"{r:g}" for r, v in match_fixed.items() if v == "A"])
    f["b_ratios"] = _listing([f"{r:g}" for r, v in match_fixed.items() if v == "B"])
    f["cafo_last_at"] = _listing([f"{r:g}" for r, o in per_ratio.items() if o[-1:] == ["CAFO"]])
    f["order_eq"] = " > ".join(order_eq)
    f["order_as_predicted"] = order_eq[:1] == ["FACO"] and order_eq[-1:] == ["CAFO"]
    return f


def _s3_facts(summary: pd.DataFrame, table: pd.DataFrame, params: Sequence[str],
              ratios: Sequence[float]) -> dict[str, Any]:
    """S3 after the fixed steps (a view; the verdict is read at matched loss): the runs stuck at
    the highest ratio and below it, the share of their test instances whose most-attended token
    is a common one, and for how many parameterizations the mean attention rose from the lowest
    to the highest ratio."""
    hi = ratios[-1]
    top = table[(table["ratio"] == hi) & (table["diverged"] == 0)]
    n_fail_hi = int((top["accuracy"] < C.STUCK_ACC).sum())
    f: dict[str, Any] = {"n_fail_hi": str(n_fail_hi), "n_hi_runs": str(len(top)),
                         "n_fail_below": str(int(((table["ratio"] < hi) & (table["accuracy"] < C.STUCK_ACC)).sum()))}
    if "lowest_class_acc" in table:
        ok = table[table["diverged"] == 0]
        f["lockin_by_ratio"] = "; ".join(
            f"ratio {r:g}: {int((g['lowest_class_acc'] < LOCKED_CLASS_ACC).sum())} of {len(g)}"
            for r, g in ok.groupby("ratio"))
        f["thr_locked"] = f"{LOCKED_CLASS_ACC:g}"
    if len(ratios) >= 2:
        f["s3_n_up"] = str(sum(x >= C.SHARPER for x in ratio_changes(summary, ("attn_relevant",))["attn_relevant"]))
    if n_fail_hi:
        stuck = top[top["accuracy"] < C.STUCK_ACC]
        ff = float((stuck["FFPT"] + stuck["FFPF"]).mean()) if {"FFPT", "FFPF"} <= set(stuck) else float("nan")
        f["stuck_common_focus"] = f"{ff:.2f}"
    return f


def _r3_facts(matched: pd.DataFrame, mtable: pd.DataFrame, params: Sequence[str],
              ratios: Sequence[float]) -> dict[str, Any]:
    """R3 on the synthetic task: the runs that reached the matched loss and the move of their mean
    attention from the lowest to the highest matched ratio."""
    reached = mtable[mtable["stop_step"].notna() & (mtable["diverged"] == 0)]
    f: dict[str, Any] = {"n_reached": str(len(reached)), "n_matched_runs": str(len(mtable))}
    if len(ratios) < 2:
        return f
    mratios = sorted(matched["ratio"].unique())
    mby = matched.set_index(["parameterization", "ratio"])
    mlo, mhi = (mratios[0], mratios[-1]) if mratios else (ratios[0], ratios[-1])
    f.update(r3_lo=f"{mlo:g}", r3_hi=f"{mhi:g}",
             r3_moves=", ".join(f"{p} {_fmt(_val(mby, p, mlo, 'attn_relevant'))} -> "
                                f"{_fmt(_val(mby, p, mhi, 'attn_relevant'))}" for p in params))
    return f


def s2_verdict(top_fixed: Sequence[str], top_matched: Sequence[str]) -> str:
    """``A``/``B`` when both regimes' top two match that summary, ``mixed`` when each matches a
    different one or only one matches, ``neither`` otherwise."""
    a, b = s2_match(top_fixed), s2_match(top_matched)
    return a if a == b else "mixed"



def sweep_sentences(f: Mapping[str, Any]) -> dict[str, str]:
    """The sentences the sweep page quotes (glue strings by name: ``s1_sentence``, ``s2_sentence``,
    ``check_sentence``, ``r3_sentence``, ...), each chosen by a comparison that :func:`chapter_facts`
    or :func:`stability_facts` made (its bools, counts and words) and filled with its numbers."""
    s: dict[str, str] = {}
    s["s1_sentence"] = (
        f"At ratio {f['r_eq']} the total-variation distance between two parameterizations' mean heatmaps ranges from "
        f"{f['tv_min']} ({f['tv_min_pair']}) to {f['tv_max']} ({f['tv_max_pair']}); {f['tv_n_differ']} of {f['tv_n_pairs']} "
        f"pairs of mean heatmaps are at least {f['thr_dtap_tv']} apart." if f["s1_tested"] else
        "Fewer than two parameterizations were run, so there are no heatmaps to compare (S1 not tested).")
    s["fafo_sentence"] = (
        f"FAFO's move under a faster QK is not tested (no FAFO, FACO and CACO heatmaps at ratio {f['r_eq']} and above)."
        if f["fafo_toward"] == "not tested" else
        f"From ratio {f['r_eq']} to {f['fafo_to_ratio']}, FAFO's heatmap went from {f['tv_faco_before']} to "
        f"{f['tv_faco_after']} in total variation from FACO's equal-rate heatmap and from {f['tv_caco_before']} to "
        f"{f['tv_caco_after']} from CACO's: "
        + {"FACO": "FAFO moves toward FACO, as the first summary says.",
           "CACO": "FAFO moves toward CACO, as the second summary says.",
           "neither": "FAFO moves away from both, as neither summary says.",
           "tie": "FAFO moves toward both and ends equally far from them within the seed interval: a tie, which "
                  "supports neither summary."}[f["fafo_toward"]])
    n_param = int(f["n_param"])
    s["s2_sentence"] = (
        f"Only {n_param} of the four parameterizations {'was' if n_param == 1 else 'were'} run, so S2 is not tested."
        if n_param < 4 else
        f"The two sharpest parameterizations at equal rates are {f['top2_eq']} after {f['matched_steps']} steps and "
        f"{f['top2_eq_matched']} at matched loss; "
        + {"A": "this is the first summary's pair (collapsed OV), not the second's.",
           "B": "this is the second summary's pair, not the first's.",
           "mixed": "the two regimes disagree, so neither summary holds in general.",
           "neither": "neither summary's pair is measured."}[f["s2_pair_kind"]])
    share = {"FA": "a factorized QK circuit, so at this horizon the QK effect decides the top",
             "CO": "a collapsed OV circuit, so the OV effect decides the top", "CA": "a collapsed QK circuit",
             "FO": "a factorized OV circuit"}.get(f["top2_shared"], "no circuit type")
    s["top2_share"] = (
        f"The two sharpest at equal rates share {share}. After the fixed steps the collapsed-OV pair (summary A) is on top "
        f"at the ratios {f['a_ratios']}, the pair (CAFO, CACO) (summary B) at {f['b_ratios']}; CAFO is last at "
        f"{f['cafo_last_at']}.")
    s["rescaling_sentence"] = (
        f"At ratio {f['r_eq']} the order is {f['order_eq']}: "
        + ("FACO first and CAFO last, as the effective ratio predicts. " if f["order_as_predicted"] else
           "not the order the effective ratio predicts at the ends. ")
        + f"FAFO is sharper than CACO at the ratios {f['fafo_over_caco']}.")
    s["s3_sentence"] = (
        f"Only ratio {f['r_lo']} was run, so the effect of the ratio (S3) is not tested." if f["n_ratios_run"] < 2 else
        f"After the fixed {f['matched_steps']} steps (a view, not the verdict), attention on the distinct token rose by at "
        f"least {f['thr_sharper']} from ratio {f['r_lo']} to {f['r_hi']} for {f['s3_n_up']} of {f['n_param']} "
        f"parameterizations; most runs are saturated there.")
    s["check_sentence"] = (
        f"At the grid's rates (eta_QK = {f['check_eta_qk']}, {f['check_steps']} steps) the training loss rose at some step "
        f"in {f['check_rises']} of {f['check_n']} runs; at eta_QK = {f['eta_qk_stable']} (eta_OV = "
        f"{f['check_eta_ov_stable']}, {f['check_steps_stable']} steps) in {f['check_rises_stable']}. The two ends differ "
        f"by at most {f['check_dloss']} nats of training loss and {f['check_datt']} of attention on the distinct token: "
        + ("the runs at the grid's rates end where the stable runs end, so the sweep reads them." if f["check_agrees"] else
           f"more than the rules' tolerances ({f['thr_same_loss']}, {f['thr_sharper']}) in some run; {f['check_n_agree']} "
           f"of {f['check_n']} runs end within them.")
        + f" At both rates alike, {f['check_stuck_both']} of the {f['check_n']} runs had not reached training loss "
          f"{f['check_level']} by the end of the check."
        if f["check_tested"] else "")
    s["stability_sentence"] = (
        f"Gradient descent is stable at the ratios {f['stable_at']} and stops being stable at ratio "
        f"{f['first_unstable']}: a result of its own, and the reason the runs there need a check before they are read."
        if f["first_unstable"] != "none" else
        "No run's training loss rose: gradient descent is stable at every ratio of the grid.")
    s["fail_sentence"] = (
        "" if f["n_ratios_run"] < 2 else
        f"Class lock-in, a finding of its own: runs in which one class never learned, {f['lockin_by_ratio']}. "
        f"At ratio {f['r_hi']}, {f['n_fail_hi']} of {f['n_hi_runs']} runs ended with test accuracy below "
        f"{f['thr_stuck_acc']}; in those the most-attended token is a common token for "
        f"{f.get('stuck_common_focus', 'n/a')} of the test instances. With a small random init QK learns "
        f"{f['r_hi']} times faster than OV while OV is still random, attention commits to what the random OV favours, "
        "and the run never reaches the deeper matched losses, so it is missing from the pairs there.")
    s["r3_sentence"] = (
        f"Only ratio {f['r_lo']} was run, so the matched-loss comparison (R3-synthetic) is not tested."
        if f["n_ratios_run"] < 2 else
        f"{f['n_reached']} of {f['n_matched_runs']} runs reached training loss {f['matched_loss']}. At that loss the mean "
        f"attention on the distinct token moves, from ratio {f['r3_lo']} to {f['r3_hi']}: {f['r3_moves']}. "
        + {"reproduced": "Equal loss, different sharpness, the same accuracy: here sharper attention is not a by-product "
                         "of better prediction.",
           "holds where": "Sharper attention at equal loss holds in part of the ladder only (the region below).",
           "mixed": "Sharper attention at equal loss holds in some cells and is contradicted in others (below).",
           "inconclusive": "The seed intervals do not decide it either way.",
           "not reproduced": "At matched loss the attention does not rise with the ratio.",
           "not tested": "No cell above the lowest ratio reached the loss, so the comparison is not tested."
           }[f["verdict_R3_synthetic"]])
    return s


def robustness_sentences(f: Mapping[str, Any]) -> dict[str, str]:
    """The sentence the robustness page quotes about its variants (``rob_sentence``), chosen by
    whether they ran (:func:`robustness_facts`) and filled with its numbers."""
    s: dict[str, str] = {}
    s["rob_sentence"] = (
        f"Per variant, S3's rule at matched loss gives: {f['rob_counts']} (of {f['rob_n']}). At the highest ratio, "
        f"{f['rob_stuck']} of {f['rob_hi_runs']} runs got stuck (accuracy below {f['thr_stuck_acc']}) or diverged, and "
        f"the training loss rose at some step in {f['rob_rises']} of the {f['rob_gd_runs']} full-batch gradient-descent "
        "runs there. The equal-rate ranking of the main grid after its fixed steps "
        f"({f['rob_main_rank']}) reappears in {f['rob_same_rank']} of {f['rob_n']} variants; the top two at equal rates "
        f"match: {f['rob_top2']}."
        if f["rob_tested"] else
        "The robustness variants were not run (no variant), so S3-robustness is not tested.")
    return s


#: the columns of a history frame (:func:`qkov_lib.studies.synthetic.histories_frame`) that
#: :func:`plot_trajectories` draws in chapter 04 and the results keep
HISTORY_COLUMNS = ("parameterization", "ratio", "seed", "step", "attn_relevant", "loss")
#: the columns of a runs frame that :func:`plot_decoupling` draws and the results keep
DECOUPLING_COLUMNS = ("parameterization", "ratio", "seed", "diverged", "stop_step", "loss", "AC@0.9")


def readings_points(readings: Mapping[str, Sequence[C.Reading]], keys: Sequence[str]) -> pd.DataFrame:
    """The readings of ``keys`` (e.g. ``"S3-gd"``, ``"S3-adam"``) as numbers, one row per cell: ``key``,
    ``cell``, ``change`` (the mean change read, NaN when the cell was not read), ``half_width`` (its
    family half-width) and ``outcome`` -- what :func:`plot_adam` draws."""
    return pd.DataFrame([{"key": k, "cell": r.cell, "change": None if r.change is None else float(r.change.mean),
                          "half_width": float(r.hw), "outcome": r.outcome} for k in keys for r in readings.get(k, ())],
                        columns=["key", "cell", "change", "half_width", "outcome"])


def speed_facts(speed: Mapping[str, float], wall_s: float, profile: str) -> dict[str, str]:
    """The glue strings of chapter 04's closing note: the engine's measured speedup (``"12.3x"``),
    model-steps per second one at a time and batched, the largest parameter difference between the
    two, the number of batched models (from a :func:`throughput` dict), the chapter's wall time in
    seconds and its profile."""
    return {"speedup": f"{speed['speedup']:.1f}x", "speed_loop": f"{speed['loop_model_steps_per_s']:.0f}",
            "speed_batched": f"{speed['batched_model_steps_per_s']:.0f}",
            "speed_diff": f"{speed['max_param_diff']:.1e}", "speed_n": str(speed["n_batched"]),
            "wall_time": f"{wall_s:.0f} s", "profile_name": str(profile)}


def grid_glue(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The grid's settings as chapter 04 quotes them: ``ratios_list`` (``"{0.1, 1, 10}"``),
    ``ladder_levels`` (the matched-loss ladder, nats), ``r_eq_ladder`` (the ratio the ladder is read
    at, :func:`equal_rate`) and ``n_seeds_cfg``."""
    return {"ratios_list": "{" + ", ".join(f"{float(r):g}" for r in cfg["ratios"]) + "}",
            "ladder_levels": ", ".join(f"{x:g}" for x in ladder_levels(cfg)),
            "r_eq_ladder": f"{equal_rate(cfg['ratios']):g}", "n_seeds_cfg": str(len(cfg["seeds"]))}


def sweep_metrics(tables: Mapping[str, Any], hist: pd.DataFrame, dtaps: Mapping, ladder_maps: Mapping,
                  facts: Mapping[str, Any], verdicts: Mapping[str, Verdict]) -> dict:
    """The metrics the sweep page saves: its ``tables`` as they are (``runs``, ``summary``, ...: the names
    the sweep tooling reads), and for its figures ``dtap`` (mean DTAP heatmaps by parameterization and
    ratio), ``history`` (:data:`HISTORY_COLUMNS`), ``decoupling`` (:data:`DECOUPLING_COLUMNS` of the
    fixed-step and the matched-loss runs) and ``ladder_dtap`` (by parameterization and loss level);
    then the facts and the scorecard rows."""
    runs, matched = tables["runs"], tables["matched_runs"]
    cols = lambda t: [c for c in DECOUPLING_COLUMNS if c in t]  # noqa: E731
    return {**tables, "dtap": dict(dtaps), "history": hist[[c for c in HISTORY_COLUMNS if c in hist]],
            "decoupling": {"fixed_steps": runs[cols(runs)], "matched_loss": matched[cols(matched)]},
            "ladder_dtap": dict(ladder_maps), "facts": dict(facts), "claims": claims(facts, verdicts)}


def robustness_metrics(tables: Mapping[str, Any], readings: Mapping[str, Sequence[C.Reading]],
                       facts: Mapping[str, Any], verdicts: Mapping[str, Verdict]) -> dict:
    """The metrics the robustness page saves: its ``tables`` as they are (``robustness``,
    ``robustness_verdicts``), ``adam`` (:func:`readings_points` of S3 under GD and AdamW, what
    :func:`plot_adam` draws), the facts and the scorecard rows (:func:`robustness_claims`)."""
    return {**tables, "adam": readings_points(readings, ("S3-gd", "S3-adam")), "facts": dict(facts),
            "claims": robustness_claims(facts, verdicts)}


def claims(facts: Mapping[str, Any], verdicts: Mapping[str, Verdict]) -> list[dict[str, str]]:
    """Scorecard rows for the paper's S1, S3 and T5 (T5 read on the sweep's ratios) and the
    extension R3-synthetic (S2 is decided by the phase map of the sharpness page): one line of
    measured numbers each, from :func:`chapter_facts`; verdicts from :func:`chapter_verdicts`."""
    f, ch = facts, "04_sweep"
    return [
        claim("S1", "DTAP heatmaps differ between the four parameterizations",
              f"pairs of parameterizations whose per-seed heatmap distance at ratio {f['r_eq']}, by training loss: "
              f"{verdicts['S1'].effect or 'not measured'}", verdicts["S1"], ch),
        claim("S3", "a larger eta_QK/eta_OV moves DTAP mass to high attention, loss about the same",
              f"at matched training loss, {verdicts['S3'].effect or 'no change measured'}", verdicts["S3"], ch),
        claim("T5", "faster QK learning puts more attention on relevant tokens; common-token mass shrinks faster "
                    "with the ratio",
              f"full model, per step of the ratio at matched training loss: {verdicts['T5'].effect or 'not measured'}",
              verdicts["T5"], ch),
        claim("R3-synthetic", C.statement("R3-synthetic"),
              f"{f['n_reached']} of {f['n_matched_runs']} runs reached loss {f['matched_loss']}; "
              f"{verdicts['R3-synthetic'].effect or 'no change measured'}", verdicts["R3-synthetic"], ch),
    ]


ROBUSTNESS_PAGE = "robustness"  # the page that decides S3-robustness and S3-adam (book/robustness.md)


def robustness_claims(facts: Mapping[str, Any], verdicts: Mapping[str, Verdict]) -> list[dict[str, str]]:
    """Scorecard rows for the extensions S3-robustness and S3-adam, from :func:`robustness_facts`;
    verdicts from :func:`chapter_verdicts` over :func:`variant_readings`."""
    f, ch = facts, ROBUSTNESS_PAGE
    return [
        claim("S3-robustness", C.statement("S3-robustness"),
              f"per variant at matched loss S3 gives {f['rob_counts']} (of {f['rob_n']})" if f["rob_tested"]
              else "robustness variants not run", verdicts["S3-robustness"], ch),
        claim("S3-adam", C.EXTENSIONS["S3-adam"][1], f["adam_sentence"], verdicts["S3-adam"], ch),
    ]
