"""SVA: where the head's attention goes, by token role, and a one-head model for Linzen's natural prefixes.

Roles (Marvin & Linzen prefixes). :func:`qkov_lib.data.sva.prefix_roles` gives every prefix word
one role -- ``subject``, ``attractor`` (any other noun), ``verb`` (a present-tense verb that
already carries a number: relative-clause verbs and the first verb of a coordination), ``last``
(the word right before the target verb when it plays none of those roles) or ``rest`` -- stored
as one letter per word in ``TextDataset.test_info["roles"]``. :func:`role_masks` turns them into
non-overlapping (N, T) masks of the left-padded batch and :func:`role_table` the mean attention
mass per role (:func:`qkov_lib.metrics.mass_by_role`) per template condition.

Natural prefixes. :class:`ContextHeadModel` is the analysed head of
:class:`~qkov_lib.models.TokenModel` (one :class:`~qkov_lib.models.QKOVAttention` read at the
query position, any of the four parameterizations) with a better input: word embeddings, a
position counted from the first word of the prefix as well as from the query, and a small
convolutional encoder, so that each key vector sees its neighbours (``+-(kernel // 2) * layers``
words; "the *members* of", "*that*"). The receptive field is local on purpose: the head still
has to pick the word whose number decides, so its attention stays the object of study; no key
vector summarises the whole prefix. :func:`train_natural` trains it on ``numpred.val`` minus a
held-out validation part (early stopping on validation loss) and :func:`attractor_accuracy`
tests it on Linzen's attractor sets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.batch import Batch
from ..data.sva import ROLE_CODES
from ..data.text import PAD_ID, TextDataset, load_text_dataset
from ..metrics import mass_by_role
from ..profiles import profile_table
from ..models import QKOVAttention
from ..runtime import seed_everything
from ..stacked import train_stacked
from ..training import History, TrainConfig, predict
from . import realdata

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


def role_table(attn: Tensor, probs: Tensor, data: Batch, roles: Sequence[str],
               conditions: Sequence[str]) -> pd.DataFrame:
    """Per template condition and ``"all"``: the instances ``n``, ``accuracy``, ``AC@0.5``
    (subject mass >= 0.5) and the mean attention mass per role (:func:`role_mass`).
    ``attn``/``probs`` (N, T)/(N, C) are a model's outputs on ``data``."""
    if not (len(roles) == len(conditions) == len(data) == attn.shape[0] == probs.shape[0]):
        raise ValueError(f"lengths differ: roles {len(roles)}, conditions {len(conditions)}, data {len(data)}, "
                         f"attn {attn.shape[0]}, probs {probs.shape[0]}")
    attn, probs, data = attn.cpu(), probs.cpu(), data.to("cpu")
    cond = np.asarray(list(conditions), dtype=object)
    correct = (probs.argmax(-1) == data.y).double()
    subject = role_masks(roles, data.key_mask)["subject"]
    ac = ((attn * subject).sum(1) >= 0.5).double()
    rows = []
    for name in ["all", *sorted(set(cond.tolist()))]:
        sel = np.ones(len(cond), dtype=bool) if name == "all" else cond == name
        t = torch.from_numpy(sel)
        sub_roles = [r for r, s in zip(roles, sel) if s]
        rows.append({"condition": name, "n": int(sel.sum()), "accuracy": float(correct[t].mean()),
                     "AC@0.5": float(ac[t].mean()), **role_mass(attn[t], sub_roles, data.key_mask[t])})
    return pd.DataFrame(rows)


def model_role_table(model: nn.Module, ds: TextDataset, split: str = "test", by: str = "condition") -> pd.DataFrame:
    """:func:`role_table` of a trained model on a Marvin & Linzen split (``ds.<split>_info``
    must hold ``roles`` and ``condition``, as :func:`qkov_lib.data.sva.load` gives them), grouped
    ``by`` template ``"condition"`` or by the ``"target"`` number (singular / plural); the group
    column is called ``condition`` either way."""
    info = getattr(ds, f"{split}_info")
    if "roles" not in info:
        raise ValueError(f"dataset {ds.name!r} has no token roles; load the Marvin & Linzen set ('sva')")
    data = getattr(ds, split)
    if by == "condition":
        groups = info["condition"]
    elif by == "target":
        groups = [ds.class_names[int(y)] for y in data.y]
    else:
        raise ValueError(f"by must be 'condition' or 'target', got {by!r}")
    dev = next(model.parameters()).device
    attn, probs = predict(model, data.to(dev))
    return role_table(attn, probs, data, info["roles"], groups)


