"""Machine-readable results files of chapters and tidy per-run tables, and how a run puts them
in place: under a lock on its name and folder (:func:`output_lock`), written where no reader
looks (:func:`running_path`) and moved into place only when the run has succeeded
(:func:`publish_run`); a run that failed leaves a record of its own (:func:`record_failure`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkov_lib.data.sources import used_files
from qkov_lib.runtime import REPO_ROOT, RESULTS_ENV, git_commit, pick_device, results_file, versions

FAILED_SUFFIX = ".failed.json"  # <name>.failed.json: the results file of a run that failed
RUNNING_DIR = ".running"  # <folder>/.running/<name>/<file>: what a run writes until it has succeeded


def default_results_path(chapter: str) -> Path:
    """``$QKOV_RESULTS_DIR/<chapter>.json``, else ``<repo>/_build/results/<chapter>.json``
    (:func:`qkov_lib.runtime.results_file`)."""
    return results_file(chapter)


def jsonable(x: Any) -> Any:
    """``x`` made strict-JSON-able: mappings (keys as strings; a tuple key's parts joined by " / ",
    as ``FAFO / 10``), lists/tuples, numpy scalars and arrays, torch tensors, pandas tables (a list
    of row records) and paths become plain JSON values, and a non-finite float (NaN, inf, e.g. the
    interval of a single seed) becomes None (``null``)."""
    if isinstance(x, Mapping):
        return {(" / ".join(f"{p:g}" if isinstance(p, float) else str(p) for p in k) if isinstance(k, tuple)
                 else str(k)): jsonable(v) for k, v in x.items()}
    if type(x).__name__ == "DataFrame" and hasattr(x, "to_dict"):
        return jsonable(x.to_dict("records"))
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
                 wall_time_s: float | None = None, device: str | None = None, cost: Any = None) -> Path:
    """Write the chapter's machine-readable results: parameters, metrics (any JSON-able
    structure, typically a list of row dicts), versions, git commit, device, wall time (s), the
    sha256 of every data file read in this process (:func:`qkov_lib.data.sources.used_files`) and
    ``cost``: the estimate made before the run (a :class:`qkov_lib.cost.Estimate`; None: the one
    :func:`qkov_lib.cost.preflight` made for ``chapter`` in this process, if any) beside the
    measured wall time. The file is strict JSON (NaN/inf as ``null``, see :func:`write_json`),
    written atomically."""
    from qkov_lib import cost as cost_model

    out = Path(path) if path else default_results_path(chapter)
    doc = {"chapter": chapter, "params": dict(params), "metrics": metrics, "versions": versions(),
           "git_commit": git_commit(), "device": device or str(pick_device()), "wall_time_s": wall_time_s,
           "data_files": used_files(),
           "cost": cost_model.results_record(cost or cost_model.recorded(chapter), wall_time_s)}
    return write_json(out, doc)


def failed_path(path: str | os.PathLike) -> Path:
    """``<name>.failed.json`` beside the results file ``<name>.json`` (``<name>.failed.ipynb``
    beside the notebook ``<name>.ipynb``)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.failed{p.suffix}")


