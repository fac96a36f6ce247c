"""Cache invalidation: a change to the library (or the profile) invalidates cached chapter
outputs; the scorecard page is always re-read; building from executed notebooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from qkov_lib.tooling import bookrun, cache


def _lib(tmp_path: Path) -> Path:
    lib = tmp_path / "lib"
    (lib / "sub").mkdir(parents=True)
    (lib / "a.py").write_text("X = 1\n")
    (lib / "sub" / "b.py").write_text("Y = 2\n")
    return lib


def test_library_hash_sees_code_not_bytecode(tmp_path: Path):
    lib = _lib(tmp_path)
    h0 = cache.library_hash(lib)
    assert h0 == cache.library_hash(lib)
    (lib / "__pycache__").mkdir()
    (lib / "__pycache__" / "a.cpython-311.py").write_text("junk")
    (lib / "notes.txt").write_text("not code")
    assert cache.library_hash(lib) == h0
    (lib / "sub" / "b.py").write_text("Y = 3\n")
    h1 = cache.library_hash(lib)
    assert h1 != h0
    (lib / "sub" / "b.py").rename(lib / "sub" / "c.py")  # same bytes, other name
    assert cache.library_hash(lib) != h1
    with pytest.raises(FileNotFoundError):
        cache.library_hash(tmp_path / "nope")
    assert len(cache.library_hash()) == 64  # the real qkov_lib


def test_cache_key_covers_profile_and_qkov_env_only(tmp_path: Path):
    lib = _lib(tmp_path)
    k = cache.cache_key(lib, {})
    assert k == cache.cache_key(lib, {"QKOV_PROFILE": "cpu"})  # cpu is the default profile
    assert k != cache.cache_key(lib, {"QKOV_PROFILE": "test"})
    assert k != cache.cache_key(lib, {"QKOV_DATA_DIR": "/elsewhere"})
    assert k == cache.cache_key(lib, {"QKOV_RESULTS_DIR": "/x", "HOME": "/y"})
    (lib / "a.py").write_text("X = 2\n")
    assert k != cache.cache_key(lib, {})


def _book(root: Path) -> None:
    (root / "book").mkdir(parents=True)
    (root / "_config.yml").write_text("title: t\nexecute:\n  execute_notebooks: force\n")
    (root / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nparts:\n  - caption: c\n    chapters:\n"
                                   "      - file: book/01_alpha\n      - file: book/10_scorecard.md\n")
    (root / "book" / "intro.md").write_text("# Intro\n")
    head = "---\njupytext:\n  text_representation: {extension: .md, format_name: myst}\n" \
           "kernelspec: {display_name: Python 3, language: python, name: python3}\n"
    (root / "book" / "01_alpha.md").write_text(head + "---\n# Alpha\n```{code-cell} ipython3\n1\n```\n")
    (root / "book" / "10_scorecard.md").write_text(head + "mystnb:\n  execution_mode: force\n---\n# Card\n")


def test_toc_and_chapters(tmp_path: Path):
    _book(tmp_path)
    assert cache.toc_files(tmp_path) == ["book/intro", "book/01_alpha", "book/10_scorecard"]
    assert [p.name for p in cache.chapters(tmp_path)] == ["01_alpha.md", "10_scorecard.md"]
    assert not cache.is_notebook(tmp_path / "book" / "intro.md")
    with pytest.raises(FileNotFoundError):
        cache.toc_files(tmp_path / "book")


def test_stage_executed_replaces_chapters_and_switches_execution_off(tmp_path: Path):
    import yaml

    root, executed = tmp_path / "repo", tmp_path / "executed"
    _book(root)
    executed.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1", outputs=[
        nbformat.v4.new_output("execute_result", {"text/plain": "1"}, execution_count=1)])])
    nbformat.write(nb, executed / "alpha.ipynb")
    with pytest.raises(FileNotFoundError, match="10_scorecard"):
        cache.stage_executed(root, executed, tmp_path / "stage")
    nb.metadata["mystnb"] = {"execution_mode": "force"}
    nbformat.write(nb, executed / "scorecard.ipynb")
    stage = cache.stage_executed(root, executed, tmp_path / "stage")
    assert not (stage / "book" / "01_alpha.md").exists()
    staged = nbformat.read(stage / "book" / "01_alpha.ipynb", as_version=4)
    assert staged.cells[0].outputs[0]["data"]["text/plain"] == "1"
    card = nbformat.read(stage / "book" / "10_scorecard.ipynb", as_version=4)
    assert "execution_mode" not in card.metadata.get("mystnb", {})  # would re-execute otherwise
    assert (stage / "book" / "intro.md").exists()
    assert yaml.safe_load((stage / "_config.yml").read_text())["execute"]["execute_notebooks"] == "off"


# -- the Sphinx extension, end to end: real builds of a two-page project -------------------------

PAGE = """---
jupytext:
  text_representation: {{extension: .md, format_name: myst}}
