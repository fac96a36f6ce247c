"""The base rate x ratio protocol: grid, trained-run filter, base-rate selection on validation,
paired changes, verdicts per map column and at the tuned base rate."""


import numpy as np
import pandas as pd
import pytest
import torch

from qkov_lib import claims as C
from qkov_lib import protocol as P
from qkov_lib.models import TokenModel
from qkov_lib.train import TrainConfig, evaluate


def test_grid_needs_ratio_one_and_base_rates():
    cells = P.grid(["adamw", "sgd"], {"adamw": [1e-3, 3e-3], "sgd": [0.1]}, [1, 10], [0, 1])
    assert len(cells) == (2 + 1) * 2 * 2 and cells[0] == P.Cell("adamw", 1e-3, 1.0, 0)
    with pytest.raises(ValueError, match="must include 1"):
        P.grid(["adamw"], {"adamw": [1e-3]}, [10], [0])
    with pytest.raises(ValueError, match="no base rates"):
        P.grid(["sgd"], {"adamw": [1e-3]}, [1], [0])


def _table(d_acc=0.0, d_attn=0.1, fail_seed=None, seeds=(0, 1, 2), jitter=0.0):
    """Runs of two adamw and one sgd column at ratios 1 and 10. At ratio 10 each metric moves by
    its effect times 1 + (+1, -1, +1, ...) * ``jitter`` / |d_attn| over the seeds, so attention
    moves by d_attn +- jitter: for an even number of seeds the paired changes keep the effect as
    their mean and get a spread."""
    rows = []
    for opt, etas in (("adamw", (1e-3, 1e-2)), ("sgd", (0.1,))):
        for eta in etas:
            for r in (1.0, 10.0):
                for s in seeds:
                    up = (r > 1) * (1 + jitter * (-1) ** s / max(abs(d_attn), 1e-9))
                    rows.append({"optimizer": opt, "eta_ov": eta, "ratio": r, "seed": s, "diverged": False,
                                 "val_accuracy": 0.9 - (0.5 if (fail_seed == s and up) else 0.0) + 0.01 * (eta == 1e-3),
                                 "accuracy": 0.8 + d_acc * up + 0.001 * s, "macro_f1": 0.7 + d_acc * up,
                                 "attn_relevant": 0.3 + d_attn * up + 0.001 * s,
                                 "AC@0.5": 0.2 + 2 * d_attn * up + 0.002 * s, "ACMC@0.5": 0.2 + 2 * d_attn * up,
                                 "sufficiency": 0.3 - d_attn * up})
    return pd.DataFrame(rows)


def test_trained_filter_and_selection_use_validation_only():
    t = _table(fail_seed=1)
    t["trained"] = P.trained(t, chance=0.5)
    assert int((~t["trained"]).sum()) == 3  # seed 1 at ratio 10 in each column
    assert P.select_base_rates(t) == {"adamw": 1e-3, "sgd": 0.1}
    f = P.failures(t)
    assert f.loc[(f.optimizer == "adamw") & (f.eta_ov == 1e-3) & (f.ratio == 10.0), "failed"].item() == 1
    ph = P.phase_table(t)
    row = ph[(ph.optimizer == "adamw") & (ph.eta_ov == 1e-3) & (ph.ratio == 10.0)].iloc[0]
    assert row["trained_runs"] == 2 and row["failure_rate"] == pytest.approx(1 / 3)
    assert row["d_attn_relevant"] == pytest.approx(0.1) and bool(row["d_attn_relevant_sig"])


def test_phase_table_counts_seed_pairs_and_rejects_a_bad_chance():
    t = _table(seeds=(0, 1, 2, 3), jitter=0.002).assign(trained=True)
    ph = P.phase_table(t).set_index(["optimizer", "eta_ov", "ratio"])
    row = ph.loc[("sgd", 0.1, 10.0)]
    assert row["d_attn_relevant_n"] == 4 and row["d_all_accuracy_n"] == 4 and row["d_all_macro_f1_n"] == 4
    # the four paired changes are 0.1 +- 0.002: mean 0.1, half-width t(0.975, 3) * 0.0023094 / 2 = 0.003675
    assert row["d_attn_relevant"] == pytest.approx(0.1, abs=1e-9)
    assert row["d_attn_relevant_ci"] == pytest.approx(3.182446 * 0.0023094 / 2, abs=1e-5)
    with pytest.raises(ValueError, match="chance must be an accuracy"):
        P.phase_table(t, chance=1.5)