def role_frame(models: Sequence[nn.Module], grid: Sequence[tuple[float, int]], ds: TextDataset,
               by: str = "condition") -> pd.DataFrame:
    """:func:`model_role_table` of every trained model, tagged with its ``(ratio, seed)``."""
    if len(models) != len(grid):
        raise ValueError(f"{len(models)} models for {len(grid)} grid points")
    return pd.concat([model_role_table(m, ds, by=by).assign(ratio=float(r), seed=s)
                      for m, (r, s) in zip(models, grid)], ignore_index=True)


def role_summary(frame: pd.DataFrame, condition: str | None = "all") -> pd.DataFrame:
    """Seed means of :func:`role_frame` per ratio (one condition, default ``"all"``) or per
    (condition, ratio) (``condition=None``)."""
    cols = ["accuracy", "AC@0.5", *ROLES, LAST_ANY]
    if condition is not None:
        frame = frame[frame["condition"] == condition]
        if frame.empty:
            raise ValueError(f"no rows for condition {condition!r}")
        return frame.groupby("ratio")[cols].mean()
    return frame.groupby(["condition", "ratio"])[cols].mean()


def role_facts(frames: Mapping[str, pd.DataFrame]) -> dict[str, str]:
    """Numbers and sentences for the chapter's "where the attention goes" section, from
    :func:`sgd_role_frames`: the lowest against the highest ratio, over all prefixes and on each
    run's default number (the target number with the lower AC). The sentences follow the signs
    of the measured changes."""
    summ = role_summary(frames["condition"])
    lo, hi = float(summ.index.min()), float(summ.index.max())
    a, b = summ.loc[lo], summ.loc[hi]
    pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
    f = {"role_lo": f"{lo:g}", "role_hi": f"{hi:g}", **{f"role_{k}_{t}": pct(v[k]) for t, v in (("lo", a), ("hi", b))
                                                           for k in ("accuracy", "AC@0.5", *ROLES)}}
    f = {k.replace("@0.5", "05").replace(" ", "_"): v for k, v in f.items()}
    if lo == hi:
        f["role_sentence"] = f"Only ratio {lo:g} was run, so how the ratio moves the attention is not measured here."
        return f
    moved = {r: float(b[r] - a[r]) for r in ROLES}
    gain = {r: d for r, d in moved.items() if r != "subject" and d > 0}
    where = ", ".join(f"{r} ({100 * d:+.1f} points)" for r, d in sorted(gain.items(), key=lambda kv: -kv[1])) or "nowhere"
    d = frames["default"].groupby("ratio").mean(numeric_only=True)
    share = {t: float(d.loc[r, "subject share of margin, default"]) for t, r in (("lo", lo), ("hi", hi))}
    f["role_sentence"] = (
        f"From ratio {lo:g} to {hi:g}, accuracy went from {pct(a['accuracy'])} to {pct(b['accuracy'])} and AC@0.5 "
        f"from {pct(a['AC@0.5'])} to {pct(b['AC@0.5'])}; the mass on the subject went from {pct(a['subject'])} to "
        f"{pct(b['subject'])}, and the mass that moved went to {where}. On each run's default number (the "
        f"target number with the lower AC) the subject's share of the logit margin went from {pct(share['lo'])} to "
        f"{pct(share['hi'])}: " + ("the other tokens' value vectors carry the default number, so the prediction "
                                   "stays right while the attention leaves the subject." if share["hi"] < share["lo"]
                                   and b["subject"] < a["subject"] else
                                   "the subject still carries the prediction at the higher ratio."))
    return f


