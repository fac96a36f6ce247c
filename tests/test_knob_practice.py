"""``knob.step_moves``: the mean absolute move of each optimizer group in one step, as the book's
"knob in your own model" section measures it on a Hugging Face ViT and a diffusers block."""

import copy

import pytest
import torch
from torch import nn

from qkov_lib import knob

E, RATIO, LR = 8, 10.0, 1e-3


class Tiny(nn.Module):
    """A packed ``nn.MultiheadAttention`` (no biases: a key bias gets no gradient) and a readout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, 2, bias=False, batch_first=True)
        self.readout = nn.Linear(E, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.attn(x, x, x, need_weights=False)[0])


def _x() -> torch.Tensor:
    return torch.randn(4, 5, E, generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module):
    x = _x()
    return lambda: model(x).pow(2).mean()


def test_adam_step_moves_qk_ratio_times_as_far_as_ov():
    model = Tiny()
    opt, report = knob.knob_optimizer(model, torch.optim.AdamW, lr=LR, qk_ratio=RATIO)
    moves = knob.step_moves(model, report, opt, _loss(model))
    assert list(moves) == ["qk", "ov", "other"]
    # Adam's first step: every element with a gradient moves by its group's learning rate
    assert moves["ov"] == pytest.approx(LR, rel=1e-3)
    assert moves["other"] == pytest.approx(LR, rel=1e-3)
    assert moves["qk"] / moves["ov"] == pytest.approx(RATIO, rel=1e-3)


def test_sgd_moves_are_the_mean_gradient_times_the_rate_over_each_group():
    model = Tiny()
    ref = copy.deepcopy(model)
    ref(_x()).pow(2).mean().backward()
    g = ref.attn.in_proj_weight.grad.abs()
    opt, report = knob.knob_optimizer(model, torch.optim.SGD, lr=LR, qk_ratio=RATIO)
    moves = knob.step_moves(model, report, opt, _loss(model))
    # qk: the Q and K rows of in_proj_weight; ov: its V rows and out_proj's weight
    assert moves["qk"] == pytest.approx(LR * RATIO * float(g[:2 * E].mean()), rel=1e-4)
    ov = torch.cat([g[2 * E:].flatten(), ref.attn.out_proj.weight.grad.abs().flatten()])
    assert moves["ov"] == pytest.approx(LR * float(ov.mean()), rel=1e-4)


def test_bad_inputs_are_refused_and_nothing_steps():
    model = Tiny()
    opt, report = knob.knob_optimizer(model, torch.optim.AdamW, lr=LR, qk_ratio=RATIO)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match="KnobReport"):
        knob.step_moves(model, str(report), opt, _loss(model))
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        knob.step_moves(model, report, opt, model(_x()).sum())
    with pytest.raises(ValueError, match="scalar tensor that requires grad"):
        knob.step_moves(model, report, opt, lambda: model(_x()))  # not reduced to a scalar
    other = nn.Sequential(nn.Linear(E, E))
    with pytest.raises(ValueError, match="not in Sequential"):
        knob.step_moves(other, report, opt, lambda: other(_x()).sum())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
