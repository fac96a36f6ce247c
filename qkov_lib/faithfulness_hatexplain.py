"""HateXplain's own explainability protocol (Mathew et al. 2021, AAAI; computed there with the
ERASER scorer of DeYoung et al. 2020): the top-5 tokens by attention, deleted from the post (so
later tokens shift position) rather than masked as keys, on hate-speech and offensive posts only;
token-F1 of those 5 tokens; IOU-F1 with each of them as a single-token span; AUPRC as the
trapezoid under the precision-recall curve. It works on plain token-id lists and a model-agnostic
``predict_fn(list_of_token_id_lists) -> probs (n, C)``; :func:`hatexplain_protocol` applies it to a
model and a :class:`Batch`. :data:`DEFINITIONAL_DIFFERENCES` lists every way it differs from the
book's own definitions (:mod:`qkov_lib.faithfulness`), for the book to display.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from qkov_lib.data.batch import Batch, left_pad
from qkov_lib.data.hatexplain import NORMAL as HATEXPLAIN_NORMAL
from qkov_lib.data.text import PAD_ID
from qkov_lib.faithfulness import _check_masks, _iou, _probs, _runs, _check_threshold

# Posts are plain lists: ``sequences[i]`` the token ids of post i (words only, no padding, no
# query), ``scores[i]`` one importance score per token, ``rationales[i]`` one 0/1 per token.
# Positions are indices into the post.
HATEXPLAIN_TOP_K = 5
EMPTY_RATIONALE_POLICIES: tuple[str, ...] = ("skip", "eraser")
EMPTY_INPUT_POLICIES: tuple[str, ...] = ("nan", "predict")

#: ``predict_fn(list_of_token_id_lists) -> probs`` of shape (n, C), rows summing to 1.
PredictFn = Callable[[list[list[int]]], "np.ndarray | Tensor"]

#: Every definitional difference between our AOPC/plausibility metrics (:mod:`qkov_lib.faithfulness`)
#: and HateXplain's / ERASER's, as ``(topic, ours, theirs)``. Sources for "theirs": the
#: HateXplain repository (hate-alert/HateXplain: testing_with_rational.py, Preprocess/dataCollect.py
#: ``convert_data``, Explainability_Calculation_NB.ipynb) and its copy of ERASER's scorer
#: (eraserbenchmark/rationale_benchmark/metrics.py).
DEFINITIONAL_DIFFERENCES: tuple[tuple[str, str, str], ...] = (
    ("Tokens in r (how many)",
     "AOPC: the top ceil(frac * n) keys for each frac in {1, 5, 10, 20, 50} %; the score is averaged over the five "
     "fracs",
     "HateXplain: a fixed k = 5 tokens (the whole post when it has at most 5 tokens); one score, no averaging over "
     "bins"),
    ("Rounding of k",
     "k = ceil(frac * n), rounded up and clipped to [1, n]",
     "HateXplain: nothing to round (k = 5 tokens). ERASER's scorer only receives the perturbed probabilities; how "
     "k% is turned into a token count is left to whoever produces them"),
    ("Ties in the importance score",
     "the earlier position wins (stable sort by descending score): uniform attention selects the first k keys",
     "the later position wins (stable ascending sort, the last k kept): uniform attention selects the last k tokens"),
    ("How r is removed",
     "masking keys: every token keeps its position and only what can be attended changes; the query token still "
     "forms the query",
     "deleting tokens: 'x without r' is the post with r cut out, so later tokens move forward; 'r only' is the k "
     "tokens alone in their original order (re-wrapped in [CLS] ... [SEP] for BERT)"),
    ("Empty input after removal",
     "'x without r' with no key left is not run: that comprehensiveness is undefined, left out of the mean and "
     "counted",
     "a post of at most 5 tokens becomes empty and the model is run on the empty post"),
    ("Posts scored",
     "AOPC faithfulness on every test post; plausibility on the posts with a non-empty rationale",
     "only posts whose majority label is hate speech or offensive, for faithfulness and plausibility alike"),
    ("Token-F1",
     "the top-k keys with k = the size of the post's rationale by default (so precision = recall = F1); mean over "
     "posts with a non-empty rationale",
     "the top-5 tokens; per-post F1 averaged over all scored posts (ERASER 'instance_macro'); a post without "
     "rationale tokens scores 0"),
    ("IOU-F1 spans and averaging",
     "predicted spans are maximal runs of adjacent top-k keys; macro precision and recall are both means over the "
     "posts with a non-empty rationale",
     "each top-5 token is its own single-token span, so at IOU >= 0.5 it matches only a rationale span of 1 or 2 "
     "tokens that contains it; macro precision is averaged over posts with predictions, recall over posts with "
     "rationale spans, and recall (matched predicted spans / rationale spans) can exceed 1"),
    ("AUPRC",
     "average precision (scikit-learn's average_precision_score, a step sum over thresholds); mean over posts with "
     "a non-empty rationale",
     "the trapezoid under scikit-learn's precision_recall_curve (sklearn.metrics.auc), which joins the points "
     "linearly and ends at (recall 0, precision 1); a post without rationale is kept and gives 0.5 with the "
     "scikit-learn pinned here (it sets recall to 1 when there is no positive; older versions divided by zero)"),
    ("Gold rationale across annotators",
     "the union of the annotators' rationales, on posts whose majority label is not normal",
     "the same union (HateXplain's evaluation uses 'the union of explanations'); its training target, not used for "
     "evaluation, is a softmax of the annotators' mean mask"),
    ("Token units",
     "the post's words (HateXplain's post_tokens) as keys; the query position is not a token",
     "words for BiRNN, BiRNN-Attn and CNN-GRU; WordPiece sub-tokens including [CLS] and [SEP] for BERT"),
    ("Importance score",
     "the analysed head's attention row at the query position",
     "the model's attention ([Attn] rows: BiRNN-Attn's attention layer; BERT's last-layer [CLS] row averaged over "
     "heads) or LIME weights ([LIME] rows)"),
)


def _check_top_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return int(k)


def _check_policy(value: str, allowed: tuple[str, ...], name: str) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _as_scores(scores: Sequence[float] | np.ndarray | Tensor, i: int, n: int | None = None) -> np.ndarray:
    """Float64 (n,) copy of one post's scores; 1-D, finite, ``n`` long when ``n`` is given."""
    if isinstance(scores, Tensor):
        scores = scores.detach().cpu().double().numpy()
    try:
        a = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"scores of post {i} must be numbers: {e}") from None
    if a.ndim != 1:
        raise ValueError(f"scores of post {i} must be 1-D, got shape {a.shape}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"post {i} has {n} tokens but {a.shape[0]} scores")
    if not np.isfinite(a).all():
        raise ValueError(f"scores of post {i} have non-finite values")
    return a


def _as_rationale(rationale: Sequence[bool] | np.ndarray | Tensor, i: int, n: int) -> np.ndarray:
    """Bool (n,) copy of one post's rationale (bools or 0/1 values)."""
    if isinstance(rationale, Tensor):
        rationale = rationale.detach().cpu().numpy()
    a = np.asarray(rationale)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"rationale of post {i} must be 1-D with one value per token ({n}), got shape {a.shape}")
    if a.dtype != np.bool_ and not (np.issubdtype(a.dtype, np.number) and np.isin(a, (0, 1)).all()):
        raise ValueError(f"rationale of post {i} must hold bools or 0/1 values")
    return a.astype(bool)


