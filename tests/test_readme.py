"""The README's example commands run as written (with the test profile), so the README cannot drift.

Every fenced ``bash`` block of README.md is split into commands (a trailing backslash joins
lines) and each command runs in a scratch folder that looks like a fresh checkout (``book/`` and
``.venv`` linked from this one), with ``QKOV_PROFILE=test`` and every profile written in a
command replaced by ``test``. Every ``python`` block runs too. A command that needs Slurm,
starts a server, needs the network or builds the whole book is listed in :data:`COVERED_ELSEWHERE`
with the test that covers it; a command that is neither run nor listed fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: Commands that are not run here, with why and the test (or CI step) that covers them.
COVERED_ELSEWHERE: dict[str, str] = {
    "make book": "the whole book build: .ci/run builds it (test profile) on every change",
    "make test": "the test suite itself: .ci/run runs it",
    "make lab": "starts a Jupyter server: tests/test_jupyter_server.py opens and runs a chapter through one",
    "make data": "downloads from the internet: tests/test_fetch.py fetches from a local HTTP server",
    "--executor slurm": "needs a Slurm cluster: tests/test_sweeps.py runs the same code path with a local executor",
}

# A python block may use the reader's own objects by these names; the test stands in for them
# (tiny random models built here, nothing downloaded), each defined only where the block uses it.
STAND_INS: dict[str, str] = {
    "model": "model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)\n",
    "make_model": (
        "from transformers import GPTNeoXConfig, GPTNeoXForCausalLM\n"
        "def make_model():\n"
        "    torch.manual_seed(0)\n"
        "    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,\n"
        "        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16, tie_word_embeddings=True))\n"),
    "train": ("_ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))\n"
              "train = [{'input_ids': x, 'labels': x} for x in _ids]\n"),
}


def with_stand_ins(code: str) -> str:
    """``code`` preceded by a stand-in for every reader's name it uses without defining it."""
    used = [n for n in STAND_INS if re.search(rf"\b{n}\b", code) and not re.search(rf"^(def )?{n}\b\s*[=(]", code, re.M)]
    return "import torch\n" + "".join(STAND_INS[n] for n in used) + code


def blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``text`` in language ``lang``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank lines and comments dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def with_test_profile(cmd: str) -> str:
    """``cmd`` with every profile it names replaced by ``test``."""
    cmd = re.sub(r"(-p profile )'\"\w+\"'", lambda m: m.group(1) + "'\"test\"'", cmd)
    cmd = re.sub(r"(-p profile )(?!')\w+", r"\1test", cmd)
    return re.sub(r"(--profile |PROFILE=)\w+", r"\1test", cmd)


def covered_elsewhere(cmd: str) -> str | None:
    return next((why for key, why in COVERED_ELSEWHERE.items() if key in cmd), None)


README_TEXT = README.read_text()
BASH = [c for b in blocks(README_TEXT, "bash") for c in commands(b)]
RUN = [c for c in BASH if not covered_elsewhere(c)]
PYTHON = blocks(README_TEXT, "python")


def test_the_readme_has_its_commands():
    # the two commands the README promises, and at least one rerun and one python example
    assert "make book" in BASH[0] and any(c.startswith("make test") for c in BASH)
    assert any(" run " in c for c in RUN) and any("papermill" in c for c in RUN) and PYTHON


def test_every_command_not_run_here_names_where_it_is_covered():
    skipped = [c for c in BASH if covered_elsewhere(c)]
    assert skipped and all(covered_elsewhere(c) for c in skipped)
    unused = [k for k in COVERED_ELSEWHERE if not any(k in c for c in BASH)]
    assert not unused, f"COVERED_ELSEWHERE lists commands the README no longer has: {unused}"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A scratch folder laid out like a fresh checkout: the chapters and the environment."""
    d = tmp_path_factory.mktemp("readme")
    for name in ("book", ".venv"):
        if not (ROOT / name).exists():
            pytest.skip(f"{name}/ is not in this checkout (run `make setup` first)")
        (d / name).symlink_to(ROOT / name)
    return d


def _env() -> dict[str, str]:
    # as a reader would run them: no virtual environment activated, so `.venv/bin/` is written out
    return dict(os.environ, QKOV_PROFILE="test", PYTHONUNBUFFERED="1")


@pytest.mark.parametrize("cmd", RUN, ids=lambda c: " ".join(c.split()[:3])[:40])
def test_readme_command_runs_as_written(cmd, checkout):
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", with_test_profile(cmd)], cwd=checkout, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"`{cmd}` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_readme_python_example_runs(i, checkout):
    proc = subprocess.run([sys.executable, "-c", with_stand_ins(PYTHON[i])], cwd=checkout, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README python block {i} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def test_the_test_profile_rewrite():
    assert with_test_profile("qkov run x -p profile '\"cpu\"'") == "qkov run x -p profile '\"test\"'"
    assert with_test_profile("papermill a b -p profile cpu -y 'r: [1]'") == "papermill a b -p profile test -y 'r: [1]'"
    assert with_test_profile("qkov sweep s --profile full -j 2") == "qkov sweep s --profile test -j 2"
    assert commands("a \\\n  b\n# c\n\nd  # e\n") == ["a    b", "d  # e"]
