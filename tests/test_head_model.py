"""The analysed-head model of the real-data chapters (qkov_lib.head_model): no path around the
head, token-local values, the SQuAD readout over the paragraph's distinct words worked by hand,
the relative readout, gradients against finite differences, a stack of two equal to two separate
trainings, the optimizer groups, the SQuAD word casting and its drop counts, the necessity check
on a case whose answer is known, the graded intervention from the model's attention to the oracle
(its ends equal the necessity check, a hand-worked curve, a flat curve when the attention already is
the oracle, the per-model frame and its seed means), and clear errors on bad input."""

import math

import pandas as pd
import pytest
import torch
from torch.func import functional_call

from qkov_lib import head_model as hm
from qkov_lib.data.batch import Batch
from qkov_lib.data.text import Example, finish
from qkov_lib.models import PARAMETERIZATIONS, named_groups
from qkov_lib.train import TrainConfig, predict, train, train_stacked

F64 = torch.float64
SEP, V, T = 3, 14, 12
# left-padded "question <sep> context q": ids 5..13 are words, 4 the query token
ROWS = [[0, 5, 6, 7, SEP, 8, 6, 9, 8, 10, 11, 4],
        [0, 0, 12, 5, SEP, 13, 9, 5, 7, 7, 8, 4],
        [0, 0, 0, 10, SEP, 11, 12, 13, 6, 9, 5, 4]]
ENCODERS = [dict(encoder="none"), dict(encoder="conv", layers=2, window=3), dict(encoder="bigru")]


def tiny_batch() -> Batch:
    tokens = torch.tensor(ROWS)
    key_mask = (tokens != 0) & ((tokens == SEP).cumsum(1) > 0) & (tokens != SEP)  # the context words
    key_mask[:, -1] = False
    relevant = torch.zeros_like(key_mask)
    for i, p in enumerate((9, 5, 7)):
        relevant[i, p] = True
    y = T - 1 - torch.tensor([9, 5, 7])  # the answer word's position, counted back from the query
    return Batch(tokens, key_mask, relevant, y)


def model(seed=0, readout="words", **kw) -> hm.HeadModel:
    opts = dict(match=True, query="question", positions=("back", "start"), sep_id=SEP, dtype=F64,
                parameterization="FAFO", init_scale=0.3)
    opts.update(kw)
    n = T if readout == "words" else 3
    return hm.HeadModel(V, 6, n, T, readout=readout, generator=torch.Generator().manual_seed(seed), **opts)


def fixed_row(b: Batch) -> torch.Tensor:
    """A fixed attention row over the keys (not uniform)."""
    w = torch.rand(b.tokens.shape, generator=torch.Generator().manual_seed(7), dtype=F64) * b.key_mask
    return w / w.sum(1, keepdim=True)