def test_equal_validation_accuracy_is_broken_by_validation_loss():
    t = pd.DataFrame({"optimizer": "adamw", "eta_ov": [1e-4, 3e-4, 1e-3], "ratio": 1.0, "seed": 0, "trained": True,
                      "val_accuracy": [0.9, 0.97, 0.97], "val_loss": [0.2, 0.074, 0.070]})
    assert P.select_base_rates(t) == {"adamw": 1e-3}
    assert P.select_base_rates(t.assign(val_loss=[0.2, 0.07, 0.07])) == {"adamw": 3e-4}  # then the smaller rate
    assert P.select_base_rates(t.drop(columns="val_loss")) == {"adamw": 3e-4}


def test_a_rate_with_fewer_trained_seeds_does_not_win_the_selection():
    """1e-3: one of four seeds trained, with the best validation accuracy; 3e-4: all four
    trained, a little worse. The tuned rate is 3e-4 (MIN_SEEDS trained seeds); with the rule's
    minimum met by both, the better mean wins again."""
    rows = [{"optimizer": "sgd", "eta_ov": eta, "ratio": 1.0, "seed": s, "trained": eta == 3e-4 or s == 0,
             "val_accuracy": (0.95 if eta == 1e-3 else 0.9) if (eta == 3e-4 or s == 0) else 0.1}
            for eta in (3e-4, 1e-3) for s in range(4)]
    t = pd.DataFrame(rows)
    assert C.MIN_SEEDS == 3
    assert P.select_base_rates(t) == {"sgd": 3e-4}
    all_trained = t.assign(trained=True, val_accuracy=0.9 + 0.05 * (t["eta_ov"] == 1e-3))
    assert P.select_base_rates(all_trained) == {"sgd": 1e-3}


def test_failures_stay_visible_in_the_failure_counts():
    """Ratio 100 diverges in every seed: the failures are counted per ratio, not averaged in."""
    rows = []
    for r in (1.0, 10.0, 100.0):
        for s in (0, 1, 2):
            up = r > 1
            rows.append({"optimizer": "sgd", "eta_ov": 0.3, "ratio": r, "seed": s, "diverged": r == 100.0,
                         "val_accuracy": 0.9, "accuracy": 0.8, "macro_f1": 0.8, "attn_relevant": 0.3 + 0.2 * up,
                         "AC@0.5": 0.2 + 0.2 * up + 0.001 * s, "ACMC@0.5": 0.2 + 0.2 * up,
                         "sufficiency": 0.3 - 0.1 * up})
    t = pd.DataFrame(rows)
    t["trained"] = P.trained(t, chance=0.5)
    f = P.failures(t).set_index("ratio")
    assert f.loc[100.0, "failed"] == 3 and f.loc[10.0, "failed"] == 0


def _tiny_model(seed):
    return TokenModel(12, 8, 4, 8, parameterization="CACO", generator=torch.Generator().manual_seed(seed))


def _tiny_config(c):
    return TrainConfig(optimizer=c.optimizer, eta_ov=c.eta_ov, ratio=c.ratio, steps=60, batch_size=64, seed=c.seed,
                       n_logs=4, progress=False, patience=5)


def _tiny_measure(model, batch):
    return {k: v for k, v in evaluate(model, batch).items() if k in ("accuracy", "attn_relevant", "AC@0.5")}


def test_train_grid_on_a_tiny_task_learns_and_is_deterministic():
    train, val, test = P.synthetic_demo(n=300)
    cells = P.grid(["adamw"], {"adamw": [0.05]}, [1, 10], [0])
    a = P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure)
    b = P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure)
    pd.testing.assert_frame_equal(a, b)
    assert (a["val_accuracy"] > 0.5).all() and not a["diverged"].any()
    fig = P.plot_phase(P.phase_table(a.assign(trained=True), ["accuracy", "attn_relevant"]), ["accuracy"],
                       {"adamw": 0.05})
    assert fig.get_facecolor()[:3] == (1.0, 1.0, 1.0)


