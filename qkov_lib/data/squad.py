"""SQuAD v1.1 cast as a copy task for a one-layer attention model (our reconstruction).

* **Input.** ``question words, <sep>, context words, q`` -- lower-cased word tokens; the query token
  ``q`` at the prediction position is ``<q:TYPE>``, the question's wh-type (what, which, who, whom,
  whose, when, where, why, how, how_many, how_much, other: its first wh-word); with
  ``query="plain"`` it is ``<query>`` for every question.
* **Target.** The distance of the answer's first token back from the query (class ``d`` = ``d``
  positions before the prediction position; ``n_classes = max_len``). A copy task over positions:
  the position embeddings are indexed by the same distance, so the OV circuit maps the attended
  token's position embedding to the class of that position (a pointer). Every position within the
  length cap is a candidate; the model has to learn that only context positions hold answers.
* **Relevant tokens.** The positions of the answer span in the context.
* **Keys.** ``keys="all"`` (default): every word (question, ``<sep>`` and context);
  ``keys="context"``: only the context words, the candidates of the answer.
* **Rare words.** With ``oov_buckets=n > 0`` a word seen fewer than ``min_freq`` times in the
  training split (or not at all) becomes ``<oov:k>``, ``k`` = CRC-32 of the word mod ``n``, instead
  of ``<unk>``: a rare word gets the same id in question and context, so an exact-match test on ids
  (:func:`question_match`) still finds it (two rare words share an id with probability ~``1/n``).
* **Splits.** Train: the official train file (``qkov data fetch``) when present, else the curated
  copy rebuilt from the SQuAD explorer pages; either way only the questions whose answer text
  occurs exactly once in the context, counted from the context by :func:`answer_occurrences` (never
  read from a field of the file; the rest counted as ``train_skipped_ambiguous_span``), so both
  files give the same training set. Test: the official dev file, first answer of each question.
* **Bad input.** An ``answer_start`` that does not point at the answer text is corrected by string
  search when the text occurs in the context (counted), else the question is skipped
  (``*_skipped_answer_not_found``). Questions are cut to ``max_question`` words (counted). Contexts
  longer than the remaining cap lose their end: a question whose answer starts beyond the cap is
  skipped (``*_skipped_answer_beyond_cap``), one whose span is only partly cut is kept and counted.
"""

from __future__ import annotations

import bisect
import os
import zlib
from functools import lru_cache
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkov_lib.data import sources
from qkov_lib.data.batch import Batch
from qkov_lib.data.text import PAD_ID, Example, TextDataset, count, finish, tokenize, tokenize_spans, truncate

TRAIN_FILES = ("squad/train-v1.1.json.gz", "squad/train-v1.1-from-explorer.json.gz")  # official first
DEV_FILE = "squad/dev-v1.1.json.gz"
SEP = "<sep>"
WH_TYPES = ("how_many", "how_much", "what", "which", "who", "whom", "whose", "when", "where", "why", "how", "other")
QUERY_TOKENS = tuple(f"<q:{t}>" for t in WH_TYPES)
KEYS = ("all", "context")
# Function words and punctuation that do not count as a match with the question: they occur in
# almost every question and paragraph, so matching them says nothing about where the answer is.
STOPWORDS = frozenset("""a an the of in on at to for from by with and or as is are was were be been being it its
this that these those which what who whom whose when where why how did do does has have had not no
there their they he she his her them than then into during about after before over under between "
' ` , . ? ! ; : ( ) [ ] - -- s""".split())


# The loader's own casting; a model that scores words instead (head_model.word_task) replaces this note.
POSITION_TARGET_NOTE = ("SQuAD v1.1 as a copy task over positions (our reconstruction): input question <sep> context, "
                        "query token = question wh-type, target = distance of the answer's first token from the query.")


def question_type(words: list[str]) -> str:
    """The first wh-word of a tokenised question (``how many``/``how much`` as one type), or ``other``."""
    for i, w in enumerate(words):
        if w == "how":
            nxt = words[i + 1] if i + 1 < len(words) else ""
            return {"many": "how_many", "much": "how_much"}.get(nxt, "how")
        if w in WH_TYPES:
            return w
    return "other"


def answer_occurrences(context: str, text: str) -> int:
    """How many positions of ``context`` the answer ``text`` starts at (overlaps counted; 0 for an empty
    ``text``); an answer that occurs once has an unambiguous span."""
    n, i = 0, context.find(text) if text else -1
    while i >= 0:
        n += 1
        i = context.find(text, i + 1)
    return n


