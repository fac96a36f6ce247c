"""The protocol map of each real-data chapter: a model that learns the task, a validation split,
base-rate grids for AdamW and SGD, and the R1-R3 verdicts over the map.

Per dataset (``sva``, ``hatexplain``, ``squad``), :data:`PROFILES` fixes the model that feeds the
analysed head (SVA: :class:`~qkov_lib.models.TokenModel` on the Marvin & Linzen prefixes;
HateXplain: the stackable convolution encoder of :mod:`.encoder_head`; SQuAD: the best casting of
:mod:`.squad_casting`), the splits (HateXplain: the official validation split; SVA and SQuAD: a
seeded part of the training split held out), the base-rate grid of each optimizer, the ratios,
seeds and the step budget with early stopping on validation loss.

:func:`run_map` trains the whole map with :func:`.protocol.train_grid` and returns a
:class:`MapResult` (the run table with the trained-run flag, the validation-chosen base rates,
the phase table, per-column verdicts and the region verdicts); :func:`map_facts` and
:func:`claims_rows` turn it into the sentences and scorecard rows a chapter quotes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from .. import claims
from .. import faithfulness as fa
from ..data.batch import Batch
from ..data.text import TextDataset
from ..metrics import prediction_metrics, seed_half_width, summarize
from ..profiles import profile_table
from ..training import TrainConfig, predict
from . import encoder_head, protocol, realdata, squad_casting
from .sva_roles import split_validation

DATASETS = ("sva", "hatexplain", "squad")
OPTIMIZERS = ("adamw", "sgd")
MAP_FRACS = (0.01, 0.05, 0.1, 0.2, 0.5)
RATIOS = [1.0, 3.0, 10.0, 30.0, 100.0]

# Shared by every dataset: both optimizers, the paper's ratios, early stopping on validation loss
# (evaluated every eval_every steps, best weights restored), sufficiency on n_eraser instances.
_COMMON = dict(optimizers=["adamw", "sgd"], ratios=RATIOS, map_seeds=[0, 1, 2], parameterization="FAFO",
               init_scale=1e-2, batch_size=64, weight_decay=0.0, eta_other=None, data_seed=0, val_frac=0.1,
               eval_every=100, patience=4, n_eraser=300, threads=1,
               adamw_rates=[1e-4, 3e-4, 1e-3, 3e-3], sgd_rates=[0.03, 0.1, 0.3, 1.0])

# test = seconds (CI); cpu = the map within the chapter's 15-minute budget on 2 cores (one chapter
# runs at a time, so the map uses both); full = GPU. Measured cpu maps (2 cores shared by two maps):
# SVA 120 runs in 97 s; SQuAD 40 runs in 440 s; HateXplain 80 runs in 920 s (2400-step budget).
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "sva": profile_table(
        dict(_COMMON, model="token", d_model=64, max_len=16, min_freq=2, test_frac=0.2, readout="class",
             adamw_steps=2000, sgd_steps=4000),
        dict(ratios=[1.0, 10.0], map_seeds=[0], adamw_rates=[1e-3, 3e-3], sgd_rates=[0.3, 1.0], adamw_steps=40,
             sgd_steps=40, eval_every=10, n_train=400, n_test=200, n_eraser=50),
        dict(n_train=None, n_test=None, threads=2),
        dict(map_seeds=[0, 1, 2, 3, 4], adamw_steps=6000, sgd_steps=12000, n_train=None, n_test=None, n_eraser=2000,
             adamw_rates=[3e-5, 1e-4, 3e-4, 1e-3, 3e-3], sgd_rates=[0.01, 0.03, 0.1, 0.3, 1.0]),
    ),
    "hatexplain": profile_table(
        dict(_COMMON, model="conv", encoder="conv", d_embed=64, d_model=64, kernel=3, dropout=0.0, max_len=64,
             min_freq=2, adamw_steps=2400, sgd_steps=2400, eval_every=120, adamw_rates=[3e-4, 1e-3, 3e-3, 1e-2]),
        dict(ratios=[1.0, 10.0], map_seeds=[0], adamw_rates=[1e-3, 3e-3], sgd_rates=[0.3, 1.0], adamw_steps=40,
             sgd_steps=40, eval_every=10, d_embed=16, d_model=16, n_train=300, n_test=100, n_val=100, n_eraser=50),
        dict(map_seeds=[0, 1], n_train=None, n_test=None, n_val=None, adamw_steps=1500, sgd_steps=1500, threads=2),
        dict(map_seeds=[0, 1, 2, 3, 4], max_len=128, n_train=None, n_test=None, n_val=None, n_eraser=1924,
             adamw_steps=4800, sgd_steps=4800),
    ),
    "squad": profile_table(
        dict(_COMMON, model="casting", casting="match+conv", d_model=32, window=5, max_len=128, min_freq=10,
             oov_buckets=1000, keys="context", adamw_steps=800, sgd_steps=800, eval_every=100, patience=3),
        dict(ratios=[1.0, 10.0], map_seeds=[0], adamw_rates=[1e-3, 3e-3], sgd_rates=[0.3, 1.0], adamw_steps=20,
             sgd_steps=20, eval_every=10, n_train=300, n_test=100, n_eraser=50),
        dict(map_seeds=[0, 1], n_train=8000, n_test=2000, threads=2),
        # full: d_model 64, window 9, 128 words and every exact-span training question. At ratio 1 with
        # AdamW at 1e-3 (seed 0) this reached 27.7% dev accuracy on 2000 dev questions, stopping at step
        # 3000 (69 s on 2 CPU threads); a 256-word cut did not learn at all in the same budget (1.3%).
        dict(map_seeds=[0, 1, 2, 3, 4], d_model=64, window=9, max_len=128, n_train=None, n_test=None, n_eraser=2000,
             adamw_steps=8000, sgd_steps=8000, eval_every=500, patience=3),
    ),
}


def check_dataset(name: str) -> None:
    """Raise a clear ValueError for a dataset without a map."""
    if name not in PROFILES:
        raise ValueError(f"unknown dataset {name!r}; the protocol map exists for {', '.join(DATASETS)}")


def load_splits(name: str, cfg: Mapping[str, Any], data_dir=None) -> tuple[TextDataset, Batch]:
    """``(dataset, validation batch)`` of dataset ``name`` for a map config: HateXplain's official
    validation split, else ``cfg["val_frac"]`` of the training split held out (seeded by
    ``data_seed``; ``dataset.train`` is what is left). The test split chooses nothing."""
    check_dataset(name)
    if name == "hatexplain":
        from ..data import hatexplain

        return hatexplain.load_with_val(data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"],
                                        n_train=cfg.get("n_train"), n_test=cfg.get("n_test"), n_val=cfg.get("n_val"),
                                        seed=cfg["data_seed"])
    ds = squad_casting.load(cfg, data_dir) if name == "squad" else realdata.load({**cfg, "dataset": name}, data_dir)
    ds.train, val = split_validation(ds.train, cfg["val_frac"], cfg["data_seed"])
    ds.report["val_held_out"] = len(val)
    ds.notes.append(f"Validation: {len(val):,} training instances held out at random (seed {cfg['data_seed']}) "
                    "for choosing the base rate and early stopping.")
    return ds, val


def make_model(ds: TextDataset, cfg: Mapping[str, Any], seed: int) -> nn.Module:
    """The seeded model of a map config: ``model`` = ``"token"`` (the SVA chapter's
    :class:`~qkov_lib.models.TokenModel`), ``"conv"`` (the HateXplain convolution encoder under the
    head) or ``"casting"`` (a SQuAD casting)."""
    kind = cfg["model"]
    if kind == "token":
        return realdata.make_model(ds, cfg, seed)
    if kind == "conv":
        return encoder_head.make_model(ds.vocab_size, ds.n_classes, cfg, seed)
    if kind == "casting":
        return squad_casting.make_model(ds, cfg, seed)
    raise ValueError(f"unknown map model {kind!r}; expected 'token', 'conv' or 'casting'")


def base_rates(cfg: Mapping[str, Any]) -> dict[str, list[float]]:
    """``{optimizer: its base-rate grid}`` for the optimizers of ``cfg``."""
    unknown = [o for o in cfg["optimizers"] if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; the map runs {', '.join(OPTIMIZERS)}")
    return {o: [float(e) for e in cfg[f"{o}_rates"]] for o in cfg["optimizers"]}


def cell_config(cfg: Mapping[str, Any], cell: protocol.Cell) -> TrainConfig:
    """The :class:`TrainConfig` of one cell: its optimizer, base rate and ratio; validation every
    ``eval_every`` steps and early stopping after ``patience`` evaluations without a lower
    validation loss (best weights restored)."""
    return TrainConfig(optimizer=cell.optimizer, eta_ov=cell.eta_ov, ratio=cell.ratio, eta_other=cfg["eta_other"],
                       steps=int(cfg[f"{cell.optimizer}_steps"]), batch_size=cfg["batch_size"],
                       weight_decay=cfg["weight_decay"], seed=cell.seed, progress=False,
                       log_every=int(cfg["eval_every"]), log_subsample=0, patience=cfg["patience"], restore_best=True)


def measure(model: nn.Module, data: Batch, n_eraser: int, fracs: Sequence[float] = MAP_FRACS) -> dict[str, float]:
    """Accuracy, macro-F1, loss, mean attention on the relevant tokens, AC@0.5 and ACMC@0.5
    (instances with relevant tokens) and ERASER sufficiency (AOPC over ``fracs``, lower is
    better) on ``n_eraser`` evenly spaced instances of ``data`` (none when 0)."""
    attn, probs = predict(model, data)
    out = prediction_metrics(probs, data.y)
    has = data.relevant.any(1)
    if bool(has.any()):
        s = summarize(attn[has], probs[has], data.relevant[has], data.y[has], [0.5])
        out.update({k: s[k] for k in ("attn_relevant", "AC@0.5", "ACMC@0.5")})
    if n_eraser > 0:
        idx = realdata.spread(len(data), n_eraser).to(attn.device)
        out["sufficiency"] = float(fa.faithfulness(model, data.index(idx), attn[idx], fracs)["sufficiency"])
    return out


def chance(val: Batch) -> float:
    """The majority-class rate of a split: the accuracy of always guessing its commonest class."""
    return float(torch.bincount(val.y.cpu()).max()) / len(val.y)


@dataclass
class MapResult:
    """A trained protocol map: ``table`` (one row per run, with ``trained``), ``selected``
    (validation-chosen base rate per optimizer), ``phase`` (:func:`.protocol.phase_table`),
    ``cells`` (per-column verdicts), ``regions`` (per claim: tuned-rate verdict and region),
    ``chance`` (validation majority rate), the trained ``models`` keyed by cell and the
    validation split ``val`` they were stopped on."""

    table: pd.DataFrame
    selected: dict[str, float]
    phase: pd.DataFrame
    cells: pd.DataFrame
    regions: dict[str, tuple[claims.Verdict, str]]
    chance: float
    models: dict[protocol.Cell, nn.Module] = field(repr=False, default_factory=dict)
    val: Batch | None = field(repr=False, default=None)


def analyse(table: pd.DataFrame, chance_rate: float,
            models: Mapping[protocol.Cell, nn.Module] | None = None) -> MapResult:
    """The protocol's analysis of a run table (:func:`.protocol.train_grid`): trained-run flag,
    validation-chosen base rates, phase table, column verdicts and region verdicts."""
    table = table.assign(trained=protocol.trained(table, chance_rate))
    selected = protocol.select_base_rates(table)
    phase = protocol.phase_table(table)
    cells = protocol.cell_verdicts(phase)
    return MapResult(table, selected, phase, cells, protocol.region_verdicts(cells, selected), chance_rate,
                     dict(models or {}))


def run_map(ds: TextDataset, val: Batch, cfg: Mapping[str, Any], device: torch.device | None = None,
            desc: str | None = None) -> MapResult:
    """Train the map of ``cfg`` (optimizers × their base rates × ratios × ``map_seeds``) on
    ``ds.train`` with early stopping on ``val``, measure every run on ``val`` and ``ds.test``,
    and analyse it (:func:`analyse`)."""
    device = device or torch.device("cpu")
    cells = protocol.grid(cfg["optimizers"], base_rates(cfg), cfg["ratios"], cfg["map_seeds"])
    models: dict[protocol.Cell, nn.Module] = {}
    table = protocol.train_grid(
        cells, lambda s: make_model(ds, cfg, s).to(device), ds.train.to(device), val.to(device), ds.test.to(device),
        lambda c: cell_config(cfg, c), lambda m, b: measure(m, b, cfg["n_eraser"]), desc=desc or ds.name,
        models_out=models, threads=cfg.get("threads"))
    result = analyse(table, chance(val), models)
    result.val = val
    return result


def compare_castings(ds: TextDataset, val: Batch, cfg: Mapping[str, Any], eta_ov: float,
                     names: Sequence[str] | None = None, seed: int = 0) -> pd.DataFrame:
    """Every SQuAD casting of :data:`.squad_casting.CASTINGS` (or ``names``) trained like a map cell
    (AdamW at ``eta_ov``, ratio 1, early stopping on ``val``) from seed ``seed``: one row per
    casting with its options, validation and dev (test) accuracy, the stopping step and the mean
    attention mass per token role on the dev split."""
    rows = []
    cell = protocol.Cell("adamw", float(eta_ov), 1.0, int(seed))
    for name in names or list(squad_casting.CASTINGS):
        c = {**cfg, "casting": name}
        models: dict[protocol.Cell, nn.Module] = {}
        t = protocol.train_grid([cell], lambda s: squad_casting.make_model(ds, c, s), ds.train, val, ds.test,
                                lambda x: cell_config(c, x), lambda m, b: measure(m, b, 0), desc=name,
                                models_out=models, threads=cfg.get("threads")).iloc[0]
        opts = {"readout": "tied", **squad_casting.CASTINGS[name]}
        row = {"casting": name, **opts, "diverged": bool(t["diverged"]), "stop_step": t["stop_step"],
               "val_accuracy": t.get("val_accuracy", math.nan), "dev_accuracy": t.get("accuracy", math.nan)}
        if cell in models:
            row.update({f"mass_{k}": v for k, v in squad_casting.attention_by_role(models[cell], ds).items()})
        rows.append(row)
    return pd.DataFrame(rows).set_index("casting")


def map_config(name: str, profile: str | None, **overrides: Any) -> dict[str, Any]:
    """The map settings of dataset ``name``: its ``profile`` of :data:`PROFILES` with the chapter's
    ``overrides`` (None = profile value). Every value is checked here (types, names, ranges:
    :func:`qkov_lib.profiles.resolve`), so a chapter calls this in its settings cell, before
    anything trains."""
    from ..profiles import resolve

    check_dataset(name)
    return resolve(PROFILES[name], profile, **overrides)


def run_chapter_map(name: str, cfg: Mapping[str, Any], data_dir=None, device: torch.device | None = None,
                    ) -> tuple[MapResult, TextDataset, dict[str, str]]:
    """What a dataset chapter runs with the settings of :func:`map_config`: load the splits,
    train and analyse the map. Returns ``(result, dataset, facts)``; ``facts`` are
    :func:`map_facts` plus the validation size and the trained-run margin."""
    check_dataset(name)
    ds, val = load_splits(name, cfg, data_dir)
    result = run_map(ds, val, cfg, device, desc=f"{name} map")
    facts = map_facts(result) | {"map_n_val": f"{len(val):,}", "map_gain": largest_gain_sentence(result),
                                 "trained_margin": claims.threshold_text("TRAINED_MARGIN")}
    return result, ds, facts


def chapter_map(name: str, profile: str | None, data_dir=None, device: torch.device | None = None,
                **overrides: Any) -> tuple[MapResult, TextDataset, dict[str, Any], dict[str, str]]:
    """:func:`map_config` then :func:`run_chapter_map`: ``(result, dataset, config, facts)``."""
    cfg = map_config(name, profile, **overrides)
    result, ds, facts = run_chapter_map(name, cfg, data_dir, device)
    return result, ds, cfg, facts


def anchor_gap(result: MapResult, optimizer: str, accuracy: float, f1: float, within: float = 0.02) -> dict[str, str]:
    """How far the tuned ``optimizer`` runs at ratio 1 are from a published model's test
    ``accuracy`` and macro-``f1`` (fractions): the two gaps in points and whether both lie
    within ``within``."""
    ref = tuned_runs(result, optimizer, ratio=1.0)
    if not len(ref):
        return {"anchor_gap_accuracy": "n/a", "anchor_gap_macro_f1": "n/a", "anchor_within": "not tested (no run trained)"}
    ga, gf = float(ref["accuracy"].mean()) - accuracy, float(ref["macro_f1"].mean()) - f1
    ok = abs(ga) <= within and abs(gf) <= within
    return {"anchor_gap_accuracy": f"{100 * ga:+.1f} points", "anchor_gap_macro_f1": f"{100 * gf:+.1f} points",
            "anchor_within": ("within" if ok else "not within") + f" {100 * within:g} points on both"}


# --- what the chapter quotes ------------------------------------------------------------------
def _pm(values: Sequence[float]) -> str:
    """Seed mean ± 95% half-width of fractions, in percent (:func:`.realdata.pm`)."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    return realdata.pm(float(v.mean()), seed_half_width(v)) if len(v) else "n/a"


