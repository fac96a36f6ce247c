import math

import pytest
import torch

from qkov_lib.metrics import (ac, acmc, circuit_scalars, confidence, dtap_histogram, focus_prediction_table,
                              prediction_metrics, relevant_mass, summarize)

# Three instances, four positions. Relevant positions: {1}, {0, 2}, {3}.
ATTN = torch.tensor([[0.1, 0.6, 0.2, 0.1],
                     [0.3, 0.1, 0.5, 0.1],
                     [0.4, 0.3, 0.2, 0.1]])
REL = torch.tensor([[0, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
PROBS = torch.tensor([[0.8, 0.2], [0.45, 0.55], [0.3, 0.7]])
Y = torch.tensor([0, 1, 0])


def test_relevant_mass_and_confidence_by_hand():
    torch.testing.assert_close(relevant_mass(ATTN, REL), torch.tensor([0.6, 0.8, 0.1]))
    torch.testing.assert_close(confidence(PROBS, Y), torch.tensor([0.8, 0.55, 0.3]))


def test_ac_acmc_by_hand():
    a, c = torch.tensor([0.6, 0.8, 0.1]), torch.tensor([0.8, 0.55, 0.3])
    assert ac(a, 0.5) == pytest.approx(2 / 3)
    assert ac(a, 0.7) == pytest.approx(1 / 3)
    assert ac(a, 0.9) == 0.0                          # exact: 0 of 3 rows
    assert acmc(a, c, 0.5) == pytest.approx(2 / 3)    # (0.6, 0.8) and (0.8, 0.55)
    assert acmc(a, c, 0.7) == pytest.approx(0.0)      # 0.8 attention but 0.55 confidence
    assert acmc(a, c, 0.5, 0.6) == pytest.approx(1 / 3)
    assert ac(torch.tensor([0.5]), 0.5) == 1.0        # threshold is inclusive (exact: 1 of 1 row)
    with pytest.raises(ValueError, match="threshold"):
        ac(a, 1.5)


def test_dtap_histogram_bins_and_normalisation():
    a = torch.tensor([0.0, 0.05, 0.95, 1.0, 0.5])
    c = torch.tensor([1.0, 0.0, 0.99, 1.0, 0.55])
    h = dtap_histogram(a, c)
    assert h.shape == (10, 10)
    assert float(h.sum()) == pytest.approx(1.0)
    assert h[0, 9] == pytest.approx(0.2)   # a=0.0, c=1.0 (1.0 falls in the last bin)
    assert h[0, 0] == pytest.approx(0.2)   # a=0.05, c=0.0
    assert h[9, 9] == pytest.approx(0.4)   # (0.95, 0.99) and (1.0, 1.0)
    assert h[5, 5] == pytest.approx(0.2)
    with pytest.raises(ValueError):
        dtap_histogram(a, c[:2])


def test_focus_prediction_table_by_hand():
    pred = PROBS.argmax(-1)  # [0, 1, 1]; correct, correct, wrong
    t = focus_prediction_table(ATTN, REL, pred, Y)
    # focus: argmax positions 1 (relevant), 2 (relevant), 0 (not relevant)
    assert t == pytest.approx({"FTPT": 2 / 3, "FFPT": 0.0, "FTPF": 0.0, "FFPF": 1 / 3})


def test_summarize_weighted_equals_duplicated_rows():
    # weights (0.5, 0.25, 0.25) must equal duplicating the first row
    w = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    s_w = summarize(ATTN, PROBS, REL, Y, weight=w)
    idx = torch.tensor([0, 0, 1, 2])
    s_d = summarize(ATTN[idx], PROBS[idx], REL[idx], Y[idx])
    assert s_w == pytest.approx(s_d)
    assert s_d["accuracy"] == pytest.approx(0.75)
    assert s_d["loss"] == pytest.approx(-(2 * torch.log(torch.tensor(0.8)) + torch.log(torch.tensor(0.55))
                                          + torch.log(torch.tensor(0.3))).item() / 4, rel=1e-6)


def test_circuit_scalars_by_hand():
    # K=2 classes, one-hot embeddings in R^4: distinct e0, e1; common e2; query e3
    E = torch.eye(4, dtype=torch.float64)
    W_OV = torch.tensor([[2.0, -1.0, 0.0, 0.0], [0.5, 3.0, 0.0, 0.0]], dtype=torch.float64)
    W_QK = torch.zeros(4, 4, dtype=torch.float64)
    W_QK[0, 3], W_QK[1, 3], W_QK[2, 3] = 1.5, 0.5, -1.0
    s = circuit_scalars(W_QK, W_OV, E[:2], E[2:3], E[3])
    # OV: class 0 margin 2 - 0.5 = 1.5; class 1 margin 3 - (-1) = 4; mean 2.75
    assert s["ov"] == pytest.approx(2.75)
    # QK: mean distinct score (1.5 + 0.5)/2 = 1 minus common score -1 -> 2
    assert s["qk"] == pytest.approx(2.0)


def test_mass_by_role_by_hand():
    from qkov_lib.metrics import mass_by_role

    attn = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    subj = torch.tensor([[True, False, False], [False, False, True]])
    attr = torch.tensor([[False, True, False], [False, False, False]])
    out = mass_by_role(attn, {"subject": subj, "attractor": attr})
    assert out == pytest.approx({"subject": (0.5 + 0.8) / 2, "attractor": 0.3 / 2, "rest": (0.2 + 0.2) / 2})
    assert sum(out.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="overlaps"):
        mass_by_role(attn, {"a": subj, "b": subj})
    with pytest.raises(ValueError, match="shape"):
        mass_by_role(attn, {"a": subj[:, :2]})


def test_seed_half_width_by_hand():
    import math

    from scipy import stats

    from qkov_lib.metrics import seed_half_width

    # values 1, 2, 3: mean 2, sd 1, n 3 -> t(0.975, 2) / sqrt(3)
    assert seed_half_width([1.0, 2.0, 3.0]) == pytest.approx(stats.t.ppf(0.975, 2) / math.sqrt(3))
    assert math.isnan(seed_half_width([1.0]))


def test_prediction_metrics_on_a_hand_worked_case():
    # predictions 0, 1, 1 against labels 0, 1, 0: accuracy 2/3; F1 class 0 = 2/3, class 1 = 2/3
    probs = torch.tensor([[0.8, 0.2], [0.25, 0.75], [0.4, 0.6]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0])
    m = prediction_metrics(probs, y)
    assert m["accuracy"] == pytest.approx(2 / 3) and m["macro_f1"] == pytest.approx(2 / 3)
    assert m["loss"] == pytest.approx(-(math.log(0.8) + math.log(0.75) + math.log(0.4)) / 3)
    # a class that never occurs nor is predicted does not enter macro-F1, whatever n_classes says
    assert prediction_metrics(probs, y, n_classes=5)["macro_f1"] == pytest.approx(2 / 3)
