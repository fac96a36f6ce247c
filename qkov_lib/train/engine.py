"""Batched training of many small synthetic models at once.

:func:`qkov_lib.train.train` runs one Python loop per model. For sweeps over
parameterizations, learning-rate ratios and seeds that loop is mostly interpreter overhead:
every model is tiny. This engine trains ``B`` :class:`~qkov_lib.models.SyntheticModel` s (any mix
of parameterizations, one task) together, with their weights stacked along a leading *model*
dimension (``(B, ...)``) and every heavy operation one matrix product over all models.

**Bag-of-tokens representation.** A :class:`SyntheticModel` has fixed embeddings and no
positional information, so a key's score ``x_i^T W_QK x_q`` depends only on the key's token
*type*. A sequence is then fully described by how many times each token type is an attendable
key (``counts``, (N, V)), how many of those occurrences are relevant (``relevant``, (N, V)), its
query type and its target (:class:`Bag`). With ``s_v`` the score of type ``v``,

    alpha per occurrence of v = exp(s_v) / sum_u counts_u exp(s_u),
    logits = sum_v counts_v alpha_v W_OV e_v,

which is exactly the model's forward pass regrouped by type (this is also why
:func:`qkov_lib.data.synthetic.population` is the exact population loss). The cost per model is
``O(N V C)`` instead of ``O(N T d)``.

**Same results as the loop, by construction.** The engine takes the *initialised* models (so the
initialisation is the library's own), their :class:`~qkov_lib.train.TrainConfig` s, and gets
every learning rate from :func:`~qkov_lib.models.param_groups`. The updates are those of
``torch.optim.SGD`` (``gd``/``sgd``, momentum and weight decay included) and
``torch.optim.AdamW`` with a per-model learning rate, from :mod:`qkov_lib.train.optim` (the one
implementation the token-model trainer uses too). Minibatch orders replay
:func:`~qkov_lib.train.train`'s seeded ``randperm``. Logged records have the keys of
:func:`~qkov_lib.train.evaluate` (with ``taus=()``), computed batched. The tests check
equality with :func:`~qkov_lib.train.train` on a small grid.

**Extras for sweeps.** ``stop_loss`` freezes each model at the first step where its full-batch
training loss is ``<= stop_loss``; ``snapshot_loss`` (one loss or a ladder of them) instead keeps
training and stores a copy of the weights (and a log record) at the first step below each level,
so one run gives both a fixed-length and matched-loss results; ``on_nonfinite="freeze"`` freezes a
diverging model (records ``diverged_step``) instead of raising, so one bad run does not end a
sweep. After training the stacked weights are written back into the models. Tensors follow the
models' device; only CPU was exercised when this was written (no GPU was available).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from qkov_lib.data.batch import Batch
from qkov_lib.metrics import DEFAULT_TAUS, FOCUS_CELLS, dtap_histogram, instance_means
from qkov_lib.models import SyntheticModel, group_of, param_groups
from qkov_lib.runtime import flush_denormals, torch_threads  # noqa: F401  (torch_threads re-exported: engine.torch_threads)
from qkov_lib.train import History, NonFiniteError, TrainConfig, log_steps
from qkov_lib.train.loop import NONFINITE_MODES, check_configs, finish_bar
from qkov_lib.train.optim import StackedOptimizer, rates_of, stack_rates

DEFAULT_THREADS = 1


# --- data ----------------------------------------------------------------------------------
@dataclass
class Bag:
    """Bag-of-token-types view of ``N`` sequences for models without positional information.

    counts (N, V) float: how often each token type is an attendable key; relevant (N, V) float:
    how many of those occurrences are relevant; query (N,) long: the query's token type;
    y (N,) long; weight (N,) float64 or None (as in :class:`~qkov_lib.data.batch.Batch`).
    A leading model dimension (B, N, ...) is allowed when every model has its own data.
    """

    counts: Tensor
    relevant: Tensor
    query: Tensor
    y: Tensor
    weight: Tensor | None = None
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # derived tensors, per bag

    def __len__(self) -> int:
        return self.y.shape[-1]

    def to(self, device: torch.device | str) -> "Bag":
        """The same bag on ``device`` (the cache is not carried over)."""
        w = None if self.weight is None else self.weight.to(device)
        return Bag(self.counts.to(device), self.relevant.to(device), self.query.to(device), self.y.to(device), w)


def bag_of(batch: Batch, n_types: int) -> Bag:
    """The :class:`Bag` of ``batch`` for a vocabulary of ``n_types`` token ids (the rows of the
    embedding table). Relevant positions that are not keys get no attention and are dropped."""
    if not isinstance(batch, Batch):
        raise TypeError(f"expected a Batch, got {type(batch).__name__}")
    tok = batch.tokens
    if int(tok.min()) < 0 or int(tok.max()) >= n_types:
        raise ValueError(f"token ids must lie in [0, {n_types}) (the embedding table's rows)")
    if not bool(batch.key_mask.any(dim=1).all()):
        raise ValueError("every sequence needs at least one attendable key")
    N = tok.shape[0]
    keys = batch.key_mask.double()
    counts = torch.zeros(N, n_types, dtype=torch.float64).scatter_add_(1, tok, keys)
    rel = torch.zeros(N, n_types, dtype=torch.float64).scatter_add_(1, tok, keys * batch.relevant.double())
    return Bag(counts, rel, tok[:, -1].clone(), batch.y.clone(), batch.weight)


def stack_bags(bags: Sequence[Bag]) -> Bag:
    """Stack per-model bags of equal size into one bag with a leading model dimension."""
    if len({len(b) for b in bags}) != 1:
        raise ValueError("per-model data sets must all have the same number of sequences")
    if len({b.weight is None for b in bags}) != 1:
        raise ValueError("per-model data sets must all be weighted (population) or all unweighted")
    w = None if bags[0].weight is None else torch.stack([b.weight for b in bags])
    return Bag(*(torch.stack([getattr(b, k) for b in bags]) for k in ("counts", "relevant", "query", "y")), w)


def _rows(bag: Bag, idx: Tensor) -> Bag:
    """Rows ``idx`` (B, n) of a shared (N, ...) or per-model (B, N, ...) bag, as a (B, n, ...)
    bag; population weights are renormalised per model (as :meth:`Batch.index` does)."""
    B = idx.shape[0]
    if bag.y.dim() == 1:
        take = lambda t: t[idx]  # noqa: E731
    else:
        ar = torch.arange(B, device=idx.device)[:, None]
        take = lambda t: t[ar, idx]  # noqa: E731
    w = None if bag.weight is None else take(bag.weight)
    if w is not None:
        w = w / w.sum(dim=1, keepdim=True)
    return Bag(take(bag.counts), take(bag.relevant), take(bag.query), take(bag.y), w)


# --- stacked models ------------------------------------------------------------------------
class Stack:
    """``B`` :class:`SyntheticModel` s (any mix of parameterizations, embedding tables of one
    shape) with their weights stacked along a leading model dimension.

    Models keep their input order ``0..B-1``. The models of one parameterization form a group
    whose parameters are leaf tensors (b_g, ...) in ``params``, keyed ``"<group>/<name>"``
    (``name`` one of ``W_QK``, ``W_Q``, ``W_K``, ``W_OV``, ``W_O``, ``W_V``); ``members[key]``
    lists the models (input indices) of that tensor's rows. ``E`` is (B, V, d).
    """

    def __init__(self, models: Sequence[SyntheticModel]) -> None:
        if not models:
            raise ValueError("need at least one model")
        for m in models:
            if not isinstance(m, SyntheticModel):
                raise TypeError(f"the batched engine trains SyntheticModel only (no positions), got {type(m).__name__}")
        E0 = models[0].E
        for k, m in enumerate(models):
            if m.E.shape != E0.shape or m.E.dtype != E0.dtype or m.attention.n_out != models[0].attention.n_out:
                raise ValueError(f"model {k} has embeddings {tuple(m.E.shape)} {m.E.dtype} and "
                                 f"{m.attention.n_out} classes, model 0 {tuple(E0.shape)} {E0.dtype} and "
                                 f"{models[0].attention.n_out}; batch only models of one task")
        self.B = len(models)
        self.kinds = [m.attention.param.name for m in models]
        self.E = torch.stack([m.E.detach() for m in models])
        groups: dict[tuple, list[int]] = {}
        for k, m in enumerate(models):
            shapes = tuple((n, tuple(p.shape)) for n, p in m.attention.named_parameters())
            groups.setdefault((m.attention.param, shapes), []).append(k)
        self.groups = []  # (Parameterization, keys by name, member indices)
        self.params: dict[str, Tensor] = {}
        self.members: dict[str, Tensor] = {}
        for gi, ((param, shapes), idx) in enumerate(groups.items()):
            keys = {}
            for n, _ in shapes:
                key = f"{param.name}#{gi}/{n}"
                keys[n] = key
                self.params[key] = torch.stack([dict(models[k].attention.named_parameters())[n].detach()
                                                for k in idx]).clone().requires_grad_(True)
                self.members[key] = torch.tensor(idx)
            self.groups.append((param, keys, idx))
        order = [k for _, _, idx in self.groups for k in idx]
        self._inv = None if order == list(range(self.B)) else torch.argsort(torch.tensor(order))

    def _join(self, parts: list[Tensor]) -> Tensor:
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return out if self._inv is None else out[self._inv]

    # effective matrices
    def effective(self) -> tuple[Tensor, Tensor]:
        """Stacked ``(W_QK (B, d, d), W_OV (B, C, d))`` in model order."""
        qks, ovs = [], []
        for param, keys, _ in self.groups:
            p = {n: self.params[k] for n, k in keys.items()}
            qks.append(p["W_K"].transpose(1, 2) @ p["W_Q"] if param.qk_factorized else p["W_QK"])
            ovs.append(p["W_O"] @ p["W_V"] if param.ov_factorized else p["W_OV"])
        return self._join(qks), self._join(ovs)

    def finite(self, tensors: dict[str, Tensor]) -> Tensor:
        """(B,) bool: model b's rows of every tensor in ``tensors`` (keyed like ``params``)
        are finite. A NaN or inf makes the row sum non-finite, so one reduction per tensor
        suffices (a false alarm needs entries near the largest float: training diverged anyway)."""
        parts = []
        for _, keys, _ in self.groups:
            total = sum(tensors[k].reshape(tensors[k].shape[0], -1).sum(1) for k in keys.values())
            parts.append(torch.isfinite(total))
        return self._join(parts)

    def weights_of(self, b: int) -> dict[str, Tensor]:
        """Copies of model ``b``'s attention parameters, by name (``W_QK``, ``W_Q``, ...)."""
        out = {}
        for key, rows in self.members.items():
            hit = (rows == b).nonzero()
            if len(hit):
                out[key.split("/", 1)[1]] = self.params[key][int(hit[0, 0])].detach().clone()
        return out

    def first_bad_tensor(self, tensors: dict[str, Tensor], b: int) -> str | None:
        """The parameter name whose rows of model ``b`` hold a non-finite value."""
        for key, t in tensors.items():
            rows = (self.members[key] == b).nonzero()
            if len(rows) and not bool(torch.isfinite(t[int(rows[0, 0])]).all()):
                return key.split("/", 1)[1]
        return None

    def tables(self) -> tuple[Tensor, Tensor]:
        """``S`` (B, V, V), the score ``e_v^T W_QK e_u`` of key type ``v`` for query type ``u``,
        and ``G`` (B, V, C), the logits ``W_OV e_v`` from one unit of attention on type ``v``."""
        W_QK, W_OV = self.effective()
        E = self.E
        return E @ W_QK @ E.transpose(1, 2), E @ W_OV.transpose(1, 2)

    def forward(self, bag: Bag) -> tuple[Tensor, Tensor]:
        """``(logits (B, N, C), alpha (B, N, V))`` where ``alpha[b, n, v]`` is the attention on
        *one* occurrence of type ``v`` (zero where the type is not a key)."""
        S, G = self.tables()
        q = bag.query
        if q.dim() == 1:
            s = S[:, :, q].transpose(1, 2)  # (B, N, V)
        else:
            s = torch.gather(S, 2, q[:, None, :].expand(-1, S.shape[1], -1)).transpose(1, 2)
        cnt = bag.counts.to(S.dtype)
        log_c = cnt.log()  # -inf where the type is not a key
        logZ = torch.logsumexp(s + log_c, dim=-1, keepdim=True)
        alpha = torch.exp(s - logZ) * (cnt > 0)
        logits = (cnt * alpha) @ G
        return logits, alpha

    def losses(self, bag: Bag) -> Tensor:
        """Per-model training loss (B,) as :func:`qkov_lib.train.loss_fn`, through the
        generic :meth:`forward` (autograd graph attached)."""
        logits, _ = self.forward(bag)
        B, N, C = logits.shape
        y = bag.y.expand(B, N)
        ce = torch.logsumexp(logits, -1) - logits.gather(-1, y[..., None])[..., 0]
        return ce.mean(dim=1) if bag.weight is None else (bag.weight.to(ce.dtype) * ce).sum(dim=-1)

    def loss_backward(self, bag: Bag) -> Tensor:
        """Per-model training loss (B,), detached, with its gradient accumulated into the
        parameters' ``.grad``.

        When every sequence has the same query type (the synthetic task) the scores ``s`` (B, V)
        do not depend on the row. With ``e = exp(s - max s)``, ``Z = counts @ e`` and
        ``L = counts @ (e * G) / Z`` (the logits, kept as (C, B, N)), the cross-entropy gradient
        ``R = w (softmax(L) - onehot(y))`` gives in closed form, with ``H = (R / Z) @ counts``,

            dG[b, v, c] = e[b, v] H[c, b, v],
            ds[b, v]    = e[b, v] (sum_c G[b, v, c] H[c, b, v] - ((R / Z) * L).sum_c @ counts),

        and autograd only carries ``ds``, ``dG`` back through the small (B, V, .) graph to
        the factors. Two matmuls per pass and no (B, N, V) intermediate. Otherwise, or if a
        row's normaliser would underflow (score gaps of hundreds of nats), this is plain autograd
        through :meth:`losses`."""
        c = bag.cache
        if "q0" not in c:
            q = bag.query
            q0 = int(q.reshape(-1)[0])
            c["q0"] = q0 if bool((q == q0).all()) else None
            c["seen"] = (bag.counts > 0).reshape(-1, bag.counts.shape[-1]).any(0)  # types that are ever keys
        if c["q0"] is None:
            return self._autograd_fallback(bag)
        S, G = self.tables()
        s = S[:, :, c["q0"]].masked_fill(~c["seen"], float("-inf"))  # (B, V)
        e = torch.exp(s - s.max(dim=1, keepdim=True).values.detach())
        B, V, C = G.shape
        N = bag.counts.shape[-2]
        with torch.no_grad():
            if "cnt" not in c:
                c["cnt"] = bag.counts.to(e.dtype)
                c["cntT"] = c["cnt"].transpose(-1, -2).contiguous()
                c["y"] = bag.y.expand(B, N)[None].contiguous()  # (1, B, N)
                c["w"] = (torch.full((B, N), 1.0 / N, dtype=e.dtype, device=e.device) if bag.weight is None
                          else bag.weight.to(e.dtype).expand(B, N).contiguous())
            cnt, y, w = c["cnt"], c["y"], c["w"]
            shared = cnt.dim() == 2
            Z = e @ c["cntT"] if shared else torch.bmm(cnt, e[:, :, None])[..., 0]  # (B, N)
            underflow = bool(Z.min() < torch.finfo(e.dtype).tiny ** 0.5)
        if underflow:
            return self._autograd_fallback(bag)
        with torch.no_grad():
            X = e[:, :, None] * G  # (B, V, C)
            if shared:
                L = (X.permute(2, 0, 1).reshape(C * B, V) @ c["cntT"]).reshape(C, B, N)
            else:
                L = torch.bmm(cnt, X).permute(2, 0, 1)
            invZ = Z.reciprocal_()
            L.mul_(invZ)  # logits (C, B, N)
            m = L.amax(0)
            P = torch.sub(L, m).exp_()
            sP = P.sum(0)
            picked = L.gather(0, y)[0]
            loss = (w * (m + sP.log() - picked)).sum(-1)
            wz = w * invZ
            P.mul_(wz / sP)  # w softmax / Z
            Rz = P.scatter_add_(0, y, -wz[None])  # w (softmax - onehot(y)) / Z, (C, B, N)
            k = (Rz * L).sum(0)  # (B, N)
            if shared:
                H = (Rz.reshape(C * B, N) @ cnt).reshape(C, B, V)
                k = k @ cnt  # (B, V)
            else:
                H = torch.bmm(Rz.permute(1, 0, 2), cnt).permute(1, 0, 2)
                k = torch.bmm(k[:, None, :], cnt)[:, 0]
            Hb = H.permute(1, 2, 0)  # (B, V, C)
            dG = e[:, :, None] * Hb
            de = ((G * Hb).sum(-1) - k).nan_to_num_(0.0, 0.0, 0.0)  # masked types: e = 0, no gradient
        torch.autograd.backward([e, G], [de, dG])
        return loss

    def _autograd_fallback(self, bag: Bag) -> Tensor:
        loss = self.losses(bag)
        loss.sum().backward()
        return loss.detach()

    @torch.no_grad()
    def write_back(self, models: Sequence[SyntheticModel]) -> None:
        """Copy the stacked weights into ``models`` (the models this stack was built from)."""
        for _, keys, idx in self.groups:
            for n, key in keys.items():
                for j, k in enumerate(idx):
                    getattr(models[k].attention, n).copy_(self.params[key][j])


