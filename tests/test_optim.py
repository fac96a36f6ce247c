"""qkov_lib.train.optim: every row of a stacked update equals torch.optim on that row alone, with torch's
fused kernels and with the plain fallback."""

import pytest
import torch
from torch import nn

from qkov_lib.train import optim
from qkov_lib.models import TokenModel, param_groups
from qkov_lib.train.optim import RowRates, StackedOptimizer, rates_of, runs_of, stack_rates, update_kernel

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


@pytest.fixture(autouse=True)
def _fresh_kernel_choice(monkeypatch):
    """Every test decides the kernel afresh and leaves no choice behind."""
    monkeypatch.delenv(optim.PLAIN_ENV, raising=False)
    optim._fused_works.cache_clear()
    yield
    optim._fused_works.cache_clear()


@pytest.mark.parametrize("kind", ["gd", "sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("plain", [False, True])
def test_rows_equal_torch_optim(kind, dtype, plain, monkeypatch):
    if plain:
        monkeypatch.setenv(optim.PLAIN_ENV, "1")
    assert update_kernel(kind, "cpu") == ("plain" if plain else "fused")
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(len(ROWS), 5, 3, generator=gen, dtype=dtype)
    grads = [torch.randn(p0.shape, generator=gen, dtype=dtype) for _ in range(6)]
    p = p0.clone()
    opt = StackedOptimizer(kind, {"w": _rates()})
    for g in grads:
        opt.step({"w": p}, {"w": g})
    # rounding only: the vectorised kernels may treat an element of a slice differently (FMA),
    # and the plain update rounds its temporaries; 6 steps stay within a few hundred ulps
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
    # exact: a frozen row is copied back bit for bit (torch.where), not recomputed
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
    # exact by construction: per_row=True hands the kernel every row as its own tensor, so a row
    # is computed by the same code on the same numbers whichever rows share its stack
    torch.testing.assert_close(q, full[keep], rtol=0, atol=0)


def test_runs_and_rates_from_param_groups():
    assert runs_of(_rates()) == [(0, 2, 0.1, 0.0, 0.9), (2, 3, 0.03, 0.01, 0.5), (3, 4, 0.3, 0.2, 0.0)]
    models = [TokenModel(7, 4, 2, 5, parameterization=p, generator=torch.Generator().manual_seed(0))
              for p in ("FAFO", "FAFO")]
    per = [rates_of(param_groups(m, 0.01, ratio, None, 0.1), m) for m, ratio in zip(models, (1.0, 30.0))]
    r = stack_rates(per, ["attention.W_Q", "attention.W_V", "embed.weight"])
    assert r["attention.W_Q"].lr.tolist() == pytest.approx([0.01, 0.3])      # qk: ratio * eta_ov
    assert r["attention.W_V"].lr.tolist() == pytest.approx([0.01, 0.01])     # ov: eta_ov
    assert r["embed.weight"].weight_decay.tolist() == [0.1, 0.1]  # exact: the float 0.1 copied, not computed
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


@pytest.mark.parametrize("kind", ["gd", "sgd", "adamw"])
@pytest.mark.parametrize("per_row", [True, False])
def test_plain_update_equals_fused_kernel(kind, per_row, monkeypatch):
    """The fallback and torch's fused kernel agree over 10 steps, for every row."""
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(len(ROWS), 6, 4, generator=gen, dtype=torch.float64)
    grads = [torch.randn(p0.shape, generator=gen, dtype=torch.float64) for _ in range(10)]
    out = {}
    for plain in (False, True):
        monkeypatch.setenv(optim.PLAIN_ENV, "1" if plain else "0")
        p, opt = p0.clone(), StackedOptimizer(kind, {"w": _rates()}, per_row=per_row)
        for g in grads:
            opt.step({"w": p}, {"w": g})
        out[plain] = p
    assert float((out[False] - p0).abs().min()) > 1e-6  # every element moved
    # float64 rounding only (the kernels order the same operations differently): 1e-13 relative
    torch.testing.assert_close(out[True], out[False], rtol=1e-13, atol=1e-15)


def _raises_type_error(*args, **kwargs):
    raise TypeError("unexpected keyword argument 'is_first_step'")


@pytest.mark.parametrize("kind, op", [("adamw", "_fused_adamw_"), ("sgd", "_fused_sgd_"), ("gd", "_fused_sgd_")])
@pytest.mark.parametrize("broken", ["missing", "TypeError", "no-op"])
def test_fallback_is_chosen_when_the_fused_kernel_is_missing_or_changed(kind, op, broken, monkeypatch):
    if broken == "missing":
        monkeypatch.delattr(torch, op)
    else:  # a changed signature, or a kernel that runs but no longer does this update
        monkeypatch.setattr(torch, op, _raises_type_error if broken == "TypeError" else (lambda *a, **k: None))
    match = "failed" if broken != "no-op" else "gives another update"
    with pytest.warns(RuntimeWarning, match=f"fused {'adamw' if kind == 'adamw' else 'sgd'} kernel on cpu {match}"):
        assert update_kernel(kind, "cpu") == "plain"
    assert update_kernel(kind, torch.device("cpu")) == "plain"  # decided once: no second probe, no warning
    assert optim._fused_works.cache_info().misses == 1
    # training goes on, with torch.optim's update
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(len(ROWS), 3, generator=gen, dtype=torch.float64)
    grads = [torch.randn(p0.shape, generator=gen, dtype=torch.float64) for _ in range(4)]
    p, opt = p0.clone(), StackedOptimizer(kind, {"w": _rates()})
    for g in grads:
        opt.step({"w": p}, {"w": g})
    for row in range(len(ROWS)):  # float64 rounding of 4 steps
        torch.testing.assert_close(p[row], _reference(kind, p0, grads, row, foreach=False), rtol=1e-13, atol=1e-15)


def test_bad_plain_flag_raises_and_changes_nothing(monkeypatch):
    monkeypatch.setenv(optim.PLAIN_ENV, "yes")
    p0 = torch.ones(len(ROWS), 2)
    p, opt = p0.clone(), StackedOptimizer("sgd", {"w": _rates()})
    with pytest.raises(ValueError, match="QKOV_PLAIN_OPTIM must be 1"):
        opt.step({"w": p}, {"w": torch.ones_like(p)})
    assert opt.t == 0 and not opt.state and torch.equal(p, p0)  # exact: nothing was written
    with pytest.raises(ValueError, match="unknown optimizer"):
        update_kernel("lbfgs", "cpu")
