"""Host buffers of pipeline messages: zero-copy views for sends, aligned receive buffers aliased by tensors.

Example::

    pool = ReceivePool(plan.boundaries, limit=16, dynamic=False)
    buf = pool.buffer(("F", 1, 0, 3, 0), boundary, (64, 128))   # reused while no tensor holds it
    t = pool.tensor(boundary, buf)                              # aliases buf through DLPack
    host_view(tensor)                                          # a send's buffer, no copy
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from tfsmp.partitioning.plan import Boundary

__all__ = ["ReceivePool", "aligned_empty", "as_tensor", "held", "host_view", "pool_tensor", "wire"]


def wire(buf: np.ndarray) -> np.ndarray:
    """A view MPI can move: ml_dtypes types (bfloat16) travel as unsigned ints of equal size."""
    if buf.dtype.kind in "biufc":
        return buf
    return buf.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[buf.dtype.itemsize])


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


class ReceivePool:
    """The receive buffers of one executor's messages, kept from step to step.

    [Note: receive buffers] A received message becomes a tensor without a copy: the buffer
    is 64-byte aligned and handed to TensorFlow through DLPack, so the tensor aliases it.
    Fresh buffers every step would cost page faults (2-5x the transfer itself) and a copy
    into a TF tensor costs as much again (`benchmarks/bench_p2p.py`), so each message of
    the schedule keeps its buffer from step to step (the engine keeps one executor per
    schedule, `tfsmp.runtime.executors.Executors`), reused only when no tensor holds it
    any more: a tensor made through DLPack keeps a reference to its array until TensorFlow
    frees the tensor, so the array's reference count says whether it is free. A buffer still
    held (an output the user kept, say) is left to its tensor and the message gets a new
    one. Types DLPack cannot carry (bfloat16) are copied into a tensor when received, so
    their buffers are always free. A step that ended early (an exception) may leave
    receives posted into its buffers, so the next step starts a new pool. With shapes known
    only at run time ([Note: dynamic boundaries]) a message keeps one buffer per shape, so
    batches alternating between a few lengths reuse theirs; past `limit` messages and
    shapes (4 shapes per message) the pool starts afresh, which bounds its memory.
    """

    def __init__(self, boundaries: Iterable[Boundary], limit: int, dynamic: bool) -> None:
        self.buffers: dict[tuple[Any, ...], np.ndarray] = {}
        self.limit = limit  # messages x shapes kept with dynamic shapes
        self.dynamic = dynamic
        # [Note: message plan] in executor.py: a boundary's numpy type and whether DLPack can
        # alias it, decided once
        self.dtypes = {b.index: np.dtype(tf.as_dtype(b.dtype).as_numpy_dtype) for b in boundaries}
        self.dlpack = {i: d.kind in _DLPACK_KINDS for i, d in self.dtypes.items()}

    def reset(self) -> None:
        """Starts a new pool (a step that ended early may have left receives posted)."""
        self.buffers = {}

    def buffer(self, key: tuple[Any, ...], b: Boundary, shape: tuple[int, ...]) -> np.ndarray:
        """The receive buffer of one message: the one it had last step unless that is taken."""
        dtype = self.dtypes[b.index]
        if self.dynamic:
            key = (*key, shape)
            if key not in self.buffers and len(self.buffers) >= self.limit:
                self.buffers = {}
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype or held(buf):
            buf = self.buffers[key] = aligned_empty(shape, dtype)
        return buf

    def tensor(self, b: Boundary, buf: np.ndarray) -> tf.Tensor:
        """The tensor of a received buffer of this pool (aligned: `aligned_empty`)."""
        return pool_tensor(buf, self.dlpack[b.index])
