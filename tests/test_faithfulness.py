"""Tests of qkov_lib.faithfulness: hand-worked ERASER cases, an independent loop implementation
of AOPC, scikit-learn's average precision, derived properties and bad input; then HateXplain's
protocol (hand-worked cases, scikit-learn's precision-recall trapezoid, deletion vs masking) and
the published-numbers table of qkov_lib.published."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import pandas as pd
from sklearn.metrics import auc, average_precision_score, precision_recall_curve

from qkov_lib import published
from qkov_lib.data import hatexplain as hx_data
from qkov_lib.data.batch import Batch
from qkov_lib.faithfulness import (DEFAULT_FRACS, aopc_scores, auprc, average_precision_per_instance,
                                   comprehensiveness, faithfulness, iou_f1, iou_match_counts, n_selected,
                                   plausibility, random_attention, sufficiency, token_f1, topk_mask,
                                   uniform_attention)
from qkov_lib.faithfulness_hatexplain import (DEFINITIONAL_DIFFERENCES, HATEXPLAIN_TOP_K, auprc_trapezoid, batch_posts,
                                             hatexplain_auprc, hatexplain_faithfulness, hatexplain_faithfulness_scores,
                                             hatexplain_iou_counts, hatexplain_iou_f1, hatexplain_protocol,
                                             hatexplain_token_f1, hatexplain_token_f1_per_post, hatexplain_top_k,
                                             model_predict_fn, split_tokens)
from qkov_lib.models import SyntheticModel, TokenModel

F64 = torch.float64


def sig(z: float) -> float:
    """p(class 0) for two classes with logits (z, 0)."""
    return 1 / (1 + math.exp(-z))


def _b(rows):
    return torch.tensor(rows, dtype=torch.bool)


# --- top-k ------------------------------------------------------------------------------------
def test_topk_mask_by_hand_ties_and_rounding():
    # 4 keys (column 4 is the query, not a key, and its 0.9 must be ignored)
    attn = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.9]])
    km = _b([[1, 1, 1, 1, 0]])
    # frac 0.25: ceil(1.0) = 1 key; columns 1 and 2 tie at 0.3, the earlier column wins
    assert topk_mask(attn, km, 0.25).tolist() == [[False, True, False, False, False]]
    # frac 0.5: ceil(2.0) = 2 -> {1, 2}; frac 0.6: ceil(2.4) = 3 -> {1, 2, 3}
    assert topk_mask(attn, km, 0.5).tolist() == [[False, True, True, False, False]]
    assert topk_mask(attn, km, 0.6).tolist() == [[False, True, True, True, False]]
    # frac 0.01: ceil(0.04) = 1 (at least one key); frac 1: all four keys, never the query
    assert topk_mask(attn, km, 0.01).sum() == 1
    assert topk_mask(attn, km, 1.0).tolist() == km.tolist()
    # 0.07 * 100 = 7.000000000000001 in floating point; the rule means 7 keys, not 8
    assert 0.07 * 100 > 7
    km100 = torch.ones(1, 100, dtype=torch.bool)
    assert int(n_selected(km100, 0.07)[0]) == 7
    assert int(topk_mask(torch.rand(1, 100), km100, 0.07).sum()) == 7


def test_topk_mask_tie_break_uniform_selects_first_keys():
    # uniform attention over keys at columns 2..6 of a left-padded row: ties -> the first keys
    km = _b([[0, 0, 1, 1, 1, 1, 1, 0]])
    m = topk_mask(uniform_attention(km), km, 0.4)  # ceil(0.4 * 5) = 2
    assert m.nonzero()[:, 1].tolist() == [2, 3]
    # long rows of ties (an unstable sort reorders these): still the first k keys
    km = torch.ones(3, 500, dtype=torch.bool)
    km[:, :7] = False
    m = topk_mask(uniform_attention(km), km, 0.1)  # ceil(49.3) = 50 keys: columns 7..56
    assert m.sum(1).tolist() == [50] * 3 and bool(m[:, 7:57].all())


def test_topk_mask_counts_match_independent_rule():
    g = torch.Generator().manual_seed(0)
    km = torch.rand(50, 30, generator=g) < 0.6
    km[:, 0] = True
    attn = torch.rand(50, 30, generator=g)
    for frac in (0.01, 0.05, 0.1, 0.2, 0.5, 0.33, 1.0):
        m = topk_mask(attn, km, frac)
        for i in range(50):
            n = int(km[i].sum())
            k = min(n, max(1, math.ceil(Fraction(str(frac)) * n)))  # exact rational arithmetic
            keys = sorted((float(attn[i, t]), -t) for t in range(30) if km[i, t])
            expect = {-t for _, t in keys[-k:]}
            assert set(m[i].nonzero().flatten().tolist()) == expect


# --- baselines --------------------------------------------------------------------------------
def test_uniform_attention_by_hand():
    km = _b([[0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    torch.testing.assert_close(uniform_attention(km), torch.tensor([[0, .25, .25, .25, .25], [.5, .5, 0, 0, 0]]))


def test_random_attention_is_a_seeded_flat_dirichlet_over_keys():
    km = torch.ones(20000, 5, dtype=torch.bool)
    km[:, 0] = False  # 4 keys per row
    a = random_attention(km, torch.Generator().manual_seed(3))
    assert torch.equal(a, random_attention(km, torch.Generator().manual_seed(3)))  # exact: same seed, same code
    assert not torch.equal(a, random_attention(km, torch.Generator().manual_seed(4)))
    assert bool((a[:, 0] == 0).all()) and bool((a[:, 1:] > 0).all())
    torch.testing.assert_close(a.sum(1), torch.ones(20000))
    # Dirichlet(1,1,1,1) marginals are Beta(1, 3): mean 1/4, variance 3 / (16 * 5) = 0.0375
    # (standard errors: 0.19/sqrt(20000) ~ 0.0014 for the mean, ~0.0004 for the variance)
    assert a[:, 1:].mean(0).sub(0.25).abs().max() < 0.006
    assert a[:, 1:].var(0).sub(0.0375).abs().max() < 0.002


# --- a hand-built model for AOPC ------------------------------------------------------------
# Tokens A=0, B=1, D=2, Q=3 (query), PAD=4 (zero embedding); one-hot in R^4. W_QK = 0, so the
# model attends uniformly to whatever keys are left, and the logits are W_OV * mean(kept keys)
# with W_OV = [[2, 0, 0, 0], [0, 0, 2, 0]]: A pushes class 0 by 2, D pushes class 1 by 2, B nothing.
A, B_, D, Q, PAD = 0, 1, 2, 3, 4


def _hand_model():
    E = torch.cat([torch.eye(4, dtype=F64), torch.zeros(1, 4, dtype=F64)])
    m = SyntheticModel(E, 2, parameterization="CACO", init_scale=0.0, dtype=F64)
    m.attention.set_effective(torch.zeros(4, 4, dtype=F64), torch.tensor([[2., 0, 0, 0], [0, 0, 2, 0]], dtype=F64))
    return m


def _hand_batch():
    tokens = torch.tensor([[A, B_, B_, B_, Q],
                           [PAD, PAD, B_, A, Q],
                           [PAD, PAD, D, B_, Q],
                           [PAD, PAD, PAD, A, Q]])
    km = tokens.ne(PAD) & tokens.ne(Q)
    attn = torch.tensor([[0.7, 0.1, 0.1, 0.1, 0.0],
                         [0.0, 0.0, 0.2, 0.8, 0.0],
                         [0.0, 0.0, 0.3, 0.7, 0.0],
                         [0.0, 0.0, 0.0, 1.0, 0.0]], dtype=F64)
    batch = Batch(tokens, km, torch.zeros_like(km), torch.zeros(4, dtype=torch.long))
    return batch, attn


def test_aopc_by_hand():
    model, (batch, attn) = _hand_model(), _hand_batch()
    fracs = (0.25, 0.5)
    s = aopc_scores(model, batch, attn, fracs)
    # instance 0: keys A,B,B,B (n=4) -> mean (1/4 A) -> logits (0.5, 0): yhat 0, p = sig(0.5).
    #   frac .25: k=1, r={A}: without r = B,B,B -> logits 0 -> 1/2; r only = A -> logits (2,0) -> sig(2)
    #   frac .5 : k=2, r={A, first B} (0.1 ties -> earliest): without = B,B -> 1/2; only A,B -> (1,0) -> sig(1)
    # instance 1: keys B,A (n=2, k=1 for both fracs) -> logits (1,0): yhat 0, p = sig(1); r = {A}
    #   without r = B -> 1/2; r only = A -> sig(2)
    # instance 2: keys D,B -> logits (0,1): yhat 1, p = sig(1); r = {B} (0.7)
    #   without r = D -> logits (0,2) -> p(1) = sig(2); r only = B -> 1/2
    # instance 3: a single key A: k = n = 1, comprehensiveness undefined; r only = full input -> 0
    assert s["yhat"].tolist() == [0, 0, 1, 0]
    assert s["k"].tolist() == [[1, 2], [1, 1], [1, 1], [1, 1]]
    exp_p = torch.tensor([sig(.5), sig(1), sig(1), sig(2)], dtype=F64)
    exp_c = torch.tensor([[sig(.5) - .5, sig(.5) - .5],
                          [sig(1) - .5, sig(1) - .5],
                          [sig(1) - sig(2), sig(1) - sig(2)],
                          [math.nan, math.nan]], dtype=F64)
    exp_s = torch.tensor([[sig(.5) - sig(2), sig(.5) - sig(1)],
                          [sig(1) - sig(2), sig(1) - sig(2)],
                          [sig(1) - .5, sig(1) - .5],
                          [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(s["p_full"], exp_p)
    torch.testing.assert_close(s["comprehensiveness"], exp_c, equal_nan=True)
    torch.testing.assert_close(s["sufficiency"], exp_s)
    # AOPC = mean over fracs
    torch.testing.assert_close(comprehensiveness(model, batch, attn, fracs), exp_c.mean(1), equal_nan=True)
    torch.testing.assert_close(sufficiency(model, batch, attn, fracs), exp_s.mean(1))
    f = faithfulness(model, batch, attn, fracs)
    assert f["n_comprehensiveness_undefined"] == 1 and f["n"] == 4
    assert f["comprehensiveness"] == pytest.approx(float(exp_c[:3].mean()))
    assert f["sufficiency"] == pytest.approx(float(exp_s.mean()))
    assert f["sufficiency_by_frac"] == pytest.approx(exp_s.mean(0).tolist())
    assert f["comprehensiveness_by_frac"] == pytest.approx(exp_c[:3].mean(0).tolist())


def test_frac_one_sufficiency_zero_comprehensiveness_undefined():
    model, (batch, attn) = _hand_model(), _hand_batch()
    s = aopc_scores(model, batch, attn, (1.0,))
    # exact: r = all keys, so "r only" is the same call on the same inputs as the full pass
    assert bool((s["sufficiency"] == 0).all())
    assert bool(torch.isnan(s["comprehensiveness"]).all())
    assert faithfulness(model, batch, attn, (1.0,))["n_comprehensiveness_undefined"] == 4
    # fracs (0.5, 1): frac 1 is undefined everywhere, so each AOPC is its frac-0.5 value
    # (from test_aopc_by_hand): sig(.5) - 1/2, sig(1) - 1/2, sig(1) - sig(2), and NaN for one key
    c = comprehensiveness(model, batch, attn, (0.5, 1.0))
    exp = torch.tensor([sig(.5) - .5, sig(1) - .5, sig(1) - sig(2), math.nan], dtype=F64)
    torch.testing.assert_close(c, exp, equal_nan=True)


def test_model_state_is_restored():
    model, (batch, attn) = _hand_model(), _hand_batch()
    model.train()
    comprehensiveness(model, batch, attn)
    assert model.training


# --- an independent straightforward implementation on a random TokenModel ------------------
def _token_setup(seed=0, N=11, T=9):
    g = torch.Generator().manual_seed(seed)
    model = TokenModel(12, 6, 3, max_len=16, generator=g, parameterization="FAFO", init_scale=1.5, dtype=F64)
    lengths = torch.randint(1, T, (N,), generator=g)  # 1..T-1 keys, so some single-key rows
    lengths[0] = 1
    tokens = torch.randint(1, 12, (N, T), generator=g)
    km = torch.arange(T)[None] >= (T - 1 - lengths)[:, None]
    km[:, -1] = False  # the query is not a key
    tokens[~km] = 0
    tokens[:, -1] = 11
    rel = km & (torch.rand(N, T, generator=g) < 0.4)
    batch = Batch(tokens, km, rel, torch.randint(0, 3, (N,), generator=g))
    return model, batch, g


def _reference_aopc(model, batch, attn, fracs):
    """One instance, one frac at a time; python sorting and exact-rational ceil."""
    comp, suff = [], []
    for i in range(len(batch)):
        tok, km = batch.tokens[i:i + 1], batch.key_mask[i:i + 1]
        keys = [t for t in range(km.shape[1]) if km[0, t]]
        p = torch.softmax(model(tok, km)[0][0], -1)
        yhat = int(torch.argmax(p))
        ci, si = [], []
        for f in fracs:
            k = min(len(keys), max(1, math.ceil(Fraction(str(f)) * len(keys))))
            r = sorted(keys, key=lambda t: (-float(attn[i, t]), t))[:k]
            only = torch.zeros_like(km)
            only[0, r] = True
            without = km & ~only
            si.append(float(p[yhat] - torch.softmax(model(tok, only)[0][0], -1)[yhat]))
            if without.any():
                ci.append(float(p[yhat] - torch.softmax(model(tok, without)[0][0], -1)[yhat]))
        comp.append(sum(ci) / len(ci) if ci else math.nan)
        suff.append(sum(si) / len(si))
    return torch.tensor(comp, dtype=F64), torch.tensor(suff, dtype=F64)


@pytest.mark.parametrize("which", ["model", "random", "uniform"])
def test_aopc_matches_independent_loop(which):
    model, batch, g = _token_setup()
    with torch.no_grad():
        attn = {"model": lambda: model(batch.tokens, batch.key_mask)[1],
                "random": lambda: random_attention(batch.key_mask, g),
                "uniform": lambda: uniform_attention(batch.key_mask)}[which]()
    with torch.no_grad():
        rc, rs = _reference_aopc(model, batch, attn, DEFAULT_FRACS)
    c = comprehensiveness(model, batch, attn, chunk_size=3)  # chunks of 3, 3, 3, 2
    s = sufficiency(model, batch, attn, chunk_size=3)
    torch.testing.assert_close(c, rc, equal_nan=True)
    torch.testing.assert_close(s, rs)
    assert bool(torch.isnan(c[0])) and int(torch.isnan(c).sum()) == int((batch.key_mask.sum(1) == 1).sum())
    assert not bool(torch.isnan(s).any())


def test_aopc_invariances_permutation_chunking_padding():
    model, batch, g = _token_setup(seed=1, N=13)
    attn = random_attention(batch.key_mask, g)
    c, s = comprehensiveness(model, batch, attn), sufficiency(model, batch, attn)
    perm = torch.randperm(len(batch), generator=g)
    torch.testing.assert_close(comprehensiveness(model, batch.index(perm), attn[perm]), c[perm], equal_nan=True)
    torch.testing.assert_close(sufficiency(model, batch.index(perm), attn[perm]), s[perm])
    torch.testing.assert_close(sufficiency(model, batch, attn, chunk_size=1), s)
    # one more left-padding column (not a key): positions are counted back from the query, so
    # nothing changes
    pad = lambda x, v: torch.cat([torch.full((x.shape[0], 1), v, dtype=x.dtype), x], 1)  # noqa: E731
    wide = Batch(pad(batch.tokens, 0), pad(batch.key_mask, False), pad(batch.relevant, False), batch.y)
    torch.testing.assert_close(comprehensiveness(model, wide, pad(attn, 0.0)), c, equal_nan=True)
    torch.testing.assert_close(sufficiency(model, wide, pad(attn, 0.0)), s)


def test_identical_keys_make_every_attention_zero_aopc():
    # no positions and all keys the same token: every kept subset has the same mean embedding,
    # so p(yhat) never changes and both scores are 0 for any attention
    g = torch.Generator().manual_seed(5)
    model = TokenModel(5, 4, 3, max_len=8, positional=False, generator=g, init_scale=2.0, dtype=F64)
    tokens = torch.tensor([[2, 2, 2, 2, 2, 4], [0, 0, 2, 2, 2, 4]])
    km = _b([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0]])
    batch = Batch(tokens, km, km, torch.zeros(2, dtype=torch.long))
    attn = random_attention(km, g)
    assert comprehensiveness(model, batch, attn).abs().max() < 1e-12
    assert sufficiency(model, batch, attn).abs().max() < 1e-12


def test_oracle_vs_uniform_attention_on_the_distinct_token_task():
    # One-hot tokens: commons 0..2, distinct 3 (class 0) and 4 (class 1), query 5. The QK score
    # of a distinct key is 40 (attention on it ~ 1 - 4e-17), the OV margin m = 3. A sequence is
    # three commons then the distinct token, so p(yhat|x) = sig(3).
    # * the model's own (oracle) attention ranks the distinct token first: every "without r"
    #   holds only commons (logits 0, p = 1/2) and every "r only" keeps it, so
    #   comprehensiveness = sig(3) - 1/2 and sufficiency = 0;
    # * uniform attention picks the first k keys (ties -> earliest), commons only for k < 4:
    #   sufficiency = sig(3) - 1/2 and comprehensiveness = 0, the roles swapped.
    E = torch.eye(6, dtype=F64)
    model = SyntheticModel(E, 2, parameterization="FAFO", init_scale=0.0, dtype=F64)
    W_QK = torch.zeros(6, 6, dtype=F64)
    W_QK[3, 5] = W_QK[4, 5] = 40.0
    W_OV = torch.zeros(2, 6, dtype=F64)
    W_OV[0, 3] = W_OV[1, 4] = 3.0
    model.attention.set_effective(W_QK, W_OV)
    tokens = torch.tensor([[0, 1, 2, 3, 5], [2, 2, 0, 4, 5]])
    km = _b([[1, 1, 1, 1, 0]] * 2)
    batch = Batch(tokens, km, km & (tokens >= 3), torch.tensor([0, 1]))
    with torch.no_grad():
        own = model(tokens, km)[1]
    fr = (0.25, 0.5)
    gap = sig(3) - 0.5
    torch.testing.assert_close(comprehensiveness(model, batch, own, fr), torch.full((2,), gap, dtype=F64))
    torch.testing.assert_close(sufficiency(model, batch, own, fr), torch.zeros(2, dtype=F64))
    uni = uniform_attention(km).double()
    torch.testing.assert_close(comprehensiveness(model, batch, uni, fr), torch.zeros(2, dtype=F64))
    torch.testing.assert_close(sufficiency(model, batch, uni, fr), torch.full((2,), gap, dtype=F64))


# --- plausibility -----------------------------------------------------------------------------
def test_token_f1_by_hand():
    attn = torch.tensor([[0.1, 0.4, 0.3, 0.05, 0.15, 0.0],
                         [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
                         [0.5, 0.3, 0.1, 0.05, 0.05, 0.0]])
    km = _b([[1, 1, 1, 1, 1, 0]] * 3)
    rat = _b([[0, 1, 0, 0, 1, 0],     # {1, 4}: top-2 = {1, 2} -> 1 hit -> P = R = F1 = 1/2
              [0, 0, 0, 0, 0, 0],     # empty: skipped
              [1, 1, 1, 0, 0, 0]])    # {0, 1, 2}: top-3 = {0, 1, 2} -> F1 = 1
    assert token_f1(attn, km, rat) == pytest.approx((0.5 + 1.0) / 2)
    # k = 3: instance 0 top-3 = {1, 2, 4} -> P = 2/3, R = 1, F1 = 2*(2/3)/(5/3) = 0.8;
    # instance 2 unchanged (F1 = 1)
    assert token_f1(attn, km, rat, k=3) == pytest.approx((0.8 + 1.0) / 2)
    # k = 1: instance 0 top-1 = {1} -> P = 1, R = 1/2, F1 = 2/3; instance 2 {0} -> P = 1, R = 1/3, F1 = 1/2
    assert token_f1(attn, km, rat, k=1) == pytest.approx((2 / 3 + 1 / 2) / 2)
    p = plausibility(attn, km, rat)
    assert p["n_skipped_empty"] == 1 and p["n_evaluated"] == 2
    assert p["token_f1"] == pytest.approx(0.75)


def test_iou_f1_by_hand():
    # instance 0: keys 0..7, rationale {1,2,3} + {6} -> spans [1,4), [6,7).
    # top-4 by attention = {2, 3, 4, 7} -> spans [2,5), [7,8).
    #   IOU([2,5), [1,4)) = |{2,3}| / |{1,2,3,4}| = 2/4 = 0.5 -> a match at threshold 0.5
    #   IOU([7,8), [6,7)) = 0 -> no match.  P = 1/2 (of 2 predicted), R = 1/2 (of 2 true)
    # instance 1: rationale {0}, top-1 = {0}: P = R = 1.  instance 2: empty rationale, skipped.
    attn = torch.tensor([[0.0, 0.05, 0.2, 0.2, 0.2, 0.05, 0.1, 0.2, 0.0],
                         [0.9, 0.1, 0, 0, 0, 0, 0, 0, 0.0],
                         [0.5, 0.5, 0, 0, 0, 0, 0, 0, 0.0]])
    km = _b([[1] * 8 + [0], [1, 1] + [0] * 7, [1, 1] + [0] * 7])
    rat = _b([[0, 1, 1, 1, 0, 0, 1, 0, 0], [1] + [0] * 8, [0] * 9])
    counts = iou_match_counts(attn, km, rat)
    assert counts.tolist() == [[1, 2, 2], [1, 1, 1], [0, 1, 0]]
    # macro: P = (1/2 + 1)/2 = 3/4, R = 3/4, F1 = 3/4
    assert iou_f1(attn, km, rat) == pytest.approx(0.75)
    # micro: 2 matches of 3 predicted and 3 true spans: P = R = F1 = 2/3
    assert iou_f1(attn, km, rat, average="micro") == pytest.approx(2 / 3)
    # threshold 0.6: instance 0 has no match: macro P = R = (0 + 1)/2 -> F1 = 1/2
    assert iou_f1(attn, km, rat, threshold=0.6) == pytest.approx(0.5)
    # a non-key column breaks a span: keys {0,1,3,4}, top-4 = all -> spans [0,2), [3,5);
    # rationale {0,1} -> IOU 1 and 0 -> P = 1/2, R = 1, F1 = 2/3
    a2 = torch.tensor([[0.25, 0.25, 0.0, 0.25, 0.25, 0.0]])
    km2 = _b([[1, 1, 0, 1, 1, 0]])
    assert iou_f1(a2, km2, _b([[1, 1, 0, 0, 0, 0]]), k=4) == pytest.approx(2 / 3)
    assert plausibility(attn, km, rat)["iou_f1"] == pytest.approx(0.75)


def test_average_precision_by_hand():
    km = _b([[1, 1, 1, 1, 0]] * 3)
    attn = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0],    # labels 1,0,1,0
                         [0.5, 0.5, 0.2, 0.1, 0.0],    # labels 0,1,1,0 with a tie at the top
                         [0.1, 0.2, 0.3, 0.4, 0.0]])   # labels 1,1,1,1
    rat = _b([[1, 0, 1, 0, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    ap = average_precision_per_instance(attn, km, rat)
    # row 0: hits at ranks 1 and 3: AP = 1/2 * 1/1 + 1/2 * 2/3 = 5/6
    # row 1: the tied pair enters together: R 0 -> 1/2 at P = 1/2; then rank 3: R = 1 at P = 2/3
    #        AP = 1/2 * 1/2 + 1/2 * 2/3 = 7/12
    # row 2: every key is in the rationale: AP = 1
    torch.testing.assert_close(ap, torch.tensor([5 / 6, 7 / 12, 1.0], dtype=F64))
    assert auprc(attn, km, rat) == pytest.approx((5 / 6 + 7 / 12 + 1) / 3)


def test_average_precision_matches_sklearn_with_ties():
    g = torch.Generator().manual_seed(7)
    N, T = 60, 25
    km = torch.arange(T)[None] >= torch.randint(0, T - 2, (N,), generator=g)[:, None]
    km[:, -1] = False
    attn = (torch.rand(N, T, generator=g) * 5).round() / 5  # 6 distinct values -> many ties
    rat = km & (torch.rand(N, T, generator=g) < 0.3)
    rat[0] = False  # an empty rationale: skipped
    ours = average_precision_per_instance(attn, km, rat)
    assert bool(torch.isnan(ours[0]))
    ref = []
    for i in range(1, N):
        keys = km[i].numpy()
        y, s = rat[i].numpy()[keys], attn[i].numpy()[keys]
        if y.any():
            assert ours[i].item() == pytest.approx(average_precision_score(y, s), abs=1e-12)
            ref.append(average_precision_score(y, s))
        else:
            assert bool(torch.isnan(ours[i]))
    assert auprc(attn, km, rat) == pytest.approx(np.mean(ref))


def test_uniform_attention_plausibility_properties():
    # all scores tied: AP = precision at the single threshold = |rationale| / n (per instance);
    # top-k with k = |rationale| = the first k keys
    km = _b([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]])
    rat = _b([[0, 1, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]])
    u = uniform_attention(km)
    torch.testing.assert_close(average_precision_per_instance(u, km, rat), torch.tensor([2 / 4, 1 / 5], dtype=F64))
    # instance 0: first 2 keys {1, 2} vs {1, 4}: F1 = 1/2; instance 1: {0} vs {3}: 0
    assert token_f1(u, km, rat) == pytest.approx(0.25)


def test_plausibility_invariant_to_instance_order():
    g = torch.Generator().manual_seed(2)
    km = torch.ones(30, 12, dtype=torch.bool)
    km[:, -1] = False
    attn = random_attention(km, g)
    rat = km & (torch.rand(30, 12, generator=g) < 0.25)
    perm = torch.randperm(30, generator=g)
    a, b = plausibility(attn, km, rat), plausibility(attn[perm], km[perm], rat[perm])
    assert a == pytest.approx(b)


# --- bad input --------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    km = _b([[1, 1, 0]])
    attn = torch.tensor([[0.5, 0.5, 0.0]])
    rat = _b([[1, 0, 0]])
    for frac in (0.0, -0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="frac"):
            topk_mask(attn, km, frac)
    with pytest.raises(ValueError, match="key_mask must have the shape"):
        topk_mask(attn, _b([[1, 1]]), 0.5)
    with pytest.raises(ValueError, match="attn must have shape"):
        topk_mask(torch.tensor([0.5, 0.5]), km, 0.5)
    with pytest.raises(TypeError, match="bool"):
        topk_mask(attn, km.long(), 0.5)
    with pytest.raises(ValueError, match="empty key_mask"):
        topk_mask(attn, _b([[0, 0, 0]]), 0.5)
    with pytest.raises(ValueError, match="empty batch"):
        topk_mask(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), 0.5)
    with pytest.raises(ValueError, match="non-finite"):
        topk_mask(torch.tensor([[float("nan"), 0.5, 0.0]]), km, 0.5)
    with pytest.raises(ValueError, match="rationale must have the shape"):
        token_f1(attn, km, _b([[1, 0]]))
    with pytest.raises(ValueError, match="not attendable keys"):
        auprc(attn, km, _b([[0, 0, 1]]))
    with pytest.raises(ValueError, match="no instance has a non-empty rationale"):
        plausibility(attn, km, _b([[0, 0, 0]]))
    for f in (token_f1, auprc, iou_f1):
        with pytest.raises(ValueError, match="non-empty rationale"):
            f(attn, km, _b([[0, 0, 0]]))
    with pytest.raises(ValueError, match="k must be"):
        token_f1(attn, km, rat, k=0)
    with pytest.raises(ValueError, match="threshold"):
        iou_f1(attn, km, rat, threshold=0.0)
    with pytest.raises(ValueError, match="average"):
        iou_f1(attn, km, rat, average="weighted")
    with pytest.raises(ValueError, match="at least one key"):
        uniform_attention(_b([[0, 0, 0]]))
    with pytest.raises(ValueError, match="at least one key"):
        random_attention(_b([[0, 0, 0]]), torch.Generator().manual_seed(0))
    model, (batch, hattn) = _hand_model(), _hand_batch()
    with pytest.raises(ValueError, match="fracs"):
        comprehensiveness(model, batch, hattn, fracs=())
    with pytest.raises(ValueError, match="frac"):
        sufficiency(model, batch, hattn, fracs=(0.1, 2.0))
    with pytest.raises(ValueError, match="key_mask must have the shape"):
        sufficiency(model, batch, hattn[:, :3])
    with pytest.raises(ValueError, match="chunk_size"):
        sufficiency(model, batch, hattn, chunk_size=0)
    with pytest.raises(TypeError, match="Batch"):
        sufficiency(model, (batch.tokens, batch.key_mask), hattn)


# =============================================================================================
# HateXplain's protocol
# =============================================================================================
def _later_wins_top_k(scores, k):
    """Reference rule: pick the highest score k times, ties to the later position."""
    left, picked = list(range(len(scores))), []
    for _ in range(min(k, len(scores))):
        best = left[0]
        for j in left[1:]:
            if scores[j] >= scores[best]:
                best = j
        picked.append(best)
        left.remove(best)
    return sorted(picked)


def _laplace_predict(seqs):
    """Two classes, p(class 0) = (number of 7s + 1) / (length + 2): exact fractions by hand, 1/2
    on an empty post. It ignores positions."""
    p0 = np.array([(s.count(7) + 1) / (len(s) + 2) for s in seqs])
    return np.stack([p0, 1 - p0], axis=1)


def _first_token_predict(seqs):
    """Two classes, p(class 0) = 0.8 when the FIRST token is 7, else 0.3: reads positions."""
    p0 = np.array([0.8 if s and s[0] == 7 else 0.3 for s in seqs])
    return np.stack([p0, 1 - p0], axis=1)


def test_hatexplain_top_k_by_hand_ties_go_to_the_later_position():
    s = [0.1, 0.3, 0.3, 0.2, 0.3]
    assert hatexplain_top_k(s, 2) == [2, 4]  # three tokens tie at 0.3: the two later ones
    assert hatexplain_top_k(s, 3) == [1, 2, 4]
    assert hatexplain_top_k(s, 4) == [1, 2, 3, 4]
    # our AOPC rule breaks the same tie the other way: ceil(0.4 * 5) = 2 keys, the earlier ones
    assert topk_mask(torch.tensor([s]), torch.ones(1, 5, dtype=torch.bool), 0.4).nonzero()[:, 1].tolist() == [1, 2]
    # uniform scores select the LAST k tokens; k larger than the post selects every token
    assert hatexplain_top_k([0.25] * 8, 5) == [3, 4, 5, 6, 7]
    assert hatexplain_top_k([0.5, 0.1, 0.2], 5) == [0, 1, 2]
    assert HATEXPLAIN_TOP_K == 5 and hatexplain_top_k(list(range(9))) == [4, 5, 6, 7, 8]
    assert hatexplain_top_k(torch.tensor([0.2, 0.9, 0.1]), 1) == [1]


def test_hatexplain_top_k_matches_independent_rule():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, k = int(rng.integers(1, 15)), int(rng.integers(1, 8))
        s = rng.integers(0, 4, n) / 4  # four distinct values: many ties
        assert hatexplain_top_k(s, k) == _later_wins_top_k(s.tolist(), k)


def test_split_tokens_keeps_and_deletes_in_order():
    assert split_tokens([10, 11, 12, 13, 14], [3, 1]) == ([11, 13], [10, 12, 14])
    assert split_tokens([10, 11], [0, 1]) == ([10, 11], [])


def test_hatexplain_faithfulness_by_hand():
    # post A = [7, 1, 7, 2, 3, 4, 5]: p0 = 3/9 = 1/3, so yhat = 1 with p = 2/3. Top-5 by score:
    # positions {0, 2, 3, 5, 6} (5 and 6 tie at 0.3, both in). r only = [7, 7, 2, 4, 5]: p1 = 4/7;
    # without r = [1, 3]: p1 = 3/4. comprehensiveness = 2/3 - 3/4 = -1/12, sufficiency = 2/3 - 4/7 = 2/21.
    # post B = [7, 9, 7] (3 <= 5 tokens): p0 = 3/5, yhat = 0; r = the whole post: sufficiency 0;
    # without r is empty: undefined by default, 3/5 - 1/2 = 1/10 when the predictor runs on it.
    seqs = [[7, 1, 7, 2, 3, 4, 5], [7, 9, 7]]
    scores = [[0.9, 0.1, 0.8, 0.2, 0.05, 0.3, 0.3], [0.2, 0.2, 0.2]]
    s = hatexplain_faithfulness_scores(_laplace_predict, seqs, scores)
    assert s["yhat"].tolist() == [1, 0] and s["k"].tolist() == [5, 3] and s["n_empty_without"] == 1
    np.testing.assert_allclose(s["p_full"], [2 / 3, 3 / 5])
    np.testing.assert_allclose(s["comprehensiveness"], [-1 / 12, np.nan])
    np.testing.assert_allclose(s["sufficiency"], [2 / 21, 0.0], atol=1e-15)
    f = hatexplain_faithfulness(_laplace_predict, seqs, scores)
    assert f["comprehensiveness"] == pytest.approx(-1 / 12) and f["sufficiency"] == pytest.approx(1 / 21)
    assert f["n_comprehensiveness_undefined"] == 1 and f["n"] == 2 and f["k"] == 5
    g = hatexplain_faithfulness(_laplace_predict, seqs, scores, on_empty="predict")
    assert g["comprehensiveness"] == pytest.approx((-1 / 12 + 1 / 10) / 2) and g["n_comprehensiveness_undefined"] == 0
    # k = 1 on post A: r = {0}; only [7]: p1 = 1/3; without [1, 7, 2, 3, 4, 5]: p0 = 2/8, p1 = 3/4
    s1 = hatexplain_faithfulness_scores(_laplace_predict, seqs[:1], scores[:1], k=1)
    np.testing.assert_allclose(s1["sufficiency"], [2 / 3 - 1 / 3])
    np.testing.assert_allclose(s1["comprehensiveness"], [2 / 3 - 3 / 4])
    # a predict_fn returning a torch tensor is accepted
    t = hatexplain_faithfulness(lambda q: torch.from_numpy(_laplace_predict(q)), seqs, scores)
    assert t == f  # exact: the same numbers, only the container differs


def test_hatexplain_deletion_shifts_positions():
    # [1, 7, 2] reads as class 1 (p1 = 0.7). Deleting the top token (position 0) moves the 7 to the
    # front, so "without r" reads as class 0 (p1 = 0.2): comprehensiveness 0.5. Masking would
    # leave the 7 at position 1 and change nothing for this predictor.
    s = hatexplain_faithfulness_scores(_first_token_predict, [[1, 7, 2]], [[0.9, 0.1, 0.2]], k=1)
    assert s["yhat"].tolist() == [1]
    np.testing.assert_allclose(s["comprehensiveness"], [0.5])
    np.testing.assert_allclose(s["sufficiency"], [0.0])  # r only = [1]: p1 = 0.7


def test_hatexplain_token_f1_by_hand():
    scores = [[0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0], [0.1, 0.2, 0.3], [0.3, 0.1]]
    rats = [[1, 0, 0, 0, 0, 0, 1], [0, 1, 0], [False, False]]
    # post 0: top-5 = {0..4} vs {0, 6}: P = 1/5, R = 1/2, F1 = 2/7; post 1: all 3 tokens vs {1}:
    # P = 1/3, R = 1, F1 = 1/2; post 2: no rationale
    np.testing.assert_allclose(hatexplain_token_f1_per_post(scores, rats), [2 / 7, 1 / 2, np.nan])
    assert hatexplain_token_f1(scores, rats) == pytest.approx((2 / 7 + 1 / 2) / 2)
    assert hatexplain_token_f1(scores, rats, empty_rationale="eraser") == pytest.approx((2 / 7 + 1 / 2) / 3)
    # k = 1: post 0 {0}: P = 1, R = 1/2, F1 = 2/3; post 1 {2}: F1 = 0
    assert hatexplain_token_f1(scores, rats, k=1) == pytest.approx(1 / 3)


def test_hatexplain_iou_f1_by_hand():
    # post A: rationale spans [1, 3) (2 tokens) and [5, 8) (3 tokens); top-5 = {0, 1, 2, 5, 6}.
    #   tokens 1, 2: IOU 1/2 with [1, 3) -> match; 5, 6: IOU 1/3 -> no; 0: none. 2 of 5 predicted,
    #   2 matches for 2 rationale spans: P = 2/5, R = 1.
    # post B: span [0, 2); all 3 tokens predicted, tokens 0 and 1 match: P = 2/3, R = 2/1 = 2 (ERASER's
    #   recall counts matched PREDICTED spans, so two tokens in one span give 2).
    # post C: no rationale: 2 predicted spans, none matched.
    scores = [[0.5, 0.9, 0.8, 0.0, 0.1, 0.7, 0.6, 0.2], [0.3, 0.2, 0.1], [0.3, 0.1]]
    rats = [[0, 1, 1, 0, 0, 1, 1, 1], [1, 1, 0], [0, 0]]
    assert hatexplain_iou_counts(scores, rats).tolist() == [[2, 5, 2], [2, 3, 1], [0, 2, 0]]
    # skip: P = (2/5 + 2/3)/2 = 8/15, R = (1 + 2)/2 = 3/2, F1 = 2PR/(P+R) = 48/61
    assert hatexplain_iou_f1(scores, rats) == pytest.approx(48 / 61)
    # eraser: post C joins the precision mean only: P = 16/45, R = 3/2, F1 = 96/167
    assert hatexplain_iou_f1(scores, rats, empty_rationale="eraser") == pytest.approx(96 / 167)
    # threshold 1/3: tokens 5, 6 of post A match too: P = (4/5 + 2/3)/2 = 11/15, R = (2 + 2)/2 = 2;
    # F1 = 44/41 > 1, a consequence of the uncapped recall
    assert hatexplain_iou_f1(scores, rats, threshold=1 / 3) == pytest.approx(44 / 41)
    # k = 1 (top tokens 1, 0, 0): post A matches 1 of its 2 spans (P = 1, R = 1/2), post B P = R = 1;
    # skip: P = 1, R = 3/4
    assert hatexplain_iou_counts(scores, rats, k=1).tolist() == [[1, 1, 2], [1, 1, 1], [0, 1, 0]]
    assert hatexplain_iou_f1(scores, rats, k=1) == pytest.approx(2 * 1 * 0.75 / 1.75)


def _iou_f1_reference(scores, rats, k, thr):
    """ERASER's partial-match F1 from its definition: sets of (post, start, end) spans."""
    tps, npred, ntrue = [], [], []
    for s, r in zip(scores, rats):
        pred = [{p} for p in _later_wins_top_k(list(s), k)]
        true, cur = [], set()
        for j, v in enumerate(list(r) + [0]):
            if v:
                cur.add(j)
            elif cur:
                true.append(cur)
                cur = set()
        tps.append(sum(any(len(p & t) / len(p | t) >= thr for t in true) for p in pred))
        npred.append(len(pred))
        ntrue.append(len(true))
    p = np.mean([a / b for a, b in zip(tps, npred)])
    r = np.mean([a / b for a, b in zip(tps, ntrue) if b])
    return 0.0 if p == 0 or r == 0 else 2 * p * r / (p + r)


