"""The real-data protocol: base rate × ratio maps, trained-run filtering and paired changes.

The paper tunes a model, then raises the QK rate with everything else fixed; which base rate it
used is unknown. So each dataset chapter maps the claim over a grid of base rates ``eta_ov`` and
ratios ``eta_QK/eta_OV``, for each optimizer, with early stopping on the validation split:

1. :func:`grid` lists the runs (optimizer × base rate × ratio × seed); :func:`train_grid` trains
   them with :func:`qkov_lib.train.loop.train_stacked` (one stack per optimizer) and evaluates each
   on the validation and the test split.
2. :func:`trained` marks the runs that learned the task (validation accuracy above chance by
   :data:`qkov_lib.claims.TRAINED_MARGIN`); failed runs are counted, not averaged in.
3. :func:`select_base_rates` picks, per optimizer, the base rate with the best validation metric
   at ratio 1 among the rates on which enough seeds trained -- the tuned model the paper's
   protocol starts from.
4. :func:`phase_table` gives, per (optimizer, base rate, ratio), the change of each test metric
   against ratio 1 paired by seed, with its 95% seed interval, its number of seed pairs and
   whether it is significant; for R1 also the change of accuracy and macro-F1 over every model,
   trained or not.
5. :mod:`qkov_lib.rate_plane` reads the same runs as the (eta_QK, eta_OV) plane and decides each
   claim over the paper's protocol cells by the one rule of :mod:`qkov_lib.claims`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from qkov_lib.figure_source import draws
from qkov_lib import claims
from qkov_lib.data.batch import Batch
from qkov_lib.metrics import INSTANCE_METRICS, threshold_names
from qkov_lib.runtime import torch_threads
from qkov_lib.train import History, TrainConfig, train_stacked

MAP_TAU = 0.5  # the AC/ACMC threshold the protocol map measures


def phase_metrics() -> tuple[str, ...]:
    """The metrics the protocol map measures and its phase table reports: accuracy, macro-F1,
    every :data:`qkov_lib.metrics.INSTANCE_METRICS` entry with ``phase=True``, AC/ACMC at
    :data:`MAP_TAU` and ERASER sufficiency."""
    return ("accuracy", "macro_f1", *(m.name for m in INSTANCE_METRICS.values() if m.phase),
            *threshold_names([MAP_TAU]), "sufficiency")


@dataclass(frozen=True)
class Cell:
    """One run of the map."""

    optimizer: str
    eta_ov: float
    ratio: float
    seed: int


def grid(optimizers: Sequence[str], base_rates: Mapping[str, Sequence[float]], ratios: Sequence[float],
         seeds: Sequence[int]) -> list[Cell]:
    """Every (optimizer, base rate of that optimizer, ratio, seed); ratio 1 must be among the
    ratios (it is the reference of every comparison)."""
    if 1.0 not in [float(r) for r in ratios]:
        raise ValueError(f"the ratios must include 1 (the reference), got {list(ratios)}")
    missing = [o for o in optimizers if o not in base_rates or not base_rates[o]]
    if missing:
        raise ValueError(f"no base rates for optimizer(s) {missing}; base_rates has {sorted(base_rates)}")
    return [Cell(o, float(e), float(r), int(s)) for o in optimizers for e in base_rates[o]
            for r in ratios for s in seeds]


def profile_cells(profile: Mapping[str, Any], ratios: Sequence[float], seeds: Sequence[int]) -> list[Cell]:
    """The cells of a study at one setting: the optimizer and base rate of ``profile`` (a resolved
    settings dict, read through :meth:`qkov_lib.train.TrainConfig.from_profile`) at every
    ``(ratio, seed)``, ratio-major."""
    base = TrainConfig.from_profile(profile, progress=False)
    return [Cell(base.optimizer, base.eta_ov, float(r), int(s)) for r in ratios for s in seeds]


def raise_if_diverged(frame: pd.DataFrame, what: str) -> None:
    """Raise RuntimeError naming the cells of a :func:`train_grid` frame whose training produced
    a non-finite loss or weight (for studies that report every run, so none may be dropped)."""
    bad = frame[frame["diverged"]]
    if len(bad):
        cells = ", ".join(f"eta_ov {e:g} ratio {r:g} seed {s}" for e, r, s in zip(bad["eta_ov"], bad["ratio"], bad["seed"]))
        raise RuntimeError(f"{what}: training diverged (non-finite loss or weights) at {cells}; "
                           "lower eta_ov or the ratio")


def run_each(settings: Iterable[tuple], train_one: Callable[..., Any], desc: str, progress: bool = True,
             processes: int = 1) -> list:
    """``[train_one(*s) for s in settings]`` in order, under one progress bar: the grid runner of
    the studies whose models train one at a time through :func:`qkov_lib.train.train` (their own
    parameter groups, batching or probes, which a stack cannot share). Grids of models that can
    share a stack go through :func:`train_grid`.

    ``processes`` > 1 runs the settings in that many spawned processes at once, each with one torch
    thread (``train_one`` must be a module-level function and the settings must pickle); each run
    seeds itself, so the results equal those of ``processes=1`` on one thread."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive integer, got {processes!r}")
    settings = list(settings)
    if processes > 1 and len(settings) > 1:
        return _in_processes([(train_one, *s) for s in settings], _call_reporting, processes, len(settings), desc, "run",
                             progress)
    return [train_one(*s) for s in tqdm(settings, desc=desc, disable=not progress)]


