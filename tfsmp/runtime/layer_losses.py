"""Layer losses in a pipeline: activity regularizers and ``add_loss`` per call, weight regularizers per step.

Example::

    rules = probe_call(call)            # [] when the call adds no loss; one rule per loss it adds
    losses = own_losses(call.layer)     # inside compiled code, right after the call
    value = combine(losses, rules, frac)  # this microbatch's share of the batch's layer losses
    reg = regularization(variables)    # the weight regularizers' value, once per step

Keras adds every layer loss to the compiled loss (`Trainer.compute_loss`: ``ops.sum`` of each
of ``model.losses``). In a pipeline each stage adds the losses of its own layers to what it
differentiates, so their gradients reach its weights and, through the boundary gradients, the
stages before it. Weight regularizers do not depend on the batch: they count once per step, on
the rank that updates the variable, and never per microbatch.

[Note: decomposable losses] A loss a layer adds while it runs (an activity regularizer, which
Keras 3 divides by the batch size; ``self.add_loss(...)`` in a layer's ``call``) is computed per
microbatch here. Its value for the whole batch is the sum of the microbatches' values if it
sums over its samples, and their row-weighted mean if it averages over them (a loss that does
not depend on the batch counts as a mean). Which one it is cannot be read off the code, so it
is measured once, before training, on the rank that owns the layer: the layer runs in a
`keras.StatelessScope` (no variable or random state changes) on 3 synthetic rows, on row 0
alone and on rows 1-2, and the losses decide: ``L(0:3) = L(0) + L(1:3)`` is a sum,
``L(0:3) = (L(0) + 2 L(1:3)) / 3`` a mean. A loss that is neither (a mixture-of-experts
balancing loss reads the whole batch's routing statistics) cannot be split exactly: it is
computed per microbatch and counted as a row-weighted mean, as pipeline frameworks compute such
losses, and the first step with more than one part warns once, naming the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["MEAN", "SUM", "classify", "combine", "may_add_losses", "own_losses", "probe_call",
           "regularization"]

SUM, MEAN = "sum", "mean"
_ROWS = 3


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-3)


def classify(values: Callable[[np.ndarray], list[float]], num_rows: int) -> list[str | None] | None:
    """Measures how each of a batch function's values combines over rows ([Note: decomposable
    losses]): ``values(rows)`` evaluates the function on those rows of a batch of ``num_rows``
    (rows repeat when the batch has fewer than 3). Returns one rule per value (None: neither a
    sum nor a mean), or None when the values cannot be measured."""
    def rows(*index: int) -> np.ndarray:
        return np.asarray(index, dtype=np.int64) % max(num_rows, 1)

    try:
        whole, first, rest = values(rows(0, 1, 2)), values(rows(0)), values(rows(1, 2))
    except Exception:  # a function that cannot run on other row counts: unmeasured
        return None
    if not len(whole) == len(first) == len(rest):
        return None
    out: list[str | None] = []
    for w, a, b in zip(whole, first, rest):
        if _close(w, (a + 2 * b) / 3):
            out.append(MEAN)  # also a value that does not depend on the batch at all
        elif _close(w, a + b):
            out.append(SUM)
        else:
            out.append(None)
    return out


def may_add_losses(layer: Any) -> bool:
    """Whether a call of ``layer`` may add a loss: it or a layer inside it has an activity
    regularizer, or is a class of its own (its ``call`` may use ``add_loss``)."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    return any(getattr(sub, "activity_regularizer", None) is not None
               or not type(sub).__module__.startswith(_KERAS_OWN_LAYERS)
               for sub in layer._flatten_layers(include_self=True))


# Keras's own layers and models add losses only through activity regularizers; a class defined
# anywhere else in the keras package (its shipped tests: trainer_test's LossLayer) is a user's.
_KERAS_OWN_LAYERS = ("keras.src.layers.", "keras.src.models.", "keras.layers.", "keras.models.")


def probe_call(call: Any) -> list[str | None] | None:
    """The rule of every loss one call of its layer adds, measured on synthetic rows in a
    stateless scope ([Note: decomposable losses]); [] when it adds none, None when unknown."""
    specs = list(call.arguments.keras_tensors)
    base = [_synthetic(t, i) for i, t in enumerate(specs)]
    batched = [len(t.shape) > 0 and t.shape[0] is None for t in specs]
    layer = call.layer
    takes_training = "training" in getattr(layer, "_call_context_args", ())

    def values(rows: np.ndarray) -> list[float]:
        filled = {id(t): tf.gather(b, rows) if is_b else b
                  for t, b, is_b in zip(specs, base, batched)}
        args, kwargs = call.arguments.fill_in(filled)
        if takes_training:
            kwargs = {**kwargs, "training": True}
        with keras.StatelessScope(collect_losses=True) as scope:
            layer(*args, **kwargs)
            found = list(scope.losses)
        return [float(tf.reduce_sum(tf.cast(v, tf.float32))) for v in found]

    return classify(values, _ROWS)


def _synthetic(t: Any, seed: int) -> tf.Tensor:
    shape = [(_ROWS if i == 0 else 4) if d is None else int(d) for i, d in enumerate(t.shape)]
    dtype = tf.as_dtype(keras.backend.standardize_dtype(t.dtype))
    if dtype.is_floating:
        return tf.cast(tf.random.stateless_normal(shape, seed=[seed, 7]), dtype)
    if dtype == tf.bool:
        return tf.ones(shape, tf.bool)
    return tf.zeros(shape, dtype)


def own_losses(layer: Any) -> list[tf.Tensor]:
    """The losses the last call of ``layer`` added (its own and its sublayers'), without the
    weight regularizers (`regularization` counts those once per step)."""
    if not isinstance(layer, keras.layers.Layer):
        return []
    return [v for sub in layer._flatten_layers(include_self=True) for v in sub._get_own_losses()]


def combine(losses: list[tf.Tensor], rules: list[str | None], frac: tf.Tensor) -> tf.Tensor:
    """A microbatch's share of the batch's layer losses: each loss summed to a scalar (as
    Keras's ``_aggregate_additional_loss`` does), times 1 (a sum) or the microbatch's share of
    the rows (a mean)."""
    total = tf.zeros((), tf.float32)
    for value, rule in zip(losses, rules):
        v = tf.reduce_sum(tf.cast(value, tf.float32))
        total += v * frac if rule == MEAN else v
    return total


def regularization(variables: list[Any]) -> tf.Tensor:
    """The weight regularizers' losses of trainable ``variables``, summed (Keras's
    ``_get_regularization_losses``)."""
    total = tf.zeros((), tf.float32)
    for v in variables:
        reg = getattr(v, "regularizer", None)
        if reg is not None and v.trainable:
            total += tf.reduce_sum(tf.cast(reg(v), tf.float32))
    return total
