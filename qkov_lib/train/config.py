"""What one training run is: its config (optimizer, the QK and OV rates, length, batching,
logging, early stopping, seed), its logged history, the logged steps and the error of a run
that goes non-finite.

The knob is ``ratio = eta_QK / eta_OV``; ``eta_ov`` is the OV learning rate, the QK group gets
``eta_ov * ratio``, everything else ``eta_other``. Optimizers: ``gd`` (full-batch gradient
descent), ``sgd`` (minibatch, optional momentum) and ``adamw``, as ``torch.optim`` defines them
(implemented once, in :mod:`qkov_lib.train.optim`); the loop is :mod:`qkov_lib.train.loop`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pandas as pd
from torch import nn

from qkov_lib.models import check_rate

OPTIMIZERS = ("gd", "sgd", "adamw")


def stable_rates(ratio: float, eta_ov: float, eta_qk_max: float | None = None,
                 steps: int | None = None) -> tuple[float, int | None]:
    """``(eta_OV, steps)`` of a run at ``ratio = eta_QK / eta_OV`` whose QK rate must stay within
    ``eta_qk_max`` (None: no limit): ``eta_ov`` and ``steps`` while ``ratio * eta_ov <= eta_qk_max``;
    above it eta_OV is lowered to ``eta_qk_max / ratio`` and ``steps`` (if given) grows by the same
    factor, so that the run covers the same training time ``eta_OV * steps``. The reduced
    dynamics depend on the two rates only through their ratio and that time (gradient flow
    rescales time), so the lowered run is the same run as far as the theory sees it, at a QK rate
    inside gradient descent's stable range. ValueError for a rate or ratio that is not > 0."""
    if not (ratio > 0 and eta_ov > 0 and (eta_qk_max is None or eta_qk_max > 0)):
        raise ValueError(f"ratio, eta_ov and eta_qk_max must be > 0, got {ratio}, {eta_ov}, {eta_qk_max}")
    if eta_qk_max is None or ratio * eta_ov <= float(eta_qk_max):
        return float(eta_ov), steps
    low = float(eta_qk_max) / ratio
    return low, None if steps is None else int(math.ceil(steps * eta_ov / low))


class NonFiniteError(RuntimeError):
    """A loss, gradient or parameter became NaN or infinite during training."""


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer, learning rates, length, batching, logging, early stopping and seed of one run.

    Logging happens at about ``n_logs`` log-spaced steps (or every ``log_every`` steps) on a
    fixed random subsample of ``log_subsample`` training rows drawn with ``log_seed`` (None: all
    rows; 0: no training metrics). With validation data, ``patience`` stops a run once its
    validation loss has not improved for that many evaluations; ``restore_best`` then gives it
    back the weights of its best evaluation.

    ``length_buckets`` > 1 is for models whose output on a row does not depend on its left padding
    (:class:`qkov_lib.head_model.HeadModel`): each minibatch is then run as that many groups of rows,
    shortest first, each group cut to its longest row, and evaluations cut their rows the same way. The
    loss and metrics are the same up to float rounding; the work follows the rows' real lengths, not the
    padded length (on data whose rows are mostly much shorter than the longest).

    ``flush_denormals`` (default True) trains with the CPU flushing subnormal floats to zero
    (:func:`qkov_lib.runtime.flush_denormals`): sharp attention rows otherwise hold softmax weights below
    float32's smallest normal number, whose arithmetic is many times slower on x86."""

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
    log_every: int | None = None
    log_subsample: int | None = None
    log_seed: int = 0
    patience: int | None = None
    restore_best: bool = True
    length_buckets: int = 1
    flush_denormals: bool = True

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
        if not (0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum!r}")
        if not (self.weight_decay >= 0.0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        for name in ("log_every", "patience"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if isinstance(self.length_buckets, bool) or not isinstance(self.length_buckets, int) or self.length_buckets < 1:
            raise ValueError(f"length_buckets must be a positive integer, got {self.length_buckets!r}")
        if not isinstance(self.flush_denormals, bool):
            raise ValueError(f"flush_denormals must be True or False, got {self.flush_denormals!r}")
        if self.log_subsample is not None and (not isinstance(self.log_subsample, int) or self.log_subsample < 0):
            raise ValueError(f"log_subsample must be an integer >= 0 or None, got {self.log_subsample!r}")

    @property
    def eta_qk(self) -> float:
        return self.eta_ov * self.ratio

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any], **run: Any) -> TrainConfig:
        """The config of one run of a study: every field of this class that ``profile`` (a
        resolved settings dict, :func:`qkov_lib.profiles.resolve`) names, overridden by ``run``
        (the run's own values: ``ratio``, ``seed``, a fixed ``optimizer``...). Profile keys that
        are not fields are ignored; a ``run`` key that is not a field is a TypeError. Integral
        ``steps`` become ``int``, numeric ``eta_ov``/``ratio``/``eta_other`` become ``float``."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(run) - set(names))
        if unknown:
            raise TypeError(f"TrainConfig has no field(s) {unknown}")
        kw = {k: profile[k] for k in names if k in profile} | run
        for k in ("eta_ov", "ratio", "eta_other"):
            if isinstance(kw.get(k), (int, float)) and not isinstance(kw[k], bool):
                kw[k] = float(kw[k])
        if isinstance(kw.get("steps"), float) and kw["steps"].is_integer():
            kw["steps"] = int(kw["steps"])
        return cls(**kw)


def log_steps(steps: int, n_logs: int) -> list[int]:
    """About ``n_logs`` log-spaced steps in ``[0, steps]``, always including 0 and ``steps``."""
    grid = np.unique(np.round(np.geomspace(1, steps, max(n_logs - 1, 1))).astype(int))
    return sorted({0, steps, *grid.tolist()})


def log_schedule(cfg: TrainConfig) -> list[int]:
    """The logged steps of ``cfg``: every ``log_every`` steps if set, else :func:`log_steps`;
    always including 0 and ``steps``."""
    if cfg.log_every is not None:
        return sorted({*range(0, cfg.steps, cfg.log_every), cfg.steps})
    return log_steps(cfg.steps, cfg.n_logs)


@dataclass
class History:
    """Logged training records (one dict per logged step) and where the run ended early:
    ``stop_step`` (early stopping, or the synthetic engine's ``stop_loss``), ``diverged_step``
    (frozen after going non-finite) and ``best_step`` (lowest validation loss)."""

    config: dict
    records: list[dict] = field(default_factory=list)
    stop_step: int | None = None
    diverged_step: int | None = None
    best_step: int | None = None

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.records)

    @property
    def final(self) -> dict:
        return self.records[-1]


Probe = Callable[[nn.Module], dict[str, float]]


