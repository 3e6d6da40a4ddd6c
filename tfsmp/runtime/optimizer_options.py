"""A rank's optimizer step with every Keras optimizer option honoured across the pipeline.

Example::

    bridge = OptimizerBridge(optimizer, variables, counted, comm.pipeline, xla=False,
                             rank_tag="[rank 0]")
    scale = bridge.loss_scale()             # what each microbatch's loss is multiplied by
    bridge.apply(accumulators, sparse, factor=1.0)   # optimizer.apply_gradients, compiled

[Note: optimizer options] Each rank applies the Keras optimizer to its own stages' variables
with their gradients of the whole batch. Options that look at one variable at a time
(``clipnorm``, ``clipvalue``, ``weight_decay`` and ``exclude_from_weight_decay``, learning-rate
schedules, ``use_ema`` and ``ema_overwrite_frequency``, ``gradient_accumulation_steps``,
``amsgrad``...) then act exactly as in one process, since every rank counts the same
iterations. Three need the pipeline:

- ``global_clipnorm`` clips by the norm of *all* gradients: the rank's own optimizer computes
  Keras's squared norm of its gradients (a tied variable's counted on one rank only) and one
  scalar allreduce over the pipeline sums them, inside Keras's own ``_clip_gradients``, so the
  clip happens where Keras does it (after gradient accumulation, after loss-scale unscaling).
- Loss scaling (``LossScaleOptimizer`` under mixed precision, or ``loss_scale_factor``): every
  stage's loss is scaled by ``optimizer.scale_loss`` as Keras's train step scales its loss, and
  the optimizer unscales the gradients as usual.
- ``use_ema``: Keras swaps in the moving averages at the end of ``fit``
  (``finalize_variable_values``); `tfsmp.runtime.engine.Engine.finalize` does it on every rank.

The step calls ``optimizer.apply_gradients`` as Keras's train step does, so an optimizer
subclass overriding ``apply_gradients``, ``apply`` or ``update_step`` is honoured.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras import ops
from keras.src.optimizers import base_optimizer

from tfsmp.errors import StepError
from tfsmp.runtime import layer_losses as ll
from tfsmp.runtime.dispatch import Program
from tfsmp.runtime.memory import one_variable_at_a_time

__all__ = ["OptimizerBridge"]


def _is_loss_scaled(optimizer: Any) -> bool:
    """Keras's LossScaleOptimizer (mixed_float16) has ``inner_optimizer``."""
    return hasattr(optimizer, "inner_optimizer")


