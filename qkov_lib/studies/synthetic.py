"""Chapter "The synthetic task and the four parameterizations": a grid of full-model runs
(parameterization x eta_QK/eta_OV x seed) on the distinct/common-token task, its tables and
verdicts. The grid trains in the batched engine (:func:`qkov_lib.studies.synthetic_sweeps.run_grid`);
:func:`train_one` is the same run through the one-model loop, which that engine is tested to equal."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from qkov_lib.data import synthetic as syn
from qkov_lib import claims
from qkov_lib.metrics import (DEFAULT_TAUS, circuit_scalars, confidence, dtap_distance, dtap_histogram, relevant_mass,
                       seed_half_width, summarize)
from qkov_lib.models import PARAMETERIZATIONS, SyntheticModel
from qkov_lib.metrics import tag_frame
from qkov_lib.runtime import pick_device, seed_everything
from qkov_lib.train import History, TrainConfig, predict, train

SHOWN = 12  # a verdict names the cells of an outcome when there are at most this many; else it counts them


def read(est: "claims.Estimand | Mapping[str, claims.Estimand]",
         *families: Mapping[str, "claims.Change | None"]) -> list[claims.Reading]:
    """Every cell of a claim read by the one rule (:func:`qkov_lib.claims.read_cells`), one
    Bonferroni family per mapping of ``families``: the exact values of an ODE carry no sampling
    error, so they do not widen the seed intervals of the cells measured over seeds beside them."""
    return [r for fam in families if fam for r in claims.read_cells(fam, est)]


def verdict(readings: Sequence[claims.Reading], est: claims.Estimand, rule: str = "") -> claims.Verdict:
    """The claim's :class:`qkov_lib.claims.Verdict` by :func:`qkov_lib.claims.decide` (the only
    source of its word). Over more than :data:`SHOWN` cells the region names only the outcomes with
    at most that many cells and counts the others, and the effect gives the range of the changes and
    the cells at both ends, so a map of hundreds of cells still reads in a line."""
    v = claims.decide(readings, est, rule)
    if len(readings) <= SHOWN or v.verdict == "not tested":
        return v
    n = len(readings)
    named = {o: [r.cell for r in readings if r.outcome == o] for o in claims.OUTCOMES}
    region = "; ".join(f"{o} at " + (", ".join(c) if len(c) <= SHOWN else f"{len(c)} of {n} cells")
                       for o, c in named.items() if c) if v.region else ""
    have = [r for r in readings if r.change is not None and np.isfinite(r.change.mean)]
    lo, hi = (min(have, key=lambda r: r.change.mean), max(have, key=lambda r: r.change.mean)) if have else (None, None)
    effect = (f"{n} cells, from {lo.text()} ({lo.cell}) to {hi.text()} ({hi.cell})" if have else v.effect)
    open_ = sorted((r for r in readings if r.outcome == "undecided"), key=lambda r: (r.seeds is None, r.seeds or 0))
    seeds = claims.seeds_text(open_[:SHOWN]) + (f"; {len(open_) - SHOWN} more undecided cells" if len(open_) > SHOWN
                                                else "")
    reason = outcome_counts(readings) + (f"; {seeds}" if seeds else "")
    return claims.Verdict(v.verdict, v.rule, reason, region=region, effect=effect)


def outcome_counts(readings: Sequence[claims.Reading]) -> str:
    """``k holds, m contradicted, u undecided of n cells`` (the outcomes present)."""
    return ", ".join(f"{sum(r.outcome == o for r in readings)} {o}" for o in claims.OUTCOMES
                     if any(r.outcome == o for r in readings)) + f" of {len(readings)} cells"


# Profile table: test = seconds (tests, CI); cpu = default build on 2 cores; full = GPU scale.
PROFILES: dict[str, dict] = {
    "test": dict(parameterizations=list(PARAMETERIZATIONS), ratios=[1.0, 10.0], seeds=[0],
                 steps=60, eta_ov=0.5, init_scale=0.1, optimizer="gd", n_classes=3,
                 n_common_vocab=2, n_common=[2, 4], embedding="onehot", n_test=400, dtype="float64"),
    "cpu": dict(parameterizations=list(PARAMETERIZATIONS), ratios=[1.0, 10.0], seeds=[0, 1, 2],
                steps=1000, eta_ov=0.5, init_scale=0.1, optimizer="gd", n_classes=4,
                n_common_vocab=3, n_common=[2, 4, 8, 12], embedding="onehot", n_test=4000, dtype="float64"),
    "full": dict(parameterizations=list(PARAMETERIZATIONS), ratios=[1.0, 10.0], seeds=[0, 1, 2, 3, 4],
                 steps=20000, eta_ov=0.5, init_scale=0.1, optimizer="gd", n_classes=8,
                 n_common_vocab=4, n_common=[2, 4, 8, 16, 32], embedding="onehot", n_test=20000, dtype="float64"),
}


def task_of(cfg: dict) -> syn.SyntheticTask:
    """The :class:`SyntheticTask` described by a resolved settings dict."""
    return syn.SyntheticTask(n_classes=cfg["n_classes"], n_common_vocab=cfg["n_common_vocab"],
                             n_common=tuple(cfg["n_common"]), embedding=cfg["embedding"])


def scalar_probe(task: syn.SyntheticTask, E: torch.Tensor):
    """A training probe recording the OV and QK scalars of :func:`circuit_scalars`."""
    Ed, Ec, eq = E[task.distinct_ids], E[task.common_ids], E[task.query_id]

    def probe(model: SyntheticModel) -> dict[str, float]:
        with torch.no_grad():
            W_QK, W_OV = model.attention.effective()
            return circuit_scalars(W_QK, W_OV, Ed, Ec, eq)

    return probe


@dataclass
class Run:
    """One trained model: its settings, training history and test-set evaluation."""

    parameterization: str
    ratio: float
    seed: int
    history: History
    test: dict[str, float]
    dtap: np.ndarray
    train_set: str = "exact population"


def train_one(task: syn.SyntheticTask, parameterization: str, ratio: float, seed: int, cfg: dict,
              device: torch.device | None = None, progress: bool = False) -> Run:
    """Train one model on the exact population loss (or a large sample when the population is
    too big) and evaluate it on a fresh seeded test sample."""
    device = device or pick_device()
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    gen = seed_everything(seed)
    E = syn.make_embeddings(task, gen, dtype)
    # minibatches of a weighted population are not samples of it: minibatch runs get an i.i.d. sample
    # (recorded in the run: a population too large to enumerate falls back to a seeded sample)
    train_data, train_set = None, f"i.i.d. sample of {cfg.get('n_train', 20000)}"
    if cfg.get("batch_size") is None:
        try:
            train_data, train_set = syn.population(task), "exact population"
        except ValueError as e:
            train_set += f" (exact population unavailable: {e})"
    if train_data is None:
        train_data = syn.sample(task, cfg.get("n_train", 20000), gen)
    test_data = syn.sample(task, cfg["n_test"], torch.Generator().manual_seed(10_000 + seed))
    model = SyntheticModel(E, task.n_classes, parameterization=parameterization,
                           init_scale=cfg["init_scale"], generator=gen, dtype=dtype).to(device)
    tc = TrainConfig.from_profile(cfg, ratio=ratio, seed=seed, progress=progress)
    hist = train(model, train_data, tc, probe=scalar_probe(task, E.to(device)),
                 desc=f"{parameterization} r={ratio:g} s={seed}")
    test_data = test_data.to(device)
    attn, probs = predict(model, test_data)
    test = summarize(attn, probs, test_data.relevant, test_data.y, DEFAULT_TAUS)
    a, c = relevant_mass(attn, test_data.relevant), confidence(probs, test_data.y)
    return Run(parameterization, float(ratio), seed, hist, test, dtap_histogram(a.cpu(), c.cpu()).numpy(), train_set)


def runs_frame(runs: Iterable[Run]) -> pd.DataFrame:
    """One row per run: settings plus every test metric."""
    return pd.DataFrame([{"parameterization": r.parameterization, "ratio": r.ratio, "seed": r.seed,
                          "train_set": r.train_set, **r.test} for r in runs])


def histories_frame(runs: Iterable[Run]) -> pd.DataFrame:
    """Long table of every logged training record, tagged with its run's settings."""
    return pd.concat([tag_frame(r.history.frame(), parameterization=r.parameterization, ratio=r.ratio, seed=r.seed)
                      for r in runs], ignore_index=True)


