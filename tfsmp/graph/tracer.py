"""Keras model -> `LayerGraph`, plus an interpreter of the model's flattened layer calls.

Example::

    with deferred_scope():
        model = build_keras_model()        # no weights allocated
    traced = trace(model)                  # Functional, Sequential, nested or subclassed
    traced.graph                           # the LayerGraph the partitioner reads
    env = traced.run(traced.pack_inputs(x), layer_names=set(plan.layers(stage)))

[Note: flattening] Every model becomes one list of leaf calls. A Functional model is read from
its nodes (`keras.src.ops.node.Node`); a Sequential through its Functional form; a subclassed
model by calling its ``call`` on ``keras.Input`` tensors inside `deferred_scope` and reading the
nodes that call created (Keras layers and ``keras.ops`` operations). A model used as a layer is
expanded in place, recursively, so the graph holds only leaf layers; a leaf called at several
places (directly, or because its model is called several times) is one node with several calls.
A layer's calls are numbered in the order of (enclosing model's call, …, the layer's own node
index among the nodes of its model), which for a model without nesting is Keras's node index
counted over this model's nodes only; tensor keys follow [Note: tensor keys] in `ir.py`.
``keras.ops`` operations get names ``ops.<op>``, ``ops.<op>_1`` … in execution order, because
Keras's own names for them come from a process-wide counter and differ between processes.
A leaf called several times whose variables are all trainable becomes one graph node per call
(``"<layer>@<call>"`` after the first call in execution order), so its calls may run on
different stages, each holding a copy of the variables it reads ([Note: tied copies] in `ir.py`;
which variables a call reads: [Note: variable reads] in `reads.py`).

[Note: a layer with Keras's Trainer] Keras trains any layer that mixes its `Trainer` in ("a
model is just a layer mixed in with a Trainer", as Keras's own trainer tests build theirs), so
`DistributedModel` wraps one too. Such a layer is traced as a model of one call: the layer
itself, called on ``keras.Input`` tensors shaped like the sample, is the graph's one node
(its own sublayers are not expanded, as for any layer that is not a ``keras.Model``). It runs at
``partitions: 1`` (data-parallel replicas and microbatches); more partitions are refused by the
planner, as for any model with fewer layers than stages.

[Note: call semantics] `Call.run` calls the layer as `Functional` does: the node's recorded
args/kwargs with tensors substituted, and ``training`` overriding the recorded value when it is
not None and the layer takes it. Masks ride on the tensors (``_keras_mask``) as in Keras; see
[Note: masks] for how they cross stages.

[Note: masks] A Keras mask rides on its tensor (``_keras_mask``: `Embedding(mask_zero=True)`,
`Masking`, and every layer that propagates it), and a layer reads it from its inputs (the
``mask``/``query_mask``/… arguments Keras fills in, or ``compute_mask``). A tensor received from
another stage, or returned by a compiled function, carries no attribute, so the tracer makes the
mask a tensor of its own: every traced tensor that carries a mask when the model runs
([Note: mask discovery] in `masks.py`) gets a companion key ``"<key>#mask"``
(`TracedModel.masks`), written by the same call as the data (`Call.output_mask_keys`) and read by
every Keras layer that reads the data (`Call.input_mask_keys`; ``keras.ops`` calls ignore
masks). The `LayerGraph` holds it as an ordinary bool tensor, so the partitioner prices it and
makes it a boundary wherever its data is one; a model output's mask is a graph output too.
`Call.run` re-attaches the masks it finds in ``env`` to its inputs before calling and writes its
outputs' masks into ``env`` after, so a stage that receives data and masks computes exactly what
Keras computes. A mask that the model computes explicitly (``ops.not_equal(ids, 0)`` passed as
``mask=``, which Keras records for a single-input layer such as LSTM) is also an ordinary traced
tensor.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.backend import get_keras_mask, set_keras_mask
from keras.src.models.functional import Functional
from keras.src.ops.function import make_node_key
from keras.src.ops.node import Node
from keras.src.ops.symbolic_arguments import SymbolicArguments

from tfsmp.errors import StepError, TfsmpError, TraceError
from tfsmp.graph import costs
from tfsmp.graph.deferred import deferred_scope
from tfsmp.graph.ir import LayerGraph, LayerNode, TensorInfo
from tfsmp.graph.masks import attach_masks, mask_key
from tfsmp.graph.reads import Reads, call_reads, shared, split_tied_calls, variable_owners

__all__ = ["Call", "TracedModel", "trace"]

_WAYS_OUT = ("Either wrap that code in a keras.layers.Layer (its call() may use any TensorFlow "
             "op and Python control flow; tfsmp then treats it as one layer), or partition the "
             "model manually with smp.partition.")


@dataclass
class Call:
    """One call of a leaf layer (or ``keras.ops`` operation) in the flattened model.

    Example::

        env = {"x:0:0": x}
        call.run(env, training=False)      # env[call.output_keys[0]] is now set
    """

    layer: Any
    layer_name: str
    call_index: int
    input_keys: list[str]
    output_keys: list[str]
    arguments: SymbolicArguments = field(repr=False)
    keras_name: str = ""  # the Keras layer's name when ``layer_name`` is a tied copy's node
    # [Note: masks]: aligned with input_keys / output_keys, None where a tensor has no mask
    input_mask_keys: list[str | None] = field(default_factory=list)
    output_mask_keys: list[str | None] = field(default_factory=list)

    def run(self, env: dict[str, Any], training: bool | None = None) -> None:
        """Reads ``env[input_keys]`` (and their masks), calls the layer, writes
        ``env[output_keys]`` and the outputs' masks.

        See [Note: call semantics] and [Note: masks].

        Raises:
            StepError: if an output that was masked when traced comes out without a mask.
        """
        inputs = [env[k] for k in self.input_keys]
        for value, mkey in zip(inputs, self.input_mask_keys):
            if mkey is not None and mkey in env:
                set_keras_mask(value, env[mkey])
        values = {id(t): v for t, v in zip(self.arguments.keras_tensors, inputs)}
        args, kwargs = self.arguments.fill_in(values)
        if training is not None and "training" in getattr(self.layer, "_call_context_args", ()):
            kwargs = {**kwargs, "training": training}
        outputs = tree.flatten(self.layer(*args, **kwargs))
        for key, value in zip(self.output_keys, outputs):
            env[key] = value
        for value, mkey in zip(outputs, self.output_mask_keys):
            if mkey is not None:
                env[mkey] = self._mask_of(value, mkey)

    def _mask_of(self, value: Any, mkey: str) -> Any:
        mask = get_keras_mask(value)
        if mask is None:
            raise StepError(
                f"A layer must attach the same Keras masks when it runs as when it was traced, "
                f"because masks cross stages as tensors of their own. Received: layer "
                f"'{self.layer_name}' returned no mask for '{mkey.split('#')[0]}', which "
                f"was masked when the model was traced. Make the layer attach its mask in "
                f"every call, or keep the layers reading this mask on one stage.")
        return mask


@dataclass
class TracedModel:
    """A traced model: its `LayerGraph`, its calls in execution order, and how to feed them.

    Example::

        traced = trace(model)
        y = traced.pack_outputs([traced.run(traced.pack_inputs(x))[k]
                                 for k in traced.output_keys])        # == model(x)
    """

    model: keras.Model
    graph: LayerGraph
    calls: list[Call]
    input_keys: list[str]
    output_keys: list[str]
    input_names: list[str]
    output_names: list[str]
    input_specs: list[Any] = field(repr=False)
    inputs_struct: Any = field(repr=False)
    outputs_struct: Any = field(repr=False)
    unpack_singleton: bool = True
    cast_all_inputs: bool = True
    layers: dict[str, Any] = field(default_factory=dict, repr=False)
    uses: dict[str, list[Any]] = field(default_factory=dict, repr=False)
    variable_order: dict[int, int] = field(default_factory=dict, repr=False)
    # [Note: masks]: tensor key -> its mask's key; the output masks, aligned with output_keys
    masks: dict[str, str] = field(default_factory=dict)
    output_mask_keys: list[str | None] = field(default_factory=list)

    def layer(self, name: str) -> Any:
        """The Keras layer (or ``keras.ops`` operation) of a graph node."""
        if name not in self.layers:
            raise KeyError(f"No layer of this name in the traced model. Received: name={name!r}")
        return self.layers[name]

    def variables_of(self, layer_names: Iterable[str]) -> list[keras.Variable]:
        """Every variable these layers' calls read (weights and RNG seed states), each once,
        in ``model.variables`` order (which keeps ``model.weights`` order)."""
        found: dict[int, Any] = {}
        for name in layer_names:
            for v in self.uses.get(name, ()):
                found.setdefault(id(v), v)
        end = len(self.variable_order)
        return sorted(found.values(), key=lambda v: self.variable_order.get(id(v), end))

    def pack_inputs(self, x: Any, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """The user's ``x`` (tensor, list, tuple, or dict by input name) -> ``{input key: tensor}``,
        converted as ``model(x)`` converts it. With ``keys``, only those inputs become tensors;
        the others stay NumPy arrays of the shape conversion gives (no copy where ``x`` already
        is one: a rank whose stages do not read an input only needs its shape).

        Raises:
            StepError: if ``x`` does not match the model's inputs.
        """
        flat = self.flatten_inputs(x)
        wanted = None if keys is None else set(keys)
        return {k: (self._convert(v, spec)
                    if (wanted is None or k in wanted) or not _dense_host(v)
                    else _adjust_rank(np.asarray(v), spec))
                for k, v, spec in zip(self.input_keys, flat, self.input_specs)}

    def pack_outputs(self, values: Iterable[Any], masks: Iterable[Any] | None = None) -> Any:
        """Flat output values (in `output_keys` order) -> the structure ``model(x)`` returns.

        Args:
            values: the output tensors.
            masks: their Keras masks (aligned with `output_keys`, None where an output has
                none; e.g. ``[env.get(k) if k else None for k in output_mask_keys]``), attached
                to the values as ``model(x)`` attaches them. See [Note: masks].
        """
        values = list(values)
        for value, mask in zip(values, masks if masks is not None else ()):
            if mask is not None:
                set_keras_mask(value, mask)
        out = tree.pack_sequence_as(self.outputs_struct, values)
        if self.unpack_singleton and isinstance(out, (list, tuple)) and len(out) == 1:
            return out[0]
        return out

    def run(self, inputs: dict[str, Any], layer_names: set[str] | None = None,
            env: dict[str, Any] | None = None, training: bool | None = None) -> dict[str, Any]:
        """Runs the calls of ``layer_names`` (None: all) in execution order: a stage interpreter.

        Args:
            inputs: ``{tensor key: value}`` for model inputs (see `pack_inputs`) and, for a
                stage, the boundary tensors it receives.
            layer_names: the layers to run.
            env: further known tensors; not modified.
            training: passed to every layer that takes it (see [Note: call semantics]).

        Returns:
            A new dict of every known tensor: ``env``, ``inputs`` and all outputs computed.
        """
        values = dict(env or {})
        values.update(inputs)
        for call in self.calls:
            if layer_names is None or call.layer_name in layer_names:
                call.run(values, training)
        return values

    def __call__(self, x: Any, training: bool | None = None) -> Any:
        """Runs the whole model: the same result as ``model(x, training=training)``."""
        values = self.run(self.pack_inputs(x), training=training)
        return self.pack_outputs([values[k] for k in self.output_keys], self.output_masks(values))

    def output_masks(self, env: dict[str, Any]) -> list[Any]:
        """The outputs' masks found in ``env`` (aligned with `output_keys`, None where none)."""
        return [env.get(k) if k is not None else None for k in self.output_mask_keys]

    def flatten_inputs(self, x: Any) -> list[Any]:
        if isinstance(x, dict) and all(n in x for n in self.input_names):
            flat = [x[n] for n in self.input_names]
        elif len(self.input_specs) == 1 and not isinstance(x, (list, tuple, dict)):
            flat = [x]
        else:
            flat = tree.flatten(x)
        if len(flat) != len(self.input_specs):
            raise StepError(
                f"The inputs must match the model's {len(self.input_specs)} inputs "
                f"{self.input_names}. Received: {len(flat)} values "
                f"({type(x).__name__}). Pass a tensor, a list in this order, or a dict by name.")
        return flat

    def _convert(self, value: Any, spec: Any) -> Any:
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if self.cast_all_inputs:  # what Functional._convert_inputs_to_tensors does
            value = keras.ops.convert_to_tensor(value, dtype=dtype)
        else:  # what Layer.__call__ does for a subclassed model: cast floats only
            value = keras.ops.convert_to_tensor(value)
            is_float = keras.backend.is_float_dtype
            if is_float(value.dtype) and is_float(dtype) and value.dtype != dtype:
                value = keras.ops.cast(value, dtype)
        return _adjust_rank(value, spec)