# --- metrics -------------------------------------------------------------------------------
@torch.no_grad()
def predict_bag(stack: Stack, bag: Bag) -> tuple[Tensor, Tensor]:
    """``(alpha (B, N, V), probabilities (B, N, C) float64)`` on ``bag``; ``alpha`` is the
    attention on one occurrence of each type. With one query type for all rows the scores do
    not depend on the row, so ``alpha = e / (counts @ e)`` with ``e = exp(s - max s)``."""
    q = bag.query
    q0 = int(q.reshape(-1)[0])
    if not bool((q == q0).all()):
        logits, alpha = stack.forward(bag)
        return alpha, torch.softmax(logits.double(), -1)
    S, G = stack.tables()
    seen = (bag.counts > 0).reshape(-1, bag.counts.shape[-1]).any(0)
    s = S[:, :, q0].masked_fill(~seen, float("-inf"))
    e = torch.exp(s - s.max(dim=1, keepdim=True).values)  # (B, V)
    cnt = bag.counts.to(e.dtype)
    Z = cnt @ e[:, :, None] if cnt.dim() == 3 else (e @ cnt.T)[..., None]  # (B, N, 1)
    if bool(Z.min() < torch.finfo(e.dtype).tiny ** 0.5):
        logits, alpha = stack.forward(bag)
        return alpha, torch.softmax(logits.double(), -1)
    alpha = (e[:, None, :] / Z) * (cnt > 0)
    logits = (cnt * alpha) @ G
    return alpha, torch.softmax(logits.double(), -1)


