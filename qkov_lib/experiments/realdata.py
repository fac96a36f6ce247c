"""Chapters "SQuAD", "HateXplain", "SVA" and the real-data summary (claims R1-R3).

One grid per dataset: a one-layer :class:`~qkov_lib.models.TokenModel` (learned word and
position embeddings, one attention head read out at the query; :class:`CopyModel` for SQuAD)
trained with AdamW at ``eta_QK/eta_OV`` in ``ratios`` and several seeds, everything else fixed
(the embeddings learn at ``eta_OV``, so ratio 1 is plain AdamW). Each trained model is
evaluated on the test split, and every attention metric is also computed for two baseline
attention rows on the same model and instances: uniform attention over the keys and random
(flat-Dirichlet) attention.

Metrics of one run (``"attention"`` = model | uniform | random; accuracy and macro-F1 belong to
the model and repeat on the baseline rows):

* ``accuracy``, ``macro_f1``, ``loss`` -- all test instances.
* ``attn_relevant``, ``AC@tau``, ``ACMC@tau`` (tau sweep), ``FTPT/FFPT/FTPF/FFPF`` and the DTAP
  histogram -- test instances with at least one relevant token.
* ``comprehensiveness``, ``sufficiency`` -- ERASER AOPC over ``fracs`` (removal = masking keys),
  on ``n_eraser`` evenly spaced test instances; sufficiency is better when *lower*.
* ``token_f1``, ``iou_f1``, ``auprc`` -- plausibility against the relevant tokens (HateXplain:
  human rationales), on instances with a non-empty rationale.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from .. import faithfulness as fa
from ..data.batch import Batch
from ..data.text import TextDataset, load_text_dataset
from ..metrics import confidence, dtap_histogram, prediction_metrics, relevant_mass, summarize
from ..profiles import profile_table
from ..models import TokenModel
from .. import claims
from ..results import tag_frame
from ..runtime import pick_device, seed_everything, torch_threads
from ..stacked import train_stacked
from ..training import History, TrainConfig, predict, train
from .synthetic import format_summary, seed_summary  # noqa: F401  (re-exported for the chapters)

TAU_SWEEP = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
FRACS = [0.01, 0.05, 0.1, 0.2, 0.5]
ATTENTIONS = ("model", "uniform", "random")
CHAPTERS = {"squad": "05_squad", "hatexplain": "06_hatexplain", "sva": "07_sva"}


# The grid (ratios x seeds) is trained as one stack (qkov_lib.stacked); training metrics are
# logged on a fixed subsample of log_subsample training instances; threads = torch threads.
_COMMON = dict(ratios=[1.0, 3.0, 10.0, 30.0, 100.0], seeds=list(range(8)), optimizer="adamw", eta_ov=1e-4,
               eta_other=None, n_logs=8, parameterization="FAFO", init_scale=1e-2, d_model=64, batch_size=64,
               weight_decay=0.0, min_freq=2, data_seed=0, n_eraser=1000, taus=TAU_SWEEP, fracs=FRACS,
               log_subsample=2000, threads=1)
FULL_SEEDS = list(range(10))

# Profile tables: test = seconds (CI); cpu = each chapter under 15 minutes on 2 cores; full = GPU.
PROFILES: dict[str, dict[str, dict]] = {
    "sva": profile_table(
        dict(_COMMON, dataset="sva", max_len=16, test_frac=0.2, linzen=True, linzen_max_len=48,
             sgd=True, sgd_eta_ov=0.05),
        dict(ratios=[1.0, 10.0], seeds=[0], steps=40, n_train=400, n_test=200, n_eraser=100,
             linzen_n_train=400, linzen_n_test=400, linzen_steps=40, sgd_steps=40),
        dict(steps=2000, n_train=None, n_test=None, linzen_n_train=None, linzen_n_test=None, linzen_steps=1500,
             sgd_steps=4000),
        dict(seeds=FULL_SEEDS, steps=6000, n_train=None, n_test=None, n_eraser=2564,
             linzen_n_train=None, linzen_n_test=None, linzen_steps=5000, sgd_steps=12000),
    ),
    "hatexplain": profile_table(
        dict(_COMMON, dataset="hatexplain", max_len=64, plausibility=True),
        dict(ratios=[1.0, 10.0], seeds=[0], steps=40, n_train=400, n_test=200, n_eraser=100),
        dict(steps=2000, n_logs=6, n_train=None, n_test=None),
        dict(seeds=FULL_SEEDS, steps=8000, max_len=128, n_train=None, n_test=None, n_eraser=1924),
    ),
    "squad": profile_table(
        dict(_COMMON, dataset="squad", max_len=128, query="wh", readout="copy", min_freq=3, d_model=32, eta_ov=3e-4,
             n_logs=4),
        dict(ratios=[1.0, 10.0], seeds=[0], steps=40, n_train=500, n_test=200, n_eraser=100),
        dict(steps=2000, n_train=12000, n_test=1000, seeds=[0, 1, 2, 3]),
        dict(seeds=FULL_SEEDS, steps=30000, d_model=64, max_len=256, n_train=None, n_test=None, n_eraser=10570,
             n_logs=8),
    ),
}


def load(cfg: Mapping[str, Any], data_dir=None, linzen: bool = False) -> TextDataset:
    """The dataset of a resolved chapter config (``linzen=True``: the SVA chapter's Linzen part)."""
    if linzen:
        return load_text_dataset("sva_linzen", data_dir, max_len=cfg["linzen_max_len"], min_freq=cfg["min_freq"],
                                 n_train=cfg["linzen_n_train"], n_test=cfg["linzen_n_test"], seed=cfg["data_seed"])
    extra = {k: cfg[k] for k in ("test_frac", "query") if k in cfg}
    return load_text_dataset(cfg["dataset"], data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"],
                             n_train=cfg["n_train"], n_test=cfg["n_test"], seed=cfg["data_seed"], **extra)


def dataset_frame(ds: TextDataset) -> pd.DataFrame:
    """Sizes of a dataset for display: instances, padded length, vocabulary, classes."""
    rows = [("train instances", len(ds.train)), ("test instances", len(ds.test)),
            ("test instances with relevant tokens", int(ds.test.relevant.any(1).sum())),
            ("padded length T (words + query)", ds.max_len), ("vocabulary", ds.vocab_size),
            ("classes", ds.n_classes)]
    for name, b in (("train", ds.train), ("test", ds.test)):
        counts = torch.bincount(b.y, minlength=ds.n_classes)
        if ds.n_classes <= 4:
            rows += [(f"{name}: {c}", int(n)) for c, n in zip(ds.class_names, counts)]
    return pd.DataFrame(rows, columns=["what", "value"]).set_index("what")


def spread(n_total: int, n: int) -> torch.Tensor:
    """``min(n, n_total)`` evenly spaced indices in ``[0, n_total)`` (all when ``n >= n_total``):
    a fixed subset that covers test files sorted by condition or source."""
    if n >= n_total:
        return torch.arange(n_total)
    return torch.linspace(0, n_total - 1, n).round().long().unique()


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
    """One trained model: settings, training history, one metrics row per attention kind, the
    DTAP histogram (model attention) and per test instance whether the prediction is right
    (``correct``) and the attention mass on its relevant tokens (``mass``, NaN without any)."""

    ratio: float
    seed: int
    history: History
    rows: list[dict[str, Any]]
    dtap: np.ndarray | None
    mass: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    correct: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=bool))
    model: torch.nn.Module | None = field(repr=False, default=None)  # the trained model, for later measurements


