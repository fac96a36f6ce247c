"""The knob on the real attention classes of diffusers, x-transformers and timm (tiny random
models built from their own classes, nothing downloaded), and ``knob.inspect`` / layout rules on
models that no family knows.

Which elements of a tensor are Q/K is read off the model's own forward, independently of the
library: every attention module of these libraries computes its attention through
``torch.nn.functional.scaled_dot_product_attention`` (x-transformers with ``attn_flash=True``,
timm with ``fused_attn=True``), which the test replaces by :func:`recording_sdpa`, the same
computation in plain operations that also records the attention probabilities and the module
they belong to. A weight row (output feature) is Q or K exactly when it changes the attention
probabilities of its own module; V rows get an exactly zero gradient there. A bias takes the
rows of its weight (a K bias shifts every logit of a query equally, so it never changes the
probabilities). Then, as in ``tests/test_knob.py``: the split changes no output bit, and one
AdamW / SGD step moves every element by the rate the forward says it must get.

timm without torchvision: timm 1.0 imports ``torchvision`` at import time (``FrozenBatchNorm2d``
in ``timm.layers``, datasets and transforms in ``timm.data``), and the torchvision wheel that
installs beside the CPU build of torch 2.13.0 links CUDA libraries that build lacks, so it cannot
load (and, installed, breaks ``transformers``' imports). :func:`import_timm` therefore imports the
real timm package with a stand-in ``torchvision`` in ``sys.modules`` for the duration of the
import only: a module whose every attribute is an inert placeholder class, which satisfies those
import-time names. No code of the attention modules (nor anything these tests call) uses
torchvision; the stand-in is removed from ``sys.modules`` right after the import.
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.machinery
import importlib.util
import math
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkov_lib import knob
from test_knob import assert_one_step, loss_on

ETA_OV, RATIO, ETA_OTHER = 0.01, 10.0, 0.001
LRS = {"qk": ETA_OV * RATIO, "ov": ETA_OV, "other": ETA_OTHER}


# --- timm without a loadable torchvision ---------------------------------------------------
class _Placeholder(type):
    """Metaclass of the stand-in's names: any attribute of a placeholder class is another one
    (``InterpolationMode.BILINEAR`` at import time), and it can be subclassed and checked with
    isinstance like any class."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torchvision`` and every submodule as an empty stand-in package."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _torchvision_loads() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision.ops  # noqa: F401
        return True
    except Exception:  # installed but its compiled operators do not load beside this torch
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        return False


def import_timm() -> types.ModuleType:
    """The real ``timm`` package, imported with a stand-in ``torchvision`` when the real one
    cannot load (module docstring); the stand-in leaves ``sys.modules`` afterwards."""
    if "timm" in sys.modules or _torchvision_loads():
        import timm
        return timm
    finder = _StandInFinder()
    sys.meta_path.insert(0, finder)
    try:
        import timm
        import timm.models.beit
        import timm.models.eva
        import timm.models.swin_transformer
        import timm.models.swin_transformer_v2
        import timm.models.vision_transformer  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
    return timm


# --- attention probabilities, read off the forward ------------------------------------------
class Recorder:
    """Stands in for ``F.scaled_dot_product_attention`` (same maths, plain operations) and keeps
    the attention probabilities of every call, under the name of the attention module running."""

    def __init__(self, model: nn.Module, attention: Callable[[nn.Module], bool], probs_into: str = "") -> None:
        self.names = [n for n, m in model.named_modules() if attention(m)]
        assert self.names, "no attention module found"
        self.current: list[str] = []
        self.probs: dict[str, list[torch.Tensor]] = {}
        for n in self.names:
            m = model.get_submodule(n)
            m.register_forward_pre_hook(lambda mod, args, n=n: self.current.append(n) and None)
            m.register_forward_hook(lambda mod, args, out: self.current.pop() and None)
            if probs_into:  # a class that computes its softmax itself: the probabilities enter this child
                m.get_submodule(probs_into).register_forward_pre_hook(
                    lambda mod, args, n=n: self.probs.setdefault(n, []).append(args[0]) and None)

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert dropout_p == 0.0
        if enable_gqa:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        logits = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        if is_causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            logits = logits.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            bool_mask = attn_mask.dtype == torch.bool
            logits = logits.masked_fill(~attn_mask, float("-inf")) if bool_mask else logits + attn_mask
        probs = torch.softmax(logits, -1)
        self.probs.setdefault(self.current[-1], []).append(probs)
        return probs @ v