def test_train_grid_without_validation_keeps_histories_and_names_diverged_cells():
    """val None: no val_* columns and no early stopping; histories_out gets every run's history
    (also a diverged one, which has no metrics); raise_if_diverged names the diverged cell."""
    train, _, test = P.synthetic_demo(n=200)
    cells = [P.Cell("sgd", 0.5, 1.0, 0), P.Cell("sgd", 1e6, 1.0, 0)]  # the second diverges at once

    def config(c):
        return TrainConfig(optimizer="sgd", eta_ov=c.eta_ov, ratio=c.ratio, steps=30, batch_size=64, seed=c.seed,
                           n_logs=3, progress=False)

    hists, models = {}, {}
    f = P.train_grid(cells, _tiny_model, train, None, test, config, _tiny_measure, histories_out=hists,
                     models_out=models)
    assert not any(col.startswith("val_") for col in f.columns)
    assert f["diverged"].tolist() == [False, True] and set(models) == {cells[0]} and set(hists) == set(cells)
    assert hists[cells[0]].frame()["step"].iloc[-1] == 30 and hists[cells[1]].diverged_step is not None
    assert np.isnan(f.loc[1, "accuracy"]) and f.loc[0, "accuracy"] > 0.25
    with pytest.raises(RuntimeError, match=r"demo: training diverged .* at eta_ov 1e\+06 ratio 1 seed 0"):
        P.raise_if_diverged(f, "demo")
    P.raise_if_diverged(f.iloc[:1], "demo")  # nothing diverged: no error


def test_train_grid_monitors_on_the_monitor_rows_and_measures_on_the_whole_validation_split():
    """monitor: the logs and early stopping evaluate it (each logged val_loss is the loss on those rows),
    the final val_* columns are measured on all of val (they differ from the monitor's); in two processes
    the same numbers as in one."""
    train, val, test = P.synthetic_demo(n=300)
    watch = val.index(torch.arange(0, len(val), 3))
    cells = P.grid(["adamw"], {"adamw": [0.05]}, [1, 10], [0])
    hists, models = {}, {}
    # one thread, as each of the two processes below: the exact comparison must not meet another summation order
    f = P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure, histories_out=hists,
                     models_out=models, monitor=watch, threads=1)
    for c, row in zip(cells, f.itertuples()):
        m = models[c]
        assert row.val_attn_relevant == pytest.approx(evaluate(m, val)["attn_relevant"])
        assert row.val_attn_relevant != pytest.approx(evaluate(m, watch)["attn_relevant"])  # not the monitor's
        last = hists[c].records[-1]
        if hists[c].stop_step is None:  # trained to the end: the last log is of these weights
            assert last["val_loss"] == pytest.approx(evaluate(m, watch)["loss"])
    whole_h = {}
    P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure, histories_out=whole_h)
    for c in cells:  # without a monitor the logs are on all of val
        assert whole_h[c].records[-1]["val_loss"] != pytest.approx(hists[c].records[-1]["val_loss"])
    two = P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure, processes=2, monitor=watch)
    pd.testing.assert_frame_equal(f, two)


def test_profile_cells_read_the_optimizer_and_rate_through_train_config():
    cells = P.profile_cells({"optimizer": "adamw", "eta_ov": 1e-3, "steps": 5}, [1, 10], [0, 1])
    assert cells == [P.Cell("adamw", 1e-3, r, s) for r in (1.0, 10.0) for s in (0, 1)]
    assert P.profile_cells({}, [1], [0]) == [P.Cell("gd", 0.5, 1.0, 0)]  # TrainConfig's defaults
    with pytest.raises(ValueError, match="unknown optimizer"):
        P.profile_cells({"optimizer": "lion"}, [1], [0])


def _failing_measure(model, batch):
    raise ValueError("measure broke on purpose")


def test_train_grid_in_two_processes_gives_the_numbers_and_models_of_one_thread():
    """The two optimizers' stacks in two spawned processes: the same table and the same weights
    as one process on one thread (module-level callables: they are pickled to the workers)."""
    train, val, test = P.synthetic_demo(n=200)
    cells = P.grid(["adamw", "sgd"], {"adamw": [0.05], "sgd": [0.5]}, [1, 10], [0, 1])
    one_m, two_m = {}, {}
    one = P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure, models_out=one_m, threads=1)
    two = P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure, models_out=two_m,
                       processes=2)
    pd.testing.assert_frame_equal(one, two)
    assert set(one_m) == set(two_m) == set(cells)
    for c in cells:
        for (k, a), b in zip(one_m[c].state_dict().items(), two_m[c].state_dict().values()):
            assert torch.equal(a, b), (c, k)
    with pytest.raises(RuntimeError, match="measure broke on purpose"):
        P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _failing_measure, processes=2)
    with pytest.raises(ValueError, match="processes must be a positive integer"):
        P.train_grid(cells, _tiny_model, train, val, test, _tiny_config, _tiny_measure, processes=0)