def bag_summary(alpha: Tensor, probs: Tensor, bag: Bag, taus: Sequence[float] = DEFAULT_TAUS) -> dict[str, Tensor]:
    """:func:`qkov_lib.metrics.summarize` for every model at once: each key maps to a (B,)
    tensor. The relevant mass is ``sum_v relevant_v alpha_v``; the focus token is the type with
    the largest per-occurrence attention (ties: lowest type id, i.e. distinct tokens first)."""
    B, N, _ = probs.shape
    y = bag.y.expand(B, N)
    w = (torch.full((B, N), 1.0 / N, dtype=torch.float64, device=probs.device) if bag.weight is None
         else (bag.weight.double() / bag.weight.double().sum(-1, keepdim=True)).expand(B, N))
    a = (alpha.double() * bag.relevant).sum(-1)
    c = probs.gather(-1, y[..., None])[..., 0].double()
    pred = probs.argmax(-1)
    mean = lambda v: (w * v.double()).sum(-1)  # noqa: E731
    out = instance_means(a, c, pred == y, mean, taus)
    score = torch.where(bag.counts.expand_as(alpha) > 0, alpha.double(),
                        torch.tensor(-1.0, dtype=torch.float64, device=alpha.device))
    top = score.argmax(-1)
    ft = bag.relevant.expand_as(alpha).gather(-1, top[..., None])[..., 0] > 0
    pt = pred == y
    cells = {"FTPT": ft & pt, "FFPT": ~ft & pt, "FTPF": ft & ~pt, "FFPF": ~ft & ~pt}
    for k in FOCUS_CELLS:
        out[k] = mean(cells[k])
    return out


