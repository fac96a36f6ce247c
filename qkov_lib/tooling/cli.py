"""The ``qkov`` command line: run a chapter through papermill, sweeps, the book, the cache, the scorecard.

Each command imports what it needs (torch, pandas, papermill, ...) when it runs, so that
``qkov --help`` and a mistyped command answer at once."""

from __future__ import annotations

import json
import os
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


#: ASCII stand-ins for the characters the book's tables and messages use, for a terminal whose
#: encoding lacks them (anything else becomes a \\uXXXX escape): see :func:`safe_output`
ASCII_STANDINS = {"\u2013": "-", "\u2014": "--", "\u2212": "-", "\u2018": "'", "\u2019": "'", "\u201c": '"',
                  "\u201d": '"', "\u2026": "...", "\u00b7": ".", "\u00d7": "x", "\u00b2": "^2", "\u00b1": "+/-",
                  "\u2264": "<=", "\u2265": ">=", "\u2248": "~", "\u2192": "->", "\u03b7": "eta", "\u00a0": " "}
OUTPUT_ERRORS = "qkov-ascii"  # the codec error handler of safe_output


def _standin(err: UnicodeError) -> tuple[str, int]:
    if not isinstance(err, UnicodeEncodeError):
        raise err
    bad = err.object[err.start:err.end]
    return "".join(ASCII_STANDINS.get(c) or c.encode("ascii", "backslashreplace").decode() for c in bad), err.end


def safe_output(*streams: Any) -> None:
    """Let ``streams`` (default: stdout and stderr) write any text in any locale: a stream whose
    encoding is not UTF-8 (``LC_ALL=C``, Latin-1) keeps it, and a character it cannot encode is
    written as its ASCII stand-in (:data:`ASCII_STANDINS`, e.g. an en dash as ``-``) or a
    ``\\uXXXX`` escape, never a UnicodeEncodeError."""
    import codecs

    try:
        codecs.lookup_error(OUTPUT_ERRORS)
    except LookupError:
        codecs.register_error(OUTPUT_ERRORS, _standin)
    for stream in streams or (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("_", "-")
        if encoding not in ("utf-8", "utf8") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=OUTPUT_ERRORS)