def test_hatexplain_iou_f1_matches_independent_reference():
    rng = np.random.default_rng(1)
    for _ in range(40):
        n_posts = int(rng.integers(1, 8))
        scores = [rng.integers(0, 5, int(rng.integers(1, 12))) / 5 for _ in range(n_posts)]
        rats = [rng.random(len(s)) < 0.4 for s in scores]
        rats[0][0] = True  # at least one rationale
        for k, thr in ((5, 0.5), (3, 0.3), (8, 1.0)):
            assert hatexplain_iou_f1(scores, rats, k, thr, "eraser") == pytest.approx(_iou_f1_reference(scores, rats, k, thr))


def test_auprc_trapezoid_by_hand():
    # labels 1,0,1,0 by descending score: points (R, P) = (1/2, 1), (1/2, 1/2), (1, 2/3), (1, 1/2)
    # after (0, 1): area = 1/2 * 1 + 0 + 1/2 * (1/2 + 2/3)/2 + 0 = 19/24 (average precision: 5/6)
    assert auprc_trapezoid([0.4, 0.3, 0.2, 0.1], [1, 0, 1, 0]) == pytest.approx(19 / 24)
    # a tie at the top enters together: (1/2, 1/2), (1, 2/3), (1, 1/2): area 3/8 + 7/24 = 2/3 (AP: 7/12)
    assert auprc_trapezoid([0.5, 0.5, 0.2, 0.1], [0, 1, 1, 0]) == pytest.approx(2 / 3)
    assert auprc_trapezoid([0.1, 0.7, 0.3], [1, 1, 1]) == pytest.approx(1.0)
    assert math.isnan(auprc_trapezoid([0.1, 0.7], [0, 0]))
    scores, rats = [[0.4, 0.3, 0.2, 0.1], [0.5, 0.5, 0.2, 0.1], [0.3, 0.1]], [[1, 0, 1, 0], [0, 1, 1, 0], [0, 0]]
    assert hatexplain_auprc(scores, rats) == pytest.approx((19 / 24 + 2 / 3) / 2)
    assert hatexplain_auprc(scores, rats, empty_rationale="eraser") == pytest.approx((19 / 24 + 2 / 3 + 0.5) / 3)


