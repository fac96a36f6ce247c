"""SQuAD castings (qkov_lib.experiments.squad_casting) and the SQuAD data fields they use
(qkov_lib.data.squad: context/question masks, the match feature, rare-word buckets, token roles):
shapes, the copy readout by hand, left-padding invariance, the match feature and role masks on
hand-made rows, the optimizer groups of the analysed head, a stack of two equal to each model
alone, determinism under a seed, and clear errors on bad input."""

import gzip
import json

import pytest
import torch

from qkov_lib import metrics
from qkov_lib.data import squad
from qkov_lib.data.batch import Batch
from qkov_lib.data.text import load_text_dataset
from qkov_lib.experiments import squad_casting as sc
from qkov_lib.models import PARAMETERIZATIONS, param_groups
from qkov_lib.stacked import ModelStack
from qkov_lib.training import TrainConfig, train

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


def model(casting="match+conv", parameterization="CACO", T=16, seed=0, **kw):
    torch.manual_seed(seed)
    return sc.SquadHeadModel(V, 8, T, T, SEP, ignore=IGNORE, generator=torch.Generator().manual_seed(seed),
                             parameterization=parameterization, init_scale=0.5, **{**sc.CASTINGS[casting], **kw})


# --- data fields ------------------------------------------------------------------------------
def test_masks_and_match_feature_by_hand():
    t = torch.tensor([ROW])
    ctx = squad.context_mask(t, SEP)[0].nonzero().flatten().tolist()
    q = squad.question_mask(t, SEP)[0].nonzero().flatten().tolist()
    assert q == [2, 3, 4, 5] and ctx == [7, 8, 9, 10, 11, 12]
    # context words 6 (pos 7), 5 (pos 9), 7 (pos 11) occur in the question; 4 is ignored, 8 and 9 do not occur
    assert squad.question_match(t, SEP, IGNORE)[0].nonzero().flatten().tolist() == [7, 9, 11]
    assert squad.question_match(t, SEP)[0].nonzero().flatten().tolist() == [7, 9, 11, 12]  # nothing ignored


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


# --- the model --------------------------------------------------------------------------------
@pytest.mark.parametrize("casting", list(sc.CASTINGS))
def test_forward_shapes_and_copy_readout(casting):
    b = tiny_batch()
    m = model(casting)
    with torch.no_grad():
        logits, attn = m(b.tokens, b.key_mask)
        h = m.keys(b.tokens)
        out = torch.einsum("bt,btd->bd", attn, h) @ m.attention.W_OV.T
        # tied: each candidate's own vector; position: its position embedding (counted back from the query)
        r = h if m.readout == "tied" else m.pos.weight[torch.arange(13, -1, -1)].expand(2, 14, 8)
    assert logits.shape == (2, 16) and attn.shape == (2, 14)
    assert torch.allclose(attn.sum(1), torch.ones(2)) and not attn[~b.key_mask].any()
    ctx = squad.context_mask(b.tokens, SEP)
    for i in range(2):
        for d in range(16):
            col = 13 - d
            if col >= 0 and ctx[i, col]:
                assert logits[i, d] == pytest.approx(float(r[i, col] @ out[i]), rel=1e-4, abs=1e-5)
            else:
                assert logits[i, d] == -1e4                 # only context words are candidates (exact: the fill value)


@pytest.mark.parametrize("casting", ["wh", "question", "mean+match+conv", "match+conv", "match+conv/position"])
def test_left_padding_does_not_change_the_query_output(casting):
    b = tiny_batch()
    m = model(casting, T=20)
    pad = lambda x, v: torch.cat([torch.full((2, 4), v, dtype=x.dtype), x], 1)  # noqa: E731
    with torch.no_grad():
        l1, a1 = m(b.tokens, b.key_mask)
        l2, a2 = m(pad(b.tokens, 0), pad(b.key_mask, False))
    assert torch.allclose(a2[:, 4:], a1, atol=1e-6) and not a2[:, :4].any()
    assert torch.allclose(l2[:, :14], l1[:, :14], atol=1e-5)  # class d = distance back: the same position


