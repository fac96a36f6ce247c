"""The protocol map of each real-data chapter: a model whose prediction passes through the
analysed head, a validation split, base-rate grids for AdamW and SGD, the necessity check and
the R1-R3 verdicts over the map.

Per dataset (``sva``, ``hatexplain``, ``squad``) the profiles of :data:`MAPS` fix the options of
the analysed-head model (:class:`qkov_lib.head_model.HeadModel`, :data:`HEAD_OPTIONS`), the splits
(HateXplain: its official validation split; SVA and SQuAD: a seeded part of the training split
held out), the base-rate grid of each optimizer, ratios, seeds and the step budget (early stopping
on validation loss). :func:`run_map` trains the map and returns a :class:`MapResult`;
:func:`tuned_evaluations` evaluates the tuned models for the attention analyses; the ``*_facts``
functions give the numbers a chapter glues and :func:`claims_rows` its scorecard rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from qkov_lib.figure_source import draws
from qkov_lib import claims, head_model, rate_plane
from qkov_lib import faithfulness as fa
from qkov_lib.data.batch import Batch, spread
from qkov_lib.data.text import TextDataset, dry_run_dataset, dry_run_split
from qkov_lib.data import registry
from qkov_lib.data.registry import load_text_dataset
from qkov_lib.runtime import seed_everything
from qkov_lib.metrics import prediction_metrics, relevant_mass, seed_half_width, summarize
from qkov_lib.profiles import profile_table
from qkov_lib.train import TrainConfig, predict
from qkov_lib.studies import rationales, attention_analysis, trajectory
from qkov_lib import protocol
from qkov_lib.studies.agreement_roles import split_validation, test_attention  # noqa: F401 -- also realmap.test_attention

# the HeadModel options a map config may set, config name -> model argument ("head_query": "query"
# already names the SVA loader's query token)
HEAD_OPTIONS = {"readout": "readout", "encoder": "encoder", "layers": "layers", "window": "window",
                "positions": "positions", "match": "match", "head_query": "query", "values": "values",
                "relative": "relative", "ov_init": "ov_init"}
OPTIMIZERS = ("adamw", "sgd")
MAP_FRACS = (0.01, 0.05, 0.1, 0.2, 0.5)
RATIOS = [1.0, 3.0, 10.0, 30.0, 100.0]

# Shared by every dataset: both optimizers, early stopping on validation loss (every eval_every
# steps, best weights restored), sufficiency on n_eraser instances; the analysed head fed by a
# convolution over the keys, token-local values. On CPU the stacks train in two one-thread processes:
# on an idle 2-core machine as fast as one stack on two threads, and twice as fast as that when
# another job holds a core (benchmarks/bench_map_threads.py).
COMMON = dict(optimizers=["adamw", "sgd"], ratios=[1.0, 10.0, 100.0], map_seeds=[0, 1, 2, 3], parameterization="FAFO",
               init_scale=1e-2, batch_size=64, weight_decay=0.0, eta_other=None, data_seed=0, val_frac=0.1,
               eval_every=100, patience=4, n_eraser=300, threads=1, processes=2, model="head", readout="class",
               encoder="conv", layers=1, window=3, positions=["back"], match=False, head_query="last", values="embed",
               relative=False, ov_init=0.0, adamw_rates=[1e-4, 1e-3, 1e-2], sgd_rates=[0.03, 0.3, 3.0], max_stack=64,
               step_growth=1.0, max_step_scale=1.0, monitor_rows=None, protocol_seeds=None)
# every profile's map of the test profile: seconds (CI)
_TEST = dict(ratios=[1.0, 10.0], map_seeds=[0], adamw_rates=[1e-3, 1e-2], sgd_rates=[0.1, 1.0], adamw_steps=40,
             sgd_steps=40, eval_every=10, n_eraser=50, threads=1, processes=1)
# full (GPU): the paper's ratios, 5 seeds, 4 base rates per optimizer a decade apart (both routes of the rate
# plane at ratios 10 and 100)
_FULL = dict(ratios=RATIOS, map_seeds=[0, 1, 2, 3, 4], protocol_seeds=[5, 6, 7], n_eraser=2000, processes=1, adamw_rates=[1e-5, 1e-4, 1e-3, 1e-2],
             sgd_rates=[0.003, 0.03, 0.3, 3.0], step_growth=2.0, max_step_scale=2.0)

# cpu: the training logs and early stopping evaluate 512 evenly spaced validation rows (monitor_rows; every
# trained model is then measured on the whole split, which chooses the rates): a log of 18 SQuAD models on all
# 1,453 held-out questions cost as much as 21 training steps, on 512 as much as 7.
# cpu: each optimizer's 36 runs in two stacks of 18 (dealt by seed, so both hold every rate and ratio),
# one of each optimizer per process, so that the two processes finish together (a stack of 18 costs no
# more per model-step than one of 36, benchmarks/README.md)
# cpu: the paper's protocol cells (the tuned rate at every ratio, and the control below it) get four more seeds
_CPU = dict(max_stack=18, monitor_rows=512, protocol_seeds=[4, 5, 6, 7])

# cpu = sized so that a chapter, map included, runs within 12 minutes on 2 cores (SQuAD costs most: 60 map
# runs and 40 protocol-seed runs of up to 800 steps). Base rates a decade apart with ratios 1, 10, 100: every
# cell of the rate plane is reached both ways (eta_QK raised at fixed eta_OV, eta_OV lowered at fixed
# eta_QK), and the lowest AdamW rate keeps eta_QK at ratio 100 at 1e-2.
_SVA_PROFILES = profile_table(
    dict(COMMON, layers=2, relative=True, d_model=64, max_len=16, min_freq=2, test_frac=0.2, adamw_steps=2000,
         sgd_steps=2000),
    dict(_TEST, n_train=400, n_test=200),
    # cpu: width 32, as HateXplain's and SQuAD's maps: a stacked step of 18 models costs 21 ms against 44 at
    # 64, the model learns the task as well, and the plane's words are the same (benchmarks/README.md)
    dict(_CPU, n_train=None, n_test=None, d_model=32),
    dict(_FULL, adamw_steps=6000, sgd_steps=6000, n_train=None, n_test=None),
)
# cpu: a base rate where no run trains at any ratio leaves the cpu grid (the full profile keeps it), and its
# CPU pays for the protocol cells' extra seeds. SGD eta_OV 0.03 on HateXplain: 0 of 16 runs trained on seeds
# 0-7 and 0 of 16 on seeds 8-15 (its x100 control cell included); SGD eta_OV 3 on SQuAD: 0 of 12 and 0 of 12
# (cpu builds of 67b7df6). Both grids keep a rate a decade on the other side of the tuned one.
CPU_NEVER_TRAINS = {"hatexplain": {"sgd": 0.03}, "squad": {"sgd": 3.0}}
_HATEXPLAIN_PROFILES = profile_table(
    dict(COMMON, d_model=32, max_len=64, min_freq=2, adamw_steps=1000, sgd_steps=1000, eval_every=100,
         plausibility=True),
    dict(_TEST, d_model=16, n_train=300, n_test=100, n_val=100),
    # cpu: each minibatch and evaluation in two groups of rows by length, each cut to its longest row (62 % of
    # the positions are padding): the same losses up to float rounding, a stacked step about 1.1x faster
    # (TrainConfig.length_buckets; benchmarks/README.md)
    dict(_CPU, n_train=None, n_test=None, n_val=None, sgd_rates=[0.3, 3.0], length_buckets=2),
    dict(_FULL, d_model=64, max_len=128, n_train=None, n_test=None, n_val=None, n_eraser=1924, adamw_steps=4800,
         sgd_steps=4800),
)
_SQUAD_PROFILES = profile_table(
    dict(COMMON, readout="words", layers=2, window=5, match=True, head_query="question", relative=True,
         ov_init=1.0, d_model=32, max_len=128, min_freq=10, oov_buckets=1000, batch_size=32, adamw_steps=800,
         sgd_steps=800, eval_every=100, patience=3),
    dict(_TEST, adamw_steps=20, sgd_steps=20, n_train=300, n_test=100, layers=1),
    dict(_CPU, n_train=20000, n_test=3100, sgd_rates=[0.03, 0.3]),
    # full: 16 models a stack, not 64: a stack evaluates on every validation question at once (about
    # 250 MB a model on SQuAD's 4,910 questions of 128 tokens; 64 would not fit in 24 GB)
    dict(_FULL, d_model=64, layers=3, batch_size=64, n_train=None, n_test=None, adamw_steps=8000, sgd_steps=8000,
         eval_every=500, max_stack=16),
)


@dataclass(frozen=True)
class MapSpec:
    """A dataset the protocol map runs on: its ``profiles`` (:func:`qkov_lib.profiles.profile_table`
    with the keys of :data:`COMMON` and the loader's) and ``load(cfg, data_dir) -> (dataset, validation
    batch)``, where ``dataset.train`` excludes the validation instances and the test split chooses nothing."""

    name: str
    profiles: Mapping[str, Mapping[str, Any]]
    load: Callable[[Mapping[str, Any], Any], tuple[TextDataset, Batch]]


#: name -> :class:`MapSpec`; a new dataset is one :func:`register` call (see tests/test_realmap.py)
MAPS: dict[str, MapSpec] = {}


def register(spec: MapSpec) -> MapSpec:
    """Add ``spec`` to :data:`MAPS` (replacing one of the same name); returns it."""
    return registry.add(MAPS, spec, MapSpec)


def check_dataset(name: str) -> None:
    """Raise a clear ValueError for a dataset without a map."""
    if name not in MAPS:
        raise ValueError(f"unknown dataset {name!r}; the protocol map exists for {', '.join(MAPS)}")


def load_splits(name: str, cfg: Mapping[str, Any], data_dir=None) -> tuple[TextDataset, Batch]:
    """``(dataset, validation batch)`` of dataset ``name`` for a map config (:attr:`MapSpec.load`); in a
    dry run both evaluation splits are samples (:func:`~qkov_lib.data.text.dry_run_split`)."""
    check_dataset(name)
    ds, val = MAPS[name].load(cfg, data_dir)
    return dry_run_dataset(ds), dry_run_split(val)


def hold_out_validation(ds: TextDataset, cfg: Mapping[str, Any]) -> tuple[TextDataset, Batch]:
    """``cfg["val_frac"]`` of ``ds.train`` held out at random (seeded by ``data_seed``) as the
    validation split; ``ds.train`` keeps the rest, and the report and notes say so."""
    ds.train, val = split_validation(ds.train, cfg["val_frac"], cfg["data_seed"])
    ds.report["val_held_out"] = len(val)
    ds.notes.append(f"Validation: {len(val):,} training instances held out at random (seed {cfg['data_seed']}) "
                    "for choosing the base rate and early stopping.")
    return ds, val


def _hatexplain_splits(cfg: Mapping[str, Any], data_dir=None) -> tuple[TextDataset, Batch]:
    """HateXplain with its official validation split."""
    from qkov_lib.data import hatexplain

    return hatexplain.load_with_val(data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"],
                                    n_train=cfg.get("n_train"), n_test=cfg.get("n_test"), n_val=cfg.get("n_val"),
                                    seed=cfg["data_seed"])


def _squad_splits(cfg: Mapping[str, Any], data_dir=None) -> tuple[TextDataset, Batch]:
    """SQuAD as the answer-word task of :func:`qkov_lib.head_model.word_task`, validation held out."""
    ds = head_model.word_task(load_text_dataset("squad", data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"],
                                                n_train=cfg["n_train"], n_test=cfg["n_test"], seed=cfg["data_seed"],
                                                query="wh", keys="context", oov_buckets=cfg["oov_buckets"]))
    return hold_out_validation(ds, cfg)


def _sva_splits(cfg: Mapping[str, Any], data_dir=None) -> tuple[TextDataset, Batch]:
    """Marvin & Linzen's agreement prefixes, held-out test prefixes, validation held out."""
    ds = load_text_dataset("sva", data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"], n_train=cfg["n_train"],
                           n_test=cfg["n_test"], seed=cfg["data_seed"], test_frac=cfg["test_frac"])
    return hold_out_validation(ds, cfg)


