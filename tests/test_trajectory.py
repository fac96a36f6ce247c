"""Attention over training: the logged threshold metrics and their relevant-row restriction, the
crossing reader, matched loss levels, the seed-paired changes at matched loss and the figure."""

import math

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch

from qkov_lib import protocol as P
from qkov_lib.data.batch import Batch
from qkov_lib.metrics import summarize
from qkov_lib.models import TokenModel
from qkov_lib.studies import trajectory as tj
from qkov_lib.train import History, TrainConfig, predict, train_stacked


def _model(seed):
    return TokenModel(12, 8, 4, 8, parameterization="CACO", generator=torch.Generator().manual_seed(seed))


def _cfg(ratio, steps=40):
    return TrainConfig(optimizer="adamw", eta_ov=0.05, ratio=ratio, steps=steps, batch_size=64, seed=0, n_logs=3,
                       progress=False)


# --- logged metrics ----------------------------------------------------------------------------
def test_logged_thresholds_equal_summarize_of_the_trained_model():
    """Two models in one stack with taus=(0.5,): the last record's val_AC@0.5 / val_ACMC@0.5 /
    val_attn_relevant / val_loss are summarize of each trained model recomputed on the split."""
    train, val, _ = P.synthetic_demo(n=300)
    models = [_model(0), _model(0)]
    hists = train_stacked(models, train, [_cfg(1.0), _cfg(10.0)], val=val, taus=(0.5,))
    for m, h in zip(models, hists):
        last = h.final
        assert last["step"] == 40 and "val_AC@0.5" in last and "AC@0.5" in last
        attn, probs = predict(m, val)
        want = summarize(attn, probs, val.relevant, val.y, (0.5,))
        for k in ("AC@0.5", "ACMC@0.5", "attn_relevant", "loss", "accuracy"):
            assert last[f"val_{k}"] == pytest.approx(want[k], abs=1e-9), k
    assert hists[1].final["val_AC@0.5"] != hists[1].records[0]["val_AC@0.5"]  # it moved during training
    plain = train_stacked([_model(0)], train, _cfg(1.0, steps=2), val=val)[0]
    assert not any(k.startswith(("val_AC@", "AC@")) for k in plain.final)  # none unless asked for


