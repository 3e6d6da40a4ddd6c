"""Per-sample cost estimates of Keras layer calls (FLOPs, parameter bytes) and measured profiles.

Example::

    flops = forward_flops(dense, args, kwargs, [x_spec], [y_spec])   # 2·d_in·units + ...
    seconds = profile(trace(model), x_batch)                         # {layer name: s/sample}

[Note: reverse calls] A layer may be called in two modes: keras_hub's ``ReversibleEmbedding`` is a
lookup (``E[ids]``) on the way in and, called with ``reverse=True`` as a tied LM head, the matmul
``x · Eᵀ`` on the way out: 2·d·vocab FLOPs per position, forward, and twice that backward (``dx``
and ``dE``). Costing the head as a lookup (one FLOP per logit) made the largest matmul of a GPT
look free to the planner.

[Note: FLOP conventions] One multiply-add counts 2 FLOPs. Estimates are per sample: the batch
axis (axis 0) is dropped and unknown dimensions count as 1, as in `TensorInfo.bytes_per_sample`.
Backward is 2× forward for a layer with trainable weights (``y = W·x`` needs ``dx = Wᵀ·dy`` and
``dW = dy·xᵀ``, each as large as the forward product) and 1× otherwise; an ``Embedding``'s weight
gradient is a scatter the size of its output, so its backward is 1× too. Layers without a rule
get a conservative estimate: max(10 FLOPs per output element, 2 FLOPs per parameter per row).
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras

from tfsmp.graph.ir import DTYPE_BYTES

if TYPE_CHECKING:
    from tfsmp.graph.tracer import TracedModel

__all__ = ["accepted_kwargs", "backward_flops", "forward_flops", "input_shapes", "measure_activations",
           "param_stats", "per_sample", "profile", "resolve_dims", "sample_batch"]

Specs = Sequence[Any]  # KerasTensors (shape with batch axis, dtype)
Rule = Callable[[Any, tuple[Any, ...], dict[str, Any], Specs, Specs], float]


def per_sample(shape: Sequence[int | None]) -> int:
    """Elements of one sample of a tensor of this (batched) shape; unknown dims count 1."""
    return math.prod(d if d is not None else 1 for d in list(shape)[1:])


def _n(spec: Any) -> int:
    return per_sample(spec.shape)


def _rows(spec: Any) -> int:
    """Per-sample count of vectors along the last axis (sequence positions, pixels …)."""
    last = spec.shape[-1] if len(spec.shape) > 1 else 1
    return _n(spec) // max(int(last or 1), 1)


def _shape(variable: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in variable.shape)


# -- layer rules -------------------------------------------------------------------------------

def _dense(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    d_in, units, rows = int(ins[0].shape[-1]), int(layer.units), _rows(ins[0])
    return 2 * rows * d_in * units + _bias_act(layer, rows * units)


def _bias_act(layer: Any, outputs: int) -> int:
    """One FLOP per output for the bias and one for a (non-linear) built-in activation."""
    bias = outputs if getattr(layer, "use_bias", False) else 0
    act = getattr(getattr(layer, "activation", None), "__name__", "linear")
    return bias + (outputs if act != "linear" else 0)


def _einsum_dense(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    equation: str = layer.equation
    lhs, out = equation.split("->")
    kernel_letters = lhs.split(",")[1]
    sizes = dict(zip(kernel_letters, _shape(layer.kernel)))
    contracted = math.prod(s for c, s in sizes.items() if c not in out)
    bias = _n(outs[0]) if getattr(layer, "bias", None) is not None else 0
    return 2 * _n(outs[0]) * contracted + bias + _bias_act(layer, _n(outs[0]))


def _conv(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    # kernel = kernel_size + (in_channels / groups, filters)
    per_output = math.prod(_shape(layer.kernel)[:-1])
    return 2 * _n(outs[0]) * per_output + _bias_act(layer, _n(outs[0]))


def _conv_transpose(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    # kernel = kernel_size + (filters, in_channels): every input element scatters into a window
    k = _shape(layer.kernel)
    return 2 * _n(ins[0]) * math.prod(k[:-2]) * k[-2] + _bias_act(layer, _n(outs[0]))


def _depthwise(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    window = math.prod(_shape(layer.kernel)[:-2])
    return 2 * _n(outs[0]) * window + _bias_act(layer, _n(outs[0]))


def _separable(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    dk = _shape(layer.depthwise_kernel)
    window, mid = math.prod(dk[:-2]), dk[-2] * dk[-1]
    positions = _n(outs[0]) // int(layer.filters)
    flops = 2 * positions * window * mid + 2 * positions * mid * int(layer.filters)
    return flops + _bias_act(layer, _n(outs[0]))


def _mha(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    bound = inspect.signature(layer.call).bind_partial(*args, **kwargs).arguments
    q, v = bound["query"], bound["value"]
    k = bound.get("key") if bound.get("key") is not None else v
    h, dk = int(layer.num_heads), int(layer.key_dim)
    dv = int(layer.value_dim or layer.key_dim)
    return _attention(h, h, dk, dv, q, k, v, outs[0], layer.use_bias)


def _gqa(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    bound = inspect.signature(layer.call).bind_partial(*args, **kwargs).arguments
    q, v = bound["query"], bound["value"]
    k = bound.get("key") if bound.get("key") is not None else v
    hd = int(layer.head_dim)
    return _attention(int(layer.num_query_heads), int(layer.num_key_value_heads), hd, hd,
                      q, k, v, outs[0], layer.use_bias)


def _attention(hq: int, hkv: int, dk: int, dv: int, q: Any, k: Any, v: Any, out: Any,
               bias: bool) -> float:
    """Projections, scores, softmax (5 FLOPs per score), weighted sum, output projection."""
    tq, tv = _rows(q), _rows(v)
    flops = (2 * tq * int(q.shape[-1]) * hq * dk + 2 * tv * int(k.shape[-1]) * hkv * dk
             + 2 * tv * int(v.shape[-1]) * hkv * dv
             + 2 * hq * tq * tv * dk + 5 * hq * tq * tv + 2 * hq * tq * tv * dv
             + 2 * tq * hq * dv * int(out.shape[-1]))
    if bias:
        flops += tq * hq * dk + tv * hkv * dk + tv * hkv * dv + tq * int(out.shape[-1])
    return flops


def _rnn(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    """Per step: ``gates`` matrix products over [x, h], their bias, and the gate arithmetic."""
    x = ins[0]
    steps = int(x.shape[1] or 1) if len(x.shape) > 2 else 1
    units, d_in = int(layer.units), int(x.shape[-1])
    gates, pointwise = _RNN_GATES.get(type(layer).__name__, (1, 1))
    per_step = 2 * gates * units * (d_in + units) + gates * units + pointwise * units
    return steps * per_step


_RNN_GATES = {"LSTM": (4, 8), "GRU": (3, 8), "SimpleRNN": (1, 1)}


def _bidirectional(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    return 2 * _rnn(layer.forward_layer, args, kwargs, ins, outs)


def _embedding(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    """A lookup costs one FLOP per output; keras_hub's ``ReversibleEmbedding`` called with
    ``reverse=True`` (a tied LM head: ``logits = x · Eᵀ``) is the matmul it is, 2·d·vocab per
    position. See [Note: reverse calls]."""
    if _reverse_call(layer, args, kwargs):
        d_in, vocab = int(ins[0].shape[-1]), _n(outs[0]) // max(_rows(ins[0]), 1)
        return 2.0 * _rows(ins[0]) * d_in * vocab
    return float(sum(_n(o) for o in outs))


def _reverse_call(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if "reverse" in kwargs:
        return bool(kwargs["reverse"])
    try:
        bound = inspect.signature(layer.call).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return False
    return bool(bound.get("reverse", False))


def _per_output(k: float) -> Rule:
    def rule(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
        return k * sum(_n(o) for o in outs)
    return rule


def _per_input(k: float) -> Rule:
    def rule(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
        return k * _n(ins[0]) if ins else 0.0
    return rule


def _pooling(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    return float(_n(outs[0]) * math.prod(layer.pool_size))


def _merge(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    return max(len(ins) - 1, 1) * _n(outs[0])


def _activation(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs, outs: Specs) -> float:
    name = getattr(getattr(layer, "activation", None), "__name__", "")
    return _n(outs[0]) * _ACTIVATION_FLOPS.get(name, 4)


_ACTIVATION_FLOPS = {"linear": 0, "relu": 1, "relu6": 1, "leaky_relu": 1, "softmax": 5,
                     "log_softmax": 5}

# Keras class name (matched along the MRO, most derived first) -> forward rule.
_LAYER_RULES: dict[str, Rule] = {
    "Dense": _dense, "EinsumDense": _einsum_dense,
    "BaseConv": _conv, "BaseConvTranspose": _conv_transpose,
    "BaseDepthwiseConv": _depthwise, "BaseSeparableConv": _separable,
    "Embedding": _embedding,
    "MultiHeadAttention": _mha, "GroupedQueryAttention": _gqa,
    "LayerNormalization": _per_output(8), "GroupNormalization": _per_output(8),
    "BatchNormalization": _per_output(4), "RMSNormalization": _per_output(4),
    "UnitNormalization": _per_output(3), "Normalization": _per_output(2),
    "BasePooling": _pooling, "BaseGlobalPooling": _per_input(1),
    "LSTM": _rnn, "GRU": _rnn, "SimpleRNN": _rnn, "Bidirectional": _bidirectional,
    "Activation": _activation, "ReLU": _per_output(1), "LeakyReLU": _per_output(1),
    "PReLU": _per_output(2), "ELU": _per_output(4), "Softmax": _per_output(5),
    "Add": _merge, "Subtract": _merge, "Multiply": _merge, "Maximum": _merge,
    "Minimum": _merge, "Average": _merge,
    "Concatenate": _per_output(1), "Permute": _per_output(1), "RepeatVector": _per_output(1),
    "UpSampling1D": _per_output(1), "UpSampling2D": _per_output(1), "UpSampling3D": _per_output(1),
    "ZeroPadding1D": _per_output(1), "ZeroPadding2D": _per_output(1), "ZeroPadding3D": _per_output(1),
    "Cropping1D": _per_output(1), "Cropping2D": _per_output(1), "Cropping3D": _per_output(1),
    "Dropout": _per_output(1), "GaussianNoise": _per_output(1),
    "GaussianDropout": _per_output(1), "AlphaDropout": _per_output(1),
    "Reshape": _per_output(0), "Flatten": _per_output(0), "Identity": _per_output(0),
    "InputLayer": _per_output(0), "Masking": _per_output(1),
}

# keras.ops operations (nodes of traced subclassed models), by class name.
_OP_VIEWS = {"Reshape", "ExpandDims", "Squeeze", "Flatten", "Cast", "Identity", "StopGradient"}
_OP_COPIES = {"Transpose", "GetItem", "Concatenate", "Stack", "Split", "Tile", "Repeat", "Take",
              "Slice", "Pad", "BroadcastTo", "MoveAxis", "SwapAxes", "OneHot"}
_OP_REDUCTIONS = {"Mean", "Sum", "Max", "Min", "Prod", "Std", "Var", "Argmax", "Argmin", "All",
                  "Any", "LogSumExp", "Norm"}
_OP_ELEMENTWISE = {
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "FloorDivide", "Power", "Maximum",
    "Minimum", "Negative", "Abs", "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "Relu",
    "Relu6", "LeakyRelu", "Sigmoid", "Tanh", "Silu", "Gelu", "Elu", "Selu", "Softplus", "Where",
    "Clip", "Equal", "NotEqual", "Greater", "GreaterEqual", "Less", "LessEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "Sign", "Round", "Floor", "Ceil", "Reciprocal", "Erf",
}


def _op_flops(op: Any, ins: Specs, outs: Specs) -> float:
    name = type(op).__name__
    out = sum(_n(o) for o in outs)
    if name in _OP_VIEWS:
        return 0.0
    if name in _OP_COPIES or name in _OP_ELEMENTWISE:
        return float(out)
    if name in _OP_REDUCTIONS:
        return float(max((_n(i) for i in ins), default=out))
    if name in {"Softmax", "LogSoftmax"}:
        return 5.0 * out
    if name in {"Matmul", "Dot"} and len(ins) >= 2:
        return 2.0 * out * int(ins[0].shape[-1] or 1)
    return 10.0 * out


def forward_flops(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ins: Specs,
                  outs: Specs) -> float:
    """Estimated forward FLOPs per sample of one call. See [Note: FLOP conventions].

    Args:
        op: the Keras layer, or a ``keras.ops`` operation.
        args: the call's positional arguments (KerasTensors where tensors were passed).
        kwargs: the call's keyword arguments.
        ins: the call's input KerasTensors, flattened.
        outs: the call's output KerasTensors, flattened.
    """
    if not isinstance(op, keras.layers.Layer):
        return _op_flops(op, ins, outs)
    for klass in type(op).__mro__:
        rule = _LAYER_RULES.get(klass.__name__)
        if rule is not None:
            try:
                return float(rule(op, args, kwargs, ins, outs))
            except (AttributeError, KeyError, TypeError, ValueError, IndexError):
                break  # an unusual configuration of a known layer: use the fallback
    return _fallback(op, ins, outs)


def _fallback(layer: Any, ins: Specs, outs: Specs) -> float:
    params = sum(math.prod(_shape(v)) for v in layer.weights)
    rows = _rows(ins[0]) if ins and len(ins[0].shape) > 1 else 1
    return float(max(10 * sum(_n(o) for o in outs), 2 * params * rows))


def backward_flops(op: Any, forward: float) -> float:
    """Estimated backward FLOPs per sample. See [Note: FLOP conventions]; an ``Embedding``
    subclass (keras_hub's ``ReversibleEmbedding``) counts 2x, right for its reverse (matmul)
    calls, which dominate it ([Note: reverse calls])."""
    if not isinstance(op, keras.layers.Layer) or type(op).__name__ == "Embedding":
        return forward
    trainable = op.trainable and any(v.trainable for v in op.weights)
    return 2 * forward if trainable else forward


def param_stats(variables: Sequence[Any], trainable_ids: set[int]) -> tuple[int, int, int]:
    """(bytes, trainable bytes, scalar count) of these variables, from shapes and dtypes only."""
    total = trainable = count = 0
    for v in variables:
        n = math.prod(_shape(v))
        size = n * DTYPE_BYTES.get(keras.backend.standardize_dtype(v.dtype), 4)
        total += size
        count += n
        if id(v) in trainable_ids:
            trainable += size
    return total, trainable, count


# -- unknown dimensions --------------------------------------------------------------------------

def input_shapes(traced: TracedModel, sample_input: Any) -> dict[str, tuple[int, ...]]:
    """``{input key: per-sample shape}`` of a batch (arrays, tensors or specs as in ``model(x)``)."""
    flat = traced.flatten_inputs(sample_input)
    return {k: tuple(int(d) for d in tuple(getattr(v, "shape", ()))[1:])
            for k, v in zip(traced.input_keys, flat)}


def resolve_dims(traced: TracedModel, shapes: Mapping[str, Sequence[int]]) -> int:
    """Costs every call again with the unknown dimensions these input shapes give them.

    [Note: unknown dimensions] A model with ``Input(shape=(None,))`` (a sequence model, a
    keras_hub backbone) is traced with its sequence length unknown, and per-sample estimates
    counted such a dimension as 1: a Transformer block looked like one token. Given the
    per-sample input shapes of the first batch (`tfsmp.runtime.setup` passes them) or of a
    user's hint (``tfsmp plan --input-shape token_ids=1024``), every call is run on
    ``keras.KerasTensor`` specs through its ``compute_output_spec`` (no weights are read), and
    each node's FLOPs and activation bytes are computed again from the concrete shapes; each
    tensor with unknown dimensions keeps its traced shape (the runtime still accepts other
    lengths) and records the concrete one as ``TensorInfo.typical``, which byte estimates use.
    A call whose spec cannot be computed keeps the traced estimates, and so do the calls after.

    Args:
        traced: the traced model (its graph is updated in place).
        shapes: ``{input key or input name: per-sample shape}``; missing inputs keep theirs.

    Returns:
        How many tensors got concrete shapes.
    """
    import dataclasses

    from tfsmp.graph.deferred import deferred_scope

    graph = traced.graph
    if not any(None in t.shape for t in graph.tensors.values()):
        return 0
    named = dict(zip(traced.input_names, traced.input_keys))
    given = {named.get(k, k): tuple(int(d) for d in v) for k, v in shapes.items()}
    env: dict[str, Any] = {}
    for k in traced.input_keys:
        info = graph.tensors[k]
        per_sample = given.get(k) or tuple(d or 1 for d in info.shape)
        env[k] = keras.KerasTensor((1, *per_sample), dtype=info.dtype)
    costs: dict[str, list[float]] = {}
    with deferred_scope():
        for call in traced.calls:
            found = _spec_costs(call, env)
            if found is None:
                break
            fwd, act = found
            c = costs.setdefault(call.layer_name, [0.0, 0.0, 0.0])
            c[0] += fwd
            c[1] += backward_flops(call.layer, fwd)
            c[2] += act
        else:
            _update_nodes(graph, costs)
    count = 0
    for key, value in env.items():
        tensor = graph.tensors.get(key)
        if tensor is not None and None in tensor.shape and len(value.shape) == len(tensor.shape) + 1:
            graph.tensors[key] = dataclasses.replace(
                tensor, typical=tuple(int(d or 1) for d in value.shape[1:]))
            count += 1
    return count


def accepted_kwargs(layer: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the call-context arguments (``training``, and those a layer registers)
    that ``layer``'s ``call`` does not take, as Keras's ``CallSpec`` strips them before a call:
    a replay of a recorded call through ``compute_output_spec`` (which has no such stripping)
    otherwise passes ``training`` to a layer whose ``call`` has none (``Embedding``)."""
    context = getattr(layer, "_call_context_args", ())
    signature = getattr(layer, "_call_signature", None)
    if not context or signature is None:
        return kwargs
    drop = {k for k in context if k in kwargs and k not in signature.parameters}
    return {k: v for k, v in kwargs.items() if k not in drop} if drop else kwargs


def _spec_costs(call: Any, env: dict[str, Any]) -> tuple[float, float] | None:
    """(forward FLOPs, output bytes) of one call on concrete specs, writing its output specs
    into ``env``; None when its spec cannot be computed."""
    from keras import tree

    values = {id(t): env[k] for t, k in zip(call.arguments.keras_tensors, call.input_keys)}
    args, kwargs = call.arguments.fill_in(values)
    try:
        outs = tree.flatten(call.layer.compute_output_spec(*args, **accepted_kwargs(call.layer, kwargs)))
    except Exception:  # any layer's own failure: keep the traced estimates
        return None
    ins = [values[id(t)] for t in call.arguments.keras_tensors]
    for key, value in zip(call.output_keys, outs):
        env[key] = value
    act = sum(math.prod(int(d or 1) for d in tuple(o.shape)[1:])
              * DTYPE_BYTES.get(keras.backend.standardize_dtype(o.dtype), 4) for o in outs)
    return forward_flops(call.layer, args, kwargs, ins, outs), float(act)


def _update_nodes(graph: Any, costs: Mapping[str, list[float]]) -> None:
    for name, (fwd, bwd, act) in costs.items():
        node = graph.nodes.get(name)
        if node is not None:
            node.flops_forward, node.flops_backward = fwd, bwd
            node.activation_bytes = int(act)


def sample_batch(traced: TracedModel, rows: int = 2) -> Any:
    """A batch of ``rows`` ones shaped like the model's inputs (unknown dimensions from
    `resolve_dims`, else 1; ones: valid token ids, and masks that keep every position),
    structured as ``model(x)`` takes it."""
    import numpy as np

    flat = []
    for k in traced.input_keys:
        info = traced.graph.tensors[k]
        dims = info.typical if info.typical is not None else tuple(d or 1 for d in info.shape)
        dtype = "bool" if info.dtype == "bool" else info.dtype
        flat.append(np.ones((rows, *dims), dtype=dtype))
    if len(flat) == 1:
        return flat[0]
    return dict(zip(traced.input_names, flat))


# -- measurement -------------------------------------------------------------------------------

def profile(traced: TracedModel, sample_input: Any, layer_names: set[str] | None = None,
            repeats: int = 3, training: bool = True) -> dict[str, float]:
    """Measures forward+backward seconds per sample of each layer and stores them in the graph.

    Layers run one call at a time, eagerly, on the activations the previous calls produced from
    ``sample_input``. A layer whose variables are deferred is materialized for its measurement
    and released right after, so profiling never holds more than one layer's weights beyond what
    the rank already had. Each call is run once to warm up, then ``repeats`` times; the fastest
    run counts. A layer called several times gets the sum over its calls.

    Args:
        traced: the traced model.
        sample_input: one batch of model inputs (as passed to ``model(x)``; no targets).
        layer_names: layers to measure (default: all); the others still run to feed them.
        repeats: timed runs per call.
        training: the ``training`` flag passed to the layers.

    Returns:
        ``{layer name: seconds per sample}``; also written to ``graph.nodes[name].measured_seconds``.
    """
    import tensorflow as tf

    from tfsmp.graph.deferred import is_deferred, materialize, release

    env = traced.pack_inputs(sample_input)
    batch = max(int(next(iter(env.values())).shape[0] or 1), 1) if env else 1
    last_use = _last_use(traced)
    seconds: dict[str, float] = {}
    for i, call in enumerate(traced.calls):
        variables = traced.variables_of([call.layer_name])
        fresh = materialize([v for v in variables if is_deferred(v)])
        try:
            measure = layer_names is None or call.layer_name in layer_names
            if measure:
                t = _time_call(tf, call, env, variables, training, repeats)
                seconds[call.layer_name] = seconds.get(call.layer_name, 0.0) + t / batch
            call.run(env, training)
        finally:
            release(fresh)
        for key in [k for k, last in last_use.items() if last == i]:
            env.pop(key, None)
    for name, s in seconds.items():
        traced.graph.nodes[name].measured_seconds = s
    return seconds


def measure_activations(traced: TracedModel, sample_input: Any, training: bool = True
                        ) -> dict[str, int]:
    """Measures the bytes per sample each layer's calls keep for the backward pass and stores
    them as the graph's ``activation_bytes``.

    [Note: saved activations] What a stage holds between a microbatch's forward and its backward
    is not the layers' outputs but what their gradients need: a Dense layer keeps its input, a
    Transformer block its queries, keys, values, attention probabilities and feed-forward
    activations (for GPT-2, about 20x its output per position, plus the heads' score
    matrices). Estimating that per layer kind is guesswork, so it is measured: each call runs
    once, eagerly, under a ``GradientTape`` on the activations the previous calls produced, and
    TensorFlow's allocator reports how many bytes the call left allocated (its outputs and
    what the tape keeps). Each call is a ``tf.function`` run under the tape, as a stage's
    programs are: graph-mode gradients keep 0.4-0.45x what eager ones keep, op by op (measured
    on GPT-2 and ResNet50). Layers are materialized one at a time, as in `profile`. Where the
    allocator keeps no statistics (``TF_ENABLE_ONEDNN_OPTS=0`` on CPU) the outputs' bytes stay
    and only operations and linear bytes are counted. Calls alike (`_signature`) are
    measured once and their outputs reused, so a model of 32 equal blocks materializes one.

    [Note: recomputed bytes] Under ``optimize: memory`` a stage's backward recomputes its
    forward inside one compiled call, and what that call holds per sample is less than what
    the taped calls keep: GPT-2's blocks 26-31 MiB per row against 35-38 MiB taped (the memory
    model was 12-17 % high on GPT-2 at one microbatch of 8 rows). So each call is also run
    as a compiled forward and backward at the sample's rows and at twice as many: the growth
    of its peak per added row is its ``recompute_bytes`` (the growth, because what does not
    grow with the rows, its weight gradients, is priced apart: `GRADIENTS_IN_FLIGHT` in
    tfsmp/partitioning/memory.py). That growth also counts the call's own backward temporaries,
    of which only one layer's are alive at a time in a stage (ResNet50's layers: a median 2x
    the taped figure), so the memory model reads the smaller of the two figures per layer.

    [Note: kept bytes] Both figures count every output of a call, but a stage's compiled
    backward keeps an output only where a gradient needs it: ResNet50's batch normalizations
    keep their inputs (the convolutions' outputs) but not their outputs, which the ReLUs after
    them do not need (a ReLU's gradient reads its own output). So each call also runs once more
    under a tape on fresh copies of its inputs, and the allocator tells, as references are
    dropped, what the tape keeps of its outputs, of its inputs and besides them. A tensor counts
    once, with the call that made it, where that call or any consumer keeps it
    (``kept_bytes``). Measured on ResNet50's first stage at 1-8 rows per microbatch: the
    model's per-row activations were 25-30 % above TensorFlow's own peak with the other two
    figures.

    Args:
        traced: the traced model (``graph.nodes[name].activation_bytes`` is updated).
        sample_input: a batch of model inputs (one or a few samples suffice).
        training: the ``training`` flag passed to the layers.

    Returns:
        ``{layer name: bytes per sample}`` of the layers measured.
    """
    import tensorflow as tf

    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    try:
        tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError):
        device = ""  # no allocator statistics (TF_ENABLE_ONEDNN_OPTS=0 on CPU): count only
    env = traced.pack_inputs(sample_input)
    batch = max(int(next(iter(env.values())).shape[0] or 1), 1) if env else 1
    last_use = _last_use(traced)
    saved: dict[str, int] = {}
    for node in traced.graph:
        node.ops = node.linear_bytes = node.recompute_bytes = node.kept_bytes = 0
        node.product_bytes = 0
    seen: dict[Any, _Measured] = {}
    # [Note: kept bytes]: each tensor's bytes per sample, maker and the most any reader keeps
    made: dict[str, tuple[str, float, float]] = {}  # key -> (layer, bytes, fraction kept)
    for i, call in enumerate(traced.calls):
        inputs = [env[k] for k in call.input_keys]
        variables = traced.variables_of([call.layer_name])
        key = _signature(call, inputs, variables)
        if key not in seen:
            seen[key] = _measure_call(tf, device, call, inputs, variables, training, batch)
        m = seen[key]
        node = traced.graph.nodes[call.layer_name]
        node.ops += m.ops
        node.linear_bytes += m.linear
        node.product_bytes += m.products
        node.recompute_bytes += m.recompute
        node.kept_bytes += m.own
        saved[call.layer_name] = saved.get(call.layer_name, 0) + m.held
        for k in call.input_keys:
            if k in made:
                layer, nbytes, kept = made[k]
                made[k] = (layer, nbytes, max(kept, m.inputs_kept))
        for k, t in zip(call.output_keys, m.outputs):
            made[k] = (call.layer_name, _nbytes(t) / batch, m.outputs_kept)
        env.update(zip(call.output_keys, m.outputs))
        for k in [k for k, last in last_use.items() if last == i]:
            env.pop(k, None)
    for layer, nbytes, kept in made.values():  # nothing kept without allocator statistics
        traced.graph.nodes[layer].kept_bytes += int(nbytes * kept)
    for name, nbytes in saved.items():
        node = traced.graph.nodes[name]
        node.activation_bytes = max(nbytes, node.activation_bytes)
    return saved


