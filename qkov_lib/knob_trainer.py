"""The knob in the ``transformers`` Trainer: :class:`KnobTrainer` and :class:`KnobTrainingArguments`.

``KnobTrainer`` is a ``transformers.Trainer`` whose ``create_optimizer`` builds the optimizer with
:func:`qkov_lib.knob.knob_optimizer`: the optimizer class and its keyword arguments are the
Trainer's own (``args.optim``, ``adam_beta1`` ... or ``optimizer_cls_and_kwargs``), the OV rate is
``args.learning_rate``, the QK rate ``args.learning_rate * args.qk_ratio``, weight decay
``args.weight_decay`` (no decay for biases and normalisation weights:
:func:`qkov_lib.knob.default_no_decay`). Because the optimizer is made by the Trainer, this works
with ``model_init`` and ``hyperparameter_search`` (``qk_ratio`` is a field of the arguments, so a
search space may include it), which ``Trainer(optimizers=...)`` does not allow. The Trainer's
schedulers multiply every group's rate by the same factor, so the ratio holds at every step.

Each training log gets the current rate of every group, ``learning_rate/qk``,
``learning_rate/ov`` and ``learning_rate/other``, and ``learning_rate`` is the OV rate (the
Trainer would log the rate of group 0). Checkpoints keep the model's original state-dict keys
(see :mod:`qkov_lib.knob`), so ``resume_from_checkpoint`` and ``from_pretrained`` work as usual.

Not covered here: FSDP and DeepSpeed, which build the optimizer after wrapping the model; the
knob must split the model before any wrapper holds its parameters.

Seen with transformers 5.24, knob or not: ``resume_from_checkpoint`` of a ``GPTNeoXForCausalLM``
with untied embeddings (Pythia's choice) warns "missing keys ... ['lm_head.weight']" and resumes
with the output head at its initial values, because the checkpoint stores it under the legacy
name ``embed_out`` and the Trainer's loader does not rename it (``from_pretrained`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn
from transformers import Trainer, TrainingArguments

from qkov_lib.knob import KnobReport, default_no_decay, knob_optimizer, real_number


@dataclass
class KnobTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the knob: ``qk_ratio`` (``eta_QK / eta_OV``) and ``other_lr``
    (the rate of the non-attention parameters; default ``learning_rate``)."""

    qk_ratio: float = field(default=1.0, metadata={"help": "eta_QK / eta_OV: the QK rate is learning_rate * qk_ratio"})
    other_lr: float | None = field(default=None, metadata={"help": "rate of the non-attention parameters "
                                                                   "(default: learning_rate)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.qk_ratio = real_number("qk_ratio", self.qk_ratio)
        if self.other_lr is not None:
            self.other_lr = real_number("other_lr", self.other_lr)


class KnobTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with the knob's ``qk``/``ov``/``other`` groups.

    ``args`` should be :class:`KnobTrainingArguments` (plain ``TrainingArguments`` mean
    ``qk_ratio = 1``); ``knob_rules``, ``knob_no_decay`` and ``knob_strict`` go to
    :func:`qkov_lib.knob.knob_optimizer` (``rules``, ``no_decay``, ``strict``). After the optimizer is made,
    ``knob_report`` says which tensor (or slice) went to which group."""

    def __init__(self, *args, knob_rules: Mapping[str, str] | None = None,
                 knob_no_decay: Callable[[str, Tensor, nn.Module], bool] | None = default_no_decay,
                 knob_strict: bool = True, **kwargs) -> None:
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ValueError("KnobTrainer builds its own optimizer from the knob's groups; pass the optimizer class "
                             "through args.optim or optimizer_cls_and_kwargs instead of optimizers=(opt, sched)")
        super().__init__(*args, **kwargs)
        self.knob_rules, self.knob_no_decay, self.knob_strict = knob_rules, knob_no_decay, knob_strict
        self.knob_report: KnobReport | None = None

    def create_optimizer(self, model: nn.Module | None = None):
        """The knob's optimizer over ``model`` (default ``self.model``), made once."""
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            if self.optimizer_cls_and_kwargs is not None:
                cls, kwargs = self.optimizer_cls_and_kwargs
            else:
                cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            kwargs = dict(kwargs)
            lr = kwargs.pop("lr", self.args.learning_rate)
            for bad in ("params", "model", "optimizer_dict"):
                if bad in kwargs:
                    raise ValueError(f"the optimizer {self.args.optim!r} builds its own parameter groups ({bad!r}); "
                                     "the knob needs a plain optimizer class such as AdamW")
            self.optimizer, self.knob_report = knob_optimizer(
                opt_model, cls, lr=lr, qk_ratio=getattr(self.args, "qk_ratio", 1.0),
                weight_decay=self.args.weight_decay, other_lr=getattr(self.args, "other_lr", None),
                rules=self.knob_rules, no_decay=self.knob_no_decay, strict=self.knob_strict, **kwargs)
        return self.optimizer

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add every group's current rate (``learning_rate/<group>``) to a training log, and log
        the OV rate as ``learning_rate``."""
        if "learning_rate" in logs and self.optimizer is not None:
            rates = {}
            for g in self.optimizer.param_groups:
                rates.setdefault(str(g.get("name", "?")).split(".")[0], float(g["lr"]))
            logs.update({f"learning_rate/{name}": lr for name, lr in rates.items()})
            if "ov" in rates:
                logs["learning_rate"] = rates["ov"]
        super().log(logs, *args, **kwargs)