def main(argv: list[str] | None = None) -> int:
    """The ``qkov`` command (:func:`_main`). SIGTERM is raised as Ctrl-C is (a
    :class:`~qkov_lib.tooling.chapters.Interrupted`), so what a command cleans up on Ctrl-C (a run's
    record and lock, the book's chapter processes) it cleans up on SIGTERM; either ends it with one
    line, not a traceback (exit status 130 or 143)."""
    import signal
    import threading

    def terminated(signum: int, frame: Any) -> None:
        from qkov_lib.tooling.chapters import Interrupted

        raise Interrupted(signum)

    main_thread = threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    try:
        return _main(argv)
    except KeyboardInterrupt as e:
        print(f"qkov: {str(e) or 'interrupted'}", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    except BrokenPipeError:
        # the reader of stdout went away (`qkov scorecard | head`): stop quietly, as a shell tool does,
        # and point stdout at /dev/null so that the flush at exit cannot raise a second time
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None = None) -> int:
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

    safe_output()
    ap = argparse.ArgumentParser(prog="qkov", description=_main.__doc__,
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
    from qkov_lib.tooling import cache as qcache
    from qkov_lib.tooling.cache import REPO_ROOT

    if args.cmd in ("chapters", "book"):
        try:
            return _chapters(args, REPO_ROOT) if args.cmd == "chapters" else _book(args, REPO_ROOT)
        except BrokenPipeError:  # the reader went away: main() ends quietly
            raise
        except (OSError, ValueError) as e:  # a missing or broken _toc.yml, a page it lists without a file, ...
            print(f"qkov {args.cmd}: {e}", file=sys.stderr)
            return 2
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
    try:
        if args.results is None and not folder.exists():  # no build yet: every claim "not run", and said so
            print(f"qkov scorecard: no results folder {folder} yet (make book writes it): every claim is "
                  "'not run'", file=sys.stderr)
            results = []
        else:
            results = scorecard.load_results(folder)
        card = scorecard.build(scorecard.claim_rows(results, book_dir=REPO_ROOT / "book",
                                                    pages=qcache.toc_files(REPO_ROOT)))
    except (OSError, ValueError) as e:  # a missing folder, a results file that breaks the contract, a bad toc
        print(f"qkov scorecard: {e}", file=sys.stderr)
        return 2
    print(scorecard.to_matrix(card, link=False))
    print()
    print(scorecard.to_details(card, link=False))
    print(json.dumps({"paper": scorecard.counts(card), "extension": scorecard.counts(card, "extension")}))
    return 0


def _chapters(args: Any, root: Path) -> int:
    """``qkov chapters``: the executable pages in book order (or run order), one name a line; reads
    ``_toc.yml`` and the pages' parameters cells only (no torch, no pandas)."""
    from qkov_lib.tooling import cache as qcache

    if args.run_order:
        from qkov_lib.tooling.bookrun import run_plan

        pages = [p.src for p in run_plan(root)]
    else:
        pages = qcache.chapters(root)
    print("\n".join(qcache.chapter_name(p) for p in pages))
    return 0


def _book(args: Any, root: Path) -> int:
    """``qkov book``: its options and the table of contents are checked before anything runs (a bad
    one raises ValueError or OSError, exit status 2); 1 when chapters failed."""
    from qkov_lib.tooling import cache as qcache

    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.mode == "executed" and not args.executed:
        raise ValueError("--mode executed builds from notebooks that were run before: give their folder with "
                         "--executed DIR (e.g. the --out of qkov run, or _build/results)")
    if args.executed and args.mode not in ("executed", "run"):
        raise ValueError(f"--executed is for --mode executed or --mode run, not --mode {args.mode}")
    if args.mode == "executed" and not Path(args.executed).is_dir():
        raise FileNotFoundError(f"--executed {args.executed}: no such folder of executed notebooks")
    qcache.toc_pages(root)  # every page the book lists is there, before anything runs
    if args.mode != "run":
        return qcache.build_book(root, args.mode, args.executed, strict=not args.no_strict)
    from qkov_lib.tooling import bookrun

    executed = Path(args.executed) if args.executed else root / "_build" / "results"
    try:
        bookrun.run_book(root, executed, args.jobs)
    except bookrun.BookRunFailed as e:
        print("\n  ".join(["qkov book: chapters failed, nothing was built:",
                            *(f"{k}: {v}" for k, v in e.failures.items())]), file=sys.stderr)
        return 1
    return qcache.build_book(root, "executed", executed, strict=not args.no_strict)


def _run(args: Any) -> int:
    """``qkov run``: exit status 0 (the files are in place), 1 (the chapter failed: what it left is
    named, and only files that exist), 2 (nothing ran: bad parameters or name, the output busy or
    not writable), 130 (Ctrl-C) or 143 (SIGTERM: stopped the same way, see
    :func:`qkov_lib.tooling.chapters.stopping_on_signals`)."""
    from qkov_lib.tooling import chapters
    from qkov_lib.tooling.cache import chapter_name

    def stopped(e: KeyboardInterrupt) -> int:
        return 128 + getattr(e, "signum", 2)  # 2: SIGINT

    params = {k: _parse_value(v) for k, v in args.param}
    try:
        src = chapters.chapter_path(args.chapter)
        try:
            chapters.check_name(chapter_name(src) if args.name is None else args.name, args.out)
        except ValueError as e:
            raise ValueError(f"--name: {e}") from e
        if "results_path" in params:  # the run sets it to its staging file: a value given here would be lost
            raise ValueError("-p results_path: qkov run writes the results file itself, to OUT/NAME.json; "
                             "choose where with --out and --name")
        chapters.check_parameters(src, params)
        chapters.check_settings(src, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"qkov run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"qkov run: {str(e) or 'interrupted'} before the chapter started; nothing was written", file=sys.stderr)
        return stopped(e)
    name = chapter_name(src) if args.name is None else args.name
    res, nb = Path(args.out) / f"{name}.json", Path(args.out) / f"{name}.ipynb"
    earlier = res.is_file()
    try:
        nb, res = chapters.run_chapter(src, args.out, params, name=name, progress=True, stop_on_signals=True)
    except chapters.RunNotStarted as e:
        print(f"qkov run: {e}", file=sys.stderr)
        return 2
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 -- a failing chapter: one message, not a traceback
        from qkov_lib.tooling.results import failed_path

        how = f"was {e}" if isinstance(e, chapters.Interrupted) else (
            "was interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        lines = [f"qkov run: {src.name} {how}" + ("" if isinstance(e, chapters.Interrupted)
                                                  else f": {chapters.error_line(e)}")]
        for path, what, none in ((failed_path(nb), "notebook with the error", "no notebook of the failed run was kept"),
                                 (failed_path(res), "record of the failed run", "no record of the failed run could "
                                                                                "be written")):
            lines.append(f"{what}: {path}" if path.is_file() else none)
        if res.is_file():
            lines.append(f"{res} and {nb} are an earlier run's, left as they were")
        print("\n".join(lines), file=sys.stderr)
        return stopped(e) if isinstance(e, KeyboardInterrupt) else 1
    print(f"notebook: {nb}\nresults:  {res}")
    if earlier:
        print("(they replace the notebook and results of an earlier run of this name)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