# --- no path around the head --------------------------------------------------------------
@pytest.mark.parametrize("enc", ENCODERS, ids=lambda e: e["encoder"])
@pytest.mark.parametrize("readout", ["words", "class"])
def test_no_path_around_the_head(enc, readout):
    """With the attention fixed, what reaches only keys and query -- the question's words, the
    positions, the match vector, the encoder, the question summary, W_QK -- cannot move a logit;
    without it fixed the same change does (so the check can fail)."""
    b, m = tiny_batch(), model(readout=readout, **enc)
    A = fixed_row(b)
    before, before_free = m(b.tokens, b.key_mask, A)[0], m(b.tokens, b.key_mask)[0]
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not (name.startswith("embed") or name.split(".")[-1] in ("W_O", "W_V", "W_OV")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=F64))
    tokens = b.tokens.clone()
    tokens[0, 1:4] = torch.tensor([13, 12, 11])  # a different question, same context
    after, after_free = m(tokens, b.key_mask, A)[0], m(b.tokens, b.key_mask)[0]
    fin = torch.isfinite(before)
    assert torch.equal(fin, torch.isfinite(after))
    assert torch.allclose(before[fin], after[fin], rtol=0, atol=1e-12)  # same float64 products
    assert (before_free[fin] - after_free[fin]).abs().max() > 1e-3


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("readout", ["words", "class"])
def test_logits_are_the_readout_of_the_head_output_by_hand(readout, relative):
    """logits = readout(W_OV sum_i alpha_i v_i) with the model's own attention row, by hand."""
    b, m = tiny_batch(), model(readout=readout, relative=relative, encoder="conv", values="map")
    with torch.no_grad():
        logits, attn = m(b.tokens, b.key_mask)
    e = m.embed(b.tokens)
    v = e + torch.relu(m.value_map(e))
    k = b.key_mask.to(F64)
    w = attn - (k / k.sum(1, keepdim=True) if relative else 0)
    o = torch.einsum("bt,btd->bd", w, v) @ m.head.W_OV_eff().T
    if readout == "class":
        assert torch.allclose(logits, o, atol=1e-12)
    else:
        full = o @ m.embed.weight.T  # (B, V): every word's score
        for i in range(3):
            keys = b.key_mask[i].nonzero()[:, 0].tolist()
            firsts = [p for p in keys if b.tokens[i, p] not in b.tokens[i, [q for q in keys if q < p]]]
            finite = sorted(T - 1 - p for p in firsts)  # one class per distinct word, at its first position
            assert torch.isfinite(logits[i]).nonzero()[:, 0].tolist() == finite
            for p in firsts:
                assert abs(float(logits[i, T - 1 - p] - full[i, b.tokens[i, p]])) < 1e-12


def test_real_lengths_count_from_the_first_real_token():
    from qkov_lib.data.text import real_lengths

    tokens = torch.tensor([[0, 0, 5, 6], [0, 0, 0, 0], [3, 0, 4, 1], [0, 7, 0, 2]])
    assert real_lengths(tokens).tolist() == [2, 1, 4, 3]  # a pad inside a row is kept; padding only: 1
    assert real_lengths(tokens.view(2, 2, 4)).tolist() == [[2, 1], [4, 3]]  # per row of a stack


@pytest.mark.parametrize("enc", ENCODERS, ids=lambda e: e["encoder"])
@pytest.mark.parametrize("readout", ["words", "class"])
def test_prediction_by_length_is_the_padded_prediction(enc, readout):
    """Rows taken shortest first, two at a time, each pair cut to its longer row: the same attention and
    probabilities as the padded rows (a HeadModel ignores left padding), in the rows' own order, zero
    attention on the dropped columns."""
    b, m = tiny_batch(), model(readout=readout, **enc)
    b = b.index(torch.tensor([2, 0, 1, 2]))  # lengths 9, 11, 10, 9: taken as rows 0, 3 / 2, 1
    a0, p0 = predict(m, b)
    a1, p1 = hm.predict_by_length(m, b, rows=2)
    assert torch.allclose(a0, a1, rtol=0, atol=1e-12) and torch.allclose(p0, p1, rtol=0, atol=1e-12)
    assert (a1[b.tokens == 0] == 0).all()
    with pytest.raises(TypeError, match="needs a HeadModel"):
        hm.predict_by_length(torch.nn.Linear(2, 2), b)


@pytest.mark.parametrize("enc", ENCODERS, ids=lambda e: e["encoder"])
@pytest.mark.parametrize("query", ["question", "last"])
def test_attention_row_is_the_softmax_of_the_scores_with_the_query_at_the_last_position(enc, query):
    """The attention row by its definition: the head's scores of the key vectors with the last one
    replaced by the query vector (the query scored against itself there), masked to the keys and
    normalised; the model scores the keys and the query's own column apart, so this compares the two."""
    b, m = tiny_batch(), model(query=query, **enc)
    with torch.no_grad():
        _, attn = m(b.tokens, b.key_mask)
        k = m.keys(b.tokens)
        x = k.clone()
        x[:, -1] = m.query_vector(b.tokens, k)
        s = m.head.scores(x).masked_fill(~b.key_mask, float("-inf"))
    assert torch.allclose(attn, torch.softmax(s, -1), rtol=0, atol=1e-14)
    assert torch.equal(m.head.scores(x), m.head.scores(x, x[:, -1]))  # the query defaults to the last position


