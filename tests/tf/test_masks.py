"""Keras masks cross stage cuts as boundary tensors ([Note: masks] in tfsmp.graph.tracer).

Every case cuts a model through a masked tensor, runs each stage's calls on the model inputs and
ONLY the plan's boundary tensors (copied, so no ``_keras_mask`` rides along), and compares the
outputs and the output masks with ``model(x)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras.src.backend import get_keras_mask

from tfsmp.errors import StepError
from tfsmp.graph.deferred import deferred_scope, materialize
from tfsmp.graph.tracer import TracedModel, trace
from tfsmp.partitioning.plan import StagePlan
from tfsmp.runtime.dynamic_shapes import BoundaryShapes, ShapeResolver

# Keras warns when a layer that does not propagate masks (keras_hub's PositionEmbedding, a nested
# Functional) is called on a masked tensor: expected here, plain Keras warns the same.
pytestmark = [pytest.mark.tf,
              pytest.mark.filterwarnings("ignore:Layer .* does not support masking:UserWarning")]

VOCAB, DIM, SEQ, BATCH = 20, 8, 7, 5


def _tokens(seq: int = SEQ, seed: int = 0) -> np.ndarray:
    """Token ids with trailing zeros (padding) of different lengths."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (BATCH, seq)).astype("int32")
    lengths = np.array([seq, 3, 1, seq - 2, 2])[:BATCH]
    ids[np.arange(seq)[None, :] >= lengths[:, None]] = 0
    return ids


def _ids_input(dynamic: bool) -> keras.KerasTensor:
    return keras.Input((None,) if dynamic else (SEQ,), dtype="int32", name="ids")


def _emb(x: Any) -> Any:
    return layers.Embedding(VOCAB, DIM, mask_zero=True, name="emb")(x)


def build_attention(dynamic: bool) -> tuple[keras.Model, str]:
    """Embedding(mask_zero) | MHA reading the query/key masks -> Dense (the mask reaches the output)."""
    ids = _ids_input(dynamic)
    h = _emb(ids)
    a = layers.MultiHeadAttention(2, 4, name="mha")(h, h)
    return keras.Model(ids, layers.Dense(3, name="head")(a)), "emb"


def build_lstm(dynamic: bool) -> tuple[keras.Model, str]:
    """Embedding(mask_zero) | LSTM(return_sequences) -> TimeDistributed(Dense): masked output."""
    ids = _ids_input(dynamic)
    h = layers.LSTM(6, return_sequences=True, name="lstm")(_emb(ids))
    return keras.Model(ids, layers.TimeDistributed(layers.Dense(3), name="td")(h)), "emb"


def build_gru(dynamic: bool) -> tuple[keras.Model, str]:
    """Embedding(mask_zero) -> Dense | GRU (last state): the output has no mask."""
    ids = _ids_input(dynamic)
    h = layers.Dense(DIM, name="proj")(_emb(ids))
    return keras.Model(ids, layers.GRU(5, name="gru")(h)), "proj"


def build_masking_pool(dynamic: bool) -> tuple[keras.Model, str]:
    """Masking | GlobalAveragePooling1D (averages the unmasked steps only) -> Dense."""
    x = keras.Input((None if dynamic else SEQ, 4), name="x")
    h = layers.Masking(0.0, name="masking")(x)
    h = layers.Dense(DIM, name="proj")(h)
    pooled = layers.GlobalAveragePooling1D(name="gap")(h)
    return keras.Model(x, layers.Dense(2, name="head")(pooled)), "proj"


def build_time_distributed(dynamic: bool) -> tuple[keras.Model, str]:
    """Embedding(mask_zero) -> Dense | TimeDistributed(Dense) -> Dense: the mask reaches the output."""
    ids = _ids_input(dynamic)
    h = layers.Dense(DIM, name="proj")(_emb(ids))
    h = layers.TimeDistributed(layers.Dense(4), name="td")(h)
    return keras.Model(ids, layers.Dense(3, name="head")(h)), "proj"


def build_reversible(dynamic: bool) -> tuple[keras.Model, str]:
    """ReversibleEmbedding(mask_zero) attaches its mask only in call() (none when traced
    symbolically) | MHA reads it."""
    ids = _ids_input(dynamic)
    h = layers.ReversibleEmbedding(VOCAB, DIM, mask_zero=True, name="emb")(ids)
    a = layers.MultiHeadAttention(2, 4, name="mha")(h, h)
    return keras.Model(ids, layers.Dense(3, name="head")(a)), "emb"


