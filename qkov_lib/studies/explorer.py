"""The reduced dynamics in the reader's hands: the book's interactive figure, precomputed.

Over the S2 phase map's axes (:mod:`qkov_lib.studies.s2_phase`: ``eta_QK/eta_OV``, the init
scale of the symmetric state ``w0 = q0``, the common-token counts ``n``) and the four
parameterizations, the reduced ODE (:func:`qkov_lib.studies.s2_phase.integrate_cells`, the phase
map's own solver call) is read where each trajectory's training loss first reaches every level of
a ladder (:func:`qkov_lib.studies.s2_phase.at_losses`): the OV margin ``w``, the QK scalar ``q``
and the attention on the distinct token. The ladder holds the phase map's loss levels, so the
phase map's cells are read off the same grid (:func:`phase_cells`, equal to
:func:`qkov_lib.studies.s2_phase.ode_map`). :func:`figure_data` turns the grid into the
JSON-able arrays that :func:`figure_html` embeds in the page: the browser only selects among
precomputed arrays (no arithmetic on the dynamics happens there). Plotly's JavaScript is served by
the book (:mod:`qkov_lib.tooling.plotlyjs`), never from a CDN.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qkov_lib import claims as C
from qkov_lib import dynamics as dy
from qkov_lib.studies import s2_phase as s2

PARAMS = s2.PARAMS

# The phase map's settings (same profile) and the shallow part of the loss ladder of the curves:
# ``n_curve_levels`` log-spaced levels from just below the loss at init down to ``curve_floor``,
# where the attention still moves visibly; the phase map's own (deeper) levels are added to them.
_S2_KEYS = ("n_classes", "n_common_vocab", "s2_eta_ov", "s2_t_max", "s2_n_points", "s2_ratios", "s2_init_scales",
            "s2_n_common", "s2_losses")
PROFILES: dict[str, dict] = {
    name: {**{k: s2.PROFILES[name][k] for k in _S2_KEYS}, "n_curve_levels": n, "curve_floor": 1e-16}
    for name, n in (("test", 12), ("cpu", 32), ("full", 40))
}


def check_settings(cfg: Mapping) -> None:
    """ValueError, naming the setting, unless the phase map's axes are valid
    (:func:`qkov_lib.studies.s2_phase.check_settings`), ``n_curve_levels >= 2`` and
    ``0 < curve_floor`` below the shallowest phase-map level."""
    s2.check_settings({**cfg, "s2_full_cells": []})
    n = cfg.get("n_curve_levels")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n_curve_levels must be an integer >= 2, got {n!r}")
    floor = cfg.get("curve_floor")
    if not (isinstance(floor, (int, float)) and 0 < floor < max(cfg["s2_losses"])):
        raise ValueError(f"curve_floor must be a number in (0, {max(cfg['s2_losses']):g}) (below the shallowest "
                         f"loss level), got {floor!r}")


def loss_ladder(cfg: Mapping) -> np.ndarray:
    """The training-loss levels of the curves, deepest last: ``n_curve_levels`` log-spaced levels
    from 0.9 log K (just below the loss at a small init) to ``curve_floor``, with the phase map's
    levels ``s2_losses`` added."""
    top = 0.9 * math.log(cfg["n_classes"])
    ladder = np.geomspace(top, float(cfg["curve_floor"]), int(cfg["n_curve_levels"]))
    return np.array(sorted(set(ladder.tolist()) | {float(v) for v in cfg["s2_losses"]}, reverse=True))


@dataclass
class Grid:
    """The precomputed dynamics. ``w``, ``q`` and ``attention`` have shape (n, init, ratio,
    parameterization, level) over ``ns`` (labels of the common-token sets), ``inits``, ``ratios``,
    :data:`PARAMS` and ``levels`` (training loss, deepest last); NaN where a trajectory never
    reaches a level within ``s2_t_max`` steps or starts below it."""

    cfg: dict
    ratios: list[float]
    inits: list[float]
    ns: list[str]
    levels: np.ndarray
    w: np.ndarray
    q: np.ndarray
    attention: np.ndarray

    @property
    def phase_levels(self) -> list[float]:
        """The phase map's levels, shallowest first (each is one of ``levels``)."""
        return sorted((float(v) for v in self.cfg["s2_losses"]), reverse=True)

    def level_index(self, level: float) -> int:
        """The index of ``level`` in ``levels`` (KeyError if it is not one)."""
        hit = np.flatnonzero(self.levels == float(level))
        if not len(hit):
            raise KeyError(f"loss level {level!r} is not on the grid's ladder")
        return int(hit[0])


