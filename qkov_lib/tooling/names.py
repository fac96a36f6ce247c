"""A page's name: its source file's stem without the number that sets its place in the book. The
lowest layer of the book tooling, importing nothing heavy (listing the chapters loads neither torch nor
pandas)."""

from __future__ import annotations

import os
from pathlib import Path


def chapter_name(path: str | os.PathLike) -> str:
    """``book/01_synthetic.md`` -> ``synthetic``, ``book/protocol_choices.md`` -> ``protocol_choices``:
    only a number prefix is dropped (the name of the page's results file and of its ``qkov run``)."""
    stem = Path(path).stem
    head, _, tail = stem.partition("_")
    return tail if head.isdigit() and tail else stem
