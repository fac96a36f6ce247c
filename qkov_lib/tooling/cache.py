"""Keep cached chapter outputs honest: a change to ``qkov_lib`` invalidates them.

Jupyter Book caches a notebook's outputs keyed on its code cells (jupyter-cache), and Sphinx
re-reads only the sources whose files changed. Neither sees the library the cells call, nor the
``QKOV_PROFILE`` the kernels inherit. This module adds that missing part of the key:

- :func:`library_hash` hashes the library's ``.py`` files; :func:`cache_key` combines it with the
  ``QKOV_*`` environment (profile included), the sha256 of every data file of the manifest found
  in the data folder, the data manifest and ``requirements.txt`` themselves, the Python version
  and the installed version of every library pinned in ``requirements.txt`` (torch and numpy
  always) -- see :func:`key_parts`.
- A Sphinx extension (``sphinx: extra_extensions: [qkov_lib.tooling.cache]`` in ``_config.yml``):

  * registers the key as a config value that forces a full re-read when it changes, so an
    incremental build re-executes every chapter after a library change (``force`` mode);
  * in ``cache`` mode, points jupyter-cache at ``<cache>/<key>/jc`` and the chapters' results
    files at ``<cache>/<key>/results``: each key has its own cache, so outputs and the numbers the
    scorecard reads always come from the same library state;
  * always re-reads the pages in ``qkov_always_read`` (the scorecard, which summarises the others).

- :func:`stage_executed` + :func:`build_book`: build the book from notebooks that papermill
  already executed (the GPU workflow), without executing anything again.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qkov_lib.tooling.names import chapter_name  # noqa: F401 -- also cache.chapter_name

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # qkov_lib: the library the cache key hashes
REPO_ROOT = PACKAGE_DIR.parent
REQUIREMENTS = REPO_ROOT / "requirements.txt"
KEY_ENV_EXCLUDE = ("QKOV_RESULTS_DIR",)  # where results go does not change what they are
MODES = ("force", "cache", "executed")


def library_hash(package_dir: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) over the relative paths and bytes of every ``.py`` file under
    ``package_dir`` (default: the installed ``qkov_lib``), in sorted order."""
    root = Path(package_dir) if package_dir else PACKAGE_DIR
    if not root.is_dir():
        raise FileNotFoundError(f"library folder {root} does not exist")
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(pkg: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def pinned_packages(requirements: str | os.PathLike = REQUIREMENTS) -> list[str]:
    """Names (as written) of the libraries pinned in a requirements file, in file order; a
    missing file gives ``[]``. Comments, options (``-r``, ``--index-url``) and blank lines are
    skipped; a line that is not a requirement raises ValueError naming it."""
    from packaging.requirements import InvalidRequirement, Requirement  # installed with matplotlib

    path = Path(requirements)
    if not path.is_file():
        return []
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            names.append(Requirement(line).name)
        except InvalidRequirement as e:
            raise ValueError(f"{path}: cannot read the requirement {line!r}: {e}") from e
    return names


def data_hashes(data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """``{path relative to the data folder: sha256}`` of every manifest file present in the data
    folder (:func:`qkov_lib.data.sources.resolve_data_dir`; ``{}`` when there is none)."""
    from qkov_lib.data import sources

    try:
        root = sources.resolve_data_dir(data_dir)
    except FileNotFoundError:
        return {}
    return {rel: sources.sha256_file(root / rel) for rel in sorted(sources.manifest()) if (root / rel).is_file()}


def _file_sha256(path: str | os.PathLike) -> str | None:
    from qkov_lib.data import sources

    return sources.sha256_file(path) if Path(path).is_file() else None


def key_parts(package_dir: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
              requirements: str | os.PathLike = REQUIREMENTS) -> dict[str, Any]:
    """What the cache key is made of: the library hash, the ``QKOV_*`` variables (profile
    defaulting to ``cpu`` as in :func:`qkov_lib.profiles.profile_name`), the sha256 of the data
    files (:func:`data_hashes` of ``$QKOV_DATA_DIR`` in ``environ``), of the data manifest
    (``$QKOV_DATA_MANIFEST`` or the packaged one) and of ``requirements``, the Python version and
    the installed version of torch, numpy and every library pinned in ``requirements``."""
    from qkov_lib.data import sources

    env = os.environ if environ is None else environ
    qkov_env = {k: v for k, v in sorted(env.items()) if k.startswith("QKOV_") and k not in KEY_ENV_EXCLUDE}
    qkov_env.setdefault("QKOV_PROFILE", "cpu")
    packages = sorted({"torch", "numpy", *(n.lower() for n in pinned_packages(requirements))})
    return {"library": library_hash(package_dir), "env": qkov_env,
            # the data folder of `environ` alone: without QKOV_DATA_DIR there, the default folder, never this
            # process's own $QKOV_DATA_DIR (a key computed for another environment must not read it)
            "data": data_hashes(env.get(sources.DATA_ENV) or sources.DEFAULT_DATA_DIR),
            "manifest": _file_sha256(env.get(sources.MANIFEST_ENV) or sources.MANIFEST_PATH),
            "requirements": _file_sha256(requirements), "python": platform.python_version(),
            "packages": {n: _version(n) for n in packages}}


def cache_key(package_dir: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
              requirements: str | os.PathLike = REQUIREMENTS) -> str:
    """16 hex digits identifying the library state, data, pinned libraries and settings that
    chapter outputs depend on (:func:`key_parts`)."""
    return key_of(key_parts(package_dir, environ, requirements))


def key_of(parts: Mapping[str, Any]) -> str:
    """16 hex digits of the sha256 of ``parts`` (a :func:`key_parts` dict) as sorted JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def keyed_dirs(base: str | os.PathLike, key: str) -> tuple[Path, Path]:
    """(jupyter-cache folder, results folder) of ``key`` under ``base``."""
    d = Path(base) / key
    return d / "jc", d / "results"


def prune(base: str | os.PathLike, keep: int = 3, protect: str | None = None) -> list[Path]:
    """Delete all but the ``keep`` most recently used key folders under ``base`` (never
    ``protect``). Returns the folders deleted."""
    base = Path(base)
    if not base.is_dir():
        return []
    dirs = sorted((d for d in base.iterdir() if d.is_dir() and (d / "jc").is_dir()),
                  key=lambda d: d.stat().st_mtime, reverse=True)
    gone = [d for d in dirs[keep:] if d.name != protect]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


# ----------------------------------------------------------------------------- Sphinx extension


def _config_inited(app, config) -> None:
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    lib = config.qkov_library_dir or None
    parts = key_parts(lib)
    key = key_of(parts)
    config.qkov_cache_key = key
    log.info(f"[qkov] cache key {key} (library {parts['library'][:12]}, {len(parts['data'])} data files, "
             f"profile {parts['env']['QKOV_PROFILE']})")
    if config.nb_execution_mode != "cache":
        return
    base = Path(config.nb_execution_cache_path or Path(app.outdir).parent / ".jupyter_cache")
    if not base.is_absolute():
        base = Path(app.confdir) / base
    jc, results = keyed_dirs(base, key)
    jc.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    os.utime(jc.parent)
    gone = prune(base, keep=config.qkov_cache_keep, protect=key)
    config.nb_execution_cache_path = str(jc)
    os.environ["QKOV_RESULTS_DIR"] = str(results)  # the kernels inherit it
    log.info(f"[qkov] jupyter-cache {jc}; results {results}" + (f"; pruned {len(gone)} old keys" if gone else ""))


def _always_read(app, env, added, changed, removed) -> list[str]:
    pats = app.config.qkov_always_read
    return sorted(d for d in env.found_docs if any(fnmatch.fnmatch(d, p) for p in pats) and d not in added | changed)


def setup(app) -> dict[str, Any]:
    """Sphinx entry point (``extra_extensions: [qkov_lib.tooling.cache]``)."""
    app.add_config_value("qkov_cache_key", "", "env")
    app.add_config_value("qkov_library_dir", "", "env")
    app.add_config_value("qkov_always_read", ["*scorecard*", "*intro*"], "env")
    app.add_config_value("qkov_cache_keep", 3, "")
    app.connect("config-inited", _config_inited, priority=400)
    app.connect("env-get-outdated", _always_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


# ----------------------------------------------------------------------------- book helpers


def toc_files(root: str | os.PathLike = REPO_ROOT) -> list[str]:
    """Docnames in ``_toc.yml`` (root first), in reading order. FileNotFoundError when there is no
    ``_toc.yml``; ValueError, naming the line, when it is not YAML or not a mapping with a ``root``."""
    import yaml

    path = Path(root) / "_toc.yml"
    if not path.is_file():
        raise FileNotFoundError(f"the book's table of contents {path} does not exist")
    try:
        toc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"the book's table of contents {path} is not valid YAML{where}: "
                         f"{getattr(e, 'problem', None) or e}") from None
    if not isinstance(toc, Mapping) or not isinstance(toc.get("root"), str):
        raise ValueError(f"the book's table of contents {path} must be a mapping with a 'root' page "
                         f"(Jupyter Book's _toc.yml), found {type(toc).__name__}")
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            for doc in (node.get(k) for k in ("root", "file")):
                if isinstance(doc, str):
                    out.append(str(Path(doc).with_suffix("")) if Path(doc).suffix in (".md", ".ipynb") else doc)
            for k in ("parts", "chapters", "sections", "entries"):
                for child in node.get(k) or []:
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(toc)
    return out


def is_notebook(path: str | os.PathLike) -> bool:
    """True for an ``.ipynb`` or a MyST file whose front matter has a ``kernelspec``/``jupytext``."""
    p = Path(path)
    if p.suffix == ".ipynb":
        return True
    text = p.read_text(encoding="utf-8")
    if not text.startswith("---"):
        return False
    head = text.split("\n---", 1)[0]
    return "kernelspec:" in head or "jupytext:" in head


def toc_pages(root: str | os.PathLike = REPO_ROOT) -> list[Path]:
    """The file of every page in ``_toc.yml`` (``<doc>.md``, else ``<doc>.ipynb``), in toc order.
    FileNotFoundError naming every entry that has no file, so no page is left out unseen."""
    root = Path(root)
    docs = toc_files(root)
    found = {doc: next((p for p in (root / f"{doc}.md", root / f"{doc}.ipynb") if p.is_file()), None) for doc in docs}
    missing = [doc for doc, p in found.items() if p is None]
    if missing:
        raise FileNotFoundError(f"{root / '_toc.yml'} lists {', '.join(missing)}, but there is no "
                                f"{' or '.join(f'{m}.md (or .ipynb)' for m in missing)}: restore the file or fix the entry")
    return [found[doc] for doc in docs]


def chapters(root: str | os.PathLike = REPO_ROOT) -> list[Path]:
    """The executable pages of the book (MyST notebooks in ``_toc.yml``), in toc order; an entry
    without a file is an error (:func:`toc_pages`)."""
    return [p for p in toc_pages(root) if is_notebook(p)]


def _executed_for(src: Path, executed: Path) -> Path | None:
    stem = src.stem
    head, _, tail = stem.partition("_")
    for name in ([tail] if head.isdigit() and tail else []) + [stem]:
        p = executed / f"{name}.ipynb"
        if p.exists():
            return p
    return None


def _load_config(root: Path, mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``<root>/_config.yml`` set to ``execute_notebooks: <mode>``, and its ``sphinx`` section."""
    import yaml

    path = root / "_config.yml"
    cfg = yaml.safe_load(path.read_text()) if path.exists() else {}
    cfg.setdefault("execute", {})["execute_notebooks"] = mode
    return cfg, cfg.setdefault("sphinx", {})


def _write_config(cfg: Mapping[str, Any], path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(cfg), sort_keys=False))
    return path


INJECTED_TAG = "injected-parameters"  # papermill's tag on the cell it adds after `parameters`
# a quoted absolute path in Python source: "/..." or "C:\..." / "C:/..."
_ABS_PATH_LITERAL = re.compile(r"""(["'])((?:/|[A-Za-z]:[\\/])[^"'\n]*)\1""")
_MACHINE_PATH = re.compile(r"^(?:/|~|[A-Za-z]:[\\/])")


def _is_machine_path(value: Any) -> bool:
    return isinstance(value, str) and bool(_MACHINE_PATH.match(value))


def _file_name(path: str) -> str:
    return re.split(r"[\\/]", path.rstrip("\\/"))[-1]


def hide_injected_parameters(nb: Any) -> int:
    """Hide papermill's injected-parameters cells of notebook ``nb`` (in place); returns how many.

    papermill sets ``results_path`` to an absolute path on the machine that ran the chapter. Each
    injected cell is tagged ``remove-cell`` (the page does not show it), and a markdown note after
    it lists the run's other parameters and says why the cell is hidden. Absolute paths are cut
    to their file names in the cell's source and in ``metadata.papermill``, so the downloadable
    notebook carries no machine path either."""
    import nbformat

    pm = nb.metadata.get("papermill", {})
    params = dict(pm.get("parameters") or {})
    for key in ("input_path", "output_path"):
        if _is_machine_path(pm.get(key)):
            pm[key] = _file_name(pm[key])
    if params:
        pm["parameters"] = {k: _file_name(v) if _is_machine_path(v) else v for k, v in params.items()}
    shown = ", ".join(f"`{k} = {v!r}`" for k, v in params.items() if not _is_machine_path(v))
    paths = ", ".join(f"`{k}`" for k, v in params.items() if _is_machine_path(v))
    why = (f"The cell is hidden because it also sets {paths} to a file path on the machine that ran "
           f"the notebook; the downloadable notebook keeps only the file name." if paths else
           "The cell is hidden; its values are listed here.")
    hidden, cells = 0, []
    for cell in nb.cells:
        cells.append(cell)
        tags = cell.get("metadata", {}).get("tags", [])
        if INJECTED_TAG not in tags:
            continue
        cell.source = _ABS_PATH_LITERAL.sub(lambda m: f"{m.group(1)}{_file_name(m.group(2))}{m.group(1)}",
                                            cell.source)
        if "remove-cell" not in tags:
            cell.metadata["tags"] = [*tags, "remove-cell"]
        # meta text about how the page ran, folded so that it does not stand between a reader and the results
        note = nbformat.v4.new_markdown_cell(
            "```{admonition} How this page was run\n:class: dropdown\n"
            f"This page was executed with papermill, which added a cell of parameters after the one "
            f"above: {shown or 'no values besides paths'}. {why}\n```")
        note.metadata["tags"] = ["papermill-parameters-note"]
        cells.append(note)
        hidden += 1
    nb.cells = cells
    return hidden


def stage_executed(root: str | os.PathLike, executed: str | os.PathLike, stage: str | os.PathLike) -> Path:
    """A copy of the book at ``stage`` in which every chapter notebook is replaced by its
    papermill-executed version from ``executed`` (``<name>.ipynb``, as written by
    :func:`qkov_lib.tooling.chapters.run_chapter`) and execution is switched off. papermill's
    injected-parameters cells are hidden with a note (:func:`hide_injected_parameters`); the
    download menu still offers each chapter's ``.md`` from ``root`` (``qkov_source_dir``, read by
    :mod:`qkov_lib.tooling.bookhtml`). Raises FileNotFoundError naming the chapters that have no executed
    notebook."""
    import nbformat

    root, executed, stage = Path(root).resolve(), Path(executed).resolve(), Path(stage).resolve()
    if not executed.is_dir():
        raise FileNotFoundError(f"folder of executed notebooks {executed} does not exist")
    pages = chapters(root)
    found = {p: _executed_for(p, executed) for p in pages}
    missing = [str(p.relative_to(root)) for p, e in found.items() if e is None]
    if missing:
        raise FileNotFoundError(f"no executed notebook in {executed} for: {', '.join(missing)}")
    if stage.exists():
        shutil.rmtree(stage)
    top_skip = {".git", "_build", "runs", ".jupyter_cache", ".pytest_cache"}

    def ignore(d: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n == "__pycache__" or n.endswith(".ipynb") or n.startswith(".venv")}
        return skip | (top_skip & set(names) if Path(d).resolve() == root else set())

    shutil.copytree(root, stage, ignore=ignore)
    for src, nb_path in found.items():
        nb = nbformat.read(nb_path, as_version=4)
        nb.metadata.get("mystnb", {}).pop("execution_mode", None)
        hide_injected_parameters(nb)
        rel = src.relative_to(root)
        (stage / rel).unlink(missing_ok=True)
        nbformat.write(nb, stage / rel.with_suffix(".ipynb"))
    cfg, sph = _load_config(root, "off")
    sph["config"] = {**(sph.get("config") or {}), "qkov_source_dir": str(root)}
    _write_config(cfg, stage / "_config.yml")
    return stage


def overlay_config(root: str | os.PathLike, mode: str, out: str | os.PathLike) -> Path:
    """``_config.yml`` with ``execute_notebooks: <mode>`` and this extension added, written to ``out``."""
    cfg, sph = _load_config(Path(root), mode)
    ext = list(sph.get("extra_extensions") or [])
    if __name__ not in ext:
        ext.append(__name__)
    sph["extra_extensions"] = ext
    return _write_config(cfg, Path(out))


def _jupyter_book() -> list[str]:
    exe = Path(sys.executable).parent / "jupyter-book"  # the venv's, also when it is not on PATH
    found = str(exe) if exe.exists() else shutil.which("jupyter-book")
    if not found:
        raise FileNotFoundError("jupyter-book is not installed (pip install 'jupyter-book<2')")
    return [found]


def build_book(root: str | os.PathLike = REPO_ROOT, mode: str = "force", executed: str | os.PathLike | None = None,
               strict: bool = True, extra: list[str] | None = None) -> int:
    """Build the HTML book into ``<root>/_build/html``.

    ``force``: execute every chapter (incremental builds re-execute all after a library change);
    ``cache``: reuse outputs cached under the library key; ``executed``: no execution, pages come
    from the notebooks in ``executed`` (see :func:`stage_executed`; ``qkov book --mode run`` runs
    them first, :mod:`qkov_lib.tooling.bookrun`). Returns jupyter-book's status."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    root = Path(root).resolve()
    work = root / "_build" / "qkov"
    flags = (["-W", "--keep-going"] if strict else []) + list(extra or [])
    if mode == "executed":
        if executed is None:
            raise ValueError("mode 'executed' needs the folder of executed notebooks")
        stage = stage_executed(root, executed, work / "stage")
        cmd = _jupyter_book() + ["build", str(stage), "--path-output", str(root)] + flags
    else:
        cfg = overlay_config(root, mode, work / f"_config.{mode}.yml")
        cmd = _jupyter_book() + ["build", str(root), "--config", str(cfg)] + flags
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def clear(root: str | os.PathLike = REPO_ROOT) -> list[Path]:
    """Delete the keyed caches under ``<root>/_build/.jupyter_cache``."""
    base = Path(root) / "_build" / ".jupyter_cache"
    gone = [d for d in base.iterdir() if d.is_dir()] if base.is_dir() else []
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone
