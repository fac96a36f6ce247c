import pytest
import torch

from qkov_lib.data import synthetic as syn
from qkov_lib.studies import synthetic as exp
from qkov_lib.models import SyntheticModel
from qkov_lib.profiles import resolve
from qkov_lib.train import NonFiniteError, TrainConfig, log_schedule, log_steps, train

TASK = syn.SyntheticTask(n_classes=3, n_common_vocab=2, n_common=(2, 3))


def _model(name="CACO", seed=0, scale=0.1):
    E = syn.make_embeddings(TASK, dtype=torch.float64)
    return SyntheticModel(E, 3, parameterization=name, init_scale=scale, generator=torch.Generator().manual_seed(seed))


def test_log_steps():
    s = log_steps(1000, 20)
    assert s[0] == 0 and s[-1] == 1000 and s == sorted(set(s))
    assert len(s) <= 21
    assert log_schedule(TrainConfig(steps=1000, n_logs=20)) == s
    assert log_schedule(TrainConfig(steps=25, log_every=10)) == [0, 10, 20, 25]


@pytest.mark.parametrize("opt, bs", [("gd", None), ("sgd", 16), ("adamw", 16)])
def test_training_reduces_loss_and_is_deterministic(opt, bs):
    data = syn.population(TASK) if bs is None else syn.sample(TASK, 200, torch.Generator().manual_seed(1))
    eta = 0.05 if opt == "adamw" else 1.0
    cfg = TrainConfig(optimizer=opt, eta_ov=eta, ratio=3.0, steps=60, batch_size=bs, progress=False, seed=4)
    h1 = train(_model(), data, cfg).frame()
    h2 = train(_model(), data, cfg).frame()
    assert h1.equals(h2)  # same seed, same machine, same numbers
    assert h1["loss"].iloc[-1] < 0.7 * h1["loss"].iloc[0]


def test_gd_step_matches_manual_update():
    data = syn.population(TASK)
    m = _model("FAFO")
    ref = _model("FAFO")
    train(m, data, TrainConfig(eta_ov=0.3, ratio=5.0, steps=1, progress=False))
    logits, _ = ref(data.tokens, data.key_mask)
    loss = (torch.nn.functional.cross_entropy(logits, data.y, reduction="none") * data.weight).sum()
    loss.backward()
    a, b = ref.attention, m.attention
    torch.testing.assert_close(b.W_Q, a.W_Q - 1.5 * a.W_Q.grad)   # eta_qk = 0.3 * 5
    torch.testing.assert_close(b.W_O, a.W_O - 0.3 * a.W_O.grad)


def test_nan_names_step_and_group():
    data = syn.population(TASK)
    m = _model()
    with torch.no_grad():
        m.attention.W_QK[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 0"):
        train(m, data, TrainConfig(steps=3, progress=False))
    # a NaN that appears mid-training, in the QK gradient of the third step
    m = _model("FACO")
    calls = []
    m.attention.W_Q.register_hook(lambda g: g * (float("nan") if calls.append(1) or len(calls) == 3 else 1.0))
    with pytest.raises(NonFiniteError, match=r"gradient at step 2 in parameter group 'qk' \(tensor attention.W_Q\)"):
        train(m, data, TrainConfig(steps=10, progress=False))


def test_nonfinite_gradient_names_the_group():
    data = syn.population(TASK)
    m = _model()
    m.attention.W_OV.register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteError, match=r"gradient at step 0 in parameter group 'ov'"):
        train(m, data, TrainConfig(steps=3, progress=False))


@pytest.mark.parametrize("kw, msg", [(dict(optimizer="lbfgs"), "unknown optimizer"), (dict(eta_ov=-1.0), "eta_ov"),
                                     (dict(ratio=0.0), "ratio"), (dict(steps=0), "steps"),
                                     (dict(optimizer="gd", batch_size=8), "full-batch")])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**kw)


def test_chapter_grid_is_deterministic():
    from qkov_lib.studies import synthetic_sweeps

    cfg = resolve(exp.PROFILES, "test", parameterizations=["FAFO"], ratios=[1.0, 10.0], steps=20)
    a = exp.runs_frame(synthetic_sweeps.run_grid(cfg, on_nonfinite="raise").runs)
    b = exp.runs_frame(synthetic_sweeps.run_grid(cfg, on_nonfinite="raise").runs)
    assert set(a["train_set"]) == {"exact population"}
    assert a.equals(b)  # exact: same seed, same code, same thread count
    # the knob matters: the QK-faster run puts more attention on the distinct token
    assert a.loc[a.ratio == 10.0, "attn_relevant"].item() > a.loc[a.ratio == 1.0, "attn_relevant"].item()


def test_train_config_from_profile_takes_the_profile_fields_and_the_run_wins():
    prof = {"optimizer": "sgd", "eta_ov": 1, "steps": 40.0, "batch_size": 8, "ratios": [1, 10], "seeds": [0, 1],
            "n_train": 500}
    c = TrainConfig.from_profile(prof, ratio=10, seed=3, steps=20)
    assert (c.optimizer, c.eta_ov, c.ratio, c.seed, c.steps, c.batch_size) == ("sgd", 1.0, 10.0, 3, 20, 8)
    assert isinstance(c.eta_ov, float) and isinstance(TrainConfig.from_profile(prof).steps, int)
    assert TrainConfig.from_profile(prof) == TrainConfig(optimizer="sgd", eta_ov=1.0, steps=40, batch_size=8)
    with pytest.raises(TypeError, match=r"no field\(s\) \['ratios'\]"):
        TrainConfig.from_profile(prof, ratios=[1])
    with pytest.raises(ValueError, match="ratio"):
        TrainConfig.from_profile(prof, ratio=-1.0)
