import json

import pytest

from qkov_lib.tooling import chapters, cli, results

from qkov_lib import claims, profiles
from qkov_lib.studies import synthetic as exp


def test_resolve_profiles_and_overrides(monkeypatch):
    monkeypatch.delenv(profiles.PROFILE_ENV, raising=False)
    assert profiles.resolve(exp.PROFILES, None)["profile"] == "cpu"
    monkeypatch.setenv(profiles.PROFILE_ENV, "test")
    cfg = profiles.resolve(exp.PROFILES, None, ratios=[1, 100], steps=None)
    assert cfg["profile"] == "test" and cfg["ratios"] == [1, 100]
    assert cfg["steps"] == exp.PROFILES["test"]["steps"]     # None keeps the profile value
    assert profiles.resolve(exp.PROFILES, "full")["profile"] == "full"  # explicit beats the env


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown profile 'gpu'; expected one of test, cpu, full"):
        profiles.resolve(exp.PROFILES, "gpu")


@pytest.mark.parametrize("kw, msg", [
    (dict(ratios="abc"), "parameter 'ratios' must be a non-empty list of numbers, got str 'abc'"),
    (dict(ratios=[1, "x"]), "'ratios' must be a non-empty list of numbers"),
    (dict(steps=10.5), "'steps' must be integer"),
    (dict(steps=True), "'steps' must be integer"),
    (dict(parameterizations="FAFO"), "'parameterizations' must be a non-empty list of strings"),
])
def test_wrong_parameter_type_is_a_clear_error(kw, msg):
    with pytest.raises(TypeError, match=msg):
        profiles.resolve(exp.PROFILES, "test", **kw)


def test_unknown_parameter_is_rejected():
    with pytest.raises(ValueError, match="unknown parameter 'ratio'"):
        profiles.resolve(exp.PROFILES, "test", ratio=10)


def test_claim_verdicts():
    assert claims.claim("S3", "p", "o", "inconclusive")["verdict"] == "inconclusive"
    with pytest.raises(ValueError, match="verdict"):
        claims.claim("S3", "p", "o", "yes")


def test_chapter_path():
    assert chapters.chapter_path("synthetic").name == "01_synthetic.md"
    with pytest.raises(FileNotFoundError, match="no single chapter 'nope'"):
        chapters.chapter_path("nope")


def test_papermill_rerun_writes_results_that_follow_the_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv(profiles.PROFILE_ENV, "test")
    nb1, res1 = chapters.run_chapter("synthetic", tmp_path, {"steps": 10}, name="default")
    nb2, res2 = chapters.run_chapter("synthetic", tmp_path, {"steps": 10, "ratios": [100.0], "parameterizations": ["FAFO"]},
                                    name="fafo_r100")
    assert nb1.exists() and nb2.exists()
    d1, d2 = json.loads(res1.read_text()), json.loads(res2.read_text())
    assert d1["params"]["profile"] == "test" and d1["params"]["ratios"] == [1.0, 10.0]
    assert d2["params"]["ratios"] == [100.0] and d2["params"]["parameterizations"] == ["FAFO"]
    assert {(r["parameterization"], r["ratio"]) for r in d2["metrics"]["runs"]} == {("FAFO", 100.0)}
    fafo1 = [r for r in d1["metrics"]["runs"] if r["parameterization"] == "FAFO"]
    assert d2["metrics"]["runs"][0]["attn_relevant"] not in [r["attn_relevant"] for r in fafo1]
    for key in ("versions", "git_commit", "device", "wall_time_s"):
        assert key in d1
    assert d1["versions"]["torch"].startswith("2.")
    assert d1["metrics"]["claims"] == []  # the chapter shows S1-S3; chapters 03 and 04 decide them


def test_papermill_wrong_type_fails_with_message(tmp_path, monkeypatch):
    import papermill as pm

    monkeypatch.setenv(profiles.PROFILE_ENV, "test")
    with pytest.raises(pm.PapermillExecutionError, match="parameter 'ratios' must be"):
        chapters.run_chapter("synthetic", tmp_path, {"ratios": "ten"})


def test_qkov_run_rejects_unknown_parameter_names(tmp_path, capsys):
    rc = cli.main(["run", "synthetic", "--out", str(tmp_path), "-p", "ratio", "[100]"])
    err = capsys.readouterr().err
    assert rc == 2 and "'ratio'" in err and "valid names:" in err and "ratios" in err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
    with pytest.raises(ValueError, match="unknown parameter 'ratio'"):
        chapters.run_chapter("synthetic", tmp_path, {"ratio": [100]})


def test_qkov_data_is_the_data_tool(capsys):
    assert cli.main(["data", "list"]) == 0
    assert "squad/dev-v1.1.json.gz" in capsys.readouterr().out


def test_results_files_record_the_data_files_they_read(tmp_path, monkeypatch):
    from qkov_lib.data import sources

    monkeypatch.setattr(sources, "_USED", {"sva/x.tsv.gz": "ab" * 32})
    doc = json.loads(results.save_results("x", {}, {}, path=tmp_path / "x.json").read_text())
    assert doc["data_files"] == {"sva/x.tsv.gz": "ab" * 32}


def test_profile_table_overrides_the_shared_settings():
    t = profiles.profile_table({"a": 1, "b": 2}, {"a": 0}, {}, {"b": 3})
    assert t == {"test": {"a": 0, "b": 2}, "cpu": {"a": 1, "b": 2}, "full": {"a": 1, "b": 3}}


