import matplotlib
import numpy as np
import pytest
import pandas as pd

from qkov_lib import plotting

matplotlib.use("Agg")


def test_dtap_grid_panels_and_white_face():
    h = np.zeros((10, 10))
    h[9, 9] = 1.0
    hists = {("FAFO", 1.0): h, ("FAFO", 10.0): h, ("CACO", 1.0): h}
    fig = plotting.dtap_grid(hists, rows=["FAFO", "CACO"], cols=[1.0, 10.0])
    axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert fig.get_facecolor()[:3] == (1.0, 1.0, 1.0)
    panels = [ax for ax in axes if ax.axison]
    assert len(panels) == 3  # (CACO, 10) is missing and switched off
    assert panels[0].get_title() == "eta_QK/eta_OV = 1"


def test_training_curves_one_axis_per_metric():
    hist = pd.DataFrame({"step": [0, 1, 10, 0, 1, 10], "loss": [1, 0.5, 0.1, 1, 0.6, 0.2],
                         "attn_relevant": [0.2, 0.4, 0.9, 0.2, 0.3, 0.5], "ratio": [1, 1, 1, 10, 10, 10]})
    fig = plotting.training_curves(hist, ["loss", "attn_relevant"], hue="ratio")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[:2] == ["loss", "attn_relevant"]
    assert fig.axes[0].get_xscale() == "log"


def test_training_curve_bands_are_the_seed_t_interval_of_the_mean():
    # two seeds at each step: mean 0.5 and 3, t(0.975, 1 dof) = 12.706 times sd / sqrt(2)
    hist = pd.DataFrame({"step": [1, 1, 10, 10], "loss": [0.4, 0.6, 2.0, 4.0], "seed": [0, 1, 0, 1], "ratio": 1})
    fig = plotting.training_curves(hist, ["loss"], hue="ratio")
    band = fig.axes[0].collections[0].get_paths()[0].vertices
    t = 12.7062047
    lows = {round(x): y for x, y in band[: len(band) // 2]}  # fill_between: the lower edge, then the upper
    highs = {round(x): y for x, y in band[len(band) // 2:]}
    assert min(lows[1], highs[1]) == pytest.approx(0.5 - t * 0.1, rel=1e-6)
    assert max(lows[10], highs[10]) == pytest.approx(3.0 + t * 1.0, rel=1e-6)
    assert plotting.seed_band([0.3]) == (0.3, 0.3)  # one seed: no interval, the line alone
    a = plotting.seed_band([1.0, 2.0, 6.0])
    assert a == pytest.approx((3.0 - 4.302653 * np.std([1, 2, 6], ddof=1) / np.sqrt(3),
                               3.0 + 4.302653 * np.std([1, 2, 6], ddof=1) / np.sqrt(3)), rel=1e-6)


def test_role_bars_stack_the_roles_per_ratio():
    import matplotlib.pyplot as plt

    f = pd.DataFrame({"subject": [0.6, 0.3], "rest": [0.4, 0.7]}, index=pd.Index([1.0, 10.0], name="ratio"))
    fig = plotting.role_bars({"adamw": f, "sgd": f.iloc[::-1], "none": pd.DataFrame()}, ["subject", "rest"])
    assert len(fig.axes) == 2 and fig.get_facecolor()[:3] == (1.0, 1.0, 1.0)
    tops = sorted(p.get_y() + p.get_height() for p in fig.axes[0].patches)
    assert tops == pytest.approx([0.3, 0.6, 1.0, 1.0])  # the two roles stack to the whole mass
    plt.close(fig)
    with pytest.raises(ValueError, match="no column"):
        plotting.role_bars({"adamw": f}, ["subject", "verb"])
    with pytest.raises(ValueError, match="no role table"):
        plotting.role_bars({"adamw": pd.DataFrame()}, ["subject"])


def test_dtap_grid_without_any_histogram_is_a_blank_figure_that_says_so():
    # a dry run: no run reached the ladder's training losses (the sweep chapter's matched maps)
    fig = plotting.dtap_grid({}, rows=["FAFO", "CACO"], cols=[0.5, 0.1], col_label="training loss")
    assert fig.get_facecolor()[:3] == (1.0, 1.0, 1.0)
    assert all(not ax.axison for ax in fig.axes)
    assert any("no run to draw" in t.get_text() for t in fig.texts)
