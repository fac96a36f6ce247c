"""Converters: the official releases -> the files the loaders read. Pure functions of bytes.

Each converter takes ``{download id: bytes as served}`` and returns ``{path in the data folder:
uncompressed content}``; :mod:`qkov_lib.data.fetch` checks the content against the manifest
and writes it. Every derived field is computed here from the release itself:

* ``hatexplain`` -- ``Data/dataset.json`` + ``Data/post_id_divisions.json`` of the authors'
  repository -> one JSON-lines file per official split in the Hugging Face layout (labels as
  ints 0 hatespeech, 1 normal, 2 offensive; ``annotators`` as lists), posts in the order of the
  split file. The train split keeps its rationales.
* ``linzen2016`` -- ``rnn_agr_simple.tar.gz`` of Linzen et al. (2016) -> ``numpred.val`` as it is,
  and ``numpred.test.{1..5}`` joined under a header with the file number as ``n_attractors``.
  The archive is read in memory; nothing is extracted to disk.
* ``marvin_linzen2018`` -- the 15 agreement template pickles of Marvin & Linzen (2018) -> one
  row per minimal pair, read with :class:`NoGlobalsUnpickler`. ``verb_index`` is the one token
  where the good and bad sentence differ; ``subject_index`` follows from the template
  (:func:`subject_index`).
"""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import Any

from .hatexplain import CLASS_NAMES, DIVISIONS, SPLIT_FILES, TRAIN_JSONL
from .sva import LINZEN_TEST_FILE, LINZEN_TRAIN_FILE, ML_FILE

HATEXPLAIN_OUT = {"train": TRAIN_JSONL, "val": SPLIT_FILES["val"], "test": SPLIT_FILES["test"]}
LINZEN_ATTRACTORS = (1, 2, 3, 4, 5)
# Conditions whose target verb is the embedded one, so the subject is the second noun phrase.
EMBEDDED_TARGET = ("sent_comp", "obj_rel_within_anim", "obj_rel_within_inanim",
                   "obj_rel_no_comp_within_anim", "obj_rel_no_comp_within_inanim")
COMPOUND_MODIFIERS = ("taxi",)  # "taxi driver(s)": the head noun is the next word


def _by_name(inputs: Mapping[str, bytes], name: str) -> bytes:
    """The input whose download id ends in ``name``; KeyError naming what is there otherwise."""
    hits = [v for k, v in inputs.items() if PurePosixPath(k).name == name]
    if len(hits) != 1:
        raise KeyError(f"expected one input named {name!r}, got {sorted(inputs)}")
    return hits[0]


def hf_jsonl(rows: list[dict[str, Any]]) -> bytes:
    """JSON lines as the ``datasets``/pandas JSON export writes them: compact, non-ASCII as
    ``\\uXXXX`` and ``/`` as ``\\/`` (so the converted splits equal the curated copies byte for byte)."""
    return "".join(json.dumps(r, separators=(",", ":")).replace("/", "\\/") + "\n" for r in rows).encode("ascii")


# --- HateXplain -------------------------------------------------------------------------------
def hatexplain_row(post_id: str, post: Mapping[str, Any]) -> dict[str, Any]:
    """One post of ``dataset.json`` in the Hugging Face layout; ValueError naming the post for
    an unknown label."""
    ann = post["annotators"]
    try:
        labels = [CLASS_NAMES.index(a["label"]) for a in ann]
    except ValueError as err:
        raise ValueError(f"HateXplain post {post_id}: label not in {CLASS_NAMES}: {[a['label'] for a in ann]}") from err
    return {"id": post_id,
            "annotators": {"label": labels, "annotator_id": [a["annotator_id"] for a in ann],
                           "target": [a["target"] for a in ann]},
            "rationales": post["rationales"], "post_tokens": post["post_tokens"]}


def hatexplain(inputs: Mapping[str, bytes]) -> dict[str, bytes]:
    """``dataset.json`` + ``post_id_divisions.json`` -> train/val/test JSON lines (see the
    module docstring). ValueError if a post id of the split file is not in the dataset."""
    posts = json.loads(_by_name(inputs, "dataset.json"))
    divisions = json.loads(_by_name(inputs, PurePosixPath(DIVISIONS).name))
    out = {}
    for split, rel in HATEXPLAIN_OUT.items():
        ids = divisions[split]
        absent = [i for i in ids if i not in posts]
        if absent:
            raise ValueError(f"{len(absent)} post ids of the {split} split are not in dataset.json, e.g. {absent[:3]}")
        out[rel] = hf_jsonl([hatexplain_row(i, posts[i]) for i in ids])
    return out


# --- Linzen et al. 2016 -----------------------------------------------------------------------
def tar_members(data: bytes, names: list[str]) -> dict[str, bytes]:
    """The files ``names`` (matched by base name; macOS ``._*`` stubs ignored) of a tar archive,
    read in memory. KeyError naming the missing ones."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for m in tar.getmembers():
            base = PurePosixPath(m.name).name
            if m.isfile() and base in names and not base.startswith("._"):
                out[base] = tar.extractfile(m).read()
    missing = [n for n in names if n not in out]
    if missing:
        raise KeyError(f"the archive has no {', '.join(missing)}")
    return out


def linzen_lines(data: bytes) -> list[bytes]:
    """The lines of a ``numpred.*`` file (``label\\tprefix``), without line ends; ValueError for
    a line without exactly one tab."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    bad = [i + 1 for i, line in enumerate(lines) if line.count(b"\t") != 1]
    if bad:
        raise ValueError(f"numpred lines {bad[:5]} do not have the form 'label<TAB>prefix'")
    return lines


