"""The results file as a contract: what a chapter's ``<name>.json`` must hold for the scorecard, the
book's summary pages and ``qkov scorecard`` to read it.

A results file is one whole UTF-8 JSON object (no byte-order mark) with the keys of
:data:`REQUIRED` (``chapter`` a string, ``params`` an object, ``metrics`` any JSON value), every
number finite, ``wall_time_s`` a number or null, ``git_commit`` and ``device`` strings or null.
When ``metrics`` is an object that has ``claims``, that is a list of claim rows
(:func:`qkov_lib.claims.claim`): objects with a non-empty string ``id``, a ``verdict`` among
:func:`verdict_words` (the words of :data:`qkov_lib.claims.VERDICTS`, read when checked, plus
:data:`NOT_RUN`) and strings in the text fields of :data:`CLAIM_TEXT`.

:func:`read` and :func:`check` raise :class:`ResultsFileError`, naming the file and every field
that breaks the contract; nothing is dropped silently."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from qkov_lib import claims

#: the word for a claim that no chapter of a build reported (the scorecard's own, beside the verdicts)
NOT_RUN = "not run"
#: top-level keys of every results file and the JSON types they take
REQUIRED: dict[str, tuple[type, ...]] = {"chapter": (str,), "params": (dict,), "metrics": (object,)}
#: optional top-level keys and their types when present (None: JSON null)
OPTIONAL: dict[str, tuple[type, ...]] = {"wall_time_s": (int, float, type(None)), "git_commit": (str, type(None)),
                                         "device": (str, type(None))}
#: the text fields of a claim row, strings when present
CLAIM_TEXT = ("paper", "ours", "rule", "reason", "region", "effect", "chapter")
_TYPE_NAMES = {str: "a string", dict: "an object", list: "a list", int: "a number", float: "a number",
               type(None): "null", object: "any value"}


class ResultsFileError(ValueError):
    """A results file that breaks the contract; ``problems``: ``(file, field, what is wrong)`` each."""

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = list(problems)
        lines = [f"{f}: {field}: {what}" if field else f"{f}: {what}" for f, field, what in self.problems]
        super().__init__("results file does not hold to the results-file contract:\n  " + "\n  ".join(lines)
                         if len(lines) > 1 else f"results file {lines[0]}")


def verdict_words() -> tuple[str, ...]:
    """The verdict words a claim row may carry: :data:`qkov_lib.claims.VERDICTS`, then :data:`NOT_RUN`."""
    return (*claims.VERDICTS, NOT_RUN)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, (dict, list)):
        return _TYPE_NAMES[type(value)]
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} ({json.dumps(value, allow_nan=True)})"


def _non_finite(value: Any, where: str) -> Iterator[str]:
    """The field paths (``metrics.curves[3].loss``) of every non-finite number under ``value``."""
    if isinstance(value, float) and not math.isfinite(value):
        yield where
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _non_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _non_finite(v, f"{where}[{i}]")


def problems(doc: Any) -> list[tuple[str, str]]:
    """``(field, what is wrong)`` for every way ``doc`` (a parsed results file) breaks the contract; ``[]``: none."""
    if not isinstance(doc, dict):
        return [("", f"the top level must be a JSON object, found {_kind(doc)}")]
    out: list[tuple[str, str]] = []
    for key, types in {**REQUIRED, **OPTIONAL}.items():
        if key not in doc:
            if key in REQUIRED:
                out.append((key, "missing (a required key)"))
            continue
        value = doc[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            out.append((key, f"must be {' or '.join(dict.fromkeys(_TYPE_NAMES[t] for t in types))}, "
                             f"found {_kind(value)}"))
    metrics = doc.get("metrics")
    if isinstance(metrics, dict) and "claims" in metrics:
        rows = metrics["claims"]
        words = verdict_words()
        if not isinstance(rows, list):
            out.append(("metrics.claims", f"must be a list of claim rows, found {_kind(rows)}"))
            rows = []
        for i, row in enumerate(rows):
            at = f"metrics.claims[{i}]"
            if not isinstance(row, dict):
                out.append((at, f"must be an object (a claim row), found {_kind(row)}"))
                continue
            cid = row.get("id")
            if not isinstance(cid, str) or not cid.strip():
                out.append((f"{at}.id", "missing" if "id" not in row else f"must be a non-empty string, found {_kind(cid)}"))
            else:
                at = f"{at} ({cid})"
            verdict = row.get("verdict")
            if verdict not in words or not isinstance(verdict, str):
                found = "missing" if "verdict" not in row else f"found {_kind(verdict)}"
                out.append((f"{at}.verdict", f"{found}; a verdict is one of: {', '.join(words)}"))
            out += [(f"{at}.{k}", f"must be a string, found {_kind(row[k])}")
                    for k in CLAIM_TEXT if k in row and not isinstance(row[k], str)]
    named = {re.sub(r" \(.*?\)", "", field) for field, _ in out}  # a field named above is not named twice
    return out + [(f, "a non-finite number (NaN or infinity); results files hold finite numbers or null")
                  for f in _non_finite(doc, "") if f not in named]


def check(doc: Any, path: str | os.PathLike) -> Any:
    """``doc`` (the parsed file ``path``) when it holds to the contract; else :class:`ResultsFileError`."""
    found = problems(doc)
    if found:
        raise ResultsFileError([(str(path), field, what) for field, what in found])
    return doc


def parse(path: str | os.PathLike) -> Any:
    """The JSON document in ``path``, not yet checked against the contract: :class:`ResultsFileError`
    for a file that cannot be read, is not UTF-8, starts with a byte-order mark or is not whole JSON
    (e.g. cut short)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ResultsFileError([(str(path), "", f"cannot be read ({e.strerror or e})")]) from e
    if raw.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        raise ResultsFileError([(str(path), "", "starts with a byte-order mark; results files are UTF-8 JSON "
                                                "without one (rerun its chapter, or save the file without the mark)")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ResultsFileError([(str(path), "", f"is not UTF-8 text (byte {e.start}: {e.reason})")]) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        cut = " (the file ends early: cut short?)" if e.pos >= len(text.rstrip()) else ""
        raise ResultsFileError([(str(path), "", f"is not whole JSON: {e.msg} at line {e.lineno}, "
                                                f"column {e.colno}{cut}; rerun its chapter")]) from e


def read(path: str | os.PathLike) -> dict[str, Any]:
    """The results document in ``path``, checked against the contract (:func:`parse`, :func:`check`)."""
    return check(parse(path), path)
