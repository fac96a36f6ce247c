"""The knob's placement checked by perturbation, on DeBERTa-v2/v3 and on a mixed
``EncoderDecoderModel`` (a DeBERTa-v2 encoder with a GPT-2 decoder), tiny models built from their
configs (nothing downloaded).

What each row of an attention tensor is, is read off the model's forward, independently of the
library: the row (one output feature) is perturbed, and the layer's attention probabilities
(``output_attentions``) are compared. A row is Q or K exactly when they change; a V or O row
leaves them bit for bit as they were and changes the output. The knob must put the first kind in
``qk`` and the second in ``ov``, every attention row in one of them (none left in ``other``),
and a bias with the rows of its weight (a K bias shifts every score of a query alike, so the
probabilities never show it). Then one SGD step moves every element by the rate the forward
says it must get: the Q/K rows ``qk_ratio`` times as far as the V/O rows, per unit of gradient.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from qkov_lib import knob
from test_knob import _jitter, assert_one_step, loss_on

E, H, T = 8, 2, 6
ETA_OV, RATIO, ETA_OTHER = 0.01, 10.0, 0.001
LRS = {"qk": ETA_OV * RATIO, "ov": ETA_OV, "other": ETA_OTHER}


def deberta(**kw) -> nn.Module:
    import transformers

    cfg = transformers.DebertaV2Config(num_hidden_layers=2, hidden_size=E, num_attention_heads=H, intermediate_size=16,
                                       vocab_size=20, max_position_embeddings=16, relative_attention=True,
                                       pos_att_type=["c2p", "p2c"], **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.DebertaV2Model(cfg)


def encoder_decoder() -> nn.Module:
    import transformers

    dcfg = transformers.GPT2Config(n_layer=2, n_embd=E, n_head=H, vocab_size=20, n_positions=16, is_decoder=True,
                                   add_cross_attention=True, bos_token_id=1, eos_token_id=2)
    dcfg._attn_implementation = "eager"
    enc = deberta(share_att_key=False)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.EncoderDecoderModel(encoder=enc, decoder=transformers.GPT2LMHeadModel(dcfg))


def ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 20, (2, T), generator=torch.Generator().manual_seed(seed))


def run_encoder(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(input_ids=ids(), output_attentions=True)
    return out.last_hidden_state, {f"layer.{i}": a for i, a in enumerate(out.attentions)}


def run_encoder_decoder(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(input_ids=ids(), decoder_input_ids=ids(4), output_attentions=True)
    probs = {f"encoder.{i}": a for i, a in enumerate(out.encoder_attentions)}
    probs |= {f"decoder.{i}": a for i, a in enumerate(out.decoder_attentions)}
    probs |= {f"cross.{i}": a for i, a in enumerate(out.cross_attentions)}
    return out.logits, probs


def deberta_layer(name: str) -> str | None:
    m = re.search(r"layer\.(\d+)\.attention\.", name)
    return m and f"layer.{m[1]}"


def enc_dec_layer(name: str) -> str | None:
    if m := re.match(r"encoder\.encoder\.layer\.(\d+)\.attention\.", name):
        return f"encoder.{m[1]}"
    if m := re.match(r"decoder\.transformer\.h\.(\d+)\.(attn|crossattention)\.", name):
        return f"{'decoder' if m[2] == 'attn' else 'cross'}.{m[1]}"
    return None


@dataclass(frozen=True)
class Case:
    """``build`` a model, ``run`` it (output, attention probabilities by layer name), ``layer``:
    the attention layer whose probabilities a tensor of that name may change (None: no attention
    tensor), ``pos``: the names of DeBERTa's position projections the config must have."""

    build: Callable[[], nn.Module]
    run: Callable[[nn.Module], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    layer: Callable[[str], str | None]
    pos: tuple[str, ...] = ()


CASES = {
    "deberta_v2": Case(lambda: deberta(share_att_key=False), run_encoder, deberta_layer,
                       ("pos_key_proj", "pos_query_proj")),
    "deberta_v3": Case(lambda: deberta(share_att_key=True, position_buckets=4, norm_rel_ebd="layer_norm"),
                       run_encoder, deberta_layer),
    "deberta_v2_encoder_gpt2_decoder": Case(encoder_decoder, run_encoder_decoder, enc_dec_layer,
                                            ("pos_key_proj", "pos_query_proj")),
}


def out_dim(model: nn.Module, name: str) -> int:
    """The dim of a 2-D weight that holds its output features: 1 for GPT-2's ``Conv1D`` (in, out)."""
    owner = model.get_submodule(name.rpartition(".")[0])
    return 1 if type(owner).__name__ == "Conv1D" else 0


def forward_truth(model: nn.Module, case: Case) -> dict[str, torch.Tensor]:
    """For every 2-D tensor below an attention layer, a bool per output feature (row): True when
    perturbing that row changes the layer's attention probabilities (Q/K), False when they stay
    bit for bit the same (V/O); then the output must change. Read off the forward alone."""
    model = copy.deepcopy(model)
    out0, probs0 = case.run(model)
    g = torch.Generator().manual_seed(7)
    truth = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            layer = case.layer(name)
            if layer is None or p.dim() != 2:
                continue
            d = out_dim(model, name)
            rows = []
            for r in range(p.shape[d]):
                row = p.select(d, r)
                saved = row.clone()
                row.add_(torch.randn(row.shape, generator=g, dtype=row.dtype))
                out, probs = case.run(model)
                row.copy_(saved)
                moved = (probs[layer] - probs0[layer]).abs().max().item()
                if moved == 0.0:
                    assert (out - out0).abs().max().item() > 1e-6, f"{name} row {r}: changes nothing"
                else:
                    assert moved > 1e-9, f"{name} row {r}: changes the probabilities by only {moved:g}"
                rows.append(moved > 0.0)
            truth[name] = torch.tensor(rows)
    return truth


def rate_map(name: str, shape: tuple[int, ...], dim: int | None, truth: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rate each element of ``name`` must get by the forward: Q/K rows ``eta_ov * ratio``,
    V/O rows ``eta_ov`` (a bias: the rows of its weight), everything else ``eta_other``."""
    weight = name[: -len("bias")] + "weight" if name.endswith(".bias") else name
    if weight not in truth:
        return torch.full(shape, LRS["other"], dtype=torch.float64)
    rate = torch.tensor([LRS["ov"], LRS["qk"]], dtype=torch.float64)[truth[weight].long()]
    return rate.expand(shape) if len(shape) == 1 or dim == 1 else rate.unsqueeze(1).expand(shape)


@pytest.mark.parametrize("name", list(CASES))
def test_placement_matches_the_forward_by_perturbation_and_sgd_steps_at_the_ratio(name):
    case = CASES[name]
    model = _jitter(case.build())
    params = dict(model.named_parameters())
    for pos in case.pos:  # the relative-position projections are there to be checked
        assert any(f".{pos}." in n for n in params), pos
    truth = forward_truth(model, case)
    for n, t in truth.items():  # GPT-2's fused c_attn holds both kinds of rows; the separate projections one
        assert bool(t.any() and not t.all()) if n.endswith("c_attn.weight") else bool(t.all() or not t.any()), n
    dims = {n: out_dim(model, n) for n in truth}
    qk_rows = {n for n, t in truth.items() if t.all()}
    assert any("query_proj" in n for n in qk_rows) and any("key_proj" in n for n in qk_rows)
    assert all(re.search(r"(query|key)_proj|q_attn|c_attn", n) for n in qk_rows), sorted(qk_rows)

    ref = copy.deepcopy(model)
    p0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    loss_on(case.run(ref)[0]).backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}

    opt, rep = knob.knob_optimizer(model, "sgd", lr=ETA_OV, qk_ratio=RATIO, other_lr=ETA_OTHER)
    # every slice or tensor of the report is in the group the forward gives its rows
    for e in rep.entries:
        want = rate_map(e.tensor, p0[e.tensor].shape, dims.get(e.tensor), truth)[e.index]
        assert torch.all(want == LRS[e.group]), f"{e.where}: {e.group}"
    placed = {e.tensor for e in rep.entries if e.group != "other"}
    assert set(truth) <= placed  # no attention row left in other
    # one SGD step: Q/K rows move qk_ratio times the base rate per unit of gradient, V/O rows the base rate
    opt.zero_grad()
    loss_on(case.run(model)[0]).backward()
    opt.step()
    assert_one_step(model, p0, grads, lambda n, shape: rate_map(n, shape, dims.get(n), truth), "sgd", 0.0, 0.0)
    # the same, summed per group: |update| / |gradient| is the group's rate
    moved = {g: [0.0, 0.0] for g in ("qk", "ov")}
    for e in rep.entries:
        if e.group in moved and e.tensor in grads:
            moved[e.group][0] += (knob.tensor_value(model, e.tensor).detach() - p0[e.tensor])[e.index].abs().sum().item()
            moved[e.group][1] += grads[e.tensor][e.index].abs().sum().item()
    assert moved["qk"][0] / moved["qk"][1] == pytest.approx(RATIO * ETA_OV, rel=1e-9)
    assert moved["ov"][0] / moved["ov"][1] == pytest.approx(ETA_OV, rel=1e-9)
