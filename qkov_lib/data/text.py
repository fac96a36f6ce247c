"""Word-level text datasets for the real-data chapters (SQuAD, HateXplain, SVA).

Every dataset becomes a :class:`TextDataset`: a train and a test :class:`Batch` of LEFT-padded token
ids whose last column is the query (the prediction position), a vocabulary built on the training
examples only (``min_freq``, ``<unk>`` for the rest), class names and a ``report`` of counts -- items
read, skipped (and why), truncated, and truncations that cut a relevant token. Nothing is dropped
silently.

One sequence (length ``T``): ``<pad> ... <pad> w_1 ... w_n q``, ``q`` the query token (``<query>``
or a dataset-specific one). ``key_mask`` is True on the words, False on padding and, by default, on
the query: the keys are the input words, as in the synthetic chapter (``query_is_key=True`` lets
the prediction position attend to itself too). ``relevant`` marks the annotated words (never the query).

Ids: 0 ``<pad>``, 1 ``<unk>``, 2 ``<query>``, then dataset specials, then words by decreasing training
frequency (ties alphabetical), so the vocabulary is deterministic.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from qkov_lib import profiles
from qkov_lib.data.batch import Batch, left_pad, spread

PAD, UNK, QUERY = "<pad>", "<unk>", "<query>"
SPECIALS: tuple[str, ...] = (PAD, UNK, QUERY)
PAD_ID, UNK_ID, QUERY_ID = 0, 1, 2


def real_lengths(tokens: torch.Tensor) -> torch.Tensor:
    """Per row of left-padded ``tokens`` (..., T): the number of columns from its first non-pad token to
    the end (the columns a model that ignores left padding needs), 1 for a row of padding only."""
    real = tokens != PAD_ID
    T = tokens.shape[-1]
    return torch.where(real.any(-1), T - real.int().argmax(-1), torch.ones_like(tokens[..., 0]))


def length_groups(tokens: torch.Tensor, rows: int) -> Iterator[tuple[torch.Tensor, int]]:
    """The rows of left-padded ``tokens`` (N, T) shortest first, ``rows`` at a time: per group its row
    indices and ``t``, its longest row's :func:`real_lengths` (the group needs only the last ``t`` columns)."""
    lengths = real_lengths(tokens)
    order = torch.argsort(lengths, stable=True)
    for i in range(0, len(order), rows):
        idx = order[i:i + rows]
        yield idx, int(lengths[idx].max())


_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def tokenize(text: str, lower: bool = True) -> list[str]:
    """Word-level tokens: runs of word characters, and every other non-space character alone."""
    return [t for t, _, _ in tokenize_spans(text, lower)]


def tokenize_spans(text: str, lower: bool = True) -> list[tuple[str, int, int]]:
    """Tokens of :func:`tokenize` with their character spans ``(token, start, end)`` in ``text``."""
    low = text.lower() if lower else text
    if len(low) != len(text):  # lower-casing changed the length (rare Unicode): lower per token
        return [(m.group().lower(), m.start(), m.end()) for m in _WORD.finditer(text)]
    return [(m.group(), m.start(), m.end()) for m in _WORD.finditer(low)]


@dataclass
class Vocabulary:
    """Token strings by id (``itos``) and the inverse map (``stoi``); unknown words encode to ``<unk>``."""

    itos: list[str]
    stoi: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if list(self.itos[:3]) != list(SPECIALS):
            raise ValueError(f"the vocabulary must start with {SPECIALS}, got {self.itos[:3]}")
        if len(set(self.itos)) != len(self.itos):
            raise ValueError("the vocabulary has duplicate tokens")
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    @classmethod
    def build(cls, token_lists: Iterable[Sequence[str]], min_freq: int = 2,
              specials: Sequence[str] = ()) -> "Vocabulary":
        """The words occurring at least ``min_freq`` times in ``token_lists`` (the training split), after
        ``<pad>``, ``<unk>``, ``<query>`` and ``specials``."""
        if not isinstance(min_freq, int) or min_freq < 1:
            raise ValueError(f"min_freq must be an integer >= 1, got {min_freq!r}")
        counts = Counter(t for toks in token_lists for t in toks)
        head = list(SPECIALS) + [s for s in specials if s not in SPECIALS]
        words = sorted((t for t, c in counts.items() if c >= min_freq and t not in head), key=lambda t: (-counts[t], t))
        return cls(head + words)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """Ids of ``tokens``; words outside the vocabulary become ``<unk>`` (1)."""
        return [self.stoi.get(t, UNK_ID) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.itos[int(i)] for i in ids]