class CopyModel(TokenModel):
    """A :class:`TokenModel` with a copy (pointer) readout, for SQuAD as a copy task.

    The head's OV circuit maps the attended mixture into the embedding space (``W_OV`` is
    (d, d)), and that vector is read out by a dot product with the input vector of every
    candidate position (a tied unembedding):

    ``logit(position j) = x_j . W_OV sum_i alpha_i x_i``,  ``x_j`` = word + position embedding.

    If attention sits on the answer token ``i`` and ``W_OV`` copies (is close to a positive
    multiple of the identity), position ``i`` gets the largest logit. Candidates are the context
    positions that are keys (after ``candidate_after``, the ``<sep>`` id); class ``d`` is the
    position ``d`` steps back from the query, as in the dataset's labels.
    """

    def __init__(self, vocab_size: int, d_model: int, n_classes: int, max_len: int,
                 candidate_after: int | None = None, **kwargs: Any) -> None:
        super().__init__(vocab_size, d_model, d_model, max_len, **kwargs)
        self.n_classes, self.candidate_after = n_classes, candidate_after

    def forward(self, tokens: torch.Tensor, key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = tokens.shape[1]
        if T > self.max_len or T > self.n_classes:
            raise ValueError(f"sequence length {T} exceeds max_len {self.max_len} or the number of classes {self.n_classes}")
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(T - 1, -1, -1, device=tokens.device))[None]
        out, attn = self.attention(x, key_mask)
        logits = torch.einsum("btd,bd->bt", x, out)
        cand = key_mask.clone()
        if self.candidate_after is not None:
            cand &= ((tokens == self.candidate_after).cumsum(1) > 0) & (tokens != self.candidate_after)
        logits = logits.masked_fill(~cand, -1e4).flip(1)  # column T-1-d -> class d
        if self.n_classes > T:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], self.n_classes - T), -1e4)], dim=1)
        return logits, attn


