"""Subject-verb agreement (SVA): predict the number of the next verb from the prefix before it.

Two sources (see the data README):

* ``"sva"`` -- Marvin & Linzen (2018) template sentences, ``sva/marvin_linzen2018_agreement.jsonl.gz``.
  Input: the words of ``sentence_good`` before ``verb_index``; label: ``target_number`` (singular /
  plural); relevant token: the subject noun at ``subject_index`` (exact, from the templates).
  Minimal pairs sharing a prefix are the same input, so the items are the *distinct prefixes*,
  split at random (``test_frac``, ``seed``) so that no test prefix occurs in training.
  ``test_info["roles"]`` gives every word's token role (:func:`prefix_roles`).
* ``"sva_linzen"`` -- Linzen et al. (2016) natural Wikipedia prefixes. Train pool: ``numpred.val``
  (15,772 prefixes); test: the attractor sets ``numpred.test.{1..5}`` (64,750 prefixes,
  ``n_attractors`` in ``test_info``). Labels VBZ -> singular, VBP -> plural. This release has **no
  subject index** and we derive none, so ``relevant`` is empty and only accuracy (by number of
  attractors) is meaningful.

Prefixes longer than the cap (``max_len - 1`` words) lose their first words (the words next to the
verb stay); one whose subject would be cut (``"sva"``) is skipped, and both are counted. The query
token ``<query>`` stands at the verb's position.
"""

from __future__ import annotations

import os
import io
import json
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from qkov_lib.data import sources
from qkov_lib.data.convert import NoGlobalsUnpickler, by_name, tar_members
from qkov_lib.data.text import Example, TextDataset, capped_words, count, finish, subsample, truncate

CLASS_NAMES = ["singular", "plural"]
ML_FILE = "sva/marvin_linzen2018_agreement.jsonl.gz"
LINZEN_TRAIN_FILE = "sva/linzen2016_numpred.val.tsv.gz"
LINZEN_TEST_FILE = "sva/linzen2016_numpred.test_attractors.tsv.gz"
NUMBER = {"sing": 0, "plur": 1}
LINZEN_LABEL = {"VBZ": 0, "VBP": 1}

# Token roles of a Marvin & Linzen prefix, one letter per word (see :func:`prefix_roles`).
ROLE_CODES = {"S": "subject", "A": "attractor", "V": "verb", "L": "last", "-": "rest"}
# Nouns of the fixed verb phrases of ``long_vp_coord`` ("enjoys playing tennis with colleagues", "is twenty three
# years old", "knows many different foreign languages", "likes to watch television shows", "writes in a journal
# every day"); they are not template noun slots, so no subject lists them.
LONG_VP_NOUNS = ("tennis", "colleagues", "years", "languages", "shows", "journal", "day")


def prefix_roles(words: list[str], subject_index: int, nouns: set[str] | frozenset[str],
                 verb_forms: set[str] | frozenset[str]) -> str:
    """The role of every word of a Marvin & Linzen prefix (the words before the target verb), one letter
    per word, by the first rule that applies:

    * ``S`` subject -- the word at ``subject_index`` (the noun the target verb agrees with);
    * ``A`` attractor (another noun) -- a word in ``nouns``: the template nouns (every word that is the
      subject of some row or heads a sentence's first noun phrase, both numbers, e.g. ``chef``/``chefs``,
      ``driver``, ``mechanic``) plus :data:`LONG_VP_NOUNS`. Fixed words of the prepositions ("to the
      *side* of", "in *front* of") and compound modifiers ("*taxi* driver", "*television* shows") are not;
    * ``V`` verb that already carries a number -- a word in ``verb_forms``: the present-tense forms the
      templates inflect for number (every ``verb_good``/``verb_bad`` of the file, e.g. ``is``/``are``,
      ``likes``/``like``). In the prefixes these are the relative-clause verbs (``subj_rel``: agrees
      with the subject; ``obj_rel_across*``: with the embedded noun, i.e. the attractor) and the first
      verb of a coordination (``vp_coord``, ``long_vp_coord``: with the subject). Past tense (``knew``,
      ``said``, ``thought`` in ``sent_comp``), gerunds and infinitives carry no number and stay ``rest``;
    * ``L`` last word -- the word right before the target verb, if no rule above applies (mostly
      ``and`` in the coordinations);
    * ``-`` rest -- everything else (``the``, ``that``, prepositions, adjectives, ...).

    So the roles do not overlap; the last word can also be the subject (``simple_agrmt``, ``*_within_*``,
    ``sent_comp``), an attractor (``prep_*``, ``subj_rel``) or a verb (``obj_rel_across*``), and then
    carries that role."""
    if not words:
        raise ValueError("prefix_roles needs a non-empty prefix")
    if not 0 <= subject_index < len(words):
        raise ValueError(f"subject_index {subject_index} is outside the prefix of {len(words)} words")
    return "".join("S" if i == subject_index else "A" if w in nouns else "V" if w in verb_forms
                   else "L" if i == len(words) - 1 else "-" for i, w in enumerate(words))


