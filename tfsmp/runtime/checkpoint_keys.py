"""Checkpoint keys: the partition-independent name of every variable of a traced model.

Example::

    keys = variable_keys(traced)
    keys[id(model.get_layer("d0").kernel)]      # "d0/kernel": layer name / weight name

[Note: variable keys] A checkpoint key is ``<layer>/<weight>``: the name of the leaf layer that
owns the variable (a layer whose ``variables`` contain it, else the first call that reads it),
then the variable's path below that layer, or its name when its path does not start with the
layer (a Dropout's seed-generator state is ``seed_generator_7/seed_generator_state``, a number
from a process-wide counter; its key is ``dropout/seed_generator_state``). Keys repeat only in
odd models; the second is suffixed ``#1`` and so on, in execution order. Keys depend only on the
model, never on stages or ranks, so a checkpoint written under one partitioning reads under any.
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["variable_keys"]


def _owner_layers(traced: Any) -> list[tuple[Any, str]]:
    """(variable, owning leaf layer name) for every variable the traced calls read, each once."""
    order: list[str] = []
    for call in traced.calls:  # a tied copy's node keys its variables by its Keras layer
        name = getattr(call, "keras_name", "") or call.layer_name
        if name not in order:
            order.append(name)
    seen: set[int] = set()
    out: list[tuple[Any, str]] = []
    for name in order:  # first pass: the layer that owns it as a variable
        layer = traced.layer(name)
        if isinstance(layer, keras.layers.Layer):
            for v in layer.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append((v, name))
    for name in order:  # then variables only read (e.g. by a keras.ops call)
        for v in traced.uses.get(name, ()):
            if id(v) not in seen:
                seen.add(id(v))
                out.append((v, name))
    return out


def variable_keys(traced: Any) -> dict[int, str]:
    """``{id(variable): key}`` for every variable of a traced model. See [Note: variable keys]."""
    keys: dict[int, str] = {}
    used: dict[str, int] = {}
    for v, layer in _owner_layers(traced):
        path = str(v.path)
        rel = path[len(layer) + 1:] if path.startswith(layer + "/") else str(v.name)
        key = f"{layer}/{rel}"
        count = used.get(key, 0)
        used[key] = count + 1
        keys[id(v)] = key if count == 0 else f"{key}#{count}"
    return keys
