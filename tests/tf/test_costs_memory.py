"""Cost fixes for real models: a reversed embedding is a matmul, unknown dimensions come from a
batch or a hint, and what layers keep for backward is measured."""

from __future__ import annotations

import keras
import keras_hub
import numpy as np

from tfsmp.graph import costs
from tfsmp.graph.tracer import trace

VOCAB, DIM, SEQ = 1000, 64, 32


def _gpt2() -> keras.Model:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=DIM, intermediate_dim=128,
        max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def test_a_reversed_embedding_is_costed_as_the_matmul_it_is() -> None:
    graph = trace(_gpt2()).graph
    lookup, head = graph.nodes["token_embedding"], graph.nodes["token_embedding@0"]
    # per position (the sequence length is unknown, so 1): 2 x DIM x VOCAB forward, 2x backward
    assert head.flops_forward == 2 * DIM * VOCAB
    assert head.flops_backward == 2 * head.flops_forward
    assert lookup.flops_forward == DIM  # one per output element


def test_unknown_dimensions_come_from_the_first_batch() -> None:
    traced = trace(_gpt2())
    before = {n.name: n.flops_forward for n in traced.graph}
    x = {"token_ids": np.ones((2, SEQ), "int32"), "padding_mask": np.ones((2, SEQ), "bool")}
    assert costs.resolve_dims(traced, costs.input_shapes(traced, x)) > 0
    graph = traced.graph
    assert graph.nodes["token_embedding@0"].flops_forward == SEQ * before["token_embedding@0"]
    block = graph.nodes["transformer_layer_0"]
    assert block.flops_forward >= SEQ * before["transformer_layer_0"]
    info = graph.tensors["transformer_layer_0:0:0"]
    assert info.shape == (None, DIM) and info.typical == (SEQ, DIM)  # the runtime keeps None
    assert info.bytes_per_sample == SEQ * DIM * 4


def test_a_hint_names_inputs_and_a_sample_batch_follows_it() -> None:
    traced = trace(_gpt2())
    costs.resolve_dims(traced, {"token_ids": (24,), "padding_mask": (24,)})
    batch = costs.sample_batch(traced, rows=3)
    assert batch["token_ids"].shape == batch["padding_mask"].shape == (3, 24)


def test_operations_linear_bytes_and_products_are_counted() -> None:
    x = keras.Input((256,))
    h = keras.layers.Dense(256, activation="relu", name="d0")(x)
    y = keras.layers.Dense(128, name="d1")(h)
    traced = trace(keras.Model(x, y))
    costs.measure_activations(traced, np.ones((4, 256), "float32"))
    for name, width in (("d0", 256), ("d1", 128)):
        node = traced.graph.nodes[name]
        assert node.activation_bytes >= width * 4  # at least its output
        assert node.ops > 0
        assert node.linear_bytes == (256 + width) * 4  # input and output per sample
        # what a replaying forward stashes ([Note: replayed products]): the output alone
        assert node.product_bytes == width * 4


_GPT_BLOCK = """
import json, numpy as np, keras_hub
from tfsmp.graph import costs
from tfsmp.graph.tracer import trace
seq, dim = 128, 256
backbone = keras_hub.models.GPT2Backbone(vocabulary_size=1000, num_layers=1, num_heads=4,
    hidden_dim=dim, intermediate_dim=1024, max_sequence_length=seq, dropout=0.0)
gpt = trace(backbone)
sample = {"token_ids": np.ones((4, seq), "int32"), "padding_mask": np.ones((4, seq), "int32")}
costs.resolve_dims(gpt, costs.input_shapes(gpt, sample))
costs.measure_activations(gpt, sample)
node = gpt.graph.nodes["transformer_layer_0"]
print(json.dumps([node.activation_bytes, node.linear_bytes, node.recompute_bytes]))
"""


def test_what_a_transformer_block_keeps_is_measured() -> None:
    # TensorFlow's CPU allocator keeps statistics with oneDNN on, the default users run with
    # (the tests' conftest turns it off): a process of its own, with oneDNN's allocator, which
    # counts tensors of 256 KiB and more (a block of 4 x 128 x 256 floats)
    import json
    import os
    import subprocess
    import sys

    # oneDNN said explicitly: TensorFlow's default depends on the CPU (off on AMD EPYC hosts,
    # where the CPU allocator then keeps no statistics and nothing is measured)
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}
    out = subprocess.run([sys.executable, "-c", _GPT_BLOCK], capture_output=True, text=True,
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    saved, linear, recompute = json.loads(out.stdout.strip().splitlines()[-1])
    seq, dim = 128, 256
    assert saved > 5 * seq * dim * 4  # far more than its output
    assert linear >= 2 * 6 * seq * dim * 4  # q, k, v, out and 2 feed-forward Dense layers
    # [Note: recomputed bytes]: one compiled forward and backward holds more than the block's
    # output per row, and less than the taped calls keep
    assert 5 * seq * dim * 4 < recompute < saved


def test_without_allocator_statistics_the_taped_figure_stands_for_the_compiled_one() -> None:
    # the tests' conftest turns oneDNN off: no statistics, so nothing compiled is measured and
    # the memory model reads `activation_bytes` for a recomputing backward
    x = keras.Input((64,))
    traced = trace(keras.Model(x, keras.layers.Dense(64, name="d")(x)))
    costs.measure_activations(traced, np.ones((2, 64), "float32"))
    assert traced.graph.nodes["d"].recompute_bytes == 0


_CONV_BN_RELU = """
import json, numpy as np, keras
from tfsmp.graph import costs
from tfsmp.graph.tracer import trace
x = keras.Input((32, 32, 16))
y = keras.layers.Conv2D(16, 3, padding="same", name="conv")(x)
y = keras.layers.BatchNormalization(name="bn")(y)
y = keras.layers.ReLU(name="relu")(y)
y = keras.layers.Conv2D(16, 3, padding="same", name="conv2")(y)
traced = trace(keras.Model(x, y))
costs.measure_activations(traced, np.ones((8, 32, 32, 16), "float32"))
print(json.dumps({n.name: [n.activation_bytes, n.kept_bytes] for n in traced.graph
                  if not n.is_input}))
"""


def test_what_a_compiled_backward_keeps_leaves_out_outputs_no_gradient_needs() -> None:
    # [Note: kept bytes] in tfsmp/graph/costs.py: a batch normalization keeps its input (the
    # convolution's output) but no gradient keeps its own output (a ReLU's reads the ReLU's
    # output), so the kept bytes count the convolution's output and the ReLU's, not the
    # normalization's; the taped figure counts every output. Its own process, with oneDNN's
    # allocator statistics (as in the test above).
    import json
    import os
    import subprocess
    import sys

    # oneDNN said explicitly: TensorFlow's default depends on the CPU (off on AMD EPYC hosts,
    # where the CPU allocator then keeps no statistics and nothing is measured)
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}
    out = subprocess.run([sys.executable, "-c", _CONV_BN_RELU], capture_output=True, text=True,
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    nodes = json.loads(out.stdout.strip().splitlines()[-1])
    image = 32 * 32 * 16 * 4  # one output, bytes per sample
    assert nodes["bn"][0] >= image  # taped: its output
    assert nodes["bn"][1] < image / 4  # kept: not its output
    assert nodes["conv"][1] >= image * 0.9  # the normalization keeps the convolution's output
    assert nodes["relu"][1] >= image * 0.9  # its own gradient keeps its output
    assert sum(k for _, k in nodes.values()) < sum(t for t, _ in nodes.values())
