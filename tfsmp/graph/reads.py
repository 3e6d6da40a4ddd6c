"""Which variables each traced call reads, and so which graph nodes share (tie) variables.

Example::

    reads = call_reads(calls)                 # per call: {id(variable): variable}
    calls = split_tied_calls(calls, reads)    # one node per call of a shared layer
    owned, uses = variable_owners(calls, reads)
    colocate, ties = shared(uses, nodes)

[Note: variable reads] A layer's variables are not all read by each of its calls: keras_hub's
``ReversibleEmbedding(tie_weights=False)`` (Llama, Mistral, Phi-3) is one layer called twice that
owns two matrices, and its forward call reads only ``embeddings``, its ``reverse=True`` call only
``reverse_embeddings``. Taking every call to read all of the layer's variables made both matrices
tied copies on the first and last stage: the copy that never reads a matrix got a dense zero
gradient, the tied sum became dense, and Adam diverged (and the memory doubled). So where a
variable could be shared — a layer called more than once, or a variable that several layers hold
— each call is run once more, on placeholders in a scratch graph (as Keras runs a layer without
``compute_output_shape`` in ``backend.compute_output_spec``), with ``training`` True and False,
inside a `keras.StatelessScope` that records reads: in Keras 3 (checked on 3.15, TF backend)
every read of a variable goes through ``KerasVariable.value``, which asks the active stateless
scope for ``get_current_value(variable)`` first — ``tf.convert_to_tensor`` and every TF op
(``__tf_tensor__``), ``keras.ops`` (the TF backend's ``convert_to_tensor`` passes a variable
through and the op then converts it), ``tf.gather`` (a Keras variable has no ``sparse_read``, so
it is converted too), ``.handle``, arithmetic operators and ``.numpy()``. The scope answers
each read with a placeholder (`ScratchScope`), so nothing runs, no weight is allocated and no
initializer enters the graph. A variable passed to a
``keras.ops`` call is read by it. A layer's variable that none of its calls reads stays with its
first call's node, so every variable still lives on some stage. If a call cannot run on
placeholders, it is taken to read all of its layer's variables, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend.common.symbolic_scope import SymbolicScope

from tfsmp.graph import costs
from tfsmp.graph.deferred import deferred_scope
from tfsmp.graph.ir import LayerNode, Tie

__all__ = ["ScratchScope", "call_reads", "placeholder", "record_reads", "scratch_graph", "shared",
           "split_tied_calls", "variable_owners"]

Reads = dict[int, Any]  # id(variable) -> variable, in first-read order


def call_reads(calls: list[Any]) -> list[Reads]:
    """The variables each call reads, aligned with ``calls``. See [Note: variable reads]."""
    declared = [_declared(c) for c in calls]
    readers: dict[int, int] = {}
    for vs in declared:
        for i in vs:
            readers[i] = readers.get(i, 0) + 1
    reads = []
    for c, vs in zip(calls, declared):
        if isinstance(c.layer, keras.layers.Layer) and any(readers[i] > 1 for i in vs):
            vs = _narrowed(c, vs)
        reads.append(vs)
    _keep_unread(calls, reads)
    return reads


def _declared(call: Any) -> Reads:
    """What a call may read: its layer's variables and the variables passed to it."""
    op = call.layer
    found: Reads = {}
    if isinstance(op, keras.layers.Layer):
        found.update((id(v), v) for v in op.variables)
    found.update(_arguments(call))
    return found


def _arguments(call: Any) -> Reads:
    return {id(v): v for v in call.arguments._flat_arguments if isinstance(v, keras.Variable)}


def _narrowed(call: Any, declared: Reads) -> Reads:
    """``declared`` cut down to what the call reads (its variable arguments always count)."""
    recorded = record_reads(call)
    if recorded is None:
        return declared
    kept = {i: v for i, v in declared.items() if i in recorded}
    kept.update((i, v) for i, v in recorded.items() if i not in kept)
    kept.update(_arguments(call))
    return kept


def _keep_unread(calls: list[Any], reads: list[Reads]) -> None:
    """A layer's variables that none of its calls reads go with its first call."""
    first: dict[int, int] = {}
    seen: dict[int, set[int]] = {}
    for pos, c in enumerate(calls):
        if isinstance(c.layer, keras.layers.Layer):
            first.setdefault(id(c.layer), pos)
            seen.setdefault(id(c.layer), set()).update(reads[pos])
    for key, pos in first.items():
        layer = calls[pos].layer
        reads[pos].update((id(v), v) for v in layer.variables if id(v) not in seen[key])


class ScratchScope(keras.StatelessScope):  # type: ignore[misc]
    """A stateless scope for running calls in a scratch graph: it notes every variable read
    ([Note: variable reads]) and reads each variable as a placeholder of its shape and dtype
    (or as the value the call assigned to it), so no initializer or weight enters the graph."""

    def __init__(self) -> None:
        super().__init__(initialize_variables=False)
        self.read: Reads = {}
        self._values: dict[int, Any] = {}

    def get_current_value(self, variable: Any) -> Any:
        self.read.setdefault(id(variable), variable)
        value = super().get_current_value(variable)  # assigned inside this scope
        if value is None:
            value = self._values.get(id(variable))
        if value is None:
            value = self._values[id(variable)] = tf.compat.v1.placeholder(
                shape=tuple(variable.shape), dtype=variable.dtype)
        return value


