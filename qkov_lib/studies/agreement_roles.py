"""SVA: where the head's attention goes, by token role, and a one-head model for Linzen's natural prefixes.

Roles (Marvin & Linzen prefixes). :func:`qkov_lib.data.sva.prefix_roles` gives every prefix word
one role -- ``subject``, ``attractor`` (any other noun), ``verb`` (a present-tense verb that
already carries a number: relative-clause verbs and the first verb of a coordination), ``last``
(the word right before the target verb when it plays none of those roles) or ``rest`` -- stored
as one letter per word in ``TextDataset.test_info["roles"]``. :func:`role_masks` turns them into
non-overlapping (N, T) masks of the left-padded batch and :func:`role_mass` the mean attention
mass per role (:func:`qkov_lib.metrics.mass_by_role`).

Natural prefixes. :func:`make_natural_model` builds the analysed-head model of
:mod:`qkov_lib.head_model` for Linzen's prefixes: keys see their neighbours through a small
convolution (``+-(kernel // 2) * layers`` words; "the *members* of", "*that*") and positions
counted from the first word as well as from the query, values stay token-local, so the head
still has to pick the word whose number decides and its attention stays the object of study.
:func:`natural_grid` trains it on ``numpred.val`` minus a held-out validation part (early
stopping on validation loss), :func:`attractor_accuracy` tests it on Linzen's attractor sets and
:func:`natural_r1` / :func:`natural_claim_row` give its R1 verdict and scorecard row.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from qkov_lib import claims, protocol
from qkov_lib.data.batch import Batch
from qkov_lib.data.sva import ROLE_CODES
from qkov_lib.data.text import TextDataset, dry_run_split
from qkov_lib.data.registry import load_text_dataset
from qkov_lib.metrics import mass_by_role
from qkov_lib.profiles import profile_table
from qkov_lib.runtime import seed_everything
from qkov_lib.head_model import HeadModel, predict_by_length
from qkov_lib.train import History, TrainConfig, predict

ROLES: tuple[str, ...] = tuple(ROLE_CODES.values())  # subject, attractor, verb, last, rest
LAST_ANY = "last position"  # mass on the word right before the verb, whatever its role (not exclusive)


# --- roles -------------------------------------------------------------------------------------
def role_masks(roles: Sequence[str], key_mask: Tensor) -> dict[str, Tensor]:
    """Non-overlapping (N, T) bool masks, one per role of :data:`ROLES`, of a left-padded batch
    whose last column is the query: word ``j`` of an ``n``-word prefix sits in column
    ``T - 1 - n + j``. ``roles[i]`` is the role string of example ``i`` (one letter of
    :data:`~qkov_lib.data.sva.ROLE_CODES` per word). ValueError if a string does not fit its row
    (length or letters) or its words are not exactly the keys of ``key_mask``."""
    if key_mask.dim() != 2:
        raise ValueError(f"key_mask must be (N, T), got shape {tuple(key_mask.shape)}")
    N, T = key_mask.shape
    if len(roles) != N:
        raise ValueError(f"{len(roles)} role strings for {N} rows")
    codes = list(ROLE_CODES)
    idx = torch.full((N, T), -1, dtype=torch.long)
    for i, r in enumerate(roles):
        bad = set(r) - set(codes)
        if bad:
            raise ValueError(f"row {i}: unknown role letters {sorted(bad)}; expected {codes}")
        if not 0 < len(r) <= T - 1:
            raise ValueError(f"row {i}: {len(r)} roles for a row of {T} columns (query last)")
        idx[i, T - 1 - len(r):T - 1] = torch.tensor([codes.index(c) for c in r])
    words = idx >= 0
    if not torch.equal(words, key_mask.cpu().bool()):
        raise ValueError("the role strings do not cover exactly the keys of key_mask; "
                         "this needs a left-padded batch with the query last and not a key")
    return {name: (idx == k).to(key_mask.device) for k, name in enumerate(ROLES)}


def role_mass(attn: Tensor, roles: Sequence[str], key_mask: Tensor) -> dict[str, float]:
    """Mean attention mass (fraction, over rows) on each role of :data:`ROLES`, plus
    :data:`LAST_ANY`, the mass on the word right before the verb whatever its role."""
    masks = role_masks(roles, key_mask)
    out = mass_by_role(attn, masks, key_mask)
    out[LAST_ANY] = float(attn[:, -2].mean())
    return out


def test_attention(model: nn.Module, data: Batch) -> torch.Tensor:
    """The attention rows (N, T) of ``model`` on ``data`` (on the model's device, returned on the CPU)."""
    dev = next(model.parameters()).device
    return predict(model, data.to(dev))[0].cpu()


def model_role_mass(model: nn.Module, ds: TextDataset) -> dict[str, float]:
    """:func:`role_mass` of ``model``'s attention on the test split of a Marvin & Linzen dataset (its roles
    from ``ds.test_info["roles"]``)."""
    return role_mass(test_attention(model, ds.test), ds.test_info["roles"], ds.test.key_mask)


# The natural-prefix model: AdamW, early stopping on validation loss (10 % of numpred.val held out),
# evaluated every log_every steps. Measured cost of the cpu profile: runs stop after 1000-1400 steps;
# training 4 models as one stack took 144 s on 2 cores shared with ~6 other processes (load 7-8), so
# the cpu grid (2 models) needs about 1-2 min plus ~20 s of loading and testing on 64,750 prefixes.
# eta_ov = 1e-3 had the lowest validation loss at ratio 1 (seed 0) among {3e-4, 1e-3, 3e-3}: 0.261, 0.197, 0.240.
NATURAL_PROFILES: dict[str, dict[str, dict]] = profile_table(
    dict(linzen=True, max_len=48, min_freq=2, data_seed=0, val_frac=0.1, d_model=64, kernel=3, layers=2, encoder="conv",
         parameterization="FAFO", init_scale=1e-2, optimizer="adamw", eta_ov=1e-3, eta_other=None, weight_decay=0.0,
         batch_size=64, log_every=100, patience=5, ratios=[1.0, 10.0], seeds=[0], threads=1, processes=1,
         length_buckets=2),
    dict(steps=40, n_train=400, n_test=400, log_every=10, patience=None),
    # cpu: two one-thread processes of four models each (as the maps: no slower than two threads on an
    # idle machine, twice as fast when another job holds a core)
    dict(steps=3000, n_train=None, n_test=None, seeds=[0, 1, 2, 3], processes=2),
    dict(steps=8000, n_train=None, n_test=None, seeds=list(range(5)), ratios=[1.0, 3.0, 10.0, 30.0, 100.0]),
)


def load_natural(cfg: Mapping[str, Any], data_dir=None) -> TextDataset:
    """Linzen's natural prefixes (``numpred.val`` train pool, attractor test sets) for a
    :data:`NATURAL_PROFILES` config."""
    return load_text_dataset("sva_linzen", data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"],
                             n_train=cfg["n_train"], n_test=cfg["n_test"], seed=cfg["data_seed"])


def split_validation(data: Batch, frac: float, seed: int) -> tuple[Batch, Batch]:
    """``(train, val)``: a seeded random ``frac`` of the rows held out for validation."""
    if not 0.0 < frac < 1.0:
        raise ValueError(f"val_frac must lie in (0, 1), got {frac}")
    n_val = max(1, int(round(frac * len(data))))
    if n_val >= len(data):
        raise ValueError(f"{len(data)} rows are too few to hold out {n_val} for validation")
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    return data.index(perm[n_val:].sort().values), data.index(perm[:n_val].sort().values)


def make_natural_model(ds: TextDataset, cfg: Mapping[str, Any], seed: int) -> nn.Module:
    """The seeded natural-prefix model of a :data:`NATURAL_PROFILES` config: the analysed-head
    model of :mod:`qkov_lib.head_model` (token-local values, keys = word + positions back from
    the query and from the first word through ``layers`` convolutions of width ``kernel``, the
    relative class readout), so its prediction passes through the one head."""
    from qkov_lib.head_model import for_dataset

    return for_dataset(ds, cfg["d_model"], generator=seed_everything(seed), readout="class", encoder=cfg["encoder"],
                       layers=cfg["layers"], window=cfg["kernel"], positions=("back", "start"), relative=True,
                       parameterization=cfg["parameterization"], init_scale=cfg["init_scale"])


def _natural_model(ds: TextDataset, cfg: Mapping[str, Any], device: torch.device, seed: int) -> nn.Module:
    return make_natural_model(ds, cfg, seed).to(device)


def _natural_cell_config(cfg: Mapping[str, Any], cell: protocol.Cell) -> TrainConfig:
    return natural_train_config(cfg, cell.ratio, cell.seed)


def _no_measure(model: nn.Module, data: Batch) -> dict[str, float]:
    return {}  # the natural grid reads its histories and the attractor sets instead


def natural_train_config(cfg: Mapping[str, Any], ratio: float, seed: int) -> TrainConfig:
    """The :class:`TrainConfig` of one natural-prefix run (only ``ratio`` and ``seed`` vary). Its logs
    evaluate the validation split only (``log_subsample=0``): the grid reads nothing else from them,
    and a training-split sample would cost as much again."""
    return TrainConfig.from_profile(cfg, ratio=ratio, seed=seed, progress=False, log_subsample=0,
                                    log_seed=cfg["data_seed"])


def attractor_accuracy(model: HeadModel, ds: TextDataset) -> pd.DataFrame:
    """Test accuracy per number of attractors (and ``"all"``): rows ``n_attractors``, ``n``,
    ``accuracy``. Needs ``ds.test_info["n_attractors"]`` (the Linzen attractor sets)."""
    if "n_attractors" not in ds.test_info:
        raise ValueError(f"dataset {ds.name!r} has no n_attractors; load 'sva_linzen'")
    k = np.asarray(ds.test_info["n_attractors"])
    dev = next(model.parameters()).device
    # the attractor prefixes average 11 of 48 tokens: rows by length cost about a tenth of padded ones
    _, probs = predict_by_length(model, ds.test.to(dev))
    ok = (probs.argmax(-1).cpu() == ds.test.y).numpy()
    rows = [{"n_attractors": "all", "n": len(ok), "accuracy": float(ok.mean())}]
    rows += [{"n_attractors": str(j), "n": int((k == j).sum()), "accuracy": float(ok[k == j].mean())}
             for j in sorted(set(k.tolist()))]
    return pd.DataFrame(rows)


def natural_grid(ds: TextDataset, cfg: Mapping[str, Any], device: torch.device | None = None) -> pd.DataFrame:
    """Train one :func:`make_natural_model` per ``(ratio, seed)`` of ``cfg`` through
    :func:`qkov_lib.protocol.train_grid` (one stack, or one per process: below) on ``ds.train``
    minus the validation part (``cfg["val_frac"]``), with early stopping on validation loss when
    ``cfg["patience"]``. One row per run and number of attractors (:func:`attractor_accuracy`) with
    the run's best validation loss and accuracy and the step it was taken from. A diverged run is an
    error. On a CPU with ``cfg["processes"]`` > 1 the runs are dealt into that many stacks, each in a
    one-thread process."""
    device = device or torch.device("cpu")
    train, val = split_validation(ds.train, cfg["val_frac"], cfg["data_seed"])
    val = dry_run_split(val)  # a dry run evaluates a sample (its test split is one already: the loader's)
    cells = protocol.profile_cells(cfg, cfg["ratios"], cfg["seeds"])
    models: dict[protocol.Cell, nn.Module] = {}
    hists: dict[protocol.Cell, History] = {}
    processes = int(cfg.get("processes") or 1) if device.type == "cpu" else 1
    # partials of module-level functions, not lambdas: processes > 1 pickles them to its workers
    frame = protocol.train_grid(
        cells, functools.partial(_natural_model, ds, cfg, device), train.to(device), val.to(device),
        ds.test.to(device), functools.partial(_natural_cell_config, cfg), _no_measure,
        max_stack=-(-len(cells) // processes), desc=ds.name, models_out=models, threads=cfg.get("threads"),
        processes=processes, histories_out=hists)
    protocol.raise_if_diverged(frame, f"{ds.name} natural prefixes")
    frames = []
    for c in cells:
        f = hists[c].frame()
        best = f.loc[f["val_loss"].idxmin()]
        frames.append(attractor_accuracy(models[c], ds).assign(
            eta_ov=c.eta_ov, ratio=c.ratio, seed=c.seed, best_step=int(best["step"]), val_loss=float(best["val_loss"]),
            val_accuracy=float(best["val_accuracy"]), stop_step=hists[c].stop_step))
    return pd.concat(frames, ignore_index=True)


def natural_r1(frame: pd.DataFrame) -> claims.Verdict:
    """R1 of the natural-prefix models of :func:`natural_grid` by the one rule of :mod:`qkov_lib.claims`:
    the change of accuracy over all attractor prefixes at each ratio above the lowest, paired by seed (no
    macro-F1: the attractor sets have one number per prefix)."""
    acc = frame[frame["n_attractors"] == "all"].pivot(index="seed", columns="ratio", values="accuracy")
    ratios = sorted(acc.columns)
    rates = ", ".join(f"{r:g}" for r in sorted(set(frame["eta_ov"]))) if "eta_ov" in frame else "?"
    cells = {f"natural prefixes, η_OV {rates}, ratio {r:g} vs {ratios[0]:g}":
             claims.Change.of((acc[r] - acc[ratios[0]]).to_numpy(dtype=float)) for r in ratios[1:]}
    return claims.decide(claims.read_cells(cells, claims.ESTIMANDS["R1"]), claims.ESTIMANDS["R1"])


def natural_study(cfg: Mapping[str, Any], data_dir=None, device: torch.device | None = None
                  ) -> tuple[TextDataset | None, pd.DataFrame | None, claims.Verdict | None]:
    """``(dataset, frame, verdict)`` of the natural-prefix models of a :data:`NATURAL_PROFILES` config:
    :func:`load_natural`, :func:`natural_grid` and :func:`natural_r1`; three Nones when ``cfg["linzen"]``
    is false (the models are not trained)."""
    if not cfg["linzen"]:
        return None, None, None
    ds = load_natural(cfg, data_dir)
    frame = natural_grid(ds, cfg, device)
    return ds, frame, natural_r1(frame)


def natural_facts(cfg: Mapping[str, Any], verdict: claims.Verdict | None) -> dict[str, str]:
    """What a page quotes of :func:`natural_r1`'s ``verdict`` (None: not trained): ``lz_verdict``,
    ``lz_reason``, ``lz_effect`` and the seeds of ``cfg`` (``lz_seeds``)."""
    return {"lz_verdict": verdict.verdict if verdict else "not run",
            "lz_reason": verdict.reason if verdict else "the natural-prefix models were not trained",
            "lz_effect": (verdict.effect or "-") if verdict else "-", "lz_seeds": str(len(cfg["seeds"]))}


def natural_claim_row(frame: pd.DataFrame, verdict: claims.Verdict) -> dict[str, str]:
    """The scorecard row R1 of the natural-prefix models: accuracy over all attractor prefixes at
    the lowest and the highest ratio (seed mean, percent) and :func:`natural_r1`'s verdict."""
    acc = frame[frame["n_attractors"] == "all"].groupby("ratio")["accuracy"]
    m, n = acc.mean(), acc.size()
    lo, hi = m.index.min(), m.index.max()
    ours = (f"sva, natural prefixes (Linzen's attractor sets, {int(n.loc[lo])} seeds): accuracy "
            f"{100 * m.loc[lo]:.1f}% at ratio {lo:g}, {100 * m.loc[hi]:.1f}% at ratio {hi:g}")
    return claims.claim("R1", claims.CLAIMS["R1"], ours, verdict, "07_sva")


def natural_record(frame: pd.DataFrame | None, verdict: claims.Verdict | None
                   ) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The natural-prefix study's part of a page's results: its scorecard rows (:func:`natural_claim_row`;
    none when the models were not trained) and ``{"linzen": frame as row records, or None}``, the key its
    figure's line names (:func:`show_natural`)."""
    if frame is None or verdict is None:
        return [], {"linzen": None}
    return [natural_claim_row(frame, verdict)], {"linzen": frame.to_dict("records")}


def show_natural(ds: TextDataset | None, frame: pd.DataFrame | None, results: str, key: str = "metrics.linzen") -> None:
    """The natural-prefix study of :func:`natural_study` on a page: the data report, accuracy per number
    of attractors (:func:`.attention_analysis.attractor_summary`) and its figure
    (:func:`.attention_analysis.plot_attractors`), whose line names ``results``.json and ``key`` (where the
    page saves ``frame``); nothing when the models were not trained."""
    if ds is None or frame is None:
        return
    from IPython.display import display

    from qkov_lib import figure_source
    from qkov_lib.studies import attention_analysis

    display(ds.report_frame())
    display(attention_analysis.attractor_summary(frame))
    figure_source.show(attention_analysis.plot_attractors(frame), results, key)
