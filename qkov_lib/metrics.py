"""Attention metrics as the book defines them (introduction, "The metrics, as this book defines them").

Shapes: ``attn`` and ``relevant`` (N, T); ``probs`` (N, C); ``y`` (N,). Values are plain
tensors or floats in [0, 1] (fractions, not percent).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

FOCUS_CELLS = ("FTPT", "FFPT", "FTPF", "FFPF")
DEFAULT_TAUS = (0.5, 0.7, 0.9)


def relevant_mass(attn: Tensor, relevant: Tensor) -> Tensor:
    """``a_i = sum_{t in R_i} alpha_{i,t}`` (N,)."""
    return (attn * relevant.to(attn.dtype)).sum(dim=-1)


def confidence(probs: Tensor, y: Tensor) -> Tensor:
    """``c_i = p_i(y_i)`` (N,), the probability of the gold class."""
    return probs.gather(-1, y[:, None].long())[:, 0]


def _check_tau(tau: float) -> float:
    if not 0.0 <= float(tau) <= 1.0:
        raise ValueError(f"threshold must lie in [0, 1], got {tau}")
    return float(tau)


def ac(a: Tensor, tau: float = 0.5) -> float:
    """AC: fraction of instances with ``a_i >= tau``."""
    return float((a >= _check_tau(tau)).float().mean())


def acmc(a: Tensor, c: Tensor, tau_a: float = 0.5, tau_c: float | None = None) -> float:
    """ACMC: fraction with ``a_i >= tau_a`` and ``c_i >= tau_c`` (``tau_c`` defaults to ``tau_a``)."""
    tau_c = tau_a if tau_c is None else tau_c
    return float(((a >= _check_tau(tau_a)) & (c >= _check_tau(tau_c))).float().mean())


def dtap_histogram(a: Tensor, c: Tensor, bins: int = 10) -> Tensor:
    """DTAP heatmap (bins, bins): fraction of instances per (attention bin, confidence bin).

    Row ``i`` is attention in ``[i/bins, (i+1)/bins)``, column ``j`` confidence likewise; the
    value 1.0 falls in the last bin. Entries sum to 1.
    """
    if a.shape != c.shape or a.dim() != 1 or a.numel() == 0:
        raise ValueError("a and c must be non-empty 1-D tensors of equal length")
    ia = (a.double().clamp(0, 1) * bins).long().clamp(max=bins - 1)
    ic = (c.double().clamp(0, 1) * bins).long().clamp(max=bins - 1)
    h = torch.zeros(bins * bins, dtype=torch.float64)
    h.index_add_(0, ia * bins + ic, torch.ones_like(ia, dtype=torch.float64))
    return (h / a.numel()).reshape(bins, bins)


def focus_cells(attn: Tensor, relevant: Tensor, pred: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Boolean masks (N,) of the cells FTPT/FFPT/FTPF/FFPF: focus true when
    ``argmax_t alpha_t`` is a relevant position (ties: first maximum), prediction true when
    ``pred == y``."""
    top = attn.argmax(dim=-1)
    ft = relevant.gather(-1, top[:, None])[:, 0].bool()
    pt = pred == y
    return {"FTPT": ft & pt, "FFPT": ~ft & pt, "FTPF": ft & ~pt, "FFPF": ~ft & ~pt}


def focus_prediction_table(attn: Tensor, relevant: Tensor, pred: Tensor, y: Tensor) -> dict[str, float]:
    """Fractions of instances in each focus/prediction cell (they sum to 1)."""
    return {k: float(v.float().mean()) for k, v in focus_cells(attn, relevant, pred, y).items()}


@dataclass(frozen=True)
class InstanceMetric:
    """One per-instance attention metric: ``fn(a, c, correct)`` maps the relevant mass ``a``,
    the gold-class confidence ``c`` and the correctness mask (any equal shapes, e.g. (N,) or
    (B, N)) to a value per instance; summaries report its (weighted) mean under ``name``.
    ``phase``: the protocol map measures it and its phase table shows it; ``attention``: it
    describes the attention (the real-data attention tables list it), not only the prediction."""

    name: str
    fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    phase: bool = False
    attention: bool = True


INSTANCE_METRICS: dict[str, InstanceMetric] = {}
"""The registry every summary reads (:func:`summarize`, :func:`qkov_lib.train.engine.bag_summary`,
the protocol map's ``measure``, :func:`qkov_lib.protocol.phase_metrics` and the real-data
tables): one entry adds a metric everywhere."""


