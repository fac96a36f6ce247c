"""The paper's knob on any PyTorch model: ``qk`` / ``ov`` / ``other`` optimizer groups.

:func:`knob_groups` (and :func:`knob_optimizer`) find the attention parameters of a model and
return optimizer parameter groups with ``lr = eta_ov * ratio`` for the query/key projections
(``qk``), ``eta_ov`` for the value and output projections (``ov``) and ``eta_other`` for the rest,
plus a :class:`KnobReport` that says which tensor (or slice of a tensor) went where.

Recognised attention modules ("families"):

* ``nn.MultiheadAttention`` (also in ``nn.Transformer*`` layers): packed ``in_proj_weight`` (3E, E)
  and ``in_proj_bias`` (3E,) = ``[Q; K; V]`` (separate weights with ``kdim``/``vdim``), ``bias_k``,
  ``bias_v``, ``out_proj``.
* Sibling modules (:data:`SEPARATE_FAMILIES`: Llama/OPT/BART/Phi ``q_proj`` ..., BERT
  ``query``/``key``/``value`` and DeBERTa-v2/v3 ``query_proj``/``key_proj``/``value_proj`` (with
  ``pos_query_proj``/``pos_key_proj`` as Q/K) with ``attention.output.dense``, T5, DistilBERT, and the
  ``to_q``/``to_k``/``to_v``/``to_out`` of diffusers' and x-transformers' ``Attention``, with
  diffusers' joint-attention ``add_q_proj`` ... ``to_add_out``, its qk-norms ``norm_q`` ...,
  x-transformers' memory key/values and qk-norm scales; the ``q_norm``/``k_norm`` of Hugging Face's
  Qwen3, OLMo 2, Gemma 3 ... go with Q and K, :data:`FAMILY_NORMS`). A parent needs a Q and a K child (a lone
  ``out_proj`` head stays ``other``); a child takes every parameter below it (LoRA adapters of
  ``q_proj`` are ``qk``). diffusers' ``fuse_projections()`` ``to_qkv`` / ``to_kv`` /
  ``to_added_qkv`` are split by the sizes of the projections they concatenate.
* GPT-2's packed ``c_attn`` (HF ``Conv1D`` (E, 3E) or ``nn.Linear`` (3E, E); K, V only beside a
  ``q_attn``) with its sibling ``c_proj`` as O.
* Fused projections with a model-specific layout (:data:`FUSED_LAYOUTS`: GPT-NeoX/Pythia, BLOOM,
  Falcon, MPT, ModernBERT, Phi-3, GPT-BigCode; timm's ViT/DeiT ``Attention``, BEiT, EVA (fused or
  not), Swin and Swin V2 ``qkv`` with ``q_bias`` / ``v_bias`` and ``q_norm`` / ``k_norm``), found
  by the class of their attention module and each checked against that model's forward in the
  tests. A fused projection (``qkv``, ``Wqkv``, ``query_key_value`` ...) of any other class is
  refused with a clear error, not guessed: :func:`inspect` shows what was found and suggests a
  layout rule (``rules={regex: "QKV"}`` or :class:`Fused` per head) for the user to check.
* A peft LoRA layer over any of these fused projections: ``base_layer`` as the projection, the rows
  of each ``lora_B`` (the output features) split like the base's output, each ``lora_A`` (which
  feeds Q, K and V alike) whole to ``ov``, so V never learns faster than ``eta_OV``.
* TransformerLens attention (``W_Q`` ... ``b_O``, grouped-query ``_W_K`` ...) and the library's
  :class:`qkov_lib.models.QKOVAttention`.

What no family places goes to ``other``, but :func:`knob_optimizer` refuses (``strict=False``:
warns about) a tensor that looks like an attention projection and is left there, and every
call refuses a tensor tied between places of different groups (Q and V, or an attention
projection and an embedding) unless a rule places it. Rates are any real numbers
(:func:`real_number`).

Scaling the gradient of a slice gives per-slice rates for SGD but not for Adam (``m / sqrt(v)``
ignores the scale), so :func:`split_packed` re-registers each packed tensor as leaf parameters, one
per run of adjacent slices of the same group (``[Q; K; V]``: Q+K and V; GPT-NeoX: per head Q+K and
V), rebuilt on every access by a ``torch.nn.utils.parametrize`` concatenation (:class:`PackedSlices`;
one ``torch.cat`` per forward, see ``benchmarks/bench_knob.py``). Outputs are unchanged, and
state dicts keep the original keys and shapes both ways (hooks), so checkpoints load into split and
unsplit models with ``strict=True``; :func:`unsplit` returns a merged copy for ``torch.save(model)``.
:func:`step_moves` takes one optimizer step and returns each group's mean absolute update, to check
the rates on a model. Needs torch alone (pandas for :meth:`KnobReport.frame`);
:mod:`qkov_lib.knob_trainer` puts the knob into the ``transformers`` Trainer.
"""

from __future__ import annotations

import copy
import math
import numbers
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from qkov_lib.knob_layouts import (  # the layouts are re-exported: part of knob's interface
    DIFFUSERS_FUSED,
    FAMILY_NORMS,
    FUSED_LAYOUTS,
    PART_GROUP,
    SEPARATE_FAMILIES,
    TRANSFORMER_LENS_PARTS,
    UNSUPPORTED_PACKED,
    Fused,
    FusedLayout,  # noqa: F401
    Layout,
    RuleSpec,
    equal_layout,  # noqa: F401
    grouped_layout,  # noqa: F401
    interleaved_layout,  # noqa: F401
    known_fused,
    lora_base,
    original_name,
    rule_spec,
    stacked_layout,  # noqa: F401
)
from qkov_lib.models import GROUPS, OV_PARAMS, QK_PARAMS, QKOVAttention

if TYPE_CHECKING:
    import pandas as pd

BERT_OUTPUT = re.compile(r"(?:^|\.)attention\.output\.dense$")


# --- the parametrization ------------------------------------------------------------------
class PackedSlices(nn.Module):
    """Parametrization that rebuilds a packed tensor from its slices: ``forward(*slices)`` is
    ``torch.cat(slices, dim)``; ``right_inverse(packed)`` splits it into contiguous copies of
    sizes ``sizes`` along ``dim``. ``parts`` labels the slices (e.g. ``("QK", "V")``)."""

    def __init__(self, sizes: Sequence[int], dim: int, parts: Sequence[str]) -> None:
        super().__init__()
        if len(sizes) != len(parts) or len(sizes) < 2:
            raise ValueError(f"need one part label per slice and at least two slices, got {sizes}, {parts}")
        self.sizes, self.dim, self.parts = [int(s) for s in sizes], int(dim), tuple(parts)
        self.in_optimizer = False  # set by knob_groups once the slices are handed out

    def forward(self, *slices: Tensor) -> Tensor:
        return torch.cat(slices, dim=self.dim)

    def right_inverse(self, packed: Tensor) -> tuple[Tensor, ...]:
        if packed.shape[self.dim] != sum(self.sizes):
            raise ValueError(f"cannot split size {packed.shape[self.dim]} along dim {self.dim} into {self.sizes}")
        return tuple(s.clone(memory_format=torch.contiguous_format) for s in packed.split(self.sizes, self.dim))

    def extra_repr(self) -> str:
        return f"parts={self.parts}, sizes={self.sizes}, dim={self.dim}"


def _packing(module: nn.Module, name: str) -> PackedSlices | None:
    """The :class:`PackedSlices` parametrization of ``module.<name>``, if it has one."""
    if not parametrize.is_parametrized(module, name):
        return None
    plist = module.parametrizations[name]
    if len(plist) == 1 and isinstance(plist[0], PackedSlices):
        return plist[0]
    raise ValueError(f"tensor {name!r} of {type(module).__name__} carries another parametrization; "
                     "the knob cannot split it")


def _packed_attrs(module: nn.Module) -> list[tuple[str, PackedSlices]]:
    """The ``(name, PackedSlices)`` of every split tensor of ``module`` itself."""
    if not parametrize.is_parametrized(module):
        return []
    return [(attr, plist[0]) for attr, plist in module.parametrizations.items()
            if len(plist) == 1 and isinstance(plist[0], PackedSlices)]


