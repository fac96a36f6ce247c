"""The HateXplain encoder + one-head model: shapes, padding invariance, groups, roles, word table."""

from __future__ import annotations

import pytest
import torch

from qkov_lib.data.batch import Batch, left_pad
from qkov_lib.data.hatexplain import pad_to
from qkov_lib.experiments import encoder_head as hm
from qkov_lib.models import PARAMETERIZATIONS, named_groups, param_groups
from qkov_lib.data import sources
from qkov_lib.training import TrainConfig, predict, train

V, C = 20, 3


def model(encoder: str = "bigru", parameterization: str = "FAFO", seed: int = 0, **kw) -> hm.EncoderHeadModel:
    cfg = dict(hm.PROFILES["test"], encoder=encoder, parameterization=parameterization, **kw)
    return hm.make_model(V, C, cfg, seed)


def batch(seqs: list[list[int]], length: int | None = None, relevant: list[list[int]] | None = None) -> Batch:
    """Left-padded batch; the last id of each sequence is the query (not a key)."""
    tokens, real = left_pad(seqs, 0, length)
    key_mask = real.clone()
    key_mask[:, -1] = False
    rel = torch.zeros_like(real)
    for i, (s, r) in enumerate(zip(seqs, relevant or [[] for _ in seqs])):
        for p in r:
            rel[i, tokens.shape[1] - len(s) + p] = True
    return Batch(tokens, key_mask, rel, torch.arange(len(seqs)) % C)


SEQS = [[5, 6, 7, 2], [8, 9, 10, 11, 12, 2], [3, 2]]


@pytest.mark.parametrize("encoder", hm.ENCODERS)
@pytest.mark.parametrize("parameterization", PARAMETERIZATIONS)
def test_shapes_and_masked_keys(encoder, parameterization):
    b = batch(SEQS)
    logits, attn = model(encoder, parameterization).eval()(b.tokens, b.key_mask)
    assert logits.shape == (3, C) and attn.shape == b.tokens.shape
    assert torch.allclose(attn.sum(1), torch.ones(3))
    assert (attn[~b.key_mask] == 0).all()


@pytest.mark.parametrize("encoder", hm.ENCODERS)
def test_left_padding_does_not_change_the_query_output(encoder):
    m = model(encoder).eval()
    short, long = batch(SEQS), batch(SEQS, length=11)
    (l1, a1), (l2, a2) = m(short.tokens, short.key_mask), m(long.tokens, long.key_mask)
    assert torch.allclose(l1, l2, atol=1e-5)
    assert torch.allclose(a1, a2[:, -a1.shape[1]:], atol=1e-6)
    assert (a2[:, :-a1.shape[1]] == 0).all()
    # and each row alone equals the row inside the batch (no leakage across rows)
    alone = batch([SEQS[0]])
    assert torch.allclose(m(alone.tokens, alone.key_mask)[0][0], l1[0], atol=1e-5)


def test_bigru_state_at_query_depends_on_the_post():
    m = model("bigru").eval()
    a, b = batch([[5, 6, 2]]), batch([[7, 6, 2]])
    ha, hb = m.encode(a.tokens)[0, -1], m.encode(b.tokens)[0, -1]
    assert not torch.allclose(ha, hb)  # the forward GRU reaches the query through the words


@pytest.mark.parametrize("parameterization", PARAMETERIZATIONS)
def test_param_groups_put_the_head_in_qk_and_ov(parameterization):
    m = model("bigru", parameterization)
    groups = named_groups(m)
    qk = {"FA": {"attention.W_Q", "attention.W_K"}, "CA": {"attention.W_QK"}}[parameterization[:2]]
    ov = {"FO": {"attention.W_O", "attention.W_V"}, "CO": {"attention.W_OV"}}[parameterization[2:]]
    assert set(groups["qk"]) == qk and set(groups["ov"]) == ov
    assert all(not n.startswith("attention.") for n in groups["other"])
    assert {"embed.weight", "fwd.weight_hh_l0", "bwd.weight_ih_l0"} <= set(groups["other"])
    lrs = {g["name"]: g["lr"] for g in param_groups(m, 1e-3, ratio=10.0)}
    assert lrs == {"qk": pytest.approx(1e-2), "ov": 1e-3, "other": 1e-3}


