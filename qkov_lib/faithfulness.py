"""ERASER faithfulness (comprehensiveness, sufficiency, AOPC) and plausibility (token-F1, IOU-F1,
AUPRC) of attention rows, after DeYoung et al. 2020, "ERASER: A Benchmark to Evaluate Rationalized
NLP Models", with the reconstruction choices stated in the book's introduction ("The metrics").

Shapes throughout: ``attn`` (N, T) float, the attention row at the query position (or any
per-key importance score); ``key_mask`` (N, T) bool, True where a key may be attended;
``rationale`` (N, T) bool, the human rationale. Sequences are left-padded and the last column is
the query/prediction position. Only keys count as tokens: ``attn`` on non-keys is ignored and a
rationale on a non-key is an error. Scores are fractions (probabilities, F1 in [0, 1]), not percent.

Choices (our reconstruction, stated where the paper is silent):

* **Top-k% tokens.** ``topk_mask`` keeps ``k = ceil(frac * n)`` keys of an instance with ``n``
  keys, clipped to ``[1, n]``; ties in attention go to the earlier position (lower column).
  So uniform attention selects the *first* ``k`` keys: a position baseline, not a random one.
* **Removal = masking keys.** "x without r" is ``key_mask & ~r`` and "r only" is
  ``key_mask & r``; the model is re-run as ``model(tokens, new_key_mask)`` -> ``(logits, attn)``.
  The query token still forms the query, so removal changes only what can be attended.
* **Empty inputs.** "r only" always keeps ``k >= 1`` key, so sufficiency is always defined.
  "x without r" is empty when ``k = n`` (an instance with a single key, or ``frac = 1``); the
  model is not run on an empty key set and that (instance, frac) comprehensiveness is undefined
  (NaN). The AOPC of an instance averages its defined fracs; an instance with none is NaN and
  :func:`faithfulness` reports how many. With the default fracs (all <= 0.5) ``k < n`` whenever
  ``n >= 2``, so only single-key instances are affected.
* **AOPC** = the per-instance mean over fracs; ERASER then averages over instances (the order of
  the two means does not matter when nothing is undefined).

HateXplain's own protocol, which differs from these definitions, is :mod:`qkov_lib.faithfulness_hatexplain`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from qkov_lib.data.batch import Batch

DEFAULT_FRACS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.2, 0.5)
_EPS_CEIL = 1e-9  # so that e.g. 0.07 * 100 = 7.000000000000001 selects 7 keys, not 8


# --- validation -------------------------------------------------------------------------------
def _check_masks(attn: Tensor, key_mask: Tensor, rationale: Tensor | None = None) -> None:
    if not isinstance(attn, Tensor) or not isinstance(key_mask, Tensor):
        raise TypeError("attn and key_mask must be torch tensors")
    if attn.dim() != 2:
        raise ValueError(f"attn must have shape (N, T), got {tuple(attn.shape)}")
    if not attn.is_floating_point():
        raise TypeError(f"attn must be a floating-point tensor, got {attn.dtype}")
    if key_mask.shape != attn.shape:
        raise ValueError(f"key_mask must have the shape of attn {tuple(attn.shape)}, got {tuple(key_mask.shape)}")
    if key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be a bool tensor, got {key_mask.dtype}")
    if attn.shape[0] == 0:
        raise ValueError("empty batch: attn has no instances")
    no_key = (~key_mask.any(dim=1)).nonzero().flatten()
    if no_key.numel():
        raise ValueError(f"{no_key.numel()} instance(s) have an empty key_mask (no attendable key), "
                         f"e.g. instance {int(no_key[0])}")
    bad = key_mask & ~torch.isfinite(attn)
    if bool(bad.any()):
        raise ValueError(f"attn has non-finite values on attendable keys (instance {int(bad.any(1).nonzero()[0])})")
    if rationale is not None:
        if not isinstance(rationale, Tensor):
            raise TypeError("rationale must be a torch tensor")
        if rationale.shape != attn.shape:
            raise ValueError(f"rationale must have the shape of attn {tuple(attn.shape)}, got {tuple(rationale.shape)}")
        if rationale.dtype != torch.bool:
            raise TypeError(f"rationale must be a bool tensor, got {rationale.dtype}")
        outside = rationale & ~key_mask
        if bool(outside.any()):
            i = int(outside.any(1).nonzero()[0])
            raise ValueError(f"rationale marks positions that are not attendable keys (instance {i}); "
                             "intersect it with key_mask first")


def _check_frac(frac: float) -> float:
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not (0.0 < float(frac) <= 1.0):
        raise ValueError(f"frac must be a number in (0, 1], got {frac!r}")
    return float(frac)


def _check_fracs(fracs: Sequence[float]) -> tuple[float, ...]:
    fracs = tuple(fracs)
    if not fracs:
        raise ValueError("fracs must be a non-empty sequence of numbers in (0, 1]")
    return tuple(_check_frac(f) for f in fracs)


def _check_k(k: int | None) -> int | None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be None or an int >= 1, got {k!r}")
    return k


# --- top-k selection --------------------------------------------------------------------------
def _rank_keys(attn: Tensor, key_mask: Tensor) -> Tensor:
    """Rank (N, T) long of each column by descending attention among the keys (0 = highest);
    ties go to the lower column; non-keys rank after every key."""
    N, T = attn.shape
    scores = attn.detach().double().masked_fill(~key_mask, -math.inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(T, device=attn.device).expand(N, T).contiguous())
    return rank


def _topk_by_count(attn: Tensor, key_mask: Tensor, k: Tensor) -> Tensor:
    """Bool (N, T): the ``k[i]`` highest-attention keys of instance ``i`` (``k`` (N,) long)."""
    return (_rank_keys(attn, key_mask) < k[:, None]) & key_mask


def n_selected(key_mask: Tensor, frac: float) -> Tensor:
    """``k = ceil(frac * n)`` clipped to ``[1, n]`` (N,) long, for ``n`` keys per instance."""
    frac = _check_frac(frac)
    n = key_mask.sum(dim=1)
    k = torch.ceil(frac * n.double() - _EPS_CEIL).long()
    return torch.minimum(k.clamp_min(1), n)


def topk_mask(attn: Tensor, key_mask: Tensor, frac: float) -> Tensor:
    """Bool (N, T): per instance the ``ceil(frac * n)`` keys (at least 1, at most all ``n``)
    with the highest attention; ties go to the earlier position. ``0 < frac <= 1``."""
    frac = _check_frac(frac)
    _check_masks(attn, key_mask)
    return _topk_by_count(attn, key_mask, n_selected(key_mask, frac))


# --- baselines --------------------------------------------------------------------------------
def uniform_attention(key_mask: Tensor) -> Tensor:
    """(N, T) float: ``1/n`` on each of the ``n`` keys of an instance, 0 on non-keys."""
    if not isinstance(key_mask, Tensor) or key_mask.dim() != 2 or key_mask.dtype != torch.bool:
        raise ValueError("key_mask must be a bool tensor of shape (N, T)")
    n = key_mask.sum(dim=1, keepdim=True)
    if bool((n == 0).any()):
        raise ValueError("every instance needs at least one key for uniform attention")
    return key_mask.float() / n


def random_attention(key_mask: Tensor, generator: torch.Generator | None) -> Tensor:
    """(N, T) float: an attention row drawn from the flat Dirichlet(1, ..., 1) over the keys of
    each instance (normalised Exponential(1) draws), 0 on non-keys. Deterministic given
    ``generator`` (drawn on the generator's device, returned on ``key_mask``'s)."""
    if not isinstance(key_mask, Tensor) or key_mask.dim() != 2 or key_mask.dtype != torch.bool:
        raise ValueError("key_mask must be a bool tensor of shape (N, T)")
    if bool((key_mask.sum(dim=1) == 0).any()):
        raise ValueError("every instance needs at least one key for random attention")
    dev = generator.device if generator is not None else key_mask.device
    u = torch.rand(key_mask.shape, generator=generator, device=dev, dtype=torch.float64)
    e = -torch.log1p(-u).to(key_mask.device)  # Exponential(1); u in [0, 1) so e is finite
    e = e * key_mask
    s = e.sum(dim=1, keepdim=True)
    e = torch.where(s > 0, e / s.clamp_min(1e-300), key_mask / key_mask.sum(1, keepdim=True).double())
    return e.float()


# --- faithfulness -----------------------------------------------------------------------------
@torch.no_grad()
def _probs(model: nn.Module, tokens: Tensor, key_mask: Tensor) -> Tensor:
    out = model(tokens, key_mask)
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return torch.softmax(logits.double(), dim=-1)


@torch.no_grad()
def aopc_scores(model: nn.Module, batch: Batch, attn: Tensor, fracs: Sequence[float] = DEFAULT_FRACS,
                chunk_size: int = 512) -> dict[str, Tensor]:
    """Per-instance, per-frac ERASER scores for the top-``frac`` keys ``r`` by ``attn``.

    Returns a dict of tensors (float64 unless stated): ``yhat`` (N,) long, the predicted class on
    the full input; ``p_full`` (N,) ``p(yhat|x)``; ``comprehensiveness`` (N, F)
    ``p(yhat|x) - p(yhat|x without r)``, NaN where ``x without r`` has no key; ``sufficiency``
    (N, F) ``p(yhat|x) - p(yhat|r only)``; ``k`` (N, F) long, the number of keys in ``r``.
    ``F = len(fracs)``. The model is run in eval mode (restored afterwards) on chunks of
    ``chunk_size`` instances.
    """
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a qkov_lib.data.batch.Batch, got {type(batch).__name__}")
    fracs = _check_fracs(fracs)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    key_mask = batch.key_mask
    attn = attn.to(key_mask.device)
    _check_masks(attn, key_mask)
    N, F = len(batch), len(fracs)
    ks = torch.stack([n_selected(key_mask, f) for f in fracs], dim=1)  # (N, F)
    yhat = torch.empty(N, dtype=torch.long, device=key_mask.device)
    p_full = torch.empty(N, dtype=torch.float64, device=key_mask.device)
    comp = torch.full((N, F), math.nan, dtype=torch.float64, device=key_mask.device)
    suff = torch.empty((N, F), dtype=torch.float64, device=key_mask.device)
    was_training = model.training
    model.eval()
    try:
        for lo in range(0, N, chunk_size):
            sl = slice(lo, min(lo + chunk_size, N))
            tok, km, a = batch.tokens[sl], key_mask[sl], attn[sl]
            p = _probs(model, tok, km)
            yh = p.argmax(dim=-1)
            p0 = p.gather(1, yh[:, None])[:, 0]
            yhat[sl], p_full[sl] = yh, p0
            rank = _rank_keys(a, km)
            for j in range(F):
                r = (rank < ks[sl, j, None]) & km
                keep = km & r  # "r only": k >= 1 keys, never empty
                suff[sl, j] = p0 - _probs(model, tok, keep).gather(1, yh[:, None])[:, 0]
                rest = km & ~r  # "x without r": empty when k = n
                ok = rest.any(dim=1)
                if bool(ok.any()):
                    idx = ok.nonzero().flatten()
                    pr = _probs(model, tok[idx], rest[idx]).gather(1, yh[idx, None])[:, 0]
                    comp[lo + idx, j] = p0[idx] - pr
    finally:
        model.train(was_training)
    return {"yhat": yhat, "p_full": p_full, "comprehensiveness": comp, "sufficiency": suff, "k": ks}


def _nanmean_rows(x: Tensor) -> Tensor:
    ok = ~torch.isnan(x)
    s = torch.where(ok, x, torch.zeros_like(x)).sum(dim=1)
    n = ok.sum(dim=1)
    return torch.where(n > 0, s / n.clamp_min(1), torch.full_like(s, math.nan))


def comprehensiveness(model: nn.Module, batch: Batch, attn: Tensor,
                      fracs: Sequence[float] = DEFAULT_FRACS, chunk_size: int = 512) -> Tensor:
    """AOPC comprehensiveness (N,) float64: the mean over ``fracs`` of
    ``p(yhat|x) - p(yhat|x without top-frac keys)``; undefined fracs (all keys removed) are left
    out of the mean, and an instance with no defined frac is NaN (see the module docstring)."""
    return _nanmean_rows(aopc_scores(model, batch, attn, fracs, chunk_size)["comprehensiveness"])


def sufficiency(model: nn.Module, batch: Batch, attn: Tensor,
                fracs: Sequence[float] = DEFAULT_FRACS, chunk_size: int = 512) -> Tensor:
    """AOPC sufficiency (N,) float64: the mean over ``fracs`` of
    ``p(yhat|x) - p(yhat|only the top-frac keys)``. Lower is more sufficient; it can be negative."""
    return aopc_scores(model, batch, attn, fracs, chunk_size)["sufficiency"].mean(dim=1)


def faithfulness(model: nn.Module, batch: Batch, attn: Tensor, fracs: Sequence[float] = DEFAULT_FRACS,
                 chunk_size: int = 512) -> dict[str, float | int | list[float]]:
    """Dataset-level AOPC: mean comprehensiveness over the instances where it is defined,
    mean sufficiency over all, the per-frac curves (means over instances, defined values only),
    and ``n_comprehensiveness_undefined``, the number of instances left out of the first."""
    s = aopc_scores(model, batch, attn, fracs, chunk_size)
    comp_i = _nanmean_rows(s["comprehensiveness"])
    defined = ~torch.isnan(comp_i)
    c = s["comprehensiveness"]
    col_ok = ~torch.isnan(c)
    per_frac_comp = [float(c[col_ok[:, j], j].mean()) if bool(col_ok[:, j].any()) else math.nan
                     for j in range(c.shape[1])]
    return {
        "comprehensiveness": float(comp_i[defined].mean()) if bool(defined.any()) else math.nan,
        "sufficiency": float(s["sufficiency"].mean()),
        "comprehensiveness_by_frac": per_frac_comp,
        "sufficiency_by_frac": s["sufficiency"].mean(dim=0).tolist(),
        "fracs": list(_check_fracs(fracs)),
        "n": len(batch),
        "n_comprehensiveness_undefined": int((~defined).sum()),
    }


# --- plausibility -----------------------------------------------------------------------------
def _pred_tokens(attn: Tensor, key_mask: Tensor, rationale: Tensor, k: int | None) -> Tensor:
    """Top-k keys (N, T) bool; k defaults to each instance's rationale size (at least 1);
    k is clipped to the number of keys."""
    n = key_mask.sum(dim=1)
    kk = rationale.sum(dim=1).clamp_min(1) if k is None else torch.full_like(n, k)
    return _topk_by_count(attn, key_mask, torch.minimum(kk, n))


def token_f1_per_instance(attn: Tensor, key_mask: Tensor, rationale: Tensor, k: int | None = None) -> Tensor:
    """Token F1 (N,) float64 of the top-k keys against the rationale (``k`` defaults to the
    instance's rationale size, so precision = recall = F1); NaN for an empty rationale."""
    _check_masks(attn, key_mask, rationale)
    k = _check_k(k)
    pred = _pred_tokens(attn, key_mask, rationale, k)
    tp = (pred & rationale).sum(dim=1).double()
    prec = tp / pred.sum(dim=1).double()
    n_true = rationale.sum(dim=1).double()
    rec = tp / n_true.clamp_min(1)
    f1 = torch.where(tp > 0, 2 * prec * rec / (prec + rec), torch.zeros_like(tp))
    return torch.where(n_true > 0, f1, torch.full_like(f1, math.nan))


def token_f1(attn: Tensor, key_mask: Tensor, rationale: Tensor, k: int | None = None) -> float:
    """ERASER token F1 ("instance_macro"): per-instance F1 of the top-k keys vs the rationale,
    averaged over instances with a non-empty rationale (the others are skipped;
    :func:`plausibility` reports how many)."""
    return _mean_defined(token_f1_per_instance(attn, key_mask, rationale, k))


def _check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be a number in (0, 1], got {threshold!r}")
    return float(threshold)


def _runs(v: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of True in a 1-D bool array."""
    d = np.diff(np.concatenate(([0], v.astype(np.int8), [0])))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def _iou(a: tuple[int, int], b: tuple[int, int]) -> float:
    inter = max(0, min(a[1], b[1]) - max(a[0], b[0]))
    return inter / ((a[1] - a[0]) + (b[1] - b[0]) - inter)


def iou_match_counts(attn: Tensor, key_mask: Tensor, rationale: Tensor, threshold: float = 0.5,
                     k: int | None = None) -> np.ndarray:
    """(N, 3) int: per instance ``[matched predicted spans, predicted spans, rationale spans]``.

    Spans are maximal runs of adjacent columns (a non-key column ends a run): the rationale's
    runs, and the runs of the top-k keys (``k`` as in :func:`token_f1`). A predicted span
    matches when its best IOU (token-set intersection over union) with any rationale span is
    ``>= threshold``, as in ERASER's ``partial_match_score``."""
    _check_masks(attn, key_mask, rationale)
    k = _check_k(k)
    _check_threshold(threshold)
    pred = _pred_tokens(attn, key_mask, rationale, k).cpu().numpy()
    truth = rationale.cpu().numpy()
    out = np.zeros((pred.shape[0], 3), dtype=np.int64)
    for i in range(pred.shape[0]):
        ps, ts = _runs(pred[i]), _runs(truth[i])
        tp = sum(int(max((_iou(p, t) for t in ts), default=0.0) >= threshold) for p in ps)
        out[i] = (tp, len(ps), len(ts))
    return out


def iou_f1(attn: Tensor, key_mask: Tensor, rationale: Tensor, threshold: float = 0.5, k: int | None = None,
           average: str = "macro") -> float:
    """ERASER IOU F1 over instances with a non-empty rationale (see :func:`iou_match_counts`).

    ``macro`` (default, as ERASER's ``partial_match_score``): precision = mean over instances of
    matched/predicted spans, recall = mean of matched/rationale spans, F1 = harmonic mean of the
    two. ``micro``: the same ratios of counts summed over instances."""
    if average not in ("macro", "micro"):
        raise ValueError(f"average must be 'macro' or 'micro', got {average!r}")
    c = iou_match_counts(attn, key_mask, rationale, threshold, k)
    c = c[c[:, 2] > 0]
    if len(c) == 0:
        raise ValueError("no instance has a non-empty rationale")
    if average == "macro":
        p, r = float(np.mean(c[:, 0] / c[:, 1])), float(np.mean(c[:, 0] / c[:, 2]))
    else:
        p, r = c[:, 0].sum() / c[:, 1].sum(), c[:, 0].sum() / c[:, 2].sum()
    return 0.0 if p == 0 or r == 0 else float(2 * p * r / (p + r))


def average_precision_per_instance(attn: Tensor, key_mask: Tensor, rationale: Tensor) -> Tensor:
    """Average precision (N,) float64 of the attention scores over the keys against the
    rationale, as scikit-learn's ``average_precision_score``: ``sum_n (R_n - R_{n-1}) P_n`` over
    the distinct score thresholds (tied scores enter together). NaN for an empty rationale; an
    all-rationale instance scores 1."""
    _check_masks(attn, key_mask, rationale)
    N, T = attn.shape
    rank = _rank_keys(attn, key_mask)
    order = rank.argsort(dim=1)  # columns by descending score, keys first
    s = attn.detach().double().masked_fill(~key_mask, -math.inf).gather(1, order)
    rel = rationale.gather(1, order).double()
    is_key = key_mask.gather(1, order)
    tp = rel.cumsum(dim=1)
    nxt = torch.cat([s[:, 1:], torch.full((N, 1), -math.inf, dtype=s.dtype, device=s.device)], dim=1)
    end = is_key & (s != nxt)  # last element of a group of tied scores (keys have finite scores)
    tp_end = torch.where(end, tp, torch.zeros_like(tp))
    prev = torch.cat([torch.zeros((N, 1), dtype=tp.dtype, device=tp.device), tp_end[:, :-1]], dim=1).cummax(dim=1).values
    count = torch.arange(1, T + 1, dtype=torch.float64, device=attn.device)
    npos = rel.sum(dim=1)
    ap = (end * (tp - prev) * tp / count).sum(dim=1) / npos.clamp_min(1)
    return torch.where(npos > 0, ap, torch.full_like(ap, math.nan))


def auprc(attn: Tensor, key_mask: Tensor, rationale: Tensor) -> float:
    """AUPRC as average precision (see :func:`average_precision_per_instance`), averaged over
    instances with a non-empty rationale. ERASER's scoring code computes both this average
    precision (leaving out single-class instances) and a trapezoidal area under the PR curve; we
    use average precision and keep instances whose rationale covers every key (AP = 1)."""
    return _mean_defined(average_precision_per_instance(attn, key_mask, rationale))


def _mean_defined(x: Tensor) -> float:
    ok = ~torch.isnan(x)
    if not bool(ok.any()):
        raise ValueError("no instance has a non-empty rationale")
    return float(x[ok].mean())


def plausibility(attn: Tensor, key_mask: Tensor, rationale: Tensor, k: int | None = None,
                 threshold: float = 0.5) -> dict[str, float | int]:
    """Token F1, IOU F1 (macro) and AUPRC of ``attn`` against ``rationale`` over the instances
    with a non-empty rationale (``n_evaluated``); ``n_skipped_empty`` counts the others."""
    _check_masks(attn, key_mask, rationale)
    nonempty = rationale.any(dim=1)
    n_eval = int(nonempty.sum())
    if n_eval == 0:
        raise ValueError("no instance has a non-empty rationale")
    return {
        "token_f1": token_f1(attn, key_mask, rationale, k),
        "iou_f1": iou_f1(attn, key_mask, rationale, threshold, k),
        "auprc": auprc(attn, key_mask, rationale),
        "n_evaluated": n_eval,
        "n_skipped_empty": int((~nonempty).sum()),
    }