@dataclass
class Example:
    """One item before encoding: words (without the query), relevant word positions, the class id, the
    query token and free-form info (kept per split in ``TextDataset.*_info``)."""

    tokens: list[str]
    relevant: list[int]
    y: int
    query: str = QUERY
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Truncation:
    """Result of :func:`truncate`: kept words, relevant positions re-indexed into them, words cut, relevant ones cut."""

    tokens: list[str]
    relevant: list[int]
    n_cut: int
    n_relevant_cut: int


def truncate(tokens: Sequence[str], relevant: Sequence[int], limit: int, side: str = "right") -> Truncation:
    """Keep at most ``limit`` words: the first (``side="right"`` cuts the end) or the last (``side="left"``
    cuts the start, keeping the words next to the prediction position)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    n = len(tokens)
    if any(not 0 <= r < n for r in relevant):
        raise ValueError(f"relevant positions {list(relevant)} out of range for {n} tokens")
    if n <= limit:
        return Truncation(list(tokens), sorted(set(relevant)), 0, 0)
    start = 0 if side == "right" else n - limit
    keep = range(start, start + limit)
    rel = sorted({r - start for r in relevant if r in keep})
    return Truncation(list(tokens[start:start + limit]), rel, n - limit, len(set(relevant)) - len(rel))


def subsample(items: Sequence[Any], n: int | None, seed: int) -> list[Any]:
    """``n`` items drawn without replacement with ``numpy.random.default_rng(seed)``, in their original
    order (all of them when ``n`` is None or at least ``len(items)``)."""
    if n is None or n >= len(items):
        return list(items)
    if n < 1:
        raise ValueError(f"subsample size must be >= 1, got {n}")
    idx = np.sort(np.random.default_rng(seed).choice(len(items), size=n, replace=False))
    return [items[i] for i in idx]


def encode(examples: Sequence[Example], vocab: Vocabulary, length: int, query_is_key: bool = False) -> Batch:
    """Left-padded :class:`Batch` (N, ``length``): words then the query id in the last column."""
    if not examples:
        raise ValueError("no examples to encode")
    seqs = []
    for ex in examples:
        if ex.query not in vocab.stoi:
            raise ValueError(f"query token {ex.query!r} is not in the vocabulary")
        if len(ex.tokens) + 1 > length:
            raise ValueError(f"an example has {len(ex.tokens)} words; more than the length {length} minus the query")
        seqs.append(vocab.encode(ex.tokens) + [vocab.stoi[ex.query]])
    tokens, real = left_pad(seqs, PAD_ID, length)
    key_mask = real.clone()
    if not query_is_key:
        key_mask[:, -1] = False
    relevant = torch.zeros_like(real)
    for i, (s, ex) in enumerate(zip(seqs, examples)):
        for p in ex.relevant:
            relevant[i, length - len(s) + p] = True  # shifted by the left padding
    y = torch.tensor([ex.y for ex in examples], dtype=torch.long)
    return Batch(tokens, key_mask, relevant, y)


@dataclass
class TextDataset:
    """An encoded dataset. ``train``/``test``: :class:`Batch` (left-padded, query last); ``vocab``: id ->
    token; ``class_names``: class id -> name; ``report``: counts of read, kept, skipped (by reason),
    truncated items; ``train_info``/``test_info``: per-example columns (e.g. ``condition``,
    ``n_attractors``, ``id``); ``notes``: how the data was cast."""

    name: str
    train: Batch
    test: Batch
    vocab: list[str]
    class_names: list[str]
    report: dict[str, int]
    train_info: dict[str, list] = field(default_factory=dict)
    test_info: dict[str, list] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    query_is_key: bool = False

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    @property
    def max_len(self) -> int:
        """Padded length ``T`` (the same for both splits): what ``TokenModel(max_len=...)`` needs."""
        return int(self.train.tokens.shape[1])

    def decode(self, split: str, i: int) -> list[str]:
        """The words of example ``i`` of ``split`` ("train" | "test"), padding removed."""
        b = getattr(self, split)
        return [self.vocab[int(t)] for t, k in zip(b.tokens[i], b.tokens[i] != PAD_ID) if k]

    def report_frame(self):
        """The report as a (split, count) table for display."""
        import pandas as pd

        rows = [{"split": k.split("_", 1)[0], "what": k.split("_", 1)[1], "count": v} for k, v in self.report.items()]
        return pd.DataFrame(rows).pivot(index="what", columns="split", values="count").fillna(0).astype(int)


def finish(name: str, train: Sequence[Example], test: Sequence[Example], class_names: Sequence[str],
           report: dict[str, int], min_freq: int, specials: Sequence[str] = (), query_is_key: bool = False,
           notes: Sequence[str] = ()) -> TextDataset:
    """Build the vocabulary on ``train``, pad both splits to the longest example (+ query) and return the
    :class:`TextDataset`; adds ``*_used``, ``*_unk_tokens`` (words mapped to ``<unk>``) and
    ``all_vocab_size`` to the report."""
    if not train or not test:
        raise ValueError(f"{name}: a split is empty after filtering (train {len(train)}, test {len(test)}); "
                         f"see the report {report}")
    vocab = Vocabulary.build((ex.tokens for ex in train), min_freq, specials)
    length = max(len(ex.tokens) for ex in [*train, *test]) + 1
    rep = dict(report)
    batches = {"train": encode(train, vocab, length, query_is_key), "test": encode(test, vocab, length, query_is_key)}
    for split, exs in (("train", train), ("test", test)):
        rep[f"{split}_used"] = len(exs)
        rep[f"{split}_unk_tokens"] = int((batches[split].tokens == UNK_ID).sum())
    rep["all_vocab_size"] = len(vocab)

    def info(exs: Sequence[Example]) -> dict[str, list]:
        keys = list(dict.fromkeys(k for ex in exs for k in ex.info))
        return {k: [ex.info.get(k) for ex in exs] for k in keys}

    return TextDataset(name, batches["train"], batches["test"], vocab.itos, list(class_names), rep, info(train),
                       info(test), list(notes), query_is_key)


def dry_run_split(split: Batch) -> Batch:
    """An evaluation split (validation or test) as a dry run evaluates it: in a dry run
    (:func:`qkov_lib.profiles.dry_run_active`), its :data:`~qkov_lib.profiles.DRY_RUN_EVAL_ROWS` evenly
    spaced rows (:func:`~qkov_lib.data.batch.spread`, so every condition of a sorted test file stays),
    with the padded length kept; otherwise, or when it is no longer, ``split`` itself."""
    rows = _dry_run_rows(split)
    return split if rows is None else split.index(rows.to(split.tokens.device))


def _dry_run_rows(split: Batch) -> torch.Tensor | None:
    """The rows of ``split`` a dry run evaluates (:func:`~qkov_lib.data.batch.spread`), or None when it
    evaluates them all (no dry run, or a split no longer than the sample)."""
    if not profiles.dry_run_active() or len(split) <= profiles.DRY_RUN_EVAL_ROWS:
        return None
    return spread(len(split), profiles.DRY_RUN_EVAL_ROWS)


def dry_run_dataset(ds: TextDataset) -> TextDataset:
    """``ds`` with its test split (and ``test_info``) as :func:`dry_run_split` evaluates it, its
    training split, vocabulary and padded length unchanged, and a note that says so; ``ds`` itself
    outside a dry run."""
    rows = _dry_run_rows(ds.test)
    if rows is None:
        return ds
    note = (f"Dry run: evaluated on {len(rows):,} evenly spaced of the {len(ds.test):,} test instances "
            "(the training split keeps its size).")
    idx = rows.tolist()
    return replace(ds, test=ds.test.index(rows.to(ds.test.tokens.device)),
                   test_info={k: [v[i] for i in idx] for k, v in ds.test_info.items()},
                   notes=[*ds.notes, note], report=dict(ds.report))


def count(report: dict[str, int], key: str, n: int = 1) -> None:
    """``report[key] += n`` (starting at 0)."""
    report[key] = report.get(key, 0) + n


def capped_words(text: Any, max_len: int, side: str, report: dict[str, int], split: str, what: str) -> list[str] | None:
    """The whitespace tokens of ``text`` cut to ``max_len - 1`` (room for the query) from ``side``; counts
    ``<split>_skipped_empty_<what>`` (and returns None) for an empty text, ``<split>_truncated_<what>_over_cap``
    for a cut one."""
    words = str(text).split()
    if not words:
        count(report, f"{split}_skipped_empty_{what}")
        return None
    t = truncate(words, [], max_len - 1, side=side)
    if t.n_cut:
        count(report, f"{split}_truncated_{what}_over_cap")
    return t.tokens