def seed_summary(frame: pd.DataFrame, by: Sequence[str], metrics: Sequence[str], level: float = 0.95) -> pd.DataFrame:
    """Mean and a Student-t confidence half-width over seeds of each metric, per ``by`` group.
    Columns ``<metric>`` and ``<metric>_ci``; the half-width is NaN with one seed."""
    def agg(g: pd.DataFrame) -> pd.Series:
        out = {}
        for m in metrics:
            out[m] = g[m].mean()
            out[f"{m}_ci"] = seed_half_width(g[m], level)
        out["n_seeds"] = len(g)
        return pd.Series(out)

    if frame.empty:  # e.g. no run reached a matched loss: the same columns, no rows
        return pd.DataFrame(columns=[*by, *(c for m in metrics for c in (m, f"{m}_ci")), "n_seeds"])
    return frame.groupby(list(by), sort=False).apply(agg, include_groups=False).reset_index()


def seed_dtaps(runs: Iterable[Run]) -> dict[tuple[str, float], list[np.ndarray]]:
    """Every run's DTAP histogram, in run order, keyed by (parameterization, ratio)."""
    acc: dict[tuple[str, float], list[np.ndarray]] = {}
    for r in runs:
        acc.setdefault((r.parameterization, r.ratio), []).append(r.dtap)
    return acc


