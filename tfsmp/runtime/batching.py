"""Batching: a global batch becomes this replica's microbatches, each with its constants.

Example::

    batching = Batching(traced, data_rank=0, data_size=2, microbatches=4, rank_tag="[rank 0]")
    shape = batching.step_shape(rows=64)       # every replica's rows, this one's, m per replica
    mbs = batching.microbatches(x, y, sw, shape, objective=objective)   # MicroBatch, consts set
    batching.like_outputs(x)                   # random tensors shaped like the model's outputs

[Note: one owner of the step] in engine.py: which rows each replica trains on, how many
microbatches a step has and the constants every program needs for its share of the loss
([Note: loss numerators] in objective.py) are decided here, the same way on every rank.
Microbatches and replica shares may be of any sizes (np.array_split's), so any batch size
trains, and so does an epoch's partial last batch.

[Note: what a rank converts] A step's head runs on every rank before its first action, and on
the first stage's rank it is on the critical path. So a rank converts only what its stages
read: the model inputs its stages take (the others stay NumPy arrays, views of the batch, whose
shapes the boundary shapes still follow), and the targets and sample weights only where the
loss is computed. Each converted array is split into microbatches by one ``tf.split``, which
shares the converted buffer, and the constants vectors are made once per distinct value.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.backend import set_keras_mask

from tfsmp.errors import StepError
from tfsmp.runtime import microbatch as mbatch
from tfsmp.runtime.dynamic_shapes import ShapeResolver
from tfsmp.runtime.executor import MicroBatch

if TYPE_CHECKING:
    from tfsmp.graph.tracer import TracedModel
    from tfsmp.runtime.objective import Objective

__all__ = ["Batching", "StepShape", "split_rows", "to_tensors"]


@dataclass(frozen=True)
class StepShape:
    """How one global batch splits ([Note: one owner of the step]): every replica's rows,
    this replica's row range, the microbatches per replica and the batch's parts in all."""

    rows: int
    replica_rows: tuple[int, ...]
    start: int
    stop: int
    step_microbatches: int  # of every replica that has rows
    parts: int              # the batch's microbatches over all replicas

    @property
    def microbatches(self) -> int:
        """This replica's microbatches: 0 when it has no rows in this batch."""
        return self.step_microbatches if self.stop > self.start else 0

    @property
    def my_rows(self) -> int:
        return self.stop - self.start