def test_rationale_roles_by_hand():
    b = batch([[5, 6, 7, 2], [8, 9, 2]], relevant=[[1], []])
    # row 0: keys at 0,1,2 (word 6 is rationale); row 1: pad, keys at 1,2
    attn = torch.tensor([[0.2, 0.5, 0.3, 0.0], [0.0, 0.4, 0.6, 0.0]])
    roles = hm.rationale_roles(b)
    assert roles["rationale"].tolist() == [[False, True, False, False], [False] * 4]
    assert roles["other words"].tolist() == [[True, False, True, False], [False, True, True, False]]
    t = hm.role_table(attn, b)  # only row 0 has a rationale
    assert t["rationale"] == pytest.approx(0.5) and t["other words"] == pytest.approx(0.5)
    assert t["uniform rationale"] == pytest.approx(1 / 3) and t["posts"] == 1


def test_most_attended_words_by_hand():
    vocab = [f"w{i}" for i in range(V)]
    b = batch([[5, 6, 5, 2], [6, 7, 2]], relevant=[[0], [0]])
    attn = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.0, 0.8, 0.2, 0.0]])
    df = hm.most_attended_words(attn, b, vocab, k=3)
    # w6: 0.6 + 0.8 over 2 occurrences (one rationale); w5: 0.1 + 0.3 over 2 (one); w7: 0.2, once
    assert list(df.index) == ["w6", "w5", "w7"]
    assert df.loc["w6", "total"] == pytest.approx(1.4) and df.loc["w6", "mean"] == pytest.approx(0.7)
    assert df.loc["w5", "count"] == 2 and df.loc["w5", "in_rationale"] == pytest.approx(0.5)
    assert df.loc["w7", "in_rationale"] == 0.0  # exact: 0 of 1 occurrence
    assert list(hm.most_attended_words(attn, b, vocab, k=1, by="mean").index) == ["w6"]


def test_training_is_deterministic_under_a_seed_and_learns():
    gen = torch.Generator().manual_seed(0)
    seqs = [[int(c) + 3] + torch.randint(6, V, (4,), generator=gen).tolist() + [2] for c in torch.arange(60) % C]
    data = Batch(*batch(seqs).__dict__.values())
    data.y = torch.arange(60) % C  # the class is the first word
    cfg = TrainConfig(optimizer="adamw", eta_ov=3e-2, steps=60, batch_size=16, seed=1, progress=False, n_logs=2)

    def run():
        m = model("bigru", seed=3)
        h = train(m, data, cfg, prepare=hm.trim_padding)
        return m, h

    (m1, h1), (m2, h2) = run(), run()
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), n  # exact: the same code on the same seeds twice
    assert h1.final["accuracy"] > 0.9  # a first-word rule is learnable


def test_dropout_only_in_gradient_passes():
    m = model("conv", dropout=0.5).train()
    b = batch(SEQS)
    with torch.no_grad():
        a1, a2 = m(b.tokens, b.key_mask)[0], m(b.tokens, b.key_mask)[0]
    assert torch.equal(a1, a2)  # exact: no dropout under no_grad, so the same forward twice
    g1, g2 = m(b.tokens, b.key_mask)[0], m(b.tokens, b.key_mask)[0]
    assert not torch.equal(g1, g2)


