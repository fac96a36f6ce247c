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

The fused kernels (``torch._fused_adamw_``, ``torch._fused_sgd_``) are private to torch and may
change or vanish in a torch upgrade. The first step on a device type runs each kernel once on a
tiny tensor and compares it with the plain update (the same formulas, written with ordinary
tensor operations as in ``torch.optim``'s single-tensor path); if the kernel is missing, refuses
the call or disagrees, every later step uses the plain update (the same numbers up to rounding,
with temporaries) and a warning says so. ``QKOV_PLAIN_OPTIM=1`` forces the plain update;
:func:`update_kernel` tells which one runs.

Used by :mod:`qkov_lib.train.loop` (every token-model training run, :func:`qkov_lib.train.train`
included) and by the synthetic engine :mod:`qkov_lib.train.engine`.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

KINDS = ("gd", "sgd", "adamw")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW defaults
PLAIN_ENV = "QKOV_PLAIN_OPTIM"  # "1": always the plain update; unset, "" or "0": the fused kernel when it works


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


def fused_adamw_(ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], step: Tensor, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float) -> None:
    """One AdamW step of the tensors ``ps`` in place by torch's fused kernel; ``ms``/``vs`` are
    the first/second moments, ``step`` the step count (0-dim float32 on the tensors' device)."""
    torch._fused_adamw_(ps, gs, ms, vs, [], [step] * len(ps), lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def plain_adamw_(ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], t: int, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float) -> None:
    """The update of :func:`fused_adamw_` at step ``t`` (1, 2, ...) with plain tensor operations:
    ``p *= 1 - lr wd``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`` (torch.optim.AdamW)."""
    b1, b2 = betas
    step_size, c2 = lr / (1 - b1 ** t), (1 - b2 ** t) ** 0.5
    for p, g, m, v in zip(ps, gs, ms, vs):
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.addcdiv_(m, (v.sqrt() / c2).add_(eps), value=-step_size)


def fused_sgd_(ps: list[Tensor], gs: list[Tensor], bufs: list[Tensor], lr: float, weight_decay: float,
               momentum: float, first: bool) -> None:
    """One SGD step of ``ps`` in place by torch's fused kernel (``dampening=0``, no Nesterov);
    ``bufs`` are the momentum buffers (unused when ``momentum`` is 0; on the ``first`` step the
    kernel copies the gradient into them)."""
    torch._fused_sgd_(ps, gs, bufs if momentum else [], weight_decay=weight_decay, momentum=momentum, lr=lr,
                      dampening=0.0, nesterov=False, maximize=False, is_first_step=first)


def plain_sgd_(ps: list[Tensor], gs: list[Tensor], bufs: list[Tensor], lr: float, weight_decay: float,
               momentum: float, first: bool) -> None:
    """The update of :func:`fused_sgd_` with plain tensor operations: ``d = g + wd p``; with
    momentum ``buf = d`` on the first step, else ``buf = momentum buf + d``, and ``d = buf``;
    ``p -= lr d`` (torch.optim.SGD)."""
    for i, (p, g) in enumerate(zip(ps, gs)):
        d = g.add(p, alpha=weight_decay) if weight_decay else g
        if momentum:
            d = bufs[i].copy_(d) if first else bufs[i].mul_(momentum).add_(d)
        p.add_(d, alpha=-lr)


@functools.cache
def _fused_works(kernel: str, device_type: str) -> bool:
    """Whether torch's fused ``kernel`` ("adamw" or "sgd") runs on ``device_type`` with the calls
    above and gives the plain update: two steps (momentum 0.5, weight decay 0.2) on a 3-element
    float64 tensor, equal to 1e-12 relative (rounding only). Warns when it does not."""
    dev = torch.device(device_type)
    grads = [torch.tensor(g, dtype=torch.float64, device=dev) for g in ([0.5, -0.25, 2.0], [-1.0, 0.75, 0.125])]
    start = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, device=dev)
    fused, plain = ([start.clone(), torch.zeros_like(start), torch.zeros_like(start)] for _ in range(2))
    lr, wd, mom = 0.1, 0.2, 0.5
    try:
        for t, g in enumerate(grads, 1):
            if kernel == "adamw":
                step = torch.tensor(float(t), dtype=torch.float32, device=dev)
                fused_adamw_(fused[:1], [g], fused[1:2], fused[2:], step, lr, wd, ADAM_BETAS, ADAM_EPS)
                plain_adamw_(plain[:1], [g], plain[1:2], plain[2:], t, lr, wd, ADAM_BETAS, ADAM_EPS)
            else:
                fused_sgd_(fused[:1], [g], fused[1:2], lr, wd, mom, t == 1)
                plain_sgd_(plain[:1], [g], plain[1:2], lr, wd, mom, t == 1)
        ok = all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(fused, plain))
        why = "gives another update than the plain one"
    except (AttributeError, TypeError, RuntimeError) as e:
        ok, why = False, f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if not ok:
        warnings.warn(f"torch {torch.__version__}: the fused {kernel} kernel on {device_type} {why}; "
                      "using the plain update (equal up to rounding, slower)", RuntimeWarning, stacklevel=4)
    return ok


def _plain_forced() -> bool:
    """Whether ``QKOV_PLAIN_OPTIM`` asks for the plain update (ValueError for a value other than
    unset, "", "0" or "1")."""
    flag = os.environ.get(PLAIN_ENV, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{PLAIN_ENV} must be 1 (plain update), 0 or unset (fused when it works), got {flag!r}")
    return flag == "1"


def update_kernel(kind: str, device: torch.device | str) -> str:
    """``"fused"`` or ``"plain"``: which implementation :class:`StackedOptimizer` uses for
    ``kind`` on ``device`` (decided once per kernel and device type; ``QKOV_PLAIN_OPTIM=1``
    forces ``"plain"``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown optimizer {kind!r}; expected one of {KINDS}")
    if _plain_forced():
        return "plain"
    return "fused" if _fused_works("adamw" if kind == "adamw" else "sgd", torch.device(device).type) else "plain"


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
        _plain_forced()  # a bad QKOV_PLAIN_OPTIM raises before anything changes
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
        fused = update_kernel(self.kind, p.device) == "fused"
        if fused:
            step = self._step.setdefault(p.device, torch.zeros((), dtype=torch.float32, device=p.device))
            step.fill_(self.t)
        for (lr, wd, _), (ps, gs, ms, vs) in self._pieces(n, p, g, st["m"], st["v"]):
            if fused:
                fused_adamw_(ps, gs, ms, vs, step, lr, wd, self.betas, self.eps)
            else:
                plain_adamw_(ps, gs, ms, vs, self.t, lr, wd, self.betas, self.eps)

    def _sgd(self, n: str, p: Tensor, g: Tensor) -> None:
        st = self.state.setdefault(n, {})
        first = "buf" not in st
        if first:
            st["buf"] = torch.empty_like(p)  # the first step copies the gradient into it
        update = fused_sgd_ if update_kernel(self.kind, p.device) == "fused" else plain_sgd_
        for (lr, wd, mom), (ps, gs, bufs) in self._pieces(n, p, g, st["buf"]):
            update(ps, gs, bufs, lr, wd, mom if self.kind == "sgd" else 0.0, first)

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` (index tensor) of every rate and state tensor."""
        self.rates = {n: r.select(keep.cpu()) for n, r in self.rates.items()}
        self.runs = {n: runs_of(r) for n, r in self.rates.items()}
        for st in self.state.values():
            for k, v in st.items():
                st[k] = v[keep.to(v.device)]
