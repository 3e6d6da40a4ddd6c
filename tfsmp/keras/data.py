"""Batches for `DistributedModel.fit`: the same global batches on every rank, each replica's share.

[Note: identical batches] Every pipeline rank of a replica must see the same batch, and the replicas must
split one global batch between them. NumPy inputs are therefore batched here, shuffled with a
seed every rank agrees on (broadcast from rank 0); a `tf.data.Dataset`, generator or
`keras.utils.PyDataset` is iterated as given, so it must yield the same batches on every rank
(seed its shuffle, as SMP's documentation also asks).

[Note: same batch on every rank] A stage reads only its part of a batch (the first stage the
inputs, the last the targets), so ranks given different batches (an unseeded
`np.random.permutation` in the script, `Dataset.shuffle` without a seed) train on inputs paired
with another sample's labels, silently, and later hang when their batch counts differ. Ranks
therefore compare a `batch_digest` of what the user gave them: `fit` of the first batch of
every epoch (arrays; tfsmp batches them itself) or of every batch (datasets, piggy-backed on the
per-step allgather of [Note: replicas run out together]); `smp.step` of every step's inputs, over
the pipeline only (replicas legitimately see different data there). A digest is shapes, dtypes and
a CRC-32 of the bytes (0.4 ms for a 256×28×28 float32 batch here); leaves above
`DIGEST_BYTES` hash evenly spaced rows only, so the cost stays bounded.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from tfsmp.errors import StepError
from tfsmp.runtime import microbatch as mbatch

__all__ = ["BatchSource", "batch_digest", "capped_steps", "check_same_batch", "class_sample_weights",
           "different_ranks", "same_batch_error", "split_validation"]

DIGEST_BYTES = 1 << 20  # per leaf; larger leaves hash evenly spaced rows (a bounded cost)


def _is_array_like(x: Any) -> bool:
    leaves = mbatch.leaves(x)
    return bool(leaves) and all(isinstance(v, np.ndarray) or (hasattr(v, "__array__") and
                                not hasattr(v, "element_spec")) for v in leaves)


class BatchSource:
    """Yields ``(x, y, sample_weight)`` global batches, epoch after epoch."""

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int | None,
                 shuffle: bool = False, seed: int = 0, steps_per_epoch: int | None = None,
                 class_weight: dict[int, float] | None = None) -> None:
        self.arrays = _is_array_like(x)
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.shuffle, self.seed = shuffle, seed
        self.steps_per_epoch = steps_per_epoch
        if self.arrays:
            self.x, self.y, self.sample_weight = (_as_numpy(v) for v in (x, y, sample_weight))
            if class_weight is not None:
                self.sample_weight = class_sample_weights(self.y, self.sample_weight, class_weight)
            self.num_samples = mbatch.batch_size_of(self.x)
            self.batch_size = batch_size or 32
            full, rest = divmod(self.num_samples, self.batch_size)
            self.per_pass = full + (1 if rest else 0)  # a partial last batch trains too, as in Keras
            self.num_batches: int | None = steps_per_epoch or self.per_pass
            self._pass, self._position = 0, 0  # [Note: passes over arrays]
        else:
            if batch_size is not None and not isinstance(batch_size, int):
                raise StepError(f"batch_size must be an int. Received: batch_size={batch_size!r}")
            from keras.src.trainers.data_adapters import get_data_adapter

            # Keras's adapters weigh classes (tf.data) or reject class_weight (generators)
            self.adapter = get_data_adapter(x, y, sample_weight, batch_size=batch_size,
                                            steps_per_epoch=steps_per_epoch, shuffle=False,
                                            class_weight=class_weight)
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
        """[Note: passes over arrays] As Keras's `EpochIterator`: without ``steps_per_epoch``
        an epoch is one pass over the arrays (shuffled anew); with it, an epoch takes that many
        batches and the next epoch goes on where it stopped; a pass that runs out in the middle
        of an epoch ends that epoch early (Keras warns "Your input ran out of data"), and the
        next one starts a new pass."""
        if self.steps_per_epoch is None:
            self._pass, self._position = epoch, 0
        n = self.num_samples
        order = (np.random.default_rng([self.seed, self._pass]).permutation(n) if self.shuffle
                 else np.arange(n))
        for _ in range(self.num_batches or 0):
            if self._position >= self.per_pass:
                warnings.warn("Your input ran out of data; interrupting training. Make sure "
                              "that your dataset or generator can generate at least "
                              "`steps_per_epoch * epochs` batches.", stacklevel=2)
                break
            start = self._position * self.batch_size
            self._position += 1
            idx = order[start:start + self.batch_size]
            yield tuple(None if v is None else _rows(v, idx)
                        for v in (self.x, self.y, self.sample_weight))  # type: ignore[misc]
        if self._position >= self.per_pass:
            self._pass, self._position = self._pass + 1, 0


def capped_steps(steps_per_epoch: int | None) -> int | None:
    """Keras's ``keras.config.set_max_steps_per_epoch`` cap (for debugging runs). Measured on
    Keras 3.15 (TF backend): it limits fit's training and validation steps, while a standalone
    evaluate or predict still covers all the data; `DistributedModel` does the same."""
    from keras import config

    cap = config.max_steps_per_epoch()
    if cap and (not steps_per_epoch or cap < steps_per_epoch):
        return int(cap)
    return steps_per_epoch


def _as_numpy(v: Any) -> Any:
    return keras.tree.map_structure(lambda a: None if a is None else np.asarray(a), v)


def _rows(v: Any, idx: np.ndarray) -> Any:
    return keras.tree.map_structure(lambda a: a[idx], v)


def split_validation(x: Any, y: Any, sample_weight: Any, validation_split: float
                     ) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """Keras's ``validation_split``: the last fraction of the arrays, taken before any shuffle.

    Raises:
        ValueError: as Keras does, for datasets and generators, or too few samples to split.
    """
    from keras.src.trainers.data_adapters import array_slicing

    train, val = array_slicing.train_validation_split((x, y, sample_weight),
                                                      validation_split=validation_split)
    return (train[0], train[1], train[2]), (val[0], val[1], val[2])


def class_sample_weights(y: Any, sample_weight: Any, class_weight: dict[int, float]) -> Any:
    """Keras's ``class_weight``: a sample weight per row from its class (argmax if one-hot)."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    if sample_weight is not None:  # Keras's wording, so scripts that catch it still do
        raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")
    if isinstance(y, (dict, list, tuple)):
        raise ValueError("`class_weight` is only supported for Models with a single output.")
    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def _leaf_digest(leaf: Any) -> tuple[Any, ...]:
    a = np.asarray(leaf.numpy() if hasattr(leaf, "numpy") else leaf)
    if a.dtype == object:  # strings and other Python objects: hash their text
        return (a.shape, "object", zlib.crc32(repr(a.tolist()).encode()))
    if a.nbytes > DIGEST_BYTES and a.ndim and a.shape[0] > 1:
        row_bytes = max(a.nbytes // a.shape[0], 1)
        rows = np.linspace(0, a.shape[0] - 1, max(DIGEST_BYTES // row_bytes, 2)).astype(np.int64)
        sample = np.ascontiguousarray(a[np.unique(rows)])
    else:
        sample = np.ascontiguousarray(a)
    return (a.shape, a.dtype.str, zlib.crc32(sample.data))


def batch_digest(batch: Any) -> tuple[Any, ...]:
    """Shapes, dtypes and CRC-32s of a batch's arrays: equal when the batches are (almost surely)
    equal. Non-array leaves (Python numbers, strings) enter by value. [Note: same batch on every
    rank]"""
    out = []
    for leaf in mbatch.leaves(batch):
        if hasattr(leaf, "shape") or isinstance(leaf, (list, np.ndarray)):
            out.append(_leaf_digest(leaf))
        else:
            out.append(("value", repr(leaf)))
    return tuple(out)


def different_ranks(digests: list[Any], ranks: list[int]) -> list[int]:
    """World ranks whose digest differs from the first rank's."""
    return [r for r, d in zip(ranks, digests) if d != digests[0]]


def same_batch_error(rank_tag: str, digests: list[Any], ranks: list[int], where: str) -> StepError:
    """The error every rank raises when ranks that must see one batch got different ones."""
    bad = different_ranks(digests, ranks)
    sizes = [_digest_rows(d) for d in digests]
    kind = ("batch sizes differ: " + ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, sizes))
            if len(set(sizes)) > 1 else "the contents differ")
    return StepError(
        f"{rank_tag} Ranks that train on one batch together must get the same batch from the "
        f"script (each stage reads only its part: inputs on the first stage, targets on the last; "
        f"fit also splits it among data-parallel replicas). Received: rank(s) "
        f"{bad} got a different batch than rank {ranks[0]} {where} ({kind}). This happens when "
        f"the data is shuffled or sampled without a seed (an unseeded np.random.permutation, "
        f"Dataset.shuffle without seed=). Seed it alike on every rank (np.random.seed(0), "
        f"np.random.default_rng(0), shuffle(..., seed=0)) or load the same data on every rank.")


def _digest_rows(digest: Any) -> str:
    """The batch size a digest records (its first array leaf's first dimension)."""
    for d in digest:
        if d and d[0] != "value" and len(d[0]):
            return str(d[0][0])
    return "?"


def check_same_batch(group: Any, batch: Any, *, rank_tag: str, where: str) -> None:
    """Raises the same StepError on every rank of ``group`` unless all got the same ``batch``.
    A collective: every rank of ``group`` calls it once per check."""
    if group.size <= 1:
        return
    digests = group.allgather_obj(batch_digest(batch))
    if different_ranks(digests, list(group.ranks)):
        raise same_batch_error(rank_tag, digests, list(group.ranks), where)


_STEP_CALLS = [0]  # smp.step calls on this rank, for the error message


def _step_leaf(leaf: Any) -> bool:
    """Leaves a step's agreement covers: arrays, tensors and plain scalars (not a model or other
    object passed through, whose repr may name a per-process address)."""
    return (hasattr(leaf, "dtype") and hasattr(leaf, "shape")) or isinstance(
        leaf, (bool, int, float, str, bytes))


def check_step_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Every pipeline rank must get the same ``smp.step`` arguments: raises the same
    StepError on all of them otherwise. Every step, since a step's inputs come straight from
    the user's loop. Replicas are not compared (SMP scripts feed each its own shard).
    [Note: same batch on every rank]"""
    import tfsmp.core as core

    st = core.state()
    _STEP_CALLS[0] += 1
    leaves = [v for v in mbatch.leaves((args, kwargs)) if _step_leaf(v)]
    tag = f"[{st.tag()}]"
    check_same_batch(st.comm.pipeline, leaves, rank_tag=tag,
                     where=f"in smp.step call {_STEP_CALLS[0]}")