def test_auprc_trapezoid_matches_sklearn_with_ties():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(1, 20))
        s = rng.integers(0, 4, n) / 4
        y = rng.random(n) < 0.35
        if not y.any():
            y[int(rng.integers(0, n))] = True
        prec, rec, _ = precision_recall_curve(y.astype(int), s)
        assert auprc_trapezoid(s, y) == pytest.approx(auc(rec, prec), abs=1e-12)


def test_eraser_empty_rationale_auprc_is_what_sklearn_gives():
    # ERASER's code keeps a post without rationale; today's scikit-learn sets its recall to 1
    with pytest.warns(UserWarning, match="No positive class"):
        prec, rec, _ = precision_recall_curve([0, 0, 0], [0.5, 0.2, 0.1])
    assert auc(rec, prec) == pytest.approx(0.5)
    assert hatexplain_auprc([[0.2, 0.1], [0.5, 0.2, 0.1]], [[1, 0], [0, 0, 0]], "eraser") == pytest.approx((1 + 0.5) / 2)


def test_definitional_differences_cover_the_known_topics():
    topics = [t for t, _, _ in DEFINITIONAL_DIFFERENCES]
    assert len(set(topics)) == len(topics)
    for t, ours, theirs in DEFINITIONAL_DIFFERENCES:
        assert isinstance(t, str) and t and ours != theirs
        assert all(isinstance(x, str) and len(x) > 20 for x in (ours, theirs))
    joined = " ".join(topics).lower()
    for word in ("rounding", "ties", "removed", "auprc", "annotators", "iou", "token-f1", "posts scored"):
        assert word in joined, word


