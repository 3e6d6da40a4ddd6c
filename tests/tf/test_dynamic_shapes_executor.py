"""Boundary shapes known only at run time ([Note: dynamic boundaries] in
tfsmp/runtime/dynamic_shapes.py): resolved from input shapes, posted as receives, and checked.

The executor tests run two ranks over the threaded local backend with a transfer-only schedule
(as tests/tf/test_executor_buffers.py does); before this change a boundary of shape ``(None,)``
raised "Tensors crossing stages need fully known per-sample shapes".
"""

from __future__ import annotations

import threading
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfsmp.comm.local import create_local_comms
from tfsmp.errors import StepError
from tfsmp.graph.tracer import trace
from tfsmp.partitioning.plan import Boundary, StagePlan
from tfsmp.runtime.dynamic_shapes import BoundaryShapes, ShapeResolver
from tfsmp.runtime.executor import Executor, MicroBatch
from tfsmp.runtime.hooks import StepMode
from tfsmp.schedule.actions import Action, Op
from tfsmp.schedule.placement import Placement
from tfsmp.topology import Topology

K = 2  # microbatches per step


def _seq_model(per_token: bool = True) -> keras.Model:
    keras.utils.set_random_seed(0)
    L = keras.layers
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = L.Embedding(20, 8, name="embed")(tokens)
    a = L.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = L.Add(name="res")([h, a])
    pooled = L.GlobalAveragePooling1D(name="pool")(h)
    cls = L.Dense(3, name="cls")(pooled)
    return keras.Model(tokens, [cls, L.Dense(5, name="tok")(h)] if per_token else cls)


def _plan(traced: Any, first_stage: set[str]) -> StagePlan:
    names = [n.name for n in traced.graph if not n.is_input]
    return StagePlan.from_assignment(traced.graph, {n: 0 if n in first_stage else 1 for n in names}, 2)


def test_boundary_shapes_follow_the_input_shapes_and_are_cached() -> None:
    traced = trace(_seq_model())
    plan = _plan(traced, {"embed", "mha"})
    shapes = BoundaryShapes.for_plan(traced, plan)
    assert shapes is not None
    by_tensor = {b.tensor: b.index for b in plan.boundaries}
    assert {b.tensor: b.shape for b in plan.boundaries} == {"embed:0:0": (None, 8),
                                                           "mha:0:0": (None, 8)}
    for length in (7, 12):
        mb = MicroBatch({"tokens:0:0": tf.zeros((4, length), tf.int32)}, size=4)
        got = shapes.of(mb)
        assert got == {by_tensor["embed:0:0"]: (4, length, 8), by_tensor["mha:0:0"]: (4, length, 8)}
        assert shapes.of(mb) is got  # one resolution per input-shape signature
    assert len(shapes._cache) == 2


def test_a_plan_with_static_boundaries_resolves_nothing() -> None:
    traced = trace(_seq_model(per_token=False))
    names = [n.name for n in traced.graph if not n.is_input]
    stage_of = {n: 0 for n in names}
    stage_of.update(cls=1)  # only the pooled (static) tensor crosses
    assert BoundaryShapes.for_plan(traced, StagePlan.from_assignment(traced.graph, stage_of, 2)) is None


def test_output_shapes_keep_unknown_dimensions_unknown() -> None:
    traced = trace(_seq_model())
    resolver = ShapeResolver(traced, traced.output_keys)
    assert resolver.shapes({"tokens:0:0": (None, None)}) == {"cls:0:0": (None, 3),
                                                             "tok:0:0": (None, None, 5)}
    assert resolver.calls and resolver.input_keys == ["tokens:0:0"]


class _Shapeless(keras.layers.Layer):
    """Claims an output length nobody can know in advance (as a value-dependent op would)."""

    def call(self, x: Any) -> Any:
        return x

    def compute_output_shape(self, shape: Any) -> Any:
        return (shape[0], None, shape[2])


def test_a_shape_that_does_not_follow_from_the_inputs_is_a_clear_error() -> None:
    x = keras.Input((6, 3), name="x")
    h = _Shapeless(name="shapeless")(keras.layers.Dense(4, name="d")(x))
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    traced = trace(keras.Model(x, keras.layers.Dense(2, name="out")(pooled)))
    plan = _plan(traced, {"d", "shapeless"})
    shapes = BoundaryShapes.for_plan(traced, plan)
    assert shapes is not None
    with pytest.raises(StepError, match=r"must follow from the shapes of the model's inputs\. "
                                        r"Received: 'shapeless:0:0' has per-sample shape "
                                        r"\(None, 4\)"):
        shapes.of(MicroBatch({"x:0:0": tf.zeros((2, 6, 3))}, size=2))


# -- the executor over the local backend ---------------------------------------------------------

class _Lengths:
    """A stand-in for `BoundaryShapes`: every microbatch has this rank's current length."""

    def __init__(self) -> None:
        self.length = 5

    def of(self, mb: MicroBatch) -> dict[int, tuple[int, ...]]:
        return {0: (mb.size, self.length)}