@dataclass(frozen=True)
class _Measured:
    """One call's measured figures, per sample ([Note: saved activations], [Note: recomputed
    bytes], [Note: kept bytes])."""

    held: int              # outputs and what the tape keeps
    ops: int               # forward graph operations
    linear: int            # Dense and EinsumDense inputs and outputs
    products: int          # Dense and EinsumDense outputs (a replaying stage's stash)
    recompute: int         # growth of a compiled forward and backward's peak
    own: int               # what the tape keeps besides the call's inputs and outputs
    outputs_kept: float    # the fraction of the outputs' bytes the tape keeps
    inputs_kept: float     # the fraction of the floating inputs' bytes the tape keeps
    outputs: list[Any]


def _signature(call: Any, inputs: Sequence[Any], variables: Sequence[Any]) -> Any:
    """Calls alike in class, configuration, input and variable shapes keep alike: each such
    signature is measured once (a Transformer's blocks, a stack of equal layers), so only a
    few layers are ever materialized and run."""
    layer = call.layer
    try:
        config = {k: v for k, v in layer.get_config().items() if k not in ("name", "trainable")}
        text = repr(sorted(config.items()))
    except Exception:  # a layer without a config: measured on its own
        text = str(id(layer))
    return (type(layer).__name__, text,
            tuple((tuple(x.shape), str(x.dtype)) for x in inputs),
            tuple((tuple(v.shape), str(v.dtype), v.trainable) for v in variables))


