"""The datasets of the book by name: each one's loader and default padded length, and the
converter of each official release (:mod:`qkov_lib.data.fetch` builds the data folder with them).
Each dataset module holds its loader and its converter; this module only lists them, so the
dataset modules never import each other."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import hatexplain, squad, sva
from .text import TextDataset

#: name -> loader (keyword arguments of :func:`load_text_dataset`)
LOADERS: dict[str, Callable[..., TextDataset]] = {"squad": squad.load, "hatexplain": hatexplain.load, "sva": sva.load,
                                                  "sva_linzen": sva.load_linzen}
DATASETS: tuple[str, ...] = tuple(LOADERS)
#: download group of the manifest -> converter ``{download id: bytes} -> {path: content}``
CONVERTERS: dict[str, Callable[[Mapping[str, bytes]], dict[str, bytes]]] = {
    "hatexplain": hatexplain.convert, "linzen2016": sva.convert_linzen2016,
    "marvin_linzen2018": sva.convert_marvin_linzen2018}
DEFAULT_MAX_LEN = {"squad": 192, "hatexplain": 96, "sva": 16, "sva_linzen": 48}


def load_text_dataset(name: str, data_dir=None, max_len: int | None = None, min_freq: int = 2,
                      n_train: int | None = None, n_test: int | None = None, seed: int = 0,
                      **kw: Any) -> TextDataset:
    """Load dataset ``name`` ("squad", "hatexplain", "sva" = Marvin & Linzen with the exact
    subject index, "sva_linzen" = Linzen's numpred.val train pool with the attractor test sets)
    from the data directory (``data_dir`` or ``$QKOV_DATA_DIR``).

    ``max_len`` caps the padded length including the query (default per dataset:
    :data:`DEFAULT_MAX_LEN`); ``n_train``/``n_test`` subsample with ``seed`` (None: all);
    further keywords go to the dataset's loader (see its module)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    max_len = DEFAULT_MAX_LEN[name] if max_len is None else max_len
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2 (words + query), got {max_len!r}")
    args = dict(data_dir=data_dir, max_len=max_len, min_freq=min_freq, n_train=n_train, n_test=n_test, seed=seed, **kw)
    return LOADERS[name](**args)