def mark_failed(path: str | os.PathLike, error: str, to: str | os.PathLike | None = None, **fields: Any) -> Path | None:
    """Move the results file ``path`` of a run that failed to ``to`` (default
    ``<name>.failed.json`` beside it), with ``fields``, ``"status": "failed"`` and ``error``
    added, so no reader takes its numbers for a finished run. Returns the new path, or None when
    there is no file at ``path``; ``path`` stays when the record cannot be written (OSError)."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    doc = {**doc} if isinstance(doc, Mapping) else {"chapter": p.stem, "unreadable_results": True}
    out = write_json(Path(to) if to else failed_path(p), {**doc, **fields, "status": "failed", "error": error})
    p.unlink()
    return out


def running_path(path: str | os.PathLike) -> Path:
    """Where a run writes the file that becomes ``path`` once it has succeeded:
    ``<folder>/.running/<name>/<file name>`` (``<name>``: the file's stem, the run's name). No reader
    of ``<folder>/*.json`` sees it, and it keeps its name, so a notebook that prints where its results
    went names the file it wrote. A folder per run, so that a run tidying up its own never removes the
    folder another run (of another name, in the same output folder) is about to write into."""
    p = Path(path)
    return p.parent / RUNNING_DIR / p.stem / p.name


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, name: str, busy: Callable[[str], BaseException]) -> Iterator[Path]:
    """Hold an exclusive ``flock`` on ``<folder>/.<name>.lock`` (with this process's PID in it)
    while inside. If another process holds it, raise ``busy(pid)`` at once (``pid``: what the
    holder wrote, ``"?"`` if nothing yet). The lock goes with the last process holding the file
    open, however it ends; the empty lock file stays. OSError when the folder cannot be written."""
    import fcntl

    path = Path(folder) / f".{name}.lock"
    f = open(path, "a+")  # noqa: SIM115 -- held open while inside
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise busy(holder) from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield path
    finally:
        f.close()


def start_run(results: Path, notebook: Path) -> None:
    """Before a run (under its :func:`output_lock`): make the running folder and remove what an
    earlier attempt of the same name left there (killed before it could clean up) and its failed
    record, which this run supersedes. The finished ``results`` and ``notebook`` stay."""
    folder = running_path(results).parent
    for _ in range(5):  # another run may remove the empty .running between our two mkdirs: make it again
        try:
            folder.mkdir(parents=True, exist_ok=True)
            break
        except FileNotFoundError:
            continue
    else:
        folder.mkdir(parents=True, exist_ok=True)
    for p in (running_path(results), running_path(notebook), failed_path(results), failed_path(notebook)):
        p.unlink(missing_ok=True)


def _json_of(path: Path) -> Any:
    """The JSON document in ``path``; None when the file is missing or not whole JSON (e.g. cut
    short by a full disk)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def publish_run(results: Path, notebook: Path) -> None:
    """Move a successful run's files from :func:`running_path` into place with :func:`os.replace`
    (a reader sees the earlier file or the new one, never half a file): the notebook first, the
    results file last, so a results file is never newer than its notebook. ValueError, with
    nothing moved, when the run wrote no results file or one that is not a whole JSON object."""
    doc = _json_of(running_path(results))
    if not isinstance(doc, Mapping):
        how = "wrote no results file" if not running_path(results).exists() else "wrote a results file that is not a whole JSON object"
        raise ValueError(f"the chapter {how} at its results_path ({running_path(results)}); "
                         f"nothing was put at {results}")
    os.replace(running_path(notebook), notebook)
    os.replace(running_path(results), results)
    _remove_if_empty(running_path(results).parent)


def _remove_if_empty(folder: Path) -> None:
    """Remove a run's own running folder, then ``.running`` itself, each only when empty: a run of
    another name may hold its own folder there."""
    for f in (folder, folder.parent):
        with contextlib.suppress(OSError):
            f.rmdir()


def record_failure(results: Path, notebook: Path, error: str, fallback: Mapping[str, Any]) -> tuple[Path | None, Path | None]:
    """After a run failed: keep its notebook as ``<name>.failed.ipynb`` when papermill wrote it
    whole (a notebook cut short, e.g. by a full disk, is deleted: it is no record), and write
    ``<name>.failed.json``: the results document the run wrote (:func:`mark_failed`), else
    ``fallback`` (e.g. the chapter and the requested parameters), with ``status``, ``error`` and
    the notebook's name. Touches neither ``results`` nor ``notebook``, which belong to an earlier,
    finished run; leaves nothing in the running folder. Returns (record, notebook), each None when
    not written; a record that cannot be written (OSError, e.g. a full disk) is None, never half
    a file (:func:`write_json`)."""
    run_nb, run_res = running_path(notebook), running_path(results)
    kept = None
    try:
        if isinstance(_json_of(run_nb), Mapping):
            os.replace(run_nb, failed_path(notebook))
            kept = failed_path(notebook)
    except OSError:
        kept = None
    run_nb.unlink(missing_ok=True)
    fields = {"notebook": kept.name if kept else None}
    try:
        record = (mark_failed(run_res, error, to=failed_path(results), **fields)
                  or write_json(failed_path(results), {**fallback, **fields, "status": "failed", "error": error}))
    except OSError:
        record = None
    run_res.unlink(missing_ok=True)
    _remove_if_empty(run_res.parent)
    return record, kept


def is_failed(path: str | os.PathLike, doc: Any) -> bool:
    """True for a results file marked by :func:`mark_failed` (its name or its ``status``)."""
    return Path(path).name.endswith(FAILED_SUFFIX) or (isinstance(doc, Mapping) and doc.get("status") == "failed")