# --- what goes where ----------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One tensor, or one slice of a packed tensor, and its group.

    ``tensor`` is the name in the model's original layout (``layers.0.self_attn.in_proj_weight``);
    ``dim``/``start``/``stop`` give the slice (``dim`` None: the whole tensor); ``shape`` is the
    slice's shape; ``parameter`` is the name of the leaf parameter that holds it in
    ``model.named_parameters()`` (after :func:`split_packed` for slices, else "" while unsplit);
    ``weight_decay`` its weight decay once :func:`knob_groups` has made the groups.
    """

    tensor: str
    group: str
    part: str
    family: str
    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    parameter: str = ""
    weight_decay: float | None = None  # set by knob_groups (0 for the no-decay tensors)

    @property
    def index(self) -> tuple[slice, ...]:
        """Index of the slice in the full tensor (``(slice(None),)`` for a whole tensor)."""
        if self.dim is None:
            return (slice(None),)
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)

    @property
    def where(self) -> str:
        """``tensor`` with its slice written out, e.g. ``attn.in_proj_weight[0:16, :]``."""
        if self.dim is None:
            return self.tensor
        idx = [":"] * len(self.shape)
        idx[self.dim] = f"{self.start}:{self.stop}"
        return f"{self.tensor}[{', '.join(idx)}]"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class KnobReport:
    """Which tensor or slice went to which group, with the learning rates once known."""

    entries: list[Entry]
    lrs: dict[str, float] | None = None
    decay_rule: str = ""  # which tensors got no weight decay, in words
    split: tuple[str, ...] = ()  # tensors split into slices, in place, by the call that made the report

    @property
    def split_note(self) -> str:
        """What the split did to optimizers built before it (empty when nothing was split)."""
        if not self.split:
            return ""
        names = ", ".join(self.split[:6]) + (f" ... ({len(self.split)} tensors)" if len(self.split) > 6 else "")
        return (f"split into slices in place: {names}. An optimizer built before this call still holds the old "
                "tensors, which are no longer the model's parameters: its step would not move them. Use the "
                "optimizer (or groups) this call returned")

    def frame(self) -> pd.DataFrame:
        """One row per tensor or slice: where, part, family, group, lr, weight_decay, shape,
        numel, parameter."""
        import pandas as pd

        rows = [{"tensor / slice": e.where, "part": e.part, "family": e.family, "group": e.group,
                 "lr": (self.lrs or {}).get(e.group, float("nan")),
                 "weight_decay": float("nan") if e.weight_decay is None else e.weight_decay,
                 "shape": "x".join(map(str, e.shape)), "numel": e.numel, "parameter": e.parameter or e.tensor}
                for e in self.entries]
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """Per group: number of tensors/slices, number of scalars, learning rate and ``split``: how
        many of its slices come from tensors split in place by this call (named, with what that
        means for optimizers built earlier, in ``str(report)`` and ``attrs["split"]``)."""
        f = self.frame()
        f["split"] = [e.tensor in self.split for e in self.entries]
        out = f.groupby("group", sort=False).agg(tensors=("numel", "size"), numel=("numel", "sum"), lr=("lr", "first"),
                                                 split=("split", "sum"))
        out = out.reindex([g for g in GROUPS if g in out.index])
        out.attrs["split"] = self.split_note
        return out

    def __str__(self) -> str:
        lines = [f"weight decay: {self.decay_rule}"] if self.decay_rule else []
        show_wd = any(e.weight_decay for e in self.entries)
        for g in GROUPS:
            es = [e for e in self.entries if e.group == g]
            if not es:
                continue
            lr = "" if self.lrs is None else f", lr {self.lrs[g]:g}"
            lines.append(f"{g}: {len(es)} tensors/slices, {sum(e.numel for e in es):,} scalars{lr}")
            for e in es:
                tag = f"{e.part} ({e.family})" if e.part != "-" else e.family
                wd = f"  wd {e.weight_decay:g}" if show_wd else ""
                lines.append(f"  {e.where:<60} {tag}{wd}")
        if self.split:  # last: the line a long listing leaves on screen
            lines.append(self.split_note)
        return "\n".join(lines)


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


def _exact(name: str) -> str:
    """A rule's regular expression that matches the tensor ``name`` alone."""
    return "^" + re.escape(name) + "$"


_SLOT = attrgetter("group", "dim", "start", "stop")


class _Plan:
    """Collects entries, keyed by parameter name, and refuses conflicting ones."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.ids = {id(p): n for n, p in model.named_parameters()}
        self.owners: dict[int, list[str]] = {}  # every name of each parameter (shared ones have several)
        for n, p in model.named_parameters(remove_duplicate=False):
            self.owners.setdefault(id(p), []).append(n)
        self.by_param: dict[str, list[Entry]] = {}
        self.handled_modules: set[int] = set()
        self.frozen: list[str] = []  # attention tensors left out because requires_grad is False
        self.shared: dict[str, list[str]] = {}  # packed tensors held by more than one module
        self.attention: dict[str, str] = {}  # attention modules recognised: name -> family
        self.holders: set[int] = set()  # modules whose own tensors were placed (whole or packed)
        self.leaf_ids: dict[str, int] = {}  # whole tensors placed: parameter name -> id
        self.conflicts: dict[str, str] = {}  # tensors reached with different groups -> why
        self.reached: dict[str, str] = {}  # placed tensor -> the name by which a family first reached it

    def _add(self, key: str, entries: list[Entry], reached: str = "") -> None:
        old = self.by_param.get(key)
        if old is None:
            self.by_param[key] = entries
            self.reached[key] = reached or key
        elif list(map(_SLOT, old)) != list(map(_SLOT, entries)) and key not in self.conflicts:
            # decided later: a rule that places the tensor resolves it
            first = self.reached.get(key, key)
            self.conflicts[key] = (
                f"tied weights in different groups: {first} ({old[0].part}, {old[0].family}) and "
                f"{reached or entries[0].where} ({entries[0].part}, {entries[0].family}) are one tensor, "
                f"{key}, which cannot train at both rates. Untie them, or place it whole with a rule: "
                f"rules={{r'{_exact(key)}': 'qk'}} (or 'ov', 'other')")

    def _leaf(self, p: nn.Parameter, group: str, part: str, family: str, reached: str = "") -> None:
        key = self.ids[id(p)]
        self.leaf_ids[key] = id(p)
        self._add(key, [Entry(key, group, part, family, tuple(p.shape), parameter=key)], reached)

    def whole(self, module: nn.Module, mname: str, attr: str, part: str, family: str,
              group: str | None = None) -> None:
        """The tensor ``module.<attr>`` goes whole to ``group`` (default: the group of ``part``)."""
        p = getattr(module, attr, None)
        if p is None:
            return
        if _packing(module, attr) is not None:
            raise ValueError(f"{_join(mname, attr)} was split into slices but should be whole; call merge_packed first")
        self.holders.add(id(module))
        if isinstance(p, nn.Parameter) and p.requires_grad:
            self._leaf(p, group or PART_GROUP[part], part, family, _join(mname, attr))
        elif isinstance(p, nn.Parameter):  # else a buffer or a computed tensor: nothing to train
            self.frozen.append(_join(mname, attr))

    def subtree(self, module: nn.Module, mname: str, part: str, family: str, group: str | None = None) -> None:
        """Every trainable parameter below ``module`` goes to ``group`` (default: the group of ``part``)."""
        self.handled_modules.update(id(m) for m in module.modules())
        for pname, p in module.named_parameters():
            if p.requires_grad:
                self._leaf(p, group or PART_GROUP[part], part, family, _join(mname, pname))
            else:
                self.frozen.append(_join(mname, pname))

    def part(self, parent: nn.Module, pname: str, name: str, part: str, family: str) -> None:
        """``parent.<name>`` goes to the group of ``part``: a child module whole (subtree), an own
        tensor whole; nothing if the parent has neither (or it was placed already)."""
        child = parent._modules.get(name)
        if child is not None:
            if id(child) not in self.handled_modules:
                self.subtree(child, _join(pname, name), part, family)
        elif name in parent._parameters:
            self.whole(parent, pname, name, part, family)

    def packed(self, module: nn.Module, mname: str, attr: str, layout: str | Layout, dim: int, family: str) -> None:
        """``module.<attr>`` holds the blocks of ``layout`` along ``dim``; a string of part labels
        (``"QKV"``) means that many equal blocks, one per part."""
        tname = _join(mname, attr)
        pk = _packing(module, attr)
        value = getattr(module, attr, None)
        if value is None:
            return
        self.holders.add(id(module))
        if isinstance(layout, str):
            n = value.shape[dim]
            if n % len(layout):
                raise ValueError(f"ambiguous packed tensor {tname}: size {n} along dim {dim} does not split into "
                                 f"{len(layout)} equal parts {tuple(layout)}")
            layout = tuple((part, n // len(layout)) for part in layout)
        if pk is not None:  # already split: one leaf original0, original1, ... per run of the layout
            runs = _runs(layout)
            parts, sizes = tuple(r[0] for r in runs), [r[1] for r in runs]
            if pk.parts != parts or pk.sizes != sizes or pk.dim != dim:
                raise ValueError(f"{tname} was split as {pk.parts} {pk.sizes} along dim {pk.dim}, expected "
                                 f"{parts} {sizes} along {dim}")
            plist = module.parametrizations[attr]
            leaves = [getattr(plist, f"original{i}") for i, (_, _, blocks) in enumerate(runs) for _ in blocks]
        else:
            if not isinstance(value, nn.Parameter) or not value.requires_grad:
                if isinstance(value, nn.Parameter):
                    self.frozen.append(tname)
                return
            if value.shape[dim] != sum(s for _, s in layout):
                raise ValueError(f"ambiguous packed tensor {tname}: size {value.shape[dim]} along dim {dim}, but its "
                                 f"layout {family} has {sum(s for _, s in layout)} ({_layout_text(layout)})")
            tname = self.ids[id(value)]  # the canonical name, should the tensor be shared
            owners = self.owners[id(value)]  # one module under two names is no tie; two modules are
            if len({id(self.model.get_submodule(n.rpartition(".")[0])) for n in owners}) > 1:
                self.shared[tname] = owners
            leaves = [None] * len(layout)
        full, start, ents = tuple(value.shape), 0, []
        for (part, size), leaf in zip(layout, leaves):
            if leaf is None or leaf.requires_grad:
                shape = full[:dim] + (size,) + full[dim + 1:]
                ents.append(Entry(tname, PART_GROUP[part], part, family, shape, dim, start, start + size,
                                  "" if leaf is None else self.ids[id(leaf)]))
            start += size
        if ents:
            self._add(tname, ents)

    def projection(self, module: nn.Module, mname: str, layout: str | Layout, dim: int, family: str) -> None:
        """``module.weight`` (packed along ``dim``) and ``module.bias`` (along 0) hold ``layout``."""
        self.packed(module, mname, "weight", layout, dim, family)
        self.packed(module, mname, "bias", layout, 0, family)
        self.handled_modules.add(id(module))

    def fused(self, module: nn.Module, mname: str, layout: str | Layout, family: str,
              dim: int | Callable[[nn.Module], int] = 0) -> None:
        """A fused projection: ``weight`` packed along ``dim`` (a function of the layer that holds
        the weight, for a GPT-2 ``Conv1D``), ``bias`` along 0, nothing else. Wrapped in a peft LoRA
        layer: its ``base_layer`` the same way, each adapter's ``lora_B`` rows (the output features)
        like the base's output, each ``lora_A`` (shared by every part) whole to ``ov``."""
        base = lora_base(module)
        layer = module if base is None else base
        lname = mname if base is None else _join(mname, "base_layer")
        _check_only(layer, lname, ("weight", "bias"))
        self.projection(layer, lname, layout, dim(layer) if callable(dim) else dim, family)
        if base is None:
            return
        _check_only(module, mname, ("base_layer", "lora_A", "lora_B"))
        shared = "".join(dict.fromkeys(p for p, _ in layout)) if not isinstance(layout, str) else layout
        for adapter, b in module.lora_B.items():
            bname = _join(mname, "lora_B", adapter)
            _check_only(b, bname, ("weight", "bias"))
            self.projection(b, bname, layout, 0, f"{family}, LoRA B")
        for adapter, a in module.lora_A.items():
            self.subtree(a, _join(mname, "lora_A", adapter), shared, f"{family}, LoRA A (feeds {shared}: ov)", "ov")
        self.handled_modules.update(id(m) for m in module.modules())


