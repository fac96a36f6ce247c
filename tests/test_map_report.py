"""qkov_lib.studies.map_report: what a real-data page shows of its map. Every figure line a page
shows names a key that the page's results file (map_report.record) holds; the DTAP record is the
seed mean per ratio; facts are glued merged, the later part winning."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from qkov_lib import claims  # noqa: E402
from qkov_lib.studies import agreement_roles  # noqa: E402
from qkov_lib.studies import attention_analysis as aa  # noqa: E402
from qkov_lib.studies import map_report as R  # noqa: E402
from qkov_lib.studies import realmap  # noqa: E402
from qkov_lib.tooling import booktext, results  # noqa: E402


def _table():
    """Two optimizers, two base rates, ratios 1 and 10, three seeds; every run trained (validation
    accuracy 0.9 against chance 0.5); the first base rate of each validates better."""
    rows = []
    for opt, etas in (("adamw", (1e-3, 1e-2)), ("sgd", (0.1, 1.0))):
        for i, eta in enumerate(etas):
            for r in (1.0, 10.0):
                for s in (0, 1, 2):
                    up = r > 1
                    rows.append({"optimizer": opt, "eta_ov": eta, "ratio": r, "seed": s, "diverged": False,
                                 "stop_step": 100, "val_accuracy": 0.91 - 0.01 * i, "val_loss": 0.3,
                                 "val_macro_f1": 0.9, "accuracy": 0.85 + 0.001 * s, "macro_f1": 0.84,
                                 "attn_relevant": 0.4 + 0.1 * up, "AC@0.5": 0.3 + 0.2 * up + 0.01 * s,
                                 "ACMC@0.5": 0.3, "sufficiency": 0.2})
    return pd.DataFrame(rows)


def _run(ratio, seed, dtap=None, ac=0.5):
    """A tuned run as the page's tables read it: a row per attention kind with AC/ACMC at two
    thresholds, four test instances (the last without relevant tokens), a DTAP histogram."""
    rows = [{"ratio": ratio, "seed": seed, "accuracy": 0.75, "attention": kind, "attn_relevant": 0.5,
             "AC@0.5": ac if kind == "model" else 0.1, "ACMC@0.5": 0.2, "AC@0.9": 0.1, "ACMC@0.9": 0.05,
             "FTPT": 0.5, "FFPT": 0.25, "FTPF": 0.25, "FFPF": 0.0} for kind in aa.ATTENTIONS]
    return aa.RealRun(ratio, seed, None, rows, dtap, np.array([0.9, 0.2, 0.6, np.nan]),
                      np.array([True, False, True, True]))


def test_tuned_dtap_is_the_seed_mean_of_each_ratio_keyed_by_the_ratio():
    a, b, c = np.zeros((10, 10)), np.zeros((10, 10)), np.zeros((10, 10))
    a[9, 9], b[0, 0], c[5, 5] = 1.0, 1.0, 1.0
    got = R.tuned_dtap({"adamw": [_run(1.0, 0, a), _run(1.0, 1, b), _run(10.0, 0, c), _run(10.0, 1, None)]})
    assert list(got["adamw"]) == ["1", "10"]
    one = np.array(got["adamw"]["1"])
    assert one[9, 9] == one[0, 0] == 0.5 and one.sum() == 1.0
    assert np.array(got["adamw"]["10"])[5, 5] == 1.0  # the run without a histogram is left out


def test_every_figure_line_of_a_page_names_a_key_of_its_results_file(monkeypatch):
    res = realmap.analyse(_table(), 0.5)
    assert res.selected == {"adamw": 1e-3, "sgd": 0.1}
    h = np.full((10, 10), 0.01)
    evals = {"adamw": [_run(1.0, 0, h), _run(1.0, 1, h), _run(10.0, 0, h, ac=0.9), _run(10.0, 1, h, ac=0.8)]}
    roles = {"adamw": pd.DataFrame({"answer": [0.5, 0.7], "rest": [0.5, 0.3]},
                                   index=pd.Index([1.0, 10.0], name="ratio"))}
    lines = []

    def show(fig, name, key):
        lines.append((fig, name, key))
        plt.close(fig) if fig is not None else None

    monkeypatch.setattr(R.figure_source, "show", show)
    monkeypatch.setattr(realmap, "roles_by_optimizer", lambda result, fn: roles)
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: None)
    gain = R.show_phase(res, "squad")
    assert gain.equals(realmap.largest_gain(res)) and gain["Δ AC@0.5 (points)"].iloc[0] == pytest.approx(20.0)
    R.show_accuracy_plane(res, "squad")
    R.show_curves(res, "squad")  # no histories: nothing drawn, still a line of its own
    correct = R.show_tuned(evals, res, "squad")
    shown = R.show_roles(res, None, ["answer", "rest"], "squad")
    assert shown is roles
    # the correctness table: the two right instances with relevant tokens attend 0.9 and 0.6
    assert correct.loc[("adamw", 1.0), ("attn_relevant", "correct")] == pytest.approx(0.75)
    names = [key for _, _, key in lines]
    assert names == ["metrics.map_phase", "metrics.plane", "metrics.curves", "metrics.tuned_dtap",
                     "metrics.tuned_runs.adamw", "metrics.map_roles"]
    assert {name for _, name, _ in lines} == {"squad"}
    assert [fig is None for fig, _, _ in lines] == [False, False, True, False, False, False]
    ds = SimpleNamespace(report={"train": 10})
    extra = claims.claim("R1", claims.CLAIMS["R1"], "natural prefixes", "reproduced", "07_sva")
    doc = {"metrics": results.jsonable(R.record(res, ds, "squad", evals, roles=roles, extra_claims=[extra]))}
    for key in names:
        assert booktext.results_key(doc, key), key
    m = doc["metrics"]
    assert [r["id"] for r in m["claims"]] == ["R1", "R2", "R3", "R1"] and m["claims"][-1]["ours"] == "natural prefixes"
    assert len(m["tuned_runs"]["adamw"]) == 4 * 3 and set(m["tuned_summary"]) == {"adamw"}
    assert m["map_roles"]["adamw"][1] == {"ratio": 10.0, "answer": 0.7, "rest": 0.3}
    assert "map_roles" not in R.record(res, ds, "squad", evals)


def test_facts_are_glued_merged_the_later_part_winning(monkeypatch):
    glued = {}
    monkeypatch.setattr("myst_nb.glue", lambda name, value, display=True: glued.__setitem__(name, value))
    out = R.glue_facts({"a": "1", "b": "2"}, {"b": "3"})
    assert out == glued == {"a": "1", "b": "3"}
    assert R.key("runs", "adamw") == "metrics.tuned_runs.adamw" and R.key("plane") == "metrics.plane"


def test_the_rules_read_as_a_paragraph_and_a_list_of_what_each_claim_reads():
    text = R.rules_markdown().split("\n")
    assert text[0] == claims.ONE_RULE and text[1] == ""
    assert text[2:5] == [f"- {c}: {claims.ESTIMANDS[c].text()}." for c in ("R1", "R2", "R3")]
    assert text[5] == f"- The {{term}}`necessity check`: {realmap.NECESSITY_RULE}."


def test_the_natural_prefix_facts_say_not_run_or_quote_the_verdict():
    cfg = {"seeds": [0, 1, 2]}
    assert agreement_roles.natural_facts(cfg, None) == {
        "lz_verdict": "not run", "lz_reason": "the natural-prefix models were not trained", "lz_effect": "-",
        "lz_seeds": "3"}
    v = claims.Verdict("reproduced", "rule", "why", "", "+0.1")
    f = agreement_roles.natural_facts(cfg, v)
    assert (f["lz_verdict"], f["lz_reason"], f["lz_effect"]) == ("reproduced", "why", "+0.1")
    assert agreement_roles.natural_study({"linzen": False}) == (None, None, None)
    assert agreement_roles.natural_record(None, None) == ([], {"linzen": None})
    frame = pd.DataFrame({"n_attractors": ["all", "1", "all", "1"], "n": [4, 2, 4, 2], "ratio": [1.0, 1.0, 10.0, 10.0],
                          "seed": [0, 0, 0, 0], "accuracy": [0.75, 0.5, 1.0, 1.0]})
    rows, rec = agreement_roles.natural_record(frame, v)
    assert rec == {"linzen": frame.to_dict("records")} and [r["verdict"] for r in rows] == ["reproduced"]
    assert "75.0% at ratio 1, 100.0% at ratio 10" in rows[0]["ours"]


def test_the_tau_sweep_carries_its_title():
    fig = aa.plot_tau_sweep(aa.runs_frame([_run(1.0, 0), _run(1.0, 1)]), [0.5, 0.9], title="adamw (eta_ov 0.001)")
    assert fig._suptitle.get_text() == "adamw (eta_ov 0.001)"
    plt.close(fig)


def test_the_published_hatexplain_tables_put_our_rows_below_theirs_and_leave_out_an_empty_ours():
    from qkov_lib.faithfulness_hatexplain import DEFINITIONAL_DIFFERENCES
    from qkov_lib.studies import rationales

    ours = pd.DataFrame({"ratio": [1.0, 10.0], "accuracy": [0.61234, 0.6], "macro_f1": [0.5, 0.55]})
    beside, differences = rationales.published_tables(ours)
    assert list(beside.index[-2:]) == ["ours (ratio 1)", "ours (ratio 10)"]
    assert beside.loc["ours (ratio 1)", "accuracy"] == 0.612  # three decimals
    assert "BiRNN-Attn" in beside.index and len(beside) == len(rationales.published_tables(ours.iloc[0:0])[0]) + 2
    assert list(differences.columns) == ["ours", "theirs"] and len(differences) == len(DEFINITIONAL_DIFFERENCES)
