"""The real-data evaluation and summary module (qkov_lib.studies.attention_analysis): macro-F1 by hand,
one trained model evaluated with its own, uniform and random attention (deterministic under its
seed), and the summary tables' handling of the chapters' results files (several rows per claim,
missing chapters, broken files)."""

import json
import math

import numpy as np
import pytest
import torch

from qkov_lib import claims, metrics

from qkov_lib.tooling import results, scorecard
from qkov_lib.data.text import Example, finish
from qkov_lib.studies import attention_analysis as exp
from qkov_lib.train import TrainConfig, train


def test_macro_f1_by_hand():
    y = torch.tensor([0, 0, 1, 1, 2])
    pred = torch.tensor([0, 1, 1, 1, 0])
    # class 0: tp 1, 2 true, 2 predicted -> 0.5; class 1: tp 2, 2 true, 3 pred -> 0.8; class 2: 0
    assert metrics.macro_f1(pred, y, 3) == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    # a class absent from both y and pred is left out
    assert metrics.macro_f1(torch.tensor([0, 1]), torch.tensor([0, 1]), 5) == 1.0  # exact: every count matches
    with pytest.raises(ValueError):
        metrics.macro_f1(torch.tensor([0]), torch.tensor([0, 1]))


def test_macro_f1_matches_sklearn():
    sk = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(0)
    y, pred = torch.randint(6, (300,), generator=g), torch.randint(6, (300,), generator=g)
    assert metrics.macro_f1(pred, y) == pytest.approx(sk.f1_score(y.numpy(), pred.numpy(), average="macro"))


