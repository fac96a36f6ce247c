"""Where the real-data files come from: the data folder, the manifest, checksums, the preflight.

* **Data folder.** :func:`resolve_data_dir` takes a ``data_dir`` argument, else the
  environment variable ``QKOV_DATA_DIR``, else ``<repo>/../shared/data`` beside the checkout.
  A relative path is tried against the working directory first, then against the repository
  root (chapters run from ``book/``).
* **Manifest.** ``manifest.json`` next to this file (or the file named by
  ``QKOV_DATA_MANIFEST``, e.g. a mirror) lists the official ``downloads`` (address, sha256 of the
  bytes as served, where that checksum comes from) and the ``files`` the loaders read (sha256 of
  the stored file and of its gunzipped content, and how :mod:`qkov_lib.data.fetch` builds it
  from the downloads).
* **Checksums.** :func:`verify_file` accepts a file whose sha256 or gunzipped content matches
  the manifest; anything else raises :class:`ChecksumError`. :func:`used_files` is the sha256 of
  every data file the loaders opened in this process (for the results files).
* **Preflight.** :func:`preflight` lists the files the chapters need that are missing, and either
  fetches them or stops with one message naming them and the two ways out. ``make book`` runs it
  before anything else; it needs only the standard library, so it also runs as
  ``python3 qkov_lib/data/sources.py check --probe`` before the virtual environment exists.
* **Reading.** :func:`load_files` reads local files through the ``datasets`` library with a
  cache outside the repository (``QKOV_CACHE_DIR``, else ``~/.cache/qkov/datasets``); it works
  with ``HF_DATASETS_OFFLINE=1``. A corrupt JSON line becomes a ValueError naming file and line.

Command line (also ``qkov data ...``): ``python -m qkov_lib.data.sources
{check [--fetch|--probe] | fetch [--dest DIR] | verify | list}``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_ENV = "QKOV_DATA_DIR"
CACHE_ENV = "QKOV_CACHE_DIR"
SOURCE_ENV = "QKOV_DATA_SOURCE"
MANIFEST_ENV = "QKOV_DATA_MANIFEST"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
MANIFEST_PATH = Path(__file__).with_name("manifest.json")
FETCH_HINT = "qkov data fetch"  # the same as `python -m qkov_lib.data.sources fetch`
# Public Hugging Face hub names, for users with internet (source="hub"); SVA has none.
HUB_NAMES = {"squad": "rajpurkar/squad", "hatexplain": "Hate-speech-CNERG/hatexplain"}


class ChecksumError(ValueError):
    """A data file's or a download's sha256 does not match the manifest."""


class DataUnavailable(RuntimeError):
    """Data files the chapters need are missing and cannot be fetched here; the message says
    which and what to do."""


# --- manifest ---------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _read_manifest(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the data manifest {path} (from ${MANIFEST_ENV} or the package): {err}") from err
    if not isinstance(doc.get("files"), dict) or not isinstance(doc.get("downloads", {}), dict):
        raise ValueError(f"data manifest {path} has no 'files' object")
    return doc


def manifest_doc() -> dict[str, Any]:
    """The whole manifest: ``$QKOV_DATA_MANIFEST`` if set, else the packaged ``manifest.json``."""
    return _read_manifest(os.environ.get(MANIFEST_ENV) or str(MANIFEST_PATH))


def manifest() -> dict[str, dict[str, Any]]:
    """The manifest's file entries (what the loaders read), keyed by path relative to the data folder."""
    return manifest_doc()["files"]


def downloads() -> dict[str, dict[str, Any]]:
    """The manifest's official downloads, keyed by download id."""
    return manifest_doc().get("downloads", {})