def _dense_host(value: Any) -> bool:
    """Whether ``value`` is a dense numeric array NumPy can view (not a sparse or ragged
    tensor). Strings and objects are converted on every rank, as every rank converted them
    before [Note: what a rank converts]: a batch that cannot be converted then fails on every
    rank alike, not only on the ranks that read it (the others would wait in the step)."""
    if isinstance(value, tf.Tensor):
        return bool(value.dtype.is_floating or value.dtype.is_integer or value.dtype.is_bool)
    if isinstance(value, (np.ndarray, list, tuple)):  # not sparse, not ragged
        return np.asarray(value).dtype.kind in "biuf"
    return False


def _adjust_rank(value: Any, spec: Any) -> Any:
    """Squeezes or expands a trailing axis of size 1, as `Functional` does (a NumPy array as a
    view of itself, a tensor by Keras's ops)."""
    rank, ref = len(value.shape), tuple(spec.shape)
    host = isinstance(value, np.ndarray)
    if rank == len(ref) + 1 and value.shape[-1] == 1:
        return value[..., 0] if host else keras.ops.squeeze(value, axis=-1)
    if rank == len(ref) - 1 and ref and ref[-1] == 1:
        return value[..., None] if host else keras.ops.expand_dims(value, axis=-1)
    return value