def _runs(layout: Layout) -> list[tuple[str, int, list[int]]]:
    """The runs of adjacent blocks of ``layout`` whose parts share a group (e.g. one head's Q
    and K rows): ``(part labels, size, block indices)``. Each run is one leaf parameter."""
    out: list[tuple[str, int, list[int]]] = []
    for i, (part, size) in enumerate(layout):
        if out and PART_GROUP[out[-1][0][-1]] == PART_GROUP[part]:
            label, n, blocks = out[-1]
            out[-1] = (label + part, n + size, blocks + [i])
        else:
            out.append((part, size, [i]))
    return out


def _layout_text(layout: Layout) -> str:
    """A short text for a layout, e.g. ``Q4 K4 V4 Q4 K4 V4`` (at most 12 blocks shown)."""
    text = " ".join(f"{p}{s}" for p, s in layout[:12])
    return text + (f" ... ({len(layout)} blocks)" if len(layout) > 12 else "")


def _conv1d_dim(module: nn.Module, mname: str, n_parts: int) -> int:
    """The dim of ``module.weight`` along which ``n_parts`` projections are packed: 0 for
    ``nn.Linear`` (out, in), 1 for a HF ``Conv1D`` (in, out; recognised by its class name or
    its ``nf`` attribute), else the one dim that is ``n_parts`` times the other."""
    if isinstance(module, nn.Linear):
        return 0
    w = getattr(module, "weight", None)
    shape = None if w is None else tuple(w.shape)
    if shape is None or len(shape) != 2:
        raise ValueError(f"ambiguous packed projection {mname}: expected a 2-D weight, got {shape}")
    if type(module).__name__ == "Conv1D" or hasattr(module, "nf"):
        return 1
    fits = [d for d in (0, 1) if shape[d] == n_parts * shape[1 - d]]
    if len(fits) != 1:
        raise ValueError(f"ambiguous packed projection {mname} ({type(module).__name__}, weight {shape}): "
                         f"cannot tell which dim holds the {n_parts} packed parts; use nn.Linear or HF Conv1D")
    return fits[0]


def _check_only(module: nn.Module, mname: str, allowed: Sequence[str]) -> None:
    """Raise if ``module`` has parameters other than ``allowed`` (or their split slices)."""
    extra = [n for n, _ in module.named_parameters() if n.split(".")[0] not in (*allowed, "parametrizations")]
    if extra:
        raise ValueError(f"ambiguous packed projection {mname}: unexpected parameters {extra}")


def compile_rules(rules: Mapping[str, RuleSpec] | None) -> list[tuple[re.Pattern, RuleSpec]]:
    """``rules`` (regular expression on tensor names -> group, or layout of a fused tensor)
    compiled, in order; raises ValueError for an unknown group or layout or an invalid expression."""
    if rules is not None and not isinstance(rules, Mapping):
        raise TypeError(f"rules must be a mapping {{regex: group or layout}}, got {type(rules).__name__}")
    out = []
    for rx, value in (rules or {}).items():
        if isinstance(value, str) and value.lower() in GROUPS and value not in GROUPS:
            raise ValueError(f"rule {rx!r} names group {value!r}; the groups are {GROUPS} (lower case); a fused "
                             f"[{'; '.join(value)}] layout is knob.Fused({value!r})")
        spec = rule_spec(rx, value)
        try:
            out.append((re.compile(rx), spec))
        except (re.error, TypeError) as err:
            raise ValueError(f"rule {rx!r} is not a valid regular expression: {err}") from None
    return out