def register_metric(name: str, fn: Callable[[Tensor, Tensor, Tensor], Tensor], phase: bool = False,
                    attention: bool = True) -> InstanceMetric:
    """Add ``name`` to :data:`INSTANCE_METRICS` (see :class:`InstanceMetric`); a clash with a
    registered name or a built-in one (``loss``, ``accuracy``, ``AC@...``, ``ACMC@...``, the
    focus cells) is an error."""
    if name in INSTANCE_METRICS or name in ("loss", "accuracy", *FOCUS_CELLS) or name.startswith(("AC@", "ACMC@")):
        raise ValueError(f"a metric named {name!r} already exists")
    if not callable(fn):
        raise TypeError(f"metric {name!r}: fn must be callable, got {type(fn).__name__}")
    INSTANCE_METRICS[name] = m = InstanceMetric(name, fn, bool(phase), bool(attention))
    return m


def unregister_metric(name: str) -> None:
    """Remove ``name`` from :data:`INSTANCE_METRICS` (KeyError if it is not there)."""
    del INSTANCE_METRICS[name]


register_metric("attn_relevant", lambda a, c, ok: a, phase=True)
register_metric("confidence", lambda a, c, ok: c, attention=False)


def attention_names(taus: Sequence[float] = DEFAULT_TAUS) -> list[str]:
    """The registered attention metrics, then AC/ACMC at each ``tau``."""
    return [m.name for m in INSTANCE_METRICS.values() if m.attention] + threshold_names(taus)


def threshold_names(taus: Sequence[float] = DEFAULT_TAUS) -> list[str]:
    """``AC@tau`` and ``ACMC@tau`` for each threshold, in that order."""
    return [n for t in taus for n in (f"AC@{t:g}", f"ACMC@{t:g}")]


def instance_means(a: Tensor, c: Tensor, correct: Tensor, mean: Callable[[Tensor], Any],
                   taus: Sequence[float] = DEFAULT_TAUS) -> dict[str, Any]:
    """Loss, accuracy, every registered :data:`INSTANCE_METRICS` entry and AC/ACMC at each
    ``tau``, each reduced by ``mean`` (a weighted mean over the instance axis) from per-instance
    ``a``, ``c`` (float64) and ``correct`` (bool)."""
    out = {"loss": mean(-c.clamp_min(1e-300).log()), "accuracy": mean(correct)}
    for m in INSTANCE_METRICS.values():
        out[m.name] = mean(m.fn(a, c, correct))
    for tau in taus:
        out[f"AC@{tau:g}"] = mean(a >= _check_tau(tau))
        out[f"ACMC@{tau:g}"] = mean((a >= tau) & (c >= tau))
    return out


def summarize(attn: Tensor, probs: Tensor, relevant: Tensor, y: Tensor,
              taus: Sequence[float] = DEFAULT_TAUS, weight: Tensor | None = None) -> dict[str, float]:
    """:func:`instance_means` (loss, accuracy, the registered metrics, AC/ACMC at each ``tau``)
    and the focus/prediction table, as one flat dict. ``weight`` (N,) turns means into
    expectations (population batches); the threshold fractions are then weighted too."""
    w = torch.full_like(y, 1.0 / len(y), dtype=torch.float64) if weight is None else weight.double() / weight.sum()
    a, c = relevant_mass(attn, relevant).double(), confidence(probs, y).double()
    pred = probs.argmax(-1)
    mean = lambda v: float((w * v.double()).sum())  # noqa: E731
    out = instance_means(a, c, pred == y, mean, taus)
    for k, v in focus_cells(attn, relevant, pred, y).items():
        out[k] = mean(v)
    return out


def circuit_scalars(W_QK: Tensor, W_OV: Tensor, E_distinct: Tensor, E_common: Tensor,
                    e_query: Tensor) -> dict[str, float]:
    """The two scalars of the symmetric reduction (claim T1), averaged over classes:

    * ``ov``: the logit margin the distinct token of class k gives class k,
      ``(W_OV e_k)_k - mean_{j != k} (W_OV e_k)_j``;
    * ``qk``: the score advantage of distinct over common tokens,
      ``mean_k e_k^T W_QK e_q - mean_c e_c^T W_QK e_q``.

    Shapes: W_QK (d, d), W_OV (K, d), E_distinct (K, d), E_common (M, d), e_query (d,).
    """
    K = E_distinct.shape[0]
    L = E_distinct @ W_OV.T  # (K, K): row k = logits given distinct token k
    diag = L.diagonal()
    off = (L.sum(dim=1) - diag) / (K - 1)
    s_q = W_QK @ e_query
    return {"ov": float((diag - off).mean()), "qk": float((E_distinct @ s_q).mean() - (E_common @ s_q).mean())}


