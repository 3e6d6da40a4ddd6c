"""A partitioned optimizer's state in Keras's weights-file layout: ``optimizer/vars/<i>``.

Example::

    order = keras_order(dm)             # what optimizer/vars/<i> holds, for every i
    order[0]                            # ("global", "iteration")
    order[2]                            # ("slot", ("d0/kernel", "momentum"))

[Note: Keras optimizer layout] ``keras.Model.save_weights`` stores the optimizer as the group
``optimizer/vars`` (attribute ``name``) with one dataset per ``optimizer.variables`` entry, in
the order a plain-Keras optimizer built on ``model.trainable_variables`` creates them: its
iteration count and learning rate, then each optimizer's slots (Adam: momentum and velocity of
every variable in turn). In tfsmp every rank's optimizer holds only its stages' slots. To
write and read that layout anyway, tfsmp builds a *shadow* of the optimizer (same class and
config) on the whole model's trainable variables inside `deferred_scope`, so its slots have
names, shapes and order but no storage, and names each of its variables the partition-free
way ([Note: slot keys] in tfsmp/checkpoint/layout.py): (model key, slot) or a global name. Entry
i is then written by the rank that writes the model variable (globals: the rank whose
optimizer stepped most), and read by every rank that holds it. So a weights file of a
`DistributedModel` loads into a plain-Keras model with its optimizer state, and the reverse.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras

from tfsmp.checkpoint.layout import classify, layout_of, optimizer_state

if TYPE_CHECKING:
    from tfsmp.runtime.view import RankView

__all__ = ["GROUP", "keras_order", "local_state"]

GROUP = "optimizer/vars"

Kind = tuple[str, Any]  # ("slot", (model key, slot name)) | ("global", name)
_CACHE: weakref.WeakKeyDictionary[Any, tuple[int, str, list[Kind]]] = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True)
class _Reference:
    """What an optimizer reads of a model variable to build its slots: its path, shape and dtype.
    Building on these, not on the variables, reads no variable's value (Keras's TensorFlow
    optimizer reads ``reference.value`` to colocate slots, which fails for a variable this rank
    released and allocates one it never had); the shadow uses Keras's backend-neutral
    ``add_variable_from_reference``, which reads only these."""

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    _unique_id: int


def _shadow(optimizer: Any, variables: list[Any]) -> tuple[Any, dict[int, Any]]:
    """A storage-less copy of ``optimizer`` built on stand-ins of ``variables``, and
    ``{id(stand-in): variable}`` (see the module docstring)."""
    from tfsmp.graph.deferred import deferred_scope

    stand_ins = [_Reference(str(v.path), str(v.name), tuple(v.shape), str(v.dtype), 10**9 + i)
                 for i, v in enumerate(variables)]
    refs = {id(r): v for r, v in zip(stand_ins, variables)}
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    shadow = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    for opt in (shadow, getattr(shadow, "inner_optimizer", None)):
        if opt is not None:  # the backend-neutral method: no colocation with the reference
            opt.add_variable_from_reference = BaseOptimizer.add_variable_from_reference.__get__(opt)
    with deferred_scope():  # scalars (iterations, learning rate) exist already: only slots defer
        shadow.build(stand_ins)
    return shadow, refs


def _kinds(shadow: Any, variables: list[Any], layout: RankView) -> dict[int, Kind]:
    """``{id(shadow variable): kind}``: a global by name, or a slot by (model key, slot)
    ([Note: slot keys] in tfsmp/checkpoint/layout.py, applied to the model's own paths)."""
    return {id(ov): (kind, key) for ov, kind, key in classify(shadow, variables, layout.keys)}


def keras_order(dm: Any) -> list[Kind]:
    """What each ``optimizer/vars/<i>`` of the model's weights file holds, in Keras's order.

    Raises:
        CheckpointError: the optimizer has a variable tfsmp cannot name.
    """
    optimizer = dm.optimizer
    signature = repr(keras.optimizers.serialize(optimizer))
    cached = _CACHE.get(dm)
    if cached is not None and cached[0] == id(optimizer) and cached[1] == signature:
        return cached[2]
    layout = layout_of(dm)
    variables = list(dm.source_model().trainable_variables)
    shadow, _ = _shadow(optimizer, variables)
    kinds = _kinds(shadow, variables, layout)
    order = [kinds[id(v)] for v in shadow.variables]
    _CACHE[dm] = (id(optimizer), signature, order)
    return order


def local_state(dm: Any) -> tuple[dict[tuple[str, str], Any], dict[str, Any]]:
    """This rank's optimizer variables by (model key, slot) and by global name; built first if
    needed (a rank whose stages train nothing builds it empty)."""
    optimizer = dm.optimizer
    view = dm.rank_view
    if not optimizer.built:
        optimizer.build(list(view.optimizer_variables))  # its replica's, when sharded
    return optimizer_state(optimizer, layout_of(dm))