def _plan_module(plan: _Plan, mname: str, m: nn.Module) -> None:
    """The entries of the families recognised by the children (or class) of the module ``m``."""
    # all children, also a module registered under two names (k_proj = q_proj), which
    # named_children() would list once
    children = {c: mod for c, mod in m._modules.items() if mod is not None}
    fused = next((fl for fl in FUSED_LAYOUTS if fl.matches(m) and (fl.qkv in children or fl.separate)), None)
    if fused is not None:
        plan.attention[mname] = fused.family
        if fused.qkv in children:
            qkv, qname = children[fused.qkv], _join(mname, fused.qkv)
            if not isinstance(lora_base(qkv) or qkv, nn.Linear):
                raise ValueError(f"{qname} of {fused.attention} is a {type(qkv).__name__}; its layout "
                                 f"({fused.family}) is known for nn.Linear (or a peft LoRA layer over one) only")
            size = (lora_base(qkv) or qkv).out_features
            plan.fused(qkv, qname, fused.layout(m, size), fused.family)
        for name, part in fused.separate:
            plan.part(m, mname, name, part, fused.family)
        for name, part in fused.extras + ((fused.out, "O"),):
            plan.part(m, mname, name, part, fused.family)
        return
    for fam, table in SEPARATE_FAMILIES:
        present = {c: part for c, part in table.items() if c in children}
        if {"Q", "K"} <= set(present.values()):
            plan.attention[mname] = fam
            for name, part in {**table, **FAMILY_NORMS.get(fam, {})}.items():
                plan.part(m, mname, name, part, fam)
            for name, sources in DIFFUSERS_FUSED.items():  # [to_q; to_k; to_v] of fuse_projections()
                if getattr(m, "fused_projections", False) is True and name in children \
                        and all(isinstance(lora_base(children[s]) or children[s], nn.Linear) for s in sources):
                    layout = tuple((table[s], (lora_base(children[s]) or children[s]).out_features) for s in sources)
                    plan.fused(children[name], _join(mname, name), layout, fam)
    c_attn = children.get("c_attn")
    if c_attn is not None and id(c_attn) not in plan.handled_modules:
        fam, qname = "GPT-2 c_attn/c_proj", _join(mname, "c_attn")
        plan.attention[mname] = fam
        parts = "KV" if "q_attn" in children else "QKV"
        plan.fused(c_attn, qname, parts, fam, lambda layer: _conv1d_dim(layer, qname, len(parts)))
        for sibling, part in (("q_attn", "Q"), ("c_proj", "O")):
            if sibling in children:
                plan.subtree(children[sibling], _join(mname, sibling), part, fam)
    if BERT_OUTPUT.search(mname) and id(m) not in plan.handled_modules:
        plan.subtree(m, mname, "O", "query/key/value")


def _plan_families(model: nn.Module, mods: Mapping[str, nn.Module], problems: dict[str, str] | None = None) -> _Plan:
    """The entries of the built-in families (module docstring) for ``model``, before any rule.
    With ``problems`` (a dict), a module that cannot be placed is recorded there (module name ->
    message) instead of raising."""
    plan = _Plan(model)
    for mname, m in mods.items():  # attention modules that own their tensors
        if isinstance(m, nn.MultiheadAttention):
            fam = "nn.MultiheadAttention"
            plan.attention[mname] = fam
            if m._qkv_same_embed_dim:
                plan.packed(m, mname, "in_proj_weight", "QKV", 0, fam)
            else:
                for attr, part in (("q_proj_weight", "Q"), ("k_proj_weight", "K"), ("v_proj_weight", "V")):
                    plan.whole(m, mname, attr, part, fam)
            plan.packed(m, mname, "in_proj_bias", "QKV", 0, fam)
            plan.whole(m, mname, "bias_k", "K", fam)
            plan.whole(m, mname, "bias_v", "V", fam)
            plan.subtree(m.out_proj, _join(mname, "out_proj"), "O", fam)
            plan.handled_modules.add(id(m))
        elif isinstance(m, QKOVAttention):
            plan.attention[mname] = "QKOVAttention"
            for attr in QK_PARAMS + OV_PARAMS:
                plan.whole(m, mname, attr, attr, "QKOVAttention", "qk" if attr in QK_PARAMS else "ov")
        else:
            own = {n for n, _ in m.named_parameters(recurse=False)}
            if "W_Q" in own and {"W_K", "_W_K"} & own:  # TransformerLens
                plan.attention[mname] = "TransformerLens W_Q/W_K/W_V/W_O"
                for attr, part in TRANSFORMER_LENS_PARTS.items():
                    plan.whole(m, mname, attr, part, "TransformerLens W_Q/W_K/W_V/W_O")

    for mname, m in mods.items():  # attention modules recognised by their children
        if id(m) in plan.handled_modules:
            continue
        if problems is None:
            _plan_module(plan, mname, m)
            continue
        try:
            _plan_module(plan, mname, m)
        except ValueError as err:
            problems[mname] = str(err)
    return plan


def _rule_plan(model: nn.Module, layouts: Mapping[str, tuple[Fused, str]]) -> _Plan:
    """The entries of the tensors that rules give a layout: original tensor name -> (layout, rule)."""
    plan = _Plan(model)
    for tname, (spec, pattern) in layouts.items():
        module, attr = _owner(model, tname)
        mname, fam = tname.rpartition(".")[0], f"rule {pattern}: {spec}"
        if ".lora_A." in f".{tname}":  # a LoRA A feeds every part of the fused output
            plan.whole(module, mname, attr, spec.parts, f"{fam}, LoRA A (feeds {spec.parts}: ov)", "ov")
            continue
        value = getattr(module, attr)
        dim = 0 if value.dim() == 1 or ".lora_B." in f".{tname}" else spec.dim
        if dim >= value.dim():
            raise ValueError(f"rule {pattern!r} splits {tname} along dim {dim}, but it has shape {tuple(value.shape)}")
        plan.packed(module, mname, attr, spec.layout(value.shape[dim], f"rule {pattern!r} on {tname}"), dim, fam)
    return plan


def _assign(model: nn.Module, rules: Mapping[str, RuleSpec] | None,
            problems: dict[str, str] | None = None) -> tuple[list[Entry], _Plan]:
    """The entries of every trainable tensor (families, then rules over them, then ``other``)
    and the families' plan. Raises ValueError on the first problem, or, with ``problems`` (a
    dict), records each there (module or tensor name -> message) and goes on."""
    compiled = compile_rules(rules)
    mods = dict(model.named_modules())
    plan = _plan_families(model, mods, problems)

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ruled: dict[str, tuple[str, str]] = {}  # parameter -> (group, family) of the first rule that matches it
    layouts: dict[str, tuple[Fused, str]] = {}  # original tensor -> (layout, pattern) of a layout rule
    for n in names:
        tname = original_name(n)  # rules name tensors as in the unsplit model
        for rx, spec in compiled:
            if rx.search(tname):
                if isinstance(spec, Fused):
                    layouts.setdefault(tname, (spec, rx.pattern))
                else:
                    ruled[n] = (spec, f"rule {rx.pattern}")
                break
    rplan = _rule_plan(model, layouts)
    by_rule = {n for n in names if original_name(n) in layouts}
    entries: list[Entry] = [e for ents in rplan.by_param.values() for e in ents]
    seen: set[str] = {e.parameter or e.tensor for e in entries} | by_rule
    for ents in plan.by_param.values():  # rules override the families' tensors
        if not any((e.parameter or e.tensor) in ruled or (e.parameter or e.tensor) in by_rule for e in ents):
            entries.extend(ents)
            seen.update(e.parameter or e.tensor for e in ents)

    def problem(where: str, message: str) -> None:
        if problems is None:
            raise ValueError(message)
        problems.setdefault(where, message)

    # packed projections of unknown layout must not silently land in "other"
    for mname, m in mods.items():
        leaf = mname.rsplit(".", 1)[-1].lower()
        if leaf in UNSUPPORTED_PACKED and id(m) not in plan.handled_modules:
            own = [_join(mname, n) for n, p in m.named_parameters() if p.requires_grad]
            if own and not all(n in ruled or n in seen for n in own):
                parent = mods[mname.rpartition(".")[0]]
                problem(mname,
                        f"ambiguous attention tensor(s) {own}: '{leaf}' in {type(parent).__name__} looks like a packed "
                        "projection whose slice layout is model-specific (e.g. interleaved per head); the fused "
                        f"layouts checked against their models are {known_fused()}; pass rules={{regex: group}} "
                        "to place it whole, or rules={regex: 'QKV'} (knob.Fused) to split it with a layout you "
                        "checked; knob.inspect(model) lists what was found")
    shared = {t: owners for t, owners in {**plan.shared, **rplan.shared}.items() if t not in ruled}
    for t, owners in shared.items():
        problem(t, "packed tensor(s) shared by several modules: "
                f"{t} (also {', '.join(o for o in owners if o != t)}). Splitting one would break the tie; untie "
                "them, or pass rules={regex: group} to keep each whole in one group")
    for t, why in {**plan.conflicts, **rplan.conflicts}.items():
        if t not in ruled and t not in by_rule:
            problem(t, why)
    # a tensor tied to a module that is no attention projection (an embedding) would silently train at
    # the attention rate: refused, as a tie between Q and V is
    held = plan.handled_modules | plan.holders
    for key, pid in plan.leaf_ids.items():
        outside = [o for o in plan.owners[pid] if id(_owner(model, o)[0]) not in held]
        if outside and key not in ruled and key not in by_rule:
            e = plan.by_param[key][0]
            problem(key, f"tied weights: the attention projection {plan.reached[key]} ({e.part}, {e.family}) is the "
                    f"same tensor as {', '.join(outside)}, outside any attention module, which would train at the "
                    f"{e.group} rate with it. Untie them, or place it whole with a rule: "
                    f"rules={{r'{_exact(key)}': 'other'}} (or {e.group!r})")

    for n in names:
        if n in ruled or n not in seen:
            group, family = ruled.get(n, ("other", "other"))
            entries.append(Entry(n, group, "-", family, tuple(model.get_parameter(n).shape), parameter=n))
    plan.frozen += rplan.frozen
    return entries, plan


