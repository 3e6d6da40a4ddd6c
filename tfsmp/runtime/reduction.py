"""Every data-parallel reduction of a rank: gradient sums, the one mean over replicas, the start-up broadcast.

Example::

    reduction = Reduction(comm.data, horovod=None, watch=watched)
    reduction.broadcast_first(variables)           # replicas start from data rank 0's values
    reduction.reduce_stage(grads, statistics)      # REDUCE: sum a stage's gradients over replicas
    reduction.mean([g1, g2])                       # the mean over replicas (smp.step, statistics)

Each call is collective over this stage's data-parallel replicas: every replica makes it, in
the same order, with tensors of the same shapes and dtypes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfsmp.runtime.buffers import aligned_empty, as_tensor, held, host_view
from tfsmp.runtime.sharding import WeightExchange, buckets

if TYPE_CHECKING:
    from tfsmp.comm.base import Group
    from tfsmp.comm.horovod import HorovodReducer
    from tfsmp.runtime.gradients import GradientState

__all__ = ["Reduction"]


def _floats(variables: list[Any]) -> list[Any]:
    return [v for v in variables if np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype).kind == "f"]


class Reduction:
    """The data-parallel reductions of one rank. See the module docstring."""

    def __init__(self, group: Group, *, horovod: HorovodReducer | None = None,
                 watch: Callable[[str], Any] | None = None) -> None:
        self.group = group
        self.size = group.size
        self.horovod = horovod  # with `horovod: True`, gradients are summed through Horovod
        self.watch = watch or (lambda what: contextlib.nullcontext())
        # per caller (`what`): the variables' ids and their reducers; a caller's new variables
        # replace its old ones (accumulators made anew: [Note: traced accumulators]), which
        # are then freed
        self._reducers: dict[str, tuple[tuple[Any, ...], list[_FusedReducer]]] = {}
        self._shared = _SharedBuffer()  # [Note: reduction buckets]
        self._sparse_union: dict[int, set[int]] = {}  # [Note: sparse agreement]

    def sum_(self, variables: list[Any], what: str, *, wide: bool = False) -> None:
        """Sums ``variables`` over the replicas through one fused MPI buffer (``wide``: in
        float64) and assigns the result back ([Note: fused reduction])."""
        key = (tuple(id(v) for v in variables), wide)
        cached = self._reducers.get(what)
        if cached is not None and cached[0] == key:
            reducers = cached[1]
        else:
            reducers = [_FusedReducer(b, wide, self._shared) for b in buckets(variables)]
            self._reducers[what] = (key, reducers)
        for reducer in reducers:  # [Note: reduction buckets]
            flat = reducer.gather()
            with self.watch(what):
                self.group.allreduce_(flat)
            reducer.scatter(flat, 1.0)
            del flat  # the shared buffer is free for the next bucket

    def broadcast_first(self, variables: list[Any]) -> None:
        """Gives every replica data rank 0's floating ``variables``, so that replicas start
        alike even when no ``seed`` fixed the initializers (each process draws its own)."""
        floats = _floats(variables)
        if self.size == 1 or not floats:
            return
        # a sum with zeros from the others is data rank 0's values, exactly, in buckets of the
        # variables' own dtype ([Note: weight exchange] in sharding.py): one fused float64
        # copy of a rank's weights held 4-5x the weights at once (measured: a rank's peak of
        # 3.2 GiB for 256 MiB of weights and 512 MiB of Adam slots; benchmarks/
        # bench_sharded_state.py)
        WeightExchange(floats, [self.group.rank == 0] * len(floats), self.group, self.watch,
                       "the broadcast of the first replica's initial weights").exchange()

    def mean(self, values: list[Any], what: str = "a data-parallel mean", *,
             wide: bool = False) -> list[tf.Tensor]:
        """The mean of each tensor (or variable) over the replicas, in one allreduce (``wide``:
        summed in float64): the one mean over replicas of the runtime."""
        if self.size == 1 or not values:
            return [tf.convert_to_tensor(t) for t in values]
        arrays = [np.asarray(tf.convert_to_tensor(t)) for t in values]
        dtype = np.dtype(np.float64) if wide else np.result_type(*arrays)
        dtype = dtype if dtype.kind == "f" else np.dtype(np.float32)
        flat = np.concatenate([a.astype(dtype).ravel() for a in arrays])
        with self.watch(what):
            self.group.allreduce_(flat)
        flat /= self.size
        out, start = [], 0
        for a in arrays:
            part = flat[start:start + a.size].reshape(a.shape)
            out.append(tf.convert_to_tensor(part.astype(a.dtype)))
            start += a.size
        return out

    def average_statistics(self, variables: list[Any], stage: int) -> None:
        """Averages a stage's floating non-trainable variables (BatchNormalization moving
        statistics) over its replicas, so every replica keeps the same copy (each updated them
        from its own share of the batch)."""
        stats = _floats(variables)
        if self.size == 1 or not stats:
            return
        means = self.mean(stats, f"the data-parallel average of stage {stage}'s statistics",
                          wide=True)
        for v, value in zip(stats, means):
            v.assign(value)

    def reduce_stage(self, grads: GradientState, statistics: list[Any]) -> None:
        """REDUCE: sums a stage's gradients of this step over its replicas (sparse ones
        combined as the whole batch's, [Note: sparse structure] in gradients.py), after
        averaging its ``statistics``."""
        stage = grads.stage
        self.average_statistics(statistics, stage)
        if self.size == 1 or not grads.trainable:
            return
        # [Note: sparse agreement] A variable is sparse on every replica or on none (one
        # graph), except on a replica without rows in the batch, which has no parts. The first
        # step's reduction therefore agrees on the set in one allgather; later steps gather
        # sparse parts only for stages that have some, and reduce the rest densely at once.
        known = self._sparse_union.get(stage)
        sparse = set(grads.sparse_indices()) | (known or set())
        if known is None or known:
            with self.watch(f"the sparse gradients of stage {stage} (an allgather)"):
                gathered = self.group.allgather_obj(grads.host_sparse())
            sparse |= {i for g in gathered for i in g}
            self._sparse_union[stage] = set(sparse)
            if sparse:
                grads.combine_replicas(
                    [{i: (tf.constant(v), tf.constant(x)) for i, (v, x) in g.items()}
                     for g in gathered if g])
        accs = [a for i, a in enumerate(grads.accumulators) if i not in sparse]
        if self.horovod is not None:
            summed = self.horovod.grouped_allreduce([a.value() for a in accs],
                                                    name=f"tfsmp_grads_stage{stage}")
            for a, s in zip(accs, summed):
                a.assign(s)
            return
        if accs:
            self.sum_(accs, f"the data-parallel allreduce of stage {stage}'s gradients")


class _SharedBuffer:
    """One 64-byte-aligned host buffer that the buckets of a rank's reductions take in turn."""

    def __init__(self) -> None:
        self.raw: np.ndarray | None = None

    def take(self, size: int, dtype: np.dtype[Any]) -> np.ndarray:
        """``size`` elements of ``dtype``: the shared buffer's start, or a new buffer while a
        tensor still aliases it."""
        nbytes = size * dtype.itemsize
        raw = self.raw
        if raw is None or raw.nbytes < nbytes or held(raw):
            raw = self.raw = aligned_empty((max(nbytes, 0 if raw is None else raw.nbytes),),
                                           np.dtype(np.uint8))
        return raw[:nbytes].view(dtype)