def template_lexicon(rows: list[dict]) -> tuple[frozenset[str], frozenset[str]]:
    """``(nouns, verb_forms)`` of :func:`prefix_roles` from all Marvin & Linzen rows: the subjects, the
    head noun of every sentence's first noun phrase (e.g. ``mechanic`` in ``sent_comp``, never a
    subject) and :data:`LONG_VP_NOUNS`; and every target verb form."""
    def first_noun(words: list[str]) -> str:  # "the N ..." or "the taxi N ..."
        return words[2] if words[1] in COMPOUND_MODIFIERS and len(words) > 2 else words[1]

    sentences = [str(r["sentence_good"]).split() for r in rows]
    nouns = (frozenset(str(r["subject"]) for r in rows) | frozenset(LONG_VP_NOUNS)
             | frozenset(first_noun(w) for w in sentences if len(w) > 1))
    verbs = frozenset(str(r[k]) for r in rows for k in ("verb_good", "verb_bad"))
    if nouns & verbs:
        raise ValueError(f"words {sorted(nouns & verbs)[:5]} are both template nouns and verb forms")
    return nouns, verbs


def marvin_linzen_examples(rows, max_len: int, report: dict[str, int]) -> list[Example]:
    """Distinct-prefix examples from Marvin & Linzen rows (``sentence_good``, ``verb_index``,
    ``subject_index``, ``subject``, ``target_number``, ``condition``). Counts under ``all_``: read,
    duplicate prefixes, conflicting labels, bad subject index or label, truncated prefixes and
    prefixes skipped because the subject was cut."""
    rows = list(rows)
    nouns, verb_forms = template_lexicon(rows)
    by_prefix: dict[tuple[str, ...], Example] = {}
    labels: dict[tuple[str, ...], set[int]] = {}
    for r in rows:
        count(report, "all_read")
        words = str(r["sentence_good"]).split()
        v, s = int(r["verb_index"]), int(r["subject_index"])
        if r["target_number"] not in NUMBER:
            count(report, "all_skipped_bad_label")
            continue
        if not (0 <= s < v <= len(words)) or words[s] != r["subject"]:
            count(report, "all_skipped_bad_subject_index")
            continue
        prefix = tuple(words[:v])
        y = NUMBER[r["target_number"]]
        labels.setdefault(prefix, set()).add(y)
        if prefix in by_prefix:
            count(report, "all_duplicate_prefix")
            continue
        by_prefix[prefix] = Example(list(prefix), [s], y, info={"condition": r["condition"], "subject": r["subject"],
                                                              "roles": prefix_roles(list(prefix), s, nouns, verb_forms)})
    out = []
    for prefix, ex in by_prefix.items():
        if len(labels[prefix]) > 1:
            count(report, "all_skipped_conflicting_label")
            continue
        t = truncate(ex.tokens, ex.relevant, max_len - 1, side="left")
        if t.n_relevant_cut:
            count(report, "all_skipped_prefix_over_cap_subject_cut")
            continue
        if t.n_cut:
            count(report, "all_truncated_prefix_over_cap")
        # the roles string has one letter per word: cut it like the words
        out.append(Example(t.tokens, t.relevant, ex.y, info={**ex.info, "roles": ex.info["roles"][t.n_cut:]}))
    report["all_distinct_prefixes"] = len(by_prefix)
    return out