def test_rows_without_a_relevant_token_do_not_dilute_the_logged_attention():
    """Half the validation rows lose their relevant token (as HateXplain's 'normal' posts): the
    logged attention metrics are those of the other half, loss and accuracy still of every row."""
    train, val, _ = P.synthetic_demo(n=300)
    relevant = val.relevant.clone()
    relevant[: len(val) // 2] = False
    val = Batch(val.tokens, val.key_mask, relevant, val.y)
    has = relevant.any(1)
    for models, cfgs in (([_model(1)], [_cfg(1.0, 10)]), ([_model(1), _model(1)], [_cfg(1.0, 10), _cfg(10.0, 10)])):
        hists = train_stacked(models, train, cfgs, val=val, taus=(0.5,))
        for m, h in zip(models, hists):
            attn, probs = predict(m, val)
            sub = summarize(attn[has], probs[has], relevant[has], val.y[has], (0.5,))
            every = summarize(attn, probs, relevant, val.y, (0.5,))
            last = h.final
            for k in ("attn_relevant", "AC@0.5", "ACMC@0.5", "FTPT"):
                assert last[f"val_{k}"] == pytest.approx(sub[k], abs=1e-9), k
            assert last["val_loss"] == pytest.approx(every["loss"], abs=1e-9)
            assert last["val_accuracy"] == pytest.approx(every["accuracy"], abs=1e-9)
            # the test can fail: over every row the mass would be about half as large
            assert every["attn_relevant"] < 0.7 * last["val_attn_relevant"]


def test_train_grid_passes_the_thresholds_to_the_logged_records():
    train, val, test = P.synthetic_demo(n=150)
    cells = [P.Cell("adamw", 0.05, 1.0, 0)]
    hists = {}
    P.train_grid(cells, _model, train, val, test, lambda c: _cfg(c.ratio, 4),
                 lambda m, b: {"accuracy": 0.0}, histories_out=hists, taus=(0.5,))
    assert "val_AC@0.5" in hists[cells[0]].final and "val_ACMC@0.5" in hists[cells[0]].final


# --- curves ------------------------------------------------------------------------------------
def test_curves_lays_out_every_logged_record_with_eta_qk():
    a = History(config={}, records=[{"step": 0, "val_loss": 1.0, "val_accuracy": 0.5, "val_attn_relevant": 0.2},
                                    {"step": 5, "val_loss": 0.5, "val_accuracy": 0.8, "val_attn_relevant": 0.4}])
    b = History(config={}, records=[{"step": 0, "val_loss": 1.1, "val_accuracy": 0.4, "val_attn_relevant": 0.1,
                                     "val_AC@0.5": 0.0}])
    f = tj.curves({P.Cell("sgd", 0.3, 10.0, 1): a, P.Cell("sgd", 0.3, 1.0, 0): b})
    assert list(f[["ratio", "step"]].itertuples(index=False, name=None)) == [(1.0, 0), (10.0, 0), (10.0, 5)]
    assert f["eta_qk"].tolist() == pytest.approx([0.3, 3.0, 3.0])
    assert f["val_AC@0.5"].iloc[0] == 0.0 and f["val_AC@0.5"].iloc[1:].isna().all()
    with pytest.raises(ValueError, match="no histories"):
        tj.curves({})
    with pytest.raises(ValueError, match="no validation loss"):
        tj.curves({P.Cell("sgd", 0.3, 1.0, 0): History(config={}, records=[{"step": 0, "loss": 1.0}])})


# --- crossings and levels ----------------------------------------------------------------------
def test_at_levels_on_hand_worked_crossings():
    loss, values = [1.0, 0.1, 0.01], [0.0, 1.0, 3.0]
    got = tj.at_levels(loss, values, [10 ** -0.5, 10 ** -1.5, 0.1, 2.0, 1e-3])
    # half way in log loss between 1 and 0.1, then between 0.1 and 0.01; a level hit exactly; a
    # level above the first loss (its value); a level never reached
    assert got[:4] == pytest.approx([0.5, 2.0, 1.0, 0.0], abs=1e-12) and math.isnan(got[4])
    # the first crossing counts: 1 -> 0.5 crosses 0.6 before the loss goes up to 0.8 and down to 0.2
    got = tj.at_levels([1.0, 0.5, 0.8, 0.2], [0.0, 1.0, 2.0, 3.0], [0.6, 0.3])
    assert got == pytest.approx([math.log(1 / 0.6) / math.log(2), 2 + math.log(0.8 / 0.3) / math.log(4)], abs=1e-12)
    assert math.isnan(tj.at_levels([math.nan, math.inf], [1.0, 2.0], [0.5])[0])  # a non-finite loss reaches nothing
    with pytest.raises(ValueError, match="equal length"):
        tj.at_levels([1.0, 0.5], [1.0], [0.5])
    with pytest.raises(ValueError, match="positive finite"):
        tj.at_levels([1.0, 0.5], [1.0, 2.0], [0.0])


def _frame(runs):
    """A curves frame from ``{(optimizer, eta_ov, ratio, seed): (losses, AC values)}``, steps 0, 1, ..."""
    rows = [{"optimizer": o, "eta_ov": e, "ratio": r, "seed": s, "eta_qk": e * r, "step": i, "val_loss": lo,
             "val_accuracy": 0.5, "val_attn_relevant": v / 2, "val_AC@0.5": v}
            for (o, e, r, s), (losses, values) in runs.items() for i, (lo, v) in enumerate(zip(losses, values))]
    return pd.DataFrame(rows)


def test_loss_levels_span_from_below_the_highest_start_to_the_deepest_common_loss():
    f = _frame({("adamw", 0.1, 1.0, 0): ([1.0, 0.5, 0.2], [0, 0, 0]),
                ("adamw", 0.1, 10.0, 0): ([0.8, 0.4, 0.1, 0.3], [0, 0, 0, 0])})
    # top 1.0 (highest start), bottom max(0.2, 0.1) = 0.2: geomspace(1, 0.2, 3)[1:]
    assert tj.loss_levels(f, n=2) == pytest.approx([math.sqrt(0.2), 0.2])
    assert tj.loss_levels(f, n=1) == pytest.approx([0.2])
    stuck = pd.concat([f, _frame({("adamw", 0.1, 3.0, 0): ([1.2, 1.3], [0, 0])})])
    assert tj.loss_levels(stuck) == []  # the run that started highest never got below its start
    with pytest.raises(ValueError, match="positive integer"):
        tj.loss_levels(f, n=0)
    with pytest.raises(ValueError, match="empty"):
        tj.loss_levels(f.iloc[:0])


def test_asymptotics_reads_the_common_mass_through_at_levels():
    from qkov_lib.studies import asymptotics

    hist = pd.DataFrame({"loss": [2.0, 1.0, 0.1], "attn_relevant": [0.2, 0.5, 0.95]})
    at = asymptotics.common_at_losses(hist, [10 ** -0.5, 3.0, 0.01])
    assert at[10 ** -0.5] == pytest.approx(math.sqrt(0.5 * 0.05)) and at[3.0] == pytest.approx(0.8)
    assert math.isnan(at[0.01])


# --- matched changes ---------------------------------------------------------------------------
def _paired():
    """Column (adamw, 0.1): ratio 1 seeds 0-3 with AC 0 -> 0.2 as the loss goes 1 -> 0.1; ratio 10
    seeds 0-2 with AC 0 -> 0.6 + 0.02 s, seed 2 stopping at loss 0.5. At loss 10^-0.5 (half way in
    log loss) ratio 1 reads 0.1 and ratio 10 reads 0.3 + 0.01 s. Column (adamw, 0.01) at ratio 10:
    the fixed-eta_QK partner of (adamw, 0.1, 1)."""
    runs = {("adamw", 0.1, 1.0, s): ([1.0, 0.1], [0.0, 0.2]) for s in range(4)}
    runs.update({("adamw", 0.1, 10.0, s): ([1.0, 0.1 if s < 2 else 0.5], [0.0, 0.6 + 0.02 * s]) for s in range(3)})
    runs.update({("adamw", 0.01, 10.0, s): ([1.0, 0.1], [0.0, 0.4]) for s in range(2)})
    runs.update({("adamw", 0.01, 1.0, s): ([1.0, 0.1], [0.0, 0.2]) for s in range(2)})
    return _frame(runs)


def test_matched_pairs_by_seed_and_leaves_out_seeds_that_did_not_reach_the_level():
    f = _paired()
    lv = 10 ** -0.5
    out = tj.matched(f, {("adamw", 0.1): [lv]}, metrics=("val_AC@0.5",))
    row = out[(out["eta_ov"] == 0.1) & (out["ratio"] == 10.0)].iloc[0]
    # seeds 0 and 1 only (seed 2 never reached the level, seed 3 has no ratio-10 run): 0.2 and 0.21
    assert row["d_val_AC@0.5"] == pytest.approx(0.205) and row["d_val_AC@0.5_n"] == 2
    assert row["d_val_AC@0.5_ci"] == pytest.approx(12.7062 * (0.01 / math.sqrt(2)) / math.sqrt(2), rel=1e-4)
    assert row["level"] == lv and row["eta_qk"] == pytest.approx(1.0) and row["ref_ratio"] == 1.0
    # default levels: loss_levels of the column's runs, down to 0.5 (seed 2 at ratio 10); all three pairs
    col = out[(out["eta_ov"] == 0.01)]
    assert len(col) == 3 and col["level"].tolist() == pytest.approx(tj.loss_levels(f[f["eta_ov"] == 0.01]))
    default = tj.matched(f, metrics=("val_AC@0.5", "val_attn_relevant"))
    d = default[default["eta_ov"] == 0.1]
    assert d["level"].tolist() == pytest.approx(tj.loss_levels(f[f["eta_ov"] == 0.1]))
    assert d["level"].min() == pytest.approx(0.5) and (d["d_val_AC@0.5_n"] == 3).all()
    assert d["d_val_attn_relevant"].to_numpy() == pytest.approx(d["d_val_AC@0.5"].to_numpy() / 2)


def test_matched_takes_explicit_pairs_along_fixed_eta_qk():
    f = _paired()
    out = tj.matched(f, {("adamw", 0.01): [10 ** -0.5]}, metrics=("val_AC@0.5",),
                     pairs=[(("adamw", 0.01, 10.0), ("adamw", 0.1, 1.0))])
    row = out.iloc[0]
    assert len(out) == 1 and row["eta_qk"] == pytest.approx(0.1) and row["ref_eta_ov"] == 0.1
    assert row["d_val_AC@0.5"] == pytest.approx(0.1) and row["d_val_AC@0.5_n"] == 2  # 0.2 - 0.1, seeds 0 and 1


def test_matched_names_unknown_columns_and_bad_input():
    f = _paired()
    with pytest.raises(ValueError, match="no run at optimizer 'sgd'"):
        tj.matched(f, pairs=[(("sgd", 0.1, 10.0), ("sgd", 0.1, 1.0))])
    with pytest.raises(ValueError, match="ratio 3"):
        tj.matched(f, pairs=[(("adamw", 0.1, 3.0), ("adamw", 0.1, 1.0))])
    with pytest.raises(ValueError, match="no pair compares"):
        tj.matched(f, {("adamw", 0.3): [0.5]})
    with pytest.raises(ValueError, match="no column"):
        tj.matched(f, metrics=("val_sufficiency",))
    with pytest.raises(ValueError, match="empty"):
        tj.matched(f.iloc[:0])
    with pytest.raises(ValueError, match="no ratio-1 runs"):
        tj.matched(f[f["ratio"] > 1])


# --- figure ------------------------------------------------------------------------------------
def test_plot_has_one_panel_per_column_on_a_white_face():
    import matplotlib.pyplot as plt

    f = _paired()
    fig = tj.plot_attention_vs_loss(f, [("adamw", 0.1), ("adamw", 0.01)])
    assert isinstance(fig, matplotlib.figure.Figure) and len(fig.axes) == 2
    assert fig.get_facecolor()[:3] == (1.0, 1.0, 1.0)
    ax = fig.axes[0]
    assert ax.xaxis_inverted() and ax.get_title() == "adamw, eta_OV = 0.1"
    assert len(ax.lines) == 4 + 1 + 3 + 1  # per-seed lines and one mean per ratio
    plt.close(fig)
    # a ratio present in one panel only still has its legend entry
    g = f[~((f["eta_ov"] == 0.01) & (f["ratio"] > 1))]
    fig = tj.plot_attention_vs_loss(g, [("adamw", 0.1), ("adamw", 0.01)])
    labels = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert labels == [f"{r:g}" for r in sorted(set(f["ratio"]))]
    plt.close(fig)
    with pytest.raises(ValueError, match="no run at optimizer 'adamw', eta_ov 0.3"):
        tj.plot_attention_vs_loss(f, [("adamw", 0.3)])
    with pytest.raises(ValueError, match="no columns"):
        tj.plot_attention_vs_loss(f, [])


def test_pairs_read_at_the_deepest_loss_both_reached():
    # two seeds; the reference reaches 0.25, the compared cell only 0.5: the pair is read at 0.5
    rows = []
    for seed in (0, 1):
        for ratio, losses, ac in ((1.0, (1.0, 0.5, 0.25), (0.1, 0.2, 0.3)), (10.0, (1.0, 0.7, 0.5), (0.1, 0.3, 0.5))):
            for k, (lv, a) in enumerate(zip(losses, ac)):
                rows.append({"optimizer": "adamw", "eta_ov": 1e-3, "ratio": ratio, "seed": seed, "eta_qk": 1e-3 * ratio,
                             "step": 100 * k, "val_loss": lv, "val_accuracy": 0.5, "val_attn_relevant": a,
                             "val_AC@0.5": a})
    cur = pd.DataFrame(rows)
    got = tj.at_deepest_common_loss(cur, [(("adamw", 1e-3, 10.0), ("adamw", 1e-3, 1.0))])
    assert len(got) == 1 and got["level"].iloc[0] == pytest.approx(0.5)
    # at loss 0.5: compared 0.5, reference 0.2 -> +0.3 in both seeds
    assert got["d_val_AC@0.5"].iloc[0] == pytest.approx(0.3) and got["d_val_AC@0.5_n"].iloc[0] == 2
    assert got["d_val_accuracy"].iloc[0] == pytest.approx(0.0)
    # a pair with a side that has no runs is left out, not an error
    assert tj.at_deepest_common_loss(cur, [(("adamw", 1e-2, 10.0), ("adamw", 1e-2, 1.0))]).empty
