"""The (eta_QK, eta_OV) plane of a real-data map: where each claim holds, cell by cell.

A protocol map (:mod:`qkov_lib.protocol`) trains every optimizer at base rates ``eta_ov`` times
ratios ``r``, so each run sits at a point ``(eta_OV, eta_QK) = (eta_ov, r * eta_ov)`` of the
plane. A ratio can be reached two ways, and a reader must see which one an effect follows:

* ``qk_up``: raise ``eta_QK`` at fixed ``eta_OV`` (against the ratio-1 run at the same ``eta_OV``);
* ``ov_down``: lower ``eta_OV`` at fixed ``eta_QK`` (against the ratio-1 run at ``eta_OV = eta_QK``).

With base rates spaced by the ratio step (e.g. decades and ratios 1, 10, 100) one grid gives both
routes. :func:`plane_phase` gives the paired seed changes of every cell along both routes (the
trained-pair view and the all-runs view); :func:`cell_outcomes` applies the R1-R3 rules of
:mod:`qkov_lib.claims` to every cell, with two outcomes of its own: a reference that trained on
fewer than :data:`qkov_lib.claims.MIN_SEEDS` seeds leaves the cell inconclusive, and a cell that
trains where its ratio-1 reference never did is "rescued by the higher ratio".
:func:`qk_ceiling` is the largest base rate at which plain training (ratio 1) is stable;
:func:`plane_verdicts` decides each claim over the cells whose ``eta_QK`` stays below it (the
cells past it are listed apart), and :func:`tied_rates` / :func:`tuned_line` give the tuned-rate
reading, which must hold at every base rate tied with the tuned one. :func:`plot_plane` draws a
metric's changes in absolute coordinates with the iso-ratio diagonals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from qkov_lib import claims, protocol
from qkov_lib.metrics import seed_half_width

ROUTES = {"qk_up": "eta_QK raised at fixed eta_OV", "ov_down": "eta_OV lowered at fixed eta_QK"}
ROUTE_MARK = {"qk_up": "↑", "ov_down": "←"}  # the move in the plane (x = eta_OV, y = eta_QK)
ALL_RUN_METRICS = ("accuracy", "macro_f1", "AC@0.5", "attn_relevant")  # the all-runs view
CLAIM_EFFECT = {"R1": "d_all_accuracy", "R2": "d_AC@0.5", "R3": "d_attn_relevant"}  # the effect each region quotes
MATCHED = "m_val_"  # prefix of the plane's changes at matched validation loss (:func:`add_matched`)
OUTCOMES = ("reproduced", "holds where", "not reproduced", "inconclusive", "rescued", "not tested")


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


def _ref_trained(phase: pd.DataFrame) -> dict[tuple[str, float], int]:
    """Trained runs at ratio 1 per (optimizer, base rate)."""
    ref = phase[(phase["route"] == "qk_up") & (phase["ratio"] == 1.0)]
    return {(o, rate(e)): int(n) for o, e, n in zip(ref["optimizer"], ref["eta_ov"], ref["trained_runs"])}


def cell_outcomes(phase: pd.DataFrame, necessary: Mapping[tuple[str, float], bool | None] | None = None,
                  budgets: Mapping[tuple[str, float], int] | None = None) -> pd.DataFrame:
    """R1-R3 in every cell above ratio 1 of :func:`plane_phase`, against its route's reference:
    R1 on the all-runs changes of accuracy and macro-F1, R2 on AC@0.5, ACMC@0.5 and sufficiency
    (test split, early-stopped endpoints), R3 on attention and accuracy at matched validation loss
    where :func:`add_matched` gave them (``read_at`` says which), else at the endpoints (not tested
    where ``necessary[(optimizer, ref_eta_ov)]`` is False), each by its rule in
    :mod:`qkov_lib.claims` at that one ratio. Then the reference
    decides what the cell can say: fewer than ``MIN_SEEDS`` trained seeds at ratio 1 and at
    least ``MIN_SEEDS`` (and more) in the cell is ``rescued`` (training rescued by the higher
    ratio; verdict 'not tested': too few reference models to pair with), no trained run at ratio
    1 and fewer than ``MIN_SEEDS`` in the cell 'not tested', and otherwise a
    reference with fewer than ``MIN_SEEDS`` trained seeds 'inconclusive' (or ``rescued`` when the
    cell has at least ``MIN_SEEDS`` and more than its reference). ``budgets`` (step budget per
    (optimizer, eta_ov)): on the fixed-eta_QK route a cell whose runs had no more steps than its
    reference's, at a slower eta_OV, is 'not tested' on R1 and R2 (their endpoints are not at
    comparable training; R3, read at matched loss, still is). One row per (route,
    optimizer, eta_ov, eta_qk, ratio, claim) with ``verdict``, ``outcome`` (the verdict, or
    ``rescued``), ``effect`` (the claim's :data:`CLAIM_EFFECT` change, a fraction), its
    half-width ``effect_ci``, ``reason``, ``trained``, ``ref_trained``, ``pairs`` (the fewest seed
    pairs among the changes the claim's rule read) and the all-runs change of
    AC@0.5 (every run, trained or not: ``all_AC``, ``all_AC_ci``)."""
    refs = _ref_trained(phase)
    rows = []
    for _, p in phase[phase["ratio"] > 1.0].iterrows():
        key = (p["optimizer"], rate(p["ref_eta_ov"]))
        n_ref, n = refs.get(key, 0), int(p["trained_runs"])
        ch = lambda k: protocol._change(p, k)  # noqa: E731
        need = (necessary or {}).get(key)
        r = [float(p["ratio"])]
        # R3 at matched validation loss where the curves allow it (the paper compares attention "at a
        # similar training loss"), else between the early-stopped endpoints on the test split
        m_att = ch(MATCHED + "attn_relevant")
        matched = m_att is not None and m_att.n > 0 and math.isfinite(m_att.mean)
        att, acc = (MATCHED + "attn_relevant", MATCHED + "accuracy") if matched else ("d_attn_relevant", "d_accuracy")
        vs = {"R1": claims.r1_performance_stable([ch("d_all_accuracy")], [ch("d_all_macro_f1")], ratios=r),
              "R2": claims.r2_interpretability(ch("d_AC@0.5"), ch("d_ACMC@0.5"), ch("d_sufficiency")),
              "R3": claims.r3_decoupled([ch(att)], [ch(acc)], necessary=None if need is None else bool(need),
                                        ratios=r)}
        r3_at = f"matched val loss {float(p['m_level']):.3f}" if matched else "early-stopped endpoints (test)"
        steps = (budgets or {}).get((p["optimizer"], rate(p["eta_ov"]))), (budgets or {}).get(key)
        steps = steps if None not in steps else (None, None)
        used = {"R1": ("d_all_accuracy", "d_all_macro_f1"), "R2": ("d_AC@0.5", "d_ACMC@0.5", "d_sufficiency"),
                "R3": (att, acc)}
        for cid, v in vs.items():
            word, outcome, reason = v.verdict, v.verdict, v.reason
            if n_ref < claims.MIN_SEEDS and n >= claims.MIN_SEEDS and n > n_ref:
                word, outcome = "not tested", "rescued"
                reason = (f"{n_ref} seed(s) trained at ratio 1, {n} at ratio {p['ratio']:g}: training rescued by "
                          "the higher ratio")
            elif n_ref == 0:
                word = outcome = "not tested"
                reason = f"no seed trained at ratio 1; {n} at ratio {p['ratio']:g}"
            elif n_ref < claims.MIN_SEEDS:
                word = outcome = "inconclusive"
                reason = f"{n_ref} seed(s) trained at ratio 1 (a comparison needs {claims.MIN_SEEDS}); {v.reason}"
            elif cid != "R3" and p["route"] == "ov_down" and steps[1] is not None and steps[0] <= steps[1]:
                word = outcome = "not tested"
                reason = (f"eta_OV {rate(p['eta_ov']):g} trained for {steps[0]} steps, no more than its reference at "
                          f"{key[1]:g} ({steps[1]}): the slower run's endpoint is not at comparable training")
            col = att if cid == "R3" else CLAIM_EFFECT[cid]
            rows.append({"read_at": r3_at if cid == "R3" else "early-stopped endpoints (test)", "route": p["route"], "optimizer": p["optimizer"], "eta_ov": rate(p["eta_ov"]),
                         "eta_qk": rate(p["eta_qk"]), "ratio": float(p["ratio"]), "ref_eta_ov": key[1],
                         "claim": cid, "verdict": word, "outcome": outcome,
                         "effect": float(p.get(col, math.nan)), "effect_ci": float(p.get(f"{col}_ci", math.nan)),
                         "reason": reason, "contradicts": _contradicts(cid, word, ch), "trained": n, "ref_trained": n_ref,
                         "pairs": min((c.n for c in map(ch, used[cid]) if c is not None), default=0),
                         "all_AC": float(p.get("d_all_AC@0.5", math.nan)),
                         "all_AC_ci": float(p.get("d_all_AC@0.5_ci", math.nan))})
    return pd.DataFrame(rows)


def _contradicts(cid: str, word: str, ch: Callable[[str], claims.Change | None]) -> bool:
    """Whether a cell's outcome ``word`` for claim ``cid`` counts against the claim on the plane: 'not
    reproduced', or R2 holding in part (some of its measures) while another measure stays short of its
    margin over its whole interval; a part hold whose other measures straddle their margins is undecided.
    ``ch(key)``: the cell's paired change of a plane column (as :func:`cell_outcomes` reads it)."""
    if word == "not reproduced":
        return True
    return cid == "R2" and word == "holds where" and claims.r2_contradicted(ch("d_AC@0.5"), ch("d_ACMC@0.5"),
                                                                             ch("d_sufficiency"))


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


PLANE_RULE = ("each cell above ratio 1 is compared with the ratio-1 run of its route (same eta_OV for ↑, same "
              "eta_QK for ←), paired by seed, by the claim's own rule (R3 at the deepest validation loss both runs "
              "of each pair reached, where the training curves allow; on ← R1 and R2, read at the endpoints, only where "
              "the slower eta_OV had more steps than its reference); only cells whose eta_QK stays at or below the "
              "largest base rate at which ratio-1 training was stable count; a word needs a region: at least "
              f"{claims.threshold_text('MIN_REGION_CELLS')} points of the plane that agree (one point, by either "
              "route, is a near-tie that another seed set can turn), and it must stand when any one seed is left out "
              "(else inconclusive: one seed decides it); reproduced: it holds in every cell compared, and they are a region; holds where: "
              "in a region of some (named, as (eta_OV, eta_QK)); not reproduced: it holds in no region and a region "
              "contradicts it (or held there only in part: some of its measures, another one short of its margin); "
              "inconclusive: otherwise (no region decided; a cell where some measures held and the others straddle "
              "their margins decides nothing); not tested: no cell compared (a reference with fewer than "
              f"{claims.MIN_SEEDS} trained seeds is inconclusive; a cell that trains where its reference never did "
              "is counted as rescued, not compared)")


def _cells(g: pd.DataFrame) -> str:
    return ", ".join(f"{o} {cell_name(r)}" for o, r in ((r["optimizer"], r) for _, r in g.iterrows())) or "none"


def _effect(g: pd.DataFrame, cid: str) -> str:
    """The range of the claim's effect over cells ``g`` with the interval at each end."""
    g = g[np.isfinite(g["effect"])]
    if not len(g):
        return ""
    lo, hi = g.loc[g["effect"].idxmin()], g.loc[g["effect"].idxmax()]
    name = CLAIM_EFFECT[cid].removeprefix("d_all_").removeprefix("d_")

    def one(r) -> str:
        ci = f" ± {r['effect_ci']:.3f}" if math.isfinite(r["effect_ci"]) else ""
        return f"{r['effect']:+.3f}{ci} at {r['optimizer']} {cell_name(r)}"

    return f"Δ {name} from {one(lo)} to {one(hi)}" if len(g) > 1 else f"Δ {name} {one(lo)}"


def _points(cells: pd.DataFrame) -> int:
    """Distinct points (optimizer, eta_OV, eta_QK) among ``cells``."""
    return len(set(zip(cells["optimizer"], cells["eta_ov"], cells["eta_qk"])))


def plane_verdicts(outcomes: pd.DataFrame, ceiling: Mapping[str, float]) -> dict[str, claims.Verdict]:
    """Per claim, the verdict over the plane's cells (:data:`PLANE_RULE`): the cells with
    ``eta_qk`` at most ``ceiling[optimizer]`` are read; the reason counts them by outcome and names
    the cells past the edge; the region names where the claim holds, where it is contradicted and
    where it is undecided; the effect gives the range of the claim's change over the cells read."""
    out = {}
    for cid, g in outcomes.groupby("claim", sort=True):
        within = g["eta_qk"] <= g["optimizer"].map(lambda o: ceiling.get(o, math.nan)) * (1 + 1e-9)
        read, past = g[within], g[~within]
        holds = read[read["verdict"] == "reproduced"]
        fails = read[read["verdict"] == "not reproduced"]
        part = read[read["verdict"] == "holds where"]
        open_ = read[read["verdict"] == "inconclusive"]
        rescued = g[g["outcome"] == "rescued"]
        counts = ", ".join(f"{(read['outcome'] == o).sum()} {o}" for o in OUTCOMES if (read["outcome"] == o).any())
        why = f"{len(read)} cells within the stable range: {counts or 'none'}"
        # a cell where only some of the claim's measures held is named, but the claim did not hold there: it
        # counts against the claim where another measure fell short of its margin, else it decides nothing
        short = part["contradicts"].astype(bool) if "contradicts" in part else pd.Series(True, index=part.index)
        if len(part):
            why += f"; in part (some of its measures) at {_cells(part)}"
            if not short.all():
                why += f" (the others undecided at {_cells(part[~short])})"
        if len(past):
            why += f"; {len(past)} cells past the stable ceiling, not read"
        if len(rescued):
            why += f"; training rescued by the higher ratio at {_cells(rescued)}"
        effect = _effect(read[read["verdict"] != "not tested"], cid)
        against = pd.concat([fails, part[short]])
        open_ = pd.concat([open_, part[~short]])
        compared = len(holds) + len(against) + len(open_)
        # a region counts points of the plane: one point reached by both routes is the same runs
        n_holds, n_against, enough = _points(holds), _points(against), claims.MIN_REGION_CELLS
        if 0 < n_holds < enough:
            why += f"; held at {n_holds} point only ({_cells(holds)}): not a region"
        if 0 < n_against < enough and n_holds < enough:
            why += f"; contradicted at {n_against} point only ({_cells(against)})"
        if not compared:
            out[cid] = claims.Verdict("not tested", PLANE_RULE, why)
        elif len(holds) == compared and n_holds >= enough:
            out[cid] = claims.Verdict("reproduced", PLANE_RULE, why, effect=effect)
        elif n_holds >= enough:
            region = "at " + _cells(holds)
            region += "".join(f"; {w} at {_cells(x)}" for w, x in (("in part", part), ("not", fails),
                                                                    ("undecided", open_)) if len(x))
            out[cid] = claims.Verdict("holds where", PLANE_RULE, why, region=region, effect=effect)
        elif n_against >= enough:
            out[cid] = claims.Verdict("not reproduced", PLANE_RULE, why, effect=effect)
        else:
            out[cid] = claims.Verdict("inconclusive", PLANE_RULE, why, effect=effect)
    return out


_CELL = ["route", "optimizer", "eta_ov", "ratio", "claim"]  # one row of cell_outcomes


def one_seed_out(outcomes: pd.DataFrame, without: Mapping[int, pd.DataFrame], ceiling: Mapping[str, float]
                 ) -> dict[str, claims.Verdict]:
    """:func:`plane_verdicts` of ``outcomes`` (every seed), each word checked against the plane read
    with one seed left out (``without[seed]``: :func:`cell_outcomes` of the runs without it). A cell
    in which leaving the seed out leaves fewer seed pairs or reference seeds than the rules' minimum
    keeps its outcome (a shortfall the minimum already governs); every other cell takes its
    outcome without the seed. A word other than 'inconclusive' or 'not tested' that another word
    replaces when some one seed is left out is decided by that seed: it becomes 'inconclusive', its
    reason naming the seed and the word without it (the effect is kept)."""
    full = plane_verdicts(outcomes, ceiling)
    key = outcomes.set_index(_CELL).index
    turned: dict[str, list[tuple[int, claims.Verdict]]] = {}
    for seed, loo in without.items():
        ok = loo[(loo["pairs"] >= claims.MIN_SEEDS) & (loo["ref_trained"] >= claims.MIN_SEEDS)]
        mixed = pd.concat([outcomes[~key.isin(ok.set_index(_CELL).index)], ok], ignore_index=True)
        for cid, w in plane_verdicts(mixed, ceiling).items():
            if cid in full and w.verdict != full[cid].verdict:
                turned.setdefault(cid, []).append((seed, w))
    out = {}
    for cid, v in full.items():
        turns = turned.get(cid, [])
        if turns and v.verdict not in ("inconclusive", "not tested"):
            s, w = turns[0]
            seeds = ", ".join(str(t) for t, _ in turns)
            out[cid] = claims.Verdict("inconclusive", v.rule, f"{v.reason}; {v.label} with every seed, but {w.label} "
                                      f"without seed {s} (turned by leaving out seed{'s' if len(turns) > 1 else ''} "
                                      f"{seeds}): one seed decides it", effect=v.effect)
        else:
            out[cid] = v
    return out


def region_table(outcomes: pd.DataFrame, ceiling: Mapping[str, float]) -> pd.DataFrame:
    """The plane's cells as a table to read: one row per (optimizer, route, eta_OV, eta_QK,
    ratio), one column per claim with its outcome and effect (``reproduced (+0.051 ± 0.020)``),
    the all-runs change of AC@0.5 beside R2's trained-pair one, the trained seeds at the cell and
    at its reference, and whether ``eta_QK`` lies past the stable ceiling."""
    if not len(outcomes):
        return pd.DataFrame()
    o = outcomes.assign(text=[f"{w}" + (f" ({fmt_change(e, c)})" if math.isfinite(e) else "")
                              for w, e, c in zip(outcomes["outcome"], outcomes["effect"], outcomes["effect_ci"])],
                        **{"Δ AC@0.5, all runs": [fmt_change(e, c) for e, c in zip(outcomes["all_AC"], outcomes["all_AC_ci"])]})
    idx = ["optimizer", "route", "eta_ov", "eta_qk", "ratio"]
    t = o.pivot_table(index=idx, columns="claim", values="text", aggfunc="first")
    r3_at = o[o["claim"] == "R3"].groupby(idx)["read_at"].first().rename("R3 read at")
    seeds = o.groupby(idx)[["Δ AC@0.5, all runs", "trained", "ref_trained"]].first().join(r3_at)
    t = t.join(seeds).reset_index()
    t["past the edge"] = t["eta_qk"] > t["optimizer"].map(lambda x: ceiling.get(x, math.nan)) * (1 + 1e-9)
    t["route"] = t["route"].map(lambda r: f"{ROUTE_MARK[r]} {ROUTES[r]}")
    return t.sort_values(["optimizer", "route", "eta_ov", "ratio"]).reset_index(drop=True)


def tied_rates(table: pd.DataFrame, selected: Mapping[str, float], metric: str = "val_accuracy"
               ) -> dict[str, list[float]]:
    """Per optimizer, the base rates tied with the tuned one (``selected``): their mean ``metric``
    over trained seeds at ratio 1 lies within the 95% seed half-width of the tuned rate's mean
    (themselves with at least ``MIN_SEEDS`` trained seeds); the tuned rate first. With fewer than
    two trained seeds at the tuned rate the interval is unknown and only the tuned rate is listed."""
    ref = table[(table["ratio"] == 1.0) & table["trained"]]
    out = {}
    for opt, best in selected.items():
        g = ref[ref["optimizer"] == opt]
        v = g[g["eta_ov"] == best][metric].to_numpy(dtype=float)
        hw = seed_half_width(v) if len(v) >= 2 else math.nan
        tied = [best]
        for eta, h in g.groupby("eta_ov"):
            if float(eta) != best and len(h) >= claims.MIN_SEEDS and math.isfinite(hw) and \
                    abs(float(h[metric].mean()) - float(v.mean())) <= hw:
                tied.append(float(eta))
        out[opt] = tied
    return out


TUNED_LINE_RULE = ("the claim's own rule in the column of the tuned base rate (best validation accuracy at ratio 1, "
                   "η_QK raised at fixed η_OV); the tuned rate's verdict stands only if every base rate tied with it "
                   "(validation accuracy within its 95% seed interval) gives the same verdict, else inconclusive; "
                   "then " + claims.TUNED_RULE)


def tuned_line(columns: pd.DataFrame, tied: Mapping[str, Sequence[float]]) -> dict[str, claims.Verdict]:
    """Per claim, the tuned-rate reading: ``columns`` are the per-column verdicts of
    :func:`qkov_lib.protocol.cell_verdicts`; per optimizer the verdict at its tuned rate (first
    of ``tied[opt]``) stands when every tied rate agrees, else it is 'inconclusive'; the
    optimizers are combined by :func:`qkov_lib.claims.tuned_region`."""
    out = {}
    for cid, g in columns.groupby("claim", sort=True):
        at, where, effects = {}, {}, {}
        for opt, rates_ in tied.items():
            h = g[(g["optimizer"] == opt) & g["eta_ov"].isin(rates_)]
            if not len(h):
                continue
            first = h[h["eta_ov"] == rates_[0]].iloc[0]
            words = dict(zip(h["eta_ov"], h["verdict"]))
            agree = len(set(words.values())) == 1
            at[opt] = first["verdict"] if agree else "inconclusive"
            where[opt] = str(first.get("region", ""))
            tag = "" if len(rates_) == 1 else (" (tied rates " + ", ".join(f"{e:g}: {w}" for e, w in words.items())
                                                + ")")
            effects[opt] = f"eta_ov {rates_[0]:g}: {first.get('effect', '')}{tag}"
        v = claims.tuned_region(at, where, effects)
        out[cid] = claims.Verdict(v.verdict, TUNED_LINE_RULE, v.reason, v.region, v.effect)
    return out


def plot_plane(phase: pd.DataFrame, metric: str, ceiling: Mapping[str, float] | None = None,
               all_runs: bool = False):
    """The change of ``metric`` (``d_<metric>``, or ``d_all_<metric>`` with ``all_runs``) in the
    absolute plane: one panel per (optimizer, route), x = eta_OV and y = eta_QK on log axes, the
    iso-ratio diagonals ``eta_QK = r eta_OV`` dashed and labelled, ratio-1 runs as open circles,
    each higher-ratio cell a square coloured by its change (symmetric scale per optimizer) and
    labelled with :func:`qkov_lib.protocol.phase_label` (``*``: the 95% seed interval excludes 0;
    grey "n/a": no trained pair), a thin arrow from its reference, and the stable ceiling
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
                ax.annotate(protocol.phase_label(float(c[col]), sig) or "n/a", (c["eta_ov"], c["eta_qk"]),
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


__all__ = ["recipe", "fmt_change", "pairs_of", "add_matched", "MATCHED", "ROUTES", "ROUTE_MARK", "ALL_RUN_METRICS", "CLAIM_EFFECT", "OUTCOMES", "PLANE_RULE", "TUNED_LINE_RULE",
           "rate", "plane_phase", "cell_outcomes", "qk_ceiling", "cell_name", "plane_verdicts", "one_seed_out", "region_table",
           "tied_rates", "tuned_line", "plot_plane"]