def test_relative_readout_scores_every_word_zero_under_flat_attention():
    b, m = tiny_batch(), model(relative=True)
    k = b.key_mask.to(F64)
    with torch.no_grad():
        logits, _ = m(b.tokens, b.key_mask, k / k.sum(1, keepdim=True))
        own = m(b.tokens, b.key_mask)[0]
    assert float(logits[torch.isfinite(logits)].abs().max()) < 1e-12
    assert float(own[torch.isfinite(logits)].abs().max()) > 1e-6  # not flat: not zero


# --- values are token-local ---------------------------------------------------------------
@pytest.mark.parametrize("enc", ENCODERS, ids=lambda e: e["encoder"])
@pytest.mark.parametrize("values", hm.VALUES)
def test_values_are_token_local(enc, values):
    """With all attention on key i, the head output is W_OV v_i: changing any other token j
    (key, question word or query) leaves it unchanged; changing token i changes it."""
    b, m = tiny_batch(), model(values=values, **enc)
    keys = b.key_mask[0].nonzero()[:, 0].tolist()
    for i in keys:
        A = torch.zeros(1, T, dtype=F64)
        A[0, i] = 1.0
        o_ref = m.head_output(b.tokens[:1], b.key_mask[:1], A)[0]
        for j in range(1, T):
            t = b.tokens[:1].clone()
            t[0, j] = 5 if int(t[0, j]) != 5 else 6
            o = m.head_output(t, b.key_mask[:1], A)[0]
            if j == i:
                assert (o - o_ref).abs().max() > 1e-6
            else:
                assert torch.allclose(o, o_ref, rtol=0, atol=1e-12), (i, j)


# --- the SQuAD readout over the paragraph's words, by hand ---------------------------------
def test_words_readout_hand_worked():
    """d = 2, W_OV = I: with attention 0.75 / 0.25 on words 8 and 9, logit(w) = e(w) . (0.75 e8
    + 0.25 e9) for the paragraph's words; the repeated word 8 has one logit, not two; the question
    words, the query token and words not in the row get -inf."""
    m = hm.HeadModel(V, 2, T, T, readout="words", dtype=F64, parameterization="CACO")
    E = torch.zeros(V, 2, dtype=F64)
    E[8], E[9], E[6], E[10], E[11], E[5] = (torch.tensor(r, dtype=F64) for r in ([1, 0], [0, 1], [1, 1], [2, -1], [-1, 0], [3, 3]))
    with torch.no_grad():
        m.embed.weight.copy_(E)
    m.head.set_effective(torch.zeros(2, 2, dtype=F64), torch.eye(2, dtype=F64))
    b = tiny_batch().index(slice(0, 1))  # question 5 6 7, context 8 6 9 8 10 11
    A = torch.zeros(1, T, dtype=F64)
    A[0, 5], A[0, 7] = 0.75, 0.25
    by_class = m(b.tokens, b.key_mask, A)[0][0].detach()
    o = torch.tensor([0.75, 0.25], dtype=F64)
    want = {8: 0.75, 6: 1.0, 9: 0.25, 10: 1.25, 11: -0.75}
    first = {8: 5, 6: 6, 9: 7, 10: 9, 11: 10}  # each word's first context position
    logits = {w: by_class[T - 1 - p] for w, p in first.items()}  # class = position counted back
    for w, val in want.items():
        assert abs(float(logits[w]) - val) < 1e-12 and abs(float(E[w] @ o) - val) < 1e-12
    assert torch.isinf(by_class[[c for c in range(T) if T - 1 - c not in first.values()]]).all()
    # one logit per distinct word: the probability of word 8 is exp(l8) / sum over the 5 distinct words
    p = torch.softmax(by_class, -1)
    assert abs(float(p[T - 1 - 5]) - math.exp(0.75) / sum(math.exp(v) for v in want.values())) < 1e-12
    # and its gradient reaches the head output once (e8), not once per occurrence
    o_var = o.clone().requires_grad_(True)
    m.readout_logits(o_var[None], b.tokens, b.key_mask)[0, T - 1 - 5].backward()
    assert torch.allclose(o_var.grad, E[8], atol=1e-12)