# -- trace -------------------------------------------------------------------------------------

def trace(model: keras.Model, batch_size: int | None = None, sample_input: Any = None) -> TracedModel:
    """Builds the layer graph and the call list of any Keras model. See [Note: flattening].

    Tracing allocates no weights: layers built during the trace are built in `deferred_scope`.

    Args:
        model: a Functional, Sequential or subclassed ``keras.Model`` (nesting allowed), or a
            layer with Keras's `Trainer` mixed in ([Note: a layer with Keras's Trainer]).
        batch_size: batch dimension of the symbolic inputs of an unbuilt or subclassed model
            (default: unknown).
        sample_input: a batch (arrays, tensors or ``keras.KerasTensor`` specs, structured as in
            ``model(x)``); needed for a subclassed or unbuilt Sequential model that has never
            been called.

    Returns:
        The `TracedModel`.

    Raises:
        TraceError: if the model cannot be traced (a ``call`` using raw TensorFlow ops or Python
            control flow on tensors, an unbuilt model without ``sample_input``, names that
            collide after flattening).
    """
    with deferred_scope():
        top = _top_function(model, batch_size, sample_input)
        flat = _Flattener()
        keymap = {id(t): f"{_producer(t).name}:0:0" for t in top.fn.inputs}
        flat.expand(top.fn, keymap, (), model.name)
    input_keys = [keymap[id(t)] for t in top.fn.inputs]
    output_keys = [keymap[id(t)] for t in top.fn.outputs]
    calls = flat.finish(input_names=[_producer(t).name for t in top.fn.inputs])
    flat.attach_masks(calls, {keymap[id(t)]: t for t in top.fn.inputs})
    read = call_reads(calls)  # [Note: variable reads] in reads.py
    calls = split_tied_calls(calls, read)
    rename = flat.final_keys
    output_keys = [rename.get(k, k) for k in output_keys]
    return _assemble(model, top, calls, read, flat, input_keys, output_keys)


