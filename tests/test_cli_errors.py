"""Every error of the ``qkov`` command line is one message with exit status 2, found before any work:
the book's modes and table of contents, ``--name``, the parameters' types and values. A test that
reaches papermill fails (:func:`no_kernel`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import papermill as pm
import pytest

from qkov_lib.tooling import bookrun, cache, chapters, cli

NOTEBOOK = "---\njupytext:\n  text_representation: {extension: .md, format_name: myst}\nkernelspec: {name: python3}\n---\n"


@pytest.fixture
def no_kernel(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a kernel was started")

    monkeypatch.setattr(pm, "execute_notebook", started)
    monkeypatch.setattr(bookrun, "run_book", started)
    monkeypatch.setattr(cache, "build_book", started)


@pytest.fixture
def book_root(tmp_path, monkeypatch) -> Path:
    """A book of two pages (intro, 01_first, 07_sva) that the command line takes for the checkout."""
    root = tmp_path / "checkout"
    (root / "book").mkdir(parents=True)
    for name in ("intro", "01_first", "07_sva"):
        (root / "book" / f"{name}.md").write_text(NOTEBOOK + f"# {name}\n")
    (root / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nparts:\n  - caption: A\n    chapters:\n"
                                   "      - file: book/01_first\n      - file: book/07_sva\n")
    monkeypatch.setattr(cache, "REPO_ROOT", root)
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_message(code: int, err: str, *parts: str) -> None:
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    for part in parts:
        assert part in err, err


def test_the_book_lists_its_chapters(book_root, capsys):
    assert run(capsys, "chapters") == (0, "intro\nfirst\nsva\n", "")


@pytest.mark.parametrize("argv", [["chapters"], ["chapters", "--run-order"], ["book", "--mode", "run"],
                                  ["book", "--mode", "force"]])
def test_a_toc_entry_without_its_file_stops_at_once_naming_it(book_root, capsys, no_kernel, argv):
    (book_root / "book" / "07_sva.md").rename(book_root / "book" / "07_sva.md.bak")
    code, out, err = run(capsys, *argv)
    assert_message(code, err, f"qkov {argv[0]}: ", "lists book/07_sva, but there is no book/07_sva.md")
    assert out == ""


def test_a_misspelt_toc_entry_stops_at_once_naming_it(book_root, capsys, no_kernel):
    toc = book_root / "_toc.yml"
    toc.write_text(toc.read_text().replace("book/07_sva", "book/07_sav"))
    assert_message(*run(capsys, "chapters")[::2], "lists book/07_sav, but there is no book/07_sav.md")


@pytest.mark.parametrize("argv", [["chapters"], ["book", "--mode", "run"], ["scorecard", "--results", "."]])
def test_a_missing_toc_is_a_message(book_root, capsys, no_kernel, argv):
    (book_root / "_toc.yml").unlink()
    argv = [str(book_root / "book") if a == "." else a for a in argv]  # a results folder with no results file
    assert_message(*run(capsys, *argv)[::2], "_toc.yml does not exist")


@pytest.mark.parametrize("text, where", [("parts:\n  - caption: [x\n", "line 3, column 1"),
                                         ("root: [book/intro\n", "line 2, column 1"),
                                         ("- just\n- a list\n", "must be a mapping with a 'root' page")])
def test_a_broken_toc_is_one_message_naming_where(book_root, capsys, no_kernel, text, where):
    (book_root / "_toc.yml").write_text(text)
    assert_message(*run(capsys, "chapters")[::2], "qkov chapters: the book's table of contents", where)


@pytest.mark.parametrize("argv, says", [
    (["--mode", "executed"], "--mode executed builds from notebooks that were run before: give their folder"),
    (["--mode", "executed", "--executed", "/missing"], "--executed /missing: no such folder"),
    (["--mode", "force", "--executed", "."], "--executed is for --mode executed or --mode run"),
    (["--mode", "run", "-j", "0"], "--jobs must be at least 1"),
])
def test_bad_book_options_are_a_message(book_root, capsys, no_kernel, argv, says):
    assert_message(*run(capsys, "book", *argv)[::2], "qkov book: " + says)


def test_an_executed_folder_without_a_chapters_notebook_is_a_message(book_root, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bookrun, "run_book", lambda *a, **k: pytest.fail("ran"))
    executed = tmp_path / "executed"
    executed.mkdir()
    (executed / "first.ipynb").write_text("{}")
    assert_message(*run(capsys, "book", "--mode", "executed", "--executed", str(executed))[::2],
                   "no executed notebook in", "book/07_sva.md")


# --- --name ------------------------------------------------------------------------------------------
LIMIT = chapters._name_max(Path("/tmp"))
ROOM = LIMIT - max(len(t.format("")) for t in chapters.STAGED_NAMES)


@pytest.mark.parametrize("name, says", [
    ("sub/x", "must be one file name"), ("..", "must be one file name"), ("", "must be one file name"),
    ("a" * 240, f"give at most {ROOM}"), ("a" * 300, f"give at most {ROOM}"), ("a" * (ROOM + 1), f"give at most {ROOM}"),
])
def test_a_name_that_cannot_name_the_files_is_refused_before_anything_runs(tmp_path, capsys, no_kernel, name, says):
    out = tmp_path / "runs"
    code, _, err = run(capsys, "run", "synthetic", "--out", str(out), "--name", name, "-p", "profile", '"test"')
    assert_message(code, err, "qkov run: --name: ", says)
    assert not out.exists()  # nothing was made: no folder, no lock, no record


def test_the_longest_name_that_fits_makes_every_file_of_a_run(tmp_path):
    name = "n" * ROOM
    chapters.check_name(name, tmp_path)
    for template in chapters.STAGED_NAMES:  # the file system takes each file a run makes from it
        (tmp_path / template.format(name)).write_text("x")


# --- parameters, before the kernel -------------------------------------------------------------------
@pytest.mark.parametrize("param, value, says", [
    ("steps", '"100"', "'steps' must be an integer >= 1"),
    ("force", '"yes"', "parameter 'force' must be true or false"),
    ("force", "1", "parameter 'force' must be true or false"),
    ("dry_run", "1", "parameter 'dry_run' must be true or false"),
    ("dry_run", '"no"', "parameter 'dry_run' must be true or false"),
    ("profile", '"Full"', "did you mean 'full'?"),
    ("profile", "3", "unknown profile 3"),
    ("results_path", "[1]", "qkov run writes the results file itself"),
    ("results_path", '"/tmp/x.json"', "choose where with --out and --name"),
])
def test_a_parameter_of_the_wrong_type_or_value_stops_before_the_kernel(tmp_path, capsys, no_kernel, param, value,
                                                                        says):
    code, _, err = run(capsys, "run", "synthetic", "--out", str(tmp_path), "-p", param, value)
    assert_message(code, err, says)
    assert "non-empty list" not in err and not list(tmp_path.iterdir())


def test_parameter_messages_name_the_expected_shape():
    from qkov_lib import profiles

    with pytest.raises(ValueError, match=r"'steps' must be an integer >= 1 \(numbers take no quotes.*-p steps 10\)"):
        profiles.check_value("steps", "100")
    with pytest.raises(ValueError, match="'n_heads' must be an integer >= 1"):
        profiles.check_value("n_heads", "4")
    with pytest.raises(ValueError, match="'map_seeds' must be a non-empty list of values, each an integer >= 0"):
        profiles.check_value("map_seeds", "x")
    with pytest.raises(ValueError, match="'results_dir' must be a path"):
        profiles.check_value("results_dir", ["a"])
    profiles.check_values({"force": True, "dry_run": False, "results_dir": "/tmp", "profile": "full"})


# --- light commands ----------------------------------------------------------------------------------
def test_listing_the_chapters_imports_neither_torch_nor_pandas():
    code = ("import sys\nfrom qkov_lib.tooling import cli\nfor argv in (['chapters'], ['chapters', '--run-order']):\n"
            "    assert cli.main(argv) == 0\n"
            "print(sorted(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[-1] == "[]" and "synthetic" in lines and "scorecard" in lines


def test_ctrl_c_anywhere_is_one_line(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["chapters"]) == 130
    assert capsys.readouterr().err == "qkov: interrupted\n"
    monkeypatch.setattr(cli, "_main", lambda argv: (_ for _ in ()).throw(chapters.Interrupted(15)))
    assert cli.main(["chapters"]) == 143
    assert capsys.readouterr().err == "qkov: stopped by SIGTERM\n"


def test_sweeps_keep_their_name_for_chapter_names():
    from qkov_lib.tooling import sweeps

    assert sweeps.chapter_name(Path("book/01_synthetic.md")) == "synthetic" == cache.chapter_name("01_synthetic.md")
    assert json.dumps(cache.chapter_name("book/realdata_protocol.md")) == '"realdata_protocol"'