class Batching:
    """Global batch -> this replica's microbatches. See the module docstring."""

    def __init__(self, traced: TracedModel, *, data_rank: int, data_size: int,
                 microbatches: int, rank_tag: str, reads: Iterable[str] | None = None,
                 labels: bool = True) -> None:
        """``reads``: the input keys this rank's stages read (None: all); ``labels``: whether
        one of them computes the loss ([Note: what a rank converts])."""
        self.traced = traced
        self.data_rank = data_rank
        self.data_size = data_size
        self.m = microbatches
        self.rank_tag = rank_tag
        self.reads = None if reads is None else frozenset(reads)
        self.needs_labels = labels
        self._outputs: ShapeResolver | None = None
        self._consts: dict[bytes, tf.Tensor] = {}  # [Note: what a rank converts]

    def step_shape(self, rows: int, microbatches: int | None = None) -> StepShape:
        """How a global batch of ``rows`` splits over replicas and microbatches, the same on
        every rank ([Note: one owner of the step])."""
        shares = mbatch.split_sizes(rows, self.data_size)
        r = self.data_rank
        start = sum(shares[:r])
        nonempty = [s for s in shares if s > 0]
        m = min(microbatches or self.m, min(nonempty)) if nonempty else 0
        return StepShape(rows, tuple(shares), start, start + shares[r], m, m * len(nonempty))

    def check_batch_sizes(self, x: Any, y: Any, sample_weight: Any) -> None:
        """Targets and sample weights have one row per input row (else only the last stage's
        loss would fail, and its peers would wait for it).

        Raises:
            StepError: on every rank alike, before any message; also for ragged data.
        """
        self.check_dense(x, y, sample_weight)
        b = mbatch.batch_size_of(x)
        for what, value in (("targets", y), ("sample_weight", sample_weight)):
            n = mbatch.batch_size_of(value) if value is not None else b
            if n != b:
                raise StepError(
                    f"{self.rank_tag} Targets and sample weights must have one row per input "
                    f"row. Received: inputs with batch size {b}, {what} with batch size {n}. "
                    f"Pass x, y and sample_weight of the same length.")

    def check_dense(self, x: Any, y: Any = None, sample_weight: Any = None) -> None:
        """Refuses ragged and sparse data (a SciPy sparse matrix arrives as a tf.SparseTensor
        from Keras's data adapters): rows are split by slicing dense arrays.

        Raises:
            StepError: on every rank alike, before any message.
        """
        for what, value in (("inputs", x), ("targets", y), ("sample_weight", sample_weight)):
            for t in tf.nest.flatten(value):
                if isinstance(t, tf.RaggedTensor):
                    raise StepError(
                        f"{self.rank_tag} A pipelined model trains on dense tensors: rows are "
                        f"split into microbatches and replicas, and stages exchange fixed-shape "
                        f"buffers. Received: a tf.RaggedTensor as {what} (shape {t.shape}). "
                        f"Fix: pad it (`x.to_tensor()`) and mask the padding (a padding mask "
                        f"input or keras.layers.Masking), or train this model with plain Keras.")
                if isinstance(t, tf.SparseTensor):
                    raise StepError(
                        f"{self.rank_tag} A pipelined model takes dense tensors: rows are split "
                        f"into microbatches and replicas by slicing them. Received: a "
                        f"tf.SparseTensor (or a SciPy sparse matrix) as {what} (shape "
                        f"{t.shape}). Fix: pass it dense (`tf.sparse.to_dense(x)`, "
                        f"`x.toarray()`), or train this model with plain Keras.")

    def check_inputs_packed(self, packed: dict[str, Any]) -> None:
        """Every input's per-sample shape must match the traced model's, before any message.

        Args:
            packed: the inputs keyed by tensor key (`TracedModel.pack_inputs`).

        Raises:
            StepError: naming the input, on every rank alike (all ranks see the same batch).
        """
        for key, value in packed.items():
            want = self.traced.graph.tensors[key].shape
            got = tuple(np.shape(value))[1:]
            if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
                raise StepError(
                    f"{self.rank_tag} Every batch must have the per-sample shape the model was "
                    f"traced with. Received: input '{key.split(':')[0]}' with shape {got}, "
                    f"expected {tuple(want)}. Pad or crop batches to one shape (shapes may not "
                    f"change between batches of a pipelined model).")

    def check_inputs(self, x: Any) -> None:
        """`check_inputs_packed` of the global batch ``x``, for a replica without rows of it
        (which makes no microbatches): a bad batch then fails on every rank alike, not only
        where rows are split, while the others wait in the step's collectives."""
        self.check_inputs_packed(self.traced.pack_inputs(x, self.reads))

    def microbatches(self, x: Any, y: Any, sample_weight: Any, shape: StepShape, *,
                     objective: Objective | None = None, scale: float = 1.0) -> list[MicroBatch]:
        """This replica's microbatches of a global batch, with their constants: a training
        step's (``objective`` given) carry the loss terms' too; inference's only the rows,
        `Consts.TERMS` long, so one trace serves predict before and after training."""
        packed = self.traced.pack_inputs(x, self.reads)
        self.check_inputs_packed(packed)  # the batch is converted once, then split
        labels = self.needs_labels
        mine = (packed, to_tensors(y) if labels else None,
                to_tensors(sample_weight) if labels else None)
        if shape.my_rows != shape.rows:
            mine = mbatch.take_rows(mine, shape.start, shape.stop)
        sizes = mbatch.split_sizes(shape.my_rows, shape.microbatches)
        xs, ys, ws = (split_rows(part, sizes) for part in mine)
        out = []
        for xi, yi, wi, size in zip(xs, ys, ws, sizes):
            consts = (objective.constants(rows=shape.rows, rows_mb=size,
                                          sample_weight=sample_weight, scale=scale,
                                          parts=shape.parts) if objective is not None
                      else np.array([shape.rows, size, scale, 1.0], np.float32))
            out.append(MicroBatch(xi, yi, wi, size=size, consts=self._constant(consts)))
        return out

    def _constant(self, values: np.ndarray) -> tf.Tensor:
        """The constants vector as a tensor, made once per distinct value."""
        key = values.tobytes()
        found = self._consts.get(key)
        if found is None:
            if len(self._consts) > 256:  # sample weights' normalizers vary batch to batch
                self._consts.clear()
            found = self._consts[key] = tf.constant(values)
        return found

    def given_microbatches(self, inputs: list[dict[str, Any]]) -> list[MicroBatch]:
        """`smp.step`'s microbatches, split by the script: ``inputs[i]`` by tensor key."""
        out = []
        for packed in inputs:
            tensors = {k: tf.convert_to_tensor(v) for k, v in packed.items()}
            self.check_inputs_packed(tensors)
            size = int(next(iter(tensors.values())).shape[0]) if tensors else 0
            consts = tf.constant([size, size, 1.0, 1.0], tf.float32)
            out.append(MicroBatch(tensors, size=size, consts=consts))
        return out

    def labels(self, mbs: list[MicroBatch], y: Any, sample_weight: Any, shape: StepShape
               ) -> None:
        """Gives inference microbatches of this replica's rows their targets and weights."""
        ys = mbatch.take_rows((y, sample_weight), shape.start, shape.stop)
        start = 0
        for mb in mbs:
            yi, wi = mbatch.take_rows(ys, start, start + mb.size)
            start += mb.size
            mb.y, mb.sample_weight = to_tensors(yi), to_tensors(wi)

    # -- shapes ----------------------------------------------------------------------------------

    def output_shapes(self, x: Any) -> list[tuple[int | None, ...]]:
        """The shapes of the model's outputs (batch axis first) for inputs shaped like ``x``
        (tensors, possibly symbolic with unknown dimensions), without running the model."""
        flat = self.traced.flatten_inputs(x)
        shapes = {k: tuple(v.shape) for k, v in zip(self.traced.input_keys, flat)}
        if self._outputs is None:
            self._outputs = ShapeResolver(self.traced, self.traced.output_keys)
        found = self._outputs.shapes(shapes)
        return [found[k] for k in self.traced.output_keys]

    def like_outputs(self, x: Any) -> Any:
        """Random tensors shaped like the model's outputs for inputs ``x``, carrying a mask
        where the model's output carries one (what a loss's kind depends on)."""
        shapes = self.output_shapes(tree.map_structure(tf.convert_to_tensor, x))
        rng = np.random.default_rng(0)
        outs = []
        tensors = self.traced.graph.tensors
        for key, shp, mask_key in zip(self.traced.output_keys, shapes,
                                      self.traced.output_mask_keys):
            dtype = tf.as_dtype(tensors[key].dtype)
            value = tf.constant(rng.normal(size=[int(d or 1) for d in shp]).astype(np.float32))
            value = tf.cast(value if dtype.is_floating else tf.abs(value), dtype)
            if mask_key is not None:  # a mask the stage will really produce (graph/masks.py)
                dims = [shp[0], *(shp[i + 1] if d is None else d
                                  for i, d in enumerate(tensors[mask_key].shape))]
                set_keras_mask(value, tf.ones([int(d or 1) for d in dims], tf.bool))
            outs.append(value)
        return self.traced.pack_outputs(outs)


def to_tensors(structure: Any) -> Any:
    if structure is None:
        return None
    return tree.map_structure(tf.convert_to_tensor, structure)


def split_rows(structure: Any, sizes: list[int]) -> list[Any]:
    """``structure`` cut into consecutive pieces of ``sizes`` rows: tensors by one ``tf.split``
    each (along the first axis TensorFlow shares the buffer: no copy), NumPy arrays as views."""
    if structure is None:
        return [None] * len(sizes)
    if len(sizes) == 1:
        return [structure]
    leaves = tree.flatten(structure)
    bounds = np.cumsum([0, *sizes])
    per_leaf = []
    for leaf in leaves:
        if leaf is None:
            per_leaf.append([None] * len(sizes))
        elif isinstance(leaf, tf.Tensor):
            per_leaf.append(tf.split(leaf, sizes, axis=0))
        else:
            per_leaf.append([leaf[a:b] for a, b in itertools.pairwise(bounds)])
    return [tree.pack_sequence_as(structure, [parts[i] for parts in per_leaf])
            for i in range(len(sizes))]
