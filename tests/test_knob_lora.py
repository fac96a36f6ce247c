"""The knob on peft LoRA adapters of fused Q/K/V projections: GPT-2's ``c_attn`` (a transposed
``Conv1D``, ``fan_in_fan_out=True``), GPT-NeoX's ``query_key_value`` (heads interleaved) and
timm's ``Attention.qkv`` (real classes from tiny configs, nothing downloaded; timm imported as in
``tests/test_knob_families.py``).

peft adds ``lora_B(lora_A(x)) * scaling`` to the base projection's output, so each row of
``lora_B`` is one output feature of the fused projection: a Q, K or V row like the base's. Which
rows are Q/K is read off the forward (a row is Q/K exactly when it changes the attention
probabilities of its module), not from the library. The split must leave peft's forward
unchanged bit for bit, keep the base weights frozen and out of the optimizer, move every element
by its group's rate in one AdamW step (the first Adam step is ``lr * g / (|g| + eps)``, so
``|step| = lr`` up to eps: the Q/K rows of ``lora_B`` move 10 times as far as the V rows), and
save and reload through peft's own ``save_pretrained`` / ``from_pretrained``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_knob import loss_on
from test_knob_families import Case, _class, _jitter, _randn, import_timm, qk_masks
from torch import nn

from qkov_lib import knob

ETA_OV, RATIO = 0.01, 10.0
EPS = 1e-8


def gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=20, n_positions=8)
    cfg._attn_implementation = "sdpa"
    return _jitter(transformers.GPT2Model(cfg))


def gpt_neox() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, intermediate_size=16,
                                     vocab_size=20, max_position_embeddings=8)
    cfg._attn_implementation = "sdpa"
    return _jitter(transformers.GPTNeoXModel(cfg))


def vit() -> nn.Module:
    timm = import_timm()
    torch.manual_seed(0)
    return _jitter(timm.models.vision_transformer.VisionTransformer(
        img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2, qkv_bias=True, num_classes=3))


IDS = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(3))
CASES = {
    "gpt2_c_attn": (gpt2, dict(target_modules=["c_attn"], fan_in_fan_out=True),
                    lambda m: m(input_ids=IDS).last_hidden_state,
                    _class("transformers.models.gpt2.modeling_gpt2", "GPT2Attention"), "GPT-2 c_attn/c_proj, LoRA B"),
    "gpt_neox_query_key_value": (gpt_neox, dict(target_modules=["query_key_value"]),
                                 lambda m: m(input_ids=IDS).last_hidden_state,
                                 _class("transformers.models.gpt_neox.modeling_gpt_neox", "GPTNeoXAttention"),
                                 "GPT-NeoX query_key_value, LoRA B"),
    "timm_vit_qkv": (vit, dict(target_modules=["qkv"]), lambda m: m(_randn(2, 3, 8, 8)),
                     _class("timm.layers.attention", "Attention"), "timm Attention qkv, LoRA B"),
}


def lora_model(name: str) -> nn.Module:
    """The base model with a rank-2 LoRA adapter on its fused projection, every adapter
    parameter jittered (peft initialises lora_B to zero, which would hide a misplaced row)."""
    from peft import LoraConfig, get_peft_model

    build, kw = CASES[name][:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = get_peft_model(build(), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, **kw))
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.double().eval()


def masks_of(model: nn.Module, name: str, monkeypatch) -> dict[str, torch.Tensor]:
    """Per lora_B weight: True on the rows that change their module's attention probabilities."""
    _, _, fwd, attention, _ = CASES[name]
    case = Case(lambda: model, tuple, attention, r"lora_B\.default\.weight$", "", "")
    masks = qk_masks(copy.deepcopy(model), case, monkeypatch, fwd)
    return {n: m[:, 0] for n, m in masks.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_b_rows_follow_the_fused_layout_and_step_at_their_rates(name, monkeypatch):
    _, _, fwd, _, family = CASES[name]
    model = lora_model(name)
    rows = masks_of(model, name, monkeypatch)
    assert rows and all(r.any() and not r.all() for r in rows.values())  # Q/K and V rows in each lora_B
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert any("base_layer" in n for n in frozen)
    ref = copy.deepcopy(model)
    out_ref = fwd(ref)
    p0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    opt, rep = knob.knob_optimizer(model, "adamw", lr=ETA_OV, qk_ratio=RATIO, weight_decay=0.0, eps=EPS)
    assert torch.equal(fwd(model), out_ref)  # peft's forward, bit for bit
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    for n, p in model.named_parameters():
        assert (id(p) in in_opt) == p.requires_grad, n
    assert all(not model.get_parameter(n).requires_grad for n in frozen if "parametrizations" not in n)
    # the report: lora_B rows where the forward puts them, lora_A whole in ov
    for e in rep.entries:
        if e.tensor in rows:
            assert e.family == family and e.dim == 0
            assert bool(rows[e.tensor][e.start:e.stop].all()) == (e.group == "qk"), e.where
            assert bool(rows[e.tensor][e.start:e.stop].any()) == (e.group == "qk"), e.where
        elif ".lora_A." in e.tensor:
            assert e.group == "ov" and e.dim is None
    assert {original for original in rows} == {e.tensor for e in rep.entries if ".lora_B." in e.tensor}

    loss_on(fwd(model)).backward()
    loss_on(fwd(ref)).backward()  # reference gradients from the untouched copy
    g = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    opt.step()
    for n, p in frozen.items():
        assert torch.equal(model.get_parameter(n), p), n  # frozen base weights did not move
    lr_qk, lr_ov = ETA_OV * RATIO, ETA_OV
    ratios = []
    for n, before in p0.items():
        tname = knob.original_name(n)
        if tname in rows:
            continue
        assert ".lora_A." in n, n  # only the adapters train: lora_B (below) and lora_A, in ov
        step = knob.tensor_value(model, tname).detach() - before
        assert torch.allclose(step, -lr_ov * g[n] / (g[n].abs() + EPS), rtol=1e-7, atol=1e-13), n
    for tname, r in rows.items():
        step = knob.tensor_value(model, tname).detach() - p0[tname]
        lr = torch.where(r, lr_qk, lr_ov).unsqueeze(1).double()
        assert torch.allclose(step, -lr * g[tname] / (g[tname].abs() + EPS), rtol=1e-7, atol=1e-13), tname
        ratios.append((step[r].abs().mean() / step[~r].abs().mean()).item())
    assert all(9.99 < x < 10.01 for x in ratios), ratios
    print(f"{name}: mean |step| of the Q/K rows of lora_B / of its V rows = {ratios}")


@pytest.mark.parametrize("name", list(CASES))
def test_lora_adapter_save_and_reload_round_trips(name, tmp_path):
    """After a knob step on the split adapter, peft's save_pretrained writes the original keys
    and shapes, and from_pretrained on a fresh base model computes the same outputs."""
    from peft import PeftModel
    from safetensors.torch import load_file

    build, _, fwd, _, _ = CASES[name]
    model = lora_model(name)
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items() if "lora_" in k}
    opt, _ = knob.knob_optimizer(model, "adamw", lr=ETA_OV, qk_ratio=RATIO)
    loss_on(fwd(model)).backward()
    opt.step()
    expected = fwd(model).detach()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and not any("parametrizations" in k for k in saved)
    assert {k.replace(".default", "") for k in keys} >= set(saved)  # peft drops the adapter name
    for k, v in saved.items():
        assert tuple(v.shape) == keys[k.replace(".weight", ".default.weight")], k
    reloaded = PeftModel.from_pretrained(build(), tmp_path).double().eval()
    assert torch.allclose(fwd(reloaded), expected, rtol=0, atol=1e-12)
    # and into a split model again (the load hook cuts the saved tensors into the slices)
    again = lora_model(name)
    knob.knob_optimizer(again, "adamw", lr=ETA_OV, qk_ratio=RATIO)
    from peft import set_peft_model_state_dict

    res = set_peft_model_state_dict(again, saved)
    assert not res.unexpected_keys
    assert torch.allclose(fwd(again), expected, rtol=0, atol=1e-12)