def relevant_and_confidence(alpha: Tensor, probs: Tensor, bag: Bag) -> tuple[Tensor, Tensor]:
    """Per-instance attention on relevant tokens ``a`` and gold-class confidence ``c`` (B, N)."""
    B, N, _ = probs.shape
    y = bag.y.expand(B, N)
    return (alpha.double() * bag.relevant).sum(-1), probs.gather(-1, y[..., None])[..., 0]


def evaluate_stack(stack: Stack, bag: Bag, taus: Sequence[float] = DEFAULT_TAUS,
                   dtap_bins: int | None = 10) -> tuple[list[dict[str, float]], list[Tensor] | None]:
    """Per-model metric dicts (as :func:`qkov_lib.train.evaluate`) and, if ``dtap_bins``,
    per-model DTAP histograms (bins, bins) on ``bag`` (unweighted instances; all NaN for a model
    whose outputs are not finite, e.g. one frozen after diverging)."""
    alpha, probs = predict_bag(stack, bag)
    summ = bag_summary(alpha, probs, bag, taus)
    rows = [{k: float(v[b]) for k, v in summ.items()} for b in range(stack.B)]
    if not dtap_bins:
        return rows, None
    a, c = relevant_and_confidence(alpha, probs, bag)
    a, c = a.cpu(), c.cpu()
    nan = torch.full((dtap_bins, dtap_bins), float("nan"), dtype=torch.float64)
    return rows, [dtap_histogram(a[b], c[b], dtap_bins) if bool(torch.isfinite(a[b]).all() & torch.isfinite(c[b]).all())
                  else nan.clone() for b in range(stack.B)]