def split_examples(examples: list[Example], test_frac: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Random (train, test) split with ``round(test_frac * N)`` test items (``seed``), both in input order."""
    import numpy as np

    if not 0.0 < test_frac < 1.0:
        raise ValueError(f"test_frac must lie in (0, 1), got {test_frac}")
    n_test = max(1, int(round(test_frac * len(examples))))
    perm = np.random.default_rng(seed).permutation(len(examples))
    is_test = np.zeros(len(examples), dtype=bool)
    is_test[perm[:n_test]] = True
    return [e for e, t in zip(examples, is_test) if not t], [e for e, t in zip(examples, is_test) if t]


def load(data_dir: str | os.PathLike | None = None, max_len: int = 16, min_freq: int = 2,
         n_train: int | None = None, n_test: int | None = None, seed: int = 0, test_frac: float = 0.2,
         verify: bool = True, query_is_key: bool = False, **kw: Any) -> TextDataset:
    """Marvin & Linzen SVA as a :class:`TextDataset` (see the module docstring)."""
    _no_extra(kw)
    rows = sources.load_rows("json", sources.data_file(ML_FILE, data_dir, verify))
    sources.check_records(ML_FILE, {"pairs": len(rows)}, verify)
    report: dict[str, int] = {}
    exs = marvin_linzen_examples(rows, max_len, report)
    train, test = split_examples(exs, test_frac, seed)
    report["train_split"], report["test_split"] = len(train), len(test)
    train, test = subsample(train, n_train, seed), subsample(test, n_test, seed + 1)
    notes = [f"Marvin & Linzen (2018) templates: {len(exs)} distinct prefixes, random {1 - test_frac:.0%}/{test_frac:.0%} "
             "split by prefix; relevant token = the subject noun (exact index)."]
    return finish("sva", train, test, CLASS_NAMES, report, min_freq, query_is_key=query_is_key, notes=notes)


def linzen_examples(rows, max_len: int, report: dict[str, int], split: str) -> list[Example]:
    """Examples from Linzen rows (``label``, ``prefix``, optional ``n_attractors``); counts read, bad
    label, empty and truncated prefixes under ``<split>_...``."""
    out = []
    for r in rows:
        count(report, f"{split}_read")
        label = str(r["label"]).strip()
        if label not in LINZEN_LABEL:
            count(report, f"{split}_skipped_bad_label")
            continue
        tokens = capped_words(r["prefix"], max_len, "left", report, split, "prefix")
        if tokens is None:
            continue
        info = {"n_attractors": int(r["n_attractors"])} if "n_attractors" in r else {"n_attractors": -1}
        out.append(Example(tokens, [], LINZEN_LABEL[label], info=info))
    return out


def load_linzen(data_dir: str | os.PathLike | None = None, max_len: int = 48, min_freq: int = 2,
                n_train: int | None = None, n_test: int | None = None, seed: int = 0,
                verify: bool = True, query_is_key: bool = False, **kw: Any) -> TextDataset:
    """Linzen et al. (2016), see the module docstring; ``relevant`` is all False (the release has no subject index)."""
    _no_extra(kw)
    tsv = dict(delimiter="\t", quoting=3, keep_default_na=False)
    train_rows = sources.load_rows("csv", sources.data_file(LINZEN_TRAIN_FILE, data_dir, verify),
                                   column_names=["label", "prefix"], **tsv)
    test_rows = sources.load_rows("csv", sources.data_file(LINZEN_TEST_FILE, data_dir, verify), **tsv)
    sources.check_records(LINZEN_TRAIN_FILE, {"prefixes": len(train_rows)}, verify)
    sources.check_records(LINZEN_TEST_FILE, {"prefixes": len(test_rows)}, verify)
    report: dict[str, int] = {}
    train = subsample(linzen_examples(train_rows, max_len, report, "train"), n_train, seed)
    test = subsample(linzen_examples(test_rows, max_len, report, "test"), n_test, seed + 1)
    report["test_no_subject_index"] = len(test)
    notes = ["Linzen et al. (2016) numpred.val as the train pool and the attractor test sets numpred.test.1-5; "
             "no subject index in this release, none derived: relevant is empty."]
    return finish("sva_linzen", train, test, CLASS_NAMES, report, min_freq, query_is_key=query_is_key, notes=notes)


def _no_extra(kw: dict[str, Any]) -> None:
    kw.pop("source", None)
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)}")


# --- the converters of the official releases -------------------------------------------------
LINZEN_ATTRACTORS = (1, 2, 3, 4, 5)
# Conditions whose target verb is the embedded one, so the subject is the second noun phrase.
EMBEDDED_TARGET = ("sent_comp", "obj_rel_within_anim", "obj_rel_within_inanim",
                   "obj_rel_no_comp_within_anim", "obj_rel_no_comp_within_inanim")
COMPOUND_MODIFIERS = ("taxi",)  # "taxi driver(s)": the head noun is the next word


def linzen_lines(data: bytes) -> list[bytes]:
    """The lines of a ``numpred.*`` file (``label\\tprefix``), no line ends; ValueError unless each has one tab."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    bad = [i + 1 for i, line in enumerate(lines) if line.count(b"\t") != 1]
    if bad:
        raise ValueError(f"numpred lines {bad[:5]} do not have the form 'label<TAB>prefix'")
    return lines


def convert_linzen2016(inputs: Mapping[str, bytes]) -> dict[str, bytes]:
    """The converter of Linzen et al. (2016): ``rnn_agr_simple.tar.gz`` (read in memory) -> ``numpred.val``
    as it is, and ``numpred.test.{1..5}`` joined under a header with the file number as ``n_attractors``."""
    names = ["numpred.val"] + [f"numpred.test.{k}" for k in LINZEN_ATTRACTORS]
    files = tar_members(by_name(inputs, "rnn_agr_simple.tar.gz"), names)
    linzen_lines(files["numpred.val"])  # format check only: the file is kept byte for byte
    test = [b"label\tprefix\tn_attractors"]
    for k in LINZEN_ATTRACTORS:
        test += [line + b"\t" + str(k).encode() for line in linzen_lines(files[f"numpred.test.{k}"])]
    return {LINZEN_TRAIN_FILE: files["numpred.val"], LINZEN_TEST_FILE: b"\n".join(test) + b"\n"}


def load_templates(data: bytes, condition: str) -> dict[str, list[tuple[str, str]]]:
    """``{key: [(good sentence, bad sentence), ...]}`` of one template pickle; ValueError for anything else."""
    obj = NoGlobalsUnpickler(io.BytesIO(data)).load()
    ok = isinstance(obj, dict) and all(
        isinstance(k, str) and isinstance(v, list)
        and all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in v)
        for k, v in obj.items())
    if not ok:
        raise ValueError(f"template pickle {condition!r} is not a dict of lists of (good, bad) sentence pairs")
    return obj


