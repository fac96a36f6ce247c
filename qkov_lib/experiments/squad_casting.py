"""SQuAD castings for one analysed QK/OV head: better inputs to the same head.

The object of study is unchanged: one :class:`~qkov_lib.models.QKOVAttention` head (any of the
four parameterizations, its ``W_Q``/``W_K``/``W_QK`` in the ``qk`` group and ``W_O``/``W_V``/``W_OV``
in ``ov``) read once at the prediction position, followed by the copy (pointer) readout of
:class:`~qkov_lib.experiments.realdata.CopyModel`:
``logit(j) = h_j . W_OV sum_i alpha_i h_i`` over the context positions ``j``, class ``d`` = the
position ``d`` steps back from the query (the answer's first token). What feeds the head may
be better than the chapter's casting, whose query is only the wh-token:

* ``query`` -- the head's query vector ``x_q``: ``"wh"`` the wh-token embedding (today's casting);
  ``"mean"`` plus a learned projection of the mean of the question's word embeddings;
  ``"pool"`` plus a learned projection of an attention-pooled question summary (pooling weights
  ``softmax_j e_j . (w + U e_wh)`` over the question words).
* ``match`` -- add a learned vector to every context word that occurs in the question
  (:func:`qkov_lib.data.squad.question_match`, computed in ``forward`` from the token ids).
* ``encoder`` -- ``"none"``, or ``"conv"``: a residual windowed convolution over the embedded
  sequence (padding zeroed), ``h = x + relu(conv(x))``, so a key sees its neighbours and their
  match flags. It feeds keys and values of the head; the head stays the only read at the query.
* ``readout`` -- ``"tied"``: the copy readout dots the head's output with each candidate's own
  vector ``h_j`` (as ``CopyModel``), so content features of ``h_j`` can score candidates even
  under flat attention (a path around the head); ``"position"``: it dots with the position
  embedding ``p_j`` only, so which word is the answer can only come from where the head attends.

Everything but the head is in the ``other`` group (no parameter is named like a head matrix),
so the ratio ``eta_QK/eta_OV`` moves only the analysed head. ``forward(tokens, key_mask)``
returns ``(logits (B, C), attention (B, T))`` as every model of the project does, so
:func:`qkov_lib.stacked.train_stacked` trains grids of these models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..data import squad
from ..data.batch import Batch
from ..data.text import PAD_ID, TextDataset, load_text_dataset
from ..metrics import mass_by_role
from ..models import QKOVAttention
from ..profiles import profile_name, profile_table
from ..runtime import seed_everything, torch_threads
from ..training import TrainConfig, predict, train

QUERIES = ("wh", "mean", "pool")
ENCODERS = ("none", "conv")
READOUTS = ("tied", "position")

# Named castings compared in the SQuAD chapter; "wh" queries with the wh-token only.
CASTINGS: dict[str, dict[str, Any]] = {
    "wh": dict(query="wh", match=False, encoder="none"),
    "question": dict(query="pool", match=False, encoder="none"),
    "match": dict(query="pool", match=True, encoder="none"),
    "match+conv": dict(query="pool", match=True, encoder="conv"),
    "mean+match+conv": dict(query="mean", match=True, encoder="conv"),
    "match+conv/position": dict(query="pool", match=True, encoder="conv", readout="position"),
}


# The best casting (dev accuracy at ratio 1 in the cpu profile). test = seconds; cpu = one run:
# about 20 s of loading plus 35 s (idle machine) to 4 min (2 cores shared) of 1000 steps; full = a
# GPU, all exact-span training questions and longer contexts (not yet run).
PROFILES: dict[str, dict[str, Any]] = profile_table(
    dict(casting="match+conv", parameterization="FAFO", d_model=64, window=9, init_scale=1e-2, max_len=128,
         min_freq=10, oov_buckets=1000, keys="context", optimizer="adamw", eta_ov=1e-3, ratio=1.0,
         batch_size=64, weight_decay=0.0, seed=0, data_seed=0, threads=2),
    dict(n_train=300, n_test=100, steps=20),
    dict(n_train=20000, n_test=2000, steps=1000),
    dict(n_train=None, n_test=None, steps=30000, d_model=128, max_len=256),
)


class SquadHeadModel(nn.Module):
    """Embeddings (+ match feature, + encoder) under one :class:`QKOVAttention` head read at the
    query (last) position, with the copy readout over context positions (module docstring).

    ``tokens`` (B, T) are left-padded ``question <sep> context q`` rows; ``key_mask`` (B, T)
    the attendable keys. ``ignore`` (V,) bool: ids that never count as a question match."""

    def __init__(self, vocab_size: int, d_model: int, n_classes: int, max_len: int, sep_id: int,
                 query: str = "pool", match: bool = True, encoder: str = "conv", window: int = 5,
                 readout: str = "tied", ignore: Tensor | None = None, generator: torch.Generator | None = None,
                 **attention_kwargs: Any) -> None:
        super().__init__()
        if query not in QUERIES:
            raise ValueError(f"query must be one of {QUERIES}, got {query!r}")
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {encoder!r}")
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        if not isinstance(window, int) or window < 1 or window % 2 == 0:
            raise ValueError(f"window must be an odd integer >= 1, got {window!r}")
        if not 0 <= sep_id < vocab_size:
            raise ValueError(f"sep_id {sep_id} is not an id of a vocabulary of {vocab_size}")
        if ignore is not None and ignore.shape != (vocab_size,):
            raise ValueError(f"ignore must be a (vocab_size,) = ({vocab_size},) bool table, got {tuple(ignore.shape)}")
        dtype = attention_kwargs.get("dtype", torch.float32)
        self.vocab_size, self.d_model, self.n_classes, self.max_len = vocab_size, d_model, n_classes, max_len
        self.sep_id, self.query, self.match, self.encoder_kind, self.window = sep_id, query, match, encoder, window
        self.readout = readout

        def gauss(std: float, *shape: int) -> nn.Parameter:
            return nn.Parameter(std * torch.randn(*shape, generator=generator, dtype=dtype))

        self.embed = nn.Embedding(vocab_size, d_model, dtype=dtype)
        self.pos = nn.Embedding(max_len, d_model, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(gauss(1 / math.sqrt(d_model), vocab_size, d_model))
            self.pos.weight.copy_(gauss(0.1 / math.sqrt(d_model), max_len, d_model))
        self.register_buffer("ignore", torch.zeros(vocab_size, dtype=torch.bool) if ignore is None else ignore.bool())
        if match:
            self.match_vec = gauss(1 / math.sqrt(d_model), d_model)
        if query != "wh":
            self.summary = gauss(1 / math.sqrt(d_model), d_model, d_model)  # question summary -> query space
        if query == "pool":
            self.pool_w = gauss(1 / math.sqrt(d_model), d_model)
            self.pool_u = gauss(1 / d_model, d_model, d_model)
        if encoder == "conv":
            self.conv = nn.Conv1d(d_model, d_model, window, padding=window // 2, dtype=dtype)
            with torch.no_grad():
                bound = 1 / math.sqrt(d_model * window)
                self.conv.weight.copy_(bound * (2 * torch.rand(self.conv.weight.shape, generator=generator, dtype=dtype) - 1))
                self.conv.bias.zero_()
        self.attention = QKOVAttention(d_model, d_model, generator=generator, **attention_kwargs)

    # --- pieces (each (B, T, d) or (B, d)) ------------------------------------------------
    def keys(self, tokens: Tensor) -> Tensor:
        """Key/value vectors ``h`` (B, T, d): word + position (counted back from the query) +
        match vector, padding zeroed, through the encoder."""
        T = tokens.shape[-1]
        real = (tokens != PAD_ID)[..., None]
        x = self.embed(tokens) + self.pos(torch.arange(T - 1, -1, -1, device=tokens.device))
        if self.match:
            m = squad.question_match(tokens, self.sep_id, self.ignore)
            x = x + m[..., None].to(x.dtype) * self.match_vec
        x = x * real  # padding is zero, so left padding does not change any real position
        if self.encoder_kind == "conv":
            x = (x + torch.relu(self.conv(x.transpose(-1, -2)).transpose(-1, -2))) * real
        return x

    def query_vector(self, tokens: Tensor) -> Tensor:
        """The head's query input ``x_q`` (B, d): wh-token embedding + position 0, plus a learned
        projection of the question summary for ``query`` = mean | pool."""
        e = self.embed(tokens)
        q = e[..., -1, :] + self.pos.weight[0]
        if self.query == "wh":
            return q
        qm = squad.question_mask(tokens, self.sep_id)
        if self.query == "mean":
            w = qm.to(e.dtype) / qm.sum(-1, keepdim=True).clamp_min(1).to(e.dtype)
        else:
            u = self.pool_w + e[..., -1, :] @ self.pool_u.T  # the pooling query depends on the wh-type
            s = torch.einsum("...td,...d->...t", e, u).masked_fill(~qm, float("-inf"))
            w = torch.softmax(s, -1).nan_to_num(0.0)  # a row without question words pools nothing
        return q + torch.einsum("...t,...td->...d", w, e) @ self.summary.T

    def forward(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        if tokens.dim() != 2 or key_mask.shape != tokens.shape:
            raise ValueError(f"expected tokens (B, T) and key_mask (B, T), got {tuple(tokens.shape)}, {tuple(key_mask.shape)}")
        T = tokens.shape[1]
        if T > self.max_len or T > self.n_classes:
            raise ValueError(f"sequence length {T} exceeds max_len {self.max_len} or the number of classes {self.n_classes}")
        h = self.keys(tokens)
        last = torch.zeros(T, dtype=torch.bool, device=tokens.device)
        last[-1] = True
        x = torch.where(last[:, None], self.query_vector(tokens)[:, None, :], h)  # the head reads x[:, -1] as query
        out, attn = self.attention(x, key_mask)
        if self.readout == "tied":
            logits = torch.einsum("btd,bd->bt", h, out)
        else:
            logits = self.pos(torch.arange(T - 1, -1, -1, device=tokens.device)) @ out.T  # (T, B)
            logits = logits.T
        cand = key_mask & squad.context_mask(tokens, self.sep_id)
        logits = logits.masked_fill(~cand, -1e4).flip(1)  # column T-1-d -> class d
        if self.n_classes > T:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], self.n_classes - T), -1e4)], dim=1)
        return logits, attn


def load(cfg: Mapping[str, Any], data_dir=None) -> TextDataset:
    """SQuAD for a casting config (``max_len``, ``min_freq``, ``n_train``, ``n_test``,
    ``data_seed``, ``keys``, ``oov_buckets``); wh query tokens."""
    return load_text_dataset("squad", data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"], n_train=cfg["n_train"],
                             n_test=cfg["n_test"], seed=cfg["data_seed"], query="wh", keys=cfg["keys"],
                             oov_buckets=cfg["oov_buckets"])


def make_model(ds: TextDataset, cfg: Mapping[str, Any], seed: int | None = None) -> SquadHeadModel:
    """The seeded :class:`SquadHeadModel` of casting ``cfg["casting"]`` (a key of :data:`CASTINGS`)."""
    if cfg["casting"] not in CASTINGS:
        raise ValueError(f"unknown casting {cfg['casting']!r}; expected one of {', '.join(CASTINGS)}")
    if squad.SEP not in ds.vocab:
        raise ValueError(f"dataset {ds.name!r} has no {squad.SEP} token; the castings need SQuAD")
    gen = seed_everything(cfg["seed"] if seed is None else seed)
    return SquadHeadModel(ds.vocab_size, cfg["d_model"], ds.n_classes, ds.max_len, ds.vocab.index(squad.SEP),
                          window=cfg["window"], ignore=squad.ignore_table(ds.vocab), generator=gen,
                          parameterization=cfg["parameterization"], init_scale=cfg["init_scale"],
                          **CASTINGS[cfg["casting"]])


def train_config(cfg: Mapping[str, Any], seed: int | None = None) -> TrainConfig:
    """The :class:`TrainConfig` of one casting run (``ratio``, ``eta_ov``, ``steps``, ...)."""
    return TrainConfig(optimizer=cfg["optimizer"], eta_ov=cfg["eta_ov"], ratio=float(cfg["ratio"]),
                       steps=int(cfg["steps"]), batch_size=cfg["batch_size"], weight_decay=cfg["weight_decay"],
                       n_logs=4, seed=cfg["seed"] if seed is None else seed, progress=False, log_subsample=1000,
                       log_seed=cfg["data_seed"])


def accuracy(model: nn.Module, data: Batch) -> float:
    """Exact answer-start accuracy: the fraction of rows whose argmax class is ``y``."""
    _, probs = predict(model, data)
    return float((probs.argmax(-1) == data.y).double().mean())


def attention_by_role(model: nn.Module, ds: TextDataset) -> dict[str, float]:
    """Mean attention mass of ``model`` on the dev split by :func:`qkov_lib.data.squad.squad_roles`
    (answer span, context words in the question, question words, rest)."""
    attn, _ = predict(model, ds.test)
    return mass_by_role(attn, squad.squad_roles(ds), ds.test.key_mask)


def run_casting(ds: TextDataset, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Train one casting on ``ds.train`` and return its train and dev (``ds.test``) accuracy,
    the dev accuracy over all dev questions read (skipped ones counted wrong), sizes and time."""
    with torch_threads(cfg.get("threads", 1)):
        t0 = time.perf_counter()
        model = make_model(ds, cfg)
        hist = train(model, ds.train, train_config(cfg), desc=cfg["casting"])
        seconds = time.perf_counter() - t0
        dev = accuracy(model, ds.test)
        roles = {f"mass_{k}": v for k, v in attention_by_role(model, ds).items()}
        n_read = ds.report.get("test_read", len(ds.test))
        return {"casting": cfg["casting"], **CASTINGS[cfg["casting"]], "parameterization": cfg["parameterization"],
                "steps": cfg["steps"], "n_train": len(ds.train), "n_dev": len(ds.test), "dev_read": n_read,
                "train_accuracy": accuracy(model, ds.train.index(slice(0, 2000))), "dev_accuracy": dev,
                "dev_accuracy_all_read": dev * len(ds.test) / n_read, "train_loss": hist.final.get("loss"),
                "seconds": seconds, **roles}


def main(argv: list[str] | None = None) -> None:
    """``python -m qkov_lib.experiments.squad_casting [--casting NAME ...] [--steps N] ...``:
    train castings at the resolved profile (``QKOV_PROFILE``) and print one JSON line each."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--casting", nargs="+", default=list(CASTINGS))
    for k in ("steps", "n_train", "n_test", "d_model", "max_len", "seed", "min_freq", "oov_buckets", "batch_size", "window"):
        p.add_argument(f"--{k.replace('_', '-')}", type=int)
    for k in ("eta_ov", "ratio", "weight_decay"):
        p.add_argument(f"--{k.replace('_', '-')}", type=float)
    p.add_argument("--parameterization")
    p.add_argument("--profile")
    a = vars(p.parse_args(argv))
    cfg = dict(PROFILES[profile_name(a.pop("profile"))])
    cfg.update({k: v for k, v in a.items() if k != "casting" and v is not None})
    ds = load(cfg)
    for name in a["casting"]:
        print(json.dumps(run_casting(ds, {**cfg, "casting": name})), flush=True)


if __name__ == "__main__":
    main()