def train_grid(cells: Sequence[Cell], make_model: Callable[[int], nn.Module], train: Batch, val: Batch | None,
               test: Batch, config: Callable[[Cell], TrainConfig],
               measure: Callable[[nn.Module, Batch], Mapping[str, float]] | tuple[Callable, Callable],
               max_stack: int = 64,
               desc: str = "map", models_out: dict[Cell, nn.Module] | None = None,
               threads: int | None = None, processes: int = 1,
               histories_out: dict[Cell, History] | None = None, taus: Sequence[float] = (),
               monitor: Batch | None = None) -> pd.DataFrame:
    """Train every cell and measure it: one row per cell with its settings, ``diverged``,
    ``stop_step``, the validation metrics (``val_<metric>``) and the test metrics.

    ``make_model(seed)`` builds a fresh model (the same initialisation for every cell of a seed,
    so ratios are compared from the same start); ``config(cell)`` its training config;
    ``measure(model, batch)`` the metrics of a trained model on a split (``val`` None: no
    validation split, no ``val_*`` metrics), or a pair ``(measure on val, measure on test)``
    when the validation split needs less (e.g. no faithfulness scores: it only chooses). Cells are trained in stacks of at most ``max_stack``
    models that share an optimizer. ``models_out`` and ``histories_out``, if given, receive every
    trained model that did not diverge and every run's :class:`~qkov_lib.train.History`, keyed by
    its cell (for later analyses); ``threads`` sets torch's intra-op threads while training and
    measuring; ``taus`` (thresholds in [0, 1]) add ``AC@tau``/``ACMC@tau`` to the logged records
    (:func:`~qkov_lib.train.loop.train_stacked`). ``monitor``, if given, is what the training logs and
    early stopping evaluate instead of ``val`` (e.g. a fixed sample of its rows); the trained models are
    still measured on the whole of ``val``.

    ``processes`` > 1 trains the stacks in that many spawned processes at once, each with one
    torch thread (:func:`_train_in_processes`; ``make_model``, ``config`` and ``measure`` must
    then pickle, e.g. :func:`functools.partial` of module-level functions). Every stack is then
    trained exactly as with ``processes=1, threads=1``, so the numbers are the same; on a shared
    2-core machine two one-thread processes lose least when another job takes a core."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive integer, got {processes!r}")
    units = _stack_units(cells, max_stack, steps=lambda c: config(c).steps)
    if processes > 1 and len(units) > 1:
        done = _train_in_processes(units, make_model, train, val, test, config, measure, desc, processes, taus,
                                   monitor)
    else:
        done = [_train_unit(u, make_model, train, val, test, config, measure, desc, threads, taus=taus,
                            monitor=monitor) for u in units]
    rows = []
    for unit_rows, unit_models, unit_hists in done:
        rows += unit_rows
        if models_out is not None:
            models_out.update(unit_models)
        if histories_out is not None:
            histories_out.update(unit_hists)
    return pd.DataFrame(rows)


def _stack_units(cells: Sequence[Cell], max_stack: int, steps: Callable[[Cell], int] | None = None
                 ) -> list[tuple[str, list[Cell]]]:
    """The stacks of :func:`train_grid`: ``(label, cells)``, cells of one optimizer (and one step
    budget, ``steps(cell)``, when budgets differ: a stack runs one step loop), at most ``max_stack``
    each. A group larger than ``max_stack`` is dealt into the fewest stacks of near-equal size, every
    k-th cell to the same stack (for a grid ordered rate × ratio × seed: the same cells of other seeds), so
    the stacks hold the same mix of rates and ratios and take about as long: two processes then finish
    together, where stacks cut in order would give one process the slow low rates and the other the runs
    that stop early or diverge."""
    if max_stack < 1:
        raise ValueError(f"max_stack must be at least 1, got {max_stack}")
    groups: dict[tuple[str, int | None], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.optimizer, None if steps is None else int(steps(c))), []).append(c)
    budgets = {opt for opt, _ in groups}
    many = {opt: sum(o == opt for o, _ in groups) > 1 for opt in budgets}
    units = []
    for (opt, n), group in groups.items():
        k = -(-len(group) // max_stack)
        units += [(f"{opt}{f' {n} steps' if many[opt] else ''} {i + 1}", group[i::k]) for i in range(k)]
    return units


def _train_unit(unit: tuple[str, list[Cell]], make_model, train, val, test, config, measure, desc: str,
                threads: int | None, on_step: Callable[[int], None] | None = None, taus: Sequence[float] = (),
                monitor: Batch | None = None) -> tuple[list[dict], dict[Cell, nn.Module], dict[Cell, History]]:
    """Train and measure one stack of :func:`_stack_units`: its rows, its non-diverged models and
    every run's history (logged on ``monitor`` if given, else on ``val``)."""
    label, chunk = unit
    models = [make_model(c.seed) for c in chunk]
    watch = val if monitor is None else monitor
    hists = train_stacked(models, train, [config(c) for c in chunk], val=watch, on_nonfinite="freeze",
                          desc=f"{desc} {label}", progress=on_step is None, threads=threads, on_step=on_step,
                          taus=taus)
    rows, kept = [], {}
    measure_val, measure_test = measure if isinstance(measure, tuple) else (measure, measure)
    with torch_threads(threads):  # measured on the threads it trained on: the same numbers in a worker
        for c, m, h in zip(chunk, models, hists):
            row = {**asdict(c), "diverged": h.diverged_step is not None, "stop_step": h.stop_step}
            if h.diverged_step is None:
                if val is not None:
                    row.update({f"val_{k}": v for k, v in measure_val(m, val).items()})
                row.update(measure_test(m, test))
                kept[c] = m
            rows.append(row)
    return rows, kept, dict(zip(chunk, hists))


