"""The protocol map of the real-data chapters: profiles, splits, analysis, the sentences and
scorecard rows a chapter quotes, and one tiny end-to-end map on the SVA data."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from qkov_lib import claims, profiles, protocol, rate_plane
from qkov_lib.data import registry
from qkov_lib.data.batch import Batch
from qkov_lib.data.registry import load_text_dataset
from qkov_lib.studies import realmap as M


def _table(d_acc_adamw=-0.10, d_attn_sgd=0.2, fail=0, etas=(("adamw", (1e-3, 3e-3)), ("sgd", (0.1, 0.3))),
           seeds=(0, 1, 2)):
    """A hand-made run table: AdamW loses accuracy with the ratio, SGD sharpens at equal accuracy;
    ``fail`` SGD runs at ratio 10 stay at chance. The first base rate of each optimizer has the
    better validation accuracy."""
    rows = []
    for opt, etas in etas:
        for eta in etas:
            for r in (1.0, 10.0):
                for s in seeds:
                    up = r > 1
                    d_acc = d_acc_adamw if opt == "adamw" else 0.0
                    d_attn = d_attn_sgd if opt == "sgd" else -0.1
                    at_chance = opt == "sgd" and up and s < fail
                    rows.append({"optimizer": opt, "eta_ov": eta, "ratio": r, "seed": s, "diverged": False,
                                 "stop_step": 100, "val_accuracy": 0.5 if at_chance else 0.9 + 0.01 * (eta in (1e-3, 0.3, 0.03)),
                                 "val_loss": 0.3, "val_macro_f1": 0.88,
                                 "accuracy": 0.85 + d_acc * up + 0.001 * s, "macro_f1": 0.84 + d_acc * up,
                                 "attn_relevant": 0.4 + d_attn * up + 0.001 * s,
                                 "AC@0.5": 0.3 + d_attn * up + 0.002 * s, "ACMC@0.5": 0.3 + d_attn * up,
                                 "sufficiency": 0.2 - 0.1 * d_attn * up})
    return pd.DataFrame(rows)


def test_analyse_reads_the_papers_protocol_first():
    res = M.analyse(_table(), chance_rate=0.5)
    assert res.selected == {"adamw": 1e-3, "sgd": 0.3}
    v = {cid: t.verdict for cid, t in res.verdicts.items()}
    # AdamW loses 10 points at ratio 10 (R1 contradicted there), SGD keeps accuracy (R1 holds): mixed
    assert v["R1"] == "mixed"
    assert "contradicted at AdamW, η_OV 0.001, ratio 10 vs 1" in res.verdicts["R1"].region
    assert "holds at SGD, η_OV 0.3, ratio 10 vs 1" in res.verdicts["R1"].region
    assert "AdamW, η_OV 0.001, ratio 10 vs 1 (η_QK past the stable rate): -0.100 ±" in res.verdicts["R1"].effect
    # AC@0.5 rises by 0.2 with SGD and falls by 0.1 with AdamW
    assert v["R2"] == "mixed"
    # the same table without AdamW's accuracy loss: R1 holds at both tuned rates
    assert M.analyse(_table(d_acc_adamw=0.0), 0.5).verdicts["R1"].verdict == "reproduced"
    # eta_QK 3 at SGD 0.3 x 10 lies past the largest stable base rate (0.3): marked, read all the same
    assert res.ceiling == {"adamw": 3e-3, "sgd": 0.3}
    sgd = res.protocol[(res.protocol["optimizer"] == "sgd") & (res.protocol["claim"] == "R2")]
    assert sgd["past_stable"].all() and "past the stable rate" in res.verdicts["R2"].region


def test_the_control_lowers_eta_ov_at_the_tuned_eta_qk():
    # base rates a decade apart; SGD's tuned rate is 0.03 (tied with 0.3 on validation, the smaller wins): the
    # control reaches ratio 10 at (0.003, 0.03) against (0.03, 0.03)
    decades = (("adamw", (1e-4, 1e-3, 1e-2)), ("sgd", (0.003, 0.03, 0.3)))
    res = M.analyse(_table(etas=decades, seeds=(0, 1, 2, 3)), 0.5)
    ctl = res.protocol[res.protocol["route"] == "ov_down"]
    assert {(o, e, q) for o, e, q in zip(ctl["optimizer"], ctl["eta_ov"], ctl["eta_qk"])} == {
        ("adamw", 1e-4, 1e-3), ("sgd", 0.003, 0.03)}
    assert res.control["R2"].verdict == "mixed"  # SGD sharpens by either route, AdamW blunts
    facts = M.map_facts(res)
    assert facts["map_verdict_R2"] == res.verdicts["R2"].label and facts["map_sgd_ceiling"] == "0.3"
    assert facts["map_control_R2"] == res.control["R2"].label and facts["map_rule"] == claims.ONE_RULE
    assert facts["map_estimand_R1"] == claims.ESTIMANDS["R1"].text()


def test_protocol_grid_lists_the_tuned_rate_and_the_control_below_it():
    cfg = {"optimizers": ["adamw"], "adamw_rates": [1e-4, 1e-3, 1e-2], "ratios": [1.0, 10.0, 100.0]}
    cells = M.protocol_grid({"adamw": 1e-3}, cfg, [4, 5])
    assert sorted({(c.eta_ov, c.ratio) for c in cells}) == [(1e-4, 10.0), (1e-3, 1.0), (1e-3, 10.0), (1e-3, 100.0)]
    assert {c.seed for c in cells} == {4, 5} and len(cells) == 8


def test_failures_are_counted_not_averaged():
    res = M.analyse(_table(fail=2), chance_rate=0.5)
    f = M.failure_frame(res)
    assert f.loc[("sgd", 0.1), 10.0] == "2/3" and f.loc[("adamw", 1e-3), 10.0] == "0/3"
    facts = M.map_facts(res)
    assert facts["map_failed"] == "4" and facts["map_runs"] == str(len(res.table))
    ph = res.phase.set_index(["optimizer", "eta_ov", "ratio"])
    assert ph.loc[("sgd", 0.1, 10.0), "trained_runs"] == 1
    # when every SGD run at the top ratio fails, R2 (runs that trained) has no pair there: undecided, not
    # measured; R1 reads every run
    r2 = M.analyse(_table(fail=3), 0.5)
    cell = r2.protocol[(r2.protocol["optimizer"] == "sgd") & (r2.protocol["claim"] == "R2")]
    assert cell["mean"].isna().all() and (cell["note"] == "no seed pair to compare").all()
    assert "SGD, η_OV 0.3, ratio 10 vs 1 (η_QK past the stable rate): not measured" in r2.verdicts["R2"].effect


def test_facts_rows_and_tables():
    res = M.analyse(_table(), 0.5)
    facts = M.map_facts(res)
    assert facts["map_adamw_eta"] == "0.001" and facts["map_sgd_eta"] == "0.3"
    assert facts["map_adamw_test_accuracy"].startswith("85.1% ±")  # seeds 0.850, 0.851, 0.852
    rows = M.claims_rows(res, "sva")
    assert [r["id"] for r in rows] == ["R1", "R2", "R3"] and rows[0]["chapter"] == "07_sva"
    assert "the paper's protocol: AdamW, η_OV 0.001, ratio 10 vs 1 (η_QK past the stable rate): -0.100" in rows[0]["ours"]
    assert rows[0]["verdict"] == res.verdicts["R1"].verdict and rows[0]["effect"] == res.verdicts["R1"].effect
    assert "Necessity check" in rows[2]["ours"] and "Necessity check" not in rows[1]["ours"]
    ref = M.tuned_runs(res, "adamw", ratio=1.0)
    assert len(ref) == 3 and set(ref["ratio"]) == {1.0} and set(ref["eta_ov"]) == {1e-3}
    assert len(M.tuned_runs(res, "adamw")) == 6 and M.plot_roles(res, {}, ["answer"]) is None
    sel = M.selection_table(res)
    assert sel[sel["chosen"]]["eta_ov"].tolist() == [1e-3, 0.3]
    assert M.verdict_frame(res).loc["R1", "paper's protocol"] == "mixed"


def test_largest_gain_names_its_cell():
    res = M.analyse(_table(), 0.5)
    row = M.largest_gain(res).iloc[0]
    # SGD's AC rises by 0.2 in both columns; the first (eta_ov 0.1) is named, with the tuned rate's accuracy
    assert (row["optimizer"], row["eta_ov"], row["ratio"]) == ("sgd", 0.1, 10.0)
    assert row["Δ AC@0.5 (points)"] == pytest.approx(20.0) and row["tuned eta_ov"] == 0.3
    assert round(row["ratio-1 accuracy at tuned eta_ov (%)"], 1) == 85.1
    assert M.largest_gain(M.analyse(_table().drop(columns="AC@0.5"), 0.5)).empty


def test_anchor_gap_and_no_trained_run():
    res = M.analyse(_table(), 0.5)
    near = M.anchor_gap(res, "adamw", 0.85, 0.84)
    assert near["anchor_within"].startswith("within") and near["anchor_gap_accuracy"] == "+0.1 points"
    assert (near["anchor_acc"], near["anchor_f1"]) == ("85.0%", "84.0%")
    assert M.anchor_gap(res, "adamw", 0.80, 0.84)["anchor_within"].startswith("not within")
    dead = M.analyse(_table().assign(val_accuracy=0.5), 0.5)  # nothing beats chance
    assert dead.selected == {} and M.map_facts(dead)["map_adamw_eta"].startswith("none")
    assert all(v.verdict == "not tested" for v in dead.verdicts.values())
    assert M.anchor_gap(dead, "adamw", 0.8, 0.8)["anchor_within"].startswith("not tested")
    assert M.claims_rows(dead, "squad")[0]["verdict"] == "not tested"


def test_bad_settings_fail_clearly():
    with pytest.raises(ValueError, match="unknown dataset 'imdb'"):
        M.chapter_map("imdb", "test")
    with pytest.raises(ValueError, match="unknown optimizer"):
        M.base_rates({"optimizers": ["adam"], "adam_rates": [1e-3]})
    with pytest.raises(TypeError, match="adamw_rates"):
        M.chapter_map("sva", "test", adamw_rates="1e-3")
    with pytest.raises(ValueError, match="unknown map model"):
        M.make_model(None, {"model": "lstm"}, 0)


def test_profiles_follow_the_protocol():
    """cpu: at least 4 seeds per cell and 3 base rates per optimizer (so a chosen rate can lie
    inside its grid), less any rate of :data:`CPU_NEVER_TRAINS` (where no run trained); full: 5 seeds, 4 rates and the paper's five ratios, and a model at least as wide
    and as long-trained as cpu's; every map runs the analysed-head model with early stopping."""
    for name in M.DATASETS:
        cpu, full = M.MAPS[name].profiles["cpu"], M.MAPS[name].profiles["full"]
        assert full["ratios"] == [1.0, 3.0, 10.0, 30.0, 100.0]
        assert full["d_model"] >= cpu["d_model"] and full["layers"] >= cpu["layers"]
        assert full["adamw_steps"] >= cpu["adamw_steps"] and full["sgd_steps"] >= cpu["sgd_steps"]
        for cfg, seeds, rates in ((cpu, 4, 3), (full, 5, 4)):
            assert cfg["ratios"][0] == 1.0 and len(cfg["ratios"]) >= 3
            assert set(cfg["optimizers"]) == {"adamw", "sgd"} and cfg["model"] == "head"
            dropped = M.CPU_NEVER_TRAINS.get(name, {}) if cfg is cpu else {}
            for opt in ("adamw", "sgd"):
                # a rate where no run trains leaves the cpu grid only: full keeps it, cpu keeps the others
                assert len(cfg[f"{opt}_rates"]) + (opt in dropped) >= rates
                if opt in dropped:
                    assert dropped[opt] in full[f"{opt}_rates"] and dropped[opt] not in cfg[f"{opt}_rates"]
            assert len(cfg["map_seeds"]) >= seeds and cfg["patience"] is not None