# --- the protocol on a Batch ------------------------------------------------------------------
def _hx_setup(positional=True, seed=3, N=12, T=10):
    g = torch.Generator().manual_seed(seed)
    model = TokenModel(20, 6, 3, max_len=T, positional=positional, generator=g, parameterization="FAFO",
                       init_scale=1.5, dtype=F64)
    lengths = torch.randint(1, T - 1, (N,), generator=g)
    lengths[0] = 3  # at most 5 words: "without r" is empty
    tokens = torch.randint(3, 20, (N, T), generator=g)
    km = torch.arange(T)[None] >= (T - 1 - lengths)[:, None]
    km[:, -1] = False
    tokens[~km] = 0
    tokens[:, -1] = 2  # the query token
    rel = km & (torch.rand(N, T, generator=g) < 0.4)
    rel[0, -2] = True
    y = torch.randint(0, 3, (N,), generator=g)
    y[0], y[1] = 0, hx_data.NORMAL
    return model, Batch(tokens, km, rel, y)


def test_batch_posts_by_hand():
    tokens = torch.tensor([[0, 0, 5, 6, 7, 2], [0, 8, 9, 10, 11, 2]])
    km = _b([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0]])
    rel = _b([[0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0]])
    attn = torch.tensor([[0, 0, 0.2, 0.5, 0.3, 0], [0, 0.1, 0.2, 0.3, 0.4, 0]], dtype=F64)
    p = batch_posts(Batch(tokens, km, rel, torch.tensor([0, 2])), attn)
    assert p.sequences == [[5, 6, 7], [8, 9, 10, 11]] and p.query_token == 2 and not p.query_is_key
    assert p.length == 6 and p.y.tolist() == [0, 2]
    assert [r.tolist() for r in p.rationales] == [[False, True, False], [True, False, False, True]]
    np.testing.assert_allclose(p.scores[1], [0.1, 0.2, 0.3, 0.4])
    assert batch_posts(Batch(tokens, km, rel, torch.tensor([0, 2]))).scores is None