def linzen2016(inputs: Mapping[str, bytes]) -> dict[str, bytes]:
    """``rnn_agr_simple.tar.gz`` -> ``numpred.val`` (unchanged) and the attractor sets with
    their ``n_attractors`` column (see the module docstring)."""
    names = ["numpred.val"] + [f"numpred.test.{k}" for k in LINZEN_ATTRACTORS]
    files = tar_members(_by_name(inputs, "rnn_agr_simple.tar.gz"), names)
    linzen_lines(files["numpred.val"])  # format check only: the file is kept byte for byte
    test = [b"label\tprefix\tn_attractors"]
    for k in LINZEN_ATTRACTORS:
        test += [line + b"\t" + str(k).encode() for line in linzen_lines(files[f"numpred.test.{k}"])]
    return {LINZEN_TRAIN_FILE: files["numpred.val"], LINZEN_TEST_FILE: b"\n".join(test) + b"\n"}


# --- Marvin & Linzen 2018 ---------------------------------------------------------------------
class NoGlobalsUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global, so a pickle can build only plain containers and
    strings and can run no code."""

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle's hook
        raise pickle.UnpicklingError(f"refused to load the global {module}.{name}: the template pickles "
                                     "hold only dicts, lists, tuples and strings")


def load_templates(data: bytes, condition: str) -> dict[str, list[tuple[str, str]]]:
    """``{key: [(good sentence, bad sentence), ...]}`` of one template pickle; ValueError if it
    holds anything else."""
    obj = NoGlobalsUnpickler(io.BytesIO(data)).load()
    ok = isinstance(obj, dict) and all(
        isinstance(k, str) and isinstance(v, list)
        and all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in v)
        for k, v in obj.items())
    if not ok:
        raise ValueError(f"template pickle {condition!r} is not a dict of lists of (good, bad) sentence pairs")
    return obj


def subject_index(words: list[str], condition: str) -> int:
    """The token index of the subject the target verb agrees with: the noun after the first
    ``the`` (main-clause conditions) or after the second ``the`` (:data:`EMBEDDED_TARGET`: the
    target is the embedded verb); for a compound such as ``taxi driver`` the head, one further."""
    thes = [i for i, w in enumerate(words) if w == "the"]
    k = 1 if condition in EMBEDDED_TARGET else 0
    if len(thes) <= k:
        raise ValueError(f"{condition}: {' '.join(words)!r} has no {'second' if k else 'first'} 'the'")
    s = thes[k] + 1
    return s + 1 if words[s] in COMPOUND_MODIFIERS else s


def minimal_pair_row(condition: str, key: str, i: int, good: str, bad: str) -> dict[str, Any]:
    """One row of the agreement file: the pair, its target number (from the key), the verb (the
    only differing token) and the subject (:func:`subject_index`)."""
    g, b = good.split(), bad.split()
    diff = [j for j, (x, y) in enumerate(zip(g, b)) if x != y]
    if len(g) != len(b) or len(diff) != 1:
        raise ValueError(f"{condition}/{key}[{i}]: good and bad must differ in exactly one token: {good!r} / {bad!r}")
    number = key.split("_")[0]
    if number not in ("sing", "plur"):
        raise ValueError(f"{condition}/{key}: key does not start with sing_ or plur_")
    v, s = diff[0], subject_index(g, condition)
    return {"condition": condition, "key": key, "pair_index": i, "sentence_good": good, "sentence_bad": bad,
            "target_number": number, "verb_index": v, "verb_good": g[v], "verb_bad": b[v],
            "subject_index": s, "subject": g[s]}


def marvin_linzen_rows(templates: Mapping[str, Mapping[str, list[tuple[str, str]]]]) -> list[dict[str, Any]]:
    """All rows, conditions in alphabetical order, keys and pairs in file order. ValueError if
    a noun is used as both a singular and a plural subject within a condition (the check that
    the subject rule picked the agreeing noun)."""
    rows = []
    for cond in sorted(templates):
        part = [minimal_pair_row(cond, key, i, g, b) for key, pairs in templates[cond].items()
                for i, (g, b) in enumerate(pairs)]
        sing = {r["subject"] for r in part if r["target_number"] == "sing"}
        plur = {r["subject"] for r in part if r["target_number"] == "plur"}
        if sing & plur:
            raise ValueError(f"{cond}: subjects {sorted(sing & plur)[:5]} occur with both numbers; the subject rule is wrong here")
        rows += part
    return rows


def marvin_linzen2018(inputs: Mapping[str, bytes]) -> dict[str, bytes]:
    """The template pickles (download ids ``.../<condition>.pickle``) -> the agreement JSON lines."""
    templates = {PurePosixPath(k).name.removesuffix(".pickle"): load_templates(v, k) for k, v in inputs.items()}
    rows = marvin_linzen_rows(templates)
    return {ML_FILE: "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")}


CONVERTERS: dict[str, Callable[[Mapping[str, bytes]], dict[str, bytes]]] = {
    "hatexplain": hatexplain, "linzen2016": linzen2016, "marvin_linzen2018": marvin_linzen2018}