_STEP_REPORT = 20  # a worker reports its progress every this many optimizer steps


def _worker(path: str, queue) -> None:
    """One process of :func:`_in_processes`: reads ``(jobs, fn)`` from the file ``path``, then runs
    ``fn(*args, report)`` for each ``(index, args)`` of ``jobs`` on one torch thread, where
    ``report(n)`` sends ``("step", n)`` progress; sends ``("done", index, payload)`` per finished job
    (its result through :func:`torch.save`) or ``("error", text)``."""
    import io
    import traceback

    torch.set_num_threads(1)
    try:
        jobs, fn = torch.load(path, weights_only=False)
        for index, args in jobs:
            got = fn(*args, lambda n: queue.put(("step", n)))
            buf = io.BytesIO()
            torch.save(got, buf)
            queue.put(("done", index, buf.getvalue()))
    except BaseException:  # the parent raises it, with the worker's traceback
        queue.put(("error", traceback.format_exc()))


def _in_processes(jobs: Sequence[tuple], fn: Callable[..., Any], processes: int, total: int, desc: str,
                  unit: str, progress: bool = True) -> list:
    """``[fn(*args, report) for args in jobs]``, in order, the jobs dealt round-robin over
    ``processes`` spawned one-thread processes (spawn, not fork: a process forked after torch ran
    with two threads can hang in the OpenMP pool). ``fn`` (module-level, as its arguments must pickle)
    calls ``report(n)`` for ``n`` more of the ``total`` ``unit``s of the one progress bar, which ends
    full when jobs report less (stacks that stop early). A failed job raises with the worker's traceback."""
    import multiprocessing as mp
    import os
    import tempfile

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shares = [[(i, a) for i, a in enumerate(jobs) if i % processes == w] for w in range(processes)]
    # each worker reads its jobs from a file: passed as the process's arguments, a large pickle would be
    # written into a pipe that only the started worker reads, and a worker that dies while starting (a
    # script without an ``if __name__ == "__main__"`` guard) would leave this process blocked on it
    with tempfile.TemporaryDirectory(prefix="qkov-jobs-") as tmp:
        procs = []
        for w, share in enumerate(s for s in shares if s):
            path = os.path.join(tmp, f"worker{w}.pt")
            torch.save((share, fn), path)
            procs.append(ctx.Process(target=_worker, args=(path, q), daemon=True))
        return _collect(procs, q, len(jobs), total, desc, unit, progress)