@pytest.fixture(scope="module")
def tiny_sva_map():
    return M.chapter_map("sva", "test", n_train=200, n_test=100, adamw_steps=30, sgd_steps=30)


def test_head_maps_pass_through_the_head_on_a_tiny_sva_map(tiny_sva_map):
    """The map's models are HeadModels (no path around the head), and the necessity table has
    a row per tuned optimizer at ratio 1 with fractions in [0, 1]."""
    from qkov_lib.head_model import HeadModel

    result, ds, cfg, _ = tiny_sva_map
    assert result.models and all(isinstance(m, HeadModel) for m in result.models.values())
    nec = result.necessity
    assert set(nec.columns) >= {"optimizer", "ratio", "model", "uniform", "oracle", "chance", "necessary"}
    for col in ("model", "uniform", "oracle", "chance"):
        assert ((nec[col] >= 0) & (nec[col] <= 1)).all()
    # the relative readout scores both classes 0 under uniform attention: a tie, so exactly chance
    assert (abs(nec["uniform"] - nec["chance"]) < 1e-12).all()
    f = M.necessity_facts(result)
    for opt in result.selected:
        assert f[f"nec_{opt}_model_lo"].endswith("%") and f[f"nec_{opt}_necessary"] in ("yes", "no", "undecided")


