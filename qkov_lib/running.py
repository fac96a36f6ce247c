"""Profiles, chapter parameters, devices, seeds, results files and papermill reruns.

Every chapter's ``parameters`` cell holds plain literals (``profile = None``, overrides set to
``None``); :func:`resolve` turns them into a validated settings dict from the chapter's
profile table, so a papermill parameter of the wrong type fails with a clear message.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROFILES = ("test", "cpu", "full")
PROFILE_ENV = "QKOV_PROFILE"
RESULTS_ENV = "QKOV_RESULTS_DIR"
REPO_ROOT = Path(__file__).resolve().parent.parent


def profile_name(profile: str | None) -> str:
    """``profile``, or ``$QKOV_PROFILE``, or ``"cpu"``; raises ValueError if unknown."""
    name = profile if profile is not None else os.environ.get(PROFILE_ENV, "cpu")
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; expected one of {', '.join(PROFILES)}")
    return name


def _type_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)) or not value:
            return False
        return all(_type_ok(v, default[0]) for v in value) if default else True
    return True


def _type_name(default: Any) -> str:
    if isinstance(default, (list, tuple)):
        inner = _type_name(default[0]) if default else "value"
        return f"a non-empty list of {inner}s"
    return {bool: "bool", float: "number", int: "integer", str: "string"}.get(type(default), type(default).__name__)


def resolve(table: Mapping[str, Mapping[str, Any]], profile: str | None, **overrides: Any) -> dict[str, Any]:
    """Settings of ``profile`` from a chapter's profile ``table``, updated with the overrides
    that are not None. Each override must have the type of the profile's value (ints pass as
    floats, lists as tuples); a wrong type or unknown name raises TypeError/ValueError."""
    name = profile_name(profile)
    base = dict(table[name])
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in base:
            raise ValueError(f"unknown parameter {key!r}; this chapter takes {', '.join(sorted(base))}")
        if base[key] is not None and not _type_ok(value, base[key]):
            raise TypeError(
                f"parameter {key!r} must be {_type_name(base[key])}, got {type(value).__name__} {value!r}"
                " (with papermill, pass lists as YAML: -y 'ratios: [1, 10]')"
            )
        base[key] = list(value) if isinstance(value, tuple) else value
    return {"profile": name, **base}


def tag_frame(frame, **tags: Any):
    """``frame`` (a pandas DataFrame, copied) with one leading column per tag, in the given order,
    e.g. ``tag_frame(f, parameterization="FAFO", ratio=10.0, seed=0)``."""
    out = frame.copy()
    for i, (name, value) in enumerate(tags.items()):
        out.insert(i, name, value)
    return out


def pick_device(device: str | None = None) -> torch.device:
    """``device`` if given, else CUDA when available, else CPU."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (None: leave torch's setting), then
    restore. Small synthetic models run best on one thread: their tensors are tiny, so a second
    thread gains little even on an idle machine, while on a shared machine the thread pool's
    spin-waiting made a sweep about eight times slower in CPU time."""
    old = torch.get_num_threads()
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"threads must be a positive integer or None, got {n!r}")
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None and torch.get_num_threads() != old:
            torch.set_num_threads(old)


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch; return a CPU generator seeded with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def versions() -> dict[str, str]:
    """Versions of Python and the libraries that shape the numbers."""
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("torch", "numpy", "qkov", "jupyter-book", "papermill", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def git_commit() -> str:
    """The repository's HEAD commit, with ``+dirty`` when the tree has changes; ``unknown``
    outside a checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "qkov_lib", "book"], cwd=REPO_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
    structure, typically a list of row dicts), versions, git commit, device and wall time."""
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
    }
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=True))
    tmp.replace(out)  # atomic: a reader never sees half a file
    return out


VERDICTS = ("reproduced", "partly", "not reproduced", "not tested")


def claim(claim_id: str, paper: str, ours: str, verdict: str, chapter: str | None = None) -> dict[str, str]:
    """One row of the reproducibility scorecard: a claim ID of PAPER.md (T1..T6, S1..S3,
    R1..R3), what the paper says, what we measured (numbers included) and a verdict."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
    return {"id": claim_id, "paper": paper, "ours": ours, "verdict": verdict, "chapter": chapter or ""}