@dataclass(frozen=True)
class Case:
    """A real model class from a tiny config. ``attention`` tells its attention modules (by
    class), ``attn_in`` matches the tensors that produce Q, K, V (weights, own parameters and
    qk-norms; their biases follow the weight), ``out`` the output projection (``ov``),
    ``family`` is the report's label for the attention-input tensors, ``fused``: Q, K and V
    share one tensor; ``probs_into``: the child that receives the attention probabilities, for a
    class that does not call scaled_dot_product_attention (Swin V2's cosine attention)."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    attention: Callable[[nn.Module], bool]
    attn_in: str
    out: str
    family: str
    fused: bool = False
    probs_into: str = ""


def _jitter(model: nn.Module) -> nn.Module:
    """N(0, 0.1^2) noise on every parameter, float64, eval mode (as in tests/test_knob.py); every
    timm module computes attention through scaled_dot_product_attention."""
    model = model.double().eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
    return model


def _randn(*shape: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _timm(factory: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        module, cls = factory.rsplit(".", 1)
        import_timm()
        torch.manual_seed(0)
        return _jitter(getattr(sys.modules[module], cls)(**kw))
    return build


def _class(module: str, name: str) -> Callable[[nn.Module], bool]:
    return lambda m: type(m).__name__ == name and type(m).__module__ == module


def _xt(**attn) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from x_transformers import Decoder, TransformerWrapper

        torch.manual_seed(0)
        return _jitter(TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=Decoder(
            dim=16, depth=2, heads=2, attn_dim_head=8, attn_flash=True, **attn)))
    return build


def _diffusers(cls: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import diffusers

        torch.manual_seed(0)
        return _jitter(getattr(diffusers, cls)(**kw))
    return build


IMG = dict(img_size=8, num_classes=3)
VIT = "timm.layers.attention"
TIMM_IN = r"\.attn\.(qkv\.weight|q_bias|v_bias|[qk]_norm\.weight|[qkv]_proj\.weight)$"
DIFF_IN = r"\.(to_[qkv]|add_[qkv]_proj|to_qkv|to_kv|to_added_qkv)\.weight$|\.norm_(added_)?[qk]\.weight$"
SD3 = dict(sample_size=4, patch_size=2, in_channels=2, num_layers=2, attention_head_dim=4, num_attention_heads=2,
           joint_attention_dim=6, caption_projection_dim=8, pooled_projection_dim=6, out_channels=2,
           pos_embed_max_size=4, qk_norm="rms_norm")


def _sd3_fused() -> nn.Module:
    model = _diffusers("SD3Transformer2DModel", **SD3)()
    model.fuse_qkv_projections()  # to_qkv = [to_q; to_k; to_v], to_added_qkv likewise; the originals stay unused
    return model

CASES: dict[str, Case] = {
    "diffusers_transformer2d": Case(
        _diffusers("Transformer2DModel", num_attention_heads=2, attention_head_dim=4, in_channels=4, num_layers=2,
                   cross_attention_dim=6, norm_num_groups=2),
        lambda: (_randn(2, 4, 2, 3),), _class("diffusers.models.attention_processor", "Attention"),
        DIFF_IN, r"\.to_out\.0\.", "to_q/to_k/to_v/to_out (diffusers, x-transformers)"),
    "diffusers_sd3_joint": Case(
        _diffusers("SD3Transformer2DModel", **SD3),
        lambda: (_randn(2, 2, 4, 4),), _class("diffusers.models.attention_processor", "Attention"),
        DIFF_IN, r"\.(to_out\.0|to_add_out)\.", "to_q/to_k/to_v/to_out (diffusers, x-transformers)"),
    "diffusers_sd3_fused_projections": Case(
        _sd3_fused, lambda: (_randn(2, 2, 4, 4),), _class("diffusers.models.attention_processor", "Attention"),
        DIFF_IN, r"\.(to_out\.0|to_add_out)\.", "to_q/to_k/to_v/to_out (diffusers, x-transformers)", True),
    "x_transformers": Case(
        _xt(), lambda: (torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(3)),),
        _class("x_transformers.x_transformers", "Attention"), r"\.to_[qkv]\.weight$", r"\.to_out\.",
        "to_q/to_k/to_v/to_out (diffusers, x-transformers)"),
    "x_transformers_qknorm_memkv": Case(
        _xt(attn_qk_norm=True, attn_qk_norm_dim_scale=True, attn_num_mem_kv=2),
        lambda: (torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(3)),),
        _class("x_transformers.x_transformers", "Attention"),
        r"\.(to_[qkv]\.weight|mem_[kv]|qk_norm_[qk]_scale)$", r"\.to_out\.",
        "to_q/to_k/to_v/to_out (diffusers, x-transformers)"),
    "timm_vit": Case(
        _timm("timm.models.vision_transformer.VisionTransformer", patch_size=4, embed_dim=16, depth=2, num_heads=2,
              mlp_ratio=2, qkv_bias=True, qk_norm=True, **IMG),
        lambda: (_randn(2, 3, 8, 8),), _class(VIT, "Attention"), TIMM_IN, r"\.attn\.proj\.",
        "timm Attention qkv", True),
    "timm_swin": Case(
        _timm("timm.models.swin_transformer.SwinTransformer", patch_size=2, embed_dim=8, depths=(2,), num_heads=(2,),
              window_size=2, mlp_ratio=2, **IMG),
        lambda: (_randn(2, 3, 8, 8),), _class("timm.models.swin_transformer", "WindowAttention"), TIMM_IN,
        r"\.attn\.proj\.", "timm Swin WindowAttention qkv", True),
    "timm_swin_v2": Case(
        _timm("timm.models.swin_transformer_v2.SwinTransformerV2", patch_size=2, embed_dim=8, depths=(2,),
              num_heads=(2,), window_size=2, mlp_ratio=2, **IMG),
        lambda: (_randn(2, 3, 8, 8),), _class("timm.models.swin_transformer_v2", "WindowAttention"), TIMM_IN,
        r"\.attn\.proj\.", "timm Swin V2 WindowAttention qkv", True, "attn_drop"),
    "timm_eva": Case(
        _timm("timm.models.eva.Eva", patch_size=4, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2, qkv_bias=True,
              use_rot_pos_emb=True, **IMG),
        lambda: (_randn(2, 3, 8, 8),), _class("timm.models.eva", "EvaAttention"), TIMM_IN, r"\.attn\.proj\.",
        "timm EvaAttention qkv", True),
    "timm_eva_unfused": Case(
        _timm("timm.models.eva.Eva", patch_size=4, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2, qkv_bias=True,
              qkv_fused=False, **IMG),
        lambda: (_randn(2, 3, 8, 8),), _class("timm.models.eva", "EvaAttention"), TIMM_IN, r"\.attn\.proj\.",
        "timm EvaAttention qkv"),
    "timm_beit": Case(
        _timm("timm.models.beit.Beit", patch_size=4, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2, qkv_bias=True,
              use_rel_pos_bias=True, **IMG),
        lambda: (_randn(2, 3, 8, 8),), _class("timm.models.beit", "Attention"), TIMM_IN, r"\.attn\.proj\.",
        "timm BEiT Attention qkv", True),
}


def run(model: nn.Module, case: Case) -> torch.Tensor:
    """The model's output on the case's inputs (a tensor)."""
    out = model(*case.inputs())
    out = getattr(out, "sample", out)
    return out[0] if isinstance(out, tuple) else out


def call(model: nn.Module, case: Case) -> torch.Tensor:
    """Run the model; SD3 also needs text states, pooled projections and a timestep."""
    if type(model).__name__ == "SD3Transformer2DModel":
        out = model(hidden_states=case.inputs()[0], encoder_hidden_states=_randn(2, 3, 6, seed=6),
                    pooled_projections=_randn(2, 6, seed=7), timestep=torch.tensor([3.0, 7.0], dtype=torch.float64))
        return out.sample
    if type(model).__name__ == "Transformer2DModel":
        return model(case.inputs()[0], encoder_hidden_states=_randn(2, 5, 6, seed=6)).sample
    return run(model, case)


def qk_masks(model: nn.Module, case: Case, monkeypatch,
             forward: Callable[[nn.Module], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """For every attention-input tensor (``case.attn_in``) of every attention module: a bool mask
    of its shape, True where the element changes that module's attention probabilities (for a
    2-D weight: per row). Read off the forward (:class:`Recorder`; ``forward``, default
    :func:`call`, runs the model), not the library."""
    rec = Recorder(model, case.attention, case.probs_into)
    monkeypatch.setattr(F, "scaled_dot_product_attention", rec)
    params = dict(model.named_parameters())
    masks = {}
    for i, mname in enumerate(rec.names):
        model.zero_grad()
        rec.probs.clear()
        forward(model) if forward else call(model, case)
        probs = torch.cat([p.flatten() for p in rec.probs[mname]])
        w = torch.randn(probs.shape, generator=torch.Generator().manual_seed(5 + i), dtype=probs.dtype)
        (probs * w).sum().backward()
        for n, p in params.items():
            if n.startswith(mname + ".") and re.search(case.attn_in, n):
                g = torch.zeros_like(p) if p.grad is None else p.grad
                masks[n] = (g != 0).any(1, keepdim=True).expand_as(g) if n.endswith("weight") and g.dim() == 2 \
                    else g != 0
    model.zero_grad()
    monkeypatch.undo()
    assert masks, f"no tensor matches {case.attn_in}"
    return masks


def rate_map(name: str, shape: tuple[int, ...], case: Case, masks: dict[str, torch.Tensor]) -> torch.Tensor:
    """The learning rate of each element of ``name``: attention inputs by the forward's mask
    (a bias by its weight's rows), the output projection ``ov``, everything else ``other``."""
    weight = name[: -len("bias")] + "weight" if name.endswith(".bias") else None
    if name in masks:
        qk = masks[name]
    elif weight in masks and masks[weight].dim() == 2:
        qk = masks[weight][:, 0]
    elif weight in masks:  # a norm's bias: its weight's elements
        qk = masks[weight]
    else:
        lr = LRS["ov"] if re.search(case.out, name) else LRS["other"]
        return torch.full(shape, lr, dtype=torch.float64)
    return torch.tensor([LRS["ov"], LRS["qk"]], dtype=torch.float64)[qk.long()].expand(shape)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(CASES))
