"""The ``qkov`` command line: run a chapter through papermill, sweeps, the book, the cache, the scorecard.

Each command imports what it needs (torch, pandas, papermill, ...) when it runs, so that
``qkov --help`` and a mistyped command answer at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COMMANDS = ("run", "sweep", "chapters", "book", "cache", "scorecard", "data")


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
    qkov chapters [--run-order]                          the executable chapters, in book (or run) order
    qkov book [--mode force|cache|executed|run] [-j N]   build the HTML book
    qkov cache key|clear                                 the library-keyed output cache
    qkov scorecard [--results DIR]                       the claims scorecard as a table
    qkov data check|fetch|verify|list [...]              the real-data folder (qkov data --help)
    """
    import argparse

    ap = argparse.ArgumentParser(prog="qkov", description=main.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="execute one chapter through papermill",
                         description="Execute one chapter through papermill into OUT/NAME.ipynb and OUT/NAME.json. "
                                     "They are moved into place only when the run succeeds, replacing an earlier "
                                     "run's (the command says so); a failed run leaves them as they were and writes "
                                     "OUT/NAME.failed.json (and OUT/NAME.failed.ipynb). A second run of the same "
                                     "NAME into the same OUT stops at once (exit status 2).")
    run.add_argument("chapter", help="chapter name (e.g. synthetic) or path to its .md")
    run.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="parameter override; VALUE is parsed as JSON when possible (e.g. -p ratios '[1, 100]')")
    run.add_argument("--out", default="runs", help="output folder (default: runs/)")
    run.add_argument("--name", default=None, help="base name of the outputs (default: the chapter name)")
    sw = sub.add_parser("sweep", help="run a chapter over a parameter grid (papermill; local pool or Slurm)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:  # its options come with the sweep module (and pandas): only when asked for
        from qkov_lib.tooling import sweeps

        sweeps.add_arguments(sw)
    chs = sub.add_parser("chapters", help="list the executable chapters in book order")
    chs.add_argument("--run-order", action="store_true",
                     help="in the order a whole-book run executes them: pages that summarise the others' results last")
    book = sub.add_parser("book", help="build the HTML book (library-aware caching, or from executed notebooks)")
    book.add_argument("--mode", choices=("force", "cache", "executed", "run"), default="force",
                      help="force: execute all chapters; cache: reuse outputs keyed on qkov_lib + profile; "
                           "executed: use the notebooks in --executed, execute nothing; run: execute every "
                           "chapter through papermill (--jobs at once) into --executed, then build from them")
    book.add_argument("--executed", help="folder of executed notebooks (qkov run ... --out DIR) for --mode executed; "
                                         "for --mode run, where they are written (default: _build/results)")
    book.add_argument("-j", "--jobs", type=int, default=1,
                      help="--mode run: processes at once (a chapter that trains in several processes takes all)")
    book.add_argument("--no-strict", action="store_true", help="do not turn warnings into errors")
    cache = sub.add_parser("cache", help="show or clear the library-keyed cache")
    cache.add_argument("action", choices=("key", "clear"))
    sc = sub.add_parser("scorecard", help="print the reproducibility scorecard from results files")
    sc.add_argument("--results", default=None, help="results folder (default: $QKOV_RESULTS_DIR or _build/results)")
    sub.add_parser("data", help="check, fetch, verify or list the real-data files (qkov data --help)", add_help=False)
    if argv[:1] == ["data"]:  # every option after "data" belongs to the data tool
        from qkov_lib.data import fetch

        return fetch.main(argv[1:])
    if argv[:1] and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        ap.error(f"unknown option {argv[0]!r}; give a command first: {', '.join(COMMANDS)} (qkov --help)")
    args = ap.parse_args(argv)

    if args.cmd == "run":
        return _run(args)
    if args.cmd == "sweep":
        from qkov_lib.tooling import sweeps

        return sweeps.from_args(args)
    from qkov_lib.runtime import REPO_ROOT
    from qkov_lib.tooling import cache as qcache

    if args.cmd == "chapters":
        from qkov_lib.tooling.sweeps import chapter_name

        if args.run_order:
            from qkov_lib.tooling.bookrun import run_plan

            pages = [p.src for p in run_plan(REPO_ROOT)]
        else:
            pages = qcache.chapters(REPO_ROOT)
        print("\n".join(chapter_name(p) for p in pages))
        return 0
    if args.cmd == "book":
        if args.jobs < 1:
            print(f"qkov book: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
            return 2
        if args.mode != "run":
            return qcache.build_book(REPO_ROOT, args.mode, args.executed, strict=not args.no_strict)
        from qkov_lib.tooling import bookrun

        executed = Path(args.executed) if args.executed else REPO_ROOT / "_build" / "results"
        try:
            bookrun.run_book(REPO_ROOT, executed, args.jobs)
        except bookrun.BookRunFailed as e:
            print("\n  ".join(["qkov book: chapters failed, nothing was built:",
                                *(f"{k}: {v}" for k, v in e.failures.items())]), file=sys.stderr)
            return 1
        return qcache.build_book(REPO_ROOT, "executed", executed, strict=not args.no_strict)
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
    from qkov_lib.tooling.results import default_results_path

    folder = Path(args.results) if args.results else default_results_path("scorecard").parent
    results = scorecard.load_results(folder)
    card = scorecard.build(scorecard.claim_rows(results, book_dir=REPO_ROOT / "book",
                                                pages=qcache.toc_files(REPO_ROOT)))
    print(scorecard.to_matrix(card, link=False))
    print()
    print(scorecard.to_details(card, link=False))
    print(json.dumps({"paper": scorecard.counts(card), "extension": scorecard.counts(card, "extension")}))
    return 0


def _run(args: Any) -> int:
    """``qkov run``: exit status 0 (the files are in place), 1 (the chapter failed: what it left is
    named, and only files that exist), 2 (nothing ran: bad parameters, the output busy or not
    writable), 130 (interrupted)."""
    from qkov_lib.tooling import chapters
    from qkov_lib.tooling.results import failed_path

    params = {k: _parse_value(v) for k, v in args.param}
    try:
        src = chapters.chapter_path(args.chapter)
        chapters.check_parameters(src, params)
        chapters.check_settings(src, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"qkov run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qkov run: interrupted before the chapter started; nothing was written", file=sys.stderr)
        return 130
    name = args.name or src.stem.split("_", 1)[-1]
    res, nb = Path(args.out) / f"{name}.json", Path(args.out) / f"{name}.ipynb"
    earlier = res.is_file()
    try:
        nb, res = chapters.run_chapter(src, args.out, params, name=name, progress=True)
    except chapters.RunNotStarted as e:
        print(f"qkov run: {e}", file=sys.stderr)
        return 2
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 -- a failing chapter: one message, not a traceback
        lines = [f"qkov run: {src.name} {'was interrupted' if isinstance(e, KeyboardInterrupt) else 'failed'}: "
                 f"{chapters.error_line(e)}"]
        for path, what, none in ((failed_path(nb), "notebook with the error", "no notebook of the failed run was kept"),
                                 (failed_path(res), "record of the failed run", "no record of the failed run could "
                                                                                "be written")):
            lines.append(f"{what}: {path}" if path.is_file() else none)
        if res.is_file():
            lines.append(f"{res} and {nb} are an earlier run's, left as they were")
        print("\n".join(lines), file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    print(f"notebook: {nb}\nresults:  {res}")
    if earlier:
        print("(they replace the notebook and results of an earlier run of this name)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