def make_model(ds: TextDataset, cfg: Mapping[str, Any], seed: int) -> TokenModel:
    """The seeded model of a chapter config for dataset ``ds``: a :class:`TokenModel`, or a
    :class:`CopyModel` when ``cfg["readout"] == "copy"`` (SQuAD)."""
    gen = seed_everything(seed)
    kw = dict(parameterization=cfg["parameterization"], init_scale=cfg["init_scale"], generator=gen)
    if cfg.get("readout", "class") == "copy":
        sep = ds.vocab.index("<sep>") if "<sep>" in ds.vocab else None
        return CopyModel(ds.vocab_size, cfg["d_model"], ds.n_classes, ds.max_len, candidate_after=sep, **kw)
    return TokenModel(ds.vocab_size, cfg["d_model"], ds.n_classes, ds.max_len, **kw)


def train_config(cfg: Mapping[str, Any], ratio: float, seed: int, steps: int | None = None) -> TrainConfig:
    """The :class:`TrainConfig` of one run: only ``ratio`` (and ``seed``) differ between runs;
    training metrics are logged on a fixed subsample of ``cfg["log_subsample"]`` instances."""
    return TrainConfig(optimizer=cfg["optimizer"], eta_ov=cfg["eta_ov"], ratio=float(ratio), eta_other=cfg["eta_other"],
                       steps=int(steps or cfg["steps"]), batch_size=cfg["batch_size"], weight_decay=cfg["weight_decay"],
                       n_logs=cfg["n_logs"], seed=seed, progress=False, log_subsample=cfg.get("log_subsample"),
                       log_seed=cfg["data_seed"])


def test_probe(ds: TextDataset, n: int = 500):
    """A training probe: accuracy, mean relevant mass and AC@0.5 on ``n`` evenly spaced test instances."""
    sub = ds.test.index(spread(len(ds.test), n))
    has = sub.relevant.any(1)

    def probe(model: torch.nn.Module) -> dict[str, float]:
        dev = next(model.parameters()).device
        attn, probs = predict(model, sub.to(dev))
        attn, probs = attn.cpu(), probs.cpu()
        out = {"test_accuracy": float((probs.argmax(-1) == sub.y).double().mean())}
        if bool(has.any()):
            a = relevant_mass(attn[has], sub.relevant[has])
            out.update({"test_attn_relevant": float(a.mean()), "test_AC@0.5": float((a >= 0.5).double().mean())})
        return out

    return probe


