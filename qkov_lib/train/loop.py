"""Training many models of one architecture as one stacked model.

:func:`train_stacked` trains ``B`` models (e.g. :class:`~qkov_lib.models.TokenModel` or
:class:`~qkov_lib.head_model.HeadModel` at several learning rates, ratios and seeds) together: their parameters are stacked
along a leading model dimension (``torch.func.stack_module_state``) and one forward pass of all
models is ``torch.func.vmap`` over ``torch.func.functional_call`` of the models' own ``forward``,
so the stacked model computes exactly what each model computes. A model class may instead define
``stacked_forward(params, buffers, tokens, key_mask)``, the same computation written with an
explicit model dimension (:meth:`qkov_lib.head_model.HeadModel.stacked_forward`, faster than
``vmap`` for its convolutions and embedding tables); a stack uses it when its models' buffers
agree. One backward pass of the summed per-model losses gives each model its own gradient (the
models share no parameter), and :class:`qkov_lib.train.optim.StackedOptimizer` applies torch's
SGD / AdamW update with each model's own per-group rates (``qk`` at ``ratio * eta_ov``, ``ov``,
``other``; from :func:`qkov_lib.models.param_groups` or any ``groups`` function).

Each model keeps its own initialisation (the models are built by the caller), its own minibatch
order (a generator seeded with its ``TrainConfig.seed``, the same permutations
:func:`qkov_lib.train.train` draws) and its own rates. With ``B = 1`` the model's own
parameters are trained in place with a plain forward call (this is
:func:`qkov_lib.train.train`); ``tests/test_stacked.py`` checks that a stack equals training
each model alone, and ``tests/test_stacked_head.py`` that a stacked forward equals the vmapped one.

Logging (at the log steps of the shared config): the metrics of
:func:`qkov_lib.train.evaluate` on a fixed seeded subsample of the training data
(``TrainConfig.log_subsample``; None = all of it, 0 = none), the same metrics on optional
validation data (keys prefixed ``val_``), computed in the same pass, and an optional per-model
``probe``. With ``TrainConfig.patience`` a model stops once its validation loss has not improved
for ``patience`` evaluations and, with ``restore_best``, gets the weights of its best evaluation
back. A model whose loss, gradient or parameters go non-finite raises
:class:`~qkov_lib.train.NonFiniteError` (``on_nonfinite="raise"``) or is frozen and reported
in ``History.diverged_step`` (``"freeze"``), as in the synthetic engine. Finished models are
dropped from the stack, so they cost nothing afterwards.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap
from tqdm.auto import tqdm

from qkov_lib.data.batch import Batch
from qkov_lib.data.text import real_lengths
from qkov_lib.metrics import DEFAULT_TAUS, summarize
from qkov_lib.models import group_of, param_groups
from qkov_lib.runtime import flush_denormals, torch_threads
from qkov_lib.train.config import History, NonFiniteError, Probe, TrainConfig, log_schedule
from qkov_lib.train.optim import StackedOptimizer, rates_of, stack_rates

NONFINITE_MODES = ("raise", "freeze")
# Configs of one stack must agree on these (they fix the step loop and the optimizer kind).
SHARED_FIELDS = ("optimizer", "steps", "batch_size", "n_logs", "log_every", "log_subsample", "log_seed",
                 "length_buckets", "flush_denormals")
# Elements of the (models x rows x positions x width) activations per evaluation chunk: at 2**20 (4 MiB of
# float32) 18 HateXplain map models evaluate 512 rows in 64 ms, at 2**22 in 84 (SQuAD 641 and 664 ms),
# with the same predictions (benchmarks/README.md)
EVAL_BUDGET = 2**20

GroupsFn = Callable[[nn.Module, TrainConfig], list[dict]]
BatchesFn = Callable[[torch.Generator, int, int], list[Tensor]]


@functools.cache
def retain_freed_memory() -> bool:
    """Ask glibc's ``malloc`` to keep freed memory in the process for reuse (``mallopt``:
    no ``mmap`` below 1 GiB, never trim the heap); returns whether it applied (glibc only).

    Why: by default a freed block of more than a few MiB goes back to the kernel, and the next
    step's tensor of the same size page-faults all its pages in again. In the 2-core build VM a
    step of 40 stacked SVA models took about 18 ms of CPU time instead of 14 without this."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    except (OSError, AttributeError):
        return False


