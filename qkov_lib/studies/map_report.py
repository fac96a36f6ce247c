"""What a real-data page shows of its protocol map (:mod:`.realmap`): the tables and figures every
dataset page shows in the same places, each figure with the line that says where its numbers are
(:mod:`qkov_lib.figure_source`), and the part of the results file those lines name.

A page trains its map (:func:`.realmap.run_chapter_map`) and evaluates its tuned models
(:func:`.realmap.tuned_evaluations`, ``evals``: ``{optimizer: [RealRun, ...]}``), then calls
:func:`glue_facts` with :func:`page_facts`, :func:`show_data`, :func:`show_phase`,
:func:`show_accuracy_plane` (below the plane of AC@0.5,
which it glues itself), :func:`show_curves`, :func:`show_baselines`, :func:`show_tuned` and, where it
has them, :func:`show_groups` and :func:`show_roles`; it saves :func:`record`, which holds every
key the figure lines name (:data:`KEYS`, under the results file's ``metrics``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd
from torch import nn

from qkov_lib import figure_source, protocol, rate_plane
from qkov_lib.data.text import TextDataset
from qkov_lib.studies import attention_analysis as aa
from qkov_lib.studies import realmap
from qkov_lib.studies.realmap import MapResult

Evals = Mapping[str, Sequence[aa.RealRun]]

#: what each figure of a page draws -> its key in the page's results file (under ``metrics``): the map's
#: phase table and rate plane, every run's validation curves, the tuned models' mean DTAP histograms
#: (``{optimizer: {ratio: 10 x 10 fractions}}``), their per-run metrics (one row per run and attention kind,
#: ``{optimizer: rows}``) and the attention mass per token role (``{optimizer: rows per ratio}``)
KEYS = {"phase": "map_phase", "plane": "plane", "curves": "curves", "dtap": "tuned_dtap", "runs": "tuned_runs",
        "roles": "map_roles"}
#: the changes the phase map shows, one panel each per optimizer
PHASE_METRICS = ("accuracy", "AC@0.5", "attn_relevant", "sufficiency")


def key(what: str, *more: str) -> str:
    """The dotted results key of figure ``what`` (a key of :data:`KEYS`), with ``more`` steps below it:
    ``key("runs", "adamw")`` is ``"metrics.tuned_runs.adamw"``."""
    return ".".join(["metrics", KEYS[what], *more])


def glue_facts(*parts: Mapping[str, str]) -> dict[str, str]:
    """Merge the fact dicts ``parts`` (a later one wins on a shared name), glue every value under its
    name (myst-nb, not displayed here) and return the merged dict."""
    from myst_nb import glue

    facts = {k: v for part in parts for k, v in part.items()}
    for k, v in facts.items():
        glue(k, v, display=False)
    return facts


def page_facts(result: MapResult, ds: TextDataset) -> dict[str, Any]:
    """The numbers every dataset page quotes beside :func:`.realmap.map_facts`: the necessity check
    (``nec_*``), attention at the tuned rates (``att_*``), the data sizes (``data_*``) and, as Markdown
    for a ``{glue:md}`` block, the rules that decide (``map_rules``, :func:`rules_markdown`)."""
    from IPython.display import Markdown

    return {**realmap.necessity_facts(result), **realmap.attention_facts(result), **realmap.data_facts(ds),
            "map_rules": Markdown(rules_markdown())}


def rules_markdown() -> str:
    """The one rule (:data:`qkov_lib.claims.ONE_RULE`), what each of R1-R3 reads
    (:data:`qkov_lib.claims.ESTIMANDS`) and the necessity check's rule (:data:`.realmap.NECESSITY_RULE`),
    as MyST Markdown: a paragraph and a list."""
    from qkov_lib import claims

    items = [f"- {cid}: {claims.ESTIMANDS[cid].text()}." for cid in ("R1", "R2", "R3")]
    return "\n".join([claims.ONE_RULE, "", *items, f"- The {{term}}`necessity check`: {realmap.NECESSITY_RULE}."])


def show_data(ds: TextDataset) -> pd.DataFrame:
    """Print the loader's notes on ``ds`` and return its report table (what was read, kept and dropped)."""
    print("\n".join(ds.notes))
    return ds.report_frame()


def title(result: MapResult, optimizer: str) -> str:
    """``"adamw (eta_ov 0.001)"``: an optimizer with its tuned base rate, the caption of its tables."""
    return f"{optimizer} (eta_ov {result.selected[optimizer]:g})"


def show_phase(result: MapResult, results: str, metrics: Sequence[str] = PHASE_METRICS) -> pd.DataFrame:
    """The phase map (:func:`.protocol.plot_phase`) of ``metrics`` with the tuned rows outlined, its line
    naming ``results``.json (the page's results file) and :data:`KEYS` ``phase``; returns the cell where
    AC@0.5 rises most (:func:`.realmap.largest_gain`), to show below it."""
    figure_source.show(protocol.plot_phase(result.phase, list(metrics), result.selected), results, key("phase"))
    return realmap.largest_gain(result)


def show_accuracy_plane(result: MapResult, results: str) -> None:
    """The rate plane of accuracy over every run, trained or not (:func:`.rate_plane.plot_plane`, the view R1
    reads), shown below the page's plane of AC@0.5 (which the page glues for its summary itself)."""
    figure_source.show(rate_plane.plot_plane(result.plane, "accuracy", result.ceiling, all_runs=True), results,
                       key("plane"))


