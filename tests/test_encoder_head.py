"""HateXplain analysis helpers (qkov_lib.studies.rationales): rationale roles and the word
table by hand, clear errors, HateXplain's own protocol per ratio, and the official validation
split the HateXplain map stops on (real data)."""

from __future__ import annotations

import pytest
import torch

from qkov_lib.data import sources
from qkov_lib.data.batch import Batch, left_pad
from qkov_lib.data.hatexplain import pad_to
from qkov_lib.studies import rationales as hm

V, C = 20, 3


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


def test_bad_input_errors():
    b = batch(SEQS)
    with pytest.raises(ValueError, match="shape"):
        hm.most_attended_words(torch.zeros(2, 2), b, ["w"] * V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hm.most_attended_words(torch.zeros_like(b.tokens, dtype=torch.float), b, ["w"] * 5)
    with pytest.raises(ValueError, match="by must be"):
        hm.most_attended_words(torch.zeros_like(b.tokens, dtype=torch.float), b, ["w"] * V, by="max")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        hm.most_attended_words(torch.zeros_like(b.tokens, dtype=torch.float), b, ["w"] * V, k=0)
    with pytest.raises(ValueError, match="no post"):
        hm.role_table(torch.zeros_like(b.tokens, dtype=torch.float), b)
    with pytest.raises(ValueError, match="shape"):
        hm.role_table(torch.zeros(2, 2), b)
    with pytest.raises(ValueError, match="pad a batch"):
        pad_to(b, 2)


@pytest.mark.skipif(sources.find_data_dir()[0] is None, reason=sources.find_data_dir()[1])
def test_validation_split_on_real_data():
    """The official validation split, padded to the longer of train/test/val, keeps the training
    posts and test labels of the plain loader; uniform attention's role masses add up to 1."""
    from qkov_lib import faithfulness
    from qkov_lib.data import hatexplain

    kw = dict(max_len=64, min_freq=2, n_train=300, n_test=100)
    ds, val = hatexplain.load_with_val(n_val=100, **kw)
    plain = hatexplain.load(**kw)
    T0 = plain.max_len
    assert ds.max_len == val.tokens.shape[1] >= T0 and len(val) == 100 == ds.report["val_used"]
    assert torch.equal(ds.train.tokens[:, -T0:], plain.train.tokens) and torch.equal(ds.test.y, plain.test.y)
    assert not val.relevant[val.y == hatexplain.NORMAL].any() and val.relevant.any()
    assert (val.tokens[:, -1] == 2).all()  # the query closes every validation post too
    t = hm.role_table(faithfulness.uniform_attention(ds.test.key_mask), ds.test)
    assert t["rationale"] + t["other words"] == pytest.approx(1.0)
    assert t["rationale"] == pytest.approx(t["uniform rationale"], rel=1e-6)  # uniform attention: the key share


def test_protocol_rows_average_seeds_per_ratio_and_need_models():
    from types import SimpleNamespace

    from qkov_lib.protocol import synthetic_demo
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