def build_hub_encoder(dynamic: bool) -> tuple[keras.Model, str]:
    """keras_hub TokenAndPositionEmbedding(mask_zero) (a mask attached in call()) |
    TransformerEncoder, which reads it as its padding mask -> pooled."""
    ids = _ids_input(dynamic)
    h = keras_hub.layers.TokenAndPositionEmbedding(VOCAB, SEQ, DIM, mask_zero=True,
                                                   name="emb")(ids)
    h = keras_hub.layers.TransformerEncoder(16, 2, name="encoder")(h)
    pooled = layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(ids, layers.Dense(3, name="head")(pooled)), "emb"


def build_nested(dynamic: bool) -> tuple[keras.Model, str]:
    """A nested model traced without masks, called on a masked tensor and cut inside: its
    inner tensors carry the mask when the model runs | MHA reads it."""
    inner_in = keras.Input((None, DIM), name="inner_in")
    inner_out = layers.Dense(DIM, name="inner_b")(layers.Dense(DIM, name="inner_a")(inner_in))
    inner = keras.Model(inner_in, inner_out, name="inner")
    ids = _ids_input(dynamic)
    h = inner(_emb(ids))
    a = layers.MultiHeadAttention(2, 4, name="mha")(h, h)
    return keras.Model(ids, layers.Dense(3, name="head")(a)), "inner_a"


def _floats(seq: int) -> np.ndarray:
    """(BATCH, seq, 4) with all-zero (masked) steps at the ends of some rows."""
    x = np.random.default_rng(1).normal(size=(BATCH, seq, 4)).astype("float32")
    x[1, 3:] = 0.0
    x[2, 1:] = 0.0
    x[4, 2:] = 0.0
    return x


CASES: dict[str, tuple[Callable[[bool], tuple[keras.Model, str]], Callable[[int], np.ndarray]]] = {
    "attention": (build_attention, _tokens),
    "lstm": (build_lstm, _tokens),
    "gru": (build_gru, _tokens),
    "masking_pool": (build_masking_pool, _floats),
    "time_distributed": (build_time_distributed, _tokens),
    "reversible": (build_reversible, _tokens),
    "hub_encoder": (build_hub_encoder, _tokens),
    "nested": (build_nested, _tokens),
}


def _cut_after(traced: TracedModel, layer: str) -> StagePlan:
    """Two stages: the layers up to ``layer`` in topological order, then the rest."""
    order = [n for n in traced.graph.topological_order() if not traced.graph.nodes[n].is_input]
    end = order.index(layer)
    return StagePlan.from_assignment(
        traced.graph, {n: int(i > end) for i, n in enumerate(order)}, num_stages=2)


def _wire(value: Any) -> tf.Tensor:
    """What a receiver gets: the same values in a new tensor, without ``_keras_mask``."""
    return tf.constant(np.asarray(value))


def _stage_fn(traced: TracedModel, plan: StagePlan, stage: int) -> Callable[..., dict[str, Any]]:
    """Stage ``stage``'s interpreter: inputs and received tensors -> what it sends (and, on the
    last stage, the model outputs and their masks)."""
    names = set(plan.layers(stage))
    keep = [b.tensor for b in plan.send_boundaries(stage)]
    if stage == plan.num_stages - 1:
        keep += traced.output_keys + [k for k in traced.output_mask_keys if k]

    def body(inputs: dict[str, Any], received: dict[str, Any]) -> dict[str, Any]:
        out = traced.run({**inputs, **received}, layer_names=names)
        return {k: out[k] for k in keep if k in out}

    return body


def run_stages(traced: TracedModel, plan: StagePlan, x: Any,
               compiled: bool = False) -> tuple[list[Any], list[Any]]:
    """Runs each stage on the inputs and ONLY its received boundaries (in a tf.function when
    ``compiled``, whose results carry no masks); returns the last stage's outputs and masks."""
    inputs = traced.pack_inputs(x)
    sent: dict[str, Any] = {}
    env: dict[str, Any] = {}
    for stage in range(plan.num_stages):
        received = {b.tensor: _wire(sent[b.tensor]) for b in plan.recv_boundaries(stage)}
        body = _stage_fn(traced, plan, stage)
        env = tf.function(body)(inputs, received) if compiled else body(inputs, received)
        sent.update({b.tensor: env[b.tensor] for b in plan.send_boundaries(stage)})
    return [env[k] for k in traced.output_keys], traced.output_masks(env)


def _build(name: str, dynamic: bool) -> tuple[keras.Model, TracedModel, StagePlan, np.ndarray]:
    build, data = CASES[name]
    keras.utils.set_random_seed(3)
    with deferred_scope():
        model, cut = build(dynamic)
    traced = trace(model)
    materialize(model.variables)
    return model, traced, _cut_after(traced, cut), data(SEQ)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(CASES))
