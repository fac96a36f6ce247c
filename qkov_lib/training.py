"""Training with separate learning rates for the QK and OV circuits.

The knob is ``ratio = eta_QK / eta_OV``; ``eta_ov`` is the OV learning rate, the QK group gets
``eta_ov * ratio``, everything else ``eta_other``. Optimizers: ``gd`` (full-batch gradient
descent), ``sgd`` (minibatch, optional momentum) and ``adamw``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .data.batch import Batch
from .metrics import DEFAULT_TAUS, summarize
from .models import check_rate, group_of, param_groups

OPTIMIZERS = ("gd", "sgd", "adamw")


class NonFiniteError(RuntimeError):
    """A loss, gradient or parameter became NaN or infinite during training."""


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer, learning rates, length, batching, logging and seed of one training run."""

    optimizer: str = "gd"
    eta_ov: float = 0.5
    ratio: float = 1.0
    eta_other: float | None = None
    steps: int = 1000
    batch_size: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    n_logs: int = 40
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; expected one of {OPTIMIZERS}")
        check_rate("eta_ov", self.eta_ov)
        check_rate("ratio (eta_QK/eta_OV)", self.ratio)
        if self.eta_other is not None:
            check_rate("eta_other", self.eta_other)
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be positive or None, got {self.batch_size}")
        if self.optimizer == "gd" and self.batch_size is not None:
            raise ValueError("optimizer 'gd' is full-batch; use 'sgd' for minibatches")

    @property
    def eta_qk(self) -> float:
        return self.eta_ov * self.ratio


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` over the ``qk``/``ov``/``other`` groups of ``model``."""
    groups = param_groups(model, cfg.eta_ov, cfg.ratio, cfg.eta_other, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups)
    return torch.optim.SGD(groups, momentum=cfg.momentum if cfg.optimizer == "sgd" else 0.0)


def log_steps(steps: int, n_logs: int) -> list[int]:
    """About ``n_logs`` log-spaced steps in ``[0, steps]``, always including 0 and ``steps``."""
    grid = np.unique(np.round(np.geomspace(1, steps, max(n_logs - 1, 1))).astype(int))
    return sorted({0, steps, *grid.tolist()})


def loss_fn(logits: Tensor, y: Tensor, weight: Tensor | None) -> Tensor:
    """Cross-entropy; an expectation under ``weight`` (population batches) or a plain mean."""
    ce = F.cross_entropy(logits, y, reduction="none")
    return ce.mean() if weight is None else (weight.to(ce.dtype) * ce).sum()


@torch.no_grad()
def predict(model: nn.Module, data: Batch, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """``(attention (N, T), probabilities (N, C))`` of ``model`` on ``data``, in chunks."""
    was = model.training
    model.eval()
    attn, probs = [], []
    for i in range(0, len(data), chunk):
        b = data.index(slice(i, i + chunk))
        logits, a = model(b.tokens, b.key_mask)
        attn.append(a)
        probs.append(torch.softmax(logits.double(), -1))
    model.train(was)
    return torch.cat(attn), torch.cat(probs)


def evaluate(model: nn.Module, data: Batch, taus=DEFAULT_TAUS) -> dict[str, float]:
    """:func:`qkov_lib.metrics.summarize` of the model's predictions on ``data``."""
    attn, probs = predict(model, data)
    return summarize(attn, probs, data.relevant, data.y, taus, data.weight)


def _check_finite(model: nn.Module, step: int, what: str) -> None:
    named = [(n, p.grad if what == "gradient" else p) for n, p in model.named_parameters()]
    named = [(n, t) for n, t in named if t is not None]
    if not named or bool(torch.stack([torch.isfinite(t).all() for _, t in named]).all()):
        return  # one synchronisation per step on the fast path
    name = next(n for n, t in named if not bool(torch.isfinite(t).all()))
    raise NonFiniteError(
        f"non-finite {what} at step {step} in parameter group '{group_of(name)}' "
        f"(tensor {name}); lower the learning rates or the ratio"
    )


@dataclass
class History:
    """Logged training records: one dict per logged step."""

    config: dict
    records: list[dict] = field(default_factory=list)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.records)

    @property
    def final(self) -> dict:
        return self.records[-1]


Probe = Callable[[nn.Module], dict[str, float]]


def train(model: nn.Module, data: Batch, cfg: TrainConfig, probe: Probe | None = None,
          desc: str = "train") -> History:
    """Train ``model`` on ``data`` with ``cfg``; at log-spaced steps record the loss, accuracy
    and mean attention on relevant tokens over all of ``data``, plus ``probe(model)``.
    Raises :class:`NonFiniteError` naming the step and group if anything goes non-finite."""
    device = next(model.parameters()).device
    data = data.to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg)
    logs = set(log_steps(cfg.steps, cfg.n_logs))
    bs = len(data) if cfg.batch_size is None else min(cfg.batch_size, len(data))
    order: list[Tensor] = []
    hist = History(config=asdict(cfg))
    bar = tqdm(range(cfg.steps + 1), desc=desc, disable=not cfg.progress, leave=False, mininterval=1.0)
    for step in bar:
        if step in logs:
            rec = {"step": step, **evaluate(model, data, taus=())}
            if probe is not None:
                rec.update(probe(model))
            if not math.isfinite(rec["loss"]):
                raise NonFiniteError(f"non-finite loss at step {step}; lower the learning rates or the ratio")
            hist.records.append(rec)
        if step == cfg.steps:
            break
        if bs == len(data):
            batch = data
        else:
            if not order:
                order = list(torch.randperm(len(data), generator=gen).split(bs))
            batch = data.index(order.pop(0).to(device))
        logits, _ = model(batch.tokens, batch.key_mask)
        loss = loss_fn(logits, batch.y, batch.weight)
        if not bool(torch.isfinite(loss)):
            raise NonFiniteError(f"non-finite loss ({float(loss)}) at step {step}; lower the learning rates or the ratio")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _check_finite(model, step, "gradient")
        opt.step()
        _check_finite(model, step, "parameter")
    return hist
