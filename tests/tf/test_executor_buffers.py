"""The executor's reused receive buffers ([Note: receive buffers] in tfsmp/runtime/buffers.py).

A received tensor aliases its buffer (DLPack), so a buffer may be reused only once no tensor
holds it. These tests run a two-rank transfer-only schedule on the threaded local backend and
check that a tensor kept from one step keeps its values through later steps, that tensors held
within a step never share a buffer, that a stream whose tensors are consumed cycles through a
ring of `_AHEAD` buffers that become its tensors without a copy, that a dropped tensor's buffer
is reused, that sends go out of the tensor's own memory, and that every dtype a boundary can
carry arrives intact.
"""

from __future__ import annotations

import threading
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfsmp.comm.local import create_local_comms
from tfsmp.partitioning.plan import Boundary, StagePlan
from tfsmp.runtime.buffers import direct_type, host_view, pool_tensor, send_buffer, send_view
from tfsmp.runtime.executor import _AHEAD, Executor, MicroBatch, aligned_empty, as_tensor
from tfsmp.runtime.hooks import StepMode
from tfsmp.schedule.actions import Action, Op
from tfsmp.schedule.placement import Placement
from tfsmp.topology import Topology

K = 3  # microbatches per step


def _address(t: tf.Tensor) -> int:
    """Where a CPU tensor's values are (its buffer, exported without a copy)."""
    return int(np.asarray(memoryview(t)).ctypes.data)


class _Transfer(Executor):
    """Rank 0 sends ``payload(step, i)`` forward; rank 1 receives it and keeps the tensors."""

    def __init__(self, group: Any, dtype: str, width: int) -> None:
        b = Boundary(0, "a:0:0", 0, (1,), (width,), dtype, width * 4)
        plan = StagePlan(2, {"a": 0, "b": 1}, (b,), (), "test")
        if group.rank == 0:
            actions = [Action(0, Op.SEND_F, i, 1) for i in range(K)]
        else:
            actions = [a for i in range(K) for a in (Action(1, Op.RECV_F, i, 0),)]
        super().__init__(actions, {}, plan, group, 2, K, placement=Placement(2, 2))
        self.dtype, self.width = dtype, width
        self.got: dict[int, tf.Tensor] = {}
        self.step_no = 0
        self.keep = True  # False: drop each tensor once checked, as a stage consumes its input
        self.seen: list[tuple[int, bool]] = []  # rank 1: (address, values right) per tensor

    def payload(self, i: int) -> tf.Tensor:
        values = np.arange(self.width, dtype=np.float64) + 1000 * self.step_no + 10 * i
        return tf.constant(values.reshape(1, -1).astype(tf.as_dtype(self.dtype).as_numpy_dtype))

    def _post_receives(self) -> None:
        super()._post_receives()
        if self.group.rank == 0:
            for i in range(K):
                self.step_state.produced[(0, i)] = {0: self.payload(i)}

    def _recv_forward(self, a: Any) -> None:
        _, ts = self._collect(a)
        if self.keep:
            self.got[a.microbatch] = ts[0]
        else:
            right = np.array_equal(ts[0].numpy(), _expected(self, self.step_no, a.microbatch))
            self.seen.append((_address(ts[0]), right))

    def step(self) -> dict[int, tf.Tensor]:
        self.got = {}
        self.run([MicroBatch({}, size=1) for _ in range(K)], mode=StepMode())
        self.step_no += 1
        return self.got


def _pair(dtype: str, width: int = 37) -> tuple[_Transfer, _Transfer]:
    comms = create_local_comms(Topology(world_size=2, partitions=2), timeout=30)
    return _Transfer(comms[0].pipeline, dtype, width), _Transfer(comms[1].pipeline, dtype, width)


def _steps(pair: tuple[_Transfer, _Transfer], n: int) -> list[dict[int, tf.Tensor]]:
    """Runs ``n`` steps on both ranks; returns rank 1's received tensors per step."""
    out: list[dict[int, tf.Tensor]] = []
    errors: list[BaseException] = []

    def rank0() -> None:
        try:
            for _ in range(n):
                pair[0].step()
        except BaseException as e:  # reported by the test
            errors.append(e)

    t = threading.Thread(target=rank0)
    t.start()
    for _ in range(n):
        out.append(dict(pair[1].step()))
    t.join(30)
    assert not errors, errors
    return out


def _expected(sender: _Transfer, step: int, i: int) -> np.ndarray:
    saved = sender.step_no
    sender.step_no = step
    try:
        return sender.payload(i).numpy()
    finally:
        sender.step_no = saved


def test_a_kept_tensor_keeps_its_values_while_later_steps_receive() -> None:
    pair = _pair("float32")
    first = _steps(pair, 1)[0]
    kept = {i: t.numpy().copy() for i, t in first.items()}
    later = _steps(pair, 3)
    for i, t in first.items():
        np.testing.assert_array_equal(t.numpy(), kept[i])
        np.testing.assert_array_equal(t.numpy(), _expected(pair[0], 0, i))
    for step, got in enumerate(later, start=1):
        for i, t in got.items():
            np.testing.assert_array_equal(t.numpy(), _expected(pair[0], step, i))


