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

[Note: the optimizer as Keras lists it] A script reads ``model.optimizer.variables`` as Keras
lists them (Keras's own tests zip them with a loaded model's, pair by pair). On a rank that
holds only some slots (``partitions > 1``, or sharded optimizer state) the property returns
the shadow's order with this rank's own variables where it holds them and, for the others,
storage-less stand-ins (same name, path, shape and dtype) whose eager reads ask the rank that
holds the slot (`RankView.slot_writer`) for its current value ([Note: remote reads] in
tfsmp/comm/remote_reads.py); an assign to a stand-in is refused. The holder answers such a
read by its (model key, slot) or global name (`attach_view` registers the lookup). What a rank
holds is `tfsmp.keras.porting.rank_variables(optimizer)` (tfsmp's own checkpoint and memory
code use it), and the property falls back to that list where a slot cannot be named. Horovod's
``broadcast_variables`` skips what a rank does not hold (`tfsmp.comm.horovod`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras

from tfsmp.checkpoint.layout import classify, layout_of, optimizer_parts, optimizer_state
from tfsmp.errors import CheckpointError

if TYPE_CHECKING:
    from tfsmp.runtime.view import RankView

__all__ = ["GROUP", "attach_view", "keras_groups", "keras_order", "local_state"]

GROUP = "optimizer/vars"

Kind = tuple[str, Any]  # ("slot", (model key, slot name)) | ("global", name)
Spec = tuple[str, tuple[int, ...], str]  # an optimizer variable's name, shape and dtype
# dm -> (id(optimizer), its config, `keras_order`, each entry's `Spec`, `keras_groups`)
_CACHE: weakref.WeakKeyDictionary[Any, tuple[int, str, list[Kind], list[Spec], Any]] = (
    weakref.WeakKeyDictionary())
_STAND_INS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


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
    for opt in _parts(shadow):  # the backend-neutral method: no colocation with the reference
        opt.add_variable_from_reference = BaseOptimizer.add_variable_from_reference.__get__(opt)
    with deferred_scope():  # scalars (iterations, learning rate) exist already: only slots defer
        shadow.build(stand_ins)
    return shadow, refs


def _parts(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it applies through (`optimizer_parts`), each of which
    Keras saves in a group of its own."""
    return [opt for _, opt in optimizer_parts(optimizer)]


def _groups(shadow: Any, optimizer: Any, kinds: dict[int, Kind]
            ) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, str, Kind]]]:
    """The optimizer's groups of a Keras weights file (each with its ``name`` attribute, the
    real optimizer's) and their datasets' kinds: Keras's own saving walk over the shadow, so a
    sub-optimizer's group (``optimizer/optimizers/adam/vars``) is where Keras puts it."""
    from keras.src.saving import saving_lib

    from tfsmp.checkpoint.keras_h5 import _Recorder

    names = {str(a.name): str(b.name) for a, b in zip(_parts(shadow), _parts(optimizer))}
    for part in _parts(shadow):  # Keras's stores each variable's value: the shadow has none
        part.save_own_variables = functools.partial(_store_variables, part)
    recorder = _Recorder()
    saving_lib._save_state(shadow, weights_store=recorder, assets_store=None,
                           inner_path="optimizer", visited_saveables=set())
    groups = [(g, {**meta, "name": names.get(str(meta.get("name")), meta.get("name"))})
              for g, meta in recorder.groups]
    entries = []
    for e in recorder.entries:
        kind = kinds.get(id(e.value))
        if kind is None:
            raise CheckpointError(
                f"Every dataset Keras saves for an optimizer must be one of its variables. "
                f"Received: '{e.dataset}' of {type(optimizer).__name__}. Fix: save with "
                f"save_weights of a plain Keras model, or use a Keras optimizer.")
        entries.append((e.group, e.key, kind))
    return groups, entries


def _store_variables(optimizer: Any, store: Any) -> None:
    """Keras's ``save_own_variables``, storing the variables themselves (for `_Recorder`)."""
    for i, variable in enumerate(optimizer.variables):
        store[str(i)] = variable


def _kinds(shadow: Any, variables: list[Any], layout: RankView) -> dict[int, Kind]:
    """``{id(shadow variable): kind}``: a global by name, or a slot by (model key, slot)
    ([Note: slot keys] in tfsmp/checkpoint/layout.py, applied to the model's own paths)."""
    return {id(ov): (kind, key) for ov, kind, key in classify(shadow, variables, layout.keys)}


def keras_order(dm: Any) -> list[Kind]:
    """What each ``optimizer/vars/<i>`` of the model's weights file holds, in Keras's order.

    Raises:
        CheckpointError: the optimizer has a variable tfsmp cannot name.
    """
    return _shadow_order(dm)[2]


def keras_groups(dm: Any) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, str, Kind]]]:
    """Every group of the optimizer's state in a Keras weights file, and what each dataset
    holds: ``optimizer/vars`` (`keras_order`) and, for a MultiOptimizer or a loss-scale wrapper,
    the sub-optimizers' own groups, as Keras writes them.

    Raises:
        CheckpointError: the optimizer has a variable tfsmp cannot name.
    """
    groups = _shadow_order(dm)[4]
    if isinstance(groups, CheckpointError):
        raise groups
    return groups  # type: ignore[no-any-return]


