"""Tests of qkov_lib.knob: qk/ov/other groups for standard attention modules.

For every supported module family: the re-registration of packed tensors leaves outputs and
gradients unchanged, and one optimizer step moves every tensor and every slice by exactly the
learning rate of its group, for SGD (``-lr g``) and for AdamW (first step:
``-lr (wd p + g / (|g| + eps))``, i.e. ``lr`` per element up to weight decay). Reference gradients
come from an untouched copy of the model, so a wrong slice or group cannot pass.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from qkov_lib import knob
from qkov_lib.models import TokenModel

E, H = 8, 2
ETA_OV, RATIO, ETA_OTHER = 0.01, 10.0, 0.001
LRS = {"qk": ETA_OV * RATIO, "ov": ETA_OV, "other": ETA_OTHER}


# --- tiny models with Hugging Face attribute names (built locally, nothing downloaded) -----
def attend(q, k, v, n_heads=H):
    """Multi-head softmax attention over (B, T, E) projections."""
    B, T, D = q.shape
    sh = lambda t: t.view(B, t.shape[1], n_heads, -1).transpose(1, 2)  # noqa: E731
    a = torch.softmax(sh(q) @ sh(k).transpose(-1, -2) / math.sqrt(D // n_heads), -1)
    return (a @ sh(v)).transpose(1, 2).reshape(B, T, -1)


class Conv1D(nn.Module):
    """HF GPT-2 Conv1D: weight stored transposed (nx, nf), ``y = x W + b``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(0.3 * torch.randn(nx, nf))
        self.bias = nn.Parameter(0.1 * torch.randn(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


class LlamaAttention(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(E, E, bias=bias) for _ in range(3))
        self.o_proj = nn.Linear(E, E, bias=bias)

    def forward(self, x):
        return self.o_proj(attend(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class LlamaMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(E, 16), nn.Linear(E, 16), nn.Linear(16, E)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.input_layernorm, blk.self_attn = nn.LayerNorm(E), LlamaAttention()
            blk.post_attention_layernorm, blk.mlp = nn.LayerNorm(E), LlamaMLP()
            self.layers.append(blk)

    def forward(self, x):
        for b in self.layers:
            x = x + b.self_attn(b.input_layernorm(x))
            x = x + b.mlp(b.post_attention_layernorm(x))
        return x


class BartAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(E, E) for _ in range(3))
        self.out_proj = nn.Linear(E, E)

    def forward(self, x):
        return self.out_proj(attend(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class BartLike(nn.Module):
    """q_proj/k_proj/v_proj/out_proj attention plus a classification head whose ``out_proj``
    is no attention output (it must stay ``other``)."""

    def __init__(self):
        super().__init__()
        self.self_attn = BartAttention()
        self.classifier = nn.Module()
        self.classifier.dense, self.classifier.out_proj = nn.Linear(E, E), nn.Linear(E, 3)

    def forward(self, x):
        h = x + self.self_attn(x)
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(h)))


class BertLike(nn.Module):
    """BERT names: attention.self.query/key/value, attention.output.dense (O, ``ov``) and the
    feed-forward intermediate.dense / output.dense (``other``)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList()
        for _ in range(2):
            lay = nn.Module()
            lay.attention = nn.Module()
            lay.attention.self = nn.Module()
            lay.attention.self.query, lay.attention.self.key, lay.attention.self.value = (nn.Linear(E, E) for _ in range(3))
            lay.attention.output = nn.Module()
            lay.attention.output.dense, lay.attention.output.LayerNorm = nn.Linear(E, E), nn.LayerNorm(E)
            lay.intermediate = nn.Module()
            lay.intermediate.dense = nn.Linear(E, 16)
            lay.output = nn.Module()
            lay.output.dense, lay.output.LayerNorm = nn.Linear(16, E), nn.LayerNorm(E)
            self.encoder.layer.append(lay)

    def forward(self, x):
        for lay in self.encoder.layer:
            s, o = lay.attention.self, lay.attention.output
            x = o.LayerNorm(x + o.dense(attend(s.query(x), s.key(x), s.value(x))))
            x = lay.output.LayerNorm(x + lay.output.dense(torch.relu(lay.intermediate.dense(x))))
        return x


class GPT2Like(nn.Module):
    """GPT-2 names: attn.c_attn (packed Q|K|V columns of a transposed Conv1D weight),
    attn.c_proj (O), mlp.c_fc / mlp.c_proj (``other``); optionally a cross-attention block with
    q_attn (Q) and c_attn holding K|V; ``linear=True`` builds nanoGPT-style nn.Linear layers."""

    def __init__(self, cross=False, linear=False):
        super().__init__()
        lin = (lambda nf, nx: nn.Linear(nx, nf)) if linear else Conv1D  # noqa: E731
        self.h = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.ln_1, blk.ln_2 = nn.LayerNorm(E), nn.LayerNorm(E)
            blk.attn = nn.Module()
            blk.attn.c_attn, blk.attn.c_proj = lin(3 * E, E), lin(E, E)
            if cross:
                blk.crossattention = nn.Module()
                blk.crossattention.q_attn = lin(E, E)
                blk.crossattention.c_attn, blk.crossattention.c_proj = lin(2 * E, E), lin(E, E)
            blk.mlp = nn.Module()
            blk.mlp.c_fc, blk.mlp.c_proj = lin(16, E), lin(E, 16)
            self.h.append(blk)
        self.cross = cross

    def forward(self, x):
        for b in self.h:
            q, k, v = b.attn.c_attn(b.ln_1(x)).split(E, dim=-1)
            x = x + b.attn.c_proj(attend(q, k, v))
            if self.cross:
                c = b.crossattention
                k, v = c.c_attn(x.flip(1)).split(E, dim=-1)
                x = x + c.c_proj(attend(c.q_attn(x), k, v))
            x = x + b.mlp.c_proj(torch.relu(b.mlp.c_fc(b.ln_2(x))))
        return x


class T5Like(nn.Module):
    def __init__(self):
        super().__init__()
        self.SelfAttention = nn.Module()
        for n in "qkvo":
            setattr(self.SelfAttention, n, nn.Linear(E, E, bias=False))
        self.wi = nn.Linear(E, E)

    def forward(self, x):
        a = self.SelfAttention
        return self.wi(x + a.o(attend(a.q(x), a.k(x), a.v(x))))


class MHAModel(nn.Module):
    """nn.MultiheadAttention self-attention; with kdim/vdim != E the weights are separate
    (q/k/v_proj_weight) and only the bias is packed."""

    def __init__(self, separate=False, bias_kv=False):
        super().__init__()
        kd = 6 if separate else None
        self.attn = nn.MultiheadAttention(E, H, batch_first=True, kdim=kd, vdim=kd, add_bias_kv=bias_kv)
        with torch.no_grad():  # non-zero biases so that every slice matters
            self.attn.in_proj_bias.normal_(0, 0.1)
        self.mem = nn.Linear(E, 6) if separate else None
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        kv = self.mem(x) if self.mem is not None else x
        return self.head(self.attn(x, kv, kv, need_weights=False)[0])


class EncoderModel(nn.Module):
    def __init__(self, n_layers=None, norm_first=False):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.enc = layer if n_layers is None else nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x)


class DecoderModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(E, H, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.dec(x, x.flip(1))


class QKOVModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = TokenModel(11, E, 3, max_len=5, parameterization="FAFO", init_scale=0.3,
                            generator=torch.Generator().manual_seed(0))

    def forward(self, x):
        tokens = (x.abs().sum(-1) * 10).long() % 11
        return self.m(tokens, torch.ones_like(tokens, dtype=torch.bool))[0]


FAMILIES = {
    "mha": lambda: MHAModel(),
    "mha_bias_kv": lambda: MHAModel(bias_kv=True),
    "mha_kdim": lambda: MHAModel(separate=True),
    "encoder_layer": lambda: EncoderModel(),
    "encoder": lambda: EncoderModel(n_layers=2, norm_first=True),
    "decoder_layer": lambda: DecoderModel(),
    "llama": LlamaLike,
    "bart": BartLike,
    "bert": BertLike,
    "gpt2": lambda: GPT2Like(),
    "gpt2_cross": lambda: GPT2Like(cross=True),
    "nanogpt_linear": lambda: GPT2Like(linear=True),
    "t5": T5Like,
    "qkov": QKOVModel,
}


# scalars in the qk group of each family, counted by hand: Q and K weights (+ biases)
QKB = 2 * E * E + 2 * E
QK_NUMEL = {"mha": QKB, "mha_bias_kv": QKB + E, "mha_kdim": E * E + E * 6 + 2 * E, "encoder_layer": QKB,
            "encoder": 2 * QKB, "decoder_layer": 2 * QKB, "llama": 2 * 2 * E * E, "bart": QKB, "bert": 2 * QKB,
            "gpt2": 2 * QKB, "gpt2_cross": 4 * QKB, "nanogpt_linear": 2 * QKB, "t5": 2 * E * E, "qkov": 2 * E * E}
# the group each part label must land in (independent of the library's table)
EXPECTED_GROUP = {"Q": "qk", "K": "qk", "V": "ov", "O": "ov", "W_Q": "qk", "W_K": "qk", "W_QK": "qk",
                  "W_V": "ov", "W_O": "ov", "W_OV": "ov", "-": "other"}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[name]().double()


def inputs() -> torch.Tensor:
    return torch.randn(3, 5, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    return (out * w).sum() + 0.1 * (out ** 2).sum()


def reference(model: nn.Module, x: torch.Tensor) -> tuple[dict, dict]:
    """Parameters and autograd gradients of an untouched model, by name."""
    model.zero_grad()
    loss_of(model, x).backward()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.grad.detach().clone() for n, p in model.named_parameters()})


# --- the per-slice update check ------------------------------------------------------------
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_step_moves_each_slice_by_its_group_rate(family, opt):
    model, x = build(family), inputs()
    ref = copy.deepcopy(model)
    p0, g = reference(ref, x)
    out_before = ref(x)
    wd = 0.05 if opt == "adamw" else 0.0
    # no_decay=None: weight decay on every tensor, so that wd * p is expected everywhere below
    groups, report = knob.knob_groups(model, ETA_OV, RATIO, ETA_OTHER, weight_decay=wd, no_decay=None)

    # the re-registration changes nothing before a step: same outputs, same gradients
    assert torch.equal(model(x), out_before)  # exact: the recomposed weight has the same values and layout, so the same kernel runs
    assert {gr["name"]: gr["lr"] for gr in groups} == {k: v for k, v in LRS.items() if k in {gr["name"] for gr in groups}}
    # every scalar of every original tensor is covered exactly once
    covered = {}
    for e in report.entries:
        covered[e.tensor] = covered.get(e.tensor, 0) + e.numel
    assert covered == {n: t.numel() for n, t in p0.items()}
    assert all(e.group == EXPECTED_GROUP[e.part] for e in report.entries)
    assert sum(e.numel for e in report.entries if e.group == "qk") == QK_NUMEL[family]

    eps = 1e-8
    optim = torch.optim.SGD(groups) if opt == "sgd" else torch.optim.AdamW(groups, eps=eps)
    optim.zero_grad()
    loss_of(model, x).backward()
    optim.step()

    for e in report.entries:
        idx, lr = e.index, LRS[e.group]
        delta = (knob.tensor_value(model, e.tensor).detach() - p0[e.tensor])[idx]
        gi, pi = g[e.tensor][idx], p0[e.tensor][idx]
        if opt == "sgd":
            expected = -lr * gi
        else:
            expected = -lr * (wd * pi + gi / (gi.abs() + eps))
            big = gi.abs() > 1e-5  # Adam's first step: |move| = lr up to eps, where the gradient is not ~0
            assert torch.allclose((delta + lr * wd * pi)[big].abs(), torch.full_like(gi[big], lr), rtol=1e-3)
        assert torch.allclose(delta, expected, rtol=1e-7, atol=1e-13), f"{e.where} ({e.group})"


def test_slices_of_different_groups_move_by_rates_in_ratio():
    """In one packed in_proj_weight, the Q/K rows move RATIO times as far as the V rows (AdamW)."""
    model, x = build("mha"), inputs()
    p0 = model.attn.in_proj_weight.detach().clone()
    opt, _ = knob.knob_optimizer(model, "adamw", ETA_OV, RATIO, other_lr=ETA_OTHER)
    loss_of(model, x).backward()
    opt.step()
    move = (model.attn.in_proj_weight.detach() - p0).abs()
    q, k, v = move.split(E)
    assert torch.allclose(q.median() / v.median(), torch.tensor(RATIO, dtype=q.dtype), rtol=1e-3)
    assert torch.allclose(k.median() / v.median(), torch.tensor(RATIO, dtype=q.dtype), rtol=1e-3)


def test_eval_fast_path_outputs_unchanged():
    """nn.TransformerEncoder in eval/no-grad mode (the fused fast path) still computes the same."""
    model, x = build("encoder"), inputs()
    ref = copy.deepcopy(model).eval()
    knob.knob_groups(model, ETA_OV, RATIO)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), atol=1e-12)


# --- the report ----------------------------------------------------------------------------
def groups_by_tensor(report):
    return {e.where: e.group for e in report.entries}


def test_report_mha_slices_and_text():
    model = build("mha_bias_kv")
    _, rep = knob.knob_groups(model, ETA_OV, RATIO)
    by = groups_by_tensor(rep)
    assert by[f"attn.in_proj_weight[0:{E}, :]"] == "qk"
    assert by[f"attn.in_proj_weight[{E}:{2 * E}, :]"] == "qk"
    assert by[f"attn.in_proj_weight[{2 * E}:{3 * E}, :]"] == "ov"
    assert by[f"attn.in_proj_bias[{2 * E}:{3 * E}]"] == "ov"
    assert by["attn.bias_k"] == "qk" and by["attn.bias_v"] == "ov"
    assert by["attn.out_proj.weight"] == "ov" and by["head.weight"] == "other"
    text = str(rep)
    assert "in_proj_weight[0:8, :]" in text and "lr 0.1" in text and "lr 0.01" in text
    frame = rep.frame()
    assert set(frame["group"]) == {"qk", "ov", "other"}
    assert rep.summary().loc["qk", "numel"] == 2 * E * E + 2 * E + E  # Q, K rows, their biases, bias_k


def test_report_name_patterns():
    rep = knob.classify(build("bert"))
    by = groups_by_tensor(rep)
    assert by["encoder.layer.0.attention.self.query.weight"] == "qk"
    assert by["encoder.layer.0.attention.self.value.bias"] == "ov"
    assert by["encoder.layer.0.attention.output.dense.weight"] == "ov"
    assert by["encoder.layer.0.attention.output.LayerNorm.weight"] == "other"
    assert by["encoder.layer.0.output.dense.weight"] == "other"  # the feed-forward output
    by = groups_by_tensor(knob.classify(build("bart")))
    assert by["self_attn.out_proj.weight"] == "ov" and by["classifier.out_proj.weight"] == "other"
    rep = knob.classify(build("gpt2"))
    by = groups_by_tensor(rep)
    assert by[f"h.0.attn.c_attn.weight[:, 0:{E}]"] == "qk"  # transposed: Q is the first columns
    assert by[f"h.0.attn.c_attn.weight[:, {2 * E}:{3 * E}]"] == "ov"
    assert by["h.0.attn.c_proj.weight"] == "ov" and by["h.0.mlp.c_proj.weight"] == "other"
    by = groups_by_tensor(knob.classify(build("gpt2_cross")))
    assert by["h.0.crossattention.q_attn.weight"] == "qk"
    assert by[f"h.0.crossattention.c_attn.weight[:, 0:{E}]"] == "qk"  # K
    assert by[f"h.0.crossattention.c_attn.weight[:, {E}:{2 * E}]"] == "ov"  # V
    by = groups_by_tensor(knob.classify(build("nanogpt_linear")))
    assert by[f"h.0.attn.c_attn.weight[0:{E}, :]"] == "qk"  # nn.Linear: rows
    by = groups_by_tensor(knob.classify(build("qkov")))
    assert by["m.attention.W_Q"] == "qk" and by["m.attention.W_O"] == "ov" and by["m.embed.weight"] == "other"


def test_classify_does_not_change_the_model():
    model = build("mha")
    names = [n for n, _ in model.named_parameters()]
    rep = knob.classify(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(e.parameter == "" for e in rep.entries if e.dim is not None)


def test_frozen_parameters_are_left_out():
    model = build("llama")
    model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    groups, rep = knob.knob_groups(model, ETA_OV, RATIO)
    assert "layers.0.self_attn.q_proj.weight" not in groups_by_tensor(rep)
    assert all(p.requires_grad for gr in groups for p in gr["params"])


# --- splitting, idempotence, merging -------------------------------------------------------
def test_split_is_idempotent_and_merge_restores_layout():
    model, x = build("encoder"), inputs()
    ref = copy.deepcopy(model)
    g1, _ = knob.knob_groups(model, ETA_OV, RATIO)
    g2, _ = knob.knob_groups(model, ETA_OV, RATIO)  # a second call finds the slices already split
    assert [[id(p) for p in g["params"]] for g in g1] == [[id(p) for p in g["params"]] for g in g2]
    opt = torch.optim.SGD(g1)
    loss_of(model, x).backward()
    opt.step()
    expected = model(x).detach()
    assert list(model.state_dict()) == list(ref.state_dict())  # the split model saves the original keys
    copy_ = knob.unsplit(model)
    assert list(copy_.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in copy_.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert torch.equal(copy_(x), expected)
    # merging the copy must not break the original (deep copies share the parametrized class)
    assert torch.equal(model(x), expected)  # exact: same values, same layout, same kernel
    assert type(copy_.enc.layers[0].self_attn) is nn.MultiheadAttention
    # in place, the optimizer would lose the merged tensor: refused, nothing changed
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match="would silently stop updating"):
        knob.merge_packed(model)
    assert [n for n, _ in model.named_parameters()] == names
    fresh = build("encoder")
    knob.split_packed(fresh)  # no optimizer holds these slices yet: an in-place merge is fine
    assert "enc.layers.0.self_attn.in_proj_weight" in knob.merge_packed(fresh)
    assert [n for n, _ in fresh.named_parameters()] == [n for n, _ in ref.named_parameters()]


def test_split_false_refuses_packed_tensors():
    with pytest.raises(ValueError, match="split=True"):
        knob.knob_groups(build("mha"), ETA_OV, RATIO, split=False)
    groups, _ = knob.knob_groups(build("llama"), ETA_OV, RATIO, split=False)  # nothing packed: fine
    assert [g["name"] for g in groups] == ["qk", "ov", "other"]


# --- clear errors --------------------------------------------------------------------------
def test_error_when_nothing_is_recognised():
    with pytest.raises(ValueError, match="no attention parameters recognised"):
        knob.knob_groups(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), ETA_OV, RATIO)
    lone = nn.Module()
    lone.out_proj = nn.Linear(4, 2)  # an output projection without Q and K siblings is not attention
    with pytest.raises(ValueError, match="no attention parameters recognised"):
        knob.classify(lone)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        knob.classify("model")


def test_error_on_tied_weights_in_different_groups():
    model = build("llama")
    model.layers[0].self_attn.o_proj.weight = model.layers[0].self_attn.k_proj.weight
    with pytest.raises(ValueError, match=r"tied weights in different groups: layers.0.self_attn.k_proj.weight \(K.*"
                                         r"and layers.0.self_attn.o_proj.weight \(O"):
        knob.classify(model)
    # the rule the message names places the tied tensor whole, as it says
    rep = knob.classify(model, rules={r"^layers\.0\.self_attn\.k_proj\.weight$": "qk"})
    assert groups_by_tensor(rep)["layers.0.self_attn.k_proj.weight"] == "qk"


def test_error_on_packed_tensor_that_does_not_split():
    model = build("gpt2")
    model.h[0].attn.c_attn = Conv1D(3 * E + 1, E).double()
    with pytest.raises(ValueError, match="does not split"):
        knob.classify(model)


def test_error_on_unknown_packed_layout():
    class Weird(nn.Module):  # neither nn.Linear nor HF Conv1D, square weight: which dim is packed?
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(6, 6))

    model = nn.Module()
    model.c_attn, model.c_proj = Weird(), nn.Linear(2, 2)
    with pytest.raises(ValueError, match="cannot tell which dim"):
        knob.classify(model)


def test_error_on_unsupported_packed_names_and_rules_resolve_it():
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.query_key_value, model.attn.dense = nn.Linear(E, 3 * E), nn.Linear(E, E)
    model.attn.q_proj, model.attn.k_proj = nn.Linear(E, E), nn.Linear(E, E)
    with pytest.raises(ValueError, match="ambiguous attention tensor"):
        knob.classify(model)
    rep = knob.classify(model, rules={r"query_key_value": "other"})
    assert groups_by_tensor(rep)["attn.query_key_value.weight"] == "other"
    rep = knob.classify(model, rules={"query_key_value": "other", "q_proj": "ov"})  # rules override families
    assert groups_by_tensor(rep)["attn.q_proj.weight"] == "ov"
    with pytest.raises(ValueError, match="names group"):
        knob.classify(model, rules={"x": "attention"})


def test_error_when_only_output_side_is_found():
    model = nn.Module()
    model.attention = nn.Module()
    model.attention.output = nn.Module()
    model.attention.output.dense = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no trainable query/key parameters"):
        knob.classify(model)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="ratio"):
        knob.knob_groups(build("llama"), ETA_OV, 0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        knob.knob_groups(build("llama"), ETA_OV, 1.0, weight_decay=-1.0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        knob.knob_optimizer(build("llama"), "lion")


# --- real models built from small configs (transformers, transformer-lens; nothing downloaded) --
# These run wherever the test requirements are installed (CI included): a missing package is an
# error, not a skip. Which features of an attention-input weight are Q/K is read off the model's
# own forward, independently of the library: a feature is Q or K exactly when it changes the
# attention probabilities of its layer (V features get an exactly zero gradient there).
@dataclass(frozen=True)
class RealCase:
    """A real model class built from a tiny config. ``attn_in`` matches the weights that produce
    Q, K and V (group 1: the layer index), ``in_dim`` is their input dim, ``out`` matches the
    output projection's tensors (``ov``), ``family`` is the report's label for the Q/K/V
    tensors, ``fused``: Q, K and V share one tensor."""

    build: Callable[[], nn.Module]
    run: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]
    attn_in: str
    out: str
    family: str
    in_dim: int = 1
    fused: bool = False


def _jitter(model: nn.Module) -> nn.Module:
    """Add N(0, 0.1^2) noise to every parameter (zero-initialised biases and near-uniform
    attention would hide a misplaced slice), in float64, eval mode."""
    model = model.double().eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def hf(model_cls: str, cfg_cls: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, cfg_cls)(**kw)
        cfg._attn_implementation = "eager"  # returns the attention probabilities
        torch.manual_seed(0)
        return _jitter(getattr(transformers, model_cls)(cfg))
    return build


def hf_run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(input_ids=ids, output_attentions=True)
    return out.last_hidden_state, list(out.attentions)


def tl(**kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        torch.manual_seed(0)
        cfg = HookedTransformerConfig(n_layers=2, d_model=E, n_ctx=8, d_head=E // H, n_heads=H, d_vocab=20, d_mlp=16,
                                      act_fn="gelu", device="cpu", dtype=torch.float64, **kw)
        with warnings.catch_warnings():  # 3.x announces TransformerBridge; HookedTransformer is what we support
            warnings.simplefilter("ignore", DeprecationWarning)
            return _jitter(HookedTransformer(cfg))
    return build


def tl_run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    patterns: list[torch.Tensor] = []
    out = model.run_with_hooks(ids, return_type="logits",
                               fwd_hooks=[(lambda name: name.endswith("attn.hook_pattern"), lambda t, hook: patterns.append(t))])
    return out, patterns


NEOX = dict(num_hidden_layers=2, hidden_size=E, num_attention_heads=H, intermediate_size=16, vocab_size=20,
            max_position_embeddings=8)
FALCON = dict(num_hidden_layers=2, vocab_size=20, bias=True)
QKV_FALCON = r"h\.(\d+)\.self_attention\.query_key_value\.weight$"
REAL: dict[str, RealCase] = {
    "gpt2": RealCase(hf("GPT2Model", "GPT2Config", n_layer=2, n_embd=E, n_head=H, vocab_size=20, n_positions=8),
                     hf_run, r"h\.(\d+)\.attn\.c_attn\.weight$", r"\.attn\.c_proj\.", "GPT-2 c_attn/c_proj", 0, True),
    "bert": RealCase(hf("BertModel", "BertConfig", num_hidden_layers=2, hidden_size=E, num_attention_heads=H,
                        intermediate_size=16, vocab_size=20, max_position_embeddings=8),
                     hf_run, r"layer\.(\d+)\.attention\.self\.(query|key|value)\.weight$", r"attention\.output\.dense\.",
                     "query/key/value"),
    "llama": RealCase(hf("LlamaModel", "LlamaConfig", num_hidden_layers=2, hidden_size=E, num_attention_heads=H,
                         num_key_value_heads=1, intermediate_size=16, vocab_size=20, max_position_embeddings=8),
                      hf_run, r"layers\.(\d+)\.self_attn\.[qkv]_proj\.weight$", r"self_attn\.o_proj\.",
                      "q_proj/k_proj/v_proj/o_proj"),
    # Hugging Face qk-norms (RMSNorm gains on Q and K per head, before the scores) go with Q and K
    "qwen3": RealCase(hf("Qwen3Model", "Qwen3Config", num_hidden_layers=2, hidden_size=E, num_attention_heads=H,
                         num_key_value_heads=1, head_dim=E // H, intermediate_size=16, vocab_size=20,
                         max_position_embeddings=8),
                      hf_run, r"layers\.(\d+)\.self_attn\.([qkv]_proj|[qk]_norm)\.weight$", r"self_attn\.o_proj\.",
                      "q_proj/k_proj/v_proj/o_proj"),
    # Phi's qk_layernorm (LayerNorm gains and biases on Q and K per head) goes with Q and K
    "phi_qk_layernorm": RealCase(hf("PhiModel", "PhiConfig", qk_layernorm=True, **NEOX), hf_run,
                                 r"layers\.(\d+)\.self_attn\.([qkv]_proj|[qk]_layernorm)\.weight$",
                                 r"self_attn\.dense\.", "q_proj/k_proj/v_proj/o_proj"),
    "t5": RealCase(hf("T5EncoderModel", "T5Config", num_layers=2, d_model=E, d_kv=E // H, num_heads=H, d_ff=16,
                      vocab_size=20),
                   hf_run, r"block\.(\d+)\.layer\.0\.SelfAttention\.[qkv]\.weight$", r"SelfAttention\.o\.", "q/k/v/o (T5)"),
    "distilbert": RealCase(hf("DistilBertModel", "DistilBertConfig", n_layers=2, dim=E, n_heads=H, hidden_dim=16,
                              vocab_size=20, max_position_embeddings=8),
                           hf_run, r"layer\.(\d+)\.attention\.[qkv]_lin\.weight$", r"attention\.out_lin\.",
                           "q_lin/k_lin/v_lin/out_lin (DistilBERT)"),
    "phi": RealCase(hf("PhiModel", "PhiConfig", **NEOX), hf_run, r"layers\.(\d+)\.self_attn\.[qkv]_proj\.weight$",
                    r"self_attn\.dense\.", "q_proj/k_proj/v_proj/o_proj"),
    "gpt_neox": RealCase(hf("GPTNeoXModel", "GPTNeoXConfig", **NEOX), hf_run,
                         r"layers\.(\d+)\.attention\.query_key_value\.weight$", r"attention\.dense\.",
                         "GPT-NeoX query_key_value", 1, True),
    "falcon": RealCase(hf("FalconModel", "FalconConfig", hidden_size=E, num_attention_heads=H, multi_query=False,
                          new_decoder_architecture=False, **FALCON),
                       hf_run, QKV_FALCON, r"self_attention\.dense\.", "Falcon query_key_value", 1, True),
    "falcon_multi_query": RealCase(hf("FalconModel", "FalconConfig", hidden_size=E, num_attention_heads=H,
                                      multi_query=True, new_decoder_architecture=False, **FALCON),
                                   hf_run, QKV_FALCON, r"self_attention\.dense\.", "Falcon query_key_value", 1, True),
    "falcon_new_arch": RealCase(hf("FalconModel", "FalconConfig", hidden_size=16, num_attention_heads=4, num_kv_heads=2,
                                   new_decoder_architecture=True, **FALCON),
                                hf_run, QKV_FALCON, r"self_attention\.dense\.", "Falcon query_key_value", 1, True),
    "bloom": RealCase(hf("BloomModel", "BloomConfig", n_layer=2, hidden_size=E, n_head=H, vocab_size=20), hf_run,
                      QKV_FALCON, r"self_attention\.dense\.", "BLOOM query_key_value", 1, True),
    "mpt": RealCase(hf("MptModel", "MptConfig", n_layers=2, d_model=E, n_heads=H, vocab_size=20, max_seq_len=8,
                       expansion_ratio=2),
                    hf_run, r"blocks\.(\d+)\.attn\.Wqkv\.weight$", r"attn\.out_proj\.", "MPT Wqkv", 1, True),
    "modernbert": RealCase(hf("ModernBertModel", "ModernBertConfig", num_hidden_layers=2, hidden_size=E,
                              num_attention_heads=H, intermediate_size=16, vocab_size=20, max_position_embeddings=8,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                              attention_bias=True),
                           hf_run, r"layers\.(\d+)\.attn\.Wqkv\.weight$", r"attn\.Wo\.", "ModernBERT Wqkv", 1, True),
    "phi3": RealCase(hf("Phi3Model", "Phi3Config", num_hidden_layers=2, hidden_size=16, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=16, vocab_size=20, max_position_embeddings=8,
                        pad_token_id=0),
                     hf_run, r"layers\.(\d+)\.self_attn\.qkv_proj\.weight$", r"self_attn\.o_proj\.", "Phi-3 qkv_proj",
                     1, True),
    "gpt_bigcode": RealCase(hf("GPTBigCodeModel", "GPTBigCodeConfig", n_layer=2, n_embd=E, n_head=H, vocab_size=20,
                               n_positions=8, multi_query=False),
                            hf_run, r"h\.(\d+)\.attn\.c_attn\.weight$", r"\.attn\.c_proj\.", "GPT-BigCode c_attn", 1, True),
    "gpt_bigcode_multi_query": RealCase(hf("GPTBigCodeModel", "GPTBigCodeConfig", n_layer=2, n_embd=E, n_head=H,
                                           vocab_size=20, n_positions=8, multi_query=True),
                                        hf_run, r"h\.(\d+)\.attn\.c_attn\.weight$", r"\.attn\.c_proj\.",
                                        "GPT-BigCode c_attn", 1, True),
    "transformer_lens": RealCase(tl(), tl_run, r"blocks\.(\d+)\.attn\.(W_Q|W_K|W_V)$", r"\.attn\.[Wb]_O$",
                                 "TransformerLens W_Q/W_K/W_V/W_O"),
    "transformer_lens_gqa": RealCase(tl(n_key_value_heads=1), tl_run, r"blocks\.(\d+)\.attn\.(W_Q|_W_K|_W_V)$",
                                     r"\.attn\.[Wb]_O$", "TransformerLens W_Q/W_K/W_V/W_O"),
}


def token_ids() -> torch.Tensor:
    return torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(3))


def bias_name(weight: str) -> str:
    """The bias of an attention-input weight: ``x.weight`` -> ``x.bias``, ``W_Q`` -> ``b_Q``."""
    return weight[: -len("weight")] + "bias" if weight.endswith(".weight") else re.sub(r"W_(\w)$", r"b_\1", weight)


def qk_features(model: nn.Module, case: RealCase, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """For every attention-input weight (by name), a bool mask over its output features: True
    where the feature changes the attention probabilities of its own layer (Q or K), False where
    it does not (V: exactly zero gradient). Read off the model's forward, not the library."""
    params = dict(model.named_parameters())
    layer_of = {n: int(m.group(1)) for n in params if (m := re.search(case.attn_in, n))}
    assert layer_of, f"no weight matches {case.attn_in}"
    masks = {}
    for layer in sorted(set(layer_of.values())):
        model.zero_grad()
        probs = case.run(model, ids)[1][layer]
        w = torch.randn(probs.shape, generator=torch.Generator().manual_seed(5 + layer), dtype=probs.dtype)
        (probs * w).sum().backward()
        for n, l in layer_of.items():
            if l == layer:
                grad = params[n].grad  # None: not in the graph of the probabilities at all (V)
                grad = torch.zeros_like(params[n]) if grad is None else grad
                # a weight: per output feature; a 1-D gain (qk-norm): per element
                masks[n] = (grad != 0).any(dim=case.in_dim) if grad.dim() > 1 else grad != 0
    model.zero_grad()
    return masks


def rate_map(name: str, shape: tuple[int, ...], case: RealCase, masks: dict[str, torch.Tensor]) -> torch.Tensor:
    """The learning rate each element of tensor ``name`` must get, from the forward-derived masks
    (Q/K features: eta_ov * ratio, V features: eta_ov), the output projection (eta_ov) and
    everything else (eta_other)."""
    biases = {bias_name(w): w for w in masks}
    if name in masks:
        qk = masks[name].unsqueeze(case.in_dim) if len(shape) > 1 else masks[name]
    elif name in biases:
        qk = masks[biases[name]]
    else:
        lr = LRS["ov"] if re.search(case.out, name) else LRS["other"]
        return torch.full(shape, lr, dtype=torch.float64)
    rate = torch.tensor([LRS["ov"], LRS["qk"]], dtype=torch.float64)
    return rate[qk.long()].expand(shape)


def loss_on(out: torch.Tensor) -> torch.Tensor:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    return (out * w).sum() + 0.1 * (out ** 2).sum()


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("case", list(REAL))
def test_real_model_split_and_one_step(case, opt):
    """For a real model class: the forward says which features are Q/K; the report agrees; the
    split changes no output bit; one step moves every element by the rate of its group."""
    c, ids = REAL[case], token_ids()
    model = c.build()
    masks = qk_features(copy.deepcopy(model), c, ids)
    for n, m in masks.items():  # fused: both kinds of features in one tensor; separate: one kind
        assert (m.any() and not m.all()) if c.fused else (m.all() or not m.any()), n
    assert any(m.any() for m in masks.values()) and not all(m.all() for m in masks.values())
    ref = copy.deepcopy(model)
    p0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out_ref = c.run(ref, ids)[0]
    loss_on(out_ref).backward()
    g = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}

    wd = 0.05 if opt == "adamw" else 0.0
    groups, rep = knob.knob_groups(model, ETA_OV, RATIO, ETA_OTHER, weight_decay=wd, no_decay=None)
    out = c.run(model, ids)[0]
    assert torch.equal(out, out_ref)  # bit-identical after the split
    # the report puts every slice where the forward says it belongs
    for e in rep.entries:
        lr = rate_map(e.tensor, p0[e.tensor].shape, c, masks)[e.index]
        assert torch.all(lr == LRS[e.group]), f"{e.where}: {e.group}"
        if e.tensor in masks:
            assert e.family == c.family
    assert sum(e.numel for e in rep.entries if e.group == "qk") == sum(
        int((rate_map(n, t.shape, c, masks) == LRS["qk"]).sum()) for n, t in p0.items())

    eps = 1e-8
    optim = torch.optim.SGD(groups) if opt == "sgd" else torch.optim.AdamW(groups, eps=eps)
    optim.zero_grad()
    loss_on(c.run(model, ids)[0]).backward()
    optim.step()
    assert_one_step(model, p0, g, lambda n, shape: rate_map(n, shape, c, masks), opt, wd, eps)


def assert_one_step(model: nn.Module, p0: dict, g: dict, rates: Callable, opt: str, wd: float, eps: float) -> None:
    """Every tensor of ``p0`` (values before the step) moved by one step at the rate
    ``rates(name, shape)`` of each element, from the reference gradients ``g``: SGD ``-lr g``,
    AdamW's first step ``-lr (wd p + g / (|g| + eps))``."""
    for n, p in p0.items():
        delta = knob.tensor_value(model, n).detach() - p
        lr = rates(n, p.shape)
        if n not in g:  # no gradient (unused): no step, no weight decay
            expected = torch.zeros_like(p)
        elif opt == "sgd":
            expected = -lr * g[n]
        else:
            expected = -lr * (wd * p + g[n] / (g[n].abs() + eps))
        assert torch.allclose(delta, expected, rtol=1e-7, atol=1e-13), n


def test_real_layouts_in_the_report():
    """Hand-read slices: GPT-NeoX interleaves [n_heads, 3, d_head]; Falcon's multi-query layout
    is [Q; one K head; one V head]; Phi-3 stacks [Q; K; V] with grouped-query sizes."""
    d = E // H
    rep = knob.classify(REAL["gpt_neox"].build())
    by = {e.where: e.part for e in rep.entries if "layers.0.attention.query_key_value" in e.tensor}
    w = "layers.0.attention.query_key_value.weight"
    assert [by[f"{w}[{i * d}:{(i + 1) * d}, :]"] for i in range(3 * H)] == list("QKV" * H)
    assert by[f"layers.0.attention.query_key_value.bias[{d}:{2 * d}]"] == "K"
    rep = knob.classify(REAL["falcon_multi_query"].build())
    parts = [(e.part, e.start, e.stop) for e in rep.entries if e.tensor == "h.0.self_attention.query_key_value.weight"]
    assert parts == [("Q", 0, E), ("K", E, E + d), ("V", E + d, E + 2 * d)]
    rep = knob.classify(REAL["phi3"].build())  # 4 heads of 4, 2 KV heads
    parts = [(e.part, e.start, e.stop) for e in rep.entries if e.tensor == "layers.0.self_attn.qkv_proj.weight"]
    assert parts == [("Q", 0, 16), ("K", 16, 24), ("V", 24, 32)]
    rep = knob.classify(REAL["transformer_lens"].build())
    by = groups_by_tensor(rep)
    assert by["blocks.0.attn.b_K"] == "qk" and by["blocks.0.attn.b_O"] == "ov" and by["blocks.0.mlp.W_in"] == "other"
    assert by["embed.W_E"] == "other" and by["unembed.W_U"] == "other"


def test_layout_helpers_hand_cases():
    assert knob.interleaved_layout(2, 3) == (("Q", 3), ("K", 3), ("V", 3), ("Q", 3), ("K", 3), ("V", 3))
    assert knob.grouped_layout(4, 2, 2) == (("Q", 4), ("K", 2), ("V", 2), ("Q", 4), ("K", 2), ("V", 2))
    assert knob.grouped_layout(2, 2, 3) == knob.interleaved_layout(2, 3)  # one query head per KV head
    assert knob.stacked_layout(8, 2, 2) == (("Q", 8), ("K", 2), ("V", 2))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        knob.grouped_layout(4, 3, 2)


def test_interleaved_split_merges_back_to_the_original_layout():
    """After a step on a split GPT-NeoX, unsplit gives the original state-dict layout with
    the trained values (and the model computes the same)."""
    c, ids = REAL["gpt_neox"], token_ids()
    model = c.build()
    keys = list(model.state_dict())
    opt, rep = knob.knob_optimizer(model, "adamw", ETA_OV, RATIO)
    # one leaf per run of same-group rows: per head Q+K, then V (not 3 per head)
    pk = model.layers[0].attention.query_key_value.parametrizations.weight[0]
    assert pk.parts == ("QK", "V") * H and pk.sizes == [2 * (E // H), E // H] * H
    leaves = {e.parameter for e in rep.entries if e.tensor == "layers.0.attention.query_key_value.weight"}
    assert len(leaves) == 2 * H and sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    loss_on(c.run(model, ids)[0]).backward()
    opt.step()
    expected = c.run(model, ids)[0].detach()
    packed = knob.tensor_value(model, "layers.1.attention.query_key_value.weight").detach().clone()
    assert list(model.state_dict()) == keys
    merged = knob.unsplit(model)
    assert not any("parametrizations" in n for n, _ in merged.named_parameters())
    assert list(merged.state_dict()) == keys
    assert torch.equal(merged.state_dict()["layers.1.attention.query_key_value.weight"], packed)
    assert torch.equal(c.run(merged, ids)[0], expected)  # exact: the merged tensor is the packed one


def test_unknown_fused_layouts_are_refused():
    """Fused projections whose layout is not checked here keep the clear error: a real model
    (GPT-NeoX-Japanese's query_key_value, CodeGen's qkv_proj) and remote-code style Phi ``Wqkv``."""
    import transformers

    jp = transformers.GPTNeoXJapaneseModel(transformers.GPTNeoXJapaneseConfig(
        num_hidden_layers=1, hidden_size=E, num_attention_heads=H, intermediate_multiple_size=2, vocab_size=20,
        max_position_embeddings=8))
    with pytest.raises(ValueError, match="GPTNeoXJapaneseAttention looks like a packed projection"):
        knob.classify(jp)
    cg = transformers.CodeGenModel(transformers.CodeGenConfig(n_layer=1, n_embd=16, n_head=4, rotary_dim=2,
                                                              vocab_size=20, n_positions=8))
    with pytest.raises(ValueError, match="'qkv_proj' in CodeGenAttention"):
        knob.classify(cg)

    class MHA(nn.Module):  # the pre-integration Phi remote code: mixer.Wqkv + mixer.out_proj
        def __init__(self):
            super().__init__()
            self.Wqkv, self.out_proj = nn.Linear(E, 3 * E), nn.Linear(E, E)

    with pytest.raises(ValueError, match="fused layouts checked against their models are GPTNeoXAttention"):
        knob.classify(nn.Sequential(MHA()))
    # a verified class with a tensor that does not fit its layout
    model = REAL["gpt_neox"].build()
    model.layers[0].attention.query_key_value = nn.Linear(E, 3 * E + 2).double()
    with pytest.raises(ValueError, match="layout GPT-NeoX query_key_value has 24"):
        knob.classify(model)


# --- the multi-layer chapter's model and measurements (qkov_lib.studies.multilayer) ------
from qkov_lib.data.batch import Batch  # noqa: E402
from qkov_lib.studies import multilayer as ml  # noqa: E402


def tiny_classifier(norm_first=True, seed=0):
    model = ml.EncoderClassifier(20, 3, 7, d_model=8, n_heads=2, n_layers=2, dim_ff=16,
                                 generator=torch.Generator().manual_seed(seed)).double()
    if not norm_first:
        for lay in model.encoder.layers:
            lay.norm_first = False
    return model


def padded_batch(seed=0, N=5, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 2, 6])[:N]
    key_mask = torch.arange(T)[None] >= (T - lengths)[:, None]
    tokens = torch.randint(3, 20, (N, T), generator=g) * key_mask
    relevant = key_mask & (torch.rand(N, T, generator=g) < 0.4)
    relevant[:, -1] = False
    relevant[0] = False
    relevant[0, 2] = True
    return Batch(tokens, key_mask, relevant, torch.randint(0, 3, (N,), generator=g))


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_with_attention_reproduces_the_encoder(norm_first):
    model, b = tiny_classifier(norm_first), padded_batch()
    x = model.embed_tokens(b.tokens)
    h, maps = ml.encoder_with_attention(model.encoder, x, ~b.key_mask)
    assert torch.allclose(h, model.encoder(x, src_key_padding_mask=~b.key_mask), atol=1e-12)
    assert len(maps) == 2 and maps[0].shape == (5, 2, 7, 7)
    assert torch.allclose(maps[1].sum(-1), torch.ones(5, 2, 7, dtype=torch.float64))
    for i in range(5):  # padded keys get exactly zero attention
        assert float(maps[0][i][..., ~b.key_mask[i]].detach().abs().sum()) == 0.0
    # the per-head rows match a hand computation of layer 1's attention
    lay = model.encoder.layers[0]
    z = lay.norm1(x)
    q, k, _ = torch.nn.functional.linear(z, lay.self_attn.in_proj_weight, lay.self_attn.in_proj_bias).split(8, -1)
    s = (q.view(5, 7, 2, 4).transpose(1, 2) @ k.view(5, 7, 2, 4).permute(0, 2, 3, 1)) / 2.0
    s = s.masked_fill(~b.key_mask[:, None, None, :], float("-inf"))
    if norm_first:
        assert torch.allclose(torch.softmax(s, -1), maps[0], atol=1e-12)


def test_forward_works_after_the_knob_split_and_training_is_deterministic():
    b = padded_batch()
    outs = []
    for _ in range(2):
        model = tiny_classifier()
        logits0, attn0 = model(b.tokens, b.key_mask)
        opt, _ = knob.knob_optimizer(model, "adamw", 1e-2, 10.0)
        logits1, attn1 = model(b.tokens, b.key_mask)
        assert torch.equal(logits0, logits1) and torch.equal(attn0, attn1)
        assert attn1.shape == (5, 2, 2, 7)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(b.tokens, b.key_mask)[0], b.y).backward()
            opt.step()
        outs.append(model(b.tokens, b.key_mask)[0].detach())
    assert torch.equal(outs[0], outs[1])


def test_rollout_hand_case():
    # one layer, one head, T=3: query row of (A + I)/2
    A = torch.tensor([[[[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]]]])
    r = ml.rollout([A])
    assert torch.allclose(r, torch.tensor([[0.1, 0.15, 0.75]]))
    # two layers: r2 = r1 (A + I)/2 with r1 the one-layer result
    r2 = ml.rollout([A, A])
    assert torch.allclose(r2, 0.5 * torch.tensor([[0.1, 0.15, 0.75]]) @ A[0, 0] + 0.5 * torch.tensor([[0.1, 0.15, 0.75]]))
    assert torch.allclose(r2.sum(-1), torch.ones(1))


def test_head_metrics_hand_case():
    # N=2, L=1, H=2, T=3; instance 1 has no relevant token and is left out
    attn = torch.tensor([[[[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]], [[[1.0, 0, 0], [1.0, 0, 0]]]])
    relevant = torch.tensor([[True, False, False], [False, False, False]])
    key_mask = torch.ones(2, 3, dtype=torch.bool)
    roll = torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]])
    f = ml.head_metrics(attn, roll, relevant, key_mask, tau=0.5).set_index(["layer", "head"])
    assert f.loc[(1, 1), "attn_relevant"] == pytest.approx(0.6) and f.loc[(1, 1), "AC"] == 1.0
    assert f.loc[(1, 2), "attn_relevant"] == pytest.approx(0.2) and f.loc[(1, 2), "focus"] == 0.0
    assert f.loc[(1, "mean"), "attn_relevant"] == pytest.approx(0.4)
    assert f.loc[("rollout", "-"), "attn_relevant"] == pytest.approx(0.5)
    assert f["uniform"].iloc[0] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no test instance"):
        ml.head_metrics(attn, roll, torch.zeros(2, 3, dtype=torch.bool), key_mask)