def train_models(ds: TextDataset, cfg: Mapping[str, Any], grid: Sequence[tuple[float, int]],
                 device: torch.device | None = None, steps: int | None = None,
                 probe: bool = True) -> tuple[list[TokenModel], list[History]]:
    """Build the seeded model of every ``(ratio, seed)`` in ``grid`` and train them all as one
    stack (:func:`qkov_lib.stacked.train_stacked`; each keeps its own init, minibatch order and
    rates), logging :func:`test_probe` if ``probe``. Returns ``(models, histories)`` in grid order."""
    device = device or pick_device()
    models = [make_model(ds, cfg, seed).to(device) for _, seed in grid]
    cfgs = [train_config(cfg, ratio, seed, steps) for ratio, seed in grid]
    hists = train_stacked(models, ds.train, cfgs, probe=test_probe(ds) if probe else None,
                          desc=f"{ds.name}: {len(grid)} models", progress=True)
    return models, hists


def train_one(ds: TextDataset, ratio: float, seed: int, cfg: Mapping[str, Any],
              device: torch.device | None = None) -> RealRun:
    """Train one model (:func:`qkov_lib.training.train`) and evaluate it and the two baselines
    on the test split."""
    device = device or pick_device()
    model = make_model(ds, cfg, seed).to(device)
    hist = train(model, ds.train, train_config(cfg, ratio, seed), probe=test_probe(ds), desc=f"r={ratio:g} s={seed}")
    return evaluate_run(ds, model, hist, ratio, seed, cfg)


def evaluate_run(ds: TextDataset, model: TokenModel, hist: History, ratio: float, seed: int,
             cfg: Mapping[str, Any]) -> RealRun:
    """Evaluate a trained model and the two baseline attentions on the test split."""
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


def run_grid(ds: TextDataset, cfg: Mapping[str, Any], device: torch.device | None = None) -> list[RealRun]:
    """Every (ratio, seed) of ``cfg`` on ``ds``: trained as one stack (:func:`train_models`),
    then each evaluated on the test split (:func:`evaluate_run`), with progress bars."""
    grid = [(float(r), s) for r, s in itertools.product(cfg["ratios"], cfg["seeds"])]
    with torch_threads(cfg.get("threads", 1)):
        models, hists = train_models(ds, cfg, grid, device)
        return [evaluate_run(ds, m, h, r, s, cfg)
                for m, h, (r, s) in zip(models, hists, tqdm(grid, desc=f"{ds.name}: test metrics"))]


def runs_frame(runs: Iterable[RealRun]) -> pd.DataFrame:
    """Long table: one row per (run, attention kind) with every metric."""
    return pd.DataFrame([row for r in runs for row in r.rows])


def histories_frame(runs: Iterable[RealRun]) -> pd.DataFrame:
    """Every logged training record, tagged with ratio and seed."""
    return pd.concat([tag_frame(r.history.frame(), ratio=r.ratio, seed=r.seed) for r in runs], ignore_index=True)


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
    order = ["accuracy", "macro_f1", "loss", "attn_relevant", "AC@0.5", "ACMC@0.5", "AC@0.7", "ACMC@0.7",
             "AC@0.9", "ACMC@0.9", "comprehensiveness", "sufficiency", "token_f1", "iou_f1", "auprc",
             "FTPT", "FFPT", "FTPF", "FFPF"]
    return [m for m in order if m in table.columns and table[m].notna().any()]


def summarize_runs(table: pd.DataFrame) -> pd.DataFrame:
    """Seed mean and 95% Student-t half-width of every metric per (attention, ratio)."""
    return seed_summary(table, ["attention", "ratio"], summary_metrics(table))