# --- gradients, stacks, groups -------------------------------------------------------------
@pytest.mark.parametrize("param", PARAMETERIZATIONS)
def test_gradients_match_finite_differences(param):
    b = tiny_batch()
    m = model(parameterization=param, encoder="conv", layers=1, window=3, relative=True)
    names = [n for n in dict(m.named_parameters()) if n.startswith("head.") or n in ("match_vec", "summary")]
    base = {n: p.detach() for n, p in m.named_parameters()}

    def loss(*ps):
        out = functional_call(m, {**base, **dict(zip(names, ps))}, (b.tokens, b.key_mask))[0]
        return torch.nn.functional.cross_entropy(out, b.y)

    assert torch.autograd.gradcheck(loss, tuple(base[n].clone().requires_grad_(True) for n in names), eps=1e-6, atol=1e-6)


def test_a_stack_of_two_equals_two_separate_trainings():
    """float64: the vmapped stack and a single run compute the same products up to summation order;
    after 6 AdamW steps the parameters agree to 1e-9."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.tensor(ROWS * 8)
    tokens[:, 5:11] = torch.randint(5, V, (24, 6), generator=g)
    b0 = tiny_batch()
    key_mask = b0.key_mask.repeat(8, 1)
    word = tokens[torch.arange(24), torch.tensor([9, 5, 7] * 8)]
    first = ((tokens == word[:, None]) & key_mask).to(torch.int8).argmax(1)  # the word's first key position
    y = T - 1 - first
    data = Batch(tokens, key_mask, b0.relevant.repeat(8, 1), y)
    cfgs = [TrainConfig(optimizer="adamw", eta_ov=0.05, ratio=r, steps=6, batch_size=8, seed=s, progress=False,
                        log_subsample=0, n_logs=2) for r, s in ((1.0, 0), (10.0, 1))]
    kw = dict(encoder="conv", layers=2, window=3, relative=True, ov_init=0.5)
    alone = [model(seed=s, **kw) for s in (0, 1)]
    for m, c in zip(alone, cfgs):
        train(m, data, c)
    stack = [model(seed=s, **kw) for s in (0, 1)]
    train_stacked(stack, data, cfgs)
    moved = 0.0
    for a, s, fresh in zip(alone, stack, [model(seed=k, **kw) for k in (0, 1)]):
        pa, ps, p0 = dict(a.named_parameters()), dict(s.named_parameters()), dict(fresh.named_parameters())
        for n in pa:
            assert torch.allclose(pa[n], ps[n], rtol=0, atol=1e-9), n
            moved = max(moved, float((pa[n] - p0[n]).detach().abs().max()))
    assert moved > 1e-3  # they trained


@pytest.mark.parametrize("param", PARAMETERIZATIONS)
def test_head_parameters_alone_are_in_the_qk_and_ov_groups(param):
    m = model(parameterization=param, encoder="bigru", values="map")
    g = named_groups(m)
    qk = {"FA": ["head.W_Q", "head.W_K"], "CA": ["head.W_QK"]}[param[:2]]
    ov = {"FO": ["head.W_O", "head.W_V"], "CO": ["head.W_OV"]}[param[2:]]
    assert sorted(g["qk"]) == sorted(qk) and sorted(g["ov"]) == sorted(ov)
    assert all(not n.startswith("head.") for n in g["other"]) and "embed.weight" in g["other"]


def test_copy_start_adds_the_identity_to_w_ov():
    a, c = model(seed=2), model(seed=2, ov_init=1.5)
    assert torch.allclose(c.head.W_OV_eff() - a.head.W_OV_eff(), 1.5 * torch.eye(6, dtype=F64), atol=1e-10)


# --- SQuAD as a word task ------------------------------------------------------------------
def test_word_task_keeps_answer_words_that_occur_once_and_counts_the_drops():
    def ex(q, c, start):  # words, relevant (answer span start), y = distance back from the query
        words = q + ["<sep>"] + c
        return Example(words, [len(q) + 1 + start], len(words) - (len(q) + 1 + start), "<q:what>", {"id": start})

    train_ex = [ex(["who", "won"], ["paris", "won", "the", "cup"], 0),     # kept: "paris"
                ex(["who", "won"], ["paris", "beat", "paris"], 0),         # repeated in the paragraph
                ex(["who", "won"], ["won", "by", "rome"], 0)]              # in the question
    test_ex = [ex(["what", "cup"], ["the", "rome", "cup"], 1)]             # kept: "rome"
    ds = finish("squad", train_ex, test_ex, [f"-{d}" for d in range(10)], {}, 1, specials=("<sep>", "<q:what>"))
    w = hm.word_task(ds)
    assert len(w.train) == 1 and len(w.test) == 1 and w.n_classes == ds.n_classes
    word = lambda b: w.vocab[int(b.tokens[0, b.tokens.shape[1] - 1 - int(b.y[0])])]  # noqa: E731
    assert word(w.train) == "paris" and word(w.test) == "rome"
    assert w.report["train_word_task_answer_word_repeated_in_paragraph"] == 1
    assert w.report["train_word_task_answer_word_in_question"] == 1 and w.report["train_word_task_kept"] == 1
    assert w.train_info["id"] == [0] and len(ds.train) == 3  # info follows the kept rows; input unchanged
    r = w.test.relevant[0].nonzero()[:, 0].tolist()
    assert len(r) == 1 and r[0] == w.test.tokens.shape[1] - 1 - int(w.test.y[0])


# --- the necessity check -------------------------------------------------------------------
def test_necessity_on_a_case_with_a_known_answer():
    """Class = which signal word (A -> 0, B -> 1) is the relevant key; one-hot embeddings and
    W_OV reading the A and B coordinates. Rows "A B B" / "B A A" fool flat attention (the
    distractors outvote the signal), rows "A N N" / "B N N" do not: uniform 1/2, oracle 1,
    chance 1/2; W_QK = 0 makes the model's own attention uniform, so it scores 1/2 too.
    The check can fail: the three numbers differ here only because the attention rows differ."""
    A, B, N = 5, 6, 7
    m = hm.HeadModel(V, V, 2, 5, readout="class", positions=(), dtype=F64, parameterization="CACO")
    with torch.no_grad():
        m.embed.weight.copy_(torch.eye(V, dtype=F64))
    W_OV = torch.zeros(2, V, dtype=F64)
    W_OV[0, A] = W_OV[1, B] = 1.0
    m.head.set_effective(torch.zeros(V, V, dtype=F64), W_OV)
    tokens = torch.tensor([[0, A, B, B, 4], [0, B, A, A, 4], [0, A, N, N, 4], [0, B, N, N, 4]])
    key_mask = (tokens != 0) & (torch.arange(5) < 4)
    relevant = torch.zeros_like(key_mask)
    relevant[:, 1] = True
    data = Batch(tokens, key_mask, relevant, torch.tensor([0, 1, 0, 1]))
    out = hm.necessity(m, data)
    assert out["oracle"] == 1.0 and out["uniform"] == 0.5 and out["model"] == 0.5 and out["chance"] == 0.5
    assert out["n"] == 4 and out["n_without_relevant"] == 0
    # rows 1-2 with both signal words relevant: the oracle splits its mass 50/50, a tie that counts 1/2
    data.relevant[:2, 1:3] = True
    out = hm.necessity(m, data)
    assert out["oracle"] == 0.75 and out["uniform"] == 0.5 and out["model"] == 0.5


def test_tie_accuracy_counts_a_tie_as_a_fraction():
    logits = torch.tensor([[0.0, 0.0, float("-inf")], [1.0, 2.0, 2.0], [3.0, 0.0, 0.0]])
    assert torch.allclose(hm.tie_accuracy(logits, torch.tensor([1, 0, 0])), torch.tensor([0.5, 0.0, 1.0], dtype=F64))



# --- the graded intervention: the model's row -> the oracle --------------------------------
def random_batch(readout: str, seed: int = 0) -> Batch:
    """24 rows of the tiny layout with random context words; the relevant key of row i is the
    tiny batch's; the last row has none (so it is left out). ``y``: the relevant word's first key
    position counted back (words readout) or a random class of 3 (class readout)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(ROWS * 8)
    tokens[:, 5:11] = torch.randint(5, V, (24, 6), generator=g)
    b0 = tiny_batch()
    key_mask, relevant = b0.key_mask.repeat(8, 1), b0.relevant.repeat(8, 1)
    relevant[-1] = False
    if readout == "words":
        word = tokens[torch.arange(24), torch.tensor([9, 5, 7] * 8)]
        y = T - 1 - ((tokens == word[:, None]) & key_mask).to(torch.int8).argmax(1)
    else:
        y = torch.randint(0, 3, (24,), generator=g)
    return Batch(tokens, key_mask, relevant, y)


