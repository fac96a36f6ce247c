"""HeadModel.stacked_forward, the explicit-model-dimension forward that ModelStack uses for stacks of
analysed-head models: its logits, attention and parameter gradients equal those of the vmapped forward
and of each model alone (float64, every map's cpu-profile model options and the other options), a
few training steps give the same parameters as the vmap path, left padding and the key mask are
respected, and evaluation chunks of any size give the same predictions bit for bit."""

import pytest
import torch

from qkov_lib import head_model as hm
from qkov_lib.data.batch import Batch
from qkov_lib.studies import realmap
from qkov_lib.train import TrainConfig, loop, train_stacked
from qkov_lib.train.loop import ModelStack, stacked_loss

SEP, V, T, D, C = 3, 20, 9, 6, 4


def map_options(name: str) -> dict:
    """The HeadModel options of a map's cpu profile (window and layers as the profile has them)."""
    cfg = realmap.map_config(name, "cpu")
    return {arg: cfg[k] for k, arg in realmap.HEAD_OPTIONS.items()} | {"parameterization": cfg["parameterization"]}


CASES = {name: map_options(name) for name in ("squad", "hatexplain", "sva")}
CASES.update({  # the options no map uses, one at a time on HateXplain's model
    "encoder none": CASES["hatexplain"] | {"encoder": "none"},
    "layers 2": CASES["hatexplain"] | {"layers": 2, "window": 5},
    "positions start": CASES["hatexplain"] | {"positions": ("back", "start")},
    "values map": CASES["hatexplain"] | {"values": "map"},
    "CACO": CASES["hatexplain"] | {"parameterization": "CACO", "relative": True},
    "words, squad, layers 1": CASES["squad"] | {"layers": 1, "ov_init": 0.5},
})


def make(opts: dict, seed: int, dtype=torch.float64, max_len: int = T, d: int = D) -> hm.HeadModel:
    n_classes = max_len if opts["readout"] == "words" else C
    kw = {("query" if k == "head_query" else k): v for k, v in opts.items()}
    kw["positions"] = tuple(kw["positions"])
    return hm.HeadModel(V, d, n_classes, max_len, sep_id=SEP, ignore=torch.arange(V) == 7, init_scale=0.3, dtype=dtype,
                        generator=torch.Generator().manual_seed(seed), **kw)