def test_length_batches_and_trim_padding():
    lengths = torch.randint(1, 30, (203,), generator=torch.Generator().manual_seed(0))
    batches = ml.length_batches(lengths, 16, torch.Generator().manual_seed(1), pool=4)
    assert sorted(torch.cat(batches).tolist()) == list(range(203))
    assert max(len(b) for b in batches) == 16
    again = ml.length_batches(lengths, 16, torch.Generator().manual_seed(1), pool=4)
    assert all(torch.equal(a, b) for a, b in zip(batches, again))
    model, b = tiny_classifier(), padded_batch()
    sub = b.index(torch.tensor([1, 3]))  # lengths 3 and 2: four all-padding columns
    t = ml.trim_padding(sub)
    assert t.tokens.shape == (2, 3)
    assert torch.allclose(model(t.tokens, t.key_mask)[0], model(sub.tokens, sub.key_mask)[0], atol=1e-12)


def test_changes_and_verdicts():
    rows = []
    for seed in (0, 1):
        for ratio, a in ((1.0, [0.5, 0.2]), (100.0, [0.8, 0.21])):
            for layer in (1, 2):
                for h, v in enumerate(a, start=1):
                    rows.append({"dataset": "d", "ratio": ratio, "seed": seed, "layer": layer, "head": h,
                                 "attn_relevant": v + (0.3 if layer == 2 and h == 2 and ratio == 100.0 else 0.0),
                                 "AC": 0.0, "focus": 0.0, "uniform": 0.1, "rank": float(h)})
    import pandas as pd

    heads = pd.DataFrame(rows)
    ch = ml.changes(heads, 1.0, 100.0).set_index(["layer", "rank"])
    assert ch.loc[(1, 1), "sharpened"] and not ch.loc[(1, 2), "sharpened"]
    assert ch.loc[(2, 2), "change"] == pytest.approx(0.31) and ch.loc[(2, 2), "sharpened"]
    # a gain in one seed and a loss in the other is no sharpening, whatever the mean
    mixed = heads.copy()
    sel = (mixed["seed"] == 1) & (mixed["ratio"] == 100.0) & (mixed["layer"] == 1) & (mixed["rank"] == 1)
    mixed.loc[sel, "attn_relevant"] = 0.45
    assert not ml.changes(mixed, 1.0, 100.0).set_index(["layer", "rank"]).loc[(1, 1), "sharpened"]
    assert ml._verdict([1, 2], 2, 2).startswith("yes, in every layer, with several")
    assert ml._verdict([1, 3], 1, 4) == "yes, in layers 1, 3 of 4, but in one head per layer"
    assert ml._verdict([2], 1, 2) == "only in layer 2, in a single head"
    assert ml._verdict([], 0, 2).startswith("no")
    # the carry table: layer 1's first head and both heads of layer 2 got sharper (two layers: "yes"),
    # layer 2 gained most in head-mean ((0.31 + 0.3) / 2 against (0.3 + 0.01) / 2 in layer 1)
    scores = pd.DataFrame({"dataset": "d", "ratio": [1.0, 1.0, 100.0, 100.0], "seed": [0, 1, 0, 1],
                           "accuracy": [0.6, 0.7, 0.7, 0.8]})
    cfg = {"ratios": [1.0, 100.0], "datasets": ["d"], "n_layers": 2}
    means = heads.groupby(["dataset", "ratio", "seed", "layer"], as_index=False)["attn_relevant"].mean()
    heads = pd.concat([heads, means.assign(head="mean", AC=0.0, focus=0.0, uniform=0.1, rank=float("nan"))])
    row = ml.carry_table(scores, heads, cfg).iloc[0]
    assert row["answer"].startswith("yes, in every layer") and row["sharp_layers"] == "1, 2"
    assert (row["sharper"], row["slots"], row["best_layer"]) == (3, 4, 2)
    assert row["best_gain"] == pytest.approx(0.305) and row["d_accuracy"] == pytest.approx(0.1)
    flat = ml.carry_table(scores, heads.assign(attn_relevant=0.5), cfg).iloc[0]
    assert flat["answer"].startswith("no") and flat["sharp_layers"] == "none" and flat["sharper"] == 0
