"""Where the real-data files come from: the data folder, the manifest, checksums, the preflight.

* **Data folder**: :func:`resolve_data_dir` (``data_dir``, else ``$QKOV_DATA_DIR``, else
  ``<repo>/../shared/data``).
* **Manifest**: ``manifest.json`` beside this file (or ``$QKOV_DATA_MANIFEST``, e.g. a mirror) lists
  the official ``downloads`` (address, sha256 of the bytes as served, where that checksum comes
  from) and the ``files`` the loaders read (sha256 of the stored file and of its gunzipped content,
  and how :mod:`qkov_lib.data.fetch` builds it). It is a contract, checked whenever it is read
  (:func:`manifest_problems`: its layout, every field's type, each sha256 as 64 hex digits); every
  file the chapters read (:data:`CHAPTER_FILES`) must have an entry: a file without one is an
  error, or, with ``QKOV_ALLOW_UNVERIFIED=1``, read unverified, loudly, and marked so.
* **Checksums**: :func:`verify_file`. A file the manifest has no checksum for (the HateXplain train
  split built by ``qkov data fetch``) is read only with the provenance record ``fetch`` writes
  beside it -- never otherwise, not even when a checksummed alternative of its group is there --
  unless ``QKOV_ALLOW_UNVERIFIED=1``; :func:`used_files` (the ``data_files`` of every results file)
  then marks it. Record counts: :func:`check_records`.
* **Preflight**: :func:`preflight`, run by ``make book`` before anything else; it needs only the
  standard library, so it also runs as ``python3 qkov_lib/data/sources.py check --probe`` before the
  virtual environment exists.
* **Reading**: :func:`load_files` (the ``datasets`` library with a cache outside the repository;
  works with ``HF_DATASETS_OFFLINE=1``).

Command line: ``python -m qkov_lib.data.sources {check [--probe] | verify | list}`` (:func:`main`);
with fetching, ``qkov data ...`` (:func:`qkov_lib.data.fetch.main`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_ENV = "QKOV_DATA_DIR"
CACHE_ENV = "QKOV_CACHE_DIR"
SOURCE_ENV = "QKOV_DATA_SOURCE"
MANIFEST_ENV = "QKOV_DATA_MANIFEST"
ALLOW_ENV = "QKOV_ALLOW_UNVERIFIED"  # "1": use data files that have no checksum (marked in used_files)
PROVENANCE_SUFFIX = ".provenance.json"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
MANIFEST_PATH = Path(__file__).with_name("manifest.json")
FETCH_HINT = "qkov data fetch"  # the same as `python -m qkov_lib.data.fetch fetch`
BAD_FILE_FIX = (f"delete it and run `{FETCH_HINT}` (or `make data`) to download and build it again, or set "
                f"{DATA_ENV} to a folder that holds a good copy")
# Public Hugging Face hub names, for users with internet (source="hub"); SVA has none.
HUB_NAMES = {"squad": "rajpurkar/squad", "hatexplain": "Hate-speech-CNERG/hatexplain"}
#: The files the loaders read (the paths of qkov_lib.data.squad, hatexplain and sva), as groups of
#: alternatives in the order the loaders prefer them: any one of a group will do. Written here, not
#: read from the manifest, so that a manifest that lost an entry cannot take a file out of the checks
#: (tests/test_manifest_contract.py holds the loaders and the manifest to it).
CHAPTER_FILES: tuple[tuple[str, ...], ...] = (
    ("squad/dev-v1.1.json.gz",),
    ("squad/train-v1.1.json.gz", "squad/train-v1.1-from-explorer.json.gz"),
    ("hatexplain/post_id_divisions.json",),
    ("hatexplain/hatexplain_train.jsonl.gz", "hatexplain/hatexplain_train_no_rationales.csv.gz"),
    ("hatexplain/hatexplain_validation.jsonl.gz",),
    ("hatexplain/hatexplain_test.jsonl.gz",),
    ("sva/linzen2016_numpred.val.tsv.gz",),
    ("sva/linzen2016_numpred.test_attractors.tsv.gz",),
    ("sva/marvin_linzen2018_agreement.jsonl.gz",),
)


class ChecksumError(ValueError):
    """A data file's or download's sha256 does not match the manifest: ``reason``, plus ``fix`` in the message."""

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(f"{reason}; {fix}" if fix else reason)
        self.reason = reason


class UnverifiedError(ChecksumError):
    """A file without a manifest checksum or valid provenance record; used only with ``QKOV_ALLOW_UNVERIFIED=1``."""


class RecordCountError(ValueError):
    """A loader parsed a different number of records from a data file than the manifest gives."""


class DataUnavailable(RuntimeError):
    """Needed data files are missing and cannot be fetched, or fail their check; the message says what to do."""


class ManifestError(ValueError):
    """The data manifest breaks its contract (:func:`manifest_problems`, :func:`manifest`); the message names
    the manifest and every problem."""


# --- manifest ---------------------------------------------------------------------------------
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _text(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _sha(v: Any) -> bool:
    return v is None or (isinstance(v, str) and bool(_SHA256.fullmatch(v)))


SHA_RULE = "null or a sha256 (64 lowercase hex digits)"
#: field -> (required, check, what it must be): the layout of a ``files`` entry and of a ``downloads`` entry.
FILE_FIELDS = {
    "dataset": (True, _text, "a non-empty string"), "license": (True, _text, "a non-empty string"),
    "source": (True, _text, "a non-empty string"),
    "build": (True, lambda v: v is None or isinstance(v, dict), "null or an object"),
    "sha256": (True, _sha, SHA_RULE), "content_sha256": (True, _sha, SHA_RULE),
    "lines": (False, lambda v: v is None or _count(v), "null or a count (an integer >= 0)"),
    "records": (False, lambda v: isinstance(v, dict) and all(_text(k) and _count(n) for k, n in v.items()),
                "an object of counts, e.g. {\"posts\": 1922}"),
    "group": (False, _text, "a non-empty string"), "optional": (False, lambda v: isinstance(v, bool), "true or false"),
    "note": (False, _text, "a non-empty string"),
}
DOWNLOAD_FIELDS = {
    "url": (True, lambda v: isinstance(v, str) and v.startswith(("https://", "http://")), "an http(s) address"),
    "sha256": (True, _sha, SHA_RULE), "path": (True, _text, "a path in the data folder"),
    "store": (True, lambda v: v in ("gzip", "copy"), "'gzip' or 'copy'"),
    "dataset": (False, _text, "a non-empty string"), "license": (False, _text, "a non-empty string"),
    "sha256_from": (False, _text, "a non-empty string"), "bytes": (False, _count, "a count (an integer >= 0)"),
}


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _fields(where: str, entry: Any, spec: Mapping[str, tuple]) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{where}: must be an object, is {_kind(entry)}"]
    out = [f"{where}: '{k}' is missing" for k, (required, _, _) in spec.items() if required and k not in entry]
    out += [f"{where}: unknown field '{k}' (known: {', '.join(spec)})" for k in entry if k not in spec]
    out += [f"{where}.{k}: {json.dumps(entry[k])} is not {what}" for k, (_, ok, what) in spec.items()
            if k in entry and not ok(entry[k])]
    return out


def _build_problems(where: str, build: Any, downloads: Mapping[str, Any]) -> list[str]:
    if not isinstance(build, dict):
        return []
    if set(build) == {"download"}:
        ids = [build["download"]]
    elif set(build) == {"convert", "inputs"} and _text(build["convert"]) and isinstance(build["inputs"], list) \
            and build["inputs"]:
        ids = build["inputs"]
    else:
        return [f"{where}.build: {json.dumps(build)} is neither {{\"download\": ID}} nor "
                "{\"convert\": NAME, \"inputs\": [ID, ...]}"]
    return [f"{where}.build: download {json.dumps(i)} is not in 'downloads'" for i in ids if i not in downloads]


def manifest_problems(doc: Any) -> list[str]:
    """Every way ``doc`` (a parsed manifest) breaks the manifest's contract, one line each, empty if none:
    the top level is an object with a ``files`` object and, optionally, ``downloads`` and ``about``;
    each file entry has the fields of :data:`FILE_FIELDS` (checksums ``null`` or 64 lowercase hex digits),
    a ``build`` of downloads that exist, ``optional: true`` exactly when no chapter reads it
    (:data:`CHAPTER_FILES`) and a ``group`` exactly when the chapters accept an alternative to it, the
    same for all of them; each download has the fields of :data:`DOWNLOAD_FIELDS`. A needed file that has
    no entry is not a problem here (see :func:`missing_entries`)."""
    if not isinstance(doc, dict):
        return [f"the manifest must be a JSON object with 'files' and 'downloads', is {_kind(doc)}"]
    out = [f"unknown top-level key {json.dumps(k)} (known: about, downloads, files)" for k in doc
           if k not in ("about", "downloads", "files")]
    files, downloads = doc.get("files"), doc.get("downloads", {})
    if "files" not in doc:
        out.append("'files' is missing: the object of the data files the loaders read, keyed by path")
    elif not isinstance(files, dict):
        out.append(f"'files' must be an object keyed by path, is {_kind(files)}")
    if not isinstance(downloads, dict):
        out.append(f"'downloads' must be an object keyed by download id, is {_kind(downloads)}")
        downloads = {}
    for did, d in downloads.items():
        out += _fields(f"downloads[{json.dumps(did)}]", d, DOWNLOAD_FIELDS)
    if not isinstance(files, dict):
        return out
    needed = {rel: g for g in CHAPTER_FILES for rel in g}
    for rel, e in files.items():
        where = f"files[{json.dumps(rel)}]"
        problems = _fields(where, e, FILE_FIELDS)
        out += problems
        if not isinstance(e, dict):
            continue
        out += _build_problems(where, e.get("build"), downloads)
        if rel in needed and e.get("optional"):
            out.append(f"{where}: the chapters read it, so it cannot be optional")
        elif rel not in needed and not e.get("optional"):
            out.append(f"{where}: no chapter reads it (qkov_lib.data.sources.CHAPTER_FILES); mark it \"optional\": true")
        alternatives = [r for r in needed.get(rel, (rel,)) if r in files and r != rel]
        if alternatives and (not e.get("group") or any(files[r].get("group") != e.get("group") for r in alternatives
                                                       if isinstance(files[r], dict))):
            out.append(f"{where}.group: the chapters accept {' or '.join(alternatives)} instead, so they all need "
                       "the same 'group'")
        elif not alternatives and e.get("group"):
            out.append(f"{where}.group: {json.dumps(e['group'])}, but no other file of the manifest stands in for it")
    return out


@lru_cache(maxsize=8)
def _read_manifest(path: str) -> dict[str, Any]:
    origin = f"from ${MANIFEST_ENV}" if os.environ.get(MANIFEST_ENV) == path else "the packaged one"
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ManifestError(f"cannot read the data manifest {path} ({origin}): {err}") from err
    bad = manifest_problems(doc)
    if bad:
        raise ManifestError(f"the data manifest {path} ({origin}) breaks its contract:\n" + "\n".join(f"  - {b}" for b in bad))
    return doc


def manifest_path() -> str:
    """``$QKOV_DATA_MANIFEST`` if set, else the packaged ``manifest.json``."""
    return os.environ.get(MANIFEST_ENV) or str(MANIFEST_PATH)


def manifest_doc() -> dict[str, Any]:
    """The whole manifest (:func:`manifest_path`), checked against its contract (:func:`manifest_problems`;
    ManifestError naming every problem)."""
    return _read_manifest(manifest_path())


def missing_entries() -> list[str]:
    """The files of :data:`CHAPTER_FILES` that have no entry in the manifest."""
    files = manifest_doc()["files"]
    return [rel for g in CHAPTER_FILES for rel in g if rel not in files]


_WARNED: set[tuple[str, ...]] = set()


def manifest() -> dict[str, dict[str, Any]]:
    """The manifest's file entries (what the loaders read), keyed by path relative to the data folder.
    ManifestError when a file the chapters read has no entry (its checksum could not be checked); with
    ``QKOV_ALLOW_UNVERIFIED=1`` a warning on stderr instead (once), and such a file is read unverified
    (:func:`verify_file`) and marked so in the results files (:func:`used_files`)."""
    missing = missing_entries()
    if missing and not allow_unverified():
        raise ManifestError(
            f"the data manifest {manifest_path()} has no entry for {', '.join(missing)}, which the chapters read: "
            f"without it the file's checksum cannot be checked. Restore the entry (the packaged manifest has it), or "
            f"set {ALLOW_ENV}=1 to read the file unverified (the results files then say so)")
    if missing and (key := (manifest_path(), *missing)) not in _WARNED:
        _WARNED.add(key)
        print(f"qkov data: WARNING: the data manifest {manifest_path()} has no entry for {', '.join(missing)}; "
              f"read unverified because {ALLOW_ENV}=1 (marked so in the results files)", file=sys.stderr)
    return manifest_doc()["files"]


def downloads() -> dict[str, dict[str, Any]]:
    """The manifest's official downloads, keyed by download id."""
    return manifest_doc().get("downloads", {})