def test_trim_and_pad_round_trip():
    b = batch(SEQS, length=9)
    t = hm.trim_padding(b)
    assert t.tokens.shape[1] == 6 and torch.equal(pad_to(t, 9).tokens, b.tokens)
    assert torch.equal(pad_to(t, 9).key_mask, b.key_mask)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="unknown encoder"):
        model("lstm")
    with pytest.raises(ValueError, match="even d_model"):
        model("bigru", d_model=15)
    with pytest.raises(ValueError, match="dropout"):
        model("conv", dropout=1.0)
    m, b = model("conv"), batch(SEQS)
    with pytest.raises(ValueError, match="key_mask"):
        m(b.tokens, b.key_mask[:, 1:])
    with pytest.raises(TypeError, match="integer ids"):
        m(b.tokens.float(), b.key_mask)
    with pytest.raises(ValueError, match="shape"):
        hm.most_attended_words(torch.zeros(2, 2), b, ["w"] * V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hm.most_attended_words(torch.zeros_like(b.tokens, dtype=torch.float), b, ["w"] * 5)
    with pytest.raises(ValueError, match="no post"):
        hm.role_table(torch.zeros_like(b.tokens, dtype=torch.float), b)
    with pytest.raises(ValueError, match="pad a batch"):
        pad_to(b, 2)


def test_conv_models_train_stacked_as_they_train_alone():
    from qkov_lib.stacked import train_stacked

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, V, (int(n),), generator=gen).tolist() + [2] for n in torch.randint(1, 6, (24,), generator=gen)]
    data = batch(seqs)
    cfgs = [TrainConfig(optimizer="adamw", eta_ov=1e-2, ratio=r, steps=6, batch_size=8, seed=s, progress=False, n_logs=2)
            for r, s in ((1.0, 0), (10.0, 1))]
    alone = [model("conv", seed=s, dropout=0.0) for s in (0, 1)]
    for m, c in zip(alone, cfgs):
        train(m, data, c)
    stacked = [model("conv", seed=s, dropout=0.0) for s in (0, 1)]
    with pytest.raises(ValueError, match="dropout > 0 cannot be trained in a stack"):
        train_stacked([model("conv", seed=s) for s in (0, 1)], data, cfgs)
    train_stacked(stacked, data, cfgs)
    for a, s in zip(alone, stacked):
        for (n, p), q in zip(a.named_parameters(), s.parameters()):
            assert torch.allclose(p, q, atol=1e-5), n


@pytest.mark.skipif(sources.find_data_dir()[0] is None, reason=sources.find_data_dir()[1])
def test_validation_split_and_test_profile_end_to_end():
    from qkov_lib.data import hatexplain

    cfg = hm.PROFILES["test"]
    kw = dict(max_len=cfg["max_len"], min_freq=cfg["min_freq"], n_train=cfg["n_train"], n_test=cfg["n_test"])
    ds, val = hatexplain.load_with_val(n_val=cfg["n_val"], **kw)
    plain = hatexplain.load(**kw)
    T0 = plain.max_len
    assert ds.max_len == val.tokens.shape[1] >= T0 and len(val) == cfg["n_val"] == ds.report["val_used"]
    assert torch.equal(ds.train.tokens[:, -T0:], plain.train.tokens) and torch.equal(ds.test.y, plain.test.y)
    assert not val.relevant[val.y == hatexplain.NORMAL].any() and val.relevant.any()
    assert (val.tokens[:, -1] == 2).all()  # the query closes every validation post too
    model, hist, row = hm.run_one(ds, val, cfg)
    assert hist.records[-1]["step"] <= cfg["steps"] and "val_loss" in hist.records[-1]
    assert 0.0 <= row["test_accuracy"] <= 1.0 and 0.0 <= row["val_macro_f1"] <= 1.0
    attn, _ = predict(model, ds.test)
    t = hm.role_table(attn, ds.test)
    assert t["rationale"] + t["other words"] == pytest.approx(1.0)


def test_protocol_rows_average_seeds_per_ratio_and_need_models():
    from types import SimpleNamespace

    from qkov_lib.experiments.protocol import synthetic_demo
    from qkov_lib.models import TokenModel

    _, _, test = synthetic_demo(n=120)
    test = Batch(test.tokens, test.key_mask, test.relevant, test.y % 3)  # 3 classes; class 1 = normal
    runs = [SimpleNamespace(ratio=r, seed=s, model=TokenModel(12, 8, 3, 8, generator=torch.Generator().manual_seed(s)))
            for r in (1.0, 10.0) for s in (0, 1)]
    out = hm.protocol_rows(runs, test, 3)
    assert list(out["ratio"]) == [1.0, 10.0]
    assert set(out.columns) == {"ratio", "accuracy", "macro_f1", "iou_f1", "token_f1", "auprc", "comprehensiveness",
                                "sufficiency"}
    assert ((out["accuracy"] >= 0) & (out["accuracy"] <= 1)).all()
    with pytest.raises(ValueError, match="kept no model"):
        hm.protocol_rows([SimpleNamespace(ratio=1.0, seed=0, model=None)], test, 3)
    empty = hm.protocol_rows([], test, 3)  # nothing trained: an empty table with the same columns
    assert empty.empty and list(empty.columns) == list(out.columns)
