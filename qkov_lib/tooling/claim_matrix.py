"""Page 1: every claim in one table, the real-data effects in one figure, the paper's headline in one line.

Read from the results files a build's chapters wrote (the same files as the scorecard): one row per
paper claim with the paper's statement and number, the book's number under the paper's protocol with
its interval, where the claim holds and where it is contradicted, the word and the chapters
(:func:`matrix`); the forest plot of the real-data protocol cells (:func:`forest`, drawn by
:func:`qkov_lib.rate_plane.plot_forest`); and the SQuAD headline, the paper's AC against the book's
(:func:`squad_headline`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from qkov_lib import claims, published, rate_plane
from qkov_lib.tooling import scorecard

REAL = ("squad", "hatexplain", "sva")  # the real-data chapters, by results name
PAPER_NUMBER = {"R2": "AC on SQuAD about {before} → {after}"}  # the only number the paper's summaries give
MAX_EFFECT = 160  # characters of a chapter's effect text a matrix cell shows before it points to the chapter


def protocol_frames(results_dir: str | Path | None = None) -> dict[str, pd.DataFrame]:
    """``{dataset name: its protocol cells}`` (:func:`qkov_lib.rate_plane.protocol_cells`, as the chapter's
    results file keeps them) for every real-data chapter whose results file exists."""
    out = {}
    for name in REAL:
        doc = scorecard.read_results(name, results_dir)
        cells = (doc or {}).get("metrics", {}).get("protocol_cells")
        if cells:
            out[scorecard.dataset_name(name)] = pd.DataFrame(cells)
    return out


def forest(results_dir: str | Path | None = None):
    """The forest plot of the paper's protocol cells of every real-data chapter of the build (None without one)."""
    frames = protocol_frames(results_dir)
    return rate_plane.plot_forest(frames) if frames else None


def _book_number(cid: str, frames: Mapping[str, pd.DataFrame]) -> str:
    """An R claim's changes under the paper's protocol: per dataset the smallest and the largest cell change
    with its family interval (Bonferroni over the claim's cells of that dataset)."""
    parts = []
    for ds, f in frames.items():
        sub = f[(f["route"] == "qk_up")] if len(f) else f
        readings, _ = rate_plane._readings(sub, cid) if len(sub) else ([], [])
        got = [r for r in readings if r.change is not None and math.isfinite(r.change.mean)]
        if not got:
            parts.append(f"{ds}: no cell measured")
            continue
        lo, hi = min(got, key=lambda r: r.change.mean), max(got, key=lambda r: r.change.mean)
        parts.append(f"{ds}: {lo.text()} ({lo.cell.split(', ', 1)[1]})" if lo is hi else
                     f"{ds}: {lo.text()} ({lo.cell.split(', ', 1)[0]}, ×{lo.cell.split('ratio ')[-1].split(' ')[0]}) "
                     f"to {hi.text()} ({hi.cell.split(', ', 1)[0]}, ×{hi.cell.split('ratio ')[-1].split(' ')[0]})")
    return "; ".join(parts)


def _short(text: str) -> str:
    """A chapter's effect text cut to whole cells (``cell: change ± interval``, joined by ``; ``) within
    :data:`MAX_EFFECT` characters (at least one cell), with the number of cells left to the chapter."""
    cells = [c for c in " ".join(str(text).split()).split("; ") if c]
    keep = 1
    while keep < len(cells) and len("; ".join(cells[:keep + 1])) <= MAX_EFFECT:
        keep += 1
    rest = len(cells) - keep
    return "; ".join(cells[:keep]) + (f"; {rest} more {'cell' if rest == 1 else 'cells'} in the chapter" if rest else "")