def _shadow_order(dm: Any) -> tuple[int, str, list[Kind], list[Spec], Any]:
    """``dm``'s `_CACHE` entry, made from a shadow of its optimizer when the optimizer changed."""
    optimizer = dm.optimizer
    signature = repr(keras.optimizers.serialize(optimizer))
    cached = _CACHE.get(dm)
    if cached is not None and cached[0] == id(optimizer) and cached[1] == signature:
        return cached
    layout = layout_of(dm)
    variables = list(dm.source_model().trainable_variables)
    shadow, _ = _shadow(optimizer, variables)
    kinds = _kinds(shadow, variables, layout)
    order = [kinds[id(v)] for v in shadow.variables]
    specs = [(str(v.name), tuple(v.shape), str(v.dtype)) for v in shadow.variables]
    try:
        groups: Any = _groups(shadow, optimizer, kinds)
    except CheckpointError as e:  # raised by `keras_groups` alone: the order still serves
        groups = e
    _CACHE[dm] = (id(optimizer), signature, order, specs, groups)
    return _CACHE[dm]


def attach_view(dm: Any) -> None:
    """Makes ``dm``'s optimizer list its variables as Keras's would (every rank), and this
    rank answer reads of the slots it holds ([Note: the optimizer as Keras lists it])."""
    from tfsmp.comm import remote_reads
    from tfsmp.keras.porting import KERAS_VIEW

    service = remote_reads.service()
    optimizer = getattr(dm, "optimizer", None)
    view = dm.rank_view
    if (service is None or optimizer is None or view is None
            or (view.pipeline_size < 2 and view.owned is None)):  # every slot is here
        return
    build = service.build_of(view.traced)
    if build is None:
        return
    model = weakref.ref(dm)
    service.resolve(build, lambda key: _held_slot(model(), key))
    setattr(optimizer, KERAS_VIEW, lambda: _keras_variables(model(), optimizer, build))


def _held_slot(dm: Any, key: Any) -> Any:
    """The optimizer variable of kind ``key`` this rank holds, if any (answers a remote read)."""
    if dm is None or not getattr(dm.optimizer, "built", False):
        return None
    slots, globals_ = optimizer_state(dm.optimizer, layout_of(dm))
    kind, name = key
    return slots.get(tuple(name)) if kind == "slot" else globals_.get(name)


def _keras_variables(dm: Any, optimizer: Any, build: int) -> list[Any] | None:
    """``optimizer.variables`` as a plain-Keras optimizer built on the whole model lists them:
    this rank's own, and stand-ins of the others' that read the holder's value; None (the
    rank's own list) where that list cannot be made."""
    if dm is None or dm.optimizer is not optimizer or not optimizer.built:
        return None
    view = layout_of(dm)
    try:
        _, _, order, specs, _ = _shadow_order(dm)
        slots, globals_ = optimizer_state(optimizer, view)
    except Exception:  # a model tfsmp cannot name the slots of: its own list, as before
        return None
    stand_ins = _STAND_INS.setdefault(dm, {})
    listed: list[Any] = []
    for (kind, key), spec in zip(order, specs):
        held = globals_.get(key) if kind == "global" else slots.get(key)
        if held is None and kind == "global":
            return None
        if held is None:
            holder = view.slot_writer.get(key[0])
            if holder is None:
                return None
            cached = stand_ins.get((id(optimizer), kind, key))
            if cached is None:
                cached = stand_ins[(id(optimizer), kind, key)] = _stand_in(
                    optimizer, spec, holder, (build, (kind, tuple(key))))
            held = cached
        listed.append(held)
    return listed


def _stand_in(optimizer: Any, spec: Spec, holder: int,
              key: tuple[int, Any]) -> Any:
    """A storage-less variable named and shaped as the optimizer's slot ``spec`` whose eager
    reads ask world rank ``holder`` for its value ([Note: remote reads])."""
    from keras.src.backend import name_scope

    from tfsmp.comm import remote_reads
    from tfsmp.graph.deferred import deferred_scope, release

    name, shape, dtype = spec
    with deferred_scope(), name_scope(optimizer.name, caller=optimizer):
        v = keras.Variable(initializer="zeros", shape=shape, dtype=dtype, trainable=False,
                           name=name)
    service = remote_reads.service()
    assert service is not None
    release([v], {id(v): service.source(holder, key, str(v.path))})
    return v


def local_state(dm: Any) -> tuple[dict[tuple[str, str], Any], dict[str, Any]]:
    """This rank's optimizer variables by (model key, slot) and by global name; built first if
    needed (a rank whose stages train nothing builds it empty)."""
    optimizer = dm.optimizer
    view = dm.rank_view
    if not optimizer.built:
        optimizer.build(list(view.optimizer_variables))  # its replica's, when sharded
    return optimizer_state(optimizer, layout_of(dm))
