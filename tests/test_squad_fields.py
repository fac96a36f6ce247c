"""SQuAD data fields (qkov_lib.data.squad) that the SQuAD map's model and its role analysis use:
context/question masks and the match feature on a hand-made row, the ignore table and rare-word
buckets, token roles and their attention mass by hand, and the loader's context keys and
buckets on a three-question fixture file, with clear errors on bad input."""

import gzip
import json
import warnings

import pytest
import torch

from qkov_lib import metrics
from qkov_lib.data import squad
from qkov_lib.data.batch import Batch
from qkov_lib.data.registry import load_text_dataset

SEP, V = 3, 12
# pad pad | q: 5 6 7 4 | <sep> | context: 6 8 5 9 7 4 | query 2; 4 plays a stopword (ignored)
ROW = [0, 0, 5, 6, 7, 4, SEP, 6, 8, 5, 9, 7, 4, 2]
IGNORE = torch.zeros(V, dtype=torch.bool)
IGNORE[[0, 1, 2, SEP, 4]] = True


def tiny_batch() -> Batch:
    tokens = torch.tensor([ROW, [0, 0, 0, 0, 0, 10, SEP, 11, 9, 8, 10, 6, 5, 2]])
    real = tokens != 0
    key_mask = real.clone()
    key_mask[:, -1] = False
    relevant = torch.zeros_like(real)
    relevant[0, 9:11] = True   # answer "5 9" (5 also occurs in the question)
    relevant[1, 10] = True
    y = torch.tensor([13 - 9, 13 - 10])
    return Batch(tokens, key_mask, relevant, y)



def test_masks_and_match_feature_by_hand():
    t = torch.tensor([ROW])
    ctx = squad.context_mask(t, SEP)[0].nonzero().flatten().tolist()
    q = squad.question_mask(t, SEP)[0].nonzero().flatten().tolist()
    assert q == [2, 3, 4, 5] and ctx == [7, 8, 9, 10, 11, 12]
    # context words 6 (pos 7), 5 (pos 9), 7 (pos 11) occur in the question; 4 is ignored, 8 and 9 do not occur
    assert squad.question_match(t, SEP, IGNORE)[0].nonzero().flatten().tolist() == [7, 9, 11]
    assert squad.question_match(t, SEP)[0].nonzero().flatten().tolist() == [7, 9, 11, 12]  # nothing ignored


def test_question_match_is_the_set_of_question_words_on_random_rows_and_under_vmap():
    """Against its definition, row by row with Python sets: a context word matches when its id is
    the id of a non-ignored question word of the same row (rows with no question, no context, repeated
    words and ids above every question id included), also on a stack of batches under vmap."""
    gen = torch.Generator().manual_seed(0)
    n, T = 200, 16
    tokens = torch.randint(4, V, (n, T), generator=gen)
    for i in range(n):
        q_len, c_len = int(torch.randint(0, 6, (1,), generator=gen)), int(torch.randint(0, 8, (1,), generator=gen))
        pads = T - 2 - q_len - c_len
        tokens[i, :pads] = 0
        tokens[i, pads + q_len] = SEP
        tokens[i, -1] = 2
    for ignore in (None, IGNORE):
        got = squad.question_match(tokens, SEP, ignore)
        for i, row in enumerate(tokens.tolist()):
            cut = row.index(SEP)
            asked = {t for t in row[:cut] if t != 0 and (ignore is None or not ignore[t])}
            want = [cut < j < T - 1 and row[j] in asked for j in range(T)]
            assert got[i].tolist() == want
    with warnings.catch_warnings():  # a column-major view (as a stack's minibatch may be) warns of no copy
        warnings.simplefilter("error")
        assert torch.equal(squad.question_match(tokens.t().contiguous().t(), SEP, IGNORE),
                           squad.question_match(tokens, SEP, IGNORE))
    stack = tokens.view(4, 50, T)
    assert torch.equal(torch.func.vmap(lambda t: squad.question_match(t, SEP, IGNORE))(stack),
                       squad.question_match(tokens, SEP, IGNORE).view(4, 50, T))
    # shared rows and a per-model ignore table (a stack's buffer), as a stacked evaluation calls it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_model = torch.func.vmap(lambda ign: squad.question_match(tokens, SEP, ign))(IGNORE.expand(3, -1))
    assert torch.equal(per_model, squad.question_match(tokens, SEP, IGNORE).expand(3, -1, -1))


