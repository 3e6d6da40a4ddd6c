"""Batches for `DistributedModel`: the same global batches on every rank, each replica's share.

[Note: identical batches] Every pipeline rank of a replica must see the same batch, and the
replicas split one global batch between them (the engine takes each replica's rows). Keras's own
data adapters batch and shuffle (tfsmp/keras/trainer_steps.py), on every rank alike: arrays with
TensorFlow's global seed, which every rank shares (`agree_shuffle_seed`); a `tf.data.Dataset`,
generator or `keras.utils.PyDataset` must yield the same batches on every rank (seed its
shuffle, as SMP's documentation also asks).

[Note: same batch on every rank] A stage reads only its part of a batch (the first stage the
inputs, the last the targets), so ranks given different batches (an unseeded
`np.random.permutation` in the script, `Dataset.shuffle` without a seed) train on inputs paired
with another sample's labels, silently, and later hang when their batch counts differ. Ranks
therefore compare a `batch_digest` of every batch Keras's trainer hands them (piggy-backed on the
per-step allgather of [Note: replicas run out together]); `smp.step` of every step's inputs, over
the pipeline only (replicas legitimately see different data there). A digest is shapes, dtypes and
a CRC-32 of the bytes (0.4 ms for a 256×28×28 float32 batch here); leaves above
`DIGEST_BYTES` hash evenly spaced rows only, so the cost stays bounded.
"""

from __future__ import annotations

import zlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfsmp.errors import StepError
from tfsmp.runtime import microbatch as mbatch

__all__ = ["agree_shuffle_seed", "batch_digest", "check_same_batch", "different_ranks",
           "keras_input_rank", "same_batch_error", "sampler"]

DIGEST_BYTES = 1 << 20  # per leaf; larger leaves hash evenly spaced rows (a bounded cost)


def agree_shuffle_seed(world: Any) -> None:
    """[Note: identical batches] Keras's data adapters shuffle with TensorFlow's global seed
    (``keras.utils.set_random_seed``, or the ``seed`` parameter, which sets it). Without one,
    every rank would shuffle differently; then ranks agree on rank 0's random seed first, which
    is as random as an unseeded plain-Keras run. A collective (every rank calls ``fit``)."""
    import tensorflow as tf
    from tensorflow.python.framework import random_seed

    seeded = random_seed.get_seed(None)[0] is not None
    if all(world.allgather_obj(seeded)):
        return
    entropy = int(np.random.SeedSequence().entropy or 0)  # type: ignore[arg-type]
    tf.random.set_seed(world.bcast_obj(entropy % (2**31), root=0))


def sampler(x: Any, batch_size: int | None) -> Any:
    """A function that returns a batch (or its spec) to partition the model with before ``fit``'s
    first step: the arrays' first rows, or a dataset's or generator's element spec through
    Keras's own data adapter (called only when a callback needs the partitioned model at
    ``on_train_begin``: [Note: Keras's BackupAndRestore] in tfsmp/checkpoint/fit_resume.py)."""

    def sample() -> Any:
        import tensorflow as tf

        leaves = mbatch.leaves(x)
        if leaves and all(isinstance(v, np.ndarray) or (hasattr(v, "__array__") and not
                          hasattr(v, "element_spec")) for v in leaves):
            rows = batch_size or 32
            return keras.tree.map_structure(lambda a: np.asarray(a)[:rows], x)
        from keras.src.trainers.data_adapters import get_data_adapter

        spec = get_data_adapter(x, batch_size=batch_size).get_tf_dataset().element_spec
        inputs = spec[0] if isinstance(spec, tuple) else spec
        return tf.nest.map_structure(
            lambda s: keras.KerasTensor(tuple(s.shape), dtype=s.dtype.name), inputs)

    return sample


def _leaf_digest(leaf: Any) -> tuple[Any, ...]:
    # a tensor's own memory (`__array__`): `.numpy()` copied the whole batch, every step on
    # every rank (an 8 MB input: 3-30 ms a step, by the machine's load), to read a sample of it
    a = np.asarray(leaf if hasattr(leaf, "__array__") or not hasattr(leaf, "numpy")
                   else leaf.numpy())
    if a.dtype == object:  # strings and other Python objects: hash their text
        return (a.shape, "object", zlib.crc32(repr(a.tolist()).encode()))
    if a.nbytes > DIGEST_BYTES and a.ndim and a.shape[0] > 1:
        row_bytes = max(a.nbytes // a.shape[0], 1)
        rows = np.linspace(0, a.shape[0] - 1, max(DIGEST_BYTES // row_bytes, 2)).astype(np.int64)
        sample = np.ascontiguousarray(a[np.unique(rows)])
    else:
        sample = np.ascontiguousarray(a)
    # as bytes: a buffer of ml_dtypes' bfloat16 or float8 (Keras's mixed_bfloat16 and quantized
    # policies feed them) has no buffer format ("cannot include dtype 'E' in a buffer")
    return (a.shape, str(a.dtype), zlib.crc32(sample.reshape(-1).view(np.uint8).data))


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


def keras_input_rank(model: Any, x: Any) -> Any:
    """``x`` with each input at its ``keras.Input``'s rank, as Keras's Functional model adjusts
    it before a call: an array one rank short of an Input whose last dimension is 1 (a
    ``(batch,)`` array for ``Input((1,))``) gains that dimension, one with an extra last
    dimension of 1 loses it. The pipeline's stages run the layers without the Functional's
    call, so this happens here, on the batch Keras's trainer hands over. Other inputs, and
    models without Keras inputs (subclassed), are left as they are."""
    inputs = list(getattr(model, "inputs", None) or [])
    if not inputs:
        return x
    if isinstance(x, dict):
        by_name = {str(getattr(t, "name", "")): t for t in inputs}
        return {k: _to_rank(v, by_name[k]) if k in by_name else v for k, v in x.items()}
    flat = keras.tree.flatten(x)
    if len(flat) != len(inputs):
        return x
    return keras.tree.pack_sequence_as(x, [_to_rank(v, t) for v, t in zip(flat, inputs)])


def _to_rank(value: Any, ref: Any) -> Any:
    shape, want = tuple(getattr(value, "shape", ()) or ()), tuple(ref.shape)
    host = isinstance(value, np.ndarray)  # a view of the array; a dense tensor keeps its buffer
    if not shape or not (host or isinstance(value, tf.Tensor)):
        return value
    if len(shape) == len(want) - 1 and want[-1] == 1:
        return np.expand_dims(value, -1) if host else keras.ops.expand_dims(value, -1)
    if len(shape) == len(want) + 1 and shape[-1] == 1:
        return np.squeeze(value, -1) if host else keras.ops.squeeze(value, -1)
    return value
