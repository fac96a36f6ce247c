"""A chapter as a program: find its MyST source, read its ``parameters`` cell, check overrides
against it and against the chapter's settings call, and execute it through papermill (a
jupytext conversion that keeps the ``parameters`` tag) into a notebook and a results file.
Used by the ``qkov`` command line (:mod:`qkov_lib.tooling.cli`) and the sweeps (:mod:`qkov_lib.tooling.sweeps`)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import os
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# the checkout (the chapters are under book/); not runtime.REPO_ROOT, whose module imports torch, and a
# chapter's parameters are read without it (qkov chapters --run-order)
REPO_ROOT = Path(__file__).resolve().parents[2]


def chapter_path(chapter: str | os.PathLike) -> Path:
    """The MyST source of a chapter, given a path or a name: ``synthetic`` finds
    ``book/01_synthetic.md`` (chapter files carry a number prefix that sets their order)."""
    p = Path(chapter)
    if p.suffix == ".md" and p.exists():
        return p
    book = REPO_ROOT / "book"
    from qkov_lib.tooling.names import chapter_name

    found = [q for q in sorted(book.glob("*.md")) if q.stem == p.stem or chapter_name(q) == p.stem]
    if len(found) != 1:
        names = sorted(chapter_name(q) for q in book.glob("[0-9]*_*.md"))
        raise FileNotFoundError(f"no single chapter {str(chapter)!r}; chapters: {', '.join(names)}")
    return found[0]


def chapter_parameters(path: str | os.PathLike) -> dict[str, Any]:
    """Names and default values of the ``parameters`` cell of a chapter (MyST or ipynb).
    Raises ValueError when there is no such cell or it is not plain assignments."""
    import jupytext

    nb = jupytext.read(Path(path))
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not cells:
        raise ValueError(f"{path} has no cell tagged 'parameters'")
    out: dict[str, Any] = {}
    for node in ast.parse(cells[0].source).body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                value = ast.unparse(node.value)
            for t in node.targets:
                out[t.id] = value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ast.literal_eval(node.value) if node.value is not None else None
        else:
            raise ValueError(f"the parameters cell of {path} must hold plain assignments, found: {ast.unparse(node)!r}")
    return out


def check_parameters(src: Path, parameters: Mapping[str, Any]) -> None:
    """Raise ValueError naming every key of ``parameters`` that the chapter's ``parameters`` cell
    does not define (papermill would only warn and run the defaults), with the valid names."""
    known = chapter_parameters(src)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        raise ValueError(f"unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"of {src.name}; valid names: {', '.join(sorted(known))}")


def _qkov_names(tree: ast.Module, names: dict[str, Any]) -> None:
    """Bind the ``qkov_lib`` imports of a cell (``from qkov_lib.x import y as z``) in ``names``."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "qkov_lib":
            for a in node.names:
                try:
                    names[a.asname or a.name] = importlib.import_module(f"{node.module}.{a.name}")
                except ImportError:
                    names[a.asname or a.name] = getattr(importlib.import_module(node.module), a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "qkov_lib" and a.asname:
                    names[a.asname] = importlib.import_module(a.name)


def _lookup(node: ast.expr, names: Mapping[str, Any]) -> Any:
    """The value of ``name``, ``name.attr`` or ``name[constant]`` chains over ``names``."""
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.Attribute):
        return getattr(_lookup(node.value, names), node.attr)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return _lookup(node.value, names)[node.slice.value]
    raise ValueError(f"not a plain reference: {ast.unparse(node)}")


def settings_call(path: str | os.PathLike) -> tuple[Mapping[str, Mapping[str, Any]], str | None, dict[str, str]] | None:
    """How a chapter turns its parameters into settings, read from its first
    ``profiles.resolve(TABLE, profile, key=parameter, ...)`` call without running it: (the
    profile table, the name of the parameter passed as the profile, ``{keyword: parameter
    name}``). None when the chapter has no such call in that form."""
    import jupytext

    from qkov_lib import profiles

    names: dict[str, Any] = {}
    for cell in jupytext.read(Path(path)).cells:
        if cell.cell_type != "code":
            continue
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:  # IPython magics and shell lines are not Python
            tree = ast.parse(code)
        except SyntaxError:
            continue
        _qkov_names(tree, names)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and len(node.args) == 2):
                continue
            try:
                if _lookup(node.func, names) is not profiles.resolve:
                    continue
                table = _lookup(node.args[0], names)
            except (KeyError, AttributeError, IndexError, TypeError, ValueError):
                continue
            prof = node.args[1].id if isinstance(node.args[1], ast.Name) else None
            return table, prof, {k.arg: k.value.id for k in node.keywords if k.arg and isinstance(k.value, ast.Name)}
    return None


