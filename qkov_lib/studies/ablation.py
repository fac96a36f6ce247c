"""What the real-data protocol decides: each of its choices undone alone, at the paper's protocol cells.

Per dataset of :data:`qkov_lib.studies.realmap.MAPS`, the base rate of each optimizer is tuned at ratio 1 on
validation (:func:`tune`, the map's own rule, :func:`qkov_lib.protocol.select_base_rates`; or given), then the
tuned rate is trained at ratios 1, 10, 100 and several seeds twice: the **default arm** (the dataset chapter's
settings) and, one choice at a time, an **ablated arm** (:data:`ABLATIONS`):

* ``readout``: the relative readout ``W_OV sum_i (alpha_i - u_i) v_i`` against plain ``alpha`` (where a dataset
  reads relative to uniform attention: SQuAD, SVA);
* ``ov_init``: ``W_OV`` started at the identity (the copy start) against the small random start (SQuAD);
* ``budget``: ``steps_factor`` times the steps with no early stopping, read at the end (and at matched
  validation loss, as every arm);
* ``evaluation``: the default models measured on ``eval_rows`` evenly spaced test instances against the whole
  test split (every metric, sufficiency included; nothing retrained);
* ``natural``: SVA on Linzen's natural prefixes (R1 only: no subject index) against the templates.

Every arm is a :func:`qkov_lib.studies.realmap.run_map` of a one-rate grid (so training, early stopping,
measuring and the verdicts are the map's own); :func:`delta_table` lists per dataset × optimizer × ratio the
change of AC@0.5 (R2) and of accuracy over every run (R1), ratio r against 1 paired by seed with the family
interval and cell outcome of :mod:`qkov_lib.claims` in each arm; :func:`verdict_changes` says, per choice,
whether any cell outcome differs between the arms and where; :func:`word_table` the R1-R3 words per arm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from qkov_lib import claims, protocol, rate_plane
from qkov_lib.figure_source import draws
from qkov_lib.data.batch import spread
from qkov_lib.profiles import profile_table
from qkov_lib.studies import attention_analysis, realmap


@dataclass(frozen=True)
class Ablation:
    """One choice of the protocol: ``default`` (what the book does), ``ablated`` (what the other arm does),
    ``keys`` (the map-config keys the arm changes, nothing else), ``retrain`` (False: the default models are
    measured again) and ``claims`` (the claims the arm can read)."""

    name: str
    default: str
    ablated: str
    keys: tuple[str, ...]
    retrain: bool = True
    claims: tuple[str, ...] = ("R1", "R2")


ABLATIONS: dict[str, Ablation] = {a.name: a for a in (
    Ablation("readout", "relative readout (α − u)", "plain readout (α)", ("relative",)),
    Ablation("ov_init", "W_OV starts at the identity (copy start)", "W_OV starts small and random", ("ov_init",)),
    Ablation("budget", "the chapter's steps, early stopping, best validation checkpoint",
             "more steps, no early stopping, read at the end", ("adamw_steps", "sgd_steps", "patience")),
    Ablation("evaluation", "every metric on the whole test split", "every metric on a subset of the test split",
             ("eval_rows",), retrain=False),
    Ablation("natural", "Marvin & Linzen template prefixes", "Linzen's natural prefixes (attractor sets)",
             ("data",), claims=("R1",)),
)}
CLAIM_IDS = ("R1", "R2")  # what the table reads: R1 = Δ accuracy (every run), R2 = Δ AC@0.5 (trained runs)
SETTLE_TOL = 0.01  # validation AC@0.5 has stopped moving: its range over the last SETTLE_WINDOW of the steps
SETTLE_WINDOW = 0.2
SETTLE_LOGS = 3  # ... over at least this many logged evaluations

COMMON = dict(datasets=["squad", "sva", "hatexplain"], ablations=list(ABLATIONS), optimizers=["adamw", "sgd"],
              ratios=[1.0, 10.0, 100.0], seeds=[0, 1, 2, 3], steps_factor=4, eval_rows=300, rates_given=None, processes=None)
PROFILES = profile_table(
    COMMON,
    # test: seconds (CI): SVA's test map, two seeds, AdamW at a given rate
    dict(datasets=["sva"], ablations=["readout", "budget", "evaluation"], optimizers=["adamw"], ratios=[1.0, 10.0],
         seeds=[0, 1], steps_factor=2, eval_rows=50, rates_given={"sva": {"adamw": 1e-2}}),
    # cpu: 10 minutes on 2 cores: AdamW at ratios 1 and 100. In the book each dataset's rate is the one its chapter
    # tuned in the same build (with_chapter_rates); these stand in when the page runs alone (the rates the cpu maps
    # chose in earlier builds: SQuAD AdamW 1e-3, SVA AdamW 1e-3). HateXplain and the natural prefixes in full
    dict(datasets=["squad", "sva"], ablations=["readout", "ov_init", "budget", "evaluation"], optimizers=["adamw"],
         ratios=[1.0, 100.0], rates_given={"squad": {"adamw": 1e-3}, "sva": {"adamw": 1e-3}}),
    # full (GPU): every dataset, ablation and optimizer, ratios 1, 10, 100, 8 seeds, rates tuned here
    dict(seeds=list(range(8))),
)


def check_ablation(name: str) -> Ablation:
    """The :class:`Ablation` called ``name``; a clear ValueError for an unknown one."""
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; the protocol's choices are {', '.join(ABLATIONS)}")
    return ABLATIONS[name]


def applies(name: str, dataset: str, mcfg: Mapping[str, Any]) -> bool:
    """Whether ablation ``name`` has something to undo on ``dataset`` under its map config ``mcfg``: a
    relative readout, a non-zero ``ov_init``, SVA's templates; the budget and the evaluation always."""
    check_ablation(name)
    realmap.check_dataset(dataset)
    return {"readout": bool(mcfg.get("relative")), "ov_init": float(mcfg.get("ov_init") or 0.0) != 0.0,
            "natural": dataset == "sva"}.get(name, True)