def test_measure_on_hand_made_attention():
    """measure() on a model whose attention is fixed: all mass on the relevant token."""

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens, key_mask):
            attn = (tokens == 1).double() * key_mask
            attn = attn / attn.sum(1, keepdim=True).clamp_min(1e-9)
            logits = torch.stack([torch.zeros(len(tokens)), 3.0 * attn.sum(1).float()], 1).double()
            return logits + 0 * self.w, attn

    from qkov_lib.data.batch import Batch

    tokens = torch.tensor([[2, 1, 0], [1, 2, 0]])
    key = torch.tensor([[True, True, False], [True, True, False]])
    rel = tokens == 1
    out = M.measure(Fixed(), Batch(tokens, key, rel, torch.tensor([1, 1])), n_eraser=2)
    # exact: accuracy, AC and ACMC are fractions of rows, here 2 of 2
    assert out["accuracy"] == 1.0 and out["attn_relevant"] == pytest.approx(1.0)
    assert out["AC@0.5"] == 1.0 and out["ACMC@0.5"] == 1.0


def test_tiny_sva_map_end_to_end_is_deterministic():
    """Twice, the second time with the two optimizers in two processes (one thread each, as the
    test profile's one process): the same table."""
    cfg = profiles.resolve(M.MAPS["sva"].profiles, "test")
    assert cfg["threads"] == 1 and cfg["processes"] == 1
    ds, val = M.load_splits("sva", cfg)
    assert len(val) == round(cfg["val_frac"] * (len(ds.train) + len(val)))
    a = M.run_map(ds, val, cfg)
    b = M.run_map(ds, val, {**cfg, "processes": 2})
    cols = ["val_accuracy", "accuracy", "attn_relevant", "sufficiency"]
    assert len(a.table) == 2 * 2 * len(cfg["ratios"]) * len(cfg["map_seeds"])
    pd.testing.assert_frame_equal(a.table[cols], b.table[cols])
    assert a.table["trained"].dtype == bool and set(a.verdicts) == set(a.control) == {"R1", "R2", "R3"}
    # every run logged AC@0.5 on the validation split through training
    assert a.histories and all("val_AC@0.5" in h.records[-1] for h in a.histories.values())
    runs = M.runs_at(a, "adamw")
    assert "adamw" in a.selected  # the tiny SVA map trains under AdamW (validation accuracy ~ 0.88)
    assert runs and all(math.isfinite(float(next(r.model.parameters()).detach().sum())) for r in runs)
    assert np.isfinite(a.chance) and 0.4 < a.chance < 0.7  # two balanced-ish numbers