def sgd_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The chapter config with plain SGD (``sgd_eta_ov``, ``sgd_steps``) instead of AdamW: the
    optimizer check of the SVA chapter."""
    return {**cfg, "optimizer": "sgd", "eta_ov": cfg["sgd_eta_ov"], "steps": cfg["sgd_steps"]}


# --- SVA: Linzen attractor sets ------------------------------------------------------------
def linzen_grid(ds: TextDataset, cfg: Mapping[str, Any], device: torch.device | None = None) -> pd.DataFrame:
    """Train on Linzen's numpred.val for every (ratio, seed) and return test accuracy by number
    of attractors (one row per run and attractor count, plus ``"all"`` test prefixes and
    ``"train"``, the accuracy on the training prefixes)."""
    k = np.asarray(ds.test_info["n_attractors"])
    grid = [(float(r), s) for r, s in itertools.product(cfg["ratios"], cfg["seeds"])]
    with torch_threads(cfg.get("threads", 1)):
        models, _ = train_models(ds, cfg, grid, device, steps=cfg["linzen_steps"], probe=False)
        return pd.DataFrame(_linzen_rows(ds, models, grid, k))


def _linzen_rows(ds: TextDataset, models: Sequence[TokenModel], grid: Sequence[tuple[float, int]],
                 k: np.ndarray) -> list[dict]:
    rows = []
    for model, (ratio, seed) in zip(models, tqdm(grid, desc="linzen: test accuracy")):
        device = next(model.parameters()).device
        _, p_train = predict(model, ds.train.to(device))
        rows.append({"ratio": float(ratio), "seed": seed, "n_attractors": "train",
                     "accuracy": float((p_train.argmax(-1).cpu() == ds.train.y).double().mean()), "n": len(ds.train)})
        _, probs = predict(model, ds.test.to(device))
        ok = (probs.argmax(-1).cpu() == ds.test.y).numpy()
        rows.append({"ratio": float(ratio), "seed": seed, "n_attractors": "all", "accuracy": float(ok.mean()), "n": len(ok)})
        for j in sorted(set(k.tolist())):
            sel = k == j
            rows.append({"ratio": float(ratio), "seed": seed, "n_attractors": str(j), "accuracy": float(ok[sel].mean()),
                         "n": int(sel.sum())})
    return rows


# --- claims R1-R3 -------------------------------------------------------------------------
def _get(summary: pd.DataFrame, ratio: float, metric: str, attention: str = "model") -> tuple[float, float]:
    row = summary[(summary["attention"] == attention) & (summary["ratio"] == ratio)]
    if row.empty or metric not in row:
        return math.nan, math.nan
    return float(row[metric].iloc[0]), float(row[f"{metric}_ci"].iloc[0])


def pm(value: float, ci: float, pct: bool = True, digits: int = 1) -> str:
    """``mean ± half-width`` (percent by default); no interval when it is NaN (one seed)."""
    if value is None or math.isnan(value):
        return "n/a"
    s = 100.0 if pct else 1.0
    unit = "%" if pct else ""
    return f"{value * s:.{digits}f}{unit}" + ("" if math.isnan(ci) else f" ± {ci * s:.{digits}f}{unit if pct else ''}")


def _change(summary: pd.DataFrame, metric: str, lo: float, r: float) -> tuple[float, float]:
    """Change of ``metric`` from ratio ``lo`` to ``r`` and the 95% half-width of that change
    (the seed intervals added in quadrature; NaN with one seed)."""
    (a, ca), (b, cb) = _get(summary, lo, metric), _get(summary, r, metric)
    return b - a, math.sqrt(ca ** 2 + cb ** 2)


def model_ratios(summary: pd.DataFrame, cfg: Mapping[str, Any]) -> list[float]:
    """The ratios of ``cfg`` that have model rows in ``summary``, in increasing order."""
    have = set(summary.loc[summary["attention"] == "model", "ratio"].astype(float))
    ratios = sorted(float(r) for r in cfg["ratios"] if float(r) in have)
    if not ratios:
        raise ValueError(f"the summary has no model rows at the ratios {cfg['ratios']}")
    return ratios


def chapter_verdicts(summary: pd.DataFrame, cfg: Mapping[str, Any]) -> dict[str, claims.Verdict]:
    """R1-R3 by the rules of :mod:`qkov_lib.claims`, from the seed summary: every higher ratio
    against the lowest (R1, R3) and the highest against the lowest (R2)."""
    ratios = model_ratios(summary, cfg)
    lo, hi = ratios[0], ratios[-1]
    higher = ratios[1:]
    d = {m: [_change(summary, m, lo, r)[0] for r in higher] for m in ("accuracy", "macro_f1", "attn_relevant")}
    r2 = [_change(summary, m, lo, hi) if higher else (math.nan, math.nan) for m in ("AC@0.5", "ACMC@0.5", "sufficiency")]
    return {"R1": claims.r1_performance_stable(d["accuracy"], d["macro_f1"]),
            "R2": claims.r2_interpretability(*(x for x, _ in r2), noise=[e for _, e in r2]),
            "R3": claims.r3_decoupled(d["attn_relevant"], d["accuracy"])}


def chapter_facts(summary: pd.DataFrame, cfg: Mapping[str, Any], by_correct: pd.DataFrame | None = None) -> dict[str, str]:
    """Numbers, verdicts (with their rules) and sentences the chapter quotes, computed from the
    seed summary (model rows against the lowest and highest ratio, baselines at the highest)."""
    ratios = model_ratios(summary, cfg)
    lo, hi = ratios[0], ratios[-1]
    f: dict[str, str] = {"r_lo": f"{lo:g}", "r_hi": f"{hi:g}", "n_seeds": str(len(cfg["seeds"]))}
    for m in ("accuracy", "macro_f1", "AC@0.5", "ACMC@0.5", "attn_relevant", "comprehensiveness", "sufficiency",
              "token_f1", "iou_f1", "auprc"):
        pct = m not in ("comprehensiveness", "sufficiency")
        f[f"{m}_lo"] = pm(*_get(summary, lo, m), pct=pct, digits=1 if pct else 3)
        f[f"{m}_hi"] = pm(*_get(summary, hi, m), pct=pct, digits=1 if pct else 3)
        for kind in ("uniform", "random"):
            f[f"{m}_{kind}"] = pm(*_get(summary, hi, m, kind), pct=pct, digits=1 if pct else 3)
    worst = min((_change(summary, "accuracy", lo, r)[0] for r in ratios[1:]), default=math.nan)
    worst_f1 = min((_change(summary, "macro_f1", lo, r)[0] for r in ratios[1:]), default=math.nan)
    f["worst_dacc"], f["worst_df1"] = f"{100 * worst:+.1f} points", f"{100 * worst_f1:+.1f} points"
    f["dacc"] = f"{100 * _change(summary, 'accuracy', lo, hi)[0]:+.1f} points"
    for m in ("AC@0.5", "ACMC@0.5", "sufficiency"):
        dm = _change(summary, m, lo, hi)[0]
        f[f"d_{m}"] = "n/a" if math.isnan(dm) else (f"{100 * dm:+.1f} points" if m != "sufficiency" else f"{dm:+.3f}")
    f.update(claims.verdict_glue(chapter_verdicts(summary, cfg)))
    f["ratio_sentence"] = (f"Only ratio {lo:g} was run, so R1-R3 are not tested here." if lo == hi else
                           f"From ratio {lo:g} to {hi:g}: R1 {f['verdict_R1']}, R2 {f['verdict_R2']}, "
                           f"R3 {f['verdict_R3']}.")
    if by_correct is not None and len(by_correct):
        g = by_correct.groupby(["ratio", "prediction"])["attn_relevant"].mean()
        for p in ("correct", "wrong"):
            f[f"mass_{p}_lo"] = pm(g.get((lo, p), math.nan), math.nan)
            f[f"mass_{p}_hi"] = pm(g.get((hi, p), math.nan), math.nan)
    return f


def claims_rows(facts: Mapping[str, str], verdicts: Mapping[str, claims.Verdict], dataset: str,
                chapter: str | None = None) -> list[dict[str, str]]:
    """Scorecard rows R1, R2, R3 of one dataset chapter from :func:`chapter_verdicts` and
    :func:`chapter_facts`."""
    ch = chapter or CHAPTERS[dataset]
    lo, hi = facts["r_lo"], facts["r_hi"]
    r1 = (f"{dataset}: accuracy {facts['accuracy_lo']} (ratio {lo}) -> {facts['accuracy_hi']} (ratio {hi}); "
          f"macro-F1 {facts['macro_f1_lo']} -> {facts['macro_f1_hi']}; worst change vs ratio {lo} at any higher ratio: "
          f"accuracy {facts['worst_dacc']}, macro-F1 {facts['worst_df1']}")
    r2 = (f"{dataset}: AC@0.5 {facts['AC@0.5_lo']} -> {facts['AC@0.5_hi']}; ACMC@0.5 {facts['ACMC@0.5_lo']} -> "
          f"{facts['ACMC@0.5_hi']}; sufficiency AOPC (lower is better) {facts['sufficiency_lo']} -> "
          f"{facts['sufficiency_hi']} (ratio {lo} -> {hi}); uniform-attention AC@0.5 {facts['AC@0.5_uniform']}")
    r3 = (f"{dataset}: attention on relevant tokens {facts['attn_relevant_lo']} -> {facts['attn_relevant_hi']} and AC@0.5 "
          f"change {facts['d_AC@0.5']} while accuracy changed {facts['dacc']} (ratio {lo} -> {hi})")
    if "mass_correct_lo" in facts:
        r3 += (f"; mean attention on relevant tokens among correct predictions {facts['mass_correct_lo']} -> "
               f"{facts['mass_correct_hi']}, among wrong ones {facts['mass_wrong_lo']} -> {facts['mass_wrong_hi']}")
    return [claims.claim(cid, claims.CLAIMS[cid], ours, verdicts[cid], ch)
            for cid, ours in (("R1", r1), ("R2", r2), ("R3", r3))]


# --- summary chapter -----------------------------------------------------------------------
def read_results(name: str, results_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The results document a dataset chapter wrote (``<results_dir>/<name>.json``, default
    :func:`qkov_lib.results.default_results_path`), or None when the file does not exist."""
    from ..results import default_results_path

    path = Path(results_dir) / f"{name}.json" if results_dir else default_results_path(name)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"results file {path} is not valid JSON ({err}); rerun its chapter") from err