# --- training ------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """A run at the first step where its training loss was ``<= level``: that ``step``, the log
    ``record`` there and the attention ``weights`` (parameter name -> tensor)."""

    level: float
    step: int
    record: dict
    weights: dict[str, Tensor]


@dataclass
class EngineHistory(History):
    """A :class:`~qkov_lib.train.History` (``stop_step``: the step at which the run's training
    loss first reached ``stop_loss``; ``diverged_step``) plus, with ``snapshot_loss``, one
    :class:`Snapshot` per loss level the run reached (``snapshots``, keyed by level) and, for
    full-batch training, ``loss_rises``: the number of steps at which the training loss rose by
    more than a relative 1e-9 over the previous step's. Gradient descent at a rate inside its
    stable range never raises the full-batch loss of a smooth objective, so a rise is the mark of
    an unstable rate (0 for minibatch runs, whose loss is noisy by construction)."""

    snapshots: dict[float, Snapshot] = field(default_factory=dict)
    loss_rises: int = 0


BatchedProbe = Callable[["Stack"], dict[str, Sequence[float]]]
"""Called with the :class:`Stack` at each logged step; returns per-model values (length B; None:
the model has no such value)."""


def per_model_probe(models: Sequence[SyntheticModel],
                    probes: Sequence[Callable[[SyntheticModel], dict[str, float]]]) -> BatchedProbe:
    """A :data:`BatchedProbe` from the one-model probes :func:`qkov_lib.train.train` takes: at each
    logged step model ``b``'s current stacked weights are copied into ``models[b]`` (the engine
    writes the final ones back when training ends) and ``probes[b](models[b])`` gives its values;
    a key that some probes do not return is None for their models, and their log records lack it,
    as the loop's would. For probes that need the whole model, such as one that tracks conserved
    quantities from the first logged step on."""
    models, probes = list(models), list(probes)
    if len(models) != len(probes):
        raise ValueError(f"got {len(probes)} probes for {len(models)} models")

    def probe(stack: Stack) -> dict[str, list[float | None]]:
        values = []
        for b, (m, p) in enumerate(zip(models, probes)):
            with torch.no_grad():
                for name, w in stack.weights_of(b).items():
                    getattr(m.attention, name).copy_(w)
            values.append(p(m))
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: [None if k not in v else float(v[k]) for v in values] for k in keys}

    return probe


def _as_list(x, B: int, what: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != B:
            raise ValueError(f"got {len(x)} {what} for {B} models")
        return list(x)
    return [x] * B


def _rates(stack: Stack, models: Sequence[SyntheticModel], cfgs: Sequence[TrainConfig]) -> dict:
    """Per-row optimizer rates of every stacked tensor, read off :func:`qkov_lib.models.param_groups`."""
    per_model = []
    for m, c in zip(models, cfgs):
        r = rates_of(param_groups(m, c.eta_ov, c.ratio, c.eta_other, c.weight_decay), m,
                     c.momentum if c.optimizer == "sgd" else 0.0)
        per_model.append({n.rsplit(".", 1)[-1]: v for n, v in r.items()})
    out = {}
    for key, rows in stack.members.items():
        name = key.split("/", 1)[1]
        out[key] = stack_rates([per_model[int(k)] for k in rows], [name])[name]
    return out


def train_batched(models: Sequence[SyntheticModel], data: Batch | Sequence[Batch],
                  cfgs: TrainConfig | Sequence[TrainConfig], probe: BatchedProbe | None = None,
                  stop_loss: float | None = None, on_nonfinite: str = "raise", desc: str = "batched",
                  progress: bool | None = None, threads: int | None = DEFAULT_THREADS,
                  snapshot_loss: float | Sequence[float] | None = None, leave: bool = False) -> list[EngineHistory]:
    """Train ``models`` together, as :func:`qkov_lib.train.train` would train each one on
    its data (one shared :class:`Batch`, or one per model) with its config.

    Models may mix parameterizations but must share the task (embedding shape, classes);
    configs may differ in ``eta_ov``, ``ratio``, ``eta_other``, ``weight_decay``, ``momentum`` and
    ``seed``. Returns one :class:`EngineHistory` per model and writes the trained weights back
    into ``models``.
    ``stop_loss`` (full-batch training only) freezes a model once its training loss is
    ``<= stop_loss``, logging that step; ``snapshot_loss`` (full-batch only; one level or a
    sequence of them) records, per level, the step, a log record and a copy of the weights where
    the loss first is ``<= level`` (:class:`Snapshot`, in ``EngineHistory.snapshots``) and
    trains on; ``on_nonfinite`` is ``"raise"`` (NonFiniteError, as
    ``train``) or ``"freeze"`` (the model stops, ``diverged_step`` is set, others go on);
    ``threads`` sets torch's intra-op threads while training (see :func:`torch_threads`); ``leave``
    keeps the progress bar on screen once training ends (a chapter's one grid), where a sweep's many
    stacks clear theirs."""
    models = list(models)
    cfgs = _as_list(cfgs, len(models), "configs")
    c0 = check_configs(cfgs, ("optimizer", "steps", "batch_size", "n_logs", "flush_denormals"))
    with torch_threads(threads), flush_denormals(c0.flush_denormals):
        return _train_batched(models, data, cfgs, c0, probe, stop_loss, on_nonfinite, desc, progress,
                              snapshot_loss, leave)


def _check_target(name: str, value, full_batch: bool, many: bool = False) -> list[float]:
    """The loss levels of ``value`` (None: none; a number, or with ``many`` a sequence of
    numbers), checked, highest first."""
    if value is None:
        return []
    if not full_batch:
        raise ValueError(f"{name} needs full-batch training (batch_size None) to see the training loss")
    values = list(value) if many and isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
            raise ValueError(f"{name} must be a finite number > 0{' (or a list of them)' if many else ''}, "
                             f"got {value!r}")
    if not values:
        raise ValueError(f"{name} must name at least one loss level, got {value!r}")
    return sorted({float(v) for v in values}, reverse=True)


def _train_batched(models: list[SyntheticModel], data, cfgs: list[TrainConfig], c0: TrainConfig, probe, stop_loss,
                   on_nonfinite, desc, progress, snapshot_loss=None, leave: bool = False) -> list[EngineHistory]:
    B = len(models)
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}")
    stack = Stack(models)
    n_types = stack.E.shape[1]
    if isinstance(data, Batch):
        bag = bag_of(data, n_types)
    else:
        bag = stack_bags([bag_of(d, n_types) for d in _as_list(list(data), B, "data sets")])
    device = stack.E.device
    bag = bag.to(device)
    N = len(bag)
    bs = N if c0.batch_size is None else min(c0.batch_size, N)
    _check_target("stop_loss", stop_loss, bs == N)
    levels = _check_target("snapshot_loss", snapshot_loss, bs == N, many=True)
    opt = StackedOptimizer(c0.optimizer, _rates(stack, models, cfgs), per_row=False)  # many tiny rows

    hists = [EngineHistory(config=asdict(c)) for c in cfgs]
    active = torch.ones(B, dtype=torch.bool, device=device)
    gens = [torch.Generator().manual_seed(c.seed) for c in cfgs]
    orders: list[list[Tensor]] = [[] for _ in range(B)]
    logs = set(log_steps(c0.steps, c0.n_logs))
    show = c0.progress if progress is None else progress

    def records(step: int, idx: list[int]) -> dict[int, dict]:
        alpha, probs = predict_bag(stack, bag)
        summ = bag_summary(alpha, probs, bag, taus=())
        extra = {}
        if probe is not None:
            with torch.no_grad():
                extra = probe(stack)
        out = {}
        for b in idx:
            rec = {"step": step, **{k: float(v[b]) for k, v in summ.items()}}
            rec.update({k: float(v[b]) for k, v in extra.items() if v[b] is not None})  # None: no such value
            out[b] = rec
        return out

    def record(step: int, which: Tensor) -> None:
        idx = which.nonzero()[:, 0].tolist()
        if idx:
            for b, rec in records(step, idx).items():
                hists[b].records.append(rec)

    snapped = torch.zeros(B, len(levels), dtype=torch.bool, device=device)
    rises = torch.zeros(B, dtype=torch.long, device=device)
    prev: Tensor | None = None
    level_t = torch.tensor(levels, dtype=torch.float64, device=device)

    def fail(step: int, bad: Tensor, what: str, tensors: dict[str, Tensor] | None = None) -> None:
        nonlocal active
        b = int(bad.nonzero()[0, 0])
        if on_nonfinite == "raise":
            name = None if tensors is None else stack.first_bad_tensor(tensors, b)
            where = "" if name is None else f" in parameter group '{group_of(name)}' (tensor {name})"
            c = cfgs[b]
            raise NonFiniteError(f"non-finite {what} at step {step}{where} in model {b} "
                                 f"({stack.kinds[b]}, ratio={c.ratio:g}, seed={c.seed}); "
                                 "lower the learning rates or the ratio")
        for k in bad.nonzero()[:, 0].tolist():
            hists[k].diverged_step = step
        active = active & ~bad

    bar = tqdm(total=c0.steps, desc=desc, disable=not show, leave=leave, mininterval=1.0)
    step = 0
    for step in range(c0.steps + 1):
        if step in logs:
            record(step, active)
        if step == c0.steps or not bool(active.any()):
            break
        if bs == N:
            batch = bag
        else:
            idx = []
            for b in range(B):
                if not orders[b]:
                    orders[b] = list(torch.randperm(N, generator=gens[b]).split(bs))
                idx.append(orders[b].pop(0))
            batch = _rows(bag, torch.stack(idx).to(device))
        for p in stack.params.values():
            p.grad = None
        loss = stack.loss_backward(batch)
        finite = torch.isfinite(loss)
        if bs == N:  # full batch: a rise of the training loss marks an unstable rate
            cur = loss.detach()
            if prev is not None:
                rises += (active & finite & (cur > prev + 1e-9 * prev.abs())).long()
            prev = cur
        if levels:
            new = (active & finite)[:, None] & ~snapped & (loss.detach()[:, None] <= level_t.to(loss.dtype))
            if bool(new.any()):
                rows = new.any(1).nonzero()[:, 0].tolist()
                for b, rec in records(step, rows).items():
                    w = stack.weights_of(b)
                    for k in new[b].nonzero()[:, 0].tolist():
                        hists[b].snapshots[levels[k]] = Snapshot(levels[k], step, rec, w)
                snapped |= new
        if stop_loss is not None:
            reached = active & finite & (loss <= stop_loss)
            if bool(reached.any()):
                if step not in logs:
                    record(step, reached)
                for k in reached.nonzero()[:, 0].tolist():
                    hists[k].stop_step = step
                active = active & ~reached
        bad = active & ~finite
        if bool(bad.any()):
            fail(step, bad, "loss")
        grads = {n: p.grad for n, p in stack.params.items()}
        bad = active & ~stack.finite(grads)
        if bool(bad.any()):
            fail(step, bad, "gradient", grads)
        opt.step(stack.params, grads, {n: active[stack.members[n]] for n in stack.params})
        values = {n: p.detach() for n, p in stack.params.items()}
        bad = active & ~stack.finite(values)
        if bool(bad.any()):
            fail(step, bad, "parameter", values)
        bar.update()
    finish_bar(bar, desc, step, c0.steps)
    stack.write_back(models)
    for h, k in zip(hists, rises.tolist()):
        h.loss_rises = int(k)
    return hists


def _task_key(m: SyntheticModel) -> tuple:
    if not isinstance(m, SyntheticModel):
        raise TypeError(f"the batched engine trains SyntheticModel only (no positions), got {type(m).__name__}")
    return tuple(m.E.shape), m.E.dtype, m.attention.n_out


def evaluate_models(models: Sequence[SyntheticModel], data: Batch | Sequence[Batch],
                    taus: Sequence[float] = DEFAULT_TAUS, dtap_bins: int | None = 10,
                    threads: int | None = DEFAULT_THREADS) -> tuple[list[dict[str, float]], list[Tensor] | None]:
    """Test metrics (as :func:`qkov_lib.train.evaluate`) and DTAP histograms of each model on
    its data (one shared :class:`Batch`, or one per model), computed batched per task group;
    results in input order."""
    with torch_threads(threads):
        return _evaluate_models(list(models), data, taus, dtap_bins)


def _evaluate_models(models, data, taus, dtap_bins):
    models = list(models)
    B = len(models)
    datas = data if isinstance(data, Batch) else _as_list(list(data), B, "data sets")
    groups: dict[tuple, list[int]] = {}
    for k, m in enumerate(models):
        groups.setdefault(_task_key(m), []).append(k)
    rows: list = [None] * B
    hists: list = [None] * B
    for idx in groups.values():
        stack = Stack([models[k] for k in idx])
        n_types = stack.E.shape[1]
        bag = (bag_of(datas, n_types) if isinstance(datas, Batch)
               else stack_bags([bag_of(datas[k], n_types) for k in idx]))
        r, h = evaluate_stack(stack, bag.to(stack.E.device), taus, dtap_bins)
        for j, k in enumerate(idx):
            rows[k] = r[j]
            hists[k] = None if h is None else h[j]
    return rows, (hists if dtap_bins else None)