def test_model_predict_fn_rebuilds_the_batch_inputs():
    model, batch = _hx_setup()
    posts = batch_posts(batch)
    model.train()
    p = model_predict_fn(model, posts.query_token, posts.length, chunk_size=5)(posts.sequences)
    assert model.training  # restored
    with torch.no_grad():
        ref = torch.softmax(model(batch.tokens, batch.key_mask)[0], -1)
    np.testing.assert_allclose(p, ref.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("positional", [False, True])
def test_deleting_equals_masking_only_without_positions(positional):
    # without positional embeddings a post is a bag of attended words, so deleting r and masking
    # r as keys give the same probabilities; with positions (counted back from the query) the
    # deleted words shift the others and the two differ
    g = torch.Generator().manual_seed(4)
    model = TokenModel(20, 6, 3, max_len=10, positional=positional, generator=g, parameterization="FAFO",
                       init_scale=1.5, dtype=F64)
    tokens = torch.tensor([[0, 0, 5, 9, 7, 11, 4, 8, 13, 2]])
    km = _b([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0]])
    batch = Batch(tokens, km, km & (tokens == 7), torch.tensor([0]))
    with torch.no_grad():
        attn = model(tokens, km)[1]
    posts = batch_posts(batch, attn)
    s = hatexplain_faithfulness_scores(model_predict_fn(model, 2, 10), posts.sequences, posts.scores)
    r = torch.zeros_like(km)
    r[0, 2 + torch.tensor(hatexplain_top_k(posts.scores[0]))] = True
    with torch.no_grad():
        p = torch.softmax(model(tokens, km)[0], -1)[0]
        y = int(p.argmax())
        masked_comp = float(p[y] - torch.softmax(model(tokens, km & ~r)[0], -1)[0, y])
        masked_suff = float(p[y] - torch.softmax(model(tokens, r)[0], -1)[0, y])
    gap = max(abs(s["comprehensiveness"][0] - masked_comp), abs(s["sufficiency"][0] - masked_suff))
    assert (gap > 1e-4) if positional else (gap < 1e-12)