def explorer_grid(cfg: Mapping) -> Grid:
    """Integrate the reduced ODE once per (n, parameterization) for every (ratio, init) cell
    (:func:`qkov_lib.studies.s2_phase.integrate_cells`, as the phase map does) and read ``w``,
    ``q`` and the attention on the distinct token at every level of :func:`loss_ladder`
    (:func:`qkov_lib.studies.s2_phase.at_losses`)."""
    check_settings(cfg)
    ratios, inits = [float(r) for r in cfg["s2_ratios"]], [float(s) for s in cfg["s2_init_scales"]]
    levels = loss_ladder(cfg)
    tau = np.log1p(s2._time_grid(cfg["s2_t_max"], cfg["s2_n_points"]))
    shape = (len(cfg["s2_n_common"]), len(inits), len(ratios), len(PARAMS), len(levels))
    W, Q, A = (np.full(shape, np.nan) for _ in range(3))
    for i, n in enumerate(cfg["s2_n_common"]):
        sizes = dy.Sizes(cfg["n_classes"], cfg["n_common_vocab"], tuple(n))
        for k, p in enumerate(PARAMS):
            sol = s2.integrate_cells(p, sizes, ratios, inits, cfg["s2_eta_ov"], cfg["s2_t_max"])
            w, q = s2.at_losses(sol, sizes, tau, levels)  # (ratio-major cells, levels)
            with np.errstate(invalid="ignore"):
                a = dy.distinct_mass(np.nan_to_num(q, nan=0.0), sizes).reshape(q.shape)
            a = np.where(np.isnan(q), np.nan, a)
            # cells are ratio-major (ratio, init): put them on the (init, ratio) axes
            for arr, v in ((W, w), (Q, q), (A, a)):
                arr[i, :, :, k, :] = v.reshape(len(ratios), len(inits), -1).transpose(1, 0, 2)
    return Grid(dict(cfg), ratios, inits, [s2.n_label(n) for n in cfg["s2_n_common"]], levels, W, Q, A)


def ranking_at(values: Mapping[str, float]) -> tuple[str, str]:
    """``(ranking, top two)`` of one cell from each parameterization's log-odds of the attention on
    the distinct token: the parameterizations, most attention first, joined by ``" > "`` (empty
    unless every value is finite) and :func:`qkov_lib.claims.s2_top_two`, as the phase map ranks."""
    ok = all(np.isfinite(list(values.values())))
    order = sorted(values, key=lambda p: -values[p]) if ok else []
    return " > ".join(order), C.s2_top_two(values)


def phase_cells(grid: Grid) -> pd.DataFrame:
    """The S2 phase map read off the grid: one row per (ratio, init, n, phase-map level) with the
    columns of :func:`qkov_lib.studies.s2_phase.ode_map` (``att <p>``, ``logodds <p>``, ranking,
    top two, ``2nd − 3rd``)."""
    rows = []
    for (i, n), (j, s), (r, ratio), L in _cells(grid, grid.phase_levels):
        li = grid.level_index(L)
        att = {p: float(grid.attention[i, j, r, k, li]) for k, p in enumerate(PARAMS)}
        lo = {p: float(s2.log_odds(a)) for p, a in att.items()}
        ranking, top = ranking_at(lo)
        order = ranking.split(" > ") if ranking else []
        rows.append({"ratio": ratio, "init": s, "n": n, "loss": L,
                     **{f"att {p}": att[p] for p in PARAMS}, **{f"logodds {p}": lo[p] for p in PARAMS},
                     "ranking": ranking, "top two": top,
                     "2nd − 3rd": lo[order[1]] - lo[order[2]] if order else math.nan})
    return pd.DataFrame(rows)