for _spec in (MapSpec("sva", _SVA_PROFILES, _sva_splits),
              MapSpec("hatexplain", _HATEXPLAIN_PROFILES, _hatexplain_splits),
              MapSpec("squad", _SQUAD_PROFILES, _squad_splits)):
    register(_spec)
DATASETS = tuple(MAPS)  # the book's own maps, in chapter order of their claims rows


def make_model(ds: TextDataset, cfg: Mapping[str, Any], seed: int) -> nn.Module:
    """The seeded model of a map config: ``model`` = ``"head"``, the analysed-head model of
    :func:`qkov_lib.head_model.for_dataset` with the options of :data:`HEAD_OPTIONS`."""
    kind = cfg["model"]
    if kind == "head":
        return head_model.for_dataset(ds, cfg["d_model"], generator=seed_everything(seed),
                                      parameterization=cfg["parameterization"], init_scale=cfg["init_scale"],
                                      **{arg: cfg[k] for k, arg in HEAD_OPTIONS.items() if k in cfg})
    raise ValueError(f"unknown map model {kind!r}; expected 'head'")


def base_rates(cfg: Mapping[str, Any]) -> dict[str, list[float]]:
    """``{optimizer: its base-rate grid}`` for the optimizers of ``cfg``."""
    unknown = [o for o in cfg["optimizers"] if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; the map runs {', '.join(OPTIMIZERS)}")
    return {o: [float(e) for e in cfg[f"{o}_rates"]] for o in cfg["optimizers"]}


def run_steps(cfg: Mapping[str, Any], optimizer: str, eta_ov: float) -> int:
    """The step budget of a run at base rate ``eta_ov``: ``<optimizer>_steps`` at the optimizer's highest base
    rate, times ``step_growth`` per decade below it, at most ``max_step_scale`` times, rounded to whole
    evaluations. A slower eta_OV gets more steps, so the fixed-eta_QK route of the rate plane (eta_OV lowered)
    compares runs that can reach comparable loss; early stopping ends the fast ones anyway."""
    base = int(cfg[f"{optimizer}_steps"])
    growth, cap = float(cfg.get("step_growth", 1.0)), float(cfg.get("max_step_scale", 1.0))
    if growth < 1.0 or cap < 1.0:
        raise ValueError(f"step_growth and max_step_scale must be >= 1, got {growth} and {cap}")
    decades = max(0.0, math.log10(max(float(e) for e in cfg[f"{optimizer}_rates"]) / float(eta_ov)))
    scaled = base * min(cap, growth ** decades)
    every = max(1, int(cfg.get("eval_every", 1)))
    return max(base, int(round(scaled / every)) * every)


def cell_config(cfg: Mapping[str, Any], cell: protocol.Cell) -> TrainConfig:
    """The :class:`TrainConfig` of one cell (optimizer, base rate, ratio, seed): validation every ``eval_every``
    steps, early stopping after ``patience`` evaluations without a lower validation loss (best weights restored)."""
    return TrainConfig.from_profile(cfg, optimizer=cell.optimizer, eta_ov=cell.eta_ov, ratio=cell.ratio, seed=cell.seed,
                                    steps=run_steps(cfg, cell.optimizer, cell.eta_ov), log_every=int(cfg["eval_every"]),
                                    progress=False, log_subsample=0, restore_best=True)


def measure(model: nn.Module, data: Batch, n_eraser: int, fracs: Sequence[float] = MAP_FRACS) -> dict[str, float]:
    """Accuracy, macro-F1, loss, the attention metrics of :func:`.protocol.phase_metrics` (mean
    relevant mass, AC/ACMC at 0.5, any other registered phase metric; instances with relevant
    tokens) and ERASER sufficiency (AOPC over ``fracs``, lower is better) on ``n_eraser`` evenly
    spaced instances of ``data`` (none when 0)."""
    attn, probs = predict(model, data)
    out = prediction_metrics(probs, data.y)
    has = data.relevant.any(1)
    if bool(has.any()):
        s = summarize(attn[has], probs[has], data.relevant[has], data.y[has], [protocol.MAP_TAU])
        out.update({k: s[k] for k in protocol.phase_metrics() if k in s and k not in out})
    if n_eraser > 0:
        idx = spread(len(data), n_eraser).to(attn.device)
        out["sufficiency"] = float(fa.faithfulness(model, data.index(idx), attn[idx], fracs)["sufficiency"])
    return out


def chance(val: Batch) -> float:
    """The majority-class rate of a split: the accuracy of always guessing its commonest class."""
    return float(torch.bincount(val.y.cpu()).max()) / len(val.y)


@dataclass
class MapResult:
    """A trained protocol map: ``table`` (one row per run, with ``trained``), ``selected`` (validation-chosen
    base rate per optimizer, from the map's own seeds), ``phase`` (:func:`.protocol.phase_table`, eta_QK raised
    at fixed eta_OV), ``chance`` (validation majority rate) and ``chance_loss`` (the untrained models'
    validation loss, nats); the rate plane ``plane`` (:func:`.rate_plane.plane_phase`, both routes, at matched
    validation loss where the curves allow) and its ``ceiling`` (:func:`.rate_plane.qk_ceiling`); the paper's
    protocol read first: ``protocol`` (:func:`.rate_plane.protocol_cells`), ``verdicts`` (per claim, the word
    over the protocol cells) and ``control`` (the same over the eta_OV-lowered control); the trained ``models``
    and every run's ``histories`` keyed by cell, the validation split ``val`` they were stopped on, the
    ``necessity`` table and ``necessary`` (per (optimizer, base rate) at ratio 1)."""

    table: pd.DataFrame
    selected: dict[str, float]
    phase: pd.DataFrame
    chance: float
    chance_loss: float = math.inf
    plane: pd.DataFrame = field(default_factory=pd.DataFrame)
    ceiling: dict[str, float] = field(default_factory=dict)
    protocol: pd.DataFrame = field(default_factory=pd.DataFrame)
    verdicts: dict[str, claims.Verdict] = field(default_factory=dict)
    control: dict[str, claims.Verdict] = field(default_factory=dict)
    models: dict[protocol.Cell, nn.Module] = field(repr=False, default_factory=dict)
    histories: dict[protocol.Cell, Any] = field(repr=False, default_factory=dict)
    val: Batch | None = field(repr=False, default=None)
    necessity: pd.DataFrame | None = None
    necessary: dict[tuple[str, float], bool | None] = field(default_factory=dict)
    intervention: pd.DataFrame | None = None


def analyse(table: pd.DataFrame, chance_rate: float, models: Mapping[protocol.Cell, nn.Module] | None = None,
            test: Batch | None = None, histories: Mapping[protocol.Cell, Any] | None = None,
            selected: Mapping[str, float] | None = None) -> MapResult:
    """The protocol's analysis of a run table (:func:`.protocol.train_grid`): trained-run flag, validation-chosen
    base rates (``selected`` when given: the extra protocol seeds choose nothing), phase table, the necessity
    check on ``test`` (:func:`necessity_table`, when ``models`` and ``test`` are given), the rate plane (both
    routes, at matched validation loss where the curves allow), the stable ceiling and the paper's protocol read
    first: its cells and control (:func:`.rate_plane.protocol_cells`) and each claim's word over them by the one
    rule (:func:`.rate_plane.protocol_verdicts`)."""
    table = table.assign(trained=protocol.trained(table, chance_rate), eta_qk=(table["eta_ov"] * table["ratio"]
                                                                               ).map(rate_plane.rate))
    selected = dict(selected) if selected is not None else protocol.select_base_rates(table)
    phase = protocol.phase_table(table, chance=chance_rate)
    result = MapResult(table, selected, phase, chance_rate, models=dict(models or {}),
                       histories=dict(histories or {}))
    if models and test is not None:
        result.necessity = necessity_table(result, test)
        ref = result.necessity[result.necessity["ratio"] == 1.0]
        result.necessary = {(o, rate_plane.rate(e)): (None if n is None or pd.isna(n) else bool(n))
                            for o, e, n in zip(ref["optimizer"], ref["eta_ov"], ref["necessary"])}
        result.intervention = intervention_frame(result, test)
    result.plane = rate_plane.plane_phase(table, chance=chance_rate)
    if result.histories:
        every = trajectory.curves(result.histories)
        result.chance_loss = float(every[every["step"] == 0]["val_loss"].median())
        cur = trained_curves(result)
        if len(cur):
            result.plane = rate_plane.add_matched(result.plane, trajectory.at_deepest_common_loss(
                cur, rate_plane.pairs_of(result.plane)))
    result.ceiling = rate_plane.qk_ceiling(table)
    result.protocol = rate_plane.protocol_cells(result.plane, selected, result.ceiling, result.chance_loss)
    result.verdicts = rate_plane.protocol_verdicts(result.protocol, "qk_up")
    result.control = rate_plane.protocol_verdicts(result.protocol, "ov_down")
    return result


def protocol_grid(selected: Mapping[str, float], cfg: Mapping[str, Any], seeds: Sequence[int]) -> list[protocol.Cell]:
    """The cells the paper's protocol and its control read, at ``seeds``: per optimizer its tuned base rate
    (``selected``) at every ratio, and every base rate of the grid equal to the tuned one divided by a ratio
    at that ratio (eta_OV lowered at the tuned eta_QK)."""
    grid = base_rates(cfg)
    cells = []
    for opt, tuned in selected.items():
        for r in cfg["ratios"]:
            etas = [tuned] + ([e for e in grid[opt] if rate_plane.rate(e * r) == rate_plane.rate(tuned)]
                              if r > 1 else [])
            cells += [protocol.Cell(opt, float(e), float(r), int(s)) for e in etas for s in seeds]
    return cells


def _train(cells, ds, val, cfg, device, desc, models, histories) -> pd.DataFrame:
    """:func:`.protocol.train_grid` of ``cells`` with the map's model, splits, config and measures."""
    watch = monitor_split(val, cfg.get("monitor_rows"))
    # partials of module-level functions, not lambdas: processes > 1 pickles them to its workers
    return protocol.train_grid(
        cells, functools.partial(_cell_model, ds, cfg, device), ds.train.to(device), val.to(device),
        ds.test.to(device), functools.partial(cell_config, cfg),
        # validation only chooses (rate, stopping step): no ERASER scores there
        (functools.partial(measure, n_eraser=0), functools.partial(measure, n_eraser=cfg["n_eraser"])),
        desc=desc, models_out=models, threads=cfg.get("threads"), max_stack=int(cfg.get("max_stack", 64)),
        processes=int(cfg.get("processes", 1)) if device.type == "cpu" else 1, histories_out=histories,
        taus=(protocol.MAP_TAU,), monitor=None if watch is None else watch.to(device))


def run_map(ds: TextDataset, val: Batch, cfg: Mapping[str, Any], device: torch.device | None = None,
            desc: str | None = None) -> MapResult:
    """Train the map of ``cfg`` (optimizers × their base rates × ratios × ``map_seeds``) on ``ds.train`` with
    early stopping on ``val`` (on its :func:`monitor_split` rows when ``cfg["monitor_rows"]`` is set), choose
    each optimizer's base rate on validation, train the cells of the paper's protocol and its control
    (:func:`protocol_grid`) again at ``protocol_seeds`` (none by default), measure every run on the whole of
    ``val`` and on ``ds.test``, and :func:`analyse` it."""
    device = device or torch.device("cpu")
    models: dict[protocol.Cell, nn.Module] = {}
    histories: dict[protocol.Cell, Any] = {}
    cells = protocol.grid(cfg["optimizers"], base_rates(cfg), cfg["ratios"], cfg["map_seeds"])
    table = _train(cells, ds, val, cfg, device, desc or ds.name, models, histories)
    selected = protocol.select_base_rates(table.assign(trained=protocol.trained(table, chance(val))))
    extra = [int(s) for s in cfg.get("protocol_seeds") or [] if int(s) not in {int(x) for x in cfg["map_seeds"]}]
    if extra:
        more = _train(protocol_grid(selected, cfg, extra), ds, val, cfg, device,
                      f"{desc or ds.name}: protocol cells, {len(extra)} more seeds", models, histories)
        table = pd.concat([table, more], ignore_index=True)
    table = table.assign(budget=[run_steps(cfg, o, e) for o, e in zip(table["optimizer"], table["eta_ov"])])
    result = analyse(table, chance(val), models, ds.test.to(device), histories, selected=selected)
    result.val = val
    return result


def monitor_split(val: Batch, rows: int | None) -> Batch | None:
    """The validation rows a map's training logs and early stopping evaluate: ``rows`` evenly spaced ones
    (:func:`~qkov_lib.data.batch.spread`), or None (all of ``val``) when ``rows`` is None or not fewer."""
    if rows is None:
        return None
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"monitor_rows must be a positive integer or None, got {rows!r}")
    return None if rows >= len(val) else val.index(spread(len(val), rows).to(val.tokens.device))


