import math

import pytest
import torch

from qkov_lib.models import (PARAMETERIZATIONS, QKOVAttention, SyntheticModel, TokenModel,
                             balanced_factors, named_groups, param_groups, parse_parameterization)

D, C, T = 3, 2, 4


def _tiny_x():
    # 1 sequence of 4 tokens in R^3; the last one is the query
    x = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    return x, mask


def _by_hand(x, mask, W_QK, W_OV):
    """Scalar loops, no einsum: score_i = x_i^T W_QK x_q, softmax over unmasked keys."""
    xs, q = x[0], x[0, -1]
    scores = []
    for i in range(T):
        s = sum(xs[i, a] * W_QK[a, b] * q[b] for a in range(D) for b in range(D))
        scores.append(float(s))
    ex = [math.exp(s) if mask[0, i] else 0.0 for i, s in enumerate(scores)]
    Z = sum(ex)
    alpha = [e / Z for e in ex]
    ctx = [sum(alpha[i] * float(xs[i, a]) for i in range(T)) for a in range(D)]
    logits = [sum(float(W_OV[c, a]) * ctx[a] for a in range(D)) for c in range(C)]
    return torch.tensor(logits, dtype=torch.float64), torch.tensor(alpha, dtype=torch.float64)


@pytest.mark.parametrize("name", PARAMETERIZATIONS)
def test_forward_matches_hand_computation(name):
    g = torch.Generator().manual_seed(1)
    m = QKOVAttention(D, C, name, init_scale=0.7, generator=g, dtype=torch.float64, balanced=False)
    x, mask = _tiny_x()
    logits, attn = m(x, mask)
    W_QK, W_OV = m.effective()
    want_logits, want_attn = _by_hand(x, mask, W_QK.detach(), W_OV.detach())
    torch.testing.assert_close(attn[0], want_attn)
    torch.testing.assert_close(logits[0], want_logits)
    assert attn[0, -1] == 0.0  # masked key gets exactly zero


def test_factorized_equals_collapsed_with_same_effective_matrices():
    g = torch.Generator().manual_seed(0)
    W_QK = torch.randn(D, D, generator=g, dtype=torch.float64)
    W_OV = torch.randn(C, D, generator=g, dtype=torch.float64)
    x = torch.randn(5, T, D, generator=g, dtype=torch.float64)
    mask = torch.ones(5, T, dtype=torch.bool)
    outs = []
    for name in PARAMETERIZATIONS:
        m = QKOVAttention(D, C, name, dtype=torch.float64)
        m.set_effective(W_QK, W_OV)
        torch.testing.assert_close(m.W_QK_eff(), W_QK)
        torch.testing.assert_close(m.W_OV_eff(), W_OV)
        outs.append(m(x, mask))
    for logits, attn in outs[1:]:
        torch.testing.assert_close(logits, outs[0][0])
        torch.testing.assert_close(attn, outs[0][1])


def test_balanced_factors_are_balanced_and_exact():
    M = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    A, B = balanced_factors(M, 5)
    torch.testing.assert_close(A @ B, M)
    torch.testing.assert_close(A.T @ A, B @ B.T)
    with pytest.raises(ValueError, match="rank"):
        balanced_factors(M, 2)


