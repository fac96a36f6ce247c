"""The cost of a chapter's run, stated before it starts.

:func:`work` counts what a chapter trains from its resolved settings: per part of the chapter
(a grid, a map, a set of variants), the runs and the step budget of each run (an upper bound
where runs stop early). :func:`probe` times a short run of the chapter's own training code, twice
with different step counts, on the device the chapter found: the difference gives the seconds per
step of one model, the rest the fixed seconds per run (building, evaluation); it also counts the
parameters of the model the chapter trains and the peak memory of the probe. :func:`estimate`
combines them (``runs * (fixed + steps * seconds per step)``, one model at a time, so stacked
training on a GPU can beat it) and :func:`preflight` is what a chapter calls before it trains:
it states the estimate, stops a ``full`` chapter on a CPU (:class:`TooCostly`) unless forced,
and in a dry run caps the steps of the chapter's settings (:func:`qkov_lib.profiles.cap_steps`).
"""

from __future__ import annotations

import functools
import math
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd
import torch

from qkov_lib import profiles
from qkov_lib.runtime import pick_device

#: the two step counts of a probe: seconds per step = (time(k2) - time(k1)) / (k2 - k1)
PROBE_STEPS = (3, 12)
#: probes of other step counts: a Pythia-style step of the full profile takes seconds on a CPU, a
#: step of the synthetic engine milliseconds
PROBE_STEPS_OF = {"pythia": (1, 3), "sweep": (10, 100)}
#: training rows a real-data probe reads (its model, batch size and padded length are the chapter's)
PROBE_ROWS = 2000
#: torch's intra-op threads of a chapter's dry run on a CPU (:func:`preflight`)
DRY_RUN_THREADS = 1


class TooCostly(RuntimeError):
    """A chapter stopped before training: its profile is meant for another device."""


@dataclass(frozen=True)
class Part:
    """A part of a chapter's work: ``runs`` runs of at most ``steps`` steps each, timed with the
    probe named ``probe``; on a CPU, trained in ``processes`` one-thread processes at once."""

    name: str
    runs: int
    steps: int
    probe: str
    processes: int = 1

    @property
    def run_steps(self) -> int:
        return self.runs * self.steps


@dataclass(frozen=True)
class Probe:
    """A short timed run of a chapter's model on ``device``: seconds per optimizer step of one
    model, fixed seconds per run (building, data, evaluation), parameters of the model, and the
    probe's peak memory in bytes (CUDA: peak allocated; CPU: the process's peak resident memory)."""

    name: str
    device: str
    seconds_per_step: float
    seconds_per_run: float
    n_params: int | None
    peak_memory_bytes: int


@dataclass
class Estimate:
    """A chapter's work, its probes and the estimated wall time (s) on ``device``; ``dry_run``
    estimates the capped run that follows, ``full_seconds`` the run with the profile's own steps."""

    chapter: str
    profile: str
    device: str
    dry_run: bool
    parts: list[Part]
    probes: dict[str, Probe]
    seconds: float
    full_seconds: float
    full_parts: list[Part] = field(default_factory=list)
    forced: bool = False

    def frame(self) -> pd.DataFrame:
        """One row per part: runs, steps per run, run-steps, seconds per step and estimated seconds
        (of the run that follows: capped in a dry run)."""
        rows = []
        for p in self.parts:
            pr = self.probes.get(p.probe)
            rows.append({"part": p.name, "runs": p.runs, "steps per run": p.steps, "runs x steps": p.run_steps,
                         "probe": p.probe, "s per step": pr.seconds_per_step if pr else math.nan,
                         "estimated s": _part_seconds(p, pr)})
        return pd.DataFrame(rows)

    def summary(self) -> str:
        """The estimate in one paragraph: work, parameters, memory, time."""
        n = sum(p.run_steps for p in self.parts)
        params = [pr.n_params for pr in self.probes.values() if pr.n_params]
        mem = max((pr.peak_memory_bytes for pr in self.probes.values()), default=0)
        lines = [f"{self.chapter}, profile {self.profile}{' (dry run)' if self.dry_run else ''} on {self.device}: "
                 f"{sum(p.runs for p in self.parts):,} runs, {n:,} optimizer steps in all"
                 + (f"; largest model {max(params):,} parameters" if params else "")
                 + f"; probe peak memory {mem / 2**20:,.0f} MiB.",
                 f"Estimated wall time: {duration(self.seconds)}"
                 + (f" (the run with the profile's own steps: {duration(self.full_seconds)})" if self.dry_run else "")
                 + "."]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The estimate as plain JSON values (for the results file)."""
        return {"chapter": self.chapter, "profile": self.profile, "device": self.device, "dry_run": self.dry_run,
                "dry_run_steps": profiles.DRY_RUN_STEPS if self.dry_run else None, "forced": self.forced,
                "estimated_s": self.seconds, "estimated_full_s": self.full_seconds,
                "parts": [asdict(p) for p in self.parts], "probes": {k: asdict(v) for k, v in self.probes.items()}}


def duration(seconds: float) -> str:
    """``seconds`` in words: "45 s", "12 min", "3.4 h", "2.1 days"."""
    if not math.isfinite(seconds):
        return "unknown"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _part_seconds(part: Part, probe: Probe | None) -> float:
    """Wall seconds of ``part``: its runs' probe seconds, shared by its processes on a CPU (a probe
    on a CPU counts one process's CPU seconds)."""
    if probe is None:
        return math.nan
    at_once = max(1, part.processes) if probe.device == "cpu" else 1
    return part.runs * (probe.seconds_per_run + part.steps * probe.seconds_per_step) / at_once