@contextmanager
def scratch_graph() -> Iterator[ScratchScope]:
    """A fresh graph to run calls on placeholders in, as ``backend.compute_output_spec`` does:
    variables created inside stay deferred, variables read are placeholders."""
    with deferred_scope(), tf.__internal__.FuncGraph("tfsmp_scratch").as_default():
        scope = ScratchScope()
        with scope, SymbolicScope():
            yield scope


def record_reads(call: Any) -> Reads | None:
    """The variables one call reads when run (training and inference), or None when the call
    cannot run on placeholders. See [Note: variable reads]."""
    read: Reads = {}
    takes_training = "training" in getattr(call.layer, "_call_context_args", ())
    try:
        for training in ((True, False) if takes_training else (None,)):
            with scratch_graph() as scope:
                values = {id(t): placeholder(t) for t in call.arguments.keras_tensors}
                args, kwargs = call.arguments.fill_in(values)
                if training is not None:
                    kwargs = {**kwargs, "training": training}
                tree.flatten(call.layer(*args, **kwargs))
            read.update(scope.read)
    except Exception:  # a call that only runs on real data: assume it reads everything
        return None
    return read


def placeholder(t: Any) -> Any:
    """A placeholder in the current scratch graph shaped like KerasTensor ``t`` (as
    ``backend.compute_output_spec`` makes them)."""
    if t.sparse:
        return tf.compat.v1.sparse_placeholder(shape=t.shape, dtype=t.dtype)
    return tf.compat.v1.placeholder(shape=t.shape, dtype=t.dtype)


# -- nodes and owners --------------------------------------------------------------------------

def split_tied_calls(calls: list[Any], reads: list[Reads]) -> list[Any]:
    """Gives each call of a multiply-called leaf whose read variables are all trainable its own
    graph node (see [Note: tied copies] in `ir.py`); the first call in execution order keeps the
    layer's name. A leaf reading a non-trainable variable (seed state, moving statistics) stays
    one node: that state must advance in call order on one stage."""
    by_layer: dict[str, list[int]] = {}
    for pos, c in enumerate(calls):
        by_layer.setdefault(c.layer_name, []).append(pos)
    taken = set(by_layer)
    for name, mine in by_layer.items():
        read = [v for pos in mine for v in reads[pos].values()]
        if len(mine) < 2 or not all(v.trainable for v in read):
            continue
        for pos in mine[1:]:
            c = calls[pos]
            node = f"{name}@{c.call_index}"
            while node in taken:
                node += "_"
            taken.add(node)
            c.keras_name, c.layer_name = name, node
    return calls


def variable_owners(calls: list[Any], reads: list[Reads]
                    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Which node owns each weight (its bytes count there) and which variables each node reads.

    A layer's weight is owned by the first of its layer's nodes that reads it; a variable passed
    to a ``keras.ops`` call (weight tying in a subclassed ``call``) that no layer owns, by the
    first node reading it.
    """
    uses: dict[str, Reads] = {}
    for c, vs in zip(calls, reads):
        uses.setdefault(c.layer_name, {}).update(vs)
    owner: dict[int, str] = {}
    for c in calls:
        if isinstance(c.layer, keras.layers.Layer):
            for v in c.layer.weights:
                if id(v) in uses[c.layer_name]:
                    owner.setdefault(id(v), c.layer_name)
    for c in calls:
        for i in _arguments(c):
            owner.setdefault(i, c.layer_name)
    owned = {name: [v for i, v in vs.items() if owner.get(i) == name] for name, vs in uses.items()}
    return owned, {name: list(vs.values()) for name, vs in uses.items()}


def shared(uses: dict[str, list[Any]], nodes: dict[str, LayerNode]
           ) -> tuple[list[frozenset[str]], list[Tie]]:
    """Nodes reading a common variable: co-located groups for non-trainable ones (they change in
    call order), `Tie` copies for trainable ones, one per distinct set of readers."""
    users: dict[int, list[str]] = {}
    variables: dict[int, Any] = {}
    for name, vs in uses.items():
        for v in vs:
            users.setdefault(id(v), []).append(name)
            variables[id(v)] = v
    groups: list[frozenset[str]] = []
    tied: dict[tuple[str, ...], list[Any]] = {}
    for i, names in users.items():
        if len(set(names)) < 2:
            continue
        if variables[i].trainable:
            tied.setdefault(tuple(dict.fromkeys(names)), []).append(variables[i])
            continue
        group = frozenset(names)
        if group not in groups:
            groups.append(group)
    return groups, [_tie(names, vs, nodes) for names, vs in tied.items()]


def _tie(names: tuple[str, ...], vs: list[Any], nodes: dict[str, LayerNode]) -> Tie:
    owner = next((n for n in names if nodes[n].param_bytes and any(
        str(v.path) in nodes[n].variables for v in vs)), names[0])
    size, train, _ = costs.param_stats(vs, {id(v) for v in vs})
    order = (owner, *(n for n in names if n != owner))
    return Tie(nodes=order, variables=tuple(str(v.path) for v in vs), param_bytes=size,
               trainable_param_bytes=train)
