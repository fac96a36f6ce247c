"""qkov_lib.train.loop: a stack of models trains each one exactly as train.train trains it alone."""

import itertools

import pytest
import torch

from qkov_lib import runtime
from qkov_lib.data.batch import Batch
from qkov_lib.head_model import HeadModel
from qkov_lib.models import PARAMETERIZATIONS, TokenModel, param_groups
from qkov_lib.train.loop import log_subsample, train_stacked
from qkov_lib.train import NonFiniteError, TrainConfig, evaluate, predict, train

V, C, T = 12, 3, 7


def token_data(n: int, seed: int) -> Batch:
    """Left-padded sequences whose class is the token at one relevant position (mod C)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (n, T), generator=g)
    lengths = torch.randint(3, T + 1, (n,), generator=g)
    key_mask = torch.arange(T)[None] >= (T - lengths)[:, None]
    tokens[~key_mask] = 0
    where = T - 1 - (torch.rand(n, generator=g) * (lengths - 1).float()).long()  # a real position
    relevant = torch.zeros(n, T, dtype=torch.bool)
    relevant[torch.arange(n), where] = True
    return Batch(tokens, key_mask, relevant, tokens[torch.arange(n), where] % C)


def copy_data(n: int, seed: int) -> Batch:
    """:func:`token_data` as a copy task: the class is the first key position (counted back from
    the last column) of the relevant token's word, as the ``words`` readout scores it."""
    b = token_data(n, seed)
    word = b.tokens[b.relevant]
    first = ((b.tokens == word[:, None]) & b.key_mask).to(torch.int8).argmax(1)
    return Batch(b.tokens, b.key_mask, b.relevant, T - 1 - first)


DATA, TEST = token_data(160, 0), token_data(60, 1)
COPY_DATA = copy_data(160, 0)


def token_model(param: str, seed: int, dtype=torch.float64, copy: bool = False) -> torch.nn.Module:
    """A :class:`TokenModel`, or (``copy``) the analysed-head model with the ``words`` (copy) readout."""
    gen = torch.Generator().manual_seed(seed)
    if copy:
        return HeadModel(V, 6, T, T, readout="words", parameterization=param, init_scale=0.1, generator=gen,
                         dtype=dtype)
    return TokenModel(V, 6, C, T, parameterization=param, init_scale=0.1, generator=gen, dtype=dtype)


def configs(opt: str, **kw) -> list[TrainConfig]:
    eta = 0.02 if opt == "adamw" else 0.3
    base = dict(optimizer=opt, eta_ov=eta, steps=40, batch_size=16, n_logs=6, weight_decay=0.01, progress=False,
                momentum=0.9 if opt == "sgd" else 0.0, log_subsample=100)
    base.update(kw)
    return [TrainConfig(ratio=r, seed=s, **base) for r, s in itertools.product((1.0, 10.0), (0, 1))]


@torch.no_grad()
def _param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.parameters(), b.parameters()))


def max_difference(param: str, opt: str, copy: bool = False, dtype=torch.float64, **kw) -> dict[str, float]:
    """Train ``configs(opt, **kw)`` both ways; the largest differences of parameters, logged
    values and test attention between the stack and the one-at-a-time loop."""
    cfgs = configs(opt, **kw)
    loop = [token_model(param, c.seed, dtype, copy) for c in cfgs]
    stack = [token_model(param, c.seed, dtype, copy) for c in cfgs]
    data = COPY_DATA if copy else DATA
    h_loop = [train(m, data, c) for m, c in zip(loop, cfgs)]
    h_stack = train_stacked(stack, data, cfgs)
    out = {"params": 0.0, "records": 0.0, "attention": 0.0}
    for a, b, ha, hb in zip(loop, stack, h_loop, h_stack):
        assert [r["step"] for r in ha.records] == [r["step"] for r in hb.records]
        out["params"] = max(out["params"], _param_diff(a, b))
        out["records"] = max(out["records"], *(abs(ra[k] - rb[k]) for ra, rb in zip(ha.records, hb.records) for k in ra))
        out["attention"] = max(out["attention"], float((predict(a, TEST)[0] - predict(b, TEST)[0]).abs().max()))
    return out