def subject_index(words: list[str], condition: str) -> int:
    """The index of the subject the target verb agrees with: the noun after the first ``the``
    (main-clause conditions) or the second (:data:`EMBEDDED_TARGET`: the target is the embedded
    verb); for a compound such as ``taxi driver`` the head, one further."""
    thes = [i for i, w in enumerate(words) if w == "the"]
    k = 1 if condition in EMBEDDED_TARGET else 0
    if len(thes) <= k:
        raise ValueError(f"{condition}: {' '.join(words)!r} has no {'second' if k else 'first'} 'the'")
    s = thes[k] + 1
    return s + 1 if words[s] in COMPOUND_MODIFIERS else s


def minimal_pair_row(condition: str, key: str, i: int, good: str, bad: str) -> dict[str, Any]:
    """One row of the agreement file: the pair, its target number (from the key), the verb (the only
    differing token) and the subject (:func:`subject_index`)."""
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
    """All rows, conditions in alphabetical order, keys and pairs in file order. ValueError if a noun is
    both a singular and a plural subject within a condition (so the subject rule picked the wrong noun)."""
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


def convert_marvin_linzen2018(inputs: Mapping[str, bytes]) -> dict[str, bytes]:
    """The converter of Marvin & Linzen (2018): the 15 template pickles (download ids ``.../<condition>.pickle``,
    read with :class:`~qkov_lib.data.convert.NoGlobalsUnpickler`) -> one row per minimal pair. ``verb_index``
    is the one token where good and bad differ; ``subject_index`` is :func:`subject_index`."""
    templates = {PurePosixPath(k).name.removesuffix(".pickle"): load_templates(v, k) for k, v in inputs.items()}
    rows = marvin_linzen_rows(templates)
    return {ML_FILE: "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")}