def _measure_call(tf: Any, device: str, call: Any, inputs: list[Any], variables: list[Any],
                  training: bool, batch: int) -> _Measured:
    """One call's figures, with its variables materialized for the measurement only."""
    from tfsmp.graph.deferred import is_deferred, materialize, release

    def current() -> int:
        return int(tf.config.experimental.get_memory_info(device)["current"]) if device else 0

    fresh = materialize([v for v in variables if is_deferred(v)])
    try:
        run = tf.function(functools.partial(_run_call, call, training=training))
        before = current()
        with tf.GradientTape(persistent=True) as tape, _LinearBytes() as linear:
            tape.watch([x for x in inputs if x.dtype.is_floating])
            outputs = run(*inputs)
        held = current() - before
        del tape
        ops = len(run.get_concrete_function(*inputs).graph.get_operations())
        recompute = _recompute_growth(tf, device, call, inputs, variables, training, batch)
        own, outputs_kept, inputs_kept = _kept(tf, current, run, inputs) if device else (0, 0, 0)
        return _Measured(max(held, 0) // batch, ops, linear.total // batch,
                         linear.products // batch, recompute, own // batch, outputs_kept,
                         inputs_kept, list(outputs))
    finally:
        release(fresh)


def _kept(tf: Any, current: Callable[[], int], run: Any, inputs: list[Any]
          ) -> tuple[int, float, float]:
    """(bytes the tape keeps besides inputs and outputs, fraction of the outputs' bytes it
    keeps, fraction of the floating inputs' bytes it keeps) of one taped call on fresh copies
    of its inputs ([Note: kept bytes]): the allocator's count as references are dropped."""
    before = current()
    xs = [x * tf.ones((), x.dtype) if x.dtype.is_floating else x for x in inputs]  # new buffers
    copied = current() - before
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x for x in xs if x.dtype.is_floating])
        outs = [y for y in run(*xs)]
    total = current() - before
    out_bytes = sum(_nbytes(y) for y in outs)
    del outs
    without_outputs = current() - before
    del xs
    without_inputs = current() - before
    del tape
    outputs_kept = min(max(out_bytes - (total - without_outputs), 0), out_bytes)
    inputs_kept = min(max(copied - (without_outputs - without_inputs), 0), copied)
    own = max(without_outputs - copied - outputs_kept, 0)
    return (own, outputs_kept / out_bytes if out_bytes else 0.0,
            inputs_kept / copied if copied else 0.0)