def _collect(procs: list, q, n_jobs: int, total: int, desc: str, unit: str, progress: bool) -> list:
    """Start ``procs`` (:func:`_worker`) and return their ``n_jobs`` results in job order, under one
    progress bar; a worker's error, or a worker that died, raises RuntimeError."""
    import io
    import queue as queue_mod

    out: dict[int, Any] = {}
    bar = tqdm(total=total, desc=f"{desc} ({len(procs)} processes)", unit=unit, mininterval=1.0, disable=not progress)
    try:
        for p in procs:
            p.start()
        while len(out) < n_jobs:
            try:
                msg = q.get(timeout=10)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a training process died with exit code {dead[0].exitcode} "
                                       f"({len(out)} of {n_jobs} done)") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"a training process failed:\n{msg[1]}")
            if msg[0] == "step":
                bar.update(min(msg[1], bar.total - bar.n))
                continue
            _, index, payload = msg
            out[index] = torch.load(io.BytesIO(payload), weights_only=False)
        bar.update(bar.total - bar.n)
    finally:
        bar.close()
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return [out[i] for i in range(n_jobs)]


def _train_unit_reporting(unit, make_model, train, val, test, config, measure, desc, taus, monitor, report):
    """:func:`_train_unit` on one thread, reporting every :data:`_STEP_REPORT` optimizer steps."""
    def on_step(step: int) -> None:
        if (step + 1) % _STEP_REPORT == 0:
            report(_STEP_REPORT)

    return _train_unit(unit, make_model, train, val, test, config, measure, desc, 1, on_step=on_step, taus=taus,
                       monitor=monitor)


def _train_in_processes(units, make_model, train, val, test, config, measure, desc: str, processes: int,
                        taus: Sequence[float] = (), monitor: Batch | None = None,
                        ) -> list[tuple[list[dict], dict[Cell, nn.Module], dict[Cell, History]]]:
    """:func:`_train_unit` of every unit in ``processes`` one-thread processes (:func:`_in_processes`);
    the progress bar counts optimizer steps (a stack runs at most its first config's steps)."""
    totals = [config(u[1][0]).steps for u in units]
    return _in_processes([(u, make_model, train, val, test, config, measure, desc, taus, monitor) for u in units],
                         _train_unit_reporting, processes, sum(totals), desc, "step")


def _call_reporting(fn: Callable[..., Any], *args) -> Any:
    """``fn(*args[:-1])``, then ``args[-1](1)``: one finished run for :func:`run_each`'s bar."""
    *call, report = args
    out = fn(*call)
    report(1)
    return out


def trained(table: pd.DataFrame, chance: float, metric: str = "val_accuracy") -> pd.Series:
    """True for the runs that learned the task: not diverged and ``metric`` at least ``chance``
    (e.g. the majority-class rate of the validation split) plus :data:`claims.TRAINED_MARGIN`."""
    ok = ~table["diverged"].astype(bool)
    if metric in table:
        ok &= table[metric].fillna(-np.inf) >= chance + claims.TRAINED_MARGIN
    else:
        ok &= False
    return ok