@pytest.mark.parametrize("param", PARAMETERIZATIONS)
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_stack_equals_loop(param, opt):
    """All four parameterizations, AdamW and SGD (momentum), ratios 1 and 10, seeds 0 and 1."""
    diff = max_difference(param, opt)
    assert diff["params"] < 1e-10 and diff["records"] < 1e-10 and diff["attention"] < 1e-10, diff


def test_stack_equals_loop_copy_model_float32():
    # float32 rounding (batched vs single products) grows with the step size: AdamW at
    # eta_QK = 0.2 amplifies it to 1e-3 in 40 steps, at eta_QK = 0.05 it stays below 1e-6
    diff = max_difference("FAFO", "adamw", copy=True, dtype=torch.float32, eta_ov=0.005)
    assert diff["params"] < 1e-5 and diff["records"] < 1e-5 and diff["attention"] < 1e-5, diff


def test_loop_equals_plain_torch_optim():
    """training.train equals a hand-written loop over torch.optim with the same minibatches."""
    for opt in ("adamw", "sgd"):
        c = configs(opt)[3]  # ratio 10, seed 1
        m, ref = token_model("FAFO", 5), token_model("FAFO", 5)
        train(m, DATA, c)
        groups = param_groups(ref, c.eta_ov, c.ratio, None, c.weight_decay)
        o = (torch.optim.AdamW(groups) if opt == "adamw" else torch.optim.SGD(groups, momentum=c.momentum))
        gen, order = torch.Generator().manual_seed(c.seed), []
        for _ in range(c.steps):
            if not order:
                order = list(torch.randperm(len(DATA), generator=gen).split(c.batch_size))
            b = DATA.index(order.pop(0))
            o.zero_grad()
            torch.nn.functional.cross_entropy(ref(b.tokens, b.key_mask)[0], b.y).backward()
            o.step()
        assert _param_diff(m, ref) < 1e-10  # AdamW at eta_QK = 0.2 grows float64 rounding to ~4e-12


def test_diverging_model_is_frozen_and_reported():
    cfgs = configs("sgd", momentum=0.0)
    cfgs[2] = TrainConfig(**{**cfgs[2].__dict__, "eta_ov": 1e6})  # diverges at once
    models = [token_model("CACO", c.seed) for c in cfgs]
    hists = train_stacked(models, DATA, cfgs, on_nonfinite="freeze")
    assert hists[2].diverged_step is not None and hists[2].diverged_step < cfgs[2].steps
    for k in (0, 1, 3):  # the others are untouched by it
        assert hists[k].diverged_step is None
        alone = token_model("CACO", cfgs[k].seed)
        train(alone, DATA, cfgs[k])
        assert _param_diff(models[k], alone) < 1e-12
    with pytest.raises(NonFiniteError, match=r"in model 2 \(eta_ov=1e\+06, ratio=10, seed=0\)"):
        train_stacked([token_model("CACO", c.seed) for c in cfgs], DATA, cfgs)


def test_early_stopping_restores_the_best_weights():
    # validation on other data: its loss turns up once the models overfit the small training set
    cfgs = [TrainConfig(**{**c.__dict__, "steps": 200, "log_every": 10, "patience": p})
            for c, p in zip(configs("adamw"), (2, 2, None, 3))]
    models = [token_model("FACO", c.seed) for c in cfgs]
    hists = train_stacked(models, DATA, cfgs, val=TEST)
    stopped = [h for h in hists if h.stop_step is not None]
    assert stopped, "no run stopped early; the test needs overfitting runs"
    assert hists[2].stop_step is None and hists[2].final["step"] == 200  # no patience: trains to the end
    for h, m, c in zip(hists, models, cfgs):
        vals = [r["val_loss"] for r in h.records]
        best = min(range(len(vals)), key=vals.__getitem__)
        assert h.best_step == h.records[best]["step"]
        if h.stop_step is None:
            continue
        assert h.final["step"] == h.stop_step == h.best_step + c.patience * c.log_every
        # restored: the weights of a run trained for exactly best_step steps (or the initial ones)
        alone = token_model("FACO", c.seed)
        if h.best_step > 0:
            train(alone, DATA, TrainConfig(**{**c.__dict__, "steps": h.best_step, "patience": None}))
        assert _param_diff(m, alone) < 1e-12


