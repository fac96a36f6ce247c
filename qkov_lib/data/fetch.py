"""Build the data folder from the datasets' official releases (``qkov data fetch``, ``make data``),
and the data command line (:func:`main`: :mod:`qkov_lib.data.sources`'s check, verify and list,
plus ``fetch`` and ``check --fetch``).

A download collects in ``<final>.part`` (retried and resumed, :func:`download`) and is moved to its
final path only with the manifest's sha256; the loaders never read ``*.part`` files, so an interrupted
download is never data. A download without a published checksum (Linzen's ``rnn_agr_simple.tar.gz``)
is kept only once the files converted from it match their manifest checksums. Converted files
(:data:`qkov_lib.data.registry.CONVERTERS`) are checked before they are written (:func:`check_output`);
one without a published checksum (the HateXplain train split, built from a checksummed download) gets
a provenance record ``<file>.provenance.json`` (:func:`~qkov_lib.data.sources.provenance_record`),
which lets :func:`~qkov_lib.data.sources.verify_file` accept it later.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from qkov_lib.data import sources
from qkov_lib.data.sources import ChecksumError

CHUNK = 1 << 16
RETRY_HTTP = {408, 425, 429, 500, 502, 503, 504}


class DownloadError(OSError):
    """A download failed after its retries (the message names the address and the part file)."""


class OfflineError(DownloadError):
    """The host of a download cannot be resolved: there is no network here."""


class _Retry(Exception):
    """A transient failure: the connection broke, timed out or the server was busy."""


# --- one download -----------------------------------------------------------------------------
def part_path(final: Path) -> Path:
    """Where a download collects until it is verified: ``<final>.part``."""
    return final.with_name(final.name + ".part")


def _get(url: str, part: Path, timeout: float, progress: bool, desc: str) -> bool:
    """One HTTP GET of ``url`` into ``part``, resuming from its size with a Range request; returns
    whether it resumed. Raises :class:`_Retry` on transient failures, :class:`OfflineError` when the
    host does not resolve and :class:`DownloadError` on a permanent HTTP error."""
    from tqdm.auto import tqdm

    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "qkov-data-fetch"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        r = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)  # noqa: S310
    except urllib.error.HTTPError as err:
        if err.code == 416 and have:  # the part file is not a prefix the server knows: start over
            part.unlink()
            raise _Retry(f"HTTP 416 for the range {have}-; restarting") from err
        if err.code in RETRY_HTTP:
            raise _Retry(f"HTTP {err.code} {err.reason}") from err
        raise DownloadError(f"could not download {url}: HTTP {err.code} {err.reason}") from err
    except urllib.error.URLError as err:
        if isinstance(err.reason, socket.gaierror):
            raise OfflineError(f"could not download {url}: the host does not resolve ({err.reason}); without network, "
                               f"set {sources.DATA_ENV} to a folder that has the files, or fetch them where there is "
                               "internet and copy the folder here") from err
        raise _Retry(str(err.reason)) from err
    except (OSError, http.client.HTTPException) as err:
        raise _Retry(f"{type(err).__name__}: {err}") from err
    with r:
        start = have if have and r.status == 206 else 0
        if start and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
            part.unlink()  # an answer for another range: the bytes would not line up
            raise _Retry(f"unexpected Content-Range {r.headers.get('Content-Range')!r}; restarting")
        length = r.headers.get("Content-Length")
        total = start + int(length) if length and length.isdigit() else None
        got = start
        with open(part, "ab" if start else "wb") as f, \
                tqdm(total=total, initial=start, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                     disable=not progress, leave=False) as bar:
            while True:
                try:
                    chunk = r.read(CHUNK)
                except (OSError, http.client.HTTPException) as err:
                    raise _Retry(f"connection lost after {got} bytes: {err}") from err
                if not chunk:
                    break
                f.write(chunk)
                got += len(chunk)
                bar.update(len(chunk))
        if total is not None and got < total:
            raise _Retry(f"connection closed after {got} of {total} bytes")
    return start > 0


def download(url: str, part: Path, sha256: str | None, retries: int = 4, backoff: float = 2.0,
             timeout: float = 60.0, progress: bool = True, desc: str | None = None) -> Path:
    """Download ``url`` into the part file ``part`` (resuming what is there; progress bar ``desc``) and
    check its sha256. Transient failures are retried ``retries`` times, waiting ``backoff * 2**k`` s, and
    the part file is kept for the next call to resume. A complete file with the wrong sha256 is deleted,
    and downloaded once more from the start if it had been resumed, else :class:`ChecksumError`.
    ``sha256=None`` skips the check (the caller must verify)."""
    part.parent.mkdir(parents=True, exist_ok=True)
    failures, restarted, name = 0, False, part.name[:-len(".part")]
    while True:
        try:
            resumed = _get(url, part, timeout, progress, desc or name)
        except _Retry as err:
            failures += 1
            if failures > retries:
                raise DownloadError(f"could not download {url} after {failures} attempts ({err}); the partial file "
                                    f"{part} is kept and the next fetch resumes it") from err
            print(f"qkov data: {url}: {err}; retrying in {backoff * 2 ** (failures - 1):g} s", file=sys.stderr)
            time.sleep(backoff * 2 ** (failures - 1))
            continue
        if sha256 is None:
            return part
        got = sha256_bytes_of(part)
        if got == sha256:
            return part
        part.unlink()
        if resumed and not restarted:
            restarted = True
            print(f"qkov data: {url}: the resumed file has the wrong sha256; downloading it again from the start",
                  file=sys.stderr)
            continue
        raise ChecksumError(f"download of {url} has sha256 {got}, expected {sha256} (manifest); it was deleted "
                            f"and nothing was written at {name}")


def sha256_bytes_of(path: Path) -> str:
    """Hex sha256 of a file's bytes (uncached: part files change)."""
    return sources._sha256_uncached(path)