def selection_table(result: MapResult) -> pd.DataFrame:
    """Per optimizer and base rate, at ratio 1: trained runs, validation loss / accuracy /
    macro-F1 of the trained runs (mean over seeds) and whether it was chosen."""
    t = result.table[result.table["ratio"] == 1.0]
    rows = []
    for (opt, eta), g in t.groupby(["optimizer", "eta_ov"], sort=False):
        ok = g[g["trained"]]
        rows.append({"optimizer": opt, "eta_ov": eta, "trained": f"{len(ok)}/{len(g)}",
                     **{f"val {m}": float(ok[f"val_{m}"].mean()) if len(ok) else math.nan
                        for m in ("loss", "accuracy", "macro_f1")},
                     "chosen": result.selected.get(opt) == eta})
    return pd.DataFrame(rows)


def failure_frame(result: MapResult) -> pd.DataFrame:
    """Runs that did not train as ``failed/runs`` per (optimizer, base rate) row and ratio column."""
    f = protocol.failures(result.table)
    f["cell"] = f["failed"].astype(str) + "/" + f["runs"].astype(str)
    return f.pivot(index=["optimizer", "eta_ov"], columns="ratio", values="cell")


def tuned_runs(result: MapResult, optimizer: str, ratio: float | None = None) -> pd.DataFrame:
    """The trained runs at the validation-chosen base rate of ``optimizer`` (only those at
    ``ratio`` if given; empty if none)."""
    if optimizer not in result.selected:
        return result.table.iloc[0:0]
    t = result.table
    keep = (t["optimizer"] == optimizer) & (t["eta_ov"] == result.selected[optimizer]) & t["trained"]
    if ratio is not None:
        keep &= t["ratio"] == float(ratio)
    return t[keep]