def matrix(card: pd.DataFrame, results_dir: str | Path | None = None) -> pd.DataFrame:
    """The claim matrix: one row per paper claim of the scorecard ``card`` (:func:`scorecard.build`):
    ``claim``, ``paper`` (statement, and the paper's number where its summaries give one), ``book`` (the
    book's number: for R1-R3 each dataset's range of changes under the paper's protocol with its interval,
    else the deciding chapter's effect), ``where`` (where the claim holds and where it is contradicted, in
    words), ``verdict`` and ``chapters``."""
    frames = protocol_frames(results_dir)
    h = published.headline_glue()
    rows = []
    for _, r in card[card["kind"] == "paper"].iterrows():
        cid, ms = r["id"], list(r["measurements"])
        number = PAPER_NUMBER.get(cid, "").format(before=h["paper_ac_before"], after=h["paper_ac_after"])
        book = (_book_number(cid, frames) if cid in claims.CLAIMS and cid.startswith("R") and frames else
                "; ".join(_short(m.get("effect")) for m in ms if m.get("effect")) or "-")
        rows.append({"claim": cid, "paper": claims.CLAIMS[cid] + (f" ({number})" if number else ""), "book": book,
                     "where": r["region"] or r["reason"] or "-", "verdict": r["verdict"],
                     "chapters": ", ".join(dict.fromkeys(scorecard.dataset_name(m.get("chapter", "")) for m in ms))
                     or "not run"})
    return pd.DataFrame(rows)


def matrix_myst(frame: pd.DataFrame, card: pd.DataFrame, link: bool = True) -> str:
    """:func:`matrix` as a MyST table, the verdict as the scorecard's badge and the chapters linked."""
    docs = {r["id"]: [m for m in r["measurements"]] for _, r in card.iterrows()}
    lines = ["| claim | the paper | the book, under the paper's protocol | where | verdict | chapter |",
             "|---|---|---|---|---|---|"]
    for _, r in frame.iterrows():
        chapters = ", ".join(dict.fromkeys(scorecard._short_link(m, link) for m in docs.get(r["claim"], []))) or "not run"
        lines.append("| " + " | ".join([f"**{r['claim']}**", scorecard.myst_cell(r["paper"]),
                                         scorecard.myst_cell(r["book"]), scorecard.myst_cell(r["where"]),
                                         scorecard._badge(r["verdict"], link), chapters]) + " |")
    return "\n".join(lines)


def squad_headline(results_dir: str | Path | None = None) -> dict[str, str]:
    """The paper's SQuAD headline answered: AC@0.5 on the test split at AdamW's tuned base rate at every ratio
    with a trained run (mean over its trained seeds, percent, and their number), as ``headline_book``; the
    paper's numbers as :func:`qkov_lib.published.headline_glue`. ``headline_book`` says so when SQuAD did not
    run."""
    out = dict(published.headline_glue())
    doc = scorecard.read_results("squad", results_dir)
    m: Mapping[str, Any] = (doc or {}).get("metrics", {})
    tuned = (m.get("map_selected") or {}).get("adamw")
    runs = pd.DataFrame(m.get("map") or [])
    if doc is None:
        out["headline_book"] = "not measured (the SQuAD chapter did not run in this build)"
        return out
    if tuned is None or not len(runs) or "AC@0.5" not in runs:
        out["headline_book"] = "not measured (no AdamW base rate trained at ratio 1 in this build)"
        return out
    at = runs[(runs["optimizer"] == "adamw") & (runs["eta_ov"].map(rate_plane.rate) == rate_plane.rate(tuned))
              & runs["trained"].astype(bool)]
    by = at.groupby("ratio")["AC@0.5"].agg(["mean", "size"])
    if 1.0 not in by.index:
        out["headline_book"] = "not measured (no trained run at ratio 1)"
        return out
    out["headline_book"] = (" → ".join(f"{100 * m:.0f}% at ratio {r:g}" for r, m in by["mean"].items())
                            + f" (AdamW, tuned η_OV {tuned:g}; trained seeds "
                            + ", ".join(str(int(n)) for n in by["size"]) + ")")
    return out


def word_problems(rows: pd.DataFrame) -> list[str]:
    """Every claim row (:func:`scorecard.claim_rows`) whose word disagrees with the intervals printed with it
    (:func:`qkov_lib.claims.word_problem`), as ``chapter, claim: why``."""
    out = []
    for _, r in rows.iterrows():
        why = claims.word_problem(str(r["verdict"]), str(r["rule"]), str(r["effect"]))
        if why:
            out.append(f"{r['chapter']}, {r['id']}: {why}")
    return out


def check_words(rows: pd.DataFrame) -> None:
    """ValueError listing every row of :func:`word_problems`: a page that prints a word beside numbers that
    say another one must not build."""
    bad = word_problems(rows)
    if bad:
        raise ValueError("a verdict word disagrees with the numbers printed with it:\n" + "\n".join(bad))