def test_logging_on_a_fixed_subsample_and_validation_in_the_same_pass():
    cfgs = configs("adamw", log_subsample=50, log_seed=3, log_every=8)
    models = [token_model("CAFO", c.seed) for c in cfgs]
    hists = train_stacked(models, DATA, cfgs, val=TEST)
    idx = log_subsample(len(DATA), 50, 3)
    assert len(idx) == 50 and torch.equal(idx, log_subsample(len(DATA), 50, 3))  # fixed by its seed (integers)
    assert log_subsample(len(DATA), None, 0) is None and log_subsample(len(DATA), 10**6, 0) is None
    for h, m in zip(hists, models):
        assert [r["step"] for r in h.records] == [0, 8, 16, 24, 32, 40]
        final = h.final
        sub, val = evaluate(m, DATA.index(idx), taus=()), evaluate(m, TEST, taus=())
        for k in ("loss", "accuracy", "attn_relevant"):
            assert final[k] == pytest.approx(sub[k], abs=1e-12)
            assert final[f"val_{k}"] == pytest.approx(val[k], abs=1e-12)


def test_clear_errors():
    cfgs = configs("adamw")
    with pytest.raises(ValueError, match="one architecture"):
        train_stacked([token_model("FAFO", 0), token_model("CACO", 1)], DATA, cfgs[:2])
    with pytest.raises(ValueError, match="differs from config 0 in 'steps'"):
        train_stacked([token_model("FAFO", 0)] * 2, DATA, [cfgs[0], TrainConfig(**{**cfgs[1].__dict__, "steps": 3})])
    with pytest.raises(ValueError, match="needs validation data"):
        train(token_model("FAFO", 0), DATA, TrainConfig(**{**cfgs[0].__dict__, "patience": 2}))
    bad = DATA.index(torch.arange(5))
    bad.key_mask[2] = False
    with pytest.raises(ValueError, match="row 2 has no attendable key"):
        train(token_model("FAFO", 0), bad, cfgs[0])
    with pytest.raises(ValueError, match="got 1 configs for 2 models"):
        train_stacked([token_model("FAFO", 0), token_model("FAFO", 1)], DATA, cfgs[:1])
    with pytest.raises(ValueError, match="on_nonfinite"):
        train_stacked([token_model("FAFO", 0)], DATA, cfgs[0], on_nonfinite="ignore")
    for kw, msg in ((dict(patience=0), "patience"), (dict(log_every=-1), "log_every"),
                    (dict(log_subsample=-5), "log_subsample"), (dict(momentum=1.0), "momentum")):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**{**cfgs[0].__dict__, **kw})


def _changed(x):
    raise TypeError("is_batchedtensor(): incompatible function arguments")


