"""The Binder environment (``binder/``) resolves with the same pins as ``requirements.txt``.

Read offline, as pip reads them: each requirement file with the files it includes (``-r``), its
index options and its requirement lines (``packaging``). Every package pinned at the top level must
be admitted at exactly its pinned version by every specifier the Binder files give it (torch as its
CPU build of the same version), nothing may be left unpinned, and the Binder files must bring what a
launch button needs (jupytext, JupyterLab) and the post-build step that makes ``.md`` open as a
notebook."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def read_requirements(path: Path, _seen: frozenset = frozenset()) -> tuple[list[Requirement], list[str]]:
    """``(requirements, options)`` of a pip requirement file and every file it includes with ``-r``
    (relative to the including file, as pip reads them). ValueError for a line pip would not take
    here (an editable install, a URL, a constraint file) or an include cycle."""
    path = path.resolve()
    if path in _seen:
        raise ValueError(f"{path} includes itself")
    reqs, opts = [], []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement")):
            sub = shlex.split(line)[-1]
            r, o = read_requirements(path.parent / sub, _seen | {path})
            reqs += r
            opts += o
        elif line.startswith("--index-url") or line.startswith("--extra-index-url") or line.startswith("-i "):
            opts.append(line)
        elif line.startswith("-"):
            raise ValueError(f"{path.name}: option pip would take but this environment must not use: {line!r}")
        else:
            reqs.append(Requirement(line))
    return reqs, opts


def pins(reqs: list[Requirement]) -> dict[str, Version]:
    """``{package: version}`` of the ``==`` pins (ValueError on an unpinned requirement)."""
    out = {}
    for r in reqs:
        eq = [s for s in r.specifier if s.operator == "=="]
        if len(eq) != 1:
            raise ValueError(f"{r} is not pinned with ==")
        out[canonicalize_name(r.name)] = Version(eq[0].version)
    return out


@pytest.fixture(scope="module")
def binder():
    return read_requirements(BINDER / "requirements.txt")


def test_every_top_level_pin_resolves_to_the_same_version_in_binder(binder):
    top = pins(read_requirements(ROOT / "requirements.txt")[0])
    reqs, _ = binder
    by_name: dict[str, list[Requirement]] = {}
    for r in reqs:
        by_name.setdefault(canonicalize_name(r.name), []).append(r)
    for name, version in top.items():
        assert name in by_name, f"{name} (pinned {version} in requirements.txt) is missing from binder/"
        # what pip can install: a pinned version that every specifier of binder/'s files admits
        pinned = {Version(s.version) for r in by_name[name] for s in r.specifier if s.operator == "=="}
        assert pinned, f"{name} is not pinned in binder/"
        chosen = {v for v in pinned if all(r.specifier.contains(v, prereleases=True) for r in by_name[name])}
        assert len(chosen) == 1, f"{name}: binder/'s pins cannot all hold: {[str(r) for r in by_name[name]]}"
        got = chosen.pop()
        assert got.public == version.public, f"{name}: binder/ installs {got}, requirements.txt pins {version}"
    assert set(by_name) == set(top) | {"torch"}, f"binder/ adds packages of its own: {set(by_name) - set(top)}"


def test_binder_installs_the_cpu_build_of_torch_from_its_index(binder):
    reqs, opts = binder
    torch = pins([r for r in reqs if canonicalize_name(r.name) == "torch"][:1])["torch"]
    assert torch.local == "cpu", f"binder/ must install torch's CPU build (+cpu), got {torch}"
    assert any(CPU_INDEX in o for o in opts), f"binder/ does not name the CPU wheel index {CPU_INDEX}"


def test_binder_brings_what_a_launch_button_needs():
    reqs, _ = read_requirements(BINDER / "requirements.txt")
    names = {canonicalize_name(r.name) for r in reqs}
    assert {"jupytext", "jupyterlab", "ipykernel"} <= names
    post = BINDER / "postBuild"
    assert post.stat().st_mode & 0o111, "binder/postBuild must be executable (repo2docker runs it)"
    text = post.read_text()
    assert "pip install --no-deps -e ." in text  # the library, whose requirements are installed already
    assert "set-default-viewer markdown myst" in text  # a chapter's .md opens as a notebook


def test_a_loose_or_foreign_line_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("numpy>=2\n")
    with pytest.raises(ValueError, match="not pinned"):
        pins(read_requirements(tmp_path / "a.txt")[0])
    (tmp_path / "b.txt").write_text("-e .\n")
    with pytest.raises(ValueError, match="must not use"):
        read_requirements(tmp_path / "b.txt")
    (tmp_path / "c.txt").write_text("-r c.txt\n")
    with pytest.raises(ValueError, match="includes itself"):
        read_requirements(tmp_path / "c.txt")