kernelspec: {{display_name: Python 3, language: python, name: python3}}
{extra}---
# {title}

```{{code-cell}} ipython3
import json
import os
open({counter!r}, "a").write("x")
print("LIB SAYS", open({lib!r}).read().strip(), "RESULTS", os.environ.get("QKOV_RESULTS_DIR", "-"))
```
"""


def _project(tmp_path: Path, mode: str) -> tuple[Path, Path]:
    src, lib = tmp_path / "src", _lib(tmp_path)
    src.mkdir()
    (src / "conf.py").write_text(
        f"extensions = ['myst_nb', 'qkov_lib.tooling.cache']\nnb_execution_mode = {mode!r}\n"
        f"qkov_library_dir = {str(lib)!r}\nexclude_patterns = ['_build']\n")
    (src / "index.md").write_text("# Home\n\n```{toctree}\nchapter\nscorecard\n```\n")
    (src / "chapter.md").write_text(PAGE.format(extra="", title="Chapter", counter=str(tmp_path / "n_chapter"),
                                                lib=str(lib / "a.py")))
    (src / "scorecard.md").write_text(PAGE.format(extra="mystnb:\n  execution_mode: force\n", title="Card",
                                                  counter=str(tmp_path / "n_card"), lib=str(lib / "a.py")))
    return src, lib


def _build(tmp_path: Path, src: Path, profile: str = "cpu") -> tuple[int, int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QKOV_")}
    env["QKOV_PROFILE"] = profile
    subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", str(src), str(src / "_build" / "html")],
                   check=True, env=env, capture_output=True)
    count = lambda n: len((tmp_path / n).read_text()) if (tmp_path / n).exists() else 0  # noqa: E731
    return count("n_chapter"), count("n_card"), (src / "_build" / "html" / "chapter.html").read_text()


def test_incremental_force_build_reexecutes_after_a_library_change(tmp_path: Path):
    src, lib = _project(tmp_path, "force")
    assert _build(tmp_path, src)[:2] == (1, 1)
    assert _build(tmp_path, src)[:2] == (1, 2)  # nothing changed: chapter not re-read; scorecard always
    (lib / "a.py").write_text("X = 2\n")
    n_chapter, _, html = _build(tmp_path, src)
    assert n_chapter == 2 and "LIB SAYS X = 2" in html


def test_cache_mode_keys_outputs_and_results_on_the_library(tmp_path: Path):
    src, lib = _project(tmp_path, "cache")
    n_chapter, n_card, html = _build(tmp_path, src)
    assert (n_chapter, n_card) == (1, 1) and "LIB SAYS X = 1" in html
    key1 = cache.cache_key(lib, {"QKOV_PROFILE": "cpu"})
    assert f"{key1}/results" in html  # the kernels write results next to their cache
    (lib / "a.py").write_text("X = 2\n")
    n_chapter, n_card, html = _build(tmp_path, src)
    assert (n_chapter, n_card) == (2, 2) and "LIB SAYS X = 2" in html
    (lib / "a.py").write_text("X = 1\n")  # back to the first state: its cache is still there
    n_chapter, n_card, html = _build(tmp_path, src)
    assert (n_chapter, n_card) == (2, 3) and "LIB SAYS X = 1" in html  # cached chapter, fresh scorecard


def test_cache_key_covers_data_manifest_requirements_and_pinned_versions(tmp_path: Path, monkeypatch):
    import hashlib
    import shutil as sh

    from qkov_lib.data import sources

    lib = _lib(tmp_path)
    rel = "sva/marvin_linzen2018_agreement.jsonl.gz"  # an entry of the packaged manifest
    data = tmp_path / "data"
    (data / "sva").mkdir(parents=True)
    (data / rel).write_bytes(b"0123456789" * 20)
    (data / "notes.txt").write_text("not a manifest file")
    manifest = tmp_path / "manifest.json"
    sh.copy(sources.MANIFEST_PATH, manifest)
    req = tmp_path / "requirements.txt"
    req.write_text("# pins\nnumpy==2.4.6\n-r other.txt\nPyYAML==6.0.4   # yaml\n\n")
    env = {"QKOV_DATA_DIR": str(data), "QKOV_DATA_MANIFEST": str(manifest)}

    def key() -> str:
        return cache.cache_key(lib, env, req)

    parts = cache.key_parts(lib, env, req)
    assert parts["data"] == {rel: hashlib.sha256(b"0123456789" * 20).hexdigest()}
    assert set(parts["packages"]) == {"numpy", "pyyaml", "torch"}
    assert parts["manifest"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    k0 = key()
    assert key() == k0  # nothing changed, same key
    (data / rel).write_bytes(b"0123456789" * 10)  # truncated data file
    k1 = key()
    assert k1 != k0
    manifest.write_text(manifest.read_text() + "\n")
    k2 = key()
    assert k2 != k1
    req.write_text(req.read_text() + "scipy==1.17.1\n")
    k3 = key()
    assert k3 != k2 and "scipy" in cache.key_parts(lib, env, req)["packages"]
    real = cache._version
    monkeypatch.setattr(cache, "_version", lambda p: "0.0-other" if p == "pyyaml" else real(p))
    assert key() != k3
    monkeypatch.setattr(cache, "_version", real)
    assert key() == k3
    assert cache.key_parts(lib, {"QKOV_DATA_DIR": str(tmp_path / "nope")}, req)["data"] == {}


def test_the_key_hashes_the_whole_library_and_the_repository_requirements():
    import qkov_lib

    assert cache.PACKAGE_DIR == Path(qkov_lib.__file__).resolve().parent  # every subpackage, not the tooling alone
    assert cache.REQUIREMENTS == cache.PACKAGE_DIR.parent / "requirements.txt" and cache.REQUIREMENTS.is_file()


def test_pinned_packages_reads_requirements(tmp_path: Path):
    assert "torch" in cache.pinned_packages() and "pyarrow" in cache.pinned_packages()  # the repository's file
    assert cache.pinned_packages(tmp_path / "missing.txt") == []
    bad = tmp_path / "bad.txt"
    bad.write_text("numpy==2\n==oops\n")
    with pytest.raises(ValueError, match="cannot read the requirement '==oops'"):
        cache.pinned_packages(bad)


_HEAD = ("---\njupytext:\n  text_representation: {extension: .md, format_name: myst}\n"
         "kernelspec: {display_name: Python 3, language: python, name: python3}\n---\n")


def _page(root: Path, stem: str, params: str, body: str) -> None:
    """A chapter that logs its start, its niceness and its end (monotonic seconds, under its run
    name) to ``<root>/log`` and writes a results file."""
    name = stem.split("_", 1)[1]
    (root / "book" / f"{stem}.md").write_text(
        _HEAD + f"# {stem}\n```{{code-cell}} ipython3\n:tags: [parameters]\nresults_path = None\n{params}\n```\n"
        f"```{{code-cell}} ipython3\nimport json, os, pathlib, time\nimport qkov_lib\nlog = {str(root / 'log')!r}\n"
        f"ag = pathlib.Path('/proc/self/autogroup')\n"
        f"group = int(ag.read_text().split()[-1]) if ag.exists() else os.nice(0)\n"
        f"open(log, 'a').write(f'{name} start {{time.monotonic()}} {{os.nice(0)}} {{group}}\\n')\n{body}\n"
        f"open(log, 'a').write(f'{name} end {{time.monotonic()}} {{os.nice(0)}} {{group}}\\n')\n"
        f"json.dump({{'chapter': {stem!r}}}, open(results_path, 'w'))\n```\n")


def _run_book(root: Path, failing: bool = False) -> None:
    (root / "book").mkdir(parents=True)
    stems = ["01_a", "02_wide", "03_b", "04_c", "08_summary", "09_recap"]
    (root / "_toc.yml").write_text("format: jb-book\nroot: book/01_a\nchapters:\n"
                                   + "".join(f"  - file: book/{s}\n" for s in stems[1:]))
    _page(root, "01_a", "", "time.sleep(1.5)")
    _page(root, "02_wide", "processes = None", "time.sleep(4)")
    _page(root, "03_b", "", "raise RuntimeError('broken page')" if failing else "time.sleep(1.5)")
    _page(root, "04_c", "", "time.sleep(1.5)")
    _page(root, "08_summary", "results_dir = None",
          f"import pathlib\nseen = sorted(p.name for p in pathlib.Path({str(root / 'out')!r}).glob('*.json'))\n"
          f"open({str(root / 'seen')!r}, 'w').write(' '.join(seen))")
    _page(root, "09_recap", "results_dir = None", "time.sleep(1.5)")


def _events(root: Path) -> dict[tuple[str, str], tuple[float, int, int]]:
    """``(page, "start"|"end") -> (monotonic seconds, niceness, its session's niceness)`` from the pages'
    log (the session's: Linux autogroup scheduling; the process niceness where there is none)."""
    return {(n, w): (float(t), int(k), int(g))
            for n, w, t, k, g in (x.split() for x in (root / "log").read_text().splitlines())}


def _first(lines: list[str], prefix: str) -> int:
    """Index of the first of ``lines`` that starts with ``prefix``."""
    return next(i for i, x in enumerate(lines) if x.startswith(prefix))


def test_run_plan_orders_wide_pages_first_and_summaries_last(tmp_path: Path):
    _run_book(tmp_path)
    plan = bookrun.run_plan(tmp_path, jobs=2)
    assert [(p.name, p.slots, p.reads_others) for p in plan] == [
        ("wide", 2, False), ("a", 1, False), ("b", 1, False), ("c", 1, False), ("summary", 1, True),
        ("recap", 1, True)]
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        bookrun.run_plan(tmp_path, jobs=0)


def test_run_book_runs_one_slot_pages_beside_the_wide_one_at_low_priority_and_summaries_after(tmp_path: Path):
    _run_book(tmp_path)
    lines: list[str] = []
    times = bookrun.run_book(tmp_path, tmp_path / "out", jobs=2, log=lines.append)
    assert set(times) == {"a", "wide", "b", "c", "summary", "recap"}
    assert all(t["wall_s"] > 0 and t["cpu_s"] > 0 for t in times.values())
    ev = _events(tmp_path)
    span = {n: (ev[(n, "start")][0], ev[(n, "end")][0]) for n in times}
    # the training page at normal priority; the one-slot pages beside it at low priority, two at most at once
    assert ev[("wide", "start")][1] == 0 and ev[("summary", "start")][1] == 0
    assert all(ev[(n, "start")][1:] == (bookrun.BACKGROUND_NICE,) * 2 for n in ("a", "b", "c"))
    assert ev[("wide", "start")][2] == 0
    # launched beside it, before it ended (the runner's order, not the kernels' start-up times)
    at = {x: i for i, x in enumerate(lines)}
    wide_done = next(i for x, i in at.items() if x.startswith("[book] wide done"))
    assert all(next(i for x, i in at.items() if x.startswith(f"[book] {n} started")) < wide_done for n in ("a", "b"))
    narrow = sorted(span[n] for n in ("a", "b", "c"))
    assert not (narrow[2][0] < narrow[0][1] and narrow[2][0] < narrow[1][1])
    # the summaries started after every other page ended, beside each other (the second launched
    # before the first was reaped), and saw all the other pages' results files
    others_end = max(e for n, (_, e) in span.items() if n not in ("summary", "recap"))
    assert min(span["summary"][0], span["recap"][0]) >= others_end and ev[("recap", "start")][1] == 0
    assert _first(lines, "[book] recap started") < _first(lines, "[book] summary done")
    seen = (tmp_path / "seen").read_text().split()
    assert [x for x in seen if x != "recap.json"] == ["a.json", "b.json", "c.json", "wide.json"]
    assert (tmp_path / "out" / "summary.ipynb").is_file()
    assert json.loads((tmp_path / "book_times.json").read_text())["jobs"] == 2
    assert any(x.startswith("[book] b started at niceness") for x in lines)
    # one job: one page at a time, none niced
    (tmp_path / "log").unlink()
    bookrun.run_book(tmp_path, tmp_path / "out1", jobs=1, log=lambda _: None)
    ev1 = sorted(_events(tmp_path).items(), key=lambda kv: kv[1][0])
    assert [k[1] for k, _ in ev1] == ["start", "end"] * 6 and {v[1:] for v in dict(ev1).values()} == {(0, 0)}


def test_run_book_runs_every_page_then_names_the_failures(tmp_path: Path):
    _run_book(tmp_path, failing=True)
    with pytest.raises(bookrun.BookRunFailed, match="broken page") as e:
        bookrun.run_book(tmp_path, tmp_path / "out", jobs=2, log=lambda _: None)
    assert list(e.value.failures) == ["b"]
    ended = {n for n, w in _events(tmp_path) if w == "end"}
    assert ended == {"a", "wide", "c", "summary", "recap"}
    assert (tmp_path / "out" / "b.failed.json").is_file() and not (tmp_path / "out" / "b.json").exists()
    assert json.loads((tmp_path / "book_times.json").read_text())["failed"] == {"b": e.value.failures["b"]}
    assert "broken page" in (tmp_path / "book_logs" / "b.log").read_text()


def test_run_plan_starts_the_costliest_one_slot_page_first(tmp_path: Path):
    _run_book(tmp_path)
    plan = bookrun.run_plan(tmp_path, jobs=2, costs={"c": 10.0, "a": 5.0, "wide": 99.0, "summary": 99.0})
    # the wide page first and the summary last whatever their costs; b (no cost) after those with one
    assert [p.name for p in plan] == ["wide", "c", "a", "b", "summary", "recap"]
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"pages": {"b": {"wall_s": 1.0, "cpu_s": 3.0}, "c": {"wall_s": 9.0, "cpu_s": 2.0}}}))
    assert bookrun.page_costs(times) == {"b": 3.0, "c": 2.0}
    assert [p.name for p in bookrun.run_plan(tmp_path, 2, bookrun.page_costs(times))] == ["wide", "b", "c", "a", "summary", "recap"]
    times.write_text("{not json")
    assert bookrun.page_costs(times) == {} and bookrun.page_costs(tmp_path / "missing.json") == {}
    # the book's own measured times name every page and start its costliest one-slot page first
    root = Path(__file__).resolve().parents[1]
    measured = bookrun.page_costs(root / bookrun.MEASURED_TIMES)
    plan = bookrun.run_plan(root, 2, measured)
    assert {p.name for p in plan} <= set(measured)
    narrow = [p.name for p in plan if p.slots == 1 and not p.reads_others]
    assert narrow[0] == max(narrow, key=measured.get)