def _recompute_growth(tf: Any, device: str, call: Any, inputs: list[Any], variables: list[Any],
                      training: bool, batch: int) -> int:
    """Per added row, the growth of the peak of one call's compiled forward and backward
    ([Note: recomputed bytes]); 0 without allocator statistics."""
    if not device:
        return 0
    trainable = [v for v in variables if v.trainable]

    def forward_backward(*xs: Any) -> Any:
        grads = _gradients(tf, call, list(xs), trainable, training)
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads
                         if g is not None and not isinstance(g, tf.IndexedSlices)]
                        or [tf.constant(0.0)])

    run = tf.function(forward_backward)

    def peak(xs: list[Any]) -> int:
        run(*xs)  # traced and run once: the measured run allocates only its tensors
        try:
            tf.config.experimental.reset_memory_stats(device)
        except (ValueError, RuntimeError):  # an allocator without resettable statistics
            return 0
        before = int(tf.config.experimental.get_memory_info(device)["current"])
        run(*xs)
        return int(tf.config.experimental.get_memory_info(device)["peak"]) - before

    doubled = [tf.concat([x, x], 0) if x.shape.rank else x for x in inputs]
    return max(peak(doubled) - peak(inputs), 0) // batch


class _LinearBytes:
    """Counts the bytes of the inputs and outputs of Dense and EinsumDense calls traced inside
    it (the tensors a zero-bubble W keeps, [Note: split backward] in tfsmp/runtime/deferred.py)."""

    def __init__(self) -> None:
        self.total = 0
        self.products = 0  # the outputs alone: what a replaying forward stashes
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> _LinearBytes:
        for klass in (keras.layers.Dense, keras.layers.EinsumDense):
            original = klass.call

            def call(layer: Any, x: Any, *args: Any, __original: Any = original,
                     **kwargs: Any) -> Any:
                y = __original(layer, x, *args, **kwargs)
                self.total += _nbytes(x) + _nbytes(y)
                self.products += _nbytes(y)
                return y

            self._saved.append((klass, original))
            klass.call = call
        return self

    def __exit__(self, *exc: object) -> None:
        for klass, original in self._saved:
            klass.call = original