def _cells(grid: Grid, levels: Sequence[float]):
    for i, n in enumerate(grid.ns):
        for j, s in enumerate(grid.inits):
            for r, ratio in enumerate(grid.ratios):
                for L in levels:
                    yield (i, n), (j, s), (r, ratio), L


def _fmt(x: float, digits: int = 5) -> float | None:
    """A number for the page: ``digits`` significant digits, None for NaN."""
    return None if not np.isfinite(x) else float(f"{x:.{digits}g}")


def _nested(a: np.ndarray, digits: int = 5) -> list:
    return [_nested(x, digits) for x in a] if a.ndim > 1 else [_fmt(float(x), digits) for x in a]


#: each parameterization's colour: seaborn's "deep" palette in :data:`PARAMS` order, as the book's
#: matplotlib figures draw them (written out: importing seaborn costs the page seconds)
COLOURS = dict(zip(PARAMS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52")))

#: the heat map's top-two calls (:func:`qkov_lib.claims.s2_top_two`) and their colours
CALL_COLOURS = {"A": "#4c72b0", "B": "#dd8452", "neither": "#c9c9c9", "tie": "#f2e394", "not tested": "#ffffff"}
CALLS = tuple(CALL_COLOURS)


def figure_data(grid: Grid) -> dict:
    """Everything the interactive figure shows, JSON-able, the browser only selecting among it:

    * ``curves[n][init][ratio]``: ``attention``, ``logodds`` and ``w``, each ``[parameterization][level]``
      over ``levels`` (training loss, deepest last);
    * ``ranking[n][init][ratio][phase level]``: the ranking's sentence at that loss;
    * ``phase[n][init]``: the heat map over (phase level, ratio): ``z`` (index of the top-two call
      in :data:`CALLS`) and ``text`` (the hover: the four attentions and the call);
    * labels of every control, the colours, and ``xrange[phase level]``: the curves' loss axis
      (log10, deepest right) that shows the ladder to ``curve_floor`` and the chosen level."""
    cfg = grid.cfg
    lo = s2.log_odds(grid.attention)
    cells = phase_cells(grid).set_index(["n", "init", "ratio", "loss"])
    words = {k: C.S2_WORDS[k] for k in CALLS}

    def sentence(row: pd.Series) -> str:
        if not row["ranking"]:
            return "not every parameterization reaches this loss within the integration"
        vals = " > ".join(f"{p} {row[f'att {p}']:.4f}" for p in row["ranking"].split(" > "))
        return f"{vals}; top two: {words[row['top two']]}"

    ranking, phase = [], []
    for n in grid.ns:
        ranking.append([[[sentence(cells.loc[(n, s, r, L)]) for L in grid.phase_levels] for r in grid.ratios]
                        for s in grid.inits])
        per_init = []
        for s in grid.inits:
            z, text = [], []
            for L in grid.phase_levels:
                rows = [cells.loc[(n, s, r, L)] for r in grid.ratios]
                z.append([CALLS.index(row["top two"]) for row in rows])
                text.append([f"ratio {r:g}, loss {L:g}<br>" + "<br>".join(
                    f"{p}: {row[f'att {p}']:.4f}" if np.isfinite(row[f"att {p}"]) else f"{p}: not reached"
                    for p in PARAMS) + f"<br>top two: {words[row['top two']]}" for r, row in zip(grid.ratios, rows)])
            per_init.append({"z": z, "text": text})
        phase.append(per_init)
    curves = [[[{"attention": _nested(grid.attention[i, j, r]), "logodds": _nested(lo[i, j, r]),
                 "w": _nested(grid.w[i, j, r])}
                for r in range(len(grid.ratios))] for j in range(len(grid.inits))] for i in range(len(grid.ns))]
    top, floor = math.log10(grid.levels[0]), math.log10(float(cfg["curve_floor"]))
    pad = 0.02 * (top - floor)
    xrange = [[top + pad, min(floor, math.log10(L) - 1.0) - pad] for L in grid.phase_levels]
    n_calls = len(CALLS)
    scale = [[b, CALL_COLOURS[k]] for i, k in enumerate(CALLS) for b in (i / n_calls, (i + 1) / n_calls)]
    return {
        "params": PARAMS, "colours": [COLOURS[p] for p in PARAMS],
        "levels": [float(L) for L in grid.levels], "phase_levels": grid.phase_levels, "xrange": xrange,
        "labels": {"ratio": [f"{r:g}" for r in grid.ratios], "init": [f"{s:g}" for s in grid.inits],
                   "n": grid.ns, "level": [f"{L:g}" for L in grid.phase_levels]},
        "curves": curves, "ranking": ranking, "phase": phase,
        "calls": [{"name": words[k], "colour": CALL_COLOURS[k]} for k in CALLS], "colorscale": scale,
        "sizes": {"K": cfg["n_classes"], "M": cfg["n_common_vocab"], "eta_ov": cfg["s2_eta_ov"]},
    }


def default_state(grid: Grid) -> dict[str, int]:
    """The controls' start: ratio 1 (else the middle ratio), the largest init, the mixture over
    ``n`` (else the first set), the phase map's shallowest level, attention on the y axis."""
    r = grid.ratios.index(1.0) if 1.0 in grid.ratios else len(grid.ratios) // 2
    mixed = [i for i, n in enumerate(grid.cfg["s2_n_common"]) if len(n) > 1]
    return {"ratio": r, "init": len(grid.inits) - 1, "n": mixed[0] if mixed else 0, "level": 0}


# The page's script: it reads the embedded arrays and hands the selected ones to Plotly; every
# number it draws is one of figure_data's. Controls carry data-control="ratio|init|n|level|y".
_SCRIPT = r"""
(function () {
  var root = document.getElementById(ROOT_ID);
  var D = JSON.parse(document.getElementById(ROOT_ID + '-data').textContent);
  var say = root.querySelector('.qkov-explorer-ranking');
  if (!window.Plotly) { say.textContent = D.no_plotly; return; }
  var c = {};
  ['ratio', 'init', 'n', 'level', 'y'].forEach(function (k) { c[k] = root.querySelector('[data-control="' + k + '"]'); });
  var curves = root.querySelector('.qkov-explorer-curves'), phase = root.querySelector('.qkov-explorer-phase');
  var cfg = {responsive: true, displayModeBar: false};
  function at(k) { return parseInt(c[k].value, 10); }
  function draw() {
    var n = at('n'), i = at('init'), r = at('ratio'), l = at('level'), y = c.y.value;
    root.querySelector('[data-show="ratio"]').textContent = D.labels.ratio[r];
    root.querySelector('[data-show="level"]').textContent = D.labels.level[l];
    var cell = D.curves[n][i][r], traces = [];
    D.params.forEach(function (p, k) {
      traces.push({x: D.levels, y: cell[y][k], name: p, legendgroup: p, mode: 'lines',
                   line: {color: D.colours[k], width: 2}, hovertemplate: p + ': %{y}<extra>loss %{x}</extra>'});
      traces.push({x: D.levels, y: cell.w[k], name: p, legendgroup: p, showlegend: false, mode: 'lines',
                   xaxis: 'x2', yaxis: 'y2', line: {color: D.colours[k], width: 2},
                   hovertemplate: p + ': w = %{y}<extra>loss %{x}</extra>'});
    });
    var mark = D.phase_levels[l];
    Plotly.react(curves, traces, {
      height: 560, margin: {l: 60, r: 10, t: 40, b: 60},
      legend: {orientation: 'h', x: 0, y: 1.02, xanchor: 'left', yanchor: 'bottom'},
      xaxis: {type: 'log', range: D.xrange[l], matches: 'x2', showticklabels: false, exponentformat: 'power'},
      xaxis2: {type: 'log', range: D.xrange[l], title: {text: D.text.x}, anchor: 'y2', exponentformat: 'power'},
      yaxis: {domain: [0.55, 1], title: {text: D.text[y]}},
      yaxis2: {domain: [0, 0.45], type: 'log', title: {text: D.text.w}, anchor: 'x2'},
      shapes: [{type: 'line', xref: 'x', yref: 'paper', x0: mark, x1: mark, y0: 0, y1: 1,
                line: {color: '#444', width: 1, dash: 'dot'}}]
    }, cfg);
    say.textContent = D.text.ranking + ' ' + D.labels.level[l] + ': ' + D.ranking[n][i][r][l];
    var h = D.phase[n][i];
    Plotly.react(phase, [{type: 'heatmap', z: h.z, text: h.text, x: D.labels.ratio, y: D.labels.level,
                          hovertemplate: '%{text}<extra></extra>', colorscale: D.colorscale, zmin: -0.5,
                          zmax: D.calls.length - 0.5, showscale: false, xgap: 1, ygap: 1}], {
      height: 480, margin: {l: 70, r: 10, t: 10, b: 70},
      xaxis: {type: 'category', title: {text: D.text.ratio}},
      yaxis: {type: 'category', autorange: 'reversed', title: {text: D.text.x}},
      shapes: [{type: 'rect', xref: 'x', yref: 'y', x0: r - 0.5, x1: r + 0.5, y0: l - 0.5, y1: l + 0.5,
                line: {color: '#000', width: 2}}]
    }, cfg);
  }
  Object.keys(c).forEach(function (k) { c[k].addEventListener('input', draw); c[k].addEventListener('change', draw); });
  draw();
  phase.on('plotly_click', function (ev) {
    var pt = ev.points[0];
    c.ratio.value = pt.pointIndex[1]; c.level.value = pt.pointIndex[0]; draw();
  });
})();
"""

TEXT = {"x": "training loss", "attention": "attention on the distinct token",
        "logodds": "log-odds of the attention", "w": "OV margin w (log scale)",
        "ratio": "η_QK / η_OV", "ranking": "S2 ranking (most attention on the distinct token first) at training loss"}
STYLE = """
.qkov-explorer-controls{display:flex;flex-wrap:wrap;gap:.4rem 1.4rem;align-items:center;margin-bottom:.4rem}
.qkov-explorer-controls label{display:flex;flex-wrap:wrap;align-items:center;gap:.2rem .5rem;max-width:100%}
.qkov-explorer-controls output{min-width:3em;font-weight:600}
.qkov-explorer-controls input[type=range]{width:12rem;max-width:100%}
.qkov-explorer-controls select{max-width:100%}
.qkov-explorer-ranking{font-size:.9rem;margin:.3rem 0}
.qkov-explorer-caption{font-size:.9rem;margin:.8rem 0 .2rem}
.qkov-explorer-legend{display:flex;flex-wrap:wrap;gap:.2rem 1.2rem;font-size:.85rem}
.qkov-explorer-legend i{display:inline-block;width:.9em;height:.9em;border:1px solid #555;margin-right:.35em;
  vertical-align:middle}
"""
PHASE_CAPTION = ("S2 phase map at the chosen init scale and n: the top two at each ratio (columns) and training "
                 "loss (rows). Hover over a cell for its four attentions; click it to draw its curves.")
NO_PLOTLY = ("The interactive figure needs Plotly's JavaScript, which the built book serves from its _static folder; "
             "it is not loaded here.")


def figure_html(grid: Grid, root_id: str = "qkov-explorer") -> str:
    """The interactive figure as one HTML fragment: the controls (ratio and loss sliders, init,
    n and y-axis menus), the ranking line, the curves and the phase map's heat map, the grid's
    :func:`figure_data` embedded as JSON and the script that selects among it. Plotly itself is
    loaded by the page (:mod:`qkov_lib.tooling.plotlyjs` adds it where this fragment is)."""
    data = {**figure_data(grid), "text": TEXT, "no_plotly": NO_PLOTLY}
    start = default_state(grid)
    payload = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    esc = html.escape

    def select(key: str, labels: Sequence[str], chosen: int, title: str, values: Sequence[str] | None = None) -> str:
        values = values or [str(i) for i in range(len(labels))]
        opts = "".join(f'<option value="{v}"{" selected" if i == chosen else ""}>{esc(lab)}</option>'
                       for i, (v, lab) in enumerate(zip(values, labels)))
        return f'<label>{esc(title)} <select data-control="{key}">{opts}</select></label>'

    def slider(key: str, count: int, chosen: int, title: str, shown: str) -> str:
        return (f'<label class="qkov-explorer-slider">{esc(title)} <output data-show="{key}">{esc(shown)}</output>'
                f'<input type="range" data-control="{key}" min="0" max="{count - 1}" step="1" value="{chosen}"></label>')

    labels = data["labels"]
    controls = "".join([
        slider("ratio", len(labels["ratio"]), start["ratio"], "η_QK / η_OV", labels["ratio"][start["ratio"]]),
        slider("level", len(labels["level"]), start["level"], "S2 ranking at training loss", labels["level"][0]),
        select("init", labels["init"], start["init"], "init scale (w0 = q0)"),
        select("n", labels["n"], start["n"], "common tokens n"),
        select("y", [TEXT["attention"], TEXT["logodds"]], 0, "y axis", ["attention", "logodds"]),
    ])
    legend = "".join(f'<span class="qkov-explorer-swatch"><i style="background:{c["colour"]}"></i>{esc(c["name"])}</span>'
                     for c in data["calls"])
    return (f'<style>{STYLE}</style><div class="qkov-explorer" id="{root_id}" data-qkov-plotly="1">'
            f'<div class="qkov-explorer-controls">{controls}</div>'
            f'<p class="qkov-explorer-ranking" aria-live="polite"></p>'
            f'<div class="qkov-explorer-curves"></div>'
            f'<p class="qkov-explorer-caption">{esc(PHASE_CAPTION)}</p>'
            f'<div class="qkov-explorer-legend">{legend}</div>'
            f'<div class="qkov-explorer-phase"></div></div>'
            f'<script type="application/json" id="{root_id}-data">{payload}</script>'
            f'<script>{_SCRIPT.replace("ROOT_ID", json.dumps(root_id))}</script>')


def explorer_facts(grid: Grid) -> dict[str, str]:
    """The numbers the page quotes (glue strings): the grid's axes, its size and how many of the
    phase map's cells have each top-two call."""
    cells = phase_cells(grid)
    share = cells["top two"].value_counts().to_dict()
    return {
        "ex_ratios": ", ".join(f"{r:g}" for r in grid.ratios), "ex_inits": ", ".join(f"{s:g}" for s in grid.inits),
        "ex_ns": ", ".join(grid.ns), "ex_levels": str(len(grid.levels)), "ex_phase_levels": str(len(grid.phase_levels)),
        "ex_curves": str(len(grid.ns) * len(grid.inits) * len(grid.ratios) * len(PARAMS)),
        "ex_cells": str(len(cells)), "ex_K": str(grid.cfg["n_classes"]), "ex_M": str(grid.cfg["n_common_vocab"]),
        "ex_floor": f"{grid.cfg['curve_floor']:g}", "ex_deepest": f"{grid.levels[-1]:g}",
        **{f"ex_share_{k}": str(int(share.get(k, 0))) for k in ("A", "B", "neither", "tie")},
    }
