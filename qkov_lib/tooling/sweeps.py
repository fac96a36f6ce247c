"""Parameter sweeps over a chapter: a grid of papermill runs, a tidy results table, resume.

A sweep expands a grid (``{"eta_ov": [0.25, 0.5], "steps": [30, 60]}`` = 4 runs) into runs of
one chapter, each executed by :func:`qkov_lib.tooling.chapters.run_chapter`. Every run gets a stable ID
(a hash of the chapter and its parameters), so rerunning a sweep skips the runs that already
finished. A run that fails is recorded with its error and the sweep goes on.

Layout of a sweep folder ``OUT``::

    OUT/runs/<run_id>.ipynb     executed notebook (<run_id>.failed.ipynb: a failed run's, with the error)
    OUT/runs/<run_id>.json      the chapter's results file (parameters, metrics, versions, ...)
    OUT/records/<run_id>.json   one record per run: status, error, parameters, timings
    OUT/results.{json,csv,parquet}   the table, one row per run of the current grid
    OUT/submitit/               logs of submitit jobs (Slurm or its local executor)
    OUT/.sweep.lock             held (``flock``) while a sweep writes to OUT: a second one stops

Paths in records are relative to OUT, so a moved sweep folder still resumes. The pool workers
of ``-j N`` end with the sweep process (SIGTERM, Ctrl-C, or SIGKILL of the parent), their
kernels with them. Bad input (workers < 1, an empty grid axis, a grid axis whose values are not
values of the parameter, unknown names) raises :class:`SweepError` before any kernel starts.

Executors: ``local`` (in-process for one worker, else a process pool of N workers),
``slurm`` and ``submitit-local`` (the same submitit code path; the latter runs the jobs as local
processes and is what the tests use).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import platform
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from qkov_lib.tooling.cache import chapter_name  # noqa: F401 -- also sweeps.chapter_name
from qkov_lib.tooling.chapters import chapter_parameters
from qkov_lib.tooling.results import failed_path, output_lock, replace_atomically, write_json

EXECUTORS = ("local", "slurm", "submitit-local")
RESERVED = ("results_path",)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LOCK_NAME = "sweep"  # the folder lock <OUT>/.sweep.lock (results.output_lock)


class SweepError(ValueError):
    """A sweep that cannot start (bad grid, parameters, workers or executor); nothing ran."""


class SweepBusy(SweepError):
    """Another process is sweeping into the same folder (it holds the folder's lock)."""


# ----------------------------------------------------------------------------- grid


def expand_grid(grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Sequence[Any]]]) -> list[dict[str, Any]]:
    """All combinations of a grid ``{name: [value, ...]}``, the last name varying fastest.
    A list of grids gives the concatenation of their expansions (duplicates dropped).
    Every value list must be a non-empty list; raises TypeError/ValueError otherwise."""
    if isinstance(grid, Mapping):
        grids: list[Mapping[str, Sequence[Any]]] = [grid]
    elif isinstance(grid, Sequence) and not isinstance(grid, (str, bytes)):
        grids = list(grid)
    else:
        raise TypeError("a grid is a mapping name -> list of values (or a list of such mappings), "
                        f"got {type(grid).__name__}")
    points: list[dict[str, Any]] = []
    seen: set[str] = set()
    for g in grids:
        if not isinstance(g, Mapping):
            raise TypeError(f"each grid must be a mapping name -> list of values, got {type(g).__name__}")
        for name, values in g.items():
            if not isinstance(values, (list, tuple)):
                raise TypeError(f"grid values of {name!r} must be a list, got {type(values).__name__} {values!r}"
                                " (to sweep over list-valued parameters, give a list of lists: '[[1], [10]]')")
            if not values:
                raise ValueError(f"grid values of {name!r} are empty")
        names = list(g)
        for combo in itertools.product(*(g[n] for n in names)):
            point = dict(zip(names, combo))
            key = _canonical(point)
            if key not in seen:
                seen.add(key)
                points.append(point)
    return points


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def run_id(chapter: str, params: Mapping[str, Any]) -> str:
    """Stable ID of one run: ``<chapter>-<10 hex>`` from a hash of the chapter name and the
    parameters (order of keys does not matter; ``1`` and ``1.0`` differ)."""
    digest = hashlib.sha256(_canonical({"chapter": chapter, "params": dict(params)}).encode()).hexdigest()
    return f"{chapter}-{digest[:10]}"


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to execute one run (picklable)."""

    chapter: str          # absolute path of the chapter source
    name: str             # chapter name, e.g. "synthetic"
    run_id: str
    params: dict          # the parameters injected by papermill (profile included)
    out_dir: str          # the sweep folder
    threads: int | None = None  # OMP/MKL threads for the kernel (None: inherit)


def _record_path(out_dir: str | Path, rid: str) -> Path:
    return Path(out_dir) / "records" / f"{rid}.json"


@contextlib.contextmanager
def _thread_env(threads: int | None) -> Iterator[None]:
    """Set the BLAS/OpenMP thread counts that a kernel started inside inherits."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    old = {n: os.environ.get(n) for n in names}
    if threads:
        for n in names:
            os.environ[n] = str(threads)
    try:
        yield
    finally:
        for n, v in old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _error_text(exc: BaseException) -> tuple[str, str]:
    """A one-line error and a plain-text traceback (papermill's cell error when there is one)."""
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename is not None:
        tb = getattr(exc, "traceback", None) or []
        text = "\n".join(tb) if isinstance(tb, list) else str(tb)
        return f"{ename}: {evalue}", _ANSI.sub("", text)[-4000:]
    return f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc))[-4000:]


