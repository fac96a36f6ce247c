"""The ``qkov`` command line: run a chapter through papermill, sweeps, the book, the cache, the scorecard."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from qkov_lib.tooling.chapters import chapter_path, check_parameters, check_settings, run_chapter
from qkov_lib.tooling.results import default_results_path, failed_path
from qkov_lib.runtime import REPO_ROOT


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
    qkov data check|fetch|verify|list [...]              the real-data folder (qkov data fetch --help)
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
    from qkov_lib.tooling import sweeps

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
    dat = sub.add_parser("data", help="check, fetch, verify or list the real-data files", add_help=False)
    dat.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of python -m qkov_lib.data.fetch")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["data"]:  # every option after "data" belongs to the data tool
        from qkov_lib.data import fetch

        return fetch.main(argv[1:])
    args = ap.parse_args(argv)

    if args.cmd == "run":
        params = {k: _parse_value(v) for k, v in args.param}
        try:
            src = chapter_path(args.chapter)
            check_parameters(src, params)
            check_settings(src, params)
        except (ValueError, FileNotFoundError) as e:
            print(f"qkov run: {e}", file=sys.stderr)
            return 2
        try:
            nb, res = run_chapter(src, args.out, params, name=args.name, progress=True)
        except Exception as e:  # noqa: BLE001 -- a failing chapter: one message, not a traceback
            name = args.name or src.stem.split("_", 1)[-1]
            err = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
            marked = failed_path(Path(args.out) / f"{name}.json")
            print(f"qkov run: {src.name} failed: {err}\nnotebook with the error: {Path(args.out) / f'{name}.ipynb'}"
                  + (f"\nresults of the failed run: {marked}" if marked.exists() else "\nno results file written"),
                  file=sys.stderr)
            return 1
        print(f"notebook: {nb}\nresults:  {res}")
        return 0
    if args.cmd == "sweep":
        return sweeps.from_args(args)
    from qkov_lib.tooling import cache as qcache

    if args.cmd == "chapters":
        print("\n".join(sweeps.chapter_name(p) for p in qcache.chapters(REPO_ROOT)))
        return 0
    if args.cmd == "book":
        return qcache.build_book(REPO_ROOT, args.mode, args.executed, strict=not args.no_strict)
    if args.cmd == "cache":
        if args.action == "key":
            parts = qcache.key_parts()
            print(qcache.key_of(parts))
            print(json.dumps(parts, indent=1))
        else:
            for d in qcache.clear(REPO_ROOT):
                print(f"removed {d}")
        return 0
    from qkov_lib.tooling import scorecard

    folder = Path(args.results) if args.results else default_results_path("scorecard").parent
    results = scorecard.load_results(folder)
    card = scorecard.build(scorecard.claim_rows(results, book_dir=REPO_ROOT / "book",
                                                pages=qcache.toc_files(REPO_ROOT)))
    print(scorecard.to_matrix(card, link=False))
    print()
    print(scorecard.to_details(card, link=False))
    print(json.dumps({"paper": scorecard.counts(card), "extension": scorecard.counts(card, "extension")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