def monitor_text(val: Batch, rows: int | None) -> str:
    """What the chapter says its map stops early on: "512 evenly spaced of the 1,453" or "all 1,453"."""
    watch = monitor_split(val, rows)
    return f"all {len(val):,}" if watch is None else f"{len(watch):,} evenly spaced of the {len(val):,}"


def _cell_model(ds: TextDataset, cfg: Mapping[str, Any], device: torch.device, seed: int) -> nn.Module:
    return make_model(ds, cfg, seed).to(device)


def necessity_table(result: MapResult, test: Batch) -> pd.DataFrame:
    """The necessity check (:func:`qkov_lib.head_model.necessity`) of the trained models at ratio 1 at every
    base rate (what R3 needs in every column of the plane) and at the highest trained ratio at each
    optimizer's tuned base rate: per (optimizer, base rate, ratio) the seed means of the test accuracy with the
    model's, uniform (same keys) and oracle (all mass on the relevant tokens) attention, the chance rate, the
    seeds and whether the head is necessary (:func:`qkov_lib.claims.head_necessary` on the seed means).
    Fractions in [0, 1]."""
    rows = []
    t = result.table
    for (opt, eta), g in t[t["trained"]].groupby(["optimizer", "eta_ov"], sort=False):
        ratios = sorted(set(g["ratio"]))
        top = [ratios[-1]] if result.selected.get(opt) == eta and ratios else []
        for r in dict.fromkeys([1.0, *top]):
            cells = [protocol.Cell(opt, eta, r, int(s)) for s in g[g["ratio"] == r]["seed"]]
            got = [head_model.necessity(result.models[c], test) for c in cells if c in result.models]
            if not got:
                continue
            mean = {k: float(np.mean([x[k] for x in got])) for k in ("model", "uniform", "oracle", "chance")}
            rows.append({"optimizer": opt, "eta_ov": eta, "ratio": r, "seeds": len(got), **mean,
                         "necessary": claims.head_necessary(mean["model"], mean["uniform"], mean["chance"])})
    return pd.DataFrame(rows, columns=["optimizer", "eta_ov", "ratio", "seeds", "model", "uniform", "oracle",
                                       "chance", "necessary"])


