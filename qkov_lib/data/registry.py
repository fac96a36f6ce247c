"""The datasets of the book by name (loader, default padded length) and the converters of the official
releases (:mod:`qkov_lib.data.fetch` builds the data folder with them). The dataset modules hold both;
this one only lists them, so the dataset modules never import each other."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qkov_lib.data import hatexplain, squad, sva
from qkov_lib.data.text import TextDataset, dry_run_dataset


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset of the book: ``load`` takes the keywords of :func:`load_text_dataset` (and its own) and
    returns a :class:`~qkov_lib.data.text.TextDataset`; ``max_len``: default padded length (words + query)."""

    name: str
    load: Callable[..., TextDataset]
    max_len: int


#: name -> :class:`DatasetSpec`; a new dataset is its module plus one :func:`register` call
REGISTRY: dict[str, DatasetSpec] = {}


def add(table: dict, spec: Any, kind: type) -> Any:
    """Put ``spec`` (a ``kind`` with a ``name``) into ``table`` under its name, replacing one of the same
    name; returns it. The one registering step of every spec registry."""
    if not isinstance(spec, kind):
        raise TypeError(f"register takes a {kind.__name__}, got {type(spec).__name__}")
    table[spec.name] = spec
    return spec


def register(spec: DatasetSpec) -> DatasetSpec:
    """Add ``spec`` to :data:`REGISTRY` (replacing one of the same name); returns it."""
    return add(REGISTRY, spec, DatasetSpec)


for _spec in (DatasetSpec("squad", squad.load, 192), DatasetSpec("hatexplain", hatexplain.load, 96),
              DatasetSpec("sva", sva.load, 16), DatasetSpec("sva_linzen", sva.load_linzen, 48)):
    register(_spec)
DATASETS: tuple[str, ...] = tuple(REGISTRY)  # the book's own
#: download group of the manifest -> converter ``{download id: bytes} -> {path: content}``
CONVERTERS: dict[str, Callable[[Mapping[str, bytes]], dict[str, bytes]]] = {
    "hatexplain": hatexplain.convert, "linzen2016": sva.convert_linzen2016,
    "marvin_linzen2018": sva.convert_marvin_linzen2018}


def load_text_dataset(name: str, data_dir=None, max_len: int | None = None, min_freq: int = 2,
                      n_train: int | None = None, n_test: int | None = None, seed: int = 0,
                      **kw: Any) -> TextDataset:
    """Load dataset ``name`` of :data:`REGISTRY` ("squad", "hatexplain", "sva" = Marvin & Linzen with the
    exact subject index, "sva_linzen" = Linzen's numpred.val train pool with the attractor test sets, or
    one registered later) from ``data_dir`` or ``$QKOV_DATA_DIR``. ``max_len`` caps the padded length
    including the query (default: :attr:`DatasetSpec.max_len`); ``n_train``/``n_test`` subsample with
    ``seed`` (None: all); further keywords go to the dataset's loader (see its module). In a dry run the
    test split is :func:`~qkov_lib.data.text.dry_run_dataset`'s sample."""
    if name not in REGISTRY:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(REGISTRY)}")
    max_len = REGISTRY[name].max_len if max_len is None else max_len
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2 (words + query), got {max_len!r}")
    args = dict(data_dir=data_dir, max_len=max_len, min_freq=min_freq, n_train=n_train, n_test=n_test, seed=seed, **kw)
    return dry_run_dataset(REGISTRY[name].load(**args))
