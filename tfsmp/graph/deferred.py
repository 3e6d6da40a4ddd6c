"""Deferred variable creation: the one place tfsmp touches Keras's private initialization API.

Example::

    with deferred_scope():
        model = build_keras_model()          # variables have shapes, dtypes, paths, no storage
    mine = traced.variables_of(plan.layers(stage))
    materialize(mine)                        # allocate only this stage's variables
    release(other)                           # drop storage this rank does not own

[Note: deferred variables] Keras 3 (verified on 3.15) creates a variable inside
``keras.StatelessScope(initialize_variables=False)`` without storage: it keeps its initializer,
shape and dtype, and ``Variable._deferred_initialize()`` allocates it later. Measured here
(``tests/tf/test_deferred.py`` pins it): a Functional model of 8 Dense(4096) layers built in the
scope adds 0.4 MiB of RSS instead of 512 MiB; materializing two layers adds 133 MiB, all eight
517 MiB. Three traps, handled here:

* Keras also registers such variables in a process-global list, and *any* later
  ``StatelessScope()`` that exits at top level (for example the one in
  ``backend.compute_output_spec``, run by every symbolic call of a layer without
  ``compute_output_shape``) initializes the whole list. `deferred_scope` takes its variables
  off that list, and `materialize` takes off the ones it initializes.
* Reading ``.value`` of a deferred variable does not fail: it evaluates the initializer every
  time. Seeded initializers (Keras fixes an unseeded initializer's seed when the initializer is
  constructed, from Python's ``random``, so ``keras.utils.set_random_seed`` makes it
  reproducible) return the same values each time, so this is slow, never wrong; an ``assign``
  on a deferred variable fails. Use `is_deferred` to check before running a layer.
* Initial values do not depend on which variables a rank materializes or in which order (each
  initializer carries its own seed), so 1, 2 or 4 stages start from the same weights. A
  ``keras.random.SeedGenerator`` passed as an initializer's seed breaks this (its state advances
  per draw); tfsmp does not support that.

`release` drops a variable's TensorFlow storage. With oneDNN enabled (the x86 default), TF keeps
freed buffers in its own pool: the memory is reused by later tensors of this process but is
returned to the OS only with ``TF_ENABLE_ONEDNN_OPTS=0``. Ranks should therefore not materialize
what they do not own in the first place; `release` is for variables that must be dropped later.

[Note: a leaked name scope] Keras's TensorFlow ``name_scope.__enter__`` pushes itself on Keras's
global name-scope stack *before* it enters ``tf.name_scope``, and in graph mode TensorFlow
refuses a root scope whose name starts with ``_`` (a layer named ``_x``, or the default name of a
class ``_Block``). The ``with`` then never entered, so its ``__exit__`` never pops: every
variable created after that in the process got the failed layer's name as a path prefix
(``_block/d0/kernel``), which broke the next model's plan, tied-weight rules and checkpoint
names. Plain Keras fails the same way in ``fit`` (the name is its limit), but tfsmp probes
layers in scratch graphs and goes on when a probe fails, and a process may trace again after a
refused model. So `deferred_scope`, which wraps every trace and probe, leaves the stack as it
found it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import keras
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import get_stateless_scope, in_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

from tfsmp.errors import StepError

__all__ = ["ForeignRead", "deferred_scope", "is_deferred", "materialize", "release", "stand_in_reads"]

_STAND_IN = {"depth": 0}


@contextmanager
def stand_in_reads() -> Iterator[None]:
    """Inside, a read of a released variable gives zeros of its shape instead of raising: for
    walks that need every variable's shape but no value of another stage's (the Keras weights
    layout: [Note: computed entries] in tfsmp/checkpoint/keras_h5.py). Not thread-safe: the
    walks run on the main thread."""
    _STAND_IN["depth"] += 1
    try:
        yield
    finally:
        _STAND_IN["depth"] -= 1

_GLOBAL_LIST = "uninitialized_variables"  # Keras's registry of deferred variables
_SAVED = "_tfsmp_initializer"  # attribute keeping an initializer across materialize/release
_NAME_SCOPES = "name_scope_stack"  # Keras's stack of open name scopes (variable paths)


@contextmanager
def deferred_scope() -> Iterator[None]:
    """Creates every Keras variable inside the block without storage. See [Note: deferred variables].

    Nested inside another ``StatelessScope`` it leaves the new variables to the outer scope's
    policy; at top level it keeps them deferred until `materialize`.
    """
    outermost = get_stateless_scope() is None
    before = {id(v) for v in _global_list()}
    scopes = list(global_state.get_global_attribute(_NAME_SCOPES, None) or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        _restore_name_scopes(scopes)
        if outermost:
            # Off the global list, or the next top-level StatelessScope would allocate them all.
            kept = [v for v in _global_list() if id(v) in before]
            global_state.set_global_attribute(_GLOBAL_LIST, kept)


def _restore_name_scopes(entered: list[Any]) -> None:
    """Puts Keras's name-scope stack back as it was (see [Note: a leaked name scope])."""
    stack = global_state.get_global_attribute(_NAME_SCOPES, None)
    if stack is not None and stack != entered:
        stack[:] = entered


def is_deferred(variable: keras.Variable) -> bool:
    """True if the variable has no storage yet (deferred or released)."""
    return getattr(variable, "_value", None) is None