class _DynamicTransfer(Executor):
    """Rank 0 sends a ``(1, length)`` tensor per microbatch; rank 1 receives and keeps it."""

    def __init__(self, group: Any) -> None:
        b = Boundary(0, "a:0:0", 0, (1,), (None,), "float32", 4)
        plan = StagePlan(2, {"a": 0, "b": 1}, (b,), (), "test")
        if group.rank == 0:
            actions = [Action(0, Op.SEND_F, i, 1) for i in range(K)]
        else:
            actions = [Action(1, Op.RECV_F, i, 0) for i in range(K)]
        self.lengths = _Lengths()
        super().__init__(actions, {}, plan, group, 2, K, placement=Placement(2, 2),
                         shapes=self.lengths)  # type: ignore[arg-type]
        self.got: dict[int, tf.Tensor] = {}
        self.sent_length: int | None = None  # what rank 0 really sends (None: its own length)

    def _post_receives(self) -> None:
        super()._post_receives()
        if self.group.rank == 0:
            n = self.sent_length or self.lengths.length
            for i in range(K):
                self.step_state.produced[(0, i)] = {0: tf.fill((1, n), float(10 * n + i))}

    def _recv_forward(self, a: Any) -> None:
        _, ts = self._collect(a)
        self.got[a.microbatch] = ts[0]

    def step(self, length: int) -> dict[int, tf.Tensor]:
        self.lengths.length, self.got = length, {}
        self.run([MicroBatch({}, size=1) for _ in range(K)], mode=StepMode())
        return self.got


def _run_pair(pair: tuple[_DynamicTransfer, _DynamicTransfer], lengths: list[tuple[int, int]]
              ) -> tuple[list[dict[int, tf.Tensor]], list[BaseException], list[BaseException]]:
    """Steps both ranks; ``lengths[k]`` is (rank 0's, rank 1's) length at step k."""
    out: list[dict[int, tf.Tensor]] = []
    errors: list[BaseException] = []
    mine: list[BaseException] = []

    def rank0() -> None:
        try:
            for l0, _ in lengths:
                pair[0].step(l0)
        except BaseException as e:  # reported by the test
            errors.append(e)

    t = threading.Thread(target=rank0)
    t.start()
    try:
        for _, l1 in lengths:
            out.append(dict(pair[1].step(l1)))
    except StepError as e:
        mine.append(e)
    t.join(30)
    return out, errors, mine


def _pair() -> tuple[_DynamicTransfer, _DynamicTransfer]:
    comms = create_local_comms(Topology(world_size=2, partitions=2), timeout=20)
    return _DynamicTransfer(comms[0].pipeline), _DynamicTransfer(comms[1].pipeline)


def test_changing_lengths_arrive_intact_and_each_shape_keeps_its_buffer() -> None:
    pair = _pair()
    steps, errors, mine = _run_pair(pair, [(5, 5), (9, 9)])
    assert not errors and not mine
    rings = [{k: [id(s.buf) for s in ring] for k, ring in pair[1].pool.rings.items()}]
    del steps  # the received tensors alias their buffers: drop them so the buffers are free
    steps, errors, mine = _run_pair(pair, [(5, 5), (9, 9), (5, 5)])
    assert not errors and not mine
    for got, n in zip(steps, (5, 9, 5)):
        for i, t in got.items():
            assert t.shape == (1, n)
            np.testing.assert_array_equal(t.numpy(), np.full((1, n), 10 * n + i, np.float32))
    rings.append({k: [id(s.buf) for s in ring] for k, ring in pair[1].pool.rings.items()})
    assert sorted(k[-1] for k in rings[1]) == [(1, 5), (1, 9)]  # one ring per stream and shape
    nine = next(k for k in rings[0] if k[-1] == (1, 9))
    assert rings[1][nine] == rings[0][nine]  # the last step's shape kept its buffers


def test_ranks_whose_batches_disagree_get_a_clear_error_not_garbage() -> None:
    pair = _pair()
    _, errors, mine = _run_pair(pair, [(4, 6)])  # rank 0 sends length 4, rank 1 expects 6
    assert not errors
    assert len(mine) == 1
    with pytest.raises(StepError, match=r"Every rank of a pipeline must see batches of the same "
                                        r"shapes\. Received: stage 0 sent 'a:0:0' of microbatch 0 "
                                        r"with shape \(1, 4\); this rank's inputs give \(1, 6\)"):
        raise mine[0]


def test_a_tensor_unlike_its_resolved_shape_is_refused_by_its_sender() -> None:
    pair = _pair()
    pair[0].sent_length = 7  # the stage computed length 7 where 5 was resolved
    pair[1].stall_timeout = 1.0  # its peer stops (an MPI job would abort): do not wait long
    _, errors, _ = _run_pair(pair, [(5, 5)])
    assert len(errors) == 1 and isinstance(errors[0], StepError)
    assert "Received: 'a:0:0' of microbatch 0 has shape (1, 7), expected (1, 5)" in str(errors[0])


def test_dry_step_outputs_have_exact_or_unknown_lengths() -> None:
    from tfsmp.keras.model import _dry_zeros

    assert _dry_zeros(tf.constant(3), (12, 5), "float32").shape == (3, 12, 5)
    seen = []

    @tf.function(input_signature=[tf.TensorSpec((None, None), tf.int32)])
    def traced(x: tf.Tensor) -> tf.Tensor:
        z = _dry_zeros(tf.shape(x)[0], (None, 5), "float32")
        seen.append(z.shape.as_list())
        return z

    traced(tf.zeros((2, 4), tf.int32))
    assert seen == [[None, None, 5]]


def test_a_layer_whose_call_takes_no_training_gets_none_when_its_shape_is_resolved() -> None:
    # Keras's run_layer_test model calls its layer with training=; Keras strips it for a layer
    # whose call has no such argument, compute_output_spec does not: an Embedding raised
    # "unexpected keyword argument 'training'" before the first step
    class Wrapper(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.layer = keras.layers.Embedding(4, 3)

        def call(self, x: Any, training: bool = False) -> Any:
            return self.layer(x, training=training)

    model = Wrapper()
    model(np.zeros((2, 3), np.int64))
    traced = trace(model)
    resolver = ShapeResolver(traced, traced.output_keys)
    (key,) = resolver.input_keys
    assert list(resolver.shapes({key: (None, 5)}).values()) == [(None, 5, 3)]