def default_config(mcfg: Mapping[str, Any]) -> dict[str, Any]:
    """The default arm's config: the map config with the keys the arms change made explicit (``eval_rows``
    None: the whole test split; ``data``: the chapter's own)."""
    return {**mcfg, "eval_rows": None, "data": "chapter"}


def arm_config(name: str, dataset: str, mcfg: Mapping[str, Any], steps_factor: int = 4,
               eval_rows: int = 300) -> dict[str, Any]:
    """The ablated arm's config: :func:`default_config` of ``mcfg`` with exactly the keys of ablation ``name``
    changed (``budget``: ``steps_factor`` times each optimizer's steps and no early stopping; ``evaluation``:
    ``eval_rows`` test instances). ValueError for an unknown ablation or dataset, or one that does not apply."""
    a = check_ablation(name)
    if not applies(name, dataset, mcfg):
        raise ValueError(f"ablation {name!r} does not apply to {dataset}: its protocol does not make that choice")
    if isinstance(steps_factor, bool) or not isinstance(steps_factor, int) or steps_factor < 1:
        raise ValueError(f"steps_factor must be an integer >= 1, got {steps_factor!r}")
    if isinstance(eval_rows, bool) or not isinstance(eval_rows, int) or eval_rows < 1:
        raise ValueError(f"eval_rows must be an integer >= 1, got {eval_rows!r}")
    cfg = default_config(mcfg)
    change = {"readout": {"relative": False}, "ov_init": {"ov_init": 0.0},
              "budget": {"adamw_steps": steps_factor * int(cfg["adamw_steps"]),
                         "sgd_steps": steps_factor * int(cfg["sgd_steps"]), "patience": None},
              "evaluation": {"eval_rows": eval_rows}, "natural": {"data": "natural"}}[name]
    assert set(change) == set(a.keys)
    return {**cfg, **change}