def default_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """The ``qk``/``ov``/``other`` groups of :func:`qkov_lib.models.param_groups` for ``cfg``."""
    return param_groups(model, cfg.eta_ov, cfg.ratio, cfg.eta_other, cfg.weight_decay)


def default_batches(gen: torch.Generator, n: int, batch_size: int) -> list[Tensor]:
    """One epoch of minibatch indices: a permutation of ``range(n)`` from ``gen`` cut into
    batches of ``batch_size`` (the last one shorter)."""
    return list(torch.randperm(n, generator=gen).split(batch_size))


def log_subsample(n: int, size: int | None, seed: int) -> Tensor | None:
    """Sorted indices of a fixed random subsample of ``size`` of ``n`` rows (seeded by ``seed``);
    None (all rows) when ``size`` is None or at least ``n``."""
    if size is None or size >= n:
        return None
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def check_keys(data: Batch, what: str = "training data") -> None:
    """Raise ValueError unless every row of ``data`` has at least one attendable key (checked
    once here, because a vmapped forward cannot check it per row)."""
    if not bool(data.key_mask.any(dim=1).all()):
        bad = int((~data.key_mask.any(dim=1)).nonzero()[0, 0])
        raise ValueError(f"{what}: row {bad} has no attendable key; every sequence needs at least one")


def _signature(model: nn.Module) -> tuple:
    """What must agree for models to share one forward: class, tensor shapes and dtypes, and the
    plain attributes of every submodule (sizes, parameterization, readout settings)."""
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()])
    plain = (int, float, str, bool, tuple, type(None))
    attrs = tuple((name, tuple(sorted((k, v if isinstance(v, plain) else repr(v)) for k, v in vars(m).items()
                                      if not k.startswith("_") and (isinstance(v, plain) or dataclasses.is_dataclass(v)))))
                  for name, m in model.named_modules())
    return type(model), tensors, attrs


