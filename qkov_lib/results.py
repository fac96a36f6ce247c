"""Machine-readable results files of chapters and tidy per-run tables."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data.sources import used_files
from .runtime import REPO_ROOT, git_commit, pick_device, versions

RESULTS_ENV = "QKOV_RESULTS_DIR"


def tag_frame(frame, **tags: Any):
    """``frame`` (a pandas DataFrame, copied) with one leading column per tag, in the given order,
    e.g. ``tag_frame(f, parameterization="FAFO", ratio=10.0, seed=0)``."""
    out = frame.copy()
    for i, (name, value) in enumerate(tags.items()):
        out.insert(i, name, value)
    return out


def default_results_path(chapter: str) -> Path:
    """``$QKOV_RESULTS_DIR/<chapter>.json``, else ``<repo>/_build/results/<chapter>.json``."""
    root = Path(os.environ.get(RESULTS_ENV, REPO_ROOT / "_build" / "results"))
    return root / f"{chapter}.json"


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    return x


def save_results(chapter: str, params: Mapping[str, Any], metrics: Any, path: str | os.PathLike | None = None,
                 wall_time_s: float | None = None, device: str | None = None) -> Path:
    """Write the chapter's machine-readable results: parameters, metrics (any JSON-able
    structure, typically a list of row dicts), versions, git commit, device, wall time and the
    sha256 of every data file read in this process (:func:`qkov_lib.data.sources.used_files`)."""
    out = Path(path) if path else default_results_path(chapter)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "chapter": chapter,
        "params": _jsonable(dict(params)),
        "metrics": _jsonable(metrics),
        "versions": versions(),
        "git_commit": git_commit(),
        "device": device or str(pick_device()),
        "wall_time_s": wall_time_s,
        "data_files": used_files(),  # sha256 of every data file the run read
    }
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=True))
    tmp.replace(out)  # atomic: a reader never sees half a file
    return out
