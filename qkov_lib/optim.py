"""SGD (with momentum) and AdamW, written once, for parameters stacked along a leading model
dimension.

Every tensor ``p`` (B, ...) holds one row per model; each row has its own learning rate, weight
decay and momentum (per-model, per-group rates: the ``qk`` tensors of a model get
``ratio * eta_ov``). The updates are torch's own: each run of consecutive rows with equal rates
is one call of the kernel behind ``torch.optim.SGD(fused=True)`` (``dampening=0``,
``nesterov=False``) or ``torch.optim.AdamW(fused=True)`` (``betas=(0.9, 0.999)``, ``eps=1e-8``,
``amsgrad=False``). A fused kernel reads and writes every element once, with no temporaries,
which matters for large embedding tables. With ``per_row=True`` (the default) the kernel gets the
rows as separate tensors, so each row is rounded exactly as the same model trained alone (the
vectorised kernel rounds an element by its place in a tensor); ``per_row=False`` passes a run as
one slice, cheaper for many tiny rows. ``tests/test_optim.py`` compares every row with
``torch.optim`` on the same gradients.

Used by :mod:`qkov_lib.stacked` (every token-model training run, :func:`qkov_lib.training.train`
included) and by the synthetic engine :mod:`qkov_lib.engine`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

KINDS = ("gd", "sgd", "adamw")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW defaults


@dataclass
class RowRates:
    """Per-row hyper-parameters of one stacked tensor: ``lr``, ``weight_decay`` and ``momentum``,
    each (B,) float64 (momentum is ignored by AdamW)."""

    lr: Tensor
    weight_decay: Tensor
    momentum: Tensor

    def select(self, keep: Tensor) -> "RowRates":
        """The rates of rows ``keep`` (index tensor)."""
        return RowRates(self.lr[keep], self.weight_decay[keep], self.momentum[keep])


def rates_of(groups: Sequence[Mapping], model: nn.Module, momentum: float = 0.0) -> dict[str, tuple[float, float, float]]:
    """``{parameter name: (lr, weight_decay, momentum)}`` of ``model`` from optimizer parameter
    ``groups`` (as :func:`qkov_lib.models.param_groups` or :func:`qkov_lib.knob.knob_groups`
    return them: dicts with ``params``, ``lr`` and optional ``weight_decay``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, tuple[float, float, float]] = {}
    for g in groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError("an optimizer group holds a tensor that is not a parameter of the model")
            out[names[id(p)]] = (float(g["lr"]), float(g.get("weight_decay", 0.0)), float(momentum))
    return out


def stack_rates(per_model: Sequence[Mapping[str, tuple[float, float, float]]], names: Sequence[str]) -> dict[str, RowRates]:
    """Stack per-model :func:`rates_of` dicts into one :class:`RowRates` per tensor name."""
    out = {}
    for n in names:
        missing = [b for b, r in enumerate(per_model) if n not in r]
        if missing:
            raise ValueError(f"tensor {n!r} is in no optimizer group of model(s) {missing}")
        cols = torch.tensor([r[n] for r in per_model], dtype=torch.float64)
        out[n] = RowRates(cols[:, 0].clone(), cols[:, 1].clone(), cols[:, 2].clone())
    return out


def _col(v: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) on ``like``'s device, to broadcast over a row."""
    return v.reshape(-1, *([1] * (like.dim() - 1))).to(like.device)


def runs_of(r: RowRates) -> list[tuple[int, int, float, float, float]]:
    """Maximal runs ``(start, stop, lr, weight_decay, momentum)`` of consecutive rows with equal
    rates (a grid ordered ratio by ratio gives one run per ratio)."""
    rows = list(zip(r.lr.tolist(), r.weight_decay.tolist(), r.momentum.tolist()))
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[start]:
            runs.append((start, i, *rows[start]))
            start = i
    return runs


