"""Machine-readable results files of chapters and tidy per-run tables."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkov_lib.data.sources import used_files
from qkov_lib.runtime import REPO_ROOT, git_commit, pick_device, versions

RESULTS_ENV = "QKOV_RESULTS_DIR"
FAILED_SUFFIX = ".failed.json"  # <name>.failed.json: the results file of a run that failed


def default_results_path(chapter: str) -> Path:
    """``$QKOV_RESULTS_DIR/<chapter>.json``, else ``<repo>/_build/results/<chapter>.json``."""
    return Path(os.environ.get(RESULTS_ENV, REPO_ROOT / "_build" / "results")) / f"{chapter}.json"


def jsonable(x: Any) -> Any:
    """``x`` made strict-JSON-able: mappings (keys as strings), lists/tuples, numpy scalars and
    arrays, torch tensors and paths become plain JSON values, and a non-finite float (NaN, inf,
    e.g. the interval of a single seed) becomes None (``null``)."""
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray, torch.Tensor)):
        return jsonable(x.tolist())
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def replace_atomically(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then move it onto ``path`` with
    :func:`os.replace`: a reader sees the old file or the new one, never half a file. The
    temporary file is removed if ``write`` raises. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | os.PathLike, doc: Any, indent: int | None = 1) -> Path:
    """Write ``doc`` to ``path`` as strict JSON (:func:`jsonable`: NaN/inf become ``null``,
    ``allow_nan=False``), atomically (:func:`replace_atomically`). Returns ``path``."""
    text = json.dumps(jsonable(doc), indent=indent, allow_nan=False, default=str)
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def save_results(chapter: str, params: Mapping[str, Any], metrics: Any, path: str | os.PathLike | None = None,
                 wall_time_s: float | None = None, device: str | None = None) -> Path:
    """Write the chapter's machine-readable results: parameters, metrics (any JSON-able
    structure, typically a list of row dicts), versions, git commit, device, wall time (s) and the
    sha256 of every data file read in this process (:func:`qkov_lib.data.sources.used_files`).
    The file is strict JSON (NaN/inf as ``null``, see :func:`write_json`), written atomically."""
    out = Path(path) if path else default_results_path(chapter)
    doc = {"chapter": chapter, "params": dict(params), "metrics": metrics, "versions": versions(),
           "git_commit": git_commit(), "device": device or str(pick_device()), "wall_time_s": wall_time_s,
           "data_files": used_files()}
    return write_json(out, doc)


def failed_path(path: str | os.PathLike) -> Path:
    """``<name>.failed.json`` beside the results file ``<name>.json``."""
    p = Path(path)
    return p.with_name(p.name.removesuffix(".json") + FAILED_SUFFIX)


def mark_failed(path: str | os.PathLike, error: str) -> Path | None:
    """Move the results file ``path`` of a run that failed to ``<name>.failed.json``, with
    ``"status": "failed"`` and ``error`` added, so no reader takes its numbers for a finished
    run. Returns the new path, or None when there is no file at ``path``."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    doc = {**doc} if isinstance(doc, Mapping) else {"chapter": p.stem, "unreadable_results": True}
    out = write_json(failed_path(p), {**doc, "status": "failed", "error": error})
    p.unlink()
    return out


def is_failed(path: str | os.PathLike, doc: Any) -> bool:
    """True for a results file marked by :func:`mark_failed` (its name or its ``status``)."""
    return Path(path).name.endswith(FAILED_SUFFIX) or (isinstance(doc, Mapping) and doc.get("status") == "failed")