def test_param_groups_put_only_the_head_in_qk_and_ov():
    for p in PARAMETERIZATIONS:
        m = model("match+conv", parameterization=p)
        names = {g["name"]: {n for n, q in m.named_parameters() if any(q is x for x in g["params"])}
                 for g in param_groups(m, 1e-3, ratio=10.0)}
        qk = {"attention.W_Q", "attention.W_K"} if p[:2] == "FA" else {"attention.W_QK"}
        ov = {"attention.W_O", "attention.W_V"} if p[2:] == "FO" else {"attention.W_OV"}
        assert names["qk"] == qk and names["ov"] == ov
        assert names["other"] == {"embed.weight", "pos.weight", "match_vec", "summary", "pool_w", "pool_u",
                                  "conv.weight", "conv.bias"}
    lr = {g["name"]: g["lr"] for g in param_groups(m, 1e-3, ratio=10.0)}
    assert lr == pytest.approx({"qk": 1e-2, "ov": 1e-3, "other": 1e-3})


def test_stack_of_two_equals_each_model_alone():
    b = tiny_batch()
    ms = [model("match+conv", seed=s) for s in (0, 1)]
    with torch.no_grad():
        logits, attn = ModelStack(ms).forward(b.tokens, b.key_mask, shared=True)
        for k, m in enumerate(ms):
            l1, a1 = m(b.tokens, b.key_mask)
            assert torch.allclose(logits[k], l1, atol=1e-5) and torch.allclose(attn[k], a1, atol=1e-6)


def test_training_is_deterministic_under_a_seed():
    b = tiny_batch()
    cfg = TrainConfig(optimizer="adamw", eta_ov=1e-2, steps=5, batch_size=1, n_logs=2, seed=3, progress=False)
    runs = []
    for _ in range(2):
        m = model("match+conv", seed=7)
        train(m, b, cfg)
        runs.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.equal(runs[0], runs[1])  # exact: the same code on the same seeds twice
    assert not torch.equal(runs[0], torch.cat([p.detach().flatten() for p in model("match+conv", seed=7).parameters()]))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="query must be"):
        model("wh", query="last")
    with pytest.raises(ValueError, match="encoder must be"):
        model("wh", encoder="lstm")
    with pytest.raises(ValueError, match="readout must be"):
        model("wh", readout="attention")
    with pytest.raises(ValueError, match="window"):
        model("wh", window=4)
    with pytest.raises(ValueError, match="sep_id"):
        sc.SquadHeadModel(V, 8, 16, 16, V)
    with pytest.raises(ValueError, match="ignore"):
        sc.SquadHeadModel(V, 8, 16, 16, SEP, ignore=torch.zeros(3, dtype=torch.bool))
    m, b = model("wh"), tiny_batch()
    with pytest.raises(ValueError, match="key_mask"):
        m(b.tokens, b.key_mask[:, 1:])
    with pytest.raises(ValueError, match="exceeds max_len"):
        model("wh", T=10)(b.tokens, b.key_mask)


# --- loader options on a fixture file -----------------------------------------------------------
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


def test_loader_context_keys_buckets_and_a_casting_run(tmp_path):
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
    cfg = {**sc.PROFILES["test"], "steps": 3, "threads": 1}
    res = sc.run_casting(ds, cfg)
    assert res["n_dev"] == 3 and 0.0 <= res["dev_accuracy"] <= 1.0 and res["dev_accuracy_all_read"] <= res["dev_accuracy"]
    with pytest.raises(ValueError, match="keys must be"):
        load_text_dataset("squad", tmp_path, max_len=24, verify=False, keys="question")
    with pytest.raises(ValueError, match="oov_buckets"):
        load_text_dataset("squad", tmp_path, max_len=24, verify=False, oov_buckets=-1)
    with pytest.raises(ValueError, match="unknown casting"):
        sc.make_model(ds, {**cfg, "casting": "bert"})
