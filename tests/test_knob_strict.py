"""What the knob refuses, and what it says: any real number type for the rates, tensors tied
between an attention projection and another module, an optimizer built before a split, and
attention projections that no family or rule places (strict by default)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from qkov_lib import knob

E = 8


def snapshot(model: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unchanged(model: nn.Module, snap: dict) -> bool:
    now = snapshot(model)
    return list(now) == list(snap) and all(torch.equal(now[n], snap[n]) for n in snap)


# --- numbers -------------------------------------------------------------------------------
NUMBERS = [np.int64(10), np.int32(10), np.float32(10), np.float64(10), np.array(10.0), np.array(10),
           torch.tensor(10.0), torch.tensor(10), torch.tensor(10.0, dtype=torch.float64), 10, 10.0]


@pytest.mark.parametrize("ratio", NUMBERS, ids=[f"{type(x).__module__}.{type(x).__name__}:{x!r}" for x in NUMBERS])
def test_any_real_number_type_is_a_number(ratio):
    """numpy scalars, 0-d arrays and 0-d tensors are numbers for lr, qk_ratio, other_lr and
    weight_decay, and reach the optimizer as Python floats."""
    opt, _ = knob.knob_optimizer(nn.MultiheadAttention(E, 2), "sgd", lr=np.float32(0.5), qk_ratio=ratio,
                                 other_lr=torch.tensor(0.25), weight_decay=np.float64(0.0))
    rates = {g["name"]: g["lr"] for g in opt.param_groups}
    assert rates == {"qk": 5.0, "ov": 0.5}
    assert all(type(g["lr"]) is float for g in opt.param_groups)


@pytest.mark.parametrize("value, err, message", [
    (True, TypeError, "qk_ratio must be a number, got the bool True"),
    (np.bool_(True), TypeError, "got the bool"),
    (torch.tensor(True), TypeError, "got the bool"),
    (np.float32("nan"), ValueError, r"qk_ratio must be a finite number > 0, got nan \(a numpy.float32\)"),
    (torch.tensor(-1.0), ValueError, r"qk_ratio must be a finite number > 0, got -1.0 \(a torch.Tensor\)"),
    (np.int64(0), ValueError, r"got 0.0 \(a numpy.int64\)"),
    (float("inf"), ValueError, "qk_ratio must be a finite number > 0, got inf$"),
    (np.array([10.0]), TypeError, r"one real number .* got ndarray of shape \(1,\)"),
    (torch.tensor([10.0, 1.0]), TypeError, r"got Tensor of shape \(2,\)"),
    ("10", TypeError, "got str: '10'"),
    (1 + 2j, TypeError, "one real number"),
])
def test_non_numbers_and_bad_values_are_refused_plainly(value, err, message):
    model = nn.MultiheadAttention(E, 2)
    snap = snapshot(model)
    with pytest.raises(err, match=message):
        knob.knob_optimizer(model, "sgd", lr=0.1, qk_ratio=value)
    assert unchanged(model, snap)


def test_a_schedule_for_lr_gets_a_true_message():
    """A callable lr is not "a non-finite number": the message says what to do with a schedule."""
    with pytest.raises(TypeError, match=r"lr \(eta_ov\) must be a number, got the function 'warmup'.*scheduler on "
                                        r"the optimizer it returns.*LambdaLR"):
        def warmup(step):
            return min(1.0, step / 100)
        knob.knob_optimizer(nn.MultiheadAttention(E, 2), "sgd", lr=warmup)
    with pytest.raises(ValueError, match=r"weight_decay must be a finite number >= 0, got -0.5 \(a numpy.float32\)"):
        knob.knob_optimizer(nn.MultiheadAttention(E, 2), "sgd", weight_decay=np.float32(-0.5))


# --- ties ----------------------------------------------------------------------------------
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E, bias=False) for _ in range(4))


class Embedded(nn.Module):
    """An embedding and an attention, the embedding registered first or last (which name of the
    tied tensor is its canonical one changes with the order)."""

    def __init__(self, emb_first: bool):
        super().__init__()
        if emb_first:
            self.emb = nn.Embedding(E, E)
        self.attn = Attn()
        if not emb_first:
            self.emb = nn.Embedding(E, E)


@pytest.mark.parametrize("emb_first", [True, False])
def test_a_tensor_tied_to_a_module_outside_attention_is_refused_and_a_rule_places_it(emb_first):
    model = Embedded(emb_first)
    model.attn.o_proj.weight = model.emb.weight
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"tied weights: the attention projection attn.o_proj.weight \(O, .*the same "
                                         r"tensor as emb.weight, outside any attention module") as info:
        knob.knob_optimizer(model, "sgd", lr=0.1, qk_ratio=10)
    assert unchanged(model, snap)
    rule = re.search(r"rules=\{r'([^']+)': 'other'\}", str(info.value))[1]
    opt, rep = knob.knob_optimizer(model, "sgd", lr=0.1, qk_ratio=10, rules={rule: "other"})
    key = "emb.weight" if emb_first else "attn.o_proj.weight"  # the tensor's first name in the model
    assert rule == "^" + re.escape(key) + "$" and {e.tensor: e.group for e in rep.entries}[key] == "other"
    assert model.attn.o_proj.weight is model.emb.weight  # the tie stays
    # a tie between attention projections of the same group (Q shared across layers) is no problem
    shared = nn.ModuleList([Attn(), Attn()])
    shared[1].q_proj.weight = shared[0].q_proj.weight
    _, rep = knob.knob_optimizer(shared, "sgd", lr=0.1, qk_ratio=10)
    assert {e.tensor: e.group for e in rep.entries}["0.q_proj.weight"] == "qk"


# --- an optimizer built before the split -----------------------------------------------------
def test_the_report_names_split_tensors_and_says_earlier_optimizers_are_stale():
    layer = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0)
    early = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt, rep = knob.knob_optimizer(layer, "sgd", lr=0.1, qk_ratio=10)
    assert rep.split == ("self_attn.in_proj_weight", "self_attn.in_proj_bias")
    last = str(rep).splitlines()[-1]
    assert "self_attn.in_proj_weight, self_attn.in_proj_bias" in last
    assert "optimizer built before this call still holds the old tensors" in last
    assert "no longer the model's parameters" in last
    summary = rep.summary()
    assert summary.attrs["split"] == last  # the Q and K slices of weight and bias; V of both; nothing else
    assert summary["split"].to_dict() == {"qk": 4, "ov": 2, "other": 0}
    # what it says is so: the early optimizer's step leaves the split tensor where it was
    before = layer.self_attn.in_proj_weight.detach().clone()
    layer(torch.randn(3, 2, E)).square().sum().backward()
    held = {id(p) for p in layer.parameters()}
    assert any(id(p) not in held for g in early.param_groups for p in g["params"])
    early.step()
    assert torch.equal(layer.self_attn.in_proj_weight, before)
    opt.step()
    assert not torch.equal(layer.self_attn.in_proj_weight, before)
    # nothing split (separate projections, or split already): nothing said
    _, rep = knob.knob_optimizer(Attn(), "sgd", lr=0.1)
    assert rep.split == () and "optimizer built before" not in str(rep)
    _, rep = knob.knob_optimizer(layer, "sgd", lr=0.1)
    assert rep.split == () and "optimizer built before" not in str(rep)


# --- strict by default -----------------------------------------------------------------------
class MetaAttention(nn.Module):
    """Meta's reference Llama names its projections wq, wk, wv, wo: no family knows them."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(E, E, bias=False) for _ in range(4))
        self.scale = nn.Parameter(torch.ones(1))  # not projection-like: stays in other silently