def fafo_gap(fafo: Sequence[np.ndarray], dtaps: Mapping[tuple[str, float], np.ndarray], ref: float) -> claims.Change:
    """S2's tie test: over FAFO's per-seed heatmaps ``fafo``, the difference of the distance to
    FACO's and to CACO's mean heatmap at ratio ``ref`` (a :class:`qkov_lib.claims.Change`)."""
    return claims.Change.of([dtap_distance(h, dtaps[("FACO", ref)]) - dtap_distance(h, dtaps[("CACO", ref)])
                             for h in fafo])


def mean_dtap(runs: Iterable[Run]) -> dict[tuple[str, float], np.ndarray]:
    """DTAP histogram averaged over seeds, keyed by (parameterization, ratio)."""
    return {k: np.mean(v, axis=0) for k, v in seed_dtaps(runs).items()}


SUMMARY_METRICS = ["loss", "accuracy", "attn_relevant", "AC@0.5", "ACMC@0.5", "AC@0.7", "ACMC@0.7",
                   "AC@0.9", "ACMC@0.9"]
FOCUS_METRICS = ["FTPT", "FFPT", "FTPF", "FFPF"]


def format_summary(summary: pd.DataFrame, metrics: Sequence[str], digits: int = 3) -> pd.DataFrame:
    """``mean ± half-width`` strings for each metric (just the mean when there is one seed)."""
    keys = [c for c in summary.columns if c not in metrics and not c.endswith("_ci") and c != "n_seeds"]
    out = summary[keys].copy()
    for m in metrics:
        ci = summary[f"{m}_ci"]
        out[m] = [f"{v:.{digits}f}" + ("" if np.isnan(e) else f" ± {e:.{digits}f}")
                  for v, e in zip(summary[m], ci)]
    return out.set_index(keys)


def ranking(summary: pd.DataFrame, ratio: float, metric: str = "attn_relevant") -> list[str]:
    """Parameterizations at ``ratio`` ordered by ``metric``, highest first."""
    sub = summary[summary["ratio"] == ratio].sort_values(metric, ascending=False)
    return sub["parameterization"].tolist()


def pairwise_tv(dtaps: Mapping[tuple[str, float], np.ndarray], params: Sequence[str], ratio: float
                ) -> dict[tuple[str, str], float]:
    """DTAP total-variation distance of every pair of ``params`` at ``ratio``."""
    return {(a, b): dtap_distance(dtaps[(a, ratio)], dtaps[(b, ratio)])
            for a, b in itertools.combinations(params, 2)}


def fafo_toward(dtaps: Mapping[tuple[str, float], np.ndarray], lo: float, hi: float,
                seeds: Mapping[tuple[str, float], Sequence[np.ndarray]] | None = None) -> str | None:
    """Where a faster QK moves FAFO's DTAP heatmap (:func:`qkov_lib.claims.s2_fafo_move`): toward
    FACO or CACO at ratio ``lo`` (its total-variation distance to it shrank from ratio ``lo`` to
    ``hi``), ``"tie"`` (both shrank to distances equal within the seed interval of
    :func:`fafo_gap` over FAFO's per-seed heatmaps ``seeds[("FAFO", hi)]``; exactly equal without
    ``seeds``), ``"neither"``, or None when the comparison cannot be made (one ratio, a missing model)."""
    keys = [("FAFO", lo), ("FAFO", hi), ("FACO", lo), ("CACO", lo)]
    if hi == lo or any(k not in dtaps for k in keys):
        return None
    dist = {r: {p: dtap_distance(dtaps[("FAFO", r)], dtaps[(p, lo)]) for p in ("FACO", "CACO")} for r in (lo, hi)}
    gap = fafo_gap(seeds[("FAFO", hi)], dtaps, lo) if seeds and ("FAFO", hi) in seeds else None
    return claims.s2_fafo_move(dist[lo], dist[hi], gap)