def test_command_line_runs_a_map_and_rejects_bad_values(capsys):
    M.main(["sva", "--profile", "test", "-p", "optimizers", '["adamw"]', "-p", "adamw_rates", "[0.003]",
            "-p", "ratios", "[1, 10]"])
    out = capsys.readouterr().out
    assert "adamw   0.003" in out and "R1" in out and "sgd" not in out.split("claim")[0]
    with pytest.raises(TypeError, match="map_seeds"):
        M.main(["sva", "--profile", "test", "-p", "map_seeds", '"zero"'])


def test_tuned_evaluations_cover_every_tuned_model_and_feed_the_tables(tiny_sva_map):
    """tuned_evaluations evaluates exactly the trained models at each tuned base rate (all
    ratios and seeds) with the model's, uniform and random attention; the DTAP figure has one
    row per optimizer, the correctness table counts every test instance once per run, and the
    facts quote the seeds and percentages."""
    result, ds, cfg, _ = tiny_sva_map
    evals = M.tuned_evaluations(result, ds, cfg)
    assert set(evals) == set(result.selected)
    for opt, runs in evals.items():
        want = sorted((float(r.ratio), int(r.seed)) for r in M.tuned_runs(result, opt).itertuples())
        assert sorted((r.ratio, r.seed) for r in runs) == want
        for r in runs:
            assert {row["attention"] for row in r.rows} == {"model", "uniform", "random"}
            assert len(r.correct) == len(ds.test)
    c = M.correctness_table(evals)
    if len(c):
        n = c["n"].sum(axis=1)  # right + wrong = every test instance with a subject
        assert (abs(n - int(ds.test.relevant.any(1).sum())) < 1e-9).all()
    if any(evals.values()):
        fig = M.plot_dtap(evals, result)
        assert fig is not None and len(fig.axes) >= len([o for o, r in evals.items() if r])
    f = M.attention_facts(result) | M.data_facts(ds)
    assert f["data_n_test"] == f"{len(ds.test):,}"
    for opt in result.selected:
        ref = M.tuned_runs(result, opt, ratio=1.0)
        assert f[f"att_{opt}_seeds"] == str(ref["seed"].nunique())
        assert f[f"att_{opt}_accuracy_lo"].startswith(f"{100 * float(ref['accuracy'].mean()):.1f}%")