def show_curves(result: MapResult, results: str) -> None:
    """Attention against validation loss over training (:func:`.realmap.plot_attention_curves`)."""
    figure_source.show(realmap.plot_attention_curves(result), results, key("curves"))


def tuned_tables(evals: Evals) -> dict[str, pd.DataFrame]:
    """Per optimizer, the runs table of its tuned models (:func:`.attention_analysis.runs_frame`)."""
    return {opt: aa.runs_frame(runs) for opt, runs in evals.items()}


def show_baselines(evals: Evals, result: MapResult) -> None:
    """Per optimizer, every attention metric of the model's attention beside uniform and random rows
    (:func:`.attention_analysis.baseline_table`), captioned with its tuned base rate."""
    from IPython.display import display

    for opt, t in tuned_tables(evals).items():
        display(realmap.titled(aa.baseline_table(aa.summarize_runs(t)), title(result, opt)))


def show_tuned(evals: Evals, result: MapResult, results: str) -> pd.DataFrame:
    """The tuned models' DTAP heatmaps (:func:`.realmap.plot_dtap`), per optimizer AC and ACMC against
    the threshold (:func:`.attention_analysis.plot_tau_sweep`) and the focus/prediction table; returns
    the attention among right and wrong predictions (:func:`.realmap.correctness_table`)."""
    from IPython.display import display

    figure_source.show(realmap.plot_dtap(evals, result), results, key("dtap"))
    tables = tuned_tables(evals)
    for opt, t in tables.items():
        if len(t):
            figure_source.show(aa.plot_tau_sweep(t, aa.TAU_SWEEP, title=title(result, opt)), results, key("runs", opt))
    for opt, t in tables.items():
        display(realmap.titled(aa.focus_table(aa.summarize_runs(t)), title(result, opt)))
    return realmap.correctness_table(evals)


def show_groups(evals: Evals, labels: Sequence[Any], name: str) -> None:
    """Per optimizer, test accuracy and attention on the relevant tokens per group of test instances
    (``labels``, one per instance, e.g. the question type; :func:`.attention_analysis.group_table`)."""
    from IPython.display import display

    for opt, runs in evals.items():
        groups = aa.by_group(runs, labels, name)
        display(realmap.titled(aa.group_table(groups, name, "accuracy"), f"{opt}: accuracy"))
        display(realmap.titled(aa.group_table(groups, name, "attn_relevant"), f"{opt}: attention"))


def show_roles(result: MapResult, roles: Callable[[nn.Module], Mapping[str, float]], names: Sequence[str],
               results: str) -> dict[str, pd.DataFrame]:
    """The mass per token role of the tuned models (``roles(model)``, :func:`.realmap.roles_by_optimizer`):
    one table per optimizer (seed means per ratio, three decimals) and the bars of roles ``names``
    (:func:`.realmap.plot_roles`); returns the tables, for :func:`record`."""
    from IPython.display import display

    frames = realmap.roles_by_optimizer(result, roles)
    for opt, frame in frames.items():
        display(frame.round(3).rename_axis(title(result, opt)))
    figure_source.show(realmap.plot_roles(result, frames, list(names)), results, key("roles"))
    return frames


def tuned_dtap(evals: Evals) -> dict[str, dict[str, Any]]:
    """Per optimizer, the seed-mean DTAP histogram of each ratio (:func:`.attention_analysis.mean_dtap`,
    fractions, attention bins × confidence bins) keyed by the ratio as ``"10"``: what the DTAP figure draws."""
    return {opt: {f"{r:g}": h.tolist() for (_, r), h in sorted(aa.mean_dtap(runs).items())}
            for opt, runs in evals.items()}


def record(result: MapResult, ds: TextDataset, dataset: str, evals: Evals,
           roles: Mapping[str, pd.DataFrame] | None = None, extra_claims: Sequence[Mapping[str, str]] = ()
           ) -> dict[str, Any]:
    """A page's results (JSON-ready once saved): the data report, the scorecard rows
    (:func:`.realmap.claims_rows`, then ``extra_claims``), the map (:func:`.realmap.map_record`) and,
    per optimizer, the tuned models' summary (``tuned_summary``), runs and DTAP histograms, and the
    role tables ``roles`` when given: every key of :data:`KEYS` the page's figure lines name."""
    tables = tuned_tables(evals)
    out = {"data_report": ds.report, "claims": [*realmap.claims_rows(result, dataset), *extra_claims],
           **realmap.map_record(result),
           "tuned_summary": {o: aa.summarize_runs(t).to_dict("records") for o, t in tables.items()},
           KEYS["runs"]: {o: t.to_dict("records") for o, t in tables.items()}, KEYS["dtap"]: tuned_dtap(evals)}
    if roles is not None:
        out[KEYS["roles"]] = {o: f.reset_index().to_dict("records") for o, f in roles.items()}
    return out


__all__ = ["KEYS", "PHASE_METRICS", "key", "glue_facts", "page_facts", "rules_markdown", "show_data", "title", "show_phase",
           "show_accuracy_plane", "show_curves", "tuned_tables", "show_baselines", "show_tuned", "show_groups", "show_roles",
           "tuned_dtap", "record"]
