"""The bad-input catalogue, part 2: models the tracer cannot see or that cannot be split as asked.

Every case goes through the steps `tfsmp.runtime.setup.build_engine` runs before any variable
is placed or any message is sent: trace (with `smp.partition` scopes recorded), then plan. So an
error here is raised on every rank alike (each rank traces the same model), before anything
changes. Part 1 is tests/pure/test_bad_input_catalogue.py, part 3 tests/mpi/test_bad_input.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops
from keras.src.backend.common.name_scope import current_path

import tfsmp
from tfsmp.config import Config
from tfsmp.errors import PartitionError, StepError, TraceError
from tfsmp.graph.scopes import assignment, recording
from tfsmp.graph.tracer import trace
from tfsmp.partitioning.plan import StagePlan
from tfsmp.runtime.setup import make_plan

pytestmark = pytest.mark.tf

X = np.zeros((4, 8), np.float32)
TOKENS = np.zeros((4, 6), np.int32)
WAYS_OUT = (r"A subclassed model's call\(\) must use only Keras layers and keras\.ops on its "
            r"tensors so tfsmp can trace it \(no raw TensorFlow ops, no Python control flow on "
            r"tensor values\)\. Received: ")


def plan_of(model: keras.Model, x: Any = X, **config: Any) -> StagePlan:
    """What `build_engine` does before placing anything: trace, record scopes, plan."""
    cfg = Config(**config)
    with recording() as placed:
        traced = trace(model, sample_input=x)
    manual = assignment(traced, placed) if not cfg.auto_partition else None
    return make_plan(traced, cfg, None, manual)


# -- models the tracer cannot see --------------------------------------------------------------

class RawTensorFlow(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(name="raw_tf")
        self.d = layers.Dense(8, name="d")

    def call(self, x: Any) -> Any:
        return tf.nn.relu(self.d(x))


class BranchOnValue(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(name="branchy")
        self.a, self.b = layers.Dense(8, name="a"), layers.Dense(8, name="b")

    def call(self, x: Any) -> Any:
        h = self.a(x)
        if ops.sum(h) > 0:
            return self.b(h)
        return h


class ReadsNumpy(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(name="numpy_reader")
        self.d = layers.Dense(8, name="d")

    def call(self, x: Any) -> Any:
        scale = float(np.asarray(x).max())
        return self.d(x) * scale


class LoopOverRows(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(name="row_loop")
        self.d = layers.Dense(8, name="d")

    def call(self, x: Any) -> Any:
        return ops.stack([self.d(row[None])[0] for row in x])


# -- manual placement that cannot hold ---------------------------------------------------------

class TiedHead(layers.Layer):  # type: ignore[misc]
    """An output projection tied to an embedding's matrix (it holds the embedding layer)."""

    def __init__(self, embedding: layers.Embedding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h: Any) -> Any:
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