def classify(model: nn.Module, rules: Mapping[str, RuleSpec] | None = None) -> KnobReport:
    """Assign every trainable tensor (or slice of a packed tensor) of ``model`` to ``qk``, ``ov``
    or ``other``, without changing the model; returns the :class:`KnobReport`.

    ``rules`` maps regular expressions on tensor names (as in the unsplit model) to a group
    (``"qk"``, ``"ov"``, ``"other"``: the tensor goes whole there) or to a layout that splits a
    fused tensor (``"QKV"``, ``"KV"`` ... or :class:`Fused` with ``heads`` / ``dim``); the first
    rule that matches a tensor wins, over the built-in families. Raises ValueError (TypeError for
    a non-module) when no attention or no query/key parameter is recognised (saying so when they
    are frozen), when a tensor is reached with different groups (tied weights), when a packed
    tensor is shared by several modules or cannot be split, or when a rule is invalid;
    :func:`inspect` shows what was found without raising."""
    return _classify(model, rules)[0]


def _classify(model: nn.Module, rules: Mapping[str, RuleSpec] | None) -> tuple[KnobReport, _Plan]:
    """:func:`classify`, and the families' plan."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    entries, plan = _assign(model, rules)
    if not any(e.group in ("qk", "ov") for e in entries):
        if plan.frozen:
            raise ValueError(
                f"the attention parameters of {type(model).__name__} are all frozen (requires_grad=False), e.g. "
                f"{plan.frozen[:4]}; the knob has nothing to act on. Unfreeze them (requires_grad_(True)) first")
        raise ValueError(
            f"no attention parameters recognised in {type(model).__name__}: looked for "
            "nn.MultiheadAttention, QKOVAttention, q_proj/k_proj/v_proj/o_proj, query/key/value or "
            "query_proj/key_proj/value_proj + attention.output.dense, q/k/v/o, q_lin/k_lin/v_lin/out_lin, to_q/to_k/to_v/to_out, GPT-2 c_attn/c_proj, "
            f"TransformerLens W_Q/W_K/W_V/W_O, fused {known_fused()}; knob.inspect(model) lists the attention-like "
            "modules it found; pass rules={regex: group} or rules={regex: 'QKV'} for other layouts")
    if not any(e.group == "qk" for e in entries):
        raise ValueError(f"no trainable query/key parameters recognised in {type(model).__name__}"
                         + (f" (frozen: {plan.frozen[:4]})" if plan.frozen else "")
                         + ": the ratio eta_QK/eta_OV would act on nothing")
    return KnobReport(entries), plan


# --- a model the families do not know ------------------------------------------------------
ATTENTION_CLASS = re.compile(r"attn|attention", re.IGNORECASE)
# the name of a child (or own tensor) of an attention-like module that looks like a projection of
# Q, K, V or O, or a qk-norm: left unplaced, it would silently train at the "other" rate
PROJECTION_NAME = re.compile(
    r"[qkvo]|query|key|value|qkv|qk|kv|out|dense|proj|w_?(?:q|k|v|o|qkv|kv|pack)|c_attn|[qkv]_attn"
    r"|[qkv]_?bias|\w*_proj(?:_\w+)?|proj_\w+|to_\w+|in_proj\w*|[qkv]_?lin(?:ear)?|[qk]_?(?:norm|ln|layer_?norm)"
    r"|(?:query|key|value|[qkv])_\w+",
    re.IGNORECASE)


def _attention_like(model: nn.Module, plan: _Plan, problems: Mapping[str, str] | None = None) -> list[str]:
    """The names of the attention-like modules of ``model``, innermost (longest name) first: those
    a family recognised, those of a class named ``*Attention*`` / ``*Attn*``, and the parents of
    a projection named like ``qkv`` or of a module that could not be placed."""
    mods = dict(model.named_modules())
    like = set(plan.attention) | {n for n, m in mods.items() if ATTENTION_CLASS.search(type(m).__name__)}
    like |= {n.rpartition(".")[0] for n in mods if n.rsplit(".", 1)[-1].lower() in UNSUPPORTED_PACKED}
    like |= {n.rpartition(".")[0] for n in problems or () if n in mods}
    return sorted(like, key=len, reverse=True)


def _owner_of(tname: str, like: Sequence[str]) -> str | None:
    """The innermost attention-like module (of ``like``, innermost first) that holds ``tname``."""
    return next((m for m in like if not m or tname.startswith(m + ".")), None)


def _looks_unplaced(tname: str, like: Sequence[str]) -> bool:
    """Whether the tensor ``tname``, which no family or rule placed, is a child (or own tensor)
    of an attention-like module with a projection-like name (:data:`PROJECTION_NAME`)."""
    owner = _owner_of(tname, like)
    return owner is not None and bool(PROJECTION_NAME.fullmatch(tname[len(owner) + bool(owner):].split(".")[0]))


def _guess_group(name: str) -> str:
    """The group a projection name suggests (``query_proj`` -> qk, ``wo`` -> ov), or ``"?"``."""
    words = set(re.split(r"[_\W\d]+", name.lower()))
    if words & {"q", "k", "query", "key", "wq", "wk", "qk", "norm", "ln"} and not words & {"v", "value", "kv", "qkv"}:
        return "qk"
    if words & {"v", "o", "value", "out", "dense", "proj", "wv", "wo"} and not words & {"q", "k", "query", "key"}:
        return "ov"
    return "?"


def _check_placed(model: nn.Module, report: KnobReport, plan: _Plan, strict: bool) -> None:
    """Refuse (``strict``; else warn about) the tensors that look like attention projections but
    that no family or rule placed: they would train at the ``other`` rate."""
    like = _attention_like(model, plan)
    loose = [e.tensor for e in report.entries if e.family == "other" and _looks_unplaced(e.tensor, like)]
    if not loose:
        return
    names = ", ".join(loose[:6]) + (f" ... ({len(loose)} tensors)" if len(loose) > 6 else "")
    rules: dict[str, str] = {}
    for t in loose:
        owner = _owner_of(t, like)
        child = t[len(owner) + bool(owner):].split(".")[0]
        rules.setdefault(rf"(^|\.){re.escape(child)}(\.|$)", _guess_group(child))
    body = ", ".join(f"r'{rx}': '{g}'" for rx, g in rules.items())
    classes = sorted({type(model.get_submodule(_owner_of(t, like))).__name__ for t in loose})
    what = (f"tensor(s) that look like attention projections in {', '.join(classes)} but that no family or rule "
            f"places: {names}. They would train at the 'other' rate, not at the rate of their circuit.")
    if strict:
        raise ValueError(f"{what} Check what each computes (knob.inspect(model) lists them) and place them with "
                         f"rules, e.g. rules={{{body}}} ('qk' for what enters the attention scores, 'ov' for the "
                         "values and output; '?': decide, or knob.Fused for a fused one), or pass strict=False "
                         "to train them in 'other'")
    warnings.warn(f"{what} strict=False: they go to 'other'; rules={{regex: group}} places them", stacklevel=3)


def _placed(ents: Sequence[Entry]) -> str:
    """Where the entries of one tensor go, e.g. ``qk: Q[0:8] K[8:16]; ov: V[16:24]`` or ``qk (Q)``."""
    if ents[0].dim is None:
        e = ents[0]
        return e.group if e.part == "-" else f"{e.group} ({e.part})"
    by: dict[str, list[str]] = {}
    for e in ents:
        by.setdefault(e.group, []).append(f"{e.part}[{e.start}:{e.stop}]")
    return "; ".join(f"{g}: {' '.join(v)}" if len(v) <= 6 else f"{g}: {len(v)} slices {v[0]} {v[1]} ... {v[-1]}"
                     for g, v in by.items())


def _suggest(model: nn.Module, mname: str) -> tuple[str, str]:
    """A rule for the fused projection ``mname`` of unknown layout: a regex for its tensors in
    every layer (digits generalised) and the ``[Q; K; V]`` (or ``[K; V]``) layout its size allows."""
    pattern = re.sub(r"\d+", r"\\d+", re.escape(mname)) + r"\."
    m = model.get_submodule(mname)
    w = getattr(lora_base(m) or m, "weight", None)
    dim = _conv1d_dim(lora_base(m) or m, mname, 3) if isinstance(w, Tensor) and w.dim() == 2 else 0
    n = w.shape[dim] if isinstance(w, Tensor) else 0
    return pattern, "QKV" if n % 3 == 0 else "KV" if n % 2 == 0 else "?"


@dataclass
class Inspection:
    """What :func:`inspect` found: ``rows``, one per trainable tensor below an attention-like
    module (recognised by a family, named ``*Attention*`` / ``*Attn*``, or holding a projection
    named like ``qkv``), with the keys ``module``, ``class``, ``family``, ``tensor``, ``shape``,
    ``goes to`` (group and part, or the slices of a split tensor) and ``note``; ``problems``:
    module or tensor -> why it cannot be placed (what :func:`classify` would raise); ``suggested``:
    rules (regex -> layout) for the fused projections of unknown layout, to be checked against
    the model's forward before use."""

    rows: list[dict[str, str]]
    problems: dict[str, str]
    suggested: dict[str, str]

    def frame(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.rows, columns=["module", "class", "family", "tensor", "shape", "goes to", "note"])

    def __str__(self) -> str:
        lines, current = [], None
        width = max((len(r["tensor"]) for r in self.rows), default=0)
        for r in self.rows:
            if r["module"] != current:
                current = r["module"]
                lines.append(f"{r['module'] or '(model)'}  [{r['class']}]  {r['family']}")
            note = f"   <- {r['note']}" if r["note"] else ""
            lines.append(f"  {r['tensor']:<{width}}  {r['shape']:>9}  {r['goes to']}{note}")
        if not self.rows:
            lines.append("no attention-like module found (no family matched, no class named *Attention*/*Attn*)")
        if self.problems:  # the same refusal in every layer: said once
            (first, msg), *more = self.problems.items()
            lines.append(f"cannot place {first}: {msg}")
            if more:
                names = ", ".join(w for w, _ in more[:6]) + (" ..." if len(more) > 6 else "")
                lines.append(f"  and {len(more)} more: {names}")
        if self.suggested:
            body = ", ".join(f"r'{p}': {v!r}" for p, v in self.suggested.items())
            lines.append(f"rules that would split the unknown fused projections (check the layout against the "
                         f"model's forward first; per head: knob.Fused('QKV', heads=H)): rules={{{body}}}")
        return "\n".join(lines)


