"""Published reference numbers, each with its source, for the book to glue instead of typing.

* :data:`HATEXPLAIN_ROWS`: the HateXplain paper's results table (Mathew et al. 2021, "HateXplain:
  A Benchmark Dataset for Explainable Hate Speech Detection", AAAI; arXiv:2012.10289) for the
  models the book compares with. Values are fractions, as the paper prints them. Every value
  names its sources in :data:`SOURCES`; a value that no stored source gives is ``None`` (never
  filled in from memory), and :func:`missing` lists those.
* :data:`SQUAD_AC_HEADLINE`: the paper under reproduction's headline, AC on SQuAD from about 12 %
  to about 43 %.

The paper's own text is not readable through the sources we could consult, so the performance
columns come from transcriptions of its table (Papers with Code, two GitHub repositories). They
agree except on CNN-GRU, where :data:`CONFLICTS` records the other reading. None of them gives the
explainability columns (IOU-F1, token-F1, AUPRC, comprehensiveness, sufficiency); those stay None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

SOURCES: dict[str, str] = {
    "pwc": "Papers with Code, results of 'HateXplain: A Benchmark Dataset for Explainable Hate Speech "
           "Detection' (https://www.paperswithcode.com/paper/hatexplain-a-benchmark-dataset-for), "
           "transcribing the paper's results table",
    "hyperai": "HyperAI paper page for arXiv:2012.10289 (https://beta.hyper.ai/en/papers/2012.10289), "
               "benchmark 'hate-speech-detection-on-hatexplain'",
    "lit_review": "GitHub pashaAbri/elite_strawberry_results, README.md, 'Three-Class Classification "
                  "Results', rows 'HateXplain (2020)' (also hatexplain-lit-review.md, 'Results Summary')",
    "label_audit": "GitHub yogvidwankhede/hatexplain-label-audit, src/rubricon_field/retro.py, ACCURACY "
                   "(cited there as 'Mathew et al. 2021, arXiv:2012.10289v1, Table 6, Acc. column')",
    "paper_summary": "Vashisht & Ramaswamy 2026, as summarised",
}

#: Columns of the comparison table: performance, then explainability (plausibility, faithfulness).
PERFORMANCE_COLUMNS: tuple[str, ...] = ("accuracy", "macro_f1", "auroc")
EXPLAINABILITY_COLUMNS: tuple[str, ...] = ("iou_f1", "token_f1", "auprc", "comprehensiveness", "sufficiency")
METRIC_COLUMNS: tuple[str, ...] = PERFORMANCE_COLUMNS + EXPLAINABILITY_COLUMNS
TABLE_COLUMNS: tuple[str, ...] = ("model", "token_method", "source", "ratio") + METRIC_COLUMNS


@dataclass(frozen=True)
class PublishedRow:
    """One row of a published table: metric values (fractions, or None where no stored source
    gives them) and, per given value, the keys of :data:`SOURCES` that state it."""

    model: str
    token_method: str  # how the explainability columns were produced: "Attn" or "LIME"
    values: dict[str, float | None]
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _row(model: str, token_method: str, accuracy: tuple[float, tuple[str, ...]],
         macro_f1: tuple[float, tuple[str, ...]], auroc: tuple[float, tuple[str, ...]]) -> PublishedRow:
    perf = {"accuracy": accuracy, "macro_f1": macro_f1, "auroc": auroc}
    values: dict[str, float | None] = {c: v for c, (v, _) in perf.items()}
    values.update({c: None for c in EXPLAINABILITY_COLUMNS})
    return PublishedRow(model, token_method, values, {c: s for c, (_, s) in perf.items()})


# The HateXplain table prints each model once per token method ([Attn] / [LIME]); the performance
# columns are the same for both, and we keep the row whose explainability the book compares with.
HATEXPLAIN_ROWS: tuple[PublishedRow, ...] = (
    _row("CNN-GRU", "LIME", (0.627, ("lit_review", "label_audit")), (0.606, ("lit_review",)),
         (0.793, ("lit_review", "hyperai"))),
    _row("BiRNN", "LIME", (0.595, ("pwc", "lit_review", "label_audit")), (0.575, ("pwc", "lit_review")),
         (0.767, ("pwc", "lit_review"))),
    _row("BiRNN-Attn", "Attn", (0.621, ("pwc", "lit_review", "label_audit")), (0.614, ("lit_review",)),
         (0.795, ("pwc", "lit_review"))),
    _row("BiRNN-HateXplain", "Attn", (0.629, ("lit_review", "label_audit")), (0.629, ("pwc", "lit_review")),
         (0.805, ("pwc", "lit_review"))),
    _row("BERT", "Attn", (0.690, ("pwc", "lit_review", "label_audit")), (0.674, ("pwc", "lit_review")),
         (0.843, ("pwc", "lit_review"))),
    _row("BERT-HateXplain", "Attn", (0.698, ("pwc", "lit_review", "label_audit")), (0.687, ("pwc", "lit_review")),
         (0.851, ("pwc", "lit_review"))),
)

#: Values on which the stored sources disagree: ``(model, column) -> (other value, source key)``.
#: HyperAI's CNN-GRU row reads 0.629 / 0.614 (the numbers sometimes quoted for CNN-GRU), which are
#: also BiRNN-HateXplain's accuracy and BiRNN-Attn's macro-F1; the two repositories read 0.627 / 0.606.
CONFLICTS: dict[tuple[str, str], tuple[float, str]] = {
    ("CNN-GRU", "accuracy"): (0.629, "hyperai"),
    ("CNN-GRU", "macro_f1"): (0.614, "hyperai"),
}


@dataclass(frozen=True)
class Headline:
    """A headline number of the paper under reproduction: ``metric`` goes from ``before`` to
    ``after`` (fractions, approximate when ``approximate``) as ``eta_QK/eta_OV`` grows."""

    dataset: str
    metric: str
    before: float
    after: float
    approximate: bool
    source: str


SQUAD_AC_HEADLINE = Headline("SQuAD v1.1", "AC", 0.12, 0.43, True, SOURCES["paper_summary"])


def headline_glue() -> dict[str, str]:
    """The paper's SQuAD AC headline as the text a chapter glues: ``paper_ac_before`` and
    ``paper_ac_after`` in whole percent."""
    h = SQUAD_AC_HEADLINE
    return {"paper_ac_before": f"{100 * h.before:.0f}%", "paper_ac_after": f"{100 * h.after:.0f}%"}


def published_row(model: str) -> PublishedRow:
    """The :data:`HATEXPLAIN_ROWS` entry of ``model``; KeyError naming the known models."""
    for r in HATEXPLAIN_ROWS:
        if r.model == model:
            return r
    raise KeyError(f"no published HateXplain row for {model!r}; known: {[r.model for r in HATEXPLAIN_ROWS]}")


def anchor(model: str, column: str) -> float:
    """A published value (fraction); ValueError when no stored source gives it."""
    if column not in METRIC_COLUMNS:
        raise KeyError(f"unknown column {column!r}; known: {METRIC_COLUMNS}")
    v = published_row(model).values[column]
    if v is None:
        raise ValueError(f"the published {column} of {model} was not found in a stored source")
    return v


def missing() -> list[tuple[str, str]]:
    """``(model, column)`` pairs of :data:`HATEXPLAIN_ROWS` left None (no stored source)."""
    return [(r.model, c) for r in HATEXPLAIN_ROWS for c in METRIC_COLUMNS if r.values[c] is None]


def _bounds(column: str) -> tuple[float, float]:
    # comprehensiveness and sufficiency are differences of probabilities; the rest are fractions
    return (-1.0, 1.0) if column in ("comprehensiveness", "sufficiency") else (0.0, 1.0)


def _check_ours(ours: pd.DataFrame) -> pd.DataFrame:
    if not isinstance(ours, pd.DataFrame):
        raise TypeError(f"ours must be a pandas DataFrame or None, got {type(ours).__name__}")
    if "ratio" not in ours.columns:
        raise ValueError("ours needs a 'ratio' column (one row per eta_QK/eta_OV ratio)")
    unknown = [c for c in ours.columns if c not in ("ratio", "model", *METRIC_COLUMNS)]
    if unknown:
        raise ValueError(f"ours has unknown columns {unknown}; allowed: 'ratio', 'model' and {list(METRIC_COLUMNS)}")
    if ours.empty:
        raise ValueError("ours has no row")
    ratio = pd.to_numeric(ours["ratio"], errors="coerce")
    if ratio.isna().any() or (ratio <= 0).any():
        raise ValueError(f"ratio must be positive numbers, got {ours['ratio'].tolist()}")
    if ratio.duplicated().any():
        raise ValueError(f"ours must have one row per ratio, got ratios {ratio.tolist()}")
    for c in METRIC_COLUMNS:
        if c in ours.columns:
            v = pd.to_numeric(ours[c], errors="coerce")
            bad = ours[c].notna() & v.isna()
            lo, hi = _bounds(c)
            if bad.any() or ((v < lo) | (v > hi)).any():
                raise ValueError(f"column {c!r} must hold fractions in [{lo}, {hi}] (not percent), "
                                 f"got {ours[c].tolist()}")
    return ours


def hatexplain_table(ours: pd.DataFrame | None = None) -> pd.DataFrame:
    """The published HateXplain rows with our rows (one per ratio) below them.

    ``ours``: columns ``ratio`` (required), optionally ``model`` (a row label; default
    ``"ours (ratio R)"``) and any of :data:`METRIC_COLUMNS` as fractions. Returns the columns
    :data:`TABLE_COLUMNS`: ``source`` is the :data:`SOURCES` keys of each published row (joined
    with "+") or ``"this book"``; ``ratio`` is NaN on published rows; values not published or not
    given are NaN."""
    rows = []
    for r in HATEXPLAIN_ROWS:
        keys = sorted({k for ks in r.sources.values() for k in ks})
        rows.append({"model": r.model, "token_method": r.token_method, "source": "+".join(keys),
                     "ratio": math.nan,
                     **{c: (math.nan if r.values[c] is None else r.values[c]) for c in METRIC_COLUMNS}})
    if ours is not None:
        ours = _check_ours(ours)
        for _, o in ours.sort_values("ratio", key=lambda s: pd.to_numeric(s)).iterrows():
            ratio = float(o["ratio"])
            label = o["model"] if "model" in ours.columns and pd.notna(o.get("model")) else f"ours (ratio {ratio:g})"
            rows.append({"model": str(label), "token_method": "Attn", "source": "this book", "ratio": ratio,
                         **{c: (float(o[c]) if c in ours.columns and pd.notna(o[c]) else math.nan)
                            for c in METRIC_COLUMNS}})
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