def r_table(results_dir: str | Path | None = None, datasets: Sequence[str] = ("squad", "hatexplain", "sva")) -> pd.DataFrame:
    """The R1-R3 table: one row per (claim, dataset) with the paper's statement, our measurement
    (with the profile and number of seeds it came from), the verdict, its rule and reason;
    "not run" where a dataset chapter has written no results."""
    rows = []
    for cid in ("R1", "R2", "R3"):
        for name in datasets:
            doc = read_results(name, results_dir)
            base = {"claim": cid, "dataset": name, "chapter": CHAPTERS[name], "paper": claims.CLAIMS[cid],
                    "rule": "", "reason": ""}
            if doc is None:
                rows.append({**base, "ours": f"not run: no results file for chapter {CHAPTERS[name]} in this build",
                             "verdict": "not run", "profile": None})
                continue
            found = [c for c in doc.get("metrics", {}).get("claims", []) if c.get("id") == cid]
            params = doc.get("params", {})
            if not found:
                rows.append({**base, "ours": "not reported by the chapter", "verdict": "not run",
                             "profile": params.get("profile")})
                continue
            c = found[0]
            # the verdict comes from the chapter's protocol map when it ran one, with its own seeds
            seeds = (doc.get("metrics", {}).get("map_settings") or {}).get("map_seeds") or params.get("seeds", [])
            prof = f"{params.get('profile')} profile, {len(seeds)} seed(s)"
            rows.append({**base, "ours": f"{c['ours']} [{prof}]", "verdict": c["verdict"], "rule": c.get("rule", ""),
                         "reason": c.get("reason", ""), "profile": params.get("profile")})
    return pd.DataFrame(rows)


