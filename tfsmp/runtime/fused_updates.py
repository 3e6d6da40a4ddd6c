"""Keras's per-variable optimizer updates in fewer TensorFlow kernels, bit for bit.

Example::

    @tf.function
    def apply(grads):
        with fused_updates(optimizer):     # Adam's and SGD's update_step as TF's fused kernels
            optimizer.apply_gradients(zip(grads, variables))

[Note: fused updates] Keras's optimizers update a variable with one TensorFlow kernel per
arithmetic operation: Adam's ``update_step`` is twelve (``g - m``, ``·(1 - β₁)``, ``m +=``,
``g²``, ``- v``, ``·(1 - β₂)``, ``v +=``, ``√v``, ``+ ε``, ``m·α``, the quotient, ``var -=``),
each a full pass over memory as large as the variable. Where the step's updates all wait for its
finiteness check ([Note: one-call step] in fused_step.py), those passes are the whole step's
tail: on Dense(1024)x8 they took 19 ms of one thread. TensorFlow's training kernels compute the
same expressions in one pass each, operation for operation in Keras's order, with the same
Eigen arithmetic:

- ``ResourceApplyGradientDescent(var, α, δ)`` is ``var - δ·α``: SGD's ``var -= g·lr``; and with
  ``α = -c``, ``m + (x·c)`` (IEEE rounding is symmetric in sign, and ``a - (-b)`` is ``a + b``),
  which is Adam's ``m += (g - m)(1 - β₁)`` and ``v += (g² - v)(1 - β₂)`` after one subtraction.
- ``ResourceApplyAdagradV2(var, v, α, ε, m, update_slots=False)`` is ``var - m·α / (√v + ε)``,
  Adam's last five operations.
- ``ResourceApplyKerasMomentum`` is SGD with momentum (and Nesterov) exactly as Keras writes it.

So Adam's update is six kernels (19 ms to 14.7 ms there) and SGD's one, and the variables and
slots are bit-identical to Keras's after any number of steps (tests/tf/test_fused_updates.py,
which also covers AdamW, learning-rate schedules, clipping, EMA and loss scaling: they stay
Keras's own, around ``update_step``). ``ResourceApplyAdam`` itself is *not* equal: it computes
``1 - β₁`` in float32 (0.100000024 for β₁ = 0.9) where Keras computes it in Python (0.1).

Only ``update_step`` is swapped, and only where it is Keras's own: an optimizer that is exactly
Adam or AdamW (without ``amsgrad``) or SGD, with float hyperparameters and no ``update_step`` of
its own; each call then falls back to Keras's code for anything not proven equal: a sparse
(``IndexedSlices``) gradient, a variable that is not float32, or a step compiled by XLA (whose
own fusion may contract a product and a sum).

Used by the one-call step (p = 1) only, so far: the pipeline's optimizer step and its direct and
late updates ([Note: one variable at a time] in memory.py) keep Keras's kernels until the memory
model's grid is re-measured with these, which hold one full-size temporary fewer per variable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from keras import ops
from keras.src.optimizers import adam, sgd

__all__ = ["fused_update_step", "fused_updates", "update_step_as"]


@contextlib.contextmanager
def fused_updates(optimizer: Any, *, xla: bool = False) -> Iterator[None]:
    """Within a ``tf.function`` trace, ``optimizer``'s per-variable updates as TF's fused
    kernels where they equal Keras's ([Note: fused updates]); a loss-scale wrapper's inner
    optimizer is the one swapped. Enter it before any other wrapper of ``update_step``."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    step = None if xla else fused_update_step(inner)
    if step is None:
        yield
        return
    with update_step_as(inner, step):
        yield


def fused_update_step(optimizer: Any) -> Callable[[Any, Any, Any], Any] | None:
    """The fused replacement of ``optimizer.update_step``, or None where Keras's own must run
    (an optimizer other than exactly Adam, AdamW or SGD, or one with its own update_step)."""
    if optimizer is None or "update_step" in vars(optimizer):
        return None  # replaced on the instance: the user's (or a wrapper's) update, as written
    method = type(optimizer).update_step
    if method is adam.Adam.update_step and _floats(optimizer, "beta_1", "beta_2", "epsilon"):
        if optimizer.amsgrad:
            return None
        kernels: Callable[..., None] = _adam
    elif method is sgd.SGD.update_step and _floats(optimizer, "momentum"):
        kernels = _sgd
    else:
        return None

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        if not _provably_equal(gradient, variable):
            return method(optimizer, gradient, variable, learning_rate)
        kernels(optimizer, gradient, variable, learning_rate)
        return None

    return update_step


def _floats(optimizer: Any, *names: str) -> bool:
    """Hyperparameters Keras folds in as Python numbers (a tensor or callable: Keras's code)."""
    return all(isinstance(getattr(optimizer, n, None), (float, int)) for n in names)


def _provably_equal(gradient: Any, variable: Any) -> bool:
    return (isinstance(gradient, tf.Tensor) and variable.dtype == tf.float32
            and hasattr(variable, "handle"))


def _adam(optimizer: Any, gradient: Any, variable: Any, learning_rate: Any) -> None:
    """keras/src/optimizers/adam.py's ``update_step`` (without amsgrad) in six kernels."""
    dtype = variable.dtype
    lr = ops.cast(learning_rate, dtype)
    gradient = ops.cast(gradient, dtype)
    local_step = ops.cast(optimizer.iterations + 1, dtype)
    beta_1_power = ops.power(ops.cast(optimizer.beta_1, dtype), local_step)
    beta_2_power = ops.power(ops.cast(optimizer.beta_2, dtype), local_step)
    index = optimizer._get_variable_index(variable)
    m = optimizer._momentums[index].value
    v = optimizer._velocities[index].value
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    # m + (g - m)·c as m - (g - m)·(-c); the constants round as Keras's Python floats do
    tf.raw_ops.ResourceApplyGradientDescent(
        var=m.handle, alpha=tf.constant(-(1 - optimizer.beta_1), dtype),
        delta=gradient - tf.convert_to_tensor(m))
    tf.raw_ops.ResourceApplyGradientDescent(
        var=v.handle, alpha=tf.constant(-(1 - optimizer.beta_2), dtype),
        delta=tf.square(gradient) - tf.convert_to_tensor(v))
    tf.raw_ops.ResourceApplyAdagradV2(
        var=variable.handle, accum=v.handle, lr=alpha, epsilon=tf.constant(optimizer.epsilon, dtype),
        grad=tf.convert_to_tensor(m), update_slots=False)


def _sgd(optimizer: Any, gradient: Any, variable: Any, learning_rate: Any) -> None:
    """keras/src/optimizers/sgd.py's ``update_step`` in one kernel."""
    dtype = variable.dtype
    lr = ops.cast(learning_rate, dtype)
    gradient = ops.cast(gradient, dtype)
    if optimizer.momentum != 0:
        m = optimizer.momentums[optimizer._get_variable_index(variable)].value
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle, accum=m.handle, lr=lr, grad=gradient,
            momentum=ops.cast(optimizer.momentum, dtype), use_nesterov=bool(optimizer.nesterov))
    else:
        tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=gradient)


@contextlib.contextmanager
def update_step_as(optimizer: Any, update_step: Callable[..., Any]) -> Iterator[None]:
    """``optimizer.update_step`` is ``update_step`` inside the block, then what it was (the
    class's method, or an instance attribute of its own)."""
    own = optimizer.__dict__.get("update_step")
    optimizer.update_step = update_step
    try:
        yield
    finally:
        if own is None:
            del optimizer.update_step  # back to the class's method
        else:
            optimizer.update_step = own