def test_outputs_and_output_masks_equal_keras_across_a_cut(name: str, dynamic: bool) -> None:
    model, traced, plan, x = _build(name, dynamic)
    masks = [b.tensor for b in plan.boundaries if b.tensor.endswith("#mask")]
    assert masks, f"the cut must cross a mask: {[b.tensor for b in plan.boundaries]}"
    assert all(b.dtype == "bool" for b in plan.boundaries if b.tensor in masks)
    expected = model(x)
    want_mask = get_keras_mask(expected)
    for compiled in (False, True):
        (got,), (got_mask,) = run_stages(traced, plan, x, compiled=compiled)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)
        assert (got_mask is None) == (want_mask is None)
        if want_mask is not None:
            np.testing.assert_array_equal(np.asarray(got_mask), np.asarray(want_mask))


def test_a_cut_without_masks_reproduces_the_model_with_the_masks_attached() -> None:
    _, traced, _, x = _build("attention", dynamic=False)
    values = traced.run(traced.pack_inputs(x))
    out = traced.pack_outputs([values[k] for k in traced.output_keys], traced.output_masks(values))
    np.testing.assert_array_equal(np.asarray(get_keras_mask(out)), np.asarray(x != 0))
    bare = traced.pack_outputs([_wire(values[k]) for k in traced.output_keys])
    assert get_keras_mask(bare) is None  # nothing attached unless masks are given


def test_mask_keys_are_companions_of_their_tensors() -> None:
    _, traced, plan, _ = _build("attention", dynamic=False)
    g = traced.graph
    assert traced.masks == {"emb:0:0": "emb:0:0#mask", "mha:0:0": "mha:0:0#mask",
                            "head:0:0": "head:0:0#mask"}
    assert g.masks == traced.masks
    assert traced.output_mask_keys == ["head:0:0#mask"]
    assert g.outputs == ["head:0:0", "head:0:0#mask"]
    info = g.tensors["emb:0:0#mask"]
    assert (info.producer, info.shape, info.dtype, info.bytes_per_sample) == (
        "emb", (SEQ,), "bool", SEQ)
    assert g.consumers("emb:0:0#mask") == g.consumers("emb:0:0") == ["mha"]
    # the cut sends the embedding and its mask, in that order, and prices the mask's bytes
    assert [(b.tensor, b.bytes_per_sample) for b in plan.boundaries] == [
        ("emb:0:0", SEQ * DIM * 4), ("emb:0:0#mask", SEQ)]
    assert plan.stages[0].send_bytes == SEQ * DIM * 4 + SEQ


def test_keras_ops_do_not_read_masks() -> None:
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    h = _emb(ids)
    model = keras.Model(ids, keras.ops.sum(h, axis=-1))
    traced = trace(model)
    op = next(c for c in traced.calls if c.layer_name.startswith("ops."))
    assert op.input_mask_keys == [None] and op.output_mask_keys == [None]
    assert traced.graph.consumers("emb:0:0#mask") == []


def test_mask_boundaries_of_dynamic_length_resolve_from_the_input_shapes() -> None:
    _, traced, plan, _ = _build("attention", dynamic=True)
    shapes = BoundaryShapes.for_plan(traced, plan)
    assert shapes is not None
    resolver = ShapeResolver(traced, ["emb:0:0#mask", "head:0:0#mask", "emb:0:0"])
    assert resolver.shapes({"ids:0:0": (3, 11)}) == {
        "emb:0:0#mask": (3, 11), "head:0:0#mask": (3, 11), "emb:0:0": (3, 11, DIM)}


class _MaskWhenInferring(layers.Layer):
    """Attaches a mask in inference only: a stage could not know whether to send one."""

    def call(self, x: Any, training: bool | None = None) -> Any:
        out = x * 1.0
        if not training:
            keras.src.backend.set_keras_mask(out, keras.ops.not_equal(x[..., 0], 0.0))
        return out


def test_a_mask_that_comes_and_goes_is_a_clear_error() -> None:
    x = keras.Input((SEQ, 4), name="x")
    model = keras.Model(x, layers.Dense(2, name="head")(_MaskWhenInferring(name="flaky")(x)))
    traced = trace(model)
    assert traced.masks == {"flaky:0:0": "flaky:0:0#mask", "head:0:0": "head:0:0#mask"}
    data = _floats(SEQ)
    traced(data)  # inference: as traced
    with pytest.raises(StepError, match=r"must attach the same Keras masks .* Received: layer "
                                        r"'flaky' returned no mask for 'flaky:0:0'"):
        traced(data, training=True)