def test_family_split_and_one_step(name, opt, monkeypatch):
    """For a real attention class: the forward says which elements are Q/K; the report agrees;
    the split changes no output bit; one step moves every element by the rate of its group."""
    check_split_and_step(CASES[name], opt, monkeypatch)


def check_split_and_step(case: Case, opt: str, monkeypatch, rules=None) -> knob.KnobReport:
    """The checks of :func:`test_family_split_and_one_step` for ``case`` (with ``rules``)."""
    model = case.build()
    masks = qk_masks(copy.deepcopy(model), case, monkeypatch)
    ref = copy.deepcopy(model)
    p0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out_ref = call(ref, case)
    loss_on(out_ref).backward()
    g = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    masks = {n: m for n, m in masks.items() if n in g}  # a tensor the forward does not use says nothing
    weights = {n: m for n, m in masks.items() if n.endswith("weight") and m.dim() == 2}
    for n, m in weights.items():  # fused: both kinds of rows in one tensor; separate: one kind
        assert (m.any() and not m.all()) if case.fused else (m.all() or not m.any()), n
    assert any(m.any() for m in masks.values()) and not all(m.all() for m in masks.values())

    wd = 0.05 if opt == "adamw" else 0.0
    groups, rep = knob.knob_groups(model, ETA_OV, RATIO, ETA_OTHER, weight_decay=wd, no_decay=None, rules=rules)
    assert torch.equal(call(model, case), out_ref)  # bit-identical after the split
    for e in (e for e in rep.entries if e.tensor in g):
        lr = rate_map(e.tensor, p0[e.tensor].shape, case, masks)[e.index]
        assert torch.all(lr == LRS[e.group]), f"{e.where}: {e.group}"
        if e.tensor in weights and case.family:
            assert e.family == case.family, e
    assert sum(e.numel for e in rep.entries if e.group == "qk" and e.tensor in g) == sum(
        int((rate_map(n, t.shape, case, masks) == LRS["qk"]).sum()) for n, t in p0.items() if n in g)

    eps = 1e-8
    optim = torch.optim.SGD(groups) if opt == "sgd" else torch.optim.AdamW(groups, eps=eps)
    optim.zero_grad()
    loss_on(call(model, case)).backward()
    optim.step()
    assert_one_step(model, p0, g, lambda n, shape: rate_map(n, shape, case, masks), opt, wd, eps)
    return rep


