"""The reproducibility scorecard: every claim of the paper, what we measured, and a verdict.

Chapters report claims in their results files (``results.save_results`` with
``metrics["claims"]`` = rows of ``claims.claim``). This module collects those rows from a results
folder and lays them out per claim ID of :data:`qkov_lib.claims.CLAIMS` (the paper) and
:data:`qkov_lib.claims.EXTENSIONS` (ours), with "not run" for claims no chapter reported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from qkov_lib import claims
from qkov_lib.tooling import results, schema
from qkov_lib.studies.attention_analysis import CHAPTERS, DATASET_NAMES

CLAIMS = claims.CLAIMS
EXTENSIONS = claims.EXTENSIONS
STATES = schema.verdict_words()  # the verdicts, then "not run": no chapter of this build reported the claim
BADGES = {"reproduced": "bdg-success", "holds where": "bdg-warning", "mixed": "bdg-warning-line",
          "not reproduced": "bdg-danger", "inconclusive": "bdg-info", "not tested": "bdg-muted", "not run": "bdg-muted-line"}  # sphinx-design roles
MEANING = {**claims.VERDICT_MEANING, schema.NOT_RUN: "no chapter of this build reported the claim"}


def load_results(results_dir: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """``(path, document)`` of every results file in ``results_dir`` that reports claims
    (``metrics["claims"]``), sorted by file name. Every ``*.json`` there is read and checked against
    the results-file contract (:mod:`qkov_lib.tooling.schema`): one that breaks it (not whole JSON, a
    verdict that is not a verdict word, a non-finite number, ...) raises
    :class:`~qkov_lib.tooling.schema.ResultsFileError` naming each file and field, so no claim is
    dropped or published unread. A folder that does not exist (or is not a folder) raises
    FileNotFoundError (NotADirectoryError). Results of a failed run (``<name>.failed.json`` or
    ``"status": "failed"``, see :func:`qkov_lib.tooling.results.mark_failed`) are left out, each with
    a line on stderr."""
    folder = Path(results_dir)
    if not folder.exists():
        raise FileNotFoundError(f"results folder {folder} does not exist (the chapters write their results files "
                                "there: make book, or qkov run CHAPTER --out FOLDER)")
    if not folder.is_dir():
        raise NotADirectoryError(f"results folder {folder} is not a folder")
    out, bad = [], []
    for path in sorted(folder.glob("*.json")):
        if path.name.endswith(results.FAILED_SUFFIX):
            print(f"scorecard: ignoring {path}: written by a run that failed", file=sys.stderr)
            continue
        try:
            doc = schema.parse(path)
        except schema.ResultsFileError as e:
            bad += e.problems
            continue
        if results.is_failed(path, doc):
            why = doc.get("error") if isinstance(doc, Mapping) else None
            print(f"scorecard: ignoring {path}: written by a run that failed" + (f" ({why})" if why else ""),
                  file=sys.stderr)
            continue
        bad += [(str(path), field, what) for field, what in schema.problems(doc)]
        if isinstance(doc, dict) and isinstance(doc.get("metrics"), Mapping) and "claims" in doc["metrics"]:
            out.append((path, doc))
    if bad:
        raise schema.ResultsFileError(bad)
    return out


def find_doc(chapter: str, book_dir: str | os.PathLike, pages: Iterable[str] | None = None) -> str | None:
    """Docname (relative to ``book_dir``, no suffix) of a chapter given as ``01_synthetic``,
    ``synthetic`` or a path; None when no such page exists (or it is not among ``pages``,
    the names of the pages in the build)."""
    if not chapter:
        return None
    stem = Path(chapter).stem
    allowed = None if pages is None else {Path(p).name for p in pages}
    stems = [p.stem for p in sorted(p for s in ("*.md", "*.ipynb") for p in Path(book_dir).glob(s))
             if allowed is None or p.stem in allowed]
    if stem in stems:
        return stem
    return next((s for s in stems if s.partition("_")[0].isdigit() and s.partition("_")[2] == stem), None)


def claim_rows(results: Iterable[tuple[Path, Mapping[str, Any]]], book_dir: str | os.PathLike | None = None,
               pages: Iterable[str] | None = None) -> pd.DataFrame:
    """One row per reported claim: id, paper, ours, verdict, region, effect, rule, reason, doc (the chapter's page), chapter,
    profile, git_commit, file. With ``book_dir``, results whose chapter has no page there (or
    none among ``pages``, the docnames of the build's table of contents) are dropped: they are
    stale files of chapters that are not part of this book."""
    pages = None if pages is None else list(pages)
    cols = ["id", "paper", "ours", "verdict", "region", "effect", "rule", "reason", "doc", "chapter", "profile",
            "git_commit", "file"]
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
                         "verdict": str(c.get("verdict", "not tested")), "region": str(c.get("region", "")),
                         "effect": str(c.get("effect", "")), "rule": str(c.get("rule", "")),
                         "reason": str(c.get("reason", "")), "doc": page, "chapter": where,
                         "profile": params.get("profile"), "git_commit": doc.get("git_commit"), "file": str(path)})
    return pd.DataFrame(rows, columns=cols)


DATASETS = DATASET_NAMES  # chapter stem -> dataset name


def dataset_name(chapter: str) -> str:
    """The dataset a chapter name stands for (``05_squad`` or ``squad`` -> ``SQuAD``); other
    chapter names are returned unchanged."""
    stem = Path(str(chapter)).stem
    head, _, tail = stem.partition("_")
    key = tail if head.isdigit() and tail else stem
    return DATASETS.get(key.lower(), str(chapter))


def short_name(chapter: str) -> str:
    """A chapter as a table cell names it: its dataset (``SQuAD``), else ``chapter 03`` for a numbered
    page (a file name like ``03_theory_asymptotics`` would widen a narrow column), else the name."""
    name = dataset_name(chapter)
    head, _, _ = Path(str(chapter)).stem.partition("_")
    return f"chapter {head}" if name == str(chapter) and head.isdigit() else name


def measurement_name(m: Mapping[str, Any]) -> str:
    """A measurement as a table cell names it: :func:`short_name` of its chapter, with the dataset its text
    opens with when the chapter is not itself a dataset's (``chapter 09 (SVA)``: a page that reads one claim
    on several datasets)."""
    name = short_name(m.get("chapter", ""))
    first = str(m.get("ours", "")).split(" ", 1)[0].strip(",:").lower()
    return f"{name} ({DATASETS[first]})" if name not in DATASETS.values() and first in DATASETS else name


def per_dataset(measurements: Sequence[Mapping[str, Any]]) -> str:
    """Each measurement's verdict named by its dataset (:func:`dataset_name` of its chapter), in
    order: ``SQuAD reproduced · HateXplain not reproduced · SVA partly``; ``""`` when none."""
    return " · ".join(f"{measurement_name(m)} {m.get('verdict', 'not tested')}" for m in measurements)


def build(rows: pd.DataFrame) -> pd.DataFrame:
    """The scorecard: one row per claim ID -- the paper's claims in order, then our extensions,
    then any unknown IDs -- with its statement, ``kind`` (paper / extension / unknown), the list
    of measurements (dicts with ours/verdict/region/effect/rule/reason/doc/chapter), the combined
    verdict, reason and region (:func:`qkov_lib.claims.combine`, chapters named by
    :func:`dataset_name`), and ``per_dataset`` (:func:`per_dataset`: each measurement's verdict by
    dataset)."""
    seen = set(rows["id"]) if len(rows) else set()
    ids = list(CLAIMS) + [e for e in EXTENSIONS if e in seen] + sorted(seen - set(CLAIMS) - set(EXTENSIONS))
    out = []
    for cid in ids:
        sub = rows[rows["id"] == cid] if len(rows) else rows
        ms = sub.to_dict("records")
        verdict, reason, region = claims.combine([{**m, "chapter": dataset_name(m.get("chapter", ""))} for m in ms])
        kind = "paper" if cid in CLAIMS else "extension" if cid in EXTENSIONS else "unknown"
        text = CLAIMS.get(cid) or (EXTENSIONS[cid][1] if cid in EXTENSIONS else "(not a claim ID of the paper)")
        out.append({"id": cid, "claim": text, "kind": kind, "known": kind == "paper", "measurements": ms,
                    "verdict": verdict, "reason": reason, "region": region, "per_dataset": per_dataset(ms)})
    return pd.DataFrame(out)


def counts(card: pd.DataFrame, kind: str = "paper") -> dict[str, int]:
    """Number of claims of ``kind`` (paper or extension) per combined verdict, zeros included."""
    sub = card[card["kind"] == kind]
    return {v: int((sub["verdict"] == v).sum()) for v in STATES}


def myst_cell(text: Any) -> str:
    """``text`` on one line with ``|`` escaped, safe inside a MyST table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _badge(verdict: str, link: bool, small: bool = False) -> str:
    """A verdict as a sphinx-design badge (``small``: the outline badge of the same colour), or in
    plain text without ``link`` (bold; ``small``: as is)."""
    if not link:
        return verdict if small else f"**{verdict}**"
    role = BADGES.get(verdict, "bdg-muted")
    return f"{{{role if not small or role.endswith('-line') else role + '-line'}}}`{verdict}`"


def _where(m: Mapping[str, Any], link: bool) -> str:
    doc = m.get("doc")
    return f"{{doc}}`{doc}`" if link and doc else myst_cell(m.get("chapter", ""))


def to_matrix(card: pd.DataFrame, link: bool = True, kind: str | None = None) -> str:
    """The scorecard at a glance, as a MyST table, one row per claim: claim ID | verdict | where it
    holds | effect size | chapter. ``verdict``: the combined badge, then each measurement's small
    badge (named by dataset) when several chapters report the claim; ``where it holds``: the
    combined region (empty unless the verdict is 'holds where'); ``effect size``: each
    measurement's effect, named by dataset when there are several. Statements, reasons and rules:
    :func:`to_details` (each rule once per claim)."""
    lines = ["| claim | verdict | where it holds | effect size | chapter |", "|---|---|---|---|---|"]
    rows = card if kind is None else card[card["kind"] == kind]
    for _, r in rows.iterrows():
        ms = list(r["measurements"])
        if not ms:
            lines.append(f"| **{r['id']}** | {_badge('not run', link)} | | | |")
            continue
        named = len(ms) > 1
        verdict = _badge(r["verdict"], link) + ("" if not named else " " + " ".join(
            f"{myst_cell(measurement_name(m))} "
            f"{_badge(str(m.get('verdict', 'not tested')), link, small=True)}" for m in ms))
        effect = "; ".join((f"{myst_cell(measurement_name(m))}: " if named else "")
                           + myst_cell(m.get("effect", "") or "-") for m in ms)
        where = ", ".join(dict.fromkeys(_where(m, link) for m in ms))
        lines.append(f"| **{r['id']}** | {verdict} | {myst_cell(r.get('region', '') or '')} | {effect} | {where} |")
    return "\n".join(lines)


def _short_link(m: Mapping[str, Any], link: bool) -> str:
    """A measurement's chapter as a short link: its dataset (``SQuAD``) or ``chapter NN``."""
    doc = str(m.get("doc") or "")
    head, _, _ = Path(doc).stem.partition("_")
    name = dataset_name(doc) if dataset_name(doc) != doc else f"chapter {head}" if head.isdigit() else doc
    return f"{{doc}}`{name} <{doc}>`" if link and doc else name or myst_cell(m.get("chapter", ""))


def findings(card: pd.DataFrame, link: bool = True, kind: str = "paper") -> str:
    """What the book found, one MyST list line per claim: the ID, the verdict badge, where it
    holds, the effect size and the chapters that decided it (the first page's summary)."""
    out = []
    for _, r in card[card["kind"] == kind].iterrows():
        ms = list(r["measurements"])
        where = ", ".join(dict.fromkeys(_short_link(m, link) for m in ms)) or "no chapter"
        effect = "; ".join((f"{dataset_name(m.get('chapter', ''))}: " if len(ms) > 1 else "") + str(m.get("effect"))
                           for m in ms if m.get("effect"))
        region = f" {myst_cell(r['region'])}" if r.get("region") else ""
        out.append(f"- **{r['id']}** {_badge(r['verdict'], link)}{region}"
                   + (f"; effect: {myst_cell(effect)}" if effect else "") + f" ({where})")
    return "\n".join(out)


def meanings() -> pd.DataFrame:
    """The verdict words and what each means (:data:`qkov_lib.claims.VERDICT_MEANING`, plus
    'not run'), for the scorecard's legend."""
    return pd.DataFrame([{"verdict": k, "meaning": v} for k, v in MEANING.items()]).set_index("verdict")


def to_details(card: pd.DataFrame, link: bool = True, kind: str | None = None) -> str:
    """Per claim, a folded block (a sphinx-design ``dropdown`` with ``link``, else a heading):
    the paper's statement, what each chapter measured, its verdict and reason, and the rule
    (shown once when the chapters share it)."""
    out = []
    rows = card if kind is None else card[card["kind"] == kind]
    for _, r in rows.iterrows():
        ms = list(r["measurements"])
        body = [f"*The paper says:* {myst_cell(r['claim'])}", ""]
        if not ms:
            body.append("No chapter in this build reported this claim.")
        for m in ms:
            region = f" *Holds:* {myst_cell(m['region'])}." if m.get("region") else ""
            body += [f"- {_where(m, link)} ({_badge(str(m.get('verdict', 'not tested')), link, small=True)}): "
                     f"{myst_cell(m.get('ours', ''))}{region} *Decided by:* {myst_cell(m.get('reason', ''))}"]
        rules = list(dict.fromkeys(myst_cell(m.get("rule", "")) for m in ms if m.get("rule")))
        body += ["", *(f"*Rule:* {x}" for x in rules)]
        if len(ms) > 1 and r["reason"]:
            body += ["", f"*Combined:* {myst_cell(r['reason'])}"]
        title = f"{r['id']}: {r['verdict']}" + (f" {' '.join(str(r.get('region', '')).split())}"
                                                if r["verdict"] == "holds where" else "")
        out += ([f":::{{dropdown}} {title}", *body, ":::", ""] if link else [f"**{title}**", "", *body, ""])
    return "\n".join(out)


def rules_table() -> pd.DataFrame:
    """Every threshold of the verdict rules: name, value, meaning."""
    return pd.DataFrame([{"threshold": t.name, "value": t.text(), "meaning": t.meaning}
                         for t in claims.THRESHOLDS.values()]).set_index("threshold")


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


# --- the real-data summary: the R1-R3 rows of the dataset chapters' results files ----------------
def read_results(name: str, results_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The results document a dataset chapter wrote (``<results_dir>/<name>.json``, default
    :func:`qkov_lib.tooling.results.default_results_path`), or None when the file does not exist;
    :class:`~qkov_lib.tooling.schema.ResultsFileError` when it breaks the results-file contract."""
    path = Path(results_dir) / f"{name}.json" if results_dir else results.default_results_path(name)
    if not path.is_file():
        return None
    return schema.read(path)


def r_table(results_dir: str | Path | None = None,
            datasets: Sequence[str] = ("squad", "hatexplain", "sva")) -> pd.DataFrame:
    """The R1-R3 table: one row per claim row a dataset chapter reported (a chapter may report
    several rows on one claim, e.g. SVA's second R1 row for its natural-prefix models), with the
    paper's statement, our measurement (with the profile and the seeds per cell of the chapter's
    protocol map), the verdict, its rule and reason; one "not run" row per claim where a chapter
    has written no results or no row on that claim."""
    rows = []
    for cid in ("R1", "R2", "R3"):
        for name in datasets:
            doc = read_results(name, results_dir)
            base = {"claim": cid, "dataset": name, "chapter": CHAPTERS[name], "paper": claims.CLAIMS[cid],
                    "rule": "", "reason": "", "region": "", "effect": ""}
            if doc is None:
                rows.append({**base, "ours": f"not run: no results file for chapter {CHAPTERS[name]} in this build",
                             "verdict": "not run", "profile": None})
                continue
            params = doc.get("params", {})
            found = [c for c in doc.get("metrics", {}).get("claims", []) if c.get("id") == cid]
            if not found:
                rows.append({**base, "ours": "not reported by the chapter", "verdict": "not run",
                             "profile": params.get("profile")})
                continue
            prof = f"{params.get('profile')} profile, protocol map: {len(params.get('map_seeds', []))} seed(s) per cell"
            rows += [{**base, "ours": f"{c['ours']} [{prof}]", "verdict": c["verdict"], "rule": c.get("rule", ""),
                      "reason": c.get("reason", ""), "region": c.get("region", ""), "effect": c.get("effect", ""),
                      "profile": params.get("profile")} for c in found]
    return pd.DataFrame(rows)


def knob_recipe(results_dir: str | Path | None = None,
                datasets: Sequence[str] = ("squad", "hatexplain", "sva")) -> pd.DataFrame:
    """:func:`qkov_lib.rate_plane.recipe` of every dataset chapter's rate plane (its results file's
    ``plane`` and ``plane_ceiling``), one block of rows per dataset; datasets without a results file
    or a plane are left out."""
    from qkov_lib import rate_plane

    frames = []
    for name in datasets:
        doc = read_results(name, results_dir)
        m = (doc or {}).get("metrics", {})
        if not m.get("plane"):
            continue
        frames.append(rate_plane.recipe(pd.DataFrame(m["plane"]), m.get("plane_ceiling", {})).assign(dataset=name))
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    return out[["dataset", *[c for c in out.columns if c != "dataset"]]]


def frame_myst(frame: pd.DataFrame) -> str:
    """A data frame as a MyST markdown table (header, one line per row; cells by :func:`myst_cell`)."""
    cols = list(frame.columns)
    lines = ["| " + " | ".join(myst_cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(myst_cell("" if pd.isna(v) else v) for v in row) + " |"
              for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def r_verdicts(table: pd.DataFrame) -> dict[str, tuple[str, str, str]]:
    """One ``(verdict, reason, region)`` per claim across datasets, by
    :func:`qkov_lib.claims.combine` (datasets named; disagreeing ones with their reasons)."""
    return {cid: claims.combine([{**r, "chapter": dataset_name(r["chapter"])} for r in g.to_dict("records")
                                 if r["verdict"] != "not run"])
            for cid, g in table.groupby("claim", sort=True)}


def r_table_myst(table: pd.DataFrame) -> str:
    """The R1-R3 table as MyST markdown, one short row per claim and dataset: claim | dataset |
    verdict | where it holds | effect size. What each chapter measured and the reasons:
    :func:`r_details_myst`; the rules are stated once on the page."""
    lines = ["| claim | dataset | verdict | where it holds | effect size |", "|---|---|---|---|---|"]
    for cid, g in table.groupby("claim", sort=True):
        for i, (_, r) in enumerate(g.iterrows()):
            lines.append(f"| {'**' + cid + '**' if i == 0 else ''} | {dataset_name(r['chapter'])} | "
                         f"**{r['verdict']}** | {myst_cell(r.get('region', '') or '')} | "
                         f"{myst_cell(r.get('effect', '') or '-')} |")
    return "\n".join(lines)


def r_details_myst(table: pd.DataFrame) -> str:
    """Per claim, a folded block (sphinx-design ``dropdown``) with what each dataset chapter
    measured and the numbers its rule decided on, each once."""
    out = []
    for cid, g in table.groupby("claim", sort=True):
        body = [f"- **{dataset_name(r['chapter'])}**: {myst_cell(r['ours'])}"
                + (f" *Decided by:* {myst_cell(r['reason'])}" if r["reason"] else "") for _, r in g.iterrows()]
        out += [f":::{{dropdown}} {cid}: what each dataset measured", *body, ":::", ""]
    return "\n".join(out)


def provenance_frame(results_dir: str | Path | None = None) -> pd.DataFrame:
    """Where the summary's numbers come from: per dataset chapter, whether it ran, its profile,
    the map's ratios, seeds per cell and step budget per optimizer (early stopping may end a run
    sooner), the train/test instances used, wall time (s) and git commit."""
    rows = []
    for name in ("squad", "hatexplain", "sva"):
        doc = read_results(name, results_dir)
        if doc is None:
            rows.append({"chapter": CHAPTERS[name], "status": "not run"})
            continue
        p, report = doc.get("params", {}), doc.get("metrics", {}).get("data_report", {})
        steps = ", ".join(f"{o} {p[f'{o}_steps']}" for o in p.get("optimizers", []) if f"{o}_steps" in p)
        rows.append({"chapter": CHAPTERS[name], "status": "ran", "profile": p.get("profile"),
                     "ratios": p.get("ratios"), "seeds": len(p.get("map_seeds", [])), "steps": steps or None,
                     "train instances": report.get("train_used"), "test instances": report.get("test_used"),
                     "wall time (s)": round(doc["wall_time_s"], 1) if doc.get("wall_time_s") else None,
                     "git commit": str(doc.get("git_commit", ""))[:12]})
    return pd.DataFrame(rows).set_index("chapter")