def test_attention_without_the_private_batched_check(monkeypatch):
    """With torch's private vmap check gone, stacked training still runs (the per-row check is
    skipped; the trainer checks the data once) and equals training each model alone."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 9, (40, 6), generator=g)
    km = torch.ones(40, 6, dtype=torch.bool)
    km[:, -1] = False
    data = Batch(tokens, km, km & (tokens == 3), tokens[:, 0] % 3)
    cfgs = [TrainConfig(optimizer="adamw", eta_ov=0.02, ratio=r, steps=5, batch_size=8, seed=0, progress=False,
                        n_logs=2) for r in (1.0, 10.0)]
    make = lambda: [TokenModel(9, 6, 3, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # noqa: E731
                    for _ in cfgs]
    alone = make()
    for m, c in zip(alone, cfgs):
        train(m, data, c)
    # a changed signature (deleting the name breaks torch itself: its own modules import it)
    monkeypatch.setattr(torch._C._functorch, "is_batchedtensor", _changed)
    runtime._batched_check.cache_clear()
    try:
        assert runtime.is_batched(km) is None
        stacked = make()
        train_stacked(stacked, data, cfgs)
        for a, b in zip(alone, stacked):
            for p, q in zip(a.parameters(), b.parameters()):
                torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12)  # float64 batched-vs-single rounding
        bad = km.clone()
        bad[0] = False
        with pytest.raises(ValueError, match="row 0 has no attendable key"):  # the trainer's own check
            train(make()[0], Batch(tokens, bad, bad, data.y), cfgs[0])
    finally:
        runtime._batched_check.cache_clear()


def _widths(monkeypatch) -> list[int]:
    """Record the padded length of every batch the analysed-head models see, alone or stacked."""
    seen, forward, stacked = [], HeadModel.forward, HeadModel.stacked_forward

    def spy(self, tokens, key_mask, attention=None):
        seen.append(tokens.shape[-1])
        return forward(self, tokens, key_mask, attention)

    def stacked_spy(self, params, buffers, tokens, key_mask):
        seen.append(tokens.shape[-1])
        return stacked(self, params, buffers, tokens, key_mask)

    monkeypatch.setattr(HeadModel, "forward", spy)
    monkeypatch.setattr(HeadModel, "stacked_forward", stacked_spy)
    return seen


def test_length_buckets_train_the_same_models_on_shorter_rows(monkeypatch):
    """A model that ignores left padding trains to the same weights and logs (float64 rounding) when each
    minibatch runs as groups of rows of similar length cut to their longest row, and its validation rows
    are cut the same way; those groups are shorter than the padded length."""
    cfgs = configs("adamw", eta_ov=0.005, log_every=10, log_subsample=None)
    plain = [token_model("FAFO", c.seed, copy=True) for c in cfgs]
    h_plain = train_stacked(plain, COPY_DATA, cfgs, val=copy_data(60, 1))
    seen = _widths(monkeypatch)
    bucketed = [token_model("FAFO", c.seed, copy=True) for c in cfgs]
    h_bucketed = train_stacked(bucketed, COPY_DATA, [TrainConfig(**{**c.__dict__, "length_buckets": 3}) for c in cfgs],
                               val=copy_data(60, 1))
    assert min(seen) < T, "no group was cut shorter than the padded length"
    for a, b, ha, hb in zip(plain, bucketed, h_plain, h_bucketed):
        assert _param_diff(a, b) < 1e-10
        assert [r["step"] for r in ha.records] == [r["step"] for r in hb.records]
        for ra, rb in zip(ha.records, hb.records):
            for k in ra:
                assert rb[k] == pytest.approx(ra[k], abs=1e-10), k


def test_predict_by_length_equals_padded_predict(monkeypatch):
    from qkov_lib.train import loop

    monkeypatch.setattr(loop, "EVAL_BUDGET", 3 * T * 6 * 10)  # chunks of 10 rows: the shortest are cut
    stack = loop.ModelStack([token_model("FAFO", s, copy=True) for s in (0, 1, 2)])
    data = copy_data(50, 2)
    a, p = stack.predict(data)
    seen = _widths(monkeypatch)
    a2, p2 = stack.predict(data, by_length=True)
    assert min(seen) < T
    torch.testing.assert_close(p2, p, rtol=0, atol=1e-12)
    torch.testing.assert_close(a2, a, rtol=0, atol=1e-12)  # rows in their own order, zero on the padding


def test_length_buckets_must_be_a_positive_integer_shared_by_a_stack():
    c = configs("adamw")[0]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="length_buckets"):
            TrainConfig(**{**c.__dict__, "length_buckets": bad})
    with pytest.raises(ValueError, match="differs from config 0 in 'length_buckets'"):
        train_stacked([token_model("FAFO", 0, copy=True)] * 2, COPY_DATA,
                      [c, TrainConfig(**{**c.__dict__, "length_buckets": 2})])


def test_a_stack_trains_in_its_configs_flush_mode_and_restores_the_callers(flush_supported):
    """Every optimizer step runs with subnormal floats flushed by default (``TrainConfig.flush_denormals``)
    or kept when the configs say so; the caller's mode is back afterwards; a stack's configs must agree."""
    for flush in (True, False):
        seen = []
        cfgs = [TrainConfig(**{**c.__dict__, "flush_denormals": flush}) for c in configs("adamw", steps=5)]
        train_stacked([token_model("FAFO", c.seed) for c in cfgs], DATA, cfgs,
                      on_step=lambda s: seen.append(runtime.flushing_denormals()))
        assert seen == [flush] * 5
        assert not runtime.flushing_denormals()
    c = configs("adamw")[0]
    with pytest.raises(ValueError, match="flush_denormals must be True or False"):
        TrainConfig(**{**c.__dict__, "flush_denormals": 1})
    with pytest.raises(ValueError, match="differs from config 0 in 'flush_denormals'"):
        train_stacked([token_model("FAFO", 0)] * 2, DATA, [c, TrainConfig(**{**c.__dict__, "flush_denormals": False})])
