"""The batched engine must train exactly like the one-at-a-time trainer."""

import itertools

import pytest
import torch

from qkov_lib.train import engine
from qkov_lib.data import synthetic as syn
from qkov_lib.metrics import DEFAULT_TAUS, dtap_histogram, relevant_mass, confidence
from qkov_lib.models import PARAMETERIZATIONS, SyntheticModel, TokenModel
from qkov_lib.train import NonFiniteError, TrainConfig, evaluate, predict, train

TASK = syn.SyntheticTask(n_classes=3, n_common_vocab=2, n_common=(2, 3))
GAUSS = syn.SyntheticTask(n_classes=3, n_common_vocab=3, n_common=(1, 3), embedding="gaussian", d_model=5)
GRID = [(0.3, 0), (4.0, 1)]  # (ratio, seed)
OPTS = {"gd": dict(eta_ov=0.5), "adamw": dict(eta_ov=0.03), "sgd": dict(eta_ov=0.4, batch_size=7, momentum=0.9)}


def _model(name, seed, task=TASK, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    E = syn.make_embeddings(task, g, torch.float64)
    return SyntheticModel(E, task.n_classes, parameterization=name, init_scale=scale, generator=g, dtype=torch.float64)


def _cfg(opt, ratio, seed, steps=30, **kw):
    return TrainConfig(optimizer=opt, ratio=ratio, seed=seed, steps=steps, n_logs=8, progress=False,
                       **{**OPTS[opt], **kw})


def _assert_same(ref_models, ref_hists, models, hists):
    for a, b in zip(ref_models, models):
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert na == nb
            torch.testing.assert_close(pb, pa, rtol=1e-9, atol=1e-11)
    for h, g in zip(ref_hists, hists):
        fa, fb = h.frame(), g.frame()
        assert list(fa.columns) == list(fb.columns[: len(fa.columns)])
        assert fa["step"].tolist() == fb["step"].tolist()
        torch.testing.assert_close(torch.tensor(fb[fa.columns].to_numpy()), torch.tensor(fa.to_numpy()),
                                   rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("name", PARAMETERIZATIONS)
def test_batched_equals_loop(name, opt):
    data = syn.population(TASK) if opt != "sgd" else syn.sample(TASK, 30, torch.Generator().manual_seed(5))
    cfgs = [_cfg(opt, r, s) for r, s in GRID]
    ref = [_model(name, s) for _, s in GRID]
    ref_h = [train(m, data, c) for m, c in zip(ref, cfgs)]
    ms = [_model(name, s) for _, s in GRID]
    hs = engine.train_batched(ms, data, cfgs)
    _assert_same(ref, ref_h, ms, hs)
    assert all(h.stop_step is None and h.diverged_step is None for h in hs)


def test_float32_models():
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    E = syn.make_embeddings(TASK, dtype=torch.float32)
    mk = lambda s: SyntheticModel(E, 3, parameterization="FAFO", init_scale=0.1, generator=g(s))  # noqa: E731
    data = syn.population(TASK)
    cfgs = [_cfg("gd", r, s) for r, s in GRID]
    ref, ms = [mk(s) for _, s in GRID], [mk(s) for _, s in GRID]
    for m, c in zip(ref, cfgs):
        train(m, data, c)
    engine.train_batched(ms, data, cfgs)
    for a, b in zip(ref, ms):
        for p, q in zip(a.parameters(), b.parameters()):
            assert q.dtype == torch.float32
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    alpha, probs = engine.predict_bag(engine.Stack(ms), engine.bag_of(data, E.shape[0]))
    logits, _ = engine.Stack(ms).forward(engine.bag_of(data, E.shape[0]))
    assert logits.dtype == torch.float32 and bool(torch.isfinite(probs).all())


def test_gaussian_embeddings_and_per_model_data():
    """Each seed has its own (non-orthogonal) embeddings and its own training sample."""
    names = ["FAFO", "CACO"]
    grid = list(itertools.product(names, [1.0, 10.0], [0, 1]))
    datas = {s: syn.sample(GAUSS, 40, torch.Generator().manual_seed(100 + s)) for s in (0, 1)}
    cfgs = [_cfg("sgd", r, s, steps=25) for _, r, s in grid]
    ref = [_model(p, s, GAUSS) for p, _, s in grid]
    ref_h = [train(m, datas[s], c) for m, c, (_, _, s) in zip(ref, cfgs, grid)]
    ms = [_model(p, s, GAUSS) for p, _, s in grid]
    hs = engine.train_batched(ms, [datas[s] for _, _, s in grid], cfgs)
    _assert_same(ref, ref_h, ms, hs)


def test_bag_forward_matches_model_on_positions():
    """Random positions, repeated common tokens, and the query as a key: the bag view is exact."""
    task = syn.SyntheticTask(n_classes=3, n_common_vocab=2, n_common=(1, 4), query_is_key=True)
    data = syn.sample(task, 50, torch.Generator().manual_seed(2))
    for name in PARAMETERIZATIONS:
        m = _model(name, 3, task, scale=0.8)
        stack = engine.Stack([m])
        bag = engine.bag_of(data, stack.E.shape[1])
        logits, alpha = stack.forward(bag)
        ref_logits, ref_attn = m(data.tokens, data.key_mask)
        torch.testing.assert_close(logits[0], ref_logits)
        a_ref = relevant_mass(ref_attn, data.relevant)
        torch.testing.assert_close((alpha[0] * bag.relevant).sum(-1), a_ref)
        # the attention on each occurrence equals the model's attention at that position
        torch.testing.assert_close(alpha[0].gather(1, data.tokens) * data.key_mask, ref_attn)


@pytest.mark.parametrize("name", PARAMETERIZATIONS)
def test_closed_form_gradient_matches_autograd(name):
    data = syn.population(TASK)
    m = _model(name, 1, scale=0.7)
    stack = engine.Stack([m, _model(name, 2, scale=0.7)])
    bag = engine.bag_of(data, stack.E.shape[1])
    loss = stack.loss_backward(bag)
    fast = {n: p.grad.clone() for n, p in stack.params.items()}
    for p in stack.params.values():
        p.grad = None
    ref = stack.losses(bag)
    ref.sum().backward()
    torch.testing.assert_close(loss, ref.detach())
    for n, p in stack.params.items():
        torch.testing.assert_close(fast[n], p.grad)


def test_summary_matches_library_metrics():
    data = syn.sample(TASK, 80, torch.Generator().manual_seed(8))
    ms = [_model(p, s, scale=0.9) for p in ("FACO", "CAFO") for s in (0, 1)]
    rows, hists = engine.evaluate_models(ms, data)
    for m, row, h in zip(ms, rows, hists):
        ref = evaluate(m, data, DEFAULT_TAUS)
        assert set(ref) == set(row)
        for k in ref:
            assert row[k] == pytest.approx(ref[k], abs=1e-12), k
        attn, probs = predict(m, data)
        ref_h = dtap_histogram(relevant_mass(attn, data.relevant), confidence(probs, data.y))
        torch.testing.assert_close(h, ref_h)


def test_deterministic():
    data = syn.population(TASK)
    cfgs = [_cfg("adamw", r, s) for r, s in GRID]
    runs = []
    for _ in range(2):
        ms = [_model("FAFO", s) for _, s in GRID]
        runs.append((engine.train_batched(ms, data, cfgs), ms))
    # exact: the same code on the same seeds and thread count twice
    for h1, h2 in zip(runs[0][0], runs[1][0]):
        assert h1.frame().equals(h2.frame())
    for a, b in zip(runs[0][1], runs[1][1]):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_stop_loss_freezes_each_model_where_it_reaches_the_target():
    data = syn.population(TASK)
    cfgs = [_cfg("gd", r, s, steps=300) for r, s in GRID]
    ms = [_model("CACO", s) for _, s in GRID]
    target = 0.3
    hs = engine.train_batched(ms, data, cfgs, stop_loss=target)
    for h, (r, s), m in zip(hs, GRID, ms):
        f = h.frame()
        assert h.stop_step is not None and f["step"].iloc[-1] == h.stop_step
        assert f["loss"].iloc[-1] <= target < f["loss"].iloc[-2]
        # the frozen weights are those of an ordinary run of exactly stop_step steps
        ref = _model("CACO", s)
        hist = train(ref, data, _cfg("gd", r, s, steps=h.stop_step))
        assert hist.records[-2]["loss"] > target or h.stop_step <= 1
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)
    # snapshot_loss: the same weights and step, and training goes on to the end; a ladder of
    # levels snapshots each one where a stop_loss run at that level would have stopped
    ms2 = [_model("CACO", s) for _, s in GRID]
    hs2 = engine.train_batched(ms2, data, cfgs, snapshot_loss=[0.6, target])
    hs_hi = engine.train_batched([_model("CACO", s) for _, s in GRID], data, cfgs, stop_loss=0.6)
    for h, h_hi, h2, m, m2, (r, s), c in zip(hs, hs_hi, hs2, ms, ms2, GRID, cfgs):
        assert sorted(h2.snapshots) == [target, 0.6] and h2.frame()["step"].iloc[-1] == 300
        snap = h2.snapshots[target]
        assert snap.step == h.stop_step and h2.snapshots[0.6].step == h_hi.stop_step < snap.step
        assert snap.record["loss"] == pytest.approx(h.records[-1]["loss"], abs=1e-12)
        for n, p in m.attention.named_parameters():
            torch.testing.assert_close(snap.weights[n], p, rtol=1e-9, atol=1e-11)
        ref = _model("CACO", s)
        train(ref, data, c)
        for p, q in zip(m2.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)


def test_nonfinite_raise_names_model_and_freeze_keeps_others():
    data = syn.population(TASK)
    grid = [(1.0, 0), (1e300, 1)]
    cfgs = [_cfg("gd", r, s, steps=40) for r, s in grid]
    with pytest.raises(NonFiniteError, match=r"at step \d+.* model 1 \(CACO, ratio=1e\+300, seed=1\)"):
        engine.train_batched([_model("CACO", s) for _, s in grid], data, cfgs)
    ms = [_model("CACO", s) for _, s in grid]
    hs = engine.train_batched(ms, data, cfgs, on_nonfinite="freeze")
    assert hs[0].diverged_step is None and hs[1].diverged_step is not None
    rows, dtaps = engine.evaluate_models(ms, data)  # the diverged model evaluates to NaN, no crash
    assert rows[1]["loss"] != rows[1]["loss"] and bool(torch.isnan(dtaps[1]).all())
    assert bool(torch.isfinite(dtaps[0]).all())
    ref = _model("CACO", 0)
    train(ref, data, cfgs[0])
    for p, q in zip(ms[0].parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)


def test_mixed_grid_keeps_input_order():
    """Interleaved parameterizations in one batch per task, each model back in its place."""
    grid = [("CACO", 1.0, 0, TASK), ("FAFO", 2.0, 0, GAUSS), ("CACO", 3.0, 1, TASK), ("FACO", 1.0, 1, TASK),
            ("CAFO", 5.0, 2, GAUSS)]
    datas = [syn.population(t) for *_, t in grid]
    cfgs = [_cfg("gd", r, s, steps=10) for _, r, s, _ in grid]
    ms = [_model(p, s, t) for p, _, s, t in grid]
    hs = [None] * len(grid)
    for task in (TASK, GAUSS):
        idx = [k for k, g in enumerate(grid) if g[3] is task]
        for k, h in zip(idx, engine.train_batched([ms[k] for k in idx], [datas[k] for k in idx], [cfgs[k] for k in idx])):
            hs[k] = h
    for (p, r, s, t), h, m, d in zip(grid, hs, ms, datas):
        assert h.config["ratio"] == r and m.attention.param.name == p
        ref = _model(p, s, t)
        train(ref, d, _cfg("gd", r, s, steps=10))
        for a, b in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_clear_errors():
    data = syn.population(TASK)
    c = _cfg("gd", 1.0, 0)
    with pytest.raises(ValueError, match="batch only models of one task"):
        engine.train_batched([_model("CACO", 0), _model("CACO", 0, GAUSS)], data, c)
    with pytest.raises(TypeError, match="SyntheticModel only"):
        engine.train_batched([TokenModel(5, 4, 2, 6)], data, c)
    with pytest.raises(ValueError, match="differs from config 0 in 'steps'"):
        engine.train_batched([_model("CACO", 0)] * 2, data, [c, _cfg("gd", 1.0, 0, steps=5)])
    with pytest.raises(ValueError, match="full-batch"):
        engine.train_batched([_model("CACO", 0)], syn.sample(TASK, 20, torch.Generator().manual_seed(0)),
                             _cfg("sgd", 1.0, 0), stop_loss=0.1)
    with pytest.raises(ValueError, match="stop_loss must be"):
        engine.train_batched([_model("CACO", 0)], data, c, stop_loss=-1.0)
    with pytest.raises(ValueError, match="snapshot_loss must be"):
        engine.train_batched([_model("CACO", 0)], data, c, snapshot_loss=float("nan"))
    with pytest.raises(ValueError, match="snapshot_loss must be"):
        engine.train_batched([_model("CACO", 0)], data, c, snapshot_loss=[0.5, -1.0])
    with pytest.raises(ValueError, match="stop_loss must be a finite number > 0, got"):
        engine.train_batched([_model("CACO", 0)], data, c, stop_loss=[0.5])
    with pytest.raises(ValueError, match="on_nonfinite"):
        engine.train_batched([_model("CACO", 0)], data, c, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="got 1 data sets for 2 models"):
        engine.train_batched([_model("CACO", 0), _model("CACO", 1)], [data], c)
    with pytest.raises(ValueError, match="same number of sequences"):
        engine.train_batched([_model("CACO", 0), _model("CACO", 1)],
                             [syn.sample(TASK, n, torch.Generator().manual_seed(0)) for n in (5, 6)],
                             _cfg("sgd", 1.0, 0))
    with pytest.raises(ValueError, match="token ids"):
        engine.bag_of(data, 3)
    with pytest.raises(TypeError, match="TrainConfig"):
        engine.train_batched([_model("CACO", 0)], data, [dict(steps=3)])


def test_sweep_cells_equal_the_synthetic_chapter_runs():
    """A sweep cell (batched engine, shared builder) equals exp.train_one (the loop)."""
    from qkov_lib.studies import synthetic_sweeps
    from qkov_lib.studies import synthetic as exp
    from qkov_lib.profiles import resolve

    # train_one logs with TrainConfig's default n_logs (40)
    cfg = resolve(synthetic_sweeps.PROFILES, "test", parameterizations=["FAFO", "CAFO"], ratios=[1.0, 10.0], seeds=[3],
                  steps=25, n_logs=40)
    runs = synthetic_sweeps.run_grid(cfg).runs
    for r in runs:
        ref = exp.train_one(synthetic_sweeps.task_of(cfg), r.parameterization, r.ratio, r.seed, cfg, torch.device("cpu"))
        for k, v in ref.test.items():
            assert r.test[k] == pytest.approx(v, abs=1e-10), k
        torch.testing.assert_close(torch.tensor(r.dtap), torch.tensor(ref.dtap))
        fa, fb = ref.history.frame(), r.history.frame()
        torch.testing.assert_close(torch.tensor(fb[fa.columns].to_numpy()), torch.tensor(fa.to_numpy()),
                                   rtol=1e-9, atol=1e-11)
        assert r.test["diverged"] == 0.0  # a 0/1 flag


def test_sweep_helpers():
    from qkov_lib.studies import synthetic_sweeps

    assert synthetic_sweeps.s2_match(["FACO", "CACO"]) == "A" and synthetic_sweeps.s2_match(["CACO", "CAFO"]) == "B"
    assert synthetic_sweeps.s2_match(["FAFO", "CACO"]) == "neither"
    assert synthetic_sweeps.s2_verdict(["CACO", "FACO"], ["FACO", "CACO"]) == "A"
    assert synthetic_sweeps.s2_verdict(["CACO", "FACO"], ["CAFO", "CACO"]) == "mixed"
    h = torch.zeros(10, 10).numpy()
    h[2, 7], h[9, 9] = 0.25, 0.75  # weak attention + confident, and the top-right corner
    assert synthetic_sweeps.weak_attention_confident(h) == pytest.approx(0.25)
    g = torch.zeros(10, 10).numpy()
    g[9, 9] = 1.0
    assert synthetic_sweeps.dtap_distance(h, g) == pytest.approx(0.25) and synthetic_sweeps.dtap_distance(g, g) == 0.0  # exact: |x - x| = 0
    with pytest.raises(ValueError, match="unknown settings"):
        synthetic_sweeps.variant_cfg(synthetic_sweeps.PROFILES["test"], {"name": "x", "n_comon": [2]})


def test_thread_setting_is_restored():
    old = torch.get_num_threads()
    with engine.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == old
    with pytest.raises(ValueError, match="threads must be"):
        with engine.torch_threads(0):
            pass
    assert torch.get_num_threads() == old


def test_the_batched_engine_trains_in_its_configs_flush_mode(monkeypatch, flush_supported):
    """train_batched flushes subnormal floats while it trains when its configs say so (the default),
    keeps them otherwise, and gives the caller's mode back."""
    from qkov_lib import runtime

    seen = []
    real = engine.predict_bag
    monkeypatch.setattr(engine, "predict_bag", lambda *a: seen.append(runtime.flushing_denormals()) or real(*a))
    data = syn.population(TASK)
    for flush in (True, False):
        seen.clear()
        engine.train_batched([_model("CACO", 0)], data, [_cfg("gd", 1.0, 0, steps=5, flush_denormals=flush)],
                             progress=False)
        assert seen and set(seen) == {flush}
        assert not runtime.flushing_denormals()


def test_a_grid_that_stops_early_finishes_its_progress_bar_saying_so(capsys):
    data = syn.population(TASK)
    ms = [_model("CACO", s) for s in (0, 1)]
    engine.train_batched(ms, data, [_cfg("gd", 1.0, s, steps=50) for s in (0, 1)], stop_loss=10.0, progress=True,
                         desc="early")
    err = capsys.readouterr().err
    assert "early: stopped early at step 1" in err and "1/1" in err  # shown complete, not frozen at 1 of 50
    engine.train_batched([_model("CACO", 0)], data, [_cfg("gd", 1.0, 0, steps=5)], progress=True, desc="full")
    assert "stopped early" not in capsys.readouterr().err


def test_loss_rises_count_steps_where_the_full_batch_loss_went_up():
    """A cell known to pass through GD's unstable phase at eta_QK = 50 (FAFO, seed 4, ratio 100 of
    the cpu profile) raises its full-batch loss at some steps; the same cell at the stable eta_QK
    of the profile (eta_OV lowered, steps scaled to the same training time) never does."""
    from qkov_lib.studies import synthetic_sweeps as S
    from qkov_lib.profiles import resolve

    cfg = resolve(S.PROFILES, "cpu", seeds=[4], parameterizations=["FAFO"], ratios=[100.0])
    wild = S.run_grid(cfg, steps=300).runs[0].test
    calm = S.run_grid(cfg, steps=300, eta_qk_max=cfg["eta_qk_stable"]).runs[0].test
    assert wild["eta_qk"] == 50.0 and wild["loss_rises"] > 0
    assert calm["eta_qk"] == cfg["eta_qk_stable"] and calm["steps"] == 3000 and calm["loss_rises"] == 0


def test_sweep_grid_freezes_a_diverging_run_or_raises_and_names_its_training_set():
    from qkov_lib.profiles import resolve
    from qkov_lib.studies import synthetic as exp
    from qkov_lib.studies import synthetic_sweeps

    cfg = resolve(exp.PROFILES, "test", parameterizations=["FAFO"], ratios=[1.0], steps=15, eta_ov=1e6)
    runs = synthetic_sweeps.run_grid(cfg).runs  # default: frozen and flagged, the sweep goes on
    assert [r.test["diverged"] for r in runs] == [1.0]
    with pytest.raises(NonFiniteError, match="at step"):
        synthetic_sweeps.run_grid(cfg, on_nonfinite="raise")
    ok = synthetic_sweeps.run_grid({**cfg, "eta_ov": 0.5}).runs
    assert [r.train_set for r in ok] == ["exact population"]
    sampled = synthetic_sweeps.run_grid({**cfg, "eta_ov": 0.5, "train_data": "sample", "n_train": 300}).runs
    assert [r.train_set for r in sampled] == ["i.i.d. sample of 300"]


def test_per_model_probes_log_in_the_engine_what_they_log_in_the_loop():
    from qkov_lib.studies.reduction import _probe

    # FAFO has conserved quantities for both circuits, CACO for none: the probes' keys differ
    names = ["FAFO", "CACO", "FACO"]
    ref = [_model(n, s) for n, s in zip(names, (0, 1, 2))]
    cfgs = [_cfg("gd", r, s) for r, s in zip((1.0, 10.0, 3.0), (0, 1, 2))]
    data = syn.population(TASK)
    ref_hists = [train(m, data, c, probe=_probe(TASK, m.E, 0.1, 0.1)) for m, c in zip(ref, cfgs)]
    models = [_model(n, s) for n, s in zip(names, (0, 1, 2))]
    probe = engine.per_model_probe(models, [_probe(TASK, m.E, 0.1, 0.1) for m in models])
    hists = engine.train_batched(models, data, cfgs, probe=probe)
    _assert_same(ref, ref_hists, models, hists)
    for h, g in zip(ref_hists, hists):
        assert set(g.frame().columns) == set(h.frame().columns)  # a key a probe lacks is not logged for it
    assert "drift_qk" in hists[0].frame() and "drift_qk" not in hists[1].frame()
    with pytest.raises(ValueError, match="2 probes for 3 models"):
        engine.per_model_probe(models, [_probe(TASK, m.E, 0.1, 0.1) for m in models[:2]])


def test_the_progress_bar_stays_on_screen_only_when_asked(capsys):
    data = syn.population(TASK)

    def last_frame(leave: bool) -> str:
        engine.train_batched([_model("FAFO", 0)], data, [_cfg("gd", 1.0, 0, steps=12)], progress=True, leave=leave,
                             desc="leave test")
        return capsys.readouterr().err.rstrip("\n").split("\r")[-1]

    assert "leave test" in last_frame(True) and "12/12" in last_frame(True)
    assert last_frame(False).strip() == ""  # cleared: a sweep's many stacks leave no bars behind