def check_settings(src: str | os.PathLike, parameters: Mapping[str, Any],
                   call: tuple[Mapping[str, Mapping[str, Any]], str | None, dict[str, str]] | None = None) -> None:
    """Check ``parameters`` the way the chapter's own ``profiles.resolve`` call will (see
    :func:`settings_call`), before a kernel starts: raise ValueError with the chapter's message
    for a value of the wrong type or out of range; a scalar where the profile holds a list is
    named as such. Chapters without such a call pass (their kernel checks)."""
    from qkov_lib import profiles

    profiles.check_values(parameters)  # by meaning, for every parameter (map settings too)
    call = settings_call(src) if call is None else call
    if call is None:
        return
    table, prof, kw = call
    overrides = {k: parameters[v] for k, v in kw.items() if v in parameters and parameters[v] is not None}
    defaults = table.get(profiles.profile_name(parameters.get(prof) if prof else None), {})
    for k, v in overrides.items():
        if isinstance(defaults.get(k), (list, tuple)) and not isinstance(v, (list, tuple)):
            raise ValueError(f"parameter {kw[k]!r} of {Path(src).name} takes a list "
                             f"(e.g. {json.dumps(list(defaults[k]))}), got {type(v).__name__} {v!r}")
    try:
        profiles.resolve(table, parameters.get(prof) if prof else None, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from e


#: The longest file names a run makes from its name (``.x.lock``, ``x.failed.ipynb``, an atomic write's
#: ``.x.failed.json.<pid>.tmp``; a PID has at most 7 digits on Linux): a name is checked with them.
STAGED_NAMES = (".{}.lock", "{}.failed.ipynb", ".{}.failed.json.9999999.tmp", ".{}.ipynb.9999999.tmp",
                "{}.input.ipynb")


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or its nearest existing parent) takes."""
    for f in (folder, *folder.absolute().parents):
        if f.exists():
            try:
                return os.pathconf(f, "PC_NAME_MAX")
            except (OSError, ValueError):
                break
    return 255


def check_name(name: str, out_dir: str | os.PathLike) -> None:
    """Raise ValueError when ``name`` cannot name a run's files in ``out_dir``: it must be one path
    component (no ``/``, not ``.`` or ``..``, not empty) short enough that the file system takes
    every file a run makes from it (:data:`STAGED_NAMES`). Checked before anything runs."""
    seps = {"/", os.sep, os.altsep} - {None}
    if not name or name in (".", "..") or any(c in name for c in seps) or "\0" in name:
        raise ValueError(f"the name {name!r} must be one file name (no {' or '.join(sorted(seps))}, not "
                         "'.' or '..', not empty): the run writes NAME.ipynb and NAME.json into the output folder")
    limit = _name_max(Path(out_dir))
    longest = max(len(os.fsencode(t.format(name))) for t in STAGED_NAMES)
    if longest > limit:
        room = limit - (longest - len(os.fsencode(name)))
        raise ValueError(f"the name is {len(os.fsencode(name))} bytes long; the file system of {out_dir} takes "
                         f"file names of at most {limit} bytes, and a run adds up to {longest - len(os.fsencode(name))} "
                         f"to it (e.g. {STAGED_NAMES[2].format('NAME')}): give at most {room}")


#: A kernel that dies before its first reply (jupyter_client's message) is started again, this often.
KERNEL_START_TRIES = 3
KERNEL_DIED = "Kernel died before replying to kernel_info"


def _ipc_config(folder: str):
    """Kernel config: talk to the kernel over Unix sockets in ``folder`` (one per run), not TCP
    ports, so that kernels started at the same moment (a parallel sweep) cannot be handed the same
    port, and no socket file lands in the chapter's folder."""
    from traitlets.config import Config

    c = Config()
    c.KernelManager.transport = "ipc"
    c.KernelManager.ip = os.path.join(folder, "kernel")
    return c