def test_tensors_held_within_a_step_never_share_a_buffer() -> None:
    pair = _pair("float32", width=4096)
    for step, got in enumerate(_steps(pair, 3)):  # rank 1 keeps every tensor of a step
        assert len({_address(t) for t in got.values()}) == K
        for i, t in got.items():
            np.testing.assert_array_equal(t.numpy(), _expected(pair[0], step, i))


def test_a_consumed_stream_cycles_through_its_ring_and_receives_without_a_copy() -> None:
    pair = _pair("float32", width=4096)
    pair[1].keep = False
    _steps(pair, 4)
    assert len(pair[1].seen) == 4 * K and all(right for _, right in pair[1].seen)
    buffers = {int(b.ctypes.data) for b in pair[1]._pool}
    assert len(buffers) == _AHEAD  # one per receive posted ahead, reused step after step
    assert {address for address, _ in pair[1].seen} == buffers  # each tensor is its buffer


def test_a_buffer_kept_past_its_step_is_left_to_its_tensor_and_reused_once_dropped() -> None:
    pair = _pair("float32", width=4096)
    kept = _steps(pair, 1)[0]
    first = {_address(t) for t in kept.values()}
    later = _steps(pair, 2)
    assert not first & {_address(t) for got in later for t in got.values()}
    assert not first & {int(b.ctypes.data) for b in pair[1]._pool}  # left, the ring not grown
    assert len(pair[1]._pool) == K
    for i, t in kept.items():
        np.testing.assert_array_equal(t.numpy(), _expected(pair[0], 0, i))
    del kept, later
    pool = {int(b.ctypes.data) for b in pair[1]._pool}
    again = _steps(pair, 1)[0]  # nothing holds the ring's buffers any more: reused
    assert {_address(t) for t in again.values()} == pool


def test_a_send_goes_out_of_the_tensor_s_own_memory() -> None:
    buf = aligned_empty((3, 5), np.dtype(np.float32))
    buf[:] = 7
    t = pool_tensor(buf, True)  # a tensor whose memory is known: ``buf``
    assert _address(t) == buf.ctypes.data  # the received-tensor side: no copy
    sent = host_view(t, np.dtype(np.float32))
    assert sent.ctypes.data == buf.ctypes.data and not sent.flags.owndata  # the send side
    computed = tf.ones((3, 5)) * 2  # memory TensorFlow allocated
    assert host_view(computed).ctypes.data == _address(computed)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8", "bool"])
def test_a_send_hands_mpi_the_tensor_s_own_memory_where_its_type_is_the_boundary_s(dtype: str) -> None:
    t = tf.constant(np.arange(12).reshape(3, 4), dtype=dtype)
    want = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
    view = send_view(t, want)
    assert isinstance(view, np.ndarray) and view.dtype == want and view.flags.c_contiguous
    assert view.ctypes.data == _address(t) and not view.flags.owndata  # no copy: [Note: send views]
    np.testing.assert_array_equal(view, t.numpy())
    del t  # the array keeps the tensor's memory alive while a send may still read it
    np.testing.assert_array_equal(view, np.arange(12).reshape(3, 4).astype(want))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8", "bool"])
def test_a_send_hands_mpi_the_tensor_itself_where_its_type_is_the_boundary_s(dtype: str) -> None:
    t = tf.constant(np.arange(12).reshape(3, 4), dtype=dtype)
    want = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
    assert send_buffer(t, want, direct_type(want)) is t  # [Note: direct sends]
    view = memoryview(t)  # what mpi4py takes from it: the tensor's own memory, its type
    assert np.asarray(view).ctypes.data == _address(t) and np.asarray(view).dtype == want


def test_a_send_takes_a_view_where_the_tensor_is_not_of_the_boundary_s_type() -> None:
    b = tf.constant(np.arange(6).reshape(2, 3), dtype=tf.bfloat16)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert direct_type(bf16) is None  # no buffer-protocol format: `send_view` copies it
    assert isinstance(send_buffer(b, bf16, direct_type(bf16)), np.ndarray)
    f = tf.ones((2, 3))
    i32 = np.dtype(np.int32)
    other = send_buffer(f, i32, direct_type(i32))  # a float32 tensor on an int32 boundary
    assert isinstance(other, np.ndarray)
    arr = np.ones((2, 3), np.float32)  # not an EagerTensor
    assert isinstance(send_buffer(arr, arr.dtype, direct_type(arr.dtype)), np.ndarray)