# --- models no family knows: knob.inspect and layout rules ---------------------------------
E, H = 16, 2


class FusedAttention(nn.Module):
    """A fused projection of a layout no family knows: ``[Q; K; V]`` one after the other, or per
    head ``[H, 3, d]`` (``per_head``), with an output projection named ``out``."""

    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.per_head = nn.Linear(E, 3 * E), nn.Linear(E, E), per_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.per_head:
            q, k, v = self.qkv(x).view(B, T, H, 3, E // H).permute(3, 0, 2, 1, 4)
        else:
            q, k, v = self.qkv(x).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, E))


class Custom(nn.Module):
    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.norm, blk.attn, blk.mlp = nn.LayerNorm(E), FusedAttention(per_head), nn.Linear(E, E)
            self.blocks.append(blk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b.attn(b.norm(x))
            x = x + torch.tanh(b.mlp(x))
        return x


def custom_case(per_head: bool) -> Case:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return _jitter(Custom(per_head))
    return Case(build, lambda: (_randn(2, 5, E),), lambda m: isinstance(m, FusedAttention),
                r"\.attn\.qkv\.weight$", r"\.attn\.out\.", "", True)


def test_inspect_x_transformers():
    """inspect lists every x-transformers Attention with its four projections and their groups."""
    model = CASES["x_transformers"].build()
    ins = knob.inspect(model)
    assert not ins.problems and not ins.suggested
    attn = [n for n, m in model.named_modules() if type(m).__name__ == "Attention"]
    assert len(attn) == 2 and {r["module"] for r in ins.rows} == set(attn)
    got = {r["tensor"].rsplit(".", 2)[-2]: r["goes to"] for r in ins.rows if r["module"] == attn[0]}
    assert got == {"to_q": "qk (Q)", "to_k": "qk (K)", "to_v": "ov (V)", "to_out": "ov (O)"}
    assert all(r["class"] == "Attention" and r["family"].startswith("to_q/to_k/to_v/to_out") for r in ins.rows)
    text = str(ins)
    assert f"{attn[0]}  [Attention]" in text and f"{attn[0]}.to_k.weight" in text
    assert list(ins.frame().columns) == ["module", "class", "family", "tensor", "shape", "goes to", "note"]


@pytest.mark.parametrize("per_head", [False, True])
def test_inspect_and_layout_rules_split_a_custom_fused_projection(per_head, monkeypatch):
    """A fused qkv of unknown layout: classify refuses it, inspect shows it unplaced with the
    rule that would split it; the layout rule (per head where the model is per head) splits it
    as the forward says, and one step moves every element at its group's rate."""
    case = custom_case(per_head)
    model = case.build()
    with pytest.raises(ValueError, match=r"'qkv' in FusedAttention .*knob.inspect"):
        knob.classify(model)
    ins = knob.inspect(model)
    assert set(ins.problems) == {"blocks.0.attn.qkv", "blocks.1.attn.qkv"}
    assert ins.suggested == {r"blocks\.\d+\.attn\.qkv\.": "QKV"}
    unplaced = {r["tensor"]: r for r in ins.rows if r["module"] == "blocks.0.attn"}
    assert unplaced["blocks.0.attn.qkv.weight"]["goes to"] == "other"
    assert unplaced["blocks.0.attn.qkv.weight"]["note"] and unplaced["blocks.0.attn.out.bias"]["note"]
    assert "rules={r'blocks\\.\\d+\\.attn\\.qkv\\.': 'QKV'}" in str(ins)

    rules = {r"blocks\.\d+\.attn\.qkv\.": knob.Fused("QKV", heads=H) if per_head else "QKV",
             r"blocks\.\d+\.attn\.out\.": "ov"}
    ins = knob.inspect(model, rules)
    assert not ins.problems
    goes = {r["tensor"]: r["goes to"] for r in ins.rows}
    d = E // H
    if per_head:
        qk = f"Q[0:{d}] K[{d}:{2 * d}] Q[{3 * d}:{4 * d}] K[{4 * d}:{5 * d}]"
        assert goes["blocks.1.attn.qkv.weight"] == f"qk: {qk}; ov: V[{2 * d}:{3 * d}] V[{5 * d}:{6 * d}]"
    else:
        assert goes["blocks.1.attn.qkv.bias"] == f"qk: Q[0:{E}] K[{E}:{2 * E}]; ov: V[{2 * E}:{3 * E}]"
    assert goes["blocks.0.attn.out.weight"] == "ov"
    rep = check_split_and_step(case, "adamw", monkeypatch, rules)
    assert all(e.family.startswith("rule ") for e in rep.entries if ".attn." in e.tensor)


def test_a_wrong_layout_rule_is_caught_by_the_forward(monkeypatch):
    """The stacked rule on the per-head model puts rows in the wrong group, which the forward
    check sees (so the check above is not a tautology): the user must check a rule's layout."""
    with pytest.raises(AssertionError, match="blocks.0.attn.qkv.weight"):
        check_split_and_step(custom_case(True), "sgd", monkeypatch, {r"attn\.qkv\.": "QKV", r"attn\.out\.": "ov"})


def test_layout_rule_values_are_checked():
    model = Custom(False)
    for value, match in [("QK ", "names group"), ("QXV", "names group"), ("QK", "the groups are"),
                         ("OV", "the groups are")]:
        with pytest.raises(ValueError, match=match):
            knob.classify(model, rules={"qkv": value})
    with pytest.raises(ValueError, match="heads must be"):
        knob.Fused("QKV", heads=0)
    with pytest.raises(ValueError, match="at least two of the letters"):
        knob.Fused("Q")
    with pytest.raises(ValueError, match=r"size 48 does not split into 3 x 5 heads"):
        knob.classify(model, rules={r"attn\.qkv\.": knob.Fused("QKV", heads=5)})
    with pytest.raises(ValueError, match="along dim 2, but it has shape"):
        knob.classify(model, rules={r"attn\.qkv\.bias": "other", r"attn\.qkv\.": knob.Fused("QKV", dim=2)})