def flatten(articles: Iterable[Mapping[str, Any]]) -> Iterable[dict[str, Any]]:
    """One dict per question from SQuAD's nested ``data`` list: ``id, title, context, question,
    text, answer_start`` (the first answer; None without one). Other fields of the file are ignored."""
    for a in articles:
        for p in a["paragraphs"]:
            for qa in p["qas"]:
                ans = qa["answers"][0] if qa["answers"] else None
                yield {"id": qa["id"], "title": a.get("title"), "context": p["context"], "question": qa["question"],
                       "text": None if ans is None else ans["text"],
                       "answer_start": None if ans is None else int(ans["answer_start"])}


def hub_question(r: Mapping[str, Any]) -> dict[str, Any]:
    """A row of the Hugging Face ``squad`` copy (answers as lists) as a :func:`flatten` question."""
    ans = r["answers"]
    return {"id": r["id"], "title": r.get("title"), "context": r["context"], "question": r["question"],
            "text": ans["text"][0] if ans["text"] else None,
            "answer_start": int(ans["answer_start"][0]) if ans["text"] else None}


def question_example(q: Mapping[str, Any], max_len: int, max_question: int, query: str,
                     report: dict[str, int], split: str, exact_spans: bool) -> Example | None:
    """The :class:`Example` of one flattened question, or None (a counted skip)."""
    count(report, f"{split}_read")
    text, start, ctx = q["text"], q["answer_start"], q["context"]
    if not text:
        count(report, f"{split}_skipped_no_answer")
        return None
    occurrences = answer_occurrences(ctx, text)  # counted here, whatever fields the file has
    if occurrences == 0:
        count(report, f"{split}_skipped_answer_not_found")
        return None
    if exact_spans and occurrences > 1:
        count(report, f"{split}_skipped_ambiguous_span")
        return None
    if start is None or ctx[start:start + len(text)] != text:
        count(report, f"{split}_answer_start_corrected")
        start = ctx.find(text)
    end = start + len(text)
    cwords, starts, ends = _context_spans(ctx)
    span = list(range(bisect.bisect_right(ends, start), bisect.bisect_left(starts, end)))  # tokens overlapping the answer
    if not span:
        count(report, f"{split}_skipped_answer_not_a_word")
        return None
    qwords = tokenize(q["question"])
    if len(qwords) > max_question:
        count(report, f"{split}_question_truncated")
        qwords = qwords[:max_question]
    room = max_len - 1 - len(qwords) - 1
    if room < 1:
        raise ValueError(f"max_len {max_len} leaves no room for the context after a {len(qwords)}-word question")
    t = truncate(cwords, span, room, side="right")
    if span[0] not in range(len(t.tokens)):
        count(report, f"{split}_skipped_answer_beyond_cap")
        return None
    if t.n_relevant_cut:
        count(report, f"{split}_answer_span_partly_cut")
    if t.n_cut:
        count(report, f"{split}_context_truncated")
    words = qwords + [SEP] + t.tokens
    off = len(qwords) + 1
    relevant = [off + i for i in t.relevant]
    y = len(words) - relevant[0]  # distance of the first answer token back from the query
    qtype = question_type(qwords)
    qtok = f"<q:{qtype}>" if query == "wh" else "<query>"
    return Example(words, relevant, y, qtok, info={"id": q["id"], "qtype": qtype, "answer_len": len(relevant)})


@lru_cache(maxsize=4096)
def _context_spans(context: str) -> tuple[list[str], list[int], list[int]]:
    """(words, start offsets, end offsets) of a context; cached, as about five questions share one."""
    spans = tokenize_spans(context)
    return [t for t, _, _ in spans], [s for _, s, _ in spans], [e for _, _, e in spans]


