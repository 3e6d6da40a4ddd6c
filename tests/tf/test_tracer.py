"""tfsmp.graph.tracer and costs: every kind of Keras model -> LayerGraph + a faithful interpreter."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import keras
import models  # tests/tf/models.py (pytest puts this directory on sys.path)
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

from tfsmp.errors import StepError, TraceError
from tfsmp.graph.costs import forward_flops, profile
from tfsmp.graph.deferred import deferred_scope, is_deferred, materialize
from tfsmp.graph.tracer import TracedModel, trace

pytestmark = pytest.mark.tf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (node count including inputs, {layer: calls} for layers called more than once)
EXPECTED = {
    "mlp": (4, {}),
    "cnn": (11, {}),
    "multi_io": (9, {}),
    "shared": (5, {}),  # shared's second call is the tied copy "shared@1"
    "transformer": (11, {}),
    "nested": (11, {}),   # every encoder/block layer has 2 calls, one node each: checked below
    "sequential": (5, {}),
    "subclassed": (12, {}),  # d2 has 2 calls, one node each: checked below
}


def _traced(name: str, seed: int = 1) -> tuple[keras.Model, TracedModel, Any]:
    build, data = models.ZOO[name]
    with deferred_scope():
        model = build(seed=seed)
    x, _ = data(6, seed=2)
    traced = trace(model, sample_input=x if name == "subclassed" else None)
    assert any(is_deferred(v) for v in model.variables)  # tracing allocated nothing
    materialize(model.variables)
    return model, traced, x


@pytest.fixture(scope="module")
def zoo() -> dict[str, tuple[keras.Model, TracedModel, Any]]:
    return {name: _traced(name) for name in models.ZOO}


def _ids(variables: Any) -> list[int]:
    return [id(v) for v in variables]  # Keras variables compare elementwise, not by identity


def _flat(y: Any) -> list[np.ndarray]:
    return [np.asarray(t) for t in keras.tree.flatten(y)]


@pytest.mark.parametrize("name", list(models.ZOO))
def test_run_reproduces_the_model_exactly(zoo: dict, name: str) -> None:
    model, traced, x = zoo[name]
    expected, got = model(x), traced(x)
    assert type(got) is type(expected)
    for a, b in zip(_flat(expected), _flat(got), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(models.ZOO))
def test_graph_shape_and_keys(zoo: dict, name: str) -> None:
    _, traced, _ = zoo[name]
    g = traced.graph
    count, multi = EXPECTED[name]
    assert len(g) == count
    if name not in ("nested", "subclassed"):  # auto-named repeats: checked in their own tests
        assert {n.name: n.calls for n in g if n.calls > 1} == multi
    for c in traced.calls:  # [Note: tensor keys]
        layer = c.keras_name or c.layer_name  # a tied copy's tensors carry its layer's name
        assert c.output_keys == [f"{layer}:{c.call_index}:{i}" for i in range(len(c.output_keys))]
        assert all(k in g.tensors for k in c.input_keys)
    assert g.outputs == traced.output_keys and g.inputs == traced.input_keys
    assert g.topological_order()[: len(g.inputs)] == [k.split(":")[0] for k in g.inputs]
    assert sum(n.param_bytes for n in g) == sum(
        int(np.prod(v.shape)) * 4 for v in traced.model.weights)


def test_mlp_edges_carry_bytes_per_sample(zoo: dict) -> None:
    _, traced, _ = zoo["mlp"]
    d0, d1, d2 = (c.layer_name for c in traced.calls)
    assert traced.graph.edges() == {("x", d0): 64, (d0, d1): 128, (d1, d2): 128}
    assert traced.graph.nodes[d0].param_bytes == (16 * 32 + 32) * 4
    assert traced.graph.nodes[d0].activation_bytes == 128


def test_shared_layer_is_one_node_per_call_tied_by_its_variables(zoo: dict) -> None:
    # Before tied copies a shared layer was one node whose calls made the cycle shared <-> mid,
    # one group; now each call is a node and the two hold copies of one kernel.
    _, traced, _ = zoo["shared"]
    g = traced.graph
    assert [(c.layer_name, c.output_keys[0]) for c in traced.calls
            if "shared" in (c.layer_name, c.keras_name)] == [
        ("shared", "shared:0:0"), ("shared@1", "shared:1:0")]
    assert ("shared", "mid") in g.edges() and ("mid", "shared@1") in g.edges()
    assert g.groups() == [["x"], ["shared"], ["mid"], ["shared@1"], ["head"]]
    assert [(t.nodes, t.variables) for t in g.ties] == [
        (("shared", "shared@1"), ("shared/kernel", "shared/bias"))]
    assert g.nodes["shared@1"].param_bytes == 0 and g.nodes["shared@1"].layer == "shared"
    assert _ids(traced.variables_of(["shared@1"])) == _ids(traced.variables_of(["shared"]))


def test_nested_models_flatten_to_leaf_layers(zoo: dict) -> None:
    model, traced, _ = zoo["nested"]
    g = traced.graph
    assert not {"encoder", "block", "head"} & set(g.nodes)
    encoder = model.get_layer("encoder")
    inside = {lay.name for lay in encoder.layers + encoder.get_layer("block").layers}
    leaves = [n for n in g.nodes if g.nodes[n].layer]  # second calls: tied copies
    assert len(leaves) == 3 and {g.nodes[n].layer for n in leaves} <= inside
    assert len(g.ties) == 3
    first = traced.calls[0]
    assert first.input_keys == ["left:0:0"]
    assert f"{first.layer_name}:1:0" in g.tensors  # the right branch is call 1
    assert _ids(traced.variables_of(g.nodes)) == _ids(model.weights)


class _Residual(keras.Model):
    """A subclassed model used as a layer of a Functional model."""

    def __init__(self) -> None:
        super().__init__(name="residual")
        self.a = layers.Dense(8, activation="relu", name="res_a")
        self.b = layers.Dense(8, name="res_b")

    def call(self, x: Any) -> Any:
        return self.b(self.a(x)) + x


def test_subclassed_model_nested_in_a_functional_one_is_flattened() -> None:
    with deferred_scope():
        x = keras.Input((8,), name="x")
        model = keras.Model(x, layers.Dense(2, name="out")(_Residual()(x)))
    traced = trace(model)
    assert list(traced.graph.nodes) == ["x", "res_a", "res_b", "ops.add", "out"]
    assert traced.calls[2].input_keys == ["res_b:0:0", "x:0:0"]
    assert traced.output_names == ["out"]
    materialize(model.variables)
    data = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    np.testing.assert_array_equal(np.asarray(model(data)), np.asarray(traced(data)))


def test_multi_io_packs_inputs_by_name_and_outputs_as_dict(zoo: dict) -> None:
    _, traced, x = zoo["multi_io"]
    assert traced.input_names == ["a", "b"] and traced.output_names == ["aux", "main"]
    packed = traced.pack_inputs(x)
    assert list(packed) == ["a:0:0", "b:0:0"]
    assert traced.pack_inputs([x["a"], x["b"]]).keys() == packed.keys()
    out = traced(x)
    assert set(out) == {"main", "aux"}
    with pytest.raises(StepError, match=r"must match the model's 2 inputs .* Received: 1 values"):
        traced.pack_inputs([x["a"]])


def test_stage_interpreter_runs_a_subset_then_the_rest(zoo: dict) -> None:
    model, traced, x = zoo["transformer"]
    names = traced.graph.topological_order()
    first = set(names[:5])
    env = traced.run(traced.pack_inputs(x), layer_names=first)
    boundary = {k: v for k, v in env.items() if k.split(":")[0] in first}
    rest = traced.run(boundary, layer_names=set(names[5:]))
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(rest[traced.output_keys[0]]))


def test_training_flag_reaches_the_layers(zoo: dict) -> None:
    model, traced, x = zoo["cnn"]
    np.testing.assert_array_equal(np.asarray(model(x, training=True)),
                                  np.asarray(traced(x, training=True)))
    _, seq, xs = zoo["sequential"]  # its Dropout is active only when told so
    assert not np.array_equal(np.asarray(seq(xs, training=True)), np.asarray(seq(xs)))


def test_subclassed_model_becomes_layers_and_named_ops(zoo: dict) -> None:
    model, traced, _ = zoo["subclassed"]
    g = traced.graph
    assert [n for n in g.nodes if n.startswith("ops.")] == [
        "ops.mean", "ops.relu", "ops.multiply", "ops.add"]
    assert g.nodes[f"{model.d2.name}@1"].layer == model.d2.name  # d2's second call
    assert g.nodes["ops.multiply"].variables == ("subclassed/scale",)  # a model weight used in call
    assert _ids(traced.variables_of(["ops.multiply"])) == _ids([model.scale])
    again = trace(model, sample_input=np.zeros((2, 8, 8, 1), "float32"))
    assert list(again.graph.tensors) == list(g.tensors)  # op names don't follow Keras's counters


def test_a_subclassed_model_called_once_needs_no_sample() -> None:
    model = models.build_subclassed(seed=2)
    x, _ = models.data_subclassed(3, seed=1)
    expected = model(x)
    traced = trace(model)  # the input shape comes from the build
    assert traced.input_keys == ["input:0:0"]
    np.testing.assert_array_equal(np.asarray(expected), np.asarray(traced(x)))


def test_unbuilt_sequential_needs_a_sample() -> None:
    with deferred_scope():
        model = models.build_sequential(seed=0, built=False)
    with pytest.raises(TraceError, match=r"needs a sample of its input\. Received: model "
                                         r"'sequential_net' \(Sequential\) is not built"):
        trace(model)
    traced = trace(model, sample_input=np.zeros((2, 10), "float32"))
    assert len(traced.graph) == 5


class _RawTF(keras.Model):
    def __init__(self) -> None:
        super().__init__(name="raw_tf")
        self.dense = layers.Dense(4)

    def call(self, x: Any) -> Any:
        return tf.nn.relu(self.dense(x))


class _TrainingBranch(keras.Model):
    def __init__(self) -> None:
        super().__init__(name="branchy")
        self.a, self.b = layers.Dense(4), layers.Dense(4)

    def call(self, x: Any, training: bool | None = None) -> Any:
        h = self.a(x)
        return self.b(h) if training else h


def test_raw_tensorflow_in_call_is_a_trace_error_with_the_ways_out() -> None:
    with pytest.raises(TraceError) as info:
        trace(_RawTF(), sample_input=np.zeros((2, 3), "float32"))
    line = inspect.getsourcelines(_RawTF.call)[1] + 1
    assert str(info.value) == (
        "A subclassed model's call() must use only Keras layers and keras.ops on its tensors so "
        "tfsmp can trace it (no raw TensorFlow ops, no Python control flow on tensor values). "
        f"Received: model 'raw_tf' (_RawTF) at test_tracer.py:{line} "
        "`return tf.nn.relu(self.dense(x))` raised ValueError: A KerasTensor cannot be used as "
        "input to a TensorFlow function. Either wrap that code in a keras.layers.Layer (its "
        "call() may use any TensorFlow op and Python control flow; tfsmp then treats it as one "
        "layer), or partition the model manually with smp.partition.")


def test_branching_on_training_is_a_trace_error() -> None:
    with pytest.raises(TraceError, match=r"same layers with training=True and training=False\. "
                                         r"Received: model 'branchy' .*smp\.partition"):
        trace(_TrainingBranch(), sample_input=np.zeros((2, 3), "float32"))


def test_layers_of_one_name_in_two_nested_models_are_keyed_by_their_model() -> None:
    """[Note: nested names]: keras_hub's CLIP has an 'embedding' in each encoder; the later one
    is keyed by its model's path (it was a TraceError: issue 26)."""
    def inner(tag: str) -> keras.Model:
        x = keras.Input((4,))
        return keras.Model(x, layers.Dense(4, name="proj")(x), name=tag)

    x = keras.Input((4,), name="x")
    model = keras.Model(x, inner("one")(inner("two")(x)))
    traced = trace(model)
    assert [c.layer_name for c in traced.calls] == ["proj", "one/proj"]
    assert traced.layer("one/proj") is model.get_layer("one").get_layer("proj")