class Timer:
    """Wall-clock seconds since construction (``Timer().elapsed``)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


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


def run_chapter(chapter: str | os.PathLike, out_dir: str | os.PathLike, parameters: Mapping[str, Any] | None = None,
                name: str | None = None, progress: bool = False) -> tuple[Path, Path]:
    """Execute a chapter with papermill: convert the MyST file with jupytext (keeping the
    ``parameters`` tag), inject ``parameters`` plus ``results_path``, and write
    ``<out_dir>/<name>.ipynb`` and ``<out_dir>/<name>.json``. Returns both paths."""
    import jupytext
    import papermill as pm

    src = chapter_path(chapter)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or src.stem.split("_", 1)[-1]
    nb_in = out_dir / f"{name}.input.ipynb"
    nb = jupytext.read(src)
    if not any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise ValueError(f"{src} has no cell tagged 'parameters'")
    nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"})
    jupytext.write(nb, nb_in)
    nb_out, results = out_dir / f"{name}.ipynb", out_dir / f"{name}.json"
    params = {**(parameters or {}), "results_path": str(results.resolve())}
    try:
        pm.execute_notebook(str(nb_in), str(nb_out), parameters=params, cwd=str(src.parent),
                            progress_bar=progress, kernel_name="python3")
    finally:
        nb_in.unlink(missing_ok=True)
    return nb_out, results


def _parse_value(text: str) -> Any:
    """A command-line value: JSON/YAML-like literal when it parses, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    """qkov: run chapters, sweep their parameters, build the book.

    qkov run CHAPTER [-p NAME VALUE ...] [--out DIR]      one chapter through papermill
    qkov sweep CHAPTER -g NAME VALUES ... [--out DIR]     a grid of runs, a results table, resume
    qkov chapters                                        the executable chapters, in book order
    qkov book [--mode force|cache|executed]              build the HTML book
    qkov cache key|clear                                 the library-keyed output cache
    qkov scorecard [--results DIR]                       the claims scorecard as a table
    """
    import argparse

    ap = argparse.ArgumentParser(prog="qkov", description=main.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute one chapter through papermill")
    run.add_argument("chapter", help="chapter name (e.g. synthetic) or path to its .md")
    run.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="parameter override; VALUE is parsed as JSON when possible (e.g. -p ratios '[1, 100]')")
    run.add_argument("--out", default="runs", help="output folder (default: runs/)")
    run.add_argument("--name", default=None, help="base name of the outputs (default: the chapter name)")
    from . import sweeps

    sw = sub.add_parser("sweep", help="run a chapter over a parameter grid (papermill; local pool or Slurm)")
    sweeps.add_arguments(sw)
    sub.add_parser("chapters", help="list the executable chapters in book order")
    book = sub.add_parser("book", help="build the HTML book (library-aware caching, or from executed notebooks)")
    book.add_argument("--mode", choices=("force", "cache", "executed"), default="force",
                      help="force: execute all chapters; cache: reuse outputs keyed on qkov_lib + profile; "
                           "executed: use the notebooks in --executed, execute nothing")
    book.add_argument("--executed", help="folder of executed notebooks (qkov run ... --out DIR) for --mode executed")
    book.add_argument("--no-strict", action="store_true", help="do not turn warnings into errors")
    cache = sub.add_parser("cache", help="show or clear the library-keyed cache")
    cache.add_argument("action", choices=("key", "clear"))
    sc = sub.add_parser("scorecard", help="print the reproducibility scorecard from results files")
    sc.add_argument("--results", default=None, help="results folder (default: $QKOV_RESULTS_DIR or _build/results)")
    args = ap.parse_args(argv)

    if args.cmd == "run":
        params = {k: _parse_value(v) for k, v in args.param}
        nb, res = run_chapter(args.chapter, args.out, params, name=args.name, progress=True)
        print(f"notebook: {nb}\nresults:  {res}")
        return 0
    if args.cmd == "sweep":
        return sweeps.from_args(args)
    from . import cache as qcache

    if args.cmd == "chapters":
        print("\n".join(sweeps.chapter_name(p) for p in qcache.chapters(REPO_ROOT)))
        return 0
    if args.cmd == "book":
        return qcache.build_book(REPO_ROOT, args.mode, args.executed, strict=not args.no_strict)
    if args.cmd == "cache":
        if args.action == "key":
            print(qcache.cache_key())
            print(json.dumps(qcache.key_parts(), indent=1))
        else:
            for d in qcache.clear(REPO_ROOT):
                print(f"removed {d}")
        return 0
    from . import scorecard

    folder = Path(args.results) if args.results else default_results_path("scorecard").parent
    results = scorecard.load_results(folder)
    card = scorecard.build(scorecard.claim_rows(results, book_dir=REPO_ROOT / "book",
                                                pages=qcache.toc_files(REPO_ROOT)))
    print(scorecard.to_myst(card, link=False))
    print(json.dumps(scorecard.counts(card)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