class RunNotStarted(RuntimeError):
    """Nothing ran: the output folder cannot be written, or another run holds its name there."""


class RunBusy(RunNotStarted):
    """Another process is running the same name into the same folder (it holds the lock); ``pid``: its PID."""

    def __init__(self, message: str, pid: str):
        super().__init__(message)
        self.pid = pid


def error_line(exc: BaseException) -> str:
    """One line for a failed run: papermill's cell error (``ename: evalue``), else ``Type: message``."""
    name, value = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", exc)
    return f"{name}: {value}" if str(value) else name


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal: ``signum`` is SIGINT (Ctrl-C) or SIGTERM (``kill``, ``timeout``, Slurm,
    ``docker stop``). A KeyboardInterrupt, so that what catches Ctrl-C catches both."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


#: seconds a kernel asked to interrupt its cell has to end it before the run stops without it
STOP_GRACE_S = 10.0
#: a signal this soon after the first is the same request (``timeout`` signals the process and then its
#: process group); a later one stops the run at once
REPEAT_S = 1.0
_KERNELS: weakref.WeakSet = weakref.WeakSet()  # kernel managers of this process's runs (see _kernel_manager_class)


def _kernel_manager_class():
    """jupyter_client's kernel manager, recording each instance, so that a signal can reach the kernel."""
    from jupyter_client.manager import AsyncKernelManager

    class TrackedKernelManager(AsyncKernelManager):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            _KERNELS.add(self)

    return TrackedKernelManager


def _interrupt_kernels() -> bool:
    """SIGINT to the process group of every running kernel of this process (what Jupyter's interrupt
    does): its cell raises KeyboardInterrupt and papermill ends the run with that error. False when
    no kernel is running."""
    sent = False
    for km in list(_KERNELS):
        provisioner = getattr(km, "provisioner", None)
        pgid, process = getattr(provisioner, "pgid", None), getattr(provisioner, "process", None)
        if pgid and process is not None and process.poll() is None:  # a kernel that ended: its group is gone
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGINT)
                sent = True
    return sent


@contextlib.contextmanager
def stopping_on_signals(grace_s: float = STOP_GRACE_S) -> Iterator[list[int]]:
    """While inside (main thread only; elsewhere nothing changes): SIGINT and SIGTERM stop a run
    alike, noted in the list it yields. The first one, while a kernel runs, interrupts the kernel's
    cell (:func:`_interrupt_kernels`), so papermill ends the run and shuts the kernel down itself,
    with no half-closed socket left to print tracebacks; :class:`Interrupted` is raised at once
    before a kernel runs, on a second signal (:data:`REPEAT_S` or more after the first), or when the
    kernel has not ended its cell ``grace_s`` seconds after the first (SIGALRM)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    noted: list[int] = []
    first: list[float] = []

    def on_signal(signum: int, frame: Any) -> None:
        noted.append(signum)
        if not first:
            first.append(time.monotonic())
            if _interrupt_kernels():
                signal.setitimer(signal.ITIMER_REAL, grace_s)
                return
        elif time.monotonic() - first[0] < REPEAT_S:
            return  # the same stop once more (timeout sends it to the process, then to its group)
        raise Interrupted(noted[0])

    def overdue(signum: int, frame: Any) -> None:
        raise Interrupted(noted[0])

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    old[signal.SIGALRM] = signal.signal(signal.SIGALRM, overdue)
    try:
        yield noted
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_noted(noted: list[int]) -> Iterator[None]:
    """While inside (main thread only): SIGINT and SIGTERM are only noted, so a run's clean-up ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _execute(nb_in: Path, nb_out: Path, params: Mapping[str, Any], cwd: Path, progress: bool) -> None:
    """papermill's run of ``nb_in`` into ``nb_out``; a kernel that dies before its first reply is started again."""
    import papermill as pm

    for attempt in range(KERNEL_START_TRIES):
        try:
            with tempfile.TemporaryDirectory(prefix="qkov-kernel-") as sockets:
                pm.execute_notebook(str(nb_in), str(nb_out), parameters=dict(params), cwd=str(cwd),
                                    progress_bar=progress, kernel_name="python3", config=_ipc_config(sockets),
                                    kernel_manager_class=_kernel_manager_class())
            return
        except RuntimeError as exc:
            # A kernel that dies before running any cell (a busy machine's slow start) can be
            # started again safely; kernels on Unix sockets no longer race for TCP ports.
            if KERNEL_DIED not in str(exc) or attempt == KERNEL_START_TRIES - 1:
                raise


