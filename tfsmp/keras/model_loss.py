"""A model's own ``compute_loss()`` on a pipelined model: per microbatch for the gradients, per batch for the logs.

Example (what `DistributedModel` does when the user's model class overrides ``compute_loss``)::

    loss = ModelLoss.of(distributed_model)     # None when nothing overrides Keras's
    engine.set_custom_loss(loss)               # the last stage's programs call it per microbatch
    value = loss.batch_value(x, y, y_pred, sw, training=True, losses=[total])  # after the step

[Note: a model's own compute_loss] Keras's guide to customizing ``fit`` has a model override
``compute_loss(x, y, y_pred, sample_weight, training)``: it may call ``super().compute_loss``
(the compiled loss plus ``sum(self.losses)``), add terms of its own (a teacher's outputs, in
Keras's ``Distiller``), and update metrics it holds. A pipeline honours it in two places:

* **Gradients, per microbatch.** The last stage calls the override inside its compiled program
  with the microbatch's inputs, targets, sample weights and predictions, as one ``scalar`` term
  of the objective (tfsmp/runtime/objective.py): before the first step tfsmp measures on three
  samples whether its value is a mean over the samples (Keras's losses are) or a sum, weights
  each microbatch's value by that rule, and refuses, with a clear error, a value that is
  neither (with one part per step any value is exact). ``self.losses`` is empty inside: every
  stage adds its own layers' losses and the optimizer the weight regularizers', as with a
  compiled loss.
* **Logs and metrics, once per batch.** The metric updates the per-microbatch calls made are
  undone, and the last stage's ranks call the override once, eagerly, on the whole global batch
  (every replica's rows, in order), with ``self.losses`` holding the step's layer and
  regularization losses (one entry, their sum); its value is the step's ``loss``, and the
  metrics it updated go to every rank with the compiled ones ([Note: metrics on every rank] in
  trainer_metrics.py). So History, ``evaluate`` and every metric get plain Keras's values.

The two agree when the override adds ``self.losses`` as Keras's own does: checked before the
first step, on every rank, when the model has such losses (the override's value with and
without a probe value in ``self.losses`` must differ by it), refused otherwise, since the
gradients would then differ from plain Keras's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.trainers.trainer import Trainer

from tfsmp.errors import StepError

__all__ = ["ModelLoss", "metric_variables", "overridden_by", "restore", "snapshot"]


def overridden_by(dm: Any) -> Any:
    """The model whose class overrides Keras's ``compute_loss``: a `DistributedModel`
    subclass, else the wrapped model; None when neither does."""
    from tfsmp.keras.model import DistributedModel

    if type(dm).compute_loss is not DistributedModel.compute_loss:
        return dm
    wrapped = getattr(dm, "wrapped", None)
    if wrapped is not None and type(wrapped).compute_loss is not Trainer.compute_loss:
        return wrapped
    return None


@contextlib.contextmanager
def _given_losses(model: Any, values: list[Any]) -> Iterator[None]:
    """``model.losses`` reads ``values`` inside (its class's property, for this object only)."""
    cls = type(model)
    own = "losses" in vars(cls)
    saved = vars(cls).get("losses")
    inherited = cls.losses

    def losses(self: Any) -> list[Any]:
        return list(values) if self is model else inherited.fget(self)

    cls.losses = property(losses)
    try:
        yield
    finally:
        if own:
            cls.losses = saved
        else:
            delattr(cls, "losses")


class ModelLoss:
    """The override of one `DistributedModel`, as the objective's ``custom`` term. See the
    module docstring."""

    def __init__(self, dm: Any, owner: Any) -> None:
        self._dm = weakref.ref(dm)
        self.owner = owner
        self.training = True  # the phase of the step that calls it (set by TrainerSteps)
        self.template: Any = None  # the structure of the model's inputs, as Keras yields them

    @classmethod
    def of(cls, dm: Any) -> ModelLoss | None:
        owner = overridden_by(dm)
        return None if owner is None else cls(dm, owner)

    # -- per microbatch, inside the last stage's program -----------------------------------------

    def __call__(self, inputs: list[Any], y: Any, y_pred: Any, sample_weight: Any) -> tf.Tensor:
        with self._compiled():
            value = self._call(self._pack(inputs), y, y_pred, sample_weight, self.training, [])
        return value

    # -- once per batch, eagerly on the last stage's ranks ---------------------------------------

    def batch_value(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, *, training: bool,
                    losses: list[Any]) -> float:
        """The override's value on the whole batch (Keras's ``loss``), its metric updates made."""
        with self._compiled():
            return float(self._call(x, y, y_pred, sample_weight, training, losses))

    def check_additive(self, inputs: list[Any], y: Any, y_pred: Any, sample_weight: Any, *,
                       rank_tag: str) -> None:
        """Before the first step, on every rank (a few samples, ``y_pred`` shaped like the
        outputs): refuses an override that does not add ``self.losses`` to its value as
        Keras's own does, since tfsmp adds the layer and regularization losses outside it."""
        probe = 0.5
        with self._compiled():
            x = self._pack(inputs)
            with_losses = float(self._call(x, y, y_pred, sample_weight, self.training,
                                           [tf.constant(probe, tf.float32)]))
            without = float(self._call(x, y, y_pred, sample_weight, self.training, []))
        if not np.isclose(with_losses - without, probe, rtol=1e-4, atol=1e-5):
            raise StepError(
                f"{rank_tag} A pipelined model adds its layers' losses and weight regularizers "
                f"to the value of a model's own compute_loss(), as Keras's compute_loss adds "
                f"sum(self.losses): each stage computes its own. Received: "
                f"{type(self.owner).__name__}.compute_loss, whose value changed by "
                f"{with_losses - without:.6g} when self.losses summed to {probe}. Fix: add "
                f"sum(self.losses) to the value (or call super().compute_loss), or train this "
                f"model with plain Keras.")

    # -- helpers ---------------------------------------------------------------------------------

    def _call(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool,
              losses: list[Any]) -> tf.Tensor:
        with _given_losses(self.owner, losses):
            value = self.owner._compute_loss(  # noqa: SLF001 (Keras's wrapper of the override)
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        if value is None or tuple(getattr(value, "shape", ())) not in ((), (1,)):
            raise StepError(
                f"A model's compute_loss() must return one value per batch. Received: "
                f"{type(self.owner).__name__}.compute_loss returned "
                f"{'None' if value is None else f'shape {tuple(value.shape)}'}. Fix: return "
                f"a scalar loss.")
        return tf.reshape(tf.cast(value, tf.float32), ())

    @contextlib.contextmanager
    def _compiled(self) -> Iterator[None]:
        """The owner compiled as the `DistributedModel` is (``super().compute_loss`` reads
        ``self._compile_loss``), when the owner is the wrapped model."""
        dm = self._dm()
        if dm is None or self.owner is dm:
            yield
            return
        missing = object()
        saved = self.owner.__dict__.get("_compile_loss", missing)
        object.__setattr__(self.owner, "_compile_loss", getattr(dm, "_compile_loss", None))
        try:
            yield
        finally:
            if saved is missing:
                self.owner.__dict__.pop("_compile_loss", None)
            else:
                object.__setattr__(self.owner, "_compile_loss", saved)

    def _pack(self, inputs: list[Any]) -> Any:
        """The model's inputs (in `TracedModel.input_keys` order) in the structure of ``x``."""
        dm = self._dm()
        names = list(dm.rank_view.traced.input_names) if dm is not None else []
        t = self.template
        if isinstance(t, dict) and all(n in t for n in names):
            return dict(zip(names, inputs))
        if len(inputs) == 1 and not isinstance(t, (list, tuple, dict)):
            return inputs[0]
        return tree.pack_sequence_as(t, list(inputs))


def metric_variables(model: Any) -> list[Any]:
    """Every variable of every metric Keras lists for ``model`` (``model.metrics``), once."""
    seen: dict[int, Any] = {}
    for m in model.metrics:
        for v in m.variables:
            seen.setdefault(id(v), v)
    return list(seen.values())


def snapshot(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def restore(variables: list[Any], values: list[np.ndarray]) -> None:
    for v, value in zip(variables, values):
        v.assign(value)