def test_hatexplain_protocol_matches_the_list_functions():
    model, batch = _hx_setup()
    with torch.no_grad():
        attn = model(batch.tokens, batch.key_mask)[1]
    out = hatexplain_protocol(model, batch, attn, chunk_size=4)
    keep = torch.tensor([i for i in range(len(batch)) if int(batch.y[i]) != hx_data.NORMAL])
    posts = batch_posts(batch.index(keep), attn[keep])
    pf = model_predict_fn(model, 2, batch.tokens.shape[1])
    f = hatexplain_faithfulness(pf, posts.sequences, posts.scores)
    assert out["comprehensiveness"] == pytest.approx(f["comprehensiveness"])
    assert out["sufficiency"] == pytest.approx(f["sufficiency"])
    assert out["token_f1"] == pytest.approx(hatexplain_token_f1(posts.scores, posts.rationales))
    assert out["iou_f1"] == pytest.approx(hatexplain_iou_f1(posts.scores, posts.rationales))
    assert out["auprc"] == pytest.approx(hatexplain_auprc(posts.scores, posts.rationales))
    assert out["n_evaluated"] == len(keep) and out["n_normal_excluded"] == len(batch) - len(keep) >= 1
    assert out["n_comprehensiveness_undefined"] == sum(len(q) <= 5 for q in posts.sequences) >= 1
    assert out["n_empty_rationale"] == sum(not r.any() for r in posts.rationales)
    # normal posts do not count: changing their attention changes nothing
    a2 = attn.clone()
    a2[batch.y == hx_data.NORMAL] = batch.key_mask[batch.y == hx_data.NORMAL].double()
    # the default chunk size batches the forward passes differently from chunk_size=4, so the
    # float64 sums may round differently: a few ulps (about 1e-16 relative seen), far below 1e-12
    assert hatexplain_protocol(model, batch, a2) == pytest.approx(out, rel=1e-12, abs=1e-15)
    assert hx_data.CLASS_NAMES[hx_data.NORMAL] == "normal"