def inspect(model: nn.Module, rules: Mapping[str, RuleSpec] | None = None) -> Inspection:
    """Every attention-like module of ``model`` with the tensors found below it and where each
    would go under the built-in families and ``rules`` (as :func:`classify` with the same
    rules), what could not be placed and why, and suggested layout rules for fused projections
    of unknown layout. Never raises for a model it cannot place (only for invalid ``rules``);
    changes nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    problems: dict[str, str] = {}
    entries, plan = _assign(model, rules, problems)
    mods = dict(model.named_modules())
    by_tensor: dict[str, list[Entry]] = {}
    for e in entries:
        by_tensor.setdefault(original_name(e.tensor), []).append(e)
    rows, like = [], _attention_like(model, plan, problems)
    for tname, ents in by_tensor.items():
        owner = _owner_of(tname, like)
        if owner is None:
            continue
        mod, shape = mods[owner], tuple(tensor_value(model, tname).shape)
        note = ""
        if ents[0].family == "other":
            bad = next((w for w in problems if tname.startswith(w + ".")), None)
            note = ("cannot place: see below" if bad else
                    "looks like a projection no family places: knob_optimizer refuses it (place it with rules=, "
                    "or strict=False: other)" if _looks_unplaced(tname, like) else
                    "not placed by any family: goes to other")
        family = plan.attention.get(owner) or ("rules" if any(e.family.startswith("rule ") for e in ents)
                                                else "no family matched")
        rows.append({"module": owner, "class": type(mod).__name__, "family": family, "tensor": tname,
                     "shape": "x".join(map(str, shape)), "goes to": _placed(ents), "note": note})
    order = {n: i for i, n in enumerate(mods)}
    rows.sort(key=lambda r: order[r["module"]])  # stable: tensors keep the model's order within a module
    suggested = dict(_suggest(model, w) for w in problems
                     if w in mods and w.rsplit(".", 1)[-1].lower() in UNSUPPORTED_PACKED)
    return Inspection(rows, problems, suggested)


# --- splitting packed tensors ------------------------------------------------------------
def _private_class(module: nn.Module) -> None:
    """Give a parametrized module its own copy of its ``Parametrized...`` class: deep copies
    share that class, which carries the parametrization properties, so (un)registering on one
    copy would change the other (``nn.TransformerEncoder`` deep-copies its layer)."""
    if not parametrize.is_parametrized(module):
        return
    cls = type(module)
    body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    module.__class__ = type(cls.__name__, cls.__bases__, body)


def _owner(model: nn.Module, tensor: str) -> tuple[nn.Module, str]:
    mname, _, attr = tensor.rpartition(".")
    return (model.get_submodule(mname) if mname else model), attr


def _slice_keys(prefix: str, attr: str, pk: PackedSlices) -> list[str]:
    return [f"{prefix}parametrizations.{attr}.original{i}" for i in range(len(pk.sizes))]


def _state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: the slices ``parametrizations.<attr>.original<i>`` of every split
    tensor become one tensor under the original key ``<attr>``, placed before the module's other
    keys (where a module's own parameters stand): keys, shapes and order of the unsplit model."""
    merged, drop = [], set()
    for attr, pk in _packed_attrs(module):
        keys = _slice_keys(prefix, attr, pk)
        if all(k in state_dict for k in keys):
            merged.append((prefix + attr, torch.cat([state_dict[k] for k in keys], pk.dim)))
            drop.update(keys)
    if not merged:
        return
    items = list(state_dict.items())
    at = next(i for i, (k, _) in enumerate(items) if k.startswith(prefix))
    state_dict.clear()
    state_dict.update(items[:at] + merged + [kv for kv in items[at:] if kv[0] not in drop])


def _load_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
               missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """Load-state-dict pre-hook: a tensor under the original key ``<attr>`` of a split tensor is
    cut into the slices ``parametrizations.<attr>.original<i>`` (a wrong size is reported as a
    load error, naming the key)."""
    for attr, pk in _packed_attrs(module):
        key = prefix + attr
        if key not in state_dict:
            continue
        value = state_dict[key]
        if value.dim() <= pk.dim or value.shape[pk.dim] != sum(pk.sizes):
            error_msgs.append(f"size mismatch for {key}: the checkpoint has shape {tuple(value.shape)}, the model's "
                              f"split tensor has {sum(pk.sizes)} along dim {pk.dim}")
            continue
        del state_dict[key]
        assign = local_metadata.get("assign_to_params_buffers", False)  # then the pieces become the parameters
        for k, piece in zip(_slice_keys(prefix, attr, pk), value.split(pk.sizes, pk.dim)):
            state_dict[k] = piece.clone(memory_format=torch.contiguous_format) if assign else piece


def _hook_keys(hooks: Mapping, fn: Callable) -> list:
    """The keys under which ``fn`` is registered in a module's ``hooks`` dict."""
    return [k for k, h in hooks.items() if getattr(h, "hook", h) is fn]


def split_packed(model: nn.Module, report: KnobReport | None = None) -> list[str]:
    """Re-register every packed tensor whose slices fall in different groups as one leaf
    parameter per run of adjacent slices of the same group (a :class:`PackedSlices`
    parametrization; GPT-NeoX: per head one Q+K leaf and one V leaf), in place. Outputs are
    unchanged, and so are ``state_dict()`` keys and shapes (see the module docstring). Returns
    the names of the tensors that were split (idempotent: already split tensors are skipped).
    Build the optimizer *after* this call."""
    report = report or classify(model)
    by_tensor: dict[str, list[Entry]] = {}
    for e in report.entries:
        if e.dim is not None and not e.parameter:
            by_tensor.setdefault(e.tensor, []).append(e)
    for tname, ents in by_tensor.items():
        module, attr = _owner(model, tname)
        _private_class(module)
        runs = _runs(tuple((e.part, e.stop - e.start) for e in ents))
        pk = PackedSlices([r[1] for r in runs], ents[0].dim, [r[0] for r in runs])
        parametrize.register_parametrization(module, attr, pk)
        if not _hook_keys(module._state_dict_hooks, _state_dict_hook):
            module.register_state_dict_post_hook(_state_dict_hook)
            module.register_load_state_dict_pre_hook(_load_hook)
    return list(by_tensor)