# --- the work of each chapter -----------------------------------------------------------------
def _synthetic(cfg: Mapping[str, Any], **_: Any) -> list[Part]:
    # the grid trains in the sweep's batched engine
    return [Part("grid", len(cfg["parameterizations"]) * len(cfg["ratios"]) * len(cfg["seeds"]), int(cfg["steps"]),
                 "sweep")]


def _reduction(cfg: Mapping[str, Any], **_: Any) -> list[Part]:
    # step convergence and the random-init conservation runs: one run per eta, each over the
    # horizon steps * eta_max, so steps * eta_max / eta steps
    longest = max(int(round(cfg["steps"] * cfg["eta_max"] / e)) for e in cfg["etas_convergence"])
    return [Part("ODE vs GD overlay", 4 * len(cfg["ratios"]), int(cfg["steps"]), "synthetic"),
            Part("step convergence and conservation", 2 * len(cfg["etas_convergence"]), longest, "synthetic")]


def _ode_only(cfg: Mapping[str, Any], **_: Any) -> list[Part]:
    # the long-time laws page integrates the reduced ODE only: no model is trained
    return []


def _asymptotics(cfg: Mapping[str, Any], **_: Any) -> list[Part]:
    return [Part("full-model runs", 4 * len(cfg["full_ratios"]) * (1 + len(cfg["full_seeds"])), int(cfg["full_steps"]),
                 "synthetic")]


def _sweep(cfg: Mapping[str, Any], **_: Any) -> list[Part]:
    return [Part("main grid", len(cfg["parameterizations"]) * len(cfg["ratios"]) * len(cfg["seeds"]),
                 int(cfg["steps"]), "sweep")]


def _robustness(cfg: Mapping[str, Any], **_: Any) -> list[Part]:
    per = len(cfg["parameterizations"]) * len(cfg["variant_ratios"]) * len(cfg["variant_seeds"])
    return [Part("robustness variants", per * len(cfg["variants"]), int(cfg["variant_steps"]), "sweep")]


def _map(cfg: Mapping[str, Any], natural: Mapping[str, Any] | None = None, **_: Any) -> list[Part]:
    per = len(cfg["ratios"]) * len(cfg["map_seeds"])
    from qkov_lib.studies import realmap

    parts = [Part(f"map, {o}, eta_ov {e:g}", per, realmap.run_steps(cfg, o, e), "map", int(cfg.get("processes") or 1))
             for o in cfg["optimizers"] for e in cfg[f"{o}_rates"]]
    extra = [s for s in cfg.get("protocol_seeds") or [] if s not in set(cfg["map_seeds"])]
    if extra:  # the protocol cells again at more seeds: the tuned rate at every ratio, the control below it
        for o in cfg["optimizers"]:
            top = max(cfg[f"{o}_rates"])
            parts.append(Part(f"protocol cells, {o}, {len(extra)} more seeds", (2 * len(cfg["ratios"]) - 1) * len(extra),
                              realmap.run_steps(cfg, o, top), "map", int(cfg.get("processes") or 1)))
    if natural is not None and natural.get("linzen", True):
        parts.append(Part("natural prefixes", len(natural["ratios"]) * len(natural["seeds"]), int(natural["steps"]),
                          "map", int(natural.get("processes") or 1)))
    return parts