@pytest.mark.parametrize("kw", [dict(readout="words"), dict(readout="class", relative=True),
                                dict(readout="class", encoder="conv", layers=1, window=3, values="map")],
                         ids=["words", "class-relative", "class-conv"])
def test_graded_intervention_ends_are_the_necessity_check(kw):
    """Alpha 0 is necessity's "model" column and alpha 1 its "oracle" column, exactly, on the same
    rows (the one without a relevant key left out); small chunks give the same curve."""
    m = model(seed=4, **kw)
    data = random_batch(kw["readout"])
    nec = hm.necessity(m, data)
    f = hm.graded_intervention(m, data)
    assert list(f.columns) == ["alpha", "accuracy", "n"] and f["alpha"].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert f["accuracy"].iloc[0] == nec["model"] and f["accuracy"].iloc[-1] == nec["oracle"]
    assert (f["n"] == nec["n"]).all() and nec["n"] == 23
    small = hm.graded_intervention(m, data, chunk=5)
    assert small["accuracy"].tolist() == pytest.approx(f["accuracy"].tolist(), abs=1e-12)


def signal_model(w_qk: float) -> hm.HeadModel:
    """Class = signal word (A = 5 -> 0, B = 6 -> 1), one-hot embeddings, the query token 4 last.
    W_OV reads A for class 0 and both B and the distractor N = 7 for class 1; W_QK scores A and B
    ``w_qk`` against the query and N zero (symmetric, so either orientation of the score)."""
    A, B, N, Q = 5, 6, 7, 4
    m = hm.HeadModel(V, V, 2, 5, readout="class", positions=(), dtype=F64, parameterization="CACO")
    with torch.no_grad():
        m.embed.weight.copy_(torch.eye(V, dtype=F64))
    W_OV = torch.zeros(2, V, dtype=F64)
    W_OV[0, A] = W_OV[1, B] = W_OV[1, N] = 1.0
    W_QK = torch.zeros(V, V, dtype=F64)
    for s in (A, B):
        W_QK[s, Q] = W_QK[Q, s] = w_qk
    m.head.set_effective(W_QK, W_OV)
    return m


