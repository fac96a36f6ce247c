
import pytest
import torch

from qkov_lib.data import synthetic as syn
from qkov_lib.models import SyntheticModel
from qkov_lib.train import loss_fn


def test_sample_structure():
    task = syn.SyntheticTask(n_classes=3, n_common_vocab=4, n_common=(2, 5))
    b = syn.sample(task, 500, torch.Generator().manual_seed(0))
    assert b.tokens.shape == (500, task.seq_len)
    assert (b.tokens[:, -1] == task.query_id).all()
    assert (b.relevant.sum(1) == 1).all()                      # exactly one distinct token
    assert (b.tokens[b.relevant] == b.y).all()                 # and it is the class's token
    n_keys = b.key_mask.sum(1)
    assert set(n_keys.tolist()) == {3, 6}                      # n commons + 1 distinct, query excluded
    assert not b.key_mask[:, -1].any()
    common = b.key_mask & ~b.relevant
    assert ((b.tokens[common] >= 3) & (b.tokens[common] < 7)).all()
    # the distinct token's position varies
    pos = (b.relevant.float() * torch.arange(task.seq_len)).sum(1)
    assert len(set(pos.tolist())) > 3


def test_sample_is_deterministic_under_seed():
    task = syn.SyntheticTask()
    a = syn.sample(task, 50, torch.Generator().manual_seed(7))
    b = syn.sample(task, 50, torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.y, b.y)  # integers


def test_population_weights_and_size():
    task = syn.SyntheticTask(n_classes=2, n_common_vocab=3, n_common=(1, 2))
    p = syn.population(task)
    # multisets: n=1: 3, n=2: 6 -> 9 per class
    assert len(p) == syn.population_size(task) == 18
    assert float(p.weight.sum()) == pytest.approx(1.0)
    # P(class 0, n=2, commons {c0, c1}) = 1/2 * 1/2 * 2/9
    row = [i for i in range(len(p)) if p.y[i] == 0 and sorted(p.tokens[i][p.key_mask[i]].tolist()) == [0, 2, 3]]
    assert len(row) == 1 and float(p.weight[row[0]]) == pytest.approx(0.5 * 0.5 * 2 / 9)
    with pytest.raises(ValueError, match="max_rows"):
        syn.population(syn.SyntheticTask(n_common_vocab=10, n_common=(12,)), max_rows=1000)


def test_population_loss_matches_monte_carlo():
    task = syn.SyntheticTask(n_classes=3, n_common_vocab=3, n_common=(2, 4))
    g = torch.Generator().manual_seed(0)
    E = syn.make_embeddings(task, dtype=torch.float64)
    m = SyntheticModel(E, 3, parameterization="CACO", init_scale=1.0, generator=g)
    pop = syn.population(task)
    mc = syn.sample(task, 200_000, g)
    with torch.no_grad():
        lp = loss_fn(m(pop.tokens, pop.key_mask)[0], pop.y, pop.weight)
        lm = loss_fn(m(mc.tokens, mc.key_mask)[0], mc.y, None)
    assert float(lp) == pytest.approx(float(lm), abs=4e-3)


def test_embeddings():
    t = syn.SyntheticTask(n_classes=2, n_common_vocab=2)
    E = syn.make_embeddings(t)
    assert E.shape == (t.vocab_size + 1, t.vocab_size) and torch.equal(E[:-1], torch.eye(t.vocab_size))
    assert (E[-1] == 0).all()  # padding
    tg = syn.SyntheticTask(n_classes=2, n_common_vocab=2, embedding="gaussian", d_model=8)
    Eg = syn.make_embeddings(tg, torch.Generator().manual_seed(0))
    assert Eg.shape == (6, 8)
    torch.testing.assert_close(Eg[:-1].norm(dim=1), torch.ones(5))


@pytest.mark.parametrize("kw, msg", [(dict(n_classes=1), "n_classes"), (dict(n_common=()), "n_common"),
                                     (dict(embedding="sparse"), "unknown embedding"),
                                     (dict(d_model=3), "one-hot")])
def test_bad_task(kw, msg):
    with pytest.raises(ValueError, match=msg):
        syn.SyntheticTask(**kw)