def _cue_dataset(data_dir=None, max_len=12, min_freq=1, n_train=400, n_test=120, seed=0):
    """A made-up dataset: filler words with one ``good*`` and one ``bad*`` word; the word right
    after the marker ``look`` decides the class (``good`` -> 1), and is the relevant token. The
    mean of the values holds both cues, so only attention placed by the keys' context solves it.
    Built here, from nothing shipped (``data_dir`` is not read)."""
    import random

    from qkov_lib.data.text import Example, finish

    rnd = random.Random(seed)

    def example():
        y, n = rnd.randrange(2), rnd.randrange(7, max_len - 1)
        words = [f"w{rnd.randrange(20)}" for _ in range(n)]
        a, b = sorted(rnd.sample(range(1, n, 2), 2))  # two odd positions: never adjacent, each after a word
        pos, other = (a, b) if rnd.randrange(2) else (b, a)
        words[pos] = f"{'good' if y else 'bad'}{rnd.randrange(3)}"
        words[other] = f"{'bad' if y else 'good'}{rnd.randrange(3)}"
        words[pos - 1] = "look"
        return Example(words, [pos], y)

    return finish("cue", [example() for _ in range(n_train)], [example() for _ in range(n_test)], ["bad", "good"], {},
                  min_freq=min_freq)


def _cue_splits(cfg, data_dir=None):
    ds = load_text_dataset("cue", data_dir, max_len=cfg["max_len"], min_freq=cfg["min_freq"], n_train=cfg["n_train"],
                           n_test=cfg["n_test"], seed=cfg["data_seed"])
    return M.hold_out_validation(ds, cfg)


def test_a_registered_dataset_runs_the_protocol_map_with_no_other_change():
    """A dataset defined in this test is one entry in each registry -- its loader in
    qkov_lib.data.registry, its map profiles and splits in realmap -- and the chapter's calls
    (settings, map, verdicts, necessity check) run on it unchanged; unknown names fail clearly."""
    registry.register(registry.DatasetSpec("cue", _cue_dataset, 12))
    base = dict(M.COMMON, d_model=16, max_len=12, min_freq=1, n_train=400, n_test=120, adamw_steps=150,
                sgd_steps=150, eval_every=25, patience=3, adamw_rates=[1e-2, 3e-2], sgd_rates=[1.0, 3.0], processes=1)
    spec = M.register(M.MapSpec("cue", profiles.profile_table(base, dict(ratios=[1.0, 10.0], map_seeds=[0, 1]),
                                                              {}, {}), _cue_splits))
    try:
        result, ds, cfg, facts = M.chapter_map("cue", "test")
        assert cfg["profile"] == "test" and ds.name == "cue" and len(result.table) == 2 * 2 * 2 * 2
        assert set(result.selected) == {"adamw", "sgd"} and set(result.verdicts) == {"R1", "R2", "R3"}
        assert result.necessity is not None and len(result.necessity) >= 2
        tuned = M.tuned_runs(result, "adamw", ratio=1.0)
        assert (tuned["accuracy"] > 0.9).all()  # the cue task is learnt through the head
        assert result.necessity["uniform"].max() < 0.6  # flat attention sits at chance (0.5): the head is needed
    finally:
        M.MAPS.pop(spec.name)
        registry.REGISTRY.pop("cue")
    with pytest.raises(ValueError, match="unknown dataset 'cue'"):
        M.map_config("cue", "test")
    with pytest.raises(ValueError, match="unknown dataset 'cue'"):
        load_text_dataset("cue")
    with pytest.raises(TypeError, match="register takes a DatasetSpec"):
        registry.register(M.MAPS["sva"])
    with pytest.raises(TypeError, match="register takes a MapSpec"):
        M.register({"name": "cue"})