def signal_batch(rows, relevant_cols, y) -> Batch:
    tokens = torch.tensor(rows)
    key_mask = (tokens != 0) & (torch.arange(5) < 4)
    relevant = torch.zeros_like(key_mask)
    for i, cols in enumerate(relevant_cols):
        relevant[i, cols] = True
    return Batch(tokens, key_mask, relevant, torch.tensor(y))


def test_graded_intervention_hand_worked_curve():
    """W_QK = 0: the model's own row is uniform over the three keys. Row "A N N" (y = 0): class 0
    gets (1 - a) / 3 + a, class 1 (two N) 2 (1 - a) / 3, so it is right for a > 1/4; row "B N N"
    (y = 1) is always right; the accuracy is 1/2 up to a = 1/4 and 1 above."""
    A, B, N = 5, 6, 7
    data = signal_batch([[0, A, N, N, 4], [0, B, N, N, 4]], [[1], [1]], [0, 1])
    f = hm.graded_intervention(signal_model(0.0), data, alphas=[0.0, 0.2, 0.3, 0.6, 1.0])
    assert f["accuracy"].tolist() == [0.5, 0.5, 1.0, 1.0, 1.0] and f["n"].tolist() == [2] * 5


def test_graded_intervention_is_flat_when_the_attention_is_the_oracle():
    """W_QK = 2000 on A and B: the softmax puts all mass on the signal words (exp(-2000) = 0 in
    float64), split evenly where both occur -- exactly the oracle over relevant = the signal
    words, so every mixture is the same row and the curve is flat (2 right, one tie: 5/6). The same
    rows with W_QK = 0 (uniform attention) give a curve that is not flat."""
    A, B, N = 5, 6, 7
    data = signal_batch([[0, A, N, N, 4], [0, N, B, N, 4], [0, A, B, N, 4]], [[1], [2], [1, 2]], [0, 1, 0])
    sharp = signal_model(2000.0)
    own = sharp(data.tokens, data.key_mask)[1]
    r = data.relevant.to(F64)
    assert torch.equal(own, r / r.sum(1, keepdim=True))  # the precondition: the model's row is the oracle
    f = hm.graded_intervention(sharp, data, alphas=[0.0, 0.1, 0.5, 0.9, 1.0])
    assert f["accuracy"].tolist() == [5 / 6] * 5
    flat = hm.graded_intervention(signal_model(0.0), data, alphas=[0.0, 1.0])["accuracy"].tolist()
    assert flat[0] < flat[1] == 5 / 6


