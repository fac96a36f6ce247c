"""The command line's output survives any locale: in an ASCII (``LC_ALL=C`` without Python's UTF-8
mode) or a Latin-1 terminal, the scorecard prints the characters the terminal has and an ASCII
stand-in for the others, never a UnicodeEncodeError."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qkov_lib import claims
from qkov_lib.tooling import cli
from qkov_lib.tooling.results import save_results

REPO = Path(__file__).resolve().parents[1]
OURS = "ratios 1\u2013100: margin \u2265 0.2 \u00b7 \u03b7_QK/\u03b7_OV \u00d7 10 \u2248 log\u00b2 t"


@pytest.fixture(scope="module")
def latin1_env(tmp_path_factory) -> dict[str, str]:
    """A Latin-1 locale: built with ``localedef`` where it can be (the terminal's encoding, as a user has
    it), else Python's stream encoding set to Latin-1, which is what that locale gives a program."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIOENCODING", "PYTHONUTF8"))}
    if shutil.which("localedef"):
        where = tmp_path_factory.mktemp("locale")
        made = subprocess.run(["localedef", "-i", "en_US", "-f", "ISO-8859-1", str(where / "en_US.ISO-8859-1")],
                              capture_output=True)
        if made.returncode in (0, 1) and (where / "en_US.ISO-8859-1").is_dir():  # 1: made, with warnings
            return {**env, "LOCPATH": str(where), "LC_ALL": "en_US.ISO-8859-1"}
    return {**env, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "latin-1"}


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("results")
    save_results("synthetic", {"profile": "test"},
                 {"claims": [claims.claim("S1", "heatmaps differ", OURS, "reproduced", "01_synthetic")]},
                 path=folder / "synthetic.json")
    return folder


def scorecard_in(env: dict[str, str], folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkov_lib", "scorecard", "--results", str(folder)], env=env,
                          cwd=REPO, capture_output=True)


def test_the_scorecard_prints_in_an_ascii_locale(results_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIOENCODING"))}
    done = scorecard_in({**env, "LC_ALL": "C", "PYTHONUTF8": "0"}, results_dir)
    assert done.returncode == 0 and b"Error" not in done.stderr, done.stderr.decode(errors="replace")
    done.stdout.decode("ascii")  # nothing but ASCII
    assert b"ratios 1-100: margin >= 0.2 . eta_QK/eta_OV x 10 ~ log^2 t" in done.stdout


def test_the_scorecard_prints_in_a_latin1_locale(results_dir, latin1_env):
    done = scorecard_in(latin1_env, results_dir)
    assert done.returncode == 0 and b"Error" not in done.stderr, done.stderr.decode(errors="replace")
    # what Latin-1 has is written as such, the rest as stand-ins
    assert "ratios 1-100: margin >= 0.2 \u00b7 eta_QK/eta_OV \u00d7 10 ~ log\u00b2 t".encode("latin-1") in done.stdout


def test_a_utf8_stream_is_left_as_it_is_and_others_get_stand_ins():
    utf8, ascii_ = (io.TextIOWrapper(io.BytesIO(), encoding=e) for e in ("utf-8", "ascii"))
    cli.safe_output(utf8, ascii_)
    assert utf8.errors == "strict" and ascii_.errors == cli.OUTPUT_ERRORS
    ascii_.write("a\u2013b \u4e2d")  # a character without a stand-in is escaped
    ascii_.flush()
    assert ascii_.buffer.getvalue() == b"a-b \\u4e2d"


@pytest.mark.parametrize("command", ["scorecard --results {results}", "chapters", "chapters --run-order",
                                     "data list", "cache key"])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(results_dir, command):
    """``qkov scorecard | true``: the reader goes away before the first line; the command stops with the
    shell's status for a closed pipe (141), no traceback and no message."""
    line = command.format(results=results_dir)
    done = subprocess.run(f'"{sys.executable}" -m qkov_lib {line} | true; exit ${{PIPESTATUS[0]}}',
                          shell=True, cwd=REPO, capture_output=True, executable="/bin/bash",
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.stderr == b"", done.stderr.decode()
    assert done.returncode == 141