def test_a_registered_metric_reaches_every_summary_map_and_phase_table():
    """One registry entry (made up here: the share of instances with at least a quarter of the
    attention on relevant tokens) shows up in the flat summary, the batched engine's summary,
    the protocol map's runs table and phase table, and the real-data tables' columns."""
    from qkov_lib import metrics, protocol
    from qkov_lib.data import synthetic as syn
    from qkov_lib.models import SyntheticModel
    from qkov_lib.studies import attention_analysis
    from qkov_lib.train import engine, evaluate

    metrics.register_metric("AQ", lambda a, c, ok: a >= 0.25, phase=True)
    try:
        attn = torch.tensor([[0.2, 0.8], [0.9, 0.1], [0.5, 0.5]])
        probs = torch.tensor([[0.3, 0.7], [0.6, 0.4], [0.5, 0.5]])
        rel = torch.tensor([[False, True], [False, True], [True, False]])
        s = metrics.summarize(attn, probs, rel, torch.tensor([1, 0, 1]))
        assert s["AQ"] == pytest.approx(2 / 3)  # relevant masses 0.8, 0.1, 0.5
        task = syn.SyntheticTask(n_classes=3, n_common_vocab=2, n_common=(2, 3))
        data = syn.sample(task, 40, torch.Generator().manual_seed(1))
        g = torch.Generator().manual_seed(0)
        m = SyntheticModel(syn.make_embeddings(task, g, torch.float64), 3, parameterization="FACO", init_scale=0.9,
                           generator=g, dtype=torch.float64)
        (row,), _ = engine.evaluate_models([m], data)
        assert row["AQ"] == pytest.approx(evaluate(m, data)["AQ"], abs=1e-12)
        assert "AQ" in protocol.phase_metrics() and "AQ" in attention_analysis.attention_columns()

        registry.register(registry.DatasetSpec("cue", _cue_dataset, 12))
        base = dict(M.COMMON, d_model=16, max_len=12, min_freq=1, n_train=200, n_test=60, adamw_steps=40,
                    sgd_steps=40, eval_every=20, patience=2, adamw_rates=[3e-2], sgd_rates=[1.0], processes=1,
                    optimizers=["adamw"], n_eraser=10)
        spec = M.register(M.MapSpec("cue", profiles.profile_table(base, dict(ratios=[1.0, 10.0], map_seeds=[0, 1]),
                                                                  {}, {}), _cue_splits))
        try:
            result, _, _, _ = M.chapter_map("cue", "test")
        finally:
            M.MAPS.pop(spec.name)
            registry.REGISTRY.pop("cue")
        assert result.table["AQ"].between(0, 1).all()
        assert {"AQ", "d_AQ", "d_AQ_ci"} <= set(result.phase.columns)
    finally:
        metrics.unregister_metric("AQ")
    assert "AQ" not in protocol.phase_metrics() and "AQ" not in metrics.summarize(attn, probs, rel, torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="already exists"):
        metrics.register_metric("attn_relevant", lambda a, c, ok: a)
    with pytest.raises(ValueError, match="already exists"):
        metrics.register_metric("AC@0.3", lambda a, c, ok: a)


def test_matched_loss_table_reads_both_routes_at_the_tuned_rate():
    from qkov_lib.protocol import Cell
    from qkov_lib.train import History

    etas = (("adamw", (1e-3, 1e-2)), ("sgd", (0.03, 0.3)))
    t = _table(etas=etas)
    hist = {}
    for r in t.itertuples():
        # every run's validation loss falls 1.0 -> 0.25 over 4 logs; AC@0.5 = 0.1 x ratio-step + loss-free offset:
        # at ratio 10 AC is 0.2 above ratio 1 at every loss, so the matched change is exactly +0.2
        up = 0.2 if r.ratio > 1 else 0.0
        recs = [{"step": 100 * k, "val_loss": 1.0 / 2 ** k, "val_accuracy": 0.9, "val_attn_relevant": 0.3 + up,
                 "val_AC@0.5": 0.1 * k + up} for k in range(3)]
        hist[Cell(r.optimizer, r.eta_ov, r.ratio, r.seed)] = History(config={}, records=recs)
    res = M.analyse(t, 0.5, histories=hist)
    assert res.selected == {"adamw": 1e-3, "sgd": 0.03}
    # R3 is read at the deepest matched validation loss: attention +0.2 at equal accuracy in every cell,
    # although AdamW's endpoints lose attention (-0.1) and accuracy (-0.1)
    # (the untrained models' loss, 1.0 at step 0, is chance: 0.25 lies well below it, both runs learned)
    assert res.chance_loss == 1.0
    r3 = res.protocol[(res.protocol["claim"] == "R3") & (res.protocol["route"] == "qk_up")]
    assert np.allclose(r3["mean"], 0.2) and res.verdicts["R3"].verdict == "reproduced"
    assert res.plane["m_val_attn_relevant_n"].max() == 3
    tab = M.matched_loss_table(res).reset_index()
    sgd = tab[tab["optimizer"] == "sgd"]
    # tuned SGD rate 0.03: ↑ ratio 10 at eta_OV 0.03; ← nothing (0.003 is not in the grid)
    assert set(sgd["route"]) == {"↑"}
    assert (sgd[sgd["at"].str.startswith("val loss")]["Δ AC@0.5"] == "+0.200 ± 0.000 (3)").all()
    # tuned AdamW rate 1e-3: ← the cell (1e-4, 1e-3) is not in the grid either; the endpoint rows are there
    assert any(a.startswith("early-stopped endpoint") for a in tab["at"])
    # with the tuned rate at the top of the grid, the fixed-eta_QK route appears
    res.selected["sgd"] = 0.3
    tab2 = M.matched_loss_table(res).reset_index()
    down = tab2[(tab2["optimizer"] == "sgd") & (tab2["route"] == "←")]
    assert set(zip(down["eta_ov"], down["eta_qk"])) == {(0.03, 0.3)}
    assert (down[down["at"].str.startswith("val loss")]["Δ AC@0.5"] == "+0.200 ± 0.000 (3)").all()