def chapter_facts(summary: pd.DataFrame, dtaps: Mapping[tuple[str, float], np.ndarray], cfg: dict,
                  seeds: Mapping[tuple[str, float], Sequence[np.ndarray]] | None = None) -> dict[str, str]:
    """The numbers and sentences the chapter's prose quotes, computed from the seed summary and
    the heatmaps, and the rules by which S1 and S3 are decided in the sweep chapter, at matched
    training loss (``rule_S1``, ``rule_S3``). This chapter decides no claim: its runs end after a
    fixed number of steps, where most have saturated (S2 is decided by the phase map of the sharpness page)."""
    lo, hi = min(cfg["ratios"]), max(cfg["ratios"])
    params = list(dict.fromkeys(summary["parameterization"]))
    by = summary.set_index(["parameterization", "ratio"])
    f = {"r_low": f"{lo:g}", "r_high": f"{hi:g}", "n_param": str(len(params)),
         "rank_low": " > ".join(ranking(summary, lo)), "rank_high": " > ".join(ranking(summary, hi)),
         "rule_S1": claims.ESTIMANDS["S1"].text(), "rule_S3": claims.ESTIMANDS["S3"].text(), "one_rule": claims.ONE_RULE}
    tv = pairwise_tv(dtaps, params, lo)
    if tv:
        (a, b), t = max(tv.items(), key=lambda kv: kv[1])
        f["s1_sentence"] = (f"At ratio {lo:g} the DTAP heatmaps of the {len(params)} parameterizations are "
                            f"{min(tv.values()):.3f} to {t:.3f} apart in total variation (largest: {a} vs {b}).")
    else:
        f["s1_sentence"] = "Only one parameterization was run, so there are no heatmaps to compare."
    top2 = ranking(summary, lo)[:2]
    which = claims.s2_summary({p: float(by.loc[(p, lo), "attn_relevant"]) for p in params})
    toward = fafo_toward(dtaps, lo, hi, seeds)
    if len(params) < 4:
        f["s2_sentence"] = f"Only {len(params)} of the four parameterizations were run, so there is no ranking to show."
    else:
        f["s2_sentence"] = (f"In this run the two parameterizations with the highest attention at equal rates were "
                            f"{' and '.join(top2)}, which matches "
                            + {"A": "the first summary (CACO, FACO)", "B": "the second summary (CAFO, CACO)",
                               "neither": "neither summary"}[which]
                            + ("; FAFO's move under a faster QK was not measured (one ratio)." if toward is None else
                               "; with a faster QK, FAFO's heatmap moved away from both FACO's and CACO's."
                               if toward == "neither" else
                               "; with a faster QK, FAFO's heatmap moved closer to both FACO's and CACO's and ended "
                               "equally far from them within the seed interval (a tie, which supports neither)."
                               if toward == "tie" else f"; with a faster QK, FAFO's heatmap moved closer to {toward}'s."))
    if hi == lo:
        f["s3_sentence"] = f"Only ratio {lo:g} was run, so the effect of the ratio (S3) is not tested."
    else:
        d = {m: [float(by.loc[(p, hi), m] - by.loc[(p, lo), m]) for p in params]
             for m in ("attn_relevant", "AC@0.9", "loss", "accuracy")}
        up = sum(x >= claims.SHARPER for x in d["attn_relevant"])
        f["s3_sentence"] = (f"Raising the ratio from {lo:g} to {hi:g} raised the mean attention on the distinct token "
                            f"by at least {claims.threshold_text('SHARPER')} for {up} of {len(params)} "
                            f"parameterizations and AC at τ = 0.9 for {sum(x > 0 for x in d['AC@0.9'])}; the largest "
                            f"change of test loss was {max(map(abs, d['loss'])):.3f} nats and of accuracy "
                            f"{max(map(abs, d['accuracy'])):.3f} (absolute).")
    return f