def load(data_dir: str | os.PathLike | None = None, max_len: int = 192, min_freq: int = 2,
         n_train: int | None = None, n_test: int | None = None, seed: int = 0, exact_spans: bool = True,
         max_question: int = 24, query: str = "wh", verify: bool = True, query_is_key: bool = False,
         source: str | None = None, keys: str = "all", oov_buckets: int = 0, **kw: Any) -> TextDataset:
    """SQuAD v1.1 as a :class:`TextDataset` (see the module docstring)."""
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
    if query not in ("wh", "plain"):
        raise ValueError(f"query must be 'wh' or 'plain', got {query!r}")
    if keys not in KEYS:
        raise ValueError(f"keys must be one of {KEYS}, got {keys!r}")
    if isinstance(oov_buckets, bool) or not isinstance(oov_buckets, int) or oov_buckets < 0:
        raise ValueError(f"oov_buckets must be an integer >= 0, got {oov_buckets!r}")
    report: dict[str, int] = {}
    if sources.use_hub(source):
        hub = sources.load_hub("squad")
        train_q, test_q = (map(hub_question, hub[split].to_list()) for split in ("train", "validation"))
    else:
        train_q, test_q = (_questions(rel, data_dir, verify) for rel in (_train_file(data_dir), DEV_FILE))
    args = dict(max_len=max_len, max_question=max_question, query=query, report=report)
    train = _examples(list(train_q), n_train, seed, dict(split="train", exact_spans=exact_spans, **args), report)
    test = _examples(list(test_q), n_test, seed + 1, dict(split="test", exact_spans=False, **args), report)
    class_names = [f"-{d}" for d in range(max_len)]
    notes = [POSITION_TARGET_NOTE,
             "Train: questions whose answer occurs exactly once in the context (counted from the context)."]
    buckets: tuple[str, ...] = ()
    if oov_buckets:
        buckets = bucket_rare_words(train, test, min_freq, oov_buckets)
        notes.append(f"Rare words hashed into {oov_buckets} <oov:k> ids, so that exact matches of rare words survive.")
    ds = finish("squad", train, test, class_names, report, min_freq, specials=(SEP, *QUERY_TOKENS, *buckets),
                query_is_key=query_is_key, notes=notes)
    if keys == "context":
        sep_id = ds.vocab.index(SEP)
        for split in ("train", "test"):
            b = getattr(ds, split)
            setattr(ds, split, Batch(b.tokens, b.key_mask & context_mask(b.tokens, sep_id), b.relevant, b.y, b.weight))
        ds.notes.append("Keys: the context words only.")
    return ds


def oov_token(word: str, n_buckets: int) -> str:
    """The bucket token ``<oov:k>`` of a rare ``word`` (``k`` = CRC-32 of its UTF-8 bytes mod ``n_buckets``)."""
    return f"<oov:{zlib.crc32(word.encode('utf-8')) % n_buckets}>"


def bucket_rare_words(train: list[Example], test: list[Example], min_freq: int, n_buckets: int) -> tuple[str, ...]:
    """Replace, in place, every word of ``train`` and ``test`` seen fewer than ``min_freq`` times in
    ``train`` by its :func:`oov_token`; returns all bucket tokens (vocabulary specials)."""
    freq: dict[str, int] = {}
    for ex in train:
        for w in ex.tokens:
            freq[w] = freq.get(w, 0) + 1
    keep = {SEP, *QUERY_TOKENS}
    for ex in [*train, *test]:
        ex.tokens = [w if w in keep or freq.get(w, 0) >= min_freq else oov_token(w, n_buckets) for w in ex.tokens]
    return tuple(f"<oov:{k}>" for k in range(n_buckets))


def context_mask(tokens: Tensor, sep_id: int) -> Tensor:
    """(N, T) bool: the context words of left-padded ``question <sep> context q`` rows -- after the
    first ``<sep>``, not the ``<sep>`` itself and not the last (query) column."""
    out = ((tokens == sep_id).cumsum(1) > 0) & (tokens != sep_id)
    out[..., -1] = False
    return out


def question_mask(tokens: Tensor, sep_id: int) -> Tensor:
    """(N, T) bool: the question words -- the non-padding positions before the first ``<sep>``."""
    return ((tokens == sep_id).cumsum(1) == 0) & (tokens != PAD_ID)


def question_match(tokens: Tensor, sep_id: int, ignore: Tensor | None = None) -> Tensor:
    """(N, T) bool: context words (:func:`context_mask`) whose id is that of a word of the same row's
    question (:func:`question_mask`); ids with ``ignore[id]`` True (a (V,) bool table: ``<unk>``,
    stopwords, punctuation) never match. Ids are lower-cased words, so matching a word or its
    lower-case form is the same test. Works on (..., N, T) under vmap."""
    q = question_mask(tokens, sep_id)
    if ignore is not None:
        q = q & ~ignore[tokens]
    # each row's question ids sorted (-1 elsewhere, no id), each key looked up in them: O(T log T) a row,
    # not the (N, T, T) table of every key against every position (a stack of models trains on its own
    # minibatch each, so that table was (models, N, T, T) every step)
    ids = torch.where(q, tokens, -1).sort(-1).values
    # the keys with the ids' batching, materialised: under vmap a stack's ignore table is a per-model
    # buffer, so ids are per model while shared tokens are not, and searchsorted warns on the expanded input
    keys = (torch.zeros_like(ids) + tokens).contiguous()
    found = ids.gather(-1, torch.searchsorted(ids, keys).clamp_max(tokens.shape[-1] - 1))
    return (found == tokens) & context_mask(tokens, sep_id)