# --- the data folder --------------------------------------------------------------------------
def data_dir_location(data_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """(path, where it came from) of the data folder, existing or not: ``data_dir``, else ``$QKOV_DATA_DIR``,
    else ``<repo>/../shared/data``. A relative path is taken against the working directory, or the
    repository root if only that exists (chapters run from ``book/``)."""
    if data_dir is not None:
        given, origin = str(data_dir), "the data_dir argument"
    elif os.environ.get(DATA_ENV):
        given, origin = os.environ[DATA_ENV], f"${DATA_ENV}"
    else:
        return DEFAULT_DATA_DIR, f"the default beside the checkout (${DATA_ENV} is not set)"
    p = Path(given).expanduser()
    if p.is_absolute():
        return p, origin
    for c in (Path.cwd() / p, REPO_ROOT / p):
        if c.is_dir():
            return c.resolve(), origin
    return (Path.cwd() / p).resolve(), origin


def not_a_folder(path: Path, origin: str) -> str | None:
    """None when ``path`` is a folder; else why not (it does not exist, or it is a file), with ``origin``
    and what to do."""
    if path.is_dir():
        return None
    what = "is a file, not a folder" if path.exists() else "does not exist"
    return (f"data directory {str(path)!r} (from {origin}) {what}; set {DATA_ENV} to the folder that holds "
            f"squad/, hatexplain/ and sva/ (for example ../shared/data), or build it with `{FETCH_HINT}`")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data folder (:func:`data_dir_location`); FileNotFoundError naming ``QKOV_DATA_DIR`` and a fix when
    it does not exist or is a file."""
    path, origin = data_dir_location(data_dir)
    why = not_a_folder(path, origin)
    if why:
        raise FileNotFoundError(why)
    return path


def find_data_dir() -> tuple[Path | None, str]:
    """(data folder, where it came from) or (None, why not) -- for tests that need the real files."""
    path, origin = data_dir_location()
    why = not_a_folder(path, origin)
    return (None, f"real data folder not found: {why}") if why else (path, f"real data in {path} (from {origin})")


# --- checksums ----------------------------------------------------------------------------------
_SHA: dict[tuple[str, int, int, bool], str] = {}


def sha256_file(path: str | os.PathLike, gunzip: bool = False) -> str:
    """Hex sha256 of a file's bytes (gunzipped with ``gunzip=True``), cached per (path, size, mtime) within
    the process: the loaders ask for the same file more than once."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, gunzip)
    if key not in _SHA:
        _SHA[key] = _sha256_uncached(path, gunzip)
    return _SHA[key]


def _sha256_uncached(path: str | os.PathLike, gunzip: bool = False) -> str:
    h = hashlib.sha256()
    with (gzip.open if gunzip else open)(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: str | os.PathLike, what: str, sha256: str | None, content_sha256: str | None) -> str:
    """Check ``path`` against a file checksum ``sha256`` or a gunzipped-content checksum ``content_sha256``:
    ``"sha256"``, ``"content_sha256"`` or ``"no checksum"`` (both None); ChecksumError naming ``what``."""
    if sha256 is None and content_sha256 is None:
        return "no checksum"
    got = sha256_file(path)
    if sha256 and got == sha256:
        return "sha256"
    content = got
    if str(path).endswith(".gz"):
        try:
            content = sha256_file(path, gunzip=True)
        except (OSError, EOFError, zlib.error) as err:
            raise ChecksumError(f"{path}: not a readable gzip file ({err}); expected the file of {what}",
                                BAD_FILE_FIX) from err
    if content_sha256 and content == content_sha256:
        return "content_sha256"
    raise ChecksumError(
        f"checksum mismatch for {path}: sha256 {got} does not match {what} (expected {sha256} for the file or "
        f"{content_sha256} for its content); the file is corrupt or a different version", BAD_FILE_FIX)


def allow_unverified() -> bool:
    """Whether ``$QKOV_ALLOW_UNVERIFIED`` is ``1`` (unset, empty or ``0``: no); ValueError otherwise."""
    v = os.environ.get(ALLOW_ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"${ALLOW_ENV} must be 1 (use data files without a checksum) or 0/unset, got {v!r}")
    return v == "1"


UNVERIFIED_ALLOWED = f"unverified: no checksum in the manifest, used because ${ALLOW_ENV}=1"
UNVERIFIED_NO_ENTRY = f"unverified: no entry in the manifest, used because ${ALLOW_ENV}=1"


def is_unverified(status: str) -> bool:
    """Whether a :func:`verify_file` status says the file was used without a check."""
    return status in (UNVERIFIED_ALLOWED, UNVERIFIED_NO_ENTRY)


def provenance_path(path: str | os.PathLike) -> Path:
    """Where :mod:`qkov_lib.data.fetch` records how it built ``path``: ``<path>.provenance.json``."""
    return Path(str(path) + PROVENANCE_SUFFIX)


def provenance_record(rel: str, stored: bytes, content: bytes, converter: str,
                      inputs: Mapping[str, bytes]) -> dict[str, Any]:
    """Record of a file ``qkov data fetch`` built: manifest path, sha256 of stored bytes and content, line
    count, converter and the sha256 of each download (``{id: bytes as served}``) it was built from."""
    return {"file": rel, "sha256": hashlib.sha256(stored).hexdigest(),
            "content_sha256": hashlib.sha256(content).hexdigest(), "lines": content.count(b"\n"),
            "built_by": f"qkov data fetch ({converter} converter)",
            "inputs": {did: hashlib.sha256(b).hexdigest() for did, b in inputs.items()}}


def provenance_problem(path: str | os.PathLike, rel: str) -> str | None:
    """None if the provenance record of ``path`` vouches for it (names ``rel``, the file's sha256, the
    published sha256 of every input of ``rel``'s build, the manifest's line count); else why not."""
    rec_path = provenance_path(path)
    if not rec_path.is_file():
        return f"has no provenance record {rec_path.name} from `{FETCH_HINT}`"
    try:
        rec = json.loads(rec_path.read_text())
        if not isinstance(rec, dict) or not isinstance(rec.get("inputs"), dict):
            raise ValueError("not an object with 'inputs'")
    except (OSError, ValueError) as err:
        return f"has an unreadable provenance record {rec_path.name} ({err})"
    e = manifest()[rel]
    got = sha256_file(path)
    if rec.get("file") != rel or rec.get("sha256") != got:
        return (f"has sha256 {got}, but its provenance record {rec_path.name} is for {rec.get('file')!r} with sha256 "
                f"{rec.get('sha256')} (the file changed after `{FETCH_HINT}` built it)")
    want = ((e.get("build") or {}).get("inputs")) or []
    if not want:
        return "is not built from downloads (the manifest gives no converter inputs), so no provenance record can vouch for it"
    for did in want:
        published = downloads().get(did, {}).get("sha256")
        if not published:
            return f"was built from {did}, which has no published sha256"
        if rec["inputs"].get(did) != published:
            return (f"was built, says {rec_path.name}, from {did} with sha256 {rec['inputs'].get(did)}, not the published "
                    f"{published}")
    if e.get("lines") is not None and rec.get("lines") != e["lines"]:
        return f"has {rec.get('lines')} lines by its provenance record, expected {e['lines']} (manifest)"
    return None


def verify_file(path: str | os.PathLike, rel: str) -> str:
    """Check ``path`` against manifest entry ``rel``: ``"sha256"`` or ``"content_sha256"``
    (:func:`check_sha256`); without checksums ``"provenance"`` (a valid :func:`provenance_problem`
    record) or, with ``QKOV_ALLOW_UNVERIFIED=1``, :data:`UNVERIFIED_ALLOWED`; with no entry at all,
    :data:`UNVERIFIED_NO_ENTRY` under ``QKOV_ALLOW_UNVERIFIED=1``. Raises ChecksumError on a mismatch,
    UnverifiedError for an unvouched file or one without an entry."""
    if rel not in manifest():
        if allow_unverified():
            return UNVERIFIED_NO_ENTRY
        raise UnverifiedError(f"{path} has no entry in the data manifest {manifest_path()}, so its checksum cannot "
                              "be checked and it is not used",
                              f"add its entry, or set {ALLOW_ENV}=1 to use it anyway (the results files then mark it "
                              "unverified)")
    e = manifest()[rel]
    if e.get("sha256") or e.get("content_sha256"):
        return check_sha256(path, f"the manifest entry {rel!r}", e.get("sha256"), e.get("content_sha256"))
    why = provenance_problem(path, rel)
    if why is None:
        return "provenance"
    if allow_unverified():
        return UNVERIFIED_ALLOWED
    root = Path(path).parents[len(Path(rel).parts) - 1]
    others = [r for r in group_members(rel) if r != rel and (root / r).is_file()]
    instead = f"; once it is deleted the loaders read {' or '.join(others)}" if others else ""
    raise UnverifiedError(
        f"{path} has no checksum in the manifest and {why}, so it is not used{instead}",
        f"delete it and run `{FETCH_HINT}`, which builds it from the checksummed official downloads with a "
        f"provenance record; or set {ALLOW_ENV}=1 to use it anyway (the results files then mark it unverified)")


def file_status(path: str | os.PathLike, rel: str) -> str:
    """:func:`verify_file`, with a failure as ``"FAILED: <reason>"`` instead of an exception."""
    try:
        return verify_file(path, rel)
    except ChecksumError as err:
        return f"FAILED: {err.reason}"


def check_records(rel: str, found: Mapping[str, int], verify: bool = True) -> None:
    """Compare the record counts a loader parsed from ``rel`` (``{kind: count}``, e.g. ``{"posts": 15383}``)
    with the manifest's ``records`` (only the kinds it lists; nothing with ``verify=False``).
    Raises :class:`RecordCountError` naming the file, the expected and the found counts."""
    if not verify or rel not in manifest():
        return
    want = manifest()[rel].get("records") or {}
    bad = [f"{n} {kind}, expected {want[kind]}" for kind, n in found.items() if kind in want and n != want[kind]]
    if bad:
        raise RecordCountError(f"data file {rel}: {'; '.join(bad)} (manifest records); the file is truncated, padded "
                               f"or a different version -- {BAD_FILE_FIX}")


_USED: dict[str, str] = {}


def used_files() -> dict[str, str]:
    """``{path in the data folder: sha256}`` of every file :func:`data_file` opened in this process (and
    ``hub:NAME`` fingerprints); an unverified one has ``"<sha256> (<why unverified>)"``
    (:data:`UNVERIFIED_ALLOWED`, :data:`UNVERIFIED_NO_ENTRY`)."""
    return dict(sorted(_USED.items()))


def clear_used() -> None:
    """Forget the files recorded for :func:`used_files` (e.g. between two runs)."""
    _USED.clear()


def data_file(rel: str, data_dir: str | os.PathLike | None = None, verify: bool = True) -> Path:
    """The path of data file ``rel`` (e.g. ``"sva/linzen2016_numpred.val.tsv.gz"``), checked with
    :func:`verify_file` when ``verify`` (a file read unverified is named on stderr) and recorded for
    :func:`used_files`; FileNotFoundError if missing."""
    root = resolve_data_dir(data_dir)
    path = root / rel
    if not path.is_file():
        raise FileNotFoundError(
            f"data file {rel!r} not found in {root} (the data directory comes from data_dir or ${DATA_ENV}); "
            f"build it with `{FETCH_HINT}` or point {DATA_ENV} at the folder that holds it"
        )
    how = verify_file(path, rel) if verify else None
    if how and is_unverified(how):
        print(f"qkov data: WARNING: {rel}: {how}", file=sys.stderr)
    _USED[rel] = sha256_file(path) + (f" ({how})" if how and is_unverified(how) else "")
    return path


def first_present(rels: Iterable[str], data_dir: str | os.PathLike | None = None) -> str | None:
    """The first of ``rels`` that exists in the data folder, or None."""
    root = resolve_data_dir(data_dir)
    return next((r for r in rels if (root / r).is_file()), None)


def verify_all(data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Verify every manifest file and kept download in the data folder, whatever fails: ``{path:
    status}``, a :func:`file_status` (``"sha256"``, ``"provenance"``, ``"FAILED: <reason>"``, ...),
    ``"no checksum"`` (a kept download without a published one), ``"missing"``, ``"missing
    (optional)"`` or ``"missing (alternative present)"``; a file the chapters read that has no manifest
    entry is among them too. :func:`problems` picks out what is wrong."""
    root = resolve_data_dir(data_dir)
    files = manifest()
    rels = list(dict.fromkeys([*files, *(rel for g in CHAPTER_FILES for rel in g)]))
    present = {rel for rel in rels if (root / rel).is_file()}
    out = {}
    for rel in rels:
        e = files.get(rel, {})
        if rel in present:
            out[rel] = file_status(root / rel, rel)
        elif e.get("optional"):
            out[rel] = "missing (optional)"
        elif any(m in present for m in group_members(rel)):
            out[rel] = "missing (alternative present)"
        else:
            out[rel] = "missing"
    for did, d in downloads().items():
        path = root / d["path"]
        if d["path"] not in out and path.is_file():
            try:
                out[d["path"]] = check_sha256(path, f"the download {did!r}", None, d.get("sha256"))
            except ChecksumError as err:
                out[d["path"]] = f"FAILED: {err.reason}"
    return out


def problems(status: Mapping[str, str]) -> list[str]:
    """What fails ``verify`` in a :func:`verify_all` result: each ``FAILED`` reason and each needed group absent."""
    out = []
    for rel, s in status.items():
        if s.startswith("FAILED"):
            out.append(s.removeprefix("FAILED: "))
        elif s == "missing" and group_members(rel)[0] == rel:
            others = group_members(rel)[1:]
            out.append(f"{rel}: missing" + (f" (and so are its alternatives {', '.join(others)})" if others else ""))
    return out


# --- what the chapters need -------------------------------------------------------------------
def group_members(rel: str) -> list[str]:
    """The alternatives of ``rel`` (``rel`` included) in :data:`CHAPTER_FILES`, the fetchable one first; the
    manifest's ``group`` says the same (:func:`manifest_problems`)."""
    return next((list(g) for g in CHAPTER_FILES if rel in g), [rel])


def required_files() -> list[list[str]]:
    """The files the chapters need (:data:`CHAPTER_FILES`), as groups of alternatives (any one member will do)."""
    return [list(g) for g in CHAPTER_FILES]


def check_needed(data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """``{path: file_status}`` of the file the loaders read (the first present) of each group of
    :func:`required_files` that has one. Cached sha256 checks only: about 0.03 s for the real folder's 16 MB."""
    root, _ = data_dir_location(data_dir)
    out = {}
    for g in required_files():
        rel = next((r for r in g if (root / r).is_file()), None)
        if rel is not None:
            out[rel] = file_status(root / rel, rel)
    return out


def missing_files(data_dir: str | os.PathLike | None = None) -> list[list[str]]:
    """The groups of :func:`required_files` with no member in the data folder (all, if it does not exist)."""
    root, _ = data_dir_location(data_dir)
    return [g for g in required_files() if not any((root / r).is_file() for r in g)]


def build_target(group: list[str]) -> str | None:
    """The member of a group of alternatives that ``fetch`` can build, or None."""
    return next((r for r in group if manifest().get(r, {}).get("build")), None)


def downloads_for(rels: Iterable[str]) -> list[str]:
    """The download ids needed to build the files ``rels``, in manifest order."""
    need = set()
    for rel in rels:
        b = manifest().get(rel, {}).get("build") or {}
        need.update([b["download"]] if "download" in b else b.get("inputs", []))
    return [d for d in downloads() if d in need]


def probe(urls: Iterable[str], timeout: float = 5.0) -> dict[str, str]:
    """``{host: why}`` of the hosts of ``urls`` a HEAD request (``timeout`` s) cannot reach; any HTTP answer will do."""
    by_host: dict[str, str] = {}
    for url in urls:
        by_host.setdefault(urllib.parse.urlsplit(url).netloc, url)
    down = {}
    for host, url in by_host.items():
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):  # noqa: S310
                pass
        except urllib.error.HTTPError:
            pass  # the server answered
        except (urllib.error.URLError, OSError, socket.timeout) as err:
            down[host] = str(getattr(err, "reason", err))
    return down


def unavailable_message(missing: list[list[str]], root: Path, origin: str, down: Mapping[str, str] | None) -> str:
    """The message of a stopped preflight: the missing files, why they cannot be fetched, the ways out."""
    lines = [f"qkov: {len(missing)} data file(s) needed by the real-data chapters are missing from {root} "
             f"(data folder from {origin}):"]
    lines += ["  - " + g[0] + (f"  (or {', '.join(g[1:])})" if len(g) > 1 else "") for g in missing]
    if down:
        by_why: dict[str, list[str]] = {}
        for host, why in down.items():
            by_why.setdefault(why, []).append(host)
        lines.append("They cannot be downloaded from here: " + "; ".join(
            f"{', '.join(hosts)} {'is' if len(hosts) == 1 else 'are'} unreachable ({why})" for why, hosts in by_why.items()) + ".")
    lines += ["Two ways out:",
              f"  1. set {DATA_ENV} to a folder that already holds them (laid out like ../shared/data), "
              f"e.g. `make book {DATA_ENV}=/path/to/data`;",
              "  2. run `qkov data fetch` (or `make data`) on a machine with internet access: it downloads the official "
              "releases, checks their sha256 and builds the folder; then copy the folder here or point "
              f"{DATA_ENV} at it."]
    return "\n".join(lines)


def invalid_message(bad: Mapping[str, str], missing: list[list[str]], root: Path, origin: str) -> str:
    """The message of a preflight stopped by ``{path: FAILED status}``, with the missing files and what to do."""
    lines = [f"qkov: {len(bad)} data file(s) the chapters read in {root} (data folder from {origin}) fail their check:"]
    lines += [f"  - {s.removeprefix('FAILED: ')}" for s in bad.values()]  # each reason names its file
    if missing:
        lines.append("and these are missing: " + "; ".join(" or ".join(g) for g in missing) + ".")
    lines += ["Nothing was run. What to do:",
              f"  1. delete each file named and run `{FETCH_HINT}` (or `make data`): it downloads the official releases, "
              "checks their sha256 and builds the files again;",
              f"  2. or set {DATA_ENV} to a folder with good copies, e.g. `make book {DATA_ENV}=/path/to/data`."]
    if any("no checksum in the manifest" in s for s in bad.values()):
        lines.append(f"  A file without a checksum can be used anyway with {ALLOW_ENV}=1; the results files then mark it "
                     "unverified.")
    return "\n".join(lines)


def preflight(data_dir: str | os.PathLike | None = None, probe_network: bool = True,
              timeout: float = 5.0) -> dict[str, str]:
    """Make sure the files the chapters need are there, and sound, before any chapter runs.

    :class:`DataUnavailable` if a needed file fails its sha256 (:func:`check_needed`; nothing is
    deleted or fetched), or if missing files cannot be fetched (no build, no ``probe_network``, or a
    host fails :func:`probe`); the message names the files and the ways out. A data folder that is a
    file, or that does not exist when nothing may be fetched (no ``probe_network``), is the same error,
    whatever the manifest lists. Else ``{path: status}`` of the missing files, which
    :func:`qkov_lib.data.fetch.ensure` then fetches (empty if none)."""
    root, origin = data_dir_location(data_dir)
    why = not_a_folder(root, origin)
    if why and (root.exists() or not probe_network):
        raise DataUnavailable(f"qkov: {why}")
    missing = missing_files(root)
    bad = {rel: s for rel, s in check_needed(root).items() if s.startswith("FAILED")}
    if bad:
        raise DataUnavailable(invalid_message(bad, missing, root, origin))
    if not missing:
        return {}
    targets = [build_target(g) for g in missing]
    if not probe_network or None in targets:
        raise DataUnavailable(unavailable_message(missing, root, origin, None))
    urls = [downloads()[d]["url"] for d in downloads_for(targets)]
    down = probe(urls, timeout)
    if down:
        raise DataUnavailable(unavailable_message(missing, root, origin, down))
    return {t: "missing (reachable: will be fetched)" for t in targets}


# --- reading through the datasets library --------------------------------------------------
def cache_dir() -> Path:
    """Cache folder of ``datasets`` for our files: ``$QKOV_CACHE_DIR``, else ``$XDG_CACHE_HOME/qkov/datasets``,
    else ``~/.cache/qkov/datasets`` (never the repository)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkov" / "datasets"  # set and empty: unset


def _cache_fault(err: BaseException, data_files: Iterable[str]) -> OSError | None:
    """The OSError in ``err``'s chain about a path that is not one of ``data_files`` (so a cache
    folder or file that could not be made or written), if any."""
    data = {os.path.realpath(f) for f in data_files}
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.filename and os.path.realpath(str(err.filename)) not in data:
            return err
        err = err.__cause__ or err.__context__
    return None


def check_json_file(path: str | os.PathLike) -> str:
    """``"json"`` or ``"jsonl"``: how (gzipped) ``path`` parses; ValueError naming the file and first corrupt line."""
    path = Path(path)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        text = f.read()
    try:
        json.loads(text)
        return "json"
    except json.JSONDecodeError as whole:
        lines = text.splitlines()
        first = next((line for line in lines if line.strip()), "")
        try:
            json.loads(first)
        except json.JSONDecodeError:  # one (broken) document, or a broken first line
            raise ValueError(f"corrupt JSON on line {whole.lineno} of {path}: {whole.msg} (column {whole.colno})") from whole
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"corrupt JSON on line {n} of {path}: {err.msg} (column {err.colno})") from err
        return "jsonl"


def load_files(builder: str, data_files: Mapping[str, str | os.PathLike], **kwargs: Any):
    """``datasets.load_dataset(builder, data_files=...)`` on local files with :func:`cache_dir`, no progress
    bars, offline-safe; JSON problems become a ValueError naming the file and line."""
    import datasets

    datasets.disable_progress_bars()
    files = {k: str(v) for k, v in data_files.items()}
    try:
        return datasets.load_dataset(builder, data_files=files, cache_dir=str(cache_dir()), **kwargs)
    except Exception as err:  # noqa: BLE001 - re-raised with the file names
        unwritable = _cache_fault(err, files.values())
        if unwritable is not None:  # the cache, not the data: a read-only HOME, a full or unwritable disk
            raise ValueError(
                f"the datasets library could not write its cache ({unwritable.strerror or unwritable}: "
                f"{unwritable.filename}) while reading {', '.join(files.values())}; the data file is not at fault. "
                f"Point the caches at a writable folder: {CACHE_ENV} (our cache, now {cache_dir()}) and "
                f"HF_DATASETS_CACHE (the datasets library's own, under HF_HOME by default), e.g. "
                f"{CACHE_ENV}=/tmp/qkov-cache HF_DATASETS_CACHE=/tmp/hf-datasets") from err
        if builder == "json":
            for f in files.values():
                check_json_file(f)  # raises a ValueError naming the file and the corrupt line
        raise ValueError(f"the datasets library could not read {', '.join(files.values())} "
                         f"with the {builder!r} builder: {type(err).__name__}: {err}") from err


def load_rows(builder: str, path: str | os.PathLike, **kwargs: Any) -> list[dict[str, Any]]:
    """All records of one local file as plain dicts, read by :func:`load_files`."""
    return load_files(builder, {"rows": path}, **kwargs)["rows"].to_list()


def load_hub(name: str, **kwargs: Any):
    """The public Hugging Face copy of dataset ``name`` (``QKOV_DATA_SOURCE=hub``; needs internet, not
    used by CI), recorded for :func:`used_files` as ``hub:<hub name>`` with the splits' fingerprints."""
    import datasets

    if name not in HUB_NAMES:
        raise FileNotFoundError(f"dataset {name!r} has no public hub copy; it needs the local files "
                                f"(set {DATA_ENV}, or `{FETCH_HINT}`)")
    try:
        ds = datasets.load_dataset(HUB_NAMES[name], cache_dir=str(cache_dir()), **kwargs)
    except Exception as err:  # noqa: BLE001 - re-raised with what to do instead
        raise RuntimeError(f"could not load the hub copy {HUB_NAMES[name]!r} of {name!r} ({type(err).__name__}: {err}); "
                           f"use the local files instead: unset {SOURCE_ENV}, set {DATA_ENV} or run `{FETCH_HINT}`") from err
    _USED[f"hub:{HUB_NAMES[name]}"] = ",".join(f"{k}={getattr(v, '_fingerprint', '?')}" for k, v in sorted(ds.items()))
    return ds


def use_hub(source: str | None) -> bool:
    """Whether a loader reads the hub copy: ``source`` ("local" | "hub"), else ``$QKOV_DATA_SOURCE``, else local."""
    s = source or os.environ.get(SOURCE_ENV) or "local"
    if s not in ("local", "hub"):
        raise ValueError(f"source must be 'local' or 'hub', got {s!r}")
    return s == "hub"


# --- command line ---------------------------------------------------------------------------
def parser() -> tuple[argparse.ArgumentParser, Any]:
    """The ``check``, ``verify`` and ``list`` command line (and its subparsers, to which
    :func:`qkov_lib.data.fetch.main` adds ``fetch``)."""
    ap = argparse.ArgumentParser(prog="qkov data", description="The real-data files: check, verify, list "
                                                               "(qkov data: also fetch).")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    c = sub.add_parser("check", help="are the files the chapters need there? (make book runs this first)")
    c.add_argument("--data-dir", default=None, help=f"data folder (default: ${DATA_ENV}, else ../shared/data)")
    c.add_argument("--probe", action="store_true", help="only check that what is missing could be downloaded")
    v = sub.add_parser("verify", help="check every file of a data folder against the manifest (status 1 if any fails "
                                      "or a needed one is missing)")
    v.add_argument("--data-dir", default=None)
    sub.add_parser("list", help="print the manifest: files, sources, licences")
    return ap, sub


def main(argv: list[str] | None = None) -> int:
    """``python -m qkov_lib.data.sources``: check, verify, list (standard library only; :func:`run`)."""
    return run(parser()[0].parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run parsed ``check``/``verify``/``list`` arguments (:func:`parser`). Exit status 1, one message on
    stderr, when data is missing and cannot be fetched, fails its check (``check``: the files the chapters
    read; ``verify``: every file, all listed) or the manifest breaks its contract."""
    try:
        if args.cmd == "check":
            t0 = time.perf_counter()
            status = preflight(args.data_dir, probe_network=args.probe)
            root = data_dir_location(args.data_dir)[0]
            checked = check_needed(root)  # cached: no second read of the files
            for rel, s in checked.items():
                if is_unverified(s):
                    print(f"data: WARNING: {rel}: {s}", file=sys.stderr)
            unverified = sum(is_unverified(s) for s in checked.values())
            if not status:
                print(f"data: every file the chapters need is in {root}; {len(checked)} checked against the "
                      f"manifest in {time.perf_counter() - t0:.2f} s"
                      + (f", {unverified} of them UNVERIFIED (see the warnings)" if unverified else ""))
            else:
                print(f"data: {len(status)} file(s) missing from {root}; the download servers answer, "
                      "so they are fetched before the chapters run")
        elif args.cmd == "verify":
            status = verify_all(args.data_dir)
            bad = problems(status)
            if bad:
                for rel, s in status.items():
                    print(f"{rel}: {s}")
                print(f"qkov data verify: {len(bad)} problem(s) in {resolve_data_dir(args.data_dir)}:\n"
                      + "\n".join(f"  - {b}" for b in bad)
                      + f"\nWhat to do: delete each file that failed, then run `{FETCH_HINT}` (or `make data`) to "
                        f"download and build what is missing; or set {DATA_ENV} to a folder with good copies.",
                      file=sys.stderr)
                return 1
        else:
            status = {rel: f"{e.get('license')} | {e.get('source')}" for rel, e in manifest().items()}
            status.update({f"download {d}": f"{e['url']} | sha256 {e.get('sha256') or 'none published'}"
                           for d, e in downloads().items()})
    except DataUnavailable as err:
        print(err, file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout went away: the caller ends quietly
        raise
    except (ValueError, OSError) as err:  # ChecksumError, FileNotFoundError, DownloadError, a bad --only
        print(f"qkov data {args.cmd}: {err}", file=sys.stderr)
        return 1
    for rel, s in status.items():
        print(f"{rel}: {s}")
    return 0


if __name__ == "__main__":
    # Also a plain script (`make data-check`, before .venv exists): only the standard library is imported
    # here, and none of this folder's modules (sys.path[0]) shadows one.
    sys.exit(main())