def test_stack_units_deal_a_large_group_into_equal_stacks_with_every_rate_and_ratio():
    """36 cells of one optimizer (3 rates x 3 ratios x 4 seeds) in stacks of at most 18: two stacks of 18,
    each with all 9 (rate, ratio) pairs (seeds 0 and 2 in one, 1 and 3 in the other), so two processes
    get the same work; cut in order, the first stack would hold the lowest rates only."""
    cells = P.grid(["adamw", "sgd"], {"adamw": [1e-4, 1e-3, 1e-2], "sgd": [0.03, 0.3, 3.0]}, [1, 10, 100], [0, 1, 2, 3])
    units = P._stack_units(cells, 18)
    assert [(label, len(u)) for label, u in units] == [("adamw 1", 18), ("adamw 2", 18), ("sgd 1", 18), ("sgd 2", 18)]
    for _, u in units:
        assert len({(c.eta_ov, c.ratio) for c in u}) == 9
    assert {c.seed for c in units[0][1]} == {0, 2} and {c.seed for c in units[1][1]} == {1, 3}
    assert sorted(units[0][1] + units[1][1], key=cells.index) == cells[:36]  # every cell once
    # round-robin over two processes: each gets one stack of each optimizer
    assert [label for i, (label, _) in enumerate(units) if i % 2 == 0] == ["adamw 1", "sgd 1"]
    assert [len(u) for _, u in P._stack_units(cells[:19], 18)] == [10, 9]  # near-equal, not 18 + 1
    assert [len(u) for _, u in P._stack_units(cells, 64)] == [36, 36]
    with pytest.raises(ValueError, match="max_stack must be at least 1"):
        P._stack_units(cells, 0)


def test_a_collapse_at_the_highest_ratio_counts_for_every_run():
    """At ratio 100 no run trains (validation at chance) and the test accuracy falls to chance;
    one run diverges. The all-runs change (what R1 reads) sees every model, although no trained run
    could be compared there; a diverged run counts at chance only when ``chance`` is given."""
    rows = []
    for r in (1.0, 10.0, 100.0):
        for s in range(4):
            dead = r == 100.0
            rows.append({"optimizer": "sgd", "eta_ov": 0.3, "ratio": r, "seed": s, "diverged": dead and s == 0,
                         "val_accuracy": 0.5 if dead else 0.9, "accuracy": 0.25 + 0.001 * s if dead else 0.8,
                         "macro_f1": 0.1 if dead else 0.8, "attn_relevant": 0.3 + 0.1 * (r > 1) + 0.001 * s,
                         "AC@0.5": 0.2, "ACMC@0.5": 0.2, "sufficiency": 0.3})
    t = pd.DataFrame(rows)
    t["trained"] = P.trained(t, chance=0.5)
    ph = P.phase_table(t, chance=0.25).set_index("ratio")
    assert ph.loc[100.0, "d_accuracy_n"] == 0 and ph.loc[100.0, "d_all_accuracy_n"] == 4
    assert ph.loc[100.0, "d_all_macro_f1_n"] == 3  # the diverged run has no macro-F1
    assert ph.loc[100.0, "d_all_accuracy"] == pytest.approx(np.mean([-0.55, -0.549, -0.548, -0.547]), abs=1e-9)
    assert P.phase_table(t).set_index("ratio").loc[100.0, "d_all_accuracy_n"] == 3  # no chance: left out


def test_run_each_trains_every_setting_in_order():
    seen = []
    out = P.run_each(((r, s) for r in (1.0, 10.0) for s in (0, 1)), lambda r, s: seen.append((r, s)) or r * 10 + s,
                            "test grid", progress=False)
    assert out == [10.0, 11.0, 100.0, 101.0] and seen == [(1.0, 0), (1.0, 1), (10.0, 0), (10.0, 1)]


def _phase_frame(n_ratios=5):
    """A phase table of two optimizers x three base rates x ``n_ratios`` ratios whose changes
    span tiny, negative, large and missing values, with every other cell significant."""
    rng = np.random.default_rng(0)
    rows = []
    for opt in ("adamw", "sgd"):
        for eta in (1e-3, 3e-3, 1e-2):
            for k, r in enumerate([1.0, 3.0, 10.0, 30.0, 100.0, 300.0][:n_ratios]):
                acc = 0.0 if r == 1.0 else float(rng.choice([0.0004, -0.4567, 0.0321, 1.234, 12.5, np.nan]))
                rows.append({"optimizer": opt, "eta_ov": eta, "ratio": r, "d_accuracy": acc,
                             "d_accuracy_sig": k % 2 == 1, "d_attn_relevant": (3.0 if opt == "sgd" else 2e-4) * k,
                             "d_attn_relevant_sig": k % 2 == 0, "d_loss": -0.1 * k, "d_loss_sig": True})
    return pd.DataFrame(rows)