class _Tied(layers.Layer):
    """Output projection with the transposed embedding matrix of another layer."""

    def __init__(self, embedding: layers.Embedding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h: Any) -> Any:
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def test_layers_sharing_a_trainable_variable_are_tied() -> None:
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    emb = layers.Embedding(20, 8, name="emb")
    h = layers.Dense(8, name="body")(emb(tokens))
    model = keras.Model(tokens, _Tied(emb, name="tied")(h))
    traced = trace(model)
    # before tied copies: colocate [{emb, tied}] and one group emb..tied
    assert traced.graph.colocate == []
    assert [t.nodes for t in traced.graph.ties] == [("emb", "tied")]
    assert traced.graph.groups() == [["tokens"], ["emb"], ["body"], ["tied"]]
    assert traced.graph.nodes["tied"].param_bytes == 0  # counted once, on the embedding
    assert _ids(traced.variables_of(["tied"])) == _ids([emb.embeddings])


def test_layers_with_state_called_twice_stay_one_node() -> None:
    x = keras.Input((8,), name="x")
    drop = layers.Dropout(0.5, seed=3, name="drop")
    traced = trace(keras.Model(x, drop(layers.Dense(8, name="mid")(drop(x)))))
    assert traced.graph.groups() == [["x"], ["drop", "mid"]]  # the seed advances in call order
    assert traced.graph.ties == []


