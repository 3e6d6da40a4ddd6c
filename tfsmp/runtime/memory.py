"""Memory discipline of a rank's optimizer step: one variable's update at a time.

Example::

    @tf.function
    def apply(grads):
        with one_variable_at_a_time(optimizer):
            optimizer.apply(grads, variables)

[Note: one variable at a time] Keras's optimizer step is a Python loop over the variables whose
ops (for Adam: ``g - m``, ``g²``, ``g² - v``, ``m·α``, ``√v + ε`` and the quotient, each as large
as the variable) become one graph. Inside a ``tf.function`` nothing orders one variable's update
before the next one's, and when every gradient is ready at once (read from accumulators) the
executor starts them all together: measured on 4 Dense(4096) layers, Adam's step held 320-384
MiB of temporaries, 1.25-1.5x the weights, above the 4x of weights, accumulators and slots. In
plain Keras's train step the gradients arrive one by one from the backward pass, so its updates
run nearly in turn. Here each variable's gradient is made to wait (a control dependency) for the
previous variable's update to finish, so at most one variable's temporaries are alive: the
step's transient memory is bounded by the largest variable, not the model. The ops are the same
ops on the same values, so the result is bit-identical; only their order changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from tfsmp.runtime.fused_updates import update_step_as

__all__ = ["DirectUpdate", "is_multi_optimizer", "one_variable_at_a_time"]


@contextlib.contextmanager
def one_variable_at_a_time(optimizer: Any) -> Iterator[None]:
    """Within a ``tf.function`` trace, chains the optimizer's per-variable updates ([Note: one
    variable at a time]). A loss-scale wrapper's inner optimizer is chained too. Enter
    `fused_updates` (fused_updates.py) first: the chain wraps whatever update_step is current."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    original = inner.update_step
    done: list[tf.Tensor] = []

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        if done and isinstance(gradient, tf.Tensor):
            with tf.control_dependencies(done):
                gradient = tf.identity(gradient)
        result = original(gradient, variable, learning_rate)
        # a read ordered after the update's assignments (automatic control dependencies)
        done[:] = [tf.identity(_handle_value(variable))]
        return result

    with update_step_as(inner, update_step):
        yield


def _handle_value(variable: Any) -> tf.Tensor:
    value = getattr(variable, "value", variable)
    return value() if callable(value) else tf.convert_to_tensor(value)


def _finite(g: Any) -> tf.Tensor:
    """Whether every element of one gradient is finite, without a temporary as large as it in
    the common case ([Note: cheap finiteness] in fused_step.py)."""
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    total = tf.reduce_sum(tf.cast(tf.reduce_sum(values), tf.float32))
    return tf.cond(tf.math.is_finite(total), lambda: tf.constant(True),
                   lambda: tf.reduce_all(tf.math.is_finite(values)))


def is_multi_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Keras's MultiOptimizer, which hands each variable to a
    sub-optimizer's ``apply``."""
    import keras

    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    return multi is not None and isinstance(optimizer, multi)


