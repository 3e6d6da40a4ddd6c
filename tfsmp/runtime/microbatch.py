"""Split a batch into microbatches and merge per-microbatch results back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tfsmp.errors import StepError

__all__ = ["batch_size_of", "merge", "split", "split_sizes", "take_rows"]

# i: microbatch, m: number of microbatches, b: batch size, d: data-parallel replicas


def _leaves(structure: Any) -> list[Any]:
    if structure is None:
        return []
    if isinstance(structure, dict):
        return [leaf for k in sorted(structure) for leaf in _leaves(structure[k])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in _leaves(item)]
    return [structure]


def _map(fn: Any, structure: Any) -> Any:
    if structure is None:
        return None
    if isinstance(structure, dict):
        return {k: _map(fn, v) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_map(fn, v) for v in structure)
    if isinstance(structure, list):
        return [_map(fn, v) for v in structure]
    return fn(structure)


def batch_size_of(structure: Any, axis: int = 0) -> int:
    """The batch size shared by every leaf of a nested structure.

    Raises:
        StepError: when leaves disagree on their batch size.
    """
    sizes = {int(np.shape(leaf)[axis]) for leaf in _leaves(structure)}
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
    return _map(cut, structure)


def split_sizes(rows: int, parts: int) -> list[int]:
    """Sizes of ``parts`` consecutive pieces of ``rows`` rows, as even as can be (the first
    ``rows % parts`` pieces one row larger, as ``np.array_split``); 0 parts: none."""
    if parts <= 0:
        return []
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split(structure: Any, num_microbatches: int, axis: int = 0, what: str = "batch") -> list[Any]:
    """Splits every leaf into ``num_microbatches`` equal parts along ``axis``.

    Raises:
        StepError: when the batch size is not divisible by ``num_microbatches``.
    """
    b = batch_size_of(structure, axis)
    if b % num_microbatches:
        raise StepError(
            f"{what} size must be divisible by microbatches. Received: batch_size={b}, "
            f"microbatches={num_microbatches}. Use a batch size that is a multiple of "
            f"{num_microbatches} (with tf.data: .batch(..., drop_remainder=True)).")
    size = b // num_microbatches
    return [take_rows(structure, i * size, (i + 1) * size, axis) for i in range(num_microbatches)]


def merge(parts: Sequence[Any], axis: int = 0) -> Any:
    """Concatenates per-microbatch structures along ``axis`` (the inverse of `split`)."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {k: merge([p[k] for p in parts], axis) for k in first}
    if isinstance(first, (list, tuple)):
        merged = [merge([p[j] for p in parts], axis) for j in range(len(first))]
        return type(first)(merged) if isinstance(first, tuple) else merged
    return np.concatenate([np.asarray(p) for p in parts], axis=axis)
