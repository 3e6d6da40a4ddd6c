"""Keras 2 names that SMP's TensorFlow scripts call, given back to Keras 3 objects for porting.

Example::

    @smp.step
    def get_grads(images, labels):
        predictions = model(images, training=True)
        loss = loss_object(labels, predictions)
        return optimizer.get_gradients(loss, model.trainable_variables), loss, predictions

    train_loss.reset_states()                             # Keras 3: reset_state()
    hvd.broadcast_variables(optimizer.variables(), 0)     # Keras 3: optimizer.variables
    tf.keras.models.load_model("/opt/ml/model")           # Keras 3 rejects SavedModel dirs

[Note: porting names] Every AWS SMP TF2 example calls ``optimizer.get_gradients`` (Keras 2's
OptimizerV2; Keras 3 optimizers have none), most call ``metric.reset_states()`` (Keras 3:
``reset_state()``) and the Horovod ones ``optimizer.variables()`` (a property in Keras 3).
`install` adds only names Keras lacks: ``reset_states`` calls ``reset_state``; ``variables`` stays
a list that may also be called; ``get_gradients`` inside an ``smp.step`` is the gradient of a
GradientTape tfsmp keeps around the step body (`tfsmp.keras.step`), and outside one raises an
error that says what to write instead. The DLC scripts also load what ``save_model`` wrote with
``tf.keras.models.load_model(dir)``: for a SavedModel directory, Keras 3 raises; here that one
case returns ``tf.saved_model.load(dir)`` (its ``signatures`` are what the scripts use).
"""

from __future__ import annotations

from typing import Any

import keras

from tfsmp.errors import StepError

__all__ = ["KERAS_VIEW", "CallableList", "install", "outside_step_error", "rank_variables"]

_installed = False


class CallableList(list):  # type: ignore[type-arg]
    """A list that may also be called, returning itself (Keras 2's ``optimizer.variables()``)."""

    def __call__(self) -> list[Any]:
        return list(self)


def _reset_states(self: Any) -> None:
    """Keras 2's name for `reset_state` (SMP scripts call it between epochs)."""
    self.reset_state()


def _get_gradients(self: Any, loss: Any, params: Any) -> Any:
    """Keras 2's ``optimizer.get_gradients(loss, params)``: inside an ``smp.step``, the gradient
    of ``loss`` with respect to ``params`` (and the tensors the stage received)."""
    from tfsmp.keras.step import step_gradients

    return step_gradients(loss, params)


def _variables_property(cls: type) -> None:
    owner = next((c for c in cls.__mro__ if "variables" in vars(c)), None)
    prop = vars(owner).get("variables") if owner is not None else None
    if owner is None or not isinstance(prop, property) or prop.fget is None:
        return
    getter = prop.fget
    if getattr(getter, "_tfsmp_callable", False):
        return

    def variables(self: Any) -> CallableList:
        view = self.__dict__.get(KERAS_VIEW)
        if view is not None:  # a pipelined model's optimizer: [Note: the optimizer as Keras lists it]
            listed = view()
            if listed is not None:
                return CallableList(listed)
        return CallableList(getter(self))

    variables._tfsmp_callable = True  # type: ignore[attr-defined]
    variables._tfsmp_rank = getter  # type: ignore[attr-defined]  # noqa: SLF001
    variables.__doc__ = getter.__doc__
    owner.variables = property(variables)  # type: ignore[attr-defined]


KERAS_VIEW = "_tfsmp_keras_view"  # an optimizer's attribute: its variables as Keras lists them


def rank_variables(optimizer: Any) -> list[Any]:
    """The variables ``optimizer`` holds on this rank (what Keras's ``variables`` property
    returns), also for an optimizer whose ``variables`` lists the whole model's ([Note: the
    optimizer as Keras lists it] in tfsmp/checkpoint/keras_optimizer.py)."""
    for cls in type(optimizer).__mro__:
        prop = vars(cls).get("variables")
        if isinstance(prop, property) and prop.fget is not None:
            getter = getattr(prop.fget, "_tfsmp_rank", prop.fget)
            return list(getter(optimizer))
    return list(optimizer.variables)


def _schedule_default_name(cls: type) -> None:
    """``ExponentialDecay(..., name=None)`` (AWS's ``tf2_checkpoint_test.py``): TF 2's schedules
    used ``name or "ExponentialDecay"``; Keras 3's pass None to ``name_scope``, which raises at
    the first ``apply_gradients``. A ``name`` of None reads as the class name."""
    if isinstance(vars(cls).get("name"), property):
        return

    def get(self: Any) -> str:
        return self.__dict__.get("_tfsmp_name") or type(self).__name__

    def put(self: Any, value: Any) -> None:
        self.__dict__["_tfsmp_name"] = value

    cls.name = property(get, put)  # type: ignore[attr-defined]


def install() -> None:
    """Adds the Keras 2 names of [Note: porting names] to Keras 3's classes (once; only where
    Keras lacks them)."""
    global _installed
    if _installed:
        return
    _installed = True
    metric_cls = keras.metrics.Metric
    if not hasattr(metric_cls, "reset_states"):
        metric_cls.reset_states = _reset_states
    optimizer_cls = keras.optimizers.Optimizer
    if not hasattr(optimizer_cls, "get_gradients"):
        optimizer_cls.get_gradients = _get_gradients
    _variables_property(optimizer_cls)
    # Keras's optimizers that list their inner optimizers' variables under a property of their
    # own (a MultiOptimizer's sub-optimizers') would hide the listing of a pipelined model
    for name in ("MultiOptimizer", "LossScaleOptimizer"):
        cls = getattr(keras.optimizers, name, None)
        if cls is not None and "variables" in vars(cls):
            _variables_property(cls)
    _load_saved_model_dirs()


def _is_saved_model_dir(path: Any) -> bool:
    import os

    try:
        return os.path.isfile(os.path.join(os.fspath(path), "saved_model.pb"))
    except TypeError:
        return False


def _load_saved_model_dirs() -> None:
    """``load_model(dir)`` of a TF SavedModel directory (what SMP's ``save_model`` writes) loads
    it with ``tf.saved_model.load``, whose ``signatures["serving_default"]`` SMP scripts call;
    Keras 3's load_model rejects such directories. Every other path goes to Keras unchanged."""
    import sys

    import tensorflow as tf

    original = keras.saving.load_model
    if getattr(original, "_tfsmp_porting", False):
        return

    def load_model(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_saved_model_dir(filepath):
            return tf.saved_model.load(str(filepath))
        return original(filepath, *args, **kwargs)

    load_model._tfsmp_porting = True  # type: ignore[attr-defined]
    load_model.__doc__ = original.__doc__
    for name in ("keras.src.saving.saving_api", "keras.saving", "keras.models",
                 "keras._tf_keras.keras.models", "keras._tf_keras.keras.saving"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "load_model", None) is original:
            vars(module)["load_model"] = load_model
    _schedule_default_name(keras.optimizers.schedules.LearningRateSchedule)


def outside_step_error() -> StepError:
    return StepError(
        "optimizer.get_gradients(loss, params) works only inside an smp.step function (Keras 3 "
        "optimizers have no get_gradients). Received: a call outside any step. Fix: call it "
        "inside the @smp.step function, or write `with tf.GradientTape() as tape: loss = ...` "
        "then `tape.gradient(loss, params)`.")


install()  # importing tfsmp.keras (DistributedModel, step) gives scripts these names
