"""Where the real-data files come from: the data directory, the manifest, checksums, fetching.

* **Data directory.** :func:`resolve_data_dir` takes a ``data_dir`` argument, else the
  environment variable ``QKOV_DATA_DIR`` (CI points it at ``../shared/data``), else the
  companion checkout ``<repo>/../shared/data`` when it exists. A relative path is tried against
  the working directory first, then against the repository root (chapters run from ``book/``).
* **Manifest.** ``manifest.json`` next to this file lists every file with its public address,
  licence, the sha256 of the stored file and of its gunzipped content.
* **Checksums.** :func:`verify_file` accepts a file whose sha256 matches, or whose gunzipped
  content matches (a fetched, re-compressed copy); anything else raises :class:`ChecksumError`.
* **Fetch.** ``python -m qkov_lib.data.sources fetch --dest DIR`` downloads the fetchable files,
  checks each download's sha256 *before* it is written, gzips where the manifest says so and
  verifies the result. Files that were rebuilt or assembled from several sources are listed as
  not fetchable, with the reason.
* **Reading.** :func:`load_files` reads local files through the ``datasets`` library with a
  cache outside the repository (``QKOV_CACHE_DIR``, else ``~/.cache/qkov/datasets``); it works
  with ``HF_DATASETS_OFFLINE=1``. A corrupt JSON line becomes a ValueError naming file and line.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_ENV = "QKOV_DATA_DIR"
CACHE_ENV = "QKOV_CACHE_DIR"
SOURCE_ENV = "QKOV_DATA_SOURCE"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
MANIFEST_PATH = Path(__file__).with_name("manifest.json")
FETCH_HINT = "python -m qkov_lib.data.sources fetch --dest DIR"
# Public Hugging Face hub names, for users with internet (source="hub"); SVA has none.
HUB_NAMES = {"squad": "rajpurkar/squad", "hatexplain": "Hate-speech-CNERG/hatexplain"}


class ChecksumError(ValueError):
    """A data file's sha256 does not match the manifest."""


@lru_cache(maxsize=1)
def _manifest_doc() -> dict[str, Any]:
    return json.loads(MANIFEST_PATH.read_text())