def test_run_book_orders_its_one_slot_pages_by_an_earlier_runs_times(tmp_path: Path):
    _run_book(tmp_path)
    (tmp_path / "book_times.json").write_text(json.dumps(
        {"pages": {n: {"wall_s": 1.0, "cpu_s": c} for n, c in (("a", 1.0), ("b", 2.0), ("c", 3.0))}}))
    lines: list[str] = []
    bookrun.run_book(tmp_path, tmp_path / "out", jobs=2, log=lines.append)
    starts = [x.split()[1] for x in lines if " started" in x]
    assert starts == ["wide", "c", "b", "a", "summary", "recap"]


def test_the_key_of_another_environment_reads_its_data_folder_not_ours(tmp_path: Path, monkeypatch):
    """``key_parts(environ=...)`` describes that environment: where it sets no QKOV_DATA_DIR, the default data
    folder, whatever this process's own QKOV_DATA_DIR holds (a Sphinx build started without QKOV_* variables
    keys its outputs the same way as the test that predicts the key)."""
    from qkov_lib.data import sources

    rel = sorted(sources.manifest())[0]
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_bytes(b"not the real file")
    monkeypatch.setenv(sources.DATA_ENV, str(tmp_path))
    parts = cache.key_parts(environ={"QKOV_PROFILE": "cpu"})
    assert parts["data"] == cache.data_hashes(sources.DEFAULT_DATA_DIR)
    assert cache.key_parts()["data"] == {rel: sources.sha256_file(tmp_path / rel)}  # our own environment: ours
