"""HateXplain: where the analysed head's attention goes, and HateXplain's own protocol.

:func:`rationale_roles` / :func:`role_table` give the attention mass on rationale positions vs
the rest (:func:`qkov_lib.metrics.mass_by_role`); :func:`most_attended_words` ranks the words by
the attention they receive; :func:`protocol_rows` runs HateXplain's own explainability protocol
(:func:`qkov_lib.faithfulness_hatexplain.hatexplain_protocol`) on trained runs. Attention rows are (N, T)
over the key positions of a left-padded batch (query last).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from qkov_lib.data.batch import Batch
from qkov_lib.metrics import mass_by_role, prediction_metrics
from qkov_lib.train import predict


# --- where the attention goes ----------------------------------------------------------------
def rationale_roles(batch: Batch) -> dict[str, Tensor]:
    """Role masks (N, T) over key positions: ``rationale`` (annotated words) and ``other words``
    (every other key). They partition the keys, so the two masses sum to 1 per row."""
    return {"rationale": batch.relevant & batch.key_mask, "other words": batch.key_mask & ~batch.relevant}


def role_table(attn: Tensor, batch: Batch) -> dict[str, float]:
    """Mean attention mass on rationale positions and on the other words, over the posts that
    have a rationale (the others have no ``rationale`` role), plus the uniform-attention
    reference (mean fraction of keys that are rationale) and the number of posts."""
    if attn.shape != batch.tokens.shape:
        raise ValueError(f"attn must have the batch's shape {tuple(batch.tokens.shape)}, got {tuple(attn.shape)}")
    has = batch.relevant.any(1)
    if not bool(has.any()):
        raise ValueError("no post in the batch has a rationale")
    sub = batch.index(has)
    out = mass_by_role(attn[has], rationale_roles(sub), sub.key_mask)
    out.pop("rest", None)
    frac = (sub.relevant & sub.key_mask).sum(1) / sub.key_mask.sum(1)
    out["uniform rationale"] = float(frac.double().mean())
    out["posts"] = int(has.sum())
    return out


def most_attended_words(attn: Tensor, batch: Batch, vocab: Sequence[str], k: int = 20,
                        by: str = "total") -> pd.DataFrame:
    """The ``k`` words with the most attention: per word id (over all key positions of
    ``batch``), ``total`` = summed attention mass, ``mean`` = mass per occurrence,
    ``count`` = key occurrences and ``in_rationale`` = fraction of those occurrences that are
    rationale positions. Sorted by ``by`` ("total" or "mean"; ties by word id); index = word."""
    if attn.shape != batch.tokens.shape:
        raise ValueError(f"attn must have the batch's shape {tuple(batch.tokens.shape)}, got {tuple(attn.shape)}")
    if by not in ("total", "mean"):
        raise ValueError(f"by must be 'total' or 'mean', got {by!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    ids = batch.tokens[batch.key_mask]
    if len(ids) and int(ids.max()) >= len(vocab):
        raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of {len(vocab)} words")
    V = len(vocab)
    mass = torch.bincount(ids, weights=attn[batch.key_mask].double(), minlength=V)
    n = torch.bincount(ids, minlength=V)
    rel = torch.bincount(ids, weights=batch.relevant[batch.key_mask].double(), minlength=V)
    seen = (n > 0).nonzero()[:, 0]
    df = pd.DataFrame({"word": [vocab[i] for i in seen.tolist()], "id": seen.numpy(),
                       "total": mass[seen].numpy(), "count": n[seen].numpy(),
                       "in_rationale": (rel[seen] / n[seen]).numpy()})
    df["mean"] = df["total"] / df["count"]
    df = df.sort_values([by, "id"], ascending=[False, True], kind="mergesort").head(k)
    return df.set_index("word")[["total", "mean", "count", "in_rationale"]]


def protocol_rows(runs: Sequence[Any], test: Batch, n_classes: int) -> pd.DataFrame:
    """HateXplain's own protocol (:func:`qkov_lib.faithfulness_hatexplain.hatexplain_protocol`) for every
    trained run (objects with ``ratio``, ``seed`` and ``model``, e.g.
    :class:`~qkov_lib.studies.attention_analysis.RealRun`) on ``test``, with accuracy and macro-F1,
    averaged over seeds per ratio: the ``ours`` rows of :func:`qkov_lib.published.hatexplain_table`."""
    from qkov_lib.faithfulness_hatexplain import hatexplain_protocol

    rows = []
    for r in runs:
        if r.model is None:
            raise ValueError(f"run (ratio {r.ratio:g}, seed {r.seed}) kept no model")
        device = next(r.model.parameters()).device
        batch = test.to(device)
        attn, probs = predict(r.model, batch)
        p = hatexplain_protocol(r.model, batch, attn)
        m = prediction_metrics(probs, batch.y, n_classes)
        rows.append({"ratio": float(r.ratio), "seed": r.seed, "accuracy": m["accuracy"], "macro_f1": m["macro_f1"],
                     **{k: float(p[k]) for k in ("iou_f1", "token_f1", "auprc", "comprehensiveness", "sufficiency")}})
    cols = ["ratio", "accuracy", "macro_f1", "iou_f1", "token_f1", "auprc", "comprehensiveness", "sufficiency"]
    if not rows:  # no trained run to measure (e.g. a map in which nothing trained)
        return pd.DataFrame(columns=cols)
    return pd.DataFrame(rows).drop(columns="seed").groupby("ratio", as_index=False).mean()[cols]


def published_tables(ours: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(beside, differences)``: our rows of HateXplain's own protocol (:func:`protocol_rows`; left out
    when empty) below the published ones (:func:`qkov_lib.published.hatexplain_table`), indexed by model,
    three decimals; and every way our implementation differs from the published protocol, indexed by
    topic (:data:`qkov_lib.faithfulness_hatexplain.DEFINITIONAL_DIFFERENCES`: ours, theirs)."""
    from qkov_lib import published
    from qkov_lib.faithfulness_hatexplain import DEFINITIONAL_DIFFERENCES

    beside = published.hatexplain_table(ours if len(ours) else None).set_index("model").round(3)
    return beside, pd.DataFrame(DEFINITIONAL_DIFFERENCES, columns=["topic", "ours", "theirs"]).set_index("topic")


def show_published(ours: pd.DataFrame) -> None:
    """Display the two tables of :func:`published_tables`."""
    from IPython.display import display

    for table in published_tables(ours):
        display(table)
