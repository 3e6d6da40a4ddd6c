"""Cut a batch into the rows of each replica and microbatch (nested structures through
`keras.tree`)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from tfsmp.errors import StepError

__all__ = ["batch_size_of", "leaves", "split_sizes", "take_rows"]

# i: microbatch, m: number of microbatches, b: batch size, d: data-parallel replicas


def leaves(structure: Any) -> list[Any]:
    """The arrays of a nested batch (dicts by sorted key, lists, tuples), Nones left out."""
    return [leaf for leaf in keras.tree.flatten(structure) if leaf is not None]


def batch_size_of(structure: Any, axis: int = 0) -> int:
    """The batch size shared by every leaf of a nested structure.

    Raises:
        StepError: when leaves disagree on their batch size.
    """
    sizes = {int(np.shape(leaf)[axis]) for leaf in leaves(structure)}
    if not sizes:
        raise StepError("A batch needs at least one array or tensor. Received: an empty structure.")
    if len(sizes) > 1:
        raise StepError(
            f"Every input array must have the same batch size. Received: batch sizes {sorted(sizes)}.")
    return sizes.pop()


def take_rows(structure: Any, start: int, stop: int, axis: int = 0) -> Any:
    """Rows ``[start, stop)`` along ``axis`` of every leaf."""
    def cut(leaf: Any) -> Any:
        index = [slice(None)] * len(np.shape(leaf))
        index[axis] = slice(start, stop)
        return leaf[tuple(index)]
    return keras.tree.map_structure(lambda leaf: None if leaf is None else cut(leaf), structure)


def split_sizes(rows: int, parts: int) -> list[int]:
    """Sizes of ``parts`` consecutive pieces of ``rows`` rows, as even as can be (the first
    ``rows % parts`` pieces one row larger, as ``np.array_split``); 0 parts: none."""
    if parts <= 0:
        return []
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
