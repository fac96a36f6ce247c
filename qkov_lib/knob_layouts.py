"""Where the query, key, value and output tensors of attention modules are: the families that
:mod:`qkov_lib.knob` recognises, the slice layouts of fused Q/K/V projections, and the layouts a
user can name in ``rules``.

A layout is a tuple of ``(part, size)`` blocks along the packed dim of a tensor, in order; parts
are ``"Q"``, ``"K"``, ``"V"``, ``"O"``. Families are found by the names of an attention module's
children (:data:`SEPARATE_FAMILIES`) or by the class of the attention module
(:data:`FUSED_LAYOUTS`, each checked against that model's own forward in the tests). A peft LoRA
wrapper (``base_layer`` plus ``lora_A`` / ``lora_B`` dicts of adapters) is recognised by those
children alone (:func:`lora_base`), so the library needs neither peft nor the model libraries.
Needs torch alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from qkov_lib.models import GROUPS

PART_GROUP: dict[str, str] = {"Q": "qk", "K": "qk", "V": "ov", "O": "ov"}

# separate-projection families: name -> part, for children of the attention module (a parent
# needs a Q and a K child) and for the parent's own parameters (x-transformers' memory key/values
# and the learned scales of its qk_norm)
SEPARATE_FAMILIES: tuple[tuple[str, dict[str, str]], ...] = (
    ("q_proj/k_proj/v_proj/o_proj", {"q_proj": "Q", "k_proj": "K", "v_proj": "V", "o_proj": "O", "out_proj": "O",
                                     "dense": "O"}),
    ("query/key/value", {"query": "Q", "key": "K", "value": "V"}),
    # DeBERTa-v2/v3 DisentangledSelfAttention: the relative-position projections only enter the
    # scores (content-to-position, position-to-content), so they are Q and K
    ("query_proj/key_proj/value_proj (DeBERTa-v2)",
     {"query_proj": "Q", "key_proj": "K", "value_proj": "V", "pos_query_proj": "Q", "pos_key_proj": "K"}),
    ("q/k/v/o (T5)", {"q": "Q", "k": "K", "v": "V", "o": "O"}),
    ("q_lin/k_lin/v_lin/out_lin (DistilBERT)", {"q_lin": "Q", "k_lin": "K", "v_lin": "V", "out_lin": "O"}),
    # diffusers' Attention (Stable Diffusion, DiT, SD3/Flux joint attention with the add_*_proj of
    # the second stream and their qk-norms) and x-transformers' Attention
    ("to_q/to_k/to_v/to_out (diffusers, x-transformers)",
     {"to_q": "Q", "to_k": "K", "to_v": "V", "to_out": "O",
      "add_q_proj": "Q", "add_k_proj": "K", "add_v_proj": "V", "to_add_out": "O",
      "norm_q": "Q", "norm_k": "K", "norm_added_q": "Q", "norm_added_k": "K",
      "q_rmsnorm": "Q", "k_rmsnorm": "K", "value_rmsnorm": "V",
      "mem_k": "K", "mem_v": "V", "qk_norm_q_scale": "Q", "qk_norm_k_scale": "K"}),
)
# normalisations inside a separate-projection family, placed once its Q and K children matched
# (never enough to recognise a module by): Hugging Face's qk-norms (Qwen3, OLMo 2, Gemma 3, Cohere
# ...; Phi and StableLM with qk_layernorm) act on Q and K before the scores, like timm's and
# diffusers' qk-norms
FAMILY_NORMS: dict[str, dict[str, str]] = {
    "q_proj/k_proj/v_proj/o_proj": {"q_norm": "Q", "k_norm": "K", "q_layernorm": "Q", "k_layernorm": "K"}}
# diffusers' Attention.fuse_projections() (set fused_projections=True): a fused projection that is
# the concatenation of its siblings' weights, [to_q; to_k; to_v] ..., the siblings staying in place
DIFFUSERS_FUSED: dict[str, tuple[str, ...]] = {
    "to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}
# names of packed projections: outside FUSED_LAYOUTS their slice layout is unknown, refuse to guess
UNSUPPORTED_PACKED = ("qkv", "qkv_proj", "wqkv", "query_key_value", "in_proj", "kv_proj", "kv", "w_pack",
                      "to_qkv", "to_kv", "to_added_qkv")
# TransformerLens attention: own parameter -> part (GroupedQueryAttention keeps K, V as _W_K ...)
TRANSFORMER_LENS_PARTS: dict[str, str] = {
    "W_Q": "Q", "b_Q": "Q", "W_K": "K", "b_K": "K", "_W_K": "K", "_b_K": "K",
    "W_V": "V", "b_V": "V", "_W_V": "V", "_b_V": "V", "W_O": "O", "b_O": "O",
}


# --- fused Q/K/V layouts -------------------------------------------------------------------
Layout = tuple[tuple[str, int], ...]  # (part, size) blocks along the packed dim, in order


def _merge(blocks: Sequence[tuple[str, int]]) -> Layout:
    """``blocks`` with adjacent blocks of the same part joined (fewer slices, same layout)."""
    out: list[tuple[str, int]] = []
    for part, size in blocks:
        if size < 1:
            raise ValueError(f"layout block {part!r} has size {size}; sizes must be >= 1")
        if out and out[-1][0] == part:
            out[-1] = (part, out[-1][1] + size)
        else:
            out.append((part, int(size)))
    return tuple(out)


def stacked_layout(q: int, k: int, v: int) -> Layout:
    """``[Q; K; V]`` one after the other, of sizes ``q``, ``k``, ``v`` (rows or features)."""
    return _merge([("Q", q), ("K", k), ("V", v)])


def interleaved_layout(n_heads: int, head_dim: int) -> Layout:
    """``[n_heads, 3, head_dim]``: for each head its Q, K and V rows (GPT-NeoX, BLOOM ...)."""
    return _merge([(part, head_dim) for _ in range(n_heads) for part in "QKV"])


def grouped_layout(n_heads: int, n_kv_heads: int, head_dim: int) -> Layout:
    """``[n_kv_heads, n_heads / n_kv_heads + 2, head_dim]``: for each key/value group its query
    heads, then one K head, then one V head (Falcon's ``new_decoder_architecture``)."""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    per = n_heads // n_kv_heads
    return _merge([b for _ in range(n_kv_heads) for b in (("Q", per * head_dim), ("K", head_dim), ("V", head_dim))])


def equal_layout(parts: str, size: int, heads: int | None = None, what: str = "tensor") -> Layout:
    """``size`` features cut into equal blocks, one per letter of ``parts`` (``"QKV"``: ``[Q; K;
    V]``); with ``heads``, per head: ``[heads, len(parts), size / (heads * len(parts))]``."""
    n = len(parts) * (heads or 1)
    if size % n:
        per = f" x {heads} heads" if heads else ""
        raise ValueError(f"{what}: size {size} does not split into {len(parts)}{per} equal blocks {tuple(parts)}")
    return _merge([(p, size // n) for _ in range(heads or 1) for p in parts])


def _attr(module: nn.Module, *names: str) -> int:
    """The first of ``module.<name>`` or ``module.config.<name>`` that exists, as an int."""
    for src in (module, getattr(module, "config", None)):
        for n in names:
            v = getattr(src, n, None) if src is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    raise ValueError(f"{type(module).__name__} has none of the attributes {names} (on itself or its config) "
                     "that give its fused Q/K/V layout")


@dataclass(frozen=True)
class FusedLayout:
    """A fused Q/K/V projection: the child ``qkv`` of an attention module of class ``attention``
    (defined in the Python module ``module``, when given), with output-projection sibling ``out``.
    ``kind`` says how :meth:`layout` reads the blocks off the attention module (sizes from the
    attributes ``heads`` and ``head_dim``): ``interleaved`` per head; ``falcon`` / ``bigcode``:
    interleaved, ``[Q; K; V]`` with one K/V head when ``multi_query``, Falcon's
    ``new_decoder_architecture`` grouped; ``gqa``: ``[Q; K; V]`` with ``num_key_value_heads``;
    ``thirds``: ``[Q; K; V]`` of ``hidden_size`` each; ``equal``: ``[Q; K; V]``, thirds of the
    projection's output. ``extras`` names the module's other tensors (own parameters or children)
    and their parts (timm's ``q_bias``, ``q_norm`` ...); ``separate``, the children that hold Q,
    K, V when the class is built without the fused projection (timm's ``qkv_fused=False``)."""

    family: str
    attention: str
    qkv: str
    out: str
    kind: str
    heads: tuple[str, ...] = ()
    head_dim: tuple[str, ...] = ("head_dim",)
    module: str = ""
    extras: tuple[tuple[str, str], ...] = ()
    separate: tuple[tuple[str, str], ...] = ()

    def matches(self, a: nn.Module) -> bool:
        cls = type(a)
        return cls.__name__ == self.attention and (not self.module or cls.__module__ == self.module)

    def layout(self, a: nn.Module, size: int) -> Layout:
        """The (part, size) blocks of the projection's ``size`` output features for the
        attention module ``a``."""
        if self.kind == "equal":
            return equal_layout("QKV", size, what=f"{self.family} of {type(a).__name__}")
        if self.kind == "thirds":
            e = _attr(a, "hidden_size", "d_model")
            return stacked_layout(e, e, e)
        if self.kind == "gqa":
            hd = _attr(a, *self.head_dim)
            heads, kv = _attr(a, *self.heads), _attr(a, "num_key_value_heads")
            return stacked_layout(heads * hd, kv * hd, kv * hd)
        if self.kind == "bigcode" and getattr(a, "is_cross_attention", False):
            raise ValueError("GPT-BigCode cross-attention (c_attn holding K, V of the encoder states) is not supported; "
                             "pass rules={regex: group} to place it")
        heads, hd = _attr(a, *self.heads), _attr(a, *self.head_dim)
        if self.kind == "falcon" and getattr(a, "new_decoder_architecture", False):
            return grouped_layout(heads, _attr(a, "num_kv_heads"), hd)
        if self.kind != "interleaved" and getattr(a, "multi_query", False):
            return stacked_layout(heads * hd, hd, hd)
        return interleaved_layout(heads, hd)


# timm: qkv(x).reshape(B, N, 3, heads, head_dim), so [Q; K; V] along the output; EVA, BEiT and
# Swin V2 add q_bias and v_bias (k_bias is a zero buffer); q_norm / k_norm are the qk-norm
TIMM_EXTRAS = (("q_bias", "Q"), ("v_bias", "V"), ("q_norm", "Q"), ("k_norm", "K"))
TIMM_SEPARATE = (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V"))
FUSED_LAYOUTS: tuple[FusedLayout, ...] = (
    FusedLayout("GPT-NeoX query_key_value", "GPTNeoXAttention", "query_key_value", "dense", "interleaved",
                ("num_attention_heads",), ("head_size",)),
    FusedLayout("BLOOM query_key_value", "BloomAttention", "query_key_value", "dense", "interleaved", ("num_heads",)),
    FusedLayout("Falcon query_key_value", "FalconAttention", "query_key_value", "dense", "falcon",
                ("num_heads", "num_attention_heads")),
    FusedLayout("MPT Wqkv", "MptAttention", "Wqkv", "out_proj", "thirds"),
    FusedLayout("ModernBERT Wqkv", "ModernBertAttention", "Wqkv", "Wo", "thirds"),
    FusedLayout("Phi-3 qkv_proj", "Phi3Attention", "qkv_proj", "o_proj", "gqa", ("num_attention_heads", "num_heads")),
    FusedLayout("GPT-BigCode c_attn", "GPTBigCodeAttention", "c_attn", "c_proj", "bigcode", ("num_heads",)),
    FusedLayout("timm Attention qkv", "Attention", "qkv", "proj", "equal", module="timm.layers.attention",
                extras=TIMM_EXTRAS),
    FusedLayout("timm BEiT Attention qkv", "Attention", "qkv", "proj", "equal", module="timm.models.beit",
                extras=TIMM_EXTRAS),
    FusedLayout("timm EvaAttention qkv", "EvaAttention", "qkv", "proj", "equal", module="timm.models.eva",
                extras=TIMM_EXTRAS, separate=TIMM_SEPARATE),
    FusedLayout("timm Swin WindowAttention qkv", "WindowAttention", "qkv", "proj", "equal",
                module="timm.models.swin_transformer", extras=TIMM_EXTRAS),
    FusedLayout("timm Swin V2 WindowAttention qkv", "WindowAttention", "qkv", "proj", "equal",
                module="timm.models.swin_transformer_v2", extras=TIMM_EXTRAS),
)


def known_fused() -> str:
    """The fused projections of :data:`FUSED_LAYOUTS`, as ``Class.qkv`` (module-qualified for timm)."""
    return ", ".join(f"{fl.module + '.' if fl.module else ''}{fl.attention}.{fl.qkv}" for fl in FUSED_LAYOUTS)


# --- peft LoRA wrappers ---------------------------------------------------------------------
def lora_base(module: nn.Module) -> nn.Module | None:
    """The wrapped layer of a peft LoRA layer (children ``base_layer``, ``lora_A`` and
    ``lora_B``, the latter two dicts of adapters), else None. ``lora_B[a]`` is an ``nn.Linear(r,
    out)`` whose rows are the base layer's output features (also for a transposed GPT-2
    ``Conv1D`` base with ``fan_in_fan_out``); ``lora_A[a]`` (r, in) feeds all of them."""
    base = getattr(module, "base_layer", None)
    a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if isinstance(base, nn.Module) and isinstance(a, nn.ModuleDict) and isinstance(b, nn.ModuleDict):
        return base
    return None


# --- layouts named in rules -----------------------------------------------------------------
@dataclass(frozen=True)
class Fused:
    """A rule's value that splits the tensors it matches: equal blocks along ``dim``, one per
    letter of ``parts`` (``"QKV"``: ``[Q; K; V]``; ``"KV"``; ``"QKVO"`` ...), with ``heads`` per
    head (``[heads, len(parts), d]``: GPT-NeoX style). A 1-D tensor (bias) and the ``lora_B``
    of a peft adapter are split along dim 0 (their rows are the output features); a ``lora_A``,
    shared by all parts, goes whole to ``ov``. The plain string ``"QKV"`` in ``rules`` means
    ``Fused("QKV")``."""

    parts: str = "QKV"
    heads: int | None = None
    dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.parts, str) or len(self.parts) < 2 or set(self.parts) - set(PART_GROUP):
            raise ValueError(f"Fused parts must be a string of at least two of the letters Q, K, V, O, got "
                             f"{self.parts!r}")
        if self.heads is not None and (isinstance(self.heads, bool) or not isinstance(self.heads, int)
                                       or self.heads < 1):
            raise ValueError(f"Fused heads must be an int >= 1 or None, got {self.heads!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Fused dim must be an int >= 0, got {self.dim!r}")

    def layout(self, size: int, what: str) -> Layout:
        return equal_layout(self.parts, size, self.heads, what)

    def __str__(self) -> str:
        opts = [f"heads={self.heads}"] * (self.heads is not None) + [f"dim={self.dim}"] * (self.dim != 0)
        return self.parts + (f" ({', '.join(opts)})" if opts else "")


RuleSpec = str | Fused  # a group name, or a layout


def rule_spec(rx: str, value: object) -> RuleSpec:
    """A rule's value checked: a group of ``GROUPS``, a :class:`Fused`, or a string of part
    letters (``"QKV"``) read as ``Fused(value)``."""
    if isinstance(value, Fused):
        return value
    if isinstance(value, str) and value in GROUPS:
        return value
    if isinstance(value, str) and len(value) >= 2 and not set(value) - set(PART_GROUP):
        return Fused(value)
    raise ValueError(f"rule {rx!r} names group {value!r}; expected one of {GROUPS}, or a layout: part letters "
                     "such as 'QKV' or 'KV', or knob.Fused('QKV', heads=..., dim=...)")


ORIGINAL = re.compile(r"^(?P<prefix>.*?)(?:^|\.)parametrizations\.(?P<attr>[^.]+)\.original\d+$")


def original_name(param_name: str) -> str:
    """The name of the tensor a (split) parameter belongs to: ``a.parametrizations.weight.original1``
    -> ``a.weight``; other names unchanged."""
    m = ORIGINAL.match(param_name)
    if m is None:
        return param_name
    return ".".join(x for x in (m["prefix"], m["attr"]) if x)
