"""A chapter as a program: find its MyST source, read its ``parameters`` cell, check overrides
against it and against the chapter's settings call, and execute it through papermill (a
jupytext conversion that keeps the ``parameters`` tag) into a notebook and a results file.
Used by the ``qkov`` command line (:mod:`qkov_lib.tooling.cli`) and the sweeps (:mod:`qkov_lib.tooling.sweeps`)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qkov_lib.tooling.results import failed_path, mark_failed
from qkov_lib.runtime import REPO_ROOT


def chapter_path(chapter: str | os.PathLike) -> Path:
    """The MyST source of a chapter, given a path or a name: ``synthetic`` finds
    ``book/01_synthetic.md`` (chapter files carry a number prefix that sets their order)."""
    p = Path(chapter)
    if p.suffix == ".md" and p.exists():
        return p
    book = REPO_ROOT / "book"
    found = [q for q in sorted(book.glob("*.md")) if q.stem == p.stem or q.stem.split("_", 1)[-1] == p.stem]
    if len(found) != 1:
        names = sorted(q.stem.split("_", 1)[-1] for q in book.glob("[0-9]*_*.md"))
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


def run_chapter(chapter: str | os.PathLike, out_dir: str | os.PathLike, parameters: Mapping[str, Any] | None = None,
                name: str | None = None, progress: bool = False) -> tuple[Path, Path]:
    """Execute a chapter with papermill: convert the MyST file with jupytext (keeping the
    ``parameters`` tag), inject ``parameters`` plus ``results_path``, and write
    ``<out_dir>/<name>.ipynb`` and ``<out_dir>/<name>.json``. Returns both paths.

    Parameter names are checked first (:func:`check_parameters`; values are checked by the
    chapter, or before by ``qkov run``/``qkov sweep`` with :func:`check_settings`). An earlier
    ``<name>.json`` is removed before the run; when the run fails, a results file it wrote becomes
    ``<name>.failed.json`` (:func:`qkov_lib.tooling.results.mark_failed`) and the error is raised."""
    import jupytext
    import papermill as pm

    src = chapter_path(chapter)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or src.stem.split("_", 1)[-1]
    check_parameters(src, parameters or {})
    nb_in = out_dir / f"{name}.input.ipynb"
    nb = jupytext.read(src)
    if not any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise ValueError(f"{src} has no cell tagged 'parameters'")
    nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"})
    jupytext.write(nb, nb_in)
    nb_out, results = out_dir / f"{name}.ipynb", out_dir / f"{name}.json"
    for old in (results, failed_path(results)):  # an earlier run's numbers are not this notebook's
        old.unlink(missing_ok=True)
    params = {**(parameters or {}), "results_path": str(results.resolve())}
    try:
        for attempt in range(KERNEL_START_TRIES):
            try:
                with tempfile.TemporaryDirectory(prefix="qkov-kernel-") as sockets:
                    pm.execute_notebook(str(nb_in), str(nb_out), parameters=params, cwd=str(src.parent),
                                        progress_bar=progress, kernel_name="python3", config=_ipc_config(sockets))
                break
            except RuntimeError as exc:
                # A kernel that dies before running any cell (a busy machine's slow start) can be
                # started again safely; kernels on Unix sockets no longer race for TCP ports.
                if KERNEL_DIED not in str(exc) or attempt == KERNEL_START_TRIES - 1:
                    raise
    except BaseException as exc:
        mark_failed(results, f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}")
        raise
    finally:
        nb_in.unlink(missing_ok=True)
    return nb_out, results