def execute_run(spec: RunSpec) -> dict[str, Any]:
    """Execute one run through papermill and write its record; never raises for a failing
    notebook (the record then has ``status="failed"`` and the error)."""
    from qkov_lib.tooling import chapters
    from qkov_lib import runtime

    out = Path(spec.out_dir)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    record: dict[str, Any] = {
        "run_id": spec.run_id, "chapter": spec.name, "params": dict(spec.params),
        "host": platform.node(), "started_at": started.isoformat(timespec="seconds"),
        "notebook": f"runs/{spec.run_id}.ipynb",  # relative to the sweep folder: it can move
        "results_file": f"runs/{spec.run_id}.json",
    }
    try:
        with _thread_env(spec.threads):
            chapters.run_chapter(spec.chapter, out / "runs", spec.params, name=spec.run_id, progress=False)
        doc = json.loads((out / record["results_file"]).read_text())
        record.update(status="ok", error=None, traceback=None, resolved_params=doc.get("params", {}))
        record.update({k: doc.get(k) for k in ("metrics", "versions", "git_commit", "device", "wall_time_s")})
    except Exception as exc:  # noqa: BLE001 -- any failure of a run is data, not a crash
        err, tb = _error_text(exc)
        failed_nb = failed_path(out / record["notebook"])
        record["notebook"] = f"runs/{failed_nb.name}" if failed_nb.is_file() else None
        record.update(status="failed", error=err, traceback=tb, resolved_params=None, metrics=None,
                      versions=runtime.versions(), git_commit=runtime.git_commit(),
                      device=str(runtime.pick_device()), wall_time_s=None)
    record["run_time_s"] = time.perf_counter() - t0
    record["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json(_record_path(out, spec.run_id), record)
    return record


def _failed_record(spec: RunSpec, exc: BaseException) -> dict[str, Any]:
    """Record for a run whose worker or job died before it could write its own record."""
    err, tb = _error_text(exc)
    record = {"run_id": spec.run_id, "chapter": spec.name, "params": dict(spec.params), "status": "failed",
              "error": err, "traceback": tb, "resolved_params": None, "metrics": None,
              "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json(_record_path(spec.out_dir, spec.run_id), record)
    return record


def load_record(out_dir: str | Path, rid: str) -> dict[str, Any] | None:
    """The record of run ``rid`` in a sweep folder, or None (none written, or unreadable JSON)."""
    try:
        return json.loads(_record_path(out_dir, rid).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------- table


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(obj, (list, tuple)):
        out[prefix] = json.dumps(obj, default=str)
    else:
        out[prefix] = obj


def record_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """One flat table row: ``param.<name>`` (the chapter's resolved parameters when it ran,
    else the requested ones; lists as JSON), ``metric.<path>`` (nested dicts flattened with dots,
    lists as JSON), ``claim.<ID>`` (the verdict of each claim the chapter reported),
    ``version.<package>`` and the run's status, error, commit, device and wall times."""
    row: dict[str, Any] = {k: record.get(k) for k in
                           ("run_id", "chapter", "status", "error", "git_commit", "device", "wall_time_s",
                            "run_time_s", "host", "started_at", "finished_at", "notebook", "results_file")}
    params = {**(record.get("params") or {}), **(record.get("resolved_params") or {})}
    for k, v in params.items():
        row[f"param.{k}"] = json.dumps(v) if isinstance(v, (list, tuple, dict)) else v
    metrics = record.get("metrics")
    if isinstance(metrics, Mapping):
        for k, v in metrics.items():
            _flatten(f"metric.{k}", v, row)
        for c in metrics.get("claims") or []:
            if isinstance(c, Mapping) and "id" in c:
                row[f"claim.{c['id']}"] = c.get("verdict")
    elif metrics is not None:
        _flatten("metric", metrics, row)
    for k, v in (record.get("versions") or {}).items():
        row[f"version.{k}"] = v
    return row


def results_table(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The tidy table of a sweep: one row per run (see :func:`record_row`)."""
    return pd.DataFrame([record_row(r) for r in records])


def metric_frame(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Long form of a list-of-records metric (e.g. ``"summary"``): one row per record per run,
    with the run's ``run_id`` and ``param.*`` columns joined on."""
    col = f"metric.{metric}"
    if col not in table:
        raise KeyError(f"no metric {metric!r}; metrics: {sorted(c[7:] for c in table if c.startswith('metric.'))}")
    pcols = ["run_id"] + [c for c in table if c.startswith("param.")]
    parts = []
    for _, row in table.iterrows():
        if not isinstance(row[col], str):
            continue
        recs = json.loads(row[col])
        if recs:
            part = pd.DataFrame(recs)
            for c in pcols:
                part[c] = row[c]
            parts.append(part)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=pcols)


def _arrow_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns that mix strings and other values become strings (parquet needs one type)."""
    df = df.copy()
    for c in df.columns:
        if df[c].dtype == object:
            kinds = {type(v) for v in df[c] if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if len(kinds) > 1 or (kinds and not kinds <= {str}):
                df[c] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else
                         (v if isinstance(v, str) else json.dumps(v, default=str)) for v in df[c]]
    return df


def write_table(records: Sequence[Mapping[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json`` (the full records, strict JSON), ``results.csv`` and, when pyarrow
    is installed, ``results.parquet`` (the flat table), each atomically (a reader never sees half
    a file). Returns the paths written."""
    out = Path(out_dir)
    paths = {"json": out / "results.json", "csv": out / "results.csv"}
    write_json(paths["json"], list(records))
    table = results_table(records)
    replace_atomically(paths["csv"], lambda tmp: table.to_csv(tmp, index=False))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return paths
    paths["parquet"] = replace_atomically(out / "results.parquet",
                                          lambda tmp: _arrow_safe(table).to_parquet(tmp, index=False))
    return paths


# ----------------------------------------------------------------------------- executors


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_init(parent: int) -> None:
    """First thing in each pool worker: it dies with the sweep process ``parent``. On Linux the
    kernel sends it SIGKILL when the parent exits (``prctl(PR_SET_PDEATHSIG)``), elsewhere a
    daemon thread checks once a second. Ctrl-C is the parent's to handle (it kills the workers),
    SIGTERM ends the worker at once; a worker's kernel exits within a second of its worker
    (ipykernel's parent poller)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's SIGTERM -> SystemExit
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)


@contextlib.contextmanager
def _handling(signals: Sequence[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """While inside (main thread only, where Python runs signal handlers): ``handler`` for each
    of ``signals``; the previous handlers are restored on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, previous in old.items():
            signal.signal(s, previous)


def _sigterm_as_exit() -> contextlib.AbstractContextManager[None]:
    """While inside (main thread only): SIGTERM raises SystemExit(143) instead of ending the
    process at once, so the sweep's clean-up (killing its workers) runs."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return _handling((signal.SIGTERM,), stop)


@contextlib.contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """While inside (main thread only): SIGINT and SIGTERM are noted in the list it yields, not
    raised where they land. The pool loop raises them itself between two polls: an exception
    that a signal raises inside ``concurrent.futures`` (a future's condition taken, not yet
    released) leaves that lock held, and the pool's shutdown then waits on it for ever."""
    noted: list[int] = []
    with _handling((signal.SIGINT, signal.SIGTERM), lambda signum, frame: noted.append(signum)):
        yield noted


def _raise_noted(noted: list[int]) -> None:
    """Raise what the first noted signal would have raised: KeyboardInterrupt for SIGINT,
    SystemExit(128 + signal) for SIGTERM."""
    if noted:
        if noted[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + noted[0])


def folder_lock(out_dir: str | os.PathLike) -> contextlib.AbstractContextManager[Path]:
    """Hold an exclusive ``flock`` on ``<out_dir>/.sweep.lock`` (with this process's PID in it)
    while inside (:func:`qkov_lib.tooling.results.output_lock`, the lock ``qkov run`` takes on
    its name); raise :class:`SweepBusy` at once if another process holds it."""
    return output_lock(out_dir, LOCK_NAME, lambda pid: SweepBusy(
        f"another sweep (pid {pid}) is writing to {out_dir}; wait for it to end or give another --out"))


def _kill_workers(pool: Any) -> None:
    """SIGKILL the worker processes of a ProcessPoolExecutor (no public call before Python 3.14)."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(OSError):
            proc.kill()


def _submitit_executor(kind: str, out_dir: Path, name: str, workers: int, params: Mapping[str, Any]):
    import submitit

    cluster = "slurm" if kind == "slurm" else "local"
    ex = submitit.AutoExecutor(folder=str(out_dir / "submitit"), cluster=cluster)
    opts: dict[str, Any] = {"name": f"qkov-{name}", "timeout_min": 120, "slurm_array_parallelism": workers}
    opts.update({k: v for k, v in params.items() if v is not None})
    ex.update_parameters(**opts)
    return ex


@dataclass
class SweepResult:
    """What a sweep did: the table (one row per run of the grid) and counts."""

    table: pd.DataFrame
    executed: int
    skipped: int
    failed: int
    paths: dict[str, Path] = field(default_factory=dict)
    wall_time_s: float = 0.0


def _run_parallel(pending: Sequence[RunSpec], executor: str, out: Path, name: str, workers: int,
                  executor_params: Mapping[str, Any], poll_s: float | None,
                  finish: Callable[[dict[str, Any]], None]) -> None:
    """Run ``pending`` on a pool of ``workers`` processes (``local``) or as submitit jobs, and
    hand each record to ``finish`` as it ends. Ctrl-C and SIGTERM are noted and raised between
    two polls (:func:`_signals_noted`); on any exception the local workers are killed first."""
    pool = None
    with _signals_noted() as noted:
        try:
            if executor == "local":
                import multiprocessing as mp
                from concurrent.futures import ProcessPoolExecutor

                ctx = mp.get_context("fork" if sys.platform != "win32" else "spawn")
                pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                           initargs=(os.getpid(),))
                handles = [(s, pool.submit(execute_run, s)) for s in pending]
                poll = poll_s or 0.2
            else:
                ex = _submitit_executor(executor, out, name, workers, executor_params)
                with ex.batch():
                    jobs = [ex.submit(execute_run, s) for s in pending]
                handles = list(zip(pending, jobs))
                poll = poll_s or (1.0 if executor == "submitit-local" else 15.0)
            while handles:
                _raise_noted(noted)
                still = []
                for s, h in handles:
                    if not h.done():
                        still.append((s, h))
                        continue
                    try:
                        rec = h.result()
                    except Exception as exc:  # noqa: BLE001 -- worker/job died: record it, go on
                        rec = _failed_record(s, exc)
                    finish(rec)
                handles = still
                if handles:
                    time.sleep(poll)
            _raise_noted(noted)
        except BaseException:  # Ctrl-C, SIGTERM, an error: no run goes on without us
            if pool is not None:
                _kill_workers(pool)
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def plan(chapter: str | os.PathLike, grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Sequence[Any]]],
         params: Mapping[str, Any] | None = None, profile: str | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """The chapter source and the parameter dict of every run (fixed ``params`` updated with one
    grid point, and the profile made explicit so that a run's ID pins it). Unknown parameter
    names, a grid axis whose values are not values of its parameter (``-g ratios '[1, 10]'`` for
    a list-valued ``ratios``: ``'[[1], [10]]'``) and values the chapter's ``profiles.resolve``
    would reject (:func:`qkov_lib.tooling.chapters.check_settings`) raise ValueError before anything runs."""
    from qkov_lib.tooling import chapters
    from qkov_lib import profiles

    src = chapters.chapter_path(chapter).resolve()
    known = chapter_parameters(src)
    points = expand_grid(grid) if grid else [{}]
    fixed = dict(params or {})
    if profile is not None and "profile" not in known:
        raise ValueError(f"{src.name} has no 'profile' parameter; do not pass a profile")
    for name in list(fixed) + sorted({k for p in points for k in p}):
        if name in RESERVED:
            raise ValueError(f"{name!r} is set by the sweep itself; do not pass it")
        if name not in known:
            raise ValueError(f"unknown parameter {name!r} of {src.name}; it takes {', '.join(sorted(known))}")
    call = chapters.settings_call(src)
    table, prof, kw = call or ({}, None, {})
    param_kw = {v: k for k, v in kw.items()}
    runs = []
    for point in points:
        p = {**fixed, **point}
        if "profile" in known and p.get("profile") is None:
            p["profile"] = profiles.profile_name(profile)
        defaults = table.get(profiles.profile_name(p.get(prof) if prof else None), {})
        for axis, value in point.items():
            if isinstance(defaults.get(param_kw.get(axis)), (list, tuple)) \
                    and not isinstance(value, (list, tuple, type(None))):
                values = [q[axis] for q in points if axis in q]
                raise ValueError(f"grid axis {axis!r}: each grid value is one run's {axis!r}, which is a list; "
                                 f"give a list of lists, e.g. -g {axis} '{json.dumps([[v] for v in values])}'")
        chapters.check_settings(src, p, call)
        runs.append(p)
    return src, runs


def sweep(chapter: str | os.PathLike, grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Sequence[Any]]],
          out_dir: str | os.PathLike, params: Mapping[str, Any] | None = None, profile: str | None = None,
          executor: str = "local", workers: int = 1, threads: int | None = None, force: bool = False,
          retry_failed: bool = True, executor_params: Mapping[str, Any] | None = None,
          progress: bool = True, poll_s: float | None = None) -> SweepResult:
    """Run ``chapter`` once per point of ``grid`` (merged over the fixed ``params``) and write
    the results table to ``out_dir``. Runs that already succeeded there are skipped (unless
    ``force``); failed ones are retried unless ``retry_failed=False``. ``executor`` is one of
    ``local`` (``workers`` processes), ``slurm`` or ``submitit-local``; ``executor_params`` go to
    submitit's ``update_parameters`` (``timeout_min``, ``gpus_per_node``, ``slurm_partition``, ...).

    Raises :class:`SweepError` before any kernel starts for bad input (see :func:`plan`;
    ``workers``/``threads`` < 1), :class:`SweepBusy` when another sweep holds ``out_dir``'s lock."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    try:
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}; expected one of {', '.join(EXECUTORS)}")
        for what, n in (("workers", workers), ("threads", 1 if threads is None else threads)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{what} must be a positive integer, got {n!r}")
        src, run_params = plan(chapter, grid, params, profile)
    except (TypeError, ValueError, FileNotFoundError) as e:
        raise SweepError(str(e)) from e
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out), _sigterm_as_exit():
        name = chapter_name(src)
        if threads is None and executor == "local" and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, (os.cpu_count() or 1) // workers)
        specs = [RunSpec(str(src), name, run_id(name, p), p, str(out), threads) for p in run_params]
        write_json(out / "sweep.json", {"chapter": name, "source": str(src), "params": dict(params or {}),
                                         "grid": grid, "runs": [s.run_id for s in specs]})

        def todo(s: RunSpec) -> bool:
            if force:
                return True
            rec = load_record(out, s.run_id)
            if rec is None:
                return True
            if rec.get("status") == "ok":
                done = rec.get("results_file")  # relative to the sweep folder (absolute in old records)
                return not (done and (out / done).is_file())
            return retry_failed

        pending = [s for s in specs if todo(s)]
        skipped = len(specs) - len(pending)
        bar = tqdm(total=len(specs), initial=skipped, desc=f"sweep {name}", unit="run", disable=not progress)
        n_failed = 0

        def finish(rec: dict[str, Any]) -> None:
            nonlocal n_failed
            n_failed += rec.get("status") != "ok"
            bar.update(1)
            bar.set_postfix(failed=n_failed, refresh=False)

        if pending and executor == "local" and workers == 1:
            for s in pending:
                finish(execute_run(s))
        elif pending:
            _run_parallel(pending, executor, out, name, workers, executor_params or {}, poll_s, finish)
        bar.close()

        records = [load_record(out, s.run_id) or _failed_record(s, RuntimeError("no record was written"))
                   for s in specs]
        paths = write_table(records, out)
        table = results_table(records)
        failed = int((table["status"] != "ok").sum()) if len(table) else 0
        return SweepResult(table, executed=len(pending), skipped=skipped, failed=failed, paths=paths,
                           wall_time_s=time.perf_counter() - t0)


# ----------------------------------------------------------------------------- CLI


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """A sweep file (YAML or JSON)::

        chapter: synthetic
        profile: test
        params: {parameterizations: [FAFO, CACO]}   # fixed for every run
        grid: {eta_ov: [0.25, 0.5], steps: [30, 60]}  # one run per combination
        executor: local
        workers: 2
    """
    import yaml

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"sweep file {p} does not exist")
    doc = yaml.safe_load(p.read_text()) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"sweep file {p} must hold a mapping, got {type(doc).__name__}")
    allowed = {"chapter", "profile", "params", "grid", "executor", "workers", "threads", "out", "executor_params"}
    unknown = set(doc) - allowed
    if unknown:
        raise ValueError(f"unknown keys in {p}: {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(allowed))}")
    return doc


def add_arguments(ap) -> None:
    """The ``sweep`` subcommand's arguments (see :func:`from_args`)."""
    ap.add_argument("chapter", nargs="?", help="chapter name (e.g. synthetic) or path; or set `chapter` in --config")
    ap.add_argument("-g", "--grid", nargs=2, action="append", default=[], metavar=("NAME", "VALUES"),
                    help="a grid axis: VALUES is a JSON/YAML list, one run per value and combination "
                         "(e.g. -g eta_ov '[0.25, 0.5]' -g ratios '[[1], [10]]')")
    ap.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="a parameter fixed for every run (VALUE parsed as JSON when possible)")
    ap.add_argument("-c", "--config", help="YAML sweep file (chapter, profile, params, grid, executor, workers, out); "
                                           "command-line options override it")
    ap.add_argument("--profile", choices=("test", "cpu", "full"), help="profile (default: $QKOV_PROFILE, else cpu)")
    ap.add_argument("--out", help="sweep folder (default: runs/sweep-<chapter>)")
    ap.add_argument("--executor", choices=EXECUTORS, help="local (default), slurm or submitit-local")
    ap.add_argument("-j", "--workers", type=int, help="parallel runs (local processes, or Slurm array parallelism)")
    ap.add_argument("--threads", type=int, help="OMP/MKL threads per run (default: cores / workers for local)")
    ap.add_argument("--force", action="store_true", help="rerun finished runs too")
    ap.add_argument("--no-retry-failed", action="store_true", help="keep failed runs as they are on a rerun")
    ap.add_argument("--timeout-min", type=int, help="submitit: time limit of each job in minutes (default 120)")
    ap.add_argument("--partition", help="slurm: partition")
    ap.add_argument("--gpus-per-node", type=int, help="submitit: GPUs per job")
    ap.add_argument("--cpus-per-task", type=int, help="submitit: CPUs per job")
    ap.add_argument("--mem-gb", type=int, help="submitit: memory per job in GB")