@dataclass
class _Top:
    fn: Any                       # a Functional model or keras.Function: inputs, outputs, nodes
    unpack_singleton: bool
    cast_all_inputs: bool


def _top_function(model: keras.Model, batch_size: int | None, sample_input: Any) -> _Top:
    if isinstance(model, Functional):
        return _Top(model, True, True)
    if isinstance(model, keras.Sequential):
        fn = _sequential_function(model, batch_size, sample_input)
        if fn is not None:
            return _Top(fn, True, True)
    args = _symbolic_inputs(model, batch_size, sample_input)
    if not isinstance(model, keras.Model):  # [Note: a layer with Keras's Trainer]
        return _Top(_layer_function(model, args), False, False)
    return _Top(_symbolic_function(model, (args,), {}), False, False)


def _sequential_function(model: keras.Sequential, batch_size: int | None, sample_input: Any) -> Any:
    fn = getattr(model, "_functional", None)
    if fn is None and sample_input is not None and not tree.is_nested(sample_input):
        model.build((batch_size, *tuple(sample_input.shape)[1:]))
        fn = getattr(model, "_functional", None)
    return fn


def _symbolic_inputs(model: keras.Model, batch_size: int | None, sample_input: Any) -> Any:
    """``keras.Input`` tensors shaped like ``sample_input`` or like the model's built input."""
    if sample_input is None:
        shapes = getattr(model, "_build_shapes_dict", None)
        if not shapes or len(shapes) != 1:
            raise TraceError(
                f"Tracing a model that was never called needs a sample of its input. Received: "
                f"model '{model.name}' ({type(model).__name__}) is not built and "
                f"sample_input=None. Pass sample_input=<one batch> to trace() (or to "
                f"smp.DistributedModel), or call the model once on data first.")
        spec = next(iter(shapes.values()))
        dtype = model.input_dtype
        sample_input = tree.map_shape_structure(
            lambda s: keras.KerasTensor(tuple(s), dtype=dtype), spec)
    paths = tree.flatten_with_path(sample_input)
    leaves = [leaf for _, leaf in paths]
    names = [_input_name(path, i, len(paths)) for i, (path, _) in enumerate(paths)]
    inputs = [_input_like(leaf, name, batch_size, model) for leaf, name in zip(leaves, names)]
    return tree.pack_sequence_as(sample_input, inputs)