def test_flops_match_hand_formulas(zoo: dict) -> None:
    x = keras.Input((8,))
    dense = layers.Dense(16, activation="relu")
    y = dense(x)
    assert forward_flops(dense, (x,), {}, [x], [y]) == 2 * 8 * 16 + 16 + 16

    img = keras.Input((12, 12, 3))
    conv = layers.Conv2D(8, 3, padding="same", activation="relu")
    out = conv(img)
    assert forward_flops(conv, (img,), {}, [img], [out]) == 2 * (12 * 12 * 8) * (3 * 3 * 3) + 2 * (12 * 12 * 8)

    _, traced, _ = zoo["transformer"]
    t, d, h, k = 10, 16, 2, 8   # sequence, model width, heads, key_dim
    projections = 3 * (2 * t * d * h * k) + 2 * t * h * k * d
    attention = 2 * h * t * t * k + 5 * h * t * t + 2 * h * t * t * k
    biases = 3 * t * h * k + t * d
    node = traced.graph.nodes["attention"]
    assert node.flops_forward == projections + attention + biases
    assert node.flops_backward == 2 * node.flops_forward
    emb = next(n for n in traced.graph if n.kind == "Embedding")
    assert emb.flops_forward == emb.flops_backward == t * d


def test_profile_measures_each_layer_and_leaves_deferred_weights_deferred() -> None:
    with deferred_scope():
        model = models.build_mlp(seed=5)
    traced = trace(model)
    x, _ = models.data_mlp(32, seed=0)
    seconds = profile(traced, x, repeats=1)
    assert set(seconds) == {c.layer_name for c in traced.calls}
    assert all(s > 0 and traced.graph.nodes[n].measured_seconds == s for n, s in seconds.items())
    assert all(is_deferred(v) for v in model.weights)


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import keras
    from tfsmp.graph.deferred import deferred_scope
    from tfsmp.graph.tracer import trace

    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024

    class Big(keras.Model):
        def __init__(self):
            super().__init__()
            self.stack = [keras.layers.Dense(8192) for _ in range(16)]

        def call(self, x):
            for layer in self.stack:
                x = layer(x)
            return x

    base = peak()
    with deferred_scope():
        x = keras.Input((8192,), name="x")
        h = x
        for _ in range(16):
            h = keras.layers.Dense(8192)(h)
        functional = trace(keras.Model(x, h))
    after_functional = peak()
    subclassed = trace(Big(), sample_input=keras.KerasTensor((None, 8192)))
    print(json.dumps(dict(
        gib=[functional.graph.total_param_bytes() / 2**30, subclassed.graph.total_param_bytes() / 2**30],
        functional=after_functional - base, subclassed=peak() - base)))
""")


def test_tracing_a_4gb_model_takes_almost_no_memory() -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
           "TF_NUM_INTEROP_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, REPO], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(g > 4.0 for g in result["gib"])
    assert result["functional"] < 200 and result["subclassed"] < 200  # MiB of peak RSS