def manifest() -> dict[str, dict[str, Any]]:
    """The manifest's file entries, keyed by path relative to the data directory."""
    return _manifest_doc()["files"]


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory: ``data_dir``, else ``$QKOV_DATA_DIR``, else ``<repo>/../shared/data``.

    Raises FileNotFoundError (naming ``QKOV_DATA_DIR`` and the fetch command) if it does not exist.
    """
    if data_dir is not None:
        given, origin = str(data_dir), "the data_dir argument"
    elif os.environ.get(DATA_ENV):
        given, origin = os.environ[DATA_ENV], f"${DATA_ENV}"
    else:
        if DEFAULT_DATA_DIR.is_dir():
            return DEFAULT_DATA_DIR
        raise FileNotFoundError(
            f"no data directory: set {DATA_ENV} to the folder that holds squad/, hatexplain/ and sva/ "
            f"(for example ../shared/data), pass data_dir=..., or download the files with `{FETCH_HINT}`"
        )
    p = Path(given).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    raise FileNotFoundError(
        f"data directory {given!r} (from {origin}) does not exist"
        + ("" if p.is_absolute() else f" (tried {', '.join(str(c) for c in candidates)})")
        + f"; set {DATA_ENV} to the folder that holds squad/, hatexplain/ and sva/, "
        f"or download the files with `{FETCH_HINT}`"
    )


def sha256_file(path: str | os.PathLike, gunzip: bool = False) -> str:
    """Hex sha256 of a file's bytes, or of its gunzipped bytes with ``gunzip=True``."""
    h = hashlib.sha256()
    opener = gzip.open if gunzip else open
    with opener(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_VERIFIED: dict[tuple[str, int, int], str] = {}


def verify_file(path: str | os.PathLike, rel: str) -> str:
    """Check ``path`` against the manifest entry ``rel``. Returns ``"sha256"`` (the stored file)
    or ``"content_sha256"`` (same content, other compression); raises :class:`ChecksumError`
    on a mismatch and KeyError if ``rel`` is not in the manifest. Results are cached per
    (path, size, mtime)."""
    entry = manifest()[rel]
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _VERIFIED:
        return _VERIFIED[key]
    got = sha256_file(path)
    if entry.get("sha256") and got == entry["sha256"]:
        how = "sha256"
    else:
        content = got
        if path.suffix == ".gz":
            try:
                content = sha256_file(path, gunzip=True)
            except (OSError, EOFError) as err:
                raise ChecksumError(f"{path}: not a readable gzip file ({err}); expected the file of the manifest entry {rel!r}") from err
        if content != entry.get("content_sha256"):
            raise ChecksumError(
                f"checksum mismatch for {path}: sha256 {got} does not match the manifest entry {rel!r} "
                f"(expected {entry.get('sha256')} for the file or {entry.get('content_sha256')} for its content); "
                f"the file is corrupt or a different version -- download it again with `{FETCH_HINT}`"
            )
        how = "content_sha256"
    _VERIFIED[key] = how
    return how


def data_file(rel: str, data_dir: str | os.PathLike | None = None, verify: bool = True) -> Path:
    """The path of data file ``rel`` (e.g. ``"sva/linzen2016_numpred.val.tsv.gz"``) in the data
    directory, checked against the manifest when ``verify``. Raises FileNotFoundError naming the
    file and ``QKOV_DATA_DIR`` if it is missing."""
    root = resolve_data_dir(data_dir)
    path = root / rel
    if not path.is_file():
        raise FileNotFoundError(
            f"data file {rel!r} not found in {root} (the data directory comes from data_dir or ${DATA_ENV}); "
            f"download it with `{FETCH_HINT}` or point {DATA_ENV} at the folder that holds it"
        )
    if verify and rel in manifest():
        verify_file(path, rel)
    return path


def verify_all(data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Verify every manifest file present in the data directory: ``{path: "sha256" |
    "content_sha256" | "missing" | "missing (optional)"}``; raises :class:`ChecksumError` on
    the first mismatch."""
    root = resolve_data_dir(data_dir)
    out = {}
    for rel, entry in manifest().items():
        path = root / rel
        if not path.is_file():
            out[rel] = "missing (optional)" if entry.get("optional") else "missing"
            continue
        out[rel] = verify_file(path, rel)
    return out


# --- fetching -------------------------------------------------------------------------------
def _download(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as r:  # noqa: S310 (public https/file URLs of the manifest)
        return r.read()


def fetch(dest: str | os.PathLike, only: Iterable[str] | None = None, overwrite: bool = False,
          downloader: Callable[[str], bytes] = _download,
          entries: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """Download the fetchable manifest files into ``dest``. Each download's sha256 is checked
    against ``url_sha256`` before anything is written (a mismatch raises :class:`ChecksumError`
    and writes nothing); ``gzip`` entries are then compressed deterministically and the written
    file is verified. Returns ``{path: "fetched" | "present" | "not fetchable: <why>"}``.
    ``only`` restricts to paths or dataset names; ``downloader`` and ``entries`` are for tests."""
    dest = Path(dest)
    entries = manifest() if entries is None else entries
    wanted = set(only) if only else None
    out: dict[str, str] = {}
    for rel, e in entries.items():
        if wanted is not None and rel not in wanted and e.get("dataset") not in wanted:
            continue
        target = dest / rel
        if e.get("fetch") is None:
            out[rel] = f"not fetchable: {e.get('note', 'rebuilt from several sources')} (source: {e.get('url')})"
            continue
        if target.is_file() and not overwrite:
            _verify_entry(target, rel, e)
            out[rel] = "present"
            continue
        try:
            data = downloader(e["url"])
        except OSError as err:  # URLError is an OSError
            raise OSError(f"could not download {e['url']} for {rel!r}: {err}; without internet, copy the data "
                          f"folder by hand and set {DATA_ENV}") from err
        got = hashlib.sha256(data).hexdigest()
        if got != e["url_sha256"]:
            raise ChecksumError(f"download of {e['url']} has sha256 {got}, expected {e['url_sha256']} "
                                f"(manifest entry {rel!r}); nothing was written")
        if e["fetch"] == "gzip":
            data = gzip.compress(data, compresslevel=9, mtime=0)
        elif e["fetch"] != "copy":
            raise ValueError(f"manifest entry {rel!r}: unknown fetch method {e['fetch']!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
            tmp.write(data)
        Path(tmp.name).replace(target)
        _verify_entry(target, rel, e)
        out[rel] = "fetched"
    return out


def _verify_entry(path: Path, rel: str, e: Mapping[str, Any]) -> None:
    got = sha256_file(path)
    content = sha256_file(path, gunzip=True) if path.suffix == ".gz" else got
    if got != e.get("sha256") and content != e.get("content_sha256"):
        raise ChecksumError(f"{path}: content sha256 {content} does not match the manifest entry {rel!r} "
                            f"({e.get('content_sha256')}); delete it and fetch again")


# --- reading through the datasets library --------------------------------------------------
def cache_dir() -> Path:
    """Cache folder of the ``datasets`` library for our files: ``$QKOV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/qkov/datasets``, else ``~/.cache/qkov/datasets`` (never the repository)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "qkov" / "datasets"


def check_json_file(path: str | os.PathLike) -> str:
    """Parse ``path`` (optionally gzipped) as one JSON document or as JSON lines. Returns
    ``"json"`` or ``"jsonl"``; raises ValueError naming the file and the first corrupt line."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
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
    """``datasets.load_dataset(builder, data_files=...)`` on local files with our cache folder,
    no progress bars, offline-safe. JSON problems become a ValueError naming the file and line."""
    import datasets

    datasets.disable_progress_bars()
    files = {k: str(v) for k, v in data_files.items()}
    try:
        return datasets.load_dataset(builder, data_files=files, cache_dir=str(cache_dir()), **kwargs)
    except Exception as err:  # noqa: BLE001 - re-raised with the file names
        if builder == "json":
            for f in files.values():
                check_json_file(f)  # raises a ValueError naming the file and the corrupt line
        raise ValueError(f"the datasets library could not read {', '.join(files.values())} "
                         f"with the {builder!r} builder: {type(err).__name__}: {err}") from err


def load_rows(builder: str, path: str | os.PathLike, **kwargs: Any) -> list[dict[str, Any]]:
    """All records of one local file as plain dicts, read by :func:`load_files`."""
    return load_files(builder, {"rows": path}, **kwargs)["rows"].to_list()


def load_hub(name: str, **kwargs: Any):
    """The public Hugging Face copy of dataset ``name`` (needs internet; not used by CI)."""
    import datasets

    if name not in HUB_NAMES:
        raise FileNotFoundError(f"dataset {name!r} has no public hub copy; it needs the local files "
                                f"(set {DATA_ENV}, or `{FETCH_HINT}`)")
    return datasets.load_dataset(HUB_NAMES[name], cache_dir=str(cache_dir()), **kwargs)


def use_hub(source: str | None) -> bool:
    """Whether a loader should read the hub copy: ``source`` ("local" | "hub"), else
    ``$QKOV_DATA_SOURCE``, else local."""
    s = source or os.environ.get(SOURCE_ENV) or "local"
    if s not in ("local", "hub"):
        raise ValueError(f"source must be 'local' or 'hub', got {s!r}")
    return s == "hub"


# --- command line ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m qkov_lib.data.sources {fetch --dest DIR | verify [--data-dir DIR] | list}``."""
    ap = argparse.ArgumentParser(prog="python -m qkov_lib.data.sources", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the fetchable files, verifying checksums before use")
    f.add_argument("--dest", required=True, help="data directory to fill (then set QKOV_DATA_DIR to it)")
    f.add_argument("--only", nargs="*", default=None, help="paths or dataset names (squad, hatexplain, sva, sva_linzen)")
    f.add_argument("--overwrite", action="store_true")
    v = sub.add_parser("verify", help="check the files of a data directory against the manifest")
    v.add_argument("--data-dir", default=None)
    sub.add_parser("list", help="print the manifest")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        status = fetch(args.dest, args.only, args.overwrite)
    elif args.cmd == "verify":
        status = verify_all(args.data_dir)
    else:
        status = {rel: f"{e['license']} | {e['url']}" for rel, e in manifest().items()}
    for rel, s in status.items():
        print(f"{rel}: {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