def test_phase_labels_are_short():
    assert P.phase_label(0.1234, True) == "+.12*" and P.phase_label(-0.05, False) == "-.05"
    assert P.phase_label(0.0004, False) == "0" and P.phase_label(float("nan"), True) == ""
    assert P.phase_label(1.234, False) == "+1.2" and P.phase_label(-12.5, True) == "-12*"
    values = np.concatenate([np.linspace(-20, 20, 4001), [0.995, -0.995, 9.5, -9.49, 0.005]])
    assert max(len(P.phase_label(v, True)) for v in values) <= P.PHASE_LABEL_CHARS


def test_phase_map_has_one_colour_bar_per_panel_and_labels_that_do_not_overlap():
    import matplotlib.pyplot as plt

    phase = _phase_frame()
    fig = P.plot_phase(phase, ["accuracy", "attn_relevant", "not_a_metric", "loss"], {"adamw": 3e-3})
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.axison]
    assert len(panels) == 2 * 3 and len(bars) == len(panels)  # two optimizers x three metrics
    assert len({round(ax.get_position().x0, 3) for ax in panels}) == P.PHASE_COLS  # panels to a row
    assert fig.get_facecolor()[:3] == (1.0, 1.0, 1.0)
    # each panel's colour scale is its own: symmetric, up to that panel's largest |change| (in
    # units of 10^k where the title says so)
    for ax in panels:
        opt, metric = ax.get_title().split(": Δ ")
        metric, _, unit = metric.partition(" (×$10^{")
        scale = 10.0 ** int(unit.split("}")[0]) if unit else 1.0
        lim = np.nanmax(np.abs(phase.loc[phase["optimizer"] == opt, f"d_{metric}"])) / scale
        assert ax.collections[0].get_clim() == pytest.approx((-lim, lim))
    tiny = next(ax for ax in panels if ax.get_title().startswith("adamw: Δ attn_relevant"))
    assert "10^{-4}" in tiny.get_title() and len({t.get_text() for t in tiny.texts}) > 2  # not all "0"
    labels = [t for ax in panels for t in ax.texts]
    assert labels and max(len(t.get_text()) for t in labels) <= P.PHASE_LABEL_CHARS
    assert any(t.get_text().endswith("*") for t in labels)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in panels:
        boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text()]
        overlaps = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
        assert not overlaps, f"{ax.get_title()}: cell labels overlap"
        cell_w = ax.get_window_extent(renderer).width / len(ax.get_xticks())
        assert max(b.width for b in boxes) < cell_w, f"{ax.get_title()}: a label is wider than its cell"
    plt.close(fig)


def _seeded_draw(seed: int, n: int) -> list[float]:
    """A run that seeds itself; reports the torch threads it ran on last."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64).tolist() + [torch.get_num_threads()]


def _fails_on_two(x: int) -> int:
    if x == 2:
        raise ValueError("two is a bad setting")
    return x


def test_run_each_in_two_processes_returns_every_run_in_order_each_on_one_thread():
    settings = [(s, 3) for s in range(5)]
    one = P.run_each(settings, _seeded_draw, "draws", progress=False)
    two = P.run_each(settings, _seeded_draw, "draws", progress=False, processes=2)
    assert [r[:-1] for r in two] == [r[:-1] for r in one] and {r[-1] for r in two} == {1}
    with pytest.raises(RuntimeError, match="two is a bad setting"):
        P.run_each([(1,), (2,), (3,)], _fails_on_two, "bad", progress=False, processes=2)
    with pytest.raises(ValueError, match="processes must be a positive integer"):
        P.run_each(settings, _seeded_draw, "draws", processes=0)


def test_a_worker_that_dies_while_starting_is_an_error_not_a_hang(tmp_path):
    """A script without an ``if __name__ == "__main__"`` guard: each spawned worker runs the script again
    and dies while starting. With settings too large for a pipe's buffer (a list of 200,000 numbers,
    about 1 MB pickled) the parent still reports the dead worker instead of waiting for it forever."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from qkov_lib import protocol\n"
                      "big = list(range(200_000))\n"
                      "print(protocol.run_each([(big,), (big,)], len, 'lengths', progress=False, processes=2))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    assert "a training process died with exit code" in run.stderr, run.stderr[-2000:]
