"""Host buffers of pipeline messages: zero-copy views for sends, aligned receive buffers aliased by tensors.

Example::

    pool = ReceivePool(plan.boundaries, limit=16, dynamic=False)
    buf = pool.buffer(("F", 1, 0, 0), boundary, (64, 128))      # a free buffer of the stream's ring
    t = pool.tensor(boundary, buf)                              # aliases buf through DLPack
    host_view(tensor)                                          # a send's buffer, no copy
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tfsmp.partitioning.plan import Boundary

__all__ = ["ReceivePool", "aligned_empty", "as_tensor", "direct_type", "held", "host_view",
           "pool_tensor", "send_buffer", "send_view", "wire", "wired"]


def wire(buf: np.ndarray) -> np.ndarray:
    """A view MPI can move: ml_dtypes types (bfloat16) travel as unsigned ints of equal size."""
    if not wired(buf.dtype):
        return buf
    return buf.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[buf.dtype.itemsize])


def wired(dtype: np.dtype[Any]) -> bool:
    """Whether `wire` views arrays of ``dtype`` as another type (MPI knows no ml_dtypes)."""
    return dtype.kind not in "biufc"


def host_view(t: tf.Tensor, dtype: np.dtype[Any] | None = None) -> np.ndarray:
    """The tensor's host memory as a read-only array, without a copy where TF allows it.

    A memoryview of a CPU EagerTensor exports its buffer (and keeps the tensor alive while the
    array lives, so the send may complete later); `.numpy()` would copy it. Types the buffer
    protocol does not describe (bfloat16), and tensors on other devices, are copied. ``dtype``,
    the numpy type the caller expects, saves looking up the tensor's (a few microseconds).
    """
    try:
        arr = np.asarray(memoryview(t))
    except (TypeError, ValueError, NotImplementedError):
        return np.ascontiguousarray(t.numpy())
    if arr.dtype != (t.dtype.as_numpy_dtype if dtype is None else dtype) or not arr.flags.c_contiguous:
        return np.ascontiguousarray(t.numpy())
    return arr


def send_view(t: tf.Tensor, dtype: np.dtype[Any]) -> np.ndarray:
    """What a send hands MPI for ``t``: an array over the tensor's own memory when it holds
    ``dtype`` contiguously, else `host_view`.

    [Note: send views] A CPU EagerTensor's ``_numpy()`` is an array over the tensor's buffer,
    not a copy (``numpy()`` copies what ``_numpy()`` returns), whose base keeps the buffer
    alive while MPI reads it. Measured in one process (2026-12-06): made and released in
    0.50 us, against 1.07 us for a memoryview (the tensor exports its buffer through a second
    protocol) and about 1.6 us for `host_view`'s array over that view. A send's view is made
    between a message's arrival and the next send ([Note: message handlers] in executor.py),
    so the difference is on a transfer's critical path. Tensors on other devices, and any that
    ``_numpy()`` does not give as such an array, take `host_view`. Sends of types the buffer
    protocol describes hand MPI the tensor itself instead, cheaper still right after a copy
    ([Note: direct sends], `send_buffer`); this is their fallback."""
    try:
        arr = t._numpy()  # noqa: SLF001 (TensorFlow's EagerTensor: [Note: send views])
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return host_view(t, dtype)
    if type(arr) is not np.ndarray or arr.dtype != dtype or not arr.flags.c_contiguous:
        return host_view(t, dtype)
    return arr


@functools.cache
def direct_type(dtype: np.dtype[Any]) -> int | None:
    """The TensorFlow type enum of ``dtype`` where `send_buffer` may hand MPI the tensor itself
    (a type the buffer protocol describes: bools, integers, floats), else None."""
    if dtype.kind not in _DLPACK_KINDS:
        return None
    return int(tf.as_dtype(dtype).as_datatype_enum)


def send_buffer(t: tf.Tensor, dtype: np.dtype[Any], enum: int | None) -> Any:
    """What a send hands MPI for ``t``: the tensor itself where its type is ``enum`` (the
    boundary's, `direct_type`), else `send_view`.

    [Note: direct sends] mpi4py takes a message's memory through the buffer protocol, which a
    CPU EagerTensor exports, so the tensor can be the buffer: no Python object is made to get
    its memory, and the request keeps the tensor alive until MPI is done with it. Measured in
    raw non-blocking ping-pongs (receives posted ahead, one job per size, 41 rounds, 2026-12-06,
    AMD EPYC host), against blocking `Send`/`Recv` of the same tensor's memory: sending the
    tensor ran at 0.883 (256 KB) and 1.008 (1 MB) of raw, its `_numpy()` array at 0.808 and
    0.952, a memoryview at 0.864 and 0.984, one array made before the loop at 0.953 and 1.037.
    In one process `_numpy()` is the cheaper call ([Note: send views]); right after a message's
    copy, making any object costs more than the buffer export does. The type check is the
    tensor's enum against the boundary's (a tensor of another type, or one that exports no
    buffer, takes `send_view`)."""
    if enum is not None:
        try:
            if t._datatype_enum() == enum:  # noqa: SLF001 (EagerTensor: [Note: direct sends])
                return t
        except AttributeError:  # not an EagerTensor
            pass
    return send_view(t, dtype)


_ALIGN = 64  # TensorFlow's CPU allocator alignment (EIGEN_MAX_ALIGN_BYTES)
_DLPACK_KINDS = "biuf"  # numpy kinds DLPack carries (bool, ints, floats) -- not ml_dtypes


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    offset = -raw.ctypes.data % _ALIGN
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def as_tensor(buf: np.ndarray) -> tf.Tensor:
    """A tensor of a received buffer: aliasing it through DLPack where the type allows
    (see [Note: receive buffers]), else a copy."""
    aligned = buf.__array_interface__["data"][0] % _ALIGN == 0
    return pool_tensor(buf, buf.dtype.kind in _DLPACK_KINDS and aligned)


def pool_tensor(buf: np.ndarray, dlpack: bool) -> tf.Tensor:
    """`as_tensor` of a buffer known to be aligned (`aligned_empty`): ``dlpack`` is whether its
    type can alias, decided once per boundary ([Note: message plan])."""
    if dlpack:
        return tf.experimental.dlpack.from_dlpack(buf.__dlpack__())
    return tf.convert_to_tensor(buf)


def _refcount(buf: np.ndarray) -> int:
    return sys.getrefcount(buf)


def _count_unheld() -> int:
    """The count `held` sees for an array referenced only by its owner and a caller's name,
    measured through the same calls (Python versions differ in which references they count)."""
    owner = {0: np.empty(1, dtype=np.uint8)}
    buf = owner[0]
    return _count_through_held(buf)


def _count_through_held(buf: np.ndarray) -> int:
    return _refcount(buf)


_UNHELD = _count_unheld()


def held(buf: np.ndarray, extra: int = 0) -> bool:
    """True while something besides its owner references ``buf`` (a DLPack tensor does).

    Call it as ``held(name)`` where ``name`` is a local bound to the owner's array (a dict value
    or an attribute); ``extra`` is for further references the caller knows of."""
    return _refcount(buf) > _UNHELD + extra


@dataclass
class _Slot:
    """One buffer of a ring and the step that last took it."""

    buf: np.ndarray
    step: int


class ReceivePool:
    """The receive buffers of one executor's messages: a small ring per message stream.

    [Note: receive buffers] A received message becomes a tensor without a copy: the buffer
    is 64-byte aligned and handed to TensorFlow through DLPack, so the tensor aliases it.
    The messages of one stream (one boundary tensor between one pair of stages, in one
    direction: microbatch after microbatch) share a ring of buffers, kept from step to step
    (the engine keeps one executor per schedule, `tfsmp.runtime.executors.Executors`). A
    receive takes a buffer of its ring that is free, i.e. that nothing else references: not
    a receive in flight (the executor's posted request keeps it) and not a tensor made from
    it (a DLPack tensor keeps a reference to its array until TensorFlow frees the tensor,
    so the array's reference count says so, `held`); only when none is free does the ring
    grow. So a stage that consumes each received tensor before the next arrives (the last
    stage, and every backward receive) cycles through one buffer, as it has one receive in
    flight at a time ([Note: receives ahead] in executor.py), which stays in the CPU's caches,
    where one buffer per message of the step would write every microbatch to memory that left them
    (at 256 KB messages that alone made a ping-pong 3x slower, `benchmarks/bench_p2p.py`);
    and a tensor kept beyond its step (an output the user kept, say) keeps its buffer: when
    a ring grows, the buffers still held that an earlier step took are left to their
    tensors. Fresh buffers every step would cost page faults (2-5x the transfer itself) and
    a copy into a TF tensor costs as much again. Types DLPack cannot carry (bfloat16) are
    copied into a tensor when received, so their buffers are free again at once. A step that
    ended early (an exception) may leave receives posted into its buffers, so the next step
    starts a new pool. A ring is kept per stream and shape: with shapes known only at run time
    ([Note: dynamic boundaries]) batches alternating between a few lengths reuse theirs; past
    `limit` rings the pool starts afresh, which bounds its memory.
    """

    def __init__(self, boundaries: Iterable[Boundary], limit: int, dynamic: bool) -> None:
        self.rings: dict[tuple[Any, ...], list[_Slot]] = {}
        self.limit = limit  # rings (streams x shapes) kept
        self.dynamic = dynamic
        self.step = 0  # counts `begin_step` calls: which step took a buffer
        # [Note: message plan] in executor.py: a boundary's numpy type and whether DLPack can
        # alias it, decided once
        self.dtypes = {b.index: np.dtype(tf.as_dtype(b.dtype).as_numpy_dtype) for b in boundaries}
        self.dlpack = {i: d.kind in _DLPACK_KINDS for i, d in self.dtypes.items()}

    def reset(self) -> None:
        """Starts a new pool (a step that ended early may have left receives posted)."""
        self.rings = {}

    def begin_step(self) -> None:
        """A step starts: buffers taken from now on belong to it."""
        self.step += 1

    def buffer(self, stream: tuple[Any, ...], b: Boundary, shape: tuple[int, ...]) -> np.ndarray:
        """A free buffer of ``stream``'s ring for a message of ``shape``; the caller keeps a
        reference to it until the message is in (that marks it taken)."""
        key = (*stream, shape)
        ring = self.rings.get(key)
        if ring is None:
            if len(self.rings) >= self.limit:
                self.rings = {}
            ring = self.rings[key] = []
        for slot in ring:
            buf = slot.buf
            if not held(buf):
                slot.step = self.step
                return buf
        step = self.step  # none free: leave earlier steps' held buffers to their tensors
        ring[:] = [slot for slot in ring if slot.step == step]
        buf = aligned_empty(shape, self.dtypes[b.index])
        ring.append(_Slot(buf, step))
        return buf

    def tensor(self, b: Boundary, buf: np.ndarray) -> tf.Tensor:
        """The tensor of a received buffer of this pool (aligned: `aligned_empty`)."""
        return pool_tensor(buf, self.dlpack[b.index])

    def buffers(self) -> list[np.ndarray]:
        """Every buffer the rings hold (tests and memory accounting)."""
        return [slot.buf for ring in self.rings.values() for slot in ring]