def _tiny_dataset(n=120, seed=0) :
    # class = which of two marker words occurs; the marker is the relevant token
    g = np.random.default_rng(seed)

    def ex():
        y = int(g.integers(2))
        words = [f"w{int(g.integers(5))}" for _ in range(int(g.integers(2, 6)))]
        pos = int(g.integers(len(words) + 1))
        words.insert(pos, "alpha" if y == 0 else "beta")
        return Example(words, [pos], y)

    return finish("tiny", [ex() for _ in range(n)], [ex() for _ in range(n // 2)], ["a", "b"], {}, min_freq=1)


EVAL = dict(taus=[0.5, 0.9], fracs=exp.FRACS, n_eraser=40, plausibility=True)


def _trained(ds, seed):
    from qkov_lib.models import TokenModel

    m = TokenModel(ds.vocab_size, 8, ds.n_classes, ds.max_len, generator=torch.Generator().manual_seed(seed))
    hist = train(m, ds.train, TrainConfig(optimizer="adamw", eta_ov=3e-3, ratio=10.0, steps=60, batch_size=32,
                                          seed=seed, progress=False, log_subsample=0))
    return m, hist


def test_evaluate_run_rows_baselines_and_determinism():
    ds = _tiny_dataset()
    m, hist = _trained(ds, 0)
    a = exp.evaluate_run(ds, m, hist, 10.0, 0, EVAL)
    b = exp.evaluate_run(ds, _trained(ds, 0)[0], None, 10.0, 0, EVAL)
    assert [r["attention"] for r in a.rows] == ["model", "uniform", "random"] and b.history is None
    for ra, rb in zip(a.rows, b.rows):
        assert ra.keys() == rb.keys()
        for k in ra:
            if isinstance(ra[k], float) and math.isnan(ra[k]):
                assert math.isnan(rb[k])
            else:  # exact: the same code on the same seed and thread count twice
                assert ra[k] == rb[k], k
    model, uniform = a.rows[0], a.rows[1]
    for k in ("accuracy", "AC@0.5", "ACMC@0.9", "comprehensiveness", "sufficiency", "token_f1", "iou_f1", "auprc",
              "FTPT"):
        assert k in model and not math.isnan(model[k]), k
    # the same model: only attention changes (exact: a ratio of counts of the same predictions)
    assert uniform["accuracy"] == model["accuracy"]
    # uniform attention puts 1/n on the single relevant token of an n-word sequence
    km, rel = ds.test.key_mask, ds.test.relevant
    assert uniform["attn_relevant"] == pytest.approx(float((rel.sum(1) / km.sum(1)).mean()), rel=1e-6)
    assert a.dtap.shape == (10, 10) and a.dtap.sum() == pytest.approx(1.0)
    assert len(a.mass) == len(a.correct) == len(ds.test) and a.model is m
    frame = exp.runs_frame([a])
    assert len(frame) == 3 and set(exp.summary_metrics(frame)) >= {"accuracy", "AC@0.5", "sufficiency"}
    c = exp.evaluate_run(ds, _trained(ds, 1)[0], None, 10.0, 1, EVAL)
    assert c.rows[0]["loss"] != a.rows[0]["loss"]              # another seed, another model


def _map_params(seeds=(0, 1, 2)):
    """The params a dataset chapter writes: its protocol map's settings."""
    return {"profile": "cpu", "optimizers": ["adamw", "sgd"], "ratios": [1.0, 10.0, 100.0], "map_seeds": list(seeds),
            "adamw_steps": 2000, "sgd_steps": 1500}


def _rows(verdicts):
    return [claims.claim(cid, claims.CLAIMS[cid], f"sva, map: {cid} measured", claims.Verdict(v, "rule", "why"),
                         "07_sva") for cid, v in verdicts]


def test_r_table_reads_results_and_reports_missing_chapters(tmp_path):
    both = (("R1", "reproduced"), ("R2", "reproduced"), ("R3", "reproduced"))
    results.save_results("sva", _map_params(), {"claims": _rows(both)}, path=tmp_path / "sva.json")
    table = scorecard.r_table(tmp_path)
    assert len(table) == 9
    sva = table[table["dataset"] == "sva"]
    assert list(sva["verdict"]) == ["reproduced"] * 3 and list(sva["rule"]) == ["rule"] * 3
    assert all("[cpu profile, protocol map: 3 seed(s) per cell]" in o for o in sva["ours"])
    missing = table[table["dataset"] == "squad"]
    assert list(missing["verdict"]) == ["not run"] * 3 and "not run" in missing["ours"].iloc[0]
    assert {k: v[0] for k, v in scorecard.r_verdicts(table).items()} == {"R1": "reproduced", "R2": "reproduced",
                                                                         "R3": "reproduced"}
    md = scorecard.r_table_myst(table)
    assert md.splitlines()[0] == "| claim | dataset | verdict | where it holds | effect size |"
    assert "rule" not in md and "[cpu profile" not in md  # rules and measurements fold out, once each
    details = scorecard.r_details_myst(table)
    assert details.count(":::{dropdown}") == 3 and details.count("[cpu profile, protocol map") == 3
    # a second R1 row (SVA's natural-prefix models) is a row of its own and enters the claim's verdict
    two = (*both, ("R1", "not reproduced"))
    results.save_results("sva", _map_params(), {"claims": _rows(two)}, path=tmp_path / "sva.json")
    t2 = scorecard.r_table(tmp_path)
    r1 = t2[(t2["claim"] == "R1") & (t2["dataset"] == "sva")]
    assert len(t2) == 10 and list(r1["verdict"]) == ["reproduced", "not reproduced"]
    v = scorecard.r_verdicts(t2)
    assert v["R1"][0] == "mixed" and v["R1"][2] == "holds in SVA; contradicted in SVA" and v["R2"][0] == "reproduced"
    assert scorecard.r_table_myst(t2).count("**not reproduced**") == 1
    # a chapter that wrote no row on a claim
    results.save_results("sva", _map_params(), {"claims": _rows(both[:1])}, path=tmp_path / "sva.json")
    t3 = scorecard.r_table(tmp_path)
    assert t3.query("dataset == 'sva' and claim == 'R2'")["ours"].iloc[0] == "not reported by the chapter"
    (tmp_path / "hatexplain.json").write_text("{broken")
    with pytest.raises(ValueError, match="is not whole JSON"):
        scorecard.r_table(tmp_path)
    assert json.loads((tmp_path / "sva.json").read_text())["params"]["profile"] == "cpu"


def test_provenance_frame_reads_results_and_marks_missing(tmp_path):
    doc = {"chapter": "sva", "params": _map_params(seeds=(0, 1, 2, 3)),
           "metrics": {"data_report": {"train_used": 500, "test_used": 200}}, "wall_time_s": 12.345,
           "git_commit": "0123456789abcdef"}
    (tmp_path / "sva.json").write_text(json.dumps(doc))
    f = scorecard.provenance_frame(tmp_path)
    assert f.loc["07_sva", "status"] == "ran" and f.loc["07_sva", "seeds"] == 4
    assert f.loc["07_sva", "steps"] == "adamw 2000, sgd 1500" and f.loc["07_sva", "ratios"] == [1.0, 10.0, 100.0]
    assert f.loc["07_sva", "train instances"] == 500 and f.loc["07_sva", "wall time (s)"] == 12.3
    assert f.loc["07_sva", "git commit"] == "0123456789ab"
    assert f.loc["05_squad", "status"] == "not run" and f.loc["06_hatexplain", "status"] == "not run"


def test_summary_helpers_by_hand():
    """pm formats mean ± half-width; spread picks evenly spaced indices; mass_by_correctness splits
    the relevant mass by right and wrong predictions; an unknown baseline is a clear error."""
    assert exp.pm(0.1234, 0.02) == "12.3% ± 2.0%" and exp.pm(0.5, math.nan) == "50.0%" and exp.pm(math.nan, 0) == "n/a"
    assert exp.pm(0.1234, 0.001, pct=False, digits=3) == "0.123 ± 0.001"
    assert exp.spread(10, 3).tolist() == [0, 4, 9] and exp.spread(3, 10).tolist() == [0, 1, 2]
    run = exp.RealRun(1.0, 0, None, [], None, mass=np.array([0.2, 0.6, math.nan, 0.4]),
                      correct=np.array([True, False, True, True]))
    f = exp.mass_by_correctness([run]).set_index("prediction")
    assert f.loc["correct", "attn_relevant"] == pytest.approx(0.3) and f.loc["correct", "n"] == 2
    assert f.loc["wrong", "attn_relevant"] == pytest.approx(0.6) and f.loc["wrong", "n"] == 1
    with pytest.raises(ValueError, match="unknown baseline attention"):
        exp.baseline_attention("zeros", torch.ones(2, 3, dtype=torch.bool))
