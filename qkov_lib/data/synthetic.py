"""The distinct/common-token task of the paper's synthetic experiments.

Vocabulary: ``K`` distinct tokens (ids ``0..K-1``, one per class), ``M`` common tokens
(ids ``K..K+M-1``, no class information), one query token (id ``K+M``) and a padding token
(id ``K+M+1``, zero embedding). A sequence holds exactly one distinct token, of class ``y``,
at a random position among ``n`` common tokens drawn uniformly with replacement; the query
comes last and the target is ``y``. ``n`` is drawn per sequence from ``n_common``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qkov_lib.data.batch import Batch, left_pad

EMBEDDINGS = ("onehot", "gaussian")


@dataclass(frozen=True)
class SyntheticTask:
    """Task sizes: ``n_classes`` (K), ``n_common_vocab`` (M), the set ``n_common`` of
    common-token counts per sequence, the embedding kind and width, and whether the query
    position is itself a key."""

    n_classes: int = 4
    n_common_vocab: int = 6
    n_common: tuple[int, ...] = (2, 4, 6)
    embedding: str = "onehot"
    d_model: int | None = None
    query_is_key: bool = False

    def __post_init__(self) -> None:
        if self.n_classes < 2 or self.n_common_vocab < 1:
            raise ValueError("need n_classes >= 2 and n_common_vocab >= 1")
        if not self.n_common or min(self.n_common) < 1:
            raise ValueError(f"n_common must be a non-empty set of counts >= 1, got {self.n_common}")
        if self.embedding not in EMBEDDINGS:
            raise ValueError(f"unknown embedding {self.embedding!r}; expected one of {EMBEDDINGS}")
        if self.embedding == "onehot" and self.d_model not in (None, self.vocab_size):
            raise ValueError(f"one-hot embeddings need d_model = vocab_size = {self.vocab_size}")
        object.__setattr__(self, "n_common", tuple(sorted(set(int(n) for n in self.n_common))))

    @property
    def distinct_ids(self) -> list[int]:
        return list(range(self.n_classes))

    @property
    def common_ids(self) -> list[int]:
        return list(range(self.n_classes, self.n_classes + self.n_common_vocab))

    @property
    def query_id(self) -> int:
        return self.n_classes + self.n_common_vocab

    @property
    def pad_id(self) -> int:
        return self.query_id + 1

    @property
    def vocab_size(self) -> int:
        """Tokens with an embedding of their own (distinct, common, query); padding excluded."""
        return self.query_id + 1

    @property
    def width(self) -> int:
        """Embedding width d."""
        return self.vocab_size if self.embedding == "onehot" else int(self.d_model or self.vocab_size)

    @property
    def seq_len(self) -> int:
        """Padded length T: the longest content plus the query."""
        return max(self.n_common) + 2


def make_embeddings(task: SyntheticTask, generator: torch.Generator | None = None,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """Embedding table (V + 1, d): one-hot rows, or unit-norm Gaussian rows; the last row
    (padding) is zero."""
    V, d = task.vocab_size, task.width
    if task.embedding == "onehot":
        E = torch.eye(V, dtype=dtype)
    else:
        E = torch.randn(V, d, generator=generator, dtype=dtype)
        E = E / E.norm(dim=1, keepdim=True)
    return torch.cat([E, torch.zeros(1, d, dtype=dtype)])


def _masks(task: SyntheticTask, tokens: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    key_mask = real.clone()
    if not task.query_is_key:
        key_mask[:, -1] = False
    relevant = tokens < task.n_classes
    return key_mask, relevant


def sample(task: SyntheticTask, n: int, generator: torch.Generator) -> Batch:
    """``n`` i.i.d. sequences: class uniform, common count uniform over ``task.n_common``,
    common tokens uniform with replacement, distinct token at a uniform position."""
    if n < 1:
        raise ValueError(f"need n >= 1 sequences, got {n}")
    K, M = task.n_classes, task.n_common_vocab
    counts = torch.tensor(task.n_common)
    y = torch.randint(K, (n,), generator=generator)
    n_c = counts[torch.randint(len(counts), (n,), generator=generator)]
    commons = torch.randint(M, (n, max(task.n_common)), generator=generator) + K
    pos = (torch.rand(n, generator=generator) * (n_c + 1)).long()
    seqs = []
    for i in range(n):
        c = commons[i, : n_c[i]].tolist()
        c.insert(int(pos[i]), int(y[i]))
        seqs.append(c + [task.query_id])
    tokens, real = left_pad(seqs, task.pad_id, task.seq_len)
    key_mask, relevant = _masks(task, tokens, real)
    return Batch(tokens, key_mask, relevant, y)


def population_size(task: SyntheticTask) -> int:
    """Number of distinct (class, multiset of common tokens) rows :func:`population` enumerates."""
    M = task.n_common_vocab
    return task.n_classes * sum(math.comb(M + n - 1, n) for n in task.n_common)


def population(task: SyntheticTask, max_rows: int = 200_000) -> Batch:
    """The exact data distribution as a weighted batch: one row per class and multiset of
    common tokens, weighted by its probability. Without positional information the model
    sees a sequence only through this multiset, so the weighted loss is the population loss.
    Raises ValueError when there are more than ``max_rows`` rows (sample a large batch then)."""
    size = population_size(task)
    if size > max_rows:
        raise ValueError(f"the population has {size} rows (> max_rows={max_rows}); use sample() instead")
    K, M = task.n_classes, task.n_common_vocab
    seqs, weights = [], []
    for n in task.n_common:
        for combo in itertools.combinations_with_replacement(range(M), n):
            mult = math.factorial(n)
            for _, grp in itertools.groupby(combo):
                mult //= math.factorial(len(list(grp)))
            p = mult / (M ** n) / len(task.n_common) / K
            for y in range(K):
                seqs.append([y] + [K + c for c in combo] + [task.query_id])
                weights.append(p)
    tokens, real = left_pad(seqs, task.pad_id, task.seq_len)
    key_mask, relevant = _masks(task, tokens, real)
    y = torch.tensor([s[0] for s in seqs], dtype=torch.long)
    return Batch(tokens, key_mask, relevant, y, torch.tensor(weights, dtype=torch.float64))