def check_study(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` (:data:`PROFILES` resolved by :func:`qkov_lib.profiles.resolve`) checked beyond types: known
    datasets and ablations, ratio 1 among the ratios, two seeds or more, ``steps_factor`` and ``eval_rows``
    integers >= 1, ``rates_given`` None or ``{dataset: {optimizer: rate > 0}}``; returns it."""
    for d in cfg["datasets"]:
        realmap.check_dataset(d)
    for a in cfg["ablations"]:
        check_ablation(a)
    if 1.0 not in [float(r) for r in cfg["ratios"]]:
        raise ValueError(f"the ratios must include 1 (the reference), got {cfg['ratios']}")
    if len(cfg["seeds"]) < 2:
        raise ValueError(f"an interval needs at least 2 seeds, got {cfg['seeds']}")
    for k in ("steps_factor", "eval_rows"):
        if isinstance(cfg[k], bool) or not isinstance(cfg[k], int) or cfg[k] < 1:
            raise ValueError(f"{k} must be an integer >= 1, got {cfg[k]!r}")
    rates = cfg["rates_given"]
    if rates is not None and not (isinstance(rates, Mapping) and all(
            isinstance(v, Mapping) and all(isinstance(e, (int, float)) and e > 0 for e in v.values())
            for v in rates.values())):
        raise ValueError(f"rates_given must be None or {{dataset: {{optimizer: rate > 0}}}}, got {rates!r}")
    return dict(cfg)


def with_chapter_rates(scfg: Mapping[str, Any], results_dir=None, keep_given: bool = False) -> dict[str, Any]:
    """``scfg`` with each dataset's base rates taken from its own chapter's results file
    (``<results_dir>/<dataset>.json``, None: :func:`qkov_lib.runtime.results_file`), where that file was
    written under the same profile and chose a rate for every optimizer of ``scfg``: the default arm then
    trains the rate the dataset chapter of the same build tuned. ``rates_source`` says, per dataset, where
    the rates come from: that file, ``"given"`` (``rates_given``: the profile's or the reader's) or
    ``"tuned here"``. ``keep_given``: the reader gave ``rates_given``, which then wins."""
    import json

    from qkov_lib.runtime import results_file

    out = dict(scfg)
    rates = {d: dict(v) for d, v in (scfg["rates_given"] or {}).items()}
    source = {d: ("given" if d in rates else "tuned here") for d in scfg["datasets"]}
    for d in scfg["datasets"]:
        if keep_given and d in rates:
            continue
        path = Path(results_dir) / f"{d}.json" if results_dir else results_file(d)
        try:
            doc = json.loads(path.read_text())
            same = doc["params"]["profile"] == scfg["profile"]
            chosen = {o: float(doc["metrics"]["map_selected"][o]) for o in scfg["optimizers"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if same:
            rates[d], source[d] = chosen, f"tuned by its chapter in this build ({path.name})"
    out["rates_given"] = rates or None
    out["rates_source"] = source
    return out


def study_config(profile: str | None, **overrides: Any) -> dict[str, Any]:
    """The chapter's settings: :data:`PROFILES` with ``overrides`` (None = the profile's), resolved and
    checked (:func:`check_study`)."""
    from qkov_lib.profiles import resolve

    return check_study(resolve(PROFILES, profile, **overrides))


def map_settings(dataset: str, scfg: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset's map config under the study's profile, at the study's optimizers (and ``processes``, when
    set: on a CPU, the one-thread processes the arms train in)."""
    return realmap.map_config(dataset, scfg["profile"], optimizers=list(scfg["optimizers"]),
                              processes=scfg.get("processes"))


# --- training the arms ------------------------------------------------------------------------------------
def tune(ds, val, mcfg: Mapping[str, Any], device: torch.device, seeds: Sequence[int]) -> dict[str, float]:
    """Each optimizer's tuned base rate: its rate grid trained at ratio 1 on ``seeds`` and chosen on validation
    by the map's rule (:func:`qkov_lib.protocol.select_base_rates` inside :func:`.realmap.run_map`)."""
    cfg = {**mcfg, "ratios": [1.0], "map_seeds": [int(s) for s in seeds], "protocol_seeds": None}
    return dict(realmap.run_map(ds, val, cfg, device, desc=f"{ds.name}: tuning at ratio 1").selected)


def one_rate_config(cfg: Mapping[str, Any], selected: Mapping[str, float], ratios: Sequence[float],
                    seeds: Sequence[int]) -> dict[str, Any]:
    """``cfg`` restricted to the tuned rate of each optimizer (``selected``) at ``ratios`` × ``seeds``, each
    optimizer keeping the step budget its rate has in the full grid (:func:`.realmap.run_steps`), its runs
    dealt into one stack per process."""
    opts = [o for o in cfg["optimizers"] if o in selected]
    out = {**cfg, "optimizers": opts, "ratios": [float(r) for r in ratios], "map_seeds": [int(s) for s in seeds],
           "protocol_seeds": None}
    for o in opts:
        out[f"{o}_rates"] = [float(selected[o])]
        out[f"{o}_steps"] = realmap.run_steps(cfg, o, float(selected[o]))
    per = max(1, int(cfg.get("processes") or 1) // max(1, len(opts)))
    out["max_stack"] = max(1, min(int(cfg.get("max_stack", 64)), -(-len(ratios) * len(seeds) // per)))
    return out


def train_arm(ds, val, cfg: Mapping[str, Any], selected: Mapping[str, float], ratios: Sequence[float],
              seeds: Sequence[int], device: torch.device, desc: str) -> realmap.MapResult:
    """One arm: :func:`.realmap.run_map` of :func:`one_rate_config` (R3 ``not tested`` under a copy readout,
    as the dataset chapters read it)."""
    cfg = one_rate_config(cfg, selected, ratios, seeds)
    res = realmap.run_map(ds, val, cfg, device, desc=desc)
    if cfg.get("readout") in realmap.COPY_READOUTS and "R3" in res.verdicts:
        res.verdicts["R3"] = realmap.not_testable_r3(res.verdicts["R3"], *realmap.attention_by_correctness(res, ds.test))
    return res


def remeasure(res: realmap.MapResult, test, rows: int | None, n_eraser: int) -> realmap.MapResult:
    """The default arm's models measured again on ``rows`` evenly spaced test instances (None: all of them),
    every metric there, sufficiency too (on at most ``n_eraser`` of them), and the map's analysis redone on
    that table (validation numbers, and so the chosen rates and R3, unchanged)."""
    sub = test if rows is None or rows >= len(test) else test.index(spread(len(test), rows))
    t = res.table.copy()
    for i, r in t.iterrows():
        m = res.models.get(protocol.Cell(r["optimizer"], r["eta_ov"], r["ratio"], int(r["seed"])))
        if m is None:
            continue
        dev = next(m.parameters()).device
        for k, v in realmap.measure(m, sub.to(dev), min(n_eraser, len(sub))).items():
            t.at[i, k] = v
    cols = [c for c in t.columns if c not in ("trained", "eta_qk")]
    out = realmap.analyse(t[cols], res.chance, histories=res.histories, selected=res.selected)
    out.models, out.val = res.models, res.val
    if "R3" in res.verdicts:
        out.verdicts["R3"] = res.verdicts["R3"]
    return out


def natural_arm(ncfg: Mapping[str, Any], selected: Mapping[str, float], ratios: Sequence[float],
                seeds: Sequence[int], data_dir, device: torch.device) -> pd.DataFrame:
    """SVA's natural-prefix models (:func:`.agreement_roles.natural_grid`, AdamW at its tuned template rate when
    there is one) at ``ratios`` × ``seeds``: one row per run and number of attractors."""
    from qkov_lib.studies import agreement_roles

    cfg = {**ncfg, "ratios": [float(r) for r in ratios], "seeds": [int(s) for s in seeds]}
    if "adamw" in selected:
        cfg["eta_ov"] = float(selected["adamw"])
    return agreement_roles.natural_grid(agreement_roles.load_natural(cfg, data_dir), cfg, device)


# --- reading the arms -----------------------------------------------------------------------------------
TABLE_COLUMNS = ["dataset", "ablation", "optimizer", "ratio", "claim", "default", "default outcome", "ablated",
                 "ablated outcome", "changes", "trained (default)", "trained (ablated)"]


def trained_counts(res: realmap.MapResult) -> dict[tuple[str, float], str]:
    """Per ``(optimizer, ratio)`` of an arm, how many of its runs trained (``"3/4"``): the control beside a
    cell whose change is read over every run (R1), where "no change" can mean that nothing learned."""
    return {(o, float(r)): f"{int(g['trained'].sum())}/{len(g)}"
            for (o, r), g in res.table.groupby(["optimizer", "ratio"], sort=False)}


def arm_readings(cells: pd.DataFrame, claim: str) -> dict[tuple[str, float], claims.Reading]:
    """The ``qk_up`` cells of ``claim`` in an arm's :func:`.rate_plane.protocol_cells`, read by the one rule
    (:func:`qkov_lib.claims.read_cells`: Bonferroni over the claim's cells of the arm), keyed by
    ``(optimizer, ratio)``."""
    if not len(cells):
        return {}
    g = cells[(cells["route"] == "qk_up") & (cells["claim"] == claim)]
    keys = list(zip(g["optimizer"], g["ratio"].astype(float)))
    changes = {k: (claims.Change(m, h if math.isfinite(h) else math.nan, int(n)) if math.isfinite(m) else None)
               for k, m, h, n in zip(keys, g["mean"].astype(float), g["hw"].astype(float), g["n"].fillna(0))}
    read = claims.read_cells({f"{o} {r:g}": c for (o, r), c in changes.items()}, claims.ESTIMANDS[claim])
    return dict(zip(changes, read))


def natural_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """:func:`natural_arm`'s R1 changes as protocol cells (AdamW, accuracy over every attractor prefix, ratio r
    against 1 paired by seed), in the columns :func:`arm_readings` reads."""
    acc = frame[frame["n_attractors"] == "all"].pivot(index="seed", columns="ratio", values="accuracy")
    rows = []
    for r in sorted(acc.columns):
        if float(r) == 1.0 or 1.0 not in acc.columns:
            continue
        c = claims.Change.of((acc[r] - acc[1.0]).to_numpy(dtype=float))
        rows.append({"claim": "R1", "route": "qk_up", "optimizer": "adamw", "ratio": float(r), "mean": c.mean,
                     "hw": c.half_width, "n": c.n})
    return pd.DataFrame(rows, columns=["claim", "route", "optimizer", "ratio", "mean", "hw", "n"])


def delta_rows(dataset: str, ablation: str, default: pd.DataFrame, ablated: pd.DataFrame,
               trained: tuple[Mapping, Mapping] | None = None) -> list[dict[str, Any]]:
    """Rows of :func:`delta_table` for one dataset and ablation from the two arms' protocol cells: per
    optimizer, ratio above 1 and claim it reads (:data:`CLAIM_IDS`), each arm's change with its family
    interval (``+0.051 ± 0.020 (n = 4)``, a fraction) and cell outcome, and whether the outcomes differ.
    ``trained``: the two arms' :func:`trained_counts`, shown as ``"ratio 1: 4/4, ratio 100: 1/4"``."""

    def shown(counts: Mapping | None, opt: str, r: float) -> str:
        if counts is None:
            return "-"
        return f"ratio 1: {counts.get((opt, 1.0), '-')}, ratio {r:g}: {counts.get((opt, r), '-')}"

    a = check_ablation(ablation)
    rows = []
    for cid in CLAIM_IDS:
        if cid not in a.claims:
            continue
        d, b = arm_readings(default, cid), arm_readings(ablated, cid)
        for key in sorted(set(d) | set(b)):
            rd, rb = d.get(key), b.get(key)
            od, ob = (rd.outcome if rd else "not measured"), (rb.outcome if rb else "not measured")
            rows.append({"dataset": dataset, "ablation": ablation, "optimizer": key[0], "ratio": key[1], "claim": cid,
                         "default": rd.text() if rd else "not measured", "default outcome": od,
                         "ablated": rb.text() if rb else "not measured", "ablated outcome": ob,
                         "changes": od != ob and "not measured" not in (od, ob),
                         "trained (default)": shown(trained[0] if trained else None, *key),
                         "trained (ablated)": shown(trained[1] if trained else None, *key)})
    return rows


def delta_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The rows of :func:`delta_rows` as one table (:data:`TABLE_COLUMNS`)."""
    return pd.DataFrame(list(rows), columns=TABLE_COLUMNS)


def _where(g: pd.DataFrame) -> str:
    return "; ".join(f"{ds}, {rate_plane.optimizer_name(o)}, ratio {r:g} ({c}: {a} → {b})" for ds, o, r, c, a, b in
                     zip(g["dataset"], g["optimizer"], g["ratio"], g["claim"], g["default outcome"],
                         g["ablated outcome"]))


def verdict_changes(table: pd.DataFrame, ablations: Sequence[str] | None = None) -> dict[str, str]:
    """Per ablation, one sentence from :func:`delta_table`: whether undoing the choice ``changes the answer``
    (some cell's outcome, holds / contradicted / undecided, differs between the arms; named with both
    outcomes) or ``does not`` (over how many cells), or that no cell was measured in both arms."""
    names = list(ablations) if ablations is not None else list(dict.fromkeys(table["ablation"]))
    out = {}
    for name in names:
        a = check_ablation(name)
        g = table[table["ablation"] == name]
        both = g[(g["default outcome"] != "not measured") & (g["ablated outcome"] != "not measured")]
        head = f"{a.default} against {a.ablated}"
        if not len(both):
            out[name] = f"{head}: not measured (no cell read in both arms)"
        elif both["changes"].any():
            ch = both[both["changes"]]
            out[name] = f"{head}: changes the answer in {len(ch)} of {len(both)} cells, at {_where(ch)}"
        else:
            out[name] = f"{head}: does not change the answer (the same outcome in all {len(both)} cells)"
    return out


def word_rows(dataset: str, arm: str, verdicts: Mapping[str, claims.Verdict]) -> list[dict[str, str]]:
    """One row per claim of an arm's words (R1-R3 over its protocol cells, the one rule)."""
    return [{"dataset": dataset, "arm": arm, "claim": cid, "word": v.verdict} for cid, v in verdicts.items()]


def word_changes(words: pd.DataFrame) -> pd.DataFrame:
    """Per dataset, ablated arm and claim: the default arm's word, the ablated arm's and whether they differ
    (from :func:`word_rows` of every arm; the default arm is called ``default``)."""
    d = words[words["arm"] == "default"].set_index(["dataset", "claim"])["word"]
    rows = []
    for _, r in words[words["arm"] != "default"].iterrows():
        base = d.get((r["dataset"], r["claim"]))
        if base is None:
            continue
        rows.append({"dataset": r["dataset"], "ablation": r["arm"], "claim": r["claim"], "default word": base,
                     "ablated word": r["word"], "changes": base != r["word"]})
    return pd.DataFrame(rows, columns=["dataset", "ablation", "claim", "default word", "ablated word", "changes"])


def word_sentence(changes: pd.DataFrame) -> str:
    """Which ablations change a real-data word (:func:`word_changes`), in one sentence."""
    ch = changes[changes["changes"]] if len(changes) else changes
    if not len(changes):
        return "no ablated arm was read"
    if not len(ch):
        return f"none: every word of the {len(changes)} (dataset, ablation, claim) readings is the default arm's"
    return "; ".join(f"{ABLATIONS[a].ablated} on {d}: {c} {w0} → {w1}" for d, a, c, w0, w1 in
                     zip(ch["dataset"], ch["ablation"], ch["claim"], ch["default word"], ch["ablated word"]))


# --- has the attention stopped moving? --------------------------------------------------------------------
def settle_step(steps: Sequence[float], values: Sequence[float], tol: float = SETTLE_TOL,
                window: float = SETTLE_WINDOW, min_logs: int = SETTLE_LOGS) -> float:
    """The first logged step ``s`` at which ``values`` (e.g. validation AC@0.5, a fraction, logged at ``steps``)
    varied by less than ``tol`` (max − min) over the logs in ``[(1 - window) s, s]``, at least ``min_logs`` of
    them; NaN when that never happens (the cap was reached while it still moved)."""
    s, v = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    if s.shape != v.shape or s.ndim != 1:
        raise ValueError(f"steps and values must be 1-d of one length, got {s.shape} and {v.shape}")
    order = np.argsort(s)
    s, v = s[order], v[order]
    for i, t in enumerate(s):
        w = v[(s >= (1 - window) * t) & (s <= t)]
        w = w[np.isfinite(w)]
        if len(w) >= min_logs and float(w.max() - w.min()) < tol:
            return float(t)
    return math.nan


def settle_table(curves: pd.DataFrame, budget: Mapping[str, int], metric: str = "val_AC@0.5",
                 tol: float = SETTLE_TOL) -> pd.DataFrame:
    """Per run of :func:`.trajectory.curves`: its last logged step, the step its ``metric`` stopped moving
    (:func:`settle_step`; NaN: the cap was reached first), ``metric`` there and at the end, and the step cap
    (``budget[optimizer]``)."""
    rows = []
    for (o, e, r, s), g in curves.groupby(["optimizer", "eta_ov", "ratio", "seed"]):
        st = settle_step(g["step"], g[metric], tol)
        at = g[g["step"] == st][metric] if math.isfinite(st) else None
        rows.append({"optimizer": o, "eta_ov": e, "ratio": r, "seed": s, "cap": int(budget.get(o, -1)),
                     "settled at": st, f"{metric} there": float(at.iloc[0]) if at is not None else math.nan,
                     f"{metric} at the end": float(g.sort_values("step")[metric].iloc[-1])})
    return pd.DataFrame(rows)


def settle_text(table: pd.DataFrame, tol: float = SETTLE_TOL) -> str:
    """:func:`settle_table` in a sentence: per ratio how many runs settled and at which steps, how many
    reached the cap."""
    if not len(table):
        return "no run"
    parts = []
    for (o, r), g in table.groupby(["optimizer", "ratio"]):
        done = g["settled at"].dropna().astype(int).tolist()
        parts.append(f"{rate_plane.optimizer_name(o)} ratio {r:g}: " + (
            f"{len(done)} of {len(g)} settled (steps {', '.join(map(str, sorted(done)))})" if done else
            f"none of {len(g)} settled") + (f", {len(g) - len(done)} reached the cap of {int(g['cap'].iloc[0])}"
                                            if len(done) < len(g) else ""))
    return "; ".join(parts)


@draws
def plot_settle(curves: pd.DataFrame, settle: pd.DataFrame, metric: str = "val_AC@0.5"):
    """``metric`` over training steps of every run (one panel per optimizer, one colour per ratio, one line per
    seed), a dot where each run stopped moving (:func:`settle_table`). White face; returns the figure."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from qkov_lib.plotting import FACE, setup

    setup()
    opts = list(dict.fromkeys(curves["optimizer"]))
    ratios = sorted(set(curves["ratio"].astype(float)))
    colour = dict(zip(ratios, sns.color_palette("viridis", len(ratios))))
    fig, axes = plt.subplots(1, len(opts), figsize=(4.6 * len(opts) + 1.2, 3.3), squeeze=False, facecolor=FACE,
                             sharey=True)
    for ax, o in zip(axes[0], opts):
        for (r, s), g in curves[curves["optimizer"] == o].groupby(["ratio", "seed"]):
            g = g.sort_values("step")
            ax.plot(g["step"], g[metric], color=colour[float(r)], lw=1.0, alpha=0.8)
            at = settle[(settle["optimizer"] == o) & (settle["ratio"] == r) & (settle["seed"] == s)]
            if len(at) and math.isfinite(float(at["settled at"].iloc[0])):
                ax.plot(at["settled at"], at[f"{metric} there"], "o", color=colour[float(r)], ms=5)
        ax.set_title(rate_plane.optimizer_name(o), fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"validation {metric.removeprefix('val_')}")
    from matplotlib.lines import Line2D

    axes[0, -1].legend(handles=[Line2D([], [], color=colour[r], lw=2, label=f"{r:g}") for r in ratios],
                       title="eta_QK / eta_OV", loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


# --- the whole study ------------------------------------------------------------------------------------
@dataclass
class StudyResult:
    """Everything :func:`run_study` measured: ``table`` (:func:`delta_table`), ``sentences``
    (:func:`verdict_changes`), ``words`` (:func:`word_rows` of every arm), ``selected`` (per dataset the base
    rates used), ``tuned`` (per dataset whether they were tuned here), ``arms`` (dataset -> arm -> MapResult),
    ``natural`` (SVA's natural-prefix frame) and ``settle`` (dataset -> :func:`settle_table` of its budget arm),
    ``curves`` (dataset -> the budget arm's :func:`.trajectory.curves`), ``sources`` (per dataset where its
    rates came from, :func:`with_chapter_rates`)."""

    table: pd.DataFrame
    sentences: dict[str, str]
    words: pd.DataFrame
    selected: dict[str, dict[str, float]]
    tuned: dict[str, bool]
    arms: dict[str, dict[str, realmap.MapResult]]
    natural: pd.DataFrame | None
    settle: dict[str, pd.DataFrame]
    curves: dict[str, pd.DataFrame]
    datasets: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)


def run_study(scfg: Mapping[str, Any], data_dir=None, device: torch.device | None = None) -> StudyResult:
    """For each dataset of ``scfg``: load the map's splits, tune (or take) the base rates, train the default arm
    and each ablated arm that applies (:func:`arm_config`), and read them (:func:`delta_rows`,
    :func:`word_rows`); then :func:`verdict_changes`."""
    from qkov_lib.studies import trajectory

    device = device or torch.device("cpu")
    rows, words, selected_all, tuned, arms, settle, curves, datasets = [], [], {}, {}, {}, {}, {}, {}
    natural = None
    for name in scfg["datasets"]:
        mcfg = map_settings(name, scfg)
        ds, val = realmap.load_splits(name, mcfg, data_dir)
        datasets[name] = ds
        given = (scfg["rates_given"] or {}).get(name)
        tuned[name] = given is None
        selected = ({o: float(e) for o, e in given.items() if o in mcfg["optimizers"]} if given is not None else
                    tune(ds, val, mcfg, device, scfg["seeds"]))
        selected_all[name] = selected
        base = default_config(mcfg)
        runs = {"default": train_arm(ds, val, base, selected, scfg["ratios"], scfg["seeds"], device,
                                     f"{name}: default arm")}
        words += word_rows(name, "default", runs["default"].verdicts)
        for ab in scfg["ablations"]:
            if not applies(ab, name, mcfg):
                continue
            cfg = arm_config(ab, name, mcfg, int(scfg["steps_factor"]), int(scfg["eval_rows"]))
            if ab == "evaluation":
                full = remeasure(runs["default"], ds.test, None, len(ds.test))
                runs["evaluation (whole split)"] = full
                arm = remeasure(runs["default"], ds.test, cfg["eval_rows"], cfg["n_eraser"])
                both = trained_counts(runs["default"])
                rows += delta_rows(name, ab, full.protocol, arm.protocol, (both, both))
            elif ab == "natural":
                from qkov_lib.profiles import resolve
                from qkov_lib.studies import agreement_roles

                ncfg = resolve(agreement_roles.NATURAL_PROFILES, scfg["profile"])
                natural = natural_arm(ncfg, selected, scfg["ratios"], scfg["seeds"], data_dir, device)
                rows += delta_rows(name, ab, runs["default"].protocol, natural_cells(natural))
                words += [{"dataset": name, "arm": ab, "claim": "R1",
                           "word": agreement_roles.natural_r1(natural).verdict}]
                continue
            else:
                arm = train_arm(ds, val, cfg, selected, scfg["ratios"], scfg["seeds"], device, f"{name}: {ab} arm")
                rows += delta_rows(name, ab, runs["default"].protocol, arm.protocol,
                                   (trained_counts(runs["default"]), trained_counts(arm)))
            runs[ab] = arm
            words += word_rows(name, ab, arm.verdicts)
            if ab == "budget" and arm.histories:
                curves[name] = trajectory.curves(arm.histories)
                settle[name] = settle_table(curves[name], {o: cfg[f"{o}_steps"] for o in selected})
        arms[name] = runs
    table = delta_table(rows)
    return StudyResult(table, verdict_changes(table, [a for a in scfg["ablations"] if (table["ablation"] == a).any()]),
                       pd.DataFrame(words, columns=["dataset", "arm", "claim", "word"]), selected_all, tuned, arms,
                       natural, settle, curves, datasets, dict(scfg.get("rates_source") or {}))


def word_frame(words: pd.DataFrame) -> pd.DataFrame:
    """The words as a reader's table: one row per (dataset, arm), one column per claim."""
    if not len(words):
        return pd.DataFrame()
    return words.pivot_table(index=["dataset", "arm"], columns="claim", values="word", aggfunc="first", sort=False)


def record(res: StudyResult) -> dict[str, Any]:
    """The study's part of the results file (JSON-ready)."""
    return {"ablation_table": res.table.to_dict("records"), "sentences": dict(res.sentences),
            "words": res.words.to_dict("records"), "word_changes": word_changes(res.words).to_dict("records"),
            "selected": res.selected, "tuned_here": res.tuned,
            "protocol_cells": {f"{d}/{a}": r.protocol.to_dict("records") for d, arms in res.arms.items()
                               for a, r in arms.items()},
            "settle": {d: t.to_dict("records") for d, t in res.settle.items()},
            "budget_curves": {d: c.to_dict("records") for d, c in res.curves.items()},
            "natural": None if res.natural is None else res.natural.to_dict("records")}


# --- cost, and what the chapter quotes ----------------------------------------------------------------------
def rates_frame(res: StudyResult) -> pd.DataFrame:
    """Per dataset and optimizer the base rate every arm trains, and whether this build tuned it."""
    return pd.DataFrame([{"dataset": d, "optimizer": o, "eta_ov": e,
                          "source": res.sources.get(d, "tuned here" if res.tuned[d] else "given")}
                         for d, sel in res.selected.items() for o, e in sel.items()])


def _list(xs: Sequence[str]) -> str:
    xs = list(xs)
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1] if xs else "none"


def chapter_facts(res: StudyResult, scfg: Mapping[str, Any]) -> dict[str, str]:
    """What the chapter glues (prefix ``pc_``): one sentence per choice (:func:`verdict_changes`; a choice
    not run says where it would apply), the words an ablation changes, the budget arm's settling steps,
    the sizes and rules it quotes and R3 on SQuAD."""
    names = attention_analysis.DATASET_NAMES
    def not_run(a: str) -> str:
        where = [names[d] for d in realmap.DATASETS if applies(a, d, realmap.map_config(d, scfg["profile"]))]
        return f"not run in this profile (the full profile runs it; it applies to {_list(where)})"

    f = {f"pc_{a}": res.sentences[a] if a in res.sentences else not_run(a) for a in ABLATIONS}
    f["pc_datasets"] = (f"{_list([names.get(d, d) for d in scfg['datasets']])}, "
                        f"{_list([rate_plane.optimizer_name(o) for o in scfg['optimizers']])}, ratios "
                        f"{', '.join(f'{r:g}' for r in scfg['ratios'])}, {len(scfg['seeds'])} seeds")
    f["pc_scope"] = f["pc_datasets"] + " and the choices " + _list(list(scfg["ablations"]))
    full = PROFILES["full"]
    f["pc_full_scope"] = (f"{_list([names.get(d, d) for d in full['datasets']])}, "
                          f"{_list([rate_plane.optimizer_name(o) for o in full['optimizers']])}, {len(full['ratios'])} ratios from "
                          f"{min(full['ratios']):g} to {max(full['ratios']):g}, {len(full['seeds'])} seeds")
    f["pc_words"] = word_sentence(word_changes(res.words))
    f["pc_settle_factor"] = str(scfg["steps_factor"])
    f["pc_eval_rows"] = f"{scfg['eval_rows']:,}"
    f["pc_settle_tol"], f["pc_settle_window"] = f"{SETTLE_TOL:g}", f"{100 * SETTLE_WINDOW:g} %"
    f["pc_settle_logs"] = str(SETTLE_LOGS)
    f["pc_settle_squad"] = (settle_text(res.settle["squad"]) if "squad" in res.settle else
                            "not run in this build (the budget arm on SQuAD is not among its settings)")
    f["pc_settle_all"] = "; ".join(f"{names.get(d, d)}: {settle_text(t)}" for d, t in res.settle.items()) or "no budget arm"
    f["pc_eval_every"] = ", ".join(f"{names.get(d, d)} {realmap.map_config(d, scfg['profile'])['eval_every']}"
                                   for d in res.settle) or "-"
    f["pc_rates_source"] = "; ".join(f"{names.get(d, d)}: " + res.sources.get(d, "tuned here" if res.tuned[d] else "given")
                                     + " (" + ", ".join(f"{rate_plane.optimizer_name(o)} {e:g}" for o, e in sel.items())
                                     + ")" for d, sel in res.selected.items())
    sq = res.arms.get("squad", {}).get("default")
    f["pc_squad_r3"] = (sq.verdicts["R3"].reason if sq is not None and "R3" in sq.verdicts else
                        "SQuAD is not among this build's datasets")
    return f


__all__ = ["ABLATIONS", "Ablation", "PROFILES", "StudyResult", "applies", "arm_config", "arm_readings",
           "check_ablation", "default_config", "delta_rows", "delta_table", "map_settings", "natural_cells",
           "one_rate_config", "plot_settle", "record", "remeasure", "run_study", "settle_step", "settle_table",
           "settle_text", "study_config", "check_study", "work", "rates_frame", "chapter_facts", "train_arm", "tune", "verdict_changes", "word_changes", "word_frame",
           "word_rows", "word_sentence"]