def random_data(n: int, readout: str, seed: int) -> Batch:
    """Left-padded ``question <sep> context q`` rows of random lengths (some of the full length):
    keys are the context words; ``y`` a class (``class``) or the first key position, counted back
    from the query, of a word at a key (``words``)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, V, (n, T), generator=g)
    length = torch.randint(5, T + 1, (n,), generator=g)
    length[:2] = T
    cols = torch.arange(T)[None]
    tokens[cols < (T - length)[:, None]] = 0
    sep = T - length + 1 + torch.randint(0, 2, (n,), generator=g)  # one or two question words
    tokens[torch.arange(n), sep] = SEP
    tokens[:, -1] = 2  # the query token
    key_mask = (cols > sep[:, None]) & (cols < T - 1)
    pick = torch.rand(n, T, generator=g).masked_fill(~key_mask, -1).argmax(1)
    relevant = torch.zeros(n, T, dtype=torch.bool)
    relevant[torch.arange(n), pick] = True
    if readout == "words":
        word = tokens[torch.arange(n), pick]
        y = T - 1 - ((tokens == word[:, None]) & key_mask).to(torch.int8).argmax(1)
    else:
        y = torch.randint(0, C, (n,), generator=g)
    return Batch(tokens, key_mask, relevant, y)


def forward_and_grads(models, tokens, key_mask, y, stacked: bool):
    stack = ModelStack(models)
    assert stack.stacked  # every HeadModel stack takes the explicit model dimension
    stack.stacked = stacked
    logits, attn = stack.forward(tokens, key_mask, shared=tokens.dim() == 2)
    stacked_loss(logits, y, None).sum().backward()
    return logits.detach(), attn.detach(), stack.grads()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shared", [True, False], ids=["shared rows", "rows per model"])
def test_stacked_forward_equals_vmap_and_each_model_alone(case, shared):
    opts = CASES[case]
    M = 3
    data = random_data(12 * M, opts["readout"], 0)
    if shared:
        tokens, key_mask, y = data.tokens[:12], data.key_mask[:12], data.y[:12].expand(M, -1)
    else:
        tokens, key_mask, y = data.tokens.view(M, 12, T), data.key_mask.view(M, 12, T), data.y.view(M, 12)
    new = forward_and_grads([make(opts, s) for s in range(M)], tokens, key_mask, y, True)
    ref = forward_and_grads([make(opts, s) for s in range(M)], tokens, key_mask, y, False)
    for a, b in zip(new[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)  # -inf (words readout) in the same places
    assert set(new[2]) == set(ref[2])
    for name in ref[2]:
        assert ref[2][name].abs().max() > 0 or name.endswith("bias"), name  # every tensor takes part
        torch.testing.assert_close(new[2][name], ref[2][name], rtol=1e-10, atol=1e-13, msg=name)
    for m in range(M):
        t, k = (tokens, key_mask) if shared else (tokens[m], key_mask[m])
        logits, attn = make(opts, m)(t, k)
        torch.testing.assert_close(new[0][m], logits, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(new[1][m], attn, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("case", ["squad", "hatexplain", "sva"])
def test_left_padding_changes_nothing_and_only_keys_are_attended(case):
    """Two more padding columns: the same logits (the words readout's classes count back from the
    query, so they keep their places) and the same attention on the old columns, none on the new;
    attention is zero off the keys and sums to one."""
    opts = CASES[case]
    stack = ModelStack([make(opts, s, max_len=T + 2) for s in range(2)])
    data = random_data(10, opts["readout"], 1)
    logits, attn = stack.forward(data.tokens, data.key_mask, shared=True)
    pad = torch.nn.functional.pad
    logits2, attn2 = stack.forward(pad(data.tokens, (2, 0)), pad(data.key_mask, (2, 0)), shared=True)
    torch.testing.assert_close(logits2, logits, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(attn2[..., 2:], attn, rtol=1e-12, atol=1e-13)
    assert (attn2[..., :2] == 0).all() and (attn[:, ~data.key_mask] == 0).all()
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 10, dtype=attn.dtype))


@pytest.mark.parametrize("case", ["squad", "hatexplain", "sva"])
@pytest.mark.parametrize("dtype, steps, tol", [(torch.float64, 8, 1e-9), (torch.float32, 3, 1e-5)], ids=["f64", "f32"])
def test_a_few_training_steps_give_the_parameters_of_the_vmap_path(case, dtype, steps, tol, monkeypatch):
    """AdamW on per-model minibatches: the explicit model dimension and the vmapped forward train the
    same parameters up to float summation order (relative to each tensor's largest entry; AdamW's
    normalised steps amplify float32 rounding where a gradient entry is near zero)."""
    opts = CASES[case]
    data = random_data(96, opts["readout"], 2)
    cfgs = [TrainConfig(optimizer="adamw", eta_ov=1e-2, ratio=r, steps=steps, batch_size=16, seed=s, progress=False,
                        log_subsample=0, n_logs=2) for s, r in enumerate((1.0, 10.0, 100.0))]
    new = [make(opts, c.seed, dtype) for c in cfgs]
    train_stacked(new, data, cfgs)
    monkeypatch.delattr(hm.HeadModel, "stacked_forward")
    assert not ModelStack(new).stacked
    ref = [make(opts, c.seed, dtype) for c in cfgs]
    train_stacked(ref, data, cfgs)
    fresh = make(opts, 0, dtype)
    with torch.no_grad():
        assert max(float((p - q).abs().max()) for p, q in zip(ref[0].parameters(), fresh.parameters())) > 1e-3  # trained
        for a, b in zip(new, ref):
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=tol * float(q.abs().max()), msg=name)


@pytest.mark.parametrize("by_length", [False, True])
def test_evaluation_chunks_give_the_same_predictions(by_length, monkeypatch):
    """Each row's prediction is computed from that row alone and the chunks are of near-equal size,
    so the evaluation's budget (loop.EVAL_BUDGET) changes no prediction: float32, SQuAD's and
    HateXplain's models at width 32, 60 rows in chunks of 60, 20 and 8 or 9. The numbers agree to float32
    rounding, not bit for bit: a matrix kernel may sum a product of 9 rows in another order than one
    of 60 on another CPU."""
    for case in ("squad", "hatexplain"):
        models = [make(CASES[case], s, torch.float32, d=32) for s in range(3)]
        data = random_data(60, CASES[case]["readout"], 3)
        out = []
        for rows in (60, 23, 9):
            monkeypatch.setattr(loop, "EVAL_BUDGET", rows * 3 * T * 32)
            out.append(ModelStack(models).predict(data, by_length))
        for attn, probs in out[1:]:
            torch.testing.assert_close(attn, out[0][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(probs, out[0][1], rtol=1e-5, atol=1e-6)
            assert torch.equal(probs.argmax(-1), out[0][1].argmax(-1))


def test_a_bigru_stack_needs_one_model_per_stack():
    opts = CASES["hatexplain"] | {"encoder": "bigru"}
    data = random_data(4, "class", 4)
    with pytest.raises(ValueError, match="one model per stack"):
        ModelStack([make(opts, s) for s in range(2)]).forward(data.tokens, data.key_mask, shared=True)