def intervention_frame(result: MapResult, test: Batch) -> pd.DataFrame:
    """The graded intervention (:func:`qkov_lib.head_model.intervention_frame`) of the trained models at each
    optimizer's tuned base rate, at ratio 1 and the highest trained ratio: one row per (optimizer, ratio, seed,
    alpha) with the test accuracy when the head's row is ``(1 - alpha) model + alpha oracle`` (fractions)."""
    models = {}
    for opt in result.selected:
        runs = runs_at(result, opt)
        top = max((r.ratio for r in runs), default=1.0)
        models.update({(opt, r.ratio, r.seed): r.model for r in runs if r.ratio in (1.0, top)})
    if not models:
        return pd.DataFrame(columns=["optimizer", "ratio", "seed", "alpha", "accuracy", "n"])
    return head_model.intervention_frame(models, test, names=("optimizer", "ratio", "seed"))


def intervention_table(result: MapResult) -> pd.DataFrame:
    """:func:`intervention_frame` as a table to read: seed-mean test accuracy (percent) per (optimizer, ratio)
    row and alpha column (0 = the model's own attention, 1 = the oracle's)."""
    f = result.intervention
    if f is None or not len(f):
        return pd.DataFrame()
    t = (100 * f.groupby(["optimizer", "ratio", "alpha"])["accuracy"].mean()).unstack("alpha").round(1)
    t.columns = [f"alpha {a:g}" for a in t.columns]
    return t


def trained_curves(result: MapResult) -> pd.DataFrame:
    """:func:`.trajectory.curves` of the map's runs that trained (empty without histories or trained runs)."""
    ok = result.table[result.table["trained"]]
    keep = {protocol.Cell(o, e, r, s) for o, e, r, s in zip(ok["optimizer"], ok["eta_ov"], ok["ratio"], ok["seed"])}
    hists = {c: h for c, h in result.histories.items() if c in keep}
    if not hists:
        return pd.DataFrame(columns=["optimizer", "eta_ov", "ratio", "seed", "eta_qk", "step", *trajectory.CURVE_METRICS])
    return trajectory.curves(hists)


def curve_columns(result: MapResult) -> list[tuple[str, float]]:
    """The map columns whose attention over training a page shows: per optimizer its tuned base rate and, if
    another one, the base rate at which most runs above ratio 1 trained (where the higher ratios can be
    compared at all); only columns with trained runs at ratio 1 and above."""
    t = result.table[result.table["trained"]]
    cols = []
    for opt, tuned in result.selected.items():
        up = t[(t["optimizer"] == opt) & (t["ratio"] > 1.0)]
        base = set(t[(t["optimizer"] == opt) & (t["ratio"] == 1.0)]["eta_ov"])
        counts = up[up["eta_ov"].isin(base)].groupby("eta_ov").size()
        best = float(counts.sort_values(ascending=False, kind="stable").index[0]) if len(counts) else tuned
        cols += [(opt, e) for e in dict.fromkeys([tuned, best]) if e in base]
    return cols


@draws
def plot_attention_curves(result: MapResult, metric: str = "val_AC@0.5"):
    """:func:`.trajectory.plot_attention_vs_loss` of the trained runs in the columns of :func:`curve_columns`;
    None when no column has any."""
    cur = trained_curves(result)
    cols = [c for c in curve_columns(result) if len(cur) and ((cur["optimizer"] == c[0]) & (cur["eta_ov"] == c[1])).any()]
    return trajectory.plot_attention_vs_loss(cur, cols, metric) if cols else None


def _pm_change(mean: float, hw: float, n: float, digits: int = 3) -> str:
    """A paired change as a table cell: ``+0.051 ± 0.020 (4)``; the seed pairs in brackets."""
    text = rate_plane.fmt_change(mean, hw, digits)
    return text if text == "n/a" else f"{text} ({int(n)})"


