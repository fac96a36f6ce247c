"""What every converter of an official release shares: converters are pure functions of bytes.

A converter takes ``{download id: bytes as served}`` and returns ``{path in the data folder: uncompressed
content}``, which :mod:`qkov_lib.data.fetch` checks against the manifest and writes. The converters
live with their datasets and are listed in :data:`qkov_lib.data.registry.CONVERTERS`; this module
holds the helpers they share.
"""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any


def by_name(inputs: Mapping[str, bytes], name: str) -> bytes:
    """The input whose download id ends in ``name``; KeyError naming what is there otherwise."""
    hits = [v for k, v in inputs.items() if PurePosixPath(k).name == name]
    if len(hits) != 1:
        raise KeyError(f"expected one input named {name!r}, got {sorted(inputs)}")
    return hits[0]


def hf_jsonl(rows: list[dict[str, Any]]) -> bytes:
    """JSON lines as the ``datasets``/pandas export writes them: compact, non-ASCII as ``\\uXXXX``, ``/`` as
    ``\\/`` (so the converted splits equal the curated copies byte for byte)."""
    return "".join(json.dumps(r, separators=(",", ":")).replace("/", "\\/") + "\n" for r in rows).encode("ascii")


def tar_members(data: bytes, names: list[str]) -> dict[str, bytes]:
    """The files ``names`` (by base name; macOS ``._*`` stubs ignored) of a tar archive, read in memory;
    KeyError naming the missing ones."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for m in tar.getmembers():
            base = PurePosixPath(m.name).name
            if m.isfile() and base in names and not base.startswith("._"):
                out[base] = tar.extractfile(m).read()
    missing = [n for n in names if n not in out]
    if missing:
        raise KeyError(f"the archive has no {', '.join(missing)}")
    return out


class NoGlobalsUnpickler(pickle.Unpickler):
    """An unpickler refusing every global: a pickle can build only plain containers and strings, run no code."""

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle's hook
        raise pickle.UnpicklingError(f"refused to load the global {module}.{name}: the template pickles "
                                     "hold only dicts, lists, tuples and strings")