# --- bad input --------------------------------------------------------------------------------
def test_hatexplain_bad_inputs_raise_clear_errors():
    seqs, scores, rats = [[7, 1, 2]], [[0.3, 0.2, 0.1]], [[1, 0, 0]]
    for k in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="k must be"):
            hatexplain_top_k([0.1, 0.2], k)
    with pytest.raises(ValueError, match="empty"):
        hatexplain_top_k([], 5)
    with pytest.raises(ValueError, match="non-finite"):
        hatexplain_top_k([0.1, float("nan")], 1)
    with pytest.raises(ValueError, match="1-D"):
        hatexplain_top_k([[0.1, 0.2]], 1)
    with pytest.raises(ValueError, match="outside"):
        split_tokens([1, 2], [2])
    with pytest.raises(ValueError, match="distinct"):
        split_tokens([1, 2], [0, 0])
    with pytest.raises(ValueError, match="differ in length"):
        hatexplain_faithfulness(_laplace_predict, seqs * 2, scores)
    with pytest.raises(ValueError, match="3 tokens but 2 scores"):
        hatexplain_faithfulness(_laplace_predict, seqs, [[0.1, 0.2]])
    with pytest.raises(ValueError, match="post 0 is empty"):
        hatexplain_faithfulness(_laplace_predict, [[]], [[]])
    with pytest.raises(ValueError, match="no post"):
        hatexplain_faithfulness(_laplace_predict, [], [])
    with pytest.raises(TypeError, match="sequence"):
        hatexplain_faithfulness(_laplace_predict, "abc", scores)
    with pytest.raises(ValueError, match="on_empty"):
        hatexplain_faithfulness(_laplace_predict, seqs, scores, on_empty="zero")
    with pytest.raises(ValueError, match="shape"):
        hatexplain_faithfulness(lambda q: np.ones((len(q) + 1, 2)) / 2, seqs, scores)
    with pytest.raises(ValueError, match="shape"):
        hatexplain_faithfulness(lambda q: np.ones((len(q), 1)), seqs, scores)
    with pytest.raises(ValueError, match="softmax"):
        hatexplain_faithfulness(lambda q: np.full((len(q), 2), 3.0), seqs, scores)
    with pytest.raises(ValueError, match="differ in length"):
        hatexplain_token_f1(scores, rats * 2)
    with pytest.raises(ValueError, match="one value per token"):
        hatexplain_auprc(scores, [[1, 0]])
    with pytest.raises(ValueError, match="bools or 0/1"):
        hatexplain_iou_f1(scores, [[2, 0, 0]])
    for f in (hatexplain_token_f1, hatexplain_iou_f1, hatexplain_auprc):
        for policy in ("skip", "eraser"):
            with pytest.raises(ValueError, match="non-empty rationale"):
                f(scores, [[0, 0, 0]], empty_rationale=policy)
        with pytest.raises(ValueError, match="empty_rationale"):
            f(scores, rats, empty_rationale="ignore")
    for thr in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="threshold"):
            hatexplain_iou_f1(scores, rats, threshold=thr)
    model, batch = _hx_setup()
    attn = uniform_attention(batch.key_mask)
    with pytest.raises(TypeError, match="Batch"):
        hatexplain_protocol(model, (batch.tokens, batch.key_mask), attn)
    with pytest.raises(ValueError, match="attn must be"):
        hatexplain_protocol(model, batch, attn[:, :3])
    only_normal = Batch(batch.tokens, batch.key_mask, batch.relevant, torch.full_like(batch.y, hx_data.NORMAL))
    with pytest.raises(ValueError, match="no hate-speech or offensive post"):
        hatexplain_protocol(model, only_normal, attn)
    two_queries = batch.tokens.clone()
    two_queries[0, -1] = 3
    with pytest.raises(ValueError, match="one query token"):
        batch_posts(Batch(two_queries, batch.key_mask, batch.relevant, batch.y))
    some_query_keys = batch.key_mask.clone()
    some_query_keys[0, -1] = True
    with pytest.raises(ValueError, match="some posts only"):
        batch_posts(Batch(batch.tokens, some_query_keys, batch.relevant, batch.y))
    with pytest.raises(ValueError, match="empty post has no key"):
        model_predict_fn(model, 2, 10)([[]])
    with pytest.raises(ValueError, match="chunk_size"):
        model_predict_fn(model, 2, 10, chunk_size=0)
    with pytest.raises(ValueError, match="length"):
        model_predict_fn(model, 2, 1)