def matched_loss_table(result: MapResult) -> pd.DataFrame:
    """Ratios compared at matched validation loss around each optimizer's tuned base rate ``eta``, along
    both routes of the plane: ↑ each ratio r at ``eta_OV = eta`` against ratio 1 there, and ← each cell
    ``(eta / r, eta)`` (``eta_QK`` fixed at ``eta``) against the ratio-1 run at ``eta``. Per pair and level
    (:func:`.trajectory.loss_levels` of the pair's runs, nats): the change of AC@0.5 and of attention on the
    relevant tokens on the validation split, paired by seed over the trained runs that reached the level
    (:func:`.trajectory.matched`); then the change between the early-stopped endpoints on the test split
    (the plane's). Cells read ``mean ± 95% half-width (seed pairs)``; a level not
    :data:`qkov_lib.claims.SAME_LOSS` below the untrained models' loss is marked not comparable."""
    cur = trained_curves(result)
    plane = result.plane
    rows = []

    def add(route: str, opt: str, eta_ov: float, ratio: float, at: str, d_ac, d_attn) -> None:
        rows.append({"optimizer": opt, "route": rate_plane.ROUTE_MARK[route], "eta_ov": eta_ov,
                     "eta_qk": rate_plane.rate(eta_ov * ratio), "ratio": ratio, "at": at,
                     "Δ AC@0.5": _pm_change(*d_ac), "Δ attention": _pm_change(*d_attn)})

    for opt, eta in result.selected.items():
        have = cur[cur["optimizer"] == opt] if len(cur) else cur
        cells = {(rate_plane.rate(e), float(r)) for e, r in zip(have["eta_ov"], have["ratio"])} if len(have) else set()
        ups = [((opt, eta, r), (opt, eta, 1.0)) for e, r in sorted(cells) if e == rate_plane.rate(eta) and r > 1.0]
        downs = [((opt, e, r), (opt, eta, 1.0)) for e, r in sorted(cells)
                 if r > 1.0 and rate_plane.rate(e * r) == rate_plane.rate(eta)]
        for route, pairs in (("qk_up", ups), ("ov_down", downs)):
            got = trajectory.matched(have, pairs=pairs) if pairs else pd.DataFrame()
            for _, r in got.iterrows():
                learned = r["level"] <= result.chance_loss - claims.SAME_LOSS  # else: a side never learned
                add(route, opt, r["eta_ov"], r["ratio"], f"val loss {r['level']:.3f}"
                    + ("" if learned else " (not comparable: not below chance)"),
                    (r["d_val_AC@0.5"], r["d_val_AC@0.5_ci"], r["d_val_AC@0.5_n"]),
                    (r["d_val_attn_relevant"], r["d_val_attn_relevant_ci"], r["d_val_attn_relevant_n"]))
            ph = plane[(plane["optimizer"] == opt) & (plane["route"] == route) & (plane["ratio"] > 1.0)
                       & (plane["ref_eta_ov"] == rate_plane.rate(eta))] if len(plane) else plane
            for _, r in ph.iterrows():
                add(route, opt, r["eta_ov"], r["ratio"], "early-stopped endpoint (test)",
                    (r["d_AC@0.5"], r["d_AC@0.5_ci"], r["d_AC@0.5_n"]),
                    (r["d_attn_relevant"], r["d_attn_relevant_ci"], r["d_attn_relevant_n"]))
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).sort_values(["optimizer", "route", "ratio"], kind="stable").set_index(
        ["optimizer", "route", "eta_ov", "eta_qk", "ratio", "at"])


def annotation_use(result: MapResult) -> dict[str, tuple[bool, float, float]]:
    """Per optimizer, at ratio 1 of its tuned base rate: whether the oracle row (all mass on the annotated
    tokens) predicts at least as well as the model's own (seed means of the graded intervention's ends),
    with the two test accuracies (fractions). Where it does not, AC@0.5 and attention on the annotated tokens
    measure agreement with the annotations, not what the model uses. Empty without tuned models."""
    f = result.intervention
    if f is None or not len(f):
        return {}
    ends = head_model.endpoint_means(f[f["ratio"] == 1.0].drop(columns="ratio"), over="seed")
    return {r.optimizer: (not bool(r.oracle_below_model), float(r.model), float(r.oracle)) for r in ends.itertuples()}


AGREEMENT_NOTE = ("oracle attention predicts worse than the model's own, so AC@0.5 and attention on the annotated "
                  "tokens measure agreement with the annotations, not what the model uses")


def annotation_text(result: MapResult) -> str:
    """:func:`annotation_use` as a sentence: per optimizer the model's and the oracle's accuracy at ratio 1
    and, where the oracle is below, :data:`AGREEMENT_NOTE`."""
    use = annotation_use(result)
    if not use:
        return "not measured (no tuned model)"
    return "; ".join(f"with {o}, model {100 * m:.1f}% vs oracle {100 * a:.1f}%: "
                     + ("the annotated tokens are attention the model can use" if ok else AGREEMENT_NOTE)
                     for o, (ok, m, a) in use.items())


NECESSITY_RULE = (f"the head's attention is necessary when uniform attention over the same keys loses at least "
                  f"{claims.threshold_text('NECESSITY_SHARE')} of the test accuracy above chance "
                  "(model − uniform ≥ share × (model − chance), seed means of the tuned models at ratio 1)")


def necessity_facts(result: MapResult) -> dict[str, str]:
    """Numbers a chapter glues from :func:`necessity_table` (percent): per optimizer ``nec_<opt>_<what>_<at>``
    for what in model / uniform / oracle / chance and at = ``lo`` (ratio 1) / ``hi`` (the highest trained
    ratio, ``nec_<opt>_r_hi``), ``nec_<opt>_necessary`` (yes / no / undecided at ratio 1) and ``nec_rule``;
    "n/a" where a model is missing."""
    f: dict[str, str] = {"nec_rule": NECESSITY_RULE}
    t = result.necessity if result.necessity is not None else pd.DataFrame(columns=["optimizer"])
    for opt in OPTIMIZERS:
        g = t[(t["optimizer"] == opt) & (t["eta_ov"] == result.selected.get(opt))].sort_values("ratio") if len(t) else t
        for at, row in (("lo", g.iloc[0] if len(g) else None), ("hi", g.iloc[-1] if len(g) else None)):
            for what in ("model", "uniform", "oracle", "chance"):
                f[f"nec_{opt}_{what}_{at}"] = "n/a" if row is None else f"{100 * float(row[what]):.1f}%"
        f[f"nec_{opt}_r_hi"] = f"{float(g['ratio'].iloc[-1]):g}" if len(g) else "n/a"
        nec = g["necessary"].iloc[0] if len(g) else None
        f[f"nec_{opt}_necessary"] = {True: "yes", False: "no"}.get(nec, "undecided")
    return f


def attention_facts(result: MapResult) -> dict[str, str]:
    """Per optimizer at its tuned base rate, ratio 1 (``lo``) and the highest trained ratio (``hi``): test
    accuracy, AC@0.5 and mean attention on the relevant tokens, seed mean ± 95% half-width
    (``att_<opt>_<metric>_<at>``, metric in accuracy / AC / mass), ``att_<opt>_r_hi`` and ``att_<opt>_seeds``."""
    f: dict[str, str] = {}
    for opt in OPTIMIZERS:
        runs = tuned_runs(result, opt)
        ratios = sorted(set(runs["ratio"])) if len(runs) else []
        # with no trained run above ratio 1 there is no second number to quote beside ratio 1's
        f[f"att_{opt}_r_hi"] = (f"{ratios[-1]:g}" if ratios and ratios[-1] > 1.0 else
                                "n/a (no run above ratio 1 trained)")
        f[f"att_{opt}_seeds"] = str(int(runs[runs["ratio"] == 1.0]["seed"].nunique())) if len(runs) else "0"
        for at, r in (("lo", 1.0), ("hi", ratios[-1] if ratios and ratios[-1] > 1.0 else None)):
            sub = runs[runs["ratio"] == r] if r is not None else runs.iloc[0:0]
            for key, col in (("accuracy", "accuracy"), ("AC", "AC@0.5"), ("mass", "attn_relevant")):
                v = list(sub[col]) if col in sub else []
                f[f"att_{opt}_{key}_{at}"] = _pm(v) if key != "mass" else _pm(v, pct=False, digits=3)
    return f