class _FusedReducer:
    """Flattens a fixed list of variables into one buffer and back.

    [Note: fused reduction] One compiled function flattens every variable into one tensor,
    whose memory MPI reads in place (a copy into a persistent 64-byte-aligned buffer, then
    ``Allreduce`` in place), and a second compiled function splits the reduced buffer
    (aliased through DLPack, `buffers.as_tensor`), scales, casts and assigns it back: two
    TensorFlow calls per reduction instead of a conversion per variable (2-4x faster,
    docs/performance.md).
    """

    def __init__(self, variables: list[Any], wide: bool, shared: _SharedBuffer | None = None
                 ) -> None:
        self.variables = variables
        self.shared = shared  # a buffer taken in turn with other buckets, else its own
        kinds = {np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype) for v in variables}
        common = np.dtype(np.float64) if wide else np.result_type(*kinds)
        if common.kind != "f":  # bfloat16 (ml_dtypes): MPI has no sum for it
            common = np.dtype(np.float32)
        self.dtype = tf.as_dtype(common)
        self.sizes = [int(np.prod(v.shape)) for v in variables]
        self.buffer: np.ndarray | None = None
        dtype, sizes = self.dtype, self.sizes

        def gather() -> tf.Tensor:
            return tf.concat([tf.reshape(tf.cast(v, dtype), [-1]) for v in variables], 0)

        def scatter(flat: tf.Tensor, scale: tf.Tensor) -> None:
            flat = flat * tf.cast(scale, dtype)
            for v, part in zip(variables, tf.split(flat, sizes)):
                v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))

        self._gather = tf.function(gather)
        self._scatter = tf.function(scatter)

    def gather(self) -> np.ndarray:
        """The variables' values, concatenated, in a writable aligned buffer."""
        flat = self._gather()
        if self.shared is not None:
            out = self.shared.take(sum(self.sizes), np.dtype(self.dtype.as_numpy_dtype))
            np.copyto(out, host_view(flat))
            return out
        buf = self.buffer
        if buf is None or held(buf):
            buf = self.buffer = aligned_empty((sum(self.sizes),),
                                              np.dtype(self.dtype.as_numpy_dtype))
        np.copyto(buf, host_view(flat))
        return buf

    def scatter(self, flat: np.ndarray, scale: float) -> None:
        """Assigns ``flat * scale`` back to the variables."""
        self._scatter(as_tensor(flat), tf.constant(scale, tf.float64))
