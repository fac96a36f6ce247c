"""Datasets: every loader returns :class:`Batch` objects (left-padded, query last)."""

from qkov_lib.data.batch import Batch, left_pad

__all__ = ["Batch", "left_pad"]
