"""The interactive figure's precomputed grid (qkov_lib.studies.explorer): the reduced ODE's own
trajectories read at matched loss, the phase map's cells, the sharpening with the ratio, and the
data and page fragment the browser receives."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from qkov_lib import dynamics as dy
from qkov_lib import profiles
from qkov_lib.studies import explorer as ex
from qkov_lib.studies import s2_phase as s2
from qkov_lib.tooling import plotlyjs


@pytest.fixture(scope="module")
def cfg():
    return profiles.resolve(ex.PROFILES, "test")


@pytest.fixture(scope="module")
def grid(cfg):
    return ex.explorer_grid(cfg)


def _on_trajectory(cfg, p, init, ratio, sizes, level):
    """``w``, ``q`` and the attention on the distinct token where the single-cell solver
    :func:`qkov_lib.dynamics.integrate` (from w0 = q0 = init) first reaches ``level``: the crossing
    bracketed on a coarse run and read on a fine run inside the bracket."""
    coarse = dy.integrate(p, init, init, sizes, cfg["s2_eta_ov"], ratio, t_max=cfg["s2_t_max"], n_points=400)
    loss, t = coarse["loss"].to_numpy(), coarse["t"].to_numpy()
    b = int(np.argmax(loss <= level))
    assert b > 0, "the level must be crossed after the start"
    fine = dy.integrate(p, init, init, sizes, cfg["s2_eta_ov"], ratio, t_max=t[b],
                        t_eval=np.geomspace(max(t[b - 1], 1e-3), t[b], 400))
    ll = np.log(fine["loss"].to_numpy())[::-1]
    return {c: float(np.interp(math.log(level), ll, fine[c].to_numpy()[::-1])) for c in ("w", "q", "distinct")}


@pytest.mark.parametrize("i, j, r, k, li", [(0, 0, 0, 0, 2), (1, 1, 2, 3, 8), (1, 0, 1, 1, 15), (0, 1, 2, 2, 8)])
def test_the_grid_is_the_ode_solvers_trajectory_at_each_loss_level(cfg, grid, i, j, r, k, li):
    sizes = dy.Sizes(cfg["n_classes"], cfg["n_common_vocab"], tuple(cfg["s2_n_common"][i]))
    level = float(grid.levels[li])
    got = {c: float(a[i, j, r, k, li]) for c, a in (("w", grid.w), ("q", grid.q), ("distinct", grid.attention))}
    want = _on_trajectory(cfg, ex.PARAMS[k], grid.inits[j], grid.ratios[r], sizes, level)
    assert float(dy.reduced_loss(got["w"], got["q"], sizes)) == pytest.approx(level, rel=1e-8)
    assert got["w"] == pytest.approx(want["w"], rel=1e-4)
    assert got["q"] == pytest.approx(want["q"], rel=1e-4, abs=1e-4)
    assert got["distinct"] == pytest.approx(want["distinct"], abs=1e-4)


def test_the_heat_map_holds_the_phase_maps_cells(cfg, grid):
    ode = s2.ode_map(profiles.resolve(s2.PROFILES, "test"))
    cells = ex.phase_cells(grid)
    keys = ["ratio", "init", "n", "loss"]
    both = cells.merge(ode, on=keys, suffixes=("", " (map)"), validate="one_to_one")
    assert len(both) == len(ode) == len(cells) == (len(grid.ns) * len(grid.inits) * len(grid.ratios)
                                                   * len(grid.phase_levels))
    for p in ex.PARAMS:
        np.testing.assert_allclose(both[f"att {p}"], both[f"att {p} (map)"], rtol=1e-12, atol=1e-14)
    assert (both["top two"] == both["top two (map)"]).all()
    assert (both["ranking"] == both["ranking (map)"]).all()


def test_attention_on_the_distinct_token_rises_with_the_ratio_at_matched_loss(grid):
    # T5 at matched loss: a faster QK leaves more attention on the distinct token when the loss
    # reaches the same level, in every parameterization, init, n and level reached
    a = grid.attention
    rises = np.diff(a, axis=2)  # along the ratio axis, ascending ratios
    reached = np.isfinite(rises)
    assert reached.sum() > 0.9 * rises.size
    assert np.all(rises[reached] > 0), "the attention fell somewhere as the ratio grew"
    assert sorted(grid.ratios) == grid.ratios


def test_the_grid_has_the_maps_axes_and_a_ladder_that_holds_its_levels(cfg, grid):
    shape = (len(cfg["s2_n_common"]), len(cfg["s2_init_scales"]), len(cfg["s2_ratios"]), 4, len(grid.levels))
    assert grid.w.shape == grid.q.shape == grid.attention.shape == shape
    assert np.all(np.diff(grid.levels) < 0) and grid.levels[0] < math.log(cfg["n_classes"])
    assert set(cfg["s2_losses"]) <= set(grid.levels.tolist())
    assert len(grid.levels) >= cfg["n_curve_levels"]
    assert np.nanmax(grid.attention) < 1 and np.nanmin(grid.attention) > 0
    with pytest.raises(KeyError, match="not on the grid's ladder"):
        grid.level_index(0.123456)


def test_the_figure_data_is_strict_json_and_only_selects_what_the_grid_holds(grid):
    d = ex.figure_data(grid)
    text = json.dumps(d, allow_nan=False)  # NaN would break JSON.parse in the browser
    assert "NaN" not in text
    n, i, r = len(grid.ns) - 1, 1, 2
    cell = d["curves"][n][i][r]
    for key in ("attention", "logodds", "w"):
        assert len(cell[key]) == 4 and all(len(v) == len(grid.levels) for v in cell[key])
    np.testing.assert_allclose(np.array(cell["attention"], dtype=float), grid.attention[n, i, r], rtol=1e-4)
    np.testing.assert_allclose(np.array(cell["w"], dtype=float), grid.w[n, i, r], rtol=1e-4)
    cells = ex.phase_cells(grid).set_index(["n", "init", "ratio", "loss"])
    for li, level in enumerate(grid.phase_levels):
        row = cells.loc[(grid.ns[n], grid.inits[i], grid.ratios[r], level)]
        sentence = d["ranking"][n][i][r][li]
        assert sentence.startswith(row["ranking"].split(" > ")[0]) and ex.C.S2_WORDS[row["top two"]] in sentence
        assert d["phase"][n][i]["z"][li][r] == ex.CALLS.index(row["top two"])
        assert all(f"{p}: {row[f'att {p}']:.4f}" in d["phase"][n][i]["text"][li][r] for p in ex.PARAMS)
    assert len(d["xrange"]) == len(grid.phase_levels) and all(lo < hi for hi, lo in d["xrange"])


def test_the_page_fragment_embeds_the_data_and_loads_nothing_from_elsewhere(grid):
    page = ex.figure_html(grid, root_id="fig1")
    assert plotlyjs.needs_plotly(page)
    m = re.search(r'<script type="application/json" id="fig1-data">(.*?)</script>', page, re.S)
    assert m and json.loads(m.group(1))["labels"]["ratio"] == [f"{r:g}" for r in grid.ratios]
    assert not re.search(r"<script[^>]+src=", page) and "http" not in page.replace("http-equiv", "")
    start = ex.default_state(grid)
    assert f'data-control="ratio" min="0" max="{len(grid.ratios) - 1}" step="1" value="{start["ratio"]}"' in page
    assert grid.ratios[start["ratio"]] == 1.0


@pytest.mark.parametrize("change, message", [
    (dict(n_curve_levels=1), "n_curve_levels must be an integer >= 2"),
    (dict(curve_floor=0.5), "curve_floor must be a number in"),
    (dict(s2_ratios=[]), "s2_ratios must be a non-empty list"),
    (dict(s2_losses=[5.0]), "s2_losses must lie below the loss at init"),
])
def test_bad_settings_are_refused_by_name_before_anything_is_integrated(cfg, change, message):
    with pytest.raises(ValueError, match=message):
        ex.explorer_grid({**cfg, **change})