# --- the data folder --------------------------------------------------------------------------
def data_dir_location(data_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """(path, where it came from) of the data folder, whether or not it exists yet: ``data_dir``,
    else ``$QKOV_DATA_DIR``, else ``<repo>/../shared/data``. A relative path is taken against
    the working directory, or against the repository root if only that one exists."""
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


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data folder (see :func:`data_dir_location`). Raises FileNotFoundError naming
    ``QKOV_DATA_DIR`` and the fetch command if it does not exist."""
    path, origin = data_dir_location(data_dir)
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"data directory {str(path)!r} (from {origin}) does not exist; set {DATA_ENV} to the folder that holds "
        f"squad/, hatexplain/ and sva/ (for example ../shared/data), or build it with `{FETCH_HINT}`"
    )


def find_data_dir() -> tuple[Path | None, str]:
    """The data folder the library would use and a sentence saying where it came from, or
    (None, why not) -- for tests that need the real files and say why they skip."""
    path, origin = data_dir_location()
    if path.is_dir():
        return path, f"real data in {path} (from {origin})"
    return None, (f"real data folder not found: {path} (from {origin}) does not exist; set {DATA_ENV} "
                  f"to the data folder, or build one with `{FETCH_HINT}`")


# --- checksums ----------------------------------------------------------------------------------
_SHA: dict[tuple[str, int, int, bool], str] = {}


def sha256_file(path: str | os.PathLike, gunzip: bool = False) -> str:
    """Hex sha256 of a file's bytes, or of its gunzipped bytes with ``gunzip=True``; cached per
    (path, size, mtime) since the loaders ask for the same file more than once."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, gunzip)
    if key not in _SHA:
        h = hashlib.sha256()
        opener = gzip.open if gunzip else open
        with opener(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _SHA[key] = h.hexdigest()
    return _SHA[key]


def check_sha256(path: str | os.PathLike, what: str, sha256: str | None, content_sha256: str | None) -> str:
    """Check ``path`` against a file checksum ``sha256`` or a gunzipped-content checksum
    ``content_sha256``. Returns ``"sha256"``, ``"content_sha256"`` or ``"no checksum"`` (both
    None); raises :class:`ChecksumError` naming ``what`` on a mismatch."""
    if sha256 is None and content_sha256 is None:
        return "no checksum"
    got = sha256_file(path)
    if sha256 and got == sha256:
        return "sha256"
    content = got
    if str(path).endswith(".gz"):
        try:
            content = sha256_file(path, gunzip=True)
        except (OSError, EOFError) as err:
            raise ChecksumError(f"{path}: not a readable gzip file ({err}); expected the file of {what}") from err
    if content_sha256 and content == content_sha256:
        return "content_sha256"
    raise ChecksumError(
        f"checksum mismatch for {path}: sha256 {got} does not match {what} (expected {sha256} for the file or "
        f"{content_sha256} for its content); the file is corrupt or a different version -- delete it and "
        f"build it again with `{FETCH_HINT}`"
    )


def verify_file(path: str | os.PathLike, rel: str) -> str:
    """Check ``path`` against the manifest file entry ``rel`` (see :func:`check_sha256`);
    KeyError if ``rel`` is not in the manifest."""
    e = manifest()[rel]
    return check_sha256(path, f"the manifest entry {rel!r}", e.get("sha256"), e.get("content_sha256"))


_USED: dict[str, str] = {}


def used_files() -> dict[str, str]:
    """``{path relative to the data folder: sha256 of the file}`` of every data file opened
    through :func:`data_file` (and ``hub:NAME`` fingerprints) in this process, for the results files."""
    return dict(sorted(_USED.items()))


def clear_used() -> None:
    """Forget the files recorded for :func:`used_files` (e.g. between two runs in one process)."""
    _USED.clear()


def data_file(rel: str, data_dir: str | os.PathLike | None = None, verify: bool = True) -> Path:
    """The path of data file ``rel`` (e.g. ``"sva/linzen2016_numpred.val.tsv.gz"``) in the data
    folder, checked against the manifest when ``verify``, and recorded for :func:`used_files`.
    Raises FileNotFoundError naming the file and ``QKOV_DATA_DIR`` if it is missing."""
    root = resolve_data_dir(data_dir)
    path = root / rel
    if not path.is_file():
        raise FileNotFoundError(
            f"data file {rel!r} not found in {root} (the data directory comes from data_dir or ${DATA_ENV}); "
            f"build it with `{FETCH_HINT}` or point {DATA_ENV} at the folder that holds it"
        )
    if verify and rel in manifest():
        verify_file(path, rel)
    _USED[rel] = sha256_file(path)
    return path


def first_present(rels: Iterable[str], data_dir: str | os.PathLike | None = None) -> str | None:
    """The first of ``rels`` that exists in the data folder, or None."""
    root = resolve_data_dir(data_dir)
    return next((r for r in rels if (root / r).is_file()), None)


def verify_all(data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Verify every manifest file and every kept download present in the data folder:
    ``{path: "sha256" | "content_sha256" | "no checksum" | "missing" | "missing (optional)" |
    "missing (alternative present)"}``; raises :class:`ChecksumError` on the first mismatch."""
    root = resolve_data_dir(data_dir)
    present = {rel for rel in manifest() if (root / rel).is_file()}
    out = {}
    for rel, e in manifest().items():
        if rel in present:
            out[rel] = verify_file(root / rel, rel)
        elif e.get("optional"):
            out[rel] = "missing (optional)"
        elif any(m in present for m in group_members(rel)):
            out[rel] = "missing (alternative present)"
        else:
            out[rel] = "missing"
    for did, d in downloads().items():
        path = root / d["path"]
        if d["path"] not in out and path.is_file():
            out[d["path"]] = check_sha256(path, f"the download {did!r}", None, d.get("sha256"))
    return out


# --- what the chapters need -------------------------------------------------------------------
def group_members(rel: str) -> list[str]:
    """The files that can stand in for ``rel`` (same ``group`` in the manifest), ``rel`` included,
    in manifest order (the official, fetchable one first)."""
    g = manifest()[rel].get("group")
    return [r for r, e in manifest().items() if g and e.get("group") == g] or [rel]


def required_files() -> list[list[str]]:
    """The files the chapters need, as groups of alternatives (any one member will do)."""
    seen, out = set(), []
    for rel, e in manifest().items():
        if e.get("optional") or rel in seen:
            continue
        members = group_members(rel)
        seen.update(members)
        out.append(members)
    return out


def missing_files(data_dir: str | os.PathLike | None = None) -> list[list[str]]:
    """The groups of :func:`required_files` with no member in the data folder (all of them if
    the folder does not exist)."""
    root, _ = data_dir_location(data_dir)
    return [g for g in required_files() if not any((root / r).is_file() for r in g)]


def build_target(group: list[str]) -> str | None:
    """The member of a group of alternatives that ``fetch`` can build, or None."""
    return next((r for r in group if manifest()[r].get("build")), None)


def downloads_for(rels: Iterable[str]) -> list[str]:
    """The download ids needed to build the files ``rels``, in manifest order."""
    need = set()
    for rel in rels:
        b = manifest()[rel].get("build") or {}
        need.update([b["download"]] if "download" in b else b.get("inputs", []))
    return [d for d in downloads() if d in need]


def probe(urls: Iterable[str], timeout: float = 5.0) -> dict[str, str]:
    """``{host: why}`` for each host of ``urls`` that cannot be reached (a HEAD request through
    the system's proxy settings, ``timeout`` seconds). Any HTTP answer counts as reachable."""
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
    """The one message of a stopped preflight: the missing files, why they cannot be fetched
    here, and the two ways out."""
    lines = [f"qkov: {len(missing)} data file(s) needed by the real-data chapters are missing from {root} "
             f"(data folder from {origin}):"]
    for g in missing:
        lines.append("  - " + g[0] + (f"  (or {', '.join(g[1:])})" if len(g) > 1 else ""))
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


def preflight(data_dir: str | os.PathLike | None = None, fetch: bool = False, probe_network: bool = True,
              timeout: float = 5.0, **fetch_kw: Any) -> dict[str, str]:
    """Make sure the files the chapters need are in the data folder before any chapter runs.

    Returns ``{path: status}`` of the files it fetched (empty when nothing was missing). With
    files missing: ``fetch=True`` downloads and builds them (if every host needed answers
    :func:`probe`); ``fetch=False, probe_network=True`` only checks that they could be fetched;
    otherwise, or when a host is unreachable, raises :class:`DataUnavailable` with one message
    listing the missing files and the two ways out (``QKOV_DATA_DIR``, ``qkov data fetch``)."""
    root, origin = data_dir_location(data_dir)
    missing = missing_files(root)
    if not missing:
        return {}
    targets = [build_target(g) for g in missing]
    if not (fetch or probe_network) or None in targets:
        raise DataUnavailable(unavailable_message(missing, root, origin, None))
    urls = [downloads()[d]["url"] for d in downloads_for(targets)]
    down = probe(urls, timeout)
    if down:
        raise DataUnavailable(unavailable_message(missing, root, origin, down))
    if not fetch:
        return {t: "missing (reachable: will be fetched)" for t in targets}
    return _fetch_module().fetch(root, only=targets, **fetch_kw)


def _fetch_module():
    """:mod:`qkov_lib.data.fetch`, also when this file runs as a script (before the package is importable by name)."""
    if __package__:
        from . import fetch
        return fetch
    sys.path.insert(0, str(REPO_ROOT))
    from qkov_lib.data import fetch  # noqa: E402 - script mode only
    return fetch


def fetch(dest: str | os.PathLike | None = None, only: Iterable[str] | None = None, overwrite: bool = False,
          **kw: Any) -> dict[str, str]:
    """Build the data folder ``dest`` (default: the data folder) from the official downloads;
    see :func:`qkov_lib.data.fetch.fetch`."""
    return _fetch_module().fetch(data_dir_location(dest)[0], only=only, overwrite=overwrite, **kw)


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
    """The public Hugging Face copy of dataset ``name`` (``QKOV_DATA_SOURCE=hub``; needs
    internet, not used by CI). Records ``hub:<hub name>`` with the splits' fingerprints for
    :func:`used_files`."""
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
    """Whether a loader should read the hub copy: ``source`` ("local" | "hub"), else
    ``$QKOV_DATA_SOURCE``, else local."""
    s = source or os.environ.get(SOURCE_ENV) or "local"
    if s not in ("local", "hub"):
        raise ValueError(f"source must be 'local' or 'hub', got {s!r}")
    return s == "hub"


# --- command line ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m qkov_lib.data.sources`` / ``qkov data``: check, fetch, verify, list. Returns
    the exit status (1 with one message on stderr when data is missing and cannot be fetched)."""
    ap = argparse.ArgumentParser(prog="qkov data", description="The real-data files: check, fetch, verify, list.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="are the files the chapters need there? (make book runs this first)")
    c.add_argument("--data-dir", default=None, help=f"data folder (default: ${DATA_ENV}, else ../shared/data)")
    how = c.add_mutually_exclusive_group()
    how.add_argument("--fetch", action="store_true", help="download and build what is missing")
    how.add_argument("--probe", action="store_true", help="only check that what is missing could be downloaded")
    f = sub.add_parser("fetch", help="download the official releases, verify their sha256 and build the data folder")
    f.add_argument("--dest", default=None, help=f"data folder to fill (default: ${DATA_ENV}, else ../shared/data)")
    f.add_argument("--only", nargs="*", default=None, help="file paths or dataset names (squad, hatexplain, sva, sva_linzen)")
    f.add_argument("--overwrite", action="store_true", help="rebuild files that are already there")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")
    v = sub.add_parser("verify", help="check the files of a data folder against the manifest")
    v.add_argument("--data-dir", default=None)
    sub.add_parser("list", help="print the manifest: files, sources, licences")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            status = preflight(args.data_dir, fetch=args.fetch, probe_network=args.probe or args.fetch)
            root = data_dir_location(args.data_dir)[0]
            if not status:
                print(f"data: every file the chapters need is in {root}")
            elif args.fetch:
                print(f"data: the missing files were fetched and built in {root}")
            else:
                print(f"data: {len(status)} file(s) missing from {root}; the download servers answer, "
                      "so they are fetched before the chapters run")
        elif args.cmd == "fetch":
            status = fetch(args.dest, args.only, args.overwrite, progress=not args.no_progress)
            print(f"data folder: {data_dir_location(args.dest)[0]}")
        elif args.cmd == "verify":
            status = verify_all(args.data_dir)
        else:
            status = {rel: f"{e.get('license')} | {e.get('source')}" for rel, e in manifest().items()}
            status.update({f"download {d}": f"{e['url']} | sha256 {e.get('sha256') or 'none published'}"
                           for d, e in downloads().items()})
    except DataUnavailable as err:
        print(err, file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:  # ChecksumError, FileNotFoundError, DownloadError, a bad --only
        print(f"qkov data {args.cmd}: {err}", file=sys.stderr)
        return 1
    for rel, s in status.items():
        print(f"{rel}: {s}")
    return 0


if __name__ == "__main__":
    # Also run as a plain script (`make data-check`, before .venv exists): then only the standard
    # library is imported here, and sys.path[0] is this folder, none of whose modules shadows one.
    sys.exit(main())
