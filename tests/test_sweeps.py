"""Sweeps: grid expansion, run IDs, the results table, resume, failures, executors.

The papermill tests run a tiny stand-in chapter (no torch import in its kernel) so that the
whole file stays fast; the real chapters go through the same code path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from qkov_lib.tooling import chapters, sweeps
from qkov_lib.tooling.cli import main

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
import json, os, time
if fail:
    raise RuntimeError(f"boom at x={x}")
hold = os.environ.get("SWEEP_TEST_HOLD")  # runs with x >= 100 wait while this file exists
if hold and x >= 100:
    open(f"{hold}.started-{x}", "w").close()
    while os.path.exists(hold):
        time.sleep(0.1)
json.dump({"chapter": "fake", "params": {"profile": profile, "x": x, "y": y, "fail": fail, "extra": 7},
           "metrics": {"sum": x + y, "ci": float("nan"), "nested": {"prod": x * y},
                       "rows": [{"i": i, "v": x * i} for i in range(3)],
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
    assert chapters.chapter_parameters(chapter) == {"profile": None, "x": None, "y": None, "fail": None,
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
        chapters.chapter_parameters(bad)
    none = tmp_path / "book" / "09_none.md"
    none.write_text(FAKE.replace(":tags: [parameters]", ""))
    with pytest.raises(ValueError, match="no cell tagged 'parameters'"):
        chapters.chapter_parameters(none)


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



def _strict(text: str):
    """json.loads that rejects NaN/Infinity, as JSON.parse does."""
    def no(c):
        raise ValueError(f"not JSON: {c}")
    return json.loads(text, parse_constant=no)


def test_records_and_tables_are_strict_json_with_relative_paths(chapter: Path, tmp_path: Path):
    out = tmp_path / "sw"
    res = sweeps.sweep(chapter, {"x": [1]}, out, params={"y": 2}, profile="test", progress=False)
    rid = res.table["run_id"][0]
    rec = _strict((out / "records" / f"{rid}.json").read_text())
    assert rec["metrics"]["ci"] is None  # NaN written by the chapter -> null
    assert rec["notebook"] == f"runs/{rid}.ipynb" and rec["results_file"] == f"runs/{rid}.json"
    assert _strict(res.paths["json"].read_text())[0]["metrics"]["ci"] is None
    assert not [p.name for p in out.rglob("*.tmp")]  # atomic writes leave no temporary file
    # a moved sweep folder resumes: nothing reruns
    moved = tmp_path / "moved"
    out.rename(moved)
    again = sweeps.sweep(chapter, {"x": [1]}, moved, params={"y": 2}, profile="test", progress=False)
    assert (again.executed, again.skipped) == (0, 1)


def test_replace_atomically_keeps_the_old_file_when_writing_fails(tmp_path: Path):
    from qkov_lib.tooling import results

    target = tmp_path / "results.csv"
    target.write_text("old")

    def half(tmp: Path) -> None:
        tmp.write_text("new, half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        results.replace_atomically(target, half)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.csv"]


@pytest.mark.parametrize("argv, msg", [
    (["-j", "0", "-g", "x", "[1]"], "workers must be a positive integer, got 0"),
    (["-j", "-3", "-g", "x", "[1]"], "workers must be a positive integer, got -3"),
    (["-g", "x", "[]"], "grid values of 'x' are empty"),
    (["-g", "z", "[1]"], "unknown parameter 'z'"),
])
def test_cli_sweep_refuses_bad_input_before_anything_runs(chapter: Path, tmp_path: Path, capsys, argv, msg):
    out = tmp_path / "never"
    assert main(["sweep", str(chapter), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.startswith("qkov sweep: ") and len(err.strip().splitlines()) == 1
    assert not out.exists()  # no kernel started, nothing written


def test_flat_grid_of_a_list_parameter_is_refused_before_a_kernel_starts(tmp_path: Path, capsys):
    out = tmp_path / "never"
    assert main(["sweep", "synthetic", "--profile", "test", "--out", str(out), "-g", "ratios", "[1, 10]"]) == 2
    err = capsys.readouterr().err
    assert "grid axis 'ratios'" in err and "'[[1], [10]]'" in err and "-y" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    # a value of the right form but out of range: one line naming the rule, no papermill hint
    assert main(["sweep", "synthetic", "--profile", "test", "--out", str(out), "-g", "steps", "[10.5]"]) == 2
    err = capsys.readouterr().err
    assert "'steps' must be an integer >= 1" in err and "papermill" not in err and not out.exists()
    src, runs = sweeps.plan("synthetic", {"ratios": [[1], [10]]}, profile="test")  # the right form passes
    assert [r["ratios"] for r in runs] == [[1], [10]]


def test_a_second_sweep_into_a_locked_folder_stops_at_once(chapter: Path, tmp_path: Path, capsys):
    out = tmp_path / "sw"
    out.mkdir()
    with sweeps.folder_lock(out):
        assert main(["sweep", str(chapter), "--out", str(out), "-g", "x", "[1]", "-p", "y", "1"]) == 2
        err = capsys.readouterr().err
        assert f"another sweep (pid {os.getpid()}) is writing to {out}" in err and len(err.strip().splitlines()) == 1
        assert not (out / "records").exists()
    assert main(["sweep", str(chapter), "--out", str(out), "-g", "x", "[1]", "-p", "y", "1"]) == 0  # lock released


def _children(pid: int) -> set[int]:
    """PIDs of the live processes whose parent is ``pid`` (from /proc)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(pid) and not fields.get("State", "").startswith("Z"):
            out.add(int(d.name))
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(p)
    return alive


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_killing_a_parallel_sweep_leaves_no_worker_and_a_rerun_completes_it(chapter: Path, tmp_path: Path, sig):
    out, hold = tmp_path / "sw", tmp_path / "hold"
    hold.write_text("")
    grid = "[1, 2, 100, 101]"  # two quick runs, then two that wait on `hold`
    env = {**os.environ, "SWEEP_TEST_HOLD": str(hold), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "sweep.log"
    with log.open("w") as fh:
        parent = subprocess.Popen([sys.executable, "-m", "qkov_lib.tooling.cli", "sweep", str(chapter), "-j", "2", "-g", "x",
                                   grid, "-p", "y", "1", "--profile", "test", "--out", str(out)], env=env,
                                  stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not all(Path(f"{hold}.started-{x}").exists() for x in (100, 101)):
            if parent.poll() is not None or time.monotonic() > deadline:
                records = {p.name: json.loads(p.read_text()).get("error") for p in (out / "records").glob("*.json")}
                pytest.fail(f"the held runs never started (sweep rc {parent.poll()}); its output:\n"
                            f"{log.read_text()[-3000:]}\nrecords: {records}")
            time.sleep(0.2)
        workers = _children(parent.pid)
        kernels = set().union(*(_children(w) for w in workers))
        assert len(workers) == 2 and len(kernels) == 2  # two pool workers, each running a kernel
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 15  # kernels notice a dead worker within ~1 s
        while _alive(workers | kernels) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(workers | kernels), f"left running after {sig.name}: {_alive(workers | kernels)}"
    finally:
        if parent.poll() is None:
            parent.kill()
    done = {p.stem for p in (out / "records").glob("*.json")}
    assert len(done) == 2  # the quick runs finished; the killed ones wrote nothing
    hold.unlink()
    res = sweeps.sweep(chapter, {"x": [1, 2, 100, 101]}, out, params={"y": 1}, profile="test", workers=2,
                       progress=False)
    assert (res.executed, res.skipped, res.failed) == (2, 2, 0)
    assert sorted(res.table["param.x"]) == [1, 2, 100, 101] and res.table["run_id"].is_unique
    assert set(res.table["status"]) == {"ok"} and len(list((out / "records").glob("*.json"))) == 4
