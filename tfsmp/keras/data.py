"""Batches for `DistributedModel.fit`: the same global batches on every rank, each replica's share.

[Note: identical batches] Every stage of a replica must see the same batch, and the replicas must
split one global batch between them. NumPy inputs are therefore batched here, shuffled with a
seed every rank agrees on (broadcast from rank 0); a `tf.data.Dataset`, generator or
`keras.utils.PyDataset` is iterated as given, so it must yield the same batches on every rank
(seed its shuffle, as SMP's documentation also asks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from tfsmp.errors import StepError
from tfsmp.runtime import microbatch as mbatch

__all__ = ["BatchSource", "replica_share"]


def _is_array_like(x: Any) -> bool:
    leaves = mbatch._leaves(x)
    return bool(leaves) and all(isinstance(v, np.ndarray) or (hasattr(v, "__array__") and
                                not hasattr(v, "element_spec")) for v in leaves)


def replica_share(batch: Any, data_rank: int, num_replicas: int, divisor: int) -> Any:
    """The rows of a global batch that replica ``data_rank`` trains on.

    Raises:
        StepError: if the global batch does not split into equal replica microbatches.
    """
    b = mbatch.batch_size_of(batch)
    if b % (num_replicas * divisor):
        raise StepError(
            f"The global batch size must be divisible by data-parallel replicas × microbatches. "
            f"Received: batch_size={b}, replicas={num_replicas}, microbatches={divisor}. Use a "
            f"batch size that is a multiple of {num_replicas * divisor} (with tf.data: "
            f".batch(..., drop_remainder=True)).")
    if num_replicas == 1:
        return batch
    size = b // num_replicas
    return mbatch.take_rows(batch, data_rank * size, (data_rank + 1) * size)


class BatchSource:
    """Yields ``(x, y, sample_weight)`` global batches, epoch after epoch."""

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int | None,
                 shuffle: bool = False, seed: int = 0, steps_per_epoch: int | None = None,
                 divisor: int = 1) -> None:
        self.arrays = _is_array_like(x)
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.shuffle, self.seed = shuffle, seed
        self.steps_per_epoch = steps_per_epoch
        if self.arrays:
            self.x, self.y, self.sample_weight = (_as_numpy(v) for v in (x, y, sample_weight))
            self.num_samples = mbatch.batch_size_of(self.x)
            self.batch_size = batch_size or 32
            full, rest = divmod(self.num_samples, self.batch_size)
            if steps_per_epoch is None and rest and rest % divisor:
                raise StepError(
                    f"The last batch of an epoch must also split into replicas × microbatches. "
                    f"Received: samples={self.num_samples}, batch_size={self.batch_size}, last "
                    f"batch={rest}, replicas × microbatches={divisor}. Pass "
                    f"steps_per_epoch={full} to drop it, or pick a batch size that divides "
                    f"{self.num_samples}.")
            self.num_batches: int | None = full + (1 if rest else 0)
            if steps_per_epoch is not None:
                self.num_batches = steps_per_epoch
        else:
            if batch_size is not None and not isinstance(batch_size, int):
                raise StepError(f"batch_size must be an int. Received: batch_size={batch_size!r}")
            from keras.src.trainers.data_adapters import get_data_adapter

            self.adapter = get_data_adapter(x, y, sample_weight, batch_size=batch_size,
                                            steps_per_epoch=steps_per_epoch, shuffle=False)
            self.num_batches = steps_per_epoch or self.adapter.num_batches
        self._iterator: Iterator[Any] | None = None

    def epoch(self, epoch: int) -> Iterator[tuple[Any, Any, Any]]:
        if self.arrays:
            yield from self._array_epoch(epoch)
            return
        from keras.src.trainers.data_adapters import data_adapter_utils

        if self.steps_per_epoch is None or self._iterator is None:
            self._iterator = iter(self.adapter.get_numpy_iterator())
        for step, data in enumerate(self._iterator_forever()):
            if self.num_batches is not None and step >= self.num_batches:
                return
            yield data_adapter_utils.unpack_x_y_sample_weight(data)

    def _iterator_forever(self) -> Iterator[Any]:
        while True:
            if self._iterator is None:
                return
            try:
                yield next(self._iterator)
            except StopIteration:
                if self.steps_per_epoch is None:
                    return
                self._iterator = iter(self.adapter.get_numpy_iterator())

    def _array_epoch(self, epoch: int) -> Iterator[tuple[Any, Any, Any]]:
        n = self.num_samples
        order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        steps = self.num_batches or 0
        for step in range(steps):
            start = (step * self.batch_size) % n
            idx = order[start:start + self.batch_size]
            yield tuple(None if v is None else _rows(v, idx)
                        for v in (self.x, self.y, self.sample_weight))  # type: ignore[misc]


def _as_numpy(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, dict):
        return {k: _as_numpy(a) for k, a in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_as_numpy(a) for a in v)
    return np.asarray(v)


def _rows(v: Any, idx: np.ndarray) -> Any:
    if isinstance(v, dict):
        return {k: _rows(a, idx) for k, a in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_rows(a, idx) for a in v)
    return v[idx]