def test_slower_base_rates_get_more_steps_where_the_profile_says_so():
    cfg = {"adamw_steps": 100, "adamw_rates": [1e-4, 1e-3, 1e-2], "eval_every": 10, "step_growth": 2.0,
           "max_step_scale": 3.0}
    # a decade below the top: x2; two decades: x4 capped at x3
    assert [M.run_steps(cfg, "adamw", e) for e in (1e-2, 1e-3, 1e-4)] == [100, 200, 300]
    assert M.run_steps({**cfg, "step_growth": 1.0}, "adamw", 1e-4) == 100
    with pytest.raises(ValueError, match="step_growth"):
        M.run_steps({**cfg, "step_growth": 0.5}, "adamw", 1e-3)
    # the stacks of a grid with two budgets: one step loop each
    from qkov_lib import protocol
    cells = protocol.grid(["adamw"], {"adamw": [1e-3, 1e-2]}, [1.0, 10.0], [0, 1])
    units = protocol._stack_units(cells, 64, steps=lambda c: M.run_steps(cfg, "adamw", c.eta_ov))
    assert [(label, len(u)) for label, u in units] == [("adamw 200 steps 1", 4), ("adamw 100 steps 1", 4)]
    assert M.map_config("squad", "full")["step_growth"] > 1.0 and M.map_config("squad", "cpu")["step_growth"] == 1.0


def test_annotation_use_per_optimizer_from_the_intervention_ends():
    res = M.analyse(_table(), 0.5)
    rows = []
    for opt, model, oracle in (("adamw", 0.54, 0.43), ("sgd", 0.45, 0.56)):
        for seed in (0, 1):
            for alpha, acc in ((0.0, model), (0.5, 0.5), (1.0, oracle)):
                rows.append({"optimizer": opt, "ratio": 1.0, "seed": seed, "alpha": alpha, "accuracy": acc, "n": 10})
    res.intervention = pd.DataFrame(rows)
    use = M.annotation_use(res)
    assert use["adamw"][0] is False and use["sgd"][0] is True
    assert use["adamw"][1:] == pytest.approx((0.54, 0.43))
    text = M.annotation_text(res)
    assert "with adamw, model 54.0% vs oracle 43.0%: " + M.AGREEMENT_NOTE in text
    assert "with sgd, model 45.0% vs oracle 56.0%: the annotated tokens are attention the model can use" in text
    r2 = M.claims_rows(res, "hatexplain")[1]["ours"]
    assert f"With adamw, {M.AGREEMENT_NOTE}." in r2 and "With sgd" not in r2
    res.intervention = None
    assert M.annotation_text(res).startswith("not measured")


def test_curves_of_a_map_where_nothing_trained_are_empty_and_draw_nothing():
    from qkov_lib.protocol import Cell
    from qkov_lib.train import History

    t = _table().assign(val_accuracy=0.5)  # nothing beats chance
    hist = {Cell(r.optimizer, r.eta_ov, r.ratio, r.seed): History(config={}, records=[
        {"step": 0, "val_loss": 1.0, "val_accuracy": 0.5, "val_attn_relevant": 0.3, "val_AC@0.5": 0.1}])
        for r in t.itertuples()}
    res = M.analyse(t, 0.5, histories=hist)
    assert M.trained_curves(res).empty and M.plot_attention_curves(res) is None
    assert M.matched_loss_table(res).empty or "val loss" not in " ".join(M.matched_loss_table(res).index.get_level_values("at"))