class ModelStack:
    """``B`` models of one architecture as stacked tensors (B, ...).

    ``B = 1``: the model's own parameters are the trained tensors (hooks and checks of its
    forward work as usual). ``B > 1``: leaf tensors from ``torch.func.stack_module_state``
    and, on a copy of the first model on the ``meta`` device, its ``stacked_forward`` (``stacked``:
    the class has one and the models' buffers agree) or a vmapped ``functional_call``."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        models = list(models)
        if not models:
            raise ValueError("need at least one model")
        sig = _signature(models[0])
        for k, m in enumerate(models):
            if _signature(m) != sig:
                raise ValueError(f"model {k} differs from model 0 in class, parameter shapes or settings; "
                                 "a stack holds models of one architecture (group them first)")
        self.names = [n for n, p in models[0].named_parameters() if p.requires_grad]
        self.B = len(models)
        self.device = next(models[0].parameters()).device
        self.direct = self.B == 1  # stays so when dropping rows leaves one
        if self.direct:
            self.model = models[0]
            own = dict(self.model.named_parameters())
            self.params = {n: own[n] for n in self.names}
        else:
            params, self.buffers = stack_module_state(models)
            self.params = {n: params[n] for n in self.names}
            self.frozen = {n: p.detach() for n, p in params.items() if n not in self.names}  # not trained
            self.base = copy.deepcopy(models[0]).to("meta")
            # a class's own forward over a model dimension (HeadModel.stacked_forward), for models whose
            # buffers agree: it takes one model's buffers; otherwise vmap of the models' forward
            self.stacked = hasattr(self.base, "stacked_forward") and all(bool((t == t[:1]).all())
                                                                         for t in self.buffers.values())

    # --- tensors -----------------------------------------------------------------------
    def leaves(self) -> dict[str, Tensor]:
        """The trained tensors with the model dimension first (views for ``B = 1``)."""
        if self.direct:
            return {n: p.unsqueeze(0) for n, p in self.params.items()}
        return self.params

    def grads(self) -> dict[str, Tensor | None]:
        """Their gradients (B, ...) after a backward pass; None where a tensor got none."""
        if self.direct:
            return {n: None if p.grad is None else p.grad.unsqueeze(0) for n, p in self.params.items()}
        return {n: p.grad for n, p in self.params.items()}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def row(self, b: int) -> dict[str, Tensor]:
        """Copies of model ``b``'s trained tensors."""
        return {n: t[b].detach().clone() for n, t in self.leaves().items()}

    @torch.no_grad()
    def set_row(self, b: int, values: Mapping[str, Tensor]) -> None:
        for n, t in self.leaves().items():
            t[b].copy_(values[n])

    @torch.no_grad()
    def write_back(self, targets: Mapping[int, nn.Module]) -> None:
        """Copy stack row ``i`` into ``targets[i]`` (models of this architecture); a no-op for
        ``B = 1``, whose model is trained in place."""
        if self.direct:
            return
        for i, m in targets.items():
            own = dict(m.named_parameters())
            for n in self.names:
                own[n].copy_(self.params[n][i])

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` (index tensor; B > 1), gradients included."""
        keep = keep.to(self.device)
        new = {}
        for n, p in self.params.items():
            new[n] = p.detach()[keep].clone().requires_grad_(True)
            if p.grad is not None:
                new[n].grad = p.grad[keep]
        self.params = new
        self.frozen = {n: t[keep] for n, t in self.frozen.items()}
        self.buffers = {n: t[keep] for n, t in self.buffers.items()}
        self.B = len(keep)

    # --- forward -----------------------------------------------------------------------
    def forward(self, tokens: Tensor, key_mask: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
        """``(logits (B, n, C), attention (B, n, ...))``. ``tokens``/``key_mask`` are (n, T)
        for every model (``shared``) or (B, n, T), one set per model."""
        if self.direct:
            if not shared:
                tokens, key_mask = tokens[0], key_mask[0]
            logits, attn = self.model(tokens, key_mask)
            return logits[None], attn[None]
        if self.stacked:
            return self.base.stacked_forward({**self.frozen, **self.params}, {n: t[0] for n, t in self.buffers.items()},
                                             tokens, key_mask)
        fn = lambda p, b, t, k: functional_call(self.base, (p, b), (t, k))  # noqa: E731
        d = None if shared else 0
        return vmap(fn, in_dims=(0, 0, d, d))({**self.frozen, **self.params}, self.buffers, tokens, key_mask)

    @torch.no_grad()
    def predict(self, data: Batch, by_length: bool = False) -> tuple[Tensor, Tensor]:
        """``(attention (B, N, ...), probabilities (B, N, C) float64)`` of every model on the
        shared ``data``, in chunks of near-equal size that keep the activations small. ``by_length``
        (models that ignore left padding; attention (B, N, T)): the rows shortest first, each chunk
        cut to its longest row; rows come back in their own order, attention zero on the dropped
        columns."""
        N, T = data.tokens.shape
        width = max(p.shape[-1] for p in self.params.values())
        chunk = max(1, EVAL_BUDGET // (self.B * T * width))
        lengths = real_lengths(data.tokens)
        order = torch.argsort(lengths, stable=True) if by_length else torch.arange(N, device=data.tokens.device)
        attn = probs = None
        # no short last chunk: a product of a few rows may round differently from the same rows among
        # many (another matmul kernel), and each row's prediction should not depend on the budget
        for idx in order.tensor_split(max(1, -(-N // chunk))):
            t = int(lengths[idx].max()) if by_length else T
            logits, a = self.forward(data.tokens[idx, T - t:], data.key_mask[idx, T - t:], shared=True)
            if attn is None:
                attn = a.new_zeros(self.B, N, *a.shape[2:-1], T) if by_length else a.new_empty(self.B, N, *a.shape[2:])
                probs = torch.empty(self.B, N, logits.shape[-1], dtype=torch.float64, device=logits.device)
            attn[:, idx, ..., T - t:] = a
            probs[:, idx] = torch.softmax(logits.double(), -1)
        return attn, probs


def row_losses(logits: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy (B, n) of each row of ``logits`` (B, n, C) against ``y`` (B, n)."""
    B, n, C = logits.shape
    return F.cross_entropy(logits.reshape(B * n, C), y.reshape(B * n), reduction="none").view(B, n)


def stacked_loss(logits: Tensor, y: Tensor, weight: Tensor | None) -> Tensor:
    """Per-model cross-entropy (B,) of ``logits`` (B, n, C) against ``y`` (B, n): a plain mean,
    or an expectation under ``weight`` (B, n) (population batches), as
    :func:`qkov_lib.train.loss_fn` per model."""
    return _mean_loss(row_losses(logits, y), weight)


def _mean_loss(ce: Tensor, weight: Tensor | None) -> Tensor:
    return ce.mean(1) if weight is None else (weight.to(ce.dtype) * ce).sum(1)


def bucketed_loss(stack: ModelStack, tokens: Tensor, key_mask: Tensor, y: Tensor, weight: Tensor | None,
                  buckets: int) -> Tensor:
    """:func:`stacked_loss` of ``stack`` on per-model minibatches ``tokens``/``key_mask``/``y`` (B, n, T),
    computed on ``buckets`` groups of each model's rows, shortest first, each group cut to the longest row
    it holds in any model (for models that ignore left padding: the same loss up to float rounding). The
    rows' losses are put back in their own order before the mean, so only the rows' own values round
    differently."""
    B, n, T = tokens.shape
    lengths = real_lengths(tokens)
    order = torch.argsort(lengths, dim=-1, stable=True)
    size = -(-n // buckets)
    parts = []
    for i in range(0, n, size):
        idx = order[:, i:i + size]
        t = int(lengths.gather(1, idx).max())
        cols = idx[..., None].expand(-1, -1, t)
        logits, _ = stack.forward(tokens[..., T - t:].gather(1, cols), key_mask[..., T - t:].gather(1, cols), False)
        parts.append(row_losses(logits, y.gather(1, idx)))
    ce = torch.cat(parts, 1).gather(1, torch.argsort(order, dim=-1))
    return _mean_loss(ce, weight)


def _finite_rows(tensors: Mapping[str, Tensor | None], B: int) -> Tensor:
    """(B,) bool: row b of every tensor is finite. A NaN or inf makes the row sum non-finite, so
    one reduction per tensor suffices (a false alarm needs values near the largest float)."""
    ok = None
    for t in tensors.values():
        if t is not None:
            r = torch.isfinite(t.reshape(B, -1).sum(1))
            ok = r if ok is None else ok & r
    return ok


def _first_bad(tensors: Mapping[str, Tensor | None], b: int) -> str | None:
    for n, t in tensors.items():
        if t is not None and not bool(torch.isfinite(t[b]).all()):
            return n
    return None


def check_configs(cfgs: Sequence[TrainConfig], shared: Sequence[str] = SHARED_FIELDS) -> TrainConfig:
    """The first of ``cfgs`` after checking that all are TrainConfigs that agree on ``shared``."""
    c0 = cfgs[0]
    for k, c in enumerate(cfgs):
        if not isinstance(c, TrainConfig):
            raise TypeError(f"config {k} is a {type(c).__name__}, not a TrainConfig")
        for f in shared:
            if getattr(c, f) != getattr(c0, f):
                raise ValueError(f"config {k} differs from config 0 in {f!r} ({getattr(c, f)!r} vs "
                                 f"{getattr(c0, f)!r}); models trained together share {', '.join(shared)}")
    return c0


def loss_fn(logits: Tensor, y: Tensor, weight: Tensor | None) -> Tensor:
    """Cross-entropy; an expectation under ``weight`` (population batches) or a plain mean."""
    ce = F.cross_entropy(logits, y, reduction="none")
    return ce.mean() if weight is None else (weight.to(ce.dtype) * ce).sum()


@torch.no_grad()
def predict(model: nn.Module, data: Batch, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """``(attention (N, T), probabilities (N, C))`` of ``model`` on ``data``, in chunks."""
    retain_freed_memory()  # every chunk allocates activations of the same sizes again
    was = model.training
    model.eval()
    attn, probs = [], []
    for i in range(0, len(data), chunk):
        b = data.index(slice(i, i + chunk))
        logits, a = model(b.tokens, b.key_mask)
        attn.append(a)
        probs.append(torch.softmax(logits.double(), -1))
    model.train(was)
    return torch.cat(attn), torch.cat(probs)


def evaluate(model: nn.Module, data: Batch, taus=DEFAULT_TAUS) -> dict[str, float]:
    """:func:`qkov_lib.metrics.summarize` of the model's predictions on ``data``."""
    attn, probs = predict(model, data)
    return summarize(attn, probs, data.relevant, data.y, taus, data.weight)


def train(model: nn.Module, data: Batch, cfg: TrainConfig, probe: Probe | None = None,
          desc: str = "train", val: Batch | None = None, **kwargs) -> History:
    """Train ``model`` on ``data`` with ``cfg``; at the logged steps record the loss, accuracy
    and mean attention on relevant tokens on the training data (or its ``cfg.log_subsample``),
    on ``val`` if given (``val_*``), plus ``probe(model)``. Raises :class:`NonFiniteError`
    naming the step and group if anything goes non-finite. A stack of one in
    :func:`train_stacked` (whose keyword arguments ``kwargs`` accepts), so a single run and a
    stacked grid share one training loop."""
    return train_stacked([model], data, [cfg], probe=probe, val=val, desc=desc, **kwargs)[0]


def train_stacked(models: Sequence[nn.Module], data: Batch, cfgs: TrainConfig | Sequence[TrainConfig],
                  probe: Probe | None = None, val: Batch | None = None, on_nonfinite: str = "raise",
                  groups: GroupsFn = default_groups, batches: BatchesFn = default_batches,
                  prepare: Callable[[Batch], Batch] | None = None, desc: str = "stacked",
                  progress: bool | None = None, threads: int | None = None,
                  on_step: Callable[[int], None] | None = None, taus: Sequence[float] = ()) -> list[History]:
    """Train ``models`` (one architecture; forward ``(tokens, key_mask) -> (logits, attention)``)
    on ``data`` together, each with its config (one, or one per model; they may differ in
    ``eta_ov``, ``ratio``, ``eta_other``, ``weight_decay``, ``momentum``, ``seed``,
    ``patience``). Returns one :class:`~qkov_lib.train.History` per model, in order, and
    leaves the trained weights in ``models``.

    ``probe(model)`` adds per-model values to each log record; ``val`` is validation data
    (logged as ``val_*``; needed by ``patience``); ``groups(model, cfg)`` gives the optimizer
    groups (default: :func:`default_groups`); ``batches(generator, n, batch_size)`` one epoch
    of minibatch indices (default: :func:`default_batches`); ``prepare(batch)`` transforms a
    minibatch before the forward pass (``B = 1`` only, e.g. trimming padding);
    ``on_nonfinite`` is ``"raise"`` or ``"freeze"``; ``threads`` sets torch's intra-op threads
    while training (None: unchanged); ``on_step(step)``, if given, is called after every
    optimizer step (e.g. to report progress from another process); ``taus`` are the thresholds
    in [0, 1] at which the log records also carry ``AC@tau`` / ``ACMC@tau`` (``val_AC@0.5`` for
    ``taus=(0.5,)``; none by default).

    The attention metrics of a log record (every key of :func:`qkov_lib.metrics.summarize` but
    ``loss`` and ``accuracy``) are means over the evaluated rows that have a relevant token when
    only some of them have one (HateXplain's "normal" posts carry no rationale), as
    :func:`qkov_lib.studies.realmap.measure` reports them; loss and accuracy are over every row."""
    models = list(models)
    cfgs = [cfgs] * len(models) if isinstance(cfgs, TrainConfig) else list(cfgs)
    if len(cfgs) != len(models):
        raise ValueError(f"got {len(cfgs)} configs for {len(models)} models")
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}")
    if not isinstance(data, Batch) or (val is not None and not isinstance(val, Batch)):
        raise TypeError("data and val must be Batch objects")
    if prepare is not None and len(models) > 1:
        raise ValueError("prepare is only supported for a single model")
    c0 = check_configs(cfgs)
    if val is None and any(c.patience is not None for c in cfgs):
        raise ValueError("patience (early stopping on validation loss) needs validation data: pass val=")
    taus = tuple(float(t) for t in taus)  # one outside [0, 1] fails at the first log step (step 0)
    retain_freed_memory()
    with torch_threads(threads), flush_denormals(c0.flush_denormals):
        return _Trainer(models, data, cfgs, c0, probe, val, on_nonfinite, groups, batches, prepare, taus).run(
            desc, c0.progress if progress is None else progress, on_step)


class _Trainer:
    """The state of one :func:`train_stacked` call; ``rows[i]`` is the model index of stack row i."""

    def __init__(self, models, data, cfgs, c0, probe, val, on_nonfinite, groups, batches, prepare,
                 taus: tuple[float, ...] = ()) -> None:
        self.models, self.cfgs, self.c0, self.taus = models, cfgs, c0, taus
        self.probe, self.on_nonfinite, self.batches, self.prepare = probe, on_nonfinite, batches, prepare
        self.stack = ModelStack(models)
        dev = self.stack.device
        check_keys(data)
        self.data = data.to(dev)
        idx = log_subsample(len(data), c0.log_subsample, c0.log_seed)
        self.log_data = None if c0.log_subsample == 0 else (self.data if idx is None else self.data.index(idx.to(dev)))
        self.val = None if val is None else val.to(dev)
        if self.val is not None:
            check_keys(self.val, "validation data")
        rates = stack_rates([rates_of(groups(m, c), m, c.momentum if c.optimizer == "sgd" else 0.0)
                             for m, c in zip(models, cfgs)], self.stack.names)
        self.opt = StackedOptimizer(c0.optimizer, rates)
        self.rows = list(range(len(models)))
        self.hists = [History(config=asdict(c)) for c in cfgs]
        self.gens = [torch.Generator().manual_seed(c.seed) for c in cfgs]
        self.N = len(data)
        self.bs = self.N if c0.batch_size is None else min(c0.batch_size, self.N)
        self.epoch: list[Tensor] = []  # remaining minibatches of this epoch, each (rows, bs)
        self.best: dict[int, tuple[float, int, dict | None]] = {}  # model -> (val loss, step, weights)
        self.waiting = [0] * len(models)  # evaluations since the last improvement

    # --- bookkeeping ----------------------------------------------------------------------
    def _finish(self, done: list[int]) -> None:
        """Give the models of stack rows ``done`` their final weights: the best evaluation's
        under early stopping (unless diverged), else the current ones."""
        st = self.stack
        for i in done:
            m = self.rows[i]
            if m in self.best and self.best[m][2] is not None and self.hists[m].diverged_step is None:
                st.set_row(i, self.best[m][2])
        st.write_back({i: self.models[self.rows[i]] for i in done})

    def _drop(self, done: list[int]) -> None:
        """Finish stack rows ``done`` and remove them from the stack (and the optimizer)."""
        if not done:
            return
        self._finish(done)
        keep = [i for i in range(self.stack.B) if i not in done]
        if keep:
            idx = torch.tensor(keep)
            self.stack.select(idx)
            self.opt.select(idx)
            self.epoch = [e[idx] for e in self.epoch]
        self.rows = [self.rows[i] for i in keep]

    def _fail(self, step: int, bad: Tensor, what: str, tensors: Mapping[str, Tensor | None] | None = None,
              values: Tensor | None = None) -> None:
        """Rows ``bad`` went non-finite (``what``: loss, gradient or parameter; ``values``: the
        per-row losses): raise, naming the step, tensor group and model, or freeze them."""
        idx = bad.nonzero()[:, 0].tolist()
        if self.on_nonfinite == "raise":
            i = idx[0]
            value = "" if values is None else f" ({float(values[i])})"
            name = None if tensors is None else _first_bad(tensors, i)
            where = "" if name is None else f" in parameter group '{group_of(name)}' (tensor {name})"
            who = ""
            if len(self.models) > 1:
                c = self.cfgs[self.rows[i]]
                who = f" in model {self.rows[i]} (eta_ov={c.eta_ov:g}, ratio={c.ratio:g}, seed={c.seed})"
            raise NonFiniteError(f"non-finite {what}{value} at step {step}{where}{who}; "
                                 "lower the learning rates or the ratio")
        for i in idx:
            self.hists[self.rows[i]].diverged_step = step
        self._drop(idx)

    # --- logging --------------------------------------------------------------------------
    def _metrics(self, data: Batch) -> list[dict[str, float]]:
        """:func:`~qkov_lib.metrics.summarize` of every stacked model on ``data``; where only some
        rows have a relevant token, the attention metrics are over those rows (see
        :func:`train_stacked`)."""
        attn, probs = self.stack.predict(data, by_length=self.c0.length_buckets > 1)
        out = [summarize(attn[i], probs[i], data.relevant, data.y, self.taus, data.weight) for i in range(self.stack.B)]
        has = data.relevant.any(1)
        if bool(has.any()) and not bool(has.all()):
            # rows without a relevant token have relevant mass 0 by definition and would dilute the
            # attention metrics; subset once for all models, then only the per-model summaries
            rel, y, w = data.relevant[has], data.y[has], None if data.weight is None else data.weight[has]
            attn, probs = attn[:, has], probs[:, has]
            for i, rec in enumerate(out):
                s = summarize(attn[i], probs[i], rel, y, self.taus, w)  # summarize renormalises w
                rec.update({k: v for k, v in s.items() if k not in ("loss", "accuracy")})
        return out

    def _log(self, step: int) -> None:
        recs = [{"step": step} for _ in self.rows]
        if self.log_data is not None:
            for r, m in zip(recs, self._metrics(self.log_data)):
                r.update(m)
        if self.val is not None:
            for r, m in zip(recs, self._metrics(self.val)):
                r.update({f"val_{k}": v for k, v in m.items()})
        if self.probe is not None:
            self.stack.write_back({i: self.models[m] for i, m in enumerate(self.rows)})
            for r, m in zip(recs, self.rows):
                r.update(self.probe(self.models[m]))
        bad = torch.tensor([not math.isfinite(r.get("loss", 0.0)) for r in recs])
        for r, m in zip(recs, self.rows):
            self.hists[m].records.append(r)
        if bool(bad.any()):
            self._fail(step, bad, "loss")
        if self.val is not None:
            self._early_stop(step)

    def _early_stop(self, step: int) -> None:
        done = []
        for i, m in enumerate(self.rows):
            c = self.cfgs[m]
            loss = self.hists[m].records[-1]["val_loss"]
            if m not in self.best or loss < self.best[m][0]:
                self.best[m] = (loss, step, self.stack.row(i) if c.patience is not None and c.restore_best else None)
                self.hists[m].best_step, self.waiting[m] = step, 0
            else:
                self.waiting[m] += 1
            if c.patience is not None and self.waiting[m] >= c.patience:
                self.hists[m].stop_step = step
                done.append(i)
        self._drop(done)

    # --- one step -------------------------------------------------------------------------
    def _minibatch(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
        d = self.data
        if self.bs == self.N:
            w = None if d.weight is None else d.weight.expand(self.stack.B, -1)
            return d.tokens, d.key_mask, d.y.expand(self.stack.B, -1), w, True
        if not self.epoch:
            per_model = [self.batches(self.gens[m], self.N, self.bs) for m in self.rows]
            if len({len(e) for e in per_model}) != 1:
                raise ValueError("every model's epoch must have the same number of minibatches")
            self.epoch = [torch.stack(col) for col in zip(*per_model)]
        idx = self.epoch.pop(0).to(self.stack.device)
        w = None
        if d.weight is not None:
            w = d.weight[idx]
            w = w / w.sum(1, keepdim=True)  # as Batch.index renormalises a population batch
        if self.prepare is not None:
            b = self.prepare(d.index(idx[0]))
            return b.tokens[None], b.key_mask[None], b.y[None], None if w is None else b.weight[None], False
        return d.tokens[idx], d.key_mask[idx], d.y[idx], w, False

    def _step(self, step: int) -> None:
        st = self.stack
        tokens, key_mask, y, w, shared = self._minibatch()
        st.zero_grad()
        if self.c0.length_buckets > 1 and not shared:
            loss = bucketed_loss(st, tokens, key_mask, y, w, self.c0.length_buckets)
        else:
            logits, _ = st.forward(tokens, key_mask, shared)
            loss = stacked_loss(logits, y, w)
        loss.sum().backward()
        loss = loss.detach()
        bad = ~torch.isfinite(loss)
        if bool(bad.any()):
            self._fail(step, bad, "loss", values=loss)
            if not self.rows:
                return
        grads = st.grads()
        bad = ~_finite_rows(grads, st.B)
        if bool(bad.any()):
            self._fail(step, bad, "gradient", grads)
            if not self.rows:
                return
            grads = st.grads()
        self.opt.step(st.leaves(), grads)
        values = {n: t.detach() for n, t in st.leaves().items()}
        bad = ~_finite_rows(values, st.B)
        if bool(bad.any()):
            self._fail(step, bad, "parameter", values)

    def run(self, desc: str, show: bool, on_step: Callable[[int], None] | None = None) -> list[History]:
        logs = set(log_schedule(self.c0))
        bar = tqdm(total=self.c0.steps, desc=desc, disable=not show, leave=False, mininterval=1.0)
        step = 0
        for step in range(self.c0.steps + 1):
            if not self.rows:  # every model diverged or stopped early
                break
            if step in logs:
                self._log(step)
            if step == self.c0.steps or not self.rows:
                break
            self._step(step)
            bar.update()
            if on_step is not None:
                on_step(step)
        finish_bar(bar, desc, step, self.c0.steps)
        self._finish(list(range(len(self.rows))))
        return self.hists


def finish_bar(bar: tqdm, desc: str, step: int, steps: int) -> None:
    """Close the progress bar of a loop that ended at ``step`` of ``steps``. One that ended
    before its last step (every run stopped early or diverged) is shown complete and says
    "stopped early at step N", so no bar is left frozen part-way, which would read as a failure."""
    if step < steps:
        bar.set_description(f"{desc}: stopped early at step {step}", refresh=False)
        bar.reset(total=step)  # reset (not a bare total=): the notebook widget's maximum follows
        bar.update(step)
        bar.refresh()
    bar.close()