def map_facts(result: MapResult) -> dict[str, str]:
    """Sentences and numbers a chapter glues (prefix ``map_``): per optimizer the chosen rate and
    its ratio-1 validation and test numbers, the failure count, and per claim the verdict at the
    tuned rates, its reason and the region where it holds."""
    t = result.table
    f: dict[str, str] = {"map_runs": str(len(t)), "map_failed": str(int((~t["trained"]).sum())),
                         "map_diverged": str(int(t["diverged"].sum())), "map_chance": f"{100 * result.chance:.1f}%"}
    for opt in dict.fromkeys(t["optimizer"]):
        ref = tuned_runs(result, opt, ratio=1.0)
        f[f"map_{opt}_eta"] = f"{result.selected[opt]:g}" if opt in result.selected else "none (no run trained)"
        for split, pre in (("val", "val_"), ("test", "")):
            for m in ("accuracy", "macro_f1"):
                f[f"map_{opt}_{split}_{m}"] = _pm(list(ref[pre + m]))
    for cid, (v, region) in result.regions.items():
        f[f"map_verdict_{cid}"], f[f"map_reason_{cid}"], f[f"map_region_{cid}"] = v.verdict, v.reason, region
        f[f"map_rule_{cid}"] = claims.RULE_TEXT[cid]
    f["map_rule_tuned"] = claims.TUNED_RULE
    return f