# =============================================================================================
# qkov_lib.published
# =============================================================================================
def test_published_rows_have_a_source_for_every_value():
    assert [r.model for r in published.HATEXPLAIN_ROWS] == ["CNN-GRU", "BiRNN", "BiRNN-Attn", "BiRNN-HateXplain",
                                                            "BERT", "BERT-HateXplain"]
    for r in published.HATEXPLAIN_ROWS:
        assert set(r.values) == set(published.METRIC_COLUMNS) and r.token_method in ("Attn", "LIME")
        for c, v in r.values.items():
            if v is None:
                assert c not in r.sources
            else:
                assert 0.0 <= v <= 1.0
                assert r.sources[c] and all(k in published.SOURCES for k in r.sources[c])
    for (model, col), (v, src) in published.CONFLICTS.items():
        assert src in published.SOURCES and v != published.anchor(model, col)


def test_published_anchors_and_the_headline():
    a = published.anchor
    assert a("BiRNN-Attn", "accuracy") == 0.621
    assert (a("BiRNN", "accuracy"), a("BiRNN", "macro_f1")) == (0.595, 0.575)
    assert (a("BERT", "accuracy"), a("BERT", "macro_f1")) == (0.690, 0.674)
    # CNN-GRU: the repositories read 0.627 / 0.606; the 62.9 / 61.4 sometimes quoted is HyperAI's reading
    assert (a("CNN-GRU", "accuracy"), a("CNN-GRU", "macro_f1")) == (0.627, 0.606)
    assert published.CONFLICTS[("CNN-GRU", "accuracy")] == (0.629, "hyperai")
    assert published.CONFLICTS[("CNN-GRU", "macro_f1")] == (0.614, "hyperai")
    with pytest.raises(ValueError, match="not found in a stored source"):
        a("BERT", "auprc")
    with pytest.raises(KeyError, match="known"):
        a("GPT-2", "accuracy")
    with pytest.raises(KeyError, match="unknown column"):
        a("BERT", "bleu")
    missing = published.missing()
    assert len(missing) == 6 * len(published.EXPLAINABILITY_COLUMNS)
    assert all(c in published.EXPLAINABILITY_COLUMNS for _, c in missing)
    h = published.SQUAD_AC_HEADLINE
    assert (h.metric, h.before, h.after, h.approximate) == ("AC", 0.12, 0.43, True)
    assert h.source == "Vashisht & Ramaswamy 2026, as summarised"
    assert published.headline_glue() == {"paper_ac_before": "12%", "paper_ac_after": "43%"}


def test_hatexplain_table_places_our_rows_below_the_published_ones():
    t0 = published.hatexplain_table()
    assert list(t0.columns) == list(published.TABLE_COLUMNS) and len(t0) == 6 and t0["ratio"].isna().all()
    by = t0.set_index("model")
    assert by.loc["BERT", "macro_f1"] == 0.674 and math.isnan(by.loc["BERT", "auprc"])
    assert by.loc["BiRNN-Attn", "source"] == "label_audit+lit_review+pwc"
    ours = pd.DataFrame({"ratio": [10, 1], "accuracy": [0.60, 0.61], "comprehensiveness": [-0.05, 0.1]})
    t = published.hatexplain_table(ours)
    assert len(t) == 8 and t["model"].tolist()[6:] == ["ours (ratio 1)", "ours (ratio 10)"]
    assert t.iloc[6]["accuracy"] == 0.61 and t.iloc[7]["comprehensiveness"] == -0.05  # exact: copied through
    assert math.isnan(t.iloc[6]["macro_f1"]) and (t.iloc[6:]["source"] == "this book").all()
    assert t.iloc[6:]["ratio"].tolist() == [1.0, 10.0]
    t2 = published.hatexplain_table(pd.DataFrame({"ratio": [1], "model": ["FAFO, AdamW"], "accuracy": [0.6]}))
    assert t2.iloc[-1]["model"] == "FAFO, AdamW"


def test_hatexplain_table_bad_input():
    with pytest.raises(TypeError, match="DataFrame"):
        published.hatexplain_table([{"ratio": 1}])
    with pytest.raises(ValueError, match="'ratio' column"):
        published.hatexplain_table(pd.DataFrame({"accuracy": [0.6]}))
    with pytest.raises(ValueError, match="one row per ratio"):
        published.hatexplain_table(pd.DataFrame({"ratio": [1, 1], "accuracy": [0.6, 0.7]}))
    with pytest.raises(ValueError, match="unknown columns"):
        published.hatexplain_table(pd.DataFrame({"ratio": [1], "seed": [0]}))
    with pytest.raises(ValueError, match="not percent"):
        published.hatexplain_table(pd.DataFrame({"ratio": [1], "accuracy": [62.1]}))
    with pytest.raises(ValueError, match="comprehensiveness"):
        published.hatexplain_table(pd.DataFrame({"ratio": [1], "comprehensiveness": [1.5]}))
    with pytest.raises(ValueError, match="positive"):
        published.hatexplain_table(pd.DataFrame({"ratio": [0], "accuracy": [0.6]}))
    with pytest.raises(ValueError, match="no row"):
        published.hatexplain_table(pd.DataFrame({"ratio": [], "accuracy": []}))