class StackedOptimizer:
    """``kind`` = ``"gd"`` (SGD without momentum), ``"sgd"`` or ``"adamw"`` over stacked tensors.

    ``rates[name]`` gives the per-row hyper-parameters of tensor ``name``. :meth:`step` updates
    the tensors in place from their gradients; rows whose ``active`` entry is False stay as they
    are. :meth:`select` keeps only some rows (the trainer drops finished models)."""

    def __init__(self, kind: str, rates: Mapping[str, RowRates], betas: tuple[float, float] = ADAM_BETAS,
                 eps: float = ADAM_EPS, per_row: bool = True) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown optimizer {kind!r}; expected one of {KINDS}")
        for n, r in rates.items():
            if not (bool(torch.isfinite(r.lr).all()) and bool((r.lr >= 0).all()) and bool((r.weight_decay >= 0).all())):
                raise ValueError(f"learning rates and weight decay of {n!r} must be finite and >= 0")
            if bool(((r.momentum < 0) | (r.momentum >= 1)).any()):
                raise ValueError(f"momentum of {n!r} must lie in [0, 1), got {r.momentum.tolist()}")
        self.kind, self.betas, self.eps, self.per_row = kind, betas, eps, per_row
        self.rates = dict(rates)
        self.runs = {n: runs_of(r) for n, r in self.rates.items()}
        self.state: dict[str, dict[str, Tensor]] = {}
        self.t = 0  # steps taken (AdamW bias correction; shared by all rows)
        self._step: dict[torch.device, Tensor] = {}  # the step count as the fused kernel reads it

    @torch.no_grad()
    def step(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor | None],
             active: Mapping[str, Tensor] | None = None) -> None:
        """One update of every tensor in ``params`` (B, ...) from ``grads`` (same shapes; None:
        no gradient, skipped as torch.optim does). ``active[name]`` (B,) bool freezes rows."""
        self.t += 1
        for n, p in params.items():
            g = grads[n]
            if g is None:
                continue
            mask = None if active is None or bool(active[n].all()) else _col(active[n], p).bool()
            old = p.clone() if mask is not None else None
            (self._adamw if self.kind == "adamw" else self._sgd)(n, p, g.contiguous())
            if mask is not None:
                p.copy_(torch.where(mask, p, old))

    def _pieces(self, n: str, *tensors: Tensor):
        """Per run of equal rates: the rates and, for each of ``tensors``, the list of tensors
        the fused kernel gets (one per row, or one slice per run)."""
        rows = [t.unbind(0) for t in tensors] if self.per_row else None
        for a, b, lr, wd, mom in self.runs[n]:
            yield (lr, wd, mom), [list(r[a:b]) if rows else [t[a:b]] for r, t in zip(rows or tensors, tensors)]

    def _adamw(self, n: str, p: Tensor, g: Tensor) -> None:
        st = self.state.setdefault(n, {})
        if "m" not in st:
            st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
        step = self._step.setdefault(p.device, torch.zeros((), dtype=torch.float32, device=p.device))
        step.fill_(self.t)
        b1, b2 = self.betas
        for (lr, wd, _), (ps, gs, ms, vs) in self._pieces(n, p, g, st["m"], st["v"]):
            torch._fused_adamw_(ps, gs, ms, vs, [], [step] * len(ps), lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                                eps=self.eps, amsgrad=False, maximize=False)

    def _sgd(self, n: str, p: Tensor, g: Tensor) -> None:
        st = self.state.setdefault(n, {})
        first = "buf" not in st
        if first:
            st["buf"] = torch.empty_like(p)  # the fused kernel copies the first gradient into it
        for (lr, wd, mom), (ps, gs, bufs) in self._pieces(n, p, g, st["buf"]):
            mom = mom if self.kind == "sgd" else 0.0
            torch._fused_sgd_(ps, gs, bufs if mom else [], weight_decay=wd, momentum=mom, lr=lr, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=first)

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` (index tensor) of every rate and state tensor."""
        self.rates = {n: r.select(keep.cpu()) for n, r in self.rates.items()}
        self.runs = {n: runs_of(r) for n, r in self.rates.items()}
        for st in self.state.values():
            for k, v in st.items():
                st[k] = v[keep.to(v.device)]