class OptimizerBridge:
    """Applies one rank's gradients with its Keras optimizer. See the module docstring."""

    def __init__(self, optimizer: Any, variables: list[Any], counted: list[bool], group: Any,
                 *, xla: bool, rank_tag: str) -> None:
        self.optimizer = optimizer
        self.variables = variables
        self.counted = counted
        self.group = group
        self.xla = xla
        self.rank_tag = rank_tag
        self.loss_scaled = _is_loss_scaled(optimizer)
        inner = optimizer.inner_optimizer if self.loss_scaled else optimizer
        self.scaled = self.loss_scaled or getattr(optimizer, "loss_scale_factor", None) is not None
        self._global_clip = self._patch_global_clipnorm(inner)
        self.regularized = [j for j, v in enumerate(variables)
                            if getattr(v, "regularizer", None) is not None]
        # nothing beyond Keras's own apply: the one-call step may take over
        self.plain = not self.scaled and not self._global_clip and not self.regularized
        self._apply_fn: Any = None
        self._deferred_fn: Any = None
        self._traced_with: tuple[int, ...] = ()  # the accumulators the programs read

    def _patch_global_clipnorm(self, inner: Any) -> bool:
        """Makes Keras's ``_clip_gradients`` see the whole pipeline's norm ([Note: optimizer
        options]); returns whether it did."""
        clip = getattr(inner, "global_clipnorm", None)
        if not clip or getattr(inner, "clipnorm", None):
            return False  # Keras applies clipnorm first and then ignores global_clipnorm
        if self.group.size == 1 and all(self.counted):
            return False  # the rank holds every gradient: Keras's own clip is the global one
        if type(inner)._clip_gradients is not base_optimizer.BaseOptimizer._clip_gradients:
            return False  # the user's own clipping, as they wrote it
        if self.xla:
            raise StepError(
                f"{self.rank_tag} global_clipnorm across pipeline stages needs one small "
                f"collective inside the optimizer step, which an XLA-compiled step cannot make. "
                f"Received: global_clipnorm={clip} with xla=True (or compile(jit_compile="
                f"True)). Set xla=False and jit_compile=False, or use clipnorm (per "
                f"variable).")
        counted, group = self.counted, self.group

        def allreduce(x: tf.Tensor) -> tf.Tensor:
            return tf.constant(group.allreduce_obj(float(x.numpy()), "sum"), tf.float32)

        def clip_gradients(grads: list[Any]) -> list[Any]:
            mine = [g for g, c in zip(grads, counted) if c and g is not None]
            local = (tf.square(tf.cast(base_optimizer.global_norm(mine), tf.float32)) if mine
                     else tf.zeros((), tf.float32))
            total = tf.py_function(allreduce, [local], tf.float32)
            total.set_shape(())
            norm = ops.sqrt(total)
            scale_for_finite = clip * ops.minimum(1.0 / norm, 1.0 / clip)
            scale = scale_for_finite + (norm - norm)  # NaN for a non-finite norm, as Keras
            return [g if g is None else g * ops.cast(scale, g.dtype) for g in grads]

        inner._clip_gradients = clip_gradients
        return True

    def join_global_norm(self) -> None:
        """A rank whose optimizer updates nothing this step (no trainable variable, or with
        sharded optimizer state none owned) adds nothing to the global norm's sum, which the
        other ranks' clipping waits for: one collective, matching theirs."""
        if not self._global_clip:
            return
        inner = self.optimizer.inner_optimizer if self.loss_scaled else self.optimizer
        steps = getattr(inner, "gradient_accumulation_steps", None)
        if steps and (int(inner.iterations.numpy()) + 1) % steps != 0:
            return  # Keras clips only on the steps that apply the accumulated gradients
        self.group.allreduce_obj(0.0, "sum")

    def loss_scale(self) -> float:
        """What every microbatch's losses are multiplied by: ``optimizer.scale_loss(1)``."""
        if not self.scaled:
            return 1.0
        return float(self.optimizer.scale_loss(tf.constant(1.0)))

    def apply(self, accumulators: list[Any], sparse: dict[str, tuple[tf.Tensor, tf.Tensor]],
              factor: float) -> None:
        """optimizer.apply_gradients of the accumulated gradients (``sparse``: variable
        position -> the step's combined (values, indices)), each times ``factor``, plus the
        weight regularizers' gradients, compiled once."""
        deferred = factor != 1.0
        fn = self._deferred_fn if deferred else self._apply_fn
        key = tuple(id(a) for a in accumulators)  # [Note: traced accumulators] in gradients.py
        if key != self._traced_with:
            self._apply_fn = self._deferred_fn = fn = None
            self._traced_with = key
        if fn is None:
            # called flat once traced ([Note: program dispatch] in tfsmp/runtime/dispatch.py)
            fn = Program(tf.function(self._builder(accumulators, deferred),
                                     jit_compile=self.xla or None, reduce_retracing=True))
            if deferred:
                self._deferred_fn = fn
            else:
                self._apply_fn = fn
        fn(sparse, tf.constant(factor, tf.float32))

    def _builder(self, accumulators: list[Any], deferred: bool) -> Any:
        variables, optimizer = self.variables, self.optimizer
        regularized = self.regularized
        apply_grads = (optimizer._stateful_handle_finite_grads if self.loss_scaled else
                       lambda grads, vs: optimizer.apply_gradients(zip(grads, vs)))

        def apply(sparse: dict[str, tuple[tf.Tensor, tf.Tensor]], factor: tf.Tensor) -> None:
            grads: list[Any] = []
            for i, a in enumerate(accumulators):
                if str(i) in sparse:
                    values, indices = sparse[str(i)]
                    if deferred:
                        values = values * tf.cast(factor, values.dtype)
                    grads.append(tf.IndexedSlices(values, indices, tf.shape(a, tf.int64)))
                else:
                    g = a.value()
                    grads.append(g * tf.cast(factor, g.dtype) if deferred else g)
            if regularized:
                with tf.GradientTape() as tape:
                    reg = ll.regularization([variables[j] for j in regularized])
                    scaled = optimizer.scale_loss(reg) if self.scaled else reg
                dreg = tape.gradient(scaled, [variables[j].value for j in regularized],
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
                for j, d in zip(regularized, dreg):
                    g = grads[j]
                    if isinstance(g, tf.IndexedSlices):
                        g = tf.convert_to_tensor(g)  # dense + sparse is dense, as TF sums them
                    grads[j] = g + tf.cast(d, g.dtype)
            with one_variable_at_a_time(optimizer):  # [Note: one variable at a time]
                apply_grads(grads, variables)

        return apply

    def on_nonfinite(self) -> bool:
        """A skipped step: the loss-scale optimizer lowers its scale (True), else nothing."""
        if self.loss_scaled:
            self.optimizer._stateful_handle_non_finite_grads()
            return True
        return False