def largest_gain_sentence(result: MapResult, metric: str = "AC@0.5") -> str:
    """Where in the map ``metric`` (a fraction) rises most against ratio 1, and how well the
    ratio-1 runs of that column predict compared with the tuned base rate of its optimizer:
    the sentence that says whether sharpening comes where training at ratio 1 was slow."""
    p = result.phase
    col = f"d_{metric}"
    if col not in p or not p[col].notna().any():
        return f"No cell of the map has a {metric} change to report."
    best = p.loc[p[col].idxmax()]
    opt, eta = best["optimizer"], best["eta_ov"]
    ref = p[(p["optimizer"] == opt) & (p["eta_ov"] == eta) & (p["ratio"] == 1.0)]["accuracy"]
    out = (f"The largest {metric} gain in the map is {100 * best[col]:+.1f} points ({opt}, eta_ov {eta:g}, ratio "
           f"{best['ratio']:g}; accuracy {100 * best['d_accuracy']:+.1f} points), in a column whose ratio-1 runs reach "
           f"{100 * float(ref.mean()):.1f}% test accuracy")
    tuned = result.selected.get(opt)
    if tuned is not None:
        t = p[(p["optimizer"] == opt) & (p["eta_ov"] == tuned) & (p["ratio"] == 1.0)]["accuracy"]
        out += f" (at the tuned eta_ov {tuned:g}: {100 * float(t.mean()):.1f}%)"
    return out + "."


