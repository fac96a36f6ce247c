"""HateXplain (Mathew et al. 2021): three-class post classification with human rationales.

* Classes (Hugging Face ints): 0 hatespeech, 1 normal, 2 offensive; a post's label is the majority
  of its three annotators (posts without one are dropped and counted).
* Train: the official train split -- ``hatexplain_train.jsonl.gz`` (built by ``qkov data fetch`` from
  the authors' ``dataset.json``; its rationales are not used) when present, else the curated
  ``hatexplain_train_no_rationales.csv.gz`` (texts and annotator labels): the same posts and labels.
  The converted file has no manifest checksum, so it is read only with the provenance record
  ``fetch`` writes beside it (or ``QKOV_ALLOW_UNVERIFIED=1``), never silently preferred to the
  checksummed CSV (:func:`qkov_lib.data.sources.verify_file`). ``train_split="val"`` trains on the
  official validation split instead. Each file's post count is checked against the manifest.
* Test: the official test split. Relevant tokens: the union of the annotators' token rationales, on
  posts whose majority label is not normal; a non-normal post without any is kept for
  classification and counted as ``test_empty_rationale`` (the attention metrics skip it).
* Validation: :func:`load_with_val` also returns the official validation split (with rationales).
* Words: the given post tokens (already word-tokenised), as they are; posts longer than the cap keep
  their first ``max_len - 1`` words (truncations and cut rationale tokens counted). The query token
  ``<query>`` follows the post.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import Any

import torch

from qkov_lib.data import sources
from qkov_lib.data.batch import Batch
from qkov_lib.data.convert import by_name, hf_jsonl
from qkov_lib.data.text import (PAD_ID, Example, TextDataset, Vocabulary, capped_words, count, encode, finish,
                                subsample, truncate)

CLASS_NAMES = ["hatespeech", "normal", "offensive"]
NORMAL = 1
TRAIN_JSONL = "hatexplain/hatexplain_train.jsonl.gz"
TRAIN_CSV = "hatexplain/hatexplain_train_no_rationales.csv.gz"
SPLIT_FILES = {"val": "hatexplain/hatexplain_validation.jsonl.gz", "test": "hatexplain/hatexplain_test.jsonl.gz"}
DIVISIONS = "hatexplain/post_id_divisions.json"


def majority(labels: Iterable[int]) -> int | None:
    """The label given by more than half of the annotators, or None."""
    labels = [int(x) for x in labels]
    if not labels:
        return None
    lab, n = Counter(labels).most_common(1)[0]
    return lab if 2 * n > len(labels) else None


def post_examples(rows: Iterable[Mapping[str, Any]], max_len: int, report: dict[str, int], split: str,
                  with_rationales: bool = True) -> list[Example]:
    """Examples from posts in the Hugging Face layout (``id``, ``annotators.label``, ``rationales``,
    ``post_tokens``). Counts under ``<split>_...``: read, no majority, empty post, rationale length
    mismatch, empty rationale (non-normal post), truncated posts and cut rationale tokens."""
    out = []
    for r in rows:
        count(report, f"{split}_read")
        y = majority(r["annotators"]["label"])
        if y is None:
            count(report, f"{split}_skipped_no_majority")
            continue
        words = [str(w) for w in r["post_tokens"]]
        if not words:
            count(report, f"{split}_skipped_empty_post")
            continue
        rel: list[int] = []
        if with_rationales and y != NORMAL:
            masks = r.get("rationales") or []
            if any(len(m) != len(words) for m in masks):
                count(report, f"{split}_skipped_rationale_length_mismatch")
                continue
            rel = sorted({i for m in masks for i, v in enumerate(m) if int(v)})
            if not rel:
                count(report, f"{split}_empty_rationale")
        t = truncate(words, rel, max_len - 1, side="right")
        if t.n_cut:
            count(report, f"{split}_truncated_post_over_cap")
        if t.n_relevant_cut:
            count(report, f"{split}_posts_rationale_cut")
            count(report, f"{split}_rationale_tokens_cut", t.n_relevant_cut)
        out.append(Example(t.tokens, t.relevant, y, info={"id": r.get("id"), "has_rationale": bool(t.relevant)}))
    return out


def csv_examples(rows: Iterable[Mapping[str, Any]], max_len: int, report: dict[str, int], split: str = "train") -> list[Example]:
    """Examples from the label-only train CSV (``text``, ``majority_label``, ``labels`` as "a, b, c"):
    the majority is recomputed from ``labels`` and used; disagreements with ``majority_label`` are counted."""
    out = []
    for r in rows:
        count(report, f"{split}_read")
        try:
            labels = [int(x) for x in str(r["labels"]).split(",")]
        except ValueError:
            count(report, f"{split}_skipped_bad_labels")
            continue
        y = majority(labels)
        if y is None:
            count(report, f"{split}_skipped_no_majority")
            continue
        if str(r.get("majority_label", y)).strip() != str(y):
            count(report, f"{split}_majority_label_disagrees")
        tokens = capped_words(r["text"], max_len, "right", report, split, "post")
        if tokens is None:
            continue
        out.append(Example(tokens, [], y, info={"id": None, "has_rationale": False}))
    return out


def load(data_dir: str | os.PathLike | None = None, max_len: int = 96, min_freq: int = 2,
         n_train: int | None = None, n_test: int | None = None, seed: int = 0, train_split: str = "train",
         verify: bool = True, query_is_key: bool = False, source: str | None = None, **kw: Any) -> TextDataset:
    """HateXplain as a :class:`TextDataset` (see the module docstring); ``source="hub"``: the Hugging Face copy."""
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
    if train_split not in ("train", "val"):
        raise ValueError(f"train_split must be 'train' or 'val', got {train_split!r}")
    report: dict[str, int] = {}
    train_ex, test_ex = _train_test_examples(data_dir, max_len, train_split, verify, source, report)
    report["test_with_rationale"] = sum(bool(e.relevant) for e in test_ex)
    train_ex, test_ex = subsample(train_ex, n_train, seed), subsample(test_ex, n_test, seed + 1)
    notes = [f"HateXplain: train on the official {train_split} split (labels only), test on the official test split; "
             "relevant = union of annotator rationales on non-normal posts."]
    return finish("hatexplain", train_ex, test_ex, CLASS_NAMES, report, min_freq, query_is_key=query_is_key, notes=notes)


def _train_test_examples(data_dir, max_len: int, train_split: str, verify: bool, source: str | None,
                         report: dict[str, int]) -> tuple[list[Example], list[Example]]:
    """Train examples (labels only) and test examples (with rationales) of :func:`load`."""
    if sources.use_hub(source):
        hub = sources.load_hub("hatexplain")
        train_ex = post_examples(hub["train" if train_split == "train" else "validation"].to_list(), max_len, report,
                                 "train", False)
        return train_ex, post_examples(hub["test"].to_list(), max_len, report, "test")
    test_ex = post_examples(_jsonl(SPLIT_FILES["test"], data_dir, verify), max_len, report, "test")
    rel = SPLIT_FILES["val"] if train_split == "val" else sources.first_present((TRAIN_JSONL, TRAIN_CSV), data_dir)
    if rel in (SPLIT_FILES["val"], TRAIN_JSONL):
        return post_examples(_jsonl(rel, data_dir, verify), max_len, report, "train", False), test_ex
    rows = sources.load_rows("csv", sources.data_file(TRAIN_CSV, data_dir, verify), keep_default_na=False)
    sources.check_records(TRAIN_CSV, {"posts": len(rows)}, verify)
    return csv_examples(rows, max_len, report), test_ex


def pad_to(batch: Batch, length: int) -> Batch:
    """``batch`` left-padded with extra ``<pad>`` columns (not keys, not relevant) to ``length``."""
    N, T = batch.tokens.shape
    if length < T:
        raise ValueError(f"cannot pad a batch of length {T} down to {length}")
    k = length - T

    def grow(t, fill):
        return torch.cat([t.new_full((N, k), fill), t], dim=1)

    return Batch(grow(batch.tokens, PAD_ID), grow(batch.key_mask, False), grow(batch.relevant, False), batch.y, batch.weight)


def load_with_val(data_dir: str | os.PathLike | None = None, max_len: int = 96, min_freq: int = 2,
                  n_train: int | None = None, n_test: int | None = None, n_val: int | None = None, seed: int = 0,
                  verify: bool = True, query_is_key: bool = False) -> tuple[TextDataset, Batch]:
    """HateXplain with its official validation split: ``(dataset, val)``. The dataset is :func:`load`
    (train on the official train split, test on the test split); ``val`` is the validation split
    encoded with the training vocabulary, rationales (union of annotators, non-normal posts) as
    ``relevant``, all three left-padded to the longest. Validation counts go to the report under
    ``val_*``; ``n_val`` subsamples it with ``seed + 2``."""
    ds = load(data_dir, max_len, min_freq, n_train, n_test, seed, "train", verify, query_is_key)
    val_ex = post_examples(_jsonl(SPLIT_FILES["val"], data_dir, verify), max_len, ds.report, "val")
    val_ex = subsample(val_ex, n_val, seed + 2)
    ds.report["val_used"] = len(val_ex)
    length = max(ds.max_len, max(len(e.tokens) for e in val_ex) + 1)
    val = encode(val_ex, Vocabulary(list(ds.vocab)), length, query_is_key)
    ds.train, ds.test = pad_to(ds.train, length), pad_to(ds.test, length)
    ds.notes.append("Validation: the official validation split, for choosing settings and early stopping.")
    return ds, val


def _jsonl(rel: str, data_dir, verify: bool) -> list[dict[str, Any]]:
    """The posts of the JSON-lines split file ``rel``, counted by :func:`sources.check_records`."""
    rows = sources.load_rows("json", sources.data_file(rel, data_dir, verify))
    sources.check_records(rel, {"posts": len(rows)}, verify)
    return rows


def official_split_sizes(data_dir: str | os.PathLike | None = None, verify: bool = True) -> dict[str, int]:
    """Number of post ids per split in the official ``post_id_divisions.json`` (counted against the manifest)."""
    doc = json.loads(sources.data_file(DIVISIONS, data_dir, verify).read_text())
    sizes = {k: len(v) for k, v in doc.items()}
    sources.check_records(DIVISIONS, sizes, verify)
    return sizes


# --- the converter of the official release ---------------------------------------------------
CONVERTED = {"train": TRAIN_JSONL, "val": SPLIT_FILES["val"], "test": SPLIT_FILES["test"]}


def hatexplain_row(post_id: str, post: Mapping[str, Any]) -> dict[str, Any]:
    """One post of ``dataset.json`` in the Hugging Face layout; ValueError naming the post for an unknown label."""
    ann = post["annotators"]
    try:
        labels = [CLASS_NAMES.index(a["label"]) for a in ann]
    except ValueError as err:
        raise ValueError(f"HateXplain post {post_id}: label not in {CLASS_NAMES}: {[a['label'] for a in ann]}") from err
    return {"id": post_id,
            "annotators": {"label": labels, "annotator_id": [a["annotator_id"] for a in ann],
                           "target": [a["target"] for a in ann]},
            "rationales": post["rationales"], "post_tokens": post["post_tokens"]}


def convert(inputs: Mapping[str, bytes]) -> dict[str, bytes]:
    """The converter of the release: the authors' ``dataset.json`` + ``post_id_divisions.json`` -> one
    JSON-lines file per official split in the Hugging Face layout (labels as ints 0 hatespeech, 1 normal,
    2 offensive; ``annotators`` as lists; the train split keeps its rationales), posts in split-file
    order. ValueError if a post id of the split file is not in the dataset."""
    posts = json.loads(by_name(inputs, "dataset.json"))
    divisions = json.loads(by_name(inputs, PurePosixPath(DIVISIONS).name))
    out = {}
    for split, rel in CONVERTED.items():
        ids = divisions[split]
        absent = [i for i in ids if i not in posts]
        if absent:
            raise ValueError(f"{len(absent)} post ids of the {split} split are not in dataset.json, e.g. {absent[:3]}")
        out[rel] = hf_jsonl([hatexplain_row(i, posts[i]) for i in ids])
    return out
