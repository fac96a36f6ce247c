"""One analysed attention head that every real-data prediction must pass through.

:class:`HeadModel` is one model for the three real-data tasks (SQuAD, HateXplain, SVA):

``tokens -> word embeddings e(t) -> [key encoder] -> one QKOVAttention head read once at the
query (last) position -> readout``.

* **Keys and query** may see context: ``k_i`` is ``e(t_i)`` plus optional position embeddings
  (``positions``: ``"back"`` = distance from the query, ``"start"`` = index from the first word),
  plus a learned vector on context words that occur in the question (``match``, SQuAD), through
  an optional encoder over the sequence (``encoder``: ``"none"``; ``"conv"`` = ``layers``
  residual convolutions of width ``window`` with ReLU; ``"bigru"`` = a residual bidirectional GRU).
  The query is the key vector at the last position, plus (``query="question"``, SQuAD) a learned
  projection of the mean embedding of the question's words.
* **Values are token-local**: ``v_i = e(t_i)`` (``values="embed"``) or ``e + relu(W e)``
  (``values="map"``), a function of token ``i`` alone; nothing is mixed across positions.
* **The head**: scores ``k_i^T W_QK q``, softmax over the keys (``key_mask``), output
  ``o = W_OV sum_i alpha_i v_i`` -- or ``W_OV sum_i (alpha_i - u_i) v_i`` with ``relative=True``,
  ``u`` the uniform row over the same keys, so flat attention scores every class 0.
* **Readout**, a function of ``o`` only (no residual, no skip, no candidate features):
  ``readout="class"``: the logits are ``o`` (C classes; HateXplain, SVA);
  ``readout="words"``: ``logit(w) = e(w) . o`` for the distinct words ``w`` at attendable keys
  (the paragraph on SQuAD with context keys): position-free, one logit per word, stored in the
  class of the word's first position counted back from the query (SQuAD's target), ``-inf``
  for every other class, so the cost is O(T), not O(vocabulary).

The head's parameters are the ``qk`` (``W_QK`` or ``W_Q``, ``W_K``) and ``ov`` (``W_OV`` or
``W_O``, ``W_V``) groups of :func:`qkov_lib.models.param_groups`; everything else is ``other``.
``ov_init`` adds ``ov_init * I`` to the head's initial ``W_OV`` (``words`` readout: a copy-favouring
start). ``forward(tokens, key_mask)`` returns ``(logits (B, C), attention (B, T))`` like every
model of the project, so :func:`qkov_lib.train.loop.train_stacked` trains stacks of it, through
:meth:`HeadModel.stacked_forward`, the same computation with an explicit model dimension (``bigru``:
one model per stack); ``forward(...,
attention=A)`` replaces the softmax row by a given (B, T) row, for :func:`necessity` and
:func:`graded_intervention`.

:func:`word_task` casts a SQuAD :class:`~qkov_lib.data.text.TextDataset` for the ``words``
readout; :func:`necessity` measures how much of the accuracy the head's attention carries, and
:func:`graded_intervention` (per model of a grid: :func:`intervention_frame`) the accuracy along
the way from the model's own row to the oracle.
Token-local values make the prediction a function of the attended tokens' identities; with
context in the keys, *which* token is attended can still carry information of its own, so the
oracle column of :func:`necessity` (all mass on the relevant tokens) says whether attending
them is how the model predicts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkov_lib.data import squad
from qkov_lib.data.batch import Batch
from qkov_lib.data.text import PAD_ID, TextDataset, length_groups
from qkov_lib.models import QKOVAttention

ENCODERS = ("none", "conv", "bigru")
READOUTS = ("class", "words")
QUERIES = ("last", "question")
VALUES = ("embed", "map")
POSITIONS = ("back", "start")


def _batched(t: Tensor) -> bool:
    """Whether ``t`` is a tensor inside ``torch.func.vmap`` (per-row checks cannot run there)."""
    return torch._C._functorch.is_batchedtensor(t)


class HeadModel(nn.Module):
    """Embeddings -> optional key encoder -> one :class:`~qkov_lib.models.QKOVAttention` head at
    the last position -> a readout of the head's output (module docstring).

    ``tokens`` (B, T) left-padded (pad id 0), query last; ``key_mask`` (B, T) the attendable keys.
    ``n_classes``: the classes (``readout="words"``: at least ``max_len``, one per position). ``sep_id`` (the
    ``<sep>`` id) is needed by ``match`` and ``query="question"``; ``ignore`` (V,) bool: ids that
    never count as a question match. ``attention_kwargs`` go to the head (``parameterization``,
    ``init_scale``, ranks, ``balanced``)."""

    def __init__(self, vocab_size: int, d_model: int, n_classes: int, max_len: int, readout: str = "class",
                 encoder: str = "none", layers: int = 1, window: int = 5, positions: tuple[str, ...] = ("back",),
                 match: bool = False, query: str = "last", values: str = "embed", relative: bool = False,
                 ov_init: float = 0.0, sep_id: int | None = None, ignore: Tensor | None = None,
                 generator: torch.Generator | None = None, **attention_kwargs: Any) -> None:
        super().__init__()
        for name, value, allowed in (("readout", readout, READOUTS), ("encoder", encoder, ENCODERS),
                                     ("query", query, QUERIES), ("values", values, VALUES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        positions = tuple(positions)
        if any(p not in POSITIONS for p in positions) or len(set(positions)) != len(positions):
            raise ValueError(f"positions must be distinct names from {POSITIONS}, got {positions!r}")
        if min(vocab_size, d_model, n_classes, max_len) < 1:
            raise ValueError(f"sizes must be positive, got vocab_size={vocab_size}, d_model={d_model}, "
                             f"n_classes={n_classes}, max_len={max_len}")
        if readout == "words" and n_classes < max_len:
            raise ValueError(f"the words readout stores a word's logit at its position counted back from the query: "
                             f"n_classes must be at least max_len={max_len}, got {n_classes}")
        if readout == "class" and ov_init != 0.0:
            raise ValueError("ov_init (a copy start, W_OV += ov_init * I) needs the words readout")
        if not isinstance(window, int) or window < 1 or window % 2 == 0:
            raise ValueError(f"window must be an odd integer >= 1, got {window!r}")
        if encoder == "conv" and (not isinstance(layers, int) or layers < 1):
            raise ValueError(f"the conv encoder needs layers >= 1, got {layers!r}")
        if encoder == "bigru" and d_model % 2:
            raise ValueError(f"the bigru encoder needs an even d_model (two directions), got {d_model}")
        if (match or query == "question") and (sep_id is None or not 0 <= sep_id < vocab_size):
            raise ValueError(f"match and query='question' need sep_id, the <sep> id in [0, {vocab_size}); got {sep_id!r}")
        if ignore is not None and ignore.shape != (vocab_size,):
            raise ValueError(f"ignore must be a (vocab_size,) = ({vocab_size},) bool table, got {tuple(ignore.shape)}")
        if not math.isfinite(ov_init):
            raise ValueError(f"ov_init must be finite, got {ov_init}")
        dtype = attention_kwargs.setdefault("dtype", torch.float32)
        d = d_model
        self.vocab_size, self.d_model, self.n_classes, self.max_len = vocab_size, d, n_classes, max_len
        self.readout, self.encoder, self.positions, self.match = readout, encoder, positions, bool(match)
        self.query, self.values, self.relative, self.sep_id = query, values, bool(relative), sep_id

        def gauss(std: float, *shape: int) -> Tensor:
            return std * torch.randn(*shape, generator=generator, dtype=dtype)

        def table(n: int, std: float) -> nn.Embedding:
            e = nn.Embedding(n, d, dtype=dtype)
            with torch.no_grad():
                e.weight.copy_(gauss(std, n, d))
            return e

        self.embed = table(vocab_size, 1 / math.sqrt(d))
        if "back" in positions:
            self.pos_back = table(max_len, 0.1 / math.sqrt(d))
        if "start" in positions:
            self.pos_start = table(max_len, 0.1 / math.sqrt(d))
        self.register_buffer("ignore", torch.zeros(vocab_size, dtype=torch.bool) if ignore is None else ignore.bool())
        if match:
            self.match_vec = nn.Parameter(gauss(1 / math.sqrt(d), d))
        if query == "question":
            self.summary = nn.Parameter(gauss(1 / math.sqrt(d), d, d))  # question mean -> query
        if encoder == "conv":
            self.convs = nn.ModuleList()
            for _ in range(layers):
                c = nn.Conv1d(d, d, window, padding=window // 2, dtype=dtype)
                with torch.no_grad():
                    c.weight.copy_(gauss(1 / math.sqrt(d * window), *c.weight.shape))
                    c.bias.zero_()
                self.convs.append(c)
        if encoder == "bigru":
            self.gru_fwd = nn.GRU(d, d // 2, batch_first=True, dtype=dtype)
            self.gru_bwd = nn.GRU(d, d // 2, batch_first=True, dtype=dtype)
            with torch.no_grad():
                k = 1 / math.sqrt(d // 2)
                for p in [*self.gru_fwd.parameters(), *self.gru_bwd.parameters()]:
                    p.uniform_(-k, k, generator=generator)
        if values == "map":
            self.value_map = nn.Linear(d, d, dtype=dtype)
            with torch.no_grad():
                self.value_map.weight.copy_(gauss(1 / math.sqrt(d), d, d))
                self.value_map.bias.zero_()
        n_out = d if readout == "words" else n_classes
        self.head = QKOVAttention(d, n_out, generator=generator, **attention_kwargs)
        if ov_init:
            W_QK, W_OV = self.head.effective()
            self.head.set_effective(W_QK, W_OV + ov_init * torch.eye(d, dtype=dtype))

    # --- the head's inputs -------------------------------------------------------------------
    def keys(self, tokens: Tensor, e: Tensor | None = None) -> Tensor:
        """Key vectors ``k`` (B, T, d), zero on padding; the last row is the query's key-side
        vector. Context (positions, match flags, the encoder) enters here and only here.
        ``e``: ``embed(tokens)`` if already computed (one embedding lookup per forward)."""
        T = tokens.shape[-1]
        real = (tokens != PAD_ID)[..., None]
        x = self.embed(tokens) if e is None else e
        cols = torch.arange(T, device=tokens.device)
        if "back" in self.positions:
            x = x + self.pos_back(T - 1 - cols)
        if "start" in self.positions:
            n_pad = (~real[..., 0]).sum(-1, keepdim=True)
            x = x + self.pos_start((cols - n_pad).clamp_min(0))
        if self.match:
            m = squad.question_match(tokens, self.sep_id, self.ignore)
            x = x + m[..., None].to(x.dtype) * self.match_vec
        x = x * real  # zero padding: left padding changes no real position
        if self.encoder == "conv":
            for conv in self.convs:
                # contiguous before the ReLU: its backward is ~8x slower when its input and incoming gradient
                # are laid out in transposed orders (conv output (d, T) against the residual's (T, d))
                x = (x + F.relu(conv(x.transpose(-1, -2)).transpose(-1, -2).contiguous())) * real
        elif self.encoder == "bigru":
            x = (x + self._bigru(x, real[..., 0])) * real
        return x

    def _bigru(self, x: Tensor, real: Tensor) -> Tensor:
        """Both GRU directions over each row's real tokens only: the forward GRU runs over the row
        rotated so its tokens come first, the backward one over the reversed row (pads last)."""
        T = x.shape[1]
        shift = T - real.sum(1)  # leading pads per row
        ar = torch.arange(T, device=x.device)[None]
        first = ((ar + shift[:, None]) % T)[..., None].expand_as(x)
        back = ((ar - shift[:, None]) % T)[..., None]
        f = self.gru_fwd(torch.gather(x, 1, first))[0]
        f = torch.gather(f, 1, back.expand(-1, -1, f.shape[-1]))
        b = self.gru_bwd(x.flip(1))[0].flip(1)
        return torch.cat([f, b], -1)

    def query_vector(self, tokens: Tensor, k: Tensor, e: Tensor | None = None) -> Tensor:
        """The head's query (B, d): the key vector at the last position, plus for
        ``query="question"`` ``summary @ mean of e(w)`` over the question's words."""
        q = k[..., -1, :]
        if self.query == "question":
            qm = squad.question_mask(tokens, self.sep_id).to(k.dtype)
            w = qm / qm.sum(-1, keepdim=True).clamp_min(1.0)
            e = self.embed(tokens) if e is None else e
            q = q + torch.linalg.vecdot(e, w[..., None], dim=-2) @ self.summary.T
        return q

    def value_vectors(self, tokens: Tensor, e: Tensor | None = None) -> Tensor:
        """Token-local value vectors ``v`` (B, T, d): ``e(t_i)``, or ``e + relu(W e)`` per token."""
        e = self.embed(tokens) if e is None else e
        return e + F.relu(self.value_map(e)) if self.values == "map" else e

    # --- forward -----------------------------------------------------------------------------
    def head_output(self, tokens: Tensor, key_mask: Tensor, attention: Tensor | None = None,
                    e: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(o (B, n_out), attention (B, T))``: ``o = W_OV sum_i alpha_i v_i`` (``relative``:
        ``alpha_i - u_i``). ``attention`` (B, T), if given, replaces the head's softmax row."""
        if tokens.dim() != 2 or key_mask.shape != tokens.shape:
            raise ValueError(f"expected tokens (B, T) and key_mask (B, T), got {tuple(tokens.shape)}, {tuple(key_mask.shape)}")
        T = tokens.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_len {self.max_len}")
        key_mask = key_mask.bool()
        e = self.embed(tokens) if e is None else e
        v = self.value_vectors(tokens, e)
        if attention is None:
            if not _batched(key_mask) and not bool(key_mask.any(1).all()):
                raise ValueError("every sequence needs at least one attendable key")
            k = self.keys(tokens, e)
            q = self.query_vector(tokens, k, e)
            # the query's own column scores the query vector (it stands at the last position); the other
            # columns the keys: no (B, T, d) copy of the keys with the last row replaced
            s = torch.cat([self.head.scores(k[..., :-1, :], q), self.head.scores(q[..., None, :], q)], dim=-1)
            attention = torch.softmax(s.masked_fill(~key_mask, float("-inf")), dim=-1)
        elif attention.shape != tokens.shape:
            raise ValueError(f"attention must have the shape of tokens {tuple(tokens.shape)}, got {tuple(attention.shape)}")
        elif not _batched(attention) and (bool((attention[~key_mask] != 0).any())
                                          or not torch.allclose(attention.sum(1).double(), torch.ones(len(attention), dtype=torch.float64), atol=1e-5)):
            raise ValueError("a given attention row must be zero off the keys and sum to 1")
        w = attention
        if self.relative:
            km = key_mask.to(v.dtype)
            w = attention - km / km.sum(-1, keepdim=True)
        ctx = torch.linalg.vecdot(v, w[..., None], dim=-2)  # sum_i w_i v_i, (B, d)
        return ctx @ self.head.W_OV_eff().T, attention

    def readout_logits(self, o: Tensor, tokens: Tensor, key_mask: Tensor, e: Tensor | None = None) -> Tensor:
        """Logits (B, C) from the head output ``o`` alone: ``o`` (class readout), or (words) one
        logit ``e(w) . o`` per distinct word ``w`` at the attendable keys, stored in the class of
        the word's first key position ``j`` counted back from the query (``c = T - 1 - j``, as
        SQuAD's targets), and ``-inf`` for every other class. A softmax over these classes is the
        softmax over the paragraph's distinct words; the score itself is position-free."""
        if self.readout == "class":
            return o
        # e(t_i) . o at every position: O(T d) per row instead of O(V d); later copies of a word
        # get -inf, so each distinct word is one candidate, not one per occurrence
        score = torch.linalg.vecdot(self.embed(tokens) if e is None else e, o[..., None, :])
        T = tokens.shape[-1]
        # class c = position T - 1 - c
        logits = score.masked_fill(~self._first_keys(tokens, key_mask), float("-inf")).flip(-1)
        if self.n_classes > T:
            logits = F.pad(logits, (0, self.n_classes - T), value=float("-inf"))
        return logits

    def _first_keys(self, tokens: Tensor, key_mask: Tensor) -> Tensor:
        """(..., T) bool: the keys whose word occurs at no earlier key of the row."""
        ids, order = torch.where(key_mask, tokens, self.vocab_size).sort(dim=-1, stable=True)  # earliest first
        new = torch.cat([torch.ones_like(ids[..., :1], dtype=torch.bool), ids[..., 1:] != ids[..., :-1]], -1)
        return torch.zeros_like(new).scatter(-1, order, new) & key_mask  # back to positions

    def forward(self, tokens: Tensor, key_mask: Tensor, attention: Tensor | None = None) -> tuple[Tensor, Tensor]:
        e = self.embed(tokens)  # one lookup shared by keys, query, values and readout
        o, attn = self.head_output(tokens, key_mask, attention, e)
        return self.readout_logits(o, tokens, key_mask.bool(), e), attn

    # --- a stack of models with an explicit model dimension ------------------------------------
    def stacked_forward(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tokens: Tensor,
                        key_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The forward of ``M`` models of this architecture at once, ``(logits (M, n, C), attention
        (M, n, T))``: ``params`` are every parameter stacked (M, ...), ``buffers`` one model's buffers
        (shared by the stack), ``tokens``/``key_mask`` (n, T) for every model or (M, n, T), one set per
        model. The same products as :meth:`forward` per model, in another summation order.

        Why not ``torch.func.vmap`` of :meth:`forward`: activations here are laid out (rows, positions,
        models, width), so the convolutions of all models are one channels-last grouped convolution
        (models as groups) whose outputs need no transposes, and the embedding lookups of all models
        one lookup into the (M * V, d) table."""
        if self.encoder == "bigru":
            raise ValueError("the bigru encoder trains one model per stack (no stacked GRU here, nor under vmap)")
        shared = tokens.dim() == 2
        if key_mask.shape != tokens.shape or tokens.dim() not in (2, 3):
            raise ValueError(f"expected tokens and key_mask (n, T) or (M, n, T), got {tuple(tokens.shape)}, "
                             f"{tuple(key_mask.shape)}")
        E = params["embed.weight"]
        M, V, d = E.shape
        n, T = tokens.shape[-2:]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_len {self.max_len}")
        key_mask = key_mask.bool()

        def lay(t: Tensor) -> Tensor:  # a per-row (n, T) or per-model (M, n, T) table as (n, T, M or 1)
            return t[..., None] if shared else t.permute(1, 2, 0)

        def rows(f, *args) -> Tensor:  # f of (N, T) rows (the squad masks count along dim 1), laid out
            return lay(f(tokens.reshape(-1, T), *args).view(tokens.shape))

        def per_model(x: Tensor, w: Tensor) -> Tensor:  # (n, M, i) times each model's (M, o, i)^T: (n, M, o)
            return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)

        def table(w: Tensor, idx: Tensor) -> Tensor:  # rows idx (n, T, M or 1) of each model's (M, L, d) table
            return _Rows.apply(w.reshape(-1, d), lay(idx) + torch.arange(M, device=idx.device) * w.shape[1])

        real = lay(tokens != PAD_ID)[..., None].to(E.dtype)  # (n, T, M or 1, 1)
        km = lay(key_mask)
        e = table(E, tokens)  # (n, T, M, d)
        # what a key adds to e (its position counted back, its match flag) is a row of one small table per
        # model, [pos_back; pos_back + match_vec; 0], looked up with the zero row on padding: the keys
        # x = row + e * real in one pass, where each term and the masking took one (the match term two)
        cols = torch.arange(T, device=tokens.device)
        back = params["pos_back.weight"] if "back" in self.positions else E.new_zeros(M, 1, d)
        at = (T - 1 - cols if "back" in self.positions else torch.zeros_like(cols)).expand(tokens.shape)
        parts = [back]
        if self.match:
            parts.append(back + params["match_vec"][:, None])
            matched = squad.question_match(tokens.reshape(-1, T), self.sep_id, buffers["ignore"]).view(tokens.shape)
            at = at + back.shape[1] * matched
        parts.append(E.new_zeros(M, 1, d))
        at = at.masked_fill(tokens == PAD_ID, back.shape[1] * (len(parts) - 1))
        x = torch.addcmul(table(torch.cat(parts, 1), at), e, real)
        if "start" in self.positions:
            n_pad = (tokens == PAD_ID).sum(-1, keepdim=True)
            x = torch.addcmul(x, table(params["pos_start.weight"], (cols - n_pad).clamp_min(0)), real)
        for i in range(len(self.convs) if self.encoder == "conv" else 0):
            W, b = params[f"convs.{i}.weight"], params[f"convs.{i}.bias"]
            k = W.shape[-1]
            # (n, T, M * d) is a channels-last (n, M * d, 1, T) image: one grouped convolution, no copies
            # (views only: squeeze and unsqueeze keep the gradient's layout, an index would copy it)
            y = F.conv2d(x.reshape(n, T, M * d).transpose(1, 2).unsqueeze(2), W.reshape(M * d, d, 1, k), b.reshape(-1),
                         padding=(0, k // 2), groups=M).squeeze(2).transpose(1, 2).reshape(n, T, M, d)
            # (x + relu(y)) * real, x being zero on padding: the gradient reaching x is the incoming one,
            # which differs on padding only, where it meets nothing but the zeroing of the first x
            x = torch.addcmul(x, F.relu(y), real)
        q = x[:, -1]  # (n, M, d)
        if self.query == "question":
            qm = rows(squad.question_mask, self.sep_id).to(x.dtype)
            w = qm / qm.sum(1, keepdim=True).clamp_min(1.0)
            z = per_model(torch.linalg.vecdot(e, w[..., None], dim=1), params["summary"])
            q = q + z
        u = per_model(per_model(q, params["head.W_Q"]), params["head.W_K"].transpose(1, 2)) \
            if "head.W_Q" in params else per_model(q, params["head.W_QK"])
        # every column scores its key, the last one x[:, -1] . u; the query vector q = x[:, -1] + z there
        # (z . u added), without slicing x: a slice's backward zero-fills an activation-sized gradient
        s = torch.linalg.vecdot(x, u[:, None])  # (n, T, M)
        if self.query == "question":
            s = torch.cat([s[:, :-1], (s[:, -1] + torch.linalg.vecdot(z, u))[:, None]], 1)
        attention = torch.softmax(s.masked_fill(~km, float("-inf")), dim=1)  # (n, T, M)
        v = e if self.values == "embed" else e + F.relu(
            per_model(e.reshape(n * T, M, d), params["value_map.weight"]).reshape(n, T, M, d) + params["value_map.bias"])
        w = attention
        if self.relative:
            kmf = km.to(v.dtype)
            w = attention - kmf / kmf.sum(1, keepdim=True)
        ctx = torch.linalg.vecdot(v, w[..., None], dim=1)  # (n, M, d)
        o = per_model(ctx, torch.bmm(params["head.W_O"], params["head.W_V"]) if "head.W_V" in params
                      else params["head.W_OV"])
        attention = attention.permute(2, 0, 1)
        if self.readout == "class":
            return o.transpose(0, 1), attention
        score = torch.linalg.vecdot(e, o[:, None]).masked_fill(~lay(self._first_keys(tokens, key_mask)), float("-inf"))
        logits = score.permute(2, 0, 1).flip(-1)  # (M, n, T), class c = position T - 1 - c
        if self.n_classes > T:
            logits = F.pad(logits, (0, self.n_classes - T), value=float("-inf"))
        return logits, attention


class _Rows(torch.autograd.Function):
    """Rows ``idx`` (...) of a table ``w`` (R, d): (..., d), as ``F.embedding``; the gradient (R, d)
    is zeros with the incoming rows added at ``idx`` (``index_add_``), about three times faster on
    CPU than ``F.embedding``'s dense backward for the stacked tables (18 x 15,000 rows)."""

    @staticmethod
    def forward(ctx, w: Tensor, idx: Tensor) -> Tensor:
        ctx.save_for_backward(idx)
        ctx.rows = w.shape[0]
        return F.embedding(idx, w)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        (idx,) = ctx.saved_tensors
        d = g.shape[-1]
        return g.new_zeros(ctx.rows, d).index_add_(0, idx.reshape(-1), g.reshape(-1, d)), None


def for_dataset(ds: TextDataset, d_model: int, generator: torch.Generator | None = None, **options: Any) -> HeadModel:
    """A :class:`HeadModel` sized for ``ds`` (vocabulary, classes, padded length); on a SQuAD
    dataset ``sep_id`` and the match ``ignore`` table (:func:`qkov_lib.data.squad.ignore_table`)
    are filled in. ``options`` are the model's keyword arguments."""
    if squad.SEP in ds.vocab:
        options.setdefault("sep_id", ds.vocab.index(squad.SEP))
        options.setdefault("ignore", squad.ignore_table(ds.vocab))
    return HeadModel(ds.vocab_size, d_model, ds.n_classes, ds.max_len, generator=generator, **options)


@torch.no_grad()
def predict_by_length(model: HeadModel, data: Batch, rows: int = 512) -> tuple[Tensor, Tensor]:
    """``(attention (N, T), probabilities (N, C) float64)`` of ``model`` on ``data``, as
    :func:`qkov_lib.train.predict`, computed on the rows shortest first, ``rows`` at a time, each group cut
    to its longest row: the left-padding columns every row of the group has are dropped. A
    :class:`HeadModel`'s output does not depend on left padding (positions count back from the query and
    from the first word, padding is zeroed before the encoder and gets no attention), so the result is the
    same up to float rounding, at the cost of the rows' real lengths instead of ``T``. Rows come back in
    their own order; attention is zero on the dropped columns."""
    from qkov_lib.train import predict

    if not isinstance(model, HeadModel):
        raise TypeError(f"predict_by_length needs a HeadModel (its output ignores left padding), got {type(model).__name__}")
    N, T = data.tokens.shape
    attn = torch.zeros(N, T, dtype=model.embed.weight.dtype, device=data.tokens.device)
    probs = None
    for idx, t in length_groups(data.tokens, rows):
        b = data.index(idx)
        a, p = predict(model, Batch(b.tokens[:, T - t:], b.key_mask[:, T - t:], b.relevant[:, T - t:], b.y, b.weight))
        attn[idx, T - t:] = a.to(attn.dtype)
        if probs is None:
            probs = torch.empty(N, p.shape[1], dtype=p.dtype, device=p.device)
        probs[idx] = p
    if probs is None:
        raise ValueError("predict_by_length needs at least one row")
    return attn, probs


# --- SQuAD as a word task ------------------------------------------------------------------
def _word_batch(b: Batch, sep_id: int) -> tuple[Batch, dict[str, int], Tensor]:
    """The rows of a SQuAD position batch whose answer-start word occurs once among its context
    keys and not in its question, with ``relevant`` = that word's position (``y``, its distance
    back from the query, is kept); the drop counts and the kept row indices."""
    T = b.tokens.shape[1]
    rows = torch.arange(len(b))
    pos = T - 1 - b.y  # y = distance of the answer's first word back from the query
    word = b.tokens[rows, pos]
    ctx = b.key_mask & squad.context_mask(b.tokens, sep_id)
    n_in_ctx = ((b.tokens == word[:, None]) & ctx).sum(1)
    in_q = ((b.tokens == word[:, None]) & squad.question_mask(b.tokens, sep_id)).any(1)
    not_key = ~ctx[rows, pos]
    repeated = (n_in_ctx > 1) & ~not_key
    keep = ~not_key & ~repeated & ~in_q
    counts = {"answer_word_not_a_context_key": int(not_key.sum()), "answer_word_repeated_in_paragraph": int(repeated.sum()),
              "answer_word_in_question": int((in_q & ~not_key & ~repeated).sum()), "kept": int(keep.sum())}
    idx = keep.nonzero()[:, 0]
    relevant = torch.zeros_like(b.relevant[idx])
    relevant[torch.arange(len(idx)), pos[idx]] = True
    return Batch(b.tokens[idx], b.key_mask[idx], relevant, b.y[idx]), counts, idx


def word_task(ds: TextDataset) -> TextDataset:
    """SQuAD (a :mod:`qkov_lib.data.squad` dataset, target = position of the answer's first
    word counted back from the query) cast for the ``words`` readout: ``y`` stays that position,
    which names the answer's first word (the readout scores each distinct word at its first
    position), and ``relevant`` is the word's position (the token the answer must be copied
    from). Only the questions whose answer-start word occurs once among the context keys and not
    in the question are kept (so the word names one position and cannot be read off the
    question); the report counts each reason for a drop, per split (``<split>_word_task_*``),
    and ``*_info`` columns follow the kept rows. The input dataset is not changed."""
    if squad.SEP not in ds.vocab:
        raise ValueError(f"dataset {ds.name!r} has no {squad.SEP} token; word_task needs SQuAD")
    sep_id = ds.vocab.index(squad.SEP)
    report, out = dict(ds.report), {}
    infos = {"train": ds.train_info, "test": ds.test_info}
    for split in ("train", "test"):
        b, counts, idx = _word_batch(getattr(ds, split), sep_id)
        if counts["kept"] == 0:
            raise ValueError(f"word_task: no {split} question passes the filter ({counts})")
        report.update({f"{split}_word_task_{k}": v for k, v in counts.items()})
        keep = idx.tolist()
        out[split] = (b, {k: [col[i] for i in keep] for k, col in infos[split].items()})
    notes = [n for n in ds.notes if n != squad.POSITION_TARGET_NOTE]  # the word target below replaces it
    notes.insert(0, "SQuAD v1.1 as a copy task over words (our reconstruction): input question <sep> context, query "
                 "token = question wh-type. Target: the answer's first word, scored over the paragraph's distinct "
                 "words; kept: questions whose answer-start word occurs once in the paragraph and not in the question.")
    return TextDataset(ds.name, out["train"][0], out["test"][0], list(ds.vocab), list(ds.class_names), report,
                       out["train"][1], out["test"][1], notes, ds.query_is_key)


# --- how much of the accuracy the head's attention carries ----------------------------------
def tie_accuracy(logits: Tensor, y: Tensor) -> Tensor:
    """(N,) expected accuracy with ties broken at random: ``1/k`` when the gold class is one of
    the ``k`` classes with the largest logit, else 0 (all-equal logits give chance, not class 0)."""
    top = logits == logits.max(-1, keepdim=True).values
    return top.gather(1, y[:, None])[:, 0].double() / top.sum(-1).double()


def _relevant_rows(model: HeadModel, data: Batch, what: str) -> tuple[Tensor, int]:
    """``(idx, n_without)``: the indices of the rows of ``data`` that have a relevant key among
    their attendable keys (the only rows on which the oracle row is defined) and the count of the
    others; TypeError/ValueError naming ``what`` (the calling function) on bad input."""
    if not isinstance(model, HeadModel):
        raise TypeError(f"{what} needs a HeadModel (it replaces the head's attention), got {type(model).__name__}")
    if not isinstance(data, Batch):
        raise TypeError(f"data must be a Batch, got {type(data).__name__}")
    has = (data.relevant.bool() & data.key_mask.bool()).any(1)
    if not bool(has.any()):
        raise ValueError("no row of data has a relevant key: the oracle attention is undefined")
    return has.nonzero()[:, 0], int((~has).sum())


def _reference_rows(data: Batch, idx: Tensor, chunk: int, dtype: torch.dtype) -> Iterator[tuple[Batch, Tensor, Tensor]]:
    """``(rows, uniform, oracle)`` per chunk of at most ``chunk`` of the rows ``idx``: the
    sub-batch and two (n, T) attention rows in ``dtype``, uniform over the attendable keys and the
    oracle, all mass spread evenly over the relevant keys (both built in float64, then cast)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    for s in range(0, len(idx), chunk):
        b = data.index(idx[s:s + chunk])
        k = b.key_mask.bool()
        r = b.relevant.bool() & k
        uniform = k.double() / k.sum(1, keepdim=True)
        oracle = r.double() / r.sum(1, keepdim=True)
        yield b, uniform.to(dtype), oracle.to(dtype)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block, its own mode restored after (also on an error)."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


@torch.no_grad()
def necessity(model: HeadModel, data: Batch, chunk: int = 1024) -> dict[str, float]:
    """Accuracy of ``model`` on ``data`` with three attention rows at the head: its own
    (``model``), uniform over the same keys (``uniform``) and the oracle, all mass spread evenly
    over the relevant keys (``oracle``), next to ``chance`` (the expected accuracy of a uniform
    guess among the candidate classes, those with a finite logit). Measured on the ``n`` rows
    that have a relevant key (``n_without_relevant`` rows have none and are left out). Ties
    between top logits count ``1/k`` (:func:`tie_accuracy`). Fractions in [0, 1]."""
    idx, n_without = _relevant_rows(model, data, "necessity")
    sums = {"model": 0.0, "uniform": 0.0, "oracle": 0.0, "chance": 0.0}
    with _eval_mode(model):
        for b, uniform, oracle in _reference_rows(data, idx, chunk, model.embed.weight.dtype):
            for name, attn in (("model", None), ("uniform", uniform), ("oracle", oracle)):
                logits, _ = model(b.tokens, b.key_mask, attn)
                sums[name] += float(tie_accuracy(logits, b.y).sum())
            sums["chance"] += float((1.0 / torch.isfinite(logits).sum(-1).double()).sum())
    n = len(idx)
    return {**{k: v / n for k, v in sums.items()}, "n": n, "n_without_relevant": n_without}


# --- from the model's own attention to the oracle, in steps ---------------------------------
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def check_alphas(alphas: Sequence[float]) -> list[float]:
    """``alphas`` as sorted floats after checking that they are a non-empty sequence of distinct
    finite real numbers in [0, 1] (TypeError/ValueError otherwise)."""
    if isinstance(alphas, (str, bytes)) or not isinstance(alphas, (Sequence, np.ndarray)):
        raise TypeError(f"alphas must be a sequence of numbers in [0, 1], got {type(alphas).__name__}")
    out = []
    for a in alphas:
        if isinstance(a, bool) or not isinstance(a, numbers.Real):
            raise TypeError(f"every alpha must be a real number, got {a!r} ({type(a).__name__})")
        if not math.isfinite(a) or not 0.0 <= a <= 1.0:
            raise ValueError(f"every alpha must be finite and in [0, 1] (0: the model's row, 1: the oracle), got {a!r}")
        out.append(float(a))
    if not out:
        raise ValueError("alphas is empty: give at least one mixing weight in [0, 1]")
    if len(set(out)) != len(out):
        raise ValueError(f"alphas must be distinct, got {list(alphas)}")
    return sorted(out)


@torch.no_grad()
def graded_intervention(model: HeadModel, data: Batch, alphas: Sequence[float] = ALPHAS,
                        chunk: int = 1024) -> pd.DataFrame:
    """Accuracy of ``model`` on ``data`` when the head's attention row is replaced by
    ``(1 - alpha) * own + alpha * oracle``: ``own`` the row the model computes itself, ``oracle``
    all mass spread evenly over the relevant keys. One row per alpha (sorted): ``alpha``,
    ``accuracy`` (tie-aware, :func:`tie_accuracy`; a fraction in [0, 1]) and ``n``, the rows of
    ``data`` that have a relevant key (the rows of :func:`necessity`). Alpha 0 gives exactly
    :func:`necessity`'s ``model`` column and alpha 1 exactly its ``oracle`` column
    (``1 * x + 0 * y = x`` in floating point). The accuracy between the ends says whether moving
    the attention toward the annotations helps the model or costs it."""
    alphas = check_alphas(alphas)
    idx, _ = _relevant_rows(model, data, "graded_intervention")
    sums = [0.0] * len(alphas)
    with _eval_mode(model):
        for b, _, oracle in _reference_rows(data, idx, chunk, model.embed.weight.dtype):
            _, own = model(b.tokens, b.key_mask)
            for i, a in enumerate(alphas):
                logits, _ = model(b.tokens, b.key_mask, (1.0 - a) * own + a * oracle)
                sums[i] += float(tie_accuracy(logits, b.y).sum())
    n = len(idx)
    return pd.DataFrame({"alpha": alphas, "accuracy": [s / n for s in sums], "n": n})


def intervention_frame(models: Mapping[Any, HeadModel], data: Batch, alphas: Sequence[float] = ALPHAS,
                       names: Sequence[str] | None = None, chunk: int = 1024) -> pd.DataFrame:
    """:func:`graded_intervention` of every model on the same ``data``, one row per (model,
    alpha): the model's key in the columns ``names`` (a key of ``len(names)`` values, e.g.
    ``names=("ratio", "seed")`` for (ratio, seed) keys; a plain key with one name), then
    ``alpha``, ``accuracy`` and ``n``. ``names=None``: the key as it is in one column ``key``."""
    if not isinstance(models, Mapping) or not models:
        raise ValueError("models must be a non-empty mapping {key: HeadModel}")
    alphas = check_alphas(alphas)
    plain = names is None
    names = ["key"] if plain else list(names)
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"names must be distinct column names, got {names!r}")
    if set(names) & {"alpha", "accuracy", "n"}:
        raise ValueError(f"names must not reuse the columns alpha, accuracy and n, got {names!r}")
    frames = []
    for key, model in models.items():
        values = (key,) if plain or (len(names) == 1 and not isinstance(key, tuple)) else key
        if not isinstance(values, tuple) or len(values) != len(names):
            raise ValueError(f"key {key!r} does not have one value per name in {names}")
        f = graded_intervention(model, data, alphas, chunk)
        for n, v in reversed(list(zip(names, values))):
            f.insert(0, n, [v] * len(f))
        frames.append(f)
    return pd.concat(frames, ignore_index=True)


def endpoint_means(frame: pd.DataFrame, over: str | None = "seed") -> pd.DataFrame:
    """The two ends of an :func:`intervention_frame`, averaged over the column ``over`` (the
    seeds; None: no averaging) within each group of the other key columns: those columns, then
    ``model`` (mean accuracy at alpha 0), ``oracle`` (at alpha 1), ``seeds`` (models averaged) and
    ``oracle_below_model`` (``oracle < model``). Raises ValueError when alpha 0 or alpha 1 is
    missing, when ``over`` is not a key column, or when a group has unequal counts at the ends."""
    need = {"alpha", "accuracy"}
    if not isinstance(frame, pd.DataFrame) or not need <= set(frame.columns):
        raise ValueError("frame must be an intervention_frame (columns alpha and accuracy)")
    keys = [c for c in frame.columns if c not in ("alpha", "accuracy", "n")]
    if over is not None and over not in keys:
        raise ValueError(f"over={over!r} is not a key column of the frame (key columns: {keys})")
    groups = [c for c in keys if c != over]
    ends = {}
    for name, a in (("model", 0.0), ("oracle", 1.0)):
        rows = frame[frame["alpha"] == a]
        if rows.empty:
            raise ValueError(f"the frame has no alpha = {a:g} ({name}); include 0 and 1 in alphas")
        ends[name] = rows.groupby(groups, sort=True)["accuracy"].agg(["mean", "size"]) if groups else \
            pd.DataFrame({"mean": [rows["accuracy"].mean()], "size": [len(rows)]})
    if not ends["model"].index.equals(ends["oracle"].index) or not ends["model"]["size"].equals(ends["oracle"]["size"]):
        raise ValueError("alpha 0 and alpha 1 must be measured on the same models in every group")
    out = pd.DataFrame({"model": ends["model"]["mean"], "oracle": ends["oracle"]["mean"],
                        "seeds": ends["model"]["size"]})
    out["oracle_below_model"] = out["oracle"] < out["model"]
    return out.reset_index(drop=not groups)


def oracle_below_model(frame: pd.DataFrame, over: str | None = "seed") -> bool:
    """Whether the oracle's accuracy (alpha 1) is below the model's own (alpha 0) on the means over
    ``over`` (the seeds) in every group of the other key columns (:func:`endpoint_means`). When it
    is, moving the head's attention onto the annotated tokens costs accuracy: the model predicts
    from other tokens, and attention-annotation agreement measures agreement with the annotations,
    not what the model uses."""
    return bool(endpoint_means(frame, over)["oracle_below_model"].all())
