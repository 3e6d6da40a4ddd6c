"""A stage learns how a lookup's sparse gradient combines over microbatches ([Note: sparse
structure] in tfsmp/runtime/gradients.py) without holding activations: the slice counts come from
a trace's static shapes, and the stage runs only where a count is known at run time alone."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers as L
from keras import ops

from tfsmp.graph.tracer import trace
from tfsmp.partitioning.plan import StagePlan
from tfsmp.runtime.gradients import CONCAT, SUM
from tfsmp.runtime.stage import StageProgram

pytestmark = pytest.mark.tf
SEQ, VOCAB, DIM = 6, 20, 8


class TokenAndPosition(L.Layer):
    """keras-io's TokenAndPositionEmbedding: a lookup per token, and one of ``arange``."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.token = L.Embedding(VOCAB, DIM, name="token")
        self.position = L.Embedding(SEQ, DIM, name="position")

    def call(self, x: Any) -> Any:
        return self.token(x) + self.position(ops.arange(0, ops.shape(x)[-1], 1))


class NonzeroLookup(L.Layer):
    """Looks up only the nonzero ids: how many rows it reads depends on the values."""

    def build(self, shape: Any) -> None:
        self.table = self.add_weight(shape=(VOCAB, DIM), name="table")

    def call(self, x: Any) -> Any:
        ids = tf.boolean_mask(x, x > 0)
        return tf.reduce_sum(tf.gather(self.table, ids), 0, keepdims=True) + tf.zeros(
            (tf.shape(x)[0], DIM))


def _program(lookup: L.Layer) -> tuple[StageProgram, list[tf.Tensor]]:
    keras.utils.set_random_seed(0)
    x = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = lookup(x)
    if len(h.shape) == 3:
        h = L.GlobalAveragePooling1D(name="pool")(h)
    traced = trace(keras.Model(x, L.Dense(2, name="out")(h)))
    plan = StagePlan.from_assignment(traced.graph, {n.name: 0 for n in traced.graph
                                                    if not n.is_input}, 1, planner="file")
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(4, SEQ)).astype("int32")
    return StageProgram(traced, plan, 0), [tf.constant(ids)]


def _rules(program: StageProgram, inputs: list[tf.Tensor]) -> tuple[dict[str, str], list[bool]]:
    """The measured rule per variable, and whether each run of the stage was eager."""
    eager: list[bool] = []
    run = program._eval_fn

    def observed(*args: Any) -> Any:
        eager.append(tf.executing_eagerly())
        return run(*args)

    program._eval_fn = observed  # type: ignore[method-assign]
    tables = [i for i, v in enumerate(program.trainable) if len(v.shape) == 2 and v.shape[1] == DIM
              and v.shape[0] in (VOCAB, SEQ)]
    consts = tf.constant([4.0, 4.0, 1.0, 1.0])
    rules = program._measure_sparse(inputs, [], consts, tables)
    return {program.trainable[i].path: r for i, r in rules.items()}, eager


def test_the_rules_come_from_a_trace_that_never_runs_the_stage() -> None:
    program, inputs = _program(TokenAndPosition(name="tpe"))
    rules, eager = _rules(program, inputs)
    assert rules == {"tpe/token/embeddings": CONCAT, "tpe/position/embeddings": SUM}
    assert eager and not any(eager)  # traced twice (one and two microbatches), never run


def test_a_count_known_only_at_run_time_is_measured_by_running_the_stage() -> None:
    program, inputs = _program(NonzeroLookup(name="nz"))
    rules, eager = _rules(program, inputs)
    assert rules == {"nz/table": CONCAT}
    assert any(eager)