@pytest.mark.parametrize("name", ["FAFO", "CAFO", "FACO"])
def test_balanced_init_has_zero_conserved_quantities(name):
    m = QKOVAttention(5, 3, name, init_scale=0.3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for v in m.conserved().values():
        assert v.abs().max() < 1e-10


def test_unknown_parameterization_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown parameterization 'FOFA'.*FAFO"):
        QKOVAttention(3, 2, "FOFA")
    assert parse_parameterization("fafo").name == "FAFO"


def test_param_groups_hold_exactly_the_right_tensors():
    E = torch.eye(4)
    expect = {"FAFO": ({"W_Q", "W_K"}, {"W_O", "W_V"}), "CAFO": ({"W_QK"}, {"W_O", "W_V"}),
              "FACO": ({"W_Q", "W_K"}, {"W_OV"}), "CACO": ({"W_QK"}, {"W_OV"})}
    for name, (qk, ov) in expect.items():
        groups = named_groups(SyntheticModel(E, 2, parameterization=name))
        assert {n.split(".")[-1] for n in groups["qk"]} == qk
        assert {n.split(".")[-1] for n in groups["ov"]} == ov
        assert groups["other"] == []  # fixed embeddings are a buffer, not trained
    tm = TokenModel(10, 4, 2, max_len=6, parameterization="FAFO")
    g = named_groups(tm)
    assert set(g["other"]) == {"embed.weight", "pos.weight"}
    assert len(g["qk"]) == 2 and len(g["ov"]) == 2


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_ratio_scales_the_qk_update(opt):
    """One optimizer step: the QK update under ratio r equals r times the ratio-1 update
    (SGD: linear in lr; AdamW: first step is lr * sign-like, also linear in lr)."""
    torch.manual_seed(0)
    x = torch.randn(8, T, D, dtype=torch.float64)
    mask = torch.ones(8, T, dtype=torch.bool)
    y = torch.randint(C, (8,))
    deltas = {}
    for r in (1.0, 7.0):
        m = QKOVAttention(D, C, "CACO", init_scale=0.5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        before = {k: v.detach().clone() for k, v in m.named_parameters()}
        groups = param_groups(m, eta_ov=0.01, ratio=r)
        optim = torch.optim.SGD(groups) if opt == "sgd" else torch.optim.AdamW(groups, weight_decay=0.0)
        loss = torch.nn.functional.cross_entropy(m(x, mask)[0], y)
        loss.backward()
        optim.step()
        deltas[r] = {k: v.detach() - before[k] for k, v in m.named_parameters()}
    torch.testing.assert_close(deltas[7.0]["W_QK"], 7.0 * deltas[1.0]["W_QK"])
    torch.testing.assert_close(deltas[7.0]["W_OV"], deltas[1.0]["W_OV"])
    assert deltas[1.0]["W_QK"].abs().max() > 0


@pytest.mark.parametrize("bad", [0, -0.1, float("nan"), float("inf"), "0.1"])
def test_non_positive_learning_rate_is_rejected(bad):
    m = QKOVAttention(3, 2)
    with pytest.raises(ValueError, match="eta_ov must be a finite number > 0"):
        param_groups(m, eta_ov=bad)
    with pytest.raises(ValueError, match="ratio"):
        param_groups(m, eta_ov=0.1, ratio=bad)
    with pytest.raises(ValueError, match="not a finite learning rate"):
        param_groups(m, eta_ov=1e300, ratio=1e10)


def test_param_groups_refuses_a_ratio_without_qk_parameters():
    """On a model whose parameters are not named W_QK/W_Q/W_K (here nn.MultiheadAttention) a
    ratio other than 1 would change nothing: refused, or a warning with strict=False."""
    m = torch.nn.Sequential(torch.nn.MultiheadAttention(4, 2), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="qkov_lib.knob.knob_optimizer"):
        param_groups(m, eta_ov=0.1, ratio=10.0)
    with pytest.warns(UserWarning, match="would act on nothing"):
        assert [g["name"] for g in param_groups(m, eta_ov=0.1, ratio=10.0, strict=False)] == ["other"]
    assert [g["lr"] for g in param_groups(m, eta_ov=0.1)] == [0.1]  # ratio 1: no rate is lost


def test_token_model_positions_count_back_from_query():
    tm = TokenModel(10, 4, 2, max_len=6, generator=torch.Generator().manual_seed(0))
    a = torch.tensor([[0, 0, 5, 6, 2]])
    b = torch.tensor([[0, 5, 6, 2]])
    ma, mb = a != 0, b != 0
    la, aa = tm(a, ma)
    lb, ab = tm(b, mb)
    # left padding does not change the result: the same tokens at the same distance from the query
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(aa[:, 1:], ab)
    with pytest.raises(ValueError, match="max_len"):
        tm(torch.zeros(1, 7, dtype=torch.long), torch.ones(1, 7, dtype=torch.bool))


def test_all_masked_row_is_an_error():
    m = QKOVAttention(3, 2)
    with pytest.raises(ValueError, match="at least one attendable key"):
        m(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.bool))