def data_facts(ds: TextDataset) -> dict[str, str]:
    """Sizes a chapter glues: training and test instances (``data_n_train``, ``data_n_test``) and,
    for SQuAD's word task, the questions its filter dropped per split (``data_dropped_*``)."""
    f = {"data_n_train": f"{len(ds.train):,}", "data_n_test": f"{len(ds.test):,}"}
    for split in ("train", "test"):
        keys = [k for k in ds.report if k.startswith(f"{split}_word_task_") and not k.endswith("_kept")]
        f[f"data_dropped_{split}"] = f"{sum(int(ds.report[k]) for k in keys):,}"
    return f


@draws
def plot_dtap(evals: Mapping[str, Sequence[attention_analysis.RealRun]], result: MapResult):
    """DTAP heatmaps (:func:`qkov_lib.plotting.dtap_grid`) of the tuned models, averaged over seeds: one row
    per optimizer (labelled with its tuned base rate), one column per ratio; None without any histogram."""
    from qkov_lib.plotting import dtap_grid

    hists, ratios = {}, set()
    for opt, runs in evals.items():
        label = f"{opt} (eta_ov {result.selected[opt]:g})"
        for (_, r), h in attention_analysis.mean_dtap(runs).items():
            hists[(label, r)] = h
            ratios.add(r)
    if not hists:
        return None
    return dtap_grid(hists, rows=list(dict.fromkeys(k[0] for k in hists)), cols=sorted(ratios), row_label="")


def correctness_table(evals: Mapping[str, Sequence[attention_analysis.RealRun]]) -> pd.DataFrame:
    """Mean attention on the relevant tokens among right and wrong test predictions of the tuned
    models, per optimizer and ratio (mean over seeds), with the mean count of instances."""
    frames = [attention_analysis.mass_by_correctness(runs).assign(optimizer=opt) for opt, runs in evals.items() if runs]
    if not frames:
        return pd.DataFrame()
    f = pd.concat(frames, ignore_index=True)
    return f.groupby(["optimizer", "ratio", "prediction"])[["attn_relevant", "n"]].mean().unstack("prediction").round(3)


def squad_roles(model: nn.Module, ds: TextDataset) -> dict[str, float]:
    """Mean attention mass of ``model`` on the SQuAD test split by token role
    (:func:`qkov_lib.data.squad.squad_roles`: answer, context words in the question, question, rest)."""
    from qkov_lib.data import squad
    from qkov_lib.metrics import mass_by_role

    attn = test_attention(model, ds.test)
    return mass_by_role(attn, squad.squad_roles(ds), ds.test.key_mask)


def titled(frame: pd.DataFrame, title: str):
    """``frame`` for display with ``title`` as its caption (a pandas Styler; the frame is unchanged)."""
    return frame.style.set_caption(title)


def map_record(result: MapResult) -> dict[str, Any]:
    """The map's part of a chapter's results file (JSON-ready): run, phase, chosen-rate and necessity tables,
    the plane, the protocol cells and the words over them (``protocol_verdicts``, ``control_verdicts``)."""
    nec = result.necessity if result.necessity is not None else pd.DataFrame()
    return {"map": result.table.to_dict("records"), "map_phase": result.phase.to_dict("records"),
            "map_selected": dict(result.selected), "necessity": nec.to_dict("records"),
            "plane": result.plane.to_dict("records"), "plane_ceiling": dict(result.ceiling),
            "chance_loss": result.chance_loss, "protocol_cells": result.protocol.to_dict("records"),
            "protocol_verdicts": {cid: asdict(v) for cid, v in result.verdicts.items()},
            "control_verdicts": {cid: asdict(v) for cid, v in result.control.items()},
            "curves": trajectory.curves(result.histories).to_dict("records") if result.histories else [],
            "intervention": [] if result.intervention is None else result.intervention.to_dict("records")}


def tuned_evaluations(result: MapResult, ds: TextDataset, cfg: Mapping[str, Any]
                      ) -> dict[str, list[attention_analysis.RealRun]]:
    """Every trained model at each optimizer's tuned base rate evaluated on the test split with its
    own, uniform and random attention (:func:`.attention_analysis.evaluate_run`), keyed by optimizer:
    what the DTAP heatmaps, tau sweep, focus and baseline tables and role analyses are computed from."""
    ecfg = {"taus": attention_analysis.TAU_SWEEP, "fracs": list(MAP_FRACS), "n_eraser": cfg["n_eraser"],
            "plausibility": bool(cfg.get("plausibility", False))}
    return {opt: [attention_analysis.evaluate_run(ds, r.model, None, r.ratio, r.seed, ecfg)
                  for r in sorted(runs_at(result, opt), key=lambda r: (r.ratio, r.seed))]
            for opt in result.selected}


def map_config(name: str, profile: str | None, **overrides: Any) -> dict[str, Any]:
    """The map settings of dataset ``name``: its ``profile`` of :data:`MAPS` with the chapter's
    ``overrides`` (None = profile value), every value checked (:func:`qkov_lib.profiles.resolve`)
    so that a chapter's settings cell fails before anything trains."""
    from qkov_lib.profiles import resolve

    check_dataset(name)
    return resolve(MAPS[name].profiles, profile, **overrides)


def run_chapter_map(name: str, cfg: Mapping[str, Any], data_dir=None, device: torch.device | None = None,
                    ) -> tuple[MapResult, TextDataset, dict[str, str]]:
    """Load the splits and train and analyse the map of a :func:`map_config`: ``(result, dataset, facts)``,
    ``facts`` being :func:`map_facts` plus the validation size and the trained-run margin."""
    check_dataset(name)
    ds, val = load_splits(name, cfg, data_dir)
    result = run_map(ds, val, cfg, device, desc=f"{name} map")
    if cfg.get("readout") in COPY_READOUTS and "R3" in result.verdicts:
        right, wrong, n = attention_by_correctness(result, ds.test)
        result.verdicts["R3"] = not_testable_r3(result.verdicts["R3"], right, wrong, n)
    facts = map_facts(result) | {"map_n_val": f"{len(val):,}", "map_eval_every": str(cfg["eval_every"]),
                                 "map_monitor": monitor_text(val, cfg.get("monitor_rows")),
                                 "trained_margin": claims.threshold_text("TRAINED_MARGIN")}
    return result, ds, facts


#: Readouts that copy the attended token (:class:`qkov_lib.head_model.HeadModel` ``readout="words"``: the logit
#: of a word is its embedding against the head output, so the word the head attends is the word predicted). In
#: such a casting attention on the answer and a right answer are one event, and R3 (sharpness decoupled from
#: accuracy) cannot be read from it.
COPY_READOUTS = ("words",)


def attention_by_correctness(result: MapResult, test: Batch) -> tuple[float, float, int]:
    """Mean attention on the relevant tokens among the right and among the wrong test predictions of the trained
    models at each optimizer's tuned base rate and ratio 1 (per model,
    :func:`.attention_analysis.mass_by_correctness`, then averaged over models): ``(right, wrong, models)``,
    fractions in [0, 1] (NaN where no model has such predictions)."""
    runs = []
    for opt, eta in result.selected.items():
        for c, model in result.models.items():
            if (c.optimizer, c.eta_ov, c.ratio) != (opt, eta, 1.0):
                continue
            data = test.to(next(model.parameters()).device)
            attn, probs = predict(model, data)
            mass = relevant_mass(attn, data.relevant).double().masked_fill(~data.relevant.any(1), math.nan)
            runs.append(attention_analysis.RealRun(1.0, c.seed, None, [], None, mass.cpu().numpy(),
                                                   (probs.argmax(-1) == data.y).cpu().numpy()))
    f = attention_analysis.mass_by_correctness(runs)
    side = lambda which: float(f[f["prediction"] == which]["attn_relevant"].mean()) if len(f) else math.nan  # noqa: E731
    return side("correct"), side("wrong"), len(runs)