def select_base_rates(table: pd.DataFrame, metric: str = "val_accuracy", tie: str = "val_loss") -> dict[str, float]:
    """Per optimizer, the base rate whose trained runs at ratio 1 have the best mean ``metric``
    on the validation split (the test split chooses nothing); equal means are broken by the
    lower mean ``tie`` (validation loss), then by the smaller rate. Only rates with at least
    :data:`qkov_lib.claims.MIN_SEEDS` trained seeds at ratio 1 compete (where no rate has that
    many, those with the most), so one lucky seed of a rate that mostly fails is not the tuned
    model. Needs the ``trained`` column."""
    ref = table[(table["ratio"] == 1.0) & table["trained"]]
    out = {}
    for opt, g in ref.groupby("optimizer", sort=False):
        n = g.groupby("eta_ov")["seed"].nunique()
        g = g[g["eta_ov"].isin(n.index[n >= min(claims.MIN_SEEDS, int(n.max()))])]
        cols = [metric] + ([tie] if tie in g else [])
        means = g.groupby("eta_ov")[cols].mean().reset_index()
        means[metric] = means[metric].round(12)  # equal accuracies computed in a different order
        order = means.sort_values([metric, *cols[1:], "eta_ov"], ascending=[False, *[True] * (len(cols) - 1), True])
        out[opt] = float(order["eta_ov"].iloc[0])
    return out


R1_METRICS = ("accuracy", "macro_f1")  # R1 compares every model, trained or not, on these (``d_all_<m>``)


def phase_table(table: pd.DataFrame, metrics: Sequence[str] | None = None, chance: float | None = None,
                all_metrics: Sequence[str] = R1_METRICS) -> pd.DataFrame:
    """Per (optimizer, eta_ov, ratio): runs, trained runs, the failure rate, the mean of each
    metric over trained runs, and its change against ratio 1 paired by seed (``d_<metric>``, only
    seeds whose both runs trained) with the 95% half-width ``d_<metric>_ci``, the number of seed
    pairs ``d_<metric>_n`` and ``d_<metric>_sig`` (the interval excludes 0; with one seed, never).

    For R1, which must see every model, ``d_all_<m>`` / ``d_all_<m>_ci`` / ``d_all_<m>_n`` give
    the same paired change of each of ``all_metrics`` (default accuracy and macro-F1) over every
    seed whose runs did not diverge, trained or not. With ``chance`` (a fraction, e.g. the test split's majority-class rate) a
    diverged run counts with accuracy ``chance`` instead of being left out (its macro-F1 is
    still left out)."""
    if chance is not None and not (math.isfinite(float(chance)) and 0.0 <= float(chance) <= 1.0):
        raise ValueError(f"chance must be an accuracy in [0, 1] or None, got {chance!r}")
    metrics = phase_metrics() if metrics is None else metrics
    everyone = table.copy()
    diverged = everyone["diverged"].astype(bool) if "diverged" in everyone else pd.Series(False, everyone.index)
    for m in all_metrics:
        if m in everyone:
            everyone[m] = everyone[m].astype(float).where(~diverged, chance if m == "accuracy" and chance is not None
                                                          else math.nan)

    def put(row: dict, key: str, c: claims.Change) -> None:
        row[key], row[f"{key}_ci"], row[f"{key}_n"] = c.mean, c.half_width, c.n

    rows = []
    for (opt, eta), g in table.groupby(["optimizer", "eta_ov"], sort=False):
        ref = g[(g["ratio"] == 1.0) & g["trained"]].set_index("seed")
        ref_all = everyone.loc[g.index[g["ratio"] == 1.0]].set_index("seed")
        for r, h in g.groupby("ratio", sort=True):
            ok = h[h["trained"]].set_index("seed")
            row = {"optimizer": opt, "eta_ov": eta, "ratio": r, "runs": len(h), "trained_runs": len(ok),
                   "failure_rate": 1 - len(ok) / len(h) if len(h) else math.nan}
            both = ok.index.intersection(ref.index)
            for m in metrics:
                if m not in g:
                    continue
                row[m] = float(ok[m].mean()) if len(ok) else math.nan
                c = claims.Change.of(ok.loc[both, m].to_numpy(dtype=float) - ref.loc[both, m].to_numpy(dtype=float))
                put(row, f"d_{m}", c)
                row[f"d_{m}_sig"] = bool(c.bounded and abs(c.mean) > c.half_width)
            cur = everyone.loc[h.index].set_index("seed")
            pairs = cur.index.intersection(ref_all.index)
            for m in all_metrics:
                if m in g:
                    put(row, f"d_all_{m}", claims.Change.of(cur.loc[pairs, m].to_numpy(dtype=float)
                                                            - ref_all.loc[pairs, m].to_numpy(dtype=float)))
            rows.append(row)
    return pd.DataFrame(rows)