def _ablation(scfg: Mapping[str, Any], **_: Any) -> list[Part]:
    """The protocol-choices study (:mod:`qkov_lib.studies.ablation`), per dataset timed with its own map's
    probe (``map:<dataset>``): tuning (where no rate is given), the default arm and every retrained arm that
    applies (the budget arm at its longer budget), SVA's natural prefixes."""
    from qkov_lib.profiles import resolve
    from qkov_lib.studies import ablation, agreement_roles, realmap

    parts = []
    n = len(scfg["ratios"]) * len(scfg["seeds"])
    for name in scfg["datasets"]:
        mcfg = ablation.map_settings(name, scfg)
        procs = int(mcfg.get("processes") or 1)
        given = (scfg["rates_given"] or {}).get(name)
        for o in mcfg["optimizers"]:
            if given is None:
                parts += [Part(f"{name}: tuning, {o}, eta_ov {e:g}", len(scfg["seeds"]), realmap.run_steps(mcfg, o, e),
                               f"map:{name}", procs) for e in mcfg[f"{o}_rates"]]
            eta = float(given[o]) if given is not None and o in given else max(mcfg[f"{o}_rates"])
            for arm in ["default", *(a for a in scfg["ablations"] if a not in ("evaluation", "natural")
                                     and ablation.applies(a, name, mcfg))]:
                cfg = (ablation.default_config(mcfg) if arm == "default" else
                       ablation.arm_config(arm, name, mcfg, int(scfg["steps_factor"])))
                parts.append(Part(f"{name}: {arm} arm, {o}", n, realmap.run_steps(cfg, o, eta), f"map:{name}", procs))
        if "natural" in scfg["ablations"] and ablation.applies("natural", name, mcfg):
            ncfg = resolve(agreement_roles.NATURAL_PROFILES, scfg["profile"])
            parts.append(Part(f"{name}: natural prefixes", n, int(ncfg["steps"]), f"map:{name}",
                              int(ncfg.get("processes") or 1)))
    return parts


def _multilayer(cfg: Mapping[str, Any], **_: Any) -> list[Part]:
    from qkov_lib.studies import pythia

    name = cfg["profile"]
    py, sva, one = (profiles.resolve(t, name) for t in (pythia.PROFILES, pythia.SVA_PROFILES, pythia.ONE_HEAD_PROFILES))
    return [Part("encoder grid", len(cfg["datasets"]) * len(cfg["ratios"]) * len(cfg["seeds"]), int(cfg["steps"]),
                 "encoder", int(cfg.get("processes") or 1)),
            Part("Pythia-style grid", len(py["ratios"]) * len(py["seeds"]), int(py["steps"]), "pythia"),
            Part("Pythia-style SVA (Trainer)", len(sva["ratios"]) * len(sva["seeds"]), int(sva["steps"]), "pythia"),
            Part("one-head SVA", len(sva["ratios"]) * len(sva["seeds"]), int(one["steps"]), "encoder")]


#: chapter (its results name, as ``qkov run`` names it) -> its work from the resolved settings
WORK: dict[str, Callable[..., list[Part]]] = {
    "synthetic": _synthetic, "theory_reduction": _reduction, "theory_asymptotics": _ode_only, "sharpness": _asymptotics,
    "sweep": _sweep, "robustness": _robustness,
    "squad": _map, "hatexplain": _map, "sva": _map, "multilayer": _multilayer, "protocol_choices": _ablation,
}