def test_a_send_falls_back_to_an_array_where_the_view_does_not_describe_the_boundary() -> None:
    b = tf.constant(np.arange(6).reshape(2, 3), dtype=tf.bfloat16)  # no buffer-protocol format
    sent = send_view(b, np.dtype(ml_dtypes.bfloat16))
    assert isinstance(sent, np.ndarray) and sent.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(sent, b.numpy())
    f = tf.ones((2, 3))
    other = send_view(f, np.dtype(np.int32))  # the view says float32: not what the plan expects
    assert isinstance(other, np.ndarray)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64",
                                   "uint8", "bool"])
def test_every_boundary_dtype_arrives_intact_over_several_steps(dtype: str) -> None:
    pair = _pair(dtype, width=19)
    steps = _steps(pair, 3)
    for step, got in enumerate(steps):
        for i, t in got.items():
            assert t.dtype == tf.as_dtype(dtype)
            np.testing.assert_array_equal(t.numpy(), _expected(pair[0], step, i))


def test_aligned_empty_is_aligned_and_as_tensor_aliases_only_dlpack_types() -> None:
    for dtype in (np.float32, np.int8, np.float64):
        for shape in ((1, 3), (5, 7, 2), (0, 4)):
            a = aligned_empty(shape, np.dtype(dtype))
            assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
            assert a.ctypes.data % 64 == 0 or a.size == 0
    a = aligned_empty((2, 4), np.dtype(np.float32))
    a[:] = 1
    t = as_tensor(a)
    a[0, 0] = 5  # aliased: the buffer must not be touched while `t` lives (hence the pool rule)
    assert float(t[0, 0]) == 5.0
    b = aligned_empty((2, 4), np.dtype(ml_dtypes.bfloat16))
    b[:] = 1
    u = as_tensor(b)  # not a DLPack type: copied
    b[0, 0] = 5
    assert float(u[0, 0]) == 1.0


def test_fused_reducer_round_trips_mixed_variables_and_reuses_its_buffer() -> None:
    from tfsmp.runtime.engine import _FusedReducer

    variables = [tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3)),
                 tf.Variable(np.float32(7.0)),
                 tf.Variable(np.arange(4, dtype=np.float64) / 3)]
    before = [v.numpy().copy() for v in variables]
    for wide in (False, True):
        reducer = _FusedReducer(variables, wide)
        flat = reducer.gather()
        assert flat.dtype == np.float64 and flat.shape == (11,) and flat.ctypes.data % 64 == 0
        flat *= 2  # what a sum over two identical replicas gives
        reducer.scatter(flat, 0.5)
        for v, b in zip(variables, before):
            assert v.dtype == tf.as_dtype(b.dtype)
            np.testing.assert_array_equal(v.numpy(), b)
        del flat  # the test's own reference would (rightly) make the reducer take a new buffer
        first = id(reducer.buffer)
        reducer.scatter(reducer.gather(), 1.0)
        assert id(reducer.buffer) == first  # nothing held the buffer: reused
    only32 = _FusedReducer(variables[:2], wide=False)
    assert only32.gather().dtype == np.float32


def test_the_engine_keeps_one_executor_per_schedule_so_buffers_survive_steps() -> None:
    import tfsmp as smp
    from benchmarks.tfhelp import dense_stack

    if smp.is_initialized():
        smp.shutdown()
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    try:
        smp.init({"partitions": 1, "microbatches": 2})
        model = smp.DistributedModel(lambda: dense_stack(8, 2, name="kept"))
        model.compile(optimizer="sgd", loss="mse")
        model.train_on_batch(x[:16], x[:16])
        engine = model._engine
        first = engine._executor
        model.predict(x[:16], verbose=0)  # an inference schedule gets an executor of its own
        model.train_on_batch(x[16:], x[16:])
        assert engine._executor is first and first is not None
        assert len(engine._executors) == 2
    finally:
        smp.shutdown()


def test_a_wait_spins_long_only_on_a_rank_pinned_to_cores_of_its_own() -> None:
    from tfsmp.comm.mpi import SHARED_SPIN, SPIN, spin_seconds

    assert 0 < SHARED_SPIN < SPIN / 50  # a shared core's spin costs its peer little
    two = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    one_thread = {**two, "TF_NUM_INTRAOP_THREADS": "1"}
    assert spin_seconds(two, cpus=2, affinity=1) == SPIN  # --bind-to core: a core each
    assert spin_seconds(one_thread, cpus=2, affinity=2) == SHARED_SPIN  # --bind-to none: share
    assert spin_seconds(two, cpus=2, affinity=2) == 0.0  # TensorFlow may use every core
    assert spin_seconds({**two, "TF_NUM_INTRAOP_THREADS": "2"}, cpus=2, affinity=2) == 0.0
    assert spin_seconds({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, cpus=2, affinity=1) == 0.0  # over
    assert spin_seconds({"OMPI_COMM_WORLD_LOCAL_SIZE": "x"}, cpus=2, affinity=1) == 0.0
    assert spin_seconds({"MPI_LOCALNRANKS": "2"}, cpus=4, affinity=2) == SPIN
    assert spin_seconds({}, cpus=64, affinity=1) == 0.0  # ranks per host unknown