def test_graded_intervention_is_deterministic_and_sorts_alphas():
    data = random_batch("words", seed=2)
    m = model(seed=5)
    m.train()
    a = hm.graded_intervention(m, data, alphas=(1.0, 0.5, 0.0))
    b = hm.graded_intervention(model(seed=5), data, alphas=[0.0, 0.5, 1.0])
    assert a["alpha"].tolist() == [0.0, 0.5, 1.0]
    pd.testing.assert_frame_equal(a, b)
    assert m.training  # the model's own mode is restored


@pytest.mark.parametrize("alphas,err,match", [
    ([], ValueError, "empty"), ([0.0, 1.5], ValueError, r"in \[0, 1\]"), ([-0.1], ValueError, r"in \[0, 1\]"),
    ([float("nan")], ValueError, "finite"), ([0.0, float("inf")], ValueError, "finite"),
    ([0.5, 0.5], ValueError, "distinct"), (0.5, TypeError, "sequence"), ("01", TypeError, "sequence"),
    ([True, 0.5], TypeError, "real number"), ([None], TypeError, "real number")])
def test_graded_intervention_rejects_bad_alphas(alphas, err, match):
    with pytest.raises(err, match=match):
        hm.graded_intervention(model(), random_batch("words"), alphas=alphas)


def test_graded_intervention_clear_errors():
    b = random_batch("words")
    with pytest.raises(ValueError, match="relevant key"):
        hm.graded_intervention(model(), Batch(b.tokens, b.key_mask, torch.zeros_like(b.key_mask), b.y))
    with pytest.raises(TypeError, match="graded_intervention needs a HeadModel"):
        hm.graded_intervention(torch.nn.Linear(2, 2), b)
    with pytest.raises(ValueError, match="chunk"):
        hm.graded_intervention(model(), b, chunk=0)


def test_intervention_frame_has_one_row_per_model_and_alpha():
    data = random_batch("class")
    models = {(1.0, 0): model(seed=0, readout="class"), (10.0, 1): model(seed=1, readout="class")}
    f = hm.intervention_frame(models, data, alphas=(0.0, 1.0), names=("ratio", "seed"))
    assert list(f.columns) == ["ratio", "seed", "alpha", "accuracy", "n"] and len(f) == 4
    for (r, s), m in models.items():
        got = f[(f["ratio"] == r) & (f["seed"] == s)].reset_index(drop=True)[["alpha", "accuracy", "n"]]
        pd.testing.assert_frame_equal(got, hm.graded_intervention(m, data, alphas=(0.0, 1.0)))
    plain = hm.intervention_frame({"a": models[(1.0, 0)]}, data, alphas=(0.0, 1.0))
    assert list(plain.columns) == ["key", "alpha", "accuracy", "n"] and plain["key"].tolist() == ["a", "a"]
    with pytest.raises(ValueError, match="one value per name"):
        hm.intervention_frame(models, data, names=("ratio",))
    with pytest.raises(ValueError, match="non-empty mapping"):
        hm.intervention_frame({}, data)
    with pytest.raises(ValueError, match="reuse"):
        hm.intervention_frame(models, data, names=("ratio", "alpha"))


