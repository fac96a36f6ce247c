"""What the multi-layer chapter shows of its runs (qkov_lib.studies.multilayer): the knob's first
step on the chapter's encoder, the knob report cut to its first layer, the texts of the first-step
check and of the verdicts, the data table, the training-curve figure and the chapter's analysis of
a hand-made grid (its texts, its verdict table and what its results file keeps)."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from qkov_lib import figure_source  # noqa: E402
from qkov_lib.studies import multilayer as ml  # noqa: E402

CFG = {"ratios": [1.0, 10.0], "datasets": ["sva"], "n_layers": 2, "n_heads": 2, "seeds": [0, 1, 2], "eta_ov": 1e-3}


def test_first_layer_report_keeps_layer_0_and_lines_without_a_layer():
    text = "\n".join(["group qk", "  encoder.layers.0.self_attn.in_proj_weight[0:16] -> qk",
                      "  encoder.layers.1.self_attn.in_proj_weight[0:16] -> qk",
                      "  gpt_neox.layers.10.attention.query_key_value.weight -> qk",
                      "  players.1.weight -> other", "  embed.weight -> other"])
    assert ml.first_layer_report(text).splitlines() == [
        "group qk", "  encoder.layers.0.self_attn.in_proj_weight[0:16] -> qk", "  players.1.weight -> other",
        "  embed.weight -> other"]


def test_move_facts_are_the_q_and_k_moves_over_the_v_move():
    moves = {"Q": 2.0, "K": 3.0, "V": 0.5}
    assert ml.move_facts(moves, 10.0, "demo") == {"demo_ratio": "10", "demo_qv": "4.0", "demo_kv": "6.0"}
    assert ml.move_facts(moves, 0.5, "py_demo", 2) == {"py_demo_ratio": "0.5", "py_demo_qv": "4.00",
                                                       "py_demo_kv": "6.00"}


@pytest.mark.parametrize("ratio", [1.0, 10.0])
def test_first_adamw_step_moves_q_and_k_rows_by_the_ratio(ratio):
    cfg = {"d_model": 8, "n_heads": 2, "n_layers": 2, "dim_ff": 16, "eta_ov": 1e-3}
    report, moves = ml.first_step_moves(cfg, ratio)
    # Adam's first step moves each element by its rate (AdamW's decay, 1e-2 * rate * |w|, aside)
    assert moves["V"] == pytest.approx(1e-3, rel=0.05)
    assert moves["Q"] / moves["V"] == pytest.approx(ratio, rel=0.05)
    assert moves["K"] / moves["V"] == pytest.approx(ratio, rel=0.05)
    assert "layers.0." in ml.first_layer_report(report) and "layers.1." not in ml.first_layer_report(report)
    assert ml.first_step_moves(cfg, ratio)[1] == moves  # seeded: the same model and batch


def test_data_frame_counts_the_test_items_with_relevant_tokens():
    rel = torch.tensor([[True, False], [False, False], [False, True]])
    ds = SimpleNamespace(train=SimpleNamespace(tokens=torch.zeros(5, 2)), vocab_size=7, class_names=["a", "b"],
                         test=SimpleNamespace(tokens=torch.zeros(3, 2), relevant=rel))
    f = ml.data_frame({"sva": ds})
    assert f.loc["sva"].to_dict() == {"train": "5x2", "test": "3x2", "vocabulary": 7, "classes": "a, b",
                                      "test items with relevant tokens": 2}


def test_verdict_words_say_not_run_for_what_is_missing():
    words = ml.verdict_words({"sva": {"R2-multilayer": SimpleNamespace(verdict="mixed")}})
    assert words["ml_verdict_sva_R2"] == "mixed"
    assert words["ml_verdict_sva_R1"] == words["ml_verdict_hatexplain_R3"] == "not run"
    assert len(words) == 6


def _runs(gain: float) -> list[ml.Run]:
    """Hand-made runs: every head's attention 0.3 (+ ``gain`` at ratio 10) + 0.001 * seed, accuracy
    0.9 + 0.001 * seed, a rollout row (0.1 less), and a two-step history."""
    runs = []
    for r in CFG["ratios"]:
        for s in CFG["seeds"]:
            a = 0.3 + (gain if r == 10.0 else 0.0) + 0.001 * s
            rows = [{"layer": layer, "head": h, "attn_relevant": a, "AC": 0.2, "focus": 0.2, "uniform": 0.1}
                    for layer in (1, 2) for h in (1, 2, "mean")]
            rows.append({"layer": "rollout", "head": "-", "attn_relevant": a - 0.1, "AC": 0.0, "focus": 0.2,
                         "uniform": 0.1})
            hist = pd.DataFrame({"step": [0, 10], "accuracy": [0.5, 0.9], "L1 head-mean": [0.1, a]})
            runs.append(ml.Run("sva", r, s, {"loss": 0.3, "accuracy": 0.9 + 0.001 * s, "macro_f1": 0.9},
                               pd.DataFrame(rows), hist))
    return runs


def test_analysis_of_a_hand_made_grid():
    res = ml.analyse(_runs(+0.1), CFG)
    text = res.text()
    assert text["ml_verdict_sva_R2"] == "reproduced" and text["sva_yes_at"] == "10"
    assert text["sva_r10_n_sharp"] == "4" and text["sva_rollout"] == "0.201 → 0.301"
    assert ml.analyse(_runs(-0.1), CFG).text()["ml_verdict_sva_R2"] == "not reproduced"
    table = ml.verdict_table(res.verdicts)
    assert table.index.names == ["dataset", "claim"] and len(table) == 3
    assert table.loc[("sva", "R2-multilayer"), "verdict"] == "reproduced"
    m = res.metrics()
    assert set(m) == {"scores", "layers", "heads", "history", "facts", "claims"}
    assert list(m["history"]) == ["sva"] and len(m["history"]["sva"]) == 12  # 6 runs x 2 logged steps
    assert {h["layer"] for h in m["heads"]} == {"1", "2", "rollout"} and len(m["claims"]) == 3
    assert text["full_size"].endswith(f"{len(ml.PROFILES['full']['seeds'])} seeds")


def test_training_curves_draw_one_dataset_with_its_title():
    hist = pd.concat([ml.histories_frame(_runs(0.1)), ml.histories_frame(_runs(0.1)).assign(dataset="other")])
    fig = ml.training_curves(hist, "sva")
    assert getattr(fig, figure_source.DRAWN_BY) == "qkov_lib.studies.multilayer.training_curves"
    assert fig._suptitle.get_text() == "sva"
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["accuracy", "L1 head-mean"]
    plt.close(fig)