def tuned_changes(result: MapResult, optimizer: str) -> dict[str, float]:
    """At the tuned base rate of ``optimizer``: the paired change (against ratio 1) at the highest
    ratio at which a run trained (as R2 reads it) of accuracy, AC@0.5, attention on the relevant
    tokens and sufficiency (NaN if absent)."""
    p = result.phase
    if optimizer not in result.selected:
        return {}
    g = p[(p["optimizer"] == optimizer) & (p["eta_ov"] == result.selected[optimizer])].sort_values("ratio")
    alive = g[g["trained_runs"] > 0]
    top = alive.iloc[-1] if len(alive) else g.iloc[-1]
    return {m: float(top.get(f"d_{m}", math.nan)) for m in ("accuracy", "AC@0.5", "attn_relevant", "sufficiency")} | {
        "ratio": float(top["ratio"])}


def claims_rows(result: MapResult, dataset: str, chapter: str | None = None) -> list[dict[str, str]]:
    """Scorecard rows R1-R3 of a dataset chapter from its map: the verdict at the tuned base rates
    (:func:`qkov_lib.claims.tuned_region`), our numbers at those rates and the region."""
    ch = chapter or realdata.CHAPTERS[dataset]
    rows = []
    for cid in ("R1", "R2", "R3"):
        if cid not in result.regions:
            continue
        v, region = result.regions[cid]
        parts = []
        for opt, eta in result.selected.items():
            d = tuned_changes(result, opt)
            if d["ratio"] == 1.0:
                parts.append(f"{opt} (eta_ov {eta:g}, chosen on validation): no run above ratio 1 trained")
                continue
            parts.append(f"{opt} (eta_ov {eta:g}, chosen on validation): at ratio {d['ratio']:g} vs 1, accuracy "
                         f"{100 * d['accuracy']:+.1f} points, AC@0.5 {100 * d['AC@0.5']:+.1f} points, attention on "
                         f"relevant tokens {d['attn_relevant']:+.3f}, sufficiency {d['sufficiency']:+.3f}")
        ours = (f"{dataset}, base-rate x ratio map ({len(result.table)} runs, "
                f"{int((~result.table['trained']).sum())} did not train): "
                + ("; ".join(parts) or "no base rate trained at ratio 1") + f". Reproduced in: {region}")
        rows.append(claims.claim(cid, claims.CLAIMS[cid], ours, v, ch))
    return rows