STAGED = '''---
jupytext:
  text_representation: {extension: .md, format_name: myst, format_version: 0.13}
kernelspec: {display_name: Python 3, language: python, name: python3}
---

```{code-cell} ipython3
:tags: [parameters]
fail = False
results_path = None
```

```{code-cell} ipython3
assert fail != "early", "early failure"
from qkov_lib import claims
from qkov_lib.tooling import results
results.save_results("staged", {"fail": fail}, {"claims": [claims.claim("S1", "p", f"fail={fail}", "reproduced")]},
                     path=results_path, device="cpu")
```

```{code-cell} ipython3
if fail:
    raise RuntimeError("late failure")
```
'''


def test_a_failed_run_leaves_no_results_that_look_finished(tmp_path, capsys):
    """A real kernel: a rerun that fails after its chapter wrote its results file leaves that file
    only as its failure record (with its notebook), and the earlier run's results as they were."""
    from qkov_lib.tooling import scorecard

    src = tmp_path / "07_staged.md"
    src.write_text(STAGED)
    out = tmp_path / "runs"
    assert cli.main(["run", str(src), "--out", str(out)]) == 0
    finished = (out / "staged.json").read_bytes()
    assert json.loads(finished)["params"] == {"fail": False}
    capsys.readouterr()
    assert cli.main(["run", str(src), "--out", str(out), "-p", "fail", "true"]) == 1
    err = capsys.readouterr().err
    assert "qkov run: 07_staged.md failed: RuntimeError: late failure" in err
    assert f"record of the failed run: {out / 'staged.failed.json'}" in err
    assert f"notebook with the error: {out / 'staged.failed.ipynb'}" in err
    assert (out / "staged.json").read_bytes() == finished
    marked = json.loads((out / "staged.failed.json").read_text())
    assert marked["status"] == "failed" and marked["error"] == "RuntimeError: late failure"
    assert marked["params"] == {"fail": True} and marked["notebook"] == "staged.failed.ipynb"
    assert "late failure" in (out / "staged.failed.ipynb").read_text()
    assert [p.name for p, _ in scorecard.load_results(out)] == ["staged.json"]
    assert "ignoring" in capsys.readouterr().err
    # a run that fails before writing anything: a record with its parameters; the finished files stay
    with pytest.raises(Exception, match="early failure"):
        chapters.run_chapter(src, out, {"fail": "early"})
    assert (out / "staged.json").read_bytes() == finished
    assert json.loads((out / "staged.failed.json").read_text())["params"] == {"fail": "early"}


def test_results_files_are_strict_json(tmp_path):
    import numpy as np
    import torch

    path = results.save_results("x", {"lr": float("inf")}, {"ci": float("nan"), "arr": np.array([1.0, np.nan]),
                                                             "t": torch.tensor([np.inf]), "n": np.float32(2.5)},
                                path=tmp_path / "x.json")

    def no(c):
        raise ValueError(c)

    doc = json.loads(path.read_text(), parse_constant=no)  # as strict as JSON.parse
    assert doc["params"]["lr"] is None and doc["metrics"]["ci"] is None
    assert doc["metrics"]["arr"] == [1.0, None] and doc["metrics"]["t"] == [None] and doc["metrics"]["n"] == 2.5
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary file left


def test_qkov_run_refuses_a_scalar_for_a_list_parameter_before_a_kernel_starts(tmp_path, capsys):
    assert cli.main(["run", "synthetic", "--out", str(tmp_path), "-p", "profile", "test", "-p", "ratios", "10"]) == 2
    err = capsys.readouterr().err
    assert "parameter 'ratios' of 01_synthetic.md takes a list" in err and "-y" not in err
    assert not list(tmp_path.iterdir())


def test_a_kernel_that_dies_at_start_is_started_again(tmp_path, monkeypatch):
    """Two kernels started at once can get the same TCP port; the one that dies before running
    a cell is started again, any other error is not retried."""
    import papermill as pm

    calls = []
    real = pm.execute_notebook

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(chapters.KERNEL_DIED)
        return real(*a, **k)

    monkeypatch.setattr(pm, "execute_notebook", flaky)
    monkeypatch.setenv(profiles.PROFILE_ENV, "test")
    nb, res = chapters.run_chapter("synthetic", tmp_path, {"steps": 5, "ratios": [1.0], "parameterizations": ["FAFO"]})
    assert len(calls) == 2 and res.exists()

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("something else")

    calls.clear()
    monkeypatch.setattr(pm, "execute_notebook", broken)
    with pytest.raises(RuntimeError, match="something else"):
        chapters.run_chapter("synthetic", tmp_path, {"steps": 5})
    assert len(calls) == 1


def test_qkov_help_loads_neither_torch_nor_pandas_and_tables_still_show_whole():
    """``qkov --help`` imports no heavy module (it answers at once); pandas, imported later in the
    same process, still gets the book's display options."""
    import subprocess
    import sys

    code = ("import sys\nfrom qkov_lib.tooling import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nprint(sorted(m for m in ('torch', 'pandas', 'papermill', 'jupytext') if m in sys.modules))\n"
            "import pandas as pd\nprint([pd.get_option(k) for k in ('display.max_colwidth', 'display.max_rows', "
            "'display.max_columns')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-2:] == ["[]", "[None, None, None]"]


def test_an_unknown_option_is_named_and_exits_with_status_2(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--bogus"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unknown option '--bogus'" in err and "required" not in err


def test_qkov_data_help_lists_every_data_command(capsys):
    import re

    with pytest.raises(SystemExit) as stop:
        cli.main(["data", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    for command in ("check", "verify", "list", "fetch"):
        assert re.search(rf"^\s+{command}\s+\w", out, re.M), f"{command} is not listed:\n{out}"