def test_endpoint_means_and_oracle_below_model_by_hand():
    """Ratio 1: model (0.6 + 0.8) / 2 = 0.7, oracle 0.9 -> not below; ratio 10: model (0.9 + 0.7) / 2
    = 0.8, oracle (0.5 + 0.7) / 2 = 0.6 -> below (though seed 1 alone is a tie). Alpha 0.5 rows do
    not enter."""
    rows = []
    for ratio, seed, model_acc, oracle_acc in ((1.0, 0, 0.6, 0.9), (1.0, 1, 0.8, 0.9), (10.0, 0, 0.9, 0.5),
                                               (10.0, 1, 0.7, 0.7)):
        for a, acc in ((0.0, model_acc), (0.5, 0.0), (1.0, oracle_acc)):
            rows.append({"ratio": ratio, "seed": seed, "alpha": a, "accuracy": acc, "n": 10})
    frame = pd.DataFrame(rows)
    e = hm.endpoint_means(frame)
    assert e["ratio"].tolist() == [1.0, 10.0] and e["seeds"].tolist() == [2, 2]
    assert e["model"].tolist() == pytest.approx([0.7, 0.8]) and e["oracle"].tolist() == pytest.approx([0.9, 0.6])
    assert e["oracle_below_model"].tolist() == [False, True]
    assert not hm.oracle_below_model(frame)  # not at every ratio
    assert hm.oracle_below_model(frame[frame["ratio"] == 10.0])
    one = hm.endpoint_means(frame[frame["ratio"] == 10.0].drop(columns="ratio"))
    assert len(one) == 1 and one["oracle"].iloc[0] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="not a key column"):
        hm.endpoint_means(frame, over="run")
    with pytest.raises(ValueError, match="alpha = 1"):
        hm.endpoint_means(frame[frame["alpha"] < 1.0])
    with pytest.raises(ValueError, match="same models"):
        hm.endpoint_means(frame.drop(index=0))

# --- bad input ----------------------------------------------------------------------------
def test_clear_errors():
    b = tiny_batch()
    with pytest.raises(ValueError, match="encoder"):
        hm.HeadModel(V, 4, V, T, encoder="lstm")
    with pytest.raises(ValueError, match="n_classes must be at least max_len"):
        hm.HeadModel(V, 4, 3, T, readout="words")
    with pytest.raises(ValueError, match="sep_id"):
        hm.HeadModel(V, 4, T, T, readout="words", match=True)
    with pytest.raises(ValueError, match="even d_model"):
        hm.HeadModel(V, 5, 3, T, encoder="bigru")
    with pytest.raises(ValueError, match="ov_init"):
        hm.HeadModel(V, 4, 3, T, ov_init=1.0)
    with pytest.raises(ValueError, match="positions"):
        hm.HeadModel(V, 4, 3, T, positions=("back", "back"))
    m = model()
    with pytest.raises(ValueError, match="sum to 1"):
        m(b.tokens, b.key_mask, 2 * fixed_row(b))
    with pytest.raises(ValueError, match="zero off the keys"):
        m(b.tokens, b.key_mask, torch.full(b.tokens.shape, 1.0 / T, dtype=F64))
    with pytest.raises(ValueError, match="max_len"):
        m(torch.zeros(1, T + 1, dtype=torch.long), torch.ones(1, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="relevant key"):
        hm.necessity(m, Batch(b.tokens, b.key_mask, torch.zeros_like(b.key_mask), b.y))
    with pytest.raises(TypeError, match="HeadModel"):
        hm.necessity(torch.nn.Linear(2, 2), b)