def verdict_frame(result: MapResult) -> pd.DataFrame:
    """Per claim: the verdict at the tuned base rates, its reason and the region where it holds."""
    return pd.DataFrame([{"claim": cid, "verdict": v.verdict, "at the tuned base rates": v.reason,
                          "reproduced in (optimizer: base rates)": region}
                         for cid, (v, region) in result.regions.items()]).set_index("claim")


def runs_at(result: MapResult, optimizer: str) -> list[Any]:
    """The trained models at the tuned base rate of ``optimizer`` as objects with ``ratio``,
    ``seed`` and ``model`` (what :func:`.encoder_head.protocol_rows` reads)."""
    from types import SimpleNamespace

    ok = {(r.ratio, r.seed) for r in tuned_runs(result, optimizer).itertuples()}
    eta = result.selected.get(optimizer)
    return [SimpleNamespace(ratio=c.ratio, seed=c.seed, model=m) for c, m in result.models.items()
            if c.optimizer == optimizer and c.eta_ov == eta and (c.ratio, c.seed) in ok]


def roles_by_ratio(result: MapResult, optimizer: str, roles: Callable[[nn.Module], Mapping[str, float]]
                   ) -> pd.DataFrame:
    """``roles(model)`` (e.g. the mean attention mass per token role on the test split) for every
    trained model at the tuned base rate of ``optimizer``, averaged over seeds per ratio."""
    rows = [{"ratio": r.ratio, "seed": r.seed, **roles(r.model)} for r in runs_at(result, optimizer)]
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).drop(columns="seed").groupby("ratio").mean()