def test_the_monitor_is_evenly_spaced_validation_rows_or_all_of_them():
    """monitor_rows: that many evenly spaced rows (the first and last among them), None or a number not
    below the split's size: all rows (None); a bad value: a clear error. The chapter's phrase says which."""
    n = 10
    val = Batch(torch.arange(n)[:, None].repeat(1, 3), torch.ones(n, 3, dtype=torch.bool),
                torch.zeros(n, 3, dtype=torch.bool), torch.arange(n))
    watch = M.monitor_split(val, 4)
    assert watch.y.tolist() == [0, 3, 6, 9] and M.monitor_text(val, 4) == "4 evenly spaced of the 10"
    assert M.monitor_split(val, None) is None and M.monitor_split(val, 10) is None
    assert M.monitor_text(val, None) == M.monitor_text(val, 50) == "all 10"
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="monitor_rows must be a positive integer or None"):
            M.monitor_split(val, bad)
    assert M.map_config("squad", "cpu")["monitor_rows"] == 512 and M.map_config("squad", "full")["monitor_rows"] is None
    with pytest.raises(ValueError, match="monitor_rows"):
        M.map_config("sva", "cpu", monitor_rows=0)


def test_r3_in_a_copy_casting_is_not_tested_and_says_why_in_numbers():
    read = claims.Verdict("not reproduced", "rule text", "2 cells: 1 contradicted", "", "cell: -0.124 ± 0.067 (n = 3)")
    v = M.not_testable_r3(read, 0.8, 0.06, 8)
    assert v.verdict == "not tested" and v.rule == "rule text" and v.effect == read.effect
    assert "0.80 when the prediction is right and 0.06 when it is wrong" in v.reason and "8 models" in v.reason
    assert claims.word_problem(v.verdict, v.rule, v.effect) is None  # shown, not decided: no word to check
    none = M.not_testable_r3(read, math.nan, math.nan, 0)
    assert none.verdict == "not tested" and "nan" not in none.reason and "none trained at ratio 1" in none.reason


def test_attention_by_correctness_reads_the_tuned_ratio_1_models():
    """Hand-worked: a model that puts mass m_i on the relevant token of row i and predicts right where the
    relevant token is token 1; per model the mean over right rows and over wrong rows, then over models. Models
    at other rates or ratios are not read."""
    from types import SimpleNamespace

    class Fixed(torch.nn.Module):
        def __init__(self, masses):
            super().__init__()
            self.w, self.m = torch.nn.Parameter(torch.zeros(1)), torch.tensor(masses, dtype=torch.float64)

        def forward(self, tokens, key_mask):
            attn = torch.stack([self.m, 1 - self.m, torch.zeros_like(self.m)], 1)  # column 0 is relevant
            right = (tokens[:, 0] == 1).double()
            return torch.stack([1 - right, right], 1) + 0 * self.w, attn

    tokens = torch.tensor([[1, 2, 0], [1, 2, 0], [2, 2, 0], [2, 2, 0]])  # rows 0, 1 right; rows 2, 3 wrong
    rel = torch.zeros(4, 3, dtype=torch.bool)
    rel[:, 0] = True
    test = Batch(tokens, torch.ones(4, 3, dtype=torch.bool), rel, torch.ones(4, dtype=torch.long))
    cell = lambda eta, r, s: protocol.Cell("adamw", eta, r, s)  # noqa: E731
    models = {cell(1e-3, 1.0, 0): Fixed([0.9, 0.7, 0.1, 0.3]), cell(1e-3, 1.0, 1): Fixed([0.6, 0.6, 0.0, 0.2]),
              cell(1e-3, 10.0, 0): Fixed([0.0, 0.0, 1.0, 1.0]), cell(1e-2, 1.0, 0): Fixed([0.0, 0.0, 1.0, 1.0])}
    right, wrong, n = M.attention_by_correctness(SimpleNamespace(selected={"adamw": 1e-3}, models=models), test)
    assert n == 2
    assert right == pytest.approx((0.8 + 0.6) / 2) and wrong == pytest.approx((0.2 + 0.1) / 2)
    assert "words" in M.COPY_READOUTS and M.MAPS["squad"].profiles["cpu"]["readout"] in M.COPY_READOUTS
    assert M.MAPS["sva"].profiles["cpu"]["readout"] not in M.COPY_READOUTS
