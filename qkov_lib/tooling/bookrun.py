"""Execute the whole book: every chapter through papermill in a process of its own
(``qkov run``), several at once where the machine has cores to spare, the pages that summarise
the others after them; then :func:`qkov_lib.tooling.cache.build_book` builds the pages from those
notebooks (``qkov book --mode run``, what ``make book`` does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkov_lib import BACKGROUND_ENV
from qkov_lib.tooling import chapters as ch
from qkov_lib.tooling.cache import REPO_ROOT, chapter_name, chapters


@dataclass(frozen=True)
class Page:
    """A chapter as :func:`run_book` schedules it: its source, the name its notebook and results
    file get, the ``slots`` it takes (all of them for a chapter that trains in several processes
    itself: one with a ``processes`` parameter) and whether it ``reads_others`` (a ``results_dir``
    parameter: it summarises the other chapters' results files, so it runs after all of them)."""

    src: Path
    name: str
    slots: int
    reads_others: bool


#: CPU seconds per page of a measured ``cpu`` build (``_build/book_times.json`` of a clean clone), under the
#: book's root: the order of the one-slot pages when a run has no times of its own (:func:`page_costs`)
MEASURED_TIMES = "benchmarks/book_times.json"


def page_costs(times_file: str | os.PathLike | None) -> dict[str, float]:
    """``{page name: CPU seconds}`` from a ``book_times.json`` of :func:`run_book` (``pages`` ->
    ``cpu_s``); empty when the file is missing or unreadable, since the costs only order the pages."""
    try:
        pages = json.loads(Path(times_file).read_text())["pages"]
        return {str(k): float(v["cpu_s"]) for k, v in pages.items()}
    except (TypeError, OSError, ValueError, KeyError, AttributeError):
        return {}


def run_plan(root: str | os.PathLike = REPO_ROOT, jobs: int = 1, costs: Mapping[str, float] | None = None
             ) -> list[Page]:
    """The book's executable pages in the order :func:`run_book` starts them: first the pages that
    read no other page's results, those that take every slot first, in book order, then the one-slot
    pages, costliest first by ``costs`` (``{name: CPU seconds}``; pages without a cost after those
    with one, in book order); then the pages that read the others' results, in book order. The one-slot pages run beside the training pages in the cores they leave, so the costliest
    must start first: started last, it runs alone on one core when the others have ended. ``jobs``:
    the processes the run may use at once, at least 1."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    pages = []
    for src in chapters(root):
        params = ch.chapter_parameters(src)
        pages.append(Page(src, chapter_name(src), jobs if "processes" in params else 1,
                          "results_dir" in params))
    first = [p for p in pages if not p.reads_others]
    costs = costs or {}
    narrow = sorted((p for p in first if p.slots == 1), key=lambda p: -costs.get(p.name, -1.0))  # stable
    return [p for p in first if p.slots > 1] + narrow + [p for p in pages if p.reads_others]


class BookRunFailed(RuntimeError):
    """Chapters of :func:`run_book` failed; ``failures`` maps each name to its error line."""

    def __init__(self, failures: Mapping[str, str]):
        self.failures = dict(failures)
        super().__init__("chapters failed: " + "; ".join(f"{k}: {v}" for k, v in self.failures.items()))


#: niceness of the one-slot pages that run beside a page training in several processes: they take
#: the cores it leaves idle (its evaluation, its figures) and almost nothing while it trains
BACKGROUND_NICE = 19


def _error_of(log_path: Path) -> str:
    """The error line ``qkov run`` printed last in its log (``qkov run: ... failed: <error>``)."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    found = [x for x in lines if x.startswith("qkov run:")]
    return found[-1].split(": ", 2)[-1] if found else (lines[-1] if lines else "no output")


def run_book(root: str | os.PathLike = REPO_ROOT, out: str | os.PathLike | None = None, jobs: int = 1,
             log: Any = None) -> dict[str, dict[str, float]]:
    """Execute every page of :func:`run_plan` through papermill, each in its own ``qkov run``
    process (:func:`qkov_lib.tooling.chapters.run_chapter`), into ``out`` (default
    ``<root>/_build/results``: each page's ``<name>.ipynb`` and results file ``<name>.json``; its
    output in ``<out>/../book_logs/<name>.log``).

    With ``jobs`` = 1 the pages run one at a time, in plan order (the one-slot pages costliest first
    by the CPU seconds of ``<out>/../book_times.json`` from an earlier run, else of
    ``<root>/``:data:`MEASURED_TIMES`). With more, the pages that take
    every slot (they train in several processes themselves) run one at a time at normal priority,
    and from the start the one-slot pages run beside them, up to ``jobs`` at once, at niceness
    :data:`BACKGROUND_NICE`: they use the cores a training page leaves idle and yield to it while it
    trains (their kernels lower their session's priority too, and run one torch thread). The pages that
    read the others' results start only when all of those have ended, up to
    ``jobs`` at once, at normal priority. Every page runs even when an earlier one failed; then :class:`BookRunFailed` names
    every failure. ``log`` gets a line when a page starts and ends. Returns ``{name: {"wall_s",
    "cpu_s"}}`` (wall seconds; CPU seconds of the page's process and everything it ran) of the pages
    that succeeded, in the order they ended, also written to ``<out>/../book_times.json``."""
    log = log or (lambda line: print(line, flush=True))
    out = Path(out) if out is not None else Path(root) / "_build" / "results"
    # the one-slot pages costliest first: by this output's last run, else by the measured cpu build
    plan = run_plan(root, jobs, page_costs(out.parent / "book_times.json") or page_costs(Path(root) / MEASURED_TIMES))
    logs = out.parent / "book_logs"
    logs.mkdir(parents=True, exist_ok=True)
    times: dict[str, dict[str, float]] = {}
    failures: dict[str, str] = {}
    t_start = time.perf_counter()
    running: dict[int, tuple[Page, Any, float]] = {}  # pid -> (page, Popen, start)

    def launch(page: Page, nice: int) -> None:
        cmd = [sys.executable, "-m", "qkov_lib", "run", str(page.src), "--out", str(out), "--name", page.name]
        # a background page: low priority (its kernel sets its session's too, see qkov_lib.BACKGROUND_ENV) and
        # one torch thread, since a starved second thread spin-waits on the first and burns the CPU it gets
        env = {**os.environ, BACKGROUND_ENV: str(nice), "OMP_NUM_THREADS": "1"} if nice else None
        with open(logs / f"{page.name}.log", "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=str(root), env=env,
                                    preexec_fn=(lambda: os.nice(nice)) if nice else None)
        running[proc.pid] = (page, proc, time.perf_counter())
        log(f"[book] {page.name} started{f' at niceness {nice}' if nice else ''} "
            f"({time.perf_counter() - t_start:.0f} s into the run)")

    def reap() -> None:
        """Wait for one of the running pages to end (only this run's processes are waited for)."""
        while True:
            for pid in list(running):
                done, status, usage = os.wait4(pid, os.WNOHANG)
                if done:
                    break
            else:
                time.sleep(0.2)
                continue
            break
        page, proc, t0 = running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode == 0:
            times[page.name] = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}
            log(f"[book] {page.name} done in {wall:.0f} s ({times[page.name]['cpu_s']:.0f} CPU s)")
        else:
            failures[page.name] = _error_of(logs / f"{page.name}.log")
            log(f"[book] {page.name} FAILED after {wall:.0f} s: {failures[page.name]} "
                f"(output: {logs / f'{page.name}.log'})")

    try:
        wide = [p for p in plan if not p.reads_others and p.slots > 1]
        narrow = [p for p in plan if not p.reads_others and p.slots == 1]
        if jobs == 1:
            for p in wide + narrow:
                launch(p, 0)
                reap()
        else:
            while wide or narrow or running:
                if wide and not any(pg.slots > 1 for pg, _, _ in running.values()):
                    launch(wide.pop(0), 0)
                    continue
                if narrow and sum(pg.slots == 1 for pg, _, _ in running.values()) < jobs:
                    launch(narrow.pop(0), BACKGROUND_NICE)
                    continue
                reap()
        # the summaries read the other pages' results files, not each other's (a summary writes no
        # claims, which is all they read), so they run beside one another
        summaries = [p for p in plan if p.reads_others]
        while summaries or running:
            if summaries and len(running) < jobs:
                launch(summaries.pop(0), 0)
                continue
            reap()
    finally:
        for _, proc, _ in running.values():  # interrupted: no page outlives the run
            proc.terminate()
    total = time.perf_counter() - t_start
    log(f"[book] {len(times)} of {len(plan)} pages executed in {total:.0f} s")
    from qkov_lib.runtime import write_json

    write_json(out.parent / "book_times.json", {"jobs": jobs, "total_s": total, "pages": times, "failed": failures})
    if failures:
        raise BookRunFailed(failures)
    return times