def roles_by_optimizer(result: MapResult, roles: Callable[[nn.Module], Mapping[str, float]]
                       ) -> dict[str, pd.DataFrame]:
    """:func:`roles_by_ratio` for every optimizer that has a tuned base rate."""
    return {opt: roles_by_ratio(result, opt, roles) for opt in result.selected}


def plot_roles(result: MapResult, frames: Mapping[str, pd.DataFrame], roles: Sequence[str]):
    """:func:`qkov_lib.plotting.role_bars` of :func:`roles_by_optimizer`, one panel per optimizer
    titled with its tuned base rate; None when no optimizer has one."""
    from ..plotting import role_bars

    if not frames:
        return None
    return role_bars({f"{o} (eta_ov {result.selected[o]:g})": f for o, f in frames.items()}, roles)


def role_sentence(frame: pd.DataFrame | None, role: str, label: str, uniform: str | None = None) -> str:
    """One sentence on how the mean mass on ``role`` (a column of :func:`roles_by_ratio`) moves
    from the lowest to the highest ratio: it rises or falls when the change is at least
    :data:`qkov_lib.claims.SHARPER`, else it stays; ``uniform`` names a reference column."""
    if frame is None or frame.empty or role not in frame:
        return f"No trained model was left to measure the attention on {label}."
    lo, hi = frame.index.min(), frame.index.max()
    a, b = float(frame.loc[lo, role]), float(frame.loc[hi, role])
    move = "rises" if b - a >= claims.SHARPER else "falls" if a - b >= claims.SHARPER else "stays about level"
    out = f"The mean attention mass on {label} {move}, from {a:.3f} at ratio {lo:g} to {b:.3f} at ratio {hi:g}"
    if uniform and uniform in frame:
        out += f" (uniform attention would put {float(frame.loc[lo, uniform]):.3f} there)"
    return out + "."


