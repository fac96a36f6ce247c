"""HateXplain: a classifier that learns, with the analysed object still ONE QK/OV attention head.

:class:`EncoderHeadModel`: learned word embeddings -> an encoder -> one
:class:`~qkov_lib.models.QKOVAttention` head read at the query (prediction) position, in any of the
four parameterizations. The head's ``W_Q``/``W_K`` (or ``W_QK``) are the ``qk`` group and
``W_O``/``W_V`` (or ``W_OV``) the ``ov`` group of :func:`qkov_lib.models.param_groups`; the
embeddings and the encoder are ``other``. The logits are ``W_OV sum_i alpha_i h_i``: the head's OV
readout of the attended encoder states is the whole classifier.

Encoders (``encoder=``):

* ``"bigru"``: a bidirectional GRU, as the HateXplain paper's BiRNN-Attn. Both directions see
  only the post (and query): the forward GRU runs over each row rotated so its tokens come first,
  the backward GRU over the reversed row, so left padding changes nothing (no packing needed).
  ``torch.func.vmap`` has no rule for ``aten::gru``, so this encoder trains one model per
  :func:`~qkov_lib.stacked.train_stacked` call (``B = 1``).
* ``"conv"``: a windowed convolution (width ``kernel``) with ReLU over the zero-padded
  embeddings; stackable (``B > 1``) when ``dropout == 0``.

The query position is the ``<query>`` token after the post; its encoder state is the query of
the head (for ``bigru`` its forward half summarises the whole post). The attention row is over
ENCODER STATES, i.e. over positions: ``attention[i, t]`` is the weight of position ``t``, whose
state mixes the words around ``t`` (the whole post for the GRU), so "attention on rationale
words" means attention on the positions of rationale words, as in BiRNN-Attn.

Dropout acts only in passes that build a graph (training steps), not under ``torch.no_grad``,
because :func:`~qkov_lib.stacked.train_stacked` logs validation loss without switching to
``eval()``. A stack of several models (``vmap``) needs ``dropout=0`` (a clear error otherwise).

:func:`rationale_roles` / :func:`role_table` give the attention mass on rationale positions vs
the rest (:func:`qkov_lib.metrics.mass_by_role`); :func:`most_attended_words` ranks the words by
the attention they receive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

from ..data.batch import Batch
from ..data.text import PAD_ID, TextDataset
from ..metrics import mass_by_role, prediction_metrics
from ..profiles import profile_table
from ..models import QKOVAttention
from ..runtime import is_batched, seed_everything
from ..training import History, TrainConfig, predict, train

ENCODERS: tuple[str, ...] = ("bigru", "conv")


class EncoderHeadModel(nn.Module):
    """Embeddings (V, ``d_embed``) -> encoder -> states (B, T, ``d_model``) -> one QK/OV head at
    the last position. ``forward(tokens (B, T) left-padded, key_mask (B, T))`` returns
    ``(logits (B, C), attention (B, T))``; padding (id ``pad_id``) is never seen by the encoder."""

    def __init__(self, vocab_size: int, n_classes: int, d_embed: int = 64, d_model: int = 64,
                 encoder: str = "bigru", kernel: int = 3, dropout: float = 0.0, parameterization: str = "FAFO",
                 init_scale: float = 1e-2, pad_id: int = PAD_ID, generator: torch.Generator | None = None,
                 **attention_kwargs: Any) -> None:
        super().__init__()
        if encoder not in ENCODERS:
            raise ValueError(f"unknown encoder {encoder!r}; expected one of {', '.join(ENCODERS)}")
        if min(vocab_size, n_classes, d_embed, d_model) < 1:
            raise ValueError(f"sizes must be positive, got vocab_size={vocab_size}, n_classes={n_classes}, "
                             f"d_embed={d_embed}, d_model={d_model}")
        if encoder == "bigru" and d_model % 2:
            raise ValueError(f"the bigru encoder needs an even d_model (two directions), got {d_model}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd integer, got {kernel}")
        self.encoder, self.dropout, self.pad_id, self.vocab_size = encoder, float(dropout), pad_id, vocab_size
        self.embed = nn.Embedding(vocab_size, d_embed)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab_size, d_embed, generator=generator) / math.sqrt(d_embed))
        if encoder == "bigru":
            self.fwd = nn.GRU(d_embed, d_model // 2, batch_first=True)
            self.bwd = nn.GRU(d_embed, d_model // 2, batch_first=True)
        else:
            self.conv = nn.Conv1d(d_embed, d_model, kernel, padding=kernel // 2)
        self.attention = QKOVAttention(d_model, n_classes, parameterization=parameterization,
                                       init_scale=init_scale, generator=generator, **attention_kwargs)

    def _drop(self, x: Tensor) -> Tensor:
        # only in gradient passes: the stacked trainer evaluates under no_grad without eval()
        if self.dropout == 0.0 or not (self.training and torch.is_grad_enabled()):
            return x
        if is_batched(x):  # a stacked (vmapped) forward: no per-model masks (None: vmap refuses it)
            raise ValueError("dropout > 0 cannot be trained in a stack of models (vmap); use dropout=0 or train one model")
        return nn.functional.dropout(x, self.dropout, True)

    def encode(self, tokens: Tensor) -> Tensor:
        """Encoder states (B, T, d_model), zero on padding."""
        real = (tokens != self.pad_id)[..., None]
        x = self._drop(self.embed(tokens)) * real
        if self.encoder == "conv":
            h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        else:
            T = tokens.shape[1]
            shift = T - real[..., 0].sum(1)  # leading pads per row
            ar = torch.arange(T, device=tokens.device)[None]
            first = ((ar + shift[:, None]) % T)[..., None]  # rotate: the row's tokens first
            back = ((ar - shift[:, None]) % T)[..., None]
            f = self.fwd(torch.gather(x, 1, first.expand_as(x)))[0]
            f = torch.gather(f, 1, back.expand(-1, -1, f.shape[-1]))
            b = self.bwd(x.flip(1))[0].flip(1)  # left pads come last when reversed: unseen
            h = torch.cat([f, b], -1)
        return self._drop(h) * real

    def forward(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        if tokens.dim() != 2 or key_mask.shape != tokens.shape:
            raise ValueError(f"expected tokens (B, T) and key_mask (B, T), got {tuple(tokens.shape)}, "
                             f"{tuple(key_mask.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be integer ids, got {tokens.dtype}")
        return self.attention(self.encode(tokens), key_mask)


# --- building and training -------------------------------------------------------------------
# Settings chosen at ratio 1 on the official validation split (by validation macro-F1; one seed
# per setting): BiGRU encoder, d_embed = d_model = 64, dropout 0.5,
# AdamW at eta_ov = 2e-3 for every group (ratio 1 = plain AdamW), batches of 64, validation every
# half epoch (120 steps), early stopping after 4 evaluations without a lower validation loss
# (best weights restored), at most 10 epochs (2400 steps). Cost of one cpu-profile run (one
# torch thread, 2 cores shared with other jobs): 67-214 s, stopping after 960-1200 steps, plus
# ~3-15 s to load the data; test profile: ~6 s of training. The ``full`` profile runs 10 seeds.
_BASE = dict(encoder="bigru", d_embed=64, d_model=64, kernel=3, dropout=0.5, parameterization="FAFO", init_scale=1e-2,
             optimizer="adamw", eta_ov=2e-3, eta_other=None, weight_decay=0.0, batch_size=64, max_len=64, min_freq=2,
             patience=4, eval_every=120, steps=2400, data_seed=0, threads=1, seeds=[0, 1, 2])
PROFILES: dict[str, dict] = profile_table(
    _BASE, dict(steps=40, eval_every=20, n_train=300, n_test=100, n_val=100, d_embed=16, d_model=16, seeds=[0]),
    dict(n_train=None, n_test=None, n_val=None), dict(n_train=None, n_test=None, n_val=None, seeds=list(range(10))))


def make_model(vocab_size: int, n_classes: int, cfg: Mapping[str, Any], seed: int) -> EncoderHeadModel:
    """The seeded :class:`EncoderHeadModel` of a profile config."""
    gen = seed_everything(seed)  # also seeds torch's global RNG, which nn.GRU / nn.Conv1d init uses
    return EncoderHeadModel(vocab_size, n_classes, d_embed=cfg["d_embed"], d_model=cfg["d_model"],
                            encoder=cfg["encoder"], kernel=cfg["kernel"], dropout=cfg["dropout"],
                            parameterization=cfg["parameterization"], init_scale=cfg["init_scale"], generator=gen)


def train_config(cfg: Mapping[str, Any], ratio: float, seed: int) -> TrainConfig:
    """The run's :class:`TrainConfig`: validation every ``eval_every`` steps, early stopping with
    ``patience`` evaluations on validation loss, best weights restored; no training-set logging."""
    return TrainConfig(optimizer=cfg["optimizer"], eta_ov=cfg["eta_ov"], ratio=float(ratio), eta_other=cfg["eta_other"],
                       steps=int(cfg["steps"]), batch_size=cfg["batch_size"], weight_decay=cfg["weight_decay"],
                       seed=seed, progress=False, log_every=int(cfg["eval_every"]), log_subsample=0,
                       patience=cfg["patience"], restore_best=True)


def trim_padding(batch: Batch) -> Batch:
    """``batch`` without its leading all-padding columns (the query stays last), so a minibatch
    costs its longest post rather than the padded length."""
    real = batch.key_mask | (torch.arange(batch.tokens.shape[1], device=batch.tokens.device) == batch.tokens.shape[1] - 1)
    keep = real.any(0).nonzero()
    start = int(keep[0, 0]) if len(keep) else 0
    return Batch(batch.tokens[:, start:], batch.key_mask[:, start:], batch.relevant[:, start:], batch.y,
                 batch.weight)


def split_metrics(model: nn.Module, data: Batch) -> dict[str, float]:
    """Accuracy, macro-F1 and mean cross-entropy of ``model`` on ``data`` (e.g. the test split)."""
    _, probs = predict(model, data)
    return prediction_metrics(probs, data.y)


def run_one(ds: TextDataset, val: Batch, cfg: Mapping[str, Any], ratio: float = 1.0,
            seed: int = 0) -> tuple[EncoderHeadModel, History, dict[str, Any]]:
    """Train one model (early stopping on ``val``) and return ``(model, history, row)`` with the
    validation and test accuracy / macro-F1, the stopping step and the best step."""
    model = make_model(ds.vocab_size, ds.n_classes, cfg, seed)
    hist = train(model, ds.train, train_config(cfg, ratio, seed), val=val, desc=f"hatexplain r={ratio:g} s={seed}",
                 prepare=trim_padding, threads=cfg.get("threads"))
    row: dict[str, Any] = {"ratio": float(ratio), "seed": seed, "stop_step": hist.stop_step, "best_step": hist.best_step}
    row.update({f"val_{k}": v for k, v in split_metrics(model, val).items()})
    row.update({f"test_{k}": v for k, v in split_metrics(model, ds.test).items()})
    return model, hist, row


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
    """HateXplain's own protocol (:func:`qkov_lib.faithfulness.hatexplain_protocol`) for every
    trained run (objects with ``ratio``, ``seed`` and ``model``, e.g.
    :class:`~qkov_lib.experiments.realdata.RealRun`) on ``test``, with accuracy and macro-F1,
    averaged over seeds per ratio: the ``ours`` rows of :func:`qkov_lib.published.hatexplain_table`."""
    from ..faithfulness import hatexplain_protocol

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