def _input_name(path: tuple[Any, ...], index: int, count: int) -> str:
    if path and isinstance(path[-1], str):
        return path[-1]
    return "input" if count == 1 else f"input_{index}"


def _input_like(leaf: Any, name: str, batch_size: int | None, model: keras.Model) -> Any:
    dtype = keras.backend.standardize_dtype(leaf.dtype)
    if keras.backend.is_float_dtype(dtype):  # Layer.__call__ casts float inputs so
        dtype = model.input_dtype
    return keras.Input(shape=tuple(leaf.shape)[1:], batch_size=batch_size, dtype=dtype, name=name)


def _symbolic_function(model: keras.Model, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls ``model.call`` on KerasTensors and wraps what it built in a ``keras.Function``."""
    if not model.built:
        _build_symbolically(model, args, kwargs)
    outputs = _symbolic_call(model, model.call, args, kwargs)
    if "training" in inspect.signature(model.call).parameters:
        _check_training_branches(model, args, kwargs)
    return keras.Function(_tensors((args, kwargs)), outputs, name=f"{model.name}_trace")


def _layer_function(layer: Any, args: Any) -> Any:
    """A ``keras.Function`` of one node: ``layer`` called on KerasTensors as a whole (its own
    sublayers are not expanded: a layer is a leaf, whatever it holds)."""
    outputs = _symbolic_call(layer, layer, (args,), {})
    return keras.Function(_tensors(args), outputs, name=f"{layer.name}_trace")


def _tensors(structure: Any) -> list[Any]:
    return [t for t in tree.flatten(structure) if isinstance(t, keras.KerasTensor)]


def _build_symbolically(model: keras.Model, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Builds the model as ``model(x)`` would (running a custom ``build``), without weights."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras's "unbuilt state" hints; errors come next
            model(*args, **kwargs)
    except Exception:
        pass  # the symbolic call that follows reports the error at its source


def _symbolic_call(model: keras.Model, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return fn(*args, **kwargs)
    except TfsmpError:  # already says what is wrong (e.g. a layer under two smp.partition scopes)
        raise
    except Exception as e:
        raise TraceError(_trace_message(model, e)) from e


def _check_training_branches(model: keras.Model, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    seen = {}
    for training in (True, False):
        out = _symbolic_call(model, model.call, args, {**kwargs, "training": training})
        fn = keras.Function(_tensors((args, kwargs)), out, name=f"{model.name}_check")
        seen[training] = [_op_label(n.operation) for n in _ordered_nodes(fn) if not n.is_input]
    if seen[True] != seen[False]:
        raise TraceError(
            f"A traced call() must run the same layers with training=True and training=False. "
            f"Received: model '{model.name}' runs {seen[True]} when training=True and "
            f"{seen[False]} when training=False. {_WAYS_OUT}")


def _op_label(op: Any) -> str:
    return op.name if isinstance(op, keras.layers.Layer) else f"ops.{type(op).__name__}"


def _trace_message(model: keras.Model, error: Exception) -> str:
    where, layer = _user_frame(error)
    owner = f"model '{model.name}' ({type(model).__name__})"
    if layer is not None and layer is not model:
        owner = f"layer '{layer.name}' ({type(layer).__name__}) of {owner}"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    sentence = re.match(r"(.+?[.!?])(\s|$)", text)
    first_line = sentence.group(1) if sentence else text
    return (f"A subclassed model's call() must use only Keras layers and keras.ops on its "
            f"tensors so tfsmp can trace it (no raw TensorFlow ops, no Python control flow "
            f"on tensor values). Received: {owner}{where} raised "
            f"{type(error).__name__}: {first_line} {_WAYS_OUT}")


# Frames in these directories are not the user's: Keras, TensorFlow, NumPy, tfsmp itself, and
# the standard library (but not the site-packages inside it).
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
    for m in (keras, tf, np, importlib.import_module("tfsmp")))
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _is_library(path: str) -> bool:
    if path.startswith(_LIBRARY_DIRS):
        return True
    return path.startswith(_STDLIB_DIR) and "site-packages" not in path


def _user_frame(error: BaseException) -> tuple[str, Any]:
    """`` at file:line `source` `` of the innermost user frame, and the Keras layer running it."""
    tb, found = error.__traceback__, None
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not _is_library(path):
            found = tb
        tb = tb.tb_next
    if found is None:
        return "", None
    code = found.tb_frame.f_code
    source = linecache.getline(code.co_filename, found.tb_lineno).strip()
    owner = found.tb_frame.f_locals.get("self")
    layer = owner if isinstance(owner, keras.layers.Layer) else None
    return f" at {os.path.basename(code.co_filename)}:{found.tb_lineno} `{source}`", layer


# -- flattening --------------------------------------------------------------------------------

@dataclass
class _RawCall:
    op: Any
    node: Node
    path: tuple[int, ...]
    input_keys: list[str]
    output_keys: list[str]
    owner: str


class _Flattener:
    """Expands nested models into leaf calls with provisional keys, then names them."""

    def __init__(self) -> None:
        self.raw: list[_RawCall] = []
        self.final_keys: dict[str, str] = {}
        self.names: dict[int, str] = {}
        self.masked: dict[str, Any] = {}  # provisional key -> its symbolic mask ([Note: masks])
        self.specs: dict[str, Any] = {}  # provisional key -> its KerasTensor
        self.masks: dict[str, Any] = {}  # final key -> its mask's spec, set by `attach_masks`

    def expand(self, fn: Any, keymap: dict[int, str], path: tuple[int, ...], owner: str) -> None:
        """Adds ``fn``'s calls; ``keymap`` maps id(KerasTensor) of ``fn`` -> key (extended here)."""
        for node in _ordered_nodes(fn):
            if node.is_input:
                continue
            op = node.operation
            here = (*path, _local_index(fn, op, node))
            if isinstance(op, keras.Model):
                self._expand_model(op, node, keymap, here)
                continue
            keys = [f"\0{len(self.raw)}:{i}" for i in range(len(node.outputs))]
            self.raw.append(_RawCall(op, node, here, [keymap[id(t)] for t in node.input_tensors],
                                     keys, owner))
            keymap.update({id(t): k for t, k in zip(node.outputs, keys)})
            self.specs.update(zip(keys, node.outputs))
            self.masked.update((k, get_keras_mask(t)) for k, t in zip(keys, node.outputs)
                               if _has_mask(t))

    def _expand_model(self, model: keras.Model, node: Node, keymap: dict[int, str],
                      path: tuple[int, ...]) -> None:
        inner, inner_inputs = _inner_function(model, node)
        inner_map = {id(t): keymap[id(a)] for t, a in zip(inner.inputs, inner_inputs)}
        self.expand(inner, inner_map, path, model.name)
        for outer, inner_t in zip(node.outputs, inner.outputs):
            key = keymap[id(outer)] = inner_map[id(inner_t)]
            if _has_mask(outer) and key.startswith("\0"):
                # the nested model's compute_mask ran its graph with the masks of its inputs
                self.masked.setdefault(key, get_keras_mask(outer))

    def finish(self, input_names: list[str]) -> list[Call]:
        """Names nodes, numbers calls, and rewrites provisional keys into final ones."""
        self._name_ops(input_names)
        index: dict[int, int] = {}
        seen: dict[int, int] = {}
        for pos in sorted(range(len(self.raw)), key=lambda i: self.raw[i].path):
            op_id = id(self.raw[pos].op)
            index[pos] = seen.get(op_id, 0)
            seen[op_id] = index[pos] + 1
        for pos, rc in enumerate(self.raw):
            name = self.names[id(rc.op)]
            for i, k in enumerate(rc.output_keys):
                self.final_keys[k] = f"{name}:{index[pos]}:{i}"
        calls = [Call(layer=rc.op, layer_name=self.names[id(rc.op)], call_index=index[pos],
                      input_keys=[self.final_keys.get(k, k) for k in rc.input_keys],
                      output_keys=[self.final_keys[k] for k in rc.output_keys],
                      arguments=rc.node.arguments) for pos, rc in enumerate(self.raw)]
        return calls

    def attach_masks(self, calls: list[Call], inputs: dict[str, Any]) -> None:
        """Gives the calls their mask keys ([Note: masks], [Note: mask discovery] in
        `masks.py`); ``inputs``: ``{input key: KerasTensor}``."""
        final = self.final_keys
        specs = {**inputs, **{final[k]: t for k, t in self.specs.items()}}
        symbolic = {final[k]: m for k, m in self.masked.items()}
        self.masks = attach_masks(calls, specs, symbolic)

    def _name_ops(self, input_names: list[str]) -> None:
        owners: dict[str, tuple[Any, str]] = {n: (None, "the model inputs") for n in input_names}
        counts: dict[str, int] = {}
        for rc in self.raw:
            if id(rc.op) in self.names:
                continue
            if isinstance(rc.op, keras.layers.Layer):
                name = rc.op.name
            else:
                base = f"ops.{_snake(type(rc.op).__name__)}"
                n = counts.get(base, 0)
                counts[base] = n + 1
                name = base if n == 0 else f"{base}_{n}"
            other = owners.get(name)
            if other is not None and other[0] is not rc.op and rc.owner != other[1]:
                # [Note: nested names] two models nested in one may each have a layer of the
                # same name (keras_hub's CLIP: an 'embedding' in each encoder); the later one
                # is keyed by its model's path, as Keras's variable paths are
                name = f"{rc.owner}/{name}"
                other = owners.get(name)
            if other is not None and other[0] is not rc.op:
                raise TraceError(
                    f"Layer names must be unique across a model and the models nested in it. "
                    f"Received: two different layers named '{name}' (in '{other[1]}' and "
                    f"'{rc.owner}'). Give one of them another name= when creating it.")
            owners[name] = (rc.op, rc.owner)
            self.names[id(rc.op)] = name


def _has_mask(t: Any) -> bool:
    return get_keras_mask(t) is not None


def _snake(name: str) -> str:
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _ordered_nodes(fn: Any) -> list[Node]:
    """``fn``'s nodes in the order `Function._run_through_graph` runs them."""
    by_depth = fn._nodes_by_depth
    return [n for d in sorted(by_depth, reverse=True) for n in by_depth[d]]


def _local_index(fn: Any, op: Any, node: Node) -> int:
    """Index of ``node`` among ``op``'s inbound nodes that belong to ``fn``."""
    own = fn._nodes
    position = op._inbound_nodes.index(node)
    return sum(1 for j in range(position) if make_node_key(op, j) in own)


def _inner_function(model: keras.Model, node: Node) -> tuple[Any, list[Any]]:
    """The graph of a nested model and the outer KerasTensors feeding its inputs, in order."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    fn = model if isinstance(model, Functional) else getattr(model, "_functional", None)
    if fn is None:  # a subclassed model used as a layer: trace its call on fresh inputs
        fresh_args, fresh_kwargs, outer = _fresh_inputs(model, args, kwargs)
        return _symbolic_function(model, fresh_args, fresh_kwargs), outer
    first = args[0] if args else kwargs.get("inputs")
    if isinstance(first, dict) and not isinstance(fn._inputs_struct, dict):
        outer = [first[_producer(t).name] for t in fn.inputs]
    else:
        outer = tree.flatten(first)
    if len(outer) != len(fn.inputs) or not all(isinstance(t, keras.KerasTensor) for t in outer):
        raise TraceError(
            f"A nested model must be called on as many tensors as it has inputs. Received: "
            f"model '{model.name}' with {len(fn.inputs)} inputs called on {len(outer)} values. "
            f"Pass one tensor per input.")
    return fn, outer


def _fresh_inputs(model: keras.Model, args: Any, kwargs: Any) -> tuple[Any, Any, list[Any]]:
    outer: list[Any] = []

    def swap(x: Any) -> Any:
        if not isinstance(x, keras.KerasTensor):
            return x
        outer.append(x)
        return keras.Input(batch_shape=tuple(x.shape), dtype=x.dtype,
                           name=f"{model.name}_input_{len(outer) - 1}")

    fresh_args, fresh_kwargs = tree.map_structure(swap, (tuple(args), dict(kwargs)))
    return fresh_args, fresh_kwargs, outer


def _producer(t: Any) -> Any:
    return t._keras_history.operation


# -- graph -------------------------------------------------------------------------------------

def _assemble(model: keras.Model, top: _Top, calls: list[Call], read: list[Reads],
              flat: _Flattener, input_keys: list[str], output_keys: list[str]) -> TracedModel:
    fn = top.fn
    graph = LayerGraph(name=model.name)
    for t in fn.inputs:
        graph.add_input(_producer(t).name, tuple(t.shape)[1:], keras.backend.standardize_dtype(t.dtype))
    layers = {c.layer_name: c.layer for c in calls}
    owned, uses = variable_owners(calls, read)
    trainable = {id(v) for v in model.trainable_weights}
    nodes = _layer_nodes(calls, flat, owned, trainable)
    for c, rc in zip(calls, flat.raw):
        outs = [_info(k, c.layer_name, t) for k, t in zip(c.output_keys, rc.node.outputs)]
        outs += [_info(mask_key(k), c.layer_name, flat.masks[k]) for k in c.output_keys
                 if k in flat.masks]
        graph.add_layer(nodes[c.layer_name], [*c.input_keys, *filter(None, c.input_mask_keys)],
                        outs)
    masks = {k: mask_key(k) for k in flat.masks}
    output_masks = [masks.get(k) for k in output_keys]
    graph.set_outputs([*output_keys, *filter(None, output_masks)])
    graph.masks = masks
    graph.colocate, graph.ties = shared(uses, nodes)
    order = {id(v): i for i, v in enumerate(model.variables)}
    return TracedModel(
        model=model, graph=graph, calls=calls, input_keys=input_keys, output_keys=output_keys,
        input_names=_input_names(fn), output_names=_output_names(fn, output_keys),
        input_specs=list(fn.inputs), inputs_struct=fn._inputs_struct,
        outputs_struct=fn._outputs_struct, unpack_singleton=top.unpack_singleton,
        cast_all_inputs=top.cast_all_inputs, layers=layers, uses=uses, variable_order=order,
        masks=dict(masks), output_mask_keys=output_masks)


def _info(key: str, producer: str, t: Any) -> TensorInfo:
    return TensorInfo(key, producer, tuple(t.shape)[1:], keras.backend.standardize_dtype(t.dtype))


def _layer_nodes(calls: list[Call], flat: _Flattener, owned: dict[str, list[Any]],
                 trainable: set[int]) -> dict[str, LayerNode]:
    nodes: dict[str, LayerNode] = {}
    for c, rc in zip(calls, flat.raw):
        node = nodes.get(c.layer_name)
        if node is None:
            size, train, count = costs.param_stats(owned.get(c.layer_name, []), trainable)
            kind = (type(c.layer).__name__ if isinstance(c.layer, keras.layers.Layer)
                    else f"ops.{type(c.layer).__name__}")
            node = nodes[c.layer_name] = LayerNode(
                c.layer_name, kind, param_bytes=size, trainable_param_bytes=train,
                param_count=count, calls=0, layer=c.keras_name,
                variables=tuple(v.path for v in owned.get(c.layer_name, [])))
        args = rc.node.arguments
        fwd = costs.forward_flops(c.layer, args.args, args.kwargs, rc.node.input_tensors,
                                  rc.node.outputs)
        node.flops_forward += fwd
        node.flops_backward += costs.backward_flops(c.layer, fwd)
        masks = [flat.masks[k] for k in c.output_keys if k in flat.masks]
        node.activation_bytes += sum(_info("", "", t).bytes_per_sample
                                     for t in [*rc.node.outputs, *masks])
        node.calls += 1
    return nodes


def _input_names(fn: Any) -> list[str]:
    struct = fn._inputs_struct
    if isinstance(struct, dict) and all(isinstance(v, keras.KerasTensor) for v in struct.values()):
        return [str(path[0]) for path, _ in tree.flatten_with_path(struct)]
    return [_producer(t).name for t in fn.inputs]


def _output_names(fn: Any, output_keys: list[str]) -> list[str]:
    """Dict keys for dict outputs, else Keras's ``output_names`` (the layers producing the
    outputs, a nested model counting as one), else the leaf layers producing them."""
    struct = fn._outputs_struct
    if isinstance(struct, dict) and all(isinstance(v, keras.KerasTensor) for v in struct.values()):
        return [str(path[0]) for path, _ in tree.flatten_with_path(struct)]
    names = getattr(fn, "output_names", None) if isinstance(fn, Functional) else None
    if names is not None and len(names) == len(output_keys):
        return list(names)
    return [k.rsplit(":", 2)[0] for k in output_keys]