def _merge_split(model: nn.Module) -> list[str]:
    done = []
    for mname, m in list(model.named_modules()):
        attrs = [attr for attr, _ in _packed_attrs(m)]
        for attr in attrs:
            _private_class(m)
            parametrize.remove_parametrizations(m, attr, leave_parametrized=True)
            done.append(_join(mname, attr))
        if attrs:
            for hooks, fn in ((m._state_dict_hooks, _state_dict_hook), (m._load_state_dict_pre_hooks, _load_hook)):
                for k in _hook_keys(hooks, fn):
                    del hooks[k]
    return done


def merge_packed(model: nn.Module) -> list[str]:
    """Undo :func:`split_packed` in place: every :class:`PackedSlices` tensor becomes one plain
    parameter again, holding the current values. Returns the names that were merged.

    Refused (ValueError, nothing changed) once :func:`knob_groups` / :func:`knob_optimizer` gave
    the slices to an optimizer, which would silently stop training the merged tensor. For a
    checkpoint ``model.state_dict()`` already has the original layout; :func:`unsplit` returns a
    merged copy."""
    held = [_join(mname, attr) for mname, m in model.named_modules() for attr, pk in _packed_attrs(m) if pk.in_optimizer]
    if held:
        raise ValueError(f"cannot merge {held[:3]}{' ...' if len(held) > 3 else ''} in place: its slices are parameters "
                         "of an optimizer made by knob_groups/knob_optimizer, which would silently stop updating the "
                         "merged tensor. Use unsplit(model) for a merged copy, or model.state_dict() (original "
                         "layout) for a checkpoint")
    return _merge_split(model)


def unsplit(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every split tensor merged back into one plain parameter
    (current values, original layout and class), for export: ``torch.save``, tracing, or code
    that does not know the knob. ``model`` and its optimizer are left as they are."""
    out = copy.deepcopy(model)
    _merge_split(out)
    return out


# --- optimizer groups ---------------------------------------------------------------------
NORM_CLASS = re.compile(r"norm", re.IGNORECASE)
BIAS_NAME = re.compile(r"(?:^|\.)(?:bias|_?b_[A-Z]+|bias_[kv])$")


def default_no_decay(name: str, param: Tensor, module: nn.Module) -> bool:
    """The default rule for which tensors get no weight decay (as the ``transformers`` Trainer,
    timm and nanoGPT do): 1-D tensors (biases, normalisation gains, a slice of a packed bias),
    tensors named as biases (``bias``, ``bias_k``, TransformerLens ``b_Q`` ...), and every
    parameter of a normalisation module (class name containing ``Norm``: LayerNorm, RMSNorm ...).
    ``name`` is the tensor's name in the original layout, ``module`` the module that owns it."""
    return param.dim() < 2 or bool(BIAS_NAME.search(name)) or bool(NORM_CLASS.search(type(module).__name__))


def real_number(name: str, value: object, minimum: str = "> 0") -> float:
    """``value`` as a Python float, when it is one real number: an ``int`` or ``float``, a numpy
    scalar (``np.int64``, ``np.float32`` ...: anything registered as ``numbers.Real``), or a 0-d
    numpy array or torch tensor of an integer or floating dtype. A bool is not a number. TypeError
    for anything else (a function gets what to do instead: a schedule goes on the optimizer);
    ValueError unless finite and ``> 0`` (``minimum=">= 0"``: finite and >= 0)."""
    if callable(value) and not isinstance(value, (numbers.Number, Tensor)):
        raise TypeError(f"{name} must be a number, got the function {getattr(value, '__name__', value)!r}: the knob "
                        "sets each group's rate from numbers; to change rates during training put a scheduler on the "
                        "optimizer it returns, e.g. torch.optim.lr_scheduler.LambdaLR(opt, lambda step: ...), which "
                        "scales every group alike and keeps the ratio")
    dtype = getattr(value, "dtype", None)
    kind = "b" if dtype is torch.bool else "f" if isinstance(dtype, torch.dtype) and dtype.is_floating_point \
        else "i" if isinstance(dtype, torch.dtype) and not dtype.is_complex else getattr(dtype, "kind", None)
    if isinstance(value, bool) or kind == "b":
        raise TypeError(f"{name} must be a number, got the bool {value!r}")
    if isinstance(value, numbers.Real):
        x = float(value)
    elif getattr(value, "ndim", None) == 0 and kind in ("i", "u", "f"):  # 0-d numpy array or torch tensor
        x = float(value.item())
    else:
        shape = getattr(value, "shape", None)
        what = f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else type(value).__name__
        raise TypeError(f"{name} must be one real number (int, float, a numpy scalar or a 0-d array or tensor), "
                        f"got {what}: {value!r}")
    if not math.isfinite(x) or (x <= 0 if minimum == "> 0" else x < 0):
        source = "" if type(value) in (int, float) else f" (a {type(value).__module__}.{type(value).__name__})"
        raise ValueError(f"{name} must be a finite number {minimum}, got {x!r}{source}")
    return x


def group_rates(eta_ov: float, ratio: float = 1.0, eta_other: float | None = None) -> dict[str, float]:
    """``{"qk": eta_ov * ratio, "ov": eta_ov, "other": eta_other or eta_ov}``, validated: each a
    finite real number > 0 (:func:`real_number`)."""
    eta_ov = real_number("eta_ov", eta_ov)
    ratio = real_number("ratio (eta_QK/eta_OV)", ratio)
    eta_other = eta_ov if eta_other is None else real_number("eta_other", eta_other)
    qk = eta_ov * ratio
    if not (math.isfinite(qk) and qk > 0):
        raise ValueError(f"the QK learning rate eta_ov * ratio = {eta_ov!r} * {ratio!r} = {qk!r} is not a finite "
                         "number > 0")
    return {"qk": qk, "ov": eta_ov, "other": eta_other}


def _check_weight_decay(weight_decay: float) -> float:
    return real_number("weight_decay", weight_decay, ">= 0")


def knob_groups(model: nn.Module, eta_ov: float, ratio: float = 1.0, eta_other: float | None = None,
                weight_decay: float = 0.0, rules: Mapping[str, str] | None = None, split: bool = True,
                no_decay: Callable[[str, Tensor, nn.Module], bool] | None = default_no_decay,
                strict: bool = True) -> tuple[list[dict], KnobReport]:
    """Optimizer parameter groups for any model, and the report.

    Groups ``qk`` (``lr = eta_ov * ratio``), ``ov`` (``eta_ov``) and ``other`` (``eta_other``,
    default ``eta_ov``); with ``weight_decay > 0`` the tensors for which ``no_decay(name,
    param, module)`` is true (default :func:`default_no_decay`; ``None``: decay everything) go
    to ``qk.no_decay`` / ``ov.no_decay`` / ``other.no_decay`` with ``weight_decay = 0``. Every
    group has the keys ``name``, ``params``, ``lr``, ``weight_decay`` and ``lr_scale`` (its
    ``lr`` / ``eta_ov``), for schedulers that set absolute per-group rates
    (``OneCycleLR(max_lr=[peak * g["lr_scale"] for g in groups])``). Empty groups are dropped.

    ``strict`` (default): a tensor that looks like an attention projection (a child of an
    attention-like module named like ``q``, ``key``, ``value_proj``, ``wq``, ``qkv`` ...) but that
    no family or rule places is refused, naming it and the ``rules=`` that would place it;
    ``strict=False`` puts it in ``other`` with a warning. :func:`inspect` lists such tensors.

    Everything is checked before the model is changed, so a refused call leaves it untouched.
    Then packed tensors are split in place (:func:`split_packed`; with ``split=False`` a model
    that needs it raises ValueError), and the report's ``split`` names them: an optimizer built
    before this call holds the old packed tensors, which are no longer the model's parameters
    (its step would not move them). Build the optimizer from the returned groups.
    """
    weight_decay = _check_weight_decay(weight_decay)
    lrs = group_rates(eta_ov, ratio, eta_other)
    if no_decay is not None and not callable(no_decay):
        raise TypeError(f"no_decay must be a function (name, param, module) -> bool or None, got {no_decay!r}")
    report, plan = _classify(model, rules)
    _check_placed(model, report, plan, strict)
    pending = sorted({e.tensor for e in report.entries if e.dim is not None and not e.parameter})
    done: list[str] = []
    if pending:
        if not split:
            raise ValueError(f"packed tensors {pending} hold slices of different groups; per-slice learning "
                             "rates need split=True (re-registers each slice as its own parameter)")
        done = split_packed(model, report)
        report = classify(model, rules)
    params = dict(model.named_parameters())
    quiet = set()
    if weight_decay > 0 and no_decay is not None:
        quiet = {e.parameter for e in report.entries
                 if no_decay(e.tensor, params[e.parameter], _owner(model, e.tensor)[0])}
    entries = [replace(e, weight_decay=0.0 if e.parameter in quiet else weight_decay) for e in report.entries]
    if weight_decay == 0:
        rule = ""
    elif no_decay is None:
        rule = f"{weight_decay:g} on every tensor (no_decay=None)"
    else:
        why = ("1-D tensors, biases (bias, bias_k, b_Q ...) and *Norm* modules: default_no_decay"
               if no_decay is default_no_decay else f"no_decay={getattr(no_decay, '__name__', no_decay)}")
        rule = f"{weight_decay:g}; none on {sum(e.weight_decay == 0 for e in entries)} tensors/slices ({why})"
    groups = []
    for g in GROUPS:
        leaves = list(dict.fromkeys(e.parameter for e in entries if e.group == g))  # a leaf may hold Q and K
        for name, ps, wd in ((g, [params[n] for n in leaves if n not in quiet], weight_decay),
                             (f"{g}.no_decay", [params[n] for n in leaves if n in quiet], 0.0)):
            if ps:
                groups.append({"name": name, "params": ps, "lr": lrs[g], "weight_decay": wd,
                               "lr_scale": lrs[g] / lrs["ov"]})
    covered = sum(len(gr["params"]) for gr in groups)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    if covered != trainable or len({id(p) for gr in groups for p in gr["params"]}) != covered:
        raise RuntimeError(f"internal error: {covered} grouped parameters for {trainable} trainable ones")
    for m in model.modules():
        for _, pk in _packed_attrs(m):
            pk.in_optimizer = True
    return groups, replace(report, entries=entries, lrs=lrs, decay_rule=rule, split=tuple(done))


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def _optimizer_class(optimizer_cls: Any) -> Callable[..., torch.optim.Optimizer]:
    if isinstance(optimizer_cls, str):
        if optimizer_cls.lower() not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer_cls!r}; expected 'adamw', 'sgd' or an optimizer class "
                             "such as torch.optim.Adam")
        return OPTIMIZERS[optimizer_cls.lower()]
    if not callable(optimizer_cls):
        raise TypeError(f"optimizer_cls must be an optimizer class (e.g. torch.optim.AdamW), got {optimizer_cls!r}")
    return optimizer_cls