def work(chapter: str, cfg: Mapping[str, Any], **others: Mapping[str, Any]) -> list[Part]:
    """The parts of ``chapter``'s work under the resolved settings ``cfg`` (and its other
    settings ``others``, e.g. ``natural=`` for the SVA chapter's natural-prefix models)."""
    if chapter not in WORK:
        raise ValueError(f"no cost model for chapter {chapter!r}; known: {', '.join(WORK)}")
    return WORK[chapter](cfg, **others)


# --- probes: a short run of the chapter's own training code -------------------------------------
class _RootModules:
    """Records every module whose forward starts while no other forward runs (the models a
    probe trains or evaluates), through torch's global module hooks."""

    def __init__(self) -> None:
        self.depth, self.roots = 0, {}

    def __enter__(self) -> _RootModules:
        from torch.nn.modules import module as M

        def pre(mod, _):
            if self.depth == 0:
                self.roots[id(mod)] = sum(p.numel() for p in mod.parameters())
            self.depth += 1

        def post(mod, _, __):
            self.depth -= 1

        self.handles = [M.register_module_forward_pre_hook(pre), M.register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def _peak_memory(device: torch.device, children: bool = False) -> int:
    """Peak memory in bytes: on CUDA the peak allocated on ``device``; on a CPU this process's
    peak resident memory, or with ``children`` the larger of it and that of the largest of its
    ended child processes (the map's training workers)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss: KiB on Linux, bytes on macOS
    who = [resource.RUSAGE_SELF] + ([resource.RUSAGE_CHILDREN] if children else [])
    rss = max(resource.getrusage(w).ru_maxrss for w in who)
    return int(rss if sys.platform == "darwin" else rss * 1024)


def time_steps(run: Callable[[int], Any], name: str, device: torch.device,
               steps: tuple[int, int] = PROBE_STEPS, repeats: int = 2) -> Probe:
    """Time ``run(k)`` (a chapter's own training of one model for ``k`` steps) at the two step
    counts ``steps``, after one untimed ``run(1)``: seconds per step from their difference, the
    rest of the first as the fixed seconds per run (CUDA: wall seconds; CPU: CPU seconds of this
    process on one torch thread, every thread's counted); the parameters of the largest model it
    ran and the peak memory. Each count is timed ``repeats`` times and the fastest kept; a second
    count no slower than the first (noise larger than the steps) gives the second's seconds over
    its steps as the seconds per step and no fixed seconds, an upper bound instead of a step
    that costs nothing."""
    k1, k2 = steps
    if not 1 <= k1 < k2:
        raise ValueError(f"probe steps must satisfy 1 <= k1 < k2, got {steps}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # a GPU: wall seconds (synchronised); a CPU: this process's CPU seconds, which other jobs on a
    # shared machine do not inflate (the estimate is for the chapter alone on its cores). One torch
    # thread on a CPU, as the chapters train: a second thread's spin-waits count as CPU seconds and
    # once made a 12-step probe cost no more than a 3-step one (SQuAD's map: 0 s per step)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    threads = torch.get_num_threads()
    times = []
    try:
        if device.type == "cpu":
            torch.set_num_threads(1)
        with _RootModules() as roots:
            run(1)  # warm-up, untimed: first-call costs (imports, caches, allocator) are not per run
            for k in (k1, k2):
                best = math.inf
                for _ in range(max(1, repeats)):
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = clock()
                    run(k)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    best = min(best, clock() - t0)
                times.append(best)
    finally:
        torch.set_num_threads(threads)
    per_step = (times[1] - times[0]) / (k2 - k1)
    if per_step > 0:
        per_run = max(times[0] - k1 * per_step, 0.0)
    else:
        per_step, per_run = times[1] / k2, 0.0
    return Probe(name, str(device), per_step, per_run, max(roots.roots.values()) if roots.roots else None,
                 _peak_memory(device))


def _probe_synthetic(cfg: Mapping[str, Any], device: torch.device, **_: Any) -> Callable[[int], Any]:
    from qkov_lib.studies import synthetic

    # the chapters 02/03 settings name the rate eta_max and have no test sample: the probe's run
    # is the synthetic chapter's on the same task
    c = {"embedding": "onehot", "init_scale": 0.1, "optimizer": "gd", "dtype": "float64", "n_test": 1000, **cfg,
         "eta_ov": float(cfg.get("eta_ov", cfg.get("eta_max", 0.1)))}
    task = synthetic.task_of(c)
    return lambda k: synthetic.train_one(task, "FAFO", 1.0, 0, {**c, "steps": k}, device)


def _probe_sweep(cfg: Mapping[str, Any], device: torch.device, **_: Any) -> Callable[[int], Any]:
    from qkov_lib.studies import synthetic_sweeps

    return lambda k: synthetic_sweeps.run_grid(dict(cfg), parameterizations=cfg["parameterizations"][:1], ratios=[1.0],
                                               seeds=cfg["seeds"][:1], steps=k, desc="cost probe")


def _probe_map(cfg: Mapping[str, Any], device: torch.device, chapter: str = "", **_: Any) -> Callable[[int], Any]:
    from qkov_lib import protocol
    from qkov_lib.studies import realmap
    from qkov_lib.train import train

    small = {**cfg, "n_train": PROBE_ROWS, "n_test": PROBE_ROWS // 10}
    if "n_val" in cfg:
        small["n_val"] = PROBE_ROWS // 10
    ds, val = realmap.load_splits(chapter, small)
    data, val = ds.train.to(device), val.to(device)
    opt = cfg["optimizers"][0]
    cell = protocol.Cell(opt, float(cfg[f"{opt}_rates"][0]), 1.0, 0)

    def run(k: int) -> None:
        model = realmap.make_model(ds, cfg, 0).to(device)
        tc = realmap.cell_config({**cfg, f"{opt}_steps": k}, cell)
        train(model, data, tc, val=val)

    return run


def _probe_dataset_map(dataset: str, cfg: Mapping[str, Any], device: torch.device, **_: Any) -> Callable[[int], Any]:
    from qkov_lib.studies import realmap

    return _probe_map(realmap.map_config(dataset, cfg["profile"]), device, chapter=dataset)


def _probe_encoder(cfg: Mapping[str, Any], device: torch.device, **_: Any) -> Callable[[int], Any]:
    from qkov_lib.studies import multilayer

    name = cfg["datasets"][0]
    small = {**cfg, "datasets": [name], "n_train": PROBE_ROWS, "n_test": PROBE_ROWS // 10}
    ds = multilayer.load_data(small)[name]
    return lambda k: multilayer.train_one(ds, name, 1.0, 0, {**small, "steps": k}, device)


def _probe_pythia(cfg: Mapping[str, Any], device: torch.device, **_: Any) -> Callable[[int], Any]:
    from qkov_lib.studies import pythia

    pcfg = profiles.resolve(pythia.PROFILES, cfg["profile"])
    return lambda k: pythia.train_one({**pcfg, "steps": k}, 1.0, 0)


#: probe name -> ``make(cfg, device, chapter=...) -> run(k)``: one model of the chapter trained for k steps
PROBES: dict[str, Callable[..., Callable[[int], Any]]] = {
    "synthetic": _probe_synthetic, "sweep": _probe_sweep, "map": _probe_map, "encoder": _probe_encoder,
    "pythia": _probe_pythia,
    # the protocol-choices chapter: each dataset's map model under that chapter's profile
    **{f"map:{d}": functools.partial(_probe_dataset_map, d) for d in ("squad", "hatexplain", "sva")},
}


def probe(name: str, chapter: str, cfg: Mapping[str, Any], device: torch.device) -> Probe:
    """Time probe ``name`` (:data:`PROBES`) of ``chapter`` under ``cfg`` on ``device``
    (:func:`time_steps`). The probe runs with the profile's own settings even in a dry run."""
    was = profiles.dry_run_active()
    profiles.set_dry_run(False)
    try:
        return time_steps(PROBES[name](cfg, device, chapter=chapter), name, device, PROBE_STEPS_OF.get(name, PROBE_STEPS))
    finally:
        profiles.set_dry_run(was)


def estimate(chapter: str, cfg: Mapping[str, Any], device: torch.device | None = None, dry_run: bool = False,
             **others: Mapping[str, Any]) -> Estimate:
    """The :class:`Estimate` of ``chapter`` under the resolved settings ``cfg`` (uncapped) on
    ``device``: every part's probe timed once; in a dry run, the work and time of the capped run
    beside the time of the run with the profile's own steps."""
    device = device or pick_device()
    full = work(chapter, cfg, **others)
    run = full
    if dry_run:  # the capped work, with any settings the work resolves itself capped as the chapter's will be
        was = profiles.dry_run_active()
        profiles.set_dry_run(True)
        try:
            run = work(chapter, profiles.cap_steps(cfg), **{k: profiles.cap_steps(v) for k, v in others.items()})
        finally:
            profiles.set_dry_run(was)
    probes = {name: probe(name, chapter, cfg, device) for name in dict.fromkeys(p.probe for p in full)}
    total = sum(_part_seconds(p, probes[p.probe]) for p in run)
    return Estimate(chapter, str(cfg.get("profile")), str(device), dry_run, run, probes, total,
                    sum(_part_seconds(p, probes[p.probe]) for p in full), full)


@dataclass
class Plan:
    """What :func:`preflight` hands back: the settings to run with (``cfg``, and ``configs`` for
    the chapter's other settings; capped in a dry run) and the :class:`Estimate`."""

    cfg: dict[str, Any]
    configs: dict[str, dict[str, Any]]
    estimate: Estimate


_RECORDED: dict[str, Estimate] = {}  # chapter -> the estimate of its preflight in this process


def recorded(chapter: str) -> Estimate | None:
    """The estimate :func:`preflight` made for ``chapter`` in this process, if any (what the
    chapter's results file records)."""
    return _RECORDED.get(chapter)


def stop_reason(profile: str, machine: torch.device, dry_run: bool, force: bool) -> str | None:
    """Why a chapter must not start, or None: a ``full`` profile on a machine whose best device
    (``machine``, :func:`qkov_lib.runtime.pick_device`) is a CPU, neither a dry run nor forced."""
    if profile == "full" and machine.type == "cpu" and not dry_run and not force:
        return "the full profile is meant for a GPU, and this machine has only a CPU"
    return None


def preflight(chapter: str, cfg: Mapping[str, Any], device: torch.device | str | None = None,
              dry_run: bool | None = None, force: bool | None = None, **others: Mapping[str, Any]) -> Plan:
    """Before a chapter trains: state its work and estimated time on ``device`` (where the
    chapter trains; None: :func:`qkov_lib.runtime.pick_device`), printed, and either go on or stop.
    ``dry_run`` (None: ``$QKOV_DRY_RUN``) caps every step count of ``cfg`` and ``others`` and of
    every later :func:`qkov_lib.profiles.resolve` in this process and, on a CPU, sets torch to
    :data:`DRY_RUN_THREADS` thread for the rest of the process. A ``full`` profile on a machine
    without a GPU raises :class:`TooCostly` with the estimate and how to go on anyway, unless
    ``force`` or ``dry_run``. The estimate is kept for the chapter's results file (:func:`recorded`)."""
    device = torch.device(device) if device is not None else pick_device()
    for key, value in (("dry_run", dry_run), ("force", force)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"parameter {key!r} must be True, False or None, got {type(value).__name__} {value!r}")
    dry = profiles.env_dry_run() if dry_run is None else dry_run
    est = estimate(chapter, cfg, device, dry_run=dry, **others)
    est.forced = bool(force)
    print(est.summary())
    why = stop_reason(str(cfg.get("profile")), pick_device(), dry, bool(force))
    if why:
        raise TooCostly(
            f"{chapter}: not started: {why}.\n{est.summary()}\n"
            f"To run it here anyway: set force = True (qkov run {chapter} -p profile '\"full\"' -p force true). "
            f"To check the full profile's data, shapes and code paths with every run capped at "
            f"{profiles.DRY_RUN_STEPS} steps: dry_run = True "
            f"(qkov run {chapter} -p profile '\"full\"' -p dry_run true; make book PROFILE=full DRY_RUN=1).")
    profiles.set_dry_run(dry)
    _RECORDED[chapter] = est
    if dry and device.type == "cpu":
        # one torch thread, as the maps and the cpu profiles train: the dry book runs two chapters at
        # once on two cores, and a second intra-op thread each then spins; a dry 20-step run of the
        # multi-layer grid took 111 s (26 CPU s) on two threads of a busy 2-core machine, 21 s (4 CPU s) on one
        torch.set_num_threads(DRY_RUN_THREADS)
    if dry:
        return Plan(profiles.cap_steps(cfg), {k: profiles.cap_steps(v) for k, v in others.items()}, est)
    return Plan(dict(cfg), {k: dict(v) for k, v in others.items()}, est)


def results_record(est: Estimate | None, wall_time_s: float | None) -> dict[str, Any] | None:
    """The ``cost`` entry of a results file: the estimate (:meth:`Estimate.to_dict`), the
    measured wall time (s) and their ratio (measured / estimated), and the peak memory measured
    so far (bytes; :func:`_peak_memory` with the ended worker processes). After a dry run, also the
    full run's estimate from it: the measured wall time (data, evaluation, everything the probe
    does not time) plus the steps the cap left out at the probe's seconds per step."""
    if est is None:
        return None
    measured = wall_time_s is not None
    ratio = wall_time_s / est.seconds if measured and est.seconds > 0 else None
    from_dry = wall_time_s + est.full_seconds - est.seconds if measured and est.dry_run else None
    return {**est.to_dict(), "measured_wall_time_s": wall_time_s, "measured_over_estimated": ratio,
            "estimated_full_from_dry_run_s": from_dry,
            "measured_peak_memory_bytes": _peak_memory(torch.device(est.device), children=True)}


# --- every chapter's estimate, nothing trained (make estimate, the GPU workflow's first step) -----
def _settings(chapter: str, profile: str | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(cfg, others)`` of ``chapter`` as its settings cell resolves them, every override None."""
    from qkov_lib.studies import (ablation, agreement_roles, asymptotics, multilayer, realmap, reduction, synthetic,
                                  synthetic_sweeps)

    tables = {"synthetic": synthetic.PROFILES, "theory_reduction": reduction.PROFILES_REDUCTION,
              "theory_asymptotics": asymptotics.PROFILES_ASYMPTOTICS, "sharpness": asymptotics.PROFILES_ASYMPTOTICS,
              "sweep": synthetic_sweeps.PROFILES, "robustness": synthetic_sweeps.PROFILES,
              "multilayer": multilayer.PROFILES, "protocol_choices": ablation.PROFILES}
    if chapter in tables:
        return profiles.resolve(tables[chapter], profile), {}
    cfg = realmap.map_config(chapter, profile)
    if chapter == "sva":
        return cfg, {"natural": profiles.resolve(agreement_roles.NATURAL_PROFILES, profile)}
    return cfg, {}


#: the device each chapter trains on where it is not the machine's best (the theory chapters: CPU)
CHAPTER_DEVICE = {"theory_reduction": "cpu", "theory_asymptotics": "cpu", "sharpness": "cpu"}


def main(argv: list[str] | None = None) -> int:
    """``python -m qkov_lib.cost [-p PROFILE] [CHAPTER ...]``: each chapter's work and estimated
    wall time on this machine (a probe per chapter, nothing else trained); a table and the total."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m qkov_lib.cost", description=main.__doc__)
    ap.add_argument("chapters", nargs="*", help=f"chapters (default: all: {' '.join(WORK)})")
    ap.add_argument("-p", "--profile", default=None, help="test | cpu | full (default: $QKOV_PROFILE, else cpu)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.chapters if c not in WORK]
    if unknown:
        ap.error(f"unknown chapter(s) {', '.join(unknown)}; known: {', '.join(WORK)}")
    rows = []
    for chapter in args.chapters or list(WORK):
        cfg, others = _settings(chapter, args.profile)
        est = estimate(chapter, cfg, torch.device(CHAPTER_DEVICE.get(chapter) or pick_device()), **others)
        print(est.summary(), flush=True)
        rows.append({"chapter": chapter, "device": est.device, "runs": sum(p.runs for p in est.parts),
                     "runs x steps": sum(p.run_steps for p in est.parts), "estimated": duration(est.seconds),
                     "estimated_s": round(est.seconds)})
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    print(f"total: {duration(float(table['estimated_s'].sum()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