def test_ignore_table_and_oov_buckets():
    vocab = ["<pad>", "<unk>", "<query>", "<sep>", "<q:what>", "<oov:0>", "the", "?", "rhine"]
    assert squad.ignore_table(vocab).tolist() == [True, True, True, True, True, False, True, True, False]
    assert squad.oov_token("zyx", 7) == squad.oov_token("zyx", 7)  # stable: CRC-32, not Python's salted hash
    from qkov_lib.data.text import Example
    tr = [Example(["a", "a", "b", squad.SEP, "rare"], [0], 1), Example(["a", "b", "b"], [0], 1)]
    te = [Example(["rare", "new", "a"], [0], 1)]
    buckets = squad.bucket_rare_words(tr, te, min_freq=2, n_buckets=5)
    assert len(buckets) == 5
    assert tr[0].tokens[:4] == ["a", "a", "b", squad.SEP] and tr[0].tokens[4] == squad.oov_token("rare", 5)
    assert te[0].tokens == [squad.oov_token("rare", 5), squad.oov_token("new", 5), "a"]  # same rare word, same id


def test_roles_by_hand_and_mass_by_role():
    b = tiny_batch()
    r = squad.squad_roles(b, sep_id=SEP, ignore=IGNORE)
    on = {k: v[0].nonzero().flatten().tolist() for k, v in r.items()}
    assert on == {"answer": [9, 10], "in_question": [7, 11], "question": [2, 3, 4, 5, 6], "rest": [8, 12]}
    total = sum(v.long() for v in r.values())
    assert torch.equal(total.bool(), b.key_mask) and int(total.max()) == 1       # a partition of the keys
    attn = b.key_mask.double() / b.key_mask.sum(1, keepdim=True)
    m = metrics.mass_by_role(attn, r, b.key_mask)
    assert m["answer"] == pytest.approx((2 / 11 + 1 / 8) / 2)  # 11 and 8 keys
    assert sum(m.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sep_id"):
        squad.squad_roles(b)
    with pytest.raises(ValueError, match="<sep>"):
        squad.squad_roles(b, sep_id=V + 5)
    with pytest.raises(TypeError, match="TextDataset or a Batch"):
        squad.squad_roles(b.tokens, sep_id=SEP)


CTX = "Denver beat Carolina 24 to 10 at Levi's Stadium in Santa Clara."


def _write(root):
    def qa(i, q, a):
        return {"id": i, "question": q, "answers": [{"text": a, "answer_start": CTX.index(a)}]}
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": CTX, "qas": [
        qa("a", "Who did Denver beat?", "Carolina"), qa("b", "Where is Levi's Stadium?", "Santa Clara"),
        qa("c", "How many points did Denver score?", "24")]}]}]}
    for rel in (squad.TRAIN_FILES[0], squad.DEV_FILE):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(root / rel, "wt", encoding="utf-8") as f:
            f.write(json.dumps(data))


def test_loader_context_keys_and_buckets(tmp_path):
    _write(tmp_path)
    ds = load_text_dataset("squad", tmp_path, max_len=24, min_freq=5, verify=False, keys="context", oov_buckets=50)
    sep = ds.vocab.index(squad.SEP)
    assert torch.equal(ds.test.key_mask, squad.context_mask(ds.test.tokens, sep) & (ds.test.tokens != 0))
    # train = the 3 questions, each with the context: "denver" 3 + 2 times -> kept; "stadium" 3 + 1 < min_freq 5
    # -> bucketed, and the bucketed rare word still matches between question b and the context
    assert "denver" in ds.vocab and squad.oov_token("stadium", 50) in ds.decode("test", 1)
    r = squad.squad_roles(ds)
    assert not r["question"].any() and r["answer"].sum() == ds.test.relevant.sum()
    words = ds.decode("test", 1)
    hit = [w for w, on in zip(words, r["in_question"][1][ds.test.tokens[1] != 0]) if on]
    assert squad.oov_token("stadium", 50) in hit and "denver" not in hit  # Denver is not in question b
    old = load_text_dataset("squad", tmp_path, max_len=24, min_freq=5, verify=False)  # defaults unchanged
    assert "<oov:0>" not in old.vocab and old.test.key_mask[:, :-1].sum() > ds.test.key_mask.sum()
    with pytest.raises(ValueError, match="keys must be"):
        load_text_dataset("squad", tmp_path, max_len=24, verify=False, keys="question")
    with pytest.raises(ValueError, match="oov_buckets"):
        load_text_dataset("squad", tmp_path, max_len=24, verify=False, oov_buckets=-1)