def _change(row: pd.Series | None, key: str) -> claims.Change | None:
    """The :class:`qkov_lib.claims.Change` in columns ``key``, ``key_ci``, ``key_n`` of a phase row
    (None when the row or the columns are missing)."""
    if row is None or any(k not in row for k in (key, f"{key}_ci", f"{key}_n")):
        return None
    n = row[f"{key}_n"]
    return claims.Change(float(row[key]), float(row[f"{key}_ci"]), int(n) if math.isfinite(float(n)) else 0)


LOWER_IS_BETTER = frozenset({"sufficiency"})  # metrics whose fall is an improvement
PHASE_LABEL_CHARS = 5  # the longest cell label of :func:`plot_phase` ("+.12*")
PHASE_COLS = 2  # panels side by side in a phase map (more rows instead): the labels stay legible on a page
PHASE_SCALE_BELOW = 0.05  # a phase-map panel whose largest |change| is below this is drawn in units of 10^k


def phase_label(value: float, significant: bool) -> str:
    """The cell label of a phase-map panel: ``value`` to two decimals without the leading zero
    ("+.12", "-.05"; "0" when it rounds to zero, one decimal from 1 on, none from 10 on), then
    ``*`` when ``significant``; empty for a missing value. At most :data:`PHASE_LABEL_CHARS`
    characters, so neighbouring cells never run into each other."""
    if not np.isfinite(value):
        return ""
    a = abs(float(value))
    if a >= 9.5:
        text = f"{value:+.0f}"
    elif a >= 0.995:
        text = f"{value:+.1f}"
    elif round(a, 2) == 0:
        text = "0"
    else:
        text = f"{value:+.2f}".replace("0.", ".", 1)
    return text + ("*" if significant else "")


