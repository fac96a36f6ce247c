"""A run's results file and notebook never say something false about the run.

``qkov run`` (and :func:`qkov_lib.tooling.chapters.run_chapter`, which sweeps use too) writes
under ``<out>/.running/`` and moves the files into place only when the run has succeeded; it
holds a lock on its name and folder meanwhile. Each test below is one way a results file used to
lie: a full disk, two runs into one name, a run interrupted after another had finished, a
results file cut short, a folder that cannot be written. papermill is replaced by a stand-in
that does what a chapter's kernel does (write the notebook, the chapter write its results file
at ``results_path``) or fails the way the test needs, so no kernel starts; the real kernel path
is tested in ``tests/test_profiles_cli.py``.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import papermill as pm
import pytest

from qkov_lib.tooling import chapters, cli
from test_sweeps import FAKE  # a stand-in chapter; its cells never run here (papermill is replaced)

@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "07_staged.md"
    path.write_text(FAKE)
    return path


def notebook(params: dict) -> str:
    return json.dumps({"cells": [], "metadata": {"papermill": {"parameters": params}}, "nbformat": 4,
                       "nbformat_minor": 5})


def kernel(*, results: str | None = "whole", notebook_text: str | None = None, raises: BaseException | None = None,
           during=None):
    """A stand-in for ``papermill.execute_notebook``: writes the output notebook and (as the
    chapter would) its results file ``{"chapter", "params"}`` at ``results_path`` -- whole JSON,
    ``"cut"`` short, or none -- then calls ``during()`` and raises ``raises``, if given."""
    def execute(nb_in, nb_out, parameters, **kw):
        params = {k: v for k, v in parameters.items() if k != "results_path"}
        if results is not None:
            text = json.dumps({"chapter": "staged", "params": params})
            with open(parameters["results_path"], "w") as f:
                f.write(text if results == "whole" else text[: len(text) // 2])
        with open(nb_out, "w") as f:
            f.write(notebook(params) if notebook_text is None else notebook_text)
        if during is not None:
            during()
        if raises is not None:
            raise raises
    return execute


def finished_run(monkeypatch, src: Path, out: Path) -> tuple[bytes, bytes]:
    """Run A, which succeeds with x=1: the bytes of its results file and its notebook."""
    monkeypatch.setattr(pm, "execute_notebook", kernel())
    chapters.run_chapter(src, out, {"x": 1})
    return (out / "staged.json").read_bytes(), (out / "staged.ipynb").read_bytes()


def looks_finished(out: Path) -> list[str]:
    """Files in ``out`` a reader would take for a finished run's (``<name>.json``/``.ipynb`` that
    are not failure records), and every JSON file there that is not whole JSON."""
    names = []
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.suffix in (".json", ".ipynb"):
            try:
                json.loads(p.read_text())
            except ValueError:
                names.append(f"{p.relative_to(out)} (not whole JSON)")
                continue
            if ".failed." not in p.name:
                names.append(str(p.relative_to(out)))
    return names


@pytest.fixture
def full_disk(monkeypatch, tmp_path: Path):
    """``fill(folder)``: from then on every write of a file under ``folder`` raises
    ``OSError(ENOSPC)`` after writing half its bytes, as on a full disk."""
    real_open = builtins.open
    full: list[Path] = []

    class HalfFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    def open_(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        inside = isinstance(file, (str, os.PathLike)) and any(Path(file).resolve().is_relative_to(d) for d in full)
        return HalfFile(f) if inside and any(c in mode for c in "wax") else f

    def write_text(self, data, encoding=None, errors=None, newline=None):
        with open_(self, "w", encoding=encoding, errors=errors, newline=newline) as f:
            return f.write(data)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(Path, "write_text", write_text)
    return lambda folder: full.append(Path(folder).resolve())


# --- a full disk --------------------------------------------------------------------------------------
def test_a_full_disk_keeps_the_earlier_results_and_leaves_nothing_that_looks_finished(
        src, tmp_path, monkeypatch, full_disk, capsys):
    """The disk fills while run B writes its notebook: B fails, its notebook (cut short) is not
    kept, its record cannot be written either, and A's results and notebook stay byte for byte.
    The command names no file that is not there."""
    out = tmp_path / "runs"
    a_results, a_notebook = finished_run(monkeypatch, src, out)

    def execute(nb_in, nb_out, parameters, **kw):
        with open(parameters["results_path"], "w") as f:  # the chapter's results: whole
            f.write(json.dumps({"chapter": "staged", "params": {"x": 2}}))
        full_disk(out)
        with open(nb_out, "w") as f:  # papermill's notebook: the disk is full
            f.write(notebook({"x": 2}))

    monkeypatch.setattr(pm, "execute_notebook", execute)
    capsys.readouterr()
    assert cli.main(["run", str(src), "--out", str(out), "-p", "x", "2"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err
    assert "no record of the failed run could be written" in err and "no notebook of the failed run was kept" in err
    assert f"{out / 'staged.json'} and {out / 'staged.ipynb'} are an earlier run's, left as they were" in err
    assert (out / "staged.json").read_bytes() == a_results and (out / "staged.ipynb").read_bytes() == a_notebook
    assert looks_finished(out) == ["staged.ipynb", "staged.json"]     # A's, and nothing else
    assert not (out / ".running").exists()


def test_a_run_whose_failure_record_cannot_be_written_leaves_no_results_that_look_finished(
        src, tmp_path, monkeypatch, full_disk, capsys):
    """The chapter wrote its results file, a later cell failed, and the disk is full when the
    failure is recorded: no ``staged.json`` may be left, for a sweep or the scorecard would read
    it as a finished run."""
    out = tmp_path / "runs"
    monkeypatch.setattr(pm, "execute_notebook",
                        kernel(during=lambda: full_disk(out), raises=RuntimeError("late failure")))
    assert cli.main(["run", str(src), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "failed: RuntimeError: late failure" in err and "no record of the failed run could be written" in err
    assert looks_finished(out) == [] and not (out / "staged.failed.json").exists()


# --- two runs into one name and folder -----------------------------------------------------------------
def test_a_second_run_into_the_same_name_and_folder_stops_at_once_with_the_holders_pid(
        src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs"
    started, second = [], []

    def start_another():
        if started:  # only the first run starts another (where runs are not locked, the second would too)
            return
        started.append(1)
        second.append(cli.main(["run", str(src), "--out", str(out), "-p", "x", "2"]))
        second.append(capsys.readouterr().err)

    monkeypatch.setattr(pm, "execute_notebook", kernel(during=start_another))
    assert cli.main(["run", str(src), "--out", str(out), "-p", "x", "1"]) == 0
    rc, err = second
    assert rc == 2
    assert f"another run (pid {os.getpid()}) is writing staged in {out}" in err and len(err.strip().splitlines()) == 1
    assert json.loads((out / "staged.json").read_text())["params"] == {"x": 1}     # the first run's, whole
    # another name, or another folder, is another lock: both run
    monkeypatch.setattr(pm, "execute_notebook", kernel())
    assert cli.main(["run", str(src), "--out", str(out), "--name", "other"]) == 0
    assert cli.main(["run", str(src), "--out", str(tmp_path / "elsewhere")]) == 0


def test_an_interrupted_run_leaves_the_finished_results_of_another_run_alone(src, tmp_path, monkeypatch):
    """Run A finished; run B of the same name is interrupted: B's record says B failed, with
    B's parameters, and A's results file is still A's, not renamed to a failure."""
    out = tmp_path / "runs"
    a_results, a_notebook = finished_run(monkeypatch, src, out)
    monkeypatch.setattr(pm, "execute_notebook", kernel(results=None, raises=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        chapters.run_chapter(src, out, {"x": 2})
    assert (out / "staged.json").read_bytes() == a_results and (out / "staged.ipynb").read_bytes() == a_notebook
    record = json.loads((out / "staged.failed.json").read_text())
    assert record["status"] == "failed" and record["error"] == "KeyboardInterrupt"
    assert record["params"] == {"x": 2} and record["notebook"] == "staged.failed.ipynb"
    assert json.loads((out / "staged.failed.ipynb").read_text())["metadata"]["papermill"]["parameters"] == {"x": 2}


# --- what a run puts in place --------------------------------------------------------------------------
def test_a_rerun_replaces_the_earlier_files_only_when_it_succeeds_and_says_so(src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs"
    monkeypatch.setattr(pm, "execute_notebook", kernel())
    assert cli.main(["run", str(src), "--out", str(out), "-p", "x", "1"]) == 0
    assert "earlier run" not in capsys.readouterr().out
    monkeypatch.setattr(pm, "execute_notebook", kernel(raises=RuntimeError("boom")))
    assert cli.main(["run", str(src), "--out", str(out), "-p", "x", "2"]) == 1
    assert json.loads((out / "staged.json").read_text())["params"] == {"x": 1}
    assert json.loads((out / "staged.failed.json").read_text())["params"] == {"x": 2}
    monkeypatch.setattr(pm, "execute_notebook", kernel())
    capsys.readouterr()
    assert cli.main(["run", str(src), "--out", str(out), "-p", "x", "3"]) == 0
    said = capsys.readouterr().out
    assert "they replace the notebook and results of an earlier run of this name" in said
    assert json.loads((out / "staged.json").read_text())["params"] == {"x": 3}
    assert looks_finished(out) == ["staged.ipynb", "staged.json"]  # the failed attempt's record is gone with it


@pytest.mark.parametrize("written", ["cut", None])
def test_a_run_without_a_whole_results_file_is_a_failed_run(src, tmp_path, monkeypatch, written):
    out = tmp_path / "runs"
    monkeypatch.setattr(pm, "execute_notebook", kernel(results=written))
    with pytest.raises(ValueError, match="results file that is not a whole JSON object" if written
                       else "wrote no results file"):
        chapters.run_chapter(src, out, {"x": 2})
    assert looks_finished(out) == []
    record = json.loads((out / "staged.failed.json").read_text())
    assert record["status"] == "failed" and (record.get("unreadable_results") or record["params"] == {"x": 2})


def test_an_output_folder_that_cannot_be_written_names_no_notebook(src, tmp_path, monkeypatch, capsys):
    """A read-only ``runs/``: the run stops before a kernel starts (exit status 2), and the message
    names the folder, not a notebook that was never written."""
    out = tmp_path / "runs"
    out.mkdir()
    real_open = builtins.open

    def read_only(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and Path(file).resolve().is_relative_to(out.resolve()) \
                and any(c in mode for c in "wax+"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", read_only)
    started = []
    monkeypatch.setattr(pm, "execute_notebook", lambda *a, **k: started.append(1))
    assert cli.main(["run", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write to the output folder {out}" in err and "Permission denied" in err
    assert ".ipynb" not in err and not started and not list(out.iterdir())


def test_a_run_that_ends_does_not_remove_the_running_folder_of_a_run_just_started(tmp_path: Path):
    """Two runs of different names into one folder (``make book`` runs chapters side by side): run c has
    made its running folder and papermill has not yet written there when run a publishes, and another
    run b fails. Neither may remove c's folder (both once removed the shared, empty ``.running``, and c's
    papermill failed: "output folder .../.running doesn't exist")."""
    from qkov_lib.tooling import results as R

    out = tmp_path / "out"
    out.mkdir()
    files = {n: (out / f"{n}.json", out / f"{n}.ipynb") for n in "abc"}
    for n in "abc":
        R.start_run(*files[n])
    R.running_path(files["a"][0]).write_text(json.dumps({"chapter": "a"}))
    R.running_path(files["a"][1]).write_text(notebook({}))
    R.publish_run(*files["a"])
    R.record_failure(*files["b"], "RuntimeError: broken", {"chapter": "b"})
    assert R.running_path(files["c"][1]).parent.is_dir()
    assert (out / "a.json").is_file() and (out / "b.failed.json").is_file()
    R.running_path(files["c"][0]).write_text(json.dumps({"chapter": "c"}))
    R.running_path(files["c"][1]).write_text(notebook({}))
    R.publish_run(*files["c"])
    assert not (out / ".running").exists()  # the last run out tidies the shared folder away


def test_figure_data_become_plain_json_tuple_keys_tables_arrays_and_nan():
    import numpy as np
    import pandas as pd

    from qkov_lib.tooling.results import jsonable

    doc = {("FAFO", 10.0): np.array([[0.5, 0.25]]), ("CACO", 1.0): float("nan"),
           "history": pd.DataFrame({"step": [1, 2], "loss": [0.5, np.nan]})}
    assert jsonable(doc) == {"FAFO / 10": [[0.5, 0.25]], "CACO / 1": None,
                             "history": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}]}