def top_words(result: MapResult, optimizer: str, data: Batch, vocab: Sequence[str], k: int = 10) -> pd.DataFrame:
    """The ``k`` most-attended words (summed attention mass on the test split) of the first seed's
    tuned ``optimizer`` model at each ratio, with the fraction of their occurrences inside a
    rationale in brackets; one column per ratio."""
    runs = runs_at(result, optimizer)
    if not runs:
        return pd.DataFrame()
    first = min(r.seed for r in runs)
    cols = {}
    for r in sorted((r for r in runs if r.seed == first), key=lambda r: r.ratio):
        w = encoder_head.most_attended_words(test_attention(r.model, data), data, vocab, k=k)
        cols[f"ratio {r.ratio:g}"] = [f"{word} ({100 * f:.0f}%)" for word, f in zip(w.index, w["in_rationale"])]
    return pd.DataFrame(cols, index=pd.RangeIndex(1, k + 1, name="rank"))


def test_attention(model: nn.Module, data: Batch) -> torch.Tensor:
    """The attention rows (N, T) of ``model`` on ``data`` (on the model's device, returned on the CPU)."""
    dev = next(model.parameters()).device
    return predict(model, data.to(dev))[0].cpu()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m qkov_lib.experiments.realmap DATASET [--profile P] [-p NAME VALUE ...]``: train
    one protocol map outside the book (values parsed as JSON, as ``qkov run``) and print its run
    table and region verdicts."""
    import argparse
    import json

    p = argparse.ArgumentParser(description="Train a real-data protocol map and print its runs and verdicts.")
    p.add_argument("dataset", choices=DATASETS)
    p.add_argument("--profile", default=None)
    p.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    a = p.parse_args(argv)

    def value(v: str) -> Any:
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v

    result, ds, cfg, _ = chapter_map(a.dataset, a.profile, **{k: value(v) for k, v in a.param})
    cols = ["optimizer", "eta_ov", "ratio", "seed", "trained", "stop_step", "val_accuracy", "accuracy", "macro_f1",
            "AC@0.5", "attn_relevant", "sufficiency"]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(result.table[[c for c in cols if c in result.table]].round(4).to_string(index=False))
        print(verdict_frame(result).to_string())


__all__ = ["main", "roles_by_ratio", "roles_by_optimizer", "plot_roles", "test_attention", "role_sentence", "top_words", "PROFILES", "DATASETS", "MapResult", "load_splits", "make_model", "base_rates", "cell_config", "measure",
           "chance", "analyse", "run_map", "compare_castings", "chapter_map", "map_config", "run_chapter_map", "anchor_gap", "selection_table", "failure_frame", "tuned_runs", "map_facts", "tuned_changes",
           "claims_rows", "largest_gain_sentence", "verdict_frame", "runs_at"]


if __name__ == "__main__":
    main()