def macro_f1(pred: torch.Tensor, y: torch.Tensor, n_classes: int | None = None) -> float:
    """Macro-averaged F1 over the classes that occur in ``y`` or ``pred`` (a class with no true
    and no predicted instance is left out, as scikit-learn does with ``labels=None``)."""
    pred, y = pred.long().flatten(), y.long().flatten()
    if pred.shape != y.shape or y.numel() == 0:
        raise ValueError("pred and y must be non-empty and of equal length")
    n = int(max(int(pred.max()), int(y.max())) + 1) if n_classes is None else n_classes
    tp = torch.bincount(y[pred == y], minlength=n).double()
    n_pred = torch.bincount(pred, minlength=n).double()
    n_true = torch.bincount(y, minlength=n).double()
    present = (n_pred + n_true) > 0
    f1 = torch.where(n_pred + n_true > 0, 2 * tp / (n_pred + n_true).clamp_min(1), torch.zeros_like(tp))
    return float(f1[present].mean())


def prediction_metrics(probs: Tensor, y: Tensor, n_classes: int | None = None) -> dict[str, float]:
    """Accuracy, macro-F1 (:func:`macro_f1`) and mean cross-entropy (nats) of class
    probabilities ``probs`` (N, C) against labels ``y`` (N,)."""
    pred = probs.argmax(-1)
    return {"accuracy": float((pred == y).double().mean()),
            "macro_f1": macro_f1(pred.cpu(), y.cpu(), n_classes if n_classes is not None else probs.shape[-1]),
            "loss": float(-confidence(probs, y).clamp_min(1e-300).log().mean())}


def dtap_distance(h1, h2) -> float:
    """Total-variation distance between two DTAP histograms given as fractions (0 = equal, 1 = disjoint)."""
    import numpy as np

    return 0.5 * float(np.abs(np.asarray(h1, dtype=float) - np.asarray(h2, dtype=float)).sum())


def mass_by_role(attn: Tensor, roles: dict[str, Tensor], key_mask: Tensor | None = None) -> dict[str, float]:
    """Mean attention mass (over instances) that falls on each token role.

    attn (N, T) attention rows; roles maps a role name to an (N, T) bool mask of the positions
    that play it; the masks must not overlap. The mass left over (keys in no role) is reported
    as ``"rest"`` unless a role of that name is given. Values are fractions that sum to 1 over
    the roles (and ``rest``) when the rows of ``attn`` sum to 1 over ``key_mask``."""
    if attn.dim() != 2:
        raise ValueError(f"attn must be (N, T), got shape {tuple(attn.shape)}")
    covered = torch.zeros_like(attn, dtype=torch.bool)
    out: dict[str, float] = {}
    for name, m in roles.items():
        if m.shape != attn.shape:
            raise ValueError(f"role {name!r} has shape {tuple(m.shape)}, expected {tuple(attn.shape)}")
        m = m.bool()
        if (covered & m).any():
            raise ValueError(f"role {name!r} overlaps an earlier role")
        covered |= m
        out[name] = float((attn * m).sum(1).mean())
    if "rest" not in out:
        rest = ~covered if key_mask is None else key_mask.bool() & ~covered
        out["rest"] = float((attn * rest).sum(1).mean())
    return out


def seed_half_width(values, level: float = 0.95) -> float:
    """Half-width of the Student-t confidence interval (``level``) of the mean of ``values``
    (one per seed); NaN with fewer than two values."""
    import math

    import numpy as np
    from scipy import stats

    v = np.asarray(values, dtype=float)
    n = len(v)
    return float(stats.t.ppf(0.5 + level / 2, n - 1) * v.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def tag_frame(frame, **tags: Any):
    """``frame`` (a pandas DataFrame, copied) with one leading column per tag, in the given order,
    e.g. ``tag_frame(f, parameterization="FAFO", ratio=10.0, seed=0)``."""
    out = frame.copy()
    for i, (name, value) in enumerate(tags.items()):
        out.insert(i, name, value)
    return out