class DirectUpdate:
    """A stage's optimizer step made inside its backward call ([Note: direct update]).

    Example::

        update = DirectUpdate(optimizer)
        ok = update.apply(grads, variables)   # inside the stage's compiled backward

    [Note: direct update] With one microbatch, one data-parallel replica, one stage per rank and
    no tied copies, a stage's gradients need no accumulator: nothing is added to them and
    nothing is summed with another rank's. The stage then updates each variable as soon as its
    gradient is computed, inside the compiled backward, as plain Keras's train step does, so a
    gradient is freed right after its variable's update and the rank holds weights and
    optimizer slots only (plus a few gradients in flight): 3x the weights under Adam instead of
    4x with accumulators, 4 Dense(4096) layers: 768 MiB against 1024 MiB. A variable whose
    gradient is not finite is not updated; the step then raises on every rank (engine.py,
    [Note: consistent skips]). Other variables, of this stage and of the stages whose
    backward ran before, may have been updated by then, which the error says; so configurations
    that continue after a non-finite step (``nonfinite='skip'``, loss scaling) keep
    accumulators, as do optimizers that need every gradient before any update
    (``global_clipnorm``, ``gradient_accumulation_steps``), as does Keras's MultiOptimizer (its
    sub-optimizers make the updates, out of reach of the per-variable hook below), as do
    ``use_ema`` (its averages
    are updated once per step) and weight regularizers (their gradients join at the step).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @staticmethod
    def possible(optimizer: Any) -> bool:
        """Whether ``optimizer`` can update variable by variable as gradients arrive."""
        return (optimizer is not None and not hasattr(optimizer, "inner_optimizer")
                # a MultiOptimizer's sub-optimizers update, never calling the hooked
                # update_step: no finiteness check, and a stand-in would reach the update
                and not is_multi_optimizer(optimizer)
                and not getattr(optimizer, "global_clipnorm", None)
                and not getattr(optimizer, "gradient_accumulation_steps", None)
                and not getattr(optimizer, "use_ema", False))

    @staticmethod
    def possible_late(optimizer: Any) -> bool:
        """Whether ``optimizer`` can take gradients computed inside its update, one variable at
        a time ([Note: weights at the step's end] in stage.py): `possible`, and nothing that
        transforms the gradients before Keras's per-variable update (``clipnorm``,
        ``clipvalue``), which would see the stand-ins instead."""
        return (DirectUpdate.possible(optimizer) and not getattr(optimizer, "clipnorm", None)
                and not getattr(optimizer, "clipvalue", None))

    def apply_computed(self, makers: list[Callable[[], Any]], variables: list[Any]) -> tf.Tensor:
        """`apply`, where ``makers[j]()`` computes variable j's gradient inside the update:
        each is computed only after the previous variable's update finished, so one gradient
        exists at a time ([Note: weights at the step's end] in stage.py). Keras's
        ``apply_gradients`` sees a scalar stand-in per variable (its iteration count, weight
        decay and learning rate are applied as usual). Call inside a ``tf.function``."""
        flags: list[tf.Tensor] = []
        done: list[tf.Tensor] = []
        inner = self.optimizer
        original = inner.update_step
        by_id = {id(v): m for v, m in zip(variables, makers)}
        order = list(reversed(makers))  # the order of the pairs passed below

        def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
            make = by_id.get(id(variable)) or order[len(flags)]
            with tf.control_dependencies(done):
                gradient = tf.convert_to_tensor(make())
            ok = _finite(gradient)
            flags.append(ok)

            def run() -> tf.Tensor:
                original(gradient, variable, learning_rate)
                return tf.constant(True)

            result = tf.cond(ok, run, lambda: tf.constant(False))
            done[:] = [result, tf.identity(_handle_value(variable))]
            return result

        if not variables:
            return tf.constant(True)
        stand_ins = [tf.zeros((), v.dtype) for v in variables]
        with update_step_as(inner, update_step):
            self.optimizer.apply_gradients(list(reversed(list(zip(stand_ins, variables)))))
        return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)

    def apply(self, grads: list[Any], variables: list[Any]) -> tf.Tensor:
        """Updates each variable with its (finite) gradient; returns whether all were finite.
        Call inside a ``tf.function``. Variables are updated in reverse order, the order in
        which backward produces their gradients."""
        flags: list[tf.Tensor] = []
        inner = self.optimizer
        original = inner.update_step

        def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
            ok = _finite(gradient)
            flags.append(ok)

            def run() -> tf.Tensor:
                original(gradient, variable, learning_rate)
                return tf.constant(True)

            return tf.cond(ok, run, lambda: tf.constant(False))

        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not pairs:  # a stage without trainable variables, or none on the gradient's path:
            return tf.constant(True)  # nothing to update (Keras's `apply` is a no-op then too)
        with update_step_as(inner, update_step):
            # apply_gradients, as Keras's train step calls it (an override is honoured)
            self.optimizer.apply_gradients(list(reversed(pairs)))
        return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)