def not_testable_r3(read: claims.Verdict, right: float, wrong: float, models: int) -> claims.Verdict:
    """R3 in a copy casting (:data:`COPY_READOUTS`): ``not tested``, with the reason in numbers (attention on the
    relevant tokens when the prediction is right and when it is wrong); the protocol's cells stay in the effect,
    shown and not decided."""
    measured = (f"attention on the answer is {right:.2f} when the prediction is right and {wrong:.2f} when it is "
                f"wrong (tuned rates, ratio 1, {models} models)" if models and math.isfinite(right + wrong) else
                "no trained model at a tuned rate measures how far (none trained at ratio 1)")
    return claims.Verdict(
        "not tested", read.rule,
        f"not testable in this casting: the model predicts the word it attends (a copy readout), so sharper "
        f"attention cannot come apart from better prediction; {measured}; the cells of the paper's protocol are "
        f"shown, not decided", "", read.effect)


def chapter_map(name: str, profile: str | None, data_dir=None, device: torch.device | None = None,
                **overrides: Any) -> tuple[MapResult, TextDataset, dict[str, Any], dict[str, str]]:
    """:func:`map_config` then :func:`run_chapter_map`: ``(result, dataset, config, facts)``."""
    cfg = map_config(name, profile, **overrides)
    result, ds, facts = run_chapter_map(name, cfg, data_dir, device)
    return result, ds, cfg, facts


def anchor_gap(result: MapResult, optimizer: str, accuracy: float, f1: float, within: float = 0.02) -> dict[str, str]:
    """How far the tuned ``optimizer`` runs at ratio 1 are from a published model's test ``accuracy`` and
    macro-``f1`` (fractions): the two published numbers in percent (``anchor_acc``, ``anchor_f1``), the two
    gaps in points and whether both lie within ``within``."""
    ref = tuned_runs(result, optimizer, ratio=1.0)
    published = {"anchor_acc": f"{100 * accuracy:.1f}%", "anchor_f1": f"{100 * f1:.1f}%"}
    if not len(ref):
        return {**published, "anchor_gap_accuracy": "n/a", "anchor_gap_macro_f1": "n/a",
                "anchor_within": "not tested (no run trained)"}
    ga, gf = float(ref["accuracy"].mean()) - accuracy, float(ref["macro_f1"].mean()) - f1
    ok = abs(ga) <= within and abs(gf) <= within
    return {**published, "anchor_gap_accuracy": f"{100 * ga:+.1f} points", "anchor_gap_macro_f1": f"{100 * gf:+.1f} points",
            "anchor_within": ("within" if ok else "not within") + f" {100 * within:g} points on both"}


# --- what the chapter quotes ------------------------------------------------------------------
def _pm(values: Sequence[float], pct: bool = True, digits: int = 1) -> str:
    """Seed mean ± 95% half-width of the finite ``values`` (:func:`.attention_analysis.pm`: fractions
    in percent by default); "n/a" when none."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    return attention_analysis.pm(float(v.mean()), seed_half_width(v), pct=pct, digits=digits) if len(v) else "n/a"


def selection_table(result: MapResult) -> pd.DataFrame:
    """Per optimizer and base rate at ratio 1: trained runs, their mean validation loss / accuracy / macro-F1
    and whether the rate was chosen."""
    t = result.table[result.table["ratio"] == 1.0]
    rows = []
    for (opt, eta), g in t.groupby(["optimizer", "eta_ov"], sort=False):
        ok = g[g["trained"]]
        rows.append({"optimizer": opt, "eta_ov": eta, "trained": f"{len(ok)}/{len(g)}",
                     **{f"val {m}": float(ok[f"val_{m}"].mean()) if len(ok) else math.nan
                        for m in ("loss", "accuracy", "macro_f1")},
                     "chosen": result.selected.get(opt) == eta})
    return pd.DataFrame(rows)


def failure_frame(result: MapResult) -> pd.DataFrame:
    """Runs that did not train as ``failed/runs`` per (optimizer, base rate) row and ratio column."""
    f = protocol.failures(result.table)
    f["cell"] = f["failed"].astype(str) + "/" + f["runs"].astype(str)
    return f.pivot(index=["optimizer", "eta_ov"], columns="ratio", values="cell")


def tuned_runs(result: MapResult, optimizer: str, ratio: float | None = None) -> pd.DataFrame:
    """The trained runs at the validation-chosen base rate of ``optimizer`` (at ``ratio`` if given; may be empty)."""
    if optimizer not in result.selected:
        return result.table.iloc[0:0]
    t = result.table
    keep = (t["optimizer"] == optimizer) & (t["eta_ov"] == result.selected[optimizer]) & t["trained"]
    if ratio is not None:
        keep &= t["ratio"] == float(ratio)
    return t[keep]


def map_facts(result: MapResult) -> dict[str, str]:
    """Sentences and numbers a chapter glues (prefix ``map_``): run and failure counts, per optimizer the chosen
    rate and its ratio-1 validation and test numbers, per claim the verdict at the tuned rates, reason,
    region and rule."""
    t = result.table
    f: dict[str, str] = {"map_runs": str(len(t)), "map_failed": str(int((~t["trained"]).sum())),
                         "map_diverged": str(int(t["diverged"].sum())), "map_chance": f"{100 * result.chance:.1f}%"}
    for opt in dict.fromkeys(t["optimizer"]):
        ref = tuned_runs(result, opt, ratio=1.0)
        f[f"map_{opt}_eta"] = f"{result.selected[opt]:g}" if opt in result.selected else "none (no run trained)"
        for split, pre in (("val", "val_"), ("test", "")):
            for m in ("accuracy", "macro_f1"):
                f[f"map_{opt}_{split}_{m}"] = _pm(list(ref[pre + m]))
    for cid, v in result.verdicts.items():
        f[f"map_verdict_{cid}"], f[f"map_reason_{cid}"] = v.label, v.reason
        f[f"map_effect_{cid}"] = v.effect or "-"
        f[f"map_estimand_{cid}"] = claims.ESTIMANDS[cid].text()
        f[f"map_control_{cid}"] = result.control[cid].label if cid in result.control else "not tested"
    for opt in dict.fromkeys(t["optimizer"]):
        c = result.ceiling.get(opt, math.nan)
        f[f"map_{opt}_ceiling"] = f"{c:g}" if math.isfinite(c) else "none (no base rate trained stably at ratio 1)"
    seeds = result.protocol.groupby("claim")["n"].max() if len(result.protocol) else pd.Series(dtype=int)
    f["map_protocol_seeds"] = str(int(seeds.get("R2", 0)))
    f["map_chance_loss"] = f"{result.chance_loss:.3f}" if math.isfinite(result.chance_loss) else "n/a"
    f["map_annotations"] = annotation_text(result)
    f["map_rule"] = claims.ONE_RULE
    return f


def largest_gain(result: MapResult, metric: str = "AC@0.5", digits: int | None = 1) -> pd.DataFrame:
    """The map's cell where ``metric`` (a fraction) rises most against ratio 1 (the first, on a
    tie), as one row: its optimizer, base rate and ratio, the changes of ``metric`` and of
    accuracy (percentage points, paired by seed), the mean test accuracy of that column's
    ratio-1 runs and of the ratio-1 runs at the optimizer's tuned base rate (percent; NaN if it
    has none), the points and percents rounded to ``digits`` (None: unrounded). No row when no
    cell has a ``metric`` change."""
    p, col = result.phase, f"d_{metric}"
    cols = ["optimizer", "eta_ov", "ratio", f"Δ {metric} (points)", "Δ accuracy (points)",
            "ratio-1 accuracy (%)", "tuned eta_ov", "ratio-1 accuracy at tuned eta_ov (%)"]
    if col not in p or not p[col].notna().any():
        return pd.DataFrame(columns=cols)
    best = p.loc[p[col].idxmax()]
    opt, tuned = best["optimizer"], result.selected.get(best["optimizer"], math.nan)

    def ratio1_accuracy(eta: float) -> float:
        acc = p[(p["optimizer"] == opt) & (p["eta_ov"] == eta) & (p["ratio"] == 1.0)]["accuracy"]
        return 100 * float(acc.mean()) if len(acc) else math.nan

    row = [opt, best["eta_ov"], best["ratio"], 100 * best[col], 100 * best["d_accuracy"],
           ratio1_accuracy(best["eta_ov"]), tuned, ratio1_accuracy(tuned)]
    out = pd.DataFrame([row], columns=cols)
    return out if digits is None else out.round({c: digits for c in cols if c.endswith(("(points)", "(%)"))})


def necessity_sentence(result: MapResult) -> str:
    """The necessity check per optimizer at ratio 1 and the highest trained ratio as a sentence: test
    accuracy with the model's, uniform and oracle attention, and chance (percent)."""
    t = result.necessity
    if t is None or not len(t):
        return "Necessity check: no tuned model."
    parts = []
    for opt, g in t.groupby("optimizer", sort=False):
        cells = [f"ratio {r.ratio:g}: model {100 * r.model:.1f}%, uniform {100 * r.uniform:.1f}%, oracle "
                 f"{100 * r.oracle:.1f}%" for r in g.sort_values("ratio").itertuples()]
        parts.append(f"{opt} " + "; ".join(cells) + f" (chance {100 * float(g['chance'].iloc[0]):.1f}%)")
    return "Necessity check (test accuracy with the model's / uniform / oracle attention): " + " | ".join(parts) + "."


