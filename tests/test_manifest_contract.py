"""The data manifest as a contract: checked against its layout whenever it is read, with every
file the chapters read (``sources.CHAPTER_FILES``) listed; a file without an entry is an error, or
read unverified -- loudly, and marked so in the results file -- only with QKOV_ALLOW_UNVERIFIED=1;
a data folder that does not exist, or is a file, is an error whatever the manifest says."""

from __future__ import annotations

import ast
import gzip
import json
from pathlib import Path

import pytest

from qkov_lib.data import fetch, hatexplain, sources, squad, sva

ML = "sva/marvin_linzen2018_agreement.jsonl.gz"
PACKAGED = json.loads(sources.MANIFEST_PATH.read_text())


@pytest.fixture
def use_manifest(tmp_path, monkeypatch):
    """``use_manifest(doc)``: make ``doc`` (any JSON value) the manifest; returns its path."""
    monkeypatch.delenv(sources.ALLOW_ENV, raising=False)

    def use(doc, name="manifest.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        monkeypatch.setenv(sources.MANIFEST_ENV, str(path))
        return path
    return use


def without(rel: str) -> dict:
    doc = json.loads(json.dumps(PACKAGED))
    del doc["files"][rel]
    return doc


def test_the_packaged_manifest_keeps_the_contract():
    assert sources.manifest_problems(PACKAGED) == []
    assert all(rel in PACKAGED["files"] for g in sources.CHAPTER_FILES for rel in g)


def test_the_loaders_read_exactly_the_chapter_files():
    """CHAPTER_FILES is what the loaders name: their path constants, and every data path written
    as a string in their modules."""
    constants = {*squad.TRAIN_FILES, squad.DEV_FILE, hatexplain.TRAIN_JSONL, hatexplain.TRAIN_CSV,
                 *hatexplain.SPLIT_FILES.values(), hatexplain.DIVISIONS, sva.ML_FILE, sva.LINZEN_TRAIN_FILE,
                 sva.LINZEN_TEST_FILE}
    assert constants == {rel for g in sources.CHAPTER_FILES for rel in g}
    assert squad.TRAIN_FILES in sources.CHAPTER_FILES                               # in the loader's order
    assert (hatexplain.TRAIN_JSONL, hatexplain.TRAIN_CSV) in sources.CHAPTER_FILES
    for module in (squad, hatexplain, sva):
        strings = {n.value for n in ast.walk(ast.parse(Path(module.__file__).read_text()))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        paths = {s for s in strings if s.split("/")[0] in ("squad", "hatexplain", "sva") and s.endswith((".gz", ".json"))}
        assert paths <= constants, module.__name__


@pytest.mark.parametrize("doc, problem", [
    ([], "the manifest must be a JSON object with 'files' and 'downloads', is an array"),
    ({"downloads": {}}, "'files' is missing"),
    ({"files": []}, "'files' must be an object keyed by path, is an array"),
    ({**PACKAGED, "file": {}}, 'unknown top-level key "file"'),
])
def test_a_manifest_of_the_wrong_shape_is_named_as_such(use_manifest, doc, problem):
    path = use_manifest(doc)
    with pytest.raises(ValueError, match="breaks its contract") as err:
        sources.manifest()
    assert problem in str(err.value) and str(path) in str(err.value)


def test_every_bad_field_is_named(use_manifest, capsys):
    doc = json.loads(json.dumps(PACKAGED))
    doc["files"][squad.DEV_FILE]["sha256"] = "5ef5752d50566ab5"                  # cut short
    doc["files"][sva.LINZEN_TRAIN_FILE]["content_sha256"] = "X" * 64               # not hex
    doc["files"][hatexplain.DIVISIONS]["records"] = {"train": -1}
    doc["files"][sva.LINZEN_TEST_FILE]["build"] = {"download": "nowhere"}
    doc["files"][ML]["optional"] = True
    del doc["downloads"]["squad/dev-v1.1.json"]["url"]
    use_manifest(doc)
    with pytest.raises(ValueError) as err:
        sources.manifest()
    msg = str(err.value)
    assert f'files["{squad.DEV_FILE}"].sha256: "5ef5752d50566ab5" is not null or a sha256 (64 lowercase hex digits)' in msg
    assert f'files["{sva.LINZEN_TRAIN_FILE}"].content_sha256: "{"X" * 64}" is not null or a sha256' in msg
    assert f'files["{hatexplain.DIVISIONS}"].records: {{"train": -1}} is not an object of counts' in msg
    assert f'files["{sva.LINZEN_TEST_FILE}"].build: download "nowhere" is not in \'downloads\'' in msg
    assert f'files["{ML}"]: the chapters read it, so it cannot be optional' in msg
    assert 'downloads["squad/dev-v1.1.json"]: \'url\' is missing' in msg
    assert len(msg.splitlines()) == 1 + 6
    # the command line: one message, exit status 1, no traceback
    assert sources.main(["list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qkov data list: the data manifest") and "Traceback" not in err


def test_a_file_the_chapters_read_without_an_entry_is_an_error(use_manifest, tmp_path, capsys):
    """The entry of the agreement pairs removed: checking, verifying and reading the file all stop
    with a message naming it -- they do not pass with one file fewer."""
    use_manifest(without(ML))
    data = tmp_path / "data"
    (data / "sva").mkdir(parents=True)
    (data / ML).write_bytes(gzip.compress(b'{"sentence_good": "the author laughs"}\n'))   # e.g. truncated
    for command in (["check"], ["verify"], ["check", "--fetch"]):
        assert fetch.main([*command, "--data-dir", str(data)]) == 1
        err = capsys.readouterr().err
        assert f"has no entry for {ML}, which the chapters read" in err, command
    with pytest.raises(ValueError, match=f"has no entry for {ML}"):
        sva.load(data)                                   # the loader the chapter calls


def test_an_empty_files_object_checks_nothing_and_says_so(use_manifest, tmp_path, capsys):
    use_manifest({"downloads": {}, "files": {}})
    (tmp_path / "data").mkdir()
    assert fetch.main(["check", "--data-dir", str(tmp_path / "data")]) == 1
    err = capsys.readouterr().err
    assert "has no entry for squad/dev-v1.1.json.gz" in err and "0 checked" not in err


def test_without_an_entry_the_file_is_read_only_when_asked_loudly_and_marked(use_manifest, tmp_path, monkeypatch,
                                                                             capsys):
    from qkov_lib.tooling import results

    use_manifest(without(ML))
    data = tmp_path / "data"
    (data / "sva").mkdir(parents=True)
    (data / ML).write_bytes(gzip.compress(b'{"sentence_good": "the author laughs"}\n'))
    monkeypatch.setenv(sources.ALLOW_ENV, "1")
    sources.clear_used()
    assert sources.data_file(ML, data) == data / ML
    err = capsys.readouterr().err
    assert f"WARNING: the data manifest {tmp_path / 'manifest.json'} has no entry for {ML}" in err
    assert f"WARNING: {ML}: {sources.UNVERIFIED_NO_ENTRY}" in err
    used = sources.used_files()[ML]
    assert used.endswith(f"({sources.UNVERIFIED_NO_ENTRY})") and "no entry in the manifest" in used
    doc = json.loads(results.save_results("x", {}, {}, path=tmp_path / "r.json").read_text())
    assert "no entry in the manifest" in doc["data_files"][ML]
    status = sources.verify_all(data)
    assert status[ML] == sources.UNVERIFIED_NO_ENTRY and status[squad.DEV_FILE] == "missing"


@pytest.mark.parametrize("doc", [PACKAGED, {"downloads": {}, "files": {}}])
def test_a_data_folder_that_does_not_exist_is_an_error_whatever_the_manifest_says(use_manifest, tmp_path,
                                                                                   monkeypatch, capsys, doc):
    use_manifest(doc)
    monkeypatch.setenv(sources.ALLOW_ENV, "1")      # not even this lets an empty manifest pass
    gone = tmp_path / "nowhere"
    assert sources.main(["check", "--data-dir", str(gone)]) == 1
    err = capsys.readouterr().err
    assert f"data directory '{gone}' (from the data_dir argument) does not exist" in err
    assert sources.main(["verify", "--data-dir", str(gone)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_a_data_dir_that_is_a_file_says_it_is_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(sources.MANIFEST_ENV, raising=False)
    afile = tmp_path / "data.tar"
    afile.write_bytes(b"not a folder")
    monkeypatch.setenv(sources.DATA_ENV, str(afile))
    with pytest.raises(FileNotFoundError, match=f"data directory '{afile}' \\(from \\$QKOV_DATA_DIR\\) is a file, not a folder"):
        sources.resolve_data_dir()
    for probe in ([], ["--probe"]):
        assert sources.main(["check", *probe]) == 1
        assert "is a file, not a folder" in capsys.readouterr().err
    assert sources.find_data_dir()[0] is None and "is a file" in sources.find_data_dir()[1]