def run_chapter(chapter: str | os.PathLike, out_dir: str | os.PathLike, parameters: Mapping[str, Any] | None = None,
                name: str | None = None, progress: bool = False, stop_on_signals: bool = False) -> tuple[Path, Path]:
    """Execute a chapter with papermill: convert the MyST file with jupytext (keeping the
    ``parameters`` tag), inject ``parameters`` plus ``results_path``, and write
    ``<out_dir>/<name>.ipynb`` and ``<out_dir>/<name>.json``. Returns both paths.

    The name (:func:`check_name`) and the parameter names are checked first (:func:`check_parameters`; values are checked by the
    chapter, or before by ``qkov run``/``qkov sweep`` with :func:`check_settings`). The run holds
    ``<out_dir>/.<name>.lock`` throughout: while it does, a second run of the same name into the
    same folder raises :class:`RunBusy` (with the holder's PID) and runs nothing; a folder that
    cannot be written raises :class:`RunNotStarted`. The notebook and the results file are written
    under ``<out_dir>/.running/`` and moved onto ``<name>.ipynb`` and ``<name>.json`` only when
    the run has succeeded and its results file is whole JSON: an earlier run's files are
    replaced then, and not before. A run that fails leaves them as they were, writes its own
    record ``<name>.failed.json`` (and keeps its notebook with the error as
    ``<name>.failed.ipynb``, when papermill wrote it whole;
    :func:`qkov_lib.tooling.results.record_failure`), and raises its error. With ``stop_on_signals``
    (``qkov run``; a sweep's workers leave signals to the sweep), SIGINT and SIGTERM stop it alike
    (:func:`stopping_on_signals`): the same record, the lock released, the running folder emptied,
    and :class:`Interrupted` raised."""
    import jupytext

    from qkov_lib.tooling.results import output_lock, publish_run, record_failure, running_path, start_run

    src = chapter_path(chapter)
    out_dir = Path(out_dir)
    from qkov_lib.tooling.names import chapter_name

    name = name or chapter_name(src)
    check_name(name, out_dir)
    check_parameters(src, parameters or {})
    nb = jupytext.read(src)
    if not any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise ValueError(f"{src} has no cell tagged 'parameters'")
    nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"})
    nb_out, results = out_dir / f"{name}.ipynb", out_dir / f"{name}.json"

    def busy(pid: str) -> RunBusy:
        return RunBusy(f"another run (pid {pid}) is writing {name} in {out_dir}; wait for it to end, "
                       f"or give another --out or --name", pid)

    with contextlib.ExitStack() as stack:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            stack.enter_context(output_lock(out_dir, name, busy))
            start_run(results, nb_out)
        except OSError as e:
            raise RunNotStarted(f"cannot write to the output folder {out_dir} ({e.strerror or e}); nothing ran; "
                                "give another --out") from e
        params = {**(parameters or {}), "results_path": str(running_path(results).resolve())}
        noted: list[int] = []
        try:
            with stopping_on_signals() if stop_on_signals else contextlib.nullcontext(noted) as noted:
                with tempfile.TemporaryDirectory(prefix="qkov-run-") as tmp:
                    nb_in = Path(tmp) / f"{name}.input.ipynb"
                    jupytext.write(nb, nb_in)
                    _execute(nb_in, running_path(nb_out), params, src.parent, progress)
                if noted:  # the signal came as the last cell ended: the run was still asked to stop
                    raise Interrupted(noted[0])
                publish_run(results, nb_out)
        except BaseException as exc:
            # a signal ends the run as Interrupted, whatever the kernel's interrupted cell raised
            stop = exc if isinstance(exc, Interrupted) or not noted else Interrupted(noted[0])
            with _signals_noted(noted):
                record_failure(results, nb_out, error_line(stop), {"chapter": chapter_name(src),
                                                                   "params": dict(parameters or {})})
            if stop is not exc:
                raise stop from None
            raise
    return nb_out, results
