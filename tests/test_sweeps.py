"""Sweeps: grid expansion, run IDs, the results table, resume, failures, executors.

The papermill tests run a tiny stand-in chapter (no torch import in its kernel) so that the
whole file stays fast; the real chapters go through the same code path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from qkov_lib import cli, sweeps
from qkov_lib.cli import main

FAKE = '''---
jupytext:
  text_representation: {extension: .md, format_name: myst, format_version: 0.13}
kernelspec: {display_name: Python 3, language: python, name: python3}
---

# A stand-in chapter

```{code-cell} ipython3
:tags: [parameters]
profile = None
x = None
y = None
fail = None
results_path = None
```

```{code-cell} ipython3
import json
if fail:
    raise RuntimeError(f"boom at x={x}")
json.dump({"chapter": "fake", "params": {"profile": profile, "x": x, "y": y, "fail": fail, "extra": 7},
           "metrics": {"sum": x + y, "nested": {"prod": x * y}, "rows": [{"i": i, "v": x * i} for i in range(3)],
                       "claims": [{"id": "T2", "paper": "p", "ours": f"x={x}", "verdict": "partly", "chapter": "fake"}]},
           "versions": {"python": "3"}, "git_commit": "abc123", "device": "cpu", "wall_time_s": 0.5},
          open(results_path, "w"))
```
'''


@pytest.fixture
def chapter(tmp_path: Path) -> Path:
    p = tmp_path / "book" / "07_fake.md"
    p.parent.mkdir()
    p.write_text(FAKE)
    return p


def test_expand_grid_is_the_product_with_last_name_fastest():
    pts = sweeps.expand_grid({"a": [1, 2], "b": ["x", "y"]})
    assert pts == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    # list-valued parameters: a list of lists; a list of grids is their union without duplicates
    assert sweeps.expand_grid({"r": [[1], [10]]}) == [{"r": [1]}, {"r": [10]}]
    assert sweeps.expand_grid([{"a": [1, 2]}, {"a": [2, 3]}]) == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert sweeps.expand_grid({}) == [{}]


def test_expand_grid_rejects_bad_grids():
    with pytest.raises(TypeError, match="'a' must be a list"):
        sweeps.expand_grid({"a": 3})
    with pytest.raises(ValueError, match="'a' are empty"):
        sweeps.expand_grid({"a": []})
    with pytest.raises(TypeError, match="mapping"):
        sweeps.expand_grid("a=1")


def test_run_id_depends_on_values_not_key_order():
    a = sweeps.run_id("synthetic", {"x": 1, "y": [1, 2]})
    assert a == sweeps.run_id("synthetic", {"y": [1, 2], "x": 1})
    assert a.startswith("synthetic-") and len(a) == len("synthetic-") + 10
    assert a != sweeps.run_id("synthetic", {"x": 2, "y": [1, 2]})
    assert a != sweeps.run_id("other", {"x": 1, "y": [1, 2]})


def test_chapter_parameters_and_plan(chapter: Path, tmp_path: Path):
    assert cli.chapter_parameters(chapter) == {"profile": None, "x": None, "y": None, "fail": None,
                                                  "results_path": None}
    assert sweeps.chapter_name(chapter) == "fake"
    src, runs = sweeps.plan(chapter, {"x": [1, 2]}, {"y": 3}, profile="test")
    assert src == chapter.resolve()
    assert runs == [{"y": 3, "x": 1, "profile": "test"}, {"y": 3, "x": 2, "profile": "test"}]
    with pytest.raises(ValueError, match="unknown parameter 'z'.*fail, profile"):
        sweeps.plan(chapter, {"z": [1]})
    with pytest.raises(ValueError, match="set by the sweep"):
        sweeps.plan(chapter, {}, {"results_path": "x.json"})
    bad = tmp_path / "book" / "08_bad.md"
    bad.write_text(FAKE.replace("x = None", "print(1)"))
    with pytest.raises(ValueError, match="plain assignments"):
        cli.chapter_parameters(bad)
    none = tmp_path / "book" / "09_none.md"
    none.write_text(FAKE.replace(":tags: [parameters]", ""))
    with pytest.raises(ValueError, match="no cell tagged 'parameters'"):
        cli.chapter_parameters(none)


def test_record_row_flattens_parameters_metrics_claims_and_versions():
    rec = {"run_id": "c-1", "chapter": "c", "status": "ok", "params": {"x": 1, "profile": "test"},
           "resolved_params": {"x": 1, "profile": "test", "lst": [1, 2]},
           "metrics": {"sum": 3.0, "nested": {"deep": {"v": 2}}, "rows": [{"a": 1}],
                       "claims": [{"id": "S3", "verdict": "reproduced"}]},
           "versions": {"torch": "2"}, "git_commit": "abc", "device": "cpu", "wall_time_s": 1.0}
    row = sweeps.record_row(rec)
    assert row["param.x"] == 1 and row["param.lst"] == "[1, 2]" and row["param.profile"] == "test"
    assert row["metric.sum"] == 3.0 and row["metric.nested.deep.v"] == 2
    assert json.loads(row["metric.rows"]) == [{"a": 1}]
    assert row["claim.S3"] == "reproduced" and row["version.torch"] == "2" and row["git_commit"] == "abc"


def test_sweep_records_failures_goes_on_and_resumes(chapter: Path, tmp_path: Path):
    out = tmp_path / "sw"
    res = sweeps.sweep(chapter, {"x": [2], "fail": [False, True]}, out, params={"y": 5}, profile="test",
                       progress=False)
    assert (res.executed, res.skipped, res.failed) == (2, 0, 1)
    t = res.table.set_index("param.fail")
    assert t.loc[False, "status"] == "ok" and t.loc[False, "metric.sum"] == 7
    assert t.loc[False, "metric.nested.prod"] == 10 and t.loc[False, "param.extra"] == 7
    assert t.loc[False, "claim.T2"] == "partly" and t.loc[False, "git_commit"] == "abc123"
    assert t.loc[True, "status"] == "failed" and t.loc[True, "error"] == "RuntimeError: boom at x=2"
    assert "boom" in json.loads((out / "records" / f"{t.loc[True, 'run_id']}.json").read_text())["traceback"]
    assert t.loc[True, "git_commit"] and t.loc[True, "version.python"]  # provenance even for failures
    # the files on disk hold the same table
    for kind in ("csv", "parquet"):
        disk = pd.read_csv(res.paths[kind]) if kind == "csv" else pd.read_parquet(res.paths[kind])
        assert list(disk["run_id"]) == list(res.table["run_id"])
    assert len(json.loads(res.paths["json"].read_text())) == 2
    long = sweeps.metric_frame(res.table, "rows")
    assert list(long["v"]) == [0, 2, 4] and set(long["param.x"]) == {2}
    # resume: nothing to do when failed runs are kept; a plain rerun retries only the failed one
    again = sweeps.sweep(chapter, {"x": [2], "fail": [False, True]}, out, params={"y": 5}, profile="test",
                         progress=False, retry_failed=False)
    assert (again.executed, again.skipped) == (0, 2)
    retry = sweeps.sweep(chapter, {"x": [2], "fail": [False, True]}, out, params={"y": 5}, profile="test",
                         progress=False)
    assert (retry.executed, retry.skipped, retry.failed) == (1, 1, 1)


def test_process_pool_and_submitit_local_give_the_same_table(chapter: Path, tmp_path: Path):
    pytest.importorskip("submitit")
    grid = {"x": [1, 3]}
    pool = sweeps.sweep(chapter, grid, tmp_path / "pool", params={"y": 10}, profile="test", workers=2,
                        progress=False)
    sub = sweeps.sweep(chapter, grid, tmp_path / "sub", params={"y": 10}, profile="test",
                       executor="submitit-local", workers=2, progress=False, poll_s=0.2)
    for res in (pool, sub):
        assert (res.executed, res.failed) == (2, 0)
        assert list(res.table["metric.sum"]) == [11, 13]
    assert list(pool.table["run_id"]) == list(sub.table["run_id"])
    assert any((tmp_path / "sub" / "submitit").glob("*_log.out"))  # it really went through submitit


def test_bad_executor_and_workers(chapter: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="unknown executor 'pbs'"):
        sweeps.sweep(chapter, {"x": [1]}, tmp_path, executor="pbs")
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        sweeps.sweep(chapter, {"x": [1]}, tmp_path, workers=0)


def test_cli_sweep_with_a_yaml_file(chapter: Path, tmp_path: Path):
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(f"chapter: {chapter}\nprofile: test\nparams: {{y: 4}}\ngrid: {{x: [3]}}\n")
    out = tmp_path / "cli"
    assert main(["sweep", "-c", str(cfg), "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())[0]["metrics"]["sum"] == 7
    # a command-line grid axis overrides the file's; a failing run gives exit status 1
    assert main(["sweep", "-c", str(cfg), "--out", str(out), "-g", "fail", "[true]"]) == 1
    with pytest.raises(ValueError, match="unknown keys.*bogus"):
        bad = tmp_path / "bad.yaml"
        bad.write_text("bogus: 1\n")
        sweeps.load_config(bad)
    with pytest.raises(FileNotFoundError):
        sweeps.load_config(tmp_path / "missing.yaml")
