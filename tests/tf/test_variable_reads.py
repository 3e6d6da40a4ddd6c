"""A tie exists only where a call reads the variable ([Note: variable reads] in tfsmp.graph.reads).

keras_hub Llama / Mistral / Phi-3 call one `ReversibleEmbedding(tie_weights=False)` twice, and each
call reads one of its two matrices: no tie. Gemma / GPT-2 (`tie_weights=True`) read one matrix in
both calls: one tie. The other ties (a layer called twice, a variable passed to `keras.ops`) are
pinned in test_tracer.py, tests/pure/test_partition_ties.py and tests/mpi/test_tied_weights.py.
"""

from __future__ import annotations

from typing import Any

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

from tfsmp.graph.deferred import deferred_scope, is_deferred
from tfsmp.graph.reads import record_reads
from tfsmp.graph.tracer import TracedModel, trace
from tfsmp.partitioning.plan import StagePlan

pytestmark = pytest.mark.tf

VOCAB, DIM = 40, 16


def _paths(variables: Any) -> list[str]:
    return [v.path for v in variables]


def llama() -> keras.Model:
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=32)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def gemma() -> keras.Model:
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=32, head_dim=8)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _embedding_nodes(traced: TracedModel) -> dict[str, list[str]]:
    return {n: _paths(traced.variables_of([n])) for n in traced.graph.nodes
            if traced.graph.nodes[n].keras_layer == "token_embedding"}


def test_llama_reversible_embedding_untied_is_no_tie() -> None:
    traced = trace(llama())
    assert traced.graph.ties == []
    nodes = _embedding_nodes(traced)
    assert sorted(nodes.values()) == [["token_embedding/embeddings"],
                                      ["token_embedding/reverse_embeddings"]]
    g = traced.graph
    assert {n: g.nodes[n].param_bytes for n in nodes} == {n: VOCAB * DIM * 4 for n in nodes}
    assert sum(n.param_bytes for n in g) == sum(int(np.prod(v.shape)) * 4
                                                for v in traced.model.weights)
    # stage 0 holds the input embedding, the last stage the output one, and nothing is copied
    order = [n for n in g.topological_order() if not g.nodes[n].is_input]
    plan = StagePlan.from_assignment(g, {n: int(i >= len(order) // 2) for i, n in
                                         enumerate(order)}, num_stages=2)
    assert plan.ties == () and all(s.copy_bytes == 0 for s in plan.stages)


def test_gemma_tied_embedding_is_exactly_one_tie() -> None:
    traced = trace(gemma())
    (tie,) = traced.graph.ties
    assert tie.variables == ("token_embedding/embeddings",)
    assert sorted(tie.nodes) == sorted(_embedding_nodes(traced))
    assert tie.param_bytes == VOCAB * DIM * 4
    assert all(v == ["token_embedding/embeddings"] for v in _embedding_nodes(traced).values())


def _reversible(tie_weights: bool) -> keras.Model:
    ids = keras.Input((5,), dtype="int32", name="ids")
    emb = layers.ReversibleEmbedding(VOCAB, DIM, tie_weights=tie_weights, name="emb")
    h = layers.Dense(DIM, name="mid")(emb(ids))
    return keras.Model(ids, emb(h, reverse=True))


def test_the_reads_of_each_call_are_recorded_without_allocating() -> None:
    with deferred_scope():
        model = _reversible(tie_weights=False)
    traced = trace(model)
    forward, mid, reverse = traced.calls
    assert _paths(record_reads(forward).values()) == ["emb/embeddings"]
    assert _paths(record_reads(reverse).values()) == ["emb/reverse_embeddings"]
    assert _paths(record_reads(mid).values()) == ["mid/kernel", "mid/bias"]
    assert all(is_deferred(v) for v in model.variables)  # recording ran nothing
    assert traced.graph.ties == []
    assert {c.layer_name: _paths(traced.variables_of([c.layer_name])) for c in traced.calls} == {
        "emb": ["emb/embeddings"], "mid": ["mid/kernel", "mid/bias"],
        "emb@1": ["emb/reverse_embeddings"]}
    x = np.random.default_rng(0).integers(0, VOCAB, (3, 5)).astype("int32")
    from tfsmp.graph.deferred import materialize
    materialize(model.variables)
    np.testing.assert_array_equal(np.asarray(traced(x)), np.asarray(model(x)))


def test_tied_reversible_embedding_is_one_tie() -> None:
    traced = trace(_reversible(tie_weights=True))
    assert [(t.nodes, t.variables) for t in traced.graph.ties] == [
        (("emb", "emb@1"), ("emb/embeddings",))]


class _Both(layers.Layer):
    """Reads ``a`` when called on one input, ``a`` and ``b`` when called on two."""

    def build(self, shape: Any) -> None:
        self.a = self.add_weight((DIM, DIM), name="a")
        self.b = self.add_weight((DIM, DIM), name="b")
        self.unused = self.add_weight((2,), name="unused")

    def call(self, x: Any, y: Any = None) -> Any:
        out = ops.matmul(x, self.a)
        return out if y is None else out + tf.gather(self.b, [0]) * y

    def compute_output_shape(self, shape: Any) -> Any:
        return shape


def test_a_tie_covers_only_the_variables_both_calls_read() -> None:
    x = keras.Input((DIM,), name="x")
    both = _Both(name="both")
    h = both(x)
    h = layers.Dense(DIM, name="mid")(h)
    traced = trace(keras.Model(x, both(h, x)))
    assert [(t.nodes, t.variables) for t in traced.graph.ties] == [
        (("both", "both@1"), ("both/a",))]
    # b is read only by the second call (through tf.gather); unused stays with the first call
    assert _paths(traced.variables_of(["both"])) == ["both/a", "both/unused"]
    assert _paths(traced.variables_of(["both@1"])) == ["both/a", "both/b"]
    assert traced.graph.nodes["both"].variables == ("both/a", "both/unused")
    assert traced.graph.nodes["both@1"].variables == ("both/b",)


class _EagerOnly(layers.Layer):
    """A call that runs only on real data (it reads a value in Python)."""

    def build(self, shape: Any) -> None:
        self.w = self.add_weight((DIM,), name="w")
        self.v = self.add_weight((DIM,), name="v")

    def call(self, x: Any) -> Any:
        scale = float(np.asarray(ops.convert_to_numpy(ops.max(x))))
        return x * self.w * scale

    def compute_output_shape(self, shape: Any) -> Any:
        return shape


def test_a_call_that_cannot_run_on_placeholders_reads_all_its_layer_variables() -> None:
    x = keras.Input((DIM,), name="x")
    eager = _EagerOnly(name="eager")
    traced = trace(keras.Model(x, eager(layers.Dense(DIM, name="mid")(eager(x)))))
    assert [(t.nodes, t.variables) for t in traced.graph.ties] == [
        (("eager", "eager@1"), ("eager/w", "eager/v"))]