def knob_optimizer(model: nn.Module, optimizer_cls: Any = torch.optim.AdamW, lr: float = 1e-3, qk_ratio: float = 1.0,
                   weight_decay: float = 0.0, *, other_lr: float | None = None,
                   rules: Mapping[str, str] | None = None,
                   no_decay: Callable[[str, Tensor, nn.Module], bool] | None = default_no_decay,
                   strict: bool = True, **optimizer_kwargs) -> tuple[torch.optim.Optimizer, KnobReport]:
    """``(optimizer_cls(groups, **optimizer_kwargs), report)`` over :func:`knob_groups`: the call
    of peft's ``create_loraplus_optimizer(model, optimizer_cls, lr, loraplus_lr_ratio, **kwargs)``.

    ``lr`` is the OV rate ``eta_OV`` (and the default of ``other_lr``), ``qk_ratio`` the knob
    ``eta_QK / eta_OV``; ``optimizer_cls`` is any class taking parameter groups or the shortcut
    ``"adamw"`` / ``"sgd"``. ``lr``, ``qk_ratio``, ``other_lr`` and ``weight_decay`` are real
    numbers (numpy scalars and 0-d arrays or tensors too, :func:`real_number`); a schedule goes on
    the returned optimizer (``LambdaLR`` ...), not in ``lr``. ``strict`` (default) refuses a tensor
    that looks like an attention projection but that no family or rule places
    (:func:`knob_groups`). The optimizer and its keyword arguments (built first on stand-in
    tensors), the rates, the rules and the model are all checked before the model is changed.

    An optimizer built before this call is stale: where a packed tensor is split into slices
    (``nn.MultiheadAttention``'s ``in_proj_weight``, GPT-2's ``c_attn`` ...: ``report.split``
    names them), it holds the old tensors, which are no longer the model's parameters, and its
    step would not move them. Use the returned optimizer."""
    cls = _optimizer_class(optimizer_cls)
    weight_decay = _check_weight_decay(weight_decay)
    lr, qk_ratio = real_number("lr (eta_ov)", lr), real_number("qk_ratio", qk_ratio)
    other_lr = None if other_lr is None else real_number("other_lr", other_lr)
    lrs = group_rates(lr, qk_ratio, other_lr)
    classify(model, rules)  # refuses a model it cannot place before the dry run
    probe = next((p for p in model.parameters() if p.requires_grad), None)
    try:  # a dry run: bad keyword arguments fail here, before the split
        cls([{"name": g, "params": [torch.zeros(1, dtype=probe.dtype, device=probe.device, requires_grad=True)],
              "lr": lrs[g], "weight_decay": weight_decay, "lr_scale": lrs[g] / lrs["ov"]} for g in GROUPS],
            **optimizer_kwargs)
    except Exception as err:
        kind = type(err) if isinstance(err, (TypeError, ValueError)) else ValueError
        raise kind(f"{getattr(cls, '__name__', cls)} refused the knob's groups with {optimizer_kwargs}: {err} "
                   "(the model was not changed)") from err
    groups, report = knob_groups(model, lr, qk_ratio, other_lr, weight_decay, rules, no_decay=no_decay, strict=strict)
    return cls(groups, **optimizer_kwargs), report


def tensor_value(model: nn.Module, tensor: str) -> Tensor:
    """The current value of a tensor by its name in the original layout (a split packed
    tensor is rebuilt from its slices)."""
    module, attr = _owner(model, tensor)
    value = getattr(module, attr)
    if not isinstance(value, Tensor):
        raise ValueError(f"{tensor} is not a tensor of the model")
    return value


def step_moves(model: nn.Module, report: KnobReport, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[], Tensor]) -> dict[str, float]:
    """Take one optimizer step and return, per group of ``report`` (``qk``, ``ov``, ``other``
    present in it), the mean absolute change of its elements, in the parameters' own units.

    ``report`` is the one :func:`knob_optimizer` / :func:`knob_groups` returned for ``model``
    (after the split), ``optimizer`` the optimizer built over its groups and ``loss_fn()`` a
    scalar loss of the model. The step: ``zero_grad``, ``loss_fn().backward()``,
    ``optimizer.step()``. Every tensor or slice of the report counts with all its elements, so
    each group's mean is over its ``numel``. Adam's first step (no weight decay) moves an element
    by about its learning rate wherever its gradient is not ~0, so ``qk / ov`` comes out near
    ``qk_ratio``; elements whose gradient is zero (a key bias, which softmax ignores) barely
    move and pull their group's mean down. TypeError for a report that is not a
    :class:`KnobReport` or a ``loss_fn`` that is not callable, ValueError when a tensor of the
    report is not in ``model`` or the loss is not a scalar tensor with a gradient."""
    if not isinstance(report, KnobReport):
        raise TypeError(f"report must be the KnobReport of knob_optimizer/knob_groups, got {type(report).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function () -> scalar loss tensor, got {loss_fn!r}")
    tensors = sorted({e.tensor for e in report.entries})
    try:
        before = {t: tensor_value(model, t).detach().clone() for t in tensors}
    except AttributeError as err:
        raise ValueError(f"the report names tensors that are not in {type(model).__name__} ({err}): pass the "
                         "report that knob_optimizer/knob_groups returned for this model") from err
    optimizer.zero_grad()
    loss = loss_fn()
    if not (isinstance(loss, Tensor) and loss.dim() == 0 and loss.requires_grad):
        raise ValueError(f"loss_fn() must return a scalar tensor that requires grad, got "
                         f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}")
    loss.backward()
    optimizer.step()
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    with torch.no_grad():
        for e in report.entries:
            move = (tensor_value(model, e.tensor) - before[e.tensor])[e.index].abs()
            total[e.group] = total.get(e.group, 0.0) + float(move.double().sum())
            count[e.group] = count.get(e.group, 0) + e.numel
    return {g: total[g] / count[g] for g in GROUPS if g in count}