def r_verdicts(table: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """One ``(verdict, reason)`` per claim across datasets, by :func:`qkov_lib.scorecard.combine`
    (disagreeing datasets are named with their reasons)."""
    from ..scorecard import combine

    return {cid: combine([r for r in g.to_dict("records") if r["verdict"] != "not run"])
            for cid, g in table.groupby("claim", sort=True)}


def r_table_myst(table: pd.DataFrame) -> str:
    """The R1-R3 table as MyST markdown: claim | paper | ours | verdict | rule."""
    from ..scorecard import myst_cell

    lines = ["| claim | paper | ours (mean ± 95% seed interval) | verdict | rule (thresholds) |", "|---|---|---|---|---|"]
    for cid, g in table.groupby("claim", sort=True):
        for i, (_, r) in enumerate(g.iterrows()):
            ours = myst_cell(r["ours"]) + (f" *Decided by:* {myst_cell(r['reason'])}" if r["reason"] else "")
            lines.append(f"| {'**' + cid + '**' if i == 0 else ''} | {myst_cell(r['paper']) if i == 0 else ''} | "
                         f"{ours} | **{r['verdict']}** | {myst_cell(r['rule'])} |")
    return "\n".join(lines)


# --- chapter tables and figures ------------------------------------------------------------
ATTENTION_METRICS = ["attn_relevant", "AC@0.5", "ACMC@0.5", "AC@0.9", "ACMC@0.9", "comprehensiveness", "sufficiency",
                     "token_f1", "iou_f1", "auprc"]


def model_table(summary: pd.DataFrame, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """``mean ± half-width`` of the model's metrics per ratio (rows: ratio)."""
    sub = summary[summary["attention"] == "model"].drop(columns="attention")
    metrics = [m for m in (metrics or ["accuracy", "macro_f1", "loss", *ATTENTION_METRICS]) if m in sub]
    return format_summary(sub[["ratio", *[c for m in metrics for c in (m, f"{m}_ci")], "n_seeds"]], metrics)


def baseline_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Every attention metric for model, uniform and random attention at every ratio."""
    metrics = [m for m in ATTENTION_METRICS if m in summary and summary[m].notna().any()]
    cols = ["attention", "ratio", *[c for m in metrics for c in (m, f"{m}_ci")], "n_seeds"]
    return format_summary(summary[cols], metrics)


def focus_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The focus/prediction cells (fractions of instances with relevant tokens) per ratio."""
    return model_table(summary, ["FTPT", "FFPT", "FTPF", "FFPF"])


def plot_tau_sweep(table: pd.DataFrame, taus: Sequence[float]):
    """AC and ACMC against the threshold tau, one line per ratio (model) plus the uniform and
    random baselines at the highest ratio (dashed); mean over seeds with a 95% band."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from ..plotting import FACE, setup

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


def plot_attractors(frame: pd.DataFrame):
    """Linzen test accuracy against the number of attractors, one line per ratio."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from ..plotting import FACE, setup

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


def glue_name(key: str) -> str:
    """A glue-safe name for a facts key (``AC@0.5_lo`` -> ``AC05_lo``)."""
    return key.replace("@", "").replace(".", "")


def provenance_frame(results_dir: str | Path | None = None) -> pd.DataFrame:
    """Where the summary's numbers come from: per dataset chapter, whether it ran, its profile,
    ratios, number of seeds, steps, train/test instances used, wall time (s) and git commit."""
    rows = []
    for name in ("squad", "hatexplain", "sva"):
        doc = read_results(name, results_dir)
        if doc is None:
            rows.append({"chapter": CHAPTERS[name], "status": "not run"})
            continue
        p, report = doc.get("params", {}), doc["metrics"].get("data_report", {})
        rows.append({"chapter": CHAPTERS[name], "status": "ran", "profile": p.get("profile"),
                     "ratios": p.get("ratios"), "seeds": len(p.get("seeds", [])), "steps": p.get("steps"),
                     "train instances": report.get("train_used"), "test instances": report.get("test_used"),
                     "wall time (s)": round(doc["wall_time_s"], 1) if doc.get("wall_time_s") else None,
                     "git commit": str(doc.get("git_commit", ""))[:12]})
    return pd.DataFrame(rows).set_index("chapter")