def mixed() -> nn.Module:
    return nn.ModuleDict({"mha": nn.MultiheadAttention(E, 2), "attn": MetaAttention()})


def test_an_unplaced_attention_projection_is_refused_by_default():
    model = mixed()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"look like attention projections in MetaAttention but that no family or "
                                         r"rule places: attn.wq.weight, attn.wk.weight, attn.wv.weight, "
                                         r"attn.wo.weight\. .*rules=.*strict=False") as info:
        knob.knob_optimizer(model, "adamw", lr=1e-3, qk_ratio=10)
    assert unchanged(model, snap) and not hasattr(model["mha"], "parametrizations")  # nothing split
    assert "attn.scale" not in str(info.value)
    # the rules the message suggests place them
    rules = dict(re.findall(r"r'([^']+)': '(qk|ov)'", str(info.value)))
    assert set(rules.values()) == {"qk", "ov"} and len(rules) == 4
    _, rep = knob.knob_optimizer(model, "adamw", lr=1e-3, qk_ratio=10, rules=rules)
    by = {e.tensor: e.group for e in rep.entries}
    assert [by[f"attn.w{c}.weight"] for c in "qkvo"] == ["qk", "qk", "ov", "ov"] and by["attn.scale"] == "other"
    # inspect says which rows the optimizer would refuse
    text = str(knob.inspect(mixed()))
    assert re.search(r"attn.wq.weight .*knob_optimizer refuses it", text)
    assert re.search(r"attn.scale .*not placed by any family: goes to other", text)


def test_strict_false_accepts_with_a_warning():
    model = mixed()
    with pytest.warns(UserWarning, match=r"attn.wq.weight.*strict=False: they go to 'other'"):
        opt, rep = knob.knob_optimizer(model, "sgd", lr=1e-3, qk_ratio=10, strict=False)
    assert {e.tensor: e.group for e in rep.entries}["attn.wq.weight"] == "other"
    with warnings.catch_warnings():  # a model the families place entirely: no warning either way
        warnings.simplefilter("error")
        knob.knob_optimizer(nn.MultiheadAttention(E, 2), "sgd", strict=False)


@pytest.mark.parametrize("child, flagged", [
    ("query_global", True), ("key_global", True), ("kv_a_proj_with_mqa", True), ("q_b_proj", True), ("wo", True),
    ("pos_proj", True), ("q_layer_norm", True), ("relative_attention_bias", False), ("rel_embeddings", False),
    ("LayerNorm", False), ("gate", False), ("mlp", False),
])
def test_which_children_of_an_attention_module_look_like_projections(child, flagged):
    """Beside placed q_proj ... o_proj siblings (Longformer's global projections, DeepSeek's
    low-rank ones): refused when named like a projection, in other silently when not."""
    class XAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E) for _ in range(4))
            setattr(self, child, nn.Linear(E, E))

    if flagged:
        with pytest.raises(ValueError, match=rf"in XAttention but that no family or rule places: {child}.weight, "
                                             rf"{child}.bias\."):
            knob.knob_optimizer(XAttention(), "sgd")
    else:
        _, rep = knob.knob_optimizer(XAttention(), "sgd")
        assert {e.tensor: e.group for e in rep.entries}[f"{child}.weight"] == "other"
