"""qkov_lib.optim: every row of a stacked update equals torch.optim on that row alone."""

import pytest
import torch
from torch import nn

from qkov_lib.models import TokenModel, param_groups
from qkov_lib.optim import RowRates, StackedOptimizer, rates_of, runs_of, stack_rates

# per row: (lr, weight_decay, momentum); rows 0-1 share their rates (one run), the others differ
ROWS = [(0.1, 0.0, 0.9), (0.1, 0.0, 0.9), (0.03, 0.01, 0.5), (0.3, 0.2, 0.0)]


def _rates(rows=ROWS) -> RowRates:
    t = torch.tensor(rows, dtype=torch.float64)
    return RowRates(t[:, 0].clone(), t[:, 1].clone(), t[:, 2].clone())


def _reference(kind: str, p0: torch.Tensor, grads: list[torch.Tensor], row: int, **torch_kw) -> torch.Tensor:
    """Row ``row`` of ``p0`` after the gradient steps ``grads`` with torch.optim."""
    lr, wd, mom = ROWS[row]
    q = nn.Parameter(p0[row].clone())
    if kind == "adamw":
        opt = torch.optim.AdamW([q], lr=lr, weight_decay=wd, **torch_kw)
    else:
        opt = torch.optim.SGD([q], lr=lr, weight_decay=wd, momentum=mom if kind == "sgd" else 0.0, **torch_kw)
    for g in grads:
        q.grad = g[row].clone()
        opt.step()
    return q.detach()


@pytest.mark.parametrize("kind", ["gd", "sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_equal_torch_optim(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(len(ROWS), 5, 3, generator=gen, dtype=dtype)
    grads = [torch.randn(p0.shape, generator=gen, dtype=dtype) for _ in range(6)]
    p = p0.clone()
    opt = StackedOptimizer(kind, {"w": _rates()})
    for g in grads:
        opt.step({"w": p}, {"w": g})
    # rounding only: the vectorised kernels may treat an element of a slice differently (FMA)
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-13, atol=1e-15)
    for row in range(len(ROWS)):
        for kw in ({"fused": True}, {"foreach": False}):  # the same kernel; torch's default CPU path
            torch.testing.assert_close(p[row], _reference(kind, p0, grads, row, **kw), **tol)


def test_inactive_rows_stay_and_select_keeps_state():
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(len(ROWS), 4, generator=gen)
    grads = [torch.randn(p0.shape, generator=gen) for _ in range(4)]
    p = p0.clone()
    opt = StackedOptimizer("adamw", {"w": _rates()})
    active = torch.tensor([True, False, True, True])
    opt.step({"w": p}, {"w": grads[0]}, {"w": active})
    assert torch.equal(p[1], p0[1]) and not torch.equal(p[0], p0[0])
    # dropping row 1 keeps the other rows' moments: they go on exactly as without the drop
    q = p.clone()
    ref = StackedOptimizer("adamw", {"w": _rates()})
    ref.step({"w": p0.clone()}, {"w": grads[0]})
    keep = torch.tensor([0, 2, 3])
    opt.select(keep)
    q = q[keep].clone()
    full = p.clone()
    for g in grads[1:]:
        opt.step({"w": q}, {"w": g[keep]})
        ref.step({"w": full}, {"w": g})
    torch.testing.assert_close(q, full[keep], rtol=0, atol=0)


def test_runs_and_rates_from_param_groups():
    assert runs_of(_rates()) == [(0, 2, 0.1, 0.0, 0.9), (2, 3, 0.03, 0.01, 0.5), (3, 4, 0.3, 0.2, 0.0)]
    models = [TokenModel(7, 4, 2, 5, parameterization=p, generator=torch.Generator().manual_seed(0))
              for p in ("FAFO", "FAFO")]
    per = [rates_of(param_groups(m, 0.01, ratio, None, 0.1), m) for m, ratio in zip(models, (1.0, 30.0))]
    r = stack_rates(per, ["attention.W_Q", "attention.W_V", "embed.weight"])
    assert r["attention.W_Q"].lr.tolist() == pytest.approx([0.01, 0.3])      # qk: ratio * eta_ov
    assert r["attention.W_V"].lr.tolist() == pytest.approx([0.01, 0.01])     # ov: eta_ov
    assert r["embed.weight"].weight_decay.tolist() == [0.1, 0.1]
    with pytest.raises(ValueError, match="no optimizer group"):
        stack_rates(per, ["attention.W_QK"])


def test_bad_input():
    with pytest.raises(ValueError, match="unknown optimizer"):
        StackedOptimizer("lbfgs", {"w": _rates()})
    with pytest.raises(ValueError, match="momentum"):
        StackedOptimizer("sgd", {"w": _rates([(0.1, 0.0, 1.5)])})
    with pytest.raises(ValueError, match="finite and >= 0"):
        StackedOptimizer("sgd", {"w": _rates([(float("nan"), 0.0, 0.0)])})
    with pytest.raises(ValueError, match="not a parameter"):
        rates_of([{"params": [nn.Parameter(torch.zeros(1))], "lr": 0.1}], nn.Linear(2, 2))