def _parse(text: str) -> Any:
    import yaml

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text


def from_args(args) -> int:
    """Run a sweep from parsed command-line arguments; exit status 1 when a run failed, 2 with a
    one-line message when the sweep cannot start (nothing ran)."""
    try:
        return _from_args(args)
    except (SweepError, FileNotFoundError) as e:
        print(f"qkov sweep: {e}", file=sys.stderr)
        return 2


def _from_args(args) -> int:
    try:
        cfg = load_config(args.config) if args.config else {}
    except ValueError as e:
        raise SweepError(str(e)) from e
    chapter = args.chapter or cfg.get("chapter")
    if not chapter:
        raise SweepError("give a chapter (positional or `chapter:` in --config)")
    grid = dict(cfg.get("grid") or {}, **{k: _parse(v) for k, v in args.grid})
    params = dict(cfg.get("params") or {}, **{k: _parse(v) for k, v in args.param})
    executor = args.executor or cfg.get("executor", "local")
    options = {"timeout_min": args.timeout_min, "slurm_partition": args.partition, "gpus_per_node": args.gpus_per_node,
               "cpus_per_task": args.cpus_per_task, "mem_gb": args.mem_gb}
    ex_params = dict(cfg.get("executor_params") or {}, **{k: v for k, v in options.items() if v is not None})
    src = Path(str(chapter))
    out = args.out or cfg.get("out") or f"runs/sweep-{chapter_name(src) if src.suffix else src.name}"
    res = sweep(chapter, grid, out, params=params, profile=args.profile or cfg.get("profile"), executor=executor,
                workers=cfg.get("workers", 1) if args.workers is None else args.workers,
                threads=cfg.get("threads") if args.threads is None else args.threads,
                force=args.force, retry_failed=not args.no_retry_failed, executor_params=ex_params)
    print(f"{len(res.table)} runs: {res.executed} executed, {res.skipped} skipped (finished before), "
          f"{res.failed} failed; {res.wall_time_s:.1f} s")
    for kind, path in res.paths.items():
        print(f"{kind:8s} {path}")
    if res.failed:
        for _, row in res.table[res.table["status"] != "ok"].iterrows():
            print(f"FAILED {row['run_id']}: {row['error']}", file=sys.stderr)
    return 1 if res.failed else 0


__all__ = ["expand_grid", "run_id", "RunSpec", "execute_run", "record_row", "results_table",
           "metric_frame", "write_table", "plan", "sweep", "SweepResult", "SweepError", "SweepBusy",
           "folder_lock", "load_config"]