def ignore_table(vocab: list[str], words: frozenset[str] = STOPWORDS) -> Tensor:
    """(V,) bool over the vocabulary: True for the specials ``<...>`` except the ``<oov:k>``
    buckets (they stand for rare words and may match) and for ``words`` (default :data:`STOPWORDS`)."""
    return torch.tensor([(w.startswith("<") and w.endswith(">") and not w.startswith("<oov:")) or w in words
                         for w in vocab], dtype=torch.bool)


def squad_roles(data: TextDataset | Batch, sep_id: int | None = None, ignore: Tensor | None = None,
                split: str = "test") -> dict[str, Tensor]:
    """Token roles for "where the attention goes": non-overlapping (N, T) bool masks over the keys
    (``key_mask``) of a SQuAD :class:`Batch` (or ``split`` of a :class:`TextDataset`):

    * ``answer`` -- the answer span (``relevant``);
    * ``in_question`` -- other context words that occur in the question (:func:`question_match`
      with ``ignore``; default for a dataset: :func:`ignore_table` of its vocabulary);
    * ``question`` -- the question's own words and ``<sep>`` when they are keys (``keys="all"``);
    * ``rest`` -- the other keys (for :func:`qkov_lib.metrics.mass_by_role`; a :class:`Batch` needs ``sep_id``)."""
    if isinstance(data, TextDataset):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if SEP not in data.vocab:
            raise ValueError(f"dataset {data.name!r} has no {SEP} token; squad_roles needs a SQuAD dataset")
        sep_id = data.vocab.index(SEP) if sep_id is None else sep_id
        ignore = ignore_table(data.vocab) if ignore is None else ignore
        data = getattr(data, split)
    if not isinstance(data, Batch):
        raise TypeError(f"squad_roles needs a TextDataset or a Batch, got {type(data).__name__}")
    if sep_id is None:
        raise ValueError("squad_roles on a Batch needs sep_id (the id of <sep>)")
    if not bool((data.tokens == sep_id).any(1).all()):
        raise ValueError(f"every row needs a <sep> token (id {sep_id}); is this a SQuAD batch?")
    keys = data.key_mask.bool()
    answer = data.relevant.bool() & keys
    match = question_match(data.tokens, sep_id, ignore) & keys & ~answer
    question = keys & ~context_mask(data.tokens, sep_id)
    return {"answer": answer, "in_question": match, "question": question, "rest": keys & ~(answer | match | question)}


def _examples(questions: list[dict[str, Any]], n: int | None, seed: int, kw: dict[str, Any],
              report: dict[str, int]) -> list[Example]:
    """Examples of ``questions``. With ``n`` set, the questions are visited in a random order (``seed``)
    until ``n`` examples are kept -- a uniform sample of the valid questions without processing the
    rest; the report's ``*_read`` then counts the questions visited, ``*_in_file`` all of them."""
    report[f"{kw['split']}_in_file"] = len(questions)
    if n is None:
        return [e for q in questions if (e := question_example(q, **kw))]
    if n < 1:
        raise ValueError(f"subsample size must be >= 1, got {n}")
    out = []
    for i in np.random.default_rng(seed).permutation(len(questions)):
        e = question_example(questions[int(i)], **kw)
        if e is not None:
            out.append(e)
            if len(out) == n:
                break
    return out


def _questions(rel: str, data_dir, verify: bool) -> list[dict[str, Any]]:
    """The flattened questions of SQuAD file ``rel``, counted by :func:`sources.check_records`."""
    questions = list(flatten(sources.load_rows("json", sources.data_file(rel, data_dir, verify), field="data")))
    sources.check_records(rel, {"questions": len(questions)}, verify)
    return questions


def _train_file(data_dir) -> str:
    """The first of :data:`TRAIN_FILES` present: the SQuAD train file the loader reads."""
    rel = sources.first_present(TRAIN_FILES, data_dir)
    if rel is not None:
        return rel
    root = sources.resolve_data_dir(data_dir)
    raise FileNotFoundError(f"no SQuAD train file in {root} (looked for {', '.join(TRAIN_FILES)}; the data directory "
                            f"comes from data_dir or ${sources.DATA_ENV}); download with `{sources.FETCH_HINT}`")