def _check_list(x: object, name: str) -> list:
    if isinstance(x, (str, bytes)) or not isinstance(x, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence with one entry per post, got {type(x).__name__}")
    x = list(x)
    if not x:
        raise ValueError(f"{name} is empty: no post to score")
    return x


def _scored_posts(scores: Sequence, rationales: Sequence) -> tuple[list[np.ndarray], list[np.ndarray]]:
    scores, rationales = _check_list(scores, "scores"), _check_list(rationales, "rationales")
    if len(scores) != len(rationales):
        raise ValueError(f"scores ({len(scores)} posts) and rationales ({len(rationales)} posts) differ in length")
    sc = [_as_scores(s, i) for i, s in enumerate(scores)]
    for i, s in enumerate(sc):
        if s.size == 0:
            raise ValueError(f"post {i} is empty: every post needs at least one token")
    return sc, [_as_rationale(r, i, s.size) for i, (r, s) in enumerate(zip(rationales, sc))]


def hatexplain_top_k(scores: Sequence[float] | np.ndarray | Tensor, k: int = HATEXPLAIN_TOP_K) -> list[int]:
    """Positions (ascending) of the ``k`` highest-scoring tokens of one post, HateXplain's rule:
    ties go to the LATER position; a post with at most ``k`` tokens gives all its positions."""
    k = _check_top_k(k)
    a = _as_scores(scores, 0)
    if a.size == 0:
        raise ValueError("scores are empty: a post needs at least one token")
    order = np.lexsort((np.arange(a.size), a))  # ascending by score, then by position
    return sorted(order[-k:].tolist())


def split_tokens(tokens: Sequence[int], positions: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(r_only, without_r)``: the tokens at ``positions`` alone, and the post with them deleted,
    both in the original order. Deleting shifts every later token forward."""
    tokens = [int(t) for t in tokens]
    pos = set(int(p) for p in positions)
    if len(pos) != len(list(positions)):
        raise ValueError(f"positions must be distinct, got {list(positions)}")
    bad = [p for p in pos if not 0 <= p < len(tokens)]
    if bad:
        raise ValueError(f"positions {sorted(bad)} are outside a post of {len(tokens)} tokens")
    return ([t for j, t in enumerate(tokens) if j in pos], [t for j, t in enumerate(tokens) if j not in pos])


def _predict(predict_fn: PredictFn, seqs: list[list[int]], n_classes: int | None = None) -> np.ndarray:
    """``predict_fn(seqs)`` as a checked float64 (n, C) probability array."""
    out = predict_fn([list(s) for s in seqs])
    if isinstance(out, Tensor):
        out = out.detach().cpu().double().numpy()
    p = np.asarray(out, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != len(seqs) or p.shape[1] < 2:
        raise ValueError(f"predict_fn must return probabilities of shape (n, C >= 2) for n = {len(seqs)} "
                         f"sequences, got shape {p.shape}")
    if n_classes is not None and p.shape[1] != n_classes:
        raise ValueError(f"predict_fn returned {p.shape[1]} classes here and {n_classes} on the full posts")
    if not np.isfinite(p).all() or (p < 0).any() or (np.abs(p.sum(axis=1) - 1) > 1e-6).any():
        raise ValueError("predict_fn must return probabilities (finite, >= 0, each row summing to 1); "
                         "apply a softmax to logits")
    return p


def hatexplain_faithfulness_scores(predict_fn: PredictFn, sequences: Sequence[Sequence[int]], scores: Sequence,
                                   k: int = HATEXPLAIN_TOP_K, on_empty: str = "nan") -> dict[str, np.ndarray | int]:
    """Per-post HateXplain comprehensiveness and sufficiency of the top-``k`` tokens ``r`` by score:
    ``yhat`` (N,) int, the class predicted on the full post; ``p_full`` (N,) ``p(yhat|x)``;
    ``comprehensiveness`` (N,) ``p(yhat|x) - p(yhat|x with r deleted)``; ``sufficiency`` (N,)
    ``p(yhat|x) - p(yhat|r alone)``; ``k`` (N,) int, tokens in ``r``; ``n_empty_without``, the posts
    with ``len <= k`` whose ``x without r`` is empty. ``on_empty="nan"`` leaves their
    comprehensiveness undefined (NaN); ``"predict"`` calls ``predict_fn`` on the empty list, as the
    HateXplain code runs its model on the empty post. ``predict_fn`` is called at most three times."""

    k = _check_top_k(k)
    _check_policy(on_empty, EMPTY_INPUT_POLICIES, "on_empty")
    sequences, scores = _check_list(sequences, "sequences"), _check_list(scores, "scores")
    if len(sequences) != len(scores):
        raise ValueError(f"sequences ({len(sequences)} posts) and scores ({len(scores)} posts) differ in length")
    seqs = []
    for i, s in enumerate(sequences):
        if isinstance(s, Tensor):
            s = s.tolist()
        if isinstance(s, (str, bytes)) or not isinstance(s, (Sequence, np.ndarray)):
            raise TypeError(f"post {i} must be a sequence of token ids, got {type(s).__name__}")
        if len(s) == 0:
            raise ValueError(f"post {i} is empty: every post needs at least one token")
        seqs.append([int(t) for t in s])
    sc = [_as_scores(s, i, len(t)) for i, (s, t) in enumerate(zip(scores, seqs))]
    N = len(seqs)
    p_full = _predict(predict_fn, seqs)
    rows = np.arange(N)
    yhat = p_full.argmax(axis=1)
    p0 = p_full[rows, yhat]
    parts = [split_tokens(t, hatexplain_top_k(s, k)) for t, s in zip(seqs, sc)]
    only, rest = [p[0] for p in parts], [p[1] for p in parts]
    p_only = _predict(predict_fn, only, p_full.shape[1])
    comp = np.full(N, math.nan)
    idx = np.array([i for i in range(N) if rest[i] or on_empty == "predict"], dtype=np.int64)
    if idx.size:
        p_rest = _predict(predict_fn, [rest[i] for i in idx], p_full.shape[1])
        comp[idx] = p0[idx] - p_rest[np.arange(idx.size), yhat[idx]]
    return {"yhat": yhat, "p_full": p0, "comprehensiveness": comp, "sufficiency": p0 - p_only[rows, yhat],
            "k": np.array([len(o) for o in only], dtype=np.int64),
            "n_empty_without": sum(1 for r in rest if not r)}


def hatexplain_faithfulness(predict_fn: PredictFn, sequences: Sequence[Sequence[int]], scores: Sequence,
                            k: int = HATEXPLAIN_TOP_K, on_empty: str = "nan") -> dict[str, float | int]:
    """HateXplain comprehensiveness and sufficiency (means over posts; comprehensiveness over the
    posts where it is defined, see :func:`hatexplain_faithfulness_scores`). Pass only the hate-speech
    and offensive posts to follow the paper; :func:`hatexplain_protocol` does that for a Batch."""
    s = hatexplain_faithfulness_scores(predict_fn, sequences, scores, k, on_empty)
    c = s["comprehensiveness"]
    ok = ~np.isnan(c)
    return {"comprehensiveness": float(c[ok].mean()) if ok.any() else math.nan,
            "sufficiency": float(s["sufficiency"].mean()),
            "n": int(c.size), "n_comprehensiveness_undefined": int((~ok).sum()), "k": k}


def hatexplain_token_f1_per_post(scores: Sequence, rationales: Sequence, k: int = HATEXPLAIN_TOP_K) -> np.ndarray:
    """Token F1 (N,) float64 of each post's top-``k`` tokens (HateXplain's ties) against its
    rationale; NaN for a post without rationale tokens."""
    k = _check_top_k(k)
    sc, rat = _scored_posts(scores, rationales)
    out = np.full(len(sc), math.nan)
    for i, (s, r) in enumerate(zip(sc, rat)):
        if r.any():
            pred = hatexplain_top_k(s, k)
            tp = int(r[pred].sum())
            prec, rec = tp / len(pred), tp / int(r.sum())
            out[i] = 0.0 if tp == 0 else 2 * prec * rec / (prec + rec)
    return out


def _mean_with_policy(x: np.ndarray, empty_value: float, empty_rationale: str) -> float:
    """Mean of per-post ``x`` (NaN: no rationale) by ``empty_rationale`` (checked by the callers)."""
    ok = ~np.isnan(x)
    if not ok.any():
        raise ValueError("no post has a non-empty rationale")
    return float(x[ok].mean()) if empty_rationale == "skip" else float(np.where(ok, x, empty_value).mean())


def hatexplain_token_f1(scores: Sequence, rationales: Sequence, k: int = HATEXPLAIN_TOP_K,
                        empty_rationale: str = "skip") -> float:
    """Mean per-post token F1 of the top-``k`` tokens (ERASER's ``instance_macro``). Posts without
    rationale tokens are left out (``"skip"``) or score 0 as in ERASER's code (``"eraser"``)."""
    _check_policy(empty_rationale, EMPTY_RATIONALE_POLICIES, "empty_rationale")
    return _mean_with_policy(hatexplain_token_f1_per_post(scores, rationales, k), 0.0, empty_rationale)


def hatexplain_iou_counts(scores: Sequence, rationales: Sequence, k: int = HATEXPLAIN_TOP_K,
                          threshold: float = 0.5) -> np.ndarray:
    """(N, 3) int per post: ``[matched predicted spans, predicted spans, rationale spans]``.
    Each of the top-``k`` tokens is its own single-token span; the rationale spans are the maximal
    runs of rationale tokens. A predicted span matches when its best IOU with a rationale span is
    ``>= threshold``: a token inside a rationale span of length ``L`` has IOU ``1/L``."""
    k = _check_top_k(k)
    _check_threshold(threshold)
    sc, rat = _scored_posts(scores, rationales)
    out = np.zeros((len(sc), 3), dtype=np.int64)
    for i, (s, r) in enumerate(zip(sc, rat)):
        gold = _runs(r)
        pred = [(p, p + 1) for p in hatexplain_top_k(s, k)]
        tp = sum(int(max((_iou(p, g) for g in gold), default=0.0) >= threshold) for p in pred)
        out[i] = (tp, len(pred), len(gold))
    return out


def hatexplain_iou_f1(scores: Sequence, rationales: Sequence, k: int = HATEXPLAIN_TOP_K, threshold: float = 0.5,
                      empty_rationale: str = "skip") -> float:
    """IOU-F1 of single-token predicted spans, macro-averaged as ERASER's ``partial_match_score``:
    precision = mean of matched/predicted over posts with predictions, recall = mean of
    matched/rationale spans over posts with rationale spans (it can exceed 1 when two tokens match
    the same 2-token span), F1 = their harmonic mean. ``"skip"`` leaves out posts without rationale;
    ``"eraser"`` keeps them in the precision mean, as ERASER's code does."""
    _check_policy(empty_rationale, EMPTY_RATIONALE_POLICIES, "empty_rationale")
    c = hatexplain_iou_counts(scores, rationales, k, threshold)
    has_gold = c[:, 2] > 0
    if not has_gold.any():
        raise ValueError("no post has a non-empty rationale")
    if empty_rationale == "skip":
        c = c[has_gold]
    p = float(np.mean(c[:, 0] / c[:, 1]))  # every post has >= 1 predicted span
    g = c[c[:, 2] > 0]
    r = float(np.mean(g[:, 0] / g[:, 2]))
    return 0.0 if p == 0 or r == 0 else 2 * p * r / (p + r)


def auprc_trapezoid(scores: Sequence[float] | np.ndarray | Tensor, rationale: Sequence[bool] | np.ndarray) -> float:
    """Area under one post's precision-recall curve by the trapezoid rule, as
    ``sklearn.metrics.auc(recall, precision)`` on ``precision_recall_curve``: one point per distinct
    score (tied tokens enter together) plus the end point (recall 0, precision 1), joined
    linearly. NaN for a post without rationale tokens."""
    s = _as_scores(scores, 0)
    y = _as_rationale(rationale, 0, s.size)
    n_pos = int(y.sum())
    if s.size == 0 or n_pos == 0:
        return math.nan
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order].astype(np.float64)
    tp = np.cumsum(y)
    seen = np.arange(1, s.size + 1, dtype=np.float64)
    end = np.r_[s[1:] != s[:-1], True]  # last token of each group of tied scores
    prec = np.r_[1.0, tp[end] / seen[end]]
    rec = np.r_[0.0, tp[end] / n_pos]
    return float(np.sum(np.diff(rec) * (prec[1:] + prec[:-1]) / 2))


def hatexplain_auprc(scores: Sequence, rationales: Sequence, empty_rationale: str = "skip") -> float:
    """Mean over posts of :func:`auprc_trapezoid` (ERASER's ``token_soft_metrics.auprc``, which
    HateXplain reports). ``"skip"`` leaves out posts without rationale; ``"eraser"`` counts them as
    0.5, what ERASER's code gives with the scikit-learn pinned here: recall 1 at every threshold and
    precision 0, a trapezoid from (0, 1) to (1, 0) (tests/test_faithfulness.py checks this; older
    versions divided by zero)."""
    _check_policy(empty_rationale, EMPTY_RATIONALE_POLICIES, "empty_rationale")
    sc, rat = _scored_posts(scores, rationales)
    return _mean_with_policy(np.array([auprc_trapezoid(s, r) for s, r in zip(sc, rat)]), 0.5, empty_rationale)



# --- the protocol on our Batch format ---------------------------------------------------------
@dataclass(frozen=True)
class Posts:
    """A :class:`Batch` as plain posts: ``sequences[i]`` the token ids of post i's words (the key
    columns before the query, in order), ``scores[i]`` the attention on them (or None),
    ``rationales[i]`` bool per word, ``y`` (N,) labels; ``query_token``, ``query_is_key`` and
    ``length`` (the padded width T) rebuild model inputs."""

    sequences: list[list[int]]
    scores: list[np.ndarray] | None
    rationales: list[np.ndarray]
    y: np.ndarray
    query_token: int
    query_is_key: bool
    length: int


def batch_posts(batch: Batch, attn: Tensor | None = None) -> Posts:
    """Split a left-padded :class:`Batch` (query in the last column) into :class:`Posts`. All
    posts must share one query token and one ``query_is_key`` setting, and have at least one word."""
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a qkov_lib.data.batch.Batch, got {type(batch).__name__}")
    km = batch.key_mask
    if km.dtype != torch.bool or batch.relevant.dtype != torch.bool:
        raise TypeError("batch.key_mask and batch.relevant must be bool tensors")
    if len(batch) == 0:
        raise ValueError("empty batch: no post")
    if attn is not None:
        attn = attn.to(km.device)
        _check_masks(attn, km)
    queries = torch.unique(batch.tokens[:, -1])
    if queries.numel() != 1:
        raise ValueError(f"all posts must share one query token in the last column, got {queries.tolist()}")
    qk = km[:, -1]
    if bool(qk.any()) and not bool(qk.all()):
        raise ValueError("key_mask marks the query as a key in some posts only")
    words = km[:, :-1]
    if bool((batch.relevant[:, :-1] & ~words).any()) or bool(batch.relevant[:, -1].any()):
        raise ValueError("batch.relevant marks positions that are not the post's words")
    empty = (~words.any(dim=1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"{empty.numel()} post(s) have no word, e.g. post {int(empty[0])}")
    seqs, sc, rat = [], [] if attn is not None else None, []
    for i in range(len(batch)):
        cols = words[i].nonzero().flatten()
        seqs.append(batch.tokens[i, cols].tolist())
        rat.append(batch.relevant[i, cols].cpu().numpy().astype(bool))
        if sc is not None:
            sc.append(attn[i, cols].detach().cpu().double().numpy())
    return Posts(seqs, sc, rat, batch.y.cpu().numpy(), int(queries[0]), bool(qk.all()), int(km.shape[1]))


def model_predict_fn(model: nn.Module, query_token: int, length: int, query_is_key: bool = False,
                     chunk_size: int = 512) -> Callable[[Sequence[Sequence[int]]], np.ndarray]:
    """A ``predict_fn`` for a model called as ``model(tokens, key_mask) -> (logits, attn)``: each
    post is left-padded to ``length`` with the query token last (a key only when
    ``query_is_key``); returns softmax probabilities (n, C) float64. Eval mode, no grad, chunks of
    ``chunk_size`` posts; the model's training mode is restored."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an int >= 2 (words plus the query), got {length!r}")
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")

    def predict(seqs: Sequence[Sequence[int]]) -> np.ndarray:
        seqs = [[int(t) for t in s] for s in seqs]
        if not query_is_key and any(not s for s in seqs):
            raise ValueError("an empty post has no key for this model (the query is not a key); "
                             "use on_empty='nan'")
        out = []
        was_training = model.training
        model.eval()
        try:
            for lo in range(0, len(seqs), chunk_size):
                tokens, real = left_pad([s + [query_token] for s in seqs[lo:lo + chunk_size]], PAD_ID, length)
                km = real.clone()
                if not query_is_key:
                    km[:, -1] = False
                out.append(_probs(model, tokens.to(device), km.to(device)).cpu())
        finally:
            model.train(was_training)
        return torch.cat(out).numpy() if out else np.zeros((0, 0))

    return predict


def hatexplain_protocol(model: nn.Module, batch: Batch, attn: Tensor, k: int = HATEXPLAIN_TOP_K,
                        normal_class: int = HATEXPLAIN_NORMAL, threshold: float = 0.5,
                        empty_rationale: str = "skip", on_empty: str = "nan",
                        chunk_size: int = 512) -> dict[str, float | int]:
    """HateXplain's explainability columns for ``model`` on ``batch`` with importance ``attn`` (N, T):
    comprehensiveness and sufficiency (top-``k`` deleted / kept), token-F1, IOU-F1 and AUPRC, all on the
    posts whose label is not ``normal_class`` (hate speech and offensive). Also ``n_evaluated``,
    ``n_normal_excluded``, ``n_empty_rationale`` (see ``empty_rationale``) and ``n_comprehensiveness_undefined``."""

    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a qkov_lib.data.batch.Batch, got {type(batch).__name__}")
    if not isinstance(attn, Tensor) or attn.shape != batch.key_mask.shape:
        raise ValueError(f"attn must be a tensor of the batch's shape {tuple(batch.key_mask.shape)}")
    _check_policy(empty_rationale, EMPTY_RATIONALE_POLICIES, "empty_rationale")
    keep = (batch.y != normal_class).nonzero().flatten()
    if keep.numel() == 0:
        raise ValueError(f"no hate-speech or offensive post: every label equals normal_class={normal_class}")
    posts = batch_posts(batch.index(keep), attn.to(batch.key_mask.device)[keep])
    predict = model_predict_fn(model, posts.query_token, posts.length, posts.query_is_key, chunk_size)
    faith = hatexplain_faithfulness(predict, posts.sequences, posts.scores, k, on_empty)
    return {"comprehensiveness": faith["comprehensiveness"], "sufficiency": faith["sufficiency"],
            "token_f1": hatexplain_token_f1(posts.scores, posts.rationales, k, empty_rationale),
            "iou_f1": hatexplain_iou_f1(posts.scores, posts.rationales, k, threshold, empty_rationale),
            "auprc": hatexplain_auprc(posts.scores, posts.rationales, empty_rationale), "k": k,
            "n_evaluated": len(posts.sequences), "n_normal_excluded": len(batch) - len(posts.sequences),
            "n_empty_rationale": sum(1 for r in posts.rationales if not r.any()),
            "n_comprehensiveness_undefined": faith["n_comprehensiveness_undefined"]}