@draws
def plot_phase(phase: pd.DataFrame, metrics: Sequence[str], selected: Mapping[str, float] | None = None):
    """Heatmaps of ``d_<metric>`` (change against ratio 1) over base rate (rows) × ratio
    (columns), one panel per (optimizer, metric), :data:`PHASE_COLS` panels to a row (each
    optimizer's panels on rows of their own), each with its own colour bar: the colour scale
    of a panel is symmetric around 0 and reaches that panel's largest absolute change. A panel
    whose largest change is below :data:`PHASE_SCALE_BELOW` is drawn in units of ``10^k`` (``k``
    the exponent of that change, named in its title). Each cell is labelled with
    :func:`phase_label` (the change to two decimals, ``*`` when its 95% seed interval excludes
    0); the tuned base rate's row is outlined."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from qkov_lib.plotting import FACE, setup

    setup()
    opts = list(dict.fromkeys(phase["optimizer"]))
    metrics = [m for m in metrics if f"d_{m}" in phase]
    n_ratios = max(int(phase["ratio"].nunique()), 1)
    ncols = max(min(len(metrics), PHASE_COLS), 1)
    per_opt = -(-len(metrics) // ncols)  # rows of panels per optimizer
    fig, axes = plt.subplots(len(opts) * per_opt, ncols, figsize=(max(3.4, 0.55 * n_ratios + 1.6) * ncols,
                                                                  2.7 * len(opts) * per_opt + 0.4),
                             squeeze=False, facecolor=FACE)
    font = 8 if n_ratios <= 5 else 7
    for i in range(len(opts)):  # the empty slots after each optimizer's last panel
        for jm in range(len(metrics), per_opt * ncols):
            axes[i * per_opt + jm // ncols, jm % ncols].set_axis_off()
    for i, opt in enumerate(opts):
        sub = phase[phase["optimizer"] == opt]
        for jm, m in enumerate(metrics):
            j = jm % ncols
            ax = axes[i * per_opt + jm // ncols, j]
            val = sub.pivot(index="eta_ov", columns="ratio", values=f"d_{m}")
            sig = sub.pivot(index="eta_ov", columns="ratio", values=f"d_{m}_sig").reindex_like(val)
            lim = float(np.nanmax(np.abs(val.to_numpy()))) if np.isfinite(val.to_numpy()).any() else 1.0
            # a panel whose changes are all below PHASE_SCALE_BELOW is drawn in units of 10^k
            # (k: the exponent of its largest change), so its labels are not all "0"
            k = int(np.floor(np.log10(lim))) if 0 < lim < PHASE_SCALE_BELOW else 0
            shown = val / 10.0 ** k
            text = pd.DataFrame([[phase_label(v, s == True) for v, s in zip(vr, sr)]  # noqa: E712 (numpy bools)
                                 for vr, sr in zip(shown.to_numpy(dtype=float), sig.to_numpy())],
                                index=val.index, columns=val.columns)
            lim = lim / 10.0 ** k
            # blue means better for every metric: a fall of sufficiency (lower is better) is drawn blue
            sns.heatmap(shown, ax=ax, cmap="RdBu_r" if m in LOWER_IS_BETTER else "RdBu", center=0, vmin=-lim or -1, vmax=lim or 1, annot=text, fmt="",
                        annot_kws={"fontsize": font}, cbar=True, cbar_kws={"shrink": 0.85, "pad": 0.03},
                        linewidths=0.5, linecolor="white")
            ax.collections[0].colorbar.ax.tick_params(labelsize=7)
            ax.grid(False)  # a missing cell stays blank
            ax.set_title(f"{opt}: Δ {m}" + (f" (×$10^{{{k}}}$)" if k else "")
                         + (" (lower is better)" if m in LOWER_IS_BETTER else ""), fontsize=9)
            ax.set_xlabel("eta_QK / eta_OV", fontsize=8)
            ax.set_ylabel("eta_OV" if j == 0 else "", fontsize=8)
            ax.set_yticklabels([f"{e:g}" for e in val.index], rotation=0, fontsize=8)
            ax.set_xticklabels([f"{r:g}" for r in val.columns], fontsize=8)
            if selected and opt in selected and selected[opt] in list(val.index):
                k = list(val.index).index(selected[opt])
                ax.add_patch(plt.Rectangle((0, k), len(val.columns), 1, fill=False, edgecolor="black", lw=2))
    fig.tight_layout()
    return fig


def failures(table: pd.DataFrame) -> pd.DataFrame:
    """Runs that did not train, per (optimizer, eta_ov, ratio): how many of how many."""
    g = table.groupby(["optimizer", "eta_ov", "ratio"], sort=False)["trained"]
    return pd.DataFrame({"failed": g.apply(lambda s: int((~s).sum())), "runs": g.size()}).reset_index()


def synthetic_demo(n: int = 600, T: int = 8, vocab: int = 12, seed: int = 0) -> tuple[Batch, Batch, Batch]:
    """A tiny token task for tests: the class is the id of the one token in ``[1, 4]`` of each
    sequence (the relevant position); the other tokens are noise ids in ``[5, vocab)``; the last
    position is the query token 0. Returns train, validation and test batches."""
    gen = torch.Generator().manual_seed(seed)

    def make(k: int) -> Batch:
        tokens = torch.randint(5, vocab, (k, T), generator=gen)
        pos = torch.randint(0, T - 1, (k,), generator=gen)
        y = torch.randint(0, 4, (k,), generator=gen)
        tokens[torch.arange(k), pos] = y + 1
        tokens[:, -1] = 0
        key_mask = torch.ones(k, T, dtype=torch.bool)
        key_mask[:, -1] = False
        relevant = torch.zeros(k, T, dtype=torch.bool)
        relevant[torch.arange(k), pos] = True
        return Batch(tokens, key_mask, relevant, y)

    return make(n), make(n // 3), make(n // 3)


__all__ = ["Cell", "grid", "train_grid", "trained", "select_base_rates", "phase_table",
           "plot_phase", "phase_label", "PHASE_LABEL_CHARS", "PHASE_COLS", "PHASE_SCALE_BELOW", "failures", "synthetic_demo", "phase_metrics", "MAP_TAU", "R1_METRICS"]