def _nbytes(t: Any) -> int:
    shape = tuple(getattr(t, "shape", ()))
    size = math.prod(int(d or 1) for d in shape)
    return size * DTYPE_BYTES.get(keras.backend.standardize_dtype(getattr(t, "dtype", "float32")), 4)


def _run_call(call: Any, *inputs: Any, training: bool) -> list[Any]:
    env = dict(zip(call.input_keys, inputs))
    call.run(env, training)
    return [env[k] for k in call.output_keys]


def _last_use(traced: TracedModel) -> dict[str, int]:
    last: dict[str, int] = {}
    for i, call in enumerate(traced.calls):
        for k in call.input_keys:
            last[k] = i
    for k in traced.output_keys:
        last.pop(k, None)
    return last


def _gradients(tf: Any, call: Any, inputs: list[Any], trainable: list[Any], training: bool
               ) -> list[Any]:
    """One call's forward under a tape and the gradients of its floating outputs' sum for its
    floating inputs and ``trainable`` variables (none when it has neither)."""
    floats = [x for x in inputs if x.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(floats)
        ys = _run_call(call, *inputs, training=training)
        loss = tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32)) for y in ys
                         if y.dtype.is_floating] or [tf.constant(0.0)])
    return list(tape.gradient(loss, floats + trainable)) if floats or trainable else []


def _time_call(tf: Any, call: Any, env: dict[str, Any], variables: list[Any],
               training: bool, repeats: int) -> float:
    trainable = [v for v in variables if v.trainable]

    def step() -> None:
        _gradients(tf, call, [env[k] for k in call.input_keys], trainable, training)

    step()
    best = math.inf
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best
