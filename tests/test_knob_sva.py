"""The multi-layer chapter's Trainer section (qkov_lib.studies.pythia, SVA part) on a tiny
hand-made SVA dataset (same format as the Marvin & Linzen loader: left-padded prefixes, query
last, one role letter per word), so that nothing here reads the data folder."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from qkov_lib import profiles
from qkov_lib.data.text import Example, finish
from qkov_lib.studies import pythia

PREFIXES = [  # (words, role letters, number: 0 singular / 1 plural)
    ("the dog near the cats", "-S--A", 0), ("the dogs near the cat", "-S--A", 1),
    ("the cat that the dogs like", "-S--AV", 0), ("the cats that the dog likes", "-S--AV", 1),
    ("the dog", "-S", 0), ("the dogs", "-S", 1), ("the cat near the dog", "-S--A", 0),
    ("the cats near the dogs", "-S--A", 1),
]


def tiny_sva():
    exs = [Example(w.split(), [r.index("S")], y, info={"roles": r}) for w, r, y in PREFIXES]
    return finish("sva", exs * 4, exs, ["singular", "plural"], {}, min_freq=1)


def tiny_cfg():
    cfg = profiles.resolve(pythia.SVA_PROFILES, "test")
    return {**cfg, "steps": 4, "batch_size": 8, "warmup_steps": 1, "n_logs": 4}


def test_lm_examples_put_the_class_token_after_the_query():
    ds = tiny_sva()
    ex = pythia.lm_examples(ds.train, ds.vocab_size)
    T = ds.max_len
    assert len(ex) == len(ds.train)
    for e, tokens, y in zip(ex, ds.train.tokens, ds.train.y):
        assert torch.equal(e["input_ids"][:T], tokens) and int(e["input_ids"][T]) == ds.vocab_size + int(y)
        assert (e["labels"][:T] == -100).all() and int(e["labels"][T]) == ds.vocab_size + int(y)
        assert torch.equal(e["attention_mask"].bool(), e["input_ids"] != 0)


def test_trainer_run_logs_the_ratio_and_roles_sum_to_one(tmp_path):
    ds, cfg = tiny_sva(), tiny_cfg()
    model, logs = pythia.sva_train_one(ds, cfg, ratio=10.0, seed=0, out_dir=str(tmp_path))
    assert list(logs["step"]) == [1, 2, 3, 4]
    live = logs[logs["learning_rate/ov"] > 0]
    assert len(live) == 3  # the linear schedule reaches 0 at the last step
    assert ((live["learning_rate/qk"] / live["learning_rate/ov"]) - 10.0).abs().max() < 1e-9
    assert (live["learning_rate/other"] == live["learning_rate/ov"]).all()
    res = pythia.sva_roles_of(model, ds)
    assert 0.0 <= res["accuracy"]["accuracy"] <= 1.0
    assert set(res) == {"accuracy", "layer 1", "layer 2"}
    for layer in ("layer 1", "layer 2"):  # roles are exclusive; with the query itself they hold every key
        total = sum(v for k, v in res[layer].items() if k != "last position")
        assert total == pytest.approx(1.0, abs=1e-6)
        assert res[layer]["subject"] > 0 and res[layer]["attractor"] > 0


def test_sva_facts_hand_case():
    roles = {"layer 1": pd.DataFrame({"subject": [0.2, 0.4], "attractor": [0.1, 0.05]}, index=[1.0, 10.0])}
    head = pd.DataFrame({"subject": [0.5, 0.6], "attractor": [0.2, 0.1]}, index=[1.0, 10.0])
    acc = pd.DataFrame({"accuracy": [0.9, 0.95]}, index=[1.0, 10.0])
    cfg = {**tiny_cfg(), "ratios": [1.0, 10.0], "seeds": [0, 1]}
    rcfg = {"steps": 40, "parameterization": "FAFO", "optimizer": "adamw", "eta_ov": 1e-4, "d_model": 64}
    f = pythia.sva_facts(roles, acc, head, acc, cfg, rcfg)
    assert f["trainer_sva_layers"] == "layer 1: subject 0.20, 0.40, attractors 0.10, 0.05"
    assert f["trainer_sva_head"] == "subject 0.50, 0.60, attractors 0.20, 0.10"
    assert f["trainer_sva_acc"] == "0.90, 0.95" and f["trainer_sva_seeds"] == "2" and f["trainer_sva_ratios"] == "1, 10"


def _study():
    """A hand-made :class:`pythia.SvaStudy`: two ratios, two seeds, one layer."""
    from qkov_lib.studies import agreement_roles

    cols = [*agreement_roles.ROLES, pythia.QUERY_SELF]
    layer = pd.DataFrame([[0.4, 0.1, 0.1, 0.1, 0.1, 0.2], [0.6, 0.1, 0.0, 0.1, 0.1, 0.1]], columns=cols,
                         index=pd.Index([1.0, 10.0], name="ratio"))
    head = layer.assign(**{pythia.QUERY_SELF: 0.0})
    logs = pd.DataFrame([{"step": st, "loss": 1.0, "ratio": r, "seed": s} for r in (1.0, 10.0) for s in (0, 1)
                         for st in (1, 2)])
    cfg = {"ratios": [1.0, 10.0], "seeds": [0, 1]}
    return pythia.SvaStudy(cfg, {"layer 1": layer}, None, logs, head, None, {"parameterization": "FAFO"})


def test_sva_study_panels_log_and_results():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qkov_lib import figure_source

    sva = _study()
    panels = sva.panels()
    assert list(panels) == ["GPT-NeoX, layer 1 (head mean)", "one head (FAFO)"]
    assert list(panels["one head (FAFO)"].columns)[-1] == pythia.QUERY_SELF
    assert sva.role_table().loc[("GPT-NeoX, layer 1 (head mean)", 10.0), "subject"] == 0.6
    log = sva.first_run_log()  # the highest ratio, the lowest seed
    assert list(log.columns) == ["step", "loss"] and list(log["step"]) == [1, 2]
    roles = pythia.results_metrics(pd.DataFrame({"layer": [1]}), sva)["trainer_roles"]
    assert [r["ratio"] for r in roles["one head (FAFO)"]] == [1.0, 10.0]
    fig = pythia.role_figure(panels)
    assert getattr(fig, figure_source.DRAWN_BY) == "qkov_lib.studies.pythia.role_figure"
    assert [ax.get_title() for ax in fig.axes] == list(panels)
    plt.close(fig)