def write_atomic(final: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``final`` and rename it, so ``final`` is absent or complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stored_bytes(content: bytes, rel: str) -> bytes:
    """The bytes stored for ``content`` at ``rel``: for ``*.gz`` gzip (level 9, no time stamp, so the same
    content always gives the same file), else the content itself."""
    return gzip.compress(content, compresslevel=9, mtime=0) if rel.endswith(".gz") else content


def place(part: Path, final: Path, store: str) -> None:
    """Move a verified part file to ``final``: renamed (``store="copy"``) or gzipped (``store="gzip"``)."""
    if store == "copy":
        os.replace(part, final)
    elif store == "gzip":
        write_atomic(final, stored_bytes(part.read_bytes(), ".gz"))
        part.unlink()
    else:
        raise ValueError(f"unknown store method {store!r} (expected 'copy' or 'gzip')")


# --- building the folder ----------------------------------------------------------------------
def check_output(rel: str, content: bytes, entry: Mapping[str, Any]) -> str:
    """Check converted ``content`` for manifest file ``rel`` before it is written: its sha256 against
    ``content_sha256``, else its line count against ``lines``. Returns how; ChecksumError on a mismatch."""
    want = entry.get("content_sha256")
    if want:
        got = hashlib.sha256(content).hexdigest()
        if got != want:
            raise ChecksumError(f"the converted {rel} has content sha256 {got}, expected {want} (manifest); "
                                "nothing was written")
        return "content sha256 verified"
    if entry.get("lines") is not None:
        n = content.count(b"\n")
        if n != entry["lines"]:
            raise ChecksumError(f"the converted {rel} has {n} lines, expected {entry['lines']} (manifest); nothing was written")
        return f"no published checksum; {n} lines as expected; sha256 {hashlib.sha256(content).hexdigest()}"
    return f"no published checksum; sha256 {hashlib.sha256(content).hexdigest()}"


def select(only: Iterable[str] | None) -> list[str]:
    """The manifest files to build: those named in ``only`` (paths or dataset names), else the buildable
    member of every needed group of alternatives and the buildable optional files. ValueError for an
    unknown name or a file that cannot be built."""
    files = sources.manifest()
    if only:
        picked = []
        for name in only:
            hits = [name] if name in files else [r for r, e in files.items() if e.get("dataset") == name and e.get("build")]
            if not hits:
                raise ValueError(f"{name!r} is neither a file of the manifest nor a dataset with fetchable files "
                                 f"({', '.join(sorted({e.get('dataset') for e in files.values()}))})")
            picked += hits
        for rel in picked:
            if not files[rel].get("build"):
                raise ValueError(f"{rel} cannot be fetched: {files[rel].get('note', 'no official download')}")
        return list(dict.fromkeys(picked))
    groups = sources.required_files() + [[r] for r, e in files.items() if e.get("optional") and e.get("build")]
    return [t for g in groups if (t := sources.build_target(g))]


def fetch(dest: str | os.PathLike | None, only: Iterable[str] | None = None, overwrite: bool = False,
          progress: bool = True, retries: int = 4, backoff: float = 2.0, timeout: float = 60.0,
          allow_unverified: bool = False) -> dict[str, str]:
    """Download the official releases and build the files of :func:`select` in ``dest`` (None: the
    data folder, :func:`qkov_lib.data.sources.data_dir_location`). Returns ``{path: status}`` of every
    file built, kept or downloaded. Raises :class:`ChecksumError` (nothing written at the final path),
    :class:`OfflineError` or :class:`DownloadError`. A download without a published checksum is kept
    only when a file converted from it matches a published checksum (or with ``allow_unverified``)."""
    from qkov_lib.data.registry import CONVERTERS

    dest = sources.data_dir_location(dest)[0] if dest is None else Path(dest)
    files, dls = sources.manifest(), sources.downloads()
    targets = select(only)
    status: dict[str, str] = {}
    todo = []
    for rel in targets:
        alt = next((r for r in sources.group_members(rel) if r != rel and (dest / r).is_file()), None)
        if (dest / rel).is_file() and not overwrite:
            status[rel] = f"present ({_verified(sources.verify_file(dest / rel, rel))})"
        elif alt and not only and not overwrite:
            status[rel] = f"not fetched: its alternative {alt} is there ({_verified(sources.verify_file(dest / alt, alt))})"
        else:
            todo.append(rel)
    have: dict[str, Path] = {}      # download id -> verified local copy (final path)
    pending: dict[str, Path] = {}   # download id -> part file without a published checksum
    for did in sources.downloads_for(todo):
        d = dls[did]
        final = dest / d["path"]
        if final.is_file() and not overwrite:
            sources.check_sha256(final, f"the download {did!r}", None, d.get("sha256"))
            have[did] = final
            continue
        part = download(d["url"], part_path(final), d.get("sha256"), retries, backoff, timeout, progress, Path(did).name)
        if d.get("sha256"):
            place(part, final, d["store"])
            have[did] = final
            status[d["path"]] = "downloaded (sha256 verified)"
        else:
            pending[did] = part
    for rel in todo:  # files that are a download as such
        b = files[rel]["build"]
        if "download" in b and dls[b["download"]]["path"] == rel:
            status[rel] = f"downloaded ({_verified(sources.verify_file(dest / rel, rel))})"
    for name in dict.fromkeys(files[r]["build"]["convert"] for r in todo if "convert" in files[r]["build"]):
        ids = [d for e in files.values() if (e.get("build") or {}).get("convert") == name for d in e["build"]["inputs"]]
        inputs = {did: _raw(did, have, pending) for did in dict.fromkeys(ids)}  # the downloads the converter reads
        unverified_inputs = [did for did in inputs if did in pending]
        try:
            built = CONVERTERS[name](inputs)
            checks = {}
            for rel, content in built.items():
                if rel not in files:
                    raise ValueError(f"converter {name!r} built {rel}, which is not in the manifest")
                checks[rel] = check_output(rel, content, files[rel])
            verified = any(c == "content sha256 verified" for c in checks.values())
            if unverified_inputs and not verified and not allow_unverified:
                raise ChecksumError(f"{', '.join(unverified_inputs)} has no published checksum and no file built "
                                    "from it has one either; refused (pass allow_unverified=True to accept it)")
        except Exception:
            for did in unverified_inputs:  # a complete download that gives wrong files is not kept
                pending.pop(did).unlink()
            raise
        for rel, content in built.items():
            if rel in todo or overwrite or not (dest / rel).is_file():
                stored = stored_bytes(content, rel)
                write_atomic(dest / rel, stored)
                status[rel] = f"built by {name} ({checks[rel]})"
                if checks[rel].startswith("no published checksum"):
                    record = sources.provenance_record(rel, stored, content, name, inputs)
                    write_atomic(sources.provenance_path(dest / rel), json.dumps(record, indent=1).encode() + b"\n")
                    print(f"qkov data: WARNING: {rel}: {checks[rel]}; built from {', '.join(inputs)}; provenance "
                          f"recorded in {sources.provenance_path(rel).name}", file=sys.stderr)
        for did in unverified_inputs:
            place(pending.pop(did), dest / dls[did]["path"], dls[did]["store"])
            status[dls[did]["path"]] = "downloaded (no published checksum; accepted: the files built from it match the manifest)"
    return status


def _verified(how: str) -> str:
    """Status words for a :func:`sources.verify_file` result."""
    return how if sources.is_unverified(how) else f"{how} verified"


def _raw(did: str, have: Mapping[str, Path], pending: Mapping[str, Path]) -> bytes:
    """The bytes of download ``did`` as served: its part file, or its stored copy (gunzipped if stored so)."""
    if did in pending:
        return pending[did].read_bytes()
    data = have[did].read_bytes()
    return gzip.decompress(data) if sources.downloads()[did]["store"] == "gzip" else data


def ensure(data_dir: str | os.PathLike | None = None, timeout: float = 5.0, **fetch_kw: Any) -> dict[str, str]:
    """:func:`qkov_lib.data.sources.preflight` (stops on a bad file, or a missing one that cannot be
    fetched), then :func:`fetch` (with ``fetch_kw``) what is missing: ``{path: status}``, empty if nothing."""
    missing = sources.preflight(data_dir, probe_network=True, timeout=timeout)
    if not missing:
        return {}
    return fetch(sources.data_dir_location(data_dir)[0], only=list(missing), **fetch_kw)


def main(argv: list[str] | None = None) -> int:
    """``qkov data`` / ``python -m qkov_lib.data.fetch``: ``fetch [--dest DIR] [--only ...] [--overwrite]
    [--no-progress]`` and ``check --fetch [--data-dir DIR]`` here; ``check [--probe]``, ``verify`` and
    ``list`` are :func:`qkov_lib.data.sources.run`, on one command line (:func:`qkov_lib.data.sources.parser`).
    Exit status 1, one message on stderr, when data cannot be fetched or fails its check."""
    ap, sub = sources.parser()
    sub.choices["check"].add_argument("--fetch", action="store_true",
                                      help="fetch and build what is missing (when its servers can be reached)")
    f = sub.add_parser("fetch", help="download the official releases, verify their sha256 and build the data folder",
                       description="download the official releases, verify their sha256 and build the data folder")
    f.add_argument("--dest", default=None, help=f"data folder to fill (default: ${sources.DATA_ENV}, else ../shared/data)")
    f.add_argument("--only", nargs="*", default=None, help="file paths or dataset names (squad, hatexplain, sva, sva_linzen)")
    f.add_argument("--overwrite", action="store_true", help="rebuild files that are already there")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.cmd == "check" and args.fetch:
        if args.probe:
            ap.error("check: give --fetch or --probe, not both")
        try:
            fetched = ensure(args.data_dir)
        except sources.DataUnavailable as err:
            print(err, file=sys.stderr)
            return 1
        except (ValueError, OSError) as err:  # ChecksumError, DownloadError, ManifestError
            print(f"qkov data check: {err}", file=sys.stderr)
            return 1
        if fetched:
            print(f"data: the missing files were fetched and built in {sources.data_dir_location(args.data_dir)[0]}")
            return 0
        return sources.run(args)
    if args.cmd != "fetch":
        return sources.run(args)
    try:
        status = fetch(args.dest, args.only, args.overwrite, progress=not args.no_progress)
    except (ValueError, OSError) as err:  # ChecksumError, FileNotFoundError, DownloadError, a bad --only
        print(f"qkov data fetch: {err}", file=sys.stderr)
        return 1
    for rel, s in status.items():
        print(f"{rel}: {s}")
    print(f"data folder: {sources.data_dir_location(args.dest)[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