# --- natural prefixes: a one-head model with a local encoder ----------------------------------
class ContextHeadModel(nn.Module):
    """Word embedding + position from the first word + position back from the query, a residual
    stack of ``layers`` 1-d convolutions (width ``kernel``, GELU) over the words, then the
    analysed :class:`~qkov_lib.models.QKOVAttention` head read at the query (last column).

    Left-padded input (pad id ``pad_id``): pad vectors are set to zero before every convolution,
    so the output does not depend on how much padding there is. ``encoder="none"`` skips the
    convolutions (embeddings and both positions only). Shapes: tokens, key_mask (B, T) ->
    logits (B, C), attention (B, T)."""

    def __init__(self, vocab_size: int, d_model: int, n_classes: int, max_len: int, kernel: int = 5,
                 layers: int = 2, encoder: str = "conv", pad_id: int = PAD_ID,
                 generator: torch.Generator | None = None, **attention_kwargs: Any) -> None:
        super().__init__()
        if encoder not in ("conv", "none"):
            raise ValueError(f"encoder must be 'conv' or 'none', got {encoder!r}")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {kernel}")
        if layers < 0:
            raise ValueError(f"layers must be >= 0, got {layers}")
        self.max_len, self.pad_id, self.encoder = max_len, pad_id, encoder
        d = d_model

        def table(n: int, scale: float) -> nn.Embedding:
            e = nn.Embedding(n, d)
            with torch.no_grad():
                e.weight.copy_(scale * torch.randn(n, d, generator=generator) / math.sqrt(d))
            return e

        self.embed = table(vocab_size, 1.0)
        self.pos_back = table(max_len, 0.1)   # distance from the query, as in TokenModel
        self.pos_start = table(max_len, 0.1)  # index from the first word: "early nouns are subjects"
        self.convs = nn.ModuleList()
        for _ in range(layers if encoder == "conv" else 0):
            c = nn.Conv1d(d, d, kernel, padding=kernel // 2)
            with torch.no_grad():
                c.weight.copy_(torch.randn(c.weight.shape, generator=generator) / math.sqrt(d * kernel))
                c.bias.zero_()
            self.convs.append(c)
        self.norm = nn.LayerNorm(d)
        self.attention = QKOVAttention(d, n_classes, generator=generator, **attention_kwargs)

    def encode(self, tokens: Tensor) -> Tensor:
        """The head's input vectors (B, T, d); zero at pad positions."""
        B, T = tokens.shape
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_len {self.max_len}")
        real = (tokens != self.pad_id).unsqueeze(-1)
        cols = torch.arange(T, device=tokens.device)
        n_pad = (~real[..., 0]).sum(1, keepdim=True)
        start = (cols[None] - n_pad).clamp_min(0)
        x = self.embed(tokens) + self.pos_back(T - 1 - cols)[None] + self.pos_start(start)
        x = x * real
        for conv in self.convs:
            # zero pads = the convolution's own zero padding, so the amount of padding cannot matter
            x = (x + F.gelu(conv(x.transpose(1, 2)).transpose(1, 2))) * real
        return self.norm(x) * real

    def forward(self, tokens: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
        if tokens.dim() != 2 or key_mask.shape != tokens.shape:
            raise ValueError(f"expected tokens and key_mask (B, T), got {tuple(tokens.shape)}, {tuple(key_mask.shape)}")
        return self.attention(self.encode(tokens), key_mask)


# The natural-prefix model: AdamW, early stopping on validation loss (10 % of numpred.val held out),
# evaluated every log_every steps. Measured cost of the cpu profile: runs stop after 1000-1400 steps;
# training 4 models as one stack took 144 s on 2 cores shared with ~6 other processes (load 7-8), so
# the cpu grid (2 models) needs about 1-2 min plus ~20 s of loading and testing on 64,750 prefixes.
# eta_ov = 1e-3 had the lowest validation loss at ratio 1 (seed 0) among {3e-4, 1e-3, 3e-3}: 0.261, 0.197, 0.240.
NATURAL_PROFILES: dict[str, dict[str, dict]] = profile_table(
    dict(max_len=48, min_freq=2, data_seed=0, val_frac=0.1, d_model=64, kernel=5, layers=2, encoder="conv",
         parameterization="FAFO", init_scale=1e-2, optimizer="adamw", eta_ov=1e-3, eta_other=None, weight_decay=0.0,
         batch_size=64, log_every=100, patience=5, ratios=[1.0, 10.0], seeds=[0], threads=1),
    dict(steps=40, n_train=400, n_test=400, log_every=10, patience=None),
    dict(steps=3000, n_train=None, n_test=None),
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


def make_natural_model(ds: TextDataset, cfg: Mapping[str, Any], seed: int) -> ContextHeadModel:
    """The seeded :class:`ContextHeadModel` of a :data:`NATURAL_PROFILES` config."""
    gen = seed_everything(seed)
    return ContextHeadModel(ds.vocab_size, cfg["d_model"], ds.n_classes, ds.max_len, kernel=cfg["kernel"],
                            layers=cfg["layers"], encoder=cfg["encoder"], generator=gen,
                            parameterization=cfg["parameterization"], init_scale=cfg["init_scale"])


def natural_train_config(cfg: Mapping[str, Any], ratio: float, seed: int) -> TrainConfig:
    """The :class:`TrainConfig` of one natural-prefix run (only ``ratio`` and ``seed`` vary)."""
    return TrainConfig(optimizer=cfg["optimizer"], eta_ov=cfg["eta_ov"], ratio=float(ratio), eta_other=cfg["eta_other"],
                       steps=int(cfg["steps"]), batch_size=cfg["batch_size"], weight_decay=cfg["weight_decay"],
                       log_every=cfg["log_every"], seed=seed, progress=False, log_subsample=2000,
                       log_seed=cfg["data_seed"], patience=cfg["patience"])


def train_natural(ds: TextDataset, cfg: Mapping[str, Any], grid: Sequence[tuple[float, int]],
                  device: torch.device | None = None) -> tuple[list[ContextHeadModel], list[History]]:
    """Train one :class:`ContextHeadModel` per ``(ratio, seed)`` of ``grid`` as one stack
    (:func:`qkov_lib.stacked.train_stacked`) on ``ds.train`` minus the validation part
    (``cfg["val_frac"]``), with early stopping on validation loss when ``cfg["patience"]``."""
    device = device or torch.device("cpu")
    train, val = split_validation(ds.train, cfg["val_frac"], cfg["data_seed"])
    models = [make_natural_model(ds, cfg, s).to(device) for _, s in grid]
    cfgs = [natural_train_config(cfg, r, s) for r, s in grid]
    hists = train_stacked(models, train.to(device), cfgs, val=val.to(device), desc=f"{ds.name}: {len(grid)} models",
                          threads=cfg.get("threads"))
    return models, hists


def attractor_accuracy(model: nn.Module, ds: TextDataset) -> pd.DataFrame:
    """Test accuracy per number of attractors (and ``"all"``): rows ``n_attractors``, ``n``,
    ``accuracy``. Needs ``ds.test_info["n_attractors"]`` (the Linzen attractor sets)."""
    if "n_attractors" not in ds.test_info:
        raise ValueError(f"dataset {ds.name!r} has no n_attractors; load 'sva_linzen'")
    k = np.asarray(ds.test_info["n_attractors"])
    dev = next(model.parameters()).device
    _, probs = predict(model, ds.test.to(dev))
    ok = (probs.argmax(-1).cpu() == ds.test.y).numpy()
    rows = [{"n_attractors": "all", "n": len(ok), "accuracy": float(ok.mean())}]
    rows += [{"n_attractors": str(j), "n": int((k == j).sum()), "accuracy": float(ok[k == j].mean())}
             for j in sorted(set(k.tolist()))]
    return pd.DataFrame(rows)


# --- what each role contributes to the decision ---------------------------------------------
def head_inputs(model: nn.Module, tokens: Tensor) -> Tensor:
    """The vectors (B, T, d) the analysed head reads: ``encode`` of a :class:`ContextHeadModel`,
    word + position embedding of a :class:`~qkov_lib.models.TokenModel`."""
    if isinstance(model, ContextHeadModel):
        return model.encode(tokens)
    if hasattr(model, "embed") and hasattr(model, "attention"):
        x = model.embed(tokens)
        if getattr(model, "pos", None) is not None:
            T = tokens.shape[1]
            x = x + model.pos(torch.arange(T - 1, -1, -1, device=tokens.device))[None]
        return x
    raise TypeError(f"no head inputs known for {type(model).__name__}")


@torch.no_grad()
def margin_by_role(model: nn.Module, data: Batch, roles: Sequence[str]) -> dict[str, float]:
    """Mean over instances of each role's share of the two-class logit margin
    ``(W_OV sum_i alpha_i x_i)[y] - [1 - y]``: role ``r`` contributes
    ``sum_{i in r} alpha_i (W_OV x_i)[y] - (W_OV x_i)[1 - y]`` (the shares add up to the margin,
    key ``"margin"``). Positive = pushes towards the right number. Two classes only."""
    if getattr(model.attention, "n_out", 2) != 2:
        raise ValueError("margin_by_role needs a two-class head")
    dev = next(model.parameters()).device
    data = data.to(dev)
    x = head_inputs(model, data.tokens)
    _, attn = model(data.tokens, data.key_mask)
    v = x @ model.attention.W_OV_eff().T  # (N, T, 2): each token's logits if attended alone
    sign = torch.where(data.y == 1, -1.0, 1.0)[:, None]
    per_token = attn * (v[..., 0] - v[..., 1]) * sign  # (N, T)
    masks = role_masks(roles, data.key_mask)
    out = {name: float((per_token * m).sum(1).mean()) for name, m in masks.items()}
    out["margin"] = float(per_token.sum(1).mean())
    return out


# --- grids the chapter runs -------------------------------------------------------------------
def sgd_role_frames(ds: TextDataset, cfg: Mapping[str, Any], device: torch.device | None = None
                    ) -> dict[str, pd.DataFrame]:
    """Train the SVA chapter's model with plain SGD (:func:`~qkov_lib.experiments.realdata.sgd_config`
    of ``cfg``) at every ``(ratio, seed)`` of ``cfg`` as one stack; returns ``{"condition":
    role_frame by template condition, "target": by target number, "margin": margin_frame,
    "default": default_number_table}``."""
    sgd = realdata.sgd_config(cfg)
    grid = [(float(r), s) for r in sgd["ratios"] for s in sgd["seeds"]]
    models, _ = realdata.train_models(ds, sgd, grid, device or torch.device("cpu"), probe=False)
    return role_frames(models, grid, ds)


def role_frames(models: Sequence[nn.Module], grid: Sequence[tuple[float, int]], ds: TextDataset
                ) -> dict[str, pd.DataFrame]:
    """The role analysis of trained models at ``grid``'s ``(ratio, seed)``: ``{"condition":
    role_frame by template condition, "target": by target number, "margin": margin_frame,
    "default": default_number_table}``."""
    out = {"condition": role_frame(models, grid, ds, "condition"), "target": role_frame(models, grid, ds, "target"),
           "margin": margin_frame(models, grid, ds)}
    out["default"] = default_number_table(out["target"], out["margin"])
    return out


def natural_grid(ds: TextDataset, cfg: Mapping[str, Any], device: torch.device | None = None) -> pd.DataFrame:
    """:func:`train_natural` at every ``(ratio, seed)`` of ``cfg``; one row per run and number of
    attractors (:func:`attractor_accuracy`) with the run's best validation loss and accuracy and
    the step it was taken from."""
    grid = [(float(r), s) for r in cfg["ratios"] for s in cfg["seeds"]]
    models, hists = train_natural(ds, cfg, grid, device)
    frames = []
    for m, h, (r, s) in zip(models, hists, grid):
        f = h.frame()
        best = f.loc[f["val_loss"].idxmin()]
        frames.append(attractor_accuracy(m, ds).assign(
            ratio=r, seed=s, best_step=int(best["step"]), val_loss=float(best["val_loss"]),
            val_accuracy=float(best["val_accuracy"]), stop_step=h.stop_step))
    return pd.concat(frames, ignore_index=True)


def margin_frame(models: Sequence[nn.Module], grid: Sequence[tuple[float, int]], ds: TextDataset) -> pd.DataFrame:
    """:func:`margin_by_role` of every model on the test instances of each target number; one row
    per (ratio, seed, target)."""
    roles = ds.test_info["roles"]
    rows = []
    for m, (r, s) in zip(models, grid):
        for y, name in enumerate(ds.class_names):
            sel = ds.test.y == y
            mr = margin_by_role(m, ds.test.index(sel), [q for q, k in zip(roles, sel.tolist()) if k])
            rows.append({"ratio": float(r), "seed": s, "target": name, **mr})
    return pd.DataFrame(rows)


def default_number_table(by_target: pd.DataFrame, margins: pd.DataFrame) -> pd.DataFrame:
    """Per run: the ``default`` number (the target number with the lower AC@0.5) and the
    ``marked`` one; their AC@0.5 and accuracy, where the default number's attention goes
    (mass per role) and the subject's share of the logit margin on each. ``by_target``:
    :func:`role_frame` with ``by="target"``; ``margins``: :func:`margin_frame`."""
    rows = []
    for (r, s), g in by_target[by_target["condition"] != "all"].groupby(["ratio", "seed"]):
        g = g.set_index("condition")
        if len(g) != 2:
            raise ValueError(f"run (ratio {r}, seed {s}) needs rows for both target numbers, got {list(g.index)}")
        d, k = g["AC@0.5"].idxmin(), g["AC@0.5"].idxmax()
        mm = margins[(margins["ratio"] == r) & (margins["seed"] == s)].set_index("target")
        rows.append({"ratio": r, "seed": s, "default": d, "AC default": g.loc[d, "AC@0.5"],
                     "AC marked": g.loc[k, "AC@0.5"], "accuracy default": g.loc[d, "accuracy"],
                     "accuracy marked": g.loc[k, "accuracy"],
                     **{f"{role} default": g.loc[d, role] for role in ROLES},
                     "subject share of margin, default": mm.loc[d, "subject"] / mm.loc[d, "margin"],
                     "subject share of margin, marked": mm.loc[k, "subject"] / mm.loc[k, "margin"]})
    return pd.DataFrame(rows)