class TiedAcrossStages(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(name="tied")
        self.emb = layers.Embedding(20, 8, name="emb")
        self.mix = layers.Dense(8, name="mix")
        self.head = TiedHead(self.emb, name="head")
        self.out = layers.Dense(4, name="out")

    def call(self, tokens: Any) -> Any:
        with tfsmp.partition(0):
            h = self.mix(self.emb(tokens))
        with tfsmp.partition(1):
            return self.out(self.head(h))


class OneLayerTwoScopes(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(name="reused")
        self.shared = layers.Dense(8, name="shared")
        self.mid = layers.Dense(8, name="mid")

    def call(self, x: Any) -> Any:
        with tfsmp.partition(0):
            h = self.mid(self.shared(x))
        with tfsmp.partition(1):
            return self.shared(h)


class Backwards(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(name="backwards")
        self.a, self.b = layers.Dense(8, name="a"), layers.Dense(8, name="b")

    def call(self, x: Any) -> Any:
        with tfsmp.partition(1):
            h = self.a(x)
        with tfsmp.partition(0):
            return self.b(h)


class Scoped(keras.Model):  # type: ignore[misc]
    """Two layers, the second inside ``smp.partition(index)``."""

    def __init__(self, index: Any) -> None:
        super().__init__(name="scoped")
        self.index = index
        self.a, self.b = layers.Dense(8, name="a"), layers.Dense(8, name="b")

    def call(self, x: Any) -> Any:
        h = self.a(x)
        with tfsmp.partition(self.index):
            return self.b(h)


def mlp(n: int = 3) -> keras.Model:
    x = keras.Input((8,), name="x")
    h = x
    for i in range(n):
        h = layers.Dense(8, name=f"d{i}")(h)
    return keras.Model(x, h, name="mlp")


def shared_cycle() -> keras.Model:
    """``bn`` (shared non-trainable statistics, which must update in call order on one stage) is
    called twice with ``mid`` between: one group of three calls, plus ``out``. (A layer with only
    trainable variables called twice gets a tied copy per call instead.)"""
    x = keras.Input((8,), name="x")
    shared = layers.BatchNormalization(name="bn")
    h = shared(layers.Dense(8, name="mid")(shared(x)))
    return keras.Model(x, layers.Dense(8, name="out")(h), name="cycle")


@dataclass(frozen=True)
class Bad:
    call: Callable[[Path], Any]
    error: type[BaseException]
    match: str


def _partition_file(stages: int) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        model = mlp(4)
        traced = trace(model)
        plan = StagePlan.from_assignment(traced.graph, {f"d{i}": i * stages // 4 for i in range(4)},
                                         stages)
        path = tmp / "plan.json"
        path.write_text(plan.to_json())
        return plan_of(model, None, partitions=2, partition_file=str(path))
    return call


MANUAL = {"partitions": 2, "auto_partition": False, "default_partition": 0}

CATALOGUE: dict[str, Bad] = {
    "raw_tensorflow_op_in_call": Bad(
        lambda tmp: plan_of(RawTensorFlow()), TraceError,
        WAYS_OUT + r"model 'raw_tf' \(RawTensorFlow\)"),
    "python_branch_on_a_tensor": Bad(
        lambda tmp: plan_of(BranchOnValue()), TraceError,
        WAYS_OUT + r"model 'branchy' \(BranchOnValue\)"),
    "numpy_read_of_a_tensor": Bad(
        lambda tmp: plan_of(ReadsNumpy()), TraceError,
        WAYS_OUT + r"model 'numpy_reader' \(ReadsNumpy\)"),
    "python_loop_over_rows": Bad(
        lambda tmp: plan_of(LoopOverRows()), TraceError,
        WAYS_OUT + r"model 'row_loop' \(LoopOverRows\)"),
    "one_layer_under_two_scopes": Bad(
        lambda tmp: plan_of(OneLayerTwoScopes(), **MANUAL), PartitionError,
        r"^A layer's variables live on one stage, so a layer cannot be called under two "
        r"smp\.partition scopes\. Received: 'shared' called under smp\.partition\(0\) and "
        r"smp\.partition\(1\)\."),
    "tensor_sent_to_an_earlier_stage": Bad(
        lambda tmp: plan_of(Backwards(), **MANUAL), PartitionError,
        r"^Stages must be ordered: a tensor may only flow to the same or a later stage\. "
        r"Received: 'a:0:0' from layer 'a' \(stage 1\) to layer 'b' \(stage 0\)\."),
    "scope_index_out_of_range": Bad(
        lambda tmp: plan_of(Scoped(2), **MANUAL), PartitionError,
        r"^A partition index must be an integer in \[0, partitions\)\. Received: "
        r"smp\.partition\(2\) around layer 'b', partitions=2\."),
    "scope_index_negative": Bad(
        lambda tmp: plan_of(Scoped(-1), **MANUAL), PartitionError,
        r"^smp\.partition takes a stage index >= 0\. Received: index=-1"),
    "more_stages_than_layers": Bad(
        lambda tmp: plan_of(mlp(3), None, partitions=4), PartitionError,
        r"^Every stage needs at least one layer, so a model with 3 layers cannot be split into "
        r"more stages\. Received: partitions=4, layers=3"),
    "more_stages_than_layer_groups": Bad(
        lambda tmp: plan_of(shared_cycle(), None, partitions=3), PartitionError,
        r"^Every stage needs at least one group of layers that must stay together .* Received: "
        r"partitions=3, groups=2"),
    "partition_file_other_stage_count": Bad(
        _partition_file(4), PartitionError,
        r"^The plan in partition_file must have partitions × virtual_stages stages\. Received: "
        r"4 stages in .*plan\.json, config wants 2\."),
    "not_a_keras_model": Bad(
        lambda tmp: tfsmp.DistributedModel(42), TypeError,
        r"^DistributedModel wraps a keras\.Model \(or a function returning one\)\. Received: int"),
    "a_layer_without_the_trainer": Bad(  # a layer with Trainer mixed in is a model: tfsmp
        # trains it ([Note: a layer with Keras's Trainer] in tfsmp/graph/tracer.py)
        lambda tmp: tfsmp.DistributedModel(keras.layers.Dense(3)), TypeError,
        r"^DistributedModel wraps a keras\.Model \(or a function returning one, or a layer that "
        r"mixes Keras's Trainer in\)\. Received: Dense, a keras Layer, not a Model\. Fix: build "),
    "a_trainer_layer_at_two_partitions": Bad(  # Keras's trainer_test.py's ExampleModel: one layer
        lambda tmp: plan_of(_trainer_layer(3), np.ones((4, 2), np.float32), partitions=2),
        PartitionError, r"^Every stage needs at least one layer, so a model with 1 layers cannot "
        r"be split into more stages\. Received: partitions=2, layers=1"),
    "subclass_called_outside_a_step": Bad(
        lambda tmp: type("Net", (tfsmp.DistributedModel,), {})()(X), StepError,
        r"^A DistributedModel subclass may be called only inside an smp\.step function"),
}



def _trainer_layer(units: int) -> keras.layers.Layer:
    """A layer with Keras's trainer mixed in, as trainer_test.py's ExampleModel."""
    from keras.src.trainers.trainer import Trainer

    class _TrainerLayer(Trainer, keras.layers.Dense):  # type: ignore[misc]
        def __init__(self, units: int) -> None:
            keras.layers.Dense.__init__(self, units=units)
            Trainer.__init__(self)

    return _TrainerLayer(units)


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_bad_model_is_refused_before_anything_is_placed(name: str, tmp_path: Path) -> None:
    bad = CATALOGUE[name]
    with pytest.raises(bad.error, match=bad.match):
        bad.call(tmp_path)
    # a refusal leaves Keras's global state as it found it: a name scope left open made every
    # later variable's path start with the refused layer's name ([Note: a leaked name scope])
    assert current_path() == "", name
    assert keras.Variable(1.0, name="probe").path == "probe", name


def test_automatic_partitioning_gives_tied_layers_a_copy_per_stage() -> None:
    # the scopes are ignored; a memory-weighted plan splits this tiny model between mix and head
    # (the default optimize="memory" now takes the best compute split within the rank's cap,
    # which keeps emb and head together here: no copies at all)
    plan = plan_of(TiedAcrossStages(), TOKENS, partitions=2, memory_weight=0.8)
    assert plan.stage_of == {"emb": 0, "mix": 0, "head": 1, "out": 1}
    assert [(t.nodes, t.stages) for t in plan.ties] == [(("emb", "head"), (0, 1))]


def test_manual_scopes_may_split_tied_layers_into_copies() -> None:
    """Before tied copies this raised "Layers that share a variable must be on one stage"."""
    plan = plan_of(TiedAcrossStages(), TOKENS, **MANUAL)
    assert plan.stage_of == {"emb": 0, "mix": 0, "head": 1, "out": 1}
    assert [(t.nodes, t.stages) for t in plan.ties] == [(("emb", "head"), (0, 1))]