def claims_rows(result: MapResult, dataset: str, chapter: str | None = None) -> list[dict[str, str]]:
    """Scorecard rows R1-R3 of a dataset chapter: the word over the paper's protocol cells
    (:func:`.rate_plane.protocol_verdicts`, with its region and every cell's change), then the control's word
    (eta_OV lowered at the tuned eta_QK) and (R3 only) the necessity check."""
    ch = chapter or attention_analysis.CHAPTERS[dataset]
    rows = []
    for cid in ("R1", "R2", "R3"):
        if cid not in result.verdicts:
            continue
        v, ctl = result.verdicts[cid], result.control.get(cid)
        ours = (f"{dataset}, the paper's protocol: {v.effect or v.reason}. Control (eta_OV lowered at the tuned "
                f"eta_QK): {ctl.label if ctl else 'not tested'}" + (f" ({ctl.effect})" if ctl and ctl.effect else "")
                + "." + (" " + necessity_sentence(result) if cid == "R3" else "")
                + ("".join(f" With {o}, {AGREEMENT_NOTE}." for o, (ok, _, _) in annotation_use(result).items()
                           if not ok) if cid == "R2" else ""))
        rows.append(claims.claim(cid, claims.CLAIMS[cid], ours, v, ch))
    return rows


def verdict_frame(result: MapResult) -> pd.DataFrame:
    """Per claim: the word over the paper's protocol cells with where it holds and is contradicted, and the
    control's word."""
    return pd.DataFrame([{"claim": cid, "paper's protocol": v.label, "where": v.region or "-", "cells": v.reason,
                          "control (η_OV lowered)": result.control[cid].label if cid in result.control else "-"}
                         for cid, v in result.verdicts.items()]).set_index("claim")


def runs_at(result: MapResult, optimizer: str) -> list[Any]:
    """The trained models at the tuned base rate of ``optimizer`` as objects with ``ratio``, ``seed`` and
    ``model`` (what :func:`.rationales.protocol_rows` reads)."""
    from types import SimpleNamespace

    ok = {(r.ratio, r.seed) for r in tuned_runs(result, optimizer).itertuples()}
    eta = result.selected.get(optimizer)
    return [SimpleNamespace(ratio=c.ratio, seed=c.seed, model=m) for c, m in result.models.items()
            if c.optimizer == optimizer and c.eta_ov == eta and (c.ratio, c.seed) in ok]


def roles_by_ratio(result: MapResult, optimizer: str, roles: Callable[[nn.Module], Mapping[str, float]]
                   ) -> pd.DataFrame:
    """``roles(model)`` (e.g. the mean attention mass per token role on the test split) of every trained model
    at the tuned base rate of ``optimizer``, averaged over seeds per ratio."""
    rows = [{"ratio": r.ratio, "seed": r.seed, **roles(r.model)} for r in runs_at(result, optimizer)]
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).drop(columns="seed").groupby("ratio").mean()


def roles_by_optimizer(result: MapResult, roles: Callable[[nn.Module], Mapping[str, float]]
                       ) -> dict[str, pd.DataFrame]:
    """:func:`roles_by_ratio` for every optimizer that has a tuned base rate."""
    return {opt: roles_by_ratio(result, opt, roles) for opt in result.selected}


@draws
def plot_roles(result: MapResult, frames: Mapping[str, pd.DataFrame], roles: Sequence[str]):
    """:func:`qkov_lib.plotting.role_bars` of :func:`roles_by_optimizer`, one panel per optimizer titled with
    its tuned base rate; None when no optimizer has one."""
    from qkov_lib.plotting import role_bars

    if not frames:
        return None
    return role_bars({f"{o} (eta_ov {result.selected[o]:g})": f for o, f in frames.items()}, roles)


def top_words(result: MapResult, optimizer: str, data: Batch, vocab: Sequence[str], k: int = 10) -> pd.DataFrame:
    """The ``k`` most-attended words (summed attention mass on the test split) of the first seed's tuned
    ``optimizer`` model, one column per ratio, with the share of their occurrences inside a rationale."""
    runs = runs_at(result, optimizer)
    if not runs:
        return pd.DataFrame()
    first = min(r.seed for r in runs)
    cols = {}
    for r in sorted((r for r in runs if r.seed == first), key=lambda r: r.ratio):
        w = rationales.most_attended_words(test_attention(r.model, data), data, vocab, k=k)
        cols[f"ratio {r.ratio:g}"] = [f"{word} ({100 * f:.0f}%)" for word, f in zip(w.index, w["in_rationale"])]
    return pd.DataFrame(cols, index=pd.RangeIndex(1, k + 1, name="rank"))


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m qkov_lib.studies.realmap DATASET [--profile P] [-p NAME VALUE ...]``: train one protocol
    map outside the book (values parsed as JSON, as ``qkov run``) and print its run table and verdicts."""

    import argparse
    import json

    p = argparse.ArgumentParser(description="Train a real-data protocol map and print its runs and verdicts.")
    p.add_argument("dataset", choices=list(MAPS))
    p.add_argument("--profile", default=None)
    p.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    a = p.parse_args(argv)

    def value(v: str) -> Any:
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v

    result, ds, cfg, _ = chapter_map(a.dataset, a.profile, **{k: value(v) for k, v in a.param})
    cols = ["optimizer", "eta_ov", "ratio", "seed", "trained", "stop_step", "val_accuracy", "accuracy", "macro_f1",
            "AC@0.5", "attn_relevant", "sufficiency"]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(result.table[[c for c in cols if c in result.table]].round(4).to_string(index=False))
        print(verdict_frame(result).to_string())


__all__ = ["main", "roles_by_ratio", "roles_by_optimizer", "plot_roles", "test_attention", "top_words", "MAPS",
           "MapSpec", "register", "hold_out_validation", "DATASETS", "MapResult", "load_splits", "make_model",
           "base_rates", "cell_config", "COPY_READOUTS", "attention_by_correctness", "not_testable_r3", "measure", "chance", "analyse", "run_map", "chapter_map", "map_config",
           "run_chapter_map", "anchor_gap", "selection_table", "failure_frame", "tuned_runs", "map_facts",
           "claims_rows", "largest_gain", "verdict_frame", "runs_at"]



if __name__ == "__main__":
    main()
