"""A cache that cannot be written (a read-only HOME, a cache path through a file) is named as such, with
the settings that move it, and the data file is not blamed."""

from __future__ import annotations

import gzip
import json

import pytest

from qkov_lib.data import sources


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps({"i": i}) for i in range(3)))
    return path


def test_an_unwritable_cache_names_the_cache_settings_not_the_data_file(tmp_path, monkeypatch, rows_file):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "a_file" / "cache"))  # no folder can be made there
    with pytest.raises(ValueError) as err:
        sources.load_rows("json", rows_file)
    text = str(err.value)
    assert "could not write its cache" in text and "the data file is not at fault" in text
    assert f"{sources.CACHE_ENV} (our cache, now {tmp_path / 'a_file' / 'cache'})" in text
    assert "HF_DATASETS_CACHE" in text and str(tmp_path / "a_file") in text
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))  # the way out the message gives
    assert [r["i"] for r in sources.load_rows("json", rows_file)] == [0, 1, 2]


def test_an_empty_xdg_cache_home_is_unset_not_the_current_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(sources.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert sources.cache_dir() == tmp_path / ".cache" / "qkov" / "datasets"


def test_a_corrupt_data_file_is_still_named_with_its_line(tmp_path, monkeypatch):
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"i": 0}\n{"i": \n')
    with pytest.raises(ValueError, match=r"corrupt JSON on line 2 of .*bad\.jsonl"):
        sources.load_rows("json", bad)
