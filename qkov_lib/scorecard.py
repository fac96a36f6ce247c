"""The reproducibility scorecard: every claim of the paper, what we measured, and a verdict.

Chapters report claims in their results files (``results.save_results`` with
``metrics["claims"]`` = rows of ``claims.claim``). This module collects those rows from a results
folder and lays them out per claim ID of ``PAPER.md``, with "not run" for claims no chapter reported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

# The claims of PAPER.md, in its order, as one-line statements of what the paper says.
CLAIMS: dict[str, str] = {
    "T1": "Symmetric reduction: under population gradient flow from a symmetric init, each circuit reduces "
          "to a scalar (an OV margin and a QK score advantage) with closed-form ODEs.",
    "T2": "Implicit rescaling: factorization acts as a state-dependent learning-rate rescaling; for a balanced "
          "factorized scalar the effective rate is about 2·eta·|param|.",
    "T3": "Growth rates: the OV scalar grows like O(log t) and the QK side like O(log² t), with constants that "
          "depend on eta_QK/eta_OV.",
    "T4": "In suitable coordinates the effective OV and QK parameters move along a line; the learning rates set "
          "the relative speed along it.",
    "T5": "Sharpening: when QK learns faster than OV, attention on common tokens shrinks faster and more mass "
          "goes to the relevant tokens.",
    "T6": "Parameterization matters: at equal nominal learning rates factorized and collapsed models follow "
          "different trajectories; a factorized QK circuit gives sharper attention than a collapsed one.",
    "S1": "DTAP heatmaps (attention on the distinct token vs. confidence) differ between FAFO, CAFO, FACO and CACO.",
    "S2": "Which parameterizations concentrate attention on distinct tokens: (CACO, FACO) or (CAFO, CACO) -- "
          "the two summaries disagree.",
    "S3": "A larger eta_QK/eta_OV moves DTAP mass toward high attention and high confidence at about the "
          "same loss and accuracy.",
    "R1": "On SQuAD, HateXplain and SVA, accuracy / F1 stays stable or improves slightly as eta_QK/eta_OV "
          "grows in {1, 10, 100}.",
    "R2": "Attention-based interpretability rises substantially (AC, ACMC, sufficiency); AC on SQuAD goes "
          "from about 12% to about 43%.",
    "R3": "Sharpness and accuracy are decoupled: sharper attention comes from the relative speed of the two "
          "circuits, not from better prediction.",
}
VERDICTS = ("reproduced", "partly", "not reproduced", "not tested", "not run")
BADGES = {"reproduced": "bdg-success", "partly": "bdg-warning", "not reproduced": "bdg-danger",
          "not tested": "bdg-muted", "not run": "bdg-muted-line"}  # sphinx-design roles


def load_results(results_dir: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """``(path, document)`` of every results file in ``results_dir`` that reports claims
    (``metrics["claims"]`` is a list), sorted by file name. A missing folder gives ``[]``."""
    folder = Path(results_dir)
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            continue
        metrics = doc.get("metrics") if isinstance(doc, Mapping) else None
        if isinstance(metrics, Mapping) and isinstance(metrics.get("claims"), list):
            out.append((path, doc))
    return out


def find_doc(chapter: str, book_dir: str | os.PathLike, pages: Iterable[str] | None = None) -> str | None:
    """Docname (relative to ``book_dir``, no suffix) of a chapter given as ``01_synthetic``,
    ``synthetic`` or a path; None when no such page exists (or it is not among ``pages``,
    the names of the pages in the build)."""
    if not chapter:
        return None
    stem = Path(chapter).stem
    allowed = None if pages is None else {Path(p).name for p in pages}
    pages = sorted(p for s in ("*.md", "*.ipynb") for p in Path(book_dir).glob(s)
                   if allowed is None or p.stem in allowed)
    for p in pages:
        if p.stem == stem:
            return p.stem
    for p in pages:
        head, _, tail = p.stem.partition("_")
        if head.isdigit() and tail == stem:
            return p.stem
    return None


def claim_rows(results: Iterable[tuple[Path, Mapping[str, Any]]], book_dir: str | os.PathLike | None = None,
               pages: Iterable[str] | None = None) -> pd.DataFrame:
    """One row per reported claim: id, paper, ours, verdict, doc (the chapter's page), chapter,
    profile, git_commit, file. With ``book_dir``, results whose chapter has no page there (or
    none among ``pages``, the docnames of the build's table of contents) are dropped: they are
    stale files of chapters that are not part of this book."""
    pages = None if pages is None else list(pages)
    cols = ["id", "paper", "ours", "verdict", "doc", "chapter", "profile", "git_commit", "file"]
    rows = []
    for path, doc in results:
        chapter = str(doc.get("chapter") or path.stem)
        params = doc.get("params") if isinstance(doc.get("params"), Mapping) else {}
        for c in doc["metrics"]["claims"]:
            if not isinstance(c, Mapping) or "id" not in c:
                continue
            where = str(c.get("chapter") or chapter)
            page = None
            if book_dir is not None:
                page = find_doc(where, book_dir, pages) or find_doc(chapter, book_dir, pages)
                if page is None:
                    continue
            rows.append({"id": str(c["id"]).strip(), "paper": str(c.get("paper", "")), "ours": str(c.get("ours", "")),
                         "verdict": str(c.get("verdict", "not tested")), "doc": page, "chapter": where,
                         "profile": params.get("profile"), "git_commit": doc.get("git_commit"), "file": str(path)})
    return pd.DataFrame(rows, columns=cols)


def combine(verdicts: Sequence[str]) -> str:
    """One verdict from several chapters' verdicts on a claim: ``not run`` when there are none,
    the common verdict when all agree, ``not tested`` when nothing was tested, else ``partly``."""
    tested = [v for v in verdicts if v != "not tested"]
    if not verdicts:
        return "not run"
    if not tested:
        return "not tested"
    if all(v == tested[0] for v in tested):
        return tested[0]
    return "partly"


def build(rows: pd.DataFrame) -> pd.DataFrame:
    """The scorecard: one row per claim ID (PAPER.md order, then any unknown IDs), with the
    paper's statement, the list of measurements (dicts with ours/verdict/doc/chapter) and the
    combined verdict."""
    ids = list(CLAIMS) + sorted(set(rows["id"]) - set(CLAIMS)) if len(rows) else list(CLAIMS)
    out = []
    for cid in ids:
        sub = rows[rows["id"] == cid] if len(rows) else rows
        out.append({"id": cid, "claim": CLAIMS.get(cid, "(not a claim ID of PAPER.md)"),
                    "known": cid in CLAIMS, "measurements": sub.to_dict("records"),
                    "verdict": combine(list(sub["verdict"]))})
    return pd.DataFrame(out)


def counts(card: pd.DataFrame) -> dict[str, int]:
    """Number of PAPER.md claims per combined verdict (every verdict present, zeros included)."""
    known = card[card["known"]]
    return {v: int((known["verdict"] == v).sum()) for v in VERDICTS}


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def to_myst(card: pd.DataFrame, link: bool = True) -> str:
    """The scorecard as a MyST table (claim, paper, measured, verdict, chapter). With ``link``
    (for ``{glue:md}`` with ``:format: myst`` in the book) chapters are ``{doc}`` links, titled
    by the page, and verdicts sphinx-design badges; without, plain text."""
    lines = ["| claim | the paper says | we measured | verdict | chapter |", "|---|---|---|---|---|"]
    for _, r in card.iterrows():
        ms = r["measurements"] or [{}]
        for i, m in enumerate(ms):
            doc = m.get("doc")
            where = (f"{{doc}}`{doc}`" if link and doc else _cell(m.get("chapter", ""))) if m else ""
            verdict = m.get("verdict", "not run") if m else "not run"
            shown = f"{{{BADGES.get(verdict, 'bdg-muted')}}}`{verdict}`" if link else f"**{verdict}**"
            lines.append("| " + " | ".join([
                f"**{r['id']}**" if i == 0 else "",
                _cell(r["claim"]) if i == 0 else "",
                _cell(m.get("ours", "no chapter in this build reported this claim")) if m else
                "no chapter in this build reported this claim",
                shown,
                where,
            ]) + " |")
    return "\n".join(lines)


def provenance(results: Iterable[tuple[Path, Mapping[str, Any]]]) -> pd.DataFrame:
    """Where the numbers come from: one row per results file (chapter, profile, device, commit,
    wall time, number of claims)."""
    rows = []
    for path, doc in results:
        params = doc.get("params") if isinstance(doc.get("params"), Mapping) else {}
        wall = doc.get("wall_time_s")
        rows.append({"chapter": doc.get("chapter", path.stem), "profile": params.get("profile"),
                     "device": doc.get("device"), "git commit": str(doc.get("git_commit", ""))[:12],
                     "wall time (s)": round(float(wall), 1) if isinstance(wall, (int, float)) else None,
                     "claims": len(doc["metrics"]["claims"]), "file": path.name})
    return pd.DataFrame(rows, columns=["chapter", "profile", "device", "git commit", "wall time (s)", "claims", "file"])