def materialize(variables: Iterable[keras.Variable]) -> list[keras.Variable]:
    """Allocates and initializes exactly these variables (already allocated ones are skipped).

    Args:
        variables: Keras variables, typically ``TracedModel.variables_of(stage_layers)``.

    Returns:
        The variables this call allocated.

    Raises:
        RuntimeError: inside a ``StatelessScope`` (Keras forbids initializing there), or for a
            variable that was built eagerly and then released (its initializer is gone).
    """
    if in_stateless_scope():
        raise RuntimeError(
            "Variables cannot be materialized inside a keras.StatelessScope (or deferred_scope). "
            "Received: a call to materialize() inside one. Call it after the `with` block.")
    done: list[keras.Variable] = []
    for v in _distinct(variables):
        if not is_deferred(v):
            continue
        init = v._initializer
        if isinstance(init, _Released):
            if init.initializer is None:
                raise RuntimeError(
                    f"Only a variable created deferred can be materialized again after release(). "
                    f"Received: variable '{v.path}', built eagerly, then released. Materialize "
                    f"it on the rank that owns it, or assign() it from a checkpoint.")
            v._initializer = init.initializer
        keep = v._initializer
        v.__dict__.pop("_direct_assign", None)  # `release`'s refusal
        v._deferred_initialize()
        setattr(v, _SAVED, keep)
        done.append(v)
    if done:
        ids = {id(v) for v in done}
        # A variable left on Keras's list would be initialized a second time (and raise) later.
        global_state.set_global_attribute(
            _GLOBAL_LIST, [v for v in _global_list() if id(v) not in ids])
    return done


def release(variables: Iterable[keras.Variable],
            sources: Mapping[int, Callable[[], Any]] | None = None) -> list[keras.Variable]:
    """Drops the storage of these variables; shape, dtype and path stay.

    A released variable is deferred again: `materialize` re-creates it with its initial values
    (if it was created deferred). Until then an eager read raises `tfsmp.StepError`, while
    symbolic shape inference keeps working. ``sources`` maps a variable's ``id`` to a function
    returning its current value from the rank that holds it: an eager read of that variable
    returns it instead ([Note: remote reads] in tfsmp/comm/remote_reads.py). A variable still
    deferred (never materialized here) gets the same treatment when it has a source, so that
    a read gives the holder's value, not its initial one.

    Returns:
        The variables this call released (or gave a source).
    """
    done: list[keras.Variable] = []
    for v in _distinct(variables):
        source = sources.get(id(v)) if sources else None
        if is_deferred(v):
            if source is None:
                continue
            init = v._initializer
            if isinstance(init, _Released):
                init.source = source
            else:
                v._initializer = _Released(v.path, init, source)
            v._direct_assign = _refused_assign(v.path)  # noqa: SLF001 (until materialized)
            done.append(v)
            continue
        v._initializer = _Released(v.path, getattr(v, _SAVED, None), source)
        v._value = None  # noqa: SLF001 (a Keras Variable's value slot)
        v._direct_assign = _refused_assign(v.path)  # noqa: SLF001 (until materialized again)
        done.append(v)
    return done


def _refused_assign(path: str) -> Callable[[Any], None]:
    """What an ``assign`` of a released variable does (Keras's ``_direct_assign`` would write
    to storage that is gone: ``'NoneType' object has no attribute 'assign'``)."""

    def refuse(value: Any) -> None:
        raise StepError(
            f"A variable can be assigned only on the rank that holds it. Received: an assign "
            f"to variable '{path}', whose storage was released on this rank (another stage "
            f"owns it). Assign it on that rank (every rank runs your script: guard the assign "
            f"with the rank that holds it), or load weights with model.load_weights().")

    return refuse


class ForeignRead(StepError):
    """A compiled function read a variable that another rank holds. Made from its message
    alone, as Keras remakes an error raised inside a layer's call (with the call's arguments
    added to the message): `path` reads the variable's path back from it."""

    @property
    def path(self) -> str:
        found = re.search(r"a read of variable '([^']*)'", str(self))
        return found.group(1) if found else ""


class _Released:
    """Initializer of a released variable: the original one for shape inference, the holder's
    value for an eager read where a source is known ([Note: remote reads]), else an error
    (a rank reading a variable another stage owns without one is a bug, not a recomputation)."""

    def __init__(self, path: str, initializer: Any, source: Callable[[], Any] | None = None
                 ) -> None:
        self.path = path
        self.initializer = initializer
        self.source = source

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        if _STAND_IN["depth"]:
            return keras.ops.zeros(shape, dtype=dtype)
        if in_symbolic_scope():
            if self.initializer is not None:
                return self.initializer(shape, dtype=dtype)
            return keras.ops.zeros(shape, dtype=dtype)
        if self.source is not None:
            import tensorflow as tf

            if tf.executing_eagerly():
                return keras.ops.convert_to_tensor(self.source(), dtype=dtype)
            raise ForeignRead(
                f"A compiled function cannot read another stage's variable: its value would be "
                f"fixed in the graph. Received: a read of variable '{self.path}' (held by "
                f"another rank) inside a tf.function. Read it eagerly (outside the function), "
                f"or run the function on the rank that holds it.")
        raise StepError(
            f"This variable's storage was released on this rank (another stage owns it). "
            f"Received: a read of variable '{self.path}'. Run only the layers of this rank's "
            f"stage, or materialize() the variable first.")


def _global_list() -> list[keras.Variable]:
    return list(global_state.get_global_attribute(_GLOBAL_LIST, None) or [])


def _distinct(variables: Iterable[keras.Variable]) -> list[keras.Variable]:
    seen: set[int] = set()
    out: list[keras.Variable] = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out
